"""`slogate serve` with no backend: the gateway in front of simulated engines in one process.
Composes the gateway and the simulator, so it lives above both (neither imports the other)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from slogate.gateway.config import BackendConfig, GatewayConfig
from slogate.gateway.serve import serve, start_server
from slogate.sim.server import create_engine_app


async def serve_with_sim_engines(cfg: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, sim_engines: int = 0,
                                 sim_model: str = "sim-model", log_level: str = "info", sim_budget: int | None = None,
                                 source: Callable[[], GatewayConfig] | None = None, watch: Path | None = None) -> None:
    """Start `sim_engines` simulated engines in this process, point the gateway at them, serve it.
    `source`: how a reload reads the config again (the simulated engines stay its backends)."""
    engines: list[tuple[uvicorn.Server, asyncio.Task[Any]]] = []
    sims: list[BackendConfig] = []
    for i in range(sim_engines):
        srv, task, p = await start_server(create_engine_app(sim_model))
        engines.append((srv, task))
        sims.append(BackendConfig(url=f"http://127.0.0.1:{p}", models=[sim_model], name=f"sim-{i + 1}",
                                  **({"budget": sim_budget} if sim_budget else {})))
    cfg.backends.extend(sims)

    def reread() -> GatewayConfig:
        assert source is not None
        new = source()
        new.backends.extend(sims if not new.backends else [])
        return new

    try:
        await serve(cfg, host, port, log_level, reread if source is not None and sims else source, watch)
    finally:
        for srv, task in engines:
            srv.should_exit = True
            await task


def run(cfg: GatewayConfig, host: str = "127.0.0.1", port: int = 8000, sim_engines: int = 0, log_level: str = "info",
        sim_budget: int | None = None, source: Callable[[], GatewayConfig] | None = None, watch: Path | None = None) -> None:
    """Serve until stopped, on uvloop where installed (uvicorn's own choice, which it only makes
    for loops it creates): its C transports halve the gateway's per-token socket and selector
    time at 100 streams."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(serve_with_sim_engines(cfg, host, port, sim_engines, log_level=log_level, sim_budget=sim_budget, source=source, watch=watch))
