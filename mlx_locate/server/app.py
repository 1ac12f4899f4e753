"""HTTP routes over the worker: `/v1/locate`, `/v1/ground`, `/v1/chat/completions`, `/health`, `/v1/models`, the
web page at `/`. No MLX here: handlers parse and check input, queue engine requests on the worker and await its
events. `create_app(load, settings)` is the app factory (tests pass a loader of a tiny model).

Every error body is `{"error": {"code", "message"}}`. The `Guard` middleware checks, before any route runs, the
Host and Origin headers (DNS rebinding), the API key and the body size.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from importlib.resources import files
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from ..engine import EventKind
from ..locate import LocateModel
from ..prompts import TASKS
from ..request import Request, RequestError, Result
from ..sampling import Sampling
from .protocol import (
    InputError,
    Settings,
    build_requests,
    categories_query,
    ground_json,
    image_bytes,
    is_remote,
    locate_json,
    open_image,
    result_json,
)
from .worker import Job, QueueFull, Worker, WorkerError

try:
    import anyio
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from starlette.background import BackgroundTask
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f'the server needs its extra: pip install "mlx-locate[server]" ({e})') from e

MAX_TEXT = 4096  # characters of one query, instruction or chat text
OPEN_PATHS = ("/", "/health", "/example.png", "/favicon.ico")  # no API key needed: the page asks for it itself
ANSWER_END = "<|im_end|>"  # how `Result.text` ends when the model closed its answer
WEB = files("mlx_locate.server") / "web"
EXAMPLE = files("mlx_locate") / "demo" / "example.png"  # the page's "use the example"


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


class Guard:
    """Pure ASGI middleware: Host and Origin against the allowed names (403), the API key on /v1/* (401), the
    body size from Content-Length and while it streams in (413)."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.names = settings.host_names
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
        if origin is not None and not self.host_allowed(urlsplit(origin).netloc):
            return error_response(403, "forbidden_origin", f"requests from origin {origin!r} are not allowed")
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


# -- request bodies ---------------------------------------------------------------------------------------


# Tokenizing runs on the worker thread, between everyone's steps: a query's length is bounded here.
Text = Annotated[str, Field(max_length=MAX_TEXT)]


class Decoding(BaseModel):
    """Decoding fields every endpoint takes (see `mlx_locate.Request`)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["slow", "fast", "hybrid"] = "hybrid"
    max_tokens: int = Field(512, ge=1, le=65536)
    strict: bool = False
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int = 0

    def options(self, settings: Settings) -> dict:
        sampling = Sampling(self.temperature, self.top_p, self.top_k, self.repetition_penalty)
        return {
            "mode": self.mode,
            "max_tokens": self.max_tokens,
            "strict": self.strict,
            "sampling": sampling,
            "seed": self.seed,
            "max_pixels": settings.max_pixels,
        }


class LocateBody(Decoding):
    image: str | None = None  # data URL or base64 (or a file part in multipart)
    query: Text | list[Text] | None = None  # a list: separate questions, answered under "queries"
    categories: list[Text] | None = None  # several categories in ONE detect prompt
    task: Literal[TASKS] = "detect"
    tiles: Literal["auto"] | tuple[int, int] | None = None
    stream: bool = False


class GroundBody(Decoding):
    image: str
    instruction: Text = Field(min_length=1)
    max_tokens: int = Field(64, ge=1, le=65536)


class ChatBody(BaseModel):
    """The OpenAI fields we use; others an OpenAI client may send are ignored. `mode`, `task` (the text is
    then that task's query instead of the raw prompt), `top_k` and `repetition_penalty` ride in extra_body."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=65536)
    max_completion_tokens: int | None = Field(None, ge=1, le=65536)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    mode: Literal["slow", "fast", "hybrid"] = "hybrid"
    task: Literal[TASKS] | None = None


def validation_message(e: ValidationError | RequestValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())


async def json_body(request: HttpRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("invalid_json", f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InputError("invalid_json", "the body must be a JSON object")
    return body


async def form_body(request: HttpRequest) -> tuple[dict, bytes | None]:
    """Multipart fields as a dict (repeated `query`/`categories` fields become lists) and the image file."""
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


def parse(model: type[BaseModel], fields: dict) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise InputError("invalid_request", validation_message(e)) from None


# -- the app ----------------------------------------------------------------------------------------------


def create_app(load: Callable[[], LocateModel], settings: Settings | None = None) -> FastAPI:
    """The server app. `load` runs on the worker thread (the one that owns MLX) when the app starts."""
    settings = settings or Settings()
    worker = Worker(load, max_queue=settings.max_queue, max_rows=settings.max_rows)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        await anyio.to_thread.run_sync(worker.wait_ready)
        yield
        await anyio.to_thread.run_sync(worker.stop)

    app = FastAPI(title="mlx-locate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.settings = settings
    app.add_middleware(Guard, settings=settings)
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

    async def load_image_source(source: str | None, data: bytes | None = None):
        """A client's image (data URL, base64, upload or, when allowed, a URL) decoded off the event loop."""
        if data is None:
            if not source:
                raise InputError("invalid_request", "the request has no image")
            if is_remote(source) and settings.allow_remote_images:
                data = await fetch_remote(source, int(settings.max_body_mb * 1024 * 1024))
            else:
                data = image_bytes(source)
        return await anyio.to_thread.run_sync(open_image, data, settings.max_pixels)

    async def results_of(request: HttpRequest, job_requests: Sequence[Request]) -> list[Result]:
        """Run the requests as one job and wait for every result; a client that goes away cancels them."""
        async with open_job(worker, job_requests, settings) as job:
            collecting = asyncio.ensure_future(job.results())
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not collecting.done():
                    collecting.cancel()
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
        return {
            "status": "ok" if worker.ready else "loading",
            "model": settings.model_name,
            "pending": worker.pending,
            "max_queue": settings.max_queue,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "mlx-locate"}],
        }

    @app.post("/v1/locate")
    async def locate(request: HttpRequest):
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            fields, data = await form_body(request)
        else:
            fields, data = await json_body(request), None
        body: LocateBody = parse(LocateBody, fields)
        if body.categories is not None and (body.query is not None or body.task != "detect"):
            raise InputError("invalid_request", "categories make one detect prompt; do not combine with query/task")
        queries = body.query if isinstance(body.query, list) else [body.query]
        if body.categories is not None:
            queries = [categories_query(body.categories)]
        if not queries:
            raise InputError("invalid_request", "query is an empty list")
        image = await load_image_source(body.image, data)
        job_requests = build_requests(image, queries, body.task, tiles=body.tiles, **body.options(settings))
        request_id = f"loc-{secrets.token_hex(8)}"
        listed = queries if isinstance(body.query, list) else None

        def answer(results: list[Result]) -> dict:
            return locate_json(request_id, settings.model_name, body.task, body.mode, listed, results)

        if not body.stream:
            return answer(await results_of(request, job_requests))
        start = {
            "id": request_id,
            "model": settings.model_name,
            "task": body.task,
            "mode": body.mode,
            "image": {"width": image.width, "height": image.height},
            "queries": queries,
        }
        return await event_stream(worker, job_requests, settings, start, queries, answer)

    @app.post("/v1/ground")
    async def ground(request: HttpRequest):
        body: GroundBody = parse(GroundBody, await json_body(request))
        image = await load_image_source(body.image)
        options = body.options(settings)
        job_requests = [
            *build_requests(image, [body.instruction], "point", **options),
            *build_requests(image, [body.instruction], "gui", **options),
        ]
        point, region = await results_of(request, job_requests)
        return {"id": f"gnd-{secrets.token_hex(8)}", "model": settings.model_name, **ground_json(point, region)}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        body: ChatBody = parse(ChatBody, await json_body(request))
        text, source = chat_input(body.messages)
        image = await load_image_source(source)
        task, query = (body.task, text or None) if body.task is not None else ("raw", text)
        max_tokens = body.max_completion_tokens or body.max_tokens or 512
        decoding = Decoding(
            mode=body.mode,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed or 0,
        )
        job_requests = build_requests(image, [query], task, **decoding.options(settings))
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if not body.stream:
            (result,) = await results_of(request, job_requests)
            return chat_completion(completion_id, created, settings.model_name, result)
        usage = bool((body.stream_options or {}).get("include_usage"))
        return await chat_stream(worker, job_requests, settings, completion_id, created, usage)

    return app


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn on a background thread (tests, the load benchmark); yields its base URL once
    the model is loaded, and shuts it down on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# -- running jobs -----------------------------------------------------------------------------------------


@asynccontextmanager
async def open_job(worker: Worker, job_requests: Sequence[Request], settings: Settings) -> AsyncIterator[Job]:
    """A worker job whose queueing failures are HTTP errors (503 with Retry-After when the queue is full)."""
    job = Job(worker, job_requests, settings.timeout_s)
    await enter_job(job)
    try:
        yield job
    finally:
        await job.__aexit__(None, None, None)


async def enter_job(job: Job) -> None:
    try:
        await job.__aenter__()
    except QueueFull as e:
        raise ApiError(503, "queue_full", str(e), {"Retry-After": "1"}) from None
    except WorkerError as e:
        raise ApiError(503, "unavailable", str(e)) from None


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


async def start_stream(worker, job_requests, settings, frames, error) -> StreamingResponse:
    """Queue the job first (so a full queue is a real 503), then stream its frames. The background task
    cancels what is left even when the client leaves before the stream starts."""
    job = Job(worker, job_requests, settings.timeout_s)
    await enter_job(job)
    return StreamingResponse(
        streamed(job, frames, error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(job.__aexit__, None, None, None),
    )


async def event_stream(worker, job_requests, settings, start: dict, queries: list, answer) -> StreamingResponse:
    """`/v1/locate` with `stream`: events `start`, `object` (as each `</box>` is committed), `empty`, `done`
    (the same body as without `stream`) or `error`."""

    async def frames(job: Job) -> AsyncIterator[str]:
        yield sse("start", start)
        results: list[Result | None] = [None] * len(job.requests)
        async for i, event in job:
            where = {"query_index": i, "query": queries[i]}
            if event.kind is EventKind.OBJECT:
                yield sse("object", {**where, **event.object.to_dict()})
            elif event.kind is EventKind.EMPTY:
                yield sse("empty", {**where, "label": event.label})
            elif event.kind is EventKind.ERROR:
                yield sse("error", {**where, **error_body("invalid_request", str(event.error))})
                return
            else:
                results[i] = event.result
        yield sse("done", answer(results))

    return await start_stream(worker, job_requests, settings, frames, lambda c, m: sse("error", error_body(c, m)))


# -- OpenAI chat ------------------------------------------------------------------------------------------


def chat_input(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """The text and the one image of the last user message (content parts `text` and `image_url`)."""
    users = [m for m in messages if m.get("role") == "user"]
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


def chat_completion(completion_id: str, created: int, model: str, result: Result) -> dict:
    """An OpenAI `chat.completion`: the raw answer as content; the parsed answer (`objects`, `empty_labels`,
    `truncated`, `image`, `stats`) as extra top-level fields."""
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
                "message": {"role": "assistant", "content": result.text.removesuffix(ANSWER_END)},
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage_of(result),
        "image": {"width": width, "height": height},
        **{k: parsed[k] for k in ("objects", "empty_labels", "truncated", "stats")},
    }


async def chat_stream(worker, job_requests, settings, completion_id, created, include_usage) -> StreamingResponse:
    """`chat.completion.chunk`s: the role first, one chunk per committed box or point carrying it in an extra
    `objects` field (empty content), then the whole raw answer as content, the finish reason, `[DONE]`."""
    model = settings.model_name

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return f"data: {json.dumps({**body, 'choices': [choice], **extra})}\n\n"

    async def frames(job: Job) -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        async for _, event in job:
            if event.kind is EventKind.OBJECT:
                yield chunk({"content": ""}, objects=[event.object.to_dict()])
            elif event.kind is EventKind.ERROR:
                yield f"data: {json.dumps(error_body('invalid_request', str(event.error)))}\n\n"
                return
            elif event.kind is EventKind.DONE:
                result = event.result
                yield chunk({"content": result.text.removesuffix(ANSWER_END)})
                yield chunk({}, finish_reason(result), empty_labels=result.empty_labels)
                if include_usage:
                    body = {"id": completion_id, "object": "chat.completion.chunk", "created": created}
                    yield f"data: {json.dumps({**body, 'model': model, 'choices': [], 'usage': usage_of(result)})}\n\n"
        yield "data: [DONE]\n\n"

    def error(code: str, message: str) -> str:
        return f"data: {json.dumps(error_body(code, message))}\n\n"

    return await start_stream(worker, job_requests, settings, frames, error)
