"""Qwen2.5 decoder (MODEL.md §7) with explicit position ids and an explicit mask.

`kv` is a list of per-layer K|V buffers of shape (rows, 2, kv_heads, U, head_dim) (keys, then values, a row per
sequence, `cache.py`); a step writes each sequence's rows at its slot `c` (`cache.write_rows`) and attends over
its row's U slots under `mask`. Without `kv` the layer attends over its own rows (full recompute, training).

For inference `fuse_projections` turns q|k|v and gate|up into one matrix each, so a layer runs one product
for each; q, k and v then get RoPE together in one elementwise kernel (the value heads' tables are the
identity), which also leaves K and V side by side for the single cache write.
"""

from __future__ import annotations

import copy
import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import Where, write_rows
from .config import TextConfig
from .vision import stream_spans

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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

    Written on views of x's two halves (no concatenate), so compiled code runs it as one elementwise kernel.
    """
    *lead, D = x.shape
    halves = x.reshape(*lead, 2, D // 2)
    rotated = halves[..., ::-1, :] * mx.array([[-1], [1]], dtype=x.dtype)  # (-x2, x1)
    return (halves * cos + rotated * sin).reshape(*lead, D)


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean mask (True = attend) as 0 / the lowest finite value of `dtype`, added to the scores: converted
    once per forward instead of inside every layer's attention. A masked score's weight is exactly 0."""
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """q (B, H, T, D), k/v (B, KV, K, D), mask (T, K) boolean or additive -> (B, H, T, D)."""
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
    """q|k|v and gate|up as one matrix each, layer by layer (memory grows by one layer's projections at
    most). Parts that are not alike (say, quantized with different bits) stay separate."""
    for layer in layers:
        for module in (layer.self_attn, layer.mlp):
            for fused_name, names in FUSED.items():
                if all(n in module for n in names) and (fused := fuse_linears([module[n] for n in names])):
                    mx.eval(fused.parameters())
                    for n in names:
                        del module[n]
                    module[fused_name] = fused


def transposed(w: mx.array, rows: int = 256, panel: int | None = None) -> mx.array:
    """`w.T` made contiguous, (D, V) for `w` (V, D); with `panel`, (ceil(V / panel), D, panel): the transposes
    of each `panel` rows one after another, the last zero-padded. numpy copies the blocks, one thread per core,
    straight into the buffer of the new MLX array (MLX's CPU copy of a transposed view runs at about 0.2 GB/s:
    3.6 s for the medium checkpoint's 625 MB head; this way about 1 GB/s on this project's 2 cores)."""
    V, D = w.shape
    if w.dtype not in (mx.float32, mx.float16):  # numpy has no bfloat16
        if panel is None:
            return mx.contiguous(w.T)
        padded = mx.concatenate([w, mx.zeros((-V % panel, D), w.dtype)])
        return mx.contiguous(padded.reshape(-1, panel, D).transpose(0, 2, 1))
    src = np.asarray(w)
    out = mx.zeros((D, V) if panel is None else (-(-V // panel), D, panel), dtype=w.dtype)
    mx.eval(out)
    dst = np.asarray(out)  # a view: MLX documents that writes to it show in `out`
    rows = rows if panel is None else panel
    workers = min(8, os.cpu_count() or 1)

    def block(i: int) -> np.ndarray:
        return dst[:, i : i + rows] if panel is None else dst[i // panel, :, : min(panel, V - i)]

    def fill(first: int) -> None:
        for i in range(first * rows, V, workers * rows):
            block(i)[...] = src[i : i + rows].T

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, range(workers)))
    return out


class InputMajorLinear(nn.Module):
    """A float Linear stored input-major, (in, out). On MLX's CPU backend a product of a few rows with a weight at
    least as wide as it is deep runs faster against this layout: measured on this project's CPU, 1.2-2.6x with
    OpenBLAS (a 1,536 x 1,024 projection of one row: 0.70 -> 0.27 ms) and about 1.9x with the bundled BLAS; a
    deep one (down_proj) runs slower with OpenBLAS and keeps its layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = transposed(linear.weight)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        x = x @ self.weight_t
        return x + self.bias if "bias" in self else x


class InputMajorEmbedding(nn.Module):
    """The tied embedding stored (D, V): a lookup takes columns, the head is `x @ weight_t` (one row against the
    medium checkpoint's 152,681 x 1,024 head in float32: 84 -> 63 ms with OpenBLAS on this project's CPU)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight_t = transposed(embedding.weight)

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


# OpenBLAS (0.3.x) multiplies row-major float32 matrices itself, without packing them and on one thread, when
# m * n * k is at most this and its core has AVX-512 (`sgemm_direct_performant`); each output is then one
# sequential sum over k, whatever the number of rows in the call.
DIRECT_SGEMM_MNK = 2 * 350 * 512
DIRECT_SGEMM_CORES = ("skylakex", "cooperlake", "sapphirerapids")
PANEL = 64  # vocabulary rows per head panel: the direct kernel's widest column block
GROUP_ROWS = 4  # rows per product at most: the direct kernel's row block
MLX_BATCH_ELEMENTS = 2**31  # MLX 0.32.4's CPU matmul offsets a broadcast operand in 32 bits (wrong sums past it)


def openblas_core() -> str | None:
    """The core OpenBLAS runs on when it is this process's BLAS (say, preloaded), lower case; else None."""
    try:
        corename = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError, TypeError):
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode().lower()


def panel_product(
    x: mx.array, panels: mx.array, group_rows: int, groups_per_product: int, stream: mx.Stream | None = None
) -> mx.array:
    """x (T, D) against panels (P, D, N) -> (T, P * N): one product per panel and group of at most `group_rows`
    rows (the groups of one panel one after another, so the panel is read from memory once), at most
    `groups_per_product` groups to an MLX product."""
    T, D = x.shape
    G = -(-T // group_rows)
    r = -(-T // G)
    with mx.stream(stream or mx.default_stream(mx.default_device())):
        if G * r > T:
            x = mx.concatenate([x, mx.zeros((G * r - T, D), x.dtype)])
        groups = x.reshape(1, G, r, D)
        parts = [groups[:, g : g + groups_per_product] @ panels[:, None] for g in range(0, G, groups_per_product)]
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)  # (P, G, r, N)
        return out.transpose(1, 2, 0, 3).reshape(G * r, -1)[:T]


class PanelEmbedding(nn.Module):
    """The tied embedding stored as panels (P, D, 64) of 64 vocabulary rows each (`transposed`): the head runs
    as products of a panel and at most `group_rows` rows, small enough for OpenBLAS's direct sgemm, which
    neither packs the head nor reads it twice. Against the medium checkpoint's head in float32 on this project's
    2 cores (the panels split over 2 streams): one row 43 -> 19 ms, 6 rows 55 -> 25 ms, 24 rows 80 -> 43 ms, 48
    rows 110 -> 108 ms. A row's logits are the same bits in any group (`rows_alike`), so a sequence's answer does
    not depend on its batch."""

    def __init__(self, embedding: nn.Embedding, panel: int = PANEL):
        super().__init__()
        self.vocab, hidden = embedding.weight.shape
        self.panels = transposed(embedding.weight, panel=panel)
        self.group_rows = max(1, min(GROUP_ROWS, DIRECT_SGEMM_MNK // (panel * hidden)))
        self.groups_per_product = max(1, (MLX_BATCH_ELEMENTS - 1) // self.panels.size)

    def __call__(self, ids: mx.array) -> mx.array:
        P, D, N = self.panels.shape
        first = (ids // N) * (D * N) + ids % N  # where each id's column starts in the flat panels
        return mx.take(self.panels.reshape(-1), first[..., None] + N * mx.arange(D, dtype=ids.dtype))

    def as_linear(self, x: mx.array) -> mx.array:
        """The head, its panels split over the calling thread's CPU streams (`vision.stream_spans`: the direct
        kernel runs on one thread per product), the same bits as on one."""
        *lead, D = x.shape
        x = x.reshape(-1, D)
        parts = [
            panel_product(x, self.panels[a:b], self.group_rows, self.groups_per_product, stream=s)
            for s, a, b in stream_spans(self.panels.shape[0])
        ]
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return out[:, : self.vocab].reshape(*lead, self.vocab)

    def rows_alike(self) -> bool:
        """Whether rows get the same bits alone as in a full group (checked against two panels: the BLAS chooses
        its kernel by the product's shape, the same for every panel)."""
        panels = self.panels[:2]
        x = mx.random.normal((self.group_rows, panels.shape[1]), key=mx.random.key(0)).astype(panels.dtype)
        together = panel_product(x, panels, self.group_rows, 1)
        return all(
            mx.array_equal(panel_product(x[i : i + 1], panels, self.group_rows, 1)[0], together[i]).item()
            for i in {0, self.group_rows - 1}
        )


def cpu_head(embedding: nn.Embedding, panels: bool | None = None) -> nn.Module:
    """The head for the CPU backend: in panels where OpenBLAS's direct sgemm serves them (`panels` None: where
    this process's OpenBLAS runs an AVX-512 core, the head is float32 and a row's logits do not depend on its
    group), else input-major."""
    if panels is None:
        panels = embedding.weight.dtype == mx.float32 and openblas_core() in DIRECT_SGEMM_CORES
    if panels and (head := PanelEmbedding(embedding)).rows_alike():
        return head
    return InputMajorEmbedding(embedding)


def store_input_major(model: Qwen2Model, panels: bool | None = None) -> None:
    """For the CPU backend: the decoder's wide float projections (out >= in) stored input-major and the tied
    head as `cpu_head` chooses, module by module (memory grows by one matrix at most)."""
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, child in list(module.children().items()):
                if type(child) is nn.Linear and child.weight.shape[0] >= child.weight.shape[1]:
                    module[name] = InputMajorLinear(child)
                    mx.eval(module[name].parameters())
    if type(model.embed_tokens) is nn.Embedding:
        model.embed_tokens = cpu_head(model.embed_tokens, panels)
        mx.eval(model.embed_tokens.parameters())


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

    def __call__(self, x, cos, sin, mask, kv=None, at: Where | None = None):
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
        out = attend(q, view[:, 0], view[:, 1], self.scale, mask)
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

    def __call__(self, x, cos, sin, mask, kv=None, at=None):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, at)
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
    ) -> tuple[mx.array, list[mx.array]]:
        """Returns the hidden states before the final norm (B, T, D) and the updated K|V buffers."""
        t = self.config
        cos, sin = rope_tables(positions, t.head_dim, t.rope_theta, embeds.dtype)
        cos, sin = qkv_tables(cos, sin, t.num_attention_heads + t.num_key_value_heads, t.num_key_value_heads)
        mask = additive_mask(mask, embeds.dtype)
        x, new_kv = embeds, []
        for i, layer in enumerate(self.model.layers):
            x, layer_kv = layer(x, cos, sin, mask, None if kv is None else kv[i], at)
            new_kv.append(layer_kv)
        return x, new_kv

    def logits(self, hidden: mx.array) -> mx.array:
        """Final RMSNorm, tied head, float32 logits; call it on the rows you need only."""
        return self.model.embed_tokens.as_linear(self.model.norm(hidden)).astype(mx.float32)
