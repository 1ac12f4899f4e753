"""The cached, bucketed, compiled runtime against plain full recomputes (docs/model.md §10.1-§10.3, docs/model.md §12).

The reference for every step is `LanguageModel` run eagerly without a cache over the whole sequence, with the
positions of docs/model.md §10.2 and a mask built here entry by entry from docs/model.md §10.3. Checkpoints: the golden
`tiny_random` (GQA 2:1, head_dim 4) and a random one from `make_random_checkpoint` (3 layers, GQA 4:1, head_dim 4), both
in float32. Their logits are ~0.4; cached and recomputed paths differ only in summation order: 1e-5 absolute.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, golden_case
from PIL import Image

from mlx_locate import cache as cache_module
from mlx_locate import compiled as compiled_module
from mlx_locate import engine as engine_module
from mlx_locate import runtime as runtime_module
from mlx_locate.cache import KV_BUCKET, SlotCache, kv_bucket
from mlx_locate.compiled import PREFILL_BUCKET, PREFILL_MIN, CompiledSteps, Phase, StepRunner, padded_rows
from mlx_locate.config import ModelConfig
from mlx_locate.engine import Schedule
from mlx_locate.locate import load
from mlx_locate.masks import BLOCK, step_mask
from mlx_locate.network import cpu
from mlx_locate.request import Request
from mlx_locate.weights.checkpoint import DEMO_DIR
from mlx_locate.weights.loader import build_model
from mlx_locate.weights.random_checkpoint import make_random_checkpoint

ATOL = 1e-5


@pytest.fixture(scope="module")
def golden(golden_dir):
    return load(golden_dir("tiny_random"), dtype="float32")


@pytest.fixture(scope="module")
def random_net(golden, tmp_path_factory):
    overrides = {"text_hidden": 32, "text_heads": 8, "text_kv_heads": 2, "text_layers": 3}
    folder = make_random_checkpoint(tmp_path_factory.mktemp("rt") / "ckpt", "tiny", seed=4, overrides=overrides)
    config = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return build_model(folder, config, golden.runtime.token_ids, "float32")


@pytest.fixture(params=["golden", "random"])
def net(request, golden, random_net):
    return golden.runtime.network if request.param == "golden" else random_net


def new_cache(net, slots: int = 1) -> SlotCache:
    t = net.config.text
    return SlotCache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, mx.float32, slots)


SHARED_STEPS: dict[int, CompiledSteps] = {}  # one set of compiled functions per network: each key traces once


def runner(net, compile: bool = True, fresh: bool = False) -> StepRunner:
    if not compile or fresh:
        return StepRunner(CompiledSteps(net, compile=compile), new_cache(net))
    steps = SHARED_STEPS.setdefault(id(net), CompiledSteps(net))
    return StepRunner(steps, new_cache(net))


def make_prompt(net, length: int, seed: int = 0, n_image: int = 8) -> tuple[list[int], mx.array]:
    """Random text ids with `n_image` <IMG_CONTEXT> slots (random features spliced in), ending in "\\n"."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 151643, length).tolist()
    ids[2 : 2 + n_image] = [net.token_ids.image] * n_image
    ids[-1] = 198
    features = mx.array(rng.normal(0, 0.05, (n_image, net.config.text.hidden_size)).astype(np.float32))
    return ids, net.embed(ids, features)


def step_mask_formula(kv_len: int, q_len: int, block: bool) -> np.ndarray:
    """docs/model.md §10.3 over the last `q_len` of `kv_len` slots: tail rows causal, window rows all but slot n - 1."""
    mask = np.zeros((q_len, kv_len), dtype=bool)
    n = kv_len - BLOCK if block else kv_len
    for i in range(q_len):
        g = kv_len - q_len + i
        for k in range(kv_len):
            mask[i, k] = (k < n + BLOCK and k != n - 1) if g >= n else k <= g
    return mask


class FullRecompute:
    """The sequence so far as embeddings, recomputed from scratch (no cache) for every step."""

    def __init__(self, net, prompt_embeds: mx.array):
        self.net = net
        self.lm = net.language_model
        self.embeds = prompt_embeds

    def commit(self, ids: list[int]) -> None:
        self.embeds = mx.concatenate([self.embeds, self.lm.model.embed_tokens(mx.array(ids))[None]], axis=1)

    def causal_last(self) -> mx.array:
        n = self.embeds.shape[1]
        hidden, _ = self.lm(self.embeds, mx.arange(n), mx.array(step_mask_formula(n, n, False)))
        return self.lm.logits(hidden[:, -1])

    def block(self) -> mx.array:
        """The 6 window rows after the committed sequence: anchor = copy of the last token, 5 masks."""
        n = self.embeds.shape[1]
        last = self.embeds[:, -1:]
        masks = self.lm.model.embed_tokens(mx.array([self.net.token_ids.text_mask] * (BLOCK - 1)))[None]
        embeds = mx.concatenate([self.embeds, last, masks], axis=1)
        positions = mx.array(list(range(n)) + list(range(n - 1, n + BLOCK - 1)))
        hidden, _ = self.lm(embeds, positions, mx.array(step_mask_formula(n + BLOCK, n + BLOCK, True)))
        return self.lm.logits(hidden[0, -BLOCK:])


def close(a: mx.array, b: mx.array, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.array(a).reshape(np.array(b).shape), np.array(b), atol=atol, rtol=0)


def block_ids(net, tail: list[int], last: int) -> list[int]:
    return tail + [last] + [net.token_ids.text_mask] * (BLOCK - 1)


# ---------------------------------------------------------------- cached steps == full recompute


def test_cached_ar_decode_equals_full_recompute(net):
    """Prefill, then AR tails of 1, 1, 4 and 6 tokens, each against a causal forward over everything."""
    ids, embeds = make_prompt(net, 40, seed=1)
    run, ref = runner(net), FullRecompute(net, embeds)
    close(run.prefill(embeds), ref.causal_last())
    rng = np.random.default_rng(2)
    for n_tail in (1, 1, 4, 6):
        tail = rng.integers(0, 151643, n_tail).tolist()
        ref.commit(tail)
        close(run.step(tail, block=False), ref.causal_last())
    assert run.offset == ref.embeds.shape[1]


@pytest.mark.parametrize("tail_len", [1, 3, 6])
def test_block_step_equals_full_recompute(net, tail_len):
    """Block steps with a committed tail (the 6 rows), a second block after the commit, then an AR step."""
    ids, embeds = make_prompt(net, 33, seed=tail_len)
    run, ref = runner(net), FullRecompute(net, embeds)
    run.prefill(embeds)
    rng = np.random.default_rng(10 + tail_len)
    tail = rng.integers(0, 151643, tail_len).tolist()
    ref.commit(tail)
    close(run.step(block_ids(net, tail, tail[-1]), block=True), ref.block())
    assert run.offset == len(ids) + tail_len  # the window slots are dropped
    tail = rng.integers(0, 151643, 6 - tail_len + 1).tolist()
    ref.commit(tail)
    close(run.step(block_ids(net, tail, tail[-1]), block=True), ref.block())
    tail = [net.token_ids.box_end]
    ref.commit(tail)
    close(run.step(tail, block=False), ref.causal_last())


def test_prefill_then_empty_tail_block_equals_first_call(net):
    """docs/model.md §10.3: causal prefill + a block step with q_len = 6 == one forward over prompt + window (c = 0)."""
    ids, embeds = make_prompt(net, 50, seed=7)
    run = runner(net)
    run.prefill(embeds)
    close(run.step(block_ids(net, [], ids[-1]), block=True), FullRecompute(net, embeds).block())


@pytest.mark.parametrize("split", [1, 127, 129])
def test_prefill_in_two_parts_equals_one(golden, split):
    """A cached prefix then the rest of the prompt (what a session does per query), across the 128-row bucket."""
    net = golden.runtime.network
    ids, embeds = make_prompt(net, 150, seed=split)
    run = runner(net)
    run.prefill(embeds[:, :split])
    ref = FullRecompute(net, embeds)
    close(run.prefill(embeds[:, split:]), ref.causal_last())
    assert run.offset == 150
    close(run.step(block_ids(net, [], ids[-1]), block=True), ref.block())


def test_golden_first_block_and_prompt_logits(golden):
    """The same path on a golden prompt (reference vision features spliced in) gives the recorded logits."""
    case = golden_case("tiny_random__shapes_448x448__detect")
    net = golden.runtime.network
    features = mx.array(np.load(GOLDEN / "cases" / "tiny_random__shapes_448x448.vision_features.npy"))
    ids = case["input_ids"]
    run = runner(net)
    last = run.prefill(net.embed(ids, features))[0]
    top = case["prompt_last_logits"]["top"]
    np.testing.assert_allclose(np.array(last)[top["ids"]], top["values"], atol=1e-4)
    assert np.argsort(-np.array(last))[:3].tolist() == top["ids"][:3]
    rows = run.step(block_ids(net, [], ids[-1]), block=True)
    for row, want in zip(np.array(rows), case["first_block"]["rows"], strict=True):
        np.testing.assert_allclose(row[want["top"]["ids"]], want["top"]["values"], atol=1e-4)
        assert int(row.argmax()) == want["top"]["ids"][0]


# ---------------------------------------------------------------- compile, buckets, warm-up


def script(net, run: StepRunner, ids: list[int], embeds: mx.array) -> list[mx.array]:
    """One request: prefill, empty-tail block, AR 1, AR 4, block with a 3-token tail, block with a 6-token tail."""
    box = net.token_ids.box_start
    coords = [net.token_ids.coord_token(v) for v in (10, 200, 300, 400, 500)]
    out = [run.prefill(embeds)]
    out.append(run.step(block_ids(net, [], ids[-1]), block=True))
    out.append(run.step([box], block=False))
    out.append(run.step(coords[:4], block=False))
    out.append(run.step(block_ids(net, coords[1:4], coords[3]), block=True))
    out.append(run.step(block_ids(net, coords[:5] + [box], box), block=True))
    return out


def test_compiled_equals_eager(net):
    ids, embeds = make_prompt(net, 45, seed=3)
    compiled_run, eager_run = runner(net, fresh=True), runner(net, compile=False)
    for a, b in zip(script(net, compiled_run, ids, embeds), script(net, eager_run, ids, embeds), strict=True):
        close(a, b, atol=1e-6)
    assert compiled_run.steps.traces == len(compiled_run.steps.functions)  # one trace per (phase, Q, U)


def script_reference(net, ids: list[int], embeds: mx.array) -> list[mx.array]:
    box = net.token_ids.box_start
    coords = [net.token_ids.coord_token(v) for v in (10, 200, 300, 400, 500)]
    ref = FullRecompute(net, embeds)
    out = [ref.causal_last(), ref.block()]
    for tail, block in (([box], False), (coords[:4], False), (coords[1:4], True), (coords[:5] + [box], True)):
        ref.commit(tail)
        out.append(ref.block() if block else ref.causal_last())
    return out


@pytest.mark.parametrize(
    ("prompt_len", "prefill_rows"), [(12, 16), (17, 32), (60, 64), (128, 128), (129, 256), (250, 256)]
)
def test_default_buckets_leave_logits_unchanged(golden, prompt_len, prefill_rows):
    """Short prompts (powers of two from 16), prompts around the 128-row prefill bucket and the 256-slot KV bucket
    (250 + 6 crosses it mid-request)."""
    assert (PREFILL_MIN, PREFILL_BUCKET, KV_BUCKET) == (16, 128, 256)
    net = golden.runtime.network
    ids, embeds = make_prompt(net, prompt_len, seed=prompt_len)
    run = runner(net)
    for a, b in zip(script(net, run, ids, embeds), script_reference(net, ids, embeds), strict=True):
        close(a, b)
    assert padded_rows(Phase.PREFILL, prompt_len) == prefill_rows
    assert run.cache.capacity == kv_bucket(max(prefill_rows, prompt_len + 8 + 12))  # the last block reserves c + 12


@pytest.mark.parametrize(("prefill_bucket", "kv_bucket_size"), [(1, 8), (16, 32), (64, 24)])
def test_other_buckets_leave_logits_unchanged(random_net, monkeypatch, prefill_bucket, kv_bucket_size):
    """The same request under other bucket sizes, where prefill padding and cache growth fall elsewhere."""
    net = random_net
    ids, embeds = make_prompt(net, 60, seed=5)
    monkeypatch.setattr(compiled_module, "PREFILL_BUCKET", prefill_bucket)
    monkeypatch.setattr(cache_module, "KV_BUCKET", kv_bucket_size)
    run = runner(net)
    for a, b in zip(script(net, run, ids, embeds), script_reference(net, ids, embeds), strict=True):
        close(a, b)
    assert run.cache.capacity % kv_bucket_size == 0


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))  # grid 6 x 8: 12 image tokens


class NumpySpy:
    """Stands in for numpy inside the decode loop and records every array conversion (a host read)."""

    def __init__(self):
        self.conversions = []

    def __getattr__(self, name):
        return getattr(np, name)

    def array(self, x, *args, **kwargs):
        self.conversions.append(type(x))
        return np.array(x, *args, **kwargs)


@pytest.mark.parametrize("mode", ["hybrid", "fast", "slow"])
def test_no_compilations_after_warm_up_and_one_host_read_per_step(golden, image, monkeypatch, mode):
    """Run `locate` twice: the second run traces nothing; each step reads the device exactly once, counted both by
    the stats and by a spy on the engine's conversions (decide.py and row_decoder.py get host arrays only)."""
    golden.runtime.steps = CompiledSteps(golden.runtime.network)  # count this mode's functions alone
    for run in range(2):
        spy = NumpySpy()
        monkeypatch.setattr(engine_module, "np", spy)
        monkeypatch.setattr(runtime_module, "np", spy)  # the engine's read (`Runtime.read`)
        result = golden.locate(image, "red box", mode=mode, max_tokens=16)
        stats = result.stats
        assert stats["steps"] == stats["block_steps"] + stats["ar_steps"] > 0
        assert stats["host_reads"] == stats["steps"] == len(spy.conversions)
        assert all(t is mx.array for t in spy.conversions)
        assert (stats["block_steps"] == 0) == (mode == "slow")
        if run == 0:
            warm, first = golden.runtime.compilations, result
            assert warm == stats["compilations"] == len(golden.runtime.steps.functions) > 0  # one trace per key
    print(f"{mode}: {warm} compilations in the first run, {golden.runtime.compilations} after the second")
    assert golden.runtime.compilations == warm
    assert result.token_ids == first.token_ids


def test_a_model_answers_from_any_thread(golden_dir, image, monkeypatch):
    """With the head in panels a traced step keeps its thread's CPU streams (MLX refuses another thread's): each
    thread gets step functions of its own, traced once there, and the same answer."""
    monkeypatch.setattr(cpu, "openblas_core", lambda: "skylakex")
    monkeypatch.setattr(cpu.PanelEmbedding, "rows_alike", lambda self: True)  # the layout, whatever this BLAS rounds
    model = load(golden_dir("tiny_random"), dtype="float32")
    assert type(model.runtime.network.language_model.model.embed_tokens) is cpu.PanelEmbedding
    first = model.locate(image, "red box", mode="hybrid", max_tokens=16)
    traced = model.runtime.compilations
    with ThreadPoolExecutor(1) as pool:
        again = pool.submit(model.locate, image, "red box", mode="hybrid", max_tokens=16).result()
        there = model.runtime.compilations
        twice = pool.submit(model.locate, image, "red box", mode="hybrid", max_tokens=16).result()
    assert again.token_ids == twice.token_ids == first.token_ids
    assert model.runtime.compilations == there > traced  # the other thread traced its own, once
    assert model.locate(image, "red box", mode="hybrid", max_tokens=16).token_ids == first.token_ids
    assert model.runtime.compilations == there


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
def test_steps_queued_ahead_change_nothing(monkeypatch, mode):
    """An all-AR step queues the next AR forward fed the tokens still on the device; the tokens, their
    probabilities and the reads equal a run that queues nothing. For this query the demo model's hybrid run falls
    back to AR and back to blocks: the queued forward is dropped there. Block steps queue nothing."""
    model = load("demo")
    image = DEMO_DIR / "example.png"
    runs = {}
    run_step = model.runtime.steps.run
    for queue_ahead in (False, True):
        fed = []

        def spy(phase, *args, fed=fed, **kwargs):
            fed.append(phase)
            return run_step(phase, *args, **kwargs)

        monkeypatch.setattr(model.runtime.steps, "run", spy)
        schedule = Schedule(mixed=False, dense=False, queue_ahead=queue_ahead)
        engine = model.engine(1, schedule)
        handle = engine.submit(Request(image, "red square", task="refer", mode=mode, max_tokens=40))
        engine.run()
        runs[queue_ahead] = handle.result, fed, engine
    (plain, plain_fed, plain_engine), (ahead, ahead_fed, ahead_engine) = runs[False], runs[True]
    assert ahead.token_ids == plain.token_ids and ahead.token_probs == plain.token_probs
    assert plain.objects and ahead.objects == plain.objects
    for key in ("host_reads", "ar_steps", "block_steps"):
        assert ahead.stats[key] == plain.stats[key], key
    assert ahead_engine.host_reads == plain_engine.host_reads == plain.stats["host_reads"]
    wasted = ahead_fed.count(Phase.AR) - plain_fed.count(Phase.AR)  # queued at a stop or a switch to blocks
    assert (wasted > 0) == (mode != "fast") and ahead_fed.count(Phase.BLOCK) == plain_fed.count(Phase.BLOCK)
    if mode == "hybrid":
        assert plain.stats["block_steps"] > 0 and plain.stats["fallbacks"] > 0  # block -> AR -> block


# ---------------------------------------------------------------- batched steps


def test_batched_mask_is_the_formula_per_sequence():
    """Three sequences in one block-shaped step: a block row with a 3-token tail, an AR row with a 2-token tail,
    a block row with no tail; and a padding entry (q = 0) that sees slot 0 only."""
    c, q, block, Q, U = [5, 9, 3, 0], [9, 2, 6, 0], [True, False, True, False], 12, 24
    mask = np.array(step_mask(mx.array(c), mx.array(q), Q, U, mx.array(block)))[:, 0]
    for r in range(3):
        kv_len = c[r] + q[r]
        want = step_mask_formula(kv_len, q[r], block[r])
        np.testing.assert_array_equal(mask[r, : q[r], :kv_len], want)
        assert not mask[r, : q[r], kv_len:].any()
        assert (mask[r, q[r] :] == (np.arange(U) == 0)).all()
    assert (mask[3] == (np.arange(U) == 0)).all()


@pytest.mark.parametrize("dense", [True, False])
def test_batched_step_equals_each_sequence_alone(net, dense):
    """Sequences of different lengths in one cache, one forward: a block row, an AR row with a tail and a block
    row with an empty tail give each the logits it gives alone; in the gathered form the sequences sit in other
    cache rows than their entries, padded with a scratch-row entry."""
    rng = np.random.default_rng(21)
    prompts = [make_prompt(net, n, seed=n) for n in (40, 23, 57)]
    tails = [rng.integers(0, 151643, 3).tolist(), rng.integers(0, 151643, 2).tolist(), []]
    feeds = [
        block_ids(net, tails[0], tails[0][-1]),
        tails[1],
        block_ids(net, [], prompts[2][0][-1]),
    ]
    blocks = [True, False, True]
    alone = []
    for (_ids, embeds), tail, feed, block in zip(prompts, tails, feeds, blocks, strict=True):
        run = runner(net)
        run.prefill(embeds)
        if tail and block:
            run.prefill(net.language_model.model.embed_tokens(mx.array(tail))[None])
            run.offset -= len(tail)  # the block step feeds the tail itself
        alone.append(np.array(run.step(feed, block))[-1 if not block else slice(None)])
    steps = SHARED_STEPS.setdefault(id(net), CompiledSteps(net))
    cache = new_cache(net, slots=3 if dense else 4)
    rows = [0, 1, 2] if dense else [3, 0, 2]
    for row, (_ids, embeds) in zip(rows, prompts, strict=True):
        steps.run(Phase.PREFILL, cache, mx.pad(embeds, [(0, 0), (0, 64 - embeds.shape[1]), (0, 0)]), [row],
                  [0], [embeds.shape[1]], dense=False)  # fmt: skip
    Q = 12
    inputs = np.zeros((4 if not dense else 3, Q), dtype=np.int32)
    for i, f in enumerate(feeds):
        inputs[i, : len(f)] = f
    c = [len(ids) for ids, _ in prompts]
    q = [len(f) for f in feeds]
    entries, pad = (rows, 0) if dense else (rows + [cache.scratch], 1)
    logits = steps.run(
        Phase.BLOCK, cache, mx.array(inputs), entries, c + [0] * pad, q + [0] * pad, blocks + [False] * pad, dense
    )
    for i, want in enumerate(alone):
        got = np.array(logits[i])
        close(mx.array(got[-1] if not blocks[i] else got), mx.array(want))


# ---------------------------------------------------------------- the KV cache


def test_prefix_copies_are_their_own():
    """A prefix copied out of a cache row is an array of its own: writes to the row leave it unchanged; copied
    into another row it lands at slots 0..P-1 of that row only."""
    cache = SlotCache(num_layers=2, kv_heads=2, head_dim=4, dtype=mx.float32, slots=3)
    cache.reserve(8)
    cache.kv = [b + mx.arange(cache.buffer_rows, dtype=mx.float32)[:, None, None, None, None] for b in cache.kv]
    prefix = cache.copy_out(1, 5)
    assert [p.shape for p in prefix] == [(1, 2, 2, 5, 4)] * 2
    cache.kv = [b * 0 for b in cache.kv]
    assert all((np.array(p) == 1).all() for p in prefix)
    cache.copy_in(2, prefix)
    for b in cache.kv:
        b = np.array(b)
        assert (b[2, :, :, :5] == 1).all() and not b[2, :, :, 5:].any() and not b[[0, 1, 3]].any()


def test_cache_grows_by_buckets():
    assert [kv_bucket(n) for n in (0, 1, 255, 256, 257, 600)] == [0, 256, 256, 256, 512, 768]
    cache = SlotCache(num_layers=2, kv_heads=2, head_dim=4, dtype=mx.bfloat16)
    assert cache.capacity == 0 and cache.nbytes == 0 and cache.buffer_rows == 1
    assert cache.reserve(10) == 256
    cache.kv = [buffer + mx.array([1, 2], mx.bfloat16)[:, None, None, None] for buffer in cache.kv]  # K 1, V 2
    assert cache.reserve(256) == 256  # fits: no growth
    assert cache.reserve(257) == 512
    for buffer in cache.kv:
        assert buffer.shape == (1, 2, 2, 512, 4) and buffer.dtype == mx.bfloat16
        k, v = np.array(buffer[0].astype(mx.float32))
        assert (k[:, :256] == 1).all() and (v[:, :256] == 2).all()  # kept
        assert not k[:, 256:].any() and not v[:, 256:].any()  # zero padding
    assert cache.nbytes == 2 * 2 * (2 * 512 * 4) * 2
    assert cache.reserve(100) == 512  # never shrinks
    cache.grow(4)  # four sequences and the scratch row; the first keeps its place
    for buffer in cache.kv:
        assert buffer.shape == (5, 2, 2, 512, 4)
        assert (np.array(buffer[0, 0, :, :256].astype(mx.float32)) == 1).all() and not np.array(
            buffer[1:].astype(mx.float32)
        ).any()


def test_runner_grows_the_cache_across_a_request(golden):
    net = golden.runtime.network
    ids, embeds = make_prompt(net, 240, seed=11)
    run = runner(net)
    run.prefill(embeds)
    assert run.cache.capacity == 256
    tail = [1, 2, 3, 4, 5, 6]
    run.step(block_ids(net, [], ids[-1]), block=True)  # reserves 240 + 12 slots
    run.step(block_ids(net, tail, 6), block=True)  # 240 + 12 again: still 256
    assert run.offset == 246 and run.cache.capacity == 256
    run.step(block_ids(net, tail, 6), block=True)  # 246 + 12 > 256
    assert run.offset == 252 and run.cache.capacity == 512


def test_the_decoder_loads_behind_the_first_images_tower(monkeypatch):
    """`load` reads the tower's weights and leaves the decoder's for later: the first image's first tower piece is
    queued before the decoder's weights are scheduled (MLX holds the host while it schedules them), so the tower
    runs while they load; the decoder is scheduled once, and the phases are timed without the load's wait."""
    events: list[str] = []
    schedule, sync = mx.async_eval, runtime_module.Runtime.sync

    def async_eval(*args):
        events.append("decoder" if isinstance(args[0], dict) else "tower")
        schedule(*args)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    monkeypatch.setattr(runtime_module.Runtime, "sync", lambda self, *a: events.append("sync") or sync(self, *a))
    model = load("demo")
    assert events == []
    first = model.locate(DEMO_DIR / "example.png", "square", max_tokens=8)
    assert events[:3] == ["tower", "decoder", "sync"] and events.count("decoder") == 1
    events.clear()
    model.locate(Image.new("RGB", (64, 48), "white"), "square", max_tokens=8)
    assert "decoder" not in events and "tower" not in events  # later pieces are evaluated as they come
    assert first.stats["load_s"] > 0 and first.stats["vision_s"] >= 0
