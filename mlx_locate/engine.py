"""The batched decoding engine: many requests (images x queries), each row in its own block/AR state.

Public surface (the server, tiles, video, evaluation and the batch CLI build on it):

- `Request`: one image and one query or raw prompt, with its own decoding options.
- `Engine(model, max_rows)`: `submit(request, on_event, group=...)` returns a `Handle`; `step()` admits waiting
  requests into free rows and runs one forward step for every active row, returning the `EngineEvent`s it
  produced; `run()` steps until nothing is left; `cancel(handle)` frees a row. One thread drives an engine (MLX
  streams belong to the thread that made them).
- Events: `OBJECT` (a box or point, as soon as its `</box>` is committed), `EMPTY` (a label answered None),
  `VIEW` (a tiled request's tile or whole image finished), `DONE` (the `Result`), `ERROR` (a `RequestError`; the
  other rows go on).

Fairness. Handles submitted with one `group` are one client's call (a list of queries, a tiled request's
views). Admission takes waiting requests round-robin across groups, so a one-box request waits for at most
one row per other group, however much work the others queued.

Isolation. A request is checked (`check_request`) before it joins a step. If an admission or a decoding step
still raises, the engine puts back what the step changed (the rows' decoder positions, the cache's K|V list,
`seen`) and runs the step again over halves of its rows, down to the row that raises: that row fails with a
`RequestError` naming the error, the others go on with the tokens they would have had alone.

How a step runs. Every sequence owns a row of the KV cache (`cache.SlotCache`) and a `row_decoder.RowDecoder`.
Joining requests are prepared on the host (image, patches, prompt ids), their vision runs batched per patch
grid, each new image's prompt prefix (everything up to `</img>`) is prefilled once and kept (`prefix store`),
copied into the rows that ask about that image, and the rows' own words are prefilled together. Then each step
feeds every row that needs a forward: block rows (tail + anchor + 5 masks, 12 rows) and AR rows (their tail)
share one block-shaped forward or go in two, as `Schedule` says; one compiled summary per forward packs what
each row's decision needs, and all of them come back in one host read. The rules of docs/model.md §10.4-§10.7 then
run per row (`RowDecoder`), unchanged. When every row is in AR state, the next AR forward is queued on the
device's picks before the read, as in slow mode alone; rows that do not continue drop it. While rows decode,
the vision of the next staged images runs in pieces queued behind each step's forward (behind the forward queued
ahead, in an all-AR step), sized by the host's time per step and by how long the reads wait (`runtime.TowerJob`).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .cache import SlotCache, rows_bucket
from .categories import category_pieces, is_multi, merge_categories, split_categories
from .compiled import BLOCK_ROWS, Phase, head_rows, padded_rows
from .decide import Mode, Next
from .label_trie import LabelTrie
from .parse import LocatedObject, parse_tokens
from .prompts import UserText, user_text
from .request import PreparedImage, Request, RequestError, Result, parse_mode
from .row_decoder import DecodeOptions, RowDecoder, ar_pick, summary_functions
from .runtime import Runtime, TowerJob
from .sampling import Features, RowSampling, Sampling, label_mask, real_number
from .tiles import Tile, check_tiling, merge_results, split_request, to_image

# Engine.seconds: waiting for host preparation (image load, resize, prompt ids: done ahead in threads), the
# vision tower, prefix prefills, the rows' own prefill, decoding steps; and `host`, the device's waits for the
# host (the time between one wait for the device and the next)
PHASE_TIMES = ("prepare", "vision", "prefix", "prefill", "decode", "host")
PREFETCH = 2  # host work runs ahead for this many times max_rows waiting requests


class EventKind(Enum):
    OBJECT = "object"  # a box or point was committed
    EMPTY = "empty"  # a label was answered <box>None</box>
    VIEW = "view"  # a view of a tiled request finished; `result` holds it in the whole image's pixels
    TEXT = "text"  # more of the answer's text is final (only for handles submitted with `text=True`)
    DONE = "done"  # the request finished; `result` holds the Result
    ERROR = "error"  # the request failed; `error` holds the RequestError


@dataclass(frozen=True)
class EngineEvent:
    handle: Handle
    kind: EventKind
    object: LocatedObject | None = None  # OBJECT
    label: str | None = None  # EMPTY
    result: Result | None = None  # DONE, VIEW
    error: RequestError | None = None  # ERROR
    view: int | None = None  # VIEW: the view's index among the tiled request's views
    tile: Tile | None = None  # VIEW: the view's crop of the image
    text: str | None = None  # TEXT: the answer's next piece, up to its last finished item


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
    submitted: float = field(default_factory=time.perf_counter)
    parent: Handle | None = field(default=None, repr=False)  # the tiled request a tile belongs to
    group: Hashable = field(default=None, repr=False)  # the client call it belongs to (fair admission)
    text: bool = False  # send TEXT events

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


@dataclass(frozen=True)
class Schedule:
    """How a step's rows share forwards (decided by measurement: benchmarks/README.md)."""

    mixed: bool  # block and AR rows share one block-shaped forward; else two forwards
    dense: bool  # a forward covers every slot when only free slots would be left out; else only its rows
    queue_ahead: bool = True  # an all-AR step queues the next AR forward on the device's picks
    # Tower blocks of the next staged images queued behind each decode step (run while the host prepares the next
    # one): None = sized by the host's time per step at the tower's measured cost and by the reads' waits, 0 = none
    tower_ahead: int | None = None

    @classmethod
    def for_device(cls) -> Schedule:
        """GPU: a forward costs its weight reads, so rows ride along; CPU: rows cost arithmetic."""
        gpu = mx.default_device() == mx.gpu
        return cls(mixed=gpu, dense=gpu)


@lru_cache(maxsize=256)
def row_sampling(settings: tuple[Sampling, ...]) -> RowSampling:
    """The per-row sampling arrays of a batch, made once per mix of settings."""
    return RowSampling.of(settings)


def fit_max_tokens(prompt_len: int, max_tokens: int, limit: int) -> int:
    """`max_tokens` clipped so the prompt and its answer fit in `limit` positions; `RequestError` with both
    numbers when the prompt alone leaves no room."""
    if prompt_len >= limit:
        raise RequestError(
            f"the prompt has {prompt_len} tokens but the model holds at most {limit} (prompt plus answer); "
            "shorten the query or use a smaller image"
        )
    return min(max_tokens, limit - prompt_len)


MAX_SEED = 2**64 - 1


def whole_number(name: str, value: object, low: int, high: int | None = None) -> None:
    """`RequestError` unless `value` is an int (not a bool) in low..high."""
    if not (real_number(value) and isinstance(value, int)) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name} must be a whole number {span}, got {value!r}")


def check_request(request: Request, vocab_size: int) -> None:
    """The checks of a request's numbers and options that every entry point shares, made before it joins a
    step: `RequestError` naming the field. (`Sampling` checks its own ranges when made; the vocabulary bound of
    `top_k` needs the model.)"""
    parse_mode(request.mode)
    whole_number("max_tokens", request.max_tokens, 1)
    whole_number("seed", request.seed, 0, MAX_SEED)
    if request.max_pixels is not None:
        whole_number("max_pixels", request.max_pixels, 1)
    if not isinstance(request.sampling, Sampling):
        raise RequestError(f"sampling must be a Sampling, got {type(request.sampling).__name__}")
    if request.sampling.top_k > vocab_size:
        raise RequestError(
            f"top_k {request.sampling.top_k} is over the model's vocabulary of {vocab_size} tokens; "
            f"use 0 (off) or at most {vocab_size}"
        )
    if request.tiles is not None:
        try:
            check_tiling(request.tiles, request.tile_overlap)
        except ValueError as e:
            raise RequestError(str(e)) from None


@dataclass(eq=False)
class _Row:
    """An admitted request: its slot, its decoder, and what its result and events need."""

    handle: Handle
    image: PreparedImage
    prompt: list[int]
    prefix_len: int
    options: DecodeOptions
    budget: int
    timings: dict
    slot: int = -1
    decoder: RowDecoder | None = None
    pending: mx.array | None = None  # (1, V) logits whose AR decision is due (slow mode's prefill, a queued step)
    emitted: int = 0  # objects sent as events
    emitted_empty: int = 0
    text_sent: int = 0  # generated ids already sent in TEXT events
    prefix: list[mx.array] | None = None  # its image's prompt prefix K|V, once staged

    @property
    def longest(self) -> int:
        """The most cache slots this row can use: its prompt, its token budget and a block's overshoot."""
        return len(self.prompt) + self.budget + BLOCK_ROWS


class _Tiled(NamedTuple):
    """A tiled or split request's host work: its image and its views' requests (a split request's: one per
    category, whose names are `categories`)."""

    image: PreparedImage
    requests: list[Request]
    categories: list[str] | None = None


class _Saved(NamedTuple):
    """What a step may change before it can no longer fail, to put back when it raises."""

    cache: SlotCache | None
    slots: int
    kv: list[mx.array]
    rows: list[_Row | None]
    seen: mx.array | None
    decoders: list[tuple[_Row, int, mx.array | None]]  # (row, decoder.cached, pending)


class Engine:
    """Decodes submitted requests, up to `max_rows` at a time. Not thread-safe: drive it from one thread."""

    def __init__(self, model: Runtime, max_rows: int | None = None, schedule: Schedule | None = None):
        self.model = model
        self.max_rows = max_rows or model.default_rows
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {self.max_rows}")
        self.schedule = schedule or Schedule.for_device()
        # Waiting handles by group, the group to serve next first; a served group moves to the end.
        self.waiting: OrderedDict[Hashable, deque[Handle]] = OrderedDict()
        self.cache: SlotCache | None = None
        self.rows: list[_Row | None] = []  # by slot
        self.seen: mx.array | None = None  # (cache rows, V) bool: ids already in each sequence (repetition penalty)
        self.tiles: dict[Handle, tuple[PreparedImage, list[Request], list[Handle]]] = {}  # tiled and split requests
        self.categories: dict[Handle, list[str]] = {}  # a split request's categories
        self.prefetch: dict[Handle, Future] = {}  # host work started ahead, by handle
        self.staged: deque[_Row] = deque()  # taken from `waiting` in turn, host work done, waiting for a row
        self.vision_ahead: TowerJob | None = None  # vision of staged rows, in pieces behind decode steps
        self.vision_ahead_blocks = 0  # image-blocks of the tower run that way
        self._piece_blocks = 1  # blocks per piece, as the reads' waits show the device takes them
        self._wait_floor: dict[tuple[int, bool], float] = {}  # the shortest read wait seen, by cache rows and kind
        self._unread = 0.0  # expected seconds of the pieces queued since the last read (the next read waits on them)
        self.steps = 0  # forward steps (each with one host read)
        self.host_reads = 0
        self.tokens = 0  # generated ids committed
        self.seconds = dict.fromkeys(PHASE_TIMES, 0.0)  # where the engine's time went, summed over its steps
        self._ids = itertools.count()

    # --- the caller's side ---

    def submit(
        self,
        request: Request,
        on_event: Callable[[EngineEvent], None] | None = None,
        *,
        group: Hashable = None,
        text: bool = False,
    ) -> Handle:
        """Queue `request`. Handles of one `group` (any hashable; default: the handle alone) are one client's
        call: admission takes turns between groups. `text`: also send the answer's text as it becomes final
        (TEXT events; their concatenation is a prefix of `Result.text`)."""
        handle = Handle(next(self._ids), request, on_event, text=text)
        handle.group = handle if group is None else group
        self.waiting.setdefault(handle.group, deque()).append(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop decoding `handle` and free its row; it gets no further events."""
        handle.cancelled = True
        queue = self.waiting.get(handle.group)
        if queue is not None and handle in queue:
            queue.remove(handle)
            if not queue:
                del self.waiting[handle.group]
        self.prefetch.pop(handle, None)
        for row in [r for r in self.staged if r.handle is handle]:
            self.staged.remove(row)
        self.categories.pop(handle, None)
        for child in self.tiles.pop(handle, (None, [], []))[2]:
            self.cancel(child)

    @property
    def queued(self) -> int:
        """Handles waiting for a row (a tiled request counts once until its views are made)."""
        return sum(len(queue) for queue in self.waiting.values())

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.staged and not self.active

    def step(self) -> list[EngineEvent]:
        """Admit waiting requests into free rows, then advance every active row by one forward step."""
        events: list[EngineEvent] = []
        for slot, row in enumerate(self.rows):
            if row is not None and row.handle.cancelled:
                self.rows[slot] = None
        idle_before = self.model.device_idle_s
        self._admit(events)
        live = [r for r in self.rows if r is not None]
        if live and self.vision_ahead is None and self.schedule.tower_ahead != 0:
            self._start_vision_ahead(events)
        if live:
            t0 = time.perf_counter()
            self._isolated(live, self._decode, events)
            self.seconds["decode"] += time.perf_counter() - t0
        self.seconds["host"] += self.model.device_idle_s - idle_before
        if self.idle:
            self.cache, self.rows, self.seen = None, [], None  # memory goes back when there is no work
            self.vision_ahead = None
            self.model.idle()
        return events

    def run(self) -> None:
        while not self.idle:
            self.step()

    # --- events ---

    def _emit(self, handle: Handle, event: EngineEvent, out: list[EngineEvent]) -> None:
        if handle.parent is not None:
            self._tile_done(handle, out)
            return
        handle.events.append(event)
        out.append(event)
        if handle.on_event is not None:
            handle.on_event(event)

    def _fail(self, handle: Handle, error: Exception, out: list[EngineEvent]) -> None:
        if not isinstance(error, RequestError):
            message = str(error) if isinstance(error, OSError | ValueError) else f"{type(error).__name__}: {error}"
            error = RequestError(message)
        handle.error = error
        self._emit(handle, EngineEvent(handle, EventKind.ERROR, error=handle.error), out)

    def _succeed(self, handle: Handle, result: Result, out: list[EngineEvent]) -> None:
        handle.result = result
        self._emit(handle, EngineEvent(handle, EventKind.DONE, result=result), out)

    def _tile_done(self, child: Handle, out: list[EngineEvent]) -> None:
        """A view finished: the parent gets it (in the whole image's pixels) as a VIEW event; when every view
        has, the merged result."""
        if child.result is None and child.error is None:
            return  # a streamed object of a view: the parent gets the view's objects when it finishes
        parent = child.parent
        if parent not in self.tiles or parent.cancelled:
            return
        image, requests, children = self.tiles[parent]
        if child.error is not None:
            self.tiles.pop(parent)
            self.categories.pop(parent, None)
            for other in children:
                self.cancel(other)
            self._fail(parent, child.error, out)
            return
        if parent in self.categories:
            self._categories_done(parent, child, self.categories[parent], children, out)
            return
        view, tile, size = children.index(child), child.request.tag, image.rgb.size
        objects = [to_image(o, tile, size) for o in child.result.objects]
        seen = replace(child.result, objects=objects, image_size=size)
        self._emit(parent, EngineEvent(parent, EventKind.VIEW, result=seen, view=view, tile=tile), out)
        if all(c.result is not None for c in children):
            self.tiles.pop(parent)
            try:
                result = merge_results(parent.request, image.rgb, requests, [c.result for c in children])
                result = replace(result, orientation=image.notes.orientation, warnings=list(image.notes.warnings))
            except (OSError, ValueError) as e:
                self._fail(parent, e, out)
                return
            for obj in result.objects:
                self._emit(parent, EngineEvent(parent, EventKind.OBJECT, object=obj), out)
            for label in result.empty_labels:
                self._emit(parent, EngineEvent(parent, EventKind.EMPTY, label=label), out)
            self._succeed(parent, result, out)

    def _categories_done(self, parent: Handle, child: Handle, names: list[str], children: list[Handle], out) -> None:
        """A category's row finished: its text (with `text`) once the categories before it have finished, in
        category order; when every row has, the parent's objects and its merged result."""
        done = [c.result is not None for c in children]
        at = children.index(child)
        if parent.text and all(done[:at]):
            for k in range(at, done.index(False) if False in done else len(done)):
                for piece in category_pieces(names[k], children[k].result):
                    self._emit(parent, EngineEvent(parent, EventKind.TEXT, text=piece), out)
        if not all(done):
            return
        self.tiles.pop(parent)
        self.categories.pop(parent)
        result = merge_categories(names, [c.result for c in children])
        for obj in result.objects:
            self._emit(parent, EngineEvent(parent, EventKind.OBJECT, object=obj), out)
        for label in result.empty_labels:
            self._emit(parent, EngineEvent(parent, EventKind.EMPTY, label=label), out)
        self._succeed(parent, result, out)

    # --- isolation: a step that raises is retried over halves of its rows ---

    def _save(self, rows: list[_Row]) -> _Saved:
        cache = self.cache
        # `seen` is updated in place (`seen[i] = ...` rewrites the array object), so the saved one is a copy.
        seen = None if self.seen is None else mx.array(self.seen)
        decoders = [(row, row.decoder.cached, row.pending) for row in rows if row.decoder is not None]
        return _Saved(
            cache,
            0 if cache is None else cache.slots,
            [] if cache is None else list(cache.kv),
            list(self.rows),
            seen,
            decoders,
        )

    def _restore(self, saved: _Saved) -> None:
        self.cache, self.rows, self.seen = saved.cache, saved.rows, saved.seen
        if saved.cache is not None:
            saved.cache.slots, saved.cache.kv = saved.slots, saved.kv
        for row, cached, pending in saved.decoders:
            row.decoder.cached, row.pending = cached, pending

    def _isolated(self, rows: list[_Row], run: Callable, out: list[EngineEvent]) -> None:
        """`run(rows, out)`; when it raises, the engine is put back as it was and `run` goes again over each
        half of `rows`, down to the single row that raises, which fails alone."""
        saved = self._save(rows)
        try:
            run(rows, out)
        except Exception as e:  # noqa: BLE001 - whatever one row causes, only that row fails
            self._restore(saved)
            if len(rows) == 1:
                self._fail_row(rows[0], e, out)
                return
            half = len(rows) // 2
            for part in (rows[:half], rows[half:]):
                self._isolated(part, run, out)

    def _fail_row(self, row: _Row, error: Exception, out: list[EngineEvent]) -> None:
        if 0 <= row.slot < len(self.rows) and self.rows[row.slot] is row:
            self.rows[row.slot] = None
        if row in self.staged:
            self.staged.remove(row)
        if not row.handle.done:
            message = f"decoding failed for this request: {type(error).__name__}: {error}"
            self._fail(row.handle, RequestError(message), out)

    # --- admission: host work ahead in threads, vision and prefixes in batches, rows joining together ---

    def _prepare(self, handle: Handle) -> _Row | _Tiled:
        """A request's host work (runs on the model's host threads): checks, image, patches, prompt ids; for a
        tiled request, its views (an image that needs no tiles is decoded as it is)."""
        r, model = handle.request, self.model
        t0 = time.perf_counter()
        check_request(r, model.token_ids.vocab_size)
        names, views = split_categories(r) if is_multi(r) else (None, [])
        if names is not None:
            r = replace(r, query=names)  # checked, repeats merged
        image = model.prepare(r.image, r.max_pixels, r.orientation, r.max_image_tokens)
        if views:  # one row per category, each on the image prepared once
            return _Tiled(image, [replace(v, image=image) for v in views], names)
        limit = r.max_image_tokens or model.in_token_limit
        if r.tiles is not None and (views := split_request(r, image.rgb, limit, model.patch_size)):
            return _Tiled(image, views)
        mode = parse_mode(r.mode)
        text = UserText(r.prompt) if r.prompt is not None else user_text(r.task, r.query)
        ids = model.prompt(text, image.pre.grid, r.rendering)
        budget = fit_max_tokens(len(ids), r.max_tokens, model.max_length)
        redecode = r.redecode_labels if r.redecode_labels is not None else r.task == "ocr" and mode is Mode.HYBRID
        labels = None if names is None else LabelTrie.of(names, model.tokenizer, model.token_ids)  # a joint list
        options = DecodeOptions(
            mode, budget, r.sampling, r.strict, r.guards, redecode_labels=redecode, seed=r.seed, labels=labels
        )
        timings = {"queue_s": t0 - handle.submitted, "preprocess_s": time.perf_counter() - t0}
        timings["compile_s"] = model.compile_s  # at the start: the result counts what was compiled since
        return _Row(handle, image, ids, ids.index(model.token_ids.img_end) + 1, options, budget, timings)

    def _in_turn(self) -> Iterator[Handle]:
        """Waiting handles in the order admission takes them (round-robin across groups)."""
        queues = list(self.waiting.values())
        for depth in range(max((len(q) for q in queues), default=0)):
            for queue in queues:
                if depth < len(queue):
                    yield queue[depth]

    def _prefetch(self) -> None:
        """Start the host work of the next waiting handles, PREFETCH times max_rows of them at most."""
        ahead = PREFETCH * self.max_rows
        for handle in itertools.islice(self._in_turn(), ahead):
            if handle not in self.prefetch and not handle.cancelled:
                self.prefetch[handle] = self.model.host_pool.submit(self._prepare, handle)

    def _next_waiting(self) -> Handle:
        """The first handle of the group whose turn it is; that group goes to the end of the line."""
        group, queue = next(iter(self.waiting.items()))
        handle = queue.popleft()
        if queue:
            self.waiting.move_to_end(group)
        else:
            del self.waiting[group]
        return handle

    def _take(self, out: list[EngineEvent], upto: int) -> None:
        """Waiting handles into `staged`, in turn, until it holds `upto` rows, once their host work is done (it
        started ahead, `_prefetch`; the engine waits for what is not done yet). Which rows stage and join when
        depends on the requests alone, never on the threads' timing, so the compiled shapes do too."""
        while self.waiting and len(self.staged) < upto:
            handle = self._next_waiting()
            future = self.prefetch.pop(handle, None) or self.model.host_pool.submit(self._prepare, handle)
            if handle.cancelled:
                continue
            t0 = time.perf_counter()
            try:
                work = future.result()
            except Exception as e:  # noqa: BLE001 - a request that cannot be prepared fails alone
                self._fail(handle, e, out)
                continue
            finally:
                self.seconds["prepare"] += time.perf_counter() - t0
            if isinstance(work, _Tiled):
                # The views take the tiled request's place: its group keeps its turn.
                children = [Handle(next(self._ids), c, parent=handle, group=handle.group) for c in work.requests]
                self.tiles[handle] = (work.image, work.requests, children)
                if work.categories is not None:
                    self.categories[handle] = work.categories
                views = self.waiting.pop(handle.group, deque())
                views.extendleft(reversed(children))
                self.waiting[handle.group] = views
                self.waiting.move_to_end(handle.group, last=False)
                self._prefetch()
                continue
            self.staged.append(work)

    def _admit(self, out: list[EngineEvent]) -> None:
        """Stage as many waiting requests as rows are free (their host work is done ahead); when the staged
        rows holding their prefix would not fill the free rows, run vision and the prompt prefixes in one batch
        for every staged row without one and for the next waiting requests, up to max_rows rows (ahead of need:
        a later request waits behind at most one such batch); then join as many staged rows as the free rows
        and the KV budget take."""
        self._prefetch()
        free = self.max_rows - self.active
        if free < 1:
            return
        self._take(out, free)
        if sum(row.prefix is not None for row in self.staged) < free:
            self._take(out, self.max_rows)
            unstaged = [row for row in self.staged if row.prefix is None]
            if unstaged:
                self._isolated(unstaged, self._stage, out)
        joining = []
        for row in list(self.staged):
            if len(joining) == free or row.prefix is None or not self._fits(joining + [row]):
                break
            joining.append(row)
            self.staged.remove(row)
        if joining:
            self._isolated(joining, self._join, out)

    def _start_vision_ahead(self, out: list[EngineEvent]) -> None:
        """While rows decode: stage waiting requests up to max_rows rows, and start the vision of the staged
        images that need it, to run in pieces behind the decode steps (`_queue_vision`)."""
        self._take(out, self.max_rows)
        model, images = self.model, {}
        for row in self.staged:
            key = (row.image.key, tuple(row.prompt[: row.prefix_len]))
            if row.prefix is None and key not in model.prefixes and row.image.key not in model.features:
                images.setdefault(row.image.key, row.image)
        if images:
            self.vision_ahead = TowerJob(model, list(images.values()))

    def _queue_vision(self, spare: float | None) -> float:
        """Queue the next piece of the ahead vision behind the forward just queued, for the device to run while the
        host prepares the next step: `Schedule.tower_ahead` blocks, else `_piece_blocks`, at most what the device
        runs in `spare` (the host's time this step) at the tower's measured cost. Returns the piece's expected
        seconds."""
        job = self.vision_ahead
        cost = None if job.done or spare is None else self.model.tower_block_s_of(job)
        if cost is None:
            return 0.0
        blocks = self.schedule.tower_ahead
        if blocks is None:
            blocks = min(self._piece_blocks, int(spare / cost))
        if blocks <= 0:
            return 0.0
        _, images, blocks = job.next_piece(blocks)
        try:
            mx.async_eval(job.advance(blocks))
        except Exception:  # noqa: BLE001 - not the decoding rows' failure: admission redoes it, row by row
            self.vision_ahead = None
            return 0.0
        self.vision_ahead_blocks += images * blocks
        return blocks * cost

    def _tune_pieces(self, wait: float, queued: float, kind: tuple[int, bool]) -> None:
        """After a step's read: one block more per piece while the read waited less than half the pieces' time
        longer than the shortest wait seen for reads of this `kind` (cache rows, whether of a forward queued a step
        ahead), one fewer (at least one) when it waited more."""
        floor = self._wait_floor[kind] = min(wait, self._wait_floor.get(kind, wait))
        if queued > 0:
            longer = wait - floor > queued / 2
            self._piece_blocks = max(1, self._piece_blocks - 1) if longer else self._piece_blocks + 1

    def _fits(self, joining: list[_Row]) -> bool:
        """Whether the cache of the live rows and `joining`, each at its longest, fits the KV budget (the first
        row always joins, so a lone request runs whatever its size)."""
        rows = [r for r in self.rows if r is not None] + joining
        if len(rows) == 1:
            return True
        slots = self.model.rows_for(len(rows), self.max_rows)
        return self.model.budget.kv_fits(slots + 1, max(r.longest for r in rows))

    def _stage(self, rows: list[_Row], out: list[EngineEvent]) -> None:
        """Vision (images of one grid batched) and the prompt prefix of each new image (prefilled together,
        kept in the model's prefix store) for `rows`; each row then holds its image's prefix."""
        model = self.model
        keys = [(row.image.key, tuple(row.prompt[: row.prefix_len])) for row in rows]
        have = {key: model.prefix(key) for key in keys if key in model.prefixes}  # held: storing may evict
        new: dict[tuple, _Row] = {}
        for row, key in zip(rows, keys, strict=True):
            row.timings.update(vision_cached=True, vision_s=0.0, prefix_prefill_s=0.0)
            if key not in have:
                new.setdefault(key, row)
        if new:
            t0 = time.perf_counter()
            ready = None
            if self.vision_ahead is not None:  # what was queued ahead, finished now
                while not self.vision_ahead.done:
                    model.run_piece(self.vision_ahead)
                ready, self.vision_ahead, self._unread = self.vision_ahead.features, None, 0.0
            features = model.features_for([row.image for row in new.values()], ready)
            t1 = time.perf_counter()
            items = [(row.prompt[: row.prefix_len], f) for row, (_, f) in zip(new.values(), features, strict=True)]
            prefixes = model.compute_prefixes(items)
            t2 = time.perf_counter()
            self.seconds["vision"] += t1 - t0
            self.seconds["prefix"] += t2 - t1
            for (key, row), (cached, _), prefix in zip(new.items(), features, prefixes, strict=True):
                have[key] = prefix
                model.store_prefix(key, prefix)
                row.timings.update(vision_cached=cached, vision_s=t1 - t0, prefix_prefill_s=t2 - t1)
        for row, key in zip(rows, keys, strict=True):
            row.prefix = have[key]

    def _join(self, joining: list[_Row], out: list[EngineEvent]) -> None:
        """Staged rows into slots, their prefixes into their cache rows, their own words prefilled together."""
        self._place(joining)
        for row in joining:
            self.cache.copy_in(row.slot, row.prefix)
        t0 = time.perf_counter()
        items = [(row.slot, self.model.embed_ids(row.prompt[row.prefix_len :]), row.prefix_len) for row in joining]
        last = self.model.prefill(self.cache, items)
        self.model.sync(list(last.values()))
        prefill_s = time.perf_counter() - t0
        self.seconds["prefill"] += prefill_s
        for row in joining:
            row.prefix = None  # in the cache now
            row.timings["prefill_s"] = prefill_s
            row.decoder = RowDecoder(row.prompt, self.model.token_ids, row.options, self.model.max_length)
            if row.options.mode is Mode.SLOW:
                row.pending = last[row.slot]
            row.decoder.begin()

    def _place(self, joining: list[_Row]) -> None:
        """Give each joining row a free slot, growing the cache to the cheapest row count that holds them."""
        if self.cache is None:
            self.cache = self.model.new_cache(slots=0)
        need = self.active + len(joining)
        if need > self.cache.slots:
            old = self.cache.slots
            self.cache.grow(self.model.rows_for(need, self.max_rows))
            self.rows += [None] * (self.cache.slots - old)
            if self.seen is not None:
                self.seen = mx.concatenate([self.seen[:old], self._no_seen(self.cache.buffer_rows - old)])
        free = (s for s, r in enumerate(self.rows) if r is None)
        for row in joining:
            row.slot = next(free)
            self.rows[row.slot] = row
            if row.options.sampling.repetition_penalty != 1.0:
                if self.seen is None:
                    self.seen = self._no_seen(self.cache.buffer_rows)
                marks = mx.zeros((self.model.token_ids.vocab_size,), dtype=mx.bool_)
                marks[mx.array(row.prompt)] = True
                self.seen[row.slot] = marks

    def _no_seen(self, rows: int) -> mx.array:
        return mx.zeros((rows, self.model.token_ids.vocab_size), dtype=mx.bool_)

    def _entries(self, rows: list[_Row]) -> tuple[list[int], list[int], bool]:
        """A forward's entries: the index of each row's entry, the cache row of every entry and whether the
        forward is dense (every slot, free ones as padding) or gathered (its rows, padded to a power of two
        with scratch-row entries)."""
        slots = [row.slot for row in rows]
        if len(rows) == self.cache.slots or (self.schedule.dense and len(rows) == self.active):
            return slots, list(range(self.cache.slots)), True
        R = self.model.rows_for(len(rows), self.cache.slots)
        return list(range(len(rows))), slots + [self.cache.scratch] * (R - len(rows)), False

    def _forward(self, phase: Phase, rows: list[_Row]) -> mx.array:
        """One forward of `rows` (each feeding `decoder.feed()`); returns logits (R, H, V) by entry."""
        index, entries, dense = self._entries(rows)
        R = len(entries)
        feeds = [row.decoder.feed() for row in rows]
        Q = max(padded_rows(phase, len(f)) for f in feeds)
        inputs = np.zeros((R, Q), dtype=np.int32)
        c, q, block = [0] * R, [0] * R, [False] * R
        for i, row, f in zip(index, rows, feeds, strict=True):
            inputs[i, : len(f)] = f
            c[i], q[i], block[i] = row.decoder.cached, len(f), row.decoder.next is Next.BLOCK
            row.decoder.fed()
        return self.model.run(phase, self.cache, mx.array(inputs), entries, c, q, block, dense)

    def _summary(self, phase: Phase, rows: list[_Row], index: list[int], logits: mx.array) -> mx.array:
        """The compiled summary of one forward's logits, taken at `rows`' entries: (len(rows), width)."""
        R = rows_bucket(len(rows))
        pad = R - len(rows)
        used = set(index)
        take = index + [i for i in range(logits.shape[0]) if i not in used][:pad]
        take += [index[0]] * (R - len(take))
        if take != list(range(logits.shape[0])):
            logits = mx.take(logits, mx.array(take), axis=0)
        settings = tuple(row.options.sampling for row in rows) + (Sampling(),) * pad
        ar = [row.decoder.next is Next.AR for row in rows] + [False] * pad
        allowed = [row.decoder.label_allowed() for row in rows] + [None] * pad
        floor = [row.options.thresholds.label_mass for row in rows] + [0.0] * pad
        held = label_mask(allowed, ar, floor, head_rows(phase), logits.shape[-1])
        features = Features.of(settings, labels=held is not None)
        block_fn, ar_fn = summary_functions(features, self.model.token_ids)
        rs = row_sampling(settings)
        keys = seen = ar_rows = None
        if features.temperature:  # only draws need keys, and only their AR rows read a last row alone
            keys = mx.array([row.decoder.key() for row in rows] + [(0, 0)] * pad, dtype=mx.uint32)
            ar_rows = mx.array(ar)
        if features.penalty:
            seen = mx.take(self.seen, mx.array([row.slot for row in rows] + [self.cache.scratch] * pad), axis=0)
        if phase is Phase.BLOCK:
            return block_fn(logits, seen, keys, rs, ar_rows, held)[: len(rows)]
        return ar_fn(logits, seen, keys, rs, held)[: len(rows)]

    def _decode(self, live: list[_Row], out: list[EngineEvent]) -> None:
        """One step of `live`: the forwards and the one host read (what may raise: `_isolated` retries), then
        each row's commit."""
        pending = [row for row in live if row.pending is not None]
        need = [row for row in live if row.pending is None]
        block = [row for row in need if row.decoder.next is Next.BLOCK]
        ar = [row for row in need if row.decoder.next is Next.AR]
        plan = []
        if block and (self.schedule.mixed or not ar):
            plan.append((Phase.BLOCK, block + ar))
        else:
            plan += [(phase, rows) for phase, rows in ((Phase.BLOCK, block), (Phase.AR, ar)) if rows]
        groups = []  # (phase, rows, summary)
        for phase, rows in plan:
            index = self._entries(rows)[0]
            groups.append((phase, rows, self._summary(phase, rows, index, self._forward(phase, rows))))
        if pending:
            logits = mx.stack([row.pending for row in pending])
            groups.append((Phase.AR, pending, self._summary(Phase.AR, pending, list(range(len(pending))), logits)))
            for row in pending:
                row.pending = None

        ahead = None
        if self.schedule.queue_ahead and all(phase is Phase.AR for phase, _, _ in groups):
            ahead = self._queue_ahead(groups)

        summaries = mx.concatenate([summary.reshape(-1) for _, _, summary in groups])
        spare = self.model.since_sync()
        if self.vision_ahead is not None and ahead is None:  # behind this step's forward, before its read
            mx.async_eval(summaries)
            self._unread += self._queue_vision(spare)
        t0 = time.perf_counter()
        host = self.model.read(summaries)  # the one read
        self._tune_pieces(time.perf_counter() - t0, self._unread, (self.cache.slots, bool(pending)))
        self._unread = 0.0
        if self.vision_ahead is not None and ahead is not None:  # behind the AR forward queued ahead: the next read's
            self._unread = self._queue_vision(spare)
        self.steps += 1
        self.host_reads += 1

        # From here on nothing raises out of the step: a row whose rules or events fail fails alone.
        offset = 0
        penalized: list[tuple[_Row, list[int]]] = []
        for phase, rows, summary in groups:
            values = host[offset : offset + summary.size].reshape(summary.shape)
            offset += summary.size
            for row, v in zip(rows, values, strict=True):
                try:
                    new = self._commit(row, phase, v, ahead, out)
                except Exception as e:  # noqa: BLE001 - one row's failure is that row's
                    self._fail_row(row, e, out)
                    continue
                if new and row.options.sampling.repetition_penalty != 1.0 and not row.handle.done:
                    penalized.append((row, new))
        if penalized:
            slots = [row.slot for row, new in penalized for _ in new]
            try:
                self.seen[mx.array(slots), mx.array([t for _, new in penalized for t in new])] = True
            except Exception as e:  # noqa: BLE001
                for row, _ in penalized:
                    self._fail_row(row, e, out)

    def _commit(self, row: _Row, phase: Phase, v: np.ndarray, ahead, out: list[EngineEvent]) -> list[int]:
        """One row's decision from its summary `v`: commit, stream, finish or queue its next AR forward."""
        dec = row.decoder
        if phase is Phase.BLOCK and dec.next is Next.BLOCK:
            new = dec.take_block(v)
        else:
            new = dec.take_ar(*(ar_pick(v) if phase is Phase.BLOCK else (int(v[0]), float(v[1]))))
        self.tokens += len(new)
        self._stream(row, new, out)
        if dec.done:
            self._finish(row, out)
        elif ahead is not None and row.slot in ahead[1] and dec.next is Next.AR:
            row.pending = ahead[0][ahead[1][row.slot]]  # queued on exactly the token just committed
            dec.fed()
        return new

    def _queue_ahead(self, groups) -> tuple[mx.array, dict[int, int]] | None:
        """An AR forward of the rows of an all-AR step that may go on, fed the token each is picking (still on
        the device); returns its logits and each queued slot's entry."""
        picks = [(row, summary[i, 0]) for _, rows, summary in groups for i, row in enumerate(rows)]
        picks = [(row, token) for row, token in picks if len(row.decoder.seq) + 1 < row.decoder.cap]
        if not picks:
            return None
        rows = [row for row, _ in picks]
        index, entries, dense = self._entries(rows)
        R = len(entries)
        inputs = mx.zeros((R,), dtype=mx.int32)
        inputs[mx.array(index)] = mx.stack([token for _, token in picks]).astype(mx.int32)
        c, q = [0] * R, [0] * R
        for i, row in zip(index, rows, strict=True):
            c[i], q[i] = len(row.decoder.seq), 1
        logits = self.model.run(Phase.AR, self.cache, inputs[:, None], entries, c, q, dense=dense)
        mx.async_eval(logits)
        return logits, {row.slot: i for i, row in zip(index, rows, strict=True)}

    # --- results ---

    def _stream(self, row: _Row, new: list[int], out: list[EngineEvent]) -> None:
        ids = self.model.token_ids
        if row.handle.text and new:
            self._stream_text(row, out)
        if ids.box_end not in new:
            return
        dec = row.decoder
        parsed = dec.hold(
            parse_tokens(dec.seq[dec.prompt_len :], ids, self.model.text, row.image.pre.original_size, dec.probs)
        )
        for obj in parsed.objects[row.emitted :]:
            self._emit(row.handle, EngineEvent(row.handle, EventKind.OBJECT, object=obj), out)
        for label in parsed.empty_labels[row.emitted_empty :]:
            self._emit(row.handle, EngineEvent(row.handle, EventKind.EMPTY, label=label), out)
        row.emitted, row.emitted_empty = len(parsed.objects), len(parsed.empty_labels)

    def _stream_text(self, row: _Row, out: list[EngineEvent]) -> None:
        """The answer's text up to its last finished item (`</ref>`, `</box>`, `<|im_end|>`): the decoder takes
        back nothing before it (the loop guard drops a box as its `</box>` commits)."""
        ids = self.model.token_ids
        answer = row.decoder.seq[row.decoder.prompt_len :]
        ends = (ids.ref_end, ids.box_end, ids.im_end)
        settled = next((i + 1 for i in range(len(answer) - 1, row.text_sent - 1, -1) if answer[i] in ends), 0)
        if settled > row.text_sent:
            text = self.model.text(answer[row.text_sent : settled])
            row.text_sent = settled
            self._emit(row.handle, EngineEvent(row.handle, EventKind.TEXT, text=text), out)

    def _finish(self, row: _Row, out: list[EngineEvent]) -> None:
        self.rows[row.slot] = None
        self._succeed(row.handle, build_result(self.model, row), out)


def build_result(model: Runtime, row: _Row) -> Result:
    out = row.decoder.result()
    pre = row.image.pre
    parsed = row.decoder.hold(parse_tokens(out.tokens, model.token_ids, model.text, pre.original_size, out.probs))
    s, t = out.stats, row.timings
    prefill_s = t["prefill_s"]
    stats = {
        "queue_s": t["queue_s"],
        "preprocess_s": t["preprocess_s"],
        "vision_s": t["vision_s"],
        "vision_cached": t["vision_cached"],
        "prefix_prefill_s": t["prefix_prefill_s"],
        "prefill_s": prefill_s,
        "decode_s": s.decode_s,
        "load_s": model.load_s,  # the model's, once per process (`locate.load`)
        "compile_s": model.compile_s - t["compile_s"],  # step functions compiled while this request ran
        "first_step_s": None if s.first_step_s is None else prefill_s + s.first_step_s,
        "first_box_s": None if s.first_box_s is None else prefill_s + s.first_box_s,
        "tokens": len(out.tokens),
        "steps": s.steps,
        "block_steps": s.block_steps,
        "ar_steps": s.ar_steps,
        "fallbacks": s.fallbacks,
        "label_redecodes": s.label_redecodes,
        "host_reads": s.host_reads,
        "stop_reason": s.stop_reason.value,
        "sources": s.sources,
        "compilations": model.compilations,
        "max_tokens": row.budget,
        "max_tokens_clipped": row.budget < row.handle.request.max_tokens,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,  # MLX's high-water mark of this process so far
    }
    return Result(
        objects=parsed.objects,
        empty_labels=parsed.empty_labels,
        text=model.text(out.tokens),
        prompt_ids=row.prompt,
        token_ids=out.tokens,
        token_probs=out.probs,
        grid=list(pre.grid),
        image_size=pre.original_size,
        mode=row.options.mode.value,
        truncated=parsed.truncated,
        orientation=row.image.notes.orientation,
        warnings=list(row.image.notes.warnings),
        stats=stats,
    )
