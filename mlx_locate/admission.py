"""How requests become rows of the engine's batch, and how a step that raises is isolated.

Checks. A request is checked (`check_request`, which parses its mode: the one place) before it joins a step.

Host work ahead. A request's host work (checks, image, patches, prompt ids: `prepare`) runs on the model's host
threads, started for the next waiting requests ahead of need. A request of several views (tiles, categories) becomes
a `tiles.TiledRequest` whose views take its place in the line.

Fairness. Handles submitted with one `group` are one client's call (a list of queries, a tiled request's views).
Requests are taken round-robin across groups, so a one-box request waits for at most one row per other group,
however much work the others queued.

Staging. Taken requests are staged rows; their vision runs batched per patch grid, each new image's prompt prefix
(everything up to `</img>`) is prefilled once and kept (the prefix store), and the staged rows holding their prefix
join as many free rows as the KV budget takes.

Isolation. If staging, joining or a decoding step still raises, the engine puts back what it changed and runs it
again over halves of its rows (`isolated`), down to the row that raises: that row fails with a `RequestError`
naming the error, the others go on with the tokens they would have had alone.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace

import mlx.core as mx

from .categories import SplitRequest, is_multi, split_categories
from .compiled import BLOCK_FORWARD_ROWS
from .decide import Guards, Mode
from .label_trie import LabelTrie
from .parse import AnswerParser
from .prompts import UserText, user_text
from .request import (
    EngineEvent,
    EventKind,
    Handle,
    PreparedImage,
    Request,
    RequestError,
    decode_options,
    parse_mode,
)
from .row_decoder import DecodeOptions, RowDecoder
from .runtime import Runtime
from .sampling import Sampling, real_number
from .tiles import TiledRequest, check_tiling, split_request
from .vision_ahead import VisionAhead

PREFETCH = 2  # host work runs ahead for this many times max_rows waiting requests
MAX_SEED = 2**64 - 1


def whole_number(name: str, value: object, low: int, high: int | None = None) -> None:
    """`RequestError` unless `value` is an int (not a bool) in low..high."""
    if not (real_number(value) and isinstance(value, int)) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name} must be a whole number {span}, got {value!r}")


def check_request(request: Request, vocab_size: int) -> Mode:
    """The checks of a request's numbers and options that every entry point shares, made before it joins a
    step: `RequestError` naming the field. Returns the request's mode, parsed. (`Sampling` checks its own ranges
    when made; the vocabulary bound of `top_k` needs the model.)"""
    mode = parse_mode(request.mode)
    if not (request.query is None or isinstance(request.query, str | list)):
        raise RequestError(
            f"query must be text, a list or None (a tuple or set is not taken: use a list), "
            f"got {type(request.query).__name__} {request.query!r}"
        )
    whole_number("max_tokens", request.max_tokens, 1)
    whole_number("seed", request.seed, 0, MAX_SEED)
    if request.max_pixels is not None:
        whole_number("max_pixels", request.max_pixels, 1)
    if not isinstance(request.sampling, Sampling):
        raise RequestError(f"sampling must be a Sampling, got {type(request.sampling).__name__}")
    if not isinstance(request.guards, Guards):
        raise RequestError(f"guards must be a Guards, got {type(request.guards).__name__}")
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
    return mode


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
class Row:
    """An admitted request: its slot, its decoder, its answer's parser, and what its result and events need."""

    handle: Handle
    image: PreparedImage
    prompt: list[int]
    prefix_len: int
    options: DecodeOptions
    budget: int
    timings: dict
    parser: AnswerParser
    slot: int = -1
    decoder: RowDecoder | None = None
    pending: mx.array | None = None  # (1, V) logits whose AR decision is due (slow mode's prefill, a queued step)
    text_sent: int = 0  # generated ids already sent in TEXT events
    prefix: list[mx.array] | None = None  # its image's prompt prefix K|V, once staged

    @property
    def longest(self) -> int:
        """The most cache slots this row can use: its prompt, its token budget and a block's overshoot."""
        return len(self.prompt) + self.budget + BLOCK_FORWARD_ROWS

    @property
    def prefix_key(self) -> tuple:
        """Its prompt prefix's key in the prefix store: the image and the prompt up to `</img>`."""
        return self.image.key, tuple(self.prompt[: self.prefix_len])

    def events(self, new: list[int]) -> list[EngineEvent]:
        """The events of the ids just committed: with `text`, the answer's text up to its last finished item
        (`</ref>`, `</box>`, `<|im_end|>`: the decoder takes back nothing before it, the loop guard dropping a box
        as its `</box>` commits); then the objects and empty labels a `</box>` finished."""
        dec, handle, parser = self.decoder, self.handle, self.parser
        ids, answer = dec.ids, dec.seq[dec.prompt_len :]
        out = []
        if handle.text and new:
            ends = (ids.ref_end, ids.box_end, ids.im_end)
            settled = next((i + 1 for i in range(len(answer) - 1, self.text_sent - 1, -1) if answer[i] in ends), 0)
            if settled > self.text_sent:
                text = parser.decode(answer[self.text_sent : settled])
                self.text_sent = settled
                out.append(EngineEvent(handle, EventKind.TEXT, text=text))
        if ids.box_end in new:
            objects, empty = parser.feed_to(answer, dec.probs)
            out += [EngineEvent(handle, EventKind.OBJECT, object=obj) for obj in objects]
            out += [EngineEvent(handle, EventKind.EMPTY, label=label) for label in empty]
        return out


def prepare(model: Runtime, handle: Handle) -> Row | TiledRequest:
    """A request's host work (runs on the model's host threads): checks, image, patches, prompt ids, decoding
    options; for a request of several views, its views (an image that needs no tiles is decoded as it is)."""
    r = handle.request
    t0 = time.perf_counter()
    mode = check_request(r, model.token_ids.vocab_size)
    names, views = split_categories(r) if is_multi(r) else (None, [])
    if names is not None:
        r = replace(r, query=names)  # checked, repeats merged
    image = model.prepare(r.image, r.max_pixels, r.orientation, r.max_image_tokens)
    if views:  # one row per category, each on the image prepared once
        return SplitRequest(handle, image, [replace(v, image=image) for v in views], names)
    limit = r.max_image_tokens or model.in_token_limit
    if r.tiles is not None and (views := split_request(r, image.rgb, limit, model.patch_size)):
        return TiledRequest(handle, image, views)
    text = UserText(r.prompt) if r.prompt is not None else user_text(r.task, r.query)
    ids = model.prompt(text, image.pre.grid, r.rendering)
    budget = fit_max_tokens(len(ids), r.max_tokens, model.max_length)
    labels = None if names is None else LabelTrie.of(names, model.tokenizer, model.token_ids)  # a joint list
    options = decode_options(r, mode, budget, labels)
    timings = {"queue_s": t0 - handle.submitted, "preprocess_s": time.perf_counter() - t0}
    timings["compile_s"] = model.compile_s  # at the start: the result counts what was compiled since
    held = options.held_labels
    parser = AnswerParser(
        model.token_ids, model.text, image.pre.original_size, labels=None if held is None else held.names
    )
    return Row(handle, image, ids, ids.index(model.token_ids.img_end) + 1, options, budget, timings, parser)


def isolated(
    rows: list[Row],
    run: Callable[[list[Row]], None],
    snapshot: Callable[[list[Row]], Callable[[], None]],
    fail: Callable[[Row, Exception], None],
) -> None:
    """`run(rows)`; when it raises, what it changed is put back (`snapshot(rows)` returns what puts it back) and
    `run` goes again over each half of `rows`, down to the single row that raises, which fails alone."""
    restore = snapshot(rows)
    try:
        run(rows)
    except Exception as e:  # noqa: BLE001 - whatever one row causes, only that row fails
        restore()
        if len(rows) == 1:
            fail(rows[0], e)
            return
        half = len(rows) // 2
        for part in (rows[:half], rows[half:]):
            isolated(part, run, snapshot, fail)


class Admission:
    """The engine's requests before they hold a row: waiting handles by group, host work started ahead, staged rows,
    and the requests of several views whose views are out (`tiles`, by parent handle)."""

    def __init__(self, model: Runtime, max_rows: int):
        self.model, self.max_rows = model, max_rows
        # Waiting handles by group, the group to serve next first; a served group moves to the end.
        self.waiting: OrderedDict[Hashable, deque[Handle]] = OrderedDict()
        self.prefetch: dict[Handle, Future] = {}  # host work started ahead, by handle
        self.staged: deque[Row] = deque()  # taken from `waiting` in turn, host work done, waiting for a row
        self.tiles: dict[Handle, TiledRequest] = {}  # requests of several views, by parent
        self._ids = itertools.count()

    def submit(self, request: Request, on_event, group: Hashable, text: bool) -> Handle:
        """A handle for `request`, waiting in its group (default: the handle alone)."""
        handle = Handle(next(self._ids), request, on_event, text=text)
        handle.group = handle if group is None else group
        self.waiting.setdefault(handle.group, deque()).append(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """`handle` and its views cancelled and out of the line."""
        handle.cancelled = True
        queue = self.waiting.get(handle.group)
        if queue is not None and handle in queue:
            queue.remove(handle)
            if not queue:
                del self.waiting[handle.group]
        self.prefetch.pop(handle, None)
        for row in [r for r in self.staged if r.handle is handle]:
            self.staged.remove(row)
        tiled = self.tiles.pop(handle, None)
        for child in [] if tiled is None else tiled.children:
            self.cancel(child)

    @property
    def queued(self) -> int:
        """Handles waiting for a row (a tiled request counts once until its views are made)."""
        return sum(len(queue) for queue in self.waiting.values())

    def _in_turn(self) -> Iterator[Handle]:
        """Waiting handles in the order admission takes them (round-robin across groups)."""
        queues = list(self.waiting.values())
        for depth in range(max((len(q) for q in queues), default=0)):
            for queue in queues:
                if depth < len(queue):
                    yield queue[depth]

    def prefetch_ahead(self) -> None:
        """Start the host work of the next waiting handles, PREFETCH times max_rows of them at most."""
        for handle in itertools.islice(self._in_turn(), PREFETCH * self.max_rows):
            if handle not in self.prefetch and not handle.cancelled:
                self.prefetch[handle] = self.model.host_pool.submit(prepare, self.model, handle)

    def _next_waiting(self) -> Handle:
        """The first handle of the group whose turn it is; that group goes to the end of the line."""
        group, queue = next(iter(self.waiting.items()))
        handle = queue.popleft()
        if queue:
            self.waiting.move_to_end(group)
        else:
            del self.waiting[group]
        return handle

    def take(self, upto: int, fail: Callable[[Handle, Exception], None]) -> float:
        """Waiting handles into `staged`, in turn, until it holds `upto` rows, once their host work is done (it
        started ahead, `prefetch_ahead`; this waits for what is not done yet; a request that cannot be prepared
        goes to `fail`). Which rows stage and join when depends on the requests alone, never on the threads'
        timing, so the compiled shapes do too. Returns the seconds spent waiting."""
        waited = 0.0
        while self.waiting and len(self.staged) < upto:
            handle = self._next_waiting()
            future = self.prefetch.pop(handle, None) or self.model.host_pool.submit(prepare, self.model, handle)
            if handle.cancelled:
                continue
            t0 = time.perf_counter()
            try:
                work = future.result()
            except Exception as e:  # noqa: BLE001 - a request that cannot be prepared fails alone
                fail(handle, e)
                continue
            finally:
                waited += time.perf_counter() - t0
            if isinstance(work, TiledRequest):
                # The views take the request's place: its group keeps its turn.
                self.tiles[handle] = work
                views = self.waiting.pop(handle.group, deque())
                views.extendleft(reversed(work.fan_out(lambda: next(self._ids))))
                self.waiting[handle.group] = views
                self.waiting.move_to_end(handle.group, last=False)
                self.prefetch_ahead()
                continue
            self.staged.append(work)
        return waited

    def needing_vision(self) -> list[PreparedImage]:
        """The images of staged rows whose prefix is neither held nor stored and whose vision is not cached."""
        model, images = self.model, {}
        for row in self.staged:
            if row.prefix is None and row.prefix_key not in model.prefixes and row.image.key not in model.features:
                images.setdefault(row.image.key, row.image)
        return list(images.values())

    def stage(self, rows: list[Row], ahead: VisionAhead, seconds: dict[str, float]) -> None:
        """Vision (images of one grid batched; what `ahead` ran of it used) and the prompt prefix of each new image
        (prefilled together, kept in the model's prefix store) for `rows`; each row then holds its image's
        prefix. Their seconds are added to `seconds["vision"]` and `seconds["prefix"]`."""
        model = self.model
        keys = [row.prefix_key for row in rows]
        have = {key: model.prefix(key) for key in keys if key in model.prefixes}  # held: storing may evict
        new: dict[tuple, Row] = {}
        for row, key in zip(rows, keys, strict=True):
            row.timings.update(vision_cached=True, vision_s=0.0, prefix_prefill_s=0.0)
            if key not in have:
                new.setdefault(key, row)
        if new:
            t0 = model.weights.clock()  # the first image's vision and prefix may wait for the weights (`load_s`)
            features = model.features_for([row.image for row in new.values()], ahead.finish())
            t1 = model.weights.clock()
            items = [(row.prompt[: row.prefix_len], f) for row, (_, f) in zip(new.values(), features, strict=True)]
            prefixes = model.compute_prefixes(items)
            t2 = model.weights.clock()
            vision_s, prefix_s = t1 - t0, t2 - t1
            seconds["vision"] += vision_s
            seconds["prefix"] += prefix_s
            for (key, row), (cached, _), prefix in zip(new.items(), features, prefixes, strict=True):
                have[key] = prefix
                model.store_prefix(key, prefix)
                row.timings.update(vision_cached=cached, vision_s=vision_s, prefix_prefill_s=prefix_s)
        for row, key in zip(rows, keys, strict=True):
            row.prefix = have[key]

    def joining(self, free: int, live: list[Row]) -> list[Row]:
        """The staged rows that join now, taken off `staged` in turn: those holding their prefix, as many as the
        `free` rows and the KV budget take beside the `live` rows."""
        joining = []
        for row in list(self.staged):
            if len(joining) == free or row.prefix is None or not self._fits(live + joining + [row]):
                break
            joining.append(row)
            self.staged.remove(row)
        return joining

    def _fits(self, rows: list[Row]) -> bool:
        """Whether the cache of `rows`, each at its longest, fits the KV budget (the first row always joins, so a
        lone request runs whatever its size)."""
        if len(rows) == 1:
            return True
        slots = self.model.rows_for(len(rows), self.max_rows)
        return self.model.budget.kv_fits(slots + 1, max(r.longest for r in rows))
