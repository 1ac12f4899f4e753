"""The `mx.compile`d prefill and step functions, cached by (phase, padded rows Q, cache view U).

Every step pads its rows to a fixed Q (prefill: a power of two from PREFILL_MIN below PREFILL_BUCKET, else a
multiple of PREFILL_BUCKET; AR: 1 or 6; block: 12) and attends over the whole bucket-sized cache view U, so each
function traces once. The step offset and the real row count are arrays, never part of the key. `traces` counts
every (re)trace.
"""

from __future__ import annotations

from enum import Enum

import mlx.core as mx

from .cache import KVCache
from .masks import BLOCK, step_mask, step_positions
from .model import LocateAnything

PREFILL_BUCKET = 128
PREFILL_MIN = 16  # a short prompt (a query after a cached prefix) pads to a power of two from here
BLOCK_ROWS = 2 * BLOCK  # a tail of at most 6 committed tokens, then the 6 window rows


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
        if not BLOCK <= q <= BLOCK_ROWS:
            raise ValueError(f"a block step feeds 6 to 12 rows, got {q}")
        return BLOCK_ROWS
    if not 1 <= q <= BLOCK:
        raise ValueError(f"an AR step feeds 1 to 6 rows, got {q}")
    return 1 if q == 1 else BLOCK


class CompiledSteps:
    def __init__(self, model: LocateAnything, compile: bool = True):
        self.model = model
        self.compile = compile
        self.functions = {}
        self.traces = 0

    def get(self, phase: Phase, Q: int, U: int):
        key = (phase, Q, U)
        if key not in self.functions:
            fn = self._make(phase, Q, U)
            self.functions[key] = mx.compile(fn) if self.compile else fn
        return self.functions[key]

    def _make(self, phase: Phase, Q: int, U: int):
        lm = self.model.language_model
        block = phase is Phase.BLOCK
        head_rows = BLOCK if block else 1

        def step(inputs: mx.array, c: mx.array, q: mx.array, *kv: mx.array):
            self.traces += 1  # runs only while tracing when compiled
            embeds = inputs if phase is Phase.PREFILL else lm.model.embed_tokens(inputs)[None]
            hidden, new_kv = lm(embeds, step_positions(c, q, Q, block), step_mask(c, q, Q, U, block), list(kv), c)
            rows = q - head_rows + mx.arange(head_rows, dtype=mx.int32)
            logits = lm.logits(mx.take(hidden[0], rows, axis=0))  # (head_rows, V)
            return (logits, *new_kv)

        return step


class StepRunner:
    """Feeds rows through the compiled functions and keeps the KV cache's offset (the cached length c)."""

    def __init__(self, steps: CompiledSteps, cache: KVCache):
        self.steps = steps
        self.cache = cache

    def _run(self, phase: Phase, inputs: mx.array, q: int, Q: int) -> mx.array:
        c = self.cache.offset
        U = self.cache.reserve(c + Q)
        fn = self.steps.get(phase, Q, U)
        c_array, q_array = mx.array([c], dtype=mx.int32), mx.array([q], dtype=mx.int32)
        logits, *self.cache.kv = fn(inputs, c_array, q_array, *self.cache.kv)
        return logits

    def prefill(self, embeds: mx.array) -> mx.array:
        """Caches prompt rows (1, P, D) after those already cached (a shared prefix, or none); returns the
        last row's logits (1, V)."""
        P = embeds.shape[1]
        Q = padded_rows(Phase.PREFILL, P)
        if Q > P:
            embeds = mx.concatenate([embeds, mx.zeros((1, Q - P, embeds.shape[2]), embeds.dtype)], axis=1)
        logits = self._run(Phase.PREFILL, embeds, P, Q)
        self.cache.offset += P
        return logits

    def step(self, ids: list[int] | mx.array, block: bool) -> mx.array:
        """Feeds uncached committed ids (plus anchor and masks for a block); returns 1 or 6 logit rows.

        The committed ids become cached; a block's window slots are left behind the offset (dropped). For an
        AR step `ids` may also be one token still on the device, so the step is queued before the host reads it.
        """
        phase = Phase.BLOCK if block else Phase.AR
        if isinstance(ids, mx.array):
            if block or ids.size != 1:
                raise ValueError(f"a device array feeds one AR row, got shape {ids.shape} for a block={block} step")
            q, Q, inputs = 1, 1, ids.astype(mx.int32).reshape(1)
        else:
            q = len(ids)
            Q = padded_rows(phase, q)
            inputs = mx.array(ids + [0] * (Q - q), dtype=mx.int32)
        logits = self._run(phase, inputs, q, Q)
        self.cache.offset += q - BLOCK if block else q
        return logits

    def retract(self, n: int) -> None:
        """Uncache the last `n` tokens (a step queued ahead and not taken); their slots are written over later."""
        if not 0 <= n <= self.cache.offset:
            raise ValueError(f"cannot retract {n} of {self.cache.offset} cached tokens")
        self.cache.offset -= n
