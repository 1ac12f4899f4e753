"""A loaded network ready for inference, and everything the engine asks of it (`Runtime`).

The engine works through this one interface: preparing images, prompt ids and text, vision features and prompt
prefixes (cached by image content), prefills and compiled steps over a `SlotCache`. `locate.LocateModel` holds one
(`model.runtime`) behind the public API.
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from PIL import Image

from .cache import SlotCache, kv_bucket, rows_bucket
from .compiled import BLOCK_FORWARD_ROWS, PREFILL_BUCKET, PREFILL_ROWS, CompiledSteps, Phase, padded_rows
from .memory import Budget
from .network.cpu import store_input_major
from .network.language import fuse_projections
from .preprocess import NORMALISED
from .prompts import UserText, prompt_ids
from .request import DEFAULT_MAX_TOKENS, PreparedImage, prepare_image
from .weights.checkpoint import ReadAhead, loading_streams
from .weights.loader import Checkpoint, rename

HOST_WORKERS = 8  # threads that prepare images and prompts ahead of the engine, at most
PROMPT_WORDS = 128  # a prompt's tokens besides its image's, about (the chat turns and a query)
FEATURE_CACHE_SIZE = 8  # images whose vision features stay cached, by content
PREFIX_CACHE_SIZE = 8  # images whose prompt prefix (K|V up to </img>) stays cached
PREFIX_CACHE_BYTES = 2 << 30
# Copies of its cache's buffers a prefill call holds: the buffers before and after they grow to the call's keys
# (`SlotCache.reserve`), and the copy its K|V are written into (`cache.write_rows`)
CACHE_COPIES = 3
# and, whatever the cache's rows, two more of one row's (measured: on the H200 a one-sequence prompt prefix's
# calls of 3,888 image tokens held 0.6 GB over a plan without them; a folder's calls of 16 rows held no more)
ROW_COPIES = 2


class TowerJob:
    """The vision tower and connector over images of distinct content, as pieces of a few blocks each:
    `advance` builds the next piece (lazily, for the caller to evaluate now or queue); once `done`, `features`
    holds each image's (h*w/4, D) features by key. Images of one patch grid go through together, as many at
    once as the working memory holds, a piece at most the blocks per evaluation it holds
    (`memory.Budget.tower_plan`)."""

    def __init__(self, runtime: Runtime, images: list[PreparedImage]):
        self.runtime = runtime
        self.tower = runtime.network.vision_model
        self.blocks = len(self.tower.encoder.blocks)
        by_grid: dict[tuple[int, int], list[PreparedImage]] = {}
        for image in images:
            by_grid.setdefault(image.pre.grid, []).append(image)
        self.batches: list[tuple[tuple[int, int], list[PreparedImage], int]] = []  # (grid, images, per_eval)
        for grid, group in by_grid.items():
            batch, per_eval = runtime.budget.tower_plan(len(group), grid[0] * grid[1], self.blocks)
            self.batches += [(grid, group[i : i + batch], per_eval) for i in range(0, len(group), batch)]
        self.features: dict[tuple, mx.array] = {}
        self._x: mx.array | None = None  # the current batch's activations after `_next` blocks
        self._next = 0

    @property
    def done(self) -> bool:
        return not self.batches

    def next_piece(self, blocks: int | None = None) -> tuple[tuple[int, int], int, int]:
        """(patch grid, images, blocks) of the piece `advance(blocks)` would build."""
        grid, images, per_eval = self.batches[0]
        return grid, len(images), min(self.blocks - self._next, per_eval, blocks or per_eval)

    def advance(self, blocks: int | None = None) -> mx.array:
        """Build the next piece, up to `blocks` blocks of the current batch (default and at most: its blocks per
        evaluation), with the patch embedding before its first block and the final norm and connector after its
        last; returns the array that evaluates it."""
        grid, images, _ = self.batches[0]
        stop = self._next + self.next_piece(blocks)[2]
        if self._x is None:
            pixels = mx.array(np.stack([image.pre.pixels for image in images]))  # uint8: a quarter of the floats
            self._x = self.tower.embed(self.runtime._normalised[pixels], grid)
        self._x = self.tower.run_blocks(self._x, grid, self._next, stop, self.runtime.budget.score_budget)
        self._next = stop
        if stop < self.blocks:
            return self._x
        features = self.runtime.network.connect(self.tower.finish(self._x), grid)
        for image, f in zip(images, features, strict=True):
            self.features[image.key] = f
        self.batches.pop(0)
        self._x, self._next = None, 0
        return features


class DecoderLoad:
    """The decoder's weights, read after the tower's (`loader.assemble_model` leaves them unread) or by threads
    of their own from the start (`checkpoint.ReadAhead`), made ready for inference by `prepare` (fused, laid
    out); and `seconds`, the host's time spent loading (`locate.load`'s, and the waits here)."""

    def __init__(self, decoder: nn.Module, prepare: Callable[[], None], ahead: ReadAhead | None = None):
        self.decoder = decoder
        self.prepare = prepare
        self.ahead = ahead
        self.seconds = 0.0
        self.scheduled = False
        self.ready = False
        if ahead is None:
            prepare()  # a graph over the unread weights: it runs as they load

    def schedule(self) -> None:
        """Schedule the reads, once. MLX holds the host while more than a few of its tasks are in flight, so
        scheduling hundreds of tensors keeps the host until nearly all are read: `Runtime.run_piece` queues the
        first image's first tower piece before this, so that it runs meanwhile. Threads reading ahead need none."""
        if not self.scheduled:
            self.scheduled = True
            if self.ahead is not None:
                return
            t0 = time.perf_counter()
            mx.async_eval(self.decoder.parameters())
            self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Wait until the weights are in, and ready: before anything uses them (anything traced or run); where
        threads read them, they take the place of the network's unread stand-ins first."""
        if not self.ready:
            self.schedule()
            t0 = time.perf_counter()
            if self.ahead is not None:
                tensors, self.ahead = self.ahead.take(), None
                self.decoder.update(
                    tree_unflatten([(rename(k).removeprefix("language_model."), v) for k, v in tensors.items()])
                )
                del tensors  # the fused matrices free their parts as they are made
                self.prepare()
            mx.eval(self.decoder.parameters())
            self.seconds += time.perf_counter() - t0
            self.ready = True

    def clock(self) -> float:
        """Seconds, on a clock that stands still while the host waits for the load: a request's phases are timed
        on it, so the first request's phases do not count the load again."""
        return time.perf_counter() - self.seconds


class Runtime:
    """A checkpoint's network with its tokenizer, compiled step functions, and caches of vision features and prompt
    prefixes by image content.

    Works on a view of the checkpoint's network (`network_view`), in eval mode, whose decoder projections are fused
    (`language.fuse_projections`) and, on the CPU backend, whose wide ones and head are stored for the CPU's BLAS
    (`cpu.store_input_major`): the checkpoint's own network stays as it was, so fine-tuning goes on training it.
    `take_over`: the caller gives the network up (`locate.load`), so it is changed in place instead, and its unfused
    projections are freed as the fused ones load (memory grows by one layer's projections, not the decoder's)."""

    def __init__(self, checkpoint: Checkpoint, probes: dict[str, int] | None = None, take_over: bool = False):
        network = checkpoint.network if take_over else network_view(checkpoint.network)
        network.eval()

        def prepare() -> None:
            with mx.stream(loading_streams()[1]):  # behind the decoder's load, not on the requests' stream
                fuse_projections(network.language_model.model.layers)
            if mx.default_device() == mx.cpu:
                store_input_major(network.language_model.model)

        # A network given up (`take_over`) may hold the stand-ins of weights read ahead (`read_checkpoint`).
        self.weights = DecoderLoad(network.language_model, prepare, checkpoint.ahead if take_over else None)
        if probes is None and self.weights.ahead is not None:
            self.weights.wait()  # the budget's probes run the decoder: not on its stand-ins
        self.network = network
        self.tokenizer = checkpoint.tokenizer
        self.token_ids = network.token_ids
        self.in_token_limit = checkpoint.in_token_limit
        self.max_length = checkpoint.max_length  # positions a prompt and its answer may use
        self.patch_size = network.config.vision.patch_size
        self.steps = CompiledSteps(network)
        self.budget = Budget.measure(network, probes)  # `probes`: the budget's measurements, kept (`tune.py`)
        self.prefill_chunk: int | None = None  # one sequence's rows per prefill call at most (None: PREFILL_ROWS)
        self.row_costs: dict[int, float] = {}  # seconds of a block step by rows, where measured (`measure_rows`)
        self.tuning_s: dict[str, float] = {}  # seconds the tuner took to measure its choices here (`tune.apply`)
        self.tower_block_s: dict[tuple[int, int], float] = {}  # seconds of a tower block per image, by grid
        self.device_idle_s = 0.0  # time between a wait for the device and the next one (`sync`)
        self._synced: float | None = None
        # Threads for host work ahead of the engine (image decoding, resizing, patches, prompt ids): Pillow, numpy
        # and hashlib release the GIL, and none of it touches MLX. They start with the first job.
        workers = max(1, min(HOST_WORKERS, (os.cpu_count() or 2) - 1))
        self.host_pool = ThreadPoolExecutor(workers, thread_name_prefix="mlx-locate-host")
        self.features: OrderedDict[tuple, mx.array] = OrderedDict()
        self._normalised = mx.array(NORMALISED)  # pixel value -> its float32 patch value, on the device
        self.prefixes: OrderedDict[tuple, list[mx.array]] = OrderedDict()

    @property
    def default_rows(self) -> int:
        """Rows per step when the caller does not say (`memory.Budget.default_rows`), each at the longest prompt
        the model admits: a largest image's tokens, the prompt's words and a default answer."""
        longest = self.in_token_limit // 4 + PROMPT_WORDS + DEFAULT_MAX_TOKENS
        return self.budget.default_rows(min(self.max_length, longest))

    @property
    def compilations(self) -> int:
        """How many times a compiled step function was traced so far."""
        return self.steps.traces

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling step functions so far (`compiled.CompiledSteps`)."""
        return self.steps.compile_s

    # --- host side: images, prompts, text ---

    def prepare(
        self,
        image: str | Path | Image.Image | PreparedImage,
        max_pixels: int | None = None,
        orientation: str = "exif",
        max_image_tokens: int | None = None,
    ) -> PreparedImage:
        """Load (checking the pixel limit) as a viewer shows it, convert to RGB, cut into patches within the
        patch budget and key by content."""
        return prepare_image(image, max_pixels, self.in_token_limit, self.patch_size, orientation, max_image_tokens)

    def prompt(self, user_text: str | UserText, grid: tuple[int, int], rendering: str = "A") -> list[int]:
        """The prompt ids of `user_text` (a string is a raw prompt) about one image of patch `grid`."""
        return prompt_ids(self.tokenizer, user_text, [grid], rendering=rendering)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # --- device side ---

    def sync(self, *arrays) -> None:
        """`mx.eval(arrays)`: the host waits for the device. The time since the previous wait returned is time
        the device may have had nothing to do (`device_idle_s`)."""
        start = time.perf_counter()
        if self._synced is not None:
            self.device_idle_s += start - self._synced
        mx.eval(*arrays)
        self._synced = time.perf_counter()

    def since_sync(self) -> float | None:
        """Seconds since the last wait for the device returned (the host's own time since), None after `idle`."""
        return None if self._synced is None else time.perf_counter() - self._synced

    def read(self, array: mx.array) -> np.ndarray:
        """The one host read of a step (as `sync`, then a copy to numpy)."""
        self.sync(array)
        return np.array(array)

    def idle(self) -> None:
        """No work follows (the engine ran dry): the time until the next wait is not the device's."""
        self._synced = None

    def measure_rows(self, max_rows: int, context: int = 512, repeats: int = 3) -> dict[int, float]:
        """Time a block step at each power-of-two row count up to `max_rows`, every row at `context` cached
        tokens (compiling those steps): `rows_for` then runs n sequences at the cheapest count from n up."""
        R = 1
        while R <= max_rows:
            cache = self.new_cache(R)
            step = (Phase.BLOCK, cache, mx.zeros((R, BLOCK_FORWARD_ROWS), mx.int32), list(range(R)), [context] * R)
            shape = ([BLOCK_FORWARD_ROWS] * R, [True] * R, True)
            self.sync(self.run(*step, *shape))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.sync(self.run(*step, *shape))
                times.append(time.perf_counter() - t0)
            self.row_costs[R] = min(times)
            R *= 2
        self.idle()
        return dict(self.row_costs)

    def rows_for(self, n: int, cap: int) -> int:
        """Sequence rows to run `n` sequences at: the cheapest measured row count from `n` up to `cap` (on a
        GPU a step of fewer rows can cost more), else the next power of two."""
        fitting = [r for r in self.row_costs if n <= r <= cap]
        if not fitting:
            return min(cap, rows_bucket(n)) if n <= cap else rows_bucket(n)
        return min(fitting, key=lambda r: (self.row_costs[r], r))

    def new_cache(self, slots: int = 1) -> SlotCache:
        """An empty KV cache with a row per sequence for `slots` sequences."""
        t = self.network.config.text
        dtype = self.network.language_model.model.norm.weight.dtype
        return SlotCache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, dtype, slots)

    def embed_ids(self, ids: list[int]) -> mx.array:
        """Token embeddings (P, D) of `ids` (after a prompt's prefix, `compute_prefixes`)."""
        return self.network.language_model.model.embed_tokens(mx.array(ids, dtype=mx.int32))

    def features_for(
        self, images: list[PreparedImage], ready: dict[tuple, mx.array] | None = None
    ) -> list[tuple[bool, mx.array]]:
        """Vision tower + connector per image, cached by content: (cached, (h*w/4, D) features) each; `ready`
        holds features a `TowerJob` made ahead, by key (they count as computed now). The rest go through one
        `TowerJob`, evaluated piece by piece."""
        out: dict[tuple, mx.array] = {}
        todo: dict[tuple, PreparedImage] = {}
        for image in images:
            if ready and image.key in ready:
                out[image.key] = self.features[image.key] = ready[image.key]
            elif image.key in self.features:
                self.features.move_to_end(image.key)
            else:
                todo.setdefault(image.key, image)
        job = TowerJob(self, list(todo.values()))
        while not job.done:
            self.run_piece(job)
        for key, f in job.features.items():
            out[key] = self.features[key] = f
        found = [(image.key not in out, out.get(image.key, self.features.get(image.key))) for image in images]
        while len(self.features) > FEATURE_CACHE_SIZE:  # after the answer: a call of more images than the cache
            self.features.popitem(last=False)  # holds may push out one of its own cached ones
        return found

    def run_piece(self, job: TowerJob) -> None:
        """The next piece of `job` (its plan's blocks per evaluation), evaluated now; its time per image-block
        is kept by patch grid (`tower_block_s`), what queuing pieces beside decode steps is sized by. The first
        piece is queued before the decoder's weights are scheduled to load (`DecoderLoad`), and runs meanwhile."""
        grid, images, blocks = job.next_piece()
        t0 = time.perf_counter()
        piece = job.advance()
        if overlapped := not self.weights.scheduled:
            mx.async_eval(piece)
            self.weights.schedule()
        self.sync(piece)
        if not overlapped:  # a piece that waited for the load says nothing of the tower's speed
            cost = (time.perf_counter() - t0) / (images * blocks)
            self.tower_block_s[grid] = min(cost, self.tower_block_s.get(grid, cost))

    def clear_caches(self) -> None:
        """Forget cached vision features and prompt prefixes (the next request of an image computes them again)."""
        self.features.clear()
        self.prefixes.clear()

    def store_prefix(self, key: tuple, prefix: list[mx.array]) -> None:
        self.prefixes[key] = prefix
        while len(self.prefixes) > 1 and (
            len(self.prefixes) > PREFIX_CACHE_SIZE
            or sum(a.nbytes for p in self.prefixes.values() for a in p) > min(PREFIX_CACHE_BYTES, self.budget.kv // 4)
        ):
            self.prefixes.popitem(last=False)

    def prefix(self, key: tuple) -> list[mx.array]:
        self.prefixes.move_to_end(key)
        return self.prefixes[key]

    def run(
        self,
        phase: Phase,
        cache: SlotCache,
        inputs: mx.array,
        rows: list[int],
        c: list[int],
        q: list[int],
        block: list[bool] | None = None,
        dense: bool = False,
    ) -> mx.array:
        """One compiled forward (`compiled.CompiledSteps.run`): writes the entries' K|V, returns their logits. The
        first one waits for the decoder's weights to finish loading (`DecoderLoad.wait`)."""
        self.weights.wait()
        return self.steps.run(phase, cache, inputs, rows, c, q, block, dense)

    def prefill(self, cache: SlotCache, items: list[tuple[int, mx.array, int]]) -> dict[int, mx.array]:
        """Prefill `items` (cache row, (P, D) embeddings, first slot) in calls of at most `prefill_rows` rows
        (sequences x padded rows; a prompt longer than that or than PREFILL_ROWS goes in chunks); each call is
        evaluated before the next one starts (a GPU may hold a call's buffers until it has run it); returns each
        cache row's last logits (1, V)."""
        last: dict[int, mx.array] = {}
        work, calls = list(items), 0
        limit = self.prefill_rows(max(c + x.shape[0] for _, x, c in work), cache) if work else PREFILL_ROWS
        chunk_rows = min(limit, self.prefill_chunk or PREFILL_ROWS)
        while work:
            by_rows: dict[int, list] = {}
            for slot, x, c in work:
                chunk = x[:chunk_rows]
                by_rows.setdefault(padded_rows(Phase.PREFILL, chunk.shape[0]), []).append((slot, chunk, c))
            for Q, group in sorted(by_rows.items()):
                per_call = 1 << max(0, (limit // Q).bit_length() - 1)  # a call's sequences pad to a power of two
                for start in range(0, len(group), per_call):
                    part = group[start : start + per_call]
                    dense = len(part) == cache.slots and [slot for slot, _, _ in part] == list(range(cache.slots))
                    R = cache.slots if dense else rows_bucket(len(part))
                    pad = R - len(part)
                    inputs = mx.stack(
                        [mx.pad(x, [(0, Q - x.shape[0]), (0, 0)]) for _, x, _ in part]
                        + [mx.zeros((Q, part[0][1].shape[-1]), part[0][1].dtype)] * pad
                    )
                    entries = [slot for slot, _, _ in part] + [cache.scratch] * pad
                    c = [c for _, _, c in part] + [0] * pad
                    q = [x.shape[0] for _, x, _ in part] + [0] * pad
                    if calls:
                        self.sync(list(last.values()), cache.kv)
                        mx.synchronize()  # the device frees a call's temporaries only once its stream has run
                    logits = self.run(Phase.PREFILL, cache, inputs, entries, c, q, dense=dense)
                    calls += 1
                    for i, (slot, _, _) in enumerate(part):
                        last[slot] = logits[i]
            work = [(slot, x[chunk_rows:], c + chunk_rows) for slot, x, c in work if x.shape[0] > chunk_rows]
        return last

    def prefill_rows(self, keys: int, cache: SlotCache | None = None) -> int:
        """Rows per prefill call (sequences x padded rows) attending to up to `keys` tokens (the cache's capacity
        then, `kv_bucket(keys)`): what the working memory holds beside the call's copies of `cache`
        (`cache_copies_bytes`), in whole prefill buckets."""
        held = 0 if cache is None else cache_copies_bytes(cache, keys, self.budget)
        return self.budget.prefill_rows(PREFILL_BUCKET, kv_bucket(keys), held)

    def compute_prefixes(self, items: list[tuple[list[int], mx.array]]) -> list[list[mx.array]]:
        """The K|V of each (prefix ids, image features) pair, prefilled together in a cache of their own; per
        prefix, per layer (1, 2, KV, P, D) arrays of their own."""
        self.weights.wait()  # the embedding is the decoder's
        cache = self.new_cache(slots=len(items))
        embeds = [self.network.embed(ids, features)[0] for ids, features in items]
        self.prefill(cache, [(i, e, 0) for i, e in enumerate(embeds)])
        prefixes = [cache.copy_out(i, len(ids)) for i, (ids, _) in enumerate(items)]
        self.sync(prefixes)
        return prefixes


def cache_copies_bytes(cache: SlotCache, keys: int, budget: Budget) -> int:
    """Bytes of the copies of `cache`, grown to `keys` slots a row, that a prefill call holds (CACHE_COPIES,
    ROW_COPIES)."""
    return (CACHE_COPIES * cache.buffer_rows + ROW_COPIES) * kv_bucket(keys) * budget.slot_bytes


def network_view(module):
    """A copy of a module tree that shares every array: inference may fuse the view's projections and leave the
    original's as they are."""
    if isinstance(module, nn.Module):
        view = copy.copy(module)
        for key, value in module.items():
            view[key] = network_view(value)
        return view
    if isinstance(module, list):
        return [network_view(m) for m in module]
    if isinstance(module, dict):
        return {k: network_view(v) for k, v in module.items()}
    return module
