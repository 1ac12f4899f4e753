"""Real photos as a viewer shows them: EXIF orientation, HEIC and AVIF, colour profiles, multi-frame files and the
patch budget (`max_image_tokens`), through the API, the CLI and the folder command on the demo model."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageOps

import mlx_locate
from mlx_locate.commands import batch
from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import locate as generate
from mlx_locate.draw import draw_objects
from mlx_locate.preprocess import UNDO_ORIENTATION, load_image, photo_notes, target_size, to_rgb
from mlx_locate.request import RequestError
from mlx_locate.synthetic.scenes import COLORS, Obj, draw_object

# A landscape scene (the displayed frame) with two squares; 7 x 5 LM tokens at the demo's patch budget.
SIZE = (280, 196)
SQUARES = (Obj("square", "red", (30, 40, 100, 110)), Obj("square", "blue", (170, 90, 235, 155)))


def iou(a, b) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0) * max(h, 0)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def all_found(result, truth=SQUARES) -> bool:
    """Every true square matched by a located one (IoU >= 0.5), in the result's frame."""
    return all(any(iou(o.box, t.box) >= 0.5 for o in result.objects) for t in truth)


@pytest.fixture(scope="module")
def demo():
    return mlx_locate.load("demo")


def scene() -> Image.Image:
    """The scene as a viewer shows it."""
    image = Image.new("RGB", SIZE, (232, 230, 226))
    draw = ImageDraw.Draw(image)
    for o in SQUARES:
        draw_object(draw, o, COLORS[o.color])
    return image


@pytest.fixture(scope="module")
def shown() -> Image.Image:
    return scene()


def tagged(image: Image.Image, orientation: int) -> bytes:
    """`image` stored the way a camera stores it when it writes EXIF `orientation`: the pixels a viewer turns
    into `image`, with the tag."""
    stored = image.transpose(UNDO_ORIENTATION[orientation]) if orientation != 1 else image
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    stored.save(out, "JPEG", quality=95, exif=exif.tobytes())
    return out.getvalue()


def test_undo_orientation_inverts_the_viewers_transform(shown):
    """Independent of the model: for every tag, Pillow's viewer transform of our stored pixels gives the scene."""
    for o in range(2, 9):
        stored = Image.open(io.BytesIO(tagged(shown, o)))
        assert stored.getexif()[0x0112] == o
        back = np.asarray(ImageOps.exif_transpose(stored), dtype=np.int16)
        assert back.shape[:2] == (SIZE[1], SIZE[0])
        assert np.abs(back - np.asarray(shown, dtype=np.int16)).mean() < 3  # JPEG's loss only


@pytest.mark.parametrize("orientation", range(2, 9))
def test_every_exif_orientation_in_the_displayed_frame(demo, shown, tmp_path, orientation):
    path = tmp_path / f"photo_{orientation}.jpg"
    path.write_bytes(tagged(shown, orientation))
    result = demo.locate(path, "square", mode="slow")
    assert result.image_size == SIZE and result.orientation == "exif"
    assert all_found(result), [o.box for o in result.objects]


def test_stored_keeps_the_stored_pixels(demo, shown, tmp_path):
    """`orientation="stored"` answers exactly as the stored pixels without a tag (today's behaviour)."""
    path = tmp_path / "photo_6.jpg"
    path.write_bytes(tagged(shown, 6))
    stored = Image.open(path)
    plain = Image.fromarray(np.asarray(stored))  # the same decoded pixels, no EXIF
    kept = demo.locate(path, "square", mode="slow", orientation="stored")
    bare = demo.locate(plain, "square", mode="slow")
    assert kept.orientation == "stored" and kept.image_size == stored.size == (SIZE[1], SIZE[0])
    assert [o.box for o in kept.objects] == [o.box for o in bare.objects] and kept.token_ids == bare.token_ids
    assert photo_notes(load_image(path, orientation="stored")).exif_orientation == 6
    opened = demo.locate(Image.open(path), "square", mode="slow", orientation="stored")  # a PIL image, tag and all
    assert opened.image_size == stored.size and opened.token_ids == bare.token_ids


def tagged_tiff(image: Image.Image, orientation: int, path, pages: int = 1) -> Image.Image:
    """`image` stored as a TIFF with the Orientation tag `orientation` (`pages` copies); the stored pixels."""
    stored = image.transpose(UNDO_ORIENTATION[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, exif=exif, save_all=True, append_images=[stored] * (pages - 1))
    return stored


def decoded(source) -> Image.Image:
    """`source` opened and decoded by the caller, as `Image.open(...).load()` (or reading its pixels) leaves it."""
    image = Image.open(source)
    image.load()
    return image


@pytest.mark.parametrize("orientation", range(2, 9))
def test_tiff_orientation_in_either_frame(shown, tmp_path, orientation):
    """Pillow turns a TIFF as it decodes it and drops the tag: "stored" still gives the stored pixels, from a
    path, an opened PIL image, one the caller decoded (before, its shown pixels) or a multi-page file."""
    for pages in (1, 2):
        path = tmp_path / f"scan_{pages}.tif"
        stored = tagged_tiff(shown, orientation, path, pages)
        assert Image.open(path).tag_v2[0x0112] == orientation
        for given in (Path, Image.open, decoded):  # the path, an opened image, a decoded one
            kept = load_image(given(path), orientation="stored")
            assert np.array_equal(np.asarray(kept), np.asarray(stored)), (pages, given)
            assert photo_notes(kept) == ("stored", orientation, photo_notes(kept).warnings)
            turned = load_image(given(path))
            assert (
                np.array_equal(np.asarray(turned), np.asarray(shown))
                and photo_notes(turned).exif_orientation == orientation
            )


def test_a_tiff_decoded_from_bytes_has_no_stored_frame_to_give(shown, tmp_path):
    """Its tag is gone with the bytes it was decoded from: "stored" is refused, saying what to pass instead (before,
    the shown pixels as "stored"); as a viewer shows it, it answers."""
    path = tmp_path / "scan.tif"
    tagged_tiff(shown, 6, path)
    image = decoded(io.BytesIO(path.read_bytes()))
    with pytest.raises(ValueError, match=r"^the image: Pillow turned this TIFF by its Orientation tag as it decoded"):
        load_image(image, orientation="stored")
    assert np.array_equal(np.asarray(load_image(image)), np.asarray(shown))


def test_a_tiff_answers_in_the_stored_frame_as_its_stored_pixels(demo, shown, tmp_path):
    path = tmp_path / "scan.tif"
    stored = tagged_tiff(shown, 6, path)
    kept = demo.locate(path, "square", mode="slow", orientation="stored")
    bare = demo.locate(Image.fromarray(np.asarray(stored)), "square", mode="slow")
    assert kept.orientation == "stored" and kept.image_size == stored.size == (SIZE[1], SIZE[0])
    assert kept.token_ids == bare.token_ids and [o.box for o in kept.objects] == [o.box for o in bare.objects]
    opened = demo.locate(decoded(path), "square", mode="slow", orientation="stored")  # decoded by the caller
    assert opened.image_size == kept.image_size and opened.token_ids == kept.token_ids


def test_draw_is_in_the_frame_of_the_result(demo, shown, tmp_path):
    """`draw()` and Jupyter's picture of a path or a PIL image, in either frame, are the result's frame drawn."""
    path = tmp_path / "photo_6.jpg"
    path.write_bytes(tagged(shown, 6))
    frames = {"exif": ImageOps.exif_transpose(Image.open(path)), "stored": Image.open(path)}
    for orientation, frame in frames.items():
        for image in (path, Image.open(path)):
            result = demo.locate(image, "square", orientation=orientation)
            assert result.image_size == frame.size and result.objects
            expected = np.asarray(draw_objects(Image.fromarray(np.asarray(frame)), result.objects))
            assert np.array_equal(np.asarray(result.draw()), expected), (orientation, image)
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(result._repr_png_()))), expected)
            assert np.array_equal(np.asarray(result.draw(Image.open(path))), expected)


def test_an_image_without_a_tag_or_profile_is_unchanged(shown):
    image = load_image(io.BytesIO(png_bytes(shown)))
    assert np.array_equal(np.asarray(image), np.asarray(shown))
    assert photo_notes(image) == (("exif", 1, ()))


def png_bytes(image: Image.Image, **params) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **params)
    return out.getvalue()


# --- HEIC and AVIF ---


def save_heic(image: Image.Image, orientation: int, path) -> None:
    """`image` saved as an iPhone saves it: HEIC of the stored pixels, EXIF `orientation` written (by pillow-heif)
    as HEIF's own rotation."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.transpose(UNDO_ORIENTATION[orientation]).save(path, "HEIF", quality=95, exif=exif.tobytes())


def test_iphone_style_heic_with_orientation_6(demo, shown, tmp_path):
    """pillow-heif writes EXIF orientation 6 as HEIF's own rotation, as an iPhone does; libheif undoes it."""
    path = tmp_path / "IMG_0001.HEIC"
    save_heic(shown, 6, path)
    result = demo.locate(path, "square", mode="slow")
    assert result.image_size == SIZE and all_found(result)
    stored = demo.locate(path, "square", mode="slow", orientation="stored")
    assert stored.image_size == (SIZE[1], SIZE[0]) and stored.orientation == "stored"


@pytest.mark.parametrize(("name", "fmt"), [("plain.heic", "HEIF"), ("plain.avif", "AVIF")])
def test_plain_heic_and_avif(demo, shown, tmp_path, name, fmt):
    path = tmp_path / name
    shown.save(path, fmt, quality=95)
    result = demo.locate(path, "square", mode="slow")
    assert result.image_size == SIZE and all_found(result)


# --- colour profiles ---

D50 = np.array([0.9642, 1.0, 0.8249])
D65 = np.array([0.3127 / 0.3290, 1.0, (1 - 0.3127 - 0.3290) / 0.3290])
P3_PRIMARIES = ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060))
SRGB_PRIMARIES = ((0.64, 0.33), (0.30, 0.60), (0.15, 0.06))
BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])


def rgb_to_xyz(primaries, white=D65) -> np.ndarray:
    """The RGB -> XYZ matrix of three primaries (x, y) and a white point."""
    xyz = np.array([[x / y, 1.0, (1 - x - y) / y] for x, y in primaries]).T
    return xyz * np.linalg.solve(xyz, white)


def srgb_decode(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.04045, v / 12.92, ((v + 0.055) / 1.055) ** 2.4)


def srgb_encode(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.0031308, v * 12.92, 1.055 * v ** (1 / 2.4) - 0.055)


def icc_profile(name: str, primaries=None) -> bytes:
    """An ICC v4 display profile (matrix/TRC, the sRGB transfer curve) written from the specification: the
    colorants adapted to the D50 connection space with Bradford, as Apple's Display P3 profile has them. Without
    `primaries`, a grey profile (the sRGB curve alone)."""

    def s15(values) -> bytes:
        return b"".join(struct.pack(">i", round(v * 65536)) for v in values)

    def mluc(text: str) -> bytes:
        data = text.encode("utf-16-be")
        return b"mluc" + bytes(4) + struct.pack(">II", 1, 12) + b"enUS" + struct.pack(">II", len(data), 28) + data

    curve = b"para" + bytes(4) + struct.pack(">HH", 3, 0) + s15([2.4, 1 / 1.055, 0.055 / 1.055, 1 / 12.92, 0.04045])
    tags = [(b"desc", mluc(name)), (b"cprt", mluc("none")), (b"wtpt", b"XYZ " + bytes(4) + s15(D50))]
    if primaries is None:
        space, tags = b"GRAY", [*tags, (b"kTRC", curve)]
    else:
        cone = BRADFORD @ D50 / (BRADFORD @ D65)
        adapt = np.linalg.inv(BRADFORD) @ np.diag(cone) @ BRADFORD
        colorants = adapt @ rgb_to_xyz(primaries)
        space = b"RGB "
        tags += [(sig, b"XYZ " + bytes(4) + s15(colorants[:, i])) for i, sig in enumerate((b"rXYZ", b"gXYZ", b"bXYZ"))]
        tags += [(sig, curve) for sig in (b"rTRC", b"gTRC", b"bTRC")]
    offset = 128 + 4 + 12 * len(tags)
    table, body = struct.pack(">I", len(tags)), b""
    for sig, data in tags:
        data += bytes(-len(data) % 4)
        table += sig + struct.pack(">II", offset + len(body), len(data))
        body += data
    size = offset + len(body)
    header = struct.pack(">I", size) + bytes(4) + bytes([4, 0x30, 0, 0]) + b"mntr" + space + b"XYZ "
    header += bytes(12) + b"acsp"
    header += bytes(24) + struct.pack(">I", 0) + s15(D50) + bytes(4 + 16 + 28)
    assert len(header) == 128
    return header + table + body


def p3_to_srgb(rgb) -> np.ndarray:
    """Display P3 8-bit values -> the sRGB 8-bit values of the same colour (clipped to sRGB's gamut)."""
    linear = srgb_decode(np.asarray(rgb, dtype=np.float64) / 255)
    to_srgb = np.linalg.solve(rgb_to_xyz(SRGB_PRIMARIES), rgb_to_xyz(P3_PRIMARIES))
    return np.round(255 * srgb_encode(np.clip(linear @ to_srgb.T, 0, 1)))


@pytest.mark.parametrize("colour", [(255, 0, 0), (180, 90, 60), (40, 160, 200), (128, 128, 128)])
def test_display_p3_converted_to_srgb(colour):
    profile = icc_profile("Display P3", P3_PRIMARIES)
    data = png_bytes(Image.new("RGB", (8, 8), colour), icc_profile=profile)
    got = np.asarray(load_image(io.BytesIO(data)))[4, 4].astype(int)
    expected = p3_to_srgb(colour)
    assert np.abs(got - expected).max() <= 2, (got, expected)
    if colour == (180, 90, 60):
        assert np.abs(expected - colour).max() > 10  # a colour the conversion moves: the test can fail


def test_an_srgb_profile_and_a_broken_one(shown):
    srgb = icc_profile("sRGB IEC61966-2.1", SRGB_PRIMARIES)
    same = load_image(io.BytesIO(png_bytes(shown, icc_profile=srgb)))
    assert np.array_equal(np.asarray(same), np.asarray(shown)) and photo_notes(same).warnings == ()
    broken = load_image(io.BytesIO(png_bytes(shown, icc_profile=b"not a profile" * 20)))
    assert np.array_equal(np.asarray(broken), np.asarray(shown))
    assert "colour profile could not be applied" in photo_notes(broken).warnings[0]


def test_a_grey_profile_on_8_and_16_bit_grey(shown):
    """A grey profile with sRGB's curve leaves grey as it is, at 8 bits and at 16 (read as its high byte)."""
    grey = np.asarray(shown.convert("L"))
    profile = icc_profile("Grey, sRGB curve")
    for values in (grey, grey.astype(np.uint16) * 257):
        image = load_image(io.BytesIO(png_bytes(Image.fromarray(values), icc_profile=profile)))
        assert photo_notes(image).warnings == ()
        got = np.asarray(image.convert("RGB"), dtype=np.int16)
        assert np.abs(got - grey[..., None]).max() <= 1, values.dtype


# --- transparency ---


def transparent_files(shown, folder) -> dict:
    """The scene with its background transparent (the colour stored under it black) in each way files store
    transparency: path -> (Pillow's mode read back, the same picture as RGBA)."""
    colour = np.asarray(shown).copy()
    clear = (colour == colour[0, 0]).all(-1)
    colour[clear] = 0
    rgba = Image.fromarray(np.dstack([colour, np.where(clear, 0, 255).astype(np.uint8)]), "RGBA")
    la = rgba.convert("LA")
    grey = np.asarray(la)[..., 0]
    palette = rgba.quantize(16, method=Image.Quantize.FASTOCTREE)  # an RGBA palette: a tRNS chunk, as pngquant's
    files = {
        "rgba.png": (rgba, {}, "RGBA", rgba),
        "la.png": (la, {}, "LA", la.convert("RGBA")),
        "palette.png": (palette, {}, "P", palette.convert("RGBA")),
        "rgb_key.png": (Image.fromarray(colour), {"transparency": (0, 0, 0)}, "RGB", rgba),
        "grey_key.png": (Image.fromarray(grey), {"transparency": 0}, "L", la.convert("RGBA")),
        "grey16_key.png": (
            Image.fromarray(grey.astype(np.uint16) * 257),
            {"transparency": 0},
            "I;16",
            la.convert("RGBA"),
        ),
        "transparent.gif": (rgba, {}, "P", rgba),
    }
    out = {}
    for name, (image, params, mode, as_rgba) in files.items():
        image.save(folder / name, **params)
        out[folder / name] = (mode, as_rgba)
    return out


def on_white(rgba: Image.Image) -> np.ndarray:
    """An RGBA picture of opaque and clear pixels as it shows on white."""
    pixels = np.asarray(rgba)
    return np.where(pixels[..., 3:] == 0, 255, pixels[..., :3])


def test_every_kind_of_transparency_is_put_onto_white_as_rgba_is(demo, shown, tmp_path):
    for path, (mode, as_rgba) in transparent_files(shown, tmp_path).items():
        stored = Image.open(path)
        assert stored.mode == mode and (mode in ("RGBA", "LA") or "transparency" in stored.info), path.name
        seen = to_rgb(load_image(path))
        assert np.array_equal(np.asarray(seen), on_white(as_rgba)), path.name
        assert seen.getpixel((0, 0)) == (255, 255, 255)
        result, alone = demo.locate(path, "square", mode="slow"), demo.locate(as_rgba, "square", mode="slow")
        assert result.token_ids == alone.token_ids and [o.box for o in result.objects] == [o.box for o in alone.objects]
        assert all_found(result), path.name


def test_transparency_survives_a_colour_profile():
    """Display P3 colours converted, and the clear pixel still white: RGBA, a palette's alpha, a colour key."""
    rgba = Image.new("RGBA", (8, 8), (180, 90, 60, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    palette = rgba.quantize(4, method=Image.Quantize.FASTOCTREE)
    keyed = (rgba.convert("RGB"), {"transparency": (0, 0, 0)})
    profile = icc_profile("Display P3", P3_PRIMARIES)
    for image, params in ((rgba, {}), (palette, {}), keyed):
        seen = to_rgb(load_image(io.BytesIO(png_bytes(image, icc_profile=profile, **params))))
        assert seen.getpixel((0, 0)) == (255, 255, 255), image.mode
        assert np.abs(np.asarray(seen)[4, 4] - p3_to_srgb((180, 90, 60))).max() <= 2, image.mode


# --- multi-frame files ---


def test_animated_gif_first_frame_with_a_warning(demo, shown, tmp_path, capsys):
    path = tmp_path / "moving.gif"
    others = [Image.new("RGB", SIZE, (20, 20, 20)), Image.new("RGB", SIZE, (90, 20, 20))]
    shown.save(path, save_all=True, append_images=others, duration=100)
    result = demo.locate(path, "square", mode="slow")
    assert all_found(result)
    assert result.warnings == ["the file has 3 frames; only the first was used (mlx-locate-video takes video)"]
    assert result.to_dict()["warnings"] == result.warnings
    assert demo.locate(Image.open(path), "square", mode="slow").warnings == result.warnings  # an opened PIL image


# --- the patch budget ---


def test_max_image_tokens_lowers_the_budget(demo, shown):
    full = demo.locate(shown, "square", mode="slow")
    small = demo.locate(shown, "square", mode="slow", max_image_tokens=64)
    (w, h) = target_size(*SIZE, in_token_limit=64).final  # the reference's rule, at a budget of 64 patches
    assert full.grid == [14, 20] and small.grid == [h // 14, w // 14] == [8, 10] and small.image_size == SIZE
    for bad in (0, 3, 10_000, 2.5, True):
        with pytest.raises(RequestError, match="max_image_tokens must be a whole number of patches from 4"):
            demo.locate(shown, "square", max_image_tokens=bad)
    with pytest.raises(RequestError, match="orientation must be one of exif, stored"):
        demo.locate(shown, "square", orientation="upright")


# --- the commands ---


@pytest.fixture()
def use_demo(demo, monkeypatch):
    """The commands load the demo once (`cli.load` answers "demo" with the loaded model)."""
    monkeypatch.setattr(cli_module, "load", lambda path, dtype=None, adapter_path=None: demo)


def run_cli(capsys, *argv) -> tuple[int, dict | str, str]:
    code = generate.main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in argv else out), err


def test_cli_and_folder_answer_in_the_displayed_frame(use_demo, shown, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "portrait.jpg").write_bytes(tagged(shown, 8))
    argv = ["--model", "demo", "--image", str(folder / "portrait.jpg"), "--query", "square", "--mode", "slow"]
    code, data, _ = run_cli(capsys, *argv, "--json")
    assert code == 0 and data["image_size"] == list(SIZE) and data["orientation"] == "exif"
    code, stored, _ = run_cli(capsys, *argv, "--json", "--orientation", "stored")
    assert code == 0 and stored["image_size"] == [SIZE[1], SIZE[0]] and stored["orientation"] == "stored"
    code, small, _ = run_cli(capsys, *argv, "--json", "--image-tokens", "64")
    assert code == 0 and small["grid"] == [8, 10]  # in the displayed frame

    out = tmp_path / "out.jsonl"
    code = batch.main(
        [
            "--model",
            "demo",
            "--images",
            str(folder),
            "--query",
            "square",
            "--mode",
            "slow",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    (answer,) = line["results"]
    assert answer["image_size"] == data["image_size"] and answer["orientation"] == "exif"
    assert [o["box"] for o in answer["objects"]] == [o["box"] for o in data["objects"]]
    big = ["--images", str(folder), "--query", "square", "--out", str(tmp_path / "big.jsonl"), "--image-tokens", "257"]
    code = batch.main(big)
    assert code == 2 and "error: --image-tokens 257: the model takes at most 256 patches" in capsys.readouterr().err
    assert not (tmp_path / "big.jsonl").exists()  # not a line per image, each with the API's error


def test_cli_warns_of_a_multi_frame_file(use_demo, shown, tmp_path, capsys):
    path = tmp_path / "pages.tif"
    shown.save(path, save_all=True, append_images=[shown, shown])
    code, data, err = run_cli(capsys, "--model", "demo", "--image", str(path), "--query", "square", "--json")
    assert code == 0 and data["warnings"] == [
        "the file has 3 frames; only the first was used (mlx-locate-video takes video)"
    ]
    assert err.count("warning:") == 1 and "3 frames" in err
