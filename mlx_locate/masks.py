"""Position ids and attention masks of every step as pure functions of each sequence's cached length `c`.

A step feeds each of its R sequences `q` real rows (a causal tail, plus 6 window rows for a block row) padded to
a fixed `Q` rows, and attends over a `U`-slot view of its cache row (docs/model.md §10.2-§10.3). Only `c`, `q` and
whether a sequence takes a block change from step to step, and they are arrays, so compiled steps never retrace.
"""

from __future__ import annotations

import mlx.core as mx

BLOCK = 6


def _window(q: mx.array, block: mx.array, Q: int) -> mx.array:
    """(R, Q) bool: the last 6 real rows of a block sequence."""
    i = mx.arange(Q, dtype=mx.int32)[None, :]
    return block[:, None] & (i >= q[:, None] - BLOCK) & (i < q[:, None])


def step_positions(c: mx.array, q: mx.array, Q: int, block: mx.array) -> mx.array:
    """(R, Q) int32 for c, q, block of shape (R,): tail rows at c.., window rows at slot - 1 (the anchor copies
    the last committed token)."""
    pos = c[:, None] + mx.arange(Q, dtype=mx.int32)[None, :]
    return mx.where(_window(q, block, Q), pos - 1, pos)


def step_mask(c: mx.array, q: mx.array, Q: int, U: int, block: mx.array) -> mx.array:
    """(R, 1, Q, U) bool, True = attend. Row i of a sequence sits in slot g = c + i; padding rows see slot 0."""
    i = mx.arange(Q, dtype=mx.int32)[None, :, None]
    k = mx.arange(U, dtype=mx.int32)[None, None, :]
    c3, q3 = c[:, None, None], q[:, None, None]
    causal = k <= c3 + i
    n = c3 + q3 - BLOCK  # a block sequence's committed length; its window slots are n .. n+5
    window = (k < n + BLOCK) & (k != n - 1)
    mask = mx.where(_window(q, block, Q)[..., None], window, causal)
    return mx.where(i < q3, mask, k == 0)[:, None]


def training_mask(length: int, anchors: list[int]) -> mx.array:
    """Mask of one packed sample (docs/training.md §2.2): `length` clean rows, then 6 rows per block anchor."""
    T = length + BLOCK * len(anchors)
    t = mx.arange(T)[None, :]
    r = mx.arange(length)[:, None]
    rows = [(t < length) & (t <= r)]
    for j, a in enumerate(anchors):
        start = length + BLOCK * j
        rows.append(mx.broadcast_to(((t < length) & (t < a)) | ((t >= start) & (t < start + BLOCK)), (BLOCK, T)))
    return mx.concatenate(rows, axis=0)
