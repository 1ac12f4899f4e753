"""Qwen2.5 decoder (MODEL.md §7) with explicit position ids and an explicit boolean mask.

`kv` is a list of per-layer (K, V) buffers of shape (1, kv_heads, U, head_dim); a step writes its
rows at slot `c` and attends over the whole buffer under `mask`. Without `kv` the layer attends over
its own rows (full recompute, training).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import TextConfig


def rope_tables(positions: mx.array, head_dim: int, theta: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Rotate-half RoPE: cos, sin of shape (..., T, 1, head_dim / 2) for positions (..., T), built in float32
    as the reference does, cast to the activation dtype. Both halves of a head share these angles."""
    inv_freq = mx.array((theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32))
    angles = (positions.astype(mx.float32)[..., None] * inv_freq)[..., None, :]
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (B, H, T, D) -> x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).

    Written on views of x's two halves (no concatenate), so compiled code runs it as one elementwise kernel.
    """
    *lead, D = x.shape
    halves = x.reshape(*lead, 2, D // 2)
    rotated = halves[..., ::-1, :] * mx.array([[-1], [1]], dtype=x.dtype)  # (-x2, x1)
    return (halves * cos + rotated * sin).reshape(*lead, D)


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """q (B, H, T, D), k/v (B, KV, K, D), mask (T, K) bool -> (B, H, T, D)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.scale = hd**-0.5

    def __call__(self, x, cos, sin, mask, kv=None, c=None):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            start = mx.concatenate([mx.zeros((2,), mx.int32), c.reshape(1), mx.zeros((1,), mx.int32)])
            k = mx.slice_update(kv[0], k.astype(kv[0].dtype), start, axes=(0, 1, 2, 3))
            v = mx.slice_update(kv[1], v.astype(kv[1].dtype), start, axes=(0, 1, 2, 3))
        out = attend(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, kv=None, c=None):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, c)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Qwen2Model(nn.Module):
    """`language_model.model.*` of the checkpoint."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LanguageModel(nn.Module):
    """`language_model.*`: decoder plus the head tied to `embed_tokens`."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config)

    def __call__(
        self,
        embeds: mx.array,  # (B, T, D)
        positions: mx.array,  # (T,) or (B, T) int32
        mask: mx.array,  # (T, K) or (B, 1, T, K) bool, True = attend
        kv: list[tuple[mx.array, mx.array]] | None = None,
        c: mx.array | None = None,  # (1,) int32: cache slot of the first row
    ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """Returns the hidden states before the final norm (B, T, D) and the updated K/V buffers."""
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, embeds.dtype)
        cos, sin = mx.expand_dims(cos, -4), mx.expand_dims(sin, -4)  # broadcast over the heads of (B, H, T, D)
        x, new_kv = embeds, []
        for i, layer in enumerate(self.model.layers):
            x, layer_kv = layer(x, cos, sin, mask, None if kv is None else kv[i], c)
            new_kv.append(layer_kv)
        return x, new_kv

    def logits(self, hidden: mx.array) -> mx.array:
        """Final RMSNorm, tied head, float32 logits; call it on the rows you need only."""
        return self.model.embed_tokens.as_linear(self.model.norm(hidden)).astype(mx.float32)
