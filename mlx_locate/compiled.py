"""The `mx.compile`d prefill and step functions, cached by their shapes.

A step feeds R sequences (every cache row, or a power of two of them padded with entries that write to the
cache's scratch row), each with Q padded
rows (prefill: a power of two from PREFILL_MIN below PREFILL_BUCKET, else a multiple of it; AR: 1 or 6; block:
12), and attends over the U slots of the cache's rows. The key is (phase, R, Q, U, cache rows, dense); every
per-step value (cached lengths, real row counts, which sequences take a block) is an array, so each function
traces once. `traces` counts every (re)trace.

`StepRunner` drives one sequence in a one-slot cache: the engine's batch of one, for tests and tools that feed
their own steps.
"""

from __future__ import annotations

import threading
import time
from enum import Enum

import mlx.core as mx

from .cache import SlotCache, Where
from .masks import BLOCK, step_mask, step_positions
from .network.language import AttentionPath
from .network.model import LocateAnything

PREFILL_BUCKET = 128
PREFILL_MIN = 16  # a short prompt (a query after a cached prefix) pads to a power of two from here
PREFILL_ROWS = 2048  # one sequence's rows per prefill call at most: longer prompts go in chunks
BLOCK_FORWARD_ROWS = 2 * BLOCK  # a block-shaped forward's rows: a tail of at most BLOCK committed tokens, then
# the BLOCK window rows


class Phase(Enum):
    PREFILL = "prefill"
    AR = "ar"
    BLOCK = "block"


def padded_rows(phase: Phase, q: int) -> int:
    if phase is Phase.PREFILL:
        if q < PREFILL_BUCKET:
            return min(PREFILL_BUCKET, max(PREFILL_MIN, 1 << (q - 1).bit_length()))
        return -(-q // PREFILL_BUCKET) * PREFILL_BUCKET
    if phase is Phase.BLOCK:
        if not 1 <= q <= BLOCK_FORWARD_ROWS:
            raise ValueError(f"a block-shaped step feeds 1 to 12 rows per sequence, got {q}")
        return BLOCK_FORWARD_ROWS
    if not 1 <= q <= BLOCK:
        raise ValueError(f"an AR step feeds 1 to 6 rows, got {q}")
    return 1 if q == 1 else BLOCK


def head_rows(phase: Phase) -> int:
    """Logit rows per sequence: a block step's 6 window rows (an AR sequence in it uses the last), else 1."""
    return BLOCK if phase is Phase.BLOCK else 1


class CompiledSteps:
    """The step functions, one cache per thread: a traced function keeps the CPU streams it was traced with
    (the head's, `language.PanelEmbedding`), and MLX streams belong to the thread that made them.

    A function runs eagerly for its first `compile_after` calls and is compiled at the next one: a short answer
    (a one-shot command's few steps) never pays a compilation that would cost more than its steps save
    (`tune.py` measures where that lies on the device). `compile_s` sums the calls that compiled a function,
    each evaluated at once (the trace, the kernels' builds and that first run)."""

    def __init__(self, model: LocateAnything, compile: bool = True, compile_after: int = 0):
        self.model = model
        self.compile = compile
        self.compile_after = compile_after
        self.attention = AttentionPath.SDPA  # AR and block steps' attention (`language.attend`); prefills: SDPA
        self.per_thread = threading.local()
        self.traces = 0
        self.compile_s = 0.0
        self._weights_ready = False

    @property
    def functions(self) -> dict:
        """The calling thread's functions by key: [function, compiled, calls]."""
        if not hasattr(self.per_thread, "functions"):
            self.per_thread.functions = {}
        return self.per_thread.functions

    def get(self, phase: Phase, R: int, Q: int, U: int, cache_rows: int, dense: bool):
        """(function, whether this call compiles it) for the key, counting the call."""
        key = (phase, R, Q, U, cache_rows, dense)
        functions = self.functions
        entry = functions.get(key)
        compiles = self.compile and (entry is None or not entry[1]) and (entry[2] if entry else 0) >= self.compile_after
        if compiles:
            if not self._weights_ready:  # a weight still loading would be captured as its load (`locate.load`)
                mx.eval(self.model.language_model.parameters())
                self._weights_ready = True
            entry = [mx.compile(self._make(phase, Q, U, dense, count=True)), True, entry[2] if entry else 0]
            functions[key] = entry
        elif entry is None:
            entry = functions[key] = [self._make(phase, Q, U, dense, count=False), False, 0]
        entry[2] += 1
        return entry[0], compiles

    def _make(self, phase: Phase, Q: int, U: int, dense: bool, count: bool):
        lm = self.model.language_model
        H = head_rows(phase)
        path = AttentionPath.SDPA if phase is Phase.PREFILL else self.attention

        def step(inputs: mx.array, rows: mx.array, c: mx.array, q: mx.array, block: mx.array, *kv: mx.array):
            """inputs: (R, Q, D) embeddings (prefill) or (R, Q) ids; rows, c, q, block: (R,)."""
            if count:
                self.traces += 1  # runs only while tracing
            embeds = inputs if phase is Phase.PREFILL else lm.model.embed_tokens(inputs)
            positions = step_positions(c, q, Q, block)
            mask = step_mask(c, q, Q, U, block)
            hidden, new_kv = lm(embeds, positions, mask, list(kv), Where(rows, c, dense), path)
            picked = mx.maximum(q[:, None] - H + mx.arange(H, dtype=mx.int32)[None, :], 0)  # (R, H)
            logits = lm.logits(mx.take_along_axis(hidden, picked[..., None], axis=1))  # (R, H, V)
            return (logits, *new_kv)

        return step

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
        """One forward of R entries: `inputs` (R, Q[, D]) padded, and per entry its cache row, first slot,
        real row count and whether it takes a block. Writes their K|V; returns logits (R, H, V)."""
        R, Q = inputs.shape[:2]
        U = cache.reserve(max(c) + Q)
        fn, compiles = self.get(phase, R, Q, U, cache.buffer_rows, dense)
        t0 = time.perf_counter()
        i32 = mx.int32
        block = mx.array(block if block is not None else [False] * R)
        logits, *cache.kv = fn(inputs, mx.array(rows, i32), mx.array(c, i32), mx.array(q, i32), block, *cache.kv)
        if compiles:
            mx.eval(logits, cache.kv)
            self.compile_s += time.perf_counter() - t0
        return logits


class StepRunner:
    """One sequence in a one-slot cache: feeds its rows and keeps its cached length `offset`."""

    def __init__(self, steps: CompiledSteps, cache: SlotCache):
        self.steps = steps
        self.cache = cache
        self.offset = 0

    def prefill(self, embeds: mx.array) -> mx.array:
        """Caches prompt rows (1, P, D) after those already cached; returns the last row's logits (1, V)."""
        P = embeds.shape[1]
        logits = None
        for start in range(0, P, PREFILL_ROWS):
            chunk = embeds[:, start : start + PREFILL_ROWS]
            n = chunk.shape[1]
            Q = padded_rows(Phase.PREFILL, n)
            if Q > n:
                chunk = mx.concatenate([chunk, mx.zeros((1, Q - n, chunk.shape[2]), chunk.dtype)], axis=1)
            logits = self.steps.run(Phase.PREFILL, self.cache, chunk, [0], [self.offset], [n], dense=True)
            self.offset += n
        return logits[:, 0]

    def step(self, ids: list[int], block: bool) -> mx.array:
        """Feeds uncached committed ids (plus anchor and masks for a block); returns 1 or 6 logit rows.

        The committed ids become cached; a block's window slots are left behind the offset (dropped).
        """
        phase = Phase.BLOCK if block else Phase.AR
        q = len(ids)
        Q = padded_rows(phase, q)
        inputs = mx.array([ids + [0] * (Q - q)], dtype=mx.int32)
        logits = self.steps.run(phase, self.cache, inputs, [0], [self.offset], [q], [block], dense=True)
        self.offset += q - BLOCK if block else q
        return logits[0]
