"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Every path that rejects a request raises :class:`APIError`; the handlers installed by
:func:`install_error_handlers` turn it, FastAPI's validation errors, Starlette's 404/405 and
tokenmill's own exceptions into that JSON. Client input never reaches the 500 handler.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import ContextLengthError, TokenmillError

logger = logging.getLogger("tokenmill.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        return error_response(self.status, self.message, self.type, self.param, self.code, headers)

    @classmethod
    def from_tokenmill(cls, exc: TokenmillError, param: str | None = None) -> APIError:
        code = exc.code or ("context_length_exceeded" if isinstance(exc, ContextLengthError) else None)
        return cls(400, str(exc), param=param or exc.param or param_from_message(str(exc)), code=code)


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": printable(message), "type": type, "param": printable(param), "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def printable(text: str | None) -> str | None:
    """``text`` with lone surrogates (from a client's field names) written as ``\\udxxx``, so the
    error body still encodes to UTF-8."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def param_from_message(message: str) -> str | None:
    """SamplingParams names the bad field as ``invalid sampling parameter NAME=...``."""
    prefix = "invalid sampling parameter "
    if message.startswith(prefix):
        return message[len(prefix):].split("=", 1)[0]
    return None


CUSTOM_CODES = {"invalid_unicode": "invalid_unicode", "unsupported_parameter": "unsupported_parameter",
                "string_unicode": "invalid_unicode"}
"""Error types of the schemas' own validators (protocol.py), and pydantic's own for a lone surrogate
(in a field name, say), with the code each is reported as."""


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One message, the bad field's path and a code. A value no member of a union accepts gives one
    error per member (their paths end in the member's name): report their common path. An error of
    the schemas' own validators wins over the union's others: it names the field (the top-level
    one; the message gives the full path) and its type is the code."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        return f"the request body is not valid JSON: {detail}", None, "invalid_json"
    custom = next((e for e in errors if e.get("type") in CUSTOM_CODES), None)
    if custom is not None:
        # drop the names pydantic gives a union's members: "list[int]", and model classes (a body that
        # is a union of models, as /tokenize's); the API's own fields are snake_case
        loc = [p for p in custom.get("loc", ()) if p != "body"]
        while loc and isinstance(loc[0], str) and loc[0][:1].isupper():
            loc.pop(0)
        loc = [p for p in loc if isinstance(p, int) or "[" not in p]
        path = ".".join(map(str, loc))
        where = f"invalid value for '{path}': " if path else "invalid request body: "
        return where + str(custom.get("msg")), str(loc[0]) if loc else None, CUSTOM_CODES[custom["type"]]
    locs = [tuple(str(p) for p in e.get("loc", ()) if p != "body") for e in errors]
    same = [loc for loc in locs if loc[:1] == locs[0][:1]]
    common = locs[0]
    for loc in same[1:]:
        common = tuple(a for a, b in zip(common, loc) if a == b)[:len(common)]
        while common and common != loc[:len(common)]:
            common = common[:-1]
    param = ".".join(common) or None
    messages = list(dict.fromkeys(str(errors[i].get("msg", "invalid value"))
                                  for i, loc in enumerate(locs) if loc[:1] == locs[0][:1]))
    where = f"invalid value for '{param}': " if param else "invalid request body: "
    return where + "; or ".join(messages[:3]), param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param, code)

    @app.exception_handler(TokenmillError)
    async def tokenmill_error(request: Request, exc: TokenmillError) -> JSONResponse:
        return APIError.from_tokenmill(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body" from json.loads
            cause = exc.__cause__
            return error_response(400, f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start}); "
                                  "send JSON encoded as UTF-8", "invalid_request_error", code="invalid_utf8")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, _TYPES.get(exc.status_code, "server_error"),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error")
