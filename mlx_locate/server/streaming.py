"""A worker job over HTTP: queued (its refusals as HTTP errors), awaited while the client stays, or streamed as
server-sent events (`/v1/locate` with `stream`; the OpenAI chunks in `chat.py` ride the same `start_stream`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..engine import EventKind
from ..request import Request, Result
from .errors import ApiError, error_body
from .images import Holding
from .protocol import Settings, result_json
from .worker import Job, QueueFull, TooLarge, Worker, WorkerError


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
