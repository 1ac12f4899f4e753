"""The KV cache with a row axis: per layer one buffer (rows, 2, kv_heads, U, head_dim), keys then values.

Each sequence owns one row (a slot) and its cached length `c` lives with the sequence (host side), not here.
A step writes its rows of sequence r at slots c_r .. c_r + Q - 1 of row r and attends over the whole U-slot view;
committing tokens is advancing c_r and dropping a block's window is not advancing it, so nothing is ever copied,
trimmed or repacked. Slots and U grow in buckets, so compiled steps see a few fixed shapes.

With more than one slot there is one extra row at the end, the scratch row: a step over a subset of the
sequences is padded to a bucket of rows with entries that write there and are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

KV_BUCKET = 256
ROW_AXIS, SLOT_AXIS = 0, 3


def kv_bucket(slots: int) -> int:
    return -(-slots // KV_BUCKET) * KV_BUCKET


def rows_bucket(n: int) -> int:
    """Sequence rows come in powers of two."""
    return 1 << max(0, (n - 1).bit_length())


class Where(NamedTuple):
    """Which cache rows a step feeds and where its rows land: `rows` (R,) int32 buffer rows, `c` (R,) int32
    the first slot written in each. `dense` means rows == 0..R-1 (every sequence of the buffer, in order)."""

    rows: mx.array
    c: mx.array
    dense: bool


def write_rows(kv: mx.array, new: mx.array, at: Where) -> tuple[mx.array, mx.array]:
    """Write `new` (R, 2, KV, Q, D) at `at`; returns the updated buffer and the (R, 2, KV, U, D) view to attend.

    One sequence is one slice update; several are one scatter. A dense step attends over the buffer's first R
    rows in place; a gathered one over a copy of its rows.
    """
    R, Q = new.shape[0], new.shape[SLOT_AXIS]
    new = new.astype(kv.dtype)
    if R == 1:
        zero = mx.zeros((1,), mx.int32)
        start = mx.concatenate([at.rows.reshape(1), zero, zero, at.c.reshape(1), zero])
        kv = mx.slice_update(kv, new, start, axes=(0, 1, 2, 3, 4))
    else:
        slots = at.c[:, None] + mx.arange(Q, dtype=mx.int32)[None, :]  # (R, Q)
        rows = mx.broadcast_to(at.rows[:, None], slots.shape)
        kv[rows, :, :, slots] = new.transpose(0, 3, 1, 2, 4)  # (R, Q, 2, KV, D)
    if at.dense:
        view = kv if kv.shape[ROW_AXIS] == R else kv[:R]
    else:
        view = mx.take(kv, at.rows, axis=ROW_AXIS)
    return kv, view


class SlotCache:
    """Per-layer K|V buffers for `slots` sequences (plus the scratch row when there are several)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, slots: int = 1):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.slots = slots
        self.kv = [mx.zeros(self._shape(self.buffer_rows, 0), dtype) for _ in range(num_layers)]

    def _shape(self, rows: int, slots: int) -> tuple[int, ...]:
        return (rows, 2, self.kv_heads, slots, self.head_dim)

    @property
    def buffer_rows(self) -> int:
        return self.slots if self.slots == 1 else self.slots + 1

    @property
    def scratch(self) -> int:
        """The buffer row that padding entries write to."""
        return self.slots

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[SLOT_AXIS]

    def reserve(self, slots: int) -> int:
        """Grow to the bucket holding `slots` slots per row; returns the capacity U."""
        if slots > self.capacity:
            pad = mx.zeros(self._shape(self.buffer_rows, kv_bucket(slots) - self.capacity), self.dtype)
            self.kv = [mx.concatenate([buffer, pad], axis=SLOT_AXIS) for buffer in self.kv]
        return self.capacity

    def grow(self, slots: int) -> None:
        """Room for `slots` sequences (existing rows keep their place; the scratch row moves to the end)."""
        if slots <= self.slots:
            return
        old = self.slots
        self.slots = slots
        extra = mx.zeros(self._shape(self.buffer_rows - old, self.capacity), self.dtype)
        self.kv = [mx.concatenate([buffer[:old], extra], axis=ROW_AXIS) for buffer in self.kv]

    def copy_in(self, row: int, prefix: list[mx.array]) -> None:
        """Put a cached prefix (per layer (1, 2, KV, P, D)) at slots 0..P-1 of `row`."""
        self.reserve(prefix[0].shape[SLOT_AXIS])
        start = mx.array([row, 0, 0, 0, 0], dtype=mx.int32)
        self.kv = [mx.slice_update(b, p, start, axes=(0, 1, 2, 3, 4)) for b, p in zip(self.kv, prefix, strict=True)]

    def copy_out(self, row: int, length: int) -> list[mx.array]:
        """Slots 0..length-1 of `row`, per layer, as arrays of their own (not views of the buffer)."""
        return [mx.contiguous(b[row : row + 1, :, :, :length]) for b in self.kv]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.kv)
