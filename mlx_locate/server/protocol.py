"""What goes over the wire, shared by the HTTP app, the MCP tool and the load benchmark: images in (data URL,
base64 or bytes, checked before decoding), engine `Request`s built from a client's fields, results out as JSON.

No web framework here (the benchmark runs where only the core dependencies are installed).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image

from ..admission import check_request
from ..categories import category_names, is_multi
from ..parse import json_pixels
from ..preprocess import ImageTooLargeError, load_image, open_header
from ..prompts import task_text
from ..request import Request, RequestError, Result

DEFAULT_MAX_PIXELS = 4096 * 4096  # a decoded RGBA image of this size is 64 MiB; the queue bounds how many wait
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Settings:
    """What the server and the MCP tool allow; the command-line flags of the same names set them."""

    model_name: str = "demo"
    host: str = "127.0.0.1"  # the bound address; a non-wildcard one is an allowed Host too
    allowed_hosts: tuple[str, ...] = ()  # more names clients may use in Host and Origin
    api_key: str | None = None  # Bearer token for /v1/*
    max_body_mb: float = 20.0
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_queue: int = 64  # engine requests waiting or decoding; more get 503
    max_image_mb: float = 512.0  # images held, compressed and decoded (`images.ImageBudget`); more get 503
    timeout_s: float = 120.0  # per request, queueing included; then 504
    allow_remote_images: bool = False
    max_rows: int | None = None  # the engine's rows per step (None: its default)
    allow_origins: tuple[str, ...] = ()  # web origins whose pages may read answers (CORS); "*" for any
    warmup: bool = True  # compile the step functions before saying ready

    @property
    def host_names(self) -> set[str]:
        names = {*LOOPBACK_NAMES, *(h.lower() for h in self.allowed_hosts)}
        if self.host not in WILDCARD_HOSTS:
            names.add(self.host.lower().strip("[]"))
        return names


class InputError(ValueError):
    """A client's mistake, with a stable `code` for the error body and an HTTP `status`."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code = code
        self.status = status


def is_remote(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def image_bytes(source: str) -> bytes:
    """The bytes of an image given as a data URL (`data:image/png;base64,...`) or as plain base64 (whitespace and
    missing padding allowed)."""
    text = source.strip()
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InputError("invalid_image", "a data URL image must be base64: data:image/png;base64,<data>")
    elif is_remote(text):
        raise InputError(
            "remote_images_disabled",
            "image URLs are not fetched; send the image as a data URL or base64 "
            "(or start the server with --allow-remote-images)",
        )
    text = "".join(text.split())  # line-wrapped, as `base64` and `base64.encodebytes` write it
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)  # padding optional
    except (binascii.Error, ValueError):
        raise InputError("invalid_image", "the image is neither a data URL nor valid base64") from None
    return data


def open_image(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS, orientation: str = "exif") -> Image.Image:
    """Decode `data` with `preprocess.load_image` (allowed formats found from the content, size checked from the
    header before any pixel is decoded) in `orientation`'s frame; every failure is an `InputError`,
    `image_too_large` for the size."""
    return decode_image(image_header(data, max_pixels), max_pixels, orientation)


def image_header(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """`data` opened without decoding a pixel (`preprocess.open_header`: its format and size checked); errors
    as `open_image`'s."""
    with input_errors():
        return open_header(io.BytesIO(data), "the image data", max_pixels)


def decode_image(
    header: Image.Image, max_pixels: int | None = DEFAULT_MAX_PIXELS, orientation: str = "exif"
) -> Image.Image:
    """The pixels of an image from `image_header` as `preprocess.load_image` shows them; errors as
    `open_image`'s."""
    with input_errors():
        return load_image(header, max_pixels, orientation)


@contextmanager
def input_errors() -> Iterator[None]:
    """An image's `ValueError` as an `InputError`: `image_too_large` for the size, else `invalid_image`."""
    try:
        yield
    except ValueError as e:
        code = "image_too_large" if isinstance(e, ImageTooLargeError) else "invalid_image"
        raise InputError(code, str(e)) from None


def build_requests(
    image: Image.Image, queries: Sequence[str | list[str] | None], task: str, vocab_size: int | None, **options
) -> list[Request]:
    """One engine `Request` per query (each its own question about `image`; a list is several categories of
    one detect request), each checked now as the engine will check it again (`check_request`), so a bad task,
    query or number is an `InputError` before anything is queued. `options` are `Request` fields."""
    requests = [Request(image, q, task=task, **options) for q in queries]
    for r in requests:
        try:
            task_text(task, r.query)
            if is_multi(r):
                category_names(r.query)
            if vocab_size is not None:
                check_request(r, vocab_size)
        except (RequestError, ValueError) as e:
            raise InputError("invalid_request", str(e)) from None
    return requests


RESULT_FIELDS = ("mode", "objects", "empty_labels", "truncated", "text", "orientation", "warnings", "stats")
ANSWER_FIELDS = ("objects", "empty_labels", "truncated", "image")  # the structured answer of chat completions


def result_json(result: Result) -> dict:
    """The answer fields of `Result.to_dict()` (the CLI's `--json`), without the token-level lists."""
    d = result.to_dict()
    return {k: d[k] for k in RESULT_FIELDS}


def locate_json(request_id: str, model: str, task: str, mode: str, queries: list | None, results: list[Result]) -> dict:
    """The `/v1/locate` answer: one result's fields, or `{"queries": [{"query": q, ...}, ...]}` when the client
    sent a list of queries (the CLI's `--json` with several `--query`)."""
    width, height = results[0].image_size
    head = {"id": request_id, "model": model, "task": task, "mode": mode, "image": {"width": width, "height": height}}
    if queries is None:
        return {**head, **result_json(results[0])}
    return {**head, "queries": [{"query": q, **result_json(r)} for q, r in zip(queries, results, strict=True)]}


def answer_json(result: Result) -> dict:
    """The parsed answer alone, every object with the same keys: `label`, `box` and `point` in pixels (null
    when absent), `confidence`; the chat endpoint's structured output."""
    width, height = result.image_size
    objects = [
        {"label": o.label, "box": _list(o.box), "point": _list(o.point), "confidence": o.confidence}
        for o in result.objects
    ]
    answer = {"objects": objects, "empty_labels": result.empty_labels, "truncated": result.truncated}
    return {**answer, "image": {"width": width, "height": height}}


def _list(values: tuple | None) -> list | None:
    return None if values is None else list(json_pixels(values))


def ground_json(point: Result, region: Result) -> dict:
    """The `/v1/ground` answer from a `point` and a `gui` result on the same instruction: the click point (the
    point task's, else the centre of the region's box) and the region's box, in pixels; `found: false` and
    `point: null` when neither gave one. `point_norm` is the same point in the model's 0..1000 units, as
    everywhere (`/v1/locate`, `LocatedObject.point_norm`)."""
    width, height = point.image_size
    points = [o for o in point.objects if o.point is not None]
    boxes = [o for o in region.objects if o.box is not None]
    box = boxes[0].box if boxes else None
    if points:
        xy, norm, confidence = points[0].point, list(points[0].point_norm), points[0].confidence
    elif boxes:
        b = boxes[0].box_norm
        xy, norm = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), [(b[0] + b[2]) / 2, (b[1] + b[3]) / 2]
        confidence = boxes[0].confidence
    else:
        xy, norm, confidence = None, None, None
    return {
        "found": xy is not None,
        "point": _list(xy),
        "point_norm": norm,
        "box": _list(box),
        "confidence": confidence,
        "image": {"width": width, "height": height},
        "text": {"point": point.text, "gui": region.text},
    }
