"""A `Result` in other tools: `to_supervision()` (supervision's Detections), `parse_text` (answer text from
anywhere -> our objects) and results that draw themselves (`draw()`, Jupyter's `_repr_png_`)."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
from PIL import Image

import mlx_locate
from mlx_locate.draw import draw_objects
from mlx_locate.parse import LocatedObject
from mlx_locate.preprocess import load_image
from mlx_locate.request import Request, Result
from mlx_locate.weights.checkpoint import DEMO_DIR

IMAGE = DEMO_DIR / "example.png"


@pytest.fixture(scope="module")
def model():
    return mlx_locate.load("demo")


@pytest.fixture(scope="module")
def located(model):
    return model.locate(str(IMAGE), "square", mode="fast", max_tokens=40)


def result_of(objects: list[LocatedObject]) -> Result:
    return Result(objects, [], "", [], [], [], [16, 16], (200, 100), "fast", False)


def test_to_supervision_equals_the_objects(located):
    objects = [
        LocatedObject("cat", (10.0, 20.0, 30.5, 40.25), (50, 200, 152, 402), None, None, 0.9),
        LocatedObject("dog", (1.0, 2.0, 3.0, 4.0), (5, 20, 15, 40), None, None, 0.5),
        LocatedObject(None, None, None, (7.5, 8.5), (37, 85), 0.25),
        LocatedObject("cat", (0.0, 0.0, 200.0, 100.0), (0, 0, 1000, 1000), None, None, 0.75),
    ]
    detections = result_of(objects).to_supervision(classes=["dog", "bird"])
    np.testing.assert_allclose(
        detections.xyxy, [[10, 20, 30.5, 40.25], [1, 2, 3, 4], [7.5, 8.5, 7.5, 8.5], [0, 0, 200, 100]], atol=1e-6
    )
    np.testing.assert_allclose(detections.confidence, [0.9, 0.5, 0.25, 0.75], atol=1e-7)
    assert detections.class_id.tolist() == [2, 0, 3, 2]  # dog, bird as given; then cat, "" as they come
    assert detections.data["class_name"].tolist() == ["cat", "dog", "", "cat"]
    assert len(result_of([]).to_supervision()) == 0

    real = located.to_supervision()
    assert len(real) == len(located.objects) > 0
    np.testing.assert_allclose(real.xyxy, [o.box for o in located.objects], atol=1e-4)
    np.testing.assert_allclose(real.confidence, [o.confidence for o in located.objects], atol=1e-6)


def test_to_supervision_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "supervision", None)
    with pytest.raises(ImportError, match=r"mlx-locate\[supervision\]"):
        result_of([]).to_supervision()


def test_parse_text_gives_the_objects_of_the_answer(located):
    parsed = mlx_locate.parse_text(located.text, located.image_size)
    assert parsed.objects == [
        LocatedObject(o.label, o.box, o.box_norm, o.point, o.point_norm, None) for o in located.objects
    ]
    # NVIDIA's / mlx-vlm's decoded text, plain integers, an empty answer and a point, on a 1000 x 500 image:
    # x -> v / 1000 * 1000, y -> v / 1000 * 500.
    text = "<ref>cat</ref><box><100><200><300><400></box><ref>dog</ref><box>None</box><box>500, 500</box><|im_end|>"
    parsed = mlx_locate.parse_text(text, (1000, 500))
    assert parsed.objects == [
        LocatedObject("cat", (100.0, 100.0, 300.0, 200.0), (100, 200, 300, 400), None, None, None),
        LocatedObject("dog", None, None, (500.0, 250.0), (500, 500), None),
    ]
    assert parsed.empty_labels == ["dog"] and parsed.ended and parsed.malformed == 0
    broken = mlx_locate.parse_text("<ref>a</ref><box><1><2><3></box><box>x y</box><box><5><6><7><8>", (10, 10))
    assert broken.objects == [] and broken.malformed == 2 and broken.truncated


@pytest.mark.parametrize("digit", ["²", "٣", "３"])
def test_parse_text_reads_only_ascii_digits_as_coordinates(digit):
    for box in (f"{digit} 2 3 4", f"<{digit}><2><3><4>"):
        parsed = mlx_locate.parse_text(f"<ref>a</ref><box>{box}</box>", (224, 224))
        assert parsed.objects == [] and parsed.malformed == 1, box


@pytest.mark.parametrize(
    ("text", "size", "error", "message"),
    [
        (None, (10, 10), TypeError, "text must be a string, got NoneType"),
        (5, (10, 10), TypeError, "text must be a string, got int"),
        ("", (-1, 5), ValueError, "image_size must be"),
        ("", (10, float("nan")), ValueError, "image_size must be"),
        ("", None, ValueError, "image_size must be"),
        ("", (10, 10, 3), ValueError, "image_size must be"),
    ],
)
def test_parse_text_refuses_bad_arguments(text, size, error, message):
    with pytest.raises(error, match=message):
        mlx_locate.parse_text(text, size)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_a_located_result_draws_itself_from_its_path(model, located):
    assert located.source == (str(IMAGE), None)  # the path, not a second copy of the image
    want = pixels(draw_objects(load_image(IMAGE), located.objects))
    assert np.array_equal(pixels(located.draw()), want)
    assert np.array_equal(pixels(Image.open(io.BytesIO(located._repr_png_()))), want)
    assert (pixels(located.draw()) != pixels(load_image(IMAGE).convert("RGB"))).any()  # something was drawn

    image = Image.open(IMAGE)
    from_image = model.locate(image, "square", mode="fast", max_tokens=40)
    assert from_image.source[0] is image  # the caller's own image, not a copy

    (engine_result,) = model.locate_many([Request(str(IMAGE), "square", mode="fast", max_tokens=40)])
    assert engine_result.source is None and engine_result._repr_png_() is None
    with pytest.raises(ValueError, match=r"draw\(image\)"):
        engine_result.draw()
    assert np.array_equal(pixels(engine_result.draw(IMAGE)), want)
