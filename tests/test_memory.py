"""Memory within a budget (`mlx_locate.memory`): the budget from the device's limit, the tower in batches and
pieces, prefills in calls the working memory holds, and fewer rows where the KV budget is short; every path
gives the answers of the unconstrained one."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, approx_tree
from mlx.utils import tree_flatten
from PIL import Image

import mlx_locate
from mlx_locate import memory, runtime
from mlx_locate.cache import kv_bucket
from mlx_locate.network import vision
from mlx_locate.network.language import additive_mask, attend
from mlx_locate.request import Request
from mlx_locate.weights.checkpoint import DEMO_DIR

IMAGE = DEMO_DIR / "example.png"


def forward_shapes(model, monkeypatch) -> list[tuple[int, ...]]:
    """The inputs' shape of every forward `model` runs from now on ((R, Q, D) embeddings: a prefill call)."""
    shapes = []
    run = model.runtime.run

    def counted(phase, cache, inputs, *args, **kw):
        shapes.append(inputs.shape)
        return run(phase, cache, inputs, *args, **kw)

    monkeypatch.setattr(model.runtime, "run", counted)
    return shapes


@pytest.fixture(scope="module")
def demo():
    return mlx_locate.load("demo")


def test_budget_shares_the_limit_after_the_weights(demo):
    b = demo.runtime.budget
    assert b.limit == memory.device_limit() == mx.get_memory_limit()  # the CPU: no working-set cap
    assert b.weights >= sum(v.nbytes for _, v in tree_flatten(demo.runtime.network.parameters()))
    free = b.limit - b.weights - memory.RESERVE
    assert b.working == memory.working_bytes(free, "cpu") and b.kv == free - b.working
    t = demo.runtime.network.config.text
    assert b.slot_bytes == t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 4  # float32 on the CPU
    assert b.patch_bytes > 0 and b.prefill_row_bytes > 0
    # The CPU's attention falls back: a key costs a row every head's float32 score, and its float32 mask entry.
    assert t.num_attention_heads * 4 <= b.prefill_key_bytes <= t.num_attention_heads * 4 + 8


@pytest.mark.parametrize(("rows", "keys"), [(128, 3000), (512, 2048)])
def test_the_per_key_cost_measured_on_a_small_attention_bounds_a_larger_one(demo, rows, keys):
    """What one layer's attention holds grows with rows x keys as the per-key cost measured at load says (on
    128 rows and 1,024 keys), within 10 %: the budget may plan a call over a long prompt from it."""
    t = demo.runtime.network.config.text
    dtype = demo.runtime.network.language_model.model.norm.weight.dtype
    q = mx.zeros((1, t.num_attention_heads, rows, t.head_dim), dtype)
    k = mx.zeros((1, t.num_key_value_heads, keys, t.head_dim), dtype)
    mask = mx.ones((rows, keys), mx.bool_)
    mx.eval(q, k, mask)
    held = memory.peak_bytes(lambda: attend(q, k, k, 0.125, additive_mask(mask, dtype)))
    out = rows * t.num_attention_heads * t.head_dim * dtype.size  # the attention's output
    planned = rows * keys * demo.runtime.budget.prefill_key_bytes
    assert 0.9 * planned <= held - out <= 1.1 * planned


def test_working_memory_by_device_and_free_memory():
    """Half the free memory at most; otherwise the device's base, and on a GPU an eighth of the free memory where
    that is more (128 GiB free lend 16 GiB, 8 GiB free keep the base 2 GiB)."""
    GiB = 1 << 30
    assert memory.working_bytes(1 * GiB, "gpu") == GiB // 2  # half of what is free
    assert memory.working_bytes(8 * GiB, "gpu") == 2 * GiB  # the base: an eighth would be 1 GiB
    assert memory.working_bytes(128 * GiB, "gpu") == 16 * GiB
    assert memory.working_bytes(128 * GiB, "cpu") == 512 << 20  # the CPU's base, whatever is free
    assert memory.working_bytes(0, "cpu") == memory.MIN_WORKING


def test_tower_plan_fills_the_working_memory_first_with_images_then_with_blocks():
    b = dataclasses.replace(mlx_locate.load("demo").runtime.budget, working=100 << 20, patch_bytes=1000)
    room = b.working - b.score_budget
    assert b.tower_plan(64, 1000, 27) == (min(64, room // 1_000_000), 1)  # as many images as one block holds
    assert b.tower_plan(2, 1000, 27) == (2, min(27, room // 2_000_000))  # two images: several blocks at once
    assert b.tower_plan(1, 10**6, 27) == (1, 1)  # one block of a huge image: still one piece
    thirteen = room // 13 // 1000  # patches of which one block of 13 images fills the room
    assert b.tower_plan(16, thirteen, 27)[0] == 8  # calls of even size: 8 + 8, not 13 + 3
    assert b.tower_plan(27, thirteen, 27)[0] == 9  # 9 + 9 + 9, not 13 + 13 + 1


def test_tower_in_batches_and_pieces_equals_each_image_alone(demo, monkeypatch):
    """With a working memory that holds one block of one image (and the MLP in pieces of 16 patches), the tower
    runs each image alone, block by block: the features of the whole-tower call, to float32 rounding."""
    rng = np.random.default_rng(3)
    images = [
        demo.runtime.prepare(Image.fromarray(rng.integers(0, 256, (224, 168, 3), dtype=np.uint8))) for _ in range(3)
    ]
    patches = images[0].pre.grid[0] * images[0].pre.grid[1]
    tight = dataclasses.replace(demo.runtime.budget, working=demo.runtime.budget.patch_bytes * patches + (1 << 20))
    monkeypatch.setattr(demo.runtime, "budget", tight)
    assert tight.tower_plan(3, patches, 2)[0] == 1
    monkeypatch.setattr(vision, "MLP_ROWS", 16)
    syncs = []
    sync = demo.runtime.sync
    monkeypatch.setattr(demo.runtime, "sync", lambda *a: syncs.append(1) or sync(*a))
    demo.runtime.clear_caches()
    pieces = demo.runtime.features_for(images)
    blocks = len(demo.runtime.network.vision_model.encoder.blocks)
    assert len(syncs) >= 3 * blocks  # an evaluation per block of each image
    monkeypatch.setattr(vision, "MLP_ROWS", 4096)
    for image, (cached, features) in zip(images, pieces, strict=True):
        whole = demo.runtime.network.image_features(mx.array(image.pre.patches), image.pre.grid)
        assert not cached
        np.testing.assert_allclose(np.array(features), np.array(whole), rtol=1e-5, atol=1e-5)


def test_a_prefill_call_holds_no_more_than_its_rows_measured_cost(demo):
    """The per-row cost measured at load (uncompiled, on a few rows) bounds what a compiled prefill of three times
    as many rows holds above its inputs and its cache, scores included."""
    b = demo.runtime.budget
    t = demo.runtime.network.config.text
    rows = 384
    assert demo.runtime.prefill_rows(rows) >= rows  # one call
    cache = demo.runtime.new_cache(slots=1)
    cache.reserve(rows)
    x = mx.zeros((rows, t.hidden_size), demo.runtime.network.language_model.model.norm.weight.dtype)
    mx.eval(x, cache.kv)
    mx.eval(list(demo.runtime.prefill(cache, [(0, x, 0)]).values()))  # compiles that shape
    cache = demo.runtime.new_cache(slots=1)
    cache.reserve(rows)
    mx.eval(cache.kv)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(list(demo.runtime.prefill(cache, [(0, x, 0)]).values()), cache.kv)
    held = mx.get_peak_memory() - base
    # The call's K|V land in new buffers that replace the cache's (the KV budget's, not the working memory's).
    assert 0 < held <= rows * b.prefill_row_cost(kv_bucket(rows)) + cache.nbytes


def test_a_prefill_call_is_planned_for_its_caches_capacity(demo, monkeypatch):
    """A prompt of 300 tokens is attended to over its cache's 512 slots (`kv_bucket`): where the working memory
    holds 256 rows at 300 keys but not at 512, a call takes 128."""
    b = demo.runtime.budget
    assert b.prefill_key_bytes > 0 and kv_bucket(300) == 512
    working = 256 * b.prefill_row_cost(512) - 1
    assert working // b.prefill_row_cost(300) >= 256
    monkeypatch.setattr(demo.runtime, "budget", dataclasses.replace(b, working=working))
    assert demo.runtime.prefill_rows(300) == 128


def test_a_cpu_prefill_call_takes_at_most_the_cpu_cap(demo):
    """On the CPU more working memory does not make prefill calls larger than `CPU_PREFILL_ROWS`; without the cap
    they would be."""
    roomy = dataclasses.replace(demo.runtime.budget, working=64 << 30)
    assert roomy.prefill_cap == memory.CPU_PREFILL_ROWS
    assert roomy.prefill_rows(128, 500) == memory.CPU_PREFILL_ROWS
    assert dataclasses.replace(roomy, prefill_cap=None).prefill_rows(128, 500) > memory.CPU_PREFILL_ROWS


def test_a_prefill_call_leaves_room_for_the_copies_of_its_cache(demo, monkeypatch):
    """A call's rows get the working memory its cache's copies leave (the buffers before and after they grow, the
    one its K|V are written into): where the working memory holds four rows of 128 beside those copies, four
    prompts go in one call; where it holds the four rows but not the copies, in smaller calls."""
    d = demo.runtime.network.config.text.hidden_size
    dtype = demo.runtime.network.language_model.model.norm.weight.dtype
    b = demo.runtime.budget
    cache = demo.runtime.new_cache(slots=4)
    copies = runtime.cache_copies_bytes(cache, 128, b)
    # 4 rows and the scratch row, 256 slots each, and one row's copies more
    assert copies == (runtime.CACHE_COPIES * 5 + runtime.ROW_COPIES) * 256 * b.slot_bytes
    rows_bytes = 4 * 128 * b.prefill_row_cost(kv_bucket(128))
    monkeypatch.setattr(demo.runtime, "budget", dataclasses.replace(b, working=rows_bytes + copies, prefill_cap=None))
    calls = forward_shapes(demo, monkeypatch)
    demo.runtime.prefill(cache, [(i, mx.zeros((128, d), dtype), 0) for i in range(4)])
    assert [R for R, _, _ in calls] == [4]
    monkeypatch.setattr(demo.runtime, "budget", dataclasses.replace(b, working=rows_bytes, prefill_cap=None))
    calls.clear()
    demo.runtime.prefill(demo.runtime.new_cache(slots=4), [(i, mx.zeros((128, d), dtype), 0) for i in range(4)])
    assert len(calls) > 1 and max(R for R, _, _ in calls) < 4


def test_a_photos_prompt_prefix_fits_the_working_memory_of_a_16_gb_limit():
    """Within a 16 GB limit (a 24 GB Mac's GPU share) beside the 3B's bf16 weights, at the unit costs the H200
    measured: the working memory stays the 2 GiB base, and a 12 MP photo's prompt prefix (6,510 image tokens)
    goes in prefill calls whose rows and cache copies fit it (384 rows; without the copies, 1,024 rows would)."""
    weights, slot_bytes = 7_037_296_688, 36 * 2 * 2 * 128 * 2  # 36 layers of K|V, 2 heads of 128, bf16
    free = 16 * 10**9 - weights - memory.RESERVE
    working = memory.working_bytes(free, "gpu")
    assert working == 2 << 30
    b = memory.Budget(16 * 10**9, weights, working, free - working, 77249, 1643152, 8, slot_bytes, None)
    keys = kv_bucket(6510 + 64)  # the image's tokens and the prompt's words before them: the cache's capacity
    copies = (runtime.CACHE_COPIES + runtime.ROW_COPIES) * keys * slot_bytes  # a cache of one row
    rows = b.prefill_rows(128, keys, copies)
    assert rows == 384 and rows * b.prefill_row_cost(keys) + copies <= working
    assert b.prefill_rows(128, keys) == 1024 and 1024 * b.prefill_row_cost(keys) + copies > working


def test_prefill_in_calls_the_working_memory_holds(golden_dir, monkeypatch):
    """A working memory of one prefill bucket: a 640 x 480 image's prompt (over 400 rows) goes in calls of 128
    rows, each evaluated before the next, with the tokens of one call."""
    model = mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")
    request = Request(GOLDEN / "images" / "shapes_640x480.png", "red box", mode="slow", max_tokens=12)
    whole = model.locate_many([request])[0]
    b = model.runtime.budget
    per_row = b.prefill_row_cost(kv_bucket(len(whole.prompt_ids)))
    monkeypatch.setattr(model.runtime, "budget", dataclasses.replace(b, working=128 * per_row))
    assert model.runtime.prefill_rows(len(whole.prompt_ids)) == 128
    calls = forward_shapes(model, monkeypatch)
    model.runtime.clear_caches()
    pieces = model.locate_many([request])[0]
    prefills = [shape for shape in calls if len(shape) == 3]  # (R, Q, D) embeddings: a prefill call
    assert len(prefills) >= 4 and all(R * Q <= 128 for R, Q, _ in prefills)
    assert pieces.token_ids == whole.token_ids
    assert pieces.token_probs == approx_tree(whole.token_probs)


def test_a_prefill_call_takes_several_prompts_where_the_working_memory_holds_them(golden_dir, monkeypatch):
    """One sequence's chunk stays within PREFILL_ROWS (128 here), but a call takes the chunks of several prompts
    when the working memory holds more rows than that; the tokens are those of calls of one chunk."""
    model = mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")
    images = [GOLDEN / "images" / f"shapes_{s}.png" for s in ("448x448", "640x480")] + [IMAGE]
    requests = [Request(image, "red box", mode="fast", max_tokens=12) for image in images]
    monkeypatch.setattr(runtime, "PREFILL_ROWS", 128)
    b = model.runtime.budget
    monkeypatch.setattr(model.runtime, "budget", dataclasses.replace(b, working=128 * b.prefill_row_bytes))
    alone = model.locate_many(requests)  # a call of 128 rows: one chunk of one prompt
    monkeypatch.setattr(model.runtime, "budget", dataclasses.replace(b, working=64 << 30, prefill_cap=None))
    calls = forward_shapes(model, monkeypatch)
    model.runtime.clear_caches()
    together = model.locate_many(requests)
    prefills = [shape for shape in calls if len(shape) == 3]  # (R, Q, D) embeddings: a prefill call
    assert all(Q <= 128 for _, Q, _ in prefills) and max(R * Q for R, Q, _ in prefills) > 128
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.token_probs for r in together] == approx_tree([r.token_probs for r in alone])


def test_prefill_calls_take_a_power_of_two_of_sequences(demo, monkeypatch):
    """A call's sequences pad to a power of two, so where the working memory holds three prompts, four go in two
    calls of two (not three and one, the first padded to four)."""
    d = demo.runtime.network.config.text.hidden_size
    dtype = demo.runtime.network.language_model.model.norm.weight.dtype
    b = demo.runtime.budget
    cache = demo.runtime.new_cache(slots=4)
    working = 3 * 128 * b.prefill_row_cost(kv_bucket(128)) + runtime.cache_copies_bytes(cache, 128, b)
    monkeypatch.setattr(demo.runtime, "budget", dataclasses.replace(b, working=working, prefill_cap=None))
    assert demo.runtime.prefill_rows(128, cache) == 3 * 128
    calls = forward_shapes(demo, monkeypatch)
    demo.runtime.prefill(cache, [(i, mx.zeros((128, d), dtype), 0) for i in range(4)])
    assert [R for R, _, _ in calls] == [2, 2]


def test_a_memory_limit_below_the_rows_runs_fewer_rows_with_the_same_answers(demo, monkeypatch):
    """MLX's memory limit set so that the KV budget holds the cache of two rows, not of four: the default rows
    drop below the CPU's four, an engine asked for four runs at most two at a time, and the answers are the
    same as without the limit."""
    images = [str(IMAGE)] + [str(GOLDEN / "images" / f"shapes_{s}.png") for s in ("448x448", "640x480")]
    requests = [Request(image, q, mode="fast", max_tokens=32) for image in images for q in ("square", "circle")]

    def run(model):
        engine = model.engine(4)
        handles = [engine.submit(r) for r in requests]
        rows = 0
        while not engine.idle:
            engine.step()
            rows = max(rows, engine.active)
        return rows, [h.result for h in handles]

    rows, free_results = run(demo)
    assert rows == 4 == demo.runtime.default_rows
    longest = max(len(r.prompt_ids) for r in free_results) + 32 + 12
    kv = 3 * memory.kv_bucket(longest) * demo.runtime.budget.slot_bytes  # two rows and the scratch row
    before = mx.set_memory_limit(mx.get_active_memory() + memory.RESERVE + memory.MIN_WORKING + kv)
    try:
        tight = memory.Budget.measure(demo.runtime.network)  # as `load` does, under this limit
        monkeypatch.setattr(demo.runtime, "budget", tight)
        assert tight.kv < 5 * memory.kv_bucket(longest) * tight.slot_bytes  # four rows would not fit
        assert demo.runtime.default_rows < 4
        rows, tight_results = run(demo)
    finally:
        mx.set_memory_limit(before)
    assert rows == 2
    for a, b in zip(tight_results, free_results, strict=True):
        assert a.token_ids == b.token_ids and a.token_probs == approx_tree(b.token_probs)
