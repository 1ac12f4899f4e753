"""2x2 patch merge and the `mlp1` connector (docs/model.md §6.6-§6.7)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def merge_2x2(x: mx.array, grid: tuple[int, int]) -> mx.array:
    """(..., h*w, C) in raster order -> (..., h*w/4, 4C): each row concatenates a 2x2 neighbourhood."""
    h, w = grid
    *lead, _, C = x.shape
    x = x.reshape(*lead, h // 2, 2, w // 2, 2, C).swapaxes(-4, -3)
    return x.reshape(*lead, h * w // 4, 4 * C)


def make_connector(in_dim: int, out_dim: int, eps: float = 1e-5) -> list[nn.Module]:
    """`mlp1` as the checkpoint numbers it: LayerNorm (0), Linear (1), erf GELU (2, no weights), Linear (3)."""
    return [nn.LayerNorm(in_dim, eps=eps), nn.Linear(in_dim, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim)]


def run_connector(layers: list[nn.Module], x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x
