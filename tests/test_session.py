"""Many queries on one image: the shared prefix and the vision cache change nothing in the answers."""

from __future__ import annotations

import re

import pytest
from conftest import GOLDEN
from PIL import Image

import mlx_locate
from mlx_locate.preprocess import DEFAULT_MAX_PIXELS
from mlx_locate.weights.checkpoint import DEMO_DIR

IMAGE = GOLDEN / "images" / "shapes_448x448.png"
QUERIES = ["red box", "green circle", "the blue square"]


@pytest.fixture(scope="module")
def model(golden_dir):
    return mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")


def test_prefix_reuse_gives_the_same_tokens_as_separate_calls(model, golden_dir):
    together = model.locate(IMAGE, QUERIES, mode="hybrid", max_tokens=24)
    fresh = mlx_locate.load(golden_dir("tiny_peaky"), dtype="float32")
    for query, result in zip(QUERIES, together, strict=True):
        alone = fresh.locate(IMAGE, query, mode="hybrid", max_tokens=24)
        fresh.runtime.clear_caches()
        assert result.prompt_ids == alone.prompt_ids
        assert result.token_ids == alone.token_ids
        assert result.objects == alone.objects


def test_session_queries_are_independent(model):
    session = model.session(IMAGE)
    first = session.locate("red box", mode="fast", max_tokens=12)
    session.locate("green circle", mode="slow", max_tokens=12)
    again = session.locate("red box", mode="fast", max_tokens=12)
    assert again.token_ids == first.token_ids
    assert sum(key[0] == session.image.key for key in model.runtime.prefixes) == 1  # the prefix was prefilled once


def test_vision_cache_hits_on_the_same_image_and_misses_on_a_changed_one(model, tmp_path):
    model.runtime.features.clear()
    assert not model.session(IMAGE).vision_cached
    assert model.session(Image.open(IMAGE)).vision_cached  # same content, another object
    changed = Image.open(IMAGE).convert("RGB")
    changed.putpixel((0, 0), (1, 2, 3))
    assert not model.session(changed).vision_cached
    same_size_other = Image.new("RGB", changed.size, (255, 255, 255))
    assert not model.session(same_size_other).vision_cached


@pytest.mark.parametrize(
    "options", [{"max_pixels": 10}, {"orientation": "stored"}, {"max_pixels": 10**6, "max_image_tokens": 16}]
)
def test_a_session_refuses_the_image_options_it_cannot_honour(model, options):
    with pytest.raises(mlx_locate.RequestError, match=f"{', '.join(options)}: the session's image is loaded"):
        model.session(IMAGE).locate("red box", max_tokens=4, **options)


def test_a_session_answers_under_its_own_image_options(model):
    """The session's requests carry its image's options, so a prepared image's check lets them through."""
    result = model.session(IMAGE, max_pixels=10**6, orientation="stored", max_image_tokens=16).locate("red box")
    assert (result.grid, result.orientation) == ([4, 4], "stored")


@pytest.mark.parametrize(
    "options, says",
    [
        ({"max_pixels": 1000}, "max_pixels=1000: the image was prepared with max_pixels=89478485"),
        ({"orientation": "stored"}, "orientation='stored': the image was prepared with orientation='exif'"),
        ({"max_image_tokens": 16}, "max_image_tokens=16: the image was prepared with max_image_tokens=256"),
    ],
)
def test_a_request_on_a_prepared_image_refuses_other_image_options(model, options, says):
    """A `PreparedImage` (`model.runtime.prepare`, `session.image`) holds the work its options did: a request that
    asks others is told so. Before, they were ignored: a 200,704-pixel image answered under `max_pixels=1000`, its
    16 x 16 patches under `max_image_tokens=16`, its shown frame under `orientation="stored"`."""
    prepared = model.runtime.prepare(IMAGE)
    with pytest.raises(mlx_locate.RequestError, match=re.escape(says)):
        model.locate(prepared, "red box", max_tokens=4, **options)
    same = {"max_pixels": DEFAULT_MAX_PIXELS, "orientation": "exif", "max_image_tokens": model.runtime.in_token_limit}
    again = model.locate(prepared, "red box", max_tokens=4, **same)  # the options it was prepared under, spelled out
    assert again.token_ids == model.locate(IMAGE, "red box", max_tokens=4).token_ids
    # Limits not given are the prepared image's own: an image prepared under a patch budget answers under it.
    small = model.runtime.prepare(IMAGE, max_image_tokens=16)
    assert model.locate(small, "red box", max_tokens=4).token_ids == (
        model.locate(IMAGE, "red box", max_tokens=4, max_image_tokens=16).token_ids
    )


def test_official_sampling_is_reproducible_by_seed():
    model = mlx_locate.load("demo")
    image = DEMO_DIR / "example.png"
    runs = [
        model.locate(image, "square", sampling=mlx_locate.Sampling.OFFICIAL, seed=seed, max_tokens=48)
        for seed in (1, 1, 2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats["host_reads"] == runs[0].stats["steps"]
    assert all(r.stats["stop_reason"] != "length_cap" for r in runs)  # top-p makes decoding end by itself
