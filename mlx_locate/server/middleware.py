"""The app's three pure ASGI middlewares, outermost first: `Observe` (the access-log line, `/metrics`' request
counters, `X-Request-Id`), `Cors` (the `--allow-origin` list; preflights answered) and `Guard` (Host and Origin
against DNS rebinding, the API key, the body size), so every answer, refusals included, is logged and counted.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from .errors import error_response
from .metrics import Metrics
from .protocol import Settings

OPEN_PATHS = ("/", "/health", "/metrics", "/example.png", "/favicon.ico")  # no API key: the page asks for it itself
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/locate", "/v1/ground", "/v1/chat/completions")

access_log = logging.getLogger("mlx_locate.server.access")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the limit of {limit:,} bytes (--max-body-mb)")


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    return "*" in allowed or origin in allowed


class Guard:
    """Pure ASGI middleware: Host and Origin against the allowed names and origins (403), the API key (401), the
    body size from Content-Length and while it streams in (413)."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.names = settings.host_names
        self.origins = settings.allow_origins
        self.key = None if settings.api_key is None else settings.api_key.encode()
        self.limit = int(settings.max_body_mb * 1024 * 1024)

    def host_allowed(self, value: str | None) -> bool:
        if not value:
            return False
        host = urlsplit(f"//{value}").hostname
        return host is not None and host.lower() in self.names

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        denied = self.check(scope["path"], headers)
        if denied is not None:
            return await denied(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge as e:
            if started:
                raise
            await error_response(413, "body_too_large", e.detail)(scope, receive, send)

    def check(self, path: str, headers: dict[str, str]) -> JSONResponse | None:
        if not self.host_allowed(headers.get("host")):
            return error_response(403, "forbidden_host", f"Host {headers.get('host')!r} is not served here")
        origin = headers.get("origin")
        if origin is not None and not (
            origin_allowed(origin, self.origins) or self.host_allowed(urlsplit(origin).netloc)
        ):
            return error_response(
                403, "forbidden_origin", f"requests from origin {origin!r} are not allowed (see --allow-origin)"
            )
        if self.key is not None and path not in OPEN_PATHS and not path.startswith("/web/"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return error_response(
                    401,
                    "unauthorized",
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    {"WWW-Authenticate": "Bearer"},
                )
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return error_response(413, "body_too_large", BodyTooLarge(self.limit).detail)
        return None


class Cors(CORSMiddleware):
    """Starlette's CORS for the `--allow-origin` list; a refused preflight is our JSON error (403)."""

    def __init__(self, app, origins: Sequence[str]):
        super().__init__(
            app,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Request-Id", "Retry-After"],
            allow_private_network=True,  # a page the user allowed may reach this machine's server
            max_age=600,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = response.body.decode().removeprefix("Disallowed CORS ")
        origin = request_headers["origin"]
        return error_response(403, "forbidden_origin", f"CORS preflight from {origin!r} refused ({refused})")


def route_of(path: str) -> str:
    """The metrics label of a path: its route, or "other" (labels stay few whatever clients send)."""
    if path in ROUTES:
        return path
    return "/web" if path.startswith("/web/") else "other"


class Observe:
    """Pure ASGI middleware: one access-log line per request (id, method, path, status, rows, steps, seconds),
    the HTTP metrics, and the request id in `X-Request-Id`. Handlers put `request_id`, `rows` (views x
    queries) and `steps` in `request.state`."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        state.update(request_id=f"req-{secrets.token_hex(8)}", arrived=t0)
        status = 500  # what the server's error handler answers when the app raises

        async def observed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", state["request_id"].encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            seconds = time.perf_counter() - t0
            route = route_of(scope["path"])
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(seconds)
            access_log.info(
                "%s %s %s %d rows=%s steps=%s %.3fs",
                state["request_id"],
                scope["method"],
                scope["path"],
                status,
                state.get("rows", 0),
                state.get("steps", 0),
                seconds,
            )
