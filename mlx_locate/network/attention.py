"""Attention over a whole image's patches (the vision tower), in bounded memory on every backend.

MLX's fused attention never holds all the scores at once, but it takes only some head sizes, and only on a GPU;
any other call falls back to `matmul -> softmax -> matmul`, which holds every score of the call at once (a
12 MP photo's ~26,000 patches x 16 heads: about 22 GB in bf16, in one buffer). `image_attention` takes one of
three paths (`attention_path`):

- FUSED: one call, where the backend has a fused kernel for the head size and dtype.
- PADDED: q, k and v padded with zeros to a head size the fused kernel takes (the dot products, and so the
  weights, do not change; the padded output columns are sliced off), the scale kept at 1/sqrt(head size).
- CHUNKED: the fallback in chunks of query rows, each holding at most `score_budget` bytes of scores; on the
  CPU the heads are also split over one CPU stream per core (MLX's CPU softmax runs on one thread per stream).
"""

from __future__ import annotations

from enum import Enum

import mlx.core as mx

from .cpu import stream_spans
from .language import FUSED_MIN_QUERIES

# Head sizes of MLX's fused Metal kernel for long queries (`sdpa_full`): 72 since MLX 0.32.1, 64/80/128 before.
METAL_HEAD_DIMS = (64, 72, 80, 96, 128)
METAL_HEAD_DIMS_BEFORE_0_32_1 = (64, 80, 128)
CUDA_MAX_HEAD_DIM = 128  # cuDNN's fused attention: half-precision, head size a multiple of 8 up to 128
SCORE_BUDGET = 256 << 20  # bytes of scores one fallback call may hold unless the caller says


class Path(Enum):
    FUSED = "fused"
    PADDED = "padded"
    CHUNKED = "chunked"


def mlx_version() -> tuple[int, ...]:
    return tuple(int(p) for p in mx.__version__.split(".")[:3] if p.isdigit())


def backend() -> str:
    """ "metal", "cuda" or "cpu": where the default device's work runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def attention_path(
    where: str, dtype: mx.Dtype, head_dim: int, queries: int, version: tuple[int, ...] | None = None
) -> tuple[Path, int]:
    """The path `image_attention` takes for `queries` query rows of `head_dim` on backend `where` ("metal",
    "cuda", "cpu") with MLX `version` (default: this one), and the head size it runs at."""
    version = version or mlx_version()
    if where == "metal" and queries >= FUSED_MIN_QUERIES:
        sizes = METAL_HEAD_DIMS if version >= (0, 32, 1) else METAL_HEAD_DIMS_BEFORE_0_32_1
        if head_dim in sizes:
            return Path.FUSED, head_dim
        padded = min((s for s in sizes if s > head_dim), default=None)
        if padded is not None:
            return Path.PADDED, padded
    if where == "cuda" and queries >= 2 and dtype in (mx.float16, mx.bfloat16):
        if head_dim <= CUDA_MAX_HEAD_DIM and head_dim % 8 == 0:
            return Path.FUSED, head_dim
        padded = -(-head_dim // 8) * 8
        if padded <= CUDA_MAX_HEAD_DIM:
            return Path.PADDED, padded
    return Path.CHUNKED, head_dim


SCORE_BYTES = 12  # a fallback score's bytes at most: the scores, their float32 softmax and its cast


def chunk_rows(batch: int, heads: int, keys: int, score_budget: int) -> int:
    """Query rows per fallback call so that its scores fit `score_budget` bytes."""
    return max(1, score_budget // (SCORE_BYTES * batch * heads * keys))


def image_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, score_budget: int = SCORE_BUDGET, chunked: bool = False
) -> mx.array:
    """Unmasked attention over (B, H, L, D) by `attention_path` (`chunked`: CHUNKED whatever the path); the same
    arithmetic per query row on every path (to float rounding)."""
    B, heads, L, D = q.shape
    path, size = (Path.CHUNKED, D) if chunked else attention_path(backend(), q.dtype, D, L)
    if path is Path.FUSED:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    if path is Path.PADDED:
        pad = [(0, 0), (0, 0), (0, 0), (0, size - D)]
        out = mx.fast.scaled_dot_product_attention(mx.pad(q, pad), mx.pad(k, pad), mx.pad(v, pad), scale=scale)
        return out[..., :D]
    cpu = mx.default_device() == mx.cpu
    spans = stream_spans(heads) if cpu else [(None, 0, heads)]
    parts = []
    for stream, a, b in spans:
        rows = chunk_rows(B, b - a, k.shape[2], score_budget // len(spans))
        chunks = [
            mx.fast.scaled_dot_product_attention(
                q[:, a:b, i : i + rows], k[:, a:b], v[:, a:b], scale=scale, stream=stream
            )
            for i in range(0, L, rows)
        ]
        parts.append(chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=2))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
