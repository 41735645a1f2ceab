"""OpenAI-shaped errors: every failure the server reports is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error with an HTTP status and the fields OpenAI clients read (they raise on status, show message)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The error body; text that echoes the client (a model name, a parameter path) is made UTF-8 safe,
    so writing the error can never fail in its turn."""
    return {"error": {"message": utf8_safe(message), "type": type, "param": utf8_safe(param), "code": code}}


def utf8_safe(text: str | None) -> str | None:
    """`text` with anything UTF-8 cannot encode (lone surrogates from JSON's \\ud800 escapes) written as
    a visible `\\ud800` escape."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> APIError:
    """A parameter we cannot honour exactly: refused, never silently ignored."""
    tail = f": {why}" if why else ""
    return APIError(400, f"'{param}' is not supported by this server{tail}", param=param, code="unsupported_parameter")


# ---------------------------------------------------------------------------------------------------------
# The error shape, for the OpenAPI document
# ---------------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body; every 4xx and 5xx answer of the server has this shape."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: the listed statuses and any other 4XX/5XX, all as ErrorResponse.
    (FastAPI's default 422 is not declared: this server answers validation errors with 400.)"""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(status, "error")} for status in statuses}
    out["4XX"] = {"model": ErrorResponse, "description": "client error (401 API key, 408, 413, 429 queue full, ...)"}
    out["5XX"] = {"model": ErrorResponse, "description": "server error (503 loading or shutting down)"}
    return out


_DESCRIPTIONS = {
    400: "invalid request: malformed JSON, wrong types, out-of-range or unsupported parameters",
    404: "unknown model",
}
