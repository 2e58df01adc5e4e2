"""Deployment files, checked as far as a machine without a Docker engine or a cluster can:
schemas (the compose spec, Kubernetes' OpenAPI), cross-references (every file, service, port,
label selector and probe path named exists), configs loaded by slogate itself, CLI arguments
parsed by slogate's own CLI, and the dashboard's queries against a live gateway's /metrics."""

from __future__ import annotations

import json
import re
import shlex
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import openai
import pytest
import typer.main
import yaml
from compose_spec import PyCompose
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerThread

from slogate.cli import app as cli_app
from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig, load_config
from slogate.predictors.online import OnlineLengthPredictor
from slogate.sim.server import create_engine_app

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
PROFILES = ("sim", "vllm", "sglang")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}."""
    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default
    return re.sub(r"\$\{(\w+)(:?-([^}]*))?\}", sub, text)


def compose(profile: str) -> dict[str, Any]:
    text = interpolate((ROOT / "docker-compose.yml").read_text(), {"COMPOSE_PROFILES": profile})
    data = yaml.safe_load(text)  # resolves the YAML merge keys (<<: *anchor) as compose does
    PyCompose.from_json(json.dumps(data))  # the compose spec, strictly: unknown keys, bad ports, bad tags fail
    return data


def active(data: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in data["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def cli_parses(args: list[str]) -> None:
    """The arguments parse with slogate's own CLI (the command and options exist, values fit
    their types); nothing runs. Raises on any usage error."""
    group = typer.main.get_command(cli_app)
    ctx = group.make_context("slogate", list(args))
    protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
    rest = [*protected, *ctx.args]
    name, sub, sub_args = group.resolve_command(ctx, rest)  # type: ignore[attr-defined]
    assert sub is not None, f"no slogate command {args[0]!r}"
    sub.make_context(name, sub_args, parent=ctx)


def app_routes() -> set[str]:
    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://127.0.0.1:9"}]})
    return {r.path for r in create_app(cfg).routes}  # type: ignore[attr-defined]


# ------------------------------------------------------------------ Dockerfile
def test_dockerfile_copies_what_exists_and_checks_a_real_route() -> None:
    text = (ROOT / "Dockerfile").read_text()
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    copies = [ln.split()[1:-1] for ln in text.splitlines() if ln.startswith("COPY ") and "--from" not in ln]
    assert copies
    for srcs in copies:
        for src in srcs:
            assert (ROOT / src).exists(), src
            assert src not in ignored, f"{src} is copied but .dockerignore drops it"
    assert any("slogate" in srcs for srcs in copies), "the package is not copied"
    assert re.search(r"^USER (?!root|0\b)\S+", text, re.M), "the image must not run as root"
    health = re.search(r"HEALTHCHECK.*?(/health/\w+)", text, re.S)
    assert health and health.group(1) in app_routes()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cli_parses(cmd)


# ------------------------------------------------------------------ docker-compose
@pytest.mark.parametrize("profile", PROFILES)
def test_compose_validates_and_every_reference_exists(profile: str) -> None:
    data = compose(profile)
    services = active(data, profile)
    assert {"redis", "gateway-1", "gateway-2", "prometheus", "grafana"} <= set(services)
    assert any(profile in s.get("profiles", []) for s in services.values()), f"no backend in profile {profile}"
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name}: volume source {src} missing"
            else:
                assert src in data.get("volumes", {}), f"{name}: named volume {src} not declared"
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in services, f"{name} depends on {dep}, not started in profile {profile}"
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").exists()
        if svc.get("image", "").startswith("slogate"):
            cli_parses(svc["command"])  # the slogate image's ENTRYPOINT is `slogate`

    # The gateways load the profile's config, whose backends are this profile's services and ports.
    for gw in ("gateway-1", "gateway-2"):
        path = services[gw]["environment"]["SLOGATE_CONFIG"]
        mounts = dict(v.split(":")[1::-1][:2] for v in services[gw]["volumes"])  # container dir → host dir
        host = next(ROOT / h / Path(path).relative_to(c) for c, h in mounts.items() if path.startswith(c + "/"))
        cfg = load_config(host, env={})
        assert cfg.state.kind == "redis" and cfg.state.url.startswith("redis://redis:")
        assert cfg.backends and all(b.discovered for b in cfg.backends), "compose backends are found by DNS (they scale)"
        for b in cfg.backends:
            m = re.match(r"dns\+https?://([\w-]+):(\d+)$", b.url)
            assert m, b.url
            named = [svc for n, svc in services.items() if m.group(1) == n or m.group(1) in _aliases(svc)]
            assert named, f"{b.url}: no service or network alias {m.group(1)} in profile {profile}"
            for svc in named:
                assert m.group(2) in [str(a) for a in svc["command"]], f"{b.url}: {m.group(1)} does not listen on {m.group(2)}"

    # Prometheus scrapes services that exist; Grafana's provisioning points at its files.
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert {"gateway-1:8000", "gateway-2:8000"} <= set(targets)
    for t in targets:
        assert t.split(":")[0] in data["services"], t
    every = {n for n in data["services"]} | {a for svc in data["services"].values() for a in _aliases(svc)}
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert set(sd["names"]) <= every, sd  # the engines Prometheus finds by DNS are services or aliases
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/slogate.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert any(v.endswith(":/var/lib/grafana/dashboards:ro") for v in services["grafana"]["volumes"])


def _aliases(svc: dict[str, Any]) -> list[str]:
    nets = svc.get("networks") or {}
    return [a for n in (nets.values() if isinstance(nets, dict) else []) for a in (n or {}).get("aliases", [])]


def test_compose_validator_rejects_what_compose_would() -> None:
    bad = yaml.safe_load((ROOT / "docker-compose.yml").read_text().replace("stop_grace_period", "stop_grace_perod"))
    with pytest.raises(ValueError):
        PyCompose.from_json(json.dumps(yaml.safe_load(interpolate(yaml.safe_dump(bad), {}))))


# ------------------------------------------------------------------ Kubernetes
def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for res in kust["resources"]:
        assert (K8S / res).exists(), f"kustomization names {res}, which does not exist"
        docs += [(res, d) for d in yaml.safe_load_all((K8S / res).read_text()) if d]
    listed = set(kust["resources"]) | {"kustomization.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} == listed, "a manifest is not listed in kustomization.yaml"
    return docs


def test_k8s_manifests_validate_against_the_kubernetes_schema() -> None:
    docs = k8s_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "StatefulSet"} <= kinds
    for _, d in docs:
        if d["kind"] == "ServiceMonitor":
            continue  # a CRD: checked against its Service below
        kubernetes_validate.validate(d, "1.30", strict=True)  # raises on unknown fields or wrong types
    bad = next(d for _, d in docs if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(bad).replace("readinessProbe", "readinesProbe"))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.30", strict=True)


def test_k8s_references_hold_together() -> None:
    docs = [d for _, d in k8s_docs()]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    routes = app_routes()
    workloads = by_kind["Deployment"] + by_kind["StatefulSet"]

    def pods_matching(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]

    for svc in by_kind["Service"]:
        pods = pods_matching(svc["spec"]["selector"])
        assert pods, f"service {svc['metadata']['name']} selects no pods"
        ports = {p["name"] for w in pods for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"service {svc['metadata']['name']}: no container port {p['targetPort']}"
    pdb = by_kind["PodDisruptionBudget"][0]
    gw = pods_matching(pdb["spec"]["selector"]["matchLabels"])
    assert [w["metadata"]["name"] for w in gw] == ["slogate"] and gw[0]["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    sm = by_kind["ServiceMonitor"][0]
    svcs = [s for s in by_kind["Service"] if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert svcs and all(e["port"] in {p["name"] for p in svcs[0]["spec"]["ports"]} and e["path"] in routes for e in sm["spec"]["endpoints"])

    # The gateway: args parse, probes hit real routes, the ConfigMap's config loads, and its
    # backends are the StatefulSet's pods through the headless Service.
    (dep,) = gw
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cli_parses(c["args"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in routes
    env = {e["name"]: e["value"] for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if env["SLOGATE_CONFIG"].startswith(m["mountPath"] + "/"))
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = next(m for m in by_kind["ConfigMap"] if m["metadata"]["name"] == vol["configMap"]["name"])
    cfg = GatewayConfig.model_validate(yaml.safe_load(cm["data"][Path(env["SLOGATE_CONFIG"]).name]))
    assert cfg.state.kind == "redis"
    redis_host = re.match(r"redis://([\w-]+):(\d+)", cfg.state.url)
    assert redis_host and any(s["metadata"]["name"] == redis_host.group(1) for s in by_kind["Service"])
    (sts,) = by_kind["StatefulSet"]
    headless = next(s for s in by_kind["Service"] if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"].get("clusterIP") == "None"
    assert cfg.backends
    for b in cfg.backends:  # the headless Service's name: every ready pod, as the StatefulSet scales
        m = re.match(r"dns\+http://([\w-]+):(\d+)$", b.url)
        assert m, b.url
        assert m.group(1) == headless["metadata"]["name"]
        assert int(m.group(2)) in [p["port"] for p in headless["spec"]["ports"]]
    assert "--scheduling-policy" in sts["spec"]["template"]["spec"]["containers"][0]["args"]


# ------------------------------------------------------------------ Grafana dashboard vs a live /metrics
_PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max",
                 "by", "without", "on", "ignoring", "and", "or", "unless", "bool", "offset", "label_values", "le", "e"}


def expr_metrics(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) used by a PromQL expression."""
    lv = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr)  # a Grafana variable query
    if lv:
        return {lv.group(1)}, {lv.group(2)}
    labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b(?:by|without)\s*\([^)]*\)", " ", expr)
    names = {w for w in re.findall(r"[A-Za-z_:][\w:]*", bare) if w not in _PROMQL_WORDS}
    return names, labels


def live_metrics() -> dict[str, set[str]]:
    """Every sample name a live gateway exports → its label names, after real traffic."""
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app("sim-model")))
        cfg = GatewayConfig.model_validate({"backends": [{"url": eng.url, "models": ["sim-model"], "budget": 4}],
                                            "policies": {"frame_s": 0.05}, "health_interval_s": 0.3})
        gw = st.enter_context(ServerThread(create_app(cfg, OnlineLengthPredictor())))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        for stream in (True, False):
            r = c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=stream)
            if stream:
                list(r)
        text = httpx.get(f"{gw.url}/metrics").text
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
        # Families with no sample yet (a counter nothing has incremented) are still exported names.
        for suffix in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, set())
    return out


def test_dashboard_queries_name_only_exported_metrics_and_labels() -> None:
    from slogate.gateway.reference import metric_rows

    exported = live_metrics()
    code_labels = {n.split(" ")[0].removesuffix("_bucket"): set(filter(None, lab.split(", "))) for n, _, lab, _ in metric_rows()}
    dash = json.loads((ROOT / "deploy/grafana/dashboards/slogate.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p["targets"]]
    exprs += [("variable " + v["name"], v["definition"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    covered: set[str] = set()
    for title, expr in exprs:
        names, labels = expr_metrics(expr)
        assert names, f"{title}: no metric in {expr!r}"
        allowed = {"le"}
        for n in names:
            assert n in exported, f"{title}: {n} is not exported by the gateway"
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            allowed |= exported[n] | code_labels.get(base, set()) | code_labels.get(n, set())
            covered.add(base.removesuffix("_total"))
        assert labels <= allowed, f"{title}: labels {labels - allowed} do not exist on {names}"
    # The panels: goodput, TDG, attainment, TTFT/TBT, queue, shed/retries, in-flight, coverage.
    for needed in ("slogate_token_goodput", "slogate_request_goodput", "slogate_tdg", "slogate_tdg_ideal", "slogate_requests",
                   "slogate_ttft_seconds", "slogate_tbt_seconds", "slogate_queue_depth", "slogate_queue_wait_seconds", "slogate_shed",
                   "slogate_retries", "slogate_replica_inflight", "slogate_predictor_covered", "slogate_predictor_bounds"):
        assert needed in covered, f"no panel shows {needed}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_promql_extraction_catches_a_wrong_name() -> None:
    names, labels = expr_metrics('sum by (tier) (rate(slogate_tokens_totl{model=~"$model",direction="output"}[5m]))')
    assert names == {"slogate_tokens_totl"} and labels == {"tier", "model", "direction"}


# ------------------------------------------------------------------ shell commands named in the deploy docs
def test_commands_in_the_operator_docs_parse() -> None:
    text = (ROOT / "docs" / "operators.md").read_text()
    cmds = [ln.strip()[len("slogate "):] for ln in re.findall(r"^\s*slogate .*$", text, re.M)]
    assert len(cmds) >= 3
    for cmd in cmds:
        cli_parses(shlex.split(cmd.split("#")[0]))


def test_the_image_build_context_is_enough_to_install_the_package(tmp_path) -> None:
    """What the Dockerfile copies builds and installs `slogate` (deps excluded: no network needed)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    text = (ROOT / "Dockerfile").read_text()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for ln in text.splitlines():
        if ln.startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, ctx / src)
    # A wheel, not an install: installing would replace the slogate this test run is using.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(ctx)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp_path / "whl").glob("slogate-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "slogate = slogate.cli:app" in z.read(entry).decode()
    # One top-level package: PyPI has a `router`, and pip silently overwrites clashing files.
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"slogate"}, tops
    assert "slogate/gateway/state/redis.py" in names and "slogate/router/policies/gmax.py" in names
