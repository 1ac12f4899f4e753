"""The folder-annotation core that `batch`, `cluster` and `video` share: the questions asked of every image
(`AnnotateSettings`), the annotate loop over one batched engine, and the results JSONL (one line per image, written,
flushed and fsynced at once; read back to resume; sorted by image path once a run is done, `write_sorted`).

A line is `{"image": PATH, "size": [W, H], "results": [{"task": T, "query": Q} or {"prompt": P},
...Result.to_dict()}, ...], "settings": {...}}`, results in the order of the questions (lean: without
LEAN_DROPPED unless `full`), or `{"image": PATH, "error": "...", "settings": {...}}` for an image that cannot be
read or a request that cannot run; `settings` (`AnnotateSettings.record`) are what the answers depend on besides
the questions, compared on resume and merge (`scan_output`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from .. import jsonl
from ..engine import EventKind
from ..locate import LocateModel
from ..preprocess import load_image
from ..prompts import CATEGORY_SEPARATOR
from ..request import DEFAULT_TASK, Request, Result

LEAN_DROPPED = ("prompt_ids", "token_probs")  # per-token fields left out of the JSONL unless --full
QUESTION_KEYS = ("task", "query", "prompt")  # what a result entry says about its question
LINE_START = b'{"image": '  # how every line Jsonl writes begins (json.dumps keeps the key order)


class Question(NamedTuple):
    """One question asked of every image: `query` under `task`, or raw user text `prompt`."""

    task: str | None
    query: str | None
    prompt: str | None = None

    def key(self) -> dict:
        """How the JSONL names this question in each result entry."""
        return {"prompt": self.prompt} if self.prompt is not None else {"task": self.task, "query": self.query}

    def name(self) -> str:
        """The COCO category name."""
        return next(v for v in (self.prompt, self.query, self.task) if v is not None)

    def names(self) -> list[str]:
        """The COCO category names it answers: each category of a detect query joined by `</c>`, else `name()`."""
        if self.prompt is None and (self.task or DEFAULT_TASK) == "detect" and self.query is not None:
            return self.query.split(CATEGORY_SEPARATOR)
        return [self.name()]


@dataclasses.dataclass(frozen=True)
class AnnotateSettings:
    """Everything one image's requests and its JSONL line depend on (sent to Ray workers as is)."""

    questions: tuple[Question, ...]
    options: dict = dataclasses.field(default_factory=dict)  # `Request` fields every question shares
    max_pixels: int | None = None
    full: bool = False  # keep LEAN_DROPPED
    max_rows: int | None = None  # engine rows; None: sized for the device
    model: dict = dataclasses.field(default_factory=dict)  # the model's identity (`flags.model_settings`)

    def record(self) -> dict:
        """The settings each line records: the model and the `Request` options (not the rows, `full` nor
        `max_pixels`, which change no answer)."""
        return jsonl.plain({**self.model, **self.options})

    def requests(self, image: Image.Image, path: str) -> list[Request]:
        return [
            Request(
                image,
                q.query,
                task=q.task or DEFAULT_TASK,
                prompt=q.prompt,
                max_pixels=self.max_pixels,
                tag=(path, i),
                **self.options,
            )
            for i, q in enumerate(self.questions)
        ]


class Annotated(NamedTuple):
    line: dict  # the image's JSONL line
    image: Image.Image | None  # the decoded image (for drawing); None for an error line or a remote one
    worker: str | None = None  # "host:pid" of the Ray worker that made the line


class OutputError(Exception):
    """Writing the results failed (disk full, permission): the run stops, the lines written stay."""


def question_keys(entry: dict) -> list[dict]:
    return [{k: r[k] for k in QUESTION_KEYS if k in r} for r in entry["results"]]


class Scan(NamedTuple):
    done: dict[str, bool]  # image -> whether it was answered (False: an error line)
    questions: list[dict] | None  # what its answered lines answer (`Question.key()`s); None: no answered line
    settings: dict | None  # what its lines record (`AnnotateSettings.record`); None: no line records settings
    unrecorded: int  # lines without every setting (written by an earlier version): taken as made with `settings`


def scan_output(
    path: Path,
    questions: list[dict] | None,
    settings: dict | None,
    repair: bool = True,
    against: str = "now",
    hint: str = "; use another --out to start over",
) -> Scan:
    """The lines already in the JSONL at `path`, as a run resumes it or `--merge` joins it.

    Every line must answer `questions` with `settings`; where None, the same as the first line that says (a
    file is one run's). A complete line that is not JSON or not ours, or that answers other questions or with
    other settings (named, their values in the file and `against`, then `hint`), raises `ValueError` and nothing
    is changed. Then a last line of ours cut short (an interrupted write) is cut off the file (`repair`) or
    ignored."""
    if not path.exists():
        return Scan({}, questions, settings, 0)
    text, tail = jsonl.complete_text(path, "mlx-locate-batch")
    done, unrecorded = {}, 0
    for number, entry in jsonl.values(text, path, jsonl.RESUME_HINT):
        if (
            not isinstance(entry, dict)
            or "image" not in entry
            or not ("results" in entry or "error" in entry)
            or not isinstance(entry.get("settings", {}), dict)
        ):
            raise ValueError(f"{path}:{number} is not a line of mlx-locate-batch; use another --out")
        if "results" in entry:
            if questions is None:
                questions = question_keys(entry)
            elif question_keys(entry) != questions:
                raise ValueError(f"{path} holds answers to {question_keys(entry)}, not {questions}{hint}")
        if settings is None and "settings" in entry:
            settings = entry["settings"]
        recorded = entry.get("settings", {})
        unrecorded += bool(settings is None or jsonl.check_settings(path, recorded, settings, hint, against))
        done[entry["image"]] = "results" in entry
    jsonl.cut_unfinished(path, tail, (LINE_START,), "mlx-locate-batch", cut=repair)
    return Scan(done, questions, settings, unrecorded)


def output_lines(path: Path) -> Iterator[dict]:
    """The complete lines of a JSONL that `scan_output` accepted, one at a time."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                yield json.loads(line)


def result_entry(question: Question, result: Result, full: bool) -> dict:
    entry = {**question.key(), **result.to_dict()}
    if not full:
        for key in LEAN_DROPPED:
            del entry[key]
    return entry


def error_line(path: str, error: Exception) -> dict:
    return {"image": path, "error": str(error)}


def read_image(path: str, max_pixels: int | None, orientation: str = "exif") -> Image.Image | dict:
    """The decoded image (as `load_image` shows it), or its error line."""
    try:
        return load_image(path, max_pixels, orientation)
    except (FileNotFoundError, ValueError) as e:
        return error_line(path, e)
    except Exception as e:  # Pillow's plugins raise many types on corrupt files; they concern this image only
        return error_line(path, ValueError(f"{path} is not a readable image: {type(e).__name__}: {e}"))


def annotate(model: LocateModel, paths: Iterable[str], settings: AnnotateSettings) -> Iterator[Annotated]:
    """Every image's line as soon as all its questions are answered (in completion order).

    All requests go to one engine; at most `ceil(rows / questions)` images are decoded and held at once. An
    image that cannot be read, or a request that fails (`RequestError`), gives that image's error line; any
    other exception is a failure of the model and propagates."""
    engine = model.engine(settings.max_rows)
    window = max(1, -(-engine.max_rows // len(settings.questions)))
    paths = iter(paths)
    flight: dict[str, tuple[Image.Image, list]] = {}  # path -> (image, its results or RequestErrors so far)
    while True:
        while len(flight) < window and (path := next(paths, None)) is not None:
            image = read_image(path, settings.max_pixels, settings.options.get("orientation", "exif"))
            if isinstance(image, dict):
                yield made(image, None, settings)
                continue
            flight[path] = (image, [None] * len(settings.questions))
            for request in settings.requests(image, path):
                engine.submit(request)
        if not flight:
            return
        assert not engine.idle, "images in flight but no request left in the engine"
        for event in engine.step():
            if event.kind not in (EventKind.DONE, EventKind.ERROR):
                continue
            path, index = event.handle.request.tag
            image, answers = flight[path]
            answers[index] = event.result if event.kind is EventKind.DONE else event.error
            if all(a is not None for a in answers):
                del flight[path]
                yield image_line(path, image, answers, settings)


def image_line(path: str, image: Image.Image, answers: list, settings: AnnotateSettings) -> Annotated:
    """The line of an image whose every question is answered: its results in question order, or the first
    failure (named by its question when there are several)."""
    for question, answer in zip(settings.questions, answers, strict=True):
        if not isinstance(answer, Result):
            where = f"{question.name()!r}: " if len(settings.questions) > 1 else ""
            return made(error_line(path, ValueError(f"{where}{answer}")), None, settings)
    results = [result_entry(q, r, settings.full) for q, r in zip(settings.questions, answers, strict=True)]
    return made({"image": path, "size": list(answers[0].image_size), "results": results}, image, settings)


def made(line: dict, image: Image.Image | None, settings: AnnotateSettings) -> Annotated:
    """An image's finished line, recording the settings it was made with."""
    return Annotated({**line, "settings": settings.record()}, image)


class Jsonl:
    """The output JSONL, opened for appending: each line is written, flushed and fsynced at once."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = path.open("a", encoding="utf-8")
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e}") from e

    def write(self, line: dict) -> None:
        try:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            raise OutputError(f"cannot write {self.path}: {e}") from e

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # the write that failed was reported; the lines before it are on disk
            pass


def write_sorted(out: Path, sources: list[Path]) -> tuple[int, int]:
    """Write `out` (under a temporary name, then renamed) with one line per image of the JSONL files
    `sources`, in the sorted order of the image paths (the order `batch.list_images` gives): an image's
    answered line before an error line, else the first. The lines are copied byte for byte. Returns (lines
    written, lines dropped as duplicates)."""
    chosen: dict[str, tuple[bool, Path, int, int]] = {}  # image -> (answered, file, offset, length)
    total = 0
    for source in sources:
        offset = 0
        with source.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):  # an unfinished last line
                    break
                line = json.loads(raw)
                answered, old = "results" in line, chosen.get(line["image"])
                if old is None or (answered and not old[0]):
                    chosen[line["image"]] = (answered, source, offset, len(raw))
                offset += len(raw)
                total += 1
    staged = out.with_name(out.name + ".partial")
    try:
        files = {source: source.open("rb") for source in sources}
        try:
            with staged.open("wb") as f:
                for image in sorted(chosen, key=Path):
                    _, source, offset, length = chosen[image]
                    files[source].seek(offset)
                    f.write(files[source].read(length))
                f.flush()
                os.fsync(f.fileno())
        finally:
            for handle in files.values():
                handle.close()
        os.replace(staged, out)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e}") from e
    return len(chosen), total - len(chosen)
