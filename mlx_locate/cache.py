"""Per-layer K|V buffers sized to a bucket of slots, grown by whole buckets.

Each layer keeps one buffer of shape (1, 2, kv_heads, U, head_dim): keys, then values, so a step writes both
with one update. A step writes its rows at slot `offset` and returns new buffers; committing tokens is
advancing the offset and dropping a block's window is not advancing it, so nothing is ever copied to trim.
A fork shares the buffers (MLX arrays are values: the first write after a fork copies).
"""

from __future__ import annotations

import mlx.core as mx

KV_BUCKET = 256
SLOT_AXIS = 3


def kv_bucket(slots: int) -> int:
    return -(-slots // KV_BUCKET) * KV_BUCKET


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype):
        self.shape = (1, 2, kv_heads, 0, head_dim)
        self.dtype = dtype
        self.kv = [mx.zeros(self.shape, dtype) for _ in range(num_layers)]
        self.offset = 0  # slots [0, offset) hold committed tokens

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[SLOT_AXIS]

    def reserve(self, slots: int) -> int:
        """Grow to the bucket holding `slots` slots; returns the capacity, the attention view length U."""
        if slots > self.capacity:
            extra = list(self.shape)
            extra[SLOT_AXIS] = kv_bucket(slots) - self.capacity
            pad = mx.zeros(extra, self.dtype)
            self.kv = [mx.concatenate([buffer, pad], axis=SLOT_AXIS) for buffer in self.kv]
        return self.capacity

    def fork(self) -> KVCache:
        other = object.__new__(KVCache)
        other.__dict__.update(self.__dict__, kv=list(self.kv))
        return other

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.kv)
