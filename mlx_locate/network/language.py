"""Qwen2.5 decoder (docs/model.md §7) with explicit position ids and an explicit mask.

`kv` is a list of per-layer K|V buffers of shape (rows, 2, kv_heads, U, head_dim) (keys, then values, a row per
sequence, `cache.py`); a step writes each sequence's rows at its slot `c` (`cache.write_rows`) and attends over
its row's U slots under `mask`. Without `kv` the layer attends over its own rows (full recompute, training).

For inference `fuse_projections` turns q|k|v and gate|up into one matrix each, so a layer runs one product
for each; q, k and v then get RoPE together in one elementwise kernel (the value heads' tables are the
identity), which also leaves K and V side by side for the single cache write.
"""

from __future__ import annotations

import copy
from enum import Enum

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import Where, write_rows
from ..config import TextConfig

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

FUSED_MIN_QUERIES = 9  # query rows from which Metal's full attention kernel runs (fewer: its vector kernel or none)


def rope_tables(positions: mx.array, head_dim: int, theta: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Rotate-half RoPE: cos, sin of shape (..., T, 1, head_dim / 2) for positions (..., T), built in float32
    as the reference does, cast to the activation dtype. Both halves of a head share these angles."""
    inv_freq = mx.array((theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32))
    angles = (positions.astype(mx.float32)[..., None] * inv_freq)[..., None, :]
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


def qkv_tables(cos: mx.array, sin: mx.array, rotated: int, plain: int) -> tuple[mx.array, mx.array]:
    """Tables (..., T, rotated + plain, 1, D / 2) for heads laid out as (..., T, heads, D): the first `rotated`
    heads (q, k) take `cos`/`sin` of `rope_tables`, the last `plain` heads (v) cos 1 and sin 0, which
    passes them through exactly."""
    is_plain = (mx.arange(rotated + plain) >= rotated)[:, None, None]
    return mx.where(is_plain, 1, mx.expand_dims(cos, -3)), mx.where(is_plain, 0, mx.expand_dims(sin, -3))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (..., D) -> x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); cos/sin broadcast against
    (..., 2, D / 2).

    Written on forward views of x's two halves (no concatenate, no reversed view), so compiled code runs it as
    one elementwise kernel in 32-bit indexing.
    """
    *lead, D = x.shape
    halves = x.reshape(*lead, 2, D // 2)
    rotated = mx.where(mx.array([[True], [False]]), -halves[..., 1:, :], halves[..., :1, :])  # (-x2, x1)
    return (halves * cos + rotated * sin).reshape(*lead, D)


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean mask (True = attend) as 0 / the lowest finite value of `dtype`, added to the scores: converted
    once per forward instead of inside every layer's attention. A masked score's weight is exactly 0."""
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


class AttentionPath(Enum):
    """How a decoder step's attention runs (`attend`); `tune.py` picks one by measurement on the device.

    - SDPA: MLX's fused attention as called (the kernel MLX picks for the step's query rows).
    - PADDED: 2-8 query rows padded with zero rows to FUSED_MIN_QUERIES, so that Metal's full kernel takes them
      (its vector kernel takes at most 32 query rows x GQA factor); the padded rows are sliced off.
    - UNFUSED: matmul -> float32 softmax -> matmul.
    """

    SDPA = "sdpa"
    PADDED = "padded"
    UNFUSED = "unfused"


def attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array, path: AttentionPath = AttentionPath.SDPA
) -> mx.array:
    """q (B, H, T, D), k/v (B, KV, K, D), mask (T, K) or (B, 1, T, K), boolean or additive -> (B, H, T, D)."""
    B, H, T, D = q.shape
    if path is AttentionPath.UNFUSED:
        KV = k.shape[1]
        g = (q * scale).reshape(B, KV, H // KV, T, D)
        scores = g @ k[:, :, None].swapaxes(-1, -2)  # (B, KV, G, T, K)
        m = mask[:, :, None] if mask.ndim == 4 else mask
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + m
        weights = mx.softmax(scores, axis=-1, precise=True)
        return (weights @ v[:, :, None]).reshape(B, H, T, D)
    if path is AttentionPath.PADDED and 1 < T < FUSED_MIN_QUERIES:
        n = FUSED_MIN_QUERIES - T
        q = mx.pad(q, [(0, 0), (0, 0), (0, n), (0, 0)])
        fill = True if mask.dtype == mx.bool_ else 0
        mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 2) + [(0, n), (0, 0)], constant_values=fill)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)[:, :, :T]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the parts' outputs side by side; None unless they are alike (same class,
    same quantization, same tensors)."""

    def kind(m: nn.Module) -> tuple:
        return type(m), getattr(m, "bits", None), getattr(m, "group_size", None), getattr(m, "mode", None), sorted(m)

    first = parts[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(kind(m) != kind(first) for m in parts):
        return None
    fused = copy.copy(first)
    for name in first:
        fused[name] = mx.concatenate([m[name] for m in parts])
    return fused


def fuse_projections(layers: list[DecoderLayer]) -> None:
    """q|k|v and gate|up as one matrix each, layer by layer, as a graph (nothing is read or computed here: the
    parts are freed as each fused matrix is made, when the decoder is evaluated, so memory grows by about one
    layer's projections). Parts that are not alike (say, quantized with different bits) stay separate."""
    for layer in layers:
        for module in (layer.self_attn, layer.mlp):
            for fused_name, names in FUSED.items():
                if all(n in module for n in names) and (fused := fuse_linears([module[n] for n in names])):
                    for n in names:
                        del module[n]
                    module[fused_name] = fused


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

    def project(self, x: mx.array) -> mx.array:
        """(B, T, dim) -> (B, T, (H + 2 KV) * head_dim): q, k and v side by side."""
        if "qkv_proj" in self:
            return self.qkv_proj(x)
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

    def __call__(self, x, cos, sin, mask, kv=None, at: Where | None = None, path=AttentionPath.SDPA):
        """cos/sin from `qkv_tables`; kv (rows, 2, KV, U, D) or None; returns the output and the K|V rows
        (the updated buffer, or this call's own (B, 2, KV, T, D))."""
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        heads = apply_rope(self.project(x).reshape(B, T, H + 2 * KV, -1), cos, sin)
        q = heads[:, :, :H].transpose(0, 2, 1, 3)
        kv_rows = heads[:, :, H:].reshape(B, T, 2, KV, -1).transpose(0, 2, 3, 1, 4)
        view = kv_rows
        if kv is not None:
            kv_rows, view = write_rows(kv, kv_rows, at)
        out = attend(q, view[:, 0], view[:, 1], self.scale, mask, path)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), kv_rows


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, kv=None, at=None, path=AttentionPath.SDPA):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, at, path)
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
        kv: list[mx.array] | None = None,  # per layer (rows, 2, KV, U, D)
        at: Where | None = None,  # the cache rows of the B sequences and their first slots
        path: AttentionPath = AttentionPath.SDPA,  # how the attention runs (`attend`)
    ) -> tuple[mx.array, list[mx.array]]:
        """Returns the hidden states before the final norm (B, T, D) and the updated K|V buffers."""
        t = self.config
        cos, sin = rope_tables(positions, t.head_dim, t.rope_theta, embeds.dtype)
        cos, sin = qkv_tables(cos, sin, t.num_attention_heads + t.num_key_value_heads, t.num_key_value_heads)
        mask = additive_mask(mask, embeds.dtype)
        x, new_kv = embeds, []
        for i, layer in enumerate(self.model.layers):
            x, layer_kv = layer(x, cos, sin, mask, None if kv is None else kv[i], at, path)
            new_kv.append(layer_kv)
        return x, new_kv

    def logits(self, hidden: mx.array) -> mx.array:
        """Final RMSNorm, tied head, float32 logits; call it on the rows you need only."""
        return self.model.embed_tokens.as_linear(self.model.norm(hidden)).astype(mx.float32)
