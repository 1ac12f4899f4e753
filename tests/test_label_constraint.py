"""Labels held to the asked categories (docs/model.md §10.8): the token trie against a brute-force enumeration,
the mask the step's summary applies, the block rule (best allowed candidate, else the block ends), and whole
answers of a checkpoint that writes corrupted labels, in every mode; strict keeps the reference's tokens."""

from __future__ import annotations

import itertools
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, golden_case, golden_token_ids

import mlx_locate
from mlx_locate.compiled import Phase
from mlx_locate.decide import Event, Guards, Mode, Next, Source, decide_block
from mlx_locate.label_trie import OUTSIDE, ROOT, LabelTrie
from mlx_locate.request import EventKind, Request
from mlx_locate.row_decoder import DecodeOptions, decode
from mlx_locate.sampling import Features, RowSampling, Sampling, ar_summary, block_summary, label_mask

IDS = golden_token_ids()
V = IDS.vocab_size
GREEDY = RowSampling.of([Sampling()])
NAMES = ["red box", "green circle", "cat"]


# --- the trie ---


def brute_allowed(paths: list[tuple[int, ...]], prefix: tuple[int, ...]) -> set[int]:
    """What may follow `prefix` inside a label, from the names alone: the next id of every name it starts, and
    </ref> where it is a whole name."""
    nxt = {p[len(prefix)] for p in paths if len(p) > len(prefix) and p[: len(prefix)] == prefix}
    return nxt | ({IDS.ref_end} if prefix in paths else set())


@pytest.mark.parametrize(
    "paths",
    [
        [(5,), (5, 6), (5, 6, 7), (8, 6)],  # names that are prefixes of others, a shared tail
        [(1, 2, 3), (1, 2, 4), (1, 9), (2,)],  # shared prefixes of several lengths
        [(3, 3, 3), (3, 3)],  # a repeated id
    ],
)
def test_trie_allows_exactly_the_continuations_of_the_names(paths):
    """Every sequence over the names' ids (and one id no name has) up to one past the longest name: walked from
    `<ref>`, the trie allows exactly what the enumeration says, and leaves the label where nothing does."""
    trie = LabelTrie([str(p) for p in paths], paths, IDS)
    alphabet = sorted({t for p in paths for t in p}) + [99]
    for n in range(max(map(len, paths)) + 2):
        for prefix in itertools.product(alphabet, repeat=n):
            state = trie.walk(ROOT, prefix)
            want = brute_allowed(paths, prefix)
            if any(p[:n] == prefix for p in paths):
                assert state != OUTSIDE and set(trie.allowed(state)) == want, prefix
            else:
                assert state == OUTSIDE and not want, prefix
    assert trie.after(ROOT, IDS.ref_start) == ROOT and trie.after(OUTSIDE, IDS.ref_start) == ROOT
    assert trie.after(OUTSIDE, alphabet[0]) == OUTSIDE
    assert trie.walk(ROOT, [*paths[0], IDS.ref_end]) == OUTSIDE


def test_trie_encodes_names_as_an_answer_writes_them(tok):
    """Inside `<ref>` a name has no leading space (in the prompt it has): the trie's paths are the ids between
    `<ref>` and `</ref>`, multi-token names and names that share a first token included."""
    names = ["red box", "red", "green circle", "cat"]
    trie = LabelTrie.of(names, tok, IDS)
    assert trie.names == tuple(names)
    red = tok.encode("<ref>red</ref>")[1]
    assert red != tok.encode(" red")[0]
    first = {tok.encode(f"<ref>{n}</ref>")[1] for n in names}
    assert set(trie.allowed(ROOT)) == first
    after_red = trie.after(ROOT, red)
    assert set(trie.allowed(after_red)) == {tok.encode("<ref>red box</ref>")[2], IDS.ref_end}


# --- the mask in the step's summary ---


def peaked(rows: list[dict[int, float]], h: int | None = None) -> np.ndarray:
    """(1, H, V) logits: 0 everywhere but the given peaks."""
    out = np.zeros((1, h or len(rows), V), dtype=np.float32)
    for j, peaks in enumerate(rows):
        for token, value in peaks.items():
            out[0, j, token] = value
    return out


def summarize(logits: np.ndarray, held=None) -> np.ndarray:
    f = Features(labels=held is not None)
    return np.array(block_summary(mx.array(logits), None, None, GREEDY, mx.array([False]), held, f=f, ids=IDS))[0]


def test_the_mask_holds_its_row_to_the_allowed_ids_and_leaves_the_others():
    """A block's first row is masked: its token and every candidate of nonzero probability are allowed ids; the
    other rows' summaries are the unmasked ones, bit for bit. An AR row (the last of its step) the same."""
    rows = [{7: 30.0, 11: 27.0, 12: 26.0}] + [{20 + j: 30.0, 40: 28.0} for j in range(5)]
    logits = peaked(rows)
    held = label_mask([(11, 12, 13)], [False], [0.01], 6, V)
    free, masked = summarize(logits).reshape(6, -1), summarize(logits, held).reshape(6, -1)
    assert masked[0, 0] == 11  # x0: the best allowed id, not 7
    top, p = masked[0, 2:7].astype(int), masked[0, 7:12]
    assert set(top[p > 0]) <= {11, 12, 13} and p.sum() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(free[1:], masked[1:])
    ar_logits = mx.array(peaked([{7: 30.0, 12: 27.0}]))
    held = label_mask([(11, 12)], [True], [0.01], 1, V)
    token, prob = np.array(ar_summary(ar_logits, None, None, GREEDY, held, f=Features(labels=True)))[0]
    assert token == 12 and prob == pytest.approx(1.0, abs=1e-6)


def test_a_row_that_spells_no_asked_name_is_left_unmasked():
    """Below the floor (the names' ids together) the row keeps the model's own choice: the decoder then lets the
    label go instead of inventing a name."""
    logits = peaked([{7: 30.0, 11: 20.0}] + [{}] * 5)  # p(11) ~ 4.5e-5
    for floor, want in ((0.01, 7), (1e-5, 11)):
        held = label_mask([(11,)], [False], [floor], 6, V)
        assert summarize(logits, held)[0] == want


def test_no_row_inside_a_label_needs_no_mask():
    assert label_mask([None, None], [False, True], [0.01, 0.01], 6, V) is None


# --- the block rule ---

TRIE = LabelTrie(["ab", "ac", "d"], [(501, 502), (501, 503), (504,)], IDS)
LABEL = {IDS.ref_start: 30.0}


def decide(rows, mode=Mode.FAST, state=OUTSIDE, held=None, **kw):
    return decide_block(summarize(peaked(rows), held), mode, IDS, labels=TRIE, label_state=state, **kw)


def test_a_label_token_no_name_allows_becomes_the_rows_best_allowed_candidate():
    """`<ref> 501 509 </ref>`: 509 continues no name; the row's second candidate 503 does (p ~ 0.27)."""
    rows = [LABEL, {501: 30.0}, {509: 30.0, 503: 29.0}, {IDS.ref_end: 30.0}, {IDS.null: 30.0}, {IDS.null: 30.0}]
    d = decide(rows)
    assert d.source is Source.D_REF and d.event is Event.REF and d.next is Next.BLOCK
    assert d.tokens == [IDS.ref_start, 501, 503, IDS.ref_end]
    assert d.probs[2] == pytest.approx(0.2689, abs=1e-3)
    free = decide_block(summarize(peaked(rows)), Mode.FAST, IDS)
    assert free.tokens == [IDS.ref_start, 501, 509, IDS.ref_end]


@pytest.mark.parametrize("mode", [Mode.FAST, Mode.HYBRID])
@pytest.mark.parametrize(
    "row2",
    [
        {509: 30.0, 503: 24.0},  # 503 outside the nucleus
        {509: float(np.log(V)), 503: float(np.log(V / 100))},  # 503 a candidate (p(509) ~ 0.5), below the floor
    ],
)
def test_a_label_token_with_no_allowed_candidate_ends_the_block_before_it(mode, row2):
    """Hybrid finishes the label in AR (each step masked), fast in the next block (its first row masked). A
    candidate below the floor does not count."""
    rows = [LABEL, {501: 30.0}, row2, {IDS.ref_end: 30.0}, {IDS.null: 30.0}, {IDS.null: 30.0}]
    d = decide(rows, mode)
    assert d.tokens == [IDS.ref_start, 501]
    if mode is Mode.HYBRID:
        assert d.next is Next.AR and d.event is Event.LABEL_REDECODE
    else:
        assert d.next is Next.BLOCK and d.event is Event.REF


def test_a_block_inside_a_label_continues_it_and_never_starts_a_box_or_a_label():
    """Inside a label D_box and D_ref do not run: row 0 is the masked x0, the rest follow the rule."""
    box = [{IDS.box_start: 30.0}, *({IDS.coord_token(100 + j): 30.0} for j in range(4)), {IDS.box_end: 30.0}]
    state = TRIE.after(ROOT, 501)
    held = label_mask([TRIE.allowed(state)], [False], [0.0], 6, V)
    d = decide(box, Mode.HYBRID, state, held)
    assert d.source is Source.X0 and d.tokens[0] in TRIE.allowed(state)
    assert len(d.tokens) == 1 and d.next is Next.AR  # row 1 (a coordinate) continues no name
    free = decide_block(summarize(peaked(box)), Mode.HYBRID, IDS)
    assert free.source is Source.D_BOX and free.event is Event.BOX


def test_a_first_row_left_unmasked_lets_the_label_go():
    """Row 0 of a block inside a label was left unmasked (the model spells no name): its token is kept, the label
    is let go, and the rest of the block is not held."""
    rows = [{509: 30.0}, {IDS.ref_end: 30.0}, {IDS.null: 30.0}, {IDS.null: 30.0}, {IDS.null: 30.0}, {IDS.null: 30.0}]
    d = decide(rows, Mode.FAST, TRIE.after(ROOT, 501))
    assert d.tokens == [509, IDS.ref_end] and d.next is Next.BLOCK


def test_outside_a_label_nothing_changes():
    """A box block is decided as without labels, probabilities and all."""
    box = [{IDS.box_start: 30.0}, *({IDS.coord_token(100 + j): 30.0} for j in range(4)), {IDS.box_end: 30.0}]
    held, free = decide(box), decide_block(summarize(peaked(box)), Mode.FAST, IDS)
    assert (held.tokens, held.probs, held.event) == (free.tokens, free.probs, free.event)


# --- whole answers: a checkpoint that writes corrupted labels ---


def item(label: list[dict[int, float]], box: tuple[int, int, int, int]) -> list[dict[int, float]]:
    coords = [{IDS.coord_token(v): 30.0} for v in box]
    return [{IDS.ref_start: 30.0}, *label, {IDS.ref_end: 30.0}, {IDS.box_start: 30.0}, *coords, {IDS.box_end: 30.0}]


class CorruptLabels:
    """tiny_peaky's forward with its logits replaced by a scripted answer of items, each `<ref> label </ref> <box>
    x1 y1 x2 y2 </box>`, then `<|im_end|>`: the token at each place given the row's committed answer so far (the
    tokens since its last `</box>`), in blocks as the model was trained on them (a block runs to the end of its
    label or box, padded with `<null>`). Token by token for AR rows; a block row's window rows each predict their
    place. The model writes the labels corrupted; the asked names are second, faint or absent."""

    def __init__(self, tok):
        t = {s: tok.encode(s) for s in ("red", " fox", " box", "green", " circles", " circle", "dog", "cat")}
        self.items = [
            item([{t["red"][0]: 30.0}, {t[" fox"][0]: 30.0, t[" box"][0]: 29.0}], (100, 100, 300, 300)),  # 2nd
            item([{t["dog"][0]: 30.0}], (400, 400, 500, 500)),  # no name: the item goes
            item([{t["green"][0]: 30.0}, {t[" circles"][0]: 30.0, t[" circle"][0]: 25.5}], (600, 100, 900, 400)),
            item([{t["cat"][0]: 30.0}], (100, 600, 300, 900)),
        ]
        self.seqs: dict[tuple[int, int], tuple[int, list[int]]] = {}  # by cache row: (prompt length, ids by slot)

    def wrap(self, model) -> None:
        """Answer `model`'s steps (its forward still runs: the cache is written as ever)."""
        self.run = model.run
        model.run = self

    def next_places(self, answer: list[int], n: int) -> list[dict[int, float]]:
        """The next `n` places after `answer` (AR: 1; a block: up to the end of its label or box, then <null>)."""
        k = answer.count(IDS.box_end)
        i = answer[::-1].index(IDS.box_end) if k else len(answer)  # places since the last </box>
        places = self.items[k][i:] if k < len(self.items) else [{IDS.im_end: 30.0}]
        if n == 1:
            return places[:1]
        ends = [j for j, p in enumerate(places) if IDS.ref_end in p or IDS.box_end in p or IDS.im_end in p]
        places = places[: ends[0] + 1] if ends else places
        return (places + [{IDS.null: 30.0}] * n)[:n]

    def logits(self, answer: list[int], n: int) -> np.ndarray:
        """(n, V): the next `n` places as logit rows, 0 but at their peaks."""
        out = np.zeros((n, V), dtype=np.float32)
        for j, peaks in enumerate(self.next_places(answer, n)):
            for token, value in peaks.items():
                out[j, token] = value
        return out

    def __call__(self, phase, cache, inputs, rows, c, q, block=None, dense=False):
        out = self.run(phase, cache, inputs, rows, c, q, block, dense)
        H = out.shape[1]
        logits = np.zeros(out.shape, dtype=np.float32)
        ids = np.array(inputs) if phase is not Phase.PREFILL else None
        for i, (row, start, n) in enumerate(zip(rows, c, q, strict=True)):
            if n == 0:
                continue
            key = (id(cache), row)
            window = block is not None and block[i]
            if phase is Phase.PREFILL:
                self.seqs[key] = (start + n, [-1] * (start + n))
            else:  # the committed ids fed sit at their slots (a forward queued ahead and dropped is fed again)
                prompt, seq = self.seqs[key]
                seq[start:] = ids[i, : n - 6 if window else n].tolist()
            prompt, seq = self.seqs[key]
            n = 6 if window else 1
            logits[i, H - n :] = self.logits(seq[prompt:], n)
        return mx.array(logits)


@pytest.fixture(scope="module")
def corrupt(golden_dir, tok):
    model = mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")
    CorruptLabels(tok).wrap(model.runtime)
    return model


IMAGE = GOLDEN / "images" / "shapes_448x448.png"
BOXES = {"red box": (100, 100, 300, 300), "green circle": (600, 100, 900, 400), "cat": (100, 600, 300, 900)}


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
def test_corrupted_labels_become_the_names_they_spelled_or_their_items_go(corrupt, mode):
    """Free, the labels are the model's ("red fox", "dog", "green circles", "cat"). Held: "red fox" becomes "red
    box" (its second candidate), "green circles" becomes "green circle" (faint: in a block no candidate, so the
    label goes on masked), "dog" (no name near) is dropped, never renamed; the boxes are the same ones. One host
    read per step, as without."""
    ask = partial(corrupt.locate, IMAGE, categories=NAMES, joint=True, mode=mode, max_tokens=96)
    free = ask(guards=Guards(label_constraint=False))
    assert [o.label for o in free.objects] == ["red fox", "dog", "green circles", "cat"]
    held = ask()
    assert [o.label for o in held.objects] == list(BOXES)
    assert [o.box_norm for o in held.objects] == list(BOXES.values())
    assert [o.box for o in held.objects] == [o.box for o in free.objects if o.label != "dog"]
    assert held.stats["host_reads"] == held.stats["steps"]
    strict = ask(strict=True)
    assert strict.token_ids == ask(guards=Guards.STRICT).token_ids


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
def test_streamed_events_hold_labels_as_the_result_does(corrupt, mode):
    """The objects streamed as a held joint answer grows are the result's: the item whose label is no name ("dog")
    is never sent (the row's parser drops it as it finishes)."""
    engine = corrupt.engine(1)
    request = Request(IMAGE, NAMES, joint=True, mode=mode, max_tokens=96)
    handle = engine.submit(request, text=True)
    while not engine.idle:
        engine.step()
    streamed = [e.object for e in handle.events if e.kind is EventKind.OBJECT]
    assert [o.label for o in streamed] == list(BOXES)
    assert streamed == handle.result.objects
    assert "dog" in "".join(e.text for e in handle.events if e.kind is EventKind.TEXT)  # the text is the model's


@pytest.mark.parametrize("mode", [Mode.SLOW, Mode.FAST, Mode.HYBRID])
def test_one_sequence_decode_holds_labels_as_the_engine_does(corrupt, tok, mode):
    """`row_decoder.decode` (one sequence over a caller's step function) masks and holds as the engine does."""
    script, answer = CorruptLabels(tok), []

    def step(fed: list[int], block: bool) -> mx.array:
        answer.extend(fed[: len(fed) - 6] if block else fed)
        return mx.array(script.logits(answer, 6 if block else 1))

    labels = LabelTrie.of(NAMES, tok, IDS)
    options = DecodeOptions(mode, 96, labels=labels)
    out = decode(step, [1, 2, 3], mx.array(script.logits([], 1)), IDS, options)
    engine = corrupt.locate(IMAGE, categories=NAMES, joint=True, mode=mode.value, max_tokens=96)
    assert out.tokens == engine.token_ids


def test_holding_labels_compiles_nothing_new_after_warm_up(corrupt):
    ask = partial(corrupt.locate, IMAGE, categories=NAMES, joint=True, max_tokens=96)
    for mode in ("slow", "fast", "hybrid"):
        ask(mode=mode)
    before = corrupt.runtime.compilations
    for mode in ("slow", "fast", "hybrid"):
        ask(mode=mode)
    assert corrupt.runtime.compilations == before


@pytest.fixture(scope="module")
def peaky(golden_dir):
    return mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
def test_strict_categories_give_the_reference_tokens(peaky, mode):
    """The golden detect prompt asked as a category list with `strict=True`: the reference's tokens exactly."""
    for name in ("tiny_peaky__shapes_448x448__detect", "tiny_peaky__shapes_640x480__detect"):
        case = golden_case(name)
        result = peaky.locate(
            GOLDEN / "images" / f"{name.split('__')[1]}.png",
            categories=["red box", "green circle"],
            mode=mode,
            max_tokens=case["settings"]["max_new_tokens"],
            strict=True,
        )
        assert result.prompt_ids == case["input_ids"]
        assert result.token_ids == case["generation"][mode]["generated_ids"]
