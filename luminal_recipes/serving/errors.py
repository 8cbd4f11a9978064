"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}`` with the right status, for
every failure a client can meet; never a traceback (an unexpected exception is logged on the server and answered
500 with a one-line message)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import BudgetError, LuminalError, NonFiniteError

log = logging.getLogger("luminal_recipes.serving")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An answer other than success: ``status``, the message (the request field and the fix), the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_luminal(exc: LuminalError) -> APIError:
    """A user error of the product, raised by the work a request asked for."""
    if isinstance(exc, BudgetError):
        return APIError(503, str(exc), code="insufficient_memory")
    if isinstance(exc, NonFiniteError):
        return APIError(500, str(exc), code="nonfinite_output")
    return APIError(400, str(exc))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(LuminalError)
    async def _luminal(request: Request, exc: LuminalError):
        err = from_luminal(exc)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        message = f"{param or 'the request body'}: {first.get('msg', 'invalid')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})"
        return error_response(422, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}; see GET /v1/models and docs/serving.md",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); the server log has the details")
