"""Every row of the README's "Bad input" table: what `mlx-locate` (its `main`, in process, on the demo model) and
the API do with it. An error is one `error: ...` line on stderr and exit status 2; a result is documented."""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import warnings
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import loads_demo_as
from PIL import Image, ImageFile

import mlx_locate
from mlx_locate import Request
from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import locate as generate
from mlx_locate.locate import load
from mlx_locate.preprocess import DEFAULT_MAX_PIXELS, FORMATS, SIGNATURES, ImageTooLargeError, load_image, to_rgb
from mlx_locate.request import RequestError

DEMO = Path(mlx_locate.__file__).parent / "demo"
EXAMPLE = DEMO / "example.png"
HUGE = (20_000, 12_000)  # 240 M pixels: over the default limit and over twice Pillow's own


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(size: tuple[int, int], idat: bytes) -> bytes:
    """A PNG (8-bit RGB) whose header declares `size`, with `idat` as its compressed data."""
    header = struct.pack(">IIBBBBB", *size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def white_idat(width: int, height: int) -> bytes:
    """The zlib stream of `height` white RGB rows (filter 0), in about a second and without holding the pixels:
    after a full flush every row compresses to the same bytes, and the checksum is run row by row."""
    row = b"\x00" + b"\xff" * (3 * width)
    z = zlib.compressobj(9)
    first = z.compress(row) + z.flush(zlib.Z_FULL_FLUSH)
    repeat = z.compress(row) + z.flush(zlib.Z_FULL_FLUSH)
    end = z.flush()[:-4]  # the final empty block; the stream's own checksum covers two rows only
    checksum = 1
    for _ in range(height):
        checksum = zlib.adler32(row, checksum)
    return first + repeat * (height - 1) + end + struct.pack(">I", checksum)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_input")
    green = Image.new("RGB", (64, 48), (10, 200, 30))
    paths = {name: d / name for name in ("empty.png", "notes.txt", "one.png", "palette.png", "rgba.png")}
    paths["empty.png"].write_bytes(b"")
    paths["notes.txt"].write_text("a shopping list, not a picture\n")
    for name, fmt in (("ok.png", "PNG"), ("ok.jpg", "JPEG")):
        buffer = io.BytesIO()
        Image.open(EXAMPLE).convert("RGB").save(buffer, fmt)
        data = buffer.getvalue()
        paths[f"truncated.{name[3:]}"] = d / f"truncated.{name[3:]}"
        paths[f"truncated.{name[3:]}"].write_bytes(data[: len(data) // 2])
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8))
    for suffix, fmt in (("heic", "HEIF"), ("avif", "AVIF")):  # a phone's formats: cut short, or a bomb's header
        buffer = io.BytesIO()
        photo.save(buffer, fmt)
        data = buffer.getvalue()
        paths[f"truncated.{suffix}"] = d / f"truncated.{suffix}"
        paths[f"truncated.{suffix}"].write_bytes(data[: len(data) // 2])
        at = data.index(b"ispe") + 8  # the image's spatial extent: width, height
        paths[f"bomb.{suffix}"] = d / f"bomb.{suffix}"
        paths[f"bomb.{suffix}"].write_bytes(data[:at] + struct.pack(">II", *HUGE) + data[at + 8 :])
    paths["bomb.png"] = d / "bomb.png"
    paths["bomb.png"].write_bytes(png_bytes((100_000, 100_000), zlib.compress(b"\x00" * 64)))
    paths["huge.png"] = d / "huge.png"
    paths["huge.png"].write_bytes(png_bytes(HUGE, white_idat(*HUGE)))
    Image.new("RGB", (1, 1), (1, 2, 3)).save(paths["one.png"])
    paths["16bit.png"] = d / "16bit.png"
    Image.fromarray(np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 21).save(paths["16bit.png"])
    paths["cmyk.jpg"] = d / "cmyk.jpg"
    Image.new("CMYK", (64, 48), (0, 255, 255, 0)).save(paths["cmyk.jpg"], quality=100)
    green.convert("P", palette=Image.Palette.ADAPTIVE).save(paths["palette.png"])
    Image.new("RGBA", (64, 48), (10, 200, 30, 128)).save(paths["rgba.png"])
    paths["png_named.jpg"] = d / "png_named.jpg"
    shutil.copy(EXAMPLE, paths["png_named.jpg"])
    paths["icon.ico"] = d / "icon.ico"
    green.save(paths["icon.ico"])
    return paths


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.fixture
def cli(demo, monkeypatch, capsys):
    """`cli(*args, image=, query=)` -> (exit code, stdout, stderr) of `main` on the demo model (loaded once)."""
    monkeypatch.setattr(cli_module, "load", loads_demo_as(demo, cli_module.load))

    def run(*args: str, image: Path | str = EXAMPLE, query: str | None = "square") -> tuple[int, str, str]:
        argv = ["--image", str(image), *(["--query", query] if query is not None else []), "--max-tokens", "8"]
        try:
            code = generate.main([*argv, *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, out, err

    return run


def error_line(result: tuple[int, str, str]) -> str:
    """The one `error:` line of a failed run (exit status 2, nothing on stdout)."""
    code, out, err = result
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def answer(result: tuple[int, str, str]) -> dict:
    code, out, err = result
    assert code == 0 and err == "", err
    return json.loads(out)


# --- image files ---------------------------------------------------------------------------------------------

IMAGE_ERRORS = [
    ("missing.png", ["image file not found: ", "missing.png"]),
    ("folder", ["is not a file; expected an image file (PNG, JPEG, WEBP, BMP, GIF, TIFF, HEIC, AVIF)"]),
    ("empty.png", ["empty.png is not a readable image: the file is empty (0 bytes)"]),
    (
        "notes.txt",
        ["notes.txt is not a readable image: no PNG, JPEG, WEBP, BMP, GIF, TIFF, HEIC or AVIF signature at its start"],
    ),
    ("truncated.heic", ["truncated.heic is not a readable image: its HEIF data is truncated or corrupt (ValueError"]),
    ("truncated.avif", ["truncated.avif is not a readable image: broken AVIF header (SyntaxError"]),
    ("bomb.heic", ["bomb.heic is 20000x12000 = 240,000,000 pixels, over the limit of 89,478,485 pixels"]),
    ("bomb.avif", ["bomb.avif is 20000x12000 = 240,000,000 pixels, over the limit of 89,478,485 pixels"]),
    ("truncated.png", ["truncated.png is not a readable image: its PNG data is truncated or corrupt (OSError"]),
    ("truncated.jpg", ["truncated.jpg is not a readable image: its JPEG data is truncated or corrupt (OSError"]),
    ("icon.ico", ["icon.ico is not a readable image: its format is ICO, not one of PNG, JPEG"]),
    (
        "bomb.png",
        ["bomb.png is 100000x100000 = 10,000,000,000 pixels, over the limit of 89,478,485 pixels", "--max-pixels"],
    ),
    ("huge.png", ["huge.png is 20000x12000 = 240,000,000 pixels, over the limit of 89,478,485 pixels"]),
]


@pytest.mark.parametrize(("name", "parts"), IMAGE_ERRORS)
def test_image_errors(cli, files, tmp_path, name, parts):
    image = {"missing.png": tmp_path / "missing.png", "folder": tmp_path}.get(name) or files[name]
    line = error_line(cli(image=image))
    assert all(part in line for part in parts), line


class Decoded(BaseException):
    """Raised by a patched decoder; no `except Exception` turns it into a message."""


def test_sizes_are_checked_from_the_header_before_decoding(files, monkeypatch):
    def no_decoding(self):
        raise Decoded

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for name in ("bomb.png", "huge.png", "bomb.heic", "bomb.avif"):
        with pytest.raises(ImageTooLargeError, match=r"pixels, over the limit of 89,478,485 pixels"):
            load_image(files[name])
    with pytest.raises(ValueError, match=r"64x48 = 3,072 pixels, over the limit of 3,071 pixels"):
        load_image(Image.open(files["rgba.png"]), max_pixels=3071)  # a lazily opened PIL image too


def test_an_image_opened_lazily_is_checked_as_its_file(files, tmp_path):
    """An image opened with `Image.open` and handed over undecoded (as the server hands on uploads) gets its
    file's size check before decoding and its file's messages, HEIF and WebP too (their readers keep no `tile`)."""
    for name in ("truncated.heic", "truncated.png", "truncated.jpg"):
        with pytest.raises(ValueError) as from_path:
            load_image(files[name])
        with pytest.raises(ValueError) as opened:
            load_image(Image.open(files[name]))
        assert str(opened.value) == str(from_path.value) and f"{files[name]} is not a readable" in str(opened.value)
    for fmt in FORMATS:
        path = tmp_path / f"photo.{fmt.lower()}"
        Image.new("RGB", (64, 48), (10, 200, 30)).save(path, SIGNATURES.get(fmt, fmt))
        with pytest.raises(ImageTooLargeError, match=f"{path} is 64x48 = 3,072 pixels, over the limit of 3,071"):
            load_image(Image.open(path), max_pixels=3071)


def test_huge_photo_with_the_limit_raised(cli, files):
    """Accepted above twice Pillow's own limit, without touching Pillow's process-wide setting or warning."""
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        data = answer(cli("--max-pixels", str(HUGE[0] * HUGE[1]), "--json", image=files["huge.png"]))
    assert Image.MAX_IMAGE_PIXELS == before
    assert data["image_size"] == list(HUGE) and data["grid"] == [14, 22]  # resized to the demo's 256 patches
    for obj in data["objects"]:  # boxes in the huge image's own pixels
        assert all(0 <= v <= s for v, s in zip(obj["box"], HUGE * 2, strict=True))


def test_api_max_pixels(demo, files):
    small, big = demo.locate_many([Request(EXAMPLE, "square", max_pixels=1000), Request(EXAMPLE, "square")])
    width, height = Image.open(EXAMPLE).size
    assert isinstance(small, RequestError) and "over the limit of 1,000 pixels" in str(small)
    assert big.image_size == (width, height)
    assert demo.locate_many([Request(EXAMPLE, "square", max_pixels=width * height)])[0].image_size == big.image_size
    with pytest.raises(ValueError, match="max_pixels must be a positive integer"):
        load_image(EXAMPLE, max_pixels=0)
    with pytest.raises(ValueError, match="the image data is 100000x100000"):
        load_image(io.BytesIO(files["bomb.png"].read_bytes()))  # uploaded bytes get the same policy


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_accepted_format_opens(tmp_path, fmt):
    path = tmp_path / f"image.{fmt.lower()}"
    pillow_name = SIGNATURES.get(fmt, fmt)
    Image.new("RGB", (30, 20), (250, 250, 250)).save(path, pillow_name)
    assert load_image(path).format == pillow_name and to_rgb(load_image(path)).size == (30, 20)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pillows_own_limit_never_refuses_what_max_pixels_allows(tmp_path, monkeypatch, fmt):
    """Pillow's process-wide limit (here 100 pixels) neither refuses nor warns of an image `max_pixels` allows;
    WebP, which Pillow checks as it opens it, is refused naming remedies that work."""
    path = tmp_path / f"image.{fmt.lower()}"
    image = Image.new("RGB", (30, 20), (250, 250, 250))
    image.save(path, SIGNATURES.get(fmt, fmt))
    image.save(tmp_path / "converted.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if fmt != "WEBP":
            assert load_image(path).size == (30, 20)
            return
        message = "image.webp is over Pillow's own limit for WEBP images, which --max-pixels does not raise"
        with pytest.raises(ImageTooLargeError, match=f"{message}.*; convert it to PNG, or in Python raise PIL.Image"):
            load_image(path)
        assert load_image(tmp_path / "converted.png").size == (30, 20)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert load_image(path).size == (30, 20)


def test_one_pixel(cli, files):
    data = answer(cli("--json", image=files["one.png"]))
    assert data["image_size"] == [1, 1] and data["grid"] == [2, 2]


def test_sixteen_bit_grey_keeps_its_high_byte(cli, files):
    values = np.asarray(Image.open(files["16bit.png"]))
    assert Image.open(files["16bit.png"]).mode == "I;16" and values.max() > 255
    np.testing.assert_array_equal(np.asarray(to_rgb(load_image(files["16bit.png"])))[..., 0], values >> 8)
    assert answer(cli("--json", image=files["16bit.png"]))["image_size"] == [64, 48]


def test_cmyk_jpeg(cli, files):
    assert load_image(files["cmyk.jpg"]).mode == "CMYK"
    red = np.asarray(to_rgb(load_image(files["cmyk.jpg"]))).reshape(-1, 3)
    assert (np.abs(red.astype(int) - (255, 0, 0)) <= 2).all()  # no cyan, full magenta and yellow: red
    assert answer(cli("--json", image=files["cmyk.jpg"]))["image_size"] == [64, 48]


def test_palette_png(cli, files):
    assert load_image(files["palette.png"]).mode == "P"
    assert (np.asarray(to_rgb(load_image(files["palette.png"]))) == (10, 200, 30)).all()
    assert answer(cli("--json", image=files["palette.png"]))["image_size"] == [64, 48]


def test_rgba_is_composited_on_white(cli, files):
    expected = tuple(round(c * 128 / 255 + 255 * (1 - 128 / 255)) for c in (10, 200, 30))
    pixels = np.asarray(to_rgb(load_image(files["rgba.png"]))).reshape(-1, 3)
    assert (np.abs(pixels.astype(int) - expected) <= 1).all()
    assert answer(cli("--json", image=files["rgba.png"]))["image_size"] == [64, 48]


def test_png_named_jpg_is_read_as_png(cli, files):
    named, real = (answer(cli("--json", image=p)) for p in (files["png_named.jpg"], EXAMPLE))
    assert load_image(files["png_named.jpg"]).format == "PNG"
    assert named["token_ids"] == real["token_ids"] and named["objects"] == real["objects"]


# --- prompts and options -------------------------------------------------------------------------------------


def test_prompt_too_long(cli, demo):
    line = error_line(cli(query=" ".join(["square"] * 3000)))
    prompt_len, limit = (int(n) for n in re.findall(r"\d+", line)[:2])
    assert prompt_len > 3000 and limit == demo.runtime.max_length == 2048, line
    assert line.startswith(f"error: the prompt has {prompt_len} tokens but the model holds at most 2048")
    with pytest.raises(RequestError, match=f"the prompt has {prompt_len} tokens"):
        demo.locate(EXAMPLE, " ".join(["square"] * 3000))


def test_max_tokens_clipped_to_what_fits(cli, demo, monkeypatch):
    # The demo holds 2048 positions; a lower limit makes the same case without a 2,000-row prefill.
    monkeypatch.setattr(demo.runtime, "max_length", 140)
    data = answer(cli("--json", "--max-tokens", "512"))
    room = 140 - len(data["prompt_ids"])
    assert 0 < room < 512
    assert data["stats"]["max_tokens"] == room and data["stats"]["max_tokens_clipped"] is True
    assert len(data["token_ids"]) <= room + 5  # a block may overshoot the cap by 5, as the reference does
    assert answer(cli("--json"))["stats"]["max_tokens_clipped"] is False


def test_max_tokens_reached_mid_box(cli):
    data = answer(cli("--json", "--mode", "slow", "--max-tokens", "6"))
    assert data["text"].endswith("<box><281><487>") and data["objects"] == []
    assert data["truncated"] is True and data["stats"]["stop_reason"] == "length_cap"
    code, out, _ = cli("--mode", "slow", "--max-tokens", "6")
    assert code == 0 and out.splitlines()[-1].endswith("stop: length_cap (truncated)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "segment"], "argument --task: invalid choice: 'segment'"),
        (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
        (["--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
        (["--seed", "-1"], "argument --seed: must be between 0 and 2**64 - 1, got -1"),
        (["--max-pixels", "0"], "argument --max-pixels: must be at least 1, got 0"),
        (["--image-tokens", "1"], "argument --image-tokens: must be at least 4 patches, got 1"),
        (["--image-tokens", "257"], "error: --image-tokens 257: the model takes at most 256 patches (its own budget)"),
    ],
)
def test_bad_options(cli, args, message):
    code, out, err = cli(*args)
    assert code == 2 and out == "" and message in err.splitlines()[-1], err


def test_unknown_task_or_mode_in_the_api(demo):
    with pytest.raises(ValueError, match="unknown task 'segment'; valid tasks: detect, single"):
        demo.locate(EXAMPLE, "square", task="segment")
    with pytest.raises(ValueError, match="unknown mode 'medium'; choose one of slow, fast, hybrid"):
        demo.locate(EXAMPLE, "square", mode="medium")


@pytest.mark.parametrize("token", ["<IMG_CONTEXT>", "<|im_end|>", "<|im_start|>", "<img>"])
def test_special_tokens_in_the_query_are_text_and_in_a_raw_prompt_an_error(cli, token):
    """One rule (prompts.py): a query is read as plain text; a raw prompt may not hold control tokens."""
    code, out, err = cli(query=f"the {token} square")
    assert code == 0 and out.strip() and "error" not in err, err
    message = f"error: a raw prompt must not contain '{token}', a control token"
    assert error_line(cli("--prompt", f"Point to: {token}.", query=None)).startswith(message)


# --- checkpoints ---------------------------------------------------------------------------------------------


def demo_copy(folder: Path) -> Path:
    shutil.copytree(DEMO, folder)
    return folder


def test_missing_shard(cli, tmp_path):
    model = demo_copy(tmp_path / "model")
    names = list(mx.load(str(model / "model.safetensors")))
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    shards = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    line = error_line(cli("--model", str(model)))
    assert "shards named by model.safetensors.index.json are missing: model-00002-of-00002.safetensors" in line


def test_truncated_shard(cli, tmp_path):
    model = demo_copy(tmp_path / "model")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    line = error_line(cli("--model", str(model)))
    assert f"model.safetensors: truncated safetensors file (tensors need {len(data)} bytes" in line, line


def test_corrupt_shard(cli, tmp_path):
    model = demo_copy(tmp_path / "model")
    header = json.dumps({"a": {"dtype": "XX", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    line = error_line(cli("--model", str(model)))
    assert "model.safetensors: not a readable safetensors file ([safetensor] unsupported dtype XX)" in line, line


def test_config_without_a_field(cli, tmp_path):
    model = demo_copy(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    del config["text_config"]["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    line = error_line(cli("--model", str(model)))
    assert line == f"error: {model}: config.json text_config: missing field(s) num_hidden_layers"
    (model / "config.json").write_text(json.dumps([config]))  # valid JSON, but no object
    assert error_line(cli("--model", str(model))) == f"error: {model / 'config.json'}: expected a JSON object, got list"


def test_wrong_tensor_shape(cli, tmp_path):
    model = demo_copy(tmp_path / "model")
    tensors = mx.load(str(model / "model.safetensors"))
    tensors["language_model.model.norm.weight"] = mx.ones((255,), mx.bfloat16)
    mx.save_safetensors(str(model / "model.safetensors"), tensors)
    line = error_line(cli("--model", str(model)))
    assert "weights do not match the config: misshapen tensors: language_model.model.norm.weight (255,)" in line
    assert "(expected (256,))" in line


def test_default_limit_is_pillows_warning_threshold():
    assert DEFAULT_MAX_PIXELS == int(1024 * 1024 * 1024 // 4 // 3)


def test_image_placeholder_inside_a_query(demo):
    """Rendering A puts the image where the user text names it (docs/model.md §8.1), as the reference does; rendering B
    always puts it first, so a second placeholder is a clear error."""
    result = demo.locate(EXAMPLE, "the <image-1> square")
    image = demo.runtime.token_ids.image
    start = result.prompt_ids.index(image)
    assert demo.runtime.tokenizer.decode(result.prompt_ids[:start]).endswith("the <image 1><img>")
    with pytest.raises(ValueError, match="<image-1>"):
        demo.locate(EXAMPLE, "the <image-1> square", rendering="B")


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (
            RuntimeError("[metal] device lost"),
            1,
            "error: internal error, please report it: RuntimeError: [metal] device lost",
        ),
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (MemoryError(), 2, "error: out of memory; use a smaller image or --max-pixels, or a smaller --dtype"),
    ],
)
def test_anything_else_is_one_line_too(cli, monkeypatch, raised, code, line):
    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(generate, "draw_objects", fail)
    assert cli("--draw", "unused.png") == (code, "", line + "\n")


# --- the Python API's argument types -------------------------------------------------------------------------------

ARRAY = np.zeros((8, 8, 3), np.uint8)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: m.locate(ARRAY, "square"),
            TypeError,
            "image must be a path, a PIL image or a binary file object, got ndarray; convert",
        ),
        (lambda m: m.locate(None, "square"), TypeError, "image must be .* got NoneType"),
        (lambda m: m.locate(EXAMPLE.read_bytes(), "square"), TypeError, "got bytes; wrap bytes in io.BytesIO"),
        (lambda m: m.session(ARRAY), TypeError, "image must be .* got ndarray"),
        (lambda m: m.locate(EXAMPLE, 5), RequestError, "query must be text, a list or None .* got int 5"),
        (lambda m: m.locate(EXAMPLE, ("square", "circle")), RequestError, "query must be .* got tuple"),
        (lambda m: m.locate(EXAMPLE, {"square"}), RequestError, "query must be .* got set"),
        (lambda m: m.locate(EXAMPLE, "square", guards=None), RequestError, "guards must be a Guards, got NoneType"),
        (lambda m: m.locate_many(["square"]), TypeError, "request must be a Request, got str 'square'"),
        (lambda m: m.engine().submit("square"), TypeError, "request must be a Request"),
        (
            lambda m: m.locate_many([Request(EXAMPLE, "square")], max_rows=1.5),
            ValueError,
            "max_rows must be a whole number at least 1, got 1.5",
        ),
        (lambda m: m.engine(max_rows="x"), ValueError, "max_rows must be a whole number at least 1, got 'x'"),
        (lambda m: m.engine(max_rows=0), ValueError, "max_rows must be a whole number at least 1, got 0"),
    ],
)
def test_an_argument_of_the_wrong_type_is_named(demo, call, error, message):
    with pytest.raises(error, match=message):
        call(demo)


def test_a_result_of_a_file_object_draws_after_the_file_is_closed(demo):
    with EXAMPLE.open("rb") as f:
        result = demo.locate(f, "square", mode="fast")
    from_bytes = demo.locate(io.BytesIO(EXAMPLE.read_bytes()), "square", mode="fast")
    assert result.draw().tobytes() == demo.locate(EXAMPLE, "square", mode="fast").draw().tobytes()
    assert from_bytes._repr_png_().startswith(b"\x89PNG")
