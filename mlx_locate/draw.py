"""Draw located objects onto a copy of an image: boxes as rectangles, points as small circles."""

from __future__ import annotations

import colorsys
import io
import warnings
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .parse import LocatedObject
from .preprocess import to_rgb


def _palette(n: int) -> list[tuple[int, int, int]]:
    """`n` distinct saturated colours, evenly spaced in hue (golden-ratio steps keep neighbours apart)."""
    colours = []
    for i in range(n):
        r, g, b = colorsys.hsv_to_rgb((i * 0.618033988749895) % 1.0, 0.9, 0.95)
        colours.append((round(r * 255), round(g * 255), round(b * 255)))
    return colours


def _caption(obj: LocatedObject) -> str:
    parts = [obj.label] if obj.label else []
    if obj.confidence is not None:
        parts.append(f"{obj.confidence:.2f}")
    return " ".join(parts)


def writes_rgb(fmt: str) -> bool:
    """Whether Pillow writes an RGB image (what `draw_objects` saves) in format `fmt`: not a format without its
    save handler installed, nor one of other modes only (tried on a tiny image, its warnings unshown)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecated format still writes
            Image.new("RGB", (8, 8)).save(io.BytesIO(), format=fmt)
    except (OSError, ValueError, KeyError):
        return False
    return True


def check_drawing_path(path: str | Path) -> None:
    """`ValueError` unless Pillow writes a drawing under `path`'s suffix, naming the suffixes it does."""
    formats = Image.registered_extensions()
    suffix = Path(path).suffix.lower()
    if suffix in formats and writes_rgb(formats[suffix]):
        return
    taken = sorted(s for s, fmt in formats.items() if fmt in Image.SAVE and writes_rgb(fmt))
    what = f"a {suffix} file" if suffix else "a file without a suffix"
    raise ValueError(f"{path}: Pillow cannot write a drawing as {what}; end its name with one of {', '.join(taken)}")


def draw_objects(
    image: Image.Image,
    objects: Sequence[LocatedObject],
    path: str | Path | None = None,
    *,
    overwrite: bool = False,
    labels: Sequence[str | None] = (),
) -> Image.Image:
    """Return an RGB copy of `image` with every box and point drawn, one colour per label, captioned with
    the label and confidence when known. Saves to `path` when given; an existing file raises
    `FileExistsError` unless `overwrite=True`. `objects` must be in the image's original pixel frame.
    `labels` fixes the colour order (other labels follow as they first appear): pass the same list for
    every frame of a video and each label keeps its colour.
    """
    if path is not None and Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    canvas = to_rgb(image).copy()  # RGBA on white, as the model saw it; the caller's image stays untouched
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    width, height = canvas.size
    line = max(2, round(min(width, height) / 200))
    radius = max(3, 2 * line)

    order = list(dict.fromkeys([*labels, *(obj.label for obj in objects)]))
    colour_of = dict(zip(order, _palette(len(order)), strict=True))
    for obj in objects:
        colour = colour_of[obj.label]
        if obj.box is not None:
            left, top = obj.box[:2]
            draw.rectangle(obj.box, outline=colour, width=line)
        elif obj.point is not None:
            x, y = obj.point
            left, top = x - radius, y - radius
            draw.ellipse((left, top, x + radius, y + radius), outline=colour, fill=colour)
        else:
            continue
        caption = _caption(obj)
        if caption:
            tx1, ty1, tx2, ty2 = draw.textbbox((0, 0), caption, font=font)
            text_w, text_h = tx2 - tx1 + 4, ty2 - ty1 + 4
            # Above the object when there is room, otherwise just inside its top edge.
            tx, ty = max(0, left), top - text_h if top - text_h >= 0 else max(0, top)
            draw.rectangle((tx, ty, tx + text_w, ty + text_h), fill=colour)
            draw.text((tx + 2 - tx1, ty + 2 - ty1), caption, fill=(0, 0, 0), font=font)

    if path is not None:
        canvas.save(path)
    return canvas
