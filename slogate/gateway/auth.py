"""API keys: who is calling, what they may use, how fast (JITServe §4.3's "monopolising user").

Keys arrive as `Authorization: Bearer KEY` (what the OpenAI SDK sends) or `x-api-key`; only
their SHA-256 is compared and stored, and neither appears in logs or metrics (metrics carry the
tenant). A key maps to a tenant (GMAX's fairness blend sees it), a tier, SLO defaults, an SLO
floor (the strictest SLO it may ask for: stricter asks are clamped to it), allowed models, and
request / token rate limits counted in the shared store, so every gateway enforces one limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from slogate.gateway.config import AuthConfig, KeyConfig
from slogate.gateway.errors import APIError
from slogate.gateway.state.base import SlotStore, StateUnavailable


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _presented(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


class Authenticator:
    def __init__(self, cfg: AuthConfig, store: SlotStore) -> None:
        self.cfg = cfg
        self.store = store
        self.by_hash = {k.sha256: k for k in cfg.keys}

    def identify(self, headers: Mapping[str, str]) -> KeyConfig | None:
        """The caller's key (None when auth is off). 401 when missing or unknown."""
        if not self.cfg.enabled:
            return None
        key = _presented(headers)
        if key is None:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        k = self.by_hash.get(key_hash(key))
        if k is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return k

    @staticmethod
    def may_use(k: KeyConfig | None, model: str) -> bool:
        return k is None or not k.models or model in k.models

    def check_model(self, k: KeyConfig | None, model: str) -> None:
        if not self.may_use(k, model):
            raise APIError(403, f"this key may not use model `{model}`", param="model", code="model_not_allowed")

    async def check_rate(self, k: KeyConfig | None, tokens: int) -> None:
        """Count one request and `tokens` against the key's per-minute limits (429 when over)."""
        if k is None or (k.rpm is None and k.tpm is None):
            return
        try:
            ok, retry = await self.store.rate(k.tenant + ":" + k.sha256[:16], 60.0, k.rpm, tokens, k.tpm)
        except StateUnavailable:
            return  # limits are best effort while the store is down; budgets still hold
        if not ok:
            raise APIError(429, f"rate limit exceeded for tenant {k.tenant}", code="rate_limit_exceeded", retry_after=retry)

    def require_admin(self, headers: Mapping[str, str]) -> None:
        if self.cfg.admin_sha256 is None:
            raise APIError(403, "no admin key is configured", code="admin_disabled")
        key = _presented(headers)
        if key is None or key_hash(key) != self.cfg.admin_sha256:
            raise APIError(401, "admin key required", code="invalid_api_key")
