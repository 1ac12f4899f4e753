"""HTTP routes over the worker: `/v1/locate`, `/v1/ground`, `/v1/chat/completions`, `/health`, `/metrics`,
`/v1/models`, the web page at `/`. No MLX here: handlers parse and check input, queue engine requests on the
worker and await its events. `create_app(load, settings)` is the app factory (tests pass a loader of a tiny model):
the middlewares (`middleware.py`), the error handlers (`errors.py`) and the routes (`Routes`).

The bodies' schemas are in `schemas.py` and their reading in `bodies.py`; jobs and server-sent events in
`streaming.py`; the OpenAI adapter in `chat.py`; `/metrics` in `metrics.py`.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from importlib.resources import files

from ..locate import LocateModel
from ..request import Request, Result
from .images import Holding, ImageBudget, decoded_bytes
from .protocol import (
    InputError,
    Settings,
    build_requests,
    decode_image,
    ground_json,
    image_bytes,
    image_header,
    is_remote,
    locate_json,
)
from .worker import Job, QueueFull, TooLarge, Worker

try:
    import anyio
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import FileResponse, JSONResponse, Response
    from fastapi.staticfiles import StaticFiles
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f'the server needs its extra: pip install "mlx-locate[server]" ({e})') from e

from .bodies import is_form, json_body, read_body
from .chat import answer_format, chat_completion, chat_input, chat_stream, chat_task
from .errors import CLIENT_CLOSED, ApiError, add_error_handlers
from .metrics import Metrics
from .middleware import Cors, Guard, Observe
from .schemas import ChatBody, Decoding, GroundBody, LocateBody, parse
from .streaming import disconnected, event_stream, job_result, open_job, refusal

WEB = files("mlx_locate.server") / "web"
EXAMPLE = files("mlx_locate") / "demo" / "example.png"  # the page's "use the example"


def create_app(load: Callable[[], LocateModel], settings: Settings | None = None) -> FastAPI:
    """The server app. `load` runs on the worker thread (the one that owns MLX) when the app starts; until it
    and the warm-up are done, `/health` answers 503 "loading" and the model routes 503 with Retry-After."""
    settings = settings or Settings()
    routes = Routes(load, settings)
    app = FastAPI(title="mlx-locate", lifespan=routes.lifespan, docs_url=None, redoc_url=None)
    app.state.worker = routes.worker
    app.state.images = routes.images
    app.state.settings = settings
    app.state.metrics = routes.metrics
    app.add_middleware(Guard, settings=settings)
    if settings.allow_origins:
        app.add_middleware(Cors, origins=settings.allow_origins)
    app.add_middleware(Observe, metrics=routes.metrics)
    add_error_handlers(app)
    routes.add_to(app)
    return app


class Routes:
    """The handlers of one app, over its worker (the one thread that owns MLX), image budget, settings and
    metrics."""

    def __init__(self, load: Callable[[], LocateModel], settings: Settings):
        self.settings = settings
        self.worker = Worker(load, max_queue=settings.max_queue, max_rows=settings.max_rows, warmup=settings.warmup)
        self.images = ImageBudget(int(settings.max_image_mb * 2**20))
        self.metrics = Metrics(self.worker)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.worker.start()
        yield
        await anyio.to_thread.run_sync(self.worker.stop)

    def add_to(self, app: FastAPI) -> None:
        """The page, its static files and the routes, on `app`."""
        app.mount("/web", StaticFiles(directory=str(WEB)), name="web")
        app.get("/", include_in_schema=False)(self.page)
        app.get("/example.png", include_in_schema=False)(self.example)
        app.get("/health")(self.health)
        app.get("/metrics", include_in_schema=False)(self.metrics_page)
        app.get("/v1/models")(self.models)
        app.post("/v1/locate")(self.locate)
        app.post("/v1/ground")(self.ground)
        app.post("/v1/chat/completions")(self.chat)

    # -- what the handlers share ---------------------------------------------------------------------------

    def require_ready(self) -> int:
        """The model's vocabulary size once it serves; else 503 (loading: with Retry-After)."""
        state = self.worker.state
        if state == "loading":
            raise ApiError(503, "loading", "the model is loading; retry shortly", {"Retry-After": "2"})
        if state != "ok":
            raise ApiError(503, "unavailable", f"the model is not served ({state})")
        return self.worker.limits.vocab_size

    async def image_source(self, source: str | None, data: bytes | None = None):
        """A client's image (data URL, base64, upload or, when allowed, a URL) opened, not decoded (its format and
        size checked from the header), and the bytes it holds compressed."""
        settings, held = self.settings, 0
        if data is None:
            if not source:
                raise InputError("invalid_request", "the request has no image")
            if is_remote(source) and settings.allow_remote_images:
                data = await fetch_remote(source, int(settings.max_body_mb * 1024 * 1024))
            else:
                data, held = image_bytes(source), len(source)  # the text stays with the parsed body
        header = await anyio.to_thread.run_sync(image_header, data, settings.max_pixels)
        return header, held + len(data)

    async def decoded(self, header, held: int, job_requests: list[Request]) -> tuple[list[Request], Holding]:
        """`job_requests` (built on the undecoded `header`) on its decoded pixels, decoded off the event loop once
        the image budget holds them (503 with Retry-After when it cannot take the call now, 400 when never), and
        their holding (released by the job, `open_job` or `start_stream`)."""
        settings = self.settings
        try:
            views = max(self.worker.cost(r) for r in job_requests)
        except ValueError as e:  # a bad tiling
            raise ApiError(400, "invalid_request", str(e)) from None
        limits = self.worker.limits
        need = decoded_bytes(header.size, header.mode, limits.in_token_limit, limits.patch_size, views)
        try:
            holding = self.images.admit(held, need)
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

    def observe(self, request: HttpRequest, job: Job, results: Sequence[Result | None] = ()) -> None:
        """What the access log and /metrics say of a finished job."""
        request.state.rows = job.cost
        request.state.steps = max((r.stats.get("steps") or 0 for r in results if r is not None), default=0)
        if job.first_object_at is not None:
            self.metrics.first_box.observe(job.first_object_at - request.state.arrived)

    async def results_of(self, request: HttpRequest, job_requests: Sequence[Request], holding: Holding) -> list[Result]:
        """Run the requests as one job and wait for every result; a client that goes away cancels them."""
        async with open_job(self.worker, job_requests, self.settings, holding) as job:
            collecting = asyncio.ensure_future(job.results())
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not collecting.done():
                    collecting.cancel()
                answered = collecting.done() and not collecting.cancelled() and collecting.exception() is None
                self.observe(request, job, collecting.result() if answered else ())
            if not collecting.done() or collecting.cancelled():
                raise ApiError(*CLIENT_CLOSED)
            return job_result(collecting)

    # -- the routes (a docstring here is the route's description in the OpenAPI schema) ---------------------

    async def page(self):
        return FileResponse(str(WEB / "index.html"))

    async def example(self):
        return FileResponse(str(EXAMPLE))

    async def health(self):
        """200 once the model is loaded and warmed up; 503 while loading (or when it failed to load)."""
        worker, s = self.worker, self.worker.stats
        body = {
            "status": worker.state,
            "model": self.settings.model_name,
            "pending": worker.pending,
            "max_queue": self.settings.max_queue,
            "active_rows": s.active_rows,
            "waiting": s.waiting,
        }
        return JSONResponse(body, status_code=200 if worker.state == "ok" else 503)

    async def metrics_page(self):
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {
            "object": "list",
            "data": [{"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "mlx-locate"}],
        }

    async def locate(self, request: HttpRequest):
        vocab = self.require_ready()
        settings = self.settings
        body: LocateBody
        body, data = await read_body(request, LocateBody)
        queries = body.queries()
        image, held = await self.image_source(body.image, data)
        job_requests = build_requests(image, queries, body.task, vocab, **body.options(settings))
        job_requests, holding = await self.decoded(image, held, job_requests)
        image = job_requests[0].image  # the decoded pixels
        request_id = request.state.request_id = f"loc-{secrets.token_hex(8)}"
        listed = queries if isinstance(body.query, list) else None

        def answer(results: list[Result]) -> dict:
            return locate_json(request_id, settings.model_name, body.task, body.mode, listed, results)

        if not body.stream:
            return answer(await self.results_of(request, job_requests, holding))
        start = {
            "id": request_id,
            "model": settings.model_name,
            "task": body.task,
            "mode": body.mode,
            "image": {"width": image.width, "height": image.height},
            "queries": queries,
        }
        return await event_stream(
            request, self.worker, job_requests, settings, start, queries, answer, self.observe, holding
        )

    async def ground(self, request: HttpRequest):
        vocab = self.require_ready()
        body: GroundBody
        body, data = await read_body(request, GroundBody)
        image, held = await self.image_source(body.image, data)
        options = body.options(self.settings)
        job_requests = [
            *build_requests(image, [body.instruction], "point", vocab, **options),
            *build_requests(image, [body.instruction], "gui", vocab, **options),
        ]
        job_requests, holding = await self.decoded(image, held, job_requests)
        request.state.request_id = f"gnd-{secrets.token_hex(8)}"
        point, region = await self.results_of(request, job_requests, holding)
        return {"id": request.state.request_id, "model": self.settings.model_name, **ground_json(point, region)}

    async def chat(self, request: HttpRequest):
        vocab = self.require_ready()
        settings = self.settings
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
        image, held = await self.image_source(source)
        decoding: Decoding = parse(Decoding, body.decoding())
        job_requests = build_requests(image, [query], task, vocab, **decoding.options(settings))
        job_requests, holding = await self.decoded(image, held, job_requests)
        completion_id = request.state.request_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if not body.stream:
            (result,) = await self.results_of(request, job_requests, holding)
            return chat_completion(completion_id, created, settings.model_name, result, fields)
        usage = bool((body.stream_options or {}).get("include_usage"))
        ids = (completion_id, created, settings.model_name)
        return await chat_stream(
            request, self.worker, job_requests, settings, ids, usage, fields, self.observe, holding
        )


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
