"""Schemathesis against the gateway's own OpenAPI schema, live over HTTP: valid and invalid
(negative) bodies for every operation must get no 5xx, only documented status codes, bodies
that fit the documented schemas (the OpenAI error shape for every error), and 4xx for data
that breaks the schema. Bounded: SLOGATE_FUZZ_EXAMPLES examples per operation and mode."""

from __future__ import annotations

import os
from contextlib import ExitStack

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.predictors.online import OnlineLengthPredictor
from slogate.sim.server import create_engine_app

MODEL = "sim-model"
EXAMPLES = int(os.environ.get("SLOGATE_FUZZ_EXAMPLES", "25"))


def _cfg(urls: list[str]) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "backends": [{"url": u, "models": [MODEL], "budget": 64} for u in urls],
        "policies": {"frame_s": 0.05}, "health_interval_s": 0.5, "tiers": {"high": {"weight": 2}},
        "slo": {"default": {"kind": "auto", "ttft_ms": 2000, "tbt_ms": 100, "deadline_ms": 20000, "waiting_ms": 10000}}})


schema = schemathesis.openapi.from_dict(create_app(_cfg(["http://127.0.0.1:9"])).openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES)


@pytest.fixture(scope="module")
def live_gateway():
    with ExitStack() as st:
        # Fixed-latency engines: fuzzed requests may ask for any max_tokens; keep each answer short in time.
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL, fixed_ttft_ms=1, fixed_itl_ms=0.2))) for _ in range(2)]
        yield st.enter_context(ServerThread(create_app(_cfg([e.url for e in engines]), OnlineLengthPredictor())))


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_the_gateway_against_its_openapi_schema(case, live_gateway) -> None:
    if case.method == "POST" and isinstance(case.body, dict) and case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE:
        # Reach the scheduler and a real engine, not only the 404 for a random model or tier name.
        case.body["model"] = MODEL
        for k in ("priority", "tier"):
            if isinstance(case.body.get(k), str):
                case.body[k] = "high"
    case.call_and_validate(base_url=live_gateway.url, timeout=60)
