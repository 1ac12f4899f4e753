"""Sampling transform and the per-step device summaries (MODEL.md §10.4 a, §12 "Instead.").

Pure MLX functions, meant for `mx.compile`: bind the static settings with `functools.partial`, e.g.
`mx.compile(partial(block_summary, s=sampling, ids=ids))`. Each step then needs one host read:
`decide.decide_block(np.array(block_summary(logits6, seen, key)), ...)`. The summary layout lives in decide.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from .decide import TOP_K, special_ids
from .tokens import TokenIds

F32_MIN = float(np.finfo(np.float32).min)  # what top-p and top-k write into dropped logits, as the reference does


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. `temperature == 0` is greedy; `Sampling.OFFICIAL` is the model card's (§10.7)."""

    temperature: float = 0.0  # 0 = argmax (first maximum)
    top_p: float = 1.0  # nucleus mass; 1 = off
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # per distinct seen id (prompt included); 1 = off

    OFFICIAL: ClassVar[Sampling]

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError(
                f"invalid sampling settings {self}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, "
                "repetition_penalty > 0"
            )


Sampling.OFFICIAL = Sampling(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1)


def softmax(x: mx.array, chunk: int = 512) -> mx.array:
    """Float32 softmax over the last axis with a two-level sum.

    A flat float32 sum over ~152k vocabulary entries drifts by ~0.6% on MLX's CPU backend, enough to flip the
    decision thresholds (the reference's row-5 end score at 0.201 came out as 0.1998); summing chunks first keeps
    the error near 1e-6.
    """
    e = mx.exp(x - mx.max(x, axis=-1, keepdims=True))
    n = e.shape[-1] // chunk * chunk
    total = e[..., :n].reshape(*e.shape[:-1], -1, chunk).sum(axis=-1).sum(axis=-1, keepdims=True)
    if n < e.shape[-1]:
        total = total + e[..., n:].sum(axis=-1, keepdims=True)
    return e / total


def mark_seen(seen: mx.array, tokens: list[int]) -> mx.array:
    """Mark `tokens` in `seen` ((V,) bool, updated in place) for the repetition penalty; returns `seen`."""
    if not tokens:
        return seen
    seen[mx.array(tokens)] = True
    return seen


def transform_logits(logits: mx.array, seen: mx.array, s: Sampling) -> mx.array:
    """§10.4(a) steps 1-4 on (R, V) float32 logits; `seen` (V,) bool marks every id already in the sequence.

    Steps that are the identity (penalty 1, temperature 0, top_p 1, top_k 0) are skipped.
    """
    x = logits
    if s.repetition_penalty != 1.0:
        r = s.repetition_penalty
        x = mx.where(seen, mx.where(x > 0, x / r, x * r), x)
    if s.temperature > 0:
        x = x / s.temperature
    if s.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)  # descending
        cum = mx.cumsum(softmax(mx.take_along_axis(x, order, axis=-1)), axis=-1)
        # Drop everything after the first token whose cumulative mass exceeds top_p.
        drop = mx.concatenate([mx.zeros((x.shape[0], 1), dtype=mx.bool_), cum[:, :-1] > s.top_p], axis=-1)
        drop = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, drop, axis=-1)
        x = mx.where(drop, F32_MIN, x)
    if s.top_k > 0:
        k = min(s.top_k, x.shape[-1])
        kth = mx.min(mx.topk(x, k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x < kth, F32_MIN, x)
    return x


def _pick(x: mx.array, p: mx.array, key: mx.array | None, s: Sampling) -> mx.array:
    """x0 per row: argmax of p (first maximum, as torch), or a draw from p when sampling."""
    if s.temperature > 0:
        return mx.random.categorical(x, axis=-1, key=key)
    return mx.argmax(p, axis=-1)


def block_summary(logits: mx.array, seen: mx.array, key: mx.array | None, *, s: Sampling, ids: TokenIds) -> mx.array:
    """Pack what a block decision needs from its (6, V) float32 logits into a (6 * ROW_WIDTH,) float32 array.

    Per row: x0, p(x0), the top-5 ids and probabilities (descending), and p at the `decide.SPECIAL_FIELDS`
    tokens, where p = softmax of the transformed row. `key` is used only when `s.temperature > 0`.
    """
    x = transform_logits(logits, seen, s)
    p = softmax(x)  # (R, V)
    x0 = _pick(x, p, key, s)  # (R,)
    p_x0 = mx.take_along_axis(p, x0[:, None], axis=-1)  # (R, 1)
    top_ids = mx.argpartition(-p, kth=TOP_K - 1, axis=-1)[:, :TOP_K]  # (R, 5), O(V), unordered
    top_p = mx.take_along_axis(p, top_ids, axis=-1)
    order = mx.argsort(-top_p, axis=-1)
    top_ids = mx.take_along_axis(top_ids, order, axis=-1)
    top_p = mx.take_along_axis(top_p, order, axis=-1)
    special = p[:, mx.array(special_ids(ids))]  # (R, 6)
    f32 = mx.float32
    packed = mx.concatenate([x0[:, None].astype(f32), p_x0, top_ids.astype(f32), top_p, special], axis=-1)
    return packed.reshape(-1)


def ar_summary(logits: mx.array, seen: mx.array, key: mx.array | None, *, s: Sampling) -> mx.array:
    """(1, V) float32 logits of an AR step -> (2,) float32 [token, p(token)]."""
    x = transform_logits(logits, seen, s)
    p = softmax(x)
    token = _pick(x, p, key, s)  # (1,)
    p_token = mx.take_along_axis(p, token[:, None], axis=-1)  # (1, 1)
    return mx.concatenate([token.astype(mx.float32), p_token.reshape(-1)])
