"""HTTP routes over the worker: `/v1/locate`, `/v1/ground`, `/v1/chat/completions`, `/health`, `/metrics`,
`/v1/models`, the web page at `/`. No MLX here: handlers parse and check input, queue engine requests on the
worker and await its events. `create_app(load, settings)` is the app factory (tests pass a loader of a tiny model).

Every error body is `{"error": {"code", "message"}}`. Three pure ASGI middlewares wrap the routes, outermost
first: `Observe` (the access-log line, `/metrics`' request counters, `X-Request-Id`), `Cors` (the
`--allow-origin` list; preflights answered) and `Guard` (Host and Origin against DNS rebinding, the API key,
the body size), so every answer, refusals included, is logged and counted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from importlib.resources import files
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from ..admission import MAX_SEED
from ..engine import EventKind
from ..locate import LocateModel
from ..preprocess import ORIENTATIONS
from ..prompts import GRAMMAR_TOKENS, TASK_TEMPLATES, TASKS
from ..request import Request, RequestError, Result
from ..sampling import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, Sampling
from .images import Holding, ImageBudget, decoded_bytes
from .protocol import (
    ANSWER_FIELDS,
    InputError,
    Settings,
    answer_json,
    build_requests,
    decode_image,
    ground_json,
    image_bytes,
    image_header,
    is_remote,
    locate_json,
    result_json,
)
from .worker import Job, QueueFull, TooLarge, Worker, WorkerError

try:
    import anyio
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
    from starlette.background import BackgroundTask
    from starlette.datastructures import Headers, UploadFile
    from starlette.exceptions import HTTPException
    from starlette.middleware.cors import CORSMiddleware
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f'the server needs its extra: pip install "mlx-locate[server]" ({e})') from e

MAX_TEXT = 4096  # characters of one query, instruction or chat text
MAX_TOKENS = 65536  # a request's max_tokens (the engine clips it to the model's positions)
OPEN_PATHS = ("/", "/health", "/metrics", "/example.png", "/favicon.ico")  # no API key: the page asks for it itself
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/locate", "/v1/ground", "/v1/chat/completions")
ANSWER_END = "<|im_end|>"  # how `Result.text` ends when the model closed its answer
WEB = files("mlx_locate.server") / "web"
EXAMPLE = files("mlx_locate") / "demo" / "example.png"  # the page's "use the example"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

access_log = logging.getLogger("mlx_locate.server.access")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


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


class Metrics:
    """`/metrics` of one app: HTTP requests (by route and status, latency), first boxes, and the worker's
    counters and gauges read when scraped."""

    def __init__(self, worker: Worker):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlx_locate_http_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "mlx_locate_http_request_seconds",
            "time from a request's arrival to the end of its answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_box = Histogram(
            "mlx_locate_first_box_seconds",
            "time from a request's arrival to its first box or point",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(WorkerCollector(worker))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class WorkerCollector:
    """The worker's stats as Prometheus metrics, read at scrape time."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def collect(self):
        w, s = self.worker, self.worker.stats
        steps_per_s, tokens_per_s = s.rates()
        gauges = [
            ("mlx_locate_ready", "1 once the model is loaded and warmed up", float(w.ready)),
            ("mlx_locate_queue_cost", "views x queries accepted and not finished (limit: --max-queue)", w.pending),
            ("mlx_locate_queue_limit", "--max-queue", w.max_queue),
            ("mlx_locate_waiting_requests", "engine requests waiting for a row", s.waiting),
            ("mlx_locate_active_rows", "rows decoding", s.active_rows),
            ("mlx_locate_steps_per_second", "forward steps per second over the last 10 s", steps_per_s),
            ("mlx_locate_tokens_per_second", "generated tokens per second over the last 10 s", tokens_per_s),
        ]
        counters = [
            ("mlx_locate_steps", "forward steps (one host read each)", s.steps),
            ("mlx_locate_tokens", "generated tokens", s.tokens),
            ("mlx_locate_engine_requests", "engine requests accepted (a view of a tiled call is not one)", s.submitted),
            ("mlx_locate_engine_requests_failed", "engine requests that ended with an error", s.failed),
            ("mlx_locate_cancellations", "engine requests cancelled (client gone, timeout)", s.cancelled),
            ("mlx_locate_failed_steps", "steps that raised past the engine's isolation", s.failed_steps),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


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


# -- request bodies ---------------------------------------------------------------------------------------


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


# Tokenizing runs on the worker thread, between everyone's steps: a query's length is bounded here.
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]
PENALTY_LOW, PENALTY_HIGH = REPETITION_PENALTY_RANGE


class Decoding(BaseModel):
    """Decoding fields every endpoint takes (see `mlx_locate.Request`); every number bounded."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["slow", "fast", "hybrid"] = "hybrid"
    max_tokens: Int = Field(512, ge=1, le=MAX_TOKENS)
    strict: bool = False
    temperature: Float = Field(0.0, ge=0, le=MAX_TEMPERATURE)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)  # and at most the vocabulary: checked with the model (`check_request`)
    repetition_penalty: Float = Field(1.0, ge=PENALTY_LOW, le=PENALTY_HIGH)
    seed: Int = Field(0, ge=0, le=MAX_SEED)
    orientation: Literal[ORIENTATIONS] = "exif"  # "stored": boxes in the stored pixels, EXIF orientation ignored
    max_image_tokens: Int | None = Field(None, ge=4)  # a patch budget below the model's (at most the model's)

    @model_validator(mode="after")
    def _sampling_is_valid(self) -> Decoding:
        self.sampling()
        return self

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.repetition_penalty)

    def options(self, settings: Settings) -> dict:
        return {
            "mode": self.mode,
            "max_tokens": self.max_tokens,
            "strict": self.strict,
            "sampling": self.sampling(),
            "seed": self.seed,
            "max_pixels": settings.max_pixels,
            "orientation": self.orientation,
            "max_image_tokens": self.max_image_tokens,
        }


class LocateBody(Decoding):
    image: str | None = None  # data URL or base64 (or a file part in multipart)
    query: Text | list[Text] | None = None  # a list: separate questions, answered under "queries"
    categories: list[Text] | None = None  # several categories of one detect request: one row each, one result
    joint: bool = False  # categories in ONE prompt joined by </c> (the reference's; also with strict)
    task: Literal[TASKS] = "detect"
    tiles: Literal["auto"] | tuple[Int, Int] | None = None
    stream: bool = False


class GroundBody(Decoding):
    image: str | None = None  # data URL or base64 (or a file part in multipart)
    instruction: Text = Field(min_length=1)
    max_tokens: Int = Field(64, ge=1, le=MAX_TOKENS)


class ChatBody(BaseModel):
    """The OpenAI fields we use; others an OpenAI client may send are ignored. `mode`, `task`, `top_k` and
    `repetition_penalty` ride in extra_body."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: Int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Float = Field(0.0, ge=0, le=MAX_TEMPERATURE)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    repetition_penalty: Float = Field(1.0, ge=PENALTY_LOW, le=PENALTY_HIGH)
    seed: Int | None = Field(None, ge=0, le=MAX_SEED)
    n: Int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    mode: Literal["slow", "fast", "hybrid"] = "hybrid"
    task: Literal[TASKS] | None = None

    def decoding(self) -> dict:
        """The `Decoding` fields of this body."""
        fields = ("mode", "temperature", "top_p", "top_k", "repetition_penalty")
        max_tokens = self.max_completion_tokens or self.max_tokens or 512
        return {"max_tokens": max_tokens, "seed": self.seed or 0, **{f: getattr(self, f) for f in fields}}


def validation_message(e: ValidationError | RequestValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())


def is_form(request: HttpRequest) -> bool:
    kind = request.headers.get("content-type", "")
    return kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


async def json_body(request: HttpRequest) -> dict:
    raw = bytearray()  # read here, not with request.body(), which keeps the raw bytes as long as the request
    async for chunk in request.stream():
        raw += chunk
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("invalid_json", f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InputError("invalid_json", "the body must be a JSON object")
    return body


async def form_body(request: HttpRequest) -> tuple[dict, bytes | None]:
    """Form fields as a dict (repeated `query`/`categories` fields become lists) and the image file."""
    form = await request.form(max_files=1, max_fields=64)
    fields: dict[str, Any] = {}
    data = None
    for key in set(form.keys()):
        values = form.getlist(key)
        if key == "image" and isinstance(values[0], UploadFile):
            data = await values[0].read()
        elif any(isinstance(v, UploadFile) for v in values):
            raise InputError("invalid_request", f"field {key!r}: only 'image' may be a file")
        elif key == "categories" or (key == "query" and len(values) > 1):
            fields[key] = values
        else:
            fields[key] = values[0]
    return fields, data


async def body_fields(request: HttpRequest) -> tuple[dict, bytes | None]:
    """A JSON body, or a form (multipart with the image as a file part, or urlencoded)."""
    if is_form(request):
        return await form_body(request)
    return await json_body(request), None


def parse(model: type[BaseModel], fields: dict) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise InputError("invalid_request", validation_message(e)) from None


# -- the app ----------------------------------------------------------------------------------------------


def create_app(load: Callable[[], LocateModel], settings: Settings | None = None) -> FastAPI:
    """The server app. `load` runs on the worker thread (the one that owns MLX) when the app starts; until it
    and the warm-up are done, `/health` answers 503 "loading" and the model routes 503 with Retry-After."""
    settings = settings or Settings()
    worker = Worker(load, max_queue=settings.max_queue, max_rows=settings.max_rows, warmup=settings.warmup)
    images = ImageBudget(int(settings.max_image_mb * 2**20))
    metrics = Metrics(worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await anyio.to_thread.run_sync(worker.stop)

    app = FastAPI(title="mlx-locate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.images = images
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(Guard, settings=settings)
    if settings.allow_origins:
        app.add_middleware(Cors, origins=settings.allow_origins)
    app.add_middleware(Observe, metrics=metrics)
    app.mount("/web", StaticFiles(directory=str(WEB)), name="web")

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

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(e.status_code, codes.get(e.status_code, "http_error"), str(e.detail), e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")

    def require_ready() -> int:
        """The model's vocabulary size once it serves; else 503 (loading: with Retry-After)."""
        state = worker.state
        if state == "loading":
            raise ApiError(503, "loading", "the model is loading; retry shortly", {"Retry-After": "2"})
        if state != "ok":
            raise ApiError(503, "unavailable", f"the model is not served ({state})")
        return worker.limits.vocab_size

    async def image_source(source: str | None, data: bytes | None = None):
        """A client's image (data URL, base64, upload or, when allowed, a URL) opened, not decoded (its format and
        size checked from the header), and the bytes it holds compressed."""
        held = 0
        if data is None:
            if not source:
                raise InputError("invalid_request", "the request has no image")
            if is_remote(source) and settings.allow_remote_images:
                data = await fetch_remote(source, int(settings.max_body_mb * 1024 * 1024))
            else:
                data, held = image_bytes(source), len(source)  # the text stays with the parsed body
        header = await anyio.to_thread.run_sync(image_header, data, settings.max_pixels)
        return header, held + len(data)

    async def decoded(header, held: int, job_requests: list[Request]) -> tuple[list[Request], Holding]:
        """`job_requests` (built on the undecoded `header`) on its decoded pixels, decoded off the event loop once
        the image budget holds them (503 with Retry-After when it cannot take the call now, 400 when never), and
        their holding (released by the job, `open_job` or `start_stream`)."""
        try:
            views = max(worker.cost(r) for r in job_requests)
        except ValueError as e:  # a bad tiling
            raise ApiError(400, "invalid_request", str(e)) from None
        limits = worker.limits
        need = decoded_bytes(header.size, header.mode, limits.in_token_limit, limits.patch_size, views)
        try:
            holding = images.admit(held, need)
        except (TooLarge, QueueFull) as e:
            raise refusal(e) from None
        try:
            try:
                await asyncio.wait_for(holding.turn(), settings.timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(504, "timeout", f"the request took longer than {settings.timeout_s:g} s") from None
            orientation = job_requests[0].orientation  # one image per call, so one frame
            holding.image = await anyio.to_thread.run_sync(decode_image, header, settings.max_pixels, orientation)
        except BaseException:
            holding.release()
            raise
        return [replace(r, image=holding.image) for r in job_requests], holding

    def observe(request: HttpRequest, job: Job, results: Sequence[Result | None] = ()) -> None:
        """What the access log and /metrics say of a finished job."""
        request.state.rows = job.cost
        request.state.steps = max((r.stats.get("steps") or 0 for r in results if r is not None), default=0)
        if job.first_object_at is not None:
            metrics.first_box.observe(job.first_object_at - request.state.arrived)

    async def results_of(request: HttpRequest, job_requests: Sequence[Request], holding: Holding) -> list[Result]:
        """Run the requests as one job and wait for every result; a client that goes away cancels them."""
        async with open_job(worker, job_requests, settings, holding) as job:
            collecting = asyncio.ensure_future(job.results())
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not collecting.done():
                    collecting.cancel()
                answered = collecting.done() and not collecting.cancelled() and collecting.exception() is None
                observe(request, job, collecting.result() if answered else ())
            if not collecting.done() or collecting.cancelled():
                raise ApiError(499, "client_closed", "the client closed the connection")
            return job_result(collecting)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(str(WEB / "index.html"))

    @app.get("/example.png", include_in_schema=False)
    async def example():
        return FileResponse(str(EXAMPLE))

    @app.get("/health")
    async def health():
        """200 once the model is loaded and warmed up; 503 while loading (or when it failed to load)."""
        s = worker.stats
        body = {
            "status": worker.state,
            "model": settings.model_name,
            "pending": worker.pending,
            "max_queue": settings.max_queue,
            "active_rows": s.active_rows,
            "waiting": s.waiting,
        }
        return JSONResponse(body, status_code=200 if worker.state == "ok" else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_page():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "mlx-locate"}],
        }

    @app.post("/v1/locate")
    async def locate(request: HttpRequest):
        vocab = require_ready()
        fields, data = await body_fields(request)
        body: LocateBody = parse(LocateBody, fields)
        if body.categories is not None and (body.query is not None or body.task != "detect"):
            raise InputError("invalid_request", "categories make one detect request; do not combine with query/task")
        queries = body.query if isinstance(body.query, list) else [body.query]
        if body.categories is not None:
            queries = [body.categories]
        if not queries:
            raise InputError("invalid_request", "query is an empty list")
        image, held = await image_source(body.image, data)
        options = {**body.options(settings), "joint": body.joint}
        job_requests = build_requests(image, queries, body.task, vocab, tiles=body.tiles, **options)
        job_requests, holding = await decoded(image, held, job_requests)
        image = job_requests[0].image  # the decoded pixels
        request_id = request.state.request_id = f"loc-{secrets.token_hex(8)}"
        listed = queries if isinstance(body.query, list) else None

        def answer(results: list[Result]) -> dict:
            return locate_json(request_id, settings.model_name, body.task, body.mode, listed, results)

        if not body.stream:
            return answer(await results_of(request, job_requests, holding))
        start = {
            "id": request_id,
            "model": settings.model_name,
            "task": body.task,
            "mode": body.mode,
            "image": {"width": image.width, "height": image.height},
            "queries": queries,
        }
        return await event_stream(request, worker, job_requests, settings, start, queries, answer, observe, holding)

    @app.post("/v1/ground")
    async def ground(request: HttpRequest):
        vocab = require_ready()
        fields, data = await body_fields(request)
        body: GroundBody = parse(GroundBody, fields)
        image, held = await image_source(body.image, data)
        options = body.options(settings)
        job_requests = [
            *build_requests(image, [body.instruction], "point", vocab, **options),
            *build_requests(image, [body.instruction], "gui", vocab, **options),
        ]
        job_requests, holding = await decoded(image, held, job_requests)
        request.state.request_id = f"gnd-{secrets.token_hex(8)}"
        point, region = await results_of(request, job_requests, holding)
        return {"id": request.state.request_id, "model": settings.model_name, **ground_json(point, region)}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        vocab = require_ready()
        if is_form(request):
            raise InputError(
                "unsupported_media_type",
                "this endpoint takes a JSON body (Content-Type: application/json), as OpenAI's API does; "
                "/v1/locate and /v1/ground also take multipart uploads",
                415,
            )
        body: ChatBody = parse(ChatBody, await json_body(request))
        fields = answer_format(body.response_format)
        text, source = chat_input(body.messages)
        task, query = chat_task(text, body.task)
        image, held = await image_source(source)
        decoding: Decoding = parse(Decoding, body.decoding())
        job_requests = build_requests(image, [query], task, vocab, **decoding.options(settings))
        job_requests, holding = await decoded(image, held, job_requests)
        completion_id = request.state.request_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if not body.stream:
            (result,) = await results_of(request, job_requests, holding)
            return chat_completion(completion_id, created, settings.model_name, result, fields)
        usage = bool((body.stream_options or {}).get("include_usage"))
        ids = (completion_id, created, settings.model_name)
        return await chat_stream(request, worker, job_requests, settings, ids, usage, fields, observe, holding)

    return app


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, ready: bool = True) -> Iterator[str]:
    """Run `app` under uvicorn on a background thread (tests, the load benchmark); yields its base URL once
    the model is loaded and warmed up (`ready=False`: once the port answers), and shuts it down on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    worker: Worker = app.state.worker
    while not server.started or (ready and worker.state == "loading"):
        if not thread.is_alive():
            raise RuntimeError("the server did not start (see the log above)")
        time.sleep(0.02)
    try:
        if ready and worker.state != "ok":
            worker.wait_ready(0)  # raises the load error
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# -- running jobs -----------------------------------------------------------------------------------------


@asynccontextmanager
async def open_job(worker: Worker, job_requests: Sequence[Request], settings: Settings, holding: Holding):
    """A worker job whose queueing failures are HTTP errors: 400 for a call larger than the server can ever
    hold, 503 with Retry-After when the queue is full now. Its image's holding is released once the worker
    holds none of its requests."""
    job = Job(worker, job_requests, settings.timeout_s, on_finish=holding.release)
    await enter_job(job, holding)
    try:
        yield job
    finally:
        await job.__aexit__(None, None, None)


async def enter_job(job: Job, holding: Holding) -> None:
    """Queue `job`; when it cannot be, its image's holding is released and the failure raised (`refusal`)."""
    try:
        await job.__aenter__()
    except BaseException as e:
        holding.release()
        raise refusal(e) from None


def refusal(e: BaseException) -> BaseException:
    """A queue's refusal as an HTTP error: 400 for a call larger than the server can ever hold, 503 with
    Retry-After when it is full now; other errors as they are."""
    if isinstance(e, TooLarge):
        return ApiError(400, "request_too_large", str(e))
    if isinstance(e, QueueFull):
        return ApiError(503, "queue_full", str(e), {"Retry-After": "1"})
    if isinstance(e, WorkerError):
        return ApiError(503, "unavailable", str(e))
    if isinstance(e, ValueError):  # a bad tiling, found while costing the request
        return ApiError(400, "invalid_request", str(e))
    return e


def job_result(task: asyncio.Future) -> list[Result]:
    """The collected results, or the job's failure as an HTTP error."""
    try:
        return task.result()
    except TimeoutError as e:
        raise ApiError(504, "timeout", str(e)) from None
    except WorkerError as e:
        raise ApiError(500, "internal_error", str(e)) from None


async def disconnected(request: HttpRequest) -> None:
    """Returns when the client has closed the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def fetch_remote(url: str, limit: int) -> bytes:
    """GET an image URL (only with --allow-remote-images), at most `limit` bytes, no redirects."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InputError("remote_image_failed", f"GET {url} answered {response.status_code}")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise InputError("image_too_large", f"{url} is over {limit:,} bytes")
                return bytes(data)
    except httpx.HTTPError as e:
        raise InputError("remote_image_failed", f"GET {url} failed: {e}") from None


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def streamed(job: Job, frames: Callable[[Job], AsyncIterator[str]], error: Callable[[str, str], str]):
    """The frames of a job, ending in an error frame when it times out or fails mid-stream."""
    try:
        async for frame in frames(job):
            yield frame
    except TimeoutError as e:
        yield error("timeout", str(e))
    except WorkerError as e:
        yield error("internal_error", str(e))
    finally:
        await job.__aexit__(None, None, None)


async def start_stream(worker, job_requests, settings, frames, error, holding: Holding, text=False):
    """Queue the job first (so a full queue is a real 503), then stream its frames. The background task
    cancels what is left even when the client leaves before the stream starts; the image's holding is released
    once the worker holds none of its requests."""
    job = Job(worker, job_requests, settings.timeout_s, text=text, on_finish=holding.release)
    await enter_job(job, holding)
    return StreamingResponse(
        streamed(job, frames, error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(job.__aexit__, None, None, None),
    )


async def event_stream(request, worker, job_requests, settings, start, queries, answer, observe, holding):
    """`/v1/locate` with `stream`: events `start`, `view` (a tiled request's tile or whole image as it
    finishes, its objects in the image's pixels), `object` (as each `</box>` is committed; for a tiled
    request, the merged objects at the end), `empty`, `done` (the same body as without `stream`) or `error`."""

    async def frames(job: Job) -> AsyncIterator[str]:
        yield sse("start", start)
        results: list[Result | None] = [None] * len(job.requests)
        try:
            async for i, event in job:
                where = {"query_index": i, "query": queries[i]}
                if event.kind is EventKind.OBJECT:
                    yield sse("object", {**where, **event.object.to_dict()})
                elif event.kind is EventKind.EMPTY:
                    yield sse("empty", {**where, "label": event.label})
                elif event.kind is EventKind.VIEW:
                    view = result_json(event.result)
                    tile = {"box": list(event.tile.box), "whole": event.tile.whole}
                    body = {"view": event.view, "tile": tile, **{k: view[k] for k in ("objects", "empty_labels")}}
                    yield sse("view", {**where, **body})
                elif event.kind is EventKind.ERROR:
                    yield sse("error", {**where, **error_body("invalid_request", str(event.error))})
                    return
                elif event.kind is EventKind.DONE:
                    results[i] = event.result
            yield sse("done", answer(results))
        finally:
            observe(request, job, results)

    error = lambda c, m: sse("error", error_body(c, m))  # noqa: E731
    return await start_stream(worker, job_requests, settings, frames, error, holding)


# -- OpenAI chat ------------------------------------------------------------------------------------------

# A text that starts like one of the task prompts, or holds a grammar token or an image placeholder, is the
# model's own prompt (task "raw"); any other text is the phrase to detect.
_PROMPT_STARTS = tuple(t.partition("{}")[0] for t in TASK_TEMPLATES.values())
_GRAMMAR = re.compile("|".join([*map(re.escape, GRAMMAR_TOKENS), r"<image-\d+>", r"<\d{1,4}>"]))


def chat_task(text: str, task: str | None) -> tuple[str, str | None]:
    """The (task, query) of a chat message: `task` when the client names one (extra_body), `raw` when the
    text already is a prompt in the model's grammar, else `detect` with the text as the phrase."""
    if task is not None:
        return task, text or None
    if text.startswith(_PROMPT_STARTS) or _GRAMMAR.search(text):
        return "raw", text
    phrase = text.strip().rstrip(".!?").strip()
    if not phrase:
        raise InputError("invalid_request", "the user message has no text: say what to find (e.g. 'red car')")
    return "detect", phrase


def answer_format(response_format: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The answer fields a `response_format` asks for as JSON content; None for the model's text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return ANSWER_FIELDS
    if kind != "json_schema":
        raise InputError("invalid_request", f"response_format type {kind!r}: use text, json_object or json_schema")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if properties is None:
        return ANSWER_FIELDS
    unknown = sorted(set(properties) - set(ANSWER_FIELDS)) if isinstance(properties, dict) else [repr(properties)]
    if unknown:
        raise InputError(
            "invalid_request",
            f"response_format: the answer has the fields {', '.join(ANSWER_FIELDS)} (objects with label, box, "
            f"point in pixels and confidence); the schema asks for {', '.join(map(str, unknown))}",
        )
    return tuple(properties)


def chat_input(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """The text and the one image of the last user message (content parts `text` and `image_url`)."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise InputError("invalid_request", "messages has no user message")
    content = users[-1].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise InputError("invalid_request", "a message's content must be a string or a list of parts")
    texts, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            images.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise InputError("invalid_request", f"unsupported content part {kind!r}; use 'text' and 'image_url'")
    if len(images) != 1 or not isinstance(images[0], str):
        raise InputError("invalid_request", f"the user message needs exactly one image_url, got {len(images)}")
    text = "\n".join(texts).strip()
    if len(text) > MAX_TEXT:
        raise InputError("invalid_request", f"the text has {len(text)} characters; at most {MAX_TEXT}")
    return text, images[0]


def finish_reason(result: Result) -> str:
    return "length" if result.stats.get("stop_reason") == "length_cap" else "stop"


def usage_of(result: Result) -> dict:
    prompt, answer = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def content_of(result: Result, fields: tuple[str, ...] | None) -> str:
    """The message content: the model's answer text, or with `response_format` the parsed answer as JSON."""
    if fields is None:
        return result.text.removesuffix(ANSWER_END)
    answer = answer_json(result)
    return json.dumps({k: answer[k] for k in fields})


def chat_completion(completion_id: str, created: int, model: str, result: Result, fields=None) -> dict:
    """An OpenAI `chat.completion`: the answer as content (`content_of`); the parsed answer (`objects`,
    `empty_labels`, `truncated`, `image`, `stats`) also as extra top-level fields."""
    width, height = result.image_size
    parsed = result_json(result)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content_of(result, fields)},
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage_of(result),
        "image": {"width": width, "height": height},
        **{k: parsed[k] for k in ("objects", "empty_labels", "truncated", "stats")},
    }


async def chat_stream(request, worker, job_requests, settings, ids, include_usage, fields, observe, holding):
    """`chat.completion.chunk`s: the role first; the answer's text as it is decoded, item by item (TEXT
    events), each committed box or point also in an extra `objects` field; then the rest of the text, the
    finish reason, `[DONE]`. With `response_format`, the JSON answer comes in one chunk at the end."""
    completion_id, created, model = ids

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return f"data: {json.dumps({**body, 'choices': [choice], **extra})}\n\n"

    async def frames(job: Job) -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        sent, results = "", []
        try:
            async for _, event in job:
                if event.kind is EventKind.TEXT:
                    piece = event.text.removesuffix(ANSWER_END)
                    sent += piece
                    if piece:
                        yield chunk({"content": piece})
                elif event.kind is EventKind.OBJECT:
                    yield chunk({"content": ""}, objects=[event.object.to_dict()])
                elif event.kind is EventKind.ERROR:
                    yield f"data: {json.dumps(error_body('invalid_request', str(event.error)))}\n\n"
                    return
                elif event.kind is EventKind.DONE:
                    result = event.result
                    results.append(result)
                    content = content_of(result, fields)
                    if content.startswith(sent) and len(content) > len(sent):
                        yield chunk({"content": content[len(sent) :]})
                    yield chunk({}, finish_reason(result), empty_labels=result.empty_labels)
                    if include_usage:
                        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created}
                        usage = {"model": model, "choices": [], "usage": usage_of(result)}
                        yield f"data: {json.dumps({**body, **usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            observe(request, job, results)

    def error(code: str, message: str) -> str:
        return f"data: {json.dumps(error_body(code, message))}\n\n"

    return await start_stream(worker, job_requests, settings, frames, error, holding, text=fields is None)
