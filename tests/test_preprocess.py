"""Preprocessing against docs/model.md §5 and the reference's recorded `pixel_values`."""

from __future__ import annotations

import functools
import hashlib
import re

import numpy as np
import pytest
from conftest import GOLDEN, golden_case, golden_cases
from PIL import Image

from mlx_locate.preprocess import load_image, preprocess, target_size, to_rgb

# docs/model.md §5 table: original (w, h), the sizes resized to in order, grid (h, w), patches, LM tokens.
SIZE_TABLE = [
    ((448, 448), [], (32, 32), 1024, 256),
    ((640, 360), [(644, 364)], (26, 46), 1196, 299),
    ((640, 480), [(644, 504)], (36, 46), 1656, 414),
    ((896, 896), [], (64, 64), 4096, 1024),
    ((1920, 1080), [(1932, 1092)], (78, 138), 10764, 2691),
    ((3840, 2160), [(2990, 1682), (2996, 1708)], (122, 214), 26108, 6527),
    ((10, 10), [(28, 28)], (2, 2), 4, 1),
    ((1, 1), [(28, 28)], (2, 2), 4, 1),
]


def normalise(value: float) -> float:
    return (value / 255 - 0.5) / 0.5


@pytest.mark.parametrize(("size", "resizes", "grid", "n_patches", "lm_tokens"), SIZE_TABLE)
def test_size_table(monkeypatch, size, resizes, grid, n_patches, lm_tokens):
    sizes = target_size(*size)
    assert sizes.scaled == (resizes[0] if len(resizes) == 2 else size)
    assert sizes.final == (resizes[-1] if resizes else size)

    seen = []
    resize = Image.Image.resize

    def recording_resize(self, new_size, *args, **kwargs):
        seen.append((tuple(new_size), args, kwargs))
        return resize(self, new_size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recording_resize)
    out = preprocess(Image.new("RGB", size, (200, 30, 90)))
    assert [s for s, _, _ in seen] == resizes
    assert all(Image.Resampling.BICUBIC in (*args, *kwargs.values()) for _, args, kwargs in seen)
    assert out.grid == grid
    assert out.patches.shape == (n_patches, 3, 14, 14)
    assert out.patches.dtype == np.float32
    assert out.patches.shape[0] // 4 == lm_tokens
    assert out.processed_size == (grid[1] * 14, grid[0] * 14)
    assert out.original_size == size


def test_aspect_limit_error():
    # 10000 x 900 scales to 7484 x 673, then stretches to 7504 x 700: 536 patches wide.
    with pytest.raises(ValueError, match=r"10000x900.*7504x700"):
        target_size(10000, 900)
    with pytest.raises(ValueError, match="10000x900"):
        preprocess(Image.new("RGB", (10000, 900)))
    with pytest.raises(ValueError, match="512"):
        target_size(14, 7168)  # 512 patches tall, within the token limit


@pytest.mark.parametrize("size", [(7200, 200), (7300, 700), (8000, 20), (10000, 900), (14, 7168)])
def test_a_long_image_is_told_the_real_limit_and_the_budget_that_fits_it(size):
    """A side must stay below 512 patches whatever the aspect ratio (3600 x 100 fits, 7200 x 200 does not); the
    budget the error names fits the image, and is the largest that does."""
    assert target_size(3600, 100).final == (3612, 112)
    with pytest.raises(ValueError, match=r"each side must stay below 512 patches \(7,140 pixels\)") as error:
        target_size(*size)
    budget = int(re.search(r"--image-tokens (\d+) \(API: max_image_tokens=\1\) scales it down", str(error.value))[1])
    assert max(preprocess(Image.new("RGB", size), in_token_limit=budget).grid) < 512
    with pytest.raises(ValueError, match="must stay below 512 patches"):
        target_size(*size, in_token_limit=budget + 1)


def test_an_image_no_budget_fits_is_told_to_crop():
    with pytest.raises(ValueError, match="crop it, or cut it into pieces at most 7,140 pixels long") as error:
        target_size(100_000, 14)  # its height would reach 0 before its width fits
    assert "--image-tokens" not in str(error.value)
    assert target_size(7140, 14).final == (7140, 28)


def test_zero_side_error():
    with pytest.raises(ValueError, match="0 pixels"):
        target_size(80_000_000, 14)  # scales the height to 0.9 pixels
    with pytest.raises(ValueError, match="0 pixels"):
        target_size(0, 10)


@functools.cache
def golden_patches(image_file: str):
    return preprocess(GOLDEN / "images" / image_file)


@pytest.mark.parametrize("name", golden_cases())
def test_golden_pixel_values(name):
    case = golden_case(name)
    out = golden_patches(case["image"]["file"])
    assert list(out.grid) == case["image_grid_hw"]
    assert list(out.processed_size) == case["processed_size_wh"]
    assert list(out.original_size) == case["image"]["size"]
    assert list(out.patches.shape) == case["pixel_values"]["shape"]
    assert hashlib.sha256(out.patches.astype("<f4").tobytes()).hexdigest() == case["pixel_values"]["sha256_f32"]


def pixel(patches: np.ndarray, grid_w: int, x: int, y: int) -> np.ndarray:
    """The 3 channel values of pixel (x, y) of the processed image."""
    return patches[(y // 14) * grid_w + x // 14, :, y % 14, x % 14]


def test_rgba_composited_on_white():
    rgba = np.zeros((28, 56, 4), np.uint8)
    rgba[..., :3] = (10, 20, 30)
    rgba[..., 3] = 255
    rgba[3, 5] = (0, 0, 0, 0)  # transparent black -> white
    rgba[20, 40] = (0, 0, 0, 128)  # half-transparent black -> mid grey
    rgba[7, 30] = (255, 0, 0, 51)  # 20% red over white
    image = Image.fromarray(rgba, "RGBA")
    assert to_rgb(image).mode == "RGB"

    out = preprocess(image)
    assert out.grid == (2, 4) and out.processed_size == (56, 28)
    np.testing.assert_array_equal(pixel(out.patches, 4, 5, 3), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(pixel(out.patches, 4, 40, 20), [normalise(127)] * 3, atol=1.5 / 127.5)
    np.testing.assert_allclose(pixel(out.patches, 4, 30, 7), [1.0, normalise(204), normalise(204)], atol=1.5 / 127.5)
    np.testing.assert_allclose(pixel(out.patches, 4, 0, 0), [normalise(10), normalise(20), normalise(30)], atol=1e-6)


def test_other_modes_convert():
    grey = Image.new("L", (28, 28), 64)
    out = preprocess(grey)
    np.testing.assert_allclose(out.patches, normalise(64), atol=1e-6)
    palette = Image.new("RGB", (28, 28), (255, 0, 0)).convert("P")
    np.testing.assert_allclose(preprocess(palette).patches[0, :, 0, 0], [1.0, -1.0, -1.0])


def test_patch_layout_against_loop():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, size=(42, 56, 3), dtype=np.uint8)  # H = 42 -> stretched to 56
    image = Image.fromarray(array, "RGB")
    out = preprocess(image)
    stretched = np.asarray(image.resize((56, 56), Image.Resampling.BICUBIC))
    assert out.grid == (4, 4) and out.processed_size == (56, 56) and out.original_size == (56, 42)

    expected = []
    for row in range(4):
        for col in range(4):
            patch = np.zeros((3, 14, 14), np.float32)
            for c in range(3):
                for dy in range(14):
                    for dx in range(14):
                        value = np.float32(stretched[row * 14 + dy, col * 14 + dx, c]) / np.float32(255)
                        patch[c, dy, dx] = (value - np.float32(0.5)) / np.float32(0.5)
            expected.append(patch)
    np.testing.assert_array_equal(out.patches, np.stack(expected))


def test_load_image_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(FileNotFoundError):
        preprocess(tmp_path / "missing.png")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(ValueError, match="notes.png"):
        load_image(text)
    with pytest.raises(ValueError, match="is not a file"):
        load_image(tmp_path)


def test_load_image_reads_file(tmp_path):
    path = tmp_path / "small.png"
    Image.new("RGBA", (30, 20), (1, 2, 3, 4)).save(path)
    image = load_image(str(path))
    assert image.size == (30, 20) and image.mode == "RGBA"
    assert image.getpixel((0, 0)) == (1, 2, 3, 4)
    same = Image.new("RGB", (5, 5))
    assert load_image(same) is same
