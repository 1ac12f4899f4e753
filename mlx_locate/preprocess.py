"""Image -> normalised 14 x 14 patches in raster order, as the reference processor makes them (docs/model.md §5).

Pure numpy and Pillow. The resizes go through Pillow's BICUBIC filter, which the reference uses too, so the
patches are bit-identical to the reference's `pixel_values`.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
from PIL import (
    AvifImagePlugin,
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageCms,
    ImageFile,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    WebPImagePlugin,
)
from pillow_heif import HeifImageFile, register_heif_opener

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


class _TiffImageFile(TiffImagePlugin.TiffImageFile):
    """Pillow's TIFF reader without the check against `MAX_IMAGE_PIXELS` that it alone makes again as it decodes
    (`check_pixels` has checked the size from the header)."""

    def load_prepare(self) -> None:
        if self._im is None:  # the image memory, made as Pillow's own method makes it after its check
            self.im = Image.core.new(self.mode, self._tile_size)
        super().load_prepare()


# Formats a user may hand us, opened through their plugin classes (not `Image.open`): the size check is ours
# (`max_pixels`), so Pillow's process-wide `MAX_IMAGE_PIXELS` neither refuses an image the caller allowed nor
# has to be changed; WebP alone checks it as it opens (`_pillows_limit`). JPEG opens as plain JPEG, so a
# multi-picture (MPO) file gives its first picture.
FORMATS = {
    "PNG": PngImagePlugin.PngImageFile,
    "JPEG": JpegImagePlugin.JpegImageFile,
    "WEBP": WebPImagePlugin.WebPImageFile,
    "BMP": BmpImagePlugin.BmpImageFile,
    "GIF": GifImagePlugin.GifImageFile,
    "TIFF": _TiffImageFile,
    "HEIC": HeifImageFile,  # HEIC / HEIF, the iPhone's default (pillow-heif)
    "AVIF": AvifImagePlugin.AvifImageFile,
}
SIGNATURES = {"HEIC": "HEIF"}  # our name -> Pillow's registry name, where they differ
# The frame boxes are given in: "exif" as a photo viewer shows the image (its EXIF Orientation applied), or
# "stored" as its pixels are stored (for datasets labelled on stored pixels). HEIF's own rotation (its container's
# transform, which libheif applies on decoding) counts as its orientation, so "stored" undoes it.
ORIENTATIONS = ("exif", "stored")
EXIF_ORIENTATION = 0x0112
# The transpose that undoes each orientation's display transform (Pillow's `exif_transpose` applies the display one).
UNDO_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}
APPLIED = "mlx_locate.photo"  # key in `Image.info` of what `apply_photo_policy` did: a `PhotoNotes`
register_heif_opener()  # its signature test in Pillow's registry (we open through the class itself)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # grey images Pillow's convert("RGB") clips at 255


class ImageTooLargeError(ValueError):
    """An image over the pixel limit (a server answers it differently from a broken file)."""


def pixel_limit(max_pixels: int | None) -> int:
    """The pixel limit `max_pixels` sets (None: `DEFAULT_MAX_PIXELS`)."""
    return DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels


def check_pixels(size: tuple[int, int], max_pixels: int | None, what: str) -> None:
    """Raise `ImageTooLargeError` naming `what`, its size, the limit and how to raise it when `size` has more
    than `max_pixels` pixels (None: `DEFAULT_MAX_PIXELS`)."""
    limit = pixel_limit(max_pixels)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_pixels must be a positive integer, got {max_pixels!r}")
    w, h = size
    if w * h > limit:
        raise ImageTooLargeError(
            f"{what} is {w}x{h} = {w * h:,} pixels, over the limit of {limit:,} pixels; "
            "if the image is real, raise the limit with --max-pixels N (API: max_pixels=N)"
        )


class PhotoNotes(NamedTuple):
    """What the image policy did to one image: its frame, and what the user should know."""

    orientation: str  # "exif" (the EXIF orientation applied) or "stored"
    exif_orientation: int  # the file's EXIF Orientation tag, 1 (none) to 8
    warnings: tuple[str, ...]  # multi-frame file, unreadable colour profile


def load_image(
    image: str | Path | BinaryIO | Image.Image, max_pixels: int | None = None, orientation: str = "exif"
) -> Image.Image:
    """Open and decode an image file (a path or a binary file object, such as `io.BytesIO` of uploaded bytes),
    then apply the image policy (`apply_photo_policy`): the pixels a viewer shows, in sRGB.

    The format must be one of `FORMATS` (found from the content, not the name) and the size, read from the
    header, is checked against `max_pixels` (default `DEFAULT_MAX_PIXELS`) before any pixel is decoded. A PIL
    image is checked and decoded if it is still lazy (`Image.open`), then the policy applies to it. What the
    policy did is `photo_notes(result)`. Raises `FileNotFoundError` for a missing path and `ValueError` naming
    the file for anything else: not a file, empty, another format, too large, broken header, truncated data.
    """
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {', '.join(ORIENTATIONS)}, got {orientation!r}")
    if isinstance(image, Image.Image):
        if APPLIED in image.info:
            return image
        name = getattr(image, "filename", "") or "the image"
        if isinstance(image, ImageFile.ImageFile) and image._im is None:  # opened, not decoded (no image memory)
            check_pixels(image.size, max_pixels, name)
            _decode(image, name)
        elif isinstance(image, TiffImagePlugin.TiffImageFile):
            _recall_orientation(image, name, orientation)
        shown, notes = apply_photo_policy(image, orientation)
        if shown is image:  # the caller's own image, unchanged: it carries no notes (`photo_notes` has defaults)
            return image
    else:
        if hasattr(image, "read"):
            decoded = _open(image, getattr(image, "name", None) or "the image data", max_pixels)
            shown, notes = apply_photo_policy(decoded, orientation)
        else:
            path = Path(image)
            if not path.exists():
                raise FileNotFoundError(f"image file not found: {path}")
            if not path.is_file():
                raise ValueError(f"{path} is not a file; expected an image file ({', '.join(FORMATS)})")
            with path.open("rb") as fp:  # a multi-frame file reads its frames to count them
                shown, notes = apply_photo_policy(_open(fp, str(path), max_pixels), orientation)
    shown.info[APPLIED] = notes  # an image of ours: decoded here or made by the policy
    return shown


def photo_notes(image: Image.Image, orientation: str = "exif") -> PhotoNotes:
    """What the image policy did to `image` (`load_image`'s result); for another image, what it would note."""
    return image.info.get(APPLIED) or apply_photo_policy(image, orientation, notes_only=True)[1]


def displayed_size(size: tuple[int, int], tag: int) -> tuple[int, int]:
    """The (W, H) a viewer shows of an image of stored `size` under EXIF orientation `tag`."""
    return (size[1], size[0]) if tag >= 5 else size


def displayed_xy(x: float, y: float, size: tuple[int, int], tag: int) -> tuple[float, float]:
    """Where the point (x, y) of the stored pixels of an image of stored `size` (W, H) lies in the frame a viewer
    shows under EXIF orientation `tag` (the transform Pillow's `exif_transpose` applies)."""
    w, h = size
    return {
        1: (x, y),
        2: (w - x, y),
        3: (w - x, h - y),
        4: (x, h - y),
        5: (y, x),
        6: (h - y, x),
        7: (h - y, w - x),
        8: (y, w - x),
    }[tag]


def apply_photo_policy(
    image: Image.Image, orientation: str = "exif", notes_only: bool = False
) -> tuple[Image.Image, PhotoNotes]:
    """The image a viewer shows, and what was done: the first frame of a multi-frame file (with a warning), its
    EXIF orientation applied (`orientation="stored"`: the stored pixels) and its colour profile converted to
    sRGB. The caller's image is not modified; where nothing changes it is returned itself."""
    notes: list[str] = []
    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        notes.append(f"the file has {frames} frames; only the first was used (mlx-locate-video takes video)")
    tag = _exif_orientation(image)
    if notes_only:
        return image, PhotoNotes(orientation, tag, tuple(notes))
    if frames > 1:  # counting the frames moved through them: the first, decoded, as an image of one frame
        image.seek(0)
        image.load()
        image = image.copy()
    if orientation == "exif" and tag in UNDO_ORIENTATION and "original_orientation" not in image.info:
        image = ImageOps.exif_transpose(image)
    elif orientation == "stored" and "original_orientation" in image.info and tag in UNDO_ORIENTATION:
        info = image.info  # the decoder applied the rotation: undo it
        image = image.transpose(UNDO_ORIENTATION[tag])
        image.info = dict(info)
    image, colour_warning = _to_srgb(image)
    if colour_warning:
        notes.append(colour_warning)
    return image, PhotoNotes(orientation, tag, tuple(notes))


def _exif_orientation(image: Image.Image) -> int:
    """The EXIF Orientation tag (1 to 8; 1 where there is none or it is invalid). HEIF and TIFF files report the
    rotation their decoder already applied (`_decode`)."""
    if "original_orientation" in image.info:
        value = image.info["original_orientation"]
    else:
        try:
            with warnings.catch_warnings():  # Pillow warns of a corrupt EXIF block; it only decides the frame
                warnings.simplefilter("ignore")
                value = image.getexif().get(EXIF_ORIENTATION, 1)
        except Exception:  # a malformed EXIF block says nothing about the orientation
            value = 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


SRGB = ImageCms.createProfile("sRGB")


def _to_srgb(image: Image.Image) -> tuple[Image.Image, str | None]:
    """`image` with its embedded ICC profile converted to sRGB (perceptual intent), and a warning where the
    profile cannot be applied. No profile, or an sRGB one: the same pixels."""
    icc = image.info.get("icc_profile")
    if not icc:
        return image, None
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        if ImageCms.getProfileDescription(profile).strip().lower().startswith("srgb"):
            return image, None
        colour, alpha = _colour_and_alpha(image)
        converted = ImageCms.profileToProfile(colour, profile, SRGB, outputMode="RGB")
    except Exception as e:  # LCMS rejects broken profiles and profiles of another colour space than the pixels
        return image, f"its colour profile could not be applied ({type(e).__name__}: {e}); colours used as stored"
    if alpha is not None:
        converted.putalpha(alpha)
    converted.info = {k: v for k, v in image.info.items() if k not in ("icc_profile", "transparency")}
    return converted, None


def _open(fp: BinaryIO, name: str, max_pixels: int | None) -> Image.Image:
    """The first allowed format whose signature `fp` starts with, size-checked, then decoded."""
    image = open_header(fp, name, max_pixels)
    _decode(image, name)
    return image


def open_header(fp: BinaryIO, name: str, max_pixels: int | None) -> Image.Image:
    """`fp` opened as the first allowed format whose signature it starts with, its header's size checked against
    `max_pixels`; no pixel decoded yet (`load_image` decodes it). Errors as `load_image`'s."""
    prefix = fp.read(16)
    if not prefix:
        raise ValueError(f"{name} is not a readable image: the file is empty (0 bytes)")
    fmt = next((f for f in FORMATS if Image.OPEN[SIGNATURES.get(f, f)][1](prefix) is True), None)
    if fmt is None:
        raise ValueError(f"{name} is not a readable image: {_not_allowed(prefix)}")
    fp.seek(0)
    try:
        image = FORMATS[fmt](fp, name)
    except Image.DecompressionBombError as e:
        raise _pillows_limit(name, fmt, e) from None
    except Exception as e:  # decoders raise many unrelated types on malformed data (SyntaxError, struct.error...)
        raise ValueError(f"{name} is not a readable image: broken {fmt} header ({_reason(e)})") from None
    check_pixels(image.size, max_pixels, name)
    return image


def _decode(image: Image.Image, name: str) -> None:
    """Decode `image`'s pixels. libheif applies HEIF's rotation as it decodes and reports the tag it applied in
    `original_orientation`; Pillow turns a TIFF by its Orientation tag as it decodes it and drops the tag, which
    is recorded here the same way, so `orientation="stored"` can turn either back."""
    tag = image.tag_v2.get(EXIF_ORIENTATION) if isinstance(image, TiffImagePlugin.TiffImageFile) else None
    try:
        image.load()
    except Image.DecompressionBombError as e:  # a caller's image opened with `Image.open`
        raise _pillows_limit(name, image.format, e) from None
    except Exception as e:  # as in _open: OSError for truncated data, others for corrupt data
        raise ValueError(
            f"{name} is not a readable image: its {image.format or 'image'} data is truncated or corrupt ({_reason(e)})"
        ) from None
    if tag is not None and EXIF_ORIENTATION not in image.tag_v2:
        image.info["original_orientation"] = tag


def _recall_orientation(image: TiffImagePlugin.TiffImageFile, name: str, orientation: str) -> None:
    """A TIFF the caller decoded: Pillow turned it by its Orientation tag as it decoded it and dropped the tag,
    keeping only its type (`tag_v2.tagtype`). The tag is read again from its file's first frame (the one the
    policy uses) and recorded as `_decode` records it. Decoded from bytes, it has no file: its stored frame is
    refused; the shown one is its pixels."""
    tags = image.tag_v2
    if "original_orientation" in image.info or EXIF_ORIENTATION in tags or EXIF_ORIENTATION not in tags.tagtype:
        return  # not turned, or recorded
    try:
        with open(image.filename, "rb") as fp:
            tag = _TiffImageFile(fp, name).tag_v2.get(EXIF_ORIENTATION)
    except Exception:  # no file (decoded from bytes), or one gone or changed since: the tag is unknown
        tag = None
    if tag is not None:
        image.info["original_orientation"] = tag
    elif orientation == "stored":
        raise ValueError(
            f"{name}: Pillow turned this TIFF by its Orientation tag as it decoded it and dropped the tag, so its "
            "stored pixels are unknown; for orientation='stored' pass its path or bytes, or the image as "
            "Image.open returns it (not yet decoded)"
        )


def _pillows_limit(name: str, fmt: str | None, error: Image.DecompressionBombError) -> ImageTooLargeError:
    """The error for an image Pillow's own process-wide limit refuses, which `max_pixels` cannot raise."""
    return ImageTooLargeError(
        f"{name} is over Pillow's own limit for {fmt or 'this'} images, which --max-pixels does not raise "
        f"({error}); convert it to PNG, or in Python raise PIL.Image.MAX_IMAGE_PIXELS"
    )


def _reason(error: Exception) -> str:
    text = str(error).strip()  # libheif ends its messages with a newline
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _not_allowed(prefix: bytes) -> str:
    """Why a file with this start is refused: another image format (named), or no image signature at all."""
    Image.init()
    allowed = f"{', '.join(list(FORMATS)[:-1])} or {list(FORMATS)[-1]}"
    for fmt, (_, accept) in Image.OPEN.items():
        try:
            known = (
                fmt not in FORMATS and fmt not in SIGNATURES.values() and accept is not None and accept(prefix) is True
            )
        except Exception:  # a plugin's signature test on arbitrary bytes; it only names the format
            known = False
        if known:
            return f"its format is {fmt}, not one of {allowed} (convert it to PNG)"
    return f"no {allowed} signature at its start ({prefix[:8]!r})"


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as the model sees it: any transparency (`_colour_and_alpha`) composited onto white, as the
    reference composites RGBA; 16-bit grey keeps its high byte; any other mode goes through `convert("RGB")`.
    Orientation and colour are `load_image`'s."""
    colour, alpha = _colour_and_alpha(image)
    rgb = colour if colour.mode == "RGB" else colour.convert("RGB")
    if alpha is None:
        return rgb
    canvas = Image.new("RGB", image.size, (255, 255, 255))
    canvas.paste(rgb, mask=alpha)
    return canvas


def _colour_and_alpha(image: Image.Image) -> tuple[Image.Image, Image.Image | None]:
    """`image`'s colour as 8-bit L, RGB or CMYK, and its transparency as an L mask (None where it has none): an
    alpha channel, a palette's alpha or a transparency key (PNG's tRNS, GIF's transparent index). 16-bit grey
    keeps its high byte, as Pillow reads 16-bit colour (its `convert` would clip it at 255)."""
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image)
        if image.mode == "I":  # 32-bit: read as 16-bit, as Pillow opens 16-bit PNGs in older versions
            values = np.clip(values, 0, 65535)
        key = image.info.get("transparency")
        alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8)) if isinstance(key, int) else None
        return Image.fromarray((values >> 8).astype(np.uint8)), alpha
    if image.has_transparency_data:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        return rgba.convert("L" if image.mode in ("L", "LA", "La") else "RGB"), rgba.getchannel("A")
    return (image if image.mode in ("L", "RGB", "CMYK") else image.convert("RGB")), None


def target_size(w: int, h: int, in_token_limit: int = IN_TOKEN_LIMIT, patch: int = PATCH_SIZE) -> TargetSize:
    """The sizes an image of `w x h` pixels is resized to (docs/model.md §5 steps 2-4).

    Step 2 scales the image down (truncating) when it has more than `in_token_limit` patches; step 3 stretches
    each side up to a multiple of `2 * patch`. Raises `ValueError` naming the sizes when a side would be 0
    pixels or a side would reach 512 patches (then naming the patch budget that fits it, where one does).
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
        longest = _longest_side(patch)
        budget = _fitting_budget(w, h, patch)
        remedy = (
            f"--image-tokens {budget} (API: max_image_tokens={budget}) scales it down to fit"
            if budget
            else f"crop it, or cut it into pieces at most {longest:,} pixels long"
        )
        raise ValueError(
            f"image of {w}x{h} pixels becomes {final[0]}x{final[1]} "
            f"({final[1] // patch}x{final[0] // patch} patches); each side must stay below "
            f"{MAX_PATCHES_PER_SIDE} patches ({longest:,} pixels), and the patch budget of {in_token_limit:,} "
            f"scales down only images of more patches (this one has {n_patches:,}): {remedy}"
        )
    return TargetSize(scaled, final)


def _longest_side(patch: int) -> int:
    """The longest side in pixels, after step 3's rounding up, that stays below `MAX_PATCHES_PER_SIDE` patches."""
    unit = MERGE * patch
    return (MAX_PATCHES_PER_SIDE * patch - 1) // unit * unit


def _fitting_budget(w: int, h: int, patch: int) -> int | None:
    """The largest patch budget at which step 2 shortens the long side of a `w x h` image to `_longest_side`, or
    None where no budget fits it (its other side would reach 0 pixels first)."""
    n_patches = (w // patch) * (h // patch)
    budget = math.ceil(n_patches * ((_longest_side(patch) + 1) / max(w, h)) ** 2) - 1
    for candidate in (budget, budget - 1):  # the float arithmetic may round the first up past the limit
        if candidate < 1:  # an image of no whole patch is never scaled
            break
        try:
            target_size(w, h, candidate, patch)
        except ValueError:
            continue
        return candidate
    return None


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
    return patches_of(to_rgb(load_image(image, max_pixels)), in_token_limit, patch_size)


def patches_of(rgb: Image.Image, in_token_limit: int = IN_TOKEN_LIMIT, patch_size: int = PATCH_SIZE) -> Preprocessed:
    """An RGB image as the model sees it (`preprocess` without the loading)."""
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
