"""Resolve each request's SLO, tier and workflow from body, headers, service tier and config.

Precedence, highest first: body fields (an `slo` object with `ttft_ms`, `tbt_ms`,
`deadline_ms`, `waiting_ms`, `kind`; the JITServe names `deadline`, `target_ttft` /
`target_tft`, `target_tbt`, `waiting_time` in seconds; `priority` as a tier name; a `workflow`
object with `id`, `stage`, `deadline_ms`), then headers (`x-slogate-*`, llm-d's
`x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`), then the OpenAI `service_tier` (mapped to a
tier), then the tier's and the model's defaults, then the global default. Our fields are
removed from the body that goes upstream; an integer `priority` is vLLM's and stays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slogate.gateway.config import GatewayConfig, KeyConfig, SLOSpec
from slogate.gateway.errors import APIError
from slogate.gateway.workflows import WorkflowBook
from slogate.router.request import SLO, Tier, Workflow

OUR_FIELDS = ("slo", "deadline", "target_ttft", "target_tft", "target_tbt", "waiting_time", "workflow", "tier")
MAX_MS = 86_400_000.0  # a day
_SLO_KEYS = ("ttft_ms", "tbt_ms", "deadline_ms", "waiting_ms")
_HEADER_MS = {"x-slogate-ttft-ms": "ttft_ms", "x-slogate-tbt-ms": "tbt_ms", "x-slogate-deadline-ms": "deadline_ms",
              "x-slogate-waiting-ms": "waiting_ms", "x-llm-d-slo-ttft-ms": "ttft_ms", "x-llm-d-slo-tpot-ms": "tbt_ms"}
_KINDS = ("auto", "latency", "deadline", "best_effort")

# The request-side SLO interface, documented from here (docs/reference/slo.md is generated from
# these tables and tests/test_reference.py sends every entry through `resolve`).
BODY_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("slo.kind", "string", "latency | deadline | best_effort | auto (auto: latency when streaming, else deadline)"),
    ("slo.ttft_ms", "ms", "time to first token (latency class)"),
    ("slo.tbt_ms", "ms", "time between tokens (latency class)"),
    ("slo.deadline_ms", "ms", "deadline for the whole answer (deadline class)"),
    ("slo.waiting_ms", "ms", "longest wait for admission before a 429"),
    ("deadline", "s", "JITServe's name for the deadline"),
    ("target_ttft", "s", "JITServe's TTFT target (`target_tft` is accepted too)"),
    ("target_tbt", "s", "JITServe's TBT target"),
    ("waiting_time", "s", "JITServe's admission wait"),
    ("priority", "string | int", "a tier name; an integer is vLLM's priority and is passed upstream unchanged"),
    ("tier", "string", "a tier name (when `priority` is vLLM's integer)"),
    ("workflow.id", "string", "agent workflow id: the calls sharing it share one deadline (compound class)"),
    ("workflow.stage", "int", "this call's stage in the workflow (0-based)"),
    ("workflow.deadline_ms", "ms", "the workflow's deadline, from its first call"),
    ("workflow.label", "string", "what the call is (phase / tool / kind), matched against finished workflows' stages"),
    ("workflow.final", "bool", "the workflow's last call: when it ends, the workflow is learned from"),
    ("service_tier", "string", "OpenAI's field, mapped to a tier by `service_tiers` (lower precedence than headers); passed upstream unchanged"),
)
HEADERS: tuple[tuple[str, str, str], ...] = (
    ("x-slogate-ttft-ms", "ms", "time to first token"),
    ("x-slogate-tbt-ms", "ms", "time between tokens"),
    ("x-slogate-deadline-ms", "ms", "deadline for the whole answer"),
    ("x-slogate-waiting-ms", "ms", "longest wait for admission"),
    ("x-slogate-class", "string", "latency | deadline | best_effort | auto"),
    ("x-slogate-tier", "string", "tier name"),
    ("x-slogate-workflow-id", "string", "agent workflow id"),
    ("x-slogate-workflow-stage", "int", "stage in the workflow"),
    ("x-slogate-workflow-deadline-ms", "ms", "the workflow's deadline"),
    ("x-slogate-workflow-label", "string", "what the call is (phase / tool / kind)"),
    ("x-slogate-workflow-final", "bool", "the workflow's last call (`true` / `1`)"),
    ("x-llm-d-slo-ttft-ms", "ms", "llm-d's TTFT header"),
    ("x-llm-d-slo-tpot-ms", "ms", "llm-d's time per output token, taken as TBT"),
)


@dataclass
class Resolved:
    slo: SLO
    tier: Tier
    waiting_s: float
    body: dict[str, Any]  # what goes upstream (our fields removed)
    vllm_priority: int | None = None
    workflow: Workflow | None = None
    stage: int = 0
    label: str = ""  # the call's workflow label (phase / tool / kind), else the model
    final: bool = False  # the workflow's last call
    sources: dict[str, str] = field(default_factory=dict)  # field → where it came from (debugging, tests)

    @property
    def tbt_chosen(self) -> bool:
        """Someone chose this request's TBT (request, key, tier, model), not the built-in default:
        only then is it paced."""
        return self.sources.get("tbt_ms", "default") != "default"

    @property
    def ttft_chosen(self) -> bool:
        """Someone chose this request's TTFT: only then is a first token that can no longer be
        on time worth nothing (GMAX `strict_ttft`); a client that asked for none gets its answer late."""
        return self.sources.get("ttft_ms", "default") != "default"


def _ms(v: Any, param: str, scale: float = 1.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise APIError(400, f"{param} must be a number", param=param)
    try:
        x = float(v) * scale
    except ValueError:
        raise APIError(400, f"{param} must be a number, got {v!r}", param=param) from None
    if not math.isfinite(x) or x < 1.0 or x > MAX_MS:
        raise APIError(400, f"{param} must be between 1 and {MAX_MS:.0f} ms, got {v!r}", param=param)
    return x


def resolve(body: dict[str, Any], headers: Mapping[str, str], cfg: GatewayConfig, workflows: WorkflowBook,
            now: float | None = None, api_key: KeyConfig | None = None) -> Resolved:
    """`api_key`: the caller's key, whose tier is authoritative, whose SLO defaults sit above the
    tier's, and whose SLO floor clamps what the request may ask for."""
    now = time.monotonic() if now is None else now
    stream = bool(body.get("stream"))
    model = str(body.get("model", ""))
    h = {k.lower(): v for k, v in headers.items()}
    sources: dict[str, str] = {}

    # -- tier: body priority (a name) / tier > header > service_tier > default
    prio = body.get("priority")
    vllm_priority: int | None = None
    tier_name: str | None = None
    if isinstance(prio, str):
        tier_name, sources["tier"] = prio, "body.priority"
    elif isinstance(prio, int) and not isinstance(prio, bool):
        vllm_priority = prio
    elif prio is not None:
        raise APIError(400, "priority must be a tier name or an integer", param="priority")
    if tier_name is None and isinstance(body.get("tier"), str):
        tier_name, sources["tier"] = body["tier"], "body.tier"
    if tier_name is None and h.get("x-slogate-tier"):
        tier_name, sources["tier"] = h["x-slogate-tier"], "header"
    st = body.get("service_tier")
    if tier_name is None and isinstance(st, str) and st in cfg.service_tiers:
        tier_name, sources["tier"] = cfg.service_tiers[st], "service_tier"
    tier_name = tier_name or "default"
    if api_key is not None:
        tier_name, sources["tier"] = api_key.tier, "key"  # a key cannot lift itself into another tier
    if tier_name not in cfg.tiers:
        raise APIError(400, f"unknown tier {tier_name!r}; known: {', '.join(sorted(cfg.tiers))}", param="priority")
    tier_cfg = cfg.tiers[tier_name]

    # -- layers, lowest first
    spec: dict[str, Any] = {}

    def layer(s: SLOSpec | dict[str, Any], src: str) -> None:
        items = s.model_dump(exclude_none=True) if isinstance(s, SLOSpec) else s
        for k, v in items.items():
            spec[k] = v
            sources[k] = src

    layer(cfg.slo.default, "default")
    if model in cfg.slo.models:
        layer(cfg.slo.models[model], "model")
    layer(tier_cfg.slo, "tier")
    if api_key is not None:
        layer(api_key.slo, "key")
    hdr: dict[str, Any] = {}
    for name, key in _HEADER_MS.items():
        if name in h:
            hdr[key] = _ms(h[name], name)
    if h.get("x-slogate-class"):
        hdr["kind"] = h["x-slogate-class"]
    layer(hdr, "header")
    bod: dict[str, Any] = {}
    for key, param, scale in (("deadline_ms", "deadline", 1000.0), ("ttft_ms", "target_ttft", 1000.0), ("ttft_ms", "target_tft", 1000.0),
                              ("tbt_ms", "target_tbt", 1000.0), ("waiting_ms", "waiting_time", 1000.0)):
        if body.get(param) is not None:
            bod[key] = _ms(body[param], param, scale)
    slo_obj = body.get("slo")
    if slo_obj is not None:
        if not isinstance(slo_obj, dict):
            raise APIError(400, "slo must be an object", param="slo")
        unknown = set(slo_obj) - {*_SLO_KEYS, "kind"}
        if unknown:
            raise APIError(400, f"unknown slo field(s): {', '.join(sorted(unknown))}", param="slo")
        for k in _SLO_KEYS:
            if slo_obj.get(k) is not None:
                bod[k] = _ms(slo_obj[k], f"slo.{k}")
        if slo_obj.get("kind") is not None:
            bod["kind"] = slo_obj["kind"]
    layer(bod, "body")

    if api_key is not None:  # the "monopolising user": asks stricter than the key's floor are clamped to it
        for k, floor in api_key.slo_floor.model_dump(exclude_none=True).items():
            if k in _SLO_KEYS and k != "waiting_ms" and spec.get(k) is not None and spec[k] < floor:
                spec[k] = floor
                sources[k] = "key_floor"
    kind = spec.get("kind", "auto")
    if kind not in _KINDS:
        raise APIError(400, f"slo kind must be one of {', '.join(_KINDS)}, got {kind!r}", param="slo.kind")
    explicit = {k for k in ("ttft_ms", "tbt_ms", "deadline_ms") if sources.get(k) in ("header", "body")}
    if kind == "auto" or sources.get("kind") not in ("header", "body"):
        if explicit & {"ttft_ms", "tbt_ms"}:
            kind = "latency"
        elif "deadline_ms" in explicit:
            kind = "deadline"
        elif kind == "auto":
            kind = "latency" if stream else "deadline"
    waiting_s = spec.get("waiting_ms", 5000.0) / 1000

    # -- workflow
    wf_obj = body.get("workflow")
    wf_id, stage, wf_deadline, label, final = None, 0, cfg.slo.workflow_deadline_ms, model, False
    if wf_obj is not None:
        if not isinstance(wf_obj, dict) or not isinstance(wf_obj.get("id"), str) or not wf_obj["id"]:
            raise APIError(400, "workflow must be an object with a string id", param="workflow")
        wf_id = wf_obj["id"]
        stage = wf_obj.get("stage", 0)
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise APIError(400, "workflow.stage must be a non-negative integer", param="workflow.stage")
        if wf_obj.get("deadline_ms") is not None:
            wf_deadline = _ms(wf_obj["deadline_ms"], "workflow.deadline_ms")
        if wf_obj.get("label") is not None:
            if not isinstance(wf_obj["label"], str):
                raise APIError(400, "workflow.label must be a string", param="workflow.label")
            label = wf_obj["label"]
        final = wf_obj.get("final", False)
        if not isinstance(final, bool):
            raise APIError(400, "workflow.final must be a boolean", param="workflow.final")
    elif h.get("x-slogate-workflow-id"):
        wf_id = h["x-slogate-workflow-id"]
        try:
            stage = int(h.get("x-slogate-workflow-stage", "0"))
        except ValueError:
            raise APIError(400, "x-slogate-workflow-stage must be an integer", param="x-slogate-workflow-stage") from None
        if h.get("x-slogate-workflow-deadline-ms"):
            wf_deadline = _ms(h["x-slogate-workflow-deadline-ms"], "x-slogate-workflow-deadline-ms")
        label = h.get("x-slogate-workflow-label") or label
        final = h.get("x-slogate-workflow-final", "").lower() in ("1", "true", "yes")

    workflow = None
    if wf_id is not None:
        workflow = workflows.get(wf_id, now, wf_deadline)
        slo = SLO.compound(max(workflow.deadline_at - now, 0.05))
        if sources.get("waiting_ms") not in ("header", "body"):
            # A refused call fails the whole workflow: it waits as long as the workflow can still
            # make its deadline (GMAX sheds it once it cannot), not the default few seconds.
            waiting_s = max(workflow.deadline_at - now, 0.05)
    elif kind == "latency":
        slo = SLO.latency(spec["ttft_ms"] / 1000, spec["tbt_ms"] / 1000, waiting_s)
    elif kind == "deadline":
        slo = SLO.deadline(spec["deadline_ms"] / 1000, waiting_s)
    else:
        slo = SLO.best_effort(cfg.slo.best_effort_deadline_ms / 1000)
        waiting_s = cfg.slo.best_effort_deadline_ms / 1000  # best effort waits; it is never refused for waiting

    clean = {k: v for k, v in body.items() if k not in OUR_FIELDS}
    if isinstance(prio, str):
        clean.pop("priority", None)
    return Resolved(slo, Tier(tier_name, tier_cfg.weight), waiting_s, clean, vllm_priority, workflow, stage, label, final, sources)
