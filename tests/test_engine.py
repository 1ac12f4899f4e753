"""The batched engine against the single-request path and NVIDIA's reference (MODEL.md §10; engine.py).

Every golden case of a checkpoint goes through one engine: each mode alone and all modes mixed, prompts of
different lengths, rows joining as others finish (4 rows for 18 requests) or all at once, under both schedules
(block and AR rows in one forward over every slot, or in separate gathered forwards). float32 on CPU: the token
ids, stop reasons and forward counts equal the reference's, so they equal the single-request run too.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, approx_tree, golden_case, golden_cases
from PIL import Image

import mlx_locate
from mlx_locate import compiled as compiled_module
from mlx_locate import engine as engine_module
from mlx_locate import runtime as runtime_module
from mlx_locate.cache import kv_bucket
from mlx_locate.checkpoint import DEMO_DIR
from mlx_locate.engine import EventKind, Schedule
from mlx_locate.request import Request, RequestError
from mlx_locate.sampling import Sampling

SCHEDULES = {"mixed-dense": Schedule(mixed=True, dense=True), "split-gathered": Schedule(mixed=False, dense=False)}
MODES = ("slow", "fast", "hybrid")


@pytest.fixture(scope="module")
def models(golden_dir):
    return {name: mlx_locate.load(golden_dir(name), dtype="float32") for name in ("tiny_random", "tiny_peaky")}


def golden_request(name: str, mode: str, **kw) -> Request:
    case = golden_case(name)
    return Request(
        GOLDEN / "images" / f"{name.split('__')[1]}.png",
        prompt=case["prompt"],
        task="raw",
        mode=mode,
        max_tokens=case["settings"]["max_new_tokens"],
        strict=True,
        rendering="B" if name.endswith("__jinja") else "A",
        **kw,
    )


def check_golden(engine, pairs, handles):
    for (name, mode), handle in zip(pairs, handles, strict=True):
        gold = golden_case(name)["generation"][mode]
        result = handle.result
        assert result is not None, (name, mode, handle.error)
        assert result.token_ids == gold["generated_ids"], (name, mode)
        assert result.stats["stop_reason"] == gold["stop"], (name, mode)
        assert result.stats["steps"] == gold["n_forward"] == result.stats["host_reads"], (name, mode)
    assert engine.host_reads == engine.steps


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("modes", [*MODES, "mixed"])
@pytest.mark.parametrize("checkpoint", ["tiny_random", "tiny_peaky"])
def test_every_golden_case_in_one_batch(models, checkpoint, modes, schedule):
    cases = [n for n in golden_cases() if n.startswith(checkpoint)]
    pairs = [(n, m) for n in cases for m in (MODES if modes == "mixed" else [modes])]
    rows = 4 if modes == "mixed" else len(pairs)  # mixed: rows join as others finish
    models[checkpoint].clear_caches()
    engine = models[checkpoint].engine(rows, SCHEDULES[schedule])
    handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    check_golden(engine, pairs, handles)
    assert engine.cache is None  # released once idle
    assert set(engine.seconds) == {"prepare", "vision", "prefix", "prefill", "decode"}
    assert all(v > 0 for v in engine.seconds.values()) and sum(engine.seconds.values()) <= wall, engine.seconds


def test_no_compilations_after_warm_up_for_a_steady_batch(models):
    """The same batch twice: the second traces nothing, reads once per step, and gives the same tokens."""
    model = models["tiny_peaky"]
    pairs = [(n, m) for n in golden_cases() if n.startswith("tiny_peaky") for m in MODES][:8]
    runs = []
    for _ in range(2):
        engine = model.engine(8, Schedule(mixed=True, dense=True))
        handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
        before = model.compilations
        engine.run()
        runs.append(([h.result.token_ids for h in handles], model.compilations - before))
        check_golden(engine, pairs, handles)
    assert runs[0][1] > 0 and runs[1][1] == 0
    assert runs[0][0] == runs[1][0]


def test_a_failing_request_is_reported_and_the_others_go_on(models, tmp_path):
    model = models["tiny_peaky"]
    (tmp_path / "text.png").write_text("not an image")
    good = golden_request("tiny_peaky__shapes_448x448__detect", "hybrid")
    requests = [
        Request(tmp_path / "missing.png", "x"),
        good,
        Request(tmp_path / "text.png", "x"),
        Request(good.image, "x", mode="sideways"),
        Request(good.image, "word " * 17000),  # longer than model_max_length (16384)
        good,
    ]
    results = model.locate_many(requests, max_rows=2)
    errors = [r for r in results if isinstance(r, RequestError)]
    assert [isinstance(r, RequestError) for r in results] == [True, False, True, True, True, False]
    assert "not found" in str(errors[0]) and "not a readable image" in str(errors[1])
    assert "unknown mode 'sideways'" in str(errors[2]) and "the model holds at most 16384" in str(errors[3])
    want = golden_case("tiny_peaky__shapes_448x448__detect")["generation"]["hybrid"]["generated_ids"]
    assert results[1].token_ids == results[5].token_ids == want


def test_events_stream_each_object_before_done():
    model = mlx_locate.load("demo")
    image = DEMO_DIR / "example.png"
    engine = model.engine(3)
    seen = []
    handles = [
        engine.submit(Request(image, q, mode=m), on_event=seen.append)
        for q, m in (("square", "fast"), ("star", "hybrid"), ("circle", "slow"))
    ]
    steps_with_objects = []
    while not engine.idle:
        events = engine.step()
        steps_with_objects.append(sum(e.kind is EventKind.OBJECT for e in events))
    for handle in handles:
        mine = [e for e in seen if e.handle is handle]
        assert mine == handle.events and mine[-1].kind is EventKind.DONE
        result = mine[-1].result
        assert [e.object for e in mine if e.kind is EventKind.OBJECT] == result.objects
        assert [e.label for e in mine if e.kind is EventKind.EMPTY] == result.empty_labels
        alone = model.locate(image, handle.request.query, mode=handle.request.mode)
        assert result.token_ids == alone.token_ids
        assert [o.to_dict() for o in result.objects] == approx_tree([o.to_dict() for o in alone.objects])
    assert handles[0].result.objects and handles[1].result.empty_labels == ["star"]
    assert sum(n > 0 for n in steps_with_objects) > 1  # objects arrive over several steps, not all at the end


def test_cancel_frees_the_row():
    model = mlx_locate.load("demo")
    image = DEMO_DIR / "example.png"
    engine = model.engine(1)
    first = engine.submit(Request(image, "square", mode="slow"))
    second = engine.submit(Request(image, "circle", mode="slow"))
    engine.step()
    engine.cancel(first)
    engine.run()
    assert first.result is None and first.cancelled and first.events == []
    assert second.result.token_ids == model.locate(image, "circle", mode="slow").token_ids


@pytest.mark.parametrize("mode", MODES)
def test_sampling_with_a_seed_per_row_is_the_same_batched_and_alone(mode):
    """Each row draws with its own seed: batched with other seeds (and a greedy row with a repetition penalty)
    it writes what it writes alone, and other seeds write other tokens."""
    model = mlx_locate.load("demo")
    image = DEMO_DIR / "example.png"
    hot = Sampling(temperature=1.5, top_p=0.95)
    requests = [Request(image, "square", mode=mode, sampling=hot, seed=s, max_tokens=40) for s in (1, 2, 3, 4)]
    requests.append(Request(image, "circle", mode=mode, sampling=Sampling(repetition_penalty=1.3), max_tokens=40))
    batched = model.locate_many(requests, max_rows=5)
    alone = [model.locate_many([r], max_rows=1)[0] for r in requests]
    for b, a in zip(batched, alone, strict=True):
        assert b.token_ids == a.token_ids and b.token_probs == pytest.approx(a.token_probs, rel=1e-5)
    if mode == "slow":  # block decoders take their tokens from the top candidates, not the draw
        assert len({tuple(r.token_ids) for r in batched[:4]}) > 1


def test_long_prompts_prefill_in_chunks(models, monkeypatch):
    """Prompts longer than PREFILL_ROWS go in chunks; tiny chunks give the reference's tokens as well."""
    monkeypatch.setattr(runtime_module, "PREFILL_ROWS", 64)
    monkeypatch.setattr(compiled_module, "PREFILL_ROWS", 64)
    model = models["tiny_random"]
    pairs = [(n, "hybrid") for n in golden_cases() if n.startswith("tiny_random")]
    engine = model.engine(8)
    handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
    engine.run()
    check_golden(engine, pairs, handles)


def test_images_of_one_grid_share_a_vision_batch(models):
    model = models["tiny_random"]
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(3)]
    prepared = [model.prepare(im) for im in images]
    model.features.clear()
    together = model.features_for(prepared)
    assert [cached for cached, _ in together] == [False] * 3
    for image, (_, features) in zip(prepared, together, strict=True):
        alone = model.network.image_features(mx.array(image.pre.patches), image.pre.grid)
        np.testing.assert_allclose(np.array(features), np.array(alone), atol=1e-6, rtol=0)
    assert all(cached for cached, _ in model.features_for(prepared))


def test_queries_on_one_image_prefill_its_prefix_once(models, monkeypatch):
    model = models["tiny_peaky"]
    model.prefixes.clear()
    calls = []
    compute = model.compute_prefixes
    monkeypatch.setattr(model, "compute_prefixes", lambda items: calls.append(len(items)) or compute(items))
    image = GOLDEN / "images" / "shapes_448x448.png"
    other = GOLDEN / "images" / "shapes_640x480.png"
    requests = [Request(image, q, max_tokens=8) for q in ("red box", "green circle", "the blue square")]
    model.locate_many([*requests, Request(other, "red box", max_tokens=8)], max_rows=4)
    model.locate_many(requests, max_rows=2)  # kept: no new prefix
    assert calls == [2]


def test_tiled_requests_merge_their_tiles(monkeypatch):
    """A request with `tiles` becomes its tiles' requests, decoded with the others; the caller sees the merged
    result only (the merge itself is tested in test_tiles.py)."""
    model = mlx_locate.load("demo")
    image = Image.open(DEMO_DIR / "example.png")
    crops = [image.crop((0, 0, 140, 140)), image.crop((84, 84, 224, 224))]
    monkeypatch.setattr(
        engine_module, "split_request", lambda r, im, limit, patch: [Request(c, r.query, mode=r.mode) for c in crops]
    )
    merged = []

    def merge(request, im, children, results):
        merged.append([r.token_ids for r in results])
        return results[0]

    monkeypatch.setattr(engine_module, "merge_results", merge)
    engine = model.engine(4)
    tiled = engine.submit(Request(image, "square", mode="fast", tiles=(1, 2)))
    plain = engine.submit(Request(image, "circle", mode="fast"))
    engine.run()
    assert merged == [[model.locate(c, "square", mode="fast").token_ids for c in crops]]
    assert tiled.events[-1].kind is EventKind.DONE and tiled.result.token_ids == merged[0][0]
    assert plain.result.token_ids == model.locate(image, "circle", mode="fast").token_ids


def test_memory_is_bounded_by_rows_and_buckets(models):
    model = models["tiny_peaky"]
    pairs = [(n, m) for n in golden_cases() if n.startswith("tiny_peaky") for m in MODES]
    engine = model.engine(3)
    handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
    biggest = 0
    while not engine.idle:
        engine.step()
        if engine.cache is not None:
            assert engine.cache.slots <= 3 and engine.cache.buffer_rows <= 4
            biggest = max(biggest, engine.cache.capacity)
    longest = max(len(h.result.prompt_ids) + len(h.result.token_ids) for h in handles)
    prompt = max(len(h.result.prompt_ids) for h in handles)
    assert kv_bucket(prompt) <= biggest <= kv_bucket(longest + compiled_module.BLOCK_ROWS)


def test_more_new_images_than_the_prefix_store_keeps(models, monkeypatch):
    """Rows joining together with more new images than the prefix store holds each get their own prefix (a
    prefix stored in the same admission must not push out one about to be copied)."""
    monkeypatch.setattr(runtime_module, "PREFIX_CACHE_SIZE", 2)
    model = models["tiny_peaky"]
    model.clear_caches()
    rng = np.random.default_rng(9)
    images = [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(5)]
    batched = model.locate_many([Request(im, "red box", max_tokens=8) for im in images], max_rows=5)
    alone = [model.locate_many([Request(im, "red box", max_tokens=8)], max_rows=1)[0] for im in images]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert len(model.prefixes) == 2
