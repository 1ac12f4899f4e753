"""The one thread that owns MLX: it loads the model, runs the engine loop and hands events back to asyncio.

MLX streams belong to the thread that made them, so the model is loaded *in* this thread (the caller passes a
function that loads it, never a loaded model) and every engine call happens here. Other threads only put
commands on a thread-safe queue; between engine steps the thread drains that queue (submit, cancel), steps
while anything is active and blocks on the queue when idle, as mlx-lm's server does with its generation thread.
Each event goes back to the submitter's asyncio loop through `loop.call_soon_threadsafe`.

What a request costs is its views x queries (`tiles.view_count`, from the image's size): `max_queue` bounds
the cost accepted and not finished, and a call costing more than `max_queue` is refused for good (`TooLarge`).
The requests of one call are one group of the engine's round-robin admission. Before it says ready, the worker
decodes a warm-up batch (every mode), so the step functions are compiled before the first client waits.

Only the standard library, mlx and mlx_locate are imported here: the benchmark drives this worker directly on
machines without FastAPI.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
from PIL import Image

from ..decide import Mode
from ..engine import EngineEvent, EventKind, Handle
from ..locate import LocateModel
from ..request import PreparedImage, Request, Result
from ..tiles import view_count

log = logging.getLogger("mlx_locate.server")


class QueueFull(RuntimeError):
    """More requests are waiting or decoding than `max_queue` allows; try again later."""


class TooLarge(ValueError):
    """A call that costs more than the server can ever hold (`max_queue`); it would never fit."""


class WorkerError(RuntimeError):
    """The worker could not finish a request (the model failed to load, it stopped, or a step raised)."""


class ModelError(WorkerError):
    """The model named cannot be loaded: a missing or bad folder, config, weights or adapter (the loader's
    `OSError` or `ValueError`). A user's error: told in one line, with no traceback logged."""


class ModelLimits(NamedTuple):
    """What the handlers need to know of the loaded model (plain numbers: no MLX outside the worker)."""

    vocab_size: int
    in_token_limit: int
    patch_size: int


WARMUP_IMAGE = (448, 336)  # the warm-up batch's blank image
WARMUP_TOKENS = 12
RATE_WINDOW_S = 10.0  # steps/s and tokens/s are measured over this window


@dataclass(eq=False)
class Ticket:
    """One engine request as the worker sees it. `deliver` runs on the worker thread."""

    request: Request
    deliver: Callable[[EngineEvent | WorkerError], None]
    cost: int = 1  # views x queries: its share of max_queue
    group: Hashable = None  # the client call it belongs to
    text: bool = False  # TEXT events wanted
    handle: Handle | None = None
    finished: bool = False  # done, failed or cancelled: its queue slot is free
    on_finish: Callable[[], None] | None = None  # called on the worker thread once it is finished


@dataclass
class WorkerStats:
    """Counters since start (read by /metrics from other threads: plain ints and floats)."""

    submitted: int = 0
    finished: int = 0
    failed: int = 0  # requests that ended with an error
    cancelled: int = 0
    failed_steps: int = 0  # steps that raised past the engine's isolation; the engine was then replaced
    steps: int = 0  # forward steps
    tokens: int = 0  # generated ids committed
    busy_s: float = 0.0  # time inside engine.step()
    active_rows: int = 0  # rows decoding after the last step
    waiting: int = 0  # requests the engine holds without a row
    warmup_s: float = 0.0
    recent: deque = field(default_factory=deque)  # (time, steps, tokens) of the last RATE_WINDOW_S

    def rates(self) -> tuple[float, float]:
        """(steps/s, tokens/s) over the last RATE_WINDOW_S."""
        now = time.monotonic()
        recent = [(t, s, n) for t, s, n in list(self.recent) if now - t <= RATE_WINDOW_S]
        if not recent:
            return 0.0, 0.0
        return sum(s for _, s, _ in recent) / RATE_WINDOW_S, sum(n for _, _, n in recent) / RATE_WINDOW_S


def image_size(image: object) -> tuple[int, int]:
    """The pixel size of a request's image (a path is opened for its header only)."""
    if isinstance(image, PreparedImage):
        return image.rgb.size
    if isinstance(image, Image.Image):
        return image.size
    with Image.open(Path(image)) as opened:
        return opened.size


_STOP = object()


class Worker:
    """Runs `load()` and then the engine on its own thread. `submit`, `cancel` and `stop` are thread-safe.

    `max_queue` bounds the cost of the requests accepted and not yet finished (waiting or decoding);
    `max_rows` is passed to `model.engine`; `fair=False` admits in first-come order (for comparison).
    """

    def __init__(
        self,
        load: Callable[[], LocateModel],
        *,
        max_queue: int = 128,
        max_rows: int | None = None,
        warmup: bool = True,
        fair: bool = True,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self.max_rows = max_rows
        self.warmup = warmup
        self.fair = fair  # False: one group for every call, first come first served (benchmarks compare)
        self.stats = WorkerStats()
        self.model: LocateModel | None = None
        self.limits: ModelLimits | None = None
        self.load_error: WorkerError | None = None
        self._load = load
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # accepted and not finished; changed under _lock
        self._stopped = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-locate-worker", daemon=True)

    # -- any thread ---------------------------------------------------------------------------------------

    def start(self) -> Worker:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; raises `ModelError` for a missing or bad model, `WorkerError` when
        loading failed otherwise."""
        if not self._ready.wait(timeout):
            raise WorkerError(f"the model did not load within {timeout} s")
        if self.load_error is not None:
            raise self.load_error.with_traceback(None)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.model is not None and not self._stopped

    @property
    def state(self) -> str:
        """ "loading" (the model, then the warm-up), "ok", "failed" (the model did not load) or "stopped"."""
        if self.load_error is not None:
            return "failed"
        if self._stopped:
            return "stopped"
        return "ok" if self.ready else "loading"

    @property
    def pending(self) -> int:
        """The cost (views x queries) of the requests accepted and not finished."""
        return self._pending

    def cost(self, request: Request) -> int:
        """A request's views (1, or its tiles and the whole image): its share of `max_queue`. `ValueError` for a
        bad tiling. Before the model is loaded, every request costs 1."""
        if self.limits is None or request.tiles is None:
            return 1
        return view_count(request, image_size(request.image), self.limits.in_token_limit, self.limits.patch_size)

    def submit(
        self,
        requests: Sequence[Request],
        deliver: Callable[[int, EngineEvent | WorkerError], None],
        *,
        group: Hashable = None,
        text: bool = False,
        on_finish: Callable[[], None] | None = None,
    ):
        """Queue `requests` together as one group (all or none); returns their tickets. `TooLarge` when their
        cost is over `max_queue` (it never fits), `QueueFull` when it does not fit now.

        `deliver(i, event)` is called on the worker thread for every event of `requests[i]`, and once with a
        `WorkerError` instead if the worker cannot finish it. `on_finish()` is called on the worker thread once
        every one of them is finished (done, failed or cancelled: the engine holds none of them any more)."""
        costs = [self.cost(r) for r in requests]
        total = sum(costs)
        if total > self.max_queue:
            views = f"{len(requests)} queries" if max(costs) == 1 else f"{len(requests)} queries of {max(costs)} views"
            raise TooLarge(
                f"the request costs {total} rows of work (views x queries: {views}); the server holds at most "
                f"{self.max_queue} (--max-queue), so it can never run here: send fewer queries or tiles"
            )
        with self._lock:
            if self._stopped:
                raise WorkerError("the server is shutting down")
            if self._pending + total > self.max_queue:
                raise QueueFull(
                    f"the queue holds {self._pending} of {self.max_queue} rows of work and this request needs "
                    f"{total}; retry shortly"
                )
            self._pending += total
        group = None if not self.fair else object() if group is None else group
        tickets = [
            Ticket(r, lambda event, i=i: deliver(i, event), cost, group, text)
            for i, (r, cost) in enumerate(zip(requests, costs, strict=True))
        ]
        if on_finish is not None:
            left = [len(tickets)]

            def finished() -> None:
                left[0] -= 1
                if left[0] == 0:
                    on_finish()

            for t in tickets:
                t.on_finish = finished
        for t in tickets:
            self._inbox.put(("submit", t))
        return tickets

    def cancel(self, tickets: Sequence[Ticket]) -> None:
        """Stop decoding these tickets and free their rows (a no-op for finished ones)."""
        for t in tickets:
            self._inbox.put(("cancel", t))

    def stop(self, timeout: float | None = 10.0) -> None:
        """Fail what is left with `WorkerError` and end the thread."""
        with self._lock:
            self._stopped = True
        self._inbox.put((_STOP, None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX wants a thread's arrays freed and its streams destroyed before the thread ends; left to
            # interpreter exit, the process may abort ("terminate called without an active exception").
            self.model = None
            gc.collect()
            mx.clear_streams()

    def _start(self):
        """Load the model (`ModelError` for a missing or bad one) and warm it up; its engine."""
        try:
            model = self._load()
        except (OSError, ValueError) as e:  # the loader's errors for what the user named
            raise ModelError(str(e)) from None
        engine = model.engine(self.max_rows)
        runtime = model.runtime
        if self.warmup:
            runtime.steps.compile_after = 0  # a server's steps are many: compiled in the warm-up, not eagerly run
            t0 = time.perf_counter()
            warm_up(engine)
            self.stats.warmup_s = time.perf_counter() - t0
            log.info("warm-up done in %.1f s (%d compilations)", self.stats.warmup_s, runtime.compilations)
        self.limits = ModelLimits(runtime.token_ids.vocab_size, runtime.in_token_limit, runtime.patch_size)
        self.model = model
        return engine

    def _serve(self) -> None:
        try:
            engine = self._start()
        except ModelError as e:  # the user's error, told by whoever waits (a new one: no frames of the loader kept)
            self.load_error = ModelError(str(e))
        except Exception as e:  # noqa: BLE001 - a bug: logged with its traceback, and reported to whoever waits
            log.exception("loading the model failed")
            self.load_error = WorkerError(f"the model failed to load: {type(e).__name__}: {e}")
        self._ready.set()
        if self.load_error is not None:
            self._drain_after_stop()
            return
        live: list[Ticket] = []
        while True:
            try:
                command = self._inbox.get(block=engine.idle)
            except queue.Empty:
                command = None
            while command is not None:
                kind, ticket = command
                if kind is _STOP:
                    self._fail(live, "the server is shutting down")
                    self._drain_after_stop()
                    return
                if kind == "submit":
                    on_event = self._on_event(ticket)
                    ticket.handle = engine.submit(ticket.request, on_event, group=ticket.group, text=ticket.text)
                    live.append(ticket)
                    self.stats.submitted += 1
                elif not ticket.finished and ticket.handle is not None:
                    engine.cancel(ticket.handle)
                    self.stats.cancelled += 1
                    self._finish(ticket)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            live = [t for t in live if not t.finished]
            if engine.idle:
                continue
            t0 = time.perf_counter()
            steps, tokens = engine.steps, engine.tokens
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001 - a bug in one step must not end the server
                # The engine fails a row that raises alone; past that its state is unknown: fail what it held.
                log.exception("an engine step raised; failing the %d requests it held", len(live))
                self.stats.failed_steps += 1
                self._fail(live, f"internal error while decoding: {type(e).__name__}: {e}")
                engine = self.model.engine(self.max_rows)
            self._count(engine.steps - steps, engine.tokens - tokens, engine)
            self.stats.busy_s += time.perf_counter() - t0

    def _count(self, steps: int, tokens: int, engine) -> None:
        s = self.stats
        s.steps += max(steps, 0)
        s.tokens += max(tokens, 0)
        s.active_rows, s.waiting = engine.active, engine.queued
        now = time.monotonic()
        s.recent.append((now, max(steps, 0), max(tokens, 0)))
        while s.recent and now - s.recent[0][0] > RATE_WINDOW_S:
            s.recent.popleft()

    def _on_event(self, ticket: Ticket) -> Callable[[EngineEvent], None]:
        def on_event(event: EngineEvent) -> None:
            if ticket.finished:
                return
            if event.kind in (EventKind.DONE, EventKind.ERROR):
                self.stats.failed += event.kind is EventKind.ERROR
                self._finish(ticket)
            ticket.deliver(event)

        return on_event

    def _finish(self, ticket: Ticket) -> None:
        ticket.finished = True
        self.stats.finished += 1
        with self._lock:
            self._pending -= ticket.cost
        if ticket.on_finish is not None:
            ticket.on_finish()

    def _fail(self, tickets: list[Ticket], message: str) -> None:
        for t in tickets:
            if not t.finished:
                self._finish(t)
                t.deliver(WorkerError(message))

    def _drain_after_stop(self) -> None:
        """Fail everything still queued (after a stop or a failed load), and anything submitted later."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                kind, ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._fail([ticket], "the server is shutting down" if self.model else "the model failed to load")


def warm_up(engine) -> None:
    """On a GPU, time a block step at each row count (`Runtime.measure_rows`: fewer rows can cost more); then
    decode a request in every mode on a blank image, alone and then together, so the step functions of a first
    request (and of a first batch) are compiled before the server says ready."""
    if mx.default_device() == mx.gpu:
        engine.model.measure_rows(engine.max_rows)
    image = Image.new("RGB", WARMUP_IMAGE, (128, 128, 128))
    requests = [Request(image, "object", mode=mode.value, max_tokens=WARMUP_TOKENS) for mode in Mode]
    for request in requests:
        engine.submit(request)
        engine.run()
    for request in requests:
        engine.submit(request)
    engine.run()


@dataclass(eq=False)
class Job:
    """The requests of one client call, seen from asyncio: `async for index, event in job` until each request
    is done or failed. Leaving `async with` early (a timeout, a disconnect, an error) cancels the rest. The
    requests are one group of the engine's fair admission; `text` asks for TEXT events; `on_finish` is
    `Worker.submit`'s."""

    worker: Worker
    requests: Sequence[Request]
    timeout_s: float | None = None
    text: bool = False
    on_finish: Callable[[], None] | None = None
    tickets: list[Ticket] = field(default_factory=list)
    first_object_at: float | None = None  # time.perf_counter() of the first OBJECT event
    _events: asyncio.Queue | None = None
    _open: int = 0
    _deadline: float | None = None

    @property
    def cost(self) -> int:
        return sum(t.cost for t in self.tickets)

    async def __aenter__(self) -> Job:
        loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        self._open = len(self.requests)
        self._deadline = None if self.timeout_s is None else loop.time() + self.timeout_s

        def deliver(i: int, event: EngineEvent | WorkerError) -> None:
            try:
                loop.call_soon_threadsafe(self._events.put_nowait, (i, event))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        self.tickets = self.worker.submit(self.requests, deliver, group=self, text=self.text, on_finish=self.on_finish)
        return self

    async def __aexit__(self, *exc) -> None:
        left = [t for t in self.tickets if not t.finished]
        if left:
            self.worker.cancel(left)

    def __aiter__(self) -> Job:
        return self

    async def __anext__(self) -> tuple[int, EngineEvent]:
        """The next event; raises `WorkerError` for a failed request and `TimeoutError` past the deadline."""
        if self._open == 0:
            raise StopAsyncIteration
        if self._deadline is None:
            i, event = await self._events.get()
        else:
            remaining = self._deadline - asyncio.get_running_loop().time()
            try:
                i, event = await asyncio.wait_for(self._events.get(), max(remaining, 0))
            except asyncio.TimeoutError:
                raise TimeoutError(f"the request took longer than {self.timeout_s:g} s") from None
        if isinstance(event, WorkerError):
            self._open = 0
            raise event
        if event.kind in (EventKind.DONE, EventKind.ERROR):
            self._open -= 1
        if event.kind is EventKind.OBJECT and self.first_object_at is None:
            self.first_object_at = time.perf_counter()
        return i, event

    async def results(self) -> list[Result]:
        """Every result, in request order; the first failed request raises its `RequestError`."""
        results: list[Result | None] = [None] * len(self.requests)
        async for i, event in self:
            if event.kind is EventKind.ERROR:
                raise event.error
            if event.kind is EventKind.DONE:
                results[i] = event.result
        return results
