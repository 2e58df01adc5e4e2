"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

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
