"""Position ids and attention masks of every step as pure functions of the cached length `c`.

A step feeds `q` real rows (a causal tail, plus 6 window rows for a block step) padded to a fixed `Q`
rows, and attends over a `U`-slot view of the KV cache (MODEL.md §10.2-§10.3). Only `c` changes from
step to step, and it is an array, so compiled steps never retrace.
"""

from __future__ import annotations

import mlx.core as mx

BLOCK = 6


def step_positions(c: mx.array, q: mx.array, Q: int, block: bool) -> mx.array:
    """(Q,) int32: tail rows at c.., window rows at slot - 1 (the anchor copies the last committed token)."""
    i = mx.arange(Q, dtype=mx.int32)
    pos = c + i
    if block:
        pos = mx.where(i >= q - BLOCK, pos - 1, pos)
    return pos


def step_mask(c: mx.array, q: mx.array, Q: int, U: int, block: bool) -> mx.array:
    """(Q, U) bool, True = attend. Row i sits in slot g = c + i; padding rows see only slot 0."""
    g = (c + mx.arange(Q, dtype=mx.int32))[:, None]
    k = mx.arange(U, dtype=mx.int32)[None, :]
    i = mx.arange(Q, dtype=mx.int32)[:, None]
    mask = k <= g
    if block:
        n = c + q - BLOCK  # committed length; window slots are n .. n+5
        window = (i >= q - BLOCK) & (i < q)
        mask = mx.where(window, (k < n + BLOCK) & (k != n - 1), mask)
    return mx.where(i < q, mask, k == 0)


def training_mask(length: int, anchors: list[int]) -> mx.array:
    """Mask of one packed sample (TRAINING.md §2.2): `length` clean rows, then 6 rows per block anchor."""
    T = length + BLOCK * len(anchors)
    t = mx.arange(T)[None, :]
    r = mx.arange(length)[:, None]
    rows = [(t < length) & (t <= r)]
    for j, a in enumerate(anchors):
        start = length + BLOCK * j
        rows.append(mx.broadcast_to(((t < length) & (t < a)) | ((t >= start) & (t < start + BLOCK)), (BLOCK, T)))
    return mx.concatenate(rows, axis=0)
