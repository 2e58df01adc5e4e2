"""Running the gateway (and, for the embedded default, simulated engines) under uvicorn."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import BackendConfig, GatewayConfig
from predictors.online import OnlineLengthPredictor
from predictors.qrf import LengthModel
from sim.server import create_engine_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_predictor(cfg: GatewayConfig) -> OnlineLengthPredictor:
    p = cfg.predictor
    model = LengthModel.load(p.model_path) if p.model_path else None
    return OnlineLengthPredictor(model, q=p.quantile, retrain_every=p.retrain_every if p.online else 10**12)


async def _start(server: uvicorn.Server) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.02)
    return task


async def serve(cfg: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, sim_engines: int = 0, sim_model: str = "sim-model",
                log_level: str = "info", sim_budget: int | None = None) -> None:
    """Serve the gateway; with `sim_engines` > 0, first start that many simulated engines in this
    process and point the gateway at them (the embedded default)."""
    engines: list[tuple[uvicorn.Server, asyncio.Task[Any]]] = []
    for _ in range(sim_engines):
        p = free_port()
        srv = uvicorn.Server(uvicorn.Config(create_engine_app(sim_model), host="127.0.0.1", port=p, log_level="warning", lifespan="on"))
        engines.append((srv, await _start(srv)))
        cfg.backends.append(BackendConfig(url=f"http://127.0.0.1:{p}", models=[sim_model], name=f"sim-{len(engines)}",
                                          **({"budget": sim_budget} if sim_budget else {})))
    app = create_app(cfg, make_predictor(cfg))
    # Keep idle client connections longer than clients do (httpx: 5 s, uvicorn's default is also
    # 5 s): with equal timeouts a client can reuse a connection the server is closing, and the
    # request fails with a read error before the gateway ever sees it.
    gw = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=cfg.shutdown_grace_s,
                                       timeout_keep_alive=75))
    try:
        await gw.serve()
    finally:
        for srv, task in engines:
            srv.should_exit = True
            await task
