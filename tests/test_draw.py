"""Drawing located objects."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mlx_locate.draw import draw_objects
from mlx_locate.parse import LocatedObject


def box(label, x1, y1, x2, y2, confidence=None) -> LocatedObject:
    return LocatedObject(label, (x1, y1, x2, y2), None, None, None, confidence)


def point(label, x, y) -> LocatedObject:
    return LocatedObject(label, None, None, (x, y), None, None)


def test_draws_boxes_and_points():
    image = Image.new("RGB", (200, 150), (255, 255, 255))
    objects = [box("car", 20, 30, 120, 100, 0.87), box("person", 150, 140, 130, 60), point(None, 60, 130)]
    out = draw_objects(image, objects)
    assert image.getpixel((20, 60)) == (255, 255, 255)  # the input stays untouched
    pixels = np.asarray(out)
    assert (pixels[60, 20] != 255).any() and (pixels[60, 120] != 255).any()  # left and right edges of the box
    assert (pixels[100, 70] != 255).any()  # bottom edge
    assert (pixels[75, 70] == 255).all()  # inside the box stays clear
    assert (pixels[100, 130] != 255).any()  # the reversed second box is drawn too
    assert (pixels[130, 60] != 255).any()  # the point
    assert tuple(pixels[60, 20]) != tuple(pixels[100, 130])  # one colour per label
    assert (pixels[15:30, 20:60] != 255).any()  # the caption above the first box


def test_rgba_input_and_empty_list():
    image = Image.new("RGBA", (40, 30), (0, 0, 0, 0))
    out = draw_objects(image, [])
    assert out.mode == "RGB" and out.getpixel((5, 5)) == (255, 255, 255)


def test_save_refuses_to_overwrite(tmp_path):
    image = Image.new("RGB", (64, 64), (0, 0, 0))
    path = tmp_path / "boxes.png"
    draw_objects(image, [box("a", 10, 10, 50, 50)], path)
    first = np.asarray(Image.open(path))
    assert (first[30, 10] != 0).any()
    with pytest.raises(FileExistsError, match="boxes.png"):
        draw_objects(image, [box("b", 5, 5, 20, 20)], path)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), first)
    draw_objects(image, [], path, overwrite=True)
    assert (np.asarray(Image.open(path)) == 0).all()
