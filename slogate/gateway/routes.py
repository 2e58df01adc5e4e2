"""The HTTP surface: the OpenAI (and vLLM) endpoints, the operations endpoints, and errors in
the OpenAI shape for everything, including routing errors and validation."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from slogate.gateway.errors import APIError, error_body
from slogate.gateway.handler import Gateway
from slogate.gateway.schema import PATHS, POOLING

log = logging.getLogger("slogate.gateway")


def openai_routes(r: FastAPI, gw: Gateway) -> None:
    """On the app itself, not an included router: one routing layer less on every request."""

    def route(kind: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return await gw.handle(kind, request)
        return endpoint

    # Generative endpoints, then vLLM's pooling and tokenizer endpoints, passed to a replica of the model.
    for kind in ("chat", "completions", "responses", *sorted(POOLING)):
        r.add_api_route(PATHS[kind], route(kind), methods=["POST"], response_model=None, name=kind)

    # What a key may use, with a key where auth is on (/v1/* asks for one); not where the models are
    # served: the replicas' addresses are the operator's (/admin/state), not every client's.
    def model_object(m: str) -> dict[str, Any]:
        return {"id": m, "object": "model", "created": 0, "owned_by": "slogate"}

    @r.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        key = gw.auth.identify(request.headers)
        return {"object": "list", "data": [model_object(m) for m in sorted(gw.groups) if gw.auth.may_use(key, m)]}

    @r.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        key = gw.auth.identify(request.headers)
        if model not in gw.groups or not gw.auth.may_use(key, model):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model_object(model)


def ops_routes(r: FastAPI, gw: Gateway) -> None:

    @r.get("/admin/state")
    async def admin_state(request: Request) -> dict[str, Any]:
        gw.auth.require_admin(request.headers)
        st = gw.state
        return {"instance": st.instance, "store": st.store.kind, "degraded": st.degraded, "gateways": st.n_gateways,
                "replicas": [{"name": b.name, "url": b.cfg.url, "state": b.state, "healthy": b.view.healthy, "budget": b.view.budget,
                              "inflight_here": b.view.local_inflight,
                              "inflight_remote": b.view.inflight - b.view.local_inflight,
                              "models": sorted(b.models), "beta": round(b.view.model.beta, 3)} for b in gw.backends],
                "queues": {m: len(a.waiting) for m, a in gw.groups.items()},
                "workflow_patterns": gw.workflows.patterns, "workflows_learned": gw.workflows.learned}

    @r.get("/admin/workflows/{wf_id:path}")
    async def admin_workflow(wf_id: str, request: Request) -> dict[str, Any]:
        """One agent workflow: its deadline, each stage's share of it, its calls so far."""
        gw.auth.require_admin(request.headers)
        d = gw.workflows.describe(wf_id)
        if d is None:
            raise APIError(404, f"no workflow {wf_id!r} (never seen, or forgotten an hour after its deadline)")
        return d

    @r.post("/admin/backends/{name:path}/drain")
    async def admin_drain(name: str, request: Request) -> dict[str, Any]:
        """Hold a replica out: no new requests, its streams finish (maintenance, a node to empty)."""
        gw.auth.require_admin(request.headers)
        b = gw.drain(name, True)
        return {"name": b.name, "state": b.state, "inflight_here": b.view.local_inflight}

    @r.post("/admin/backends/{name:path}/undrain")
    async def admin_undrain(name: str, request: Request) -> dict[str, Any]:
        gw.auth.require_admin(request.headers)
        b = gw.drain(name, False)
        return {"name": b.name, "state": b.state, "inflight_here": b.view.local_inflight}

    @r.post("/admin/reload")
    async def admin_reload(request: Request) -> JSONResponse:
        """Read the config again (as SIGHUP does); 400 with the reason when it is rejected."""
        gw.auth.require_admin(request.headers)
        err = await gw.reload_from_source("POST /admin/reload")
        if err is not None:
            raise APIError(400, f"config rejected, the running config stays: {err}", code="config_rejected")
        return JSONResponse({"result": "applied", "backends": [b.name for b in gw.backends]})

    @r.get("/health")
    @r.get("/health/ready")
    async def health() -> JSONResponse:
        """Readiness: 200 while at least one backend is healthy (a load balancer should send traffic)."""
        healthy = [b.name for b in gw.backends if b.view.healthy]
        ok = bool(healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", "healthy_backends": len(healthy), "backends": len(gw.backends),
                             "state_degraded": gw.state.degraded}, status_code=200 if ok else 503)

    @r.get("/health/live")
    async def live() -> dict[str, str]:
        """Liveness: the event loop answers. Independent of backends, so an engine outage never
        makes an orchestrator restart every gateway."""
        return {"status": "ok"}

    @r.get("/metrics")
    async def metrics() -> Response:
        gw.refresh_gauges()
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")


def openai_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_r: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        """Routing errors (unknown path, wrong method) in the OpenAI shape too."""
        resp = APIError(e.status_code, str(e.detail)).response()
        resp.headers.update(e.headers or {})  # e.g. Allow on a 405 (RFC 9110)
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e.errors()[:3])), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_r: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body("internal error in the gateway", "internal_error"), status_code=500)
