"""A bare httpx + uvicorn pass-through proxy (round-robin, no parsing): the yardstick for the
gateway's overhead in bench/gateway_overhead.py.

    python bench/passthrough.py --port 8300 --backend http://127.0.0.1:8301 --backend ...
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def make_app(backends: list[str]) -> Starlette:
    rr = itertools.cycle(backends)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=2000, max_keepalive_connections=2000))

    async def proxy(request: Request) -> Response:
        body = await request.body()
        rq = client.build_request(request.method, next(rr) + request.url.path, content=body or None,
                                  headers={"content-type": "application/json"} if body else None)
        resp = await client.send(rq, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    # GET /v1/models and /health too: guidellm validates its backend with them before a run
    return Starlette(routes=[Route("/v1/chat/completions", proxy, methods=["POST"]), Route("/v1/completions", proxy, methods=["POST"]),
                             Route("/v1/models", proxy, methods=["GET"]), Route("/health", proxy, methods=["GET"])],
                     lifespan=lifespan)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True)
    a = ap.parse_args()
    uvicorn.run(make_app(a.backend), host="127.0.0.1", port=a.port, log_level="warning")
