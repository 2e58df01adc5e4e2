"""The live gateway as an ASGI app: the `Gateway` (`handler.py`) behind the OpenAI and
operations routes (`routes.py`), started and stopped with the app."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from slogate.gateway.config import GatewayConfig
from slogate.gateway.handler import Gateway
from slogate.gateway.routes import openai_errors, openai_routes, ops_routes
from slogate.gateway.schema import openapi
from slogate.predictors.online import OnlineLengthPredictor


def create_app(cfg: GatewayConfig, predictor: OnlineLengthPredictor | None = None,
               source: Callable[[], GatewayConfig] | None = None, watch: Path | None = None) -> FastAPI:
    """`source` / `watch`: where a reload reads the config again (see `Gateway`)."""
    gw = Gateway(cfg, predictor, source, watch)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="slogate", lifespan=lifespan)
    app.state.gateway = gw
    openai_errors(app)
    openai_routes(app, gw)
    ops_routes(app, gw)

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi(app)
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]
    return app
