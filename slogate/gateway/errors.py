"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 502: "upstream_error", 503: "overloaded_error", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def as_openai_error(content: bytes, status: int) -> bytes:
    """An engine's 4xx body in the OpenAI shape: kept when it already is one (vLLM's usually is),
    wrapped otherwise (a bare `{"detail": "Not Found"}` for an endpoint the replica lacks)."""
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and isinstance(doc["error"].get("message"), str):
        return content
    detail = doc.get("detail", doc.get("message")) if isinstance(doc, dict) else None
    if detail is None:
        detail = content[:500].decode("utf-8", "replace") or f"upstream answered {status}"
    msg = detail if isinstance(detail, str) else json.dumps(detail)[:500]
    return json.dumps(error_body(f"upstream: {msg}", _TYPES.get(status, "invalid_request_error"))).encode()
