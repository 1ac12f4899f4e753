"""Generated token ids -> labelled boxes and points in original-image pixels (docs/model.md §9).

The grammar is `item* [<|im_end|>]` with items `<ref> TEXT </ref>`, `<box> x1 y1 x2 y2 </box>`,
`<box> x y </box>` and `<box> None </box>`. The parser never raises on an id sequence: model output is
untrusted, and anything outside the grammar is skipped or counted.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, fields

from .tokens import TokenIds

PIXEL_DECIMALS = 3  # pixel coordinates in JSON: finer than any image needs, without float noise


def json_pixels(values: Sequence[float]) -> tuple[float, ...]:
    """Pixel coordinates as every JSON output writes them: to PIXEL_DECIMALS."""
    return tuple(round(v, PIXEL_DECIMALS) for v in values)


@dataclass(frozen=True)
class LocatedObject:
    label: str | None  # the last <ref> label before the box; None when no <ref> came first (pointing)
    box: tuple[float, float, float, float] | None  # x1 <= x2, y1 <= y2 in original pixels, clamped to the image
    box_norm: tuple[int, int, int, int] | None  # as the model wrote it, 0..1000 (its corners may come in any order)
    point: tuple[float, float] | None  # x, y in original pixels, clamped
    point_norm: tuple[int, int] | None  # 0..1000
    confidence: float | None  # geometric mean of the probabilities of <box>, the coordinates and </box>

    def __post_init__(self):
        # The one place pixel boxes are ordered: every output (JSON, COCO, drawing, video, evaluation) reads them.
        if self.box is not None:
            x1, y1, x2, y2 = self.box
            object.__setattr__(self, "box", (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)))

    def to_dict(self) -> dict:
        """JSON fields: the label, and the box or the point (pixels to PIXEL_DECIMALS, and 0..1000) with its
        confidence."""
        out = {k: v for k, v in asdict(self).items() if v is not None or k == "label"}
        for key in ("box", "point"):
            if key in out:
                out[key] = json_pixels(out[key])
        return out


@dataclass(frozen=True)
class ParseResult:
    objects: list[LocatedObject]
    empty_labels: list[str | None]  # labels answered with <box>None</box> (or `none`)
    malformed: int  # boxes skipped because they held something other than 4 or 2 coordinates or one None
    truncated: bool  # the stream ended inside an unfinished <ref> or <box>, or after a label no box followed
    ended: bool  # <|im_end|> was seen


def to_pixels(coords: Sequence[int], image_size: tuple[int, int]) -> tuple[float, ...]:
    """Map normalised (x, y, x, y, ...) values in 0..1000 onto an image of `image_size` = (W0, H0) pixels.

    The preprocessing stretches the whole frame, so x -> x / 1000 * W0 and y -> y / 1000 * H0; results are
    clamped to [0, W0] and [0, H0]. Always pass the original size, never the processed one.
    """
    width, height = image_size
    out = []
    for i, value in enumerate(coords):
        extent = width if i % 2 == 0 else height
        out.append(min(max(value / 1000 * extent, 0.0), float(extent)))
    return tuple(out)


def _geometric_mean(probs: Sequence[float]) -> float:
    if any(p <= 0 for p in probs):
        return 0.0
    return math.exp(sum(math.log(p) for p in probs) / len(probs))


def _first_of(ids: Sequence[int], start: int, stops: set[int]) -> int:
    """The position of the first id in `stops` at or after `start`; len(ids) if there is none."""
    return next((j for j in range(start, len(ids)) if ids[j] in stops), len(ids))


def parse_tokens(
    ids: Sequence[int],
    token_ids: TokenIds,
    decode: Callable[[list[int]], str],
    image_size: tuple[int, int],
    token_probs: Sequence[float] | None = None,
) -> ParseResult:
    """Parse generated ids into located objects.

    Args:
        ids: the generated ids (the answer only, without the prompt).
        token_ids: the special ids of the checkpoint.
        decode: turns label ids into text (byte-level BPE); it only ever sees ids in [0, vocab_size).
        image_size: (W0, H0), the image size after RGB conversion and before any resize.
        token_probs: optional probability of each id as it was chosen; gives each object a confidence.

    Returns:
        A `ParseResult`. Never raises on the ids; raises `ValueError` if `token_probs` and `ids` differ in length.
    """
    parser = AnswerParser(token_ids, decode, image_size, confidences=token_probs is not None)
    parser.feed(ids, token_probs)
    return parser.result()


class AnswerParser:
    """The parser of `parse_tokens` over an answer that grows (`feed`): each item is parsed once, when the ids that
    finish it arrive; an unfinished item waits. After any feeds, `result()` equals `parse_tokens` of every id fed.

    With `labels` (the asked names a label is held to, docs/model.md §10.8), an object or empty answer whose label
    is none of them (a box before any label, a label that spells no name, one cut short by the length cap) is
    dropped, in what `feed` returns and in `result()` alike."""

    def __init__(
        self,
        token_ids: TokenIds,
        decode: Callable[[list[int]], str],
        image_size: tuple[int, int],
        confidences: bool = True,
        labels: Collection[str] | None = None,
    ):
        tk = self.tk = token_ids
        self.decode, self.image_size = decode, image_size
        self.skipped = {tk.null, tk.switch}
        self.ref_stops = {tk.ref_end, tk.box_start, tk.ref_start, tk.null, tk.im_end}
        self.box_stops = {tk.box_end, tk.box_start, tk.ref_start, tk.im_end}
        self.empties = {tk.none, tk.none_lower}
        self.labels = None if labels is None else frozenset(labels)
        self.ids: list[int] = []
        self.probs: list[float] | None = [] if confidences else None
        self.objects: list[LocatedObject] = []
        self.empty_labels: list[str | None] = []
        self.malformed = 0
        self.label: str | None = None
        self.boxless = False  # a label was read and no box has followed it yet: its item is unfinished
        self.ended = False  # <|im_end|> was seen: later ids are not parsed
        self.at = 0  # the first id not parsed yet: the start of an unfinished item, or the end

    def feed(
        self, ids: Sequence[int], probs: Sequence[float] | None = None
    ) -> tuple[list[LocatedObject], list[str | None]]:
        """Parse the answer's next `ids` (with their probabilities, when the parser gives confidences); returns the
        objects and the empty labels they finished. Raises `ValueError` if `probs` and `ids` differ in length."""
        ids = [int(t) for t in ids]
        if self.probs is not None:
            if probs is None or len(probs) != len(ids):
                given = 0 if probs is None else len(probs)
                raise ValueError(f"token_probs has {given} entries but ids has {len(ids)}; pass one per id")
            self.probs += [float(p) for p in probs]
        self.ids += ids
        objects, empty = len(self.objects), len(self.empty_labels)
        while not self.ended and self.at < len(self.ids) and self._item():
            pass
        return self.objects[objects:], self.empty_labels[empty:]

    def feed_to(
        self, answer: Sequence[int], probs: Sequence[float] | None = None
    ) -> tuple[list[LocatedObject], list[str | None]]:
        """`feed` the ids of `answer` (the whole answer so far, which starts with the ids fed) past those fed."""
        fed = len(self.ids)
        return self.feed(answer[fed:], None if probs is None else probs[fed:])

    def _item(self) -> bool:
        """Parse the item (or stray id) at `at`; False when it is not finished yet."""
        ids, tk, i, n = self.ids, self.tk, self.at, len(self.ids)
        token = ids[i]
        if token == tk.im_end:
            self.ended = True
            return False
        if token == tk.ref_start:
            j = _first_of(ids, i + 1, self.ref_stops)
            if j == n:
                return False
            text_ids = [t for t in ids[i + 1 : j] if 0 <= t < tk.vocab_size and t not in self.skipped]
            self.label = self.decode(text_ids).strip()
            self.boxless = True
            # </ref> is consumed; an early stop token starts the next item.
            self.at = j + 1 if ids[j] == tk.ref_end else j
            return True
        if token == tk.box_start:
            j = _first_of(ids, i + 1, self.box_stops)
            if j == n:
                return False
            self.boxless = False
            if ids[j] != tk.box_end:
                self.malformed += 1
                self.at = j
                return True
            self._box(i, j)
            self.at = j + 1
            return True
        self.at = i + 1  # stray tokens outside an item (<null>, <switch>, text, lone coordinates or </box>)
        return True

    def _box(self, i: int, j: int) -> None:
        """The box item from `<box>` at i to `</box>` at j: an object, an empty label or a malformed box."""
        ids, tk = self.ids, self.tk
        inner = [k for k in range(i + 1, j) if ids[k] not in self.skipped]
        values = [tk.coord_value(ids[k]) for k in inner if tk.is_coord(ids[k])]
        held = self.labels is None or self.label in self.labels
        if len(inner) == 1 and ids[inner[0]] in self.empties:
            if held:
                self.empty_labels.append(self.label)
        elif len(values) == len(inner) and len(values) in (2, 4):
            if not held:
                return
            confidence = None
            if self.probs is not None:
                confidence = _geometric_mean([self.probs[k] for k in (i, *inner, j)])
            pixels = to_pixels(values, self.image_size)
            if len(values) == 4:
                self.objects.append(LocatedObject(self.label, pixels, tuple(values), None, None, confidence))
            else:
                self.objects.append(LocatedObject(self.label, None, None, pixels, tuple(values), confidence))
        else:
            self.malformed += 1

    def result(self) -> ParseResult:
        """What the ids fed so far parse to; the answer is truncated when it ends inside an unfinished item (a label
        that no box has followed is one)."""
        truncated = not self.ended and (self.at < len(self.ids) or self.boxless)
        return ParseResult(list(self.objects), list(self.empty_labels), self.malformed, truncated, self.ended)


# Answer text -> the id grammar above, for `parse_text`: the text's own special tokens, each text run one id.
# Coordinates are ASCII digits only, as the model's `<0>`..`<1000>` are (`\d` would take any script's digits).
_TEXT_TOKENS = re.compile(r"<\|im_end\|>|</?ref>|</?box>|<null>|<switch>|<([0-9]{1,4})>|<\|[^<>|]*\|>")
_PLAIN_COORDINATE = re.compile(r"[0-9]{1,4}")


def _text_ids() -> TokenIds:
    """Special ids for text: negative, so every text run (ids 0, 1, ...) is in [0, vocab_size)."""
    names = [f.name for f in fields(TokenIds) if f.name not in ("coord_start", "coord_end", "vocab_size")]
    specials = {name: -1 - i for i, name in enumerate(names)}
    return TokenIds(**specials, coord_start=-2000, coord_end=-1000, vocab_size=2**62)


def parse_text(text: str, image_size: tuple[int, int]) -> ParseResult:
    """Parse a LocateAnything answer text (ours, NVIDIA's or mlx-vlm's: `<ref>label</ref><box><x1><y1><x2><y2>
    </box>...`; plain integers inside a box are read as coordinates too) into objects in the pixels of
    `image_size` = (W0, H0), by `parse_tokens`' rules; a coordinate that is not ASCII digits makes its item
    malformed. Text carries no probabilities: confidences are None. `TypeError` for text that is no string,
    `ValueError` for an `image_size` that is no pair of positive finite numbers."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if not (
        isinstance(image_size, tuple | list)
        and len(image_size) == 2
        and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in image_size
        )
    ):
        raise ValueError(f"image_size must be (width, height), two positive numbers, got {image_size!r}")
    tk = _text_ids()
    marks = {"<|im_end|>": tk.im_end, "<ref>": tk.ref_start, "</ref>": tk.ref_end, "<box>": tk.box_start}
    marks.update({"</box>": tk.box_end, "<null>": tk.null, "<switch>": tk.switch})
    runs: list[str] = []
    ids: list[int] = []
    in_box = False

    def add_text(run: str) -> None:
        if not in_box:
            ids.append(len(runs))
            runs.append(run)
            return
        for piece in re.split(r"[\s,()\[\]]+", run):
            if piece in ("None", "none"):
                ids.append(tk.none)
            elif _PLAIN_COORDINATE.fullmatch(piece) and int(piece) <= 1000:
                ids.append(tk.coord_token(int(piece)))
            elif piece:
                ids.append(len(runs))
                runs.append(piece)

    end = 0
    for match in _TEXT_TOKENS.finditer(text):
        if match.start() > end:
            add_text(text[end : match.start()])
        end = match.end()
        token = match.group()
        if match.group(1) is not None and int(match.group(1)) <= 1000:
            ids.append(tk.coord_token(int(match.group(1))))
        elif token in marks:
            ids.append(marks[token])
            in_box = token == "<box>" or (in_box and token not in ("</box>", "<ref>", "<|im_end|>"))
        # other special tokens (<|endoftext|>, an out-of-range coordinate) are skipped
    if end < len(text):
        add_text(text[end:])
    return parse_tokens(ids, tk, lambda text_ids: "".join(runs[i] for i in text_ids), image_size)
