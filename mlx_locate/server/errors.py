"""Errors as HTTP answers: every error body is `{"error": {"code", "message"}}`, whatever raised it (`ApiError`
from the handlers, `protocol.InputError`, a `RequestError`, a body that fails its schema, Starlette's 404/405/413,
anything else as a 500). A client that hangs up, while it uploads or before its answer, is 499 "client closed
request" (as nginx logs it): no traceback, not a server error in /metrics.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..request import RequestError
from .protocol import InputError
from .schemas import validation_message

CLIENT_CLOSED = (499, "client_closed", "the client closed the connection")


class ApiError(Exception):
    """An error a handler answers with: its HTTP status, code, message and headers."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app raises answered as an error body."""

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error_response(e.status, e.code, e.message, e.headers)

    @app.exception_handler(InputError)
    async def input_error(request, e: InputError):
        return error_response(e.status, e.code, str(e))

    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return error_response(400, "invalid_request", str(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return error_response(400, "invalid_request", validation_message(e))

    @app.exception_handler(ClientDisconnect)
    async def client_closed(request, e: ClientDisconnect):
        return error_response(*CLIENT_CLOSED)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(e.status_code, codes.get(e.status_code, "http_error"), str(e.detail), e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")
