"""The one thread that owns MLX: it loads the model, runs the engine loop and hands events back to asyncio.

MLX streams belong to the thread that made them, so the model is loaded *in* this thread (the caller passes a
function that loads it, never a loaded model) and every engine call happens here. Other threads only put
commands on a thread-safe queue; between engine steps the thread drains that queue (submit, cancel), steps
while anything is active and blocks on the queue when idle, as mlx-lm's server does with its generation thread.
Each event goes back to the submitter's asyncio loop through `loop.call_soon_threadsafe`.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..engine import EngineEvent, EventKind, Handle
from ..locate import LocateModel
from ..request import Request, Result

log = logging.getLogger("mlx_locate.server")


class QueueFull(RuntimeError):
    """More requests are waiting or decoding than `max_queue` allows; try again later."""


class WorkerError(RuntimeError):
    """The worker could not finish a request (the model failed to load, it stopped, or a step raised)."""


@dataclass(eq=False)
class Ticket:
    """One engine request as the worker sees it. `deliver` runs on the worker thread."""

    request: Request
    deliver: Callable[[EngineEvent | WorkerError], None]
    handle: Handle | None = None
    finished: bool = False  # done, failed or cancelled: its queue slot is free


@dataclass
class WorkerStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed_steps: int = 0  # steps that raised; every request then in the engine got a WorkerError
    steps: int = 0
    busy_s: float = 0.0  # time inside engine.step()


_STOP = object()


class Worker:
    """Runs `load()` and then the engine on its own thread. `submit`, `cancel` and `stop` are thread-safe.

    `max_queue` bounds the engine requests accepted and not yet finished (waiting or decoding); `max_rows` is
    passed to `model.engine`.
    """

    def __init__(self, load: Callable[[], LocateModel], *, max_queue: int = 128, max_rows: int | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self.max_rows = max_rows
        self.stats = WorkerStats()
        self.model: LocateModel | None = None
        self.load_error: BaseException | None = None
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
        """Block until the model is loaded; raises `WorkerError` when loading failed."""
        if not self._ready.wait(timeout):
            raise WorkerError(f"the model did not load within {timeout} s")
        if self.load_error is not None:
            raise WorkerError(f"the model failed to load: {self.load_error}") from self.load_error

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.model is not None and not self._stopped

    @property
    def pending(self) -> int:
        """Engine requests accepted and not finished."""
        return self._pending

    def submit(self, requests: Sequence[Request], deliver: Callable[[int, EngineEvent | WorkerError], None]):
        """Queue `requests` together (all or none: `QueueFull` when they do not fit); returns their tickets.

        `deliver(i, event)` is called on the worker thread for every event of `requests[i]`, and once with a
        `WorkerError` instead if the worker cannot finish it."""
        with self._lock:
            if self._stopped:
                raise WorkerError("the server is shutting down")
            if self._pending + len(requests) > self.max_queue:
                raise QueueFull(
                    f"{self._pending} requests are already waiting or decoding (limit {self.max_queue}); retry shortly"
                )
            self._pending += len(requests)
        tickets = [Ticket(r, lambda event, i=i: deliver(i, event)) for i, r in enumerate(requests)]
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

    def _serve(self) -> None:
        try:
            self.model = self._load()
            engine = self.model.engine(self.max_rows)
        except Exception as e:  # noqa: BLE001 - any load failure is reported to whoever waits
            self.load_error = e
            log.exception("loading the model failed")
            self._ready.set()
            self._drain_after_stop()
            return
        self._ready.set()
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
                    ticket.handle = engine.submit(ticket.request, on_event=self._on_event(ticket))
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
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001 - a bug in one step must not end the server
                # The engine's state is unknown after a raise: fail what it held and start a fresh one.
                log.exception("an engine step raised; failing the %d requests it held", len(live))
                self.stats.failed_steps += 1
                self._fail(live, f"internal error while decoding: {type(e).__name__}: {e}")
                engine = self.model.engine(self.max_rows)
            self.stats.steps += 1
            self.stats.busy_s += time.perf_counter() - t0

    def _on_event(self, ticket: Ticket) -> Callable[[EngineEvent], None]:
        def on_event(event: EngineEvent) -> None:
            if ticket.finished:
                return
            if event.kind in (EventKind.DONE, EventKind.ERROR):
                self._finish(ticket)
            ticket.deliver(event)

        return on_event

    def _finish(self, ticket: Ticket) -> None:
        ticket.finished = True
        self.stats.finished += 1
        with self._lock:
            self._pending -= 1

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


@dataclass(eq=False)
class Job:
    """The requests of one client call, seen from asyncio: `async for index, event in job` until each request
    is done or failed. Leaving `async with` early (a timeout, a disconnect, an error) cancels the rest."""

    worker: Worker
    requests: Sequence[Request]
    timeout_s: float | None = None
    tickets: list[Ticket] = field(default_factory=list)
    _events: asyncio.Queue | None = None
    _open: int = 0
    _deadline: float | None = None

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

        self.tickets = self.worker.submit(self.requests, deliver)
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
