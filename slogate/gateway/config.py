"""Gateway configuration: one YAML file, environment overrides, validated by pydantic.

```yaml
backends:
  - url: http://127.0.0.1:8001
    models: [llama-3.1-8b]        # empty: discovered from the backend's /v1/models
    budget: 48                    # requests the gateway keeps in flight there
    kind: vllm                    # vllm | sglang | openai
    priority_scheduling: false    # started with --scheduling-policy priority: pass `priority`
  - url: dns+http://vllm:8000     # every address `vllm` resolves to (headless Service, compose service)
policies: {ordering: gmax, placement: gorouting, frame_s: 0.3}
slo:
  default: {kind: auto, ttft_ms: 1000, tbt_ms: 50, deadline_ms: 20000, waiting_ms: 5000}
  models: {llama-3.1-8b: {tbt_ms: 80}}
tiers: {default: {weight: 1}, high: {weight: 2, slo: {ttft_ms: 1000}}}
service_tiers: {priority: high, flex: low}
```
Environment variables (`ENV_OVERRIDES`) override the file. Every key is documented in
docs/reference/configuration.md, generated from these models (`slogate reference`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slogate.router.capacity import LearnerKnobs
from slogate.router.latency import DEFAULT_PROFILE


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


DNS_SCHEMES = ("dns+", "dnssrv+")  # Prometheus / Thanos style: resolve the host, one replica per address


def same_url(url: str) -> str:
    """A backend URL as the gateway keeps it: no trailing slash, and no trailing /v1 (an OpenAI SDK's
    base_url pasted as it is; not a host named v1): the gateway calls /v1/..., /metrics and /tokenize below it."""
    url = url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") and not url.endswith("://v1") else url


class BackendConfig(_Strict):
    url: str = Field(description="Base URL of the OpenAI-compatible server (http:// or https://); a trailing /v1, as in an "
                     "OpenAI SDK's base_url, is dropped (the gateway calls /v1/..., /metrics and /tokenize below it). "
                     "`dns+http://HOST:PORT`: every address HOST resolves to is a replica on PORT (a headless Kubernetes "
                     "Service, a compose service name), re-resolved every `discovery.interval_s`; "
                     "`dnssrv+http://_PORTNAME._tcp.HOST`: every SRV record's target and port.")
    models: list[str] = Field(default_factory=list, description="Models served there; empty: discovered from its `/v1/models` (and re-read by the health check).")
    budget: int = Field(48, ge=1, le=100_000, description="Requests the gateways keep in flight there at most (all gateways together when state is shared).")
    kind: Literal["vllm", "sglang", "openai"] = Field("vllm", description="Engine kind: vllm | sglang | openai (any other OpenAI-compatible server).")
    priority_scheduling: bool = Field(False, description="The engine runs with `--scheduling-policy priority`: the request's tier is passed as `priority`.")
    name: str | None = Field(None, description="Label in metrics and logs; default: host:port.")
    api_key: str | None = Field(None, description="Sent upstream as a bearer token (hosted OpenAI-compatible APIs).")
    kv_cache_tokens: int | None = Field(None, ge=1, description="The replica's KV cache in tokens (bounds the gateway's picture of its prefix cache); "
                                        "default: read from vLLM's /metrics (`vllm:cache_config_info`), else `prefix.kv_tokens`.")
    kv_events: str | None = Field(None, description="ZMQ endpoint where the engine publishes its KV-cache events (vLLM: `--kv-events-config "
                                  "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'`; SGLang: "
                                  "`--kv-events-config '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' --page-size 16`, a page "
                                  "a multiple of `prefix.block_tokens`), e.g. "
                                  "`tcp://10.0.0.5:5557`; `{host}` stands for the replica's host (discovered replicas). The gateway's picture "
                                  "of its prefix cache then follows the engine's own stores, evictions and resets. Needs `prefix.tokenizer`. Unset, "
                                  "with `prefix.tokenizer`: asked of vLLM (`/kv_event_sources`), used where it publishes on every "
                                  "interface (`tcp://*:PORT`, read at the replica's host) or on a socket file.")

    kv_events_replay: str | None = Field(None, description="The engine's replay endpoint for its KV-cache events (vLLM's `replay_endpoint`): "
                                         "a gateway that starts asks it for the batches it missed, so an engine's cache from before is "
                                         "in the picture too (as far as vLLM's buffer reaches). Unset: asked of vLLM with the endpoint.")

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _kv_events(cls, v: str | None) -> str | None:
        port = v.rsplit(":", 1)[-1] if v is not None and v.startswith("tcp://") else ""
        if v is not None and not ((v.startswith("ipc://") and len(v) > 6) or (port.isdigit() and 0 < int(port) < 65536 and "*" not in v)):
            raise ValueError(f"kv_events must be a ZMQ endpoint to connect to (tcp://HOST:PORT or ipc://PATH), got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = same_url(v)
        bare = v.removeprefix("dnssrv+").removeprefix("dns+")
        if not bare.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http://, https://, dns+http(s):// or dnssrv+http(s)://, got {v!r}")
        if bare != v:
            from urllib.parse import urlsplit

            u = urlsplit(bare)
            if not u.hostname or (v.startswith("dns+") and u.port is None) or u.path.strip("/"):
                raise ValueError(f"{v!r}: a discovered backend is dns+SCHEME://HOST:PORT or dnssrv+SCHEME://SRVNAME, without a path")
        return v

    @property
    def discovered(self) -> bool:
        """Whether this entry names a DNS name to resolve into replicas rather than one replica."""
        return self.url.startswith(DNS_SCHEMES)


class SLOSpec(_Strict):
    """Defaults (or overrides) for the SLO fields; None = inherit."""

    kind: Literal["auto", "latency", "deadline", "best_effort"] | None = Field(
        None, description="SLO class: latency (TTFT + TBT), deadline (whole answer), best_effort; auto: latency when streaming, else deadline.")
    ttft_ms: float | None = Field(None, gt=0, description="Time to first token, ms (latency class).")
    tbt_ms: float | None = Field(None, gt=0, description="Time between tokens, ms (latency class).")
    deadline_ms: float | None = Field(None, gt=0, description="Deadline for the full answer, ms (deadline class).")
    waiting_ms: float | None = Field(None, gt=0, description="Longest wait for admission before a 429, ms.")


def _builtin_default() -> SLOSpec:
    return SLOSpec(kind="auto", ttft_ms=1000, tbt_ms=50, deadline_ms=20_000, waiting_ms=5_000)


class SLOConfig(_Strict):
    default: SLOSpec = Field(default_factory=_builtin_default,
                             description="SLO of a request that names none: an interactive stream's, as guidellm and `vllm bench serve "
                             "--goodput` users judge one (first token within 1 s, 20 tokens/s). Streams without a chosen TBT are never "
                             "paced; it sets the pace each replica's budget keeps, and under load which requests are refused. "
                             "Fields left out keep these values.")
    models: dict[str, SLOSpec] = Field(default_factory=dict, description="Per-model overrides of the default, by model id.")
    best_effort_deadline_ms: float = Field(600_000, gt=0, description="Deadline the scheduler gives best-effort requests, so they are never starved; they wait this long for admission.")
    workflow_deadline_ms: float = Field(120_000, gt=0, description="Deadline of an agent workflow that does not give one, from its first call.")

    @field_validator("default")
    @classmethod
    def _fill_default(cls, v: SLOSpec) -> SLOSpec:
        # `slo: {default: {ttft_ms: 3000}}` changes the TTFT only: the rest is the built-in's (left
        # as None, every request failed resolving an SLO with no TBT: a 500).
        base = _builtin_default()
        return SLOSpec(**{k: (x if x is not None else getattr(base, k)) for k, x in v.model_dump().items()})


class TierConfig(_Strict):
    weight: float = Field(1.0, gt=0, description="Priority weight in goodput (PROSERVE's tier weight): a weight-2 token counts twice.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="This tier's SLO defaults (above the model's, below the request's).")


class PolicyConfig(_Strict):
    ordering: str = Field("gmax", description="Ordering / admission policy: gmax, fcfs, edf, sjf, ltr, plas, slide, priority, vtc, "
                          "simulated-annealing (old key: sa).")
    placement: str = Field("gorouting", description="Placement policy: gorouting, power-of-k (pok), least-load, round-robin, random, "
                           "power-of-two (p2c), cache-aware, prefix-score, session-hash.")
    frame_s: float = Field(0.3, gt=0, le=10, description="Scheduling frame Δ, s: the queue is re-decided at least this often.")
    resume_within_s: float = Field(10.0, gt=0, description="A paused stream (preempted, or its replica lost) whose client has waited this "
                                   "long for its next token takes the next free slot before anything else, s.")
    params: dict[str, Any] = Field(default_factory=dict, description="Ordering parameters, e.g. gmax `{fairness: 0.2, delta: 1}`; "
                                   "checked against the policy's own when the config loads.")
    placement_params: dict[str, Any] = Field(default_factory=dict, description="Placement parameters, e.g. gorouting `{alpha: 0.9}`; "
                                             "checked like `params`.")
    profile: str = Field(DEFAULT_PROFILE, description="Batch latency profile the replica model starts from (corrected online by β).")
    seed: int = Field(0, description="Seed of randomised policies (random, p2c, sa).")

    @field_validator("ordering", "placement")
    @classmethod
    def _known_policy(cls, v: str, info: ValidationInfo) -> str:
        from slogate.router.registry import check_policy

        return check_policy(str(info.field_name), v)

    @model_validator(mode="after")
    def _known_params(self) -> PolicyConfig:
        from slogate.router.registry import ORDERING, PLACEMENT

        self.params = ORDERING.check_params(self.ordering, self.params)
        self.placement_params = PLACEMENT.check_params(self.placement, self.placement_params)
        return self


class PredictorConfig(_Strict):
    model_path: str | None = Field(None, description="Length model from `slogate train-predictor`; none: a cold-start quantile of observed lengths.")
    quantile: float = Field(0.9, gt=0.5, lt=1, description="Quantile of the answer-length upper bound.")
    refine_every: int = Field(50, ge=1, description="Re-predict a running request's bound every this many generated tokens.")
    online: bool = Field(True, description="Retrain on completed requests (in a worker process; a worse model is rejected).")
    retrain_every: int = Field(2000, ge=50, description="Completed requests between online retrains.")


class StateConfig(_Strict):
    kind: Literal["memory", "redis"] = Field("memory", description="memory: this process only; redis: per-replica slots shared by every gateway.")
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (kind redis).")
    prefix: str = Field("slogate", description="Key prefix; gateways with the same prefix act as one.")
    lease_s: float = Field(15.0, gt=0, description="A crashed gateway's claims expire after this, s.")
    sync_s: float = Field(0.1, gt=0, description="How often other gateways' load is read, s.")
    timeout_s: float = Field(0.25, gt=0, description="A slower Redis call counts as an outage (the gateway serves on local state).")


class CapacityConfig(_Strict):
    """Each replica's budget learned from measured inter-token times (router/capacity.py)."""

    learn: bool = Field(True, description="Learn each replica's SLO-safe concurrency online; `backends[].budget` stays the upper bound.")
    margin: float = Field(LearnerKnobs.margin, gt=0, le=1, description="Aim the inter-token time at this share of the tightest TBT target in flight.")
    slow_start: bool = Field(LearnerKnobs.slow_start, description="A replica the gateway starts with begins at `slow_start_budget` (8) and doubles it while it is full "
                             "and measured fast, until its first cut (false: it begins at `backends[].budget`). A replica that joins a "
                             "running fleet begins at its peers' learned budget either way. With shared state (`state.kind: redis`) slow start "
                             "begins no lower than what all gateways already hold at the replica.")
    slow_start_budget: int = Field(LearnerKnobs.slow_start_budget, ge=1, description="The budget slow start begins a replica at (within `backends[].budget`).")
    on_stalls: Literal["cut", "end"] = Field(LearnerKnobs.on_stalls, description="What the learner does, in slow start and after it until it has a decode line, on a second whose mean inter-token "
                                            "gap is over the target but whose median is below `stalls_below` of the goal (at no more streams than the floor, "
                                            "below the goal) or which itself met the target (stalls: a burst's prefills, the host busy elsewhere): end slow "
                                            "start and keep the budget, or cut it as on any slow second.")
    stalls_below: float = Field(LearnerKnobs.stalls_below, gt=0, le=1, description="The learner reads a slow second as stalls (`on_stalls`) "
                                "when its median inter-token gap is below this share of the goal (`margin` × the TBT target).")
    overdraft: bool = Field(LearnerKnobs.overdraft, description="Lend latency requests that would lose their first token waiting for a slot as many slots above the "
                            "budget as the replica's measured pace can take and stay below `lend_to` (never past the target's n).")
    overdraft_within_s: float = Field(LearnerKnobs.overdraft_within_s, ge=0, le=3600, description="A latency request may take a lent slot once its first token is due within "
                                      "this many seconds beyond what its prefill takes (until then it waits for a slot to free).")
    lend_now_below: float = Field(LearnerKnobs.lend_now_below, ge=0, le=1, description="While a replica's measured pace stays below this share of the TBT target, "
                                  "any latency request may take a lent slot at once, not only one whose first token is due within "
                                  "`overdraft_within_s` (0: off).")
    lend_in_bursts: bool = Field(LearnerKnobs.lend_in_bursts, description="Tell a burst from overload by each replica's load (what it "
                                 "holds plus its share of the requests with an SLO waiting) averaged over ~10 s: a replica admits "
                                 "requests beyond its budget while one admitted now, seeing the excess over that average fade as "
                                 "the others finish, still keeps the pace goal (`margin`), up to where the learned line puts the "
                                 "pace at the TBT target itself.")
    margin_from_streams: bool = Field(LearnerKnobs.margin_from_streams, description="Move each replica's margin (between `margin` and "
                                      "0.95) by the streams it finished, judged as guidellm and `vllm bench serve` judge them: up while "
                                      "the replica is full in a burst (its load over ~10 s below the goal's n) and the 90th percentile "
                                      "of their mean TPOT is below 0.9 × their TBT (a token that broke the per-token timeline counts "
                                      "as 1 ×), down while it is above 0.97 × (false: the margin stays `margin`). Off by default: on "
                                      "real vLLM it tied the fixed margin (docs/benchmarks.md, sittings AV–AX).")
    price_by_arrivals: bool = Field(LearnerKnobs.price_by_arrivals, description="Price the prefills that stall a replica's streams by "
                                    "the arrivals' rate, not per stream held, where its demand over ~10 s is below 0.75 × the n its line "
                                    "allows and no request was refused: a stream more in a burst then costs the decode step alone, so "
                                    "bursts are not held at a budget set for a replica kept full. Off by default: not yet shown to win "
                                    "at and past the knee (docs/benchmarks.md, sitting G20d).")
    demand_margin: float = Field(LearnerKnobs.demand_margin, ge=0, le=1, description="Where a replica's demand over ~10 s (what "
                                 "it held and was waiting for it, scaled by the requests offered over those admitted: a refused one "
                                 "would have stayed as long) fits below the n its line allows at this share of the TBT target, its "
                                 "budget rises to hold it; past the knee the demand does not fit and `margin`'s budget stays "
                                 "(0: off). Work between the two margins is work the engine carries within the target (0.95 since "
                                 "docs/benchmarks.md, S33).")
    stall_prior_s: float = Field(LearnerKnobs.stall_prior_s, ge=0, le=600, description="Seconds of evidence that prefills cost "
                                 "nothing which each replica's prefill price starts with (fading as the real evidence does): a "
                                 "load's first burst prefills every stream a replica holds within a few seconds, which priced alone "
                                 "puts the budget at its floor while the replica keeps its pace (0: no prior; 10 since docs/benchmarks.md G31b).")
    line_from_decode: bool = Field(LearnerKnobs.line_from_decode, description="Fit each replica's decode line on the inter-token "
                                   "gaps no prefill shared (where a batch size has 5 of them), not on all gaps: in a load's first "
                                   "burst most steps carry a new stream's prefill, and a line fitted on them is too steep (docs/benchmarks.md, G31b).")
    absorb: bool = Field(LearnerKnobs.absorb, description="A latency request that would lose its first token waiting for a slot, "
                         "with no slot lent anywhere, goes beyond the budget to a replica where every stream running on time "
                         "stays on time with its prefill and its share of the batch added (mean TPOT and the per-token "
                         "timeline, each stream's own pace so far), and where its own first token and pace keep its SLO; "
                         "not while an answer with a deadline waits. Counted in `slogate_absorbed_total`.")
    absorb_by: Literal["timeline", "tpot"] = Field(LearnerKnobs.absorb_by, description="How `absorb` keeps the streams running on time: "
                                                  "by mean TPOT and the per-token timeline (`timeline`), or by mean TPOT alone (`tpot`, as "
                                                  "guidellm and `vllm bench serve` judge a stream).")
    absorb_beside_deadlines: bool | Literal["slack"] = Field(LearnerKnobs.absorb_beside_deadlines, description="`absorb` also while an "
                                                             "answer with a deadline waits for a slot: `true` always; `slack` only "
                                                             "when every such answer could wait out the absorbed stream's life and "
                                                             "still end on time; `false` never (the deadline answers' slack is kept "
                                                             "for them, and a latency request at risk is refused).")
    lend_to: float | None = Field(LearnerKnobs.lend_to, gt=0, le=1, description="The pace, as a share of the TBT target, that slots lent to first tokens may "
                                  "raise a replica to (default: `margin`).")
    engine_metrics: bool = Field(True, description="Read vLLM's /metrics (`vllm:num_requests_running`, `_waiting`, `kv_cache_usage_perc`) "
                                 "each health check: traffic that bypasses the gateway takes from the budget; a full KV cache stops admission.")
    engine_metrics_every_s: float = Field(5.0, ge=0, le=3600, description="Read a replica's /metrics this often while its KV cache is below "
                                          "half full and no other client's requests run there; at every health check otherwise "
                                          "(vLLM's API server spends ~13 ms of CPU rendering each read on a CPU engine).")

    def knobs(self) -> LearnerKnobs:
        """The learner's knobs, as the simulator takes them too (router/capacity.py)."""
        return LearnerKnobs(**self.model_dump(include={f.name for f in dataclasses.fields(LearnerKnobs)}))


class PrefixConfig(_Strict):
    """Where each replica's prefix cache is (router/prefix.py), learned from what was sent where."""

    enabled: bool = Field(True, description="Track each replica's prefix cache: placement and the latency model count only the part of a prompt "
                          "the replica does not already hold.")
    block_chars: int = Field(128, ge=16, le=65_536, description="Prompt characters per block (about 32 tokens of English); hits count whole blocks.")
    kv_tokens: int = Field(100_000, ge=1, description="A replica's KV cache in tokens where neither `backends[].kv_cache_tokens` nor its /metrics says.")
    tokenizer: Path | None = Field(None, description="The served model's Hugging Face tokenizer (a directory with tokenizer.json and its "
                                   "tokenizer_config.json / chat_template.jinja, or the tokenizer.json): prompts are cut into blocks of "
                                   "`block_tokens` token ids as the engine tokenizes them (~1 ms per 3,000 tokens, off the event loop), "
                                   "and replicas with `kv_events` are pictured from the engine's events. Unset: blocks of characters.")
    token_cache: int = Field(1_000_000, ge=0, description="With a tokenizer: token ids of recent chat prompts kept (4 bytes each, least "
                             "recently used dropped first), so a conversation or agent loop that resends its context has only what "
                             "it added tokenized (the ids up to a special token of the template are the same in every prompt that "
                             "shares the text before it; checked on the first reuses). 0: tokenize every prompt whole.")
    block_tokens: int = Field(16, ge=1, le=4096, description="Token ids per block with a tokenizer: a divisor of every engine's KV block size "
                              "(vLLM's 16 on GPUs, 128 on CPUs).")
    kv_events_topic: str = Field("", description="The ZMQ topic the engines publish KV-cache events on (vLLM's `topic`, default empty).")
    share: bool = Field(True, description="With shared state (`state.kind: redis`), gateways tell each other which prompts they sent where "
                        "(a Redis stream of the last 20,000 dispatches, read at every sync), so each one's picture of every replica's "
                        "cache holds the others' requests too; a gateway that starts reads the history. Off: each learns from its own.")


class DiscoveryConfig(_Strict):
    """How `dns+` / `dnssrv+` backends are resolved (gateway/discovery.py)."""

    interval_s: float = Field(5.0, gt=0, le=3600, description="Re-resolve every discovered backend this often, s (and at once when one of "
                              "its replicas fails a health check).")
    nameservers: list[str] = Field(default_factory=list, description="DNS servers as `IP` or `IP:PORT`; empty: the system resolver "
                                   "(/etc/hosts and /etc/resolv.conf, what the cluster or compose network provides).")
    timeout_s: float = Field(2.0, gt=0, le=60, description="One resolution's time limit, s; a failed one keeps the replicas last found.")

    @field_validator("nameservers")
    @classmethod
    def _servers(cls, v: list[str]) -> list[str]:
        import ipaddress

        for ns in v:
            host, _, port = ns.rpartition(":") if ns.count(":") == 1 else (ns, "", "")
            try:
                ipaddress.ip_address(host or ns)
                if port and not 0 < int(port) < 65536:
                    raise ValueError
            except ValueError:
                raise ValueError(f"nameserver {ns!r}: expected IP or IP:PORT") from None
        return v


class WorkflowsConfig(_Strict):
    """Agent workflows (calls sharing a `workflow.id`): stage sub-deadlines from pattern graphs
    of finished workflows (JITServe §4.1; gateway/workflows.py)."""

    stage_deadlines: bool = Field(True, description="Give each call its stage's share of the workflow deadline, matched against the "
                                  "pattern graphs of finished workflows; off, or before any history matches: the whole workflow deadline.")
    history: Path | None = Field(None, description="Finished workflows to match against from the start: JSON lines of `{workflow_id, calls: "
                                 "[{call_id, stage, input_tokens, output_tokens, gap_before_s, phase|kind|tool|model}]}`.")
    learn: bool = Field(True, description="Add each finished live workflow to the patterns (ended by a call with `workflow.final`, "
                        "else `idle_s` after its deadline).")
    idle_s: float = Field(10.0, ge=0, le=86_400, description="A workflow with no `final` call is taken as finished this long after its deadline, s.")
    capacity: int = Field(500, ge=1, le=100_000, description="Pattern graphs kept at most (the least reused are evicted).")


class KeyConfig(_Strict):
    """One API key, stored as the SHA-256 hex of the key (the key itself never is)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 hex of the key (`slogate hash-key`); the key itself is never stored.")
    tenant: str = Field(description="Tenant name in logs and rate limits.")
    tier: str = Field("default", description="The key's tier; authoritative (a request cannot lift itself into another).")
    models: list[str] = Field(default_factory=list, description="Models the key may use; empty: every model.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="This key's SLO defaults (above the tier's).")
    slo_floor: SLOSpec = Field(default_factory=SLOSpec, description="The strictest SLO the key may ask for; stricter asks are clamped to it.")
    rpm: int | None = Field(None, ge=1, description="Requests per minute (shared across gateways with Redis state).")
    tpm: int | None = Field(None, ge=1, description="Tokens per minute: prompt estimate + max output.")


class AuthConfig(_Strict):
    enabled: bool = Field(False, description="Require `Authorization: Bearer <key>` on /v1/*.")
    keys: list[KeyConfig] = Field(default_factory=list, description="The API keys.")
    admin_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key for /admin/*; none: /admin is disabled (403).")


class PacingConfig(_Strict):
    enabled: bool = Field(True, description="Hold a few tokens of latency streams back to hide engine stalls from the client.")
    ceiling: float = Field(0.8, gt=0, le=1, description="Never hold a token past its TBT timeline at this fraction of the TBT "
                           "(mean TPOT ≤ max(the engine's, ceiling × TBT)).")
    reserve_tbts: float = Field(4.0, ge=0, le=100, description="Hold no token longer than this many TBTs (the stall reserve).")
    flush_at_end: bool = Field(True, description="When the engine's stream ends, send what is held at once: the answer ends when the "
                               "engine's does (off: the last tokens stay smooth and the answer ends up to the reserve later).")
    build: float = Field(0.25, ge=0, le=1, description="While the reserve grows, release at most this much slower than the engine makes tokens.")
    default_slo: bool = Field(False, description="Pace streams whose TBT is only `slo.default` too (off: a client that sends no SLO "
                              "gets tokens as fast as the engine makes them).")

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, v: Any) -> Any:
        return {"enabled": v} if isinstance(v, bool) else v


class GatewayConfig(_Strict):
    backends: list[BackendConfig] = Field(default_factory=list, description="The engine replicas.")
    policies: PolicyConfig = Field(default_factory=PolicyConfig, description="Scheduling policies.")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="Default SLOs.")
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"default": TierConfig()}, description="Priority tiers by name (`default` always exists).")
    service_tiers: dict[str, str] = Field(default_factory=lambda: {"auto": "default", "default": "default"},
                                          description="OpenAI `service_tier` value → tier name.")
    predictor: PredictorConfig = Field(default_factory=PredictorConfig, description="Answer-length predictor.")
    max_queue: int = Field(2000, ge=1, description="Requests waiting per model at most; beyond: 503 + Retry-After.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body; beyond: 413.")
    retries: int = Field(2, ge=0, le=10, description="Other replicas tried after a connect error or 5xx before the first byte.")
    connect_timeout_s: float = Field(3.0, gt=0, description="Upstream connect timeout, s.")
    first_byte_timeout_s: float = Field(600.0, gt=0, description="Non-streamed requests: longest wait for a replica's answer, s.")
    stream_idle_timeout_s: float = Field(60.0, gt=0, description="Streamed requests: longest silence from a replica (headers, then between chunks), s; "
                                         "before the first byte the request is retried elsewhere, after it the stream ends with an error event.")
    keepalive_s: float = Field(5.0, gt=0, description="A stream silent this long gets an SSE comment so proxies keep it open, s.")
    pacing: PacingConfig = Field(default_factory=lambda: PacingConfig(),
                                 description="The smoothing buffer for latency streams (`true` / `false` turn it on / off).")
    health_interval_s: float = Field(1.0, gt=0, description="Backend health-check period, s.")
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig, description="DNS discovery of `dns+` / `dnssrv+` backends.")
    workflows: WorkflowsConfig = Field(default_factory=WorkflowsConfig, description="Agent workflows: stage sub-deadlines.")
    shutdown_grace_s: float = Field(30.0, gt=0, description="On SIGTERM, requests in flight get this long to finish before they are cut, s.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig, description="Learned per-replica budgets.")
    prefix: PrefixConfig = Field(default_factory=PrefixConfig, description="Prefix-cache-aware placement.")
    state: StateConfig = Field(default_factory=StateConfig, description="Where per-replica load is kept.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys.")

    @field_validator("tiers")
    @classmethod
    def _has_default(cls, v: dict[str, TierConfig]) -> dict[str, TierConfig]:
        v.setdefault("default", TierConfig())
        return v

    @model_validator(mode="after")
    def _kv_events_need_tokens(self) -> GatewayConfig:
        if any(b.kv_events for b in self.backends) and self.prefix.enabled and self.prefix.tokenizer is None:
            raise ValueError("backends[].kv_events needs prefix.tokenizer: the engine's events name blocks of token ids")
        return self


# Sections a running gateway cannot swap: a reload (SIGHUP, file change) that changes them logs
# a warning and keeps the running values until a restart. Everything else applies to new requests.
RESTART_ONLY = ("state", "prefix", "predictor", "capacity", "workflows", "shutdown_grace_s")


# Environment overrides (applied over the file by `load_config`; documented from here).
ENV_OVERRIDES: dict[str, str] = {
    "SLOGATE_CONFIG": "path of the YAML config when `slogate serve` gets no `--config`",
    "SLOGATE_BACKENDS": "comma-separated backend URLs; replaces `backends` (models are discovered)",
    "SLOGATE_ORDERING": "`policies.ordering`",
    "SLOGATE_PLACEMENT": "`policies.placement`",
    "SLOGATE_FRAME_S": "`policies.frame_s`",
    "SLOGATE_MAX_QUEUE": "`max_queue`",
    "SLOGATE_REDIS_URL": "`state.url`, and sets `state.kind: redis`",
    "SLOGATE_PREDICTOR_MODEL": "`predictor.model_path`",
}


# `slogate serve` flags for the knobs a user tries first: flag → (config key, what it sets).
# They override the file and the environment (`apply_flags`); documented from here.
CLI_FLAGS: dict[str, tuple[str, str]] = {
    "--backend URL": ("backends", "repeatable; replaces `backends` (models are discovered from each `/v1/models`)"),
    "--ordering NAME": ("policies.ordering", "ordering / admission policy"),
    "--placement NAME": ("policies.placement", "placement policy"),
    "--budget N": ("backends[].budget", "every backend's budget (the upper bound when budgets are learned)"),
    "--learn-budget / --no-learn-budget": ("capacity.learn", "learn each replica's SLO-safe concurrency, or keep `budget` fixed"),
    "--pacing / --no-pacing": ("pacing.enabled", "the smoothing buffer for latency streams"),
    "--ttft-ms MS": ("slo.default.ttft_ms", "default time to first token"),
    "--tbt-ms MS": ("slo.default.tbt_ms", "default time between tokens"),
    "--deadline-ms MS": ("slo.default.deadline_ms", "default deadline of a whole answer"),
    "--waiting-ms MS": ("slo.default.waiting_ms", "default longest wait for admission"),
    "--redis-url URL": ("state.url", "share per-replica state through this Redis (sets `state.kind: redis`)"),
    "--prefix-index / --no-prefix-index": ("prefix.enabled", "place by where each replica's prefix cache is"),
    "--tokenizer PATH": ("prefix.tokenizer", "the served model's tokenizer: prefix blocks of token ids, as the engine cuts them"),
    "--kv-events ENDPOINT": ("backends[].kv_events", "repeatable, one per `--backend` in order (or one for all, with `{host}`): "
                             "where each engine publishes its KV-cache events"),
}


def apply_flags(cfg: GatewayConfig, *, backends: list[str] | None = None, ordering: str | None = None, placement: str | None = None,
                budget: int | None = None, learn_budget: bool | None = None, pacing: bool | None = None, ttft_ms: float | None = None,
                tbt_ms: float | None = None, deadline_ms: float | None = None, waiting_ms: float | None = None,
                redis_url: str | None = None, prefix_index: bool | None = None, tokenizer: str | None = None,
                kv_events: list[str] | None = None) -> GatewayConfig:
    """`cfg` with the command line's values over it (None: not given); validated like the file,
    so a bad value fails with the config key it maps to."""
    raw = cfg.model_dump()
    if backends:  # the file's settings for a URL named again stay (its budget, key, events)
        known = {b["url"]: b for b in raw["backends"]}
        raw["backends"] = [known.get(same_url(u), {"url": u}) for u in backends]
    if kv_events:
        if len(kv_events) not in (1, len(raw["backends"])):
            raise ValueError(f"--kv-events: give one per backend ({len(raw['backends'])}) or one for all, got {len(kv_events)}")
        for i, b in enumerate(raw["backends"]):
            b["kv_events"] = kv_events[i if len(kv_events) > 1 else 0]
    if tokenizer is not None:
        raw["prefix"]["tokenizer"] = tokenizer
    pol = raw["policies"]
    pol.update({k: v for k, v in (("ordering", ordering), ("placement", placement)) if v is not None})
    if budget is not None:
        for b in raw["backends"]:
            b["budget"] = budget
    if learn_budget is not None:
        raw["capacity"]["learn"] = learn_budget
    if pacing is not None:
        raw["pacing"]["enabled"] = pacing
    slo = raw["slo"]["default"]
    slo.update({k: v for k, v in (("ttft_ms", ttft_ms), ("tbt_ms", tbt_ms), ("deadline_ms", deadline_ms), ("waiting_ms", waiting_ms))
                if v is not None})
    if redis_url is not None:
        raw["state"].update(kind="redis", url=redis_url)
    if prefix_index is not None:
        raw["prefix"]["enabled"] = prefix_index
    return GatewayConfig.model_validate(raw)


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None) -> GatewayConfig:
    """Read the YAML file (if any), then apply SLOGATE_* environment overrides."""
    env = dict(os.environ if env is None else env)
    raw: dict = {}
    if path:
        text = Path(path).read_text()
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the config must be a YAML mapping")
    if env.get("SLOGATE_BACKENDS"):
        raw["backends"] = [{"url": u.strip()} for u in env["SLOGATE_BACKENDS"].split(",") if u.strip()]
    pol = raw.setdefault("policies", {})
    for key, field in (("SLOGATE_ORDERING", "ordering"), ("SLOGATE_PLACEMENT", "placement"), ("SLOGATE_FRAME_S", "frame_s")):
        if env.get(key):
            pol[field] = env[key]
    if env.get("SLOGATE_MAX_QUEUE"):
        raw["max_queue"] = env["SLOGATE_MAX_QUEUE"]
    if env.get("SLOGATE_REDIS_URL"):
        raw.setdefault("state", {}).update(kind="redis", url=env["SLOGATE_REDIS_URL"])
    if env.get("SLOGATE_PREDICTOR_MODEL"):
        raw.setdefault("predictor", {})["model_path"] = env["SLOGATE_PREDICTOR_MODEL"]
    return GatewayConfig.model_validate(raw)
