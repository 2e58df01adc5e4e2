"""Prometheus metrics of one gateway (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_TBT = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
_OVH = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
L = ("model", "tier", "slo_class")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("slogate_requests_total", "Requests by outcome", [*L, "outcome"], registry=r)
        self.token_goodput = Counter("slogate_token_goodput_total", "Tokens delivered within their SLO (JITServe token goodput)", L, registry=r)
        self.request_goodput = Counter("slogate_request_goodput_total", "Requests that met their SLO", L, registry=r)
        self.tokens = Counter("slogate_tokens_total", "Tokens processed", [*L, "direction"], registry=r)
        self.tdg = Counter("slogate_tdg_total", "Token-level deadline goodput (PROSERVE TDG)", L, registry=r)
        self.tdg_ideal = Counter("slogate_tdg_ideal_total", "TDG if every request met its SLO", L, registry=r)
        self.ttft = Histogram("slogate_ttft_seconds", "Time to first token as the client sees it", L, buckets=_LAT, registry=r)
        self.tbt = Histogram("slogate_tbt_seconds", "Time between tokens as the client sees it", L, buckets=_TBT, registry=r)
        self.e2e = Histogram("slogate_e2e_seconds", "Request latency, end to end", L, buckets=_LAT, registry=r)
        self.queue_wait = Histogram("slogate_queue_wait_seconds", "Time waiting in the gateway queue", L, buckets=_LAT, registry=r)
        self.queue_depth = Gauge("slogate_queue_depth", "Requests waiting in the gateway queue", ["model"], registry=r)
        self.shed = Counter("slogate_shed_total", "Requests refused by the scheduler", ["model", "reason"], registry=r)
        self.absorbed = Counter("slogate_absorbed_total", "First tokens about to be lost placed beyond every lent slot, where the "
                                "streams running could absorb them (capacity.absorb)", ["model"], registry=r)
        self.retries = Counter("slogate_retries_total", "Upstream attempts retried on another replica", ["backend"], registry=r)
        self.cancelled = Counter("slogate_cancelled_total", "Requests whose client disconnected", ["model"], registry=r)
        self.inflight = Gauge("slogate_replica_inflight", "Requests in flight per replica", ["backend"], registry=r)
        self.healthy = Gauge("slogate_replica_healthy", "1 if the replica passes health checks", ["backend"], registry=r)
        self.budget = Gauge("slogate_replica_budget", "Concurrency budget per replica: learned SLO-safe concurrency, capped by the "
                            "configured budget, plus the slots a burst may take, less other clients' load", ["backend"], registry=r)
        self.overdraft = Gauge("slogate_replica_overdraft", "Slots above the budget lent now to latency requests that would lose "
                               "their first token waiting (while the replica runs faster than its aim)", ["backend"], registry=r)
        self.margin = Gauge("slogate_replica_margin", "Share of the TBT target the replica's budget aims its pace at now, moved by "
                            "the mean TPOT of the streams it finished (capacity.margin_from_streams)", ["backend"], registry=r)
        self.external = Gauge("slogate_replica_external_load", "Requests the engine reports beyond the gateways' own (vLLM /metrics)",
                              ["backend"], registry=r)
        self.pred_bounds = Counter("slogate_predictor_bounds_total", "First length bounds judged at completion", ["model"], registry=r)
        self.pred_covered = Counter("slogate_predictor_covered_total", "First length bounds that covered the true length", ["model"], registry=r)
        self.overhead = Histogram("slogate_gateway_overhead_seconds", "Gateway time before the upstream request is sent, queue wait excluded",
                                  buckets=_OVH, registry=r)
        self.state_degraded = Gauge("slogate_state_degraded", "1 while the shared store is unreachable (serving on local state)", registry=r)
        self.gateways = Gauge("slogate_gateways", "Gateway instances sharing the store", registry=r)
        self.prompt_tokens = Counter("slogate_prompt_tokens_total", "Prompt tokens dispatched (estimated: 4 characters a token)", ["backend"], registry=r)
        self.prefix_cached = Counter("slogate_prefix_cached_tokens_total", "Of those, the tokens the gateway expected the replica's prefix cache "
                                     "to hold", ["backend"], registry=r)
        self.prefix_shared = Counter("slogate_prefix_shared_total", "Dispatched prompts this gateway told the others about (sent) and "
                                     "put into its replicas' prefix indexes from theirs (received), with shared state", ["direction"], registry=r)
        for d in ("sent", "received"):
            self.prefix_shared.labels(d)
        self.tokenizer_tokens = Counter("slogate_tokenizer_tokens_total", "Chat prompt token ids with `prefix.tokenizer`: tokenized, or reused "
                                        "from an earlier prompt sharing the text up to a special token (`prefix.token_cache`)",
                                        ["how"], registry=r)
        for h in ("tokenized", "reused"):
            self.tokenizer_tokens.labels(h)
        self.kv_events = Counter("slogate_kv_events_total", "From the engines' KV-cache events (`backends[].kv_events`): blocks stored, "
                                 "removed, or not applied (unknown_parent, misaligned), clears, restarts, missed and undecodable batches, "
                                 "endpoints it could not connect to (connect_failed)",
                                 ["backend", "kind"], registry=r)
        self.resumes = Counter("slogate_resumes_total", "Streams moved mid-answer from a failed replica and continued on another "
                               "(the failed one named)", ["backend"], registry=r)
        self.resume_gap = Histogram("slogate_resume_gap_seconds", "The gap a resumed stream's client saw: last token before the failure or preemption "
                                    "to first token after it", buckets=_LAT, registry=r)
        self.preemptions = Counter("slogate_preemptions_total", "Streams the scheduler took off a replica to continue later "
                                   "(the replica named)", ["backend"], registry=r)
        self.recompute = Counter("slogate_preempt_recompute_tokens_total", "Prompt and generated tokens of preempted streams "
                                 "prefilled again where they continue (less what the gateway expects that replica's prefix cache to hold)", registry=r)
        self.replica_state = Gauge("slogate_replica_state", "1 for the replica's membership state: active (takes new requests), "
                                   "draining (finishing its streams, then leaving) or drained (held out by an operator)",
                                   ["backend", "state"], registry=r)
        self.membership = Counter("slogate_replica_changes_total", "Replicas joining, starting to drain and leaving (discovery, reload, admin)",
                                  ["change"], registry=r)
        self.reloads = Counter("slogate_config_reloads_total", "Config reloads by result (applied, rejected: the old config stays)",
                               ["result"], registry=r)
        for change in ("joined", "draining", "left"):
            self.membership.labels(change)  # exported at 0 from the start: a rate, not a missing series
        for result in ("applied", "rejected"):
            self.reloads.labels(result)
        self.decision = Histogram("slogate_decision_seconds", "One scheduling decision (predict + order + place)", buckets=_OVH, registry=r)

    BY_BACKEND = ("retries", "inflight", "healthy", "budget", "overdraft", "margin", "external", "prompt_tokens", "prefix_cached", "resumes", "preemptions")

    def forget(self, backend: str) -> None:
        """A replica left: its series go (a scaled-down fleet leaves no stale gauges behind)."""
        for name in self.BY_BACKEND:
            m = getattr(self, name)
            if (backend,) in m._metrics:
                m.remove(backend)
        for key in [k for k in self.kv_events._metrics if k[0] == backend]:
            self.kv_events.remove(*key)
        for state in ("active", "draining", "drained"):
            if (backend, state) in self.replica_state._metrics:
                self.replica_state.remove(backend, state)

    def render(self) -> bytes:
        return generate_latest(self.registry)
