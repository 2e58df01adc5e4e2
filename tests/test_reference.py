"""The operator references cannot drift: the committed files equal what the code generates, and
every documented environment variable, SLO body field and header really has the documented effect."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slogate.gateway.config import ENV_OVERRIDES, GatewayConfig, WorkflowsConfig, load_config
from slogate.gateway.errors import APIError
from slogate.gateway.reference import REFERENCES, config_rows, metric_rows, stale
from slogate.gateway.slo import BODY_FIELDS, HEADERS, resolve
from slogate.gateway.workflows import WorkflowBook

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "docs" / "reference"


def test_committed_references_are_what_the_code_generates() -> None:
    assert stale(REF) == [], "run `slogate reference` and commit docs/reference/"
    assert set(REFERENCES) == {p.name for p in REF.glob("*.md")}


def test_every_config_key_is_documented_and_every_documented_key_exists() -> None:
    rows = config_rows()
    assert all(desc for _, _, _, _, desc in rows), [p for p, *_, d in rows if not d]
    paths = {p for p, *_ in rows}
    for name in GatewayConfig.model_fields:
        assert name in paths
    # A nested key the docs name is accepted by the config, and a misspelt one is rejected.
    GatewayConfig.model_validate({"state": {"lease_s": 3}, "auth": {"keys": [{"sha256": "0" * 64, "tenant": "t", "slo_floor": {"tbt_ms": 5}}]}})
    with pytest.raises(ValueError):
        GatewayConfig.model_validate({"state": {"lease": 3}})


def test_metrics_reference_lists_every_registered_metric() -> None:
    names = {r[0].split(" ")[0] for r in metric_rows()}
    text = (REF / "metrics.md").read_text()
    assert len(names) >= 20 and all(f"`{n}" in text for n in names)


SAMPLE = {"SLOGATE_BACKENDS": "http://a:1,http://b:2", "SLOGATE_ORDERING": "edf", "SLOGATE_PLACEMENT": "p2c", "SLOGATE_FRAME_S": "0.7",
          "SLOGATE_MAX_QUEUE": "17", "SLOGATE_REDIS_URL": "redis://r:1/0", "SLOGATE_PREDICTOR_MODEL": "/m.joblib"}


@pytest.mark.parametrize("var", [v for v in ENV_OVERRIDES if v != "SLOGATE_CONFIG"])
def test_every_documented_environment_variable_changes_the_config(var: str) -> None:
    assert load_config(None, env={var: SAMPLE[var]}) != load_config(None, env={})


def test_slogate_config_variable_selects_the_file(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from slogate.cli import app

    p = tmp_path / "bad.yaml"
    p.write_text("bogus_key: 1\n")
    monkeypatch.setenv("SLOGATE_CONFIG", str(p))
    r = CliRunner().invoke(app, ["serve"])
    assert r.exit_code != 0 and "bogus_key" in r.output  # it read that file (and refused the unknown key)


def _sample(unit: str) -> object:
    return {"ms": 1234, "s": 1.5, "int": 2, "string": "latency", "string | int": "high", "bool": True}[unit]


@pytest.mark.parametrize("name,unit,_", BODY_FIELDS)
def test_every_documented_body_field_takes_effect(name: str, unit: str, _: str) -> None:
    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://x:1"}], "tiers": {"high": {"weight": 2}}, "service_tiers": {"priority": "high"}})
    head, _dot, leaf = name.partition(".")
    value = _sample(unit)
    if name == "slo.kind":
        value = "best_effort"
    if name == "service_tier":
        value = "priority"
    if name in ("priority", "tier"):
        value = "high"
    body: dict[str, object] = {"model": "m", "messages": [], head: {leaf: value} if leaf else value}
    if head == "workflow" and leaf != "id":
        body["workflow"] = {"id": "w", leaf: value}  # type: ignore[dict-item]
    base = resolve({"model": "m", "messages": []}, {}, cfg, WorkflowBook(WorkflowsConfig()), now=0.0)
    got = resolve(body, {}, cfg, WorkflowBook(WorkflowsConfig()), now=0.0)
    assert (got.slo, got.tier, got.waiting_s, got.workflow, got.stage, got.label, got.final) != \
        (base.slo, base.tier, base.waiting_s, base.workflow, base.stage, base.label, base.final), name
    assert head not in got.body or head == "service_tier"  # ours are removed before going upstream; OpenAI's field stays
    bad = dict(body)
    if unit in ("ms", "s"):
        bad[head] = {leaf: -1} if leaf else -1
        if head == "workflow":
            bad["workflow"] = {"id": "w", leaf: -1}
        with pytest.raises(APIError) as e:
            resolve(bad, {}, cfg, WorkflowBook(WorkflowsConfig()), now=0.0)
        assert e.value.status == 400


@pytest.mark.parametrize("name,unit,_", HEADERS)
def test_every_documented_header_takes_effect(name: str, unit: str, _: str) -> None:
    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://x:1"}], "tiers": {"latency": {"weight": 2}}})
    headers = {name: str(_sample(unit))}
    if name == "x-slogate-workflow-stage":
        headers["x-slogate-workflow-id"] = "w"
    if name == "x-slogate-workflow-deadline-ms":
        headers["x-slogate-workflow-id"] = "w"
    base = resolve({"model": "m"}, {"x-slogate-workflow-id": "w"} if "workflow" in name and "id" not in name else {}, cfg,
                   WorkflowBook(WorkflowsConfig()), now=0.0)
    got = resolve({"model": "m"}, headers, cfg, WorkflowBook(WorkflowsConfig()), now=0.0)
    assert (got.slo, got.tier, got.waiting_s, got.workflow, got.stage, got.label, got.final) != \
        (base.slo, base.tier, base.waiting_s, base.workflow, base.stage, base.label, base.final), name


def test_slo_reference_names_the_precedence_and_every_entry() -> None:
    text = (REF / "slo.md").read_text()
    for name, *_ in (*BODY_FIELDS, *HEADERS):
        assert re.search(rf"`{re.escape(name)}`", text)
