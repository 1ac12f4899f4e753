"""Image -> normalised 14 x 14 patches in raster order, as the reference processor makes them (docs/model.md §5).

Pure numpy and Pillow. The resizes go through Pillow's BICUBIC filter, which the reference uses too, so the
patches are bit-identical to the reference's `pixel_values`.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
from PIL import BmpImagePlugin, GifImagePlugin, Image, JpegImagePlugin, PngImagePlugin, TiffImagePlugin, WebPImagePlugin

IN_TOKEN_LIMIT = 25600  # patches before the token-limit rescale (preprocessor_config.json)
PATCH_SIZE = 14
MERGE = 2  # 2 x 2 patches merge into one LM token, so both sides are multiples of 2 * PATCH_SIZE
MAX_PATCHES_PER_SIDE = 512  # a side of 512 patches or more is rejected, as the reference does


class TargetSize(NamedTuple):
    scaled: tuple[int, int]  # (w, h) after the token-limit step; the input size when no rescale is needed
    final: tuple[int, int]  # (W, H), multiples of MERGE * patch


# Each pixel value normalised to [-1, 1] by the reference's float32 operations (ToTensor + Normalize(0.5, 0.5):
# x / 255, then (x - 0.5) / 0.5), so looking a pixel up gives the bits of computing it.
NORMALISED = ((np.arange(256, dtype=np.float32) / np.float32(255.0)) - np.float32(0.5)) / np.float32(0.5)


class Preprocessed(NamedTuple):
    pixels: np.ndarray  # (L, 3, patch, patch) uint8, raster order over the patch grid (a quarter of the floats)
    grid: tuple[int, int]  # (h, w) in patches; L = h * w
    processed_size: tuple[int, int]  # (W, H) in pixels of the stretched image
    original_size: tuple[int, int]  # (W0, H0) after RGB conversion; model coordinates map onto this
    digest: str  # sha256 of the resized pixels: what the vision features depend on, so their cache key

    @property
    def patches(self) -> np.ndarray:
        """(L, 3, patch, patch) float32, normalised to [-1, 1]: the reference's `pixel_values`."""
        return NORMALISED[self.pixels]


DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's decompression-bomb warning threshold (1024 * 1024 * 1024 // 4 // 3)
# Formats a user may hand us, opened through their plugin classes (not `Image.open`): the size check is ours
# (`max_pixels`), so Pillow's process-wide `MAX_IMAGE_PIXELS` neither refuses an image the caller allowed nor
# has to be changed. JPEG opens as plain JPEG, so a multi-picture (MPO) file gives its first picture.
FORMATS = {
    "PNG": PngImagePlugin.PngImageFile,
    "JPEG": JpegImagePlugin.JpegImageFile,
    "WEBP": WebPImagePlugin.WebPImageFile,
    "BMP": BmpImagePlugin.BmpImageFile,
    "GIF": GifImagePlugin.GifImageFile,
    "TIFF": TiffImagePlugin.TiffImageFile,
}
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # grey images Pillow's convert("RGB") clips at 255


class ImageTooLargeError(ValueError):
    """An image over the pixel limit (a server answers it differently from a broken file)."""


def check_pixels(size: tuple[int, int], max_pixels: int | None, what: str) -> None:
    """Raise `ImageTooLargeError` naming `what`, its size, the limit and how to raise it when `size` has more
    than `max_pixels` pixels (None: `DEFAULT_MAX_PIXELS`)."""
    limit = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_pixels must be a positive integer, got {max_pixels!r}")
    w, h = size
    if w * h > limit:
        raise ImageTooLargeError(
            f"{what} is {w}x{h} = {w * h:,} pixels, over the limit of {limit:,} pixels; "
            "if the image is real, raise the limit with --max-pixels N (API: max_pixels=N)"
        )


def load_image(image: str | Path | BinaryIO | Image.Image, max_pixels: int | None = None) -> Image.Image:
    """Open and decode an image file (a path or a binary file object, such as `io.BytesIO` of uploaded bytes).

    One policy for every entry point: the format must be one of `FORMATS` (found from the content, not the
    name) and the size, read from the header, is checked against `max_pixels` (default `DEFAULT_MAX_PIXELS`)
    before any pixel is decoded. A PIL image is passed through; one still undecoded (`Image.open` is lazy) is
    checked and decoded here first. Raises `FileNotFoundError` for a missing path and `ValueError` naming the
    file for anything else: not a file, empty, another format, too large, broken header, truncated data.
    """
    if isinstance(image, Image.Image):
        if getattr(image, "tile", None):  # opened, not decoded yet
            name = getattr(image, "filename", "") or "the image"
            check_pixels(image.size, max_pixels, name)
            _decode(image, name)
        return image
    if hasattr(image, "read"):
        return _open(image, getattr(image, "name", None) or "the image data", max_pixels)
    path = Path(image)
    if not path.exists():
        raise FileNotFoundError(f"image file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file; expected an image file ({', '.join(FORMATS)})")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is not a readable image: the file is empty (0 bytes)")
    with path.open("rb") as fp:
        return _open(fp, str(path), max_pixels)


def _open(fp: BinaryIO, name: str, max_pixels: int | None) -> Image.Image:
    """The first allowed format whose signature `fp` starts with, size-checked, then decoded."""
    image = open_header(fp, name, max_pixels)
    _decode(image, name)
    return image


def open_header(fp: BinaryIO, name: str, max_pixels: int | None) -> Image.Image:
    """`fp` opened as the first allowed format whose signature it starts with, its header's size checked against
    `max_pixels`; no pixel decoded yet (`load_image` decodes it). Errors as `load_image`'s."""
    prefix = fp.read(16)
    fmt = next((f for f in FORMATS if Image.OPEN[f][1](prefix) is True), None)
    if fmt is None:
        raise ValueError(f"{name} is not a readable image: {_not_allowed(prefix)}")
    fp.seek(0)
    try:
        image = FORMATS[fmt](fp, name)
    except Exception as e:  # decoders raise many unrelated types on malformed data (SyntaxError, struct.error...)
        raise ValueError(f"{name} is not a readable image: broken {fmt} header ({_reason(e)})") from None
    check_pixels(image.size, max_pixels, name)
    return image


def _decode(image: Image.Image, name: str) -> None:
    try:
        image.load()
    except Exception as e:  # as in _open: OSError for truncated data, others for corrupt data
        raise ValueError(
            f"{name} is not a readable image: its {image.format or 'image'} data is truncated or corrupt ({_reason(e)})"
        ) from None


def _reason(error: Exception) -> str:
    if isinstance(error, Image.DecompressionBombError):
        return f"over Pillow's own limit, PIL.Image.MAX_IMAGE_PIXELS: {error}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _not_allowed(prefix: bytes) -> str:
    """Why a file with this start is refused: another image format (named), or no image signature at all."""
    Image.init()
    allowed = f"{', '.join(list(FORMATS)[:-1])} or {list(FORMATS)[-1]}"
    for fmt, (_, accept) in Image.OPEN.items():
        try:
            known = fmt not in FORMATS and accept is not None and accept(prefix) is True
        except Exception:  # a plugin's signature test on arbitrary bytes; it only names the format
            known = False
        if known:
            return f"its format is {fmt}, not one of {allowed} (convert it to PNG)"
    return f"no {allowed} signature at its start ({prefix[:8]!r})"


def to_rgb(image: Image.Image) -> Image.Image:
    """RGBA is composited onto white using its alpha; 16-bit grey keeps its high byte (as Pillow reads 16-bit
    colour); any other mode goes through `convert("RGB")`.

    EXIF orientation is not applied, so coordinates refer to the stored pixels.
    """
    if image.mode == "RGBA":
        canvas = Image.new("RGB", image.size, (255, 255, 255))
        canvas.paste(image, mask=image.getchannel("A"))
        return canvas
    if image.mode == "RGB":
        return image
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image)
        if image.mode == "I":  # 32-bit: read as 16-bit, as Pillow opens 16-bit PNGs in older versions
            values = np.clip(values, 0, 65535)
        return Image.fromarray((values >> 8).astype(np.uint8)).convert("RGB")
    return image.convert("RGB")


def target_size(w: int, h: int, in_token_limit: int = IN_TOKEN_LIMIT, patch: int = PATCH_SIZE) -> TargetSize:
    """The sizes an image of `w x h` pixels is resized to (docs/model.md §5 steps 2-4).

    Step 2 scales the image down (truncating) when it has more than `in_token_limit` patches; step 3 stretches
    each side up to a multiple of `2 * patch`. Raises `ValueError` naming the sizes when a side would be 0
    pixels or a side would reach 512 patches.
    """
    n_patches = (w // patch) * (h // patch)
    if n_patches > in_token_limit:
        scale = math.sqrt(in_token_limit / n_patches)
        scaled = (int(w * scale), int(h * scale))
    else:
        scaled = (w, h)
    if min(scaled) <= 0:
        raise ValueError(
            f"image of {w}x{h} pixels would have a side of 0 pixels after scaling to {scaled[0]}x{scaled[1]} "
            f"(token limit {in_token_limit} patches); use a less extreme aspect ratio"
        )
    unit = MERGE * patch
    final = (math.ceil(scaled[0] / unit) * unit, math.ceil(scaled[1] / unit) * unit)
    if final[0] // patch >= MAX_PATCHES_PER_SIDE or final[1] // patch >= MAX_PATCHES_PER_SIDE:
        raise ValueError(
            f"image of {w}x{h} pixels becomes {final[0]}x{final[1]} "
            f"({final[1] // patch}x{final[0] // patch} patches); each side must stay below "
            f"{MAX_PATCHES_PER_SIDE} patches. Crop the image to an aspect ratio below about 10:1"
        )
    return TargetSize(scaled, final)


def patchify(pixels: np.ndarray, patch: int = PATCH_SIZE) -> tuple[np.ndarray, tuple[int, int]]:
    """(H, W, 3) pixels -> (h*w, 3, patch, patch) patches in raster order (same dtype) and the grid (h, w)."""
    H, W, _ = pixels.shape
    gh, gw = H // patch, W // patch
    grid = pixels.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 4, 1, 3)  # (gh, gw, 3, p, p)
    return grid.reshape(gh * gw, 3, patch, patch), (gh, gw)


def preprocess(
    image: str | Path | BinaryIO | Image.Image,
    in_token_limit: int = IN_TOKEN_LIMIT,
    patch_size: int = PATCH_SIZE,
    max_pixels: int | None = None,
) -> Preprocessed:
    """Open (`load_image`), convert to RGB, resize (docs/model.md §5) and cut into patches in raster order
    (`Preprocessed.patches` normalises them to [-1, 1])."""
    rgb = to_rgb(load_image(image, max_pixels))
    original_size = rgb.size
    sizes = target_size(*original_size, in_token_limit=in_token_limit, patch=patch_size)
    # Two separate resizes when both steps change the size: each rounds to uint8, as in the reference.
    if sizes.scaled != rgb.size:
        rgb = rgb.resize(sizes.scaled, Image.Resampling.BICUBIC)
    if sizes.final != rgb.size:
        rgb = rgb.resize(sizes.final, Image.Resampling.BICUBIC)

    pixels = np.asarray(rgb, dtype=np.uint8)
    digest = hashlib.sha256(pixels.tobytes()).hexdigest()
    patches, grid = patchify(pixels, patch_size)
    return Preprocessed(np.ascontiguousarray(patches), grid, sizes.final, original_size, digest)
