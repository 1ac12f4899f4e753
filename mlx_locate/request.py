"""What a caller hands the engine and gets back: `Request` (one question about one image, every decoding option
its own), `Result`, `RequestError`, and `PreparedImage` (an image's host work, done once).

The engine, tiling and the public API all build on these; this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from .decide import Guards, Mode
from .parse import LocatedObject
from .preprocess import Preprocessed, load_image, preprocess, to_rgb
from .sampling import Sampling

DEFAULT_TASK = "detect"
DEFAULT_MODE = Mode.HYBRID.value
DEFAULT_MAX_TOKENS = 512


class RequestError(ValueError):
    """A request that cannot run (unreadable image, prompt too long, bad option); other requests go on."""


class PreparedImage(NamedTuple):
    """An image's host work, done once: RGB pixels, patches, and a key of its content."""

    rgb: Image.Image
    pre: Preprocessed
    key: tuple  # (sha256 of the resized pixels, original size, grid)


@dataclass(frozen=True)
class Request:
    """One question about one image. `prompt` (raw user text) replaces `task` + `query`."""

    image: str | Path | Image.Image | PreparedImage
    query: str | list[str] | None = None
    task: str = DEFAULT_TASK
    prompt: str | None = None
    mode: str | Mode = DEFAULT_MODE
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    strict: bool = False  # the reference's decisions: every guard off, several categories in one joint prompt
    joint: bool = False  # several detect categories in one prompt (the reference's), not one row each
    guards: Guards = Guards()
    redecode_labels: bool | None = None  # None: on for task "ocr" in hybrid mode
    rendering: str = "A"
    seed: int = 0
    max_pixels: int | None = None  # None: preprocess.DEFAULT_MAX_PIXELS
    tiles: str | tuple[int, int] | None = None  # "auto" or (rows, cols): decode overlapping crops and merge
    tile_overlap: float = 0.2  # fraction of a tile shared with its neighbour
    tile_whole: bool = True  # with tiles, also decode the whole image and merge it in
    tag: Hashable | Any = None  # the caller's own (a path, a frame index); never read by the engine


@dataclass
class Result:
    objects: list[LocatedObject]
    empty_labels: list[str | None]  # labels the model answered with <box>None</box>
    text: str  # the generated text, special tokens included
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids
    token_probs: list[float]  # the decoder's probability of each generated id
    grid: list[int]  # [h, w] patches of the image
    image_size: tuple[int, int]  # (W0, H0) the pixel frame of every box and point
    mode: str
    truncated: bool  # the stream ended inside an item (length cap or stop)
    stats: dict = field(default_factory=dict)  # timings per phase (s), steps, host reads, stop reason

    def to_dict(self) -> dict:
        out = asdict(self)
        out["objects"] = [o.to_dict() for o in self.objects]
        return out


def parse_mode(mode: str | Mode) -> Mode:
    if isinstance(mode, Mode):
        return mode
    modes = {m.value: m for m in Mode}
    if not isinstance(mode, str) or mode not in modes:
        raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(modes)}")
    return modes[mode]


def prepare_image(
    image: str | Path | Image.Image | PreparedImage, max_pixels: int | None, in_token_limit: int, patch_size: int
) -> PreparedImage:
    """Load (checking the pixel limit), convert to RGB, cut into patches and key by content."""
    if isinstance(image, PreparedImage):
        return image
    rgb = to_rgb(load_image(image, max_pixels))
    pre = preprocess(rgb, in_token_limit=in_token_limit, patch_size=patch_size)
    return PreparedImage(rgb, pre, (pre.digest, rgb.size, pre.grid))
