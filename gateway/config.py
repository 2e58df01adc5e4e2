"""Gateway configuration: one YAML file, environment overrides, validated by pydantic.

```yaml
backends:
  - url: http://127.0.0.1:8001
    models: [llama-3.1-8b]        # empty: discovered from the backend's /v1/models
    budget: 48                    # requests the gateway keeps in flight there
    kind: vllm                    # vllm | sglang | openai
    priority_scheduling: false    # started with --scheduling-policy priority: pass `priority`
policies: {ordering: gmax, placement: gorouting, frame_s: 0.3}
slo:
  default: {kind: auto, ttft_ms: 2000, tbt_ms: 100, deadline_ms: 20000, waiting_ms: 5000}
  models: {llama-3.1-8b: {tbt_ms: 80}}
tiers: {default: {weight: 1}, high: {weight: 2, slo: {ttft_ms: 1000}}}
service_tiers: {priority: high, flex: low}
```
Environment: `SLOGATE_BACKENDS=url1,url2`, `SLOGATE_ORDERING`, `SLOGATE_PLACEMENT`,
`SLOGATE_FRAME_S`, `SLOGATE_MAX_QUEUE`, `SLOGATE_PREDICTOR_MODEL`, `SLOGATE_REDIS_URL` (shared
state in Redis) override the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.latency import DEFAULT_PROFILE


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BackendConfig(_Strict):
    url: str
    models: list[str] = Field(default_factory=list)
    budget: int = Field(48, ge=1, le=100_000)
    kind: Literal["vllm", "sglang", "openai"] = "vllm"
    priority_scheduling: bool = False
    name: str | None = None
    api_key: str | None = None  # sent upstream as a bearer token (kind openai)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")


class SLOSpec(_Strict):
    """Defaults (or overrides) for the SLO fields; None = inherit."""

    kind: Literal["auto", "latency", "deadline", "best_effort"] | None = None
    ttft_ms: float | None = Field(None, gt=0)
    tbt_ms: float | None = Field(None, gt=0)
    deadline_ms: float | None = Field(None, gt=0)
    waiting_ms: float | None = Field(None, gt=0)


class SLOConfig(_Strict):
    default: SLOSpec = Field(default_factory=lambda: SLOSpec(kind="auto", ttft_ms=2000, tbt_ms=100, deadline_ms=20_000, waiting_ms=5_000))
    models: dict[str, SLOSpec] = Field(default_factory=dict)
    best_effort_deadline_ms: float = Field(600_000, gt=0)
    workflow_deadline_ms: float = Field(120_000, gt=0)


class TierConfig(_Strict):
    weight: float = Field(1.0, gt=0)
    slo: SLOSpec = Field(default_factory=SLOSpec)


class PolicyConfig(_Strict):
    ordering: str = "gmax"
    placement: str = "gorouting"
    frame_s: float = Field(0.3, gt=0, le=10)
    params: dict[str, float] = Field(default_factory=dict)  # ordering parameters, e.g. gmax {fairness: 0.2, delta: 1}
    profile: str = DEFAULT_PROFILE
    seed: int = 0


class PredictorConfig(_Strict):
    model_path: str | None = None
    quantile: float = Field(0.9, gt=0.5, lt=1)
    refine_every: int = Field(50, ge=1)
    online: bool = True
    retrain_every: int = Field(2000, ge=50)


class StateConfig(_Strict):
    kind: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "slogate"
    lease_s: float = Field(15.0, gt=0)  # a crashed gateway's claims expire after this
    sync_s: float = Field(0.1, gt=0)  # how often other gateways' load is read
    timeout_s: float = Field(0.25, gt=0)  # a slower Redis counts as unavailable


class KeyConfig(_Strict):
    """One API key, stored as the SHA-256 hex of the key (the key itself never is)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str
    tier: str = "default"
    models: list[str] = Field(default_factory=list)  # empty: every model
    slo: SLOSpec = Field(default_factory=SLOSpec)  # this key's SLO defaults
    slo_floor: SLOSpec = Field(default_factory=SLOSpec)  # the strictest SLO it may ask for
    rpm: int | None = Field(None, ge=1)  # requests per minute
    tpm: int | None = Field(None, ge=1)  # tokens (prompt + max output) per minute


class AuthConfig(_Strict):
    enabled: bool = False
    keys: list[KeyConfig] = Field(default_factory=list)
    admin_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class GatewayConfig(_Strict):
    backends: list[BackendConfig] = Field(default_factory=list)
    policies: PolicyConfig = Field(default_factory=PolicyConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"default": TierConfig()})
    service_tiers: dict[str, str] = Field(default_factory=lambda: {"auto": "default", "default": "default"})
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    max_queue: int = Field(2000, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    retries: int = Field(2, ge=0, le=10)
    connect_timeout_s: float = Field(3.0, gt=0)
    first_byte_timeout_s: float = Field(600.0, gt=0)
    keepalive_s: float = Field(5.0, gt=0)
    pacing: bool = True
    health_interval_s: float = Field(1.0, gt=0)
    state: StateConfig = Field(default_factory=StateConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @field_validator("tiers")
    @classmethod
    def _has_default(cls, v: dict[str, TierConfig]) -> dict[str, TierConfig]:
        v.setdefault("default", TierConfig())
        return v


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
