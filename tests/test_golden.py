"""End-to-end parity with NVIDIA's reference on the golden tiny checkpoints (tests/data/golden/README.md).

float32 against float32: vision tower (allow 1e-4), connector features (1e-5), last-prompt and first-block
logits (tiny_random 1e-4 absolute; tiny_peaky 1e-4 relative), and every greedy token sequence exactly; on the
CPU backend with the head in either of its layouts (`cpu.cpu_head`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, golden_case, golden_cases, slow_but

import mlx_locate
from mlx_locate.compiled import StepRunner
from mlx_locate.network import cpu
from mlx_locate.network.projector import merge_2x2
from mlx_locate.preprocess import preprocess

CHECKPOINTS = ("tiny_random", "tiny_peaky")
CASES = golden_cases()
IMAGES = sorted({name.split("__")[1] for name in CASES})


# The panel layout's own tests (test_numerics) are fast; its golden sweep is slow.
@pytest.fixture(scope="module", params=["input-major head", pytest.param("head in panels", marks=pytest.mark.slow)])
def models(golden_dir, request):
    with pytest.MonkeyPatch.context() as patch:  # the layout `cpu_head` picks where OpenBLAS runs on AVX-512, or not
        patch.setattr(cpu, "openblas_core", lambda: "skylakex" if request.param == "head in panels" else None)
        patch.setattr(cpu.PanelEmbedding, "rows_alike", lambda self: True)  # the layout, whatever this BLAS rounds
        models = {name: mlx_locate.load(golden_dir(name), dtype="float32") for name in CHECKPOINTS}
    kind = cpu.PanelEmbedding if request.param == "head in panels" else cpu.InputMajorEmbedding
    assert all(type(m.runtime.network.language_model.model.embed_tokens) is kind for m in models.values())
    return models


def image_path(case_name: str):
    return GOLDEN / "images" / f"{case_name.split('__')[1]}.png"


def logit_tolerance(case_name: str, values: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(values).max())) if case_name.startswith("tiny_peaky") else 1e-4


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("image", IMAGES)
def test_vision_tower_and_features(models, checkpoint, image):
    runtime = models[checkpoint].runtime
    pre = preprocess(GOLDEN / "images" / f"{image}.png")
    tower = runtime.network.vision_model(mx.array(pre.patches), pre.grid)
    merged = np.array(merge_2x2(tower, pre.grid))
    features = np.array(runtime.network.image_features(mx.array(pre.patches), pre.grid))
    gold_tower = np.load(GOLDEN / "cases" / f"{checkpoint}__{image}.vision_tower.npy")
    gold_features = np.load(GOLDEN / "cases" / f"{checkpoint}__{image}.vision_features.npy")
    np.testing.assert_allclose(merged, gold_tower, atol=1e-4, rtol=0)
    np.testing.assert_allclose(features, gold_features, atol=1e-5, rtol=0)


def first_forwards(model, case):
    """Logits of slow mode's first forward (last prompt row) and of the first block step (6 rows)."""
    runtime = model.runtime
    pre = preprocess(image_path(case["_name"]))
    features = runtime.network.image_features(mx.array(pre.patches), pre.grid)
    runner = StepRunner(runtime.steps, runtime.new_cache())
    prompt = case["input_ids"]
    last = runner.prefill(runtime.network.embed(prompt, features))
    block = runner.step([prompt[-1]] + [runtime.token_ids.text_mask] * 5, block=True)
    return np.array(last)[0], np.array(block)


@pytest.mark.parametrize("name", CASES)
def test_prompt_and_first_logits(models, name):
    case = {**golden_case(name), "_name": name}
    model = models[name.split("__")[0]]
    last, block = first_forwards(model, case)
    rows = [(last, case["prompt_last_logits"])] + [(block[j], r) for j, r in enumerate(case["first_block"]["rows"])]
    for logits, gold in rows:
        top = gold["top"]
        assert list(np.argsort(-logits, kind="stable")[:10]) == top["ids"]
        values = np.array(top["values"])
        np.testing.assert_allclose(logits[top["ids"]], values, atol=logit_tolerance(name, values), rtol=0)
        lse = float(np.log(np.sum(np.exp(logits.astype(np.float64) - logits.max()))) + logits.max())
        assert abs(lse - gold["logsumexp"]) <= logit_tolerance(name, values)


# The fast tier's cases: both checkpoints, rendering B, a refer and a point prompt (all of them in the slow tier).
FAST_CASES = [
    "tiny_random__shapes_448x448__detect__jinja",
    "tiny_peaky__shapes_640x480__refer",
    "tiny_peaky__shapes_448x448__point",
]


@pytest.mark.parametrize("mode", ["slow", "fast", "hybrid"])
@pytest.mark.parametrize("name", slow_but(CASES, FAST_CASES))
def test_greedy_tokens(models, name, mode):
    case = golden_case(name)
    gold = case["generation"][mode]
    model = models[name.split("__")[0]]
    result = model.locate(
        image_path(name),
        prompt=case["prompt"],
        task="raw",
        mode=mode,
        max_tokens=case["settings"]["max_new_tokens"],
        strict=True,
        rendering="B" if name.endswith("__jinja") else "A",
    )
    assert result.prompt_ids == case["input_ids"]
    assert result.grid == case["image_grid_hw"]
    assert result.token_ids == gold["generated_ids"]
    assert result.stats["stop_reason"] == gold["stop"]
    assert result.stats["steps"] == gold["n_forward"]
    assert result.stats["host_reads"] == result.stats["steps"]


CAPPED = [
    n for n in CASES if n.startswith("tiny_peaky") and golden_case(n)["generation"]["fast"]["stop"] == "length_cap"
]


@pytest.mark.parametrize("name", slow_but(CAPPED, CAPPED[:1]))
def test_guards_end_greedy_decoding_that_strict_runs_to_the_cap(models, name):
    """Where the reference's greedy fast mode fabricates tokens to the cap (docs/model.md §10.7), the default guards
    stop it early, by the guards' own rules."""
    case = golden_case(name)
    result = models["tiny_peaky"].locate(
        image_path(name), prompt=case["prompt"], task="raw", mode="fast", max_tokens=64
    )
    assert len(CAPPED) >= 5
    assert result.stats["stop_reason"] in ("end_guard", "loop_guard")
    assert len(result.token_ids) < len(case["generation"]["fast"]["generated_ids"])
