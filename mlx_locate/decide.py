"""Block (parallel box decoding) and AR-step decisions, in plain Python over one host read per step.

docs/model.md §10.4-§10.7. The device packs each block's rows into a small float32 array (the step summary of
sampling.py, which also reads it back); `decide_block` turns it into the tokens to commit and what to do next.
`classify_ar` does the same for one AR token. Nothing here touches MLX, so every rule is table-testable on numpy
arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import numpy as np

from .label_trie import OUTSIDE, LabelTrie
from .masks import BLOCK
from .sampling import BLOCK_SUMMARY_SIZE, TOP_K, RowSummary, read_summary
from .tokens import TokenIds

# D_box's mark for an ambiguous coordinate (docs/model.md §10.4 b4). The reference uses id 0; -1 can never be a token,
# so it also stays a non-coordinate when tests remap the coordinate range to start at 0.
AMBIGUOUS = -1


# --- Settings ---


class Mode(Enum):
    SLOW = "slow"  # AR only
    FAST = "fast"  # block steps only; malformed boxes are committed as they are
    HYBRID = "hybrid"  # block steps; an error box falls back to AR until </box>


MODE_NAMES = tuple(m.value for m in Mode)  # what users type, in one place


class Next(Enum):
    BLOCK = "block"
    AR = "ar"
    STOP = "stop"


class Source(Enum):
    """Which decoder produced the 6 tokens handed to pattern handling (docs/model.md §10.4 d)."""

    D_BOX = "d_box"
    D_BOX_EMPTY = "d_box_empty"
    D_REF = "d_ref"
    X0 = "x0"
    GUARD = "guard"  # the end guard stopped before any decoder ran


class Event(Enum):
    BOX = "box"  # <box> x1 y1 x2 y2 </box>
    POINT = "point"  # <box> x y </box>
    EMPTY = "empty"  # <box> None </box>
    REF = "ref"  # label tokens (cut at <null>)
    END = "end"  # the block stops generation
    ERROR_BOX = "error_box"  # hybrid: verified prefix of a malformed box, AR completes it
    MALFORMED_BOX = "malformed_box"  # fast: a malformed box committed unchanged
    LABEL_REDECODE = "label_redecode"  # hybrid text fix: confident label prefix, AR re-decodes the rest


class StopReason(Enum):
    """Why generation stopped; the values are the golden cases' `stop` names where one exists."""

    IM_END = "im_end"  # an AR step produced <|im_end|>
    IM_END_BLOCK = "im_end_block"  # block pattern 1: <|im_end|> or <null> first
    HYBRID_AR_STOP = "hybrid_ar_stop"  # a hybrid AR step produced something other than a coordinate, None, </box>
    LENGTH_CAP = "length_cap"
    END_GUARD = "end_guard"
    LOOP_GUARD = "loop_guard"


@dataclass(frozen=True)
class Thresholds:
    """Every decision threshold, once (docs/model.md §10.6). Comparisons are made in float32, as the reference does."""

    empty_box_start: float = 0.7  # negative block: p0[<box>] >= this (the frame check's own 0.6 is unused)
    empty_none: float = 0.2  # negative block: p1[None] > this
    empty_box_end: float = 0.2  # negative block: p2[</box>] > this
    empty_null: float = 0.1  # negative block: p3[<null>] and p4[<null>] > this
    end_score: float = 0.2  # D_box: p5[</box>] + p5[<null>] + p5[<|im_end|>] >= this
    box_candidates: int = 4  # D_box: coordinate candidates come from the top-k of rows 1..4
    ambiguous_prob: float = 0.9  # hybrid D_box: ambiguous if the first coordinate's prob < this,
    ambiguous_spread: int = 60  # ... there are >= 2 candidates, and max - min id > this
    ref_start: float = 0.6  # D_ref: p0[<ref>] >= this
    ref_candidates: int = 5  # D_ref: the first non-coordinate of the top-k of rows 1..5
    label_prob: float = 0.5  # hybrid text fix (`redecode_labels`): label tokens below this go back to AR
    # Labels held to the asked names (docs/model.md §10.8): a row is held when the names' next ids have at least
    # this probability together, and a block's label token is replaced only by a candidate of at least this.
    label_mass: float = 0.01

    def __post_init__(self) -> None:
        for name in ("box_candidates", "ref_candidates"):
            k = getattr(self, name)
            if not 1 <= k <= TOP_K:
                raise ValueError(f"Thresholds.{name} = {k}; the block summary holds the top {TOP_K}, use 1..{TOP_K}")


@dataclass(frozen=True)
class Guards:
    """Greedy-decoding guards (docs/model.md §10.7). `Guards.STRICT` turns them all off for reference parity."""

    end_guard: bool = True  # stop before D_box when argmax p0 is <|im_end|> or <null>
    loop_guard: bool = True  # stop when a box repeats the previous one or is a sliver sharing its edges
    box_start_guard: bool = False  # D_box fails unless argmax p0 is <box>
    # D_box and D_ref take candidates only from each row's top-p nucleus (docs/model.md §14 Q6), as the official top-p
    # 0.9 does, so greedy decoding cannot read faint coordinates into label or end frames. None = off.
    nucleus: float | None = 0.9
    # Labels of a joint prompt of several categories spell one of the asked names (docs/model.md §10.8).
    label_constraint: bool = True

    STRICT: ClassVar[Guards]


Guards.STRICT = Guards(end_guard=False, loop_guard=False, box_start_guard=False, nucleus=None, label_constraint=False)


@dataclass(frozen=True)
class BlockDecision:
    tokens: list[int]  # to commit, in order; token i sits at window row i
    probs: list[float]  # the decoder's probability of each committed token at its row
    next: Next
    source: Source
    event: Event
    selected: tuple[int, ...]  # the 6 tokens handed to pattern handling (AMBIGUOUS marks a coordinate)
    stop_reason: StopReason | None = None

    @property
    def label_redecode(self) -> bool:
        """True when the following AR steps re-decode a label (pass it on to `classify_ar`)."""
        return self.event is Event.LABEL_REDECODE


# --- Decoders (docs/model.md §10.4 b, c) ---


def _f32(x: float) -> float:
    return float(np.float32(x))


def _candidates(row: RowSummary, k: int, guards: Guards) -> list[tuple[int, float]]:
    """The row's top-k (id, p) that can be decoder candidates: never a zero probability (sampling's top-p
    removed it), and with the nucleus guard only tokens inside the row's top-p nucleus (kept while the mass
    of the tokens ranked above them is at most `guards.nucleus`, as top-p keeps the token that crosses)."""
    out, mass = [], np.float32(0)
    for tok, p in row.top[:k]:
        if p <= 0 or (guards.nucleus is not None and mass > np.float32(guards.nucleus)):
            break
        out.append((tok, p))
        mass += np.float32(p)
    return out


def _d_box(
    rows: list[RowSummary], mode: Mode, ids: TokenIds, t: Thresholds, guards: Guards
) -> tuple[list[int], Source] | None:
    p0, p1, p2, p3, p4, p5 = (r.special for r in rows)
    if (
        p0[ids.box_start] >= _f32(t.empty_box_start)
        and p1[ids.none] > _f32(t.empty_none)
        and p2[ids.box_end] > _f32(t.empty_box_end)
        and p3[ids.null] > _f32(t.empty_null)
        and p4[ids.null] > _f32(t.empty_null)
    ):
        return [ids.box_start, ids.none, ids.box_end, ids.null, ids.null, ids.null], Source.D_BOX_EMPTY
    end_score = np.float32(p5[ids.box_end]) + np.float32(p5[ids.null]) + np.float32(p5[ids.im_end])
    if end_score < np.float32(t.end_score):
        return None
    if guards.box_start_guard and rows[0].argmax != ids.box_start:
        return None
    coords = []
    for row in rows[1:5]:
        cands = [(tok, p) for tok, p in _candidates(row, t.box_candidates, guards) if ids.is_coord(tok)]
        if not cands:
            return None
        first, p_first = cands[0]
        spread = max(tok for tok, _ in cands) - min(tok for tok, _ in cands)
        ambiguous = p_first < _f32(t.ambiguous_prob) and len(cands) > 1 and spread > t.ambiguous_spread
        coords.append(AMBIGUOUS if mode is Mode.HYBRID and ambiguous else first)
    return [ids.box_start, *coords, ids.box_end], Source.D_BOX


def _d_ref(rows: list[RowSummary], ids: TokenIds, t: Thresholds, guards: Guards) -> list[int] | None:
    if rows[0].special[ids.ref_start] < _f32(t.ref_start):
        return None
    words = []
    for row in rows[1:]:
        cands = [tok for tok, _ in _candidates(row, t.ref_candidates, guards) if not ids.is_coord(tok)]
        if not cands:
            return None
        words.append(cands[0])
    return [ids.ref_start, *words]


# --- Pattern handling (docs/model.md §10.4 e) ---


def _handle_pattern(s: list[int], mode: Mode, ids: TokenIds) -> tuple[list[int], Next, Event]:
    if s[0] in (ids.null, ids.im_end):
        return [ids.im_end], Next.STOP, Event.END
    if s[0] == ids.box_start and s[1] == ids.none:
        return [ids.box_start, ids.none, ids.box_end], Next.BLOCK, Event.EMPTY
    if s[0] == ids.box_start:
        m = 0
        while m < 4 and ids.is_coord(s[1 + m]):
            m += 1
        if m == 4 and s[5] == ids.box_end:
            return list(s), Next.BLOCK, Event.BOX
        if m == 2 and s[3] == ids.box_end:
            return s[:4], Next.BLOCK, Event.POINT
        if mode is Mode.FAST:
            return list(s), Next.BLOCK, Event.MALFORMED_BOX
        return s[: 1 + m], Next.AR, Event.ERROR_BOX
    if ids.null in s:
        s = s[: s.index(ids.null)]
    if len(s) >= 2 and s[-1] == s[-2] == ids.ref_end:
        s = s[:-1]
    return s, Next.BLOCK, Event.REF


def _hold_label(
    tokens: list[int],
    probs: list[float],
    rows: list[RowSummary],
    state: int,
    labels: LabelTrie,
    t: Thresholds,
    guards: Guards,
) -> tuple[list[int], list[float], bool]:
    """docs/model.md §10.8: each token inside a label is one `labels` allows at its place: the token decided, else
    the row's most probable candidate that is (of at least `t.label_mass`), else the block ends before it. Row 0
    of a block that starts inside a label was masked unless the model gave the names less than `t.label_mass`:
    there a token they do not allow lets the label go (it is no name; its item is dropped). `state` is the label
    state before the block. Returns the tokens, their probabilities and whether the block was cut."""
    tokens, probs = list(tokens), list(probs)
    for j, token in enumerate(tokens):
        if state != OUTSIDE and token not in (allowed := labels.allowed(state)):
            cands = _candidates(rows[j], t.ref_candidates, guards)
            found = [(c, p) for c, p in cands if c in allowed and p >= np.float32(t.label_mass)]
            if found:
                tokens[j], probs[j] = found[0]
            elif j > 0:
                return tokens[:j], probs[:j], True
        state = labels.after(state, tokens[j])
    return tokens, probs, False


def decide_block(
    summary: np.ndarray,
    mode: Mode,
    ids: TokenIds,
    thresholds: Thresholds = Thresholds(),
    guards: Guards = Guards(),
    redecode_labels: bool = False,
    labels: LabelTrie | None = None,
    label_state: int = OUTSIDE,
) -> BlockDecision:
    """Decide one block step from its summary (docs/model.md §10.4 b-e).

    Args:
        summary: the host copy of `sampling.block_summary`, shape (BLOCK_SUMMARY_SIZE,).
        mode: `Mode.FAST` or `Mode.HYBRID`.
        thresholds: decision thresholds (reference values by default).
        guards: `Guards.STRICT` follows the reference exactly. The end and box-start guards act here; the loop
            guard spans steps (a box may also be completed by AR), so the decode loop applies `loop_guard_trips`.
        redecode_labels: hybrid text fix. When a label block has a label token (up to its first </ref>) with
            probability below `thresholds.label_prob`, commit the row-0 token and the confident tokens after it,
            and return `Next.AR` with `Event.LABEL_REDECODE`; AR then re-decodes the label until </ref>.
            Row 0 is always committed, so the AR step has an uncached tail to run on.
        labels: the asked names a label is held to (docs/model.md §10.8), or None; `label_state` is the row's
            label state before this block (`label_trie.OUTSIDE`, or inside a label). Inside a label the step
            masked row 0 to what the label allows (where the model gives it at least `thresholds.label_mass`),
            and D_box and D_ref (which begin with `<box>` or `<ref>`) do not run.

    Returns:
        A `BlockDecision`.
    """
    if mode is Mode.SLOW:
        raise ValueError("decide_block: slow mode has no block steps; use Mode.FAST or Mode.HYBRID")
    if redecode_labels and mode is not Mode.HYBRID:
        raise ValueError(f"decide_block: redecode_labels needs Mode.HYBRID (AR steps); got {mode}")
    rows = read_summary(summary, ids)
    if len(rows) != BLOCK:
        raise ValueError(f"decide_block: expected {BLOCK_SUMMARY_SIZE} summary values, got {np.size(summary)}")

    if guards.end_guard and rows[0].argmax in (ids.im_end, ids.null):
        return BlockDecision(
            tokens=[ids.im_end],
            probs=[rows[0].prob(ids.im_end)],
            next=Next.STOP,
            source=Source.GUARD,
            event=Event.END,
            selected=(),
            stop_reason=StopReason.END_GUARD,
        )

    inside = labels is not None and label_state != OUTSIDE
    box = None if inside else _d_box(rows, mode, ids, thresholds, guards)
    if box is not None:
        s, source = box
    elif not inside and (ref := _d_ref(rows, ids, thresholds, guards)) is not None:
        s, source = ref, Source.D_REF
    else:
        s, source = [r.x0 for r in rows], Source.X0

    tokens, nxt, event = _handle_pattern(s, mode, ids)
    probs = [rows[i].prob(tok) for i, tok in enumerate(tokens)]
    if labels is not None:
        tokens, probs, cut = _hold_label(tokens, probs, rows, label_state, labels, thresholds, guards)
        if cut and mode is Mode.HYBRID:  # AR finishes the label, each step masked
            nxt, event = Next.AR, Event.LABEL_REDECODE
    stop_reason = StopReason.IM_END_BLOCK if nxt is Next.STOP else None

    if redecode_labels and event is Event.REF:
        label_len = tokens.index(ids.ref_end) + 1 if ids.ref_end in tokens else len(tokens)
        keep = 1
        while keep < label_len and probs[keep] >= thresholds.label_prob:
            keep += 1
        if keep < label_len:
            tokens, probs, nxt, event = tokens[:keep], probs[:keep], Next.AR, Event.LABEL_REDECODE

    return BlockDecision(
        tokens=tokens,
        probs=probs,
        next=nxt,
        source=source,
        event=event,
        selected=tuple(s),
        stop_reason=stop_reason,
    )


def loop_guard_trips(
    prev_box: tuple[int, int, int, int], last_box: tuple[int, int, int, int], min_side: int = 20
) -> bool:
    """True when `last_box` repeats `prev_box`, or shares its x-edges or its y-edges while one of its
    sides is under `min_side` units (docs/model.md §10.7). Boxes are (x1, y1, x2, y2) in 0..1000."""
    if tuple(prev_box) == tuple(last_box):
        return True
    px1, py1, px2, py2 = prev_box
    x1, y1, x2, y2 = last_box
    shares_edges = (px1, px2) == (x1, x2) or (py1, py2) == (y1, y2)
    return shares_edges and min(abs(x2 - x1), abs(y2 - y1)) < min_side


def classify_ar(token: int, mode: Mode, ids: TokenIds, label_redecode: bool = False) -> Next:
    """What follows a committed AR token (docs/model.md §10.5).

    slow: stop only on <|im_end|>. hybrid fallback: </box> -> block steps, a coordinate or None -> AR, anything
    else -> stop (the token stays committed). hybrid label re-decoding (`BlockDecision.label_redecode`):
    </ref> -> block steps, <|im_end|> -> stop, anything else -> AR.
    """
    if mode is Mode.SLOW:
        return Next.STOP if token == ids.im_end else Next.AR
    if mode is not Mode.HYBRID:
        raise ValueError(f"classify_ar: {mode} has no AR steps")
    if label_redecode:
        if token == ids.ref_end:
            return Next.BLOCK
        return Next.STOP if token == ids.im_end else Next.AR
    if token == ids.box_end:
        return Next.BLOCK
    if ids.is_coord(token) or token == ids.none:
        return Next.AR
    return Next.STOP
