"""Every numeric piece of the forward pass against an independent float64 numpy version written here.

The numpy code follows docs/model.md §6, docs/model.md §7, docs/model.md §10.2-§10.3 and docs/training.md §2.2 directly
(loops over pixels, pairs, heads and mask entries) and calls none of the helpers under test. MLX runs in float32, so the
tolerances are float32 rounding with headroom: 1e-5 absolute on O(1) values unless a test says otherwise.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_locate.cache import Where
from mlx_locate.config import TextConfig, VisionConfig
from mlx_locate.masks import BLOCK, step_mask, step_positions, training_mask
from mlx_locate.network import attention, cpu
from mlx_locate.network.cpu import (
    InputMajorEmbedding,
    PanelEmbedding,
    cpu_head,
    openblas_core,
    store_input_major,
    transposed,
)
from mlx_locate.network.language import (
    Attention,
    DecoderLayer,
    LanguageModel,
    additive_mask,
    apply_rope,
    fuse_linears,
    fuse_projections,
    qkv_tables,
    rope_tables,
)
from mlx_locate.network.projector import make_connector, merge_2x2, run_connector
from mlx_locate.network.vision import Block, PosEmb, VisionTower, apply_rope2d, bicubic_matrix, gelu_tanh, rope2d_tables

ATOL = 1e-5


# ---------------------------------------------------------------- float64 reference pieces


def to_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def randomize(module: nn.Module, seed: int, std: float = 0.3) -> dict[str, np.ndarray]:
    """Random normal weights (norm weights around 1); returns them as float64 numpy, by name."""
    rng = np.random.default_rng(seed)
    flat = dict(tree_flatten(module.parameters()))
    new = {}
    for name, p in flat.items():
        w = rng.normal(0.0, std, p.shape)
        if "norm" in name and name.endswith("weight"):
            w = 1.0 + 0.1 * rng.normal(size=p.shape)
        new[name] = mx.array(w.astype(np.float32))
    module.load_weights(list(new.items()), strict=True)
    return {k: to_np(v) for k, v in new.items()}


def keys_cubic(t: float, a: float = -0.75) -> float:
    t = abs(t)
    if t <= 1:
        return (a + 2) * t**3 - (a + 3) * t**2 + 1
    if t < 2:
        return a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a
    return 0.0


def torch_bicubic(table: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """F.interpolate(mode="bicubic", align_corners=False) of an (H, W, C) table, pixel by pixel."""
    in_h, in_w, _ = table.shape

    def taps(o: int, size_in: int, size_out: int) -> list[tuple[int, float]]:
        s = (o + 0.5) * size_in / size_out - 0.5
        i0 = math.floor(s)
        f = s - i0
        return [(min(max(i0 + d, 0), size_in - 1), keys_cubic(f - d)) for d in (-1, 0, 1, 2)]

    out = np.zeros((out_h, out_w, table.shape[2]))
    for y in range(out_h):
        for x in range(out_w):
            for iy, wy in taps(y, in_h, out_h):
                for ix, wx in taps(x, in_w, out_w):
                    out[y, x] += wy * wx * table[iy, ix]
    return out


def np_rope2d(x: np.ndarray, h: int, w: int, theta: float = 10000.0) -> np.ndarray:
    """x (h*w, H, D): pair j = (2j, 2j+1) as a complex number, rotated by the column (even j) or row (odd j)."""
    out = np.empty_like(x)
    D = x.shape[-1]
    for p in range(h * w):
        r, c = divmod(p, w)
        for j in range(D // 2):
            m = j // 2
            angle = (c if j % 2 == 0 else r) * theta ** (-4.0 * m / D)
            z = (x[p, :, 2 * j] + 1j * x[p, :, 2 * j + 1]) * np.exp(1j * angle)
            out[p, :, 2 * j], out[p, :, 2 * j + 1] = z.real, z.imag
    return out


def np_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of x (..., T, D) at explicit positions."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2) / D)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rotated * sin


def np_layernorm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_gelu_tanh(u):
    return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


def np_gelu_erf(u):
    return 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))


def np_silu(u):
    return u / (1 + np.exp(-u))


def np_attention(q, k, v, mask, n_kv):
    """q (H, T, D), k/v (KV, S, D), mask (T, S) bool: query head h reads kv head h // (H / KV)."""
    H, _, D = q.shape
    group = H // n_kv
    out = np.empty_like(q)
    for h in range(H):
        s = q[h] @ k[h // group].T / math.sqrt(D)
        s = np.where(mask, s, -np.inf)
        out[h] = np_softmax(s) @ v[h // group]
    return out


def np_decoder_attention(x, W, prefix, positions, mask, cfg, past=None, c=0):
    """Qwen2 attention of rows x (T, dim). `past` = (K, V) buffers (KV, U, D) already rotated; rows go at slot c."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = x.shape[0]

    def proj(name, heads):
        y = x @ W[f"{prefix}{name}.weight"].T + W[f"{prefix}{name}.bias"]
        return y.reshape(T, heads, D).transpose(1, 0, 2)

    q = np_rope(proj("q_proj", H), positions, cfg.rope_theta)
    k = np_rope(proj("k_proj", KV), positions, cfg.rope_theta)
    v = proj("v_proj", KV)
    if past is not None:
        K, V = past[0].copy(), past[1].copy()
        K[:, c : c + T], V[:, c : c + T] = k, v
        k, v = K, V
    out = np_attention(q, k, v, mask, KV).transpose(1, 0, 2).reshape(T, H * D)
    return out @ W[f"{prefix}o_proj.weight"].T


def np_decoder_layer(x, W, prefix, positions, mask, cfg):
    eps = cfg.rms_norm_eps
    h = x + np_decoder_attention(
        np_rmsnorm(x, W[f"{prefix}input_layernorm.weight"], eps), W, f"{prefix}self_attn.", positions, mask, cfg
    )
    u = np_rmsnorm(h, W[f"{prefix}post_attention_layernorm.weight"], eps)
    m = np_silu(u @ W[f"{prefix}mlp.gate_proj.weight"].T) * (u @ W[f"{prefix}mlp.up_proj.weight"].T)
    return h + m @ W[f"{prefix}mlp.down_proj.weight"].T


def np_vision_block(x, W, prefix, h, w, heads):
    L, dim = x.shape
    D = dim // heads
    qkv = np_layernorm(x, W[f"{prefix}norm0.weight"], W[f"{prefix}norm0.bias"])
    qkv = (qkv @ W[f"{prefix}wqkv.weight"].T + W[f"{prefix}wqkv.bias"]).reshape(L, 3, heads, D)
    q, k, v = np_rope2d(qkv[:, 0], h, w), np_rope2d(qkv[:, 1], h, w), qkv[:, 2]
    attn = np.stack([np_softmax(q[:, i] @ k[:, i].T / math.sqrt(D)) @ v[:, i] for i in range(heads)], axis=1)
    x = x + attn.reshape(L, dim) @ W[f"{prefix}wo.weight"].T + W[f"{prefix}wo.bias"]
    u = np_layernorm(x, W[f"{prefix}norm1.weight"], W[f"{prefix}norm1.bias"])
    u = np_gelu_tanh(u @ W[f"{prefix}mlp.fc0.weight"].T + W[f"{prefix}mlp.fc0.bias"])
    return x + u @ W[f"{prefix}mlp.fc1.weight"].T + W[f"{prefix}mlp.fc1.bias"]


def np_merge(x, h, w):
    C = x.shape[1]
    img = x.reshape(h, w, C)
    rows = [
        np.concatenate([img[2 * i, 2 * j], img[2 * i, 2 * j + 1], img[2 * i + 1, 2 * j], img[2 * i + 1, 2 * j + 1]])
        for i in range(h // 2)
        for j in range(w // 2)
    ]
    return np.stack(rows)


VISION = VisionConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 8: two (column, row) frequency pairs
    intermediate_size=48,
    patch_size=2,
    init_pos_emb_height=8,
    init_pos_emb_width=6,
)
TEXT = TextConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,  # GQA 4:1, so h // 4 differs from h % 2 and from h // 2
    intermediate_size=96,
    vocab_size=300,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)


# ---------------------------------------------------------------- docs/model.md §6.2 position table


def test_bicubic_known_weights():
    """Downscale 64 -> 32 by hand: f = 0.5, k(0.5) = 0.59375, k(1.5) = -0.09375; the left tap clamps onto 0."""
    R = bicubic_matrix(64, 32)
    assert R.shape == (32, 64)
    np.testing.assert_allclose(R[0, :4], [0.5, 0.59375, -0.09375, 0.0], atol=1e-15)
    np.testing.assert_allclose(R[5, 9:13], [-0.09375, 0.59375, 0.59375, -0.09375], atol=1e-15)
    np.testing.assert_allclose(R.sum(1), 1.0, atol=1e-12)  # no renormalisation needed: Keys weights sum to 1


@pytest.mark.parametrize(("h", "w"), [(64, 64), (36, 46), (80, 70), (2, 2), (5, 64)])
def test_position_table_resize(h, w):
    """bicubic_matrix and the PosEmb module against a per-pixel torch-semantics resize (float32: 1e-5)."""
    rng = np.random.default_rng(h * 1000 + w)
    table = rng.normal(size=(64, 64, 3))
    expected = torch_bicubic(table, h, w)
    got = np.einsum("hi,ijc,wj->hwc", bicubic_matrix(64, h), table, bicubic_matrix(64, w))
    np.testing.assert_allclose(got, expected, atol=1e-12)

    pos = PosEmb(64, 64, 3)
    pos.weight = mx.array(table.astype(np.float32))
    np.testing.assert_allclose(to_np(pos(h, w)), expected.reshape(h * w, 3), atol=ATOL)
    if (h, w) == (64, 64):
        np.testing.assert_allclose(expected, table, atol=1e-12)  # the identity at the native size


# ---------------------------------------------------------------- docs/model.md §6.3 2D RoPE


def test_rope2d_column_on_even_pairs():
    """Patch (row 0, col 1) rotates pair 0 by theta_0 = 1 rad and leaves pair 1 (the row) alone; (1, 0) the reverse."""
    cos, sin = rope2d_tables(2, 2, 8, 10000.0)
    x = mx.array(np.tile([1.0, 0.0], 4)[None, None].repeat(4, 0).astype(np.float32))  # (4, 1, 8), every pair = 1
    out = to_np(apply_rope2d(x, cos, sin))[:, 0]
    np.testing.assert_allclose(out[1, 0:2], [math.cos(1), math.sin(1)], atol=1e-6)  # col 1 -> pair 0
    np.testing.assert_allclose(out[1, 2:4], [1, 0], atol=1e-6)
    np.testing.assert_allclose(out[2, 0:2], [1, 0], atol=1e-6)  # row 1 -> pair 1
    np.testing.assert_allclose(out[2, 2:4], [math.cos(1), math.sin(1)], atol=1e-6)


@pytest.mark.parametrize(("h", "w", "D"), [(3, 5, 8), (6, 4, 72)])
def test_rope2d(h, w, D):
    x = np.random.default_rng(D).normal(size=(h * w, 3, D))
    got = apply_rope2d(mx.array(x.astype(np.float32)), *rope2d_tables(h, w, D, 10000.0))
    np.testing.assert_allclose(to_np(got), np_rope2d(x, h, w), atol=ATOL)


# ---------------------------------------------------------------- docs/model.md §6.4-§6.7 vision


def test_gelu_tanh_vs_erf():
    """The tower's tanh GELU and the connector's erf GELU each match their formula to 1e-6 and differ by ~1e-3."""
    u = np.linspace(-6, 6, 2001)
    x = mx.array(u.astype(np.float32))
    tanh_form, erf_form = np_gelu_tanh(u), np_gelu_erf(u)
    np.testing.assert_allclose(to_np(gelu_tanh(x)), tanh_form, atol=1e-6)
    connector_gelu = make_connector(4, 4)[2]
    np.testing.assert_allclose(to_np(connector_gelu(x)), erf_form, atol=1e-6)
    gap = np.abs(tanh_form - erf_form).max()
    assert 1e-4 < gap < 1e-2, gap  # large enough that swapping the two would fail the checks above


def test_vision_block():
    h, w = 3, 4
    block = Block(VISION)
    W = randomize(block, seed=1)
    x = np.random.default_rng(2).normal(size=(h * w, VISION.hidden_size))
    cos, sin = rope2d_tables(h, w, VISION.head_dim, VISION.rope_theta)
    got = block(mx.array(x.astype(np.float32))[None], cos[None], sin[None])[0]
    np.testing.assert_allclose(to_np(got), np_vision_block(x, W, "", h, w, VISION.num_attention_heads), atol=1e-4)


def test_vision_attention_split_over_cpu_streams(monkeypatch):
    """Heads split over CPU streams, and queries in chunks within the score budget, give the single call's result
    to float32 rounding (a BLAS may sum a product of fewer rows in another order), against float64 too."""
    rng = np.random.default_rng(31)
    q, k, v = (rng.normal(size=(1, 5, 37, 8)) for _ in range(3))
    qm, km, vm = (mx.array(t.astype(np.float32)) for t in (q, k, v))
    scale = 8**-0.5
    whole = mx.fast.scaled_dot_product_attention(qm, km, vm, scale=scale)
    sdpa, calls = mx.fast.scaled_dot_product_attention, []
    monkeypatch.setattr(
        mx.fast, "scaled_dot_product_attention", lambda *a, **kw: calls.append((a, kw)) or sdpa(*a, **kw)
    )
    monkeypatch.setattr(cpu, "cpu_streams", lambda: tuple(mx.new_stream(mx.cpu) for _ in range(3)))
    split = attention.image_attention(qm, km, vm, scale)
    assert len(calls) == 3 and all(kw["stream"] is not None for _, kw in calls)
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-5, atol=1e-6)
    expected = np_attention(q[0], k[0], v[0], np.ones((37, 37), dtype=bool), 5)
    np.testing.assert_allclose(to_np(split[0]), expected, atol=ATOL)
    calls.clear()
    budget = attention.SCORE_BYTES * 2 * 37 * 10 * 3  # 10 query rows for 2 heads, 20 for 1, on each of 3 streams
    chunked = attention.image_attention(qm, km, vm, scale, score_budget=budget)
    assert len(calls) == 4 + 2 + 4  # heads 2, 1, 2 over 3 streams
    held = [args[0].shape[1] * args[0].shape[2] * args[1].shape[2] * attention.SCORE_BYTES for args, _ in calls]
    assert max(held) <= budget // 3
    np.testing.assert_allclose(np.array(chunked), np.array(whole), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "where, dtype, head_dim, version, expected",
    [
        ("metal", mx.bfloat16, 72, (0, 32, 4), (attention.Path.FUSED, 72)),  # sdpa_full takes 72 since 0.32.1
        ("metal", mx.float32, 72, (0, 32, 4), (attention.Path.FUSED, 72)),
        ("metal", mx.bfloat16, 72, (0, 30, 0), (attention.Path.PADDED, 80)),  # before: 64, 80 and 128 only
        ("metal", mx.bfloat16, 128, (0, 30, 0), (attention.Path.FUSED, 128)),
        ("metal", mx.bfloat16, 160, (0, 32, 4), (attention.Path.CHUNKED, 160)),
        ("cuda", mx.bfloat16, 72, (0, 32, 4), (attention.Path.FUSED, 72)),  # cuDNN: half precision, 8 | D <= 128
        ("cuda", mx.bfloat16, 70, (0, 32, 4), (attention.Path.PADDED, 72)),
        ("cuda", mx.float32, 72, (0, 32, 4), (attention.Path.CHUNKED, 72)),
        ("cpu", mx.float32, 72, (0, 32, 4), (attention.Path.CHUNKED, 72)),
        ("cpu", mx.bfloat16, 64, (0, 32, 4), (attention.Path.CHUNKED, 64)),
    ],
)
def test_attention_path_by_backend(where, dtype, head_dim, version, expected):
    """Which path the tower's attention takes on each backend (a fused kernel, one of a padded size, or the
    fallback in chunks); the tower's 72-wide heads, 26,000 queries."""
    assert attention.attention_path(where, dtype, head_dim, 26_000, version) == expected
    assert attention.attention_path(where, dtype, head_dim, 4, version)[0] is attention.Path.CHUNKED or where == "cuda"


def test_padded_heads_equal_the_unpadded_attention(monkeypatch):
    """Heads padded with zeros from 72 to 80 (q, k and v; the output sliced, the scale of 72 kept) give the same
    attention to float32 rounding."""
    rng = np.random.default_rng(32)
    q, k, v = (mx.array(rng.normal(size=(2, 3, 50, 72)).astype(np.float32)) for _ in range(3))
    scale = 72**-0.5
    whole = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    monkeypatch.setattr(attention, "attention_path", lambda *a: (attention.Path.PADDED, 80))
    padded = attention.image_attention(q, k, v, scale)
    assert padded.shape == whole.shape
    np.testing.assert_allclose(np.array(padded), np.array(whole), rtol=1e-5, atol=1e-6)


def test_vision_block_padded_batch_equals_each_image_alone():
    """Training runs images of several grids as one padded batch; a key mask keeps each to its own patches."""
    block = Block(VISION)
    W = randomize(block, seed=5)
    rng = np.random.default_rng(6)
    grids, N = [(3, 4), (2, 2)], 12
    xs, coss, sins, valid = [], [], [], []
    for h, w in grids:
        cos, sin = (np.array(t) for t in rope2d_tables(h, w, VISION.head_dim, VISION.rope_theta))
        pad = N - h * w
        xs.append(np.pad(rng.normal(size=(h * w, VISION.hidden_size)), ((0, pad), (0, 0))))
        coss.append(np.pad(cos, ((0, pad), (0, 0)), constant_values=1.0))
        sins.append(np.pad(sin, ((0, pad), (0, 0))))
        valid.append(np.arange(N) < h * w)
    mask = mx.array(np.stack(valid))[:, None, None, :]
    got = to_np(
        block(mx.array(np.stack(xs).astype(np.float32)), mx.array(np.stack(coss)), mx.array(np.stack(sins)), mask)
    )
    for i, (h, w) in enumerate(grids):
        alone = np_vision_block(xs[i][: h * w], W, "", h, w, VISION.num_attention_heads)
        np.testing.assert_allclose(got[i, : h * w], alone, atol=1e-4)


def test_vision_tower_merge_and_connector():
    """Patch linear + resized table + 2 blocks + final LN, then the 2x2 merge and LN -> Linear -> erf GELU -> Linear."""
    h, w, p = 4, 6, VISION.patch_size
    tower = VisionTower(VISION)
    W = randomize(tower, seed=3)
    patches = np.random.default_rng(4).normal(size=(h * w, 3, p, p))
    x = patches.reshape(h * w, -1) @ W["patch_embed.proj.weight"].T + W["patch_embed.proj.bias"]
    x = x + torch_bicubic(W["patch_embed.pos_emb.weight"], h, w).reshape(h * w, -1)
    for i in range(VISION.num_hidden_layers):
        x = np_vision_block(x, W, f"encoder.blocks.{i}.", h, w, VISION.num_attention_heads)
    x = np_layernorm(x, W["encoder.final_layernorm.weight"], W["encoder.final_layernorm.bias"])
    got = tower(mx.array(patches.astype(np.float32)), (h, w))
    np.testing.assert_allclose(to_np(got), x, atol=1e-4)

    connector = make_connector(4 * VISION.hidden_size, 16)
    C = randomize(nn.Sequential(*connector), seed=5)  # keys layers.{0,1,3}.*
    m = np_merge(x, h, w)
    y = np_layernorm(m, C["layers.0.weight"], C["layers.0.bias"])
    y = np_gelu_erf(y @ C["layers.1.weight"].T + C["layers.1.bias"])
    y = y @ C["layers.3.weight"].T + C["layers.3.bias"]
    np.testing.assert_allclose(to_np(run_connector(connector, merge_2x2(got, (h, w)))), y, atol=1e-4)


def test_merge_2x2_layout():
    h, w, C = 4, 6, 3
    x = np.arange(h * w * C, dtype=np.float64).reshape(h * w, C)
    got = to_np(merge_2x2(mx.array(x.astype(np.float32)), (h, w)))
    np.testing.assert_array_equal(got, np_merge(x, h, w))
    # merged token (0, 1) = patches (0,2), (0,3), (1,2), (1,3) in raster order
    np.testing.assert_array_equal(got[1].reshape(4, C)[:, 0], [2 * C, 3 * C, (w + 2) * C, (w + 3) * C])


# ---------------------------------------------------------------- docs/model.md §7 language model


def test_rmsnorm():
    layer = DecoderLayer(TEXT)
    W = randomize(layer, seed=6)
    x = np.random.default_rng(7).normal(0, 3, size=(5, TEXT.hidden_size))
    got = layer.input_layernorm(mx.array(x.astype(np.float32)))
    np.testing.assert_allclose(to_np(got), np_rmsnorm(x, W["input_layernorm.weight"], TEXT.rms_norm_eps), atol=ATOL)
    # statistics in float32 on bf16 input: within one bf16 rounding of the exact result (2^-8 relative)
    xb = mx.array(x.astype(np.float32)).astype(mx.bfloat16) * 1000
    layer.set_dtype(mx.bfloat16)
    ref = np_rmsnorm(to_np(xb), to_np(layer.input_layernorm.weight), TEXT.rms_norm_eps)
    np.testing.assert_allclose(to_np(layer.input_layernorm(xb)), ref, rtol=2**-7, atol=2**-7)


def test_rope_explicit_positions():
    """Rotate-half RoPE at repeated and shifted positions (a block's anchor shares the last token's position).

    The tables are float32 as in the reference, so the angle carries ~pos * 2^-24 rad of error: 5e-5 up to 600.
    """
    positions = np.array([0, 1, 2, 3, 3, 4, 5, 9, 100, 599])
    x = np.random.default_rng(8).normal(size=(1, 2, len(positions), 16))
    cos, sin = rope_tables(mx.array(positions, dtype=mx.int32), 16, 1e6, mx.float32)
    got = apply_rope(mx.array(x.astype(np.float32)), cos, sin)
    np.testing.assert_allclose(to_np(got), np_rope(x, positions.astype(np.float64), 1e6), atol=5e-5)
    assert np.allclose(to_np(got)[..., 0, :], x[..., 0, :], atol=1e-6)  # position 0 is the identity


def random_mask(rng, T, S):
    mask = rng.random((T, S)) < 0.5
    mask[np.arange(T), rng.integers(0, S, T)] = True  # every row attends somewhere
    return mask


def decoder_tables(positions: np.ndarray) -> tuple[mx.array, mx.array]:
    cos, sin = rope_tables(mx.array(positions, dtype=mx.int32), TEXT.head_dim, TEXT.rope_theta, mx.float32)
    KV = TEXT.num_key_value_heads
    return qkv_tables(cos, sin, TEXT.num_attention_heads + KV, KV)


def test_qkv_tables_rotate_q_and_k_and_pass_v_exactly():
    """q|k|v heads in one layout: one RoPE application rotates q and k as `rope_tables` does and leaves v bit-exact."""
    H, KV, D = TEXT.num_attention_heads, TEXT.num_key_value_heads, TEXT.head_dim
    positions = np.array([0, 3, 3, 17, 250])
    x = np.random.default_rng(7).normal(size=(1, len(positions), H + 2 * KV, D)).astype(np.float32)
    got = to_np(apply_rope(mx.array(x), *decoder_tables(positions)))
    rotated = np_rope(x[0, :, : H + KV].transpose(1, 0, 2).astype(np.float64), positions, TEXT.rope_theta)
    np.testing.assert_allclose(got[0, :, : H + KV], rotated.transpose(1, 0, 2), atol=5e-5)
    np.testing.assert_array_equal(got[0, :, H + KV :], x[0, :, H + KV :])


@pytest.mark.parametrize("additive", [False, True])
def test_attention_gqa_mask(additive):
    """A boolean mask and its additive form (0 / lowest float) give the same attention."""
    attn = Attention(TEXT)
    W = randomize(attn, seed=9)
    rng = np.random.default_rng(10)
    T = 7
    x = rng.normal(size=(T, TEXT.hidden_size))
    positions = np.array([4, 5, 6, 6, 7, 8, 9])
    mask = random_mask(rng, T, T)
    given = additive_mask(mx.array(mask), mx.float32) if additive else mx.array(mask)
    got, _ = attn(mx.array(x[None].astype(np.float32)), *decoder_tables(positions), given)
    expected = np_decoder_attention(x, W, "", positions.astype(np.float64), mask, TEXT)
    np.testing.assert_allclose(to_np(got[0]), expected, atol=ATOL)


def test_attention_writes_cache_at_slot_c():
    """With a K|V buffer the rows land at slots c..c+T-1 and attention reads the whole (masked) buffer."""
    attn = Attention(TEXT)
    W = randomize(attn, seed=11)
    rng = np.random.default_rng(12)
    T, U, c = 4, 16, 5
    KV, D = TEXT.num_key_value_heads, TEXT.head_dim
    past = rng.normal(size=(KV, U, D)), rng.normal(size=(KV, U, D))
    x = rng.normal(size=(T, TEXT.hidden_size))
    positions = np.arange(c, c + T)
    mask = random_mask(rng, T, U)
    kv = mx.array(np.stack(past)[None].astype(np.float32))  # (1, 2, KV, U, D)
    at = Where(mx.array([0]), mx.array([c]), dense=True)
    got, buffer = attn(mx.array(x[None].astype(np.float32)), *decoder_tables(positions), mx.array(mask), kv, at)
    expected = np_decoder_attention(x, W, "", positions.astype(np.float64), mask, TEXT, past, c)
    np.testing.assert_allclose(to_np(got[0]), expected, atol=ATOL)
    assert buffer.shape == (1, 2, KV, U, D)
    untouched = np.r_[0:c, c + T : U]
    for half, old in zip(to_np(buffer[0]), past, strict=True):
        np.testing.assert_array_equal(half[:, untouched], old.astype(np.float32)[:, untouched])


@pytest.mark.parametrize("fused", [False, True])
def test_decoder_layer(fused):
    layer = DecoderLayer(TEXT)
    W = randomize(layer, seed=13)
    if fused:
        fuse_projections([layer])
    rng = np.random.default_rng(14)
    T = 9
    x = rng.normal(size=(T, TEXT.hidden_size))
    positions = np.arange(T)
    mask = np.tril(np.ones((T, T), dtype=bool))
    got, _ = layer(mx.array(x[None].astype(np.float32)), *decoder_tables(positions), mx.array(mask))
    np.testing.assert_allclose(to_np(got[0]), np_decoder_layer(x, W, "", positions, mask, TEXT), atol=1e-4)


@pytest.mark.parametrize("panels", [False, True])
def test_input_major_storage_keeps_every_output(panels, monkeypatch):
    """The CPU layout: wide float projections stored (in, out) and the tied head stored (D, V) or in panels give
    the same outputs (float32, within 2e-6 of the output's largest magnitude: a BLAS may sum the other layout's
    products in another order); deep ones (down_proj) and quantized ones keep their layout."""
    lm = LanguageModel(TEXT)
    randomize(lm, seed=21)
    fuse_projections(lm.model.layers)
    nn.quantize(lm.model.layers[1], group_size=32, bits=8)
    rng = np.random.default_rng(22)
    T = 7
    x = mx.array(rng.normal(size=(1, T, TEXT.hidden_size)).astype(np.float32))
    ids = mx.array(rng.integers(0, TEXT.vocab_size, (2, 3)))
    positions, mask = mx.arange(T), mx.array(np.tril(np.ones((T, T), dtype=bool)))
    before = (lm(x, positions, mask)[0], lm.logits(x), lm.model.embed_tokens(ids))
    monkeypatch.setattr(PanelEmbedding, "rows_alike", lambda self: True)  # the layout, whatever this BLAS rounds
    store_input_major(lm.model, panels=panels)
    after = (lm(x, positions, mask)[0], lm.logits(x), lm.model.embed_tokens(ids))
    for a, b in zip(after, before, strict=True):
        b = to_np(b)
        np.testing.assert_allclose(to_np(a), b, atol=2e-6 * np.abs(b).max(), rtol=0)
    first, second = lm.model.layers
    kinds = {name: type(m).__name__ for name, m in (*first.self_attn.children().items(), *first.mlp.children().items())}
    assert kinds == {
        "qkv_proj": "InputMajorLinear",
        "o_proj": "InputMajorLinear",
        "gate_up_proj": "InputMajorLinear",
        "down_proj": "Linear",
    }
    assert isinstance(second.mlp.gate_up_proj, nn.QuantizedLinear)
    assert type(lm.model.embed_tokens) is (PanelEmbedding if panels else InputMajorEmbedding)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_transposed_copies_every_block(dtype):
    """`transposed` equals `w.T` exactly: blocks split between threads, a last partial block (1,000 rows by 64)."""
    w = mx.random.normal((1000, 24), key=mx.random.key(3)).astype(dtype)
    got = transposed(w, rows=64)
    assert got.dtype == dtype and got.shape == (24, 1000)
    assert mx.array_equal(got, w.T).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_transposed_panels_copy_every_block(dtype):
    """With `panel`, `transposed` stacks the transposes of each 64 rows, the last one zero-padded (1,000 rows:
    15 full panels and one of 40 rows), exactly."""
    w = mx.random.normal((1000, 24), key=mx.random.key(4)).astype(dtype)
    got = transposed(w, panel=64)
    assert got.dtype == dtype and got.shape == (16, 24, 64)
    padded = np.concatenate([np.array(w.astype(mx.float32)), np.zeros((24, 24), np.float32)])
    assert np.array_equal(np.array(got.astype(mx.float32)), padded.reshape(16, 64, 24).transpose(0, 2, 1))


def embedding(vocab: int, hidden: int, dtype=mx.float32, seed: int = 5) -> nn.Embedding:
    e = nn.Embedding(vocab, hidden)
    e.weight = (0.05 * mx.random.normal((vocab, hidden), key=mx.random.key(seed))).astype(dtype)
    return e


def test_panel_head_rows_alike_in_any_group():
    """The head in panels: lookups are the embedding's rows exactly; logits within 2e-6 of the largest of a
    float64 x @ W.T; a row's logits are the same bits alone, at any place among 1-24 rows, with its groups
    spread over several products and with the panels on one CPU stream or split over several. At hidden size
    1,024 a product of 24 rows against a panel goes to OpenBLAS's packed sgemm, which rounds otherwise, so with
    OpenBLAS on an AVX-512 core these checks fail when the head stops grouping rows. Where this process's BLAS
    rounds a row by its company anyway (OpenBLAS on a core without the direct kernel), `rows_alike` says so and
    `cpu_head` keeps the head input-major."""
    V, D = 1000, 1024
    emb = embedding(V, D)
    head = PanelEmbedding(emb)
    assert head.group_rows * 64 * D <= cpu.DIRECT_SGEMM_MNK
    ids = mx.array([[0, 63, 64, 999], [1, 500, 960, 2]])
    assert mx.array_equal(head(ids), emb(ids)).item()
    x = mx.random.normal((24, D), key=mx.random.key(6))
    together = head.as_linear(x)
    expected = to_np(x) @ to_np(emb.weight).T
    np.testing.assert_allclose(to_np(together), expected, atol=2e-6 * np.abs(expected).max(), rtol=0)
    if not head.rows_alike():
        assert type(cpu_head(emb)) is InputMajorEmbedding and type(cpu_head(emb, panels=True)) is InputMajorEmbedding
        return
    for T in (1, 2, 4, 5, 6, 9, 13, 17):
        assert mx.array_equal(head.as_linear(x[:T]), together[:T]).item(), T
    for i in range(24):
        assert mx.array_equal(head.as_linear(x[i : i + 1])[0], together[i]).item(), i
    assert mx.array_equal(head.as_linear(x[None, 3:9].reshape(2, 3, D)), together[3:9].reshape(2, 3, V)).item()
    head.groups_per_product = 1
    assert mx.array_equal(head.as_linear(x), together).item()
    one_stream = cpu.panel_product(x, head.panels, head.group_rows, 13)[:, :V]  # as_linear splits over streams
    assert mx.array_equal(one_stream, together).item()


def test_cpu_head_chooses_panels_only_where_they_serve(monkeypatch):
    """Panels where OpenBLAS runs an AVX-512 core and the head is float32, else input-major; panels asked for
    but rounding a row by its company fall back to input-major."""
    emb = embedding(300, 64)
    alike = PanelEmbedding.rows_alike
    monkeypatch.setattr(PanelEmbedding, "rows_alike", lambda self: True)  # the choice, whatever this BLAS rounds
    monkeypatch.setattr(cpu, "openblas_core", lambda: "cooperlake")
    assert type(cpu_head(emb)) is PanelEmbedding
    assert type(cpu_head(embedding(300, 64, mx.float16))) is InputMajorEmbedding
    assert type(cpu_head(emb, panels=False)) is InputMajorEmbedding
    monkeypatch.setattr(cpu, "openblas_core", lambda: "haswell")
    assert type(cpu_head(emb)) is InputMajorEmbedding
    monkeypatch.setattr(cpu, "openblas_core", lambda: None)
    assert type(cpu_head(emb)) is InputMajorEmbedding
    assert type(cpu_head(emb, panels=True)) is PanelEmbedding
    monkeypatch.setattr(PanelEmbedding, "rows_alike", alike)
    product = cpu.panel_product
    monkeypatch.setattr(cpu, "panel_product", lambda x, *a: product(x, *a) * (1 + 1e-3 * x.shape[0]))
    assert not PanelEmbedding(emb).rows_alike()
    assert type(cpu_head(emb, panels=True)) is InputMajorEmbedding


def test_openblas_core_seen_where_preloaded():
    """`openblas_core` names the core exactly when OpenBLAS is this process's BLAS (CI preloads it)."""
    assert (openblas_core() is not None) == ("openblas" in os.environ.get("LD_PRELOAD", ""))


def test_fuse_linears_quantized_and_unlike_parts():
    """Quantized parts fuse into one quantized matrix with the same outputs; parts quantized differently
    (or not alike) stay apart."""
    rng = np.random.default_rng(21)
    parts = [nn.Linear(64, n, bias=True) for n in (32, 16, 16)]
    for part in parts:
        randomize(part, seed=int(rng.integers(1000)))
    quantized = [nn.QuantizedLinear.from_linear(p, group_size=32, bits=4) for p in parts]
    fused = fuse_linears(quantized)
    assert isinstance(fused, nn.QuantizedLinear) and fused.weight.shape[0] == 64 and fused.bits == 4
    x = mx.array(rng.normal(size=(3, 64)).astype(np.float32))
    np.testing.assert_allclose(to_np(fused(x)), np.concatenate([to_np(q(x)) for q in quantized], -1), atol=1e-5)
    eight = nn.QuantizedLinear.from_linear(parts[2], group_size=32, bits=8)
    assert fuse_linears([*quantized[:2], eight]) is None
    assert fuse_linears([parts[0], quantized[1]]) is None
    assert fuse_linears([nn.Linear(64, 8, bias=False), parts[1]]) is None  # one has a bias, one not


def block_mask_formula(c: int, q: int, Q: int, U: int, block: bool) -> np.ndarray:
    """docs/model.md §10.3 entry by entry; padding rows (i >= q) see slot 0 only (a harmless non-empty row)."""
    mask = np.zeros((Q, U), dtype=bool)
    n = c + q - BLOCK if block else c + q
    for i in range(Q):
        g = c + i
        for k in range(U):
            if i >= q:
                mask[i, k] = k == 0
            elif g < n:
                mask[i, k] = k <= g
            else:
                mask[i, k] = k < n + BLOCK and k != n - 1
    return mask


@pytest.mark.parametrize("fused", [False, True])
def test_language_model_forward(fused):
    """Two layers, a block-step mask and docs/model.md §10.2 positions (anchor shares the last position); hidden and
    logits, with the checkpoint's projections and with them fused for inference."""
    lm = LanguageModel(TEXT)
    W = randomize(lm, seed=15)
    if fused:
        fuse_projections(lm.model.layers)
        assert all("qkv_proj" in layer.self_attn and "gate_up_proj" in layer.mlp for layer in lm.model.layers)
        assert not any("q_proj" in layer.self_attn or "up_proj" in layer.mlp for layer in lm.model.layers)
    rng = np.random.default_rng(16)
    ids = rng.integers(0, TEXT.vocab_size, 14)
    n = len(ids) - BLOCK  # 8 committed rows, then anchor + 5 masks
    positions = np.r_[np.arange(n), np.arange(n - 1, n + BLOCK - 1)]
    mask = block_mask_formula(0, len(ids), len(ids), len(ids), block=True)
    embeds = lm.model.embed_tokens(mx.array(ids))[None]
    hidden, _ = lm(embeds, mx.array(positions, dtype=mx.int32), mx.array(mask))
    logits = lm.logits(hidden)

    x = W["model.embed_tokens.weight"][ids]
    for i in range(TEXT.num_hidden_layers):
        x = np_decoder_layer(x, W, f"model.layers.{i}.", positions, mask, TEXT)
    expected_logits = np_rmsnorm(x, W["model.norm.weight"], TEXT.rms_norm_eps) @ W["model.embed_tokens.weight"].T
    assert logits.dtype == mx.float32
    np.testing.assert_allclose(to_np(hidden[0]), x, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(to_np(logits[0]), expected_logits, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------ docs/model.md §10.2-§10.3 and docs/training.md §2.2 masks


@pytest.mark.parametrize(
    ("c", "q", "Q", "U", "block"),
    [
        (0, 20, 20, 26, True),  # the first call: the whole prompt is the tail
        (0, 20, 32, 64, True),  # the same, padded
        (10, 6, 12, 32, True),  # empty tail
        (10, 9, 12, 32, True),  # a 3-token tail
        (10, 12, 12, 24, True),  # a full 6-token tail, view exactly n + 6
        (37, 7, 12, 256, True),
        (0, 20, 128, 256, False),  # a padded causal prefill
        (15, 1, 1, 32, False),  # an AR step
        (15, 4, 6, 32, False),  # an AR tail of 4, padded to 6
    ],
)
def test_step_mask_and_positions(c, q, Q, U, block):
    one = mx.array([block])
    got = np.array(step_mask(mx.array([c]), mx.array([q]), Q, U, one))[0, 0]
    np.testing.assert_array_equal(got, block_mask_formula(c, q, Q, U, block))
    n = c + q - BLOCK if block else c + q
    expected_pos = list(range(c, n)) + (list(range(n - 1, n + BLOCK - 1)) if block else [])
    np.testing.assert_array_equal(np.array(step_positions(mx.array([c]), mx.array([q]), Q, one))[0, :q], expected_pos)


def training_mask_formula(L: int, anchors: list[int]) -> np.ndarray:
    T = L + BLOCK * len(anchors)
    mask = np.zeros((T, T), dtype=bool)
    for r in range(T):
        for t in range(T):
            if r < L:
                mask[r, t] = t < L and t <= r
            else:
                k = (r - L) // BLOCK
                mask[r, t] = (t < L and t < anchors[k]) or (L + BLOCK * k <= t < L + BLOCK * k + BLOCK)
    return mask


@pytest.mark.parametrize(("L", "anchors"), [(10, [4]), (12, [0, 5, 11]), (9, [8, 8]), (7, [])])
def test_training_mask(L, anchors):
    np.testing.assert_array_equal(np.array(training_mask(L, anchors)), training_mask_formula(L, anchors))


def test_training_block_equals_decoding_block():
    """docs/training.md §2.3: block k's rows see what a decoding block step after n = a_k + 1 tokens sees."""
    L, anchors = 12, [3, 7, 11]
    full = np.array(training_mask(L, anchors))
    for k, a in enumerate(anchors):
        n = a + 1
        rows = full[L + BLOCK * k : L + BLOCK * (k + 1)]
        train_view = np.concatenate([rows[:, :n], rows[:, L + BLOCK * k : L + BLOCK * (k + 1)]], axis=1)
        one = mx.array([True])
        decode_view = np.array(step_mask(mx.array([0]), mx.array([n + BLOCK]), n + BLOCK, n + BLOCK, one))[0, 0, n:]
        np.testing.assert_array_equal(train_view, decode_view)
        assert not rows[:, n:L].any() and rows.sum() == BLOCK * (a + BLOCK)
