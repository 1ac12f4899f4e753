"""Sampling transform and the step summary (docs/model.md §10.4 a, docs/model.md §12 "Instead.").

Pure MLX functions over a batch of R sequences, meant for `mx.compile`. Each sequence has its own settings, given
as arrays (`RowSampling`), so any mix of settings runs in one compiled function; which transform steps run at all
is static (`Features`: a step no sequence needs is skipped); `summary_functions` binds them and compiles.

The step summary is one record, declared here once: its layout (`COL_*`, `ROW_WIDTH`), its packers on the device
(`block_summary`, `ar_summary`, and `summarize`, which takes a forward's logits at its rows' entries), and its
readers on the host (`read_summary` for a block decision, `read_token` for an AR one). A step needs one host read
of the packed (R, width) array.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import ClassVar, NamedTuple

import mlx.core as mx
import numpy as np

from .cache import rows_bucket
from .masks import BLOCK
from .tokens import TokenIds

F32_MIN = float(np.finfo(np.float32).min)  # what top-p and top-k write into dropped logits, as the reference does


# Bounds of the settings. A positive temperature below MIN_TEMPERATURE, or a penalty outside its range, can push a
# float32 logit past the largest finite float (x / t, x / r), and the step's softmax would return NaN.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def real_number(value: object) -> bool:
    """An int or float that is not a bool (JSON `true` is not a number)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. `temperature == 0` is greedy; `Sampling.OFFICIAL` is the model card's (docs/model.md §10.7).

    Checked when made (`ValueError`); `top_k` against the vocabulary when a request is prepared."""

    temperature: float = 0.0  # 0 = argmax (first maximum), else MIN_TEMPERATURE..MAX_TEMPERATURE
    top_p: float = 1.0  # nucleus mass; 1 = off
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # per distinct seen id (prompt included); 1 = off

    OFFICIAL: ClassVar[Sampling]

    def __post_init__(self) -> None:
        floats = (self.temperature, self.top_p, self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        valid = (
            all(real_number(v) and math.isfinite(v) for v in floats)
            and isinstance(self.top_k, int)
            and not isinstance(self.top_k, bool)
            and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE)
            and 0 < self.top_p <= 1
            and self.top_k >= 0
            and low <= self.repetition_penalty <= high
        )
        if not valid:
            raise ValueError(
                f"invalid sampling settings {self}: need numbers (not booleans) with temperature 0 or "
                f"{MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}, 0 < top_p <= 1, top_k a whole number >= 0, "
                f"repetition_penalty {low:g}..{high:g}"
            )


Sampling.OFFICIAL = Sampling(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1)


# --- The step summary's layout. Per window row, ROW_WIDTH float32 values (ids < 2**24 are exact in float32):
#   [COL_X0]                 x0: argmax (first maximum) or the sampled token
#   [COL_P_X0]               p(x0)
#   [COL_TOP_IDS + i]        the TOP_K most probable ids, descending, i = 0..TOP_K-1
#   [COL_TOP_PROBS + i]      their probabilities
#   [COL_SPECIAL + i]        p at the token named SPECIAL_FIELDS[i]
# A block is masks.BLOCK rows flattened row-major: shape (BLOCK_SUMMARY_SIZE,). An AR summary is the pair
# [token, p(token)].
TOP_K = 5
SPECIAL_FIELDS = ("box_start", "box_end", "ref_start", "im_end", "null", "none")  # TokenIds field names
COL_X0 = 0
COL_P_X0 = 1
COL_TOP_IDS = 2
COL_TOP_PROBS = COL_TOP_IDS + TOP_K
COL_SPECIAL = COL_TOP_PROBS + TOP_K
ROW_WIDTH = COL_SPECIAL + len(SPECIAL_FIELDS)
BLOCK_SUMMARY_SIZE = BLOCK * ROW_WIDTH


def special_ids(ids: TokenIds) -> tuple[int, ...]:
    """The token ids of the special columns, in column order."""
    return tuple(getattr(ids, name) for name in SPECIAL_FIELDS)


@dataclass(frozen=True)
class RowSummary:
    """One window row of a block summary, as Python numbers."""

    x0: int
    p_x0: float
    top: tuple[tuple[int, float], ...]  # (id, prob), most probable first
    special: dict[int, float]  # token id -> prob, for the SPECIAL_FIELDS tokens

    @property
    def argmax(self) -> int:
        return self.top[0][0]

    def prob(self, token: int) -> float:
        """p(token) at this row if the summary holds it, else NaN."""
        if token == self.x0:
            return self.p_x0
        for t, p in self.top:
            if t == token:
                return p
        return self.special.get(token, float("nan"))


def read_summary(summary: np.ndarray, ids: TokenIds) -> list[RowSummary]:
    """Unpack a block summary (any number of rows) into `RowSummary`s."""
    rows = np.asarray(summary, dtype=np.float32).reshape(-1, ROW_WIDTH).tolist()
    specials = special_ids(ids)
    return [
        RowSummary(
            x0=int(r[COL_X0]),
            p_x0=r[COL_P_X0],
            top=tuple(
                (int(t), p)
                for t, p in zip(
                    r[COL_TOP_IDS : COL_TOP_IDS + TOP_K], r[COL_TOP_PROBS : COL_TOP_PROBS + TOP_K], strict=True
                )
            ),
            special=dict(zip(specials, r[COL_SPECIAL:ROW_WIDTH], strict=True)),
        )
        for r in rows
    ]


def read_token(summary: np.ndarray, block_shaped: bool) -> tuple[int, float]:
    """An AR sequence's token and its probability from its summary: the pair of an AR-shaped step, or the last
    window row's x0 of a block-shaped one."""
    v = np.asarray(summary)
    if block_shaped:
        v = v[BLOCK_SUMMARY_SIZE - ROW_WIDTH :]
    return int(v[COL_X0]), float(v[COL_P_X0])


def softmax(x: mx.array, chunk: int = 512) -> mx.array:
    """Float32 softmax over the last axis with a two-level sum.

    A flat float32 sum over the whole vocabulary (152k entries) drifts on MLX's CPU backend far enough to move a
    score that lies near a decision threshold across it; summing chunks first keeps the error at float32 rounding.
    """
    e = mx.exp(x - mx.max(x, axis=-1, keepdims=True))
    n = e.shape[-1] // chunk * chunk
    total = e[..., :n].reshape(*e.shape[:-1], -1, chunk).sum(axis=-1).sum(axis=-1, keepdims=True)
    if n < e.shape[-1]:
        total = total + e[..., n:].sum(axis=-1, keepdims=True)
    return e / total


def top_ids(p: mx.array, k: int, chunk: int = 512) -> mx.array:
    """The ids of the `k` largest entries of each last-axis row, unordered: (..., V) -> (..., k).

    On MLX's CPU backend a partition of the whole vocabulary is the slow part of a step. The k largest lie in the
    k chunks with the largest maxima, so there a partition runs over a maximum per chunk and then over those k
    chunks. Ties at the k-th value may pick either id, as a plain partition does. A GPU keeps the plain partition,
    which is the faster one there."""
    V = p.shape[-1]
    if V <= 4 * k * chunk or mx.default_device() != mx.cpu:
        return mx.argpartition(-p, kth=k - 1, axis=-1)[..., :k]
    n = -(-V // chunk)
    if n * chunk > V:  # p >= 0: padding with -1 never wins
        pad = mx.full((*p.shape[:-1], n * chunk - V), -1.0, dtype=p.dtype)
        p = mx.concatenate([p, pad], axis=-1)
    p = p.reshape(*p.shape[:-1], n, chunk)
    best = mx.argpartition(-p.max(axis=-1), kth=k - 1, axis=-1)[..., :k]  # (..., k) chunks
    candidates = mx.take_along_axis(p, best[..., None], axis=-2).reshape(*best.shape[:-1], k * chunk)
    j = mx.argpartition(-candidates, kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(best, j // chunk, axis=-1) * chunk + j % chunk


class RowSampling(NamedTuple):
    """Per-sequence settings as (R,) arrays; 0 / 1 / 0 / 1 where a sequence leaves a step off."""

    temperature: mx.array  # float32
    top_p: mx.array  # float32
    top_k: mx.array  # int32
    repetition_penalty: mx.array  # float32

    @classmethod
    def of(cls, settings: Sequence[Sampling]) -> RowSampling:
        return cls(
            mx.array([s.temperature for s in settings], dtype=mx.float32),
            mx.array([s.top_p for s in settings], dtype=mx.float32),
            mx.array([s.top_k for s in settings], dtype=mx.int32),
            mx.array([s.repetition_penalty for s in settings], dtype=mx.float32),
        )


class Features(NamedTuple):
    """Which transform steps any sequence of a batch needs (static: part of the compile key)."""

    penalty: bool = False
    temperature: bool = False
    top_p: bool = False
    top_k: bool = False
    labels: bool = False  # some sequence is inside a label held to the asked names (`label_mask`)

    @classmethod
    def of(cls, settings: Sequence[Sampling], labels: bool = False) -> Features:
        return cls(
            any(s.repetition_penalty != 1.0 for s in settings),
            any(s.temperature > 0 for s in settings),
            any(s.top_p < 1.0 for s in settings),
            any(s.top_k > 0 for s in settings),
            labels,
        )


class LabelMask(NamedTuple):
    """Per sequence, the ids its label allows (docs/model.md §10.8), the logit row that holds, and the least
    probability the model must give those ids together there for the mask to apply."""

    allowed: mx.array  # (R, V) bool
    at: mx.array  # (R, H) bool: the first row of a block sequence, the last of an AR one; none outside a label
    floor: mx.array  # (R,) float32


def label_mask(
    allowed: Sequence[Sequence[int] | None], ar: Sequence[bool], floor: Sequence[float], H: int, V: int
) -> LabelMask | None:
    """Per sequence, the ids its label allows (None outside a label), whether it reads its last logit row (an AR
    sequence) rather than its first (a block), and its floor; None when no sequence is inside a label."""
    if all(a is None for a in allowed):
        return None
    rows = [r for r, a in enumerate(allowed) for _ in a or ()]
    mask = mx.zeros((len(allowed), V), dtype=mx.bool_)
    mask[mx.array(rows), mx.array([t for a in allowed for t in a or ()])] = True
    at = [
        [a is not None and j == (H - 1 if last else 0) for j in range(H)] for a, last in zip(allowed, ar, strict=True)
    ]
    return LabelMask(mask, mx.array(at), mx.array(floor, dtype=mx.float32))


def _held(logits: mx.array, labels: LabelMask | None, f: Features) -> mx.array:
    """(R, H, V) logits with the ids a label forbids dropped (float32's lowest value) at its row, where the model
    gives the ids it allows at least the floor; elsewhere (the model spells no asked name) the row is left as
    it is, and the decoder lets the label go."""
    if not f.labels:
        return logits
    at = labels.at
    row = mx.take_along_axis(logits, mx.argmax(at.astype(mx.int32), axis=1)[:, None, None], axis=1)[:, 0]  # (R, V)
    mass = mx.sum(mx.where(labels.allowed, softmax(row), 0.0), axis=-1)  # (R,)
    hold = at & (mass >= labels.floor)[:, None]
    return mx.where(hold[..., None] & ~labels.allowed[:, None, :], F32_MIN, logits)


def _per_row(x: mx.array) -> mx.array:
    return x[:, None, None]


def transform_logits(logits: mx.array, seen: mx.array | None, rs: RowSampling, f: Features) -> mx.array:
    """docs/model.md §10.4(a) steps 1-4 on (R, H, V) float32 logits; `seen` (R, V) bool marks every id already in each
    sequence (needed with `f.penalty`). A sequence whose setting is off gets that step as the identity, exactly."""
    x = logits
    if f.penalty:
        r = _per_row(rs.repetition_penalty)
        x = mx.where(seen[:, None, :] & (r != 1.0), mx.where(x > 0, x / r, x * r), x)
    if f.temperature:
        t = _per_row(rs.temperature)
        x = x / mx.where(t > 0, t, 1.0)
    if f.top_p:
        order = mx.argsort(-x, axis=-1)  # descending
        cum = mx.cumsum(softmax(mx.take_along_axis(x, order, axis=-1)), axis=-1)
        # Drop everything after the first token whose cumulative mass exceeds top_p.
        top_p = _per_row(rs.top_p)
        after = (cum[..., :-1] > top_p) & (top_p < 1.0)
        drop = mx.concatenate([mx.zeros((*x.shape[:-1], 1), dtype=mx.bool_), after], axis=-1)
        drop = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, drop, axis=-1)
        x = mx.where(drop, F32_MIN, x)
    if f.top_k:
        V = x.shape[-1]
        k = _per_row(mx.minimum(rs.top_k, V))
        kth = mx.take_along_axis(mx.sort(x, axis=-1), mx.clip(V - k, 0, V - 1), axis=-1)  # the k-th largest
        x = mx.where((k > 0) & (x < kth), F32_MIN, x)
    return x


def _pick(x: mx.array, p: mx.array, keys: mx.array | None, rs: RowSampling, f: Features, last_alone: mx.array | None):
    """x0 (R, H): the argmax of p (first maximum, as torch), or a draw from p for sequences that sample.

    Each sequence draws with its own key (R, 2) over its own rows, so a draw never depends on the rest of the
    batch; where `last_alone` (R,) is set (an AR sequence in a block-shaped step), its last row is drawn as a
    (1, V) row, exactly as in an AR-shaped step."""
    greedy = mx.argmax(p, axis=-1).astype(mx.int32)
    if not f.temperature:
        return greedy
    drawn = []
    for r in range(x.shape[0]):
        rows = mx.random.categorical(x[r], axis=-1, key=keys[r]).astype(mx.int32)
        if last_alone is not None:
            alone = mx.random.categorical(x[r, -1:], axis=-1, key=keys[r]).astype(mx.int32)
            rows = mx.where(last_alone[r] & (mx.arange(rows.shape[0]) == rows.shape[0] - 1), alone[-1], rows)
        drawn.append(rows)
    return mx.where(_per_row(rs.temperature)[..., 0] > 0, mx.stack(drawn), greedy)


def block_summary(
    logits: mx.array,
    seen: mx.array | None,
    keys: mx.array | None,
    rs: RowSampling,
    ar_rows: mx.array,
    labels: LabelMask | None = None,
    *,
    f: Features,
    ids: TokenIds,
) -> mx.array:
    """Pack what each sequence's block decision needs from its (6, V) float32 logits: (R, H, V) -> (R, H * ROW_WIDTH).

    Per row: x0, p(x0), the top-5 ids and probabilities (descending), and p at the `SPECIAL_FIELDS`
    tokens, where p = softmax of the transformed row. `ar_rows` (R,) bool marks AR sequences in the step: only
    their last row's x0 and p(x0) are read. With `f.labels`, the ids `labels` forbids are dropped first.
    """
    x = transform_logits(_held(logits, labels, f), seen, rs, f)
    p = softmax(x)  # (R, H, V)
    x0 = _pick(x, p, keys, rs, f, ar_rows)  # (R, H)
    p_x0 = mx.take_along_axis(p, x0[..., None], axis=-1)  # (R, H, 1)
    top = top_ids(p, TOP_K)  # (R, H, 5), unordered
    top_p = mx.take_along_axis(p, top, axis=-1)
    order = mx.argsort(-top_p, axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    top_p = mx.take_along_axis(top_p, order, axis=-1)
    special = p[..., mx.array(special_ids(ids))]  # (R, H, 6)
    f32 = mx.float32
    packed = mx.concatenate([x0[..., None].astype(f32), p_x0, top.astype(f32), top_p, special], axis=-1)
    return packed.reshape(packed.shape[0], -1)


def ar_summary(
    logits: mx.array,
    seen: mx.array | None,
    keys: mx.array | None,
    rs: RowSampling,
    labels: LabelMask | None = None,
    *,
    f: Features,
):
    """(R, 1, V) float32 logits of an AR step -> (R, 2) float32 [token, p(token)]; with `f.labels`, the ids
    `labels` forbids are dropped first."""
    x = transform_logits(_held(logits, labels, f), seen, rs, f)
    p = softmax(x)
    token = _pick(x, p, keys, rs, f, None)  # (R, 1)
    p_token = mx.take_along_axis(p, token[..., None], axis=-1)[..., 0]  # (R, 1)
    return mx.concatenate([token.astype(mx.float32), p_token], axis=-1)


@lru_cache(maxsize=64)
def summary_functions(features: Features, ids: TokenIds):
    """The compiled block and AR summaries for a set of transform features."""
    return (
        mx.compile(partial(block_summary, f=features, ids=ids)),
        mx.compile(partial(ar_summary, f=features)),
    )


@lru_cache(maxsize=256)
def row_sampling(settings: tuple[Sampling, ...]) -> RowSampling:
    """The per-row sampling arrays of a batch, made once per mix of settings."""
    return RowSampling.of(settings)


def summarize(
    logits: mx.array,
    index: list[int],
    settings: list[Sampling],
    keys: list[tuple[int, int]],
    ar_rows: list[bool],
    ids: TokenIds,
    *,
    block: bool,
    seen: mx.array | None = None,
    slots: list[int] | None = None,
    pad_slot: int = 0,
    allowed: list[Sequence[int] | None] | None = None,
    floors: list[float] | None = None,
) -> mx.array:
    """The summary of one forward's logits (R, H, V) at the entries `index`, one per row: (len(index), width).
    Per row: its settings, its draw's key, whether it is an AR row in a block-shaped step, (for the repetition
    penalty) its row of `seen` by `slots`, and (for a label held to the asked names, docs/model.md §10.8) the ids
    `allowed` next, or None, with its floor (`label_mask`). Rows are padded to a bucket (so the compiled summaries
    see few shapes) with other entries, greedy settings, `pad_slot`'s row of `seen` and no label."""
    n = len(index)
    R = rows_bucket(n)
    pad = R - n
    used = set(index)
    take = index + [i for i in range(logits.shape[0]) if i not in used][:pad]
    take += [index[0]] * (R - len(take))
    if take != list(range(logits.shape[0])):
        logits = mx.take(logits, mx.array(take), axis=0)
    padded = tuple(settings) + (Sampling(),) * pad
    held = None
    if allowed is not None:
        held = label_mask(allowed + [None] * pad, ar_rows + [False] * pad, floors + [0.0] * pad, *logits.shape[1:])
    features = Features.of(padded, labels=held is not None)
    block_fn, ar_fn = summary_functions(features, ids)
    rs = row_sampling(padded)
    drawn_keys = last_alone = penalized = None
    if features.temperature:  # only draws need keys, and only their AR rows read a last row alone
        drawn_keys = mx.array(keys + [(0, 0)] * pad, dtype=mx.uint32)
        last_alone = mx.array(ar_rows + [False] * pad)
    if features.penalty:
        penalized = mx.take(seen, mx.array(slots + [pad_slot] * pad), axis=0)
    if block:
        return block_fn(logits, penalized, drawn_keys, rs, last_alone, held)[:n]
    return ar_fn(logits, penalized, drawn_keys, rs, held)[:n]
