"""Running the gateway under uvicorn."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.predictors.online import OnlineLengthPredictor
from slogate.predictors.qrf import LengthModel


def make_predictor(cfg: GatewayConfig) -> OnlineLengthPredictor:
    p = cfg.predictor
    model = LengthModel.load(p.model_path) if p.model_path else None
    return OnlineLengthPredictor(model, q=p.quantile, retrain_every=p.retrain_every if p.online else 10**12)


async def start_server(app: Any, host: str = "127.0.0.1", port: int = 0) -> tuple[uvicorn.Server, asyncio.Task[Any], int]:
    """Start `app` in this loop; returns the server, its task and the port it bound (port 0: the
    kernel picks a free one, so there is no race between choosing a port and binding it)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def serve(cfg: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                source: Callable[[], GatewayConfig] | None = None, watch: Path | None = None) -> None:
    app = create_app(cfg, make_predictor(cfg), source, watch)
    # What is loaded by now (FastAPI, pydantic, numpy, scikit-learn, the length model: ~160k
    # objects) lives as long as the process. Out of the collector's sight, or every full
    # collection scans it all: 150-200 ms on a small box, a p99 spike for every open stream.
    gc.collect()
    gc.freeze()
    # Keep idle client connections longer than clients do (httpx: 5 s, uvicorn's default is also
    # 5 s): with equal timeouts a client can reuse a connection the server is closing, and the
    # request fails with a read error before the gateway ever sees it.
    gw = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=cfg.shutdown_grace_s,
                                       timeout_keep_alive=75))
    await gw.serve()
