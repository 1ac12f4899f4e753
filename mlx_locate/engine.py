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

How requests become rows (fair turns across groups, host work ahead, staging, the halving that isolates a failing
row) is admission.py; requests of several views are `tiles.TiledRequest` and `categories.SplitRequest`; the vision
of staged images run behind the steps is vision_ahead.py. The engine keeps the step.

How a step runs. Every sequence owns a row of the KV cache (`cache.SlotCache`) and a `row_decoder.RowDecoder`.
Joining rows get their image's prompt prefix copied into their cache rows and their own words prefilled together.
Then each step feeds every row that needs a forward: block rows (tail + anchor + 5 masks, 12 rows) and AR rows
(their tail) share one block-shaped forward or go in two, as `Schedule` says; one compiled summary per forward
packs what each row's decision needs (`sampling.summarize`), and all of them come back in one host read. The rules
of docs/model.md §10.4-§10.7 then run per row (`RowDecoder`), unchanged. When every row is in AR state, the next AR
forward is queued on the device's picks before the read, as in slow mode alone; rows that do not continue drop it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .admission import Admission, Row, isolated, whole_number
from .cache import SlotCache
from .compiled import Phase, padded_rows
from .decide import Next
from .request import EngineEvent, EventKind, Handle, Request, RequestError, Result, as_request_error
from .row_decoder import RowDecoder
from .runtime import Runtime
from .sampling import read_token, summarize
from .vision_ahead import VisionAhead

# Engine.seconds: waiting for host preparation (image load, resize, prompt ids: done ahead in threads), the
# vision tower, prefix prefills, the rows' own prefill, decoding steps; and `host`, the device's waits for the
# host (the time between one wait for the device and the next)
PHASE_TIMES = ("prepare", "vision", "prefix", "prefill", "decode", "host")


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


class Engine:
    """Decodes submitted requests, up to `max_rows` at a time. Not thread-safe: drive it from one thread."""

    def __init__(self, model: Runtime, max_rows: int | None = None, schedule: Schedule | None = None):
        self.model = model
        if max_rows is not None:
            whole_number("max_rows", max_rows, 1)
        self.max_rows = max_rows or model.default_rows
        self.schedule = schedule or Schedule.for_device()
        self.admission = Admission(model, self.max_rows)  # waiting, prefetched, staged; requests of several views
        self.vision_ahead = VisionAhead(model, self.schedule.tower_ahead)
        self.cache: SlotCache | None = None
        self.rows: list[Row | None] = []  # by slot
        self.seen: mx.array | None = None  # (cache rows, V) bool: ids already in each sequence (repetition penalty)
        self.steps = 0  # forward steps (each with one host read)
        self.host_reads = 0
        self.tokens = 0  # generated ids committed
        self.seconds = dict.fromkeys(PHASE_TIMES, 0.0)  # where the engine's time went, summed over its steps

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
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__} {request!r}")
        handle = self.admission.submit(request, on_event, group, text)
        handle.engine = self
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop decoding `handle` and free its row; it gets no further events. A finished handle stays as it is;
        `ValueError` for a handle of another engine."""
        if handle.engine is not self:
            raise ValueError(f"handle {handle.id} was not submitted to this engine; cancel it on its own")
        if not handle.done:
            self.admission.cancel(handle)

    @property
    def queued(self) -> int:
        """Handles waiting for a row (a tiled request counts once until its views are made)."""
        return self.admission.queued

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        return not self.admission.waiting and not self.admission.staged and not self.active

    def step(self) -> list[EngineEvent]:
        """Admit waiting requests into free rows, then advance every active row by one forward step."""
        events: list[EngineEvent] = []
        for slot, row in enumerate(self.rows):
            if row is not None and row.handle.cancelled:
                self.rows[slot] = None
        idle_before = self.model.device_idle_s
        self._admit(events)
        live = [r for r in self.rows if r is not None]
        if live and self.vision_ahead.job is None and self.schedule.tower_ahead != 0:
            # While rows decode: stage waiting requests up to max_rows rows and start their images' vision.
            self._take(events, self.max_rows)
            self.vision_ahead.start(self.admission.needing_vision())
        if live:
            t0 = time.perf_counter()
            self._isolated(live, self.decode_rows, events)
            self.seconds["decode"] += time.perf_counter() - t0
        self.seconds["host"] += self.model.device_idle_s - idle_before
        if self.idle:
            self.cache, self.rows, self.seen = None, [], None  # memory goes back when there is no work
            self.vision_ahead.job = None
            self.model.idle()
        return events

    def run(self) -> None:
        while not self.idle:
            self.step()

    # --- events ---

    def _emit(self, handle: Handle, event: EngineEvent, out: list[EngineEvent]) -> None:
        """Send `event` (a DONE or ERROR one sets the handle's result or error); a view's goes to its parent."""
        if event.kind is EventKind.DONE:
            handle.result = event.result
        elif event.kind is EventKind.ERROR:
            handle.error = event.error
        if handle.parent is not None:
            self._view_done(handle, out)
            return
        handle.events.append(event)
        out.append(event)
        if handle.on_event is not None:
            handle.on_event(event)

    def _fail(self, handle: Handle, error: Exception, out: list[EngineEvent]) -> None:
        self._emit(handle, EngineEvent(handle, EventKind.ERROR, error=as_request_error(error)), out)

    def _view_done(self, child: Handle, out: list[EngineEvent]) -> None:
        """A view finished: its parent's events (`TiledRequest.view_done`); a failed view cancels the others."""
        if child.result is None and child.error is None:
            return  # a streamed object of a view: the parent gets the view's objects when it finishes
        parent = child.parent
        tiled = self.admission.tiles.get(parent)
        if tiled is None or parent.cancelled:
            return
        events = tiled.view_done(child)
        if tiled.over:
            del self.admission.tiles[parent]
            if child.error is not None:
                for other in tiled.children:
                    self.admission.cancel(other)
        for event in events:
            self._emit(parent, event, out)

    # --- admission (admission.py) and isolation ---

    def _isolated(self, rows: list[Row], run: Callable[[list[Row], list[EngineEvent]], None], out) -> None:
        """`run(rows, out)`, a row that makes it raise failing alone (`admission.isolated`)."""
        isolated(rows, lambda part: run(part, out), self._snapshot, lambda row, e: self._fail_row(row, e, out))

    def _snapshot(self, rows: list[Row]) -> Callable[[], None]:
        """What puts back what a step over `rows` may change before it can no longer fail: the cache's slots and
        K|V list, the rows by slot, `seen`, and each row's decoder position and pending logits."""
        cache, engine_rows = self.cache, list(self.rows)
        slots, kv = (0, []) if cache is None else (cache.slots, list(cache.kv))
        # `seen` is updated in place (`seen[i] = ...` rewrites the array object), so the saved one is a copy.
        seen = None if self.seen is None else mx.array(self.seen)
        decoders = [(row, row.decoder.cached, row.pending) for row in rows if row.decoder is not None]

        def restore() -> None:
            self.cache, self.rows, self.seen = cache, engine_rows, seen
            if cache is not None:
                cache.slots, cache.kv = slots, kv
            for row, cached, pending in decoders:
                row.decoder.cached, row.pending = cached, pending

        return restore

    def _fail_row(self, row: Row, error: Exception, out: list[EngineEvent]) -> None:
        if 0 <= row.slot < len(self.rows) and self.rows[row.slot] is row:
            self.rows[row.slot] = None
        if row in self.admission.staged:
            self.admission.staged.remove(row)
        if not row.handle.done:
            message = f"decoding failed for this request: {type(error).__name__}: {error}"
            self._fail(row.handle, RequestError(message), out)

    def _take(self, out: list[EngineEvent], upto: int) -> None:
        self.seconds["prepare"] += self.admission.take(upto, lambda handle, e: self._fail(handle, e, out))

    def _admit(self, out: list[EngineEvent]) -> None:
        """Stage as many waiting requests as rows are free (their host work is done ahead); when the staged
        rows holding their prefix would not fill the free rows, run vision and the prompt prefixes in one batch
        for every staged row without one and for the next waiting requests, up to max_rows rows (ahead of need:
        a later request waits behind at most one such batch); then join as many staged rows as the free rows
        and the KV budget take."""
        admission = self.admission
        admission.prefetch_ahead()
        free = self.max_rows - self.active
        if free < 1:
            return
        self._take(out, free)
        if sum(row.prefix is not None for row in admission.staged) < free:
            self._take(out, self.max_rows)
            unstaged = [row for row in admission.staged if row.prefix is None]
            if unstaged:
                self._isolated(unstaged, lambda rows, _: admission.stage(rows, self.vision_ahead, self.seconds), out)
        joining = admission.joining(free, [r for r in self.rows if r is not None])
        if joining:
            self._isolated(joining, self._join, out)

    def _join(self, joining: list[Row], out: list[EngineEvent]) -> None:
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
            row.pending = row.decoder.begin(last[row.slot])

    def _place(self, joining: list[Row]) -> None:
        """Give each joining row a free slot, growing the cache to the cheapest row count that holds them."""
        if self.cache is None:
            self.cache = self.model.new_cache(slots=0)
        need = self.active + len(joining)
        vocab = self.model.token_ids.vocab_size
        if need > self.cache.slots:
            old = self.cache.slots
            self.cache.grow(self.model.rows_for(need, self.max_rows))
            self.rows += [None] * (self.cache.slots - old)
            if self.seen is not None:
                fresh = mx.zeros((self.cache.buffer_rows - old, vocab), dtype=mx.bool_)
                self.seen = mx.concatenate([self.seen[:old], fresh])
        free = (s for s, r in enumerate(self.rows) if r is None)
        for row in joining:
            row.slot = next(free)
            self.rows[row.slot] = row
            if row.options.sampling.repetition_penalty != 1.0:
                if self.seen is None:
                    self.seen = mx.zeros((self.cache.buffer_rows, vocab), dtype=mx.bool_)
                marks = mx.zeros((vocab,), dtype=mx.bool_)
                marks[mx.array(row.prompt)] = True
                self.seen[row.slot] = marks

    # --- the step ---

    def _entries(self, rows: list[Row]) -> tuple[list[int], list[int], bool]:
        """A forward's entries: the index of each row's entry, the cache row of every entry and whether the
        forward is dense (every slot, free ones as padding) or gathered (its rows, padded to a power of two
        with scratch-row entries)."""
        slots = [row.slot for row in rows]
        if len(rows) == self.cache.slots or (self.schedule.dense and len(rows) == self.active):
            return slots, list(range(self.cache.slots)), True
        R = self.model.rows_for(len(rows), self.cache.slots)
        return list(range(len(rows))), slots + [self.cache.scratch] * (R - len(rows)), False

    def _forward(self, phase: Phase, rows: list[Row]) -> mx.array:
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

    def _summary(self, phase: Phase, rows: list[Row], index: list[int], logits: mx.array) -> mx.array:
        """The summary of one forward's logits at `rows`' entries (`sampling.summarize`): (len(rows), width)."""
        return summarize(
            logits,
            index,
            [row.options.sampling for row in rows],
            [row.decoder.key() for row in rows],
            [row.decoder.next is Next.AR for row in rows],
            self.model.token_ids,
            block=phase is Phase.BLOCK,
            seen=self.seen,
            slots=[row.slot for row in rows],
            pad_slot=self.cache.scratch,
            allowed=[row.decoder.label_allowed() for row in rows],
            floors=[row.options.thresholds.label_mass for row in rows],
        )

    def decode_rows(self, live: list[Row], out: list[EngineEvent]) -> None:
        """One step of `live`: the forwards and the one host read (what may raise: a step is isolated), then each
        row's commit. (The memory benchmark wraps it to take the step's peak.)"""
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
        vision = self.vision_ahead
        if vision.job is not None and ahead is None:  # behind this step's forward, before its read
            mx.async_eval(summaries)
            vision.queue(spare)
        t0 = time.perf_counter()
        host = self.model.read(summaries)  # the one read
        vision.read(time.perf_counter() - t0, (self.cache.slots, bool(pending)))
        if vision.job is not None and ahead is not None:  # behind the AR forward queued ahead: the next read's
            vision.queue(spare)
        self.steps += 1
        self.host_reads += 1

        # From here on nothing raises out of the step: a row whose rules or events fail fails alone.
        offset = 0
        penalized: list[tuple[Row, list[int]]] = []
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

    def _commit(self, row: Row, phase: Phase, v: np.ndarray, ahead, out: list[EngineEvent]) -> list[int]:
        """One row's decision from its summary `v`: commit, stream, finish or queue its next AR forward."""
        dec = row.decoder
        if phase is Phase.BLOCK and dec.next is Next.BLOCK:
            new = dec.take_block(v)
        else:
            new = dec.take_ar(*read_token(v, phase is Phase.BLOCK))
        self.tokens += len(new)
        for event in row.events(new):
            self._emit(row.handle, event, out)
        if dec.done:
            self.rows[row.slot] = None
            self._emit(row.handle, EngineEvent(row.handle, EventKind.DONE, result=build_result(self.model, row)), out)
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


def build_result(model: Runtime, row: Row) -> Result:
    """A finished row's `Result`: its answer parsed (the rest of it: `Row.parser` has what streamed) and its stats."""
    out = row.decoder.result()
    pre = row.image.pre
    row.parser.feed_to(out.tokens, out.probs)
    parsed = row.parser.result()
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
        "load_s": model.weights.seconds,  # the model's, once per process (`locate.load`)
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
