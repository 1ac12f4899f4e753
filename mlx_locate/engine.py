"""The batched decoding engine: many requests (images x queries), each row in its own block/AR state.

Public surface (the server, tiles, video, evaluation and the batch CLI build on it):

- `Request`: one image and one query or raw prompt, with its own decoding options.
- `Engine(model, max_rows)`: `submit(request, on_event)` returns a `Handle`; `step()` admits waiting requests
  into free rows and runs one forward step for every active row, returning the `EngineEvent`s it produced;
  `run()` steps until nothing is left; `cancel(handle)` frees a row. One thread drives an engine (MLX streams
  belong to the thread that made them).
- Events: `OBJECT` (a box or point, as soon as its `</box>` is committed), `EMPTY` (a label answered None),
  `DONE` (the `Result`), `ERROR` (a `RequestError`; the other rows go on).

How a step runs. Every sequence owns a row of the KV cache (`cache.SlotCache`) and a `decode.RowDecoder`.
Joining requests are prepared on the host (image, patches, prompt ids), their vision runs batched per patch
grid, each new image's prompt prefix (everything up to `</img>`) is prefilled once and kept (`prefix store`),
copied into the rows that ask about that image, and the rows' own words are prefilled together. Then each step
feeds every row that needs a forward: block rows (tail + anchor + 5 masks, 12 rows) and AR rows (their tail)
share one block-shaped forward or go in two, as `Schedule` says; one compiled summary per forward packs what
each row's decision needs, and all of them come back in one host read. The rules of MODEL.md §10.4-§10.7 then
run per row (`RowDecoder`), unchanged. When every row is in AR state, the next AR forward is queued on the
device's picks before the read, as in slow mode alone; rows that do not continue drop it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

import mlx.core as mx
import numpy as np

from .cache import SlotCache, rows_bucket
from .compiled import Phase, padded_rows
from .decide import Mode, Next
from .decode import DecodeOptions, RowDecoder, ar_pick, summary_functions
from .parse import LocatedObject, parse_tokens
from .prompts import task_text
from .request import PreparedImage, Request, RequestError, Result, parse_mode
from .runtime import Runtime
from .sampling import Features, RowSampling, Sampling
from .tiles import merge_results, split_request

# Engine.seconds: host preparation (image load, resize, prompt ids), vision tower, prefix prefill, the rows'
# own prefill, decoding steps
PHASE_TIMES = ("prepare", "vision", "prefix", "prefill", "decode")


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
    submitted: float = field(default_factory=time.perf_counter)
    parent: Handle | None = field(default=None, repr=False)  # the tiled request a tile belongs to

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


@dataclass(frozen=True)
class Schedule:
    """How a step's rows share forwards (decided by measurement: benchmarks/README.md)."""

    mixed: bool  # block and AR rows share one block-shaped forward; else two forwards
    dense: bool  # a forward covers every slot when only free slots would be left out; else only its rows
    queue_ahead: bool = True  # an all-AR step queues the next AR forward on the device's picks

    @classmethod
    def for_device(cls) -> Schedule:
        """GPU: a forward costs its weight reads, so rows ride along; CPU: rows cost arithmetic."""
        gpu = mx.default_device() == mx.gpu
        return cls(mixed=gpu, dense=gpu)


@lru_cache(maxsize=256)
def row_sampling(settings: tuple[Sampling, ...]) -> RowSampling:
    """The per-row sampling arrays of a batch, made once per mix of settings."""
    return RowSampling.of(settings)


def default_rows() -> int:
    """Rows per step when the caller does not say: 16 on a GPU (a step is bound by reading the weights),
    4 on a CPU (bound by arithmetic)."""
    return 16 if mx.default_device() == mx.gpu else 4


def fit_max_tokens(prompt_len: int, max_tokens: int, limit: int) -> int:
    """`max_tokens` clipped so the prompt and its answer fit in `limit` positions; `RequestError` with both
    numbers when the prompt alone leaves no room."""
    if prompt_len >= limit:
        raise RequestError(
            f"the prompt has {prompt_len} tokens but the model holds at most {limit} (prompt plus answer); "
            "shorten the query or use a smaller image"
        )
    return min(max_tokens, limit - prompt_len)


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


class Engine:
    """Decodes submitted requests, up to `max_rows` at a time. Not thread-safe: drive it from one thread."""

    def __init__(self, model: Runtime, max_rows: int | None = None, schedule: Schedule | None = None):
        self.model = model
        self.max_rows = max_rows or default_rows()
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {self.max_rows}")
        self.schedule = schedule or Schedule.for_device()
        self.waiting: deque[Handle] = deque()
        self.cache: SlotCache | None = None
        self.rows: list[_Row | None] = []  # by slot
        self.seen: mx.array | None = None  # (cache rows, V) bool: ids already in each sequence (repetition penalty)
        self.tiles: dict[Handle, tuple[PreparedImage, list[Request], list[Handle]]] = {}
        self.steps = 0  # forward steps (each with one host read)
        self.host_reads = 0
        self.seconds = dict.fromkeys(PHASE_TIMES, 0.0)  # where the engine's time went, summed over its steps
        self._ids = itertools.count()

    # --- the caller's side ---

    def submit(self, request: Request, on_event: Callable[[EngineEvent], None] | None = None) -> Handle:
        handle = Handle(next(self._ids), request, on_event)
        self.waiting.append(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop decoding `handle` and free its row; it gets no further events."""
        handle.cancelled = True
        if handle in self.waiting:
            self.waiting.remove(handle)
        for child in self.tiles.pop(handle, (None, [], []))[2]:
            self.cancel(child)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def step(self) -> list[EngineEvent]:
        """Admit waiting requests into free rows, then advance every active row by one forward step."""
        events: list[EngineEvent] = []
        for slot, row in enumerate(self.rows):
            if row is not None and row.handle.cancelled:
                self.rows[slot] = None
        self._admit(events)
        live = [r for r in self.rows if r is not None]
        if live:
            t0 = time.perf_counter()
            self._decode(live, events)
            self.seconds["decode"] += time.perf_counter() - t0
        if self.idle:
            self.cache, self.rows, self.seen = None, [], None  # memory goes back when there is no work
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
        handle.error = error if isinstance(error, RequestError) else RequestError(str(error))
        self._emit(handle, EngineEvent(handle, EventKind.ERROR, error=handle.error), out)

    def _succeed(self, handle: Handle, result: Result, out: list[EngineEvent]) -> None:
        handle.result = result
        self._emit(handle, EngineEvent(handle, EventKind.DONE, result=result), out)

    def _tile_done(self, child: Handle, out: list[EngineEvent]) -> None:
        """A tile finished: when its whole request has, merge the tiles into the parent's result."""
        if child.result is None and child.error is None:
            return  # a streamed object of a tile: the merged objects are sent once, at the end
        parent = child.parent
        if parent not in self.tiles or parent.cancelled:
            return
        image, requests, children = self.tiles[parent]
        if child.error is not None:
            self.tiles.pop(parent)
            for other in children:
                self.cancel(other)
            self._fail(parent, child.error, out)
        elif all(c.result is not None for c in children):
            self.tiles.pop(parent)
            try:
                result = merge_results(parent.request, image.rgb, requests, [c.result for c in children])
            except (OSError, ValueError) as e:
                self._fail(parent, e, out)
                return
            for obj in result.objects:
                self._emit(parent, EngineEvent(parent, EventKind.OBJECT, object=obj), out)
            for label in result.empty_labels:
                self._emit(parent, EngineEvent(parent, EventKind.EMPTY, label=label), out)
            self._succeed(parent, result, out)

    # --- admission: host preparation, vision, prefixes, prefill ---

    def _prepare(self, handle: Handle) -> _Row | None:
        """The row of a request, or None for a tiled one whose views now wait at the front of the queue."""
        r, model = handle.request, self.model
        t0 = time.perf_counter()
        image = model.prepare(r.image, r.max_pixels)
        if r.tiles is not None and self._expand_tiles(handle, image):
            return None
        mode = parse_mode(r.mode)
        user_text = r.prompt if r.prompt is not None else task_text(r.task, r.query)
        ids = model.prompt(user_text, image.pre.grid, r.rendering)
        budget = fit_max_tokens(len(ids), r.max_tokens, model.max_length)
        redecode = r.redecode_labels if r.redecode_labels is not None else r.task == "ocr" and mode is Mode.HYBRID
        options = DecodeOptions(mode, budget, r.sampling, r.strict, r.guards, redecode_labels=redecode, seed=r.seed)
        timings = {"queue_s": t0 - handle.submitted, "preprocess_s": time.perf_counter() - t0}
        self.seconds["prepare"] += timings["preprocess_s"]
        return _Row(handle, image, ids, ids.index(model.token_ids.img_end) + 1, options, budget, timings)

    def _expand_tiles(self, handle: Handle, image: PreparedImage) -> bool:
        """Queue a tiled request's views at the front; False when the image needs no tiles (it is decoded as
        it is)."""
        requests = split_request(handle.request, image.rgb, self.model.in_token_limit, self.model.patch_size)
        if not requests:
            return False
        children = [Handle(next(self._ids), c, parent=handle) for c in requests]
        self.tiles[handle] = (image, requests, children)
        self.waiting.extendleft(reversed(children))
        return True

    def _admit(self, out: list[EngineEvent]) -> None:
        free = self.max_rows - self.active
        joining: list[_Row] = []
        while self.waiting and len(joining) < free:
            handle = self.waiting.popleft()
            if handle.cancelled:
                continue
            try:
                row = self._prepare(handle)
                if row is not None:
                    joining.append(row)
            except (OSError, ValueError) as e:
                self._fail(handle, e, out)
        if not joining:
            return
        self._place(joining)
        self._prefixes(joining)
        t0 = time.perf_counter()
        items = [(row.slot, self.model.embed_ids(row.prompt[row.prefix_len :]), row.prefix_len) for row in joining]
        last = self.model.prefill(self.cache, items)
        mx.eval(list(last.values()))
        prefill_s = time.perf_counter() - t0
        self.seconds["prefill"] += prefill_s
        for row in joining:
            row.timings["prefill_s"] = prefill_s
            row.decoder = RowDecoder(row.prompt, self.model.token_ids, row.options, self.model.max_length)
            if row.options.mode is Mode.SLOW:
                row.pending = last[row.slot]
            row.decoder.begin()

    def _place(self, joining: list[_Row]) -> None:
        """Give each joining row a free slot, growing the cache by powers of two up to max_rows."""
        if self.cache is None:
            self.cache = self.model.new_cache(slots=0)
        need = self.active + len(joining)
        if need > self.cache.slots:
            old = self.cache.slots
            self.cache.grow(min(self.max_rows, rows_bucket(need)))
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

    def _prefixes(self, joining: list[_Row]) -> None:
        """Vision (batched per grid) and the prompt prefix of each new image (prefilled once, kept in the
        model's prefix store); then every joining row gets its image's prefix in its cache row."""
        model = self.model
        keys = [(row.image.key, tuple(row.prompt[: row.prefix_len])) for row in joining]
        have = {key: model.prefix(key) for key in keys if key in model.prefixes}  # held: storing may evict
        new: dict[tuple, _Row] = {}
        for row, key in zip(joining, keys, strict=True):
            row.timings.update(vision_cached=True, vision_s=0.0, prefix_prefill_s=0.0)
            if key not in have:
                new.setdefault(key, row)
        if new:
            t0 = time.perf_counter()
            features = model.features_for([row.image for row in new.values()])
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
        for row, key in zip(joining, keys, strict=True):
            self.cache.copy_in(row.slot, have[key])

    def _entries(self, rows: list[_Row]) -> tuple[list[int], list[int], bool]:
        """A forward's entries: the index of each row's entry, the cache row of every entry and whether the
        forward is dense (every slot, free ones as padding) or gathered (its rows, padded to a power of two
        with scratch-row entries)."""
        slots = [row.slot for row in rows]
        if len(rows) == self.cache.slots or (self.schedule.dense and len(rows) == self.active):
            return slots, list(range(self.cache.slots)), True
        R = rows_bucket(len(rows))
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
        features = Features.of(settings)
        block_fn, ar_fn = summary_functions(features, self.model.token_ids)
        rs = row_sampling(settings)
        keys = seen = ar_rows = None
        if features.temperature:  # only draws need keys, and only their AR rows read a last row alone
            keys = mx.array([row.decoder.key() for row in rows] + [(0, 0)] * pad, dtype=mx.uint32)
            ar_rows = mx.array([row.decoder.next is Next.AR for row in rows] + [False] * pad)
        if features.penalty:
            seen = mx.take(self.seen, mx.array([row.slot for row in rows] + [self.cache.scratch] * pad), axis=0)
        if phase is Phase.BLOCK:
            return block_fn(logits, seen, keys, rs, ar_rows)[: len(rows)]
        return ar_fn(logits, seen, keys, rs)[: len(rows)]

    def _decode(self, live: list[_Row], out: list[EngineEvent]) -> None:
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

        host = np.array(mx.concatenate([summary.reshape(-1) for _, _, summary in groups]))  # the one host read
        self.steps += 1
        self.host_reads += 1

        offset = 0
        penalized_slots, penalized_ids = [], []
        for phase, rows, summary in groups:
            values = host[offset : offset + summary.size].reshape(summary.shape)
            offset += summary.size
            for row, v in zip(rows, values, strict=True):
                dec = row.decoder
                if phase is Phase.BLOCK and dec.next is Next.BLOCK:
                    new = dec.take_block(v)
                else:
                    new = dec.take_ar(*(ar_pick(v) if phase is Phase.BLOCK else (int(v[0]), float(v[1]))))
                if new and row.options.sampling.repetition_penalty != 1.0:
                    penalized_slots += [row.slot] * len(new)
                    penalized_ids += new
                self._stream(row, new, out)
                if dec.done:
                    self._finish(row, out)
                elif ahead is not None and row.slot in ahead[1] and dec.next is Next.AR:
                    row.pending = ahead[0][ahead[1][row.slot]]  # queued on exactly the token just committed
                    dec.fed()
        if penalized_ids:
            self.seen[mx.array(penalized_slots), mx.array(penalized_ids)] = True

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
        if ids.box_end not in new:
            return
        dec = row.decoder
        parsed = parse_tokens(dec.seq[dec.prompt_len :], ids, self.model.text, row.image.pre.original_size, dec.probs)
        for obj in parsed.objects[row.emitted :]:
            self._emit(row.handle, EngineEvent(row.handle, EventKind.OBJECT, object=obj), out)
        for label in parsed.empty_labels[row.emitted_empty :]:
            self._emit(row.handle, EngineEvent(row.handle, EventKind.EMPTY, label=label), out)
        row.emitted, row.emitted_empty = len(parsed.objects), len(parsed.empty_labels)

    def _finish(self, row: _Row, out: list[EngineEvent]) -> None:
        self.rows[row.slot] = None
        self._succeed(row.handle, build_result(self.model, row), out)


def build_result(model: Runtime, row: _Row) -> Result:
    out = row.decoder.result()
    pre = row.image.pre
    parsed = parse_tokens(out.tokens, model.token_ids, model.text, pre.original_size, out.probs)
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
        stats=stats,
    )
