"""Kernels for MLX's CPU backend: the decoder's wide projections and the tied head stored the way the CPU's BLAS
runs them fastest (input-major, or in panels for OpenBLAS's direct sgemm), and work split over one CPU stream per
core (MLX's CPU softmax and OpenBLAS's direct kernel each run on one thread).

`store_input_major` takes over a decoder (`language.Qwen2Model`) for the CPU; nothing here imports the model files.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MAX_CPU_STREAMS = 4


_thread_streams = threading.local()  # MLX streams belong to the thread that made them (a server's worker)


def cpu_streams() -> tuple[mx.Stream, ...]:
    """The calling thread's CPU streams, made on its first call."""
    if not hasattr(_thread_streams, "cpu"):
        _thread_streams.cpu = tuple(mx.new_stream(mx.cpu) for _ in range(min(os.cpu_count() or 1, MAX_CPU_STREAMS)))
    return _thread_streams.cpu


def stream_spans(n: int) -> list[tuple[mx.Stream, int, int]]:
    """`range(n)` split into near-equal spans (stream, start, stop), one per CPU stream of the calling thread
    (fewer when n is smaller)."""
    streams = cpu_streams()[:n]
    bounds = np.linspace(0, n, len(streams) + 1).round().astype(int)
    return [(s, int(a), int(b)) for s, a, b in zip(streams, bounds[:-1], bounds[1:], strict=True)]


def transposed(w: mx.array, rows: int = 256, panel: int | None = None) -> mx.array:
    """`w.T` made contiguous, (D, V) for `w` (V, D); with `panel`, (ceil(V / panel), D, panel): the transposes
    of each `panel` rows one after another, the last zero-padded. numpy copies the blocks, one thread per core,
    straight into the buffer of the new MLX array (MLX's own CPU copy of a transposed view is the slower way)."""
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
    least as wide as it is deep runs faster against this layout, with OpenBLAS and with the bundled BLAS; a deep
    one (down_proj) runs slower against it with OpenBLAS and keeps its layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = transposed(linear.weight)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        x = x @ self.weight_t
        return x + self.bias if "bias" in self else x


class InputMajorEmbedding(nn.Module):
    """The tied embedding stored (D, V): a lookup takes columns, the head is `x @ weight_t` (the faster layout for
    a few rows against the head with OpenBLAS)."""

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
    neither packs the head nor reads it twice (the panels split over the CPU streams). The gain is largest for a
    step's few rows and fades as the rows grow. A row's logits are the same bits in any group (`rows_alike`), so a
    sequence's answer does not depend on its batch."""

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
        """The head, its panels split over the calling thread's CPU streams (`stream_spans`: the direct
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


def store_input_major(model: nn.Module, panels: bool | None = None) -> None:
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
