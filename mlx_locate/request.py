"""What a caller hands the engine and gets back: `Request` (one question about one image, every decoding option
its own), `Result`, `RequestError`, `PreparedImage` (an image's host work, done once), and the engine's `Handle`
and `EngineEvent`s. `decode_options` resolves a request into its row's decoding options.

The engine, tiling and the public API all build on these; this module imports none of them.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
from PIL import Image

from .decide import Guards, Mode
from .draw import draw_objects
from .label_trie import LabelTrie
from .parse import LocatedObject
from .preprocess import (
    ORIENTATIONS,
    PhotoNotes,
    Preprocessed,
    load_image,
    patches_of,
    photo_notes,
    pixel_limit,
    to_rgb,
)
from .row_decoder import DecodeOptions
from .sampling import Sampling

DEFAULT_TASK = "detect"
DEFAULT_MODE = Mode.HYBRID.value
DEFAULT_MAX_TOKENS = 512
MIN_IMAGE_TOKENS = 4  # the smallest patch budget a request may ask for (`max_image_tokens`)


class RequestError(ValueError):
    """A request that cannot run (unreadable image, prompt too long, bad option); other requests go on."""


class ImageOptions(NamedTuple):
    """A request's options for its image, resolved: the pixel limit, the frame and the patch budget."""

    max_pixels: int
    orientation: str
    max_image_tokens: int


class PreparedImage(NamedTuple):
    """An image's host work, done once: RGB pixels (as a viewer shows them), patches, a key of its content, the
    options it was prepared under, and what the image policy did."""

    rgb: Image.Image
    pre: Preprocessed
    key: tuple  # (sha256 of the resized pixels, original size, grid)
    options: ImageOptions
    notes: PhotoNotes = PhotoNotes("exif", 1, ())


@dataclass(frozen=True)
class Request:
    """One question about one image. `prompt` (raw user text) replaces `task` + `query`."""

    image: str | Path | BinaryIO | Image.Image | PreparedImage
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
    orientation: str = "exif"  # "exif": the frame a viewer shows (EXIF orientation applied); "stored": as stored
    max_image_tokens: int | None = (
        None  # a lower patch budget than the model's own (faster, coarser); None: the model's
    )
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
    orientation: str = "exif"  # the frame of `image_size`, boxes and points: "exif" (as a viewer shows) or "stored"
    warnings: list[str] = field(default_factory=list)  # about the image (only its first frame used, ...)
    # (image or path, max_pixels) that `locate()` answered, for `draw`; not a field, so never copied or serialised
    source = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["objects"] = [o.to_dict() for o in self.objects]
        return out

    def to_supervision(self, classes: Sequence[str] = ()):
        """The objects as `supervision.Detections`: `xyxy` (a point as a box of no size at it), `confidence`,
        `class_id` (the label's position in `classes`, then labels in order of first appearance) and
        `data["class_name"]`. Needs the extra: pip install "mlx-locate[supervision]"."""
        try:
            import supervision as sv
        except ImportError:
            raise ImportError(
                'to_supervision needs the supervision extra: pip install "mlx-locate[supervision]"'
            ) from None
        names = [o.label or "" for o in self.objects]
        order = list(dict.fromkeys([*classes, *names]))
        boxes = [o.box if o.box is not None else (*o.point, *o.point) for o in self.objects]
        confidences = [o.confidence for o in self.objects]
        return sv.Detections(
            xyxy=np.array(boxes, dtype=np.float32).reshape(-1, 4),
            confidence=None if None in confidences else np.array(confidences, dtype=np.float32),
            class_id=np.array([order.index(n) for n in names], dtype=int),
            data={"class_name": np.array(names, dtype=str)},
        )

    def draw(self, image: str | Path | Image.Image | None = None) -> Image.Image:
        """An RGB copy of `image` in the result's frame (`load_image` with its `orientation`) with the boxes,
        points, labels and confidences drawn (`draw.draw_objects`); without `image`, the one `locate()` was given
        (a path is read again, so no copy is kept; a file's pixels are kept as it was read once)."""
        max_pixels = None
        if image is None:
            if self.source is None:
                raise ValueError("this result does not hold its image (only locate()'s do); pass it: draw(image)")
            image, max_pixels = self.source
        return draw_objects(load_image(image, max_pixels, self.orientation), self.objects)

    def _repr_png_(self) -> bytes | None:
        """Jupyter's picture of a `locate()` result: its image, drawn."""
        if self.source is None:
            return None
        buffer = io.BytesIO()
        self.draw().save(buffer, "PNG")
        return buffer.getvalue()


def as_request_error(error: Exception) -> RequestError:
    """`error` as the `RequestError` a handle fails with: a bad file's or value's own message, anything else
    named by its type."""
    if isinstance(error, RequestError):
        return error
    message = str(error) if isinstance(error, OSError | ValueError) else f"{type(error).__name__}: {error}"
    return RequestError(message)


class EventKind(Enum):
    OBJECT = "object"  # a box or point was committed
    EMPTY = "empty"  # a label was answered <box>None</box>
    VIEW = "view"  # a view of a tiled request finished; `result` holds it in the whole image's pixels
    TEXT = "text"  # more of the answer's text is final (only for handles submitted with `text=True`)
    DONE = "done"  # the request finished; `result` holds the Result
    ERROR = "error"  # the request failed; `error` holds the RequestError


@dataclass(frozen=True)
class EngineEvent:
    handle: Handle
    kind: EventKind
    object: LocatedObject | None = None  # OBJECT
    label: str | None = None  # EMPTY
    result: Result | None = None  # DONE, VIEW
    error: RequestError | None = None  # ERROR
    view: int | None = None  # VIEW: the view's index among the tiled request's views
    tile: tuple | None = None  # VIEW: the view's crop of the image (a `tiles.Tile`)
    text: str | None = None  # TEXT: the answer's next piece, up to its last finished item


@dataclass(eq=False)
class Handle:
    """A submitted request; `result` or `error` is set once it is done."""

    id: int
    request: Request
    on_event: Callable[[EngineEvent], None] | None = None
    result: Result | None = None
    error: RequestError | None = None
    cancelled: bool = False
    events: list[EngineEvent] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    parent: Handle | None = field(default=None, repr=False)  # the request of several views a view belongs to
    group: Hashable = field(default=None, repr=False)  # the client call it belongs to (fair admission)
    text: bool = False  # send TEXT events
    engine: Any = field(default=None, repr=False)  # the engine it was submitted to

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


def parse_mode(mode: str | Mode) -> Mode:
    """The request's mode as a `Mode`: parsed once, where a request is checked (`admission.check_request`)."""
    if isinstance(mode, Mode):
        return mode
    modes = {m.value: m for m in Mode}
    if not isinstance(mode, str) or mode not in modes:
        raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(modes)}")
    return modes[mode]


def decode_options(request: Request, mode: Mode, budget: int, labels: LabelTrie | None = None) -> DecodeOptions:
    """The decoding options of `request`'s row, its mode parsed, its token budget fitted and the asked names its
    labels are held to (a joint category list's): label re-decoding is on by default for OCR in hybrid mode, and
    needs hybrid mode (its AR steps)."""
    redecode = request.redecode_labels
    if redecode is None:
        redecode = request.task == "ocr" and mode is Mode.HYBRID
    elif redecode and mode is not Mode.HYBRID:
        raise RequestError(f"redecode_labels needs hybrid mode (AR steps), not {mode.value}")
    return DecodeOptions(
        mode,
        budget,
        request.sampling,
        request.strict,
        request.guards,
        redecode_labels=redecode,
        seed=request.seed,
        labels=labels,
    )


def check_image_options(orientation: str, max_image_tokens: int | None, in_token_limit: int) -> None:
    """`RequestError` for an orientation or a patch budget the model cannot take."""
    if orientation not in ORIENTATIONS:
        raise RequestError(f"orientation must be one of {', '.join(ORIENTATIONS)}, got {orientation!r}")
    if max_image_tokens is not None and (
        isinstance(max_image_tokens, bool)
        or not isinstance(max_image_tokens, int)
        or not MIN_IMAGE_TOKENS <= max_image_tokens <= in_token_limit
    ):
        raise RequestError(
            f"max_image_tokens must be a whole number of patches from {MIN_IMAGE_TOKENS} to the model's "
            f"{in_token_limit:,}, got {max_image_tokens!r}"
        )


def prepare_image(
    image: str | Path | BinaryIO | Image.Image | PreparedImage,
    max_pixels: int | None,
    in_token_limit: int,
    patch_size: int,
    orientation: str = "exif",
    max_image_tokens: int | None = None,
) -> PreparedImage:
    """Load (checking the pixel limit) as a viewer shows it, convert to RGB, cut into patches within the patch
    budget (`max_image_tokens`, at most the model's `in_token_limit`) and key by content. A prepared image is
    taken as it is, under the options it was prepared with only (a limit not given is its own; `RequestError` for
    others). `TypeError` for an image that is no path, PIL image or binary file object."""
    if not isinstance(image, str | Path | Image.Image | PreparedImage) and not hasattr(image, "read"):
        hint = "; wrap bytes in io.BytesIO" if isinstance(image, bytes | bytearray) else ""
        hint = "; convert an array with PIL.Image.fromarray" if isinstance(image, np.ndarray) else hint
        raise TypeError(f"image must be a path, a PIL image or a binary file object, got {type(image).__name__}{hint}")
    check_image_options(orientation, max_image_tokens, in_token_limit)
    if isinstance(image, PreparedImage):
        own = image.options
        options = ImageOptions(
            own.max_pixels if max_pixels is None else pixel_limit(max_pixels),
            orientation,
            max_image_tokens or own.max_image_tokens,
        )
        if options != own:
            differ = [name for name in ImageOptions._fields if getattr(options, name) != getattr(own, name)]
            raise RequestError(
                f"{_spelled(options, differ)}: the image was prepared with {_spelled(own, differ)}; pass "
                "the image itself, or prepare it with the request's options"
            )
        return image
    options = ImageOptions(pixel_limit(max_pixels), orientation, max_image_tokens or in_token_limit)
    shown = load_image(image, max_pixels, orientation)
    rgb = to_rgb(shown)
    pre = patches_of(rgb, options.max_image_tokens, patch_size)
    return PreparedImage(rgb, pre, (pre.digest, rgb.size, pre.grid), options, photo_notes(shown, orientation))


def _spelled(options: ImageOptions, names: list[str]) -> str:
    return ", ".join(f"{name}={getattr(options, name)!r}" for name in names)
