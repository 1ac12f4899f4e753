"""Benchmark files and answer files: what `mlx-locate-eval` reads.

Benchmarks (`load_benchmark`; the format is found from the content):

- the LocateAnything / Rex-Omni evaluation JSONL: one sample per line with `image_path`, `categories`, `gt`
  (`{category: [[x1, y1, x2, y2], ...]}` in pixels; pointing: `{category: [RLE mask, ...]}`, also under
  `gt_mask`), `task_name`, `dataset_name`;
- a COCO instances JSON (LVIS too): one detection sample per image with annotations, its categories asked in
  one prompt;
- ScreenSpot-Pro annotations (a JSON list, or a folder of them): `img_filename`, `bbox` [x1, y1, x2, y2],
  `instruction`, `ui_type`, `application`, `group`, `platform`.

Answer files (`read_answers`) are the paper's: one line per sample with `image_path`, `question`,
`raw_response`, `extracted_predictions` (`{category: [[x1, y1, x2, y2] | [x, y]]}` in original pixels), `gt`,
`task_name`, `dataset_name`; ours add `scores` (confidences) and `stats`.
"""

from __future__ import annotations

import importlib
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from .. import jsonl

FORMATS = ("auto", "jsonl", "coco", "screenspot")
POINT_TASKS = ("pointing", "pointing_referring")
COCO_TASKS = ("common_object_detection", "long_tailed_object_detection")  # scored on the COCO path too
GUI_FIELDS = ("id", "ui_type", "application", "group", "platform")
JSONL_FIELDS = ("image_path", "categories", "gt", "task_name", "dataset_name")
ANSWER_FIELDS = ("extracted_predictions", "gt", "task_name", "dataset_name")


def extra(module: str, what: str):
    """Import an optional module of the `[eval]` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f'{what} needs the eval extra: pip install "mlx-locate[eval]"') from None


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None


def is_ocr(task_name: str) -> bool:
    return "ocr" in task_name or "text" in task_name


# --- Benchmarks -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSample:
    index: int
    image_path: str  # as the annotation writes it, relative to the image root
    categories: list[str]
    gt: dict | list  # {category: [box or RLE, ...]}; GUI: one box
    task_name: str
    dataset_name: str
    fields: dict = field(default_factory=dict)  # GUI: id, ui_type, application, group, platform

    def answer_gt(self) -> dict | list:
        """The ground truth as an answer line gives it (pointing: the masks of `gt_mask`)."""
        return self.gt["gt_mask"] if isinstance(self.gt, dict) and "gt_mask" in self.gt else self.gt


@dataclass(frozen=True)
class Benchmark:
    name: str  # names the answer files
    kind: str  # jsonl, coco or screenspot
    image_root: Path | None
    samples: list[BenchSample]
    coco: dict | None = None  # the instances JSON, for the COCO path
    images: dict[str, Image.Image] | None = None  # images in memory by image_path, instead of files

    def image(self, sample: BenchSample) -> Path | Image.Image:
        return self.images[sample.image_path] if self.images is not None else self.image_root / sample.image_path


def detect_format(path: Path) -> str:
    if path.is_dir():
        return "screenspot"
    if path.suffix == ".jsonl":
        return "jsonl"
    data = read_json(path)
    if isinstance(data, dict) and "images" in data and "annotations" in data:
        return "coco"
    if isinstance(data, list):
        return "screenspot"
    raise ValueError(f"{path}: not a COCO instances JSON (images, annotations) nor a ScreenSpot-Pro list")


def load_benchmark(path: str | Path, images: str | Path | None = None, fmt: str = "auto") -> Benchmark:
    """Read a benchmark in any of the three input formats; `images` is the root of its image paths."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no benchmark file or folder {path}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    root = Path(images) if images is not None else (path if path.is_dir() else path.parent)
    if fmt == "jsonl":
        return jsonl_benchmark(path.stem, jsonl.values(path.read_text(encoding="utf-8"), path), path, root)
    if fmt == "coco":
        return coco_benchmark(path.stem, read_json(path), path, root)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no ScreenSpot-Pro annotation files (*.json) in {path}")
    return screenspot_benchmark(path.stem, [(file, read_json(file)) for file in files], path, root)


def _benchmark(name: str, kind: str, where: Path | str, root, samples: list, coco=None, images=None) -> Benchmark:
    if not samples:
        raise ValueError(f"{where} holds no sample to evaluate")
    return Benchmark(name, kind, root, samples, coco, images)


def _check_sample(where: str, s: BenchSample) -> None:
    if not isinstance(s.categories, list) or not all(isinstance(c, str) and c.strip() for c in s.categories):
        raise ValueError(f"{where}: 'categories' must be a list of non-empty strings; got {s.categories!r}")
    if s.task_name == "gui":
        if not (isinstance(s.gt, list) and len(s.gt) == 4):
            raise ValueError(f"{where}: a gui sample's 'gt' is one box [x1, y1, x2, y2]; got {s.gt!r}")
    elif not isinstance(s.gt, dict):
        raise ValueError(f"{where}: 'gt' must be an object {{category: [...]}}; got {type(s.gt).__name__}")
    if not s.categories and not is_ocr(s.task_name):
        raise ValueError(f"{where}: task {s.task_name!r} needs at least one category")


def jsonl_benchmark(
    name: str, entries: Iterable[tuple[int, object]], where: Path | str, root: Path | None, images=None
) -> Benchmark:
    """A benchmark from the evaluation JSONL's (line number, entry) pairs."""
    samples = []
    for number, entry in entries:
        missing = [k for k in JSONL_FIELDS if k not in entry]
        if missing:
            raise ValueError(f"{where}:{number} lacks {', '.join(missing)} (the evaluation JSONL's fields)")
        s = BenchSample(
            len(samples),
            entry["image_path"],
            entry["categories"],
            entry["gt"],
            entry["task_name"],
            entry["dataset_name"],
            {k: entry[k] for k in GUI_FIELDS if k in entry},
        )
        _check_sample(f"{where}:{number}", s)
        samples.append(s)
    return _benchmark(name, "jsonl", where, root, samples, images=images)


def is_lvis(coco: dict) -> bool:
    return any("neg_category_ids" in img for img in coco["images"])


def coco_boxes(coco: dict) -> dict[int, list[tuple[int, list[float], bool]]]:
    """Annotations by image id: (category id, [x1, y1, x2, y2], crowd)."""
    out: dict[int, list] = defaultdict(list)
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        out[a["image_id"]].append((a["category_id"], [x, y, x + w, y + h], bool(a.get("iscrowd", 0))))
    return out


def coco_benchmark(name: str, coco: dict, where: Path | str, root: Path | None, images=None) -> Benchmark:
    """A benchmark from a COCO instances JSON: one detection sample per image with objects."""
    names = {c["id"]: c["name"] for c in coco.get("categories", [])}
    task_name = COCO_TASKS[1] if is_lvis(coco) else COCO_TASKS[0]
    boxes = coco_boxes(coco)
    samples = []
    for img in sorted(coco["images"], key=lambda i: i["id"]):
        if "file_name" not in img:
            raise ValueError(f"{where}: image {img.get('id')} has no file_name")
        gt: dict[str, list] = {}
        for cat, box, crowd in sorted(boxes.get(img["id"], []), key=lambda a: a[0]):
            if cat not in names:
                raise ValueError(f"{where}: an annotation of image {img['id']} has unknown category_id {cat}")
            if not crowd:
                gt.setdefault(names[cat], []).append(box)
        if gt:  # images without objects have nothing to ask for
            samples.append(BenchSample(len(samples), img["file_name"], list(gt), gt, task_name, name))
    return _benchmark(name, "coco", where, root, samples, coco, images)


def screenspot_benchmark(
    name: str, files: list[tuple[Path | str, object]], where: Path | str, root: Path | None, images=None
) -> Benchmark:
    """A benchmark from ScreenSpot-Pro annotation lists, given as (file, its JSON value) pairs."""
    samples = []
    for file, items in files:
        if not isinstance(items, list):
            raise ValueError(f"{file}: ScreenSpot-Pro annotations are a JSON list of objects")
        for number, item in enumerate(items):
            missing = [k for k in ("img_filename", "bbox", "instruction") if k not in item]
            if missing:
                raise ValueError(f"{file} item {number} lacks {', '.join(missing)}")
            fields = {k: item[k] for k in GUI_FIELDS if k in item}
            s = BenchSample(
                len(samples), item["img_filename"], [item["instruction"]], list(item["bbox"]), "gui", name, fields
            )
            _check_sample(f"{file} item {number}", s)
            samples.append(s)
    return _benchmark(name, "screenspot", where, root, samples, images=images)


# --- Answer files -----------------------------------------------------------------------------------------


ANSWERS_OF = "mlx-locate-eval answers"
ANSWER_START = b'{"sample_index": '  # how every answer line begins (json.dumps keeps the key order)


def resume_lines(path: Path, bench: Benchmark, settings: dict) -> tuple[set[int], int]:
    """Sample indexes already answered in `path`, and how many of its lines do not record every setting
    (`jsonl.check_settings`; an earlier version's, taken as made with `settings`). A line that answers another
    sample (its image, task, categories or ground truth differ) or was made with other settings raises
    `ValueError`; once the complete lines are checked, a last line cut by an interruption is cut off the file."""
    if not path.exists():
        return set(), 0
    done, unrecorded = set(), 0
    hint = "; use another --out, or pass --overwrite to answer again"
    text, tail = jsonl.complete_text(path, ANSWERS_OF)
    for number, entry in jsonl.values(text, path, jsonl.RESUME_HINT):
        i = entry.get("sample_index") if isinstance(entry, dict) else None
        s = bench.samples[i] if isinstance(i, int) and 0 <= i < len(bench.samples) else None
        if s is None or jsonl.plain([s.image_path, s.task_name, s.dataset_name, s.categories, s.answer_gt()]) != [
            entry.get(k) for k in ("image_path", "task_name", "dataset_name", "categories", "gt")
        ]:
            raise ValueError(f"{path}:{number} is not an answer to {bench.name} (sample {i}){hint}")
        recorded = entry.get("settings", {})
        unrecorded += bool(jsonl.check_settings(path, recorded if isinstance(recorded, dict) else {}, settings, hint))
        done.add(i)
    jsonl.cut_unfinished(path, tail, (ANSWER_START,), ANSWERS_OF)
    return done, unrecorded


def read_answers(path: str | Path) -> list[dict]:
    """The lines of an answer file (ours or another tool's); an unfinished last line is left out."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no answer file {path}")
    text = path.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        head, _, last = text.rpartition("\n")
        try:
            json.loads(last)
        except json.JSONDecodeError:
            text = head  # cut by an interruption
    out = []
    for number, entry in jsonl.values(text, path):
        missing = [k for k in ANSWER_FIELDS if k not in entry]
        if missing:
            raise ValueError(f"{path}:{number} lacks {', '.join(missing)} (the answer file's fields)")
        if not isinstance(entry["extracted_predictions"], dict):
            raise ValueError(f"{path}:{number}: 'extracted_predictions' must be an object {{category: [...]}}")
        out.append(entry)
    if not out:
        raise ValueError(f"{path} holds no answer")
    return out


def clean_predictions(preds: dict) -> tuple[dict[str, list[list[float]]], int]:
    """Predictions with only [x1, y1, x2, y2] or [x, y] entries of numbers; None answers dropped (as the paper
    does); returns them and the number of other malformed entries dropped."""
    out, malformed = {}, 0
    for category, coords in preds.items():
        kept = []
        for c in coords if isinstance(coords, list) else []:
            if c is None or c == "None":
                continue
            if isinstance(c, list) and len(c) in (2, 4) and all(isinstance(v, int | float) for v in c):
                kept.append([float(v) for v in c])
            else:
                malformed += 1
        out[str(category)] = kept
    return out, malformed


def decode_regions(gt: dict) -> dict[str, list]:
    """Pointing GT: RLE masks (`{"counts", "size"}`) decoded to arrays; boxes stay boxes."""
    gt = gt.get("gt_mask", gt)
    out = {}
    for category, regions in gt.items():
        decoded = []
        for r in regions:
            if isinstance(r, dict):
                mask = extra("faster_coco_eval.core.mask", "decoding RLE masks")
                decoded.append(mask.decode({"size": r["size"], "counts": r["counts"]}))
            else:
                decoded.append(r)
        out[category] = decoded
    return out


def answers_coco(lines: list[dict], coco: dict) -> bool:
    """Whether answer lines (of another run) answer `coco`: every image with objects once, each line's GT
    categories its image's."""
    names = {c["id"]: c["name"].lower().replace("_", " ") for c in coco["categories"]}
    by_file = {os.path.basename(img["file_name"]): img["id"] for img in coco["images"]}
    positive = defaultdict(set)
    for img_id, anns in coco_boxes(coco).items():
        positive[img_id] |= {names[cat] for cat, _, crowd in anns if not crowd}
    seen = []
    for ln in lines:
        img_id = by_file.get(os.path.basename(ln.get("image_path", "")))
        asked = {k.lower().replace("_", " ") for k, v in ln["gt"].items() if v} if isinstance(ln["gt"], dict) else None
        if img_id is None or asked != positive[img_id]:
            return False
        seen.append(img_id)
    return sorted(seen) == sorted(i for i, cats in positive.items() if cats)
