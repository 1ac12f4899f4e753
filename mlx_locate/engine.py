"""The batched decoding engine: many requests (images x queries), each row in its own block/AR state.

Public surface (stable; the server, tiles, video, evaluation and the batch CLI build on it):

- `Request`: one image and one query or raw prompt, with its own decoding options.
- `Engine(model, max_rows)`: `submit(request, on_event)` returns a `Handle`; `step()` runs one forward step for
  every active row (admitting waiting requests first) and returns the `EngineEvent`s it produced; `run()` steps
  until nothing is left; `cancel(handle)` frees a row. One thread drives an engine (MLX streams belong to the
  thread that made them).
- Events: `OBJECT` (a box or point, as soon as its `</box>` is committed), `EMPTY` (a label answered None),
  `DONE` (the `Result`), `ERROR` (a `RequestError`; the other rows go on).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from .decide import Guards, Mode
from .parse import LocatedObject
from .preprocess import load_image
from .sampling import Sampling

if TYPE_CHECKING:
    from .locate import LocateModel, Result


class RequestError(ValueError):
    """A request that cannot run (unreadable image, prompt too long, bad option); other requests go on."""


@dataclass(frozen=True)
class Request:
    """One question about one image. `prompt` (raw user text) replaces `task` + `query`."""

    image: str | Path | Image.Image
    query: str | list[str] | None = None
    task: str = "detect"
    prompt: str | None = None
    mode: str | Mode = Mode.HYBRID
    max_tokens: int = 512
    sampling: Sampling = Sampling()
    strict: bool = False
    guards: Guards = Guards()
    redecode_labels: bool | None = None  # None: on for task "ocr"
    rendering: str = "A"
    seed: int = 0
    max_pixels: int | None = None  # None: preprocess.DEFAULT_MAX_PIXELS
    tiles: str | tuple[int, int] | None = None  # "auto" or (rows, cols): decode overlapping crops and merge
    tile_overlap: float = 0.2  # fraction of a tile shared with its neighbour
    tile_whole: bool = True  # with tiles, also decode the whole image and merge it in
    tag: Hashable | Any = None  # the caller's own (a path, a frame index); never read by the engine


class EventKind(Enum):
    OBJECT = "object"  # a box or point was committed
    EMPTY = "empty"  # a label was answered <box>None</box>
    DONE = "done"  # the request finished; `result` holds the Result
    ERROR = "error"  # the request failed; `error` holds the RequestError


@dataclass(frozen=True)
class EngineEvent:
    handle: Handle
    kind: EventKind
    object: LocatedObject | None = None  # OBJECT
    label: str | None = None  # EMPTY
    result: Result | None = None  # DONE
    error: RequestError | None = None  # ERROR


@dataclass(eq=False)
class Handle:
    """A submitted request; `result` or `error` is set once it is done."""

    id: int
    request: Request
    on_event: Callable[[EngineEvent], None] | None = None
    result: Result | None = None
    error: RequestError | None = None
    cancelled: bool = False
    events: list[EngineEvent] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


class Engine:
    """Decodes submitted requests, up to `max_rows` at a time. Not thread-safe: drive it from one thread."""

    def __init__(self, model: LocateModel, max_rows: int | None = None):
        self.model = model
        self.max_rows = max_rows or default_rows()
        self.waiting: deque[Handle] = deque()
        self._ids = itertools.count()

    def submit(self, request: Request, on_event: Callable[[EngineEvent], None] | None = None) -> Handle:
        handle = Handle(next(self._ids), request, on_event)
        self.waiting.append(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop decoding `handle` and free its row; it gets no further events."""
        handle.cancelled = True
        if handle in self.waiting:
            self.waiting.remove(handle)

    @property
    def idle(self) -> bool:
        return not self.waiting

    def step(self) -> list[EngineEvent]:
        """Advance every active request by one forward step; returns the events of this step."""
        if not self.waiting:
            return []
        handle = self.waiting.popleft()
        return self._run_one(handle)

    def run(self) -> None:
        while not self.idle:
            self.step()

    def _emit(self, handle: Handle, event: EngineEvent, out: list[EngineEvent]) -> None:
        handle.events.append(event)
        out.append(event)
        if handle.on_event is not None:
            handle.on_event(event)

    def _run_one(self, handle: Handle) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        r = handle.request
        try:
            image = load_image(r.image, r.max_pixels)
            if r.tiles is not None:
                from .tiles import merge_results, split_request

                children = split_request(r, image, self.model)
                result = merge_results(r, image, children, [self._locate(c, c.image) for c in children])
            else:
                result = self._locate(r, image)
        except (OSError, ValueError) as e:
            handle.error = e if isinstance(e, RequestError) else RequestError(str(e))
            self._emit(handle, EngineEvent(handle, EventKind.ERROR, error=handle.error), out)
            return out
        for obj in result.objects:
            self._emit(handle, EngineEvent(handle, EventKind.OBJECT, object=obj), out)
        for label in result.empty_labels:
            self._emit(handle, EngineEvent(handle, EventKind.EMPTY, label=label), out)
        handle.result = result
        self._emit(handle, EngineEvent(handle, EventKind.DONE, result=result), out)
        return out

    def _locate(self, r: Request, image: Image.Image) -> Result:
        return self.model.locate(
            image,
            r.query,
            rendering=r.rendering,
            task=r.task,
            mode=r.mode,
            max_tokens=r.max_tokens,
            sampling=r.sampling,
            strict=r.strict,
            guards=r.guards,
            redecode_labels=r.redecode_labels,
            prompt=r.prompt,
            seed=r.seed,
        )


def fit_max_tokens(prompt_len: int, max_tokens: int, limit: int) -> int:
    """`max_tokens` clipped so the prompt and its answer fit in `limit` positions; `RequestError` with both
    numbers when the prompt alone leaves no room."""
    if prompt_len >= limit:
        raise RequestError(
            f"the prompt has {prompt_len} tokens but the model holds at most {limit} (prompt plus answer); "
            "shorten the query or use a smaller image"
        )
    return min(max_tokens, limit - prompt_len)


def default_rows() -> int:
    """Rows per step when the caller does not say: 16 on a GPU (a step is bound by reading the weights),
    4 on a CPU (bound by arithmetic)."""
    import mlx.core as mx

    return 16 if mx.default_device() == mx.gpu else 4
