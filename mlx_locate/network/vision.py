"""MoonViT vision tower (docs/model.md §6.1-§6.5): patches + grid -> per-patch features.

Images never attend to each other (docs/model.md §6.5): several images of one grid run as a batch, and attention needs
no mask (`attention.image_attention`, in bounded memory). The tower runs in three parts, `embed`, `run_blocks` and
`finish`, so a caller can evaluate a large input a few blocks at a time.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import VisionConfig
from .attention import SCORE_BUDGET, image_attention


@partial(mx.compile, shapeless=True)
def gelu_tanh(x: mx.array) -> mx.array:
    """One elementwise kernel (compiled), so a large input holds no temporaries of its own."""
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def bicubic_matrix(size_in: int, size_out: int, a: float = -0.75) -> np.ndarray:
    """(size_out, size_in) matrix of PyTorch's bicubic resize (align_corners=False, clamped taps)."""

    def k(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

    out = np.arange(size_out, dtype=np.float64)
    s = (out + 0.5) * size_in / size_out - 0.5
    i0 = np.floor(s)
    f = s - i0
    matrix = np.zeros((size_out, size_in), dtype=np.float64)
    for tap, weight in ((-1, k(1 + f)), (0, k(f)), (1, k(1 - f)), (2, k(2 - f))):
        idx = np.clip(i0 + tap, 0, size_in - 1).astype(np.int64)
        np.add.at(matrix, (np.arange(size_out), idx), weight)
    return matrix


@lru_cache(maxsize=64)
def _resize_matrices(table_h: int, table_w: int, h: int, w: int) -> tuple[mx.array, mx.array]:
    return (
        mx.array(bicubic_matrix(table_h, h).astype(np.float32)),
        mx.array(bicubic_matrix(table_w, w).astype(np.float32)),
    )


@lru_cache(maxsize=64)
def rope2d_tables(h: int, w: int, head_dim: int, theta: float) -> tuple[mx.array, mx.array]:
    """cos, sin of shape (h*w, head_dim/2): pair 2m follows the column, pair 2m+1 the row (docs/model.md §6.3)."""
    freqs = theta ** (-4.0 * np.arange(head_dim // 4, dtype=np.float64) / head_dim)  # (D/4,)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    angles = np.empty((h * w, head_dim // 2), dtype=np.float64)
    angles[:, 0::2] = cols.reshape(-1, 1) * freqs
    angles[:, 1::2] = rows.reshape(-1, 1) * freqs
    return mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32))


@mx.compile
def apply_rope2d(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x: (..., L, H, D), cos/sin (..., L, D/2); rotates pairs (2j, 2j+1) as complex numbers, in float32.

    Written on forward views of x's pairs (no stack, no reversed view), so compiled code runs it as one
    elementwise kernel in 32-bit indexing that holds none of its float32 temporaries."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)  # (..., D/2, 2): re, im
    swapped = mx.where(mx.array([True, False]), -pairs[..., 1:], pairs[..., :1])  # (-im, re)
    cos, sin = cos[..., None, :, None], sin[..., None, :, None]
    out = pairs.astype(mx.float32) * cos + swapped.astype(mx.float32) * sin
    return out.astype(x.dtype).reshape(x.shape)


class PosEmb(nn.Module):
    def __init__(self, height: int, width: int, dim: int):
        super().__init__()
        self.weight = mx.zeros((height, width, dim))

    def __call__(self, h: int, w: int) -> mx.array:
        table_h, table_w, dim = self.weight.shape
        r_h, r_w = _resize_matrices(table_h, table_w, h, w)
        table = self.weight.astype(mx.float32)
        resized = mx.einsum("hi,ijc,wj->hwc", r_h, table, r_w)
        return resized.reshape(h * w, dim)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Linear(3 * p * p, config.hidden_size)  # the stride-p conv, weight (C, 3*p*p)
        self.pos_emb = PosEmb(config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size)

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """(B, L, 3*p*p) flattened patches -> (B, L, C)."""
        x = self.proj(patches.astype(self.proj.weight.dtype))
        return x + self.pos_emb(*grid).astype(x.dtype)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc1(gelu_tanh(self.fc0(x)))


MLP_ROWS = 4096  # patches per piece of a block's MLP on larger inputs


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.norm0 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.norm1 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)
        self.mlp = MLP(dim, config.intermediate_size)

    def __call__(
        self,
        x: mx.array,
        cos: mx.array,
        sin: mx.array,
        mask: mx.array | None = None,
        score_budget: int = SCORE_BUDGET,
        chunked: bool = False,
    ) -> mx.array:
        """x (B, L, C), cos/sin (B or 1, L, D/2); `mask` keeps each padded image's keys to its own patches
        (training); without it attention holds at most `score_budget` bytes of scores where it falls back
        (`chunked`: always falls back, `attention.image_attention`)."""
        B, L, dim = x.shape
        head_dim = dim // self.num_heads
        qkv = self.wqkv(self.norm0(x)).reshape(B, L, 3, self.num_heads, head_dim)
        q = apply_rope2d(qkv[:, :, 0], cos, sin)
        k = apply_rope2d(qkv[:, :, 1], cos, sin)
        v = qkv[:, :, 2]
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, L, D)
        scale = head_dim**-0.5
        if mask is None:
            attn = image_attention(q, k, v, scale, score_budget, chunked)
        else:
            attn = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        x = x + self.wo(attn.transpose(0, 2, 1, 3).reshape(B, L, dim))
        if L <= MLP_ROWS:
            return x + self.mlp(self.norm1(x))
        # Patch by patch arithmetic: in pieces, so a large image never holds its whole 4x-wide MLP at once
        parts = [x[:, i : i + MLP_ROWS] for i in range(0, L, MLP_ROWS)]
        return mx.concatenate([part + self.mlp(self.norm1(part)) for part in parts], axis=1)


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.blocks = [Block(config) for _ in range(config.num_hidden_layers)]
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class VisionTower(nn.Module):
    """`vision_model.*` of the checkpoint."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)
        self.chunked_attention = False  # the fallback's chunks even where a fused kernel runs (`tune.py`)

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """patches (h*w, 3, p, p) of one image, or (B, h*w, 3, p, p) of B images of one grid (either also
        flattened to 3*p*p) -> (..., h*w, C) after the final LayerNorm."""
        one = patches.ndim in (2, 4)
        x = self.embed(patches[None] if one else patches, grid)
        x = self.finish(self.run_blocks(x, grid, 0, len(self.encoder.blocks)))
        return x[0] if one else x

    def embed(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """(B, h*w, 3, p, p) or (B, h*w, 3*p*p) -> (B, h*w, C): patch embedding plus position embedding."""
        return self.patch_embed(patches.reshape(*patches.shape[:2], -1), grid)

    def run_blocks(
        self, x: mx.array, grid: tuple[int, int], start: int, stop: int, score_budget: int = SCORE_BUDGET
    ) -> mx.array:
        """Blocks `start`..`stop` - 1 over x (B, h*w, C)."""
        cos, sin = rope2d_tables(*grid, self.config.head_dim, self.config.rope_theta)
        for block in self.encoder.blocks[start:stop]:
            x = block(x, cos[None], sin[None], score_budget=score_budget, chunked=self.chunked_attention)
        return x

    def finish(self, x: mx.array) -> mx.array:
        return self.encoder.final_layernorm(x)
