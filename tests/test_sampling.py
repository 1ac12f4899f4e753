"""Sampling transform and device summaries against an independent float64 numpy implementation."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from conftest import golden_token_ids

from mlx_locate.decide import (
    Guards,
    Mode,
    Next,
    Source,
    decide_block,
)
from mlx_locate.sampling import (
    COL_P_X0,
    COL_SPECIAL,
    COL_TOP_IDS,
    COL_TOP_PROBS,
    COL_X0,
    F32_MIN,
    ROW_WIDTH,
    TOP_K,
    Features,
    RowSampling,
    Sampling,
    ar_summary,
    block_summary,
    softmax,
    special_ids,
    top_ids,
    transform_logits,
)

IDS = golden_token_ids()
V = IDS.vocab_size
KEY = mx.array([[7, 0]], dtype=mx.uint32)
NOT_AR = mx.array([False])


def transform(logits: np.ndarray, seen: np.ndarray, s: Sampling) -> np.ndarray:
    """One sequence's (H, V) logits through the batched transform."""
    out = transform_logits(mx.array(logits)[None], mx.array(seen)[None], RowSampling.of([s]), Features.of([s]))
    return np.array(out)[0]


def block_rows(logits: np.ndarray, seen: np.ndarray, s: Sampling, key: mx.array = KEY) -> np.ndarray:
    """One sequence's block summary, (H, ROW_WIDTH)."""
    out = block_summary(
        mx.array(logits)[None], mx.array(seen)[None], key, RowSampling.of([s]), NOT_AR, f=Features.of([s]), ids=IDS
    )
    return np.array(out).reshape(-1, ROW_WIDTH)


def ar_pair(logits: np.ndarray, seen: np.ndarray, s: Sampling, key: mx.array = KEY) -> tuple[int, float]:
    out = ar_summary(mx.array(logits)[None], mx.array(seen)[None], key, RowSampling.of([s]), f=Features.of([s]))
    token, p = np.array(out)[0].tolist()
    return int(token), p


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_transform(logits: np.ndarray, seen: np.ndarray, s: Sampling) -> np.ndarray:
    """docs/model.md §10.4(a) steps 1-4 in float64; dropped logits are -inf."""
    x = logits.astype(np.float64)
    r = s.repetition_penalty
    x = np.where(seen & (x > 0), x / r, np.where(seen, x * r, x))
    if s.temperature > 0:
        x = x / s.temperature
    if s.top_p < 1:
        for row in x:
            order = np.argsort(-row, kind="stable")
            cum = np.cumsum(np_softmax(row[order]))
            crossing = int(np.argmax(cum > s.top_p)) if (cum > s.top_p).any() else len(row) - 1
            row[order[crossing + 1 :]] = -np.inf
    if s.top_k > 0:
        kth = np.sort(x, axis=-1)[:, -s.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    return x


def random_case(rows: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = (rng.normal(0, 2.5, (rows, vocab))).astype(np.float32)
    seen = rng.random(vocab) < 0.2
    return logits, seen


def check_transform(logits: np.ndarray, seen: np.ndarray, s: Sampling) -> None:
    ours = transform(logits, seen, s)
    want = np_transform(logits, seen, s)
    dropped = np.isinf(want)
    np.testing.assert_array_equal(ours == F32_MIN, dropped)
    np.testing.assert_allclose(ours[~dropped], want[~dropped], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "s",
    [
        Sampling(repetition_penalty=1.1),
        Sampling(repetition_penalty=0.8),
        Sampling(temperature=0.7),
        Sampling(top_p=0.9),
        Sampling(top_p=0.5, temperature=1.3),
        Sampling(top_k=7),
        Sampling(top_k=1),
        Sampling.OFFICIAL,
        Sampling(temperature=0.7, top_p=0.95, top_k=20, repetition_penalty=1.3),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_transform_matches_float64(s, seed):
    check_transform(*random_case(3, 4000, seed), s)


def test_batch_of_different_settings_matches_each_alone():
    """Sequences with different settings in one batch: each row is transformed by its own settings only."""
    settings = [Sampling(), Sampling.OFFICIAL, Sampling(top_k=7), Sampling(temperature=1.3, top_p=0.5)]
    logits, seen = zip(*(random_case(3, 4000, seed) for seed in range(len(settings))), strict=True)
    seen = np.stack(seen)
    batch = transform_logits(
        mx.array(np.stack(logits)), mx.array(seen), RowSampling.of(settings), Features.of(settings)
    )
    for row, x, sn, s in zip(np.array(batch), logits, seen, settings, strict=True):
        want = np_transform(x, sn, s)
        dropped = np.isinf(want)
        np.testing.assert_array_equal(row == F32_MIN, dropped)
        np.testing.assert_allclose(row[~dropped], want[~dropped], rtol=1e-6, atol=1e-6)


def test_repetition_penalty_per_distinct_id():
    logits = np.array([[2.0, -2.0, 0.0, 3.0, -1.0]], dtype=np.float32)
    seen = np.zeros(5, dtype=bool)
    seen[[0, 0, 0, 1, 2, 1]] = True
    out = transform(logits, seen, Sampling(repetition_penalty=2.0))
    np.testing.assert_allclose(out, [[1.0, -4.0, 0.0, 3.0, -1.0]])


def test_top_p_keeps_the_crossing_token():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]])).astype(np.float32)
    for top_p, kept in [(0.79, 2), (0.81, 3), (0.5, 2), (0.49, 1), (0.96, 4)]:
        out = transform(logits, np.zeros(4, dtype=bool), Sampling(top_p=top_p))
        assert (out[0] > F32_MIN).sum() == kept, top_p


def test_greedy_is_identity():
    x = mx.array(random_case(2, 100, 3)[0])[None]
    assert transform_logits(x, None, RowSampling.of([Sampling()]), Features()) is x


def test_settings():
    assert Sampling.OFFICIAL == Sampling(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1)
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match="sampling"):
            Sampling(**bad)


def test_softmax_accuracy_on_full_vocabulary():
    """A flat float32 sum over V drifts by ~0.6%; the two-level sum stays near float64."""
    logits, _ = random_case(2, V, 4)
    logits[:, 5] = 14.0
    np.testing.assert_allclose(np.array(softmax(mx.array(logits))), np_softmax(logits.astype(np.float64)), rtol=2e-5)


def test_block_summary_greedy_matches_numpy():
    logits, _ = random_case(6, V, 5)
    rows = block_rows(logits, np.zeros(V, dtype=bool), Sampling())
    p = np_softmax(logits.astype(np.float64))
    top = np.argsort(-p, axis=-1, kind="stable")[:, :TOP_K]
    np.testing.assert_array_equal(rows[:, COL_X0], logits.argmax(axis=-1))
    np.testing.assert_array_equal(rows[:, COL_TOP_IDS : COL_TOP_IDS + TOP_K], top)
    np.testing.assert_allclose(
        rows[:, COL_TOP_PROBS : COL_TOP_PROBS + TOP_K], np.take_along_axis(p, top, -1), rtol=2e-5
    )
    np.testing.assert_allclose(rows[:, COL_P_X0], p.max(axis=-1), rtol=2e-5)
    np.testing.assert_allclose(rows[:, COL_SPECIAL:], p[:, list(special_ids(IDS))], rtol=2e-5)


@pytest.mark.parametrize("V", [300, 20_483, 152_681])
def test_top_ids_are_the_largest(V):
    """Chunked on the CPU backend (the k best chunks by maximum, then within them): the same set as a full sort,
    also when the best entries crowd one chunk or sit in the padded tail."""
    rng = np.random.default_rng(V)
    p = rng.random((2, 3, V)).astype(np.float32)
    start = min(1024, V - 10)
    p[0, 0, start : start + 5] = 2.0 + np.arange(5)  # all five in one chunk
    p[0, 1, V - 3 :] = 3.0  # three in the last, padded chunk
    p[1, 2, [0, V // 2, V - 1, 7, 213]] = 5.0
    got = np.sort(np.array(top_ids(mx.array(p), TOP_K)), axis=-1)
    want = np.sort(np.argsort(-p, axis=-1, kind="stable")[..., :TOP_K], axis=-1)
    np.testing.assert_array_equal(got, want)


def test_x0_is_the_first_maximum():
    logits = np.zeros((6, 300), dtype=np.float32)
    logits[:, [40, 10, 200]] = 5.0
    seen = np.zeros(300, dtype=bool)
    rows = block_rows(logits, seen, Sampling())
    assert (rows[:, COL_X0] == 10).all()
    assert ar_pair(logits[:1], seen, Sampling())[0] == 10


@pytest.mark.parametrize("s", [Sampling(), Sampling.OFFICIAL, Sampling(temperature=1.0, top_k=50)])
def test_compiled_equals_eager(s):
    logits, seen = random_case(6, V, 6)
    args = (mx.array(logits)[None], mx.array(seen)[None], KEY, RowSampling.of([s]))
    f = Features.of([s])
    eager = np.array(block_summary(*args, NOT_AR, f=f, ids=IDS)).reshape(-1, ROW_WIDTH)
    compiled = np.array(mx.compile(partial(block_summary, f=f, ids=IDS))(*args, NOT_AR)).reshape(-1, ROW_WIDTH)
    ids_cols = [COL_X0, *range(COL_TOP_IDS, COL_TOP_IDS + TOP_K)]
    np.testing.assert_array_equal(compiled[:, ids_cols], eager[:, ids_cols])
    np.testing.assert_allclose(compiled, eager, rtol=1e-6)
    ar_args = (args[0][:, :1], *args[1:])
    ar_eager = np.array(ar_summary(*ar_args, f=f))
    ar_compiled = np.array(mx.compile(partial(ar_summary, f=f))(*ar_args))
    assert ar_compiled[0, 0] == ar_eager[0, 0]
    np.testing.assert_allclose(ar_compiled, ar_eager, rtol=1e-6)


def test_sampling_draws_only_nucleus_tokens():
    vocab = 3000
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 0.3, (1, vocab)).astype(np.float32)
    logits[0, :6] = [9.0, 8.5, 8.2, 8.0, 7.6, 7.0]  # a nucleus of a handful of tokens
    seen = rng.random(vocab) < 0.2
    s = Sampling.OFFICIAL
    p = np_softmax(np_transform(logits, seen, s))[0]
    nucleus = set(np.flatnonzero(p > 0).tolist())
    assert 2 < len(nucleus) < 50
    drawn = []
    for step in range(40):
        key = mx.array([[0, step]], dtype=mx.uint32)
        rows = block_rows(np.repeat(logits, 6, axis=0), seen, s, key)
        drawn += rows[:, COL_X0].astype(int).tolist()
        np.testing.assert_allclose(rows[:, COL_P_X0], p[rows[:, COL_X0].astype(int)], rtol=1e-4)
        token, p_token = ar_pair(logits, seen, s, key)
        drawn.append(token)
        assert p_token == pytest.approx(p[token], rel=1e-4)
    assert set(drawn) <= nucleus
    assert len(set(drawn)) > 2


def test_draws_depend_on_the_sequence_alone():
    """A sequence's draws come from its own key and rows: the same in a batch of 4 as alone, and an AR
    sequence in a block-shaped step draws its last row as the AR-shaped step would."""
    s = Sampling(temperature=1.0)
    logits = [random_case(6, 2000, seed)[0] for seed in range(4)]
    keys = mx.array([[3, i] for i in range(4)], dtype=mx.uint32)
    settings = RowSampling.of([s] * 4)
    ar_rows = mx.array([False, True, False, True])
    batch = block_summary(mx.array(np.stack(logits)), None, keys, settings, ar_rows, f=Features.of([s]), ids=IDS)
    batch = np.array(batch).reshape(4, -1, ROW_WIDTH)
    for i, x in enumerate(logits):
        alone = block_rows(x, np.zeros(2000, dtype=bool), s, keys[i : i + 1])
        np.testing.assert_array_equal(batch[i, :5, COL_X0], alone[:5, COL_X0])
        if i % 2:
            assert batch[i, 5, COL_X0] == ar_pair(x[5:], np.zeros(2000, dtype=bool), s, keys[i : i + 1])[0]
        else:
            assert batch[i, 5, COL_X0] == alone[5, COL_X0]
    assert len({tuple(batch[i, :, COL_X0]) for i in range(4)}) == 4


def peaked(probs: dict[int, float], vocab: int = V) -> np.ndarray:
    rest = 1.0 - sum(probs.values())
    row = np.full(vocab, np.log(rest / (vocab - len(probs))))
    for token, p in probs.items():
        row[token] = np.log(p)
    return row.astype(np.float32)


def test_top_p_is_what_makes_the_reference_stop():
    """docs/model.md §10.7: once the model is done, greedy D_box fabricates a box from faint coordinates; top-p removes
    them."""
    c = IDS.coord_token
    word = 1000
    faint = {c(100): 0.004, c(700): 0.003, 1037: 0.002, 1074: 0.001}
    rows = [peaked({IDS.im_end: 0.95, 1037: 0.01})]
    rows += [peaked({word: 0.95, **faint}) for _ in range(4)]
    rows += [peaked({IDS.null: 0.95, 1037: 0.01})]
    logits, seen = np.stack(rows), np.zeros(V, dtype=bool)
    greedy = decide_block(block_rows(logits, seen, Sampling()).reshape(-1), Mode.FAST, IDS, guards=Guards.STRICT)
    assert greedy.source is Source.D_BOX and greedy.next is Next.BLOCK
    official = block_rows(logits, seen, Sampling.OFFICIAL)
    assert (official[1:5, COL_TOP_PROBS + 1 : COL_TOP_PROBS + TOP_K] == 0).all()
    d = decide_block(official.reshape(-1), Mode.FAST, IDS, guards=Guards.STRICT)
    assert (d.source, d.tokens, d.next) == (Source.X0, [IDS.im_end], Next.STOP)
