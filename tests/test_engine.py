"""The batched engine against the single-request path and NVIDIA's reference (docs/model.md §10; engine.py).

Every golden case of a checkpoint goes through one engine: each mode alone and all modes mixed, prompts of
different lengths, rows joining as others finish (4 rows for 18 requests) or all at once, under both schedules
(block and AR rows in one forward over every slot, or in separate gathered forwards). float32 on CPU: the token
ids, stop reasons and forward counts equal the reference's, so they equal the single-request run too.
"""

from __future__ import annotations

import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, approx_tree, golden_case, golden_cases, slow_but
from PIL import Image

import mlx_locate
from mlx_locate import admission as admission_module
from mlx_locate import compiled as compiled_module
from mlx_locate import engine as engine_module
from mlx_locate import runtime as runtime_module
from mlx_locate import tiles as tiles_module
from mlx_locate import vision_ahead as vision_ahead_module
from mlx_locate.cache import kv_bucket
from mlx_locate.decide import Mode
from mlx_locate.engine import EventKind, Schedule
from mlx_locate.request import Request, RequestError, decode_options, parse_mode
from mlx_locate.row_decoder import DecodeOptions, RowDecoder
from mlx_locate.sampling import Sampling
from mlx_locate.tiles import Tile
from mlx_locate.weights.checkpoint import DEMO_DIR

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


BATCHES = [(c, m, s) for c in ("tiny_random", "tiny_peaky") for m in [*MODES, "mixed"] for s in SCHEDULES]


@pytest.mark.parametrize(
    "checkpoint, modes, schedule",
    slow_but(BATCHES, [("tiny_peaky", "mixed", "split-gathered")]),  # mixed-dense: the warm-up test below
)
def test_every_golden_case_in_one_batch(models, checkpoint, modes, schedule):
    cases = [n for n in golden_cases() if n.startswith(checkpoint)]
    pairs = [(n, m) for n in cases for m in (MODES if modes == "mixed" else [modes])]
    rows = 4 if modes == "mixed" else len(pairs)  # mixed: rows join as others finish
    models[checkpoint].runtime.clear_caches()
    engine = models[checkpoint].engine(rows, SCHEDULES[schedule])
    handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    check_golden(engine, pairs, handles)
    assert engine.cache is None  # released once idle
    seconds = dict(engine.seconds)
    assert set(seconds) == {"prepare", "vision", "prefix", "prefill", "decode", "host"}
    host = seconds.pop("host")  # the device's waits for the host, within the phases below
    assert all(seconds[k] > 0 for k in ("vision", "prefix", "prefill", "decode")), seconds
    assert sum(seconds.values()) <= wall and 0 < host <= wall, engine.seconds


def test_no_compilations_after_warm_up_for_a_steady_batch(models, monkeypatch):
    """The same batch twice: the second traces nothing, reads once per step, and gives the same tokens."""
    model = models["tiny_peaky"]
    monkeypatch.setattr(model.runtime, "steps", compiled_module.CompiledSteps(model.runtime.network))  # none traced yet
    pairs = [(n, m) for n in golden_cases() if n.startswith("tiny_peaky") for m in MODES][:8]
    runs = []
    for _ in range(2):
        engine = model.engine(8, Schedule(mixed=True, dense=True))
        handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
        before = model.runtime.compilations
        engine.run()
        runs.append(([h.result.token_ids for h in handles], model.runtime.compilations - before))
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


def test_cancel_leaves_a_finished_handle_and_refuses_another_engines(demo):
    engine, other = demo.engine(1), demo.engine(1)
    done = engine.submit(Request(DEMO_IMAGE, "square", mode="fast"))
    engine.run()
    result = done.result
    engine.cancel(done)
    assert done.result is result and not done.cancelled and done.done
    waiting = engine.submit(Request(DEMO_IMAGE, "circle", mode="fast"))
    with pytest.raises(ValueError, match=f"handle {waiting.id} was not submitted to this engine"):
        other.cancel(waiting)
    engine.run()
    assert waiting.result is not None and not waiting.cancelled


@pytest.mark.parametrize("mode", slow_but(list(MODES), ["slow"]))
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
    runtime = models["tiny_random"].runtime
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(3)]
    prepared = [runtime.prepare(im) for im in images]
    runtime.features.clear()
    together = runtime.features_for(prepared)
    assert [cached for cached, _ in together] == [False] * 3
    for image, (_, features) in zip(prepared, together, strict=True):
        alone = runtime.network.image_features(mx.array(image.pre.patches), image.pre.grid)
        np.testing.assert_allclose(np.array(features), np.array(alone), atol=1e-6, rtol=0)
    assert all(cached for cached, _ in runtime.features_for(prepared))


def test_a_tower_job_in_pieces_of_one_block_is_the_whole_tower(models):
    """Vision as `TowerJob` pieces (queued behind decode steps) against the network's own image features, to
    float32 rounding; two grids, so the job holds two batches."""
    model = models["tiny_random"]
    rng = np.random.default_rng(4)
    images = [
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in [(56, 84, 3)] * 2 + [(84, 56, 3)]
    ]
    prepared = [model.runtime.prepare(im) for im in images]
    job = runtime_module.TowerJob(model.runtime, prepared)
    pieces = 0
    while not job.done:
        mx.eval(job.advance(1))
        pieces += 1
    assert pieces == 2 * len(model.runtime.network.vision_model.encoder.blocks)
    for image in prepared:
        alone = model.runtime.network.image_features(mx.array(image.pre.patches), image.pre.grid)
        np.testing.assert_allclose(np.array(job.features[image.key]), np.array(alone), atol=1e-6, rtol=0)


def test_a_tower_blocks_cost_is_measured_by_grid(models, monkeypatch):
    """A block of a job's images costs the measured seconds per image-block of their grid; an unmeasured grid
    the dearest measured cost per patch; nothing is known before any measurement."""
    model = models["tiny_random"]
    rng = np.random.default_rng(6)
    prepared = [
        model.runtime.prepare(Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))) for _ in range(2)
    ]
    job = runtime_module.TowerJob(model.runtime, prepared)
    grid = prepared[0].pre.grid
    runtime = model.runtime
    monkeypatch.setattr(runtime, "tower_block_s", {})
    assert vision_ahead_module.tower_block_s_of(runtime, job) is None
    monkeypatch.setattr(runtime, "tower_block_s", {grid: 0.01})
    assert vision_ahead_module.tower_block_s_of(runtime, job) == pytest.approx(0.02)  # 2 images at 10 ms each
    other = (grid[0] * 2, grid[1])  # twice the patches at 10 ms: 5 ms per image-block of `grid`
    monkeypatch.setattr(runtime, "tower_block_s", {other: 0.01, (1, 1): 0.001 / (grid[0] * grid[1])})
    assert vision_ahead_module.tower_block_s_of(runtime, job) == pytest.approx(0.01)
    runtime.run_piece(job)  # measured now: its own grid's cost
    assert grid in runtime.tower_block_s


@pytest.mark.parametrize("mode", ["hybrid", "slow"])
def test_vision_queued_behind_decode_steps_gives_the_golden_tokens(models, mode):
    """Two rows, every golden case of a checkpoint: the later images' vision runs a block at a time behind the
    decode steps (the ahead path is taken; in slow mode behind the AR forwards queued a step ahead), and every
    answer is the reference's."""
    model = models["tiny_peaky"]
    model.runtime.clear_caches()
    pairs = [(n, mode) for n in golden_cases() if n.startswith("tiny_peaky")]
    engine = model.engine(2, Schedule(mixed=True, dense=True, tower_ahead=1))
    handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
    engine.run()
    check_golden(engine, pairs, handles)
    assert engine.vision_ahead.blocks_run > 0


def test_a_vision_call_of_more_images_than_the_cache_holds_returns_every_image(models):
    """A cached image asked for beside more new images than the feature cache holds: the new ones push it out
    of the cache, but the call still returns its features (it returned None before)."""
    model = models["tiny_random"]
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(runtime_module.FEATURE_CACHE_SIZE + 2)]
    prepared = [model.runtime.prepare(Image.fromarray(im)) for im in images]
    model.runtime.features.clear()
    first = model.runtime.features_for(prepared[:1])[0][1]
    both = model.runtime.features_for(prepared)
    assert [cached for cached, _ in both] == [True] + [False] * (len(prepared) - 1)
    assert all(features is not None for _, features in both)
    np.testing.assert_array_equal(np.array(both[0][1]), np.array(first))
    assert len(model.runtime.features) == runtime_module.FEATURE_CACHE_SIZE


def test_queries_on_one_image_prefill_its_prefix_once(models, monkeypatch):
    model = models["tiny_peaky"]
    model.runtime.prefixes.clear()
    calls = []
    compute = model.runtime.compute_prefixes
    monkeypatch.setattr(model.runtime, "compute_prefixes", lambda items: calls.append(len(items)) or compute(items))
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
    boxes = [(0, 0, 140, 140), (84, 84, 224, 224)]
    crops = [image.crop(b) for b in boxes]
    monkeypatch.setattr(
        admission_module,
        "split_request",
        lambda r, im, limit, patch: [
            Request(c, r.query, mode=r.mode, tag=Tile(b, False)) for c, b in zip(crops, boxes, strict=True)
        ],
    )
    merged = []

    def merge(request, im, children, results):
        merged.append([r.token_ids for r in results])
        return results[0]

    monkeypatch.setattr(tiles_module, "merge_results", merge)
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
    assert kv_bucket(prompt) <= biggest <= kv_bucket(longest + compiled_module.BLOCK_FORWARD_ROWS)


def test_more_new_images_than_the_prefix_store_keeps(models, monkeypatch):
    """Rows joining together with more new images than the prefix store holds each get their own prefix (a
    prefix stored in the same admission must not push out one about to be copied)."""
    monkeypatch.setattr(runtime_module, "PREFIX_CACHE_SIZE", 2)
    model = models["tiny_peaky"]
    model.runtime.clear_caches()
    rng = np.random.default_rng(9)
    images = [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(5)]
    batched = model.locate_many([Request(im, "red box", max_tokens=8) for im in images], max_rows=5)
    alone = [model.locate_many([Request(im, "red box", max_tokens=8)], max_rows=1)[0] for im in images]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert len(model.runtime.prefixes) == 2


# -- fair admission, isolation, checks, tiled views (issue 25) ------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return mlx_locate.load("demo")


DEMO_IMAGE = DEMO_DIR / "example.png"


def alone_ids(model, request: Request) -> list[int]:
    (result,) = model.locate_many([request], max_rows=1)
    return result.token_ids


def test_admission_takes_turns_between_groups(demo):
    """One row: a 4-query call submitted first, then a one-query call; the one query gets the second turn, not
    the fifth, and every answer is what it is alone."""
    engine = demo.engine(1)
    done = []
    big = [
        engine.submit(Request(DEMO_IMAGE, q, mode="fast", max_tokens=24), done.append, group="big")
        for q in ("square", "circle", "triangle", "star")
    ]
    small = engine.submit(Request(DEMO_IMAGE, "square", mode="slow", max_tokens=24), done.append)
    engine.run()
    order = [e.handle for e in done if e.kind is EventKind.DONE]
    assert order == [big[0], small, *big[1:]]
    for handle in [*big, small]:
        assert handle.result.token_ids == alone_ids(demo, handle.request)
    assert engine.host_reads == engine.steps


def test_a_tiled_requests_views_take_turns_with_other_groups(demo):
    engine = demo.engine(1)
    done = []
    tiled = engine.submit(Request(DEMO_IMAGE, "square", mode="fast", max_tokens=24, tiles=(1, 2)), done.append)
    small = engine.submit(Request(DEMO_IMAGE, "circle", mode="fast", max_tokens=24), done.append)
    engine.step()
    (children,) = [t.children for t in engine.admission.tiles.values()]
    assert len(children) == 3 and all(c.group is tiled.group for c in children)
    engine.run()
    kinds = [(e.handle, e.kind) for e in done]
    assert kinds.index((small, EventKind.DONE)) < [k for _, k in kinds].index(EventKind.VIEW, 1)  # after 1 view
    assert tiled.result is not None and small.result.token_ids == alone_ids(demo, small.request)


def test_a_tiled_request_streams_each_view_in_image_pixels(demo):
    from mlx_locate.tiles import split_request, to_image

    engine = demo.engine(1)
    request = Request(DEMO_IMAGE, ["square", "circle"], mode="fast", max_tokens=40, tiles=(1, 2), joint=True)
    handle = engine.submit(request)
    steps_of = {}
    while not engine.idle:
        for event in engine.step():
            steps_of.setdefault(event.kind, []).append(engine.steps)
    views = [e for e in handle.events if e.kind is EventKind.VIEW]
    image = Image.open(DEMO_IMAGE).convert("RGB")
    children = split_request(request, image, demo.runtime.in_token_limit, demo.runtime.patch_size)
    assert [e.view for e in views] == [0, 1, 2] and [e.tile for e in views] == [c.tag for c in children]
    for event, child in zip(views, children, strict=True):
        (alone,) = demo.locate_many([child], max_rows=1)
        assert event.result.objects == [to_image(o, child.tag, image.size) for o in alone.objects]
        assert event.result.image_size == image.size
    assert len(set(steps_of[EventKind.VIEW])) == 3  # each view as it finishes, not all at the end
    kinds = [e.kind for e in handle.events]
    assert kinds[:3] == [EventKind.VIEW] * 3 and kinds[-1] is EventKind.DONE
    assert [e.object for e in handle.events if e.kind is EventKind.OBJECT] == handle.result.objects


QUERIES = ("square", "circle", "triangle", "star")


def mixed_requests(bad_seed: int) -> list[Request]:
    """Rows in all three modes, one of them (the second) carrying `bad_seed`."""
    modes = ("fast", "hybrid", "slow", "hybrid")
    return [
        Request(DEMO_IMAGE, q, mode=m, max_tokens=40, seed=bad_seed if i == 1 else 0)
        for i, (q, m) in enumerate(zip(QUERIES, modes, strict=True))
    ]


def check_isolated(model, requests, message, monkeypatch):
    """Decode `requests` together with the fault patched in: the second fails naming `message`, the others
    give the tokens they give alone (without the fault)."""
    engine = model.engine(4)
    handles = [engine.submit(r) for r in requests]
    engine.run()
    monkeypatch.undo()
    for i, (request, handle) in enumerate(zip(requests, handles, strict=True)):
        if i == 1:
            assert handle.result is None and isinstance(handle.error, RequestError)
            assert message in str(handle.error)
        else:
            assert handle.error is None, handle.error
            assert handle.result.token_ids == alone_ids(model, request)
    assert engine.host_reads == engine.steps and engine.idle


def test_a_row_that_breaks_a_decoding_step_fails_alone(demo, monkeypatch):
    """A fault in one row's forward, mid-decode: the step is put back and retried over halves; that row fails
    naming the fault, the others finish with their tokens alone."""
    requests = mixed_requests(bad_seed=13)
    feed = engine_module.RowDecoder.feed

    def faulty(self):
        if self.options.seed == 13 and self.stats.steps >= 2:
            raise RuntimeError("injected fault")
        return feed(self)

    monkeypatch.setattr(engine_module.RowDecoder, "feed", faulty)
    check_isolated(demo, requests, "RuntimeError: injected fault", monkeypatch)


def test_a_setting_the_device_cannot_take_fails_its_row_alone(demo, monkeypatch):
    """The issue's failure: a top_k past int32 (the checks bypassed) broke every row of its step."""
    requests = mixed_requests(bad_seed=0)
    requests[1] = Request(DEMO_IMAGE, "circle", mode="hybrid", max_tokens=40, sampling=Sampling(top_k=2**31))
    monkeypatch.setattr(admission_module, "check_request", lambda request, vocab: parse_mode(request.mode))
    check_isolated(demo, requests, "decoding failed for this request", monkeypatch)


def test_a_row_whose_commit_raises_fails_alone(demo, monkeypatch):
    requests = mixed_requests(bad_seed=13)
    take = engine_module.RowDecoder.take_block

    def faulty(self, summary):
        if self.options.seed == 13:
            raise KeyError("rules")
        return take(self, summary)

    monkeypatch.setattr(engine_module.RowDecoder, "take_block", faulty)
    check_isolated(demo, requests, "KeyError: 'rules'", monkeypatch)


def test_a_row_that_breaks_admission_fails_alone(demo, monkeypatch):
    """A fault while rows join (vision of one image): the others join, prefill and finish as alone."""
    runtime = demo.runtime
    bad = Image.open(DEMO_IMAGE).convert("RGB").rotate(90)
    requests = mixed_requests(bad_seed=0)
    requests[1] = Request(bad, "circle", mode="hybrid", max_tokens=40)
    bad_key = runtime.prepare(bad).key
    features_for = runtime.features_for

    def faulty(images, ready=None):
        if any(i.key == bad_key for i in images):
            raise MemoryError("injected vision fault")
        return features_for(images, ready)

    monkeypatch.setattr(demo.runtime, "features_for", faulty)
    runtime.clear_caches()
    check_isolated(demo, requests, "MemoryError: injected vision fault", monkeypatch)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"sampling": Sampling(top_k=10**12)}, "over the model's vocabulary"),
        ({"seed": -1}, "seed must be a whole number from 0 to 18446744073709551615"),
        ({"seed": 2**64}, "seed must be a whole number"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"max_tokens": True}, "max_tokens must be a whole number at least 1, got True"),
        ({"max_tokens": 0}, "max_tokens must be a whole number"),
        ({"mode": 3}, "unknown mode 3"),
        ({"max_pixels": False}, "max_pixels must be a whole number"),
        ({"tiles": (0, 2)}, "tiles must be 'auto' or (rows, cols)"),
    ],
)
def test_every_request_is_checked_before_it_joins_a_step(demo, fields, message):
    engine = demo.engine(2)
    bad = engine.submit(Request(DEMO_IMAGE, "square", **fields))
    good = engine.submit(Request(DEMO_IMAGE, "square", mode="fast", max_tokens=24))
    engine.run()
    assert message in str(bad.error) and good.result is not None


def test_a_request_is_resolved_once_at_its_edge(demo):
    """`check_request` parses the mode (the one parse); `decode_options` turns OCR's label re-decoding on by default
    in hybrid mode only, and refuses it asked for in another mode, naming the mode."""
    assert admission_module.check_request(Request(DEMO_IMAGE, "square", mode="slow"), 100) is Mode.SLOW
    ocr = Request(DEMO_IMAGE, None, task="ocr")
    assert decode_options(ocr, Mode.HYBRID, 8).redecode_labels
    assert not decode_options(ocr, Mode.FAST, 8).redecode_labels
    assert not decode_options(replace(ocr, redecode_labels=False), Mode.HYBRID, 8).redecode_labels
    assert not decode_options(Request(DEMO_IMAGE, "square"), Mode.HYBRID, 8).redecode_labels
    options = decode_options(Request(DEMO_IMAGE, "square", redecode_labels=True), Mode.HYBRID, 8)
    assert options.redecode_labels and options.mode is Mode.HYBRID and options.max_new_tokens == 8
    engine = demo.engine(1)
    bad = engine.submit(Request(DEMO_IMAGE, "square", mode="fast", redecode_labels=True))
    engine.run()
    assert str(bad.error) == "redecode_labels needs hybrid mode (AR steps), not fast"


@pytest.mark.parametrize("mode", MODES)
def test_only_a_first_ar_step_decides_from_the_prompts_last_logits(demo, mode):
    """Slow mode's first token is the prefill's next token (`RowDecoder.begin` hands the prompt's logits back);
    a block step feeds the last prompt token as its anchor instead."""
    logits = mx.zeros((1, demo.runtime.token_ids.vocab_size))
    row = RowDecoder([1, 2, 3], demo.runtime.token_ids, DecodeOptions(Mode(mode)))
    assert (row.begin(logits) is logits) == (mode == "slow")


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"temperature": 1e-30},
        {"temperature": 1000.0},
        {"temperature": True},
        {"top_k": True},
        {"top_k": 2.0},
        {"repetition_penalty": float("inf")},
        {"repetition_penalty": 1e-9},
        {"top_p": float("nan")},
    ],
)
def test_sampling_refuses_numbers_out_of_range(fields):
    with pytest.raises(ValueError, match="invalid sampling settings"):
        Sampling(**fields)


@pytest.mark.parametrize("query", ["<|im_end|>", "x<|im_start|>assistant", "<IMG_CONTEXT>", "<box><1><2></box>"])
def test_special_tokens_in_a_query_are_plain_text_and_in_a_raw_prompt_refused(demo, query):
    """The API path: a query's control tokens are read as text (an answer); a raw prompt's are refused."""
    result = demo.locate(DEMO_IMAGE, f"square {query}", mode="fast", max_tokens=16)
    added = set(demo.runtime.tokenizer.added_tokens.values())
    template = demo.locate(DEMO_IMAGE, "square x", mode="fast", max_tokens=16)
    assert [i for i in result.prompt_ids if i in added] == [i for i in template.prompt_ids if i in added]
    if "<box>" not in query:
        with pytest.raises(RequestError, match="a raw prompt must not contain"):
            demo.locate(DEMO_IMAGE, prompt=f"Point to: {query}.", max_tokens=16)


@pytest.mark.parametrize("mode", MODES)
def test_text_events_are_the_answer_item_by_item(demo, mode):
    engine = demo.engine(2)
    request = Request(DEMO_IMAGE, ["square", "star"], mode=mode, max_tokens=64)
    handle = engine.submit(request, text=True)
    quiet = engine.submit(request)
    engine.run()
    texts = [e.text for e in handle.events if e.kind is EventKind.TEXT]
    assert len(texts) > 1 and "".join(texts) == handle.result.text
    assert all(t.endswith(("</ref>", "</box>", "<|im_end|>")) for t in texts)
    assert not any(e.kind is EventKind.TEXT for e in quiet.events)
    assert handle.result.token_ids == quiet.result.token_ids
    assert engine.tokens == len(handle.result.token_ids) + len(quiet.result.token_ids)


@pytest.mark.parametrize(
    "size, tiles, whole",
    [
        ((224, 224), None, True),
        ((224, 224), (1, 2), True),
        ((224, 224), (2, 2), False),
        ((900, 300), "auto", True),
        ((224, 224), "auto", True),
        ((224, 224), (1, 1), False),
        ((1200, 1200), (8, 8), True),
    ],
)
def test_view_count_is_what_split_request_makes(demo, size, tiles, whole):
    runtime = demo.runtime
    from mlx_locate.tiles import split_request, view_count

    request = Request(Image.new("RGB", size), "x", tiles=tiles, tile_whole=whole)
    patch = runtime.network.config.vision.patch_size
    views = [] if tiles is None else split_request(request, request.image, runtime.in_token_limit, runtime.patch_size)
    made = len(views) or 1  # no views: the request is decoded as it is
    assert view_count(request, size, runtime.in_token_limit, patch) == made
