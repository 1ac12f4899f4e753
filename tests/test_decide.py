"""Block and AR decisions against the reference's golden decisions (decisions.json), plus guards and table tests."""

from __future__ import annotations

import json
import math
from functools import cache, partial

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, golden_token_ids

from mlx_locate.decide import (
    AMBIGUOUS,
    Event,
    Guards,
    Mode,
    Next,
    Source,
    StopReason,
    Thresholds,
    classify_ar,
    decide_block,
    loop_guard_trips,
)
from mlx_locate.sampling import (
    BLOCK_SUMMARY_SIZE,
    Features,
    RowSampling,
    Sampling,
    ar_summary,
    block_summary,
    read_summary,
)

DECISIONS = json.loads((GOLDEN / "decisions.json").read_text())
V = DECISIONS["vocab_size"]
BLOCKS = {b["name"]: b for b in DECISIONS["blocks"]}
NEXT = {"mtp": Next.BLOCK, "ar": Next.AR, "stop": Next.STOP}
# handle_pattern's type -> our event (fast commits malformed <box> patterns as "coord_box")
EVENTS = {
    "coord_box": {Event.BOX, Event.MALFORMED_BOX},
    "point_box": {Event.POINT},
    "empty_box": {Event.EMPTY},
    "ref_object": {Event.REF},
    "im_end": {Event.END},
    "error_box": {Event.ERROR_BOX},
}


IDS = golden_token_ids()
GREEDY = RowSampling.of([Sampling()])
_summarize = mx.compile(partial(block_summary, f=Features(), ids=IDS))
_ar = mx.compile(partial(ar_summary, f=Features()))


def golden_logits(rows: list[dict]) -> np.ndarray:
    out = np.empty((len(rows), V), dtype=np.float32)
    for i, row in enumerate(rows):
        out[i] = row["base"]
        for token, value in row["peaks"]:
            out[i, token] = value
    return out


def summarize(logits: np.ndarray) -> np.ndarray:
    return np.array(_summarize(mx.array(logits)[None], None, None, GREEDY, mx.array([False])))[0]


@cache
def golden_summary(name: str) -> np.ndarray:
    return summarize(golden_logits(BLOCKS[name]["rows"]))


FILLER = [1000 + 37 * i for i in range(8)]  # plain BPE ids, never special


def prob_row(probs: dict[int, float]) -> np.ndarray:
    """Logits whose softmax puts `probs` on the given ids, distinct small fillers below, and the rest spread flat."""
    probs = dict(probs)
    for i, token in enumerate(FILLER):
        probs.setdefault(token, 1e-3 * (1 - 0.05 * i))
    rest = 1.0 - sum(probs.values())
    assert rest > 0
    row = np.full(V, math.log(rest / (V - len(probs))), dtype=np.float64)
    for token, p in probs.items():
        row[token] = math.log(p)
    return row.astype(np.float32)


def block(*rows: dict[int, float]) -> np.ndarray:
    return summarize(np.stack([prob_row(r) for r in rows]))


c = IDS.coord_token
BOX, EBOX, REF, EREF, NULL, END, NONE = (
    IDS.box_start,
    IDS.box_end,
    IDS.ref_start,
    IDS.ref_end,
    IDS.null,
    IDS.im_end,
    IDS.none,
)
RED, WORD, THE = 2518, 3745, 279


# --- Golden decisions (strict, greedy) ---


@pytest.mark.parametrize("mode", ["hybrid", "fast"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_golden_block(name, mode):
    ref = BLOCKS[name]["reference"]
    want = ref[mode]
    d = decide_block(golden_summary(name), Mode(mode), IDS, guards=Guards.STRICT)
    assert d.tokens == want["loop"]["committed"]
    assert d.tokens == want["pattern"]["tokens"]
    assert d.next is NEXT[want["loop"]["next"]]
    assert d.source is Source(want["source"])
    assert [0 if t == AMBIGUOUS else t for t in d.selected] == want["selected"]
    assert d.event in EVENTS[want["pattern"]["type"]]
    assert (d.stop_reason is StopReason.IM_END_BLOCK) == want["pattern"]["is_terminal"]
    assert len(d.probs) == len(d.tokens) and all(0 <= p <= 1 for p in d.probs)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_golden_block_probs(name):
    """The summary's special columns agree with the reference's float32 softmax (torch's own error ~4e-4)."""
    rows = read_summary(golden_summary(name), IDS)
    ref = BLOCKS[name]["reference"]
    ours = {
        "p0[<box>]": rows[0].special[BOX],
        "p0[<ref>]": rows[0].special[REF],
        "p0[<|im_end|>]": rows[0].special[END],
        "p0[<null>]": rows[0].special[NULL],
        "p1[None]": rows[1].special[NONE],
        "p2[</box>]": rows[2].special[EBOX],
        "p3[<null>]": rows[3].special[NULL],
        "p4[<null>]": rows[4].special[NULL],
        "end_score": rows[5].special[EBOX] + rows[5].special[NULL] + rows[5].special[END],
    }
    for key, value in ours.items():
        assert value == pytest.approx(ref["probs"][key], rel=2e-3, abs=1e-9), key
    assert [r.x0 for r in rows] == ref["x0"]
    assert [r.p_x0 for r in rows] == pytest.approx(ref["probs"]["top1_prob"], rel=2e-3)


AR_CASES = [(t["name"], t["row"], t["slow"], t["hybrid"]) for t in DECISIONS["ar_tests"]] + [
    (f"{b['name']}:row0", b["rows"][0], b["reference"]["ar_row0"]["slow"], b["reference"]["ar_row0"]["hybrid"])
    for b in DECISIONS["blocks"]
]


@pytest.mark.parametrize(("name", "row", "slow", "hybrid"), AR_CASES, ids=[c[0] for c in AR_CASES])
def test_golden_ar(name, row, slow, hybrid):
    token, p = np.array(_ar(mx.array(golden_logits([row]))[None], None, None, GREEDY))[0].tolist()
    token = int(token)
    assert token == slow["token"] == hybrid["token"]
    assert 0 < p <= 1
    assert classify_ar(token, Mode.SLOW, IDS) is NEXT[slow["next"]]
    assert classify_ar(token, Mode.HYBRID, IDS) is NEXT[hybrid["next"]]


# --- Guards ---


def test_end_guard_stops_before_d_box():
    strict = decide_block(golden_summary("im_end_first_but_box_rows"), Mode.HYBRID, IDS, guards=Guards.STRICT)
    assert strict.event is Event.BOX
    guarded = decide_block(golden_summary("im_end_first_but_box_rows"), Mode.HYBRID, IDS)
    assert guarded.tokens == [END]
    assert guarded.next is Next.STOP
    assert guarded.source is Source.GUARD
    assert guarded.stop_reason is StopReason.END_GUARD
    assert guarded.probs == [pytest.approx(0.9, abs=0.01)]


@pytest.mark.parametrize("mode", [Mode.HYBRID, Mode.FAST])
def test_end_guard_on_null_first_and_not_on_box(mode):
    d = decide_block(golden_summary("null_first"), mode, IDS)
    assert (d.tokens, d.stop_reason) == ([END], StopReason.END_GUARD)
    for name in ("box_legal", "box_row0_ref", "empty_box", "ref_label", "im_end_inside_label"):
        assert decide_block(golden_summary(name), mode, IDS) == decide_block(
            golden_summary(name), mode, IDS, guards=Guards.STRICT
        ), name


def test_box_start_guard():
    guard = Guards(end_guard=False, loop_guard=False, box_start_guard=True, nucleus=None)
    d = decide_block(golden_summary("box_row0_ref"), Mode.HYBRID, IDS, guards=guard)
    assert d.source is Source.D_REF
    assert d.tokens == [REF, 1000, 1000, 1000, 1000, EBOX]
    d = decide_block(golden_summary("box_row0_text"), Mode.FAST, IDS, guards=guard)
    assert d.source is Source.X0
    # argmax p0 = <box>: the guard changes nothing; the negative block is checked before it
    for name in ("box_legal", "empty_box", "ambiguous_row1"):
        assert decide_block(golden_summary(name), Mode.HYBRID, IDS, guards=guard) == decide_block(
            golden_summary(name), Mode.HYBRID, IDS, guards=Guards.STRICT
        )


NUCLEUS_ONLY = Guards(end_guard=False, loop_guard=False, nucleus=0.9)


def label_block_with_faint_coordinates(p_word: float) -> np.ndarray:
    """A label frame (<ref> red ... </ref> <null>) whose rows 1-4 hold a coordinate at rank 2 with 0.02, and
    whose row 5 passes the end check: strict greedy D_box reads it as a box (the greedy trap)."""
    return block(
        {REF: 0.95},
        {RED: p_word, c(100): 0.02},
        {WORD: p_word, c(200): 0.02},
        {EREF: p_word, c(300): 0.02},
        {NULL: p_word, c(400): 0.02},
        {NULL: 0.95},
    )


@pytest.mark.parametrize(("p_word", "outside"), [(0.89, False), (0.91, True), (0.95, True)])
def test_nucleus_guard_keeps_faint_coordinates_out_of_label_frames(p_word, outside):
    summary = label_block_with_faint_coordinates(p_word)
    strict = decide_block(summary, Mode.FAST, IDS, guards=Guards.STRICT)
    assert strict.source is Source.D_BOX and strict.tokens == [BOX, c(100), c(200), c(300), c(400), EBOX]
    guarded = decide_block(summary, Mode.FAST, IDS, guards=NUCLEUS_ONLY)
    if outside:  # the coordinate ranks below a word holding more than 0.9: no candidate, so D_ref decides
        assert guarded.source is Source.D_REF
        assert guarded.tokens == [REF, RED, WORD, EREF]
    else:  # the word holds under 0.9: top-p keeps the next token, so the coordinate stays a candidate
        assert guarded.tokens == strict.tokens


def test_nucleus_guard_is_on_by_default_and_off_when_strict():
    assert Guards().nucleus == 0.9 and Guards.STRICT.nucleus is None
    summary = label_block_with_faint_coordinates(0.95)
    assert decide_block(summary, Mode.HYBRID, IDS).source is Source.D_REF


def test_nucleus_guard_leaves_confident_boxes_alone():
    box = block({BOX: 0.9}, {c(10): 0.95}, {c(20): 0.5, c(25): 0.3}, {c(30): 0.95}, {c(40): 0.95}, {EBOX: 0.95})
    assert decide_block(box, Mode.HYBRID, IDS, guards=NUCLEUS_ONLY) == decide_block(
        box, Mode.HYBRID, IDS, guards=Guards.STRICT
    )


@pytest.mark.parametrize(
    ("prev", "last", "trips"),
    [
        ((100, 100, 300, 300), (100, 100, 300, 300), True),  # exact repeat
        ((100, 100, 300, 300), (100, 290, 300, 300), True),  # same x-edges, height 10
        ((100, 100, 300, 300), (100, 281, 300, 300), True),  # height 19
        ((100, 100, 300, 300), (100, 280, 300, 300), False),  # height 20: not under 20
        ((100, 100, 300, 300), (281, 100, 300, 300), True),  # same y-edges, width 19
        ((100, 100, 300, 300), (280, 100, 300, 300), False),
        ((100, 100, 300, 300), (100, 500, 300, 900), False),  # same x-edges, tall
        ((100, 100, 300, 300), (400, 400, 405, 405), False),  # tiny but no shared edges
        ((100, 100, 300, 300), (100, 400, 110, 405), False),  # one shared edge only
    ],
)
def test_loop_guard_trips(prev, last, trips):
    assert loop_guard_trips(prev, last) is trips


# --- Thresholds the golden blocks leave out ---


def test_ref_candidates_top5_not_6():
    coords = {c(100 + 10 * i): 0.15 - 0.01 * i for i in range(5)}  # 0.15 .. 0.11
    rows = [{REF: 0.9}, {**coords, RED: 0.05}] + [{THE: 0.9}] * 4  # RED at rank 6
    assert decide_block(block(*rows), Mode.FAST, IDS, guards=Guards.STRICT).source is Source.X0
    rows[1] = {**coords, RED: 0.115}  # rank 5
    d = decide_block(block(*rows), Mode.FAST, IDS, guards=Guards.STRICT)
    assert d.source is Source.D_REF
    assert d.tokens == [REF, RED, THE, THE, THE, THE]


def test_thresholds_are_used():
    summary = golden_summary("box_coord_rank5")
    assert decide_block(summary, Mode.FAST, IDS, guards=Guards.STRICT).source is Source.X0
    wide = decide_block(summary, Mode.FAST, IDS, Thresholds(box_candidates=5), Guards.STRICT)
    assert wide.source is Source.D_BOX
    summary = golden_summary("ambiguous_spread_60")
    assert decide_block(summary, Mode.HYBRID, IDS, Thresholds(ambiguous_spread=59), Guards.STRICT).next is Next.AR
    summary = golden_summary("ref_p0_below")
    assert decide_block(summary, Mode.HYBRID, IDS, Thresholds(ref_start=0.5), Guards.STRICT).source is Source.D_REF
    summary = golden_summary("empty_p0_box_0.65")
    assert decide_block(summary, Mode.HYBRID, IDS, Thresholds(empty_box_start=0.6), Guards.STRICT).event is Event.EMPTY
    with pytest.raises(ValueError, match="box_candidates"):
        Thresholds(box_candidates=6)


def test_committed_probs():
    rows = read_summary(golden_summary("box_coord_not_top1"), IDS)
    d = decide_block(golden_summary("box_coord_not_top1"), Mode.FAST, IDS, guards=Guards.STRICT)
    assert d.source is Source.D_BOX
    assert d.probs[0] == rows[0].special[BOX] and d.probs[5] == rows[5].special[EBOX]
    assert d.probs[2] == pytest.approx(0.3, abs=0.01)  # the coordinate below a word at 0.5
    rows = read_summary(golden_summary("x0_box_none_no_box_end"), IDS)
    d = decide_block(golden_summary("x0_box_none_no_box_end"), Mode.HYBRID, IDS, guards=Guards.STRICT)
    assert d.tokens == [BOX, NONE, EBOX]
    assert d.probs == [rows[0].p_x0, rows[1].p_x0, rows[2].special[EBOX]]
    d = decide_block(golden_summary("null_first"), Mode.HYBRID, IDS, guards=Guards.STRICT)
    assert d.tokens == [END] and d.probs == [read_summary(golden_summary("null_first"), IDS)[0].special[END]]


# --- Hybrid text fix: label re-decoding ---


def label_block(p_word: float, p_ref_end: float = 0.9) -> np.ndarray:
    return block({REF: 0.9}, {RED: 0.9}, {WORD: p_word, THE: 0.04}, {EREF: p_ref_end}, {NULL: 0.9}, {NULL: 0.9})


def test_label_redecode():
    summary = label_block(0.45)
    plain = decide_block(summary, Mode.HYBRID, IDS, guards=Guards.STRICT)
    assert (plain.tokens, plain.event, plain.next) == ([REF, RED, WORD, EREF], Event.REF, Next.BLOCK)
    d = decide_block(summary, Mode.HYBRID, IDS, guards=Guards.STRICT, redecode_labels=True)
    assert (d.tokens, d.next, d.event) == ([REF, RED], Next.AR, Event.LABEL_REDECODE)
    assert d.label_redecode and d.source is Source.D_REF and len(d.probs) == 2
    # just above the threshold: accepted as it is
    d = decide_block(label_block(0.52), Mode.HYBRID, IDS, guards=Guards.STRICT, redecode_labels=True)
    assert (d.tokens, d.event, d.next) == ([REF, RED, WORD, EREF], Event.REF, Next.BLOCK)
    # an uncertain </ref> is a label token too
    d = decide_block(label_block(0.9, p_ref_end=0.4), Mode.HYBRID, IDS, redecode_labels=True)
    assert (d.tokens, d.next) == ([REF, RED, WORD], Next.AR)
    d = decide_block(label_block(0.45), Mode.HYBRID, IDS, Thresholds(label_prob=0.4), redecode_labels=True)
    assert d.event is Event.REF


def test_label_redecode_scope():
    # tokens after the first </ref> are not label tokens
    summary = block({REF: 0.9}, {RED: 0.9}, {EREF: 0.9}, {BOX: 0.3, THE: 0.25}, {NULL: 0.9}, {NULL: 0.9})
    d = decide_block(summary, Mode.HYBRID, IDS, redecode_labels=True)
    assert (d.tokens, d.event) == ([REF, RED, EREF, BOX], Event.REF)
    # row 0 is always committed, even when uncertain (AR needs an uncached tail)
    summary = block({RED: 0.3, THE: 0.25}, {WORD: 0.3, THE: 0.25}, {THE: 0.9}, {EREF: 0.9}, {NULL: 0.9}, {NULL: 0.9})
    d = decide_block(summary, Mode.HYBRID, IDS, redecode_labels=True)
    assert (d.tokens, d.event, d.next) == ([RED], Event.LABEL_REDECODE, Next.AR)
    # boxes are never re-decoded as labels
    d = decide_block(golden_summary("box_legal"), Mode.HYBRID, IDS, redecode_labels=True)
    assert d.event is Event.BOX
    with pytest.raises(ValueError, match="HYBRID"):
        decide_block(summary, Mode.FAST, IDS, redecode_labels=True)


@pytest.mark.parametrize(
    ("token", "want"),
    [(EREF, Next.BLOCK), (END, Next.STOP), (RED, Next.AR), (c(500), Next.AR), (EBOX, Next.AR), (NULL, Next.AR)],
)
def test_classify_ar_label_redecode(token, want):
    assert classify_ar(token, Mode.HYBRID, IDS, label_redecode=True) is want


def test_errors():
    with pytest.raises(ValueError, match="slow"):
        decide_block(golden_summary("box_legal"), Mode.SLOW, IDS)
    with pytest.raises(ValueError, match="summary values"):
        decide_block(golden_summary("box_legal")[:-18], Mode.FAST, IDS)
    with pytest.raises(ValueError, match="no AR steps"):
        classify_ar(END, Mode.FAST, IDS)
    assert golden_summary("box_legal").shape == (BLOCK_SUMMARY_SIZE,)
