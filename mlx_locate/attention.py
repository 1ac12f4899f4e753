"""Attention over whole images (the vision tower's patches, a long prefill), in bounded memory on every backend."""

from __future__ import annotations

import mlx.core as mx

from .cpu import stream_spans

CPU_SCORES = 1 << 27  # attention scores one CPU call may hold (float32: 512 MB); longer queries go in chunks


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """Fused SDPA over (B, H, L, D). On the CPU backend, whose softmax runs on one thread per stream and whose
    attention holds all its scores at once, an unmasked call splits the heads over one stream per core (up to
    MAX_CPU_STREAMS) and the queries into chunks of at most CPU_SCORES scores: the same arithmetic per query row,
    bit for bit, in bounded memory (a 25,600-patch image would need 21 GB of scores at once)."""
    B, heads, L, _ = q.shape
    if mask is not None or mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    parts = []
    for s, a, b in stream_spans(heads):
        rows = max(1, CPU_SCORES // (B * (b - a) * k.shape[2]))
        chunks = [
            mx.fast.scaled_dot_product_attention(q[:, a:b, i : i + rows], k[:, a:b], v[:, a:b], scale=scale, stream=s)
            for i in range(0, L, rows)
        ]
        parts.append(chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=2))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
