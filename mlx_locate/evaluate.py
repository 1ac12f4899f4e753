"""`mlx-locate-eval`: the LocateAnything paper's metrics on the paper's benchmark formats.

    mlx-locate-eval --export bench --n 100                    # a synthetic benchmark in each input format
    mlx-locate-eval --data bench/synthetic.jsonl --modes slow fast hybrid --out runs/demo
    mlx-locate-eval --predictions runs/demo/synthetic_fast.jsonl   # score an answer file; no model is loaded
    mlx-locate-eval --compare runs/bf16/report.json runs/q4/report.json

`python -m mlx_locate.evaluate` runs the same `main`. Inputs (`--data`, repeatable; images are found under
`--images`, by default the data file's folder):

- the LocateAnything / Rex-Omni evaluation JSONL: one sample per line with `image_path`, `categories`, `gt`
  (`{category: [[x1, y1, x2, y2], ...]}` in pixels; pointing: `{category: [RLE mask, ...]}`, also under
  `gt_mask`), `task_name`, `dataset_name`;
- a COCO instances JSON (LVIS too): one detection sample per image with annotations, its categories asked in
  one prompt; scored on the paper's COCO path plus COCO mAP (faster-coco-eval);
- ScreenSpot-Pro annotations (a JSON list, or a folder of them): `img_filename`, `bbox` [x1, y1, x2, y2],
  `instruction`, `ui_type`, `application`, `group`, `platform`.

Prompts are the paper's: detection asks all of a sample's categories in one `</c>` prompt, referring one
phrase (single-instance template for RefCOCO*), pointing `Point to: {category}.` once per category, OCR the
OCR prompt, GUI a point per instruction (`--gui-task gui` asks for a box). Predictions go through the engine,
in every `--modes` mode, to `OUT/<data>_<mode>.jsonl` in the answer format the paper's scripts read
(`image_path`, `question`, `raw_response`, `extracted_predictions` in original pixels, `gt`, `task_name`,
`dataset_name`; plus `scores` (confidences) and `stats` (mode, forward passes, objects, wall seconds)). A line
is written and fsynced when its sample is done; an existing answer file is continued, its samples skipped. A
sample whose request fails (an unreadable image) gets an `error` line, counted and left out of the scores, as
the paper's scripts skip such images; delete the line to retry it.

The report (printed; with `--out` also `report.json`, `report.md` and `f1_vs_iou.png`) has one row per
dataset (`task_dataset`, the paper's key) and mode. See `mlx_locate.metrics` for every rule.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import cli, jsonl, metrics
from .decide import Mode
from .engine import EventKind
from .prompts import CATEGORY_SEPARATOR, task_text
from .request import Request, RequestError
from .sampling import Sampling

DEFAULT_MAX_TOKENS = 4096  # the paper's evaluation budget; clipped to what the model's context holds
MODES = tuple(m.value for m in Mode)
# "greedy" is the product default (with its guards); "official" samples as the model card and evaluation do.
SAMPLINGS = {"greedy": Sampling(), "nucleus": Sampling(top_p=0.9), "official": Sampling.OFFICIAL}
FORMATS = ("auto", "jsonl", "coco", "screenspot")
POINT_TASKS = ("pointing", "pointing_referring")
COCO_TASKS = ("common_object_detection", "long_tailed_object_detection")  # scored on the COCO path too
SINGLE_INSTANCE_PREFIX = "refcoco"  # datasets asked with the single-instance template
REPORT_FILES = ("report.json", "report.md", "f1_vs_iou.png")
GUI_FIELDS = ("id", "ui_type", "application", "group", "platform")
CONSTANT_SCORE = 0.2  # the paper's score for every box on the COCO path


def _extra(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f'{what} needs the eval extra: pip install "mlx-locate[eval]"') from None


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


@dataclass(frozen=True)
class Benchmark:
    name: str  # names the answer files
    kind: str  # jsonl, coco or screenspot
    image_root: Path
    samples: list[BenchSample]
    coco: dict | None = None  # the instances JSON, for the COCO path


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


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None


def load_benchmark(path: str | Path, images: str | Path | None = None, fmt: str = "auto") -> Benchmark:
    """Read a benchmark in any of the three input formats; `images` is the root of its image paths."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no benchmark file or folder {path}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    root = Path(images) if images is not None else (path if path.is_dir() else path.parent)
    loader = {"jsonl": _load_jsonl, "coco": _load_coco, "screenspot": _load_screenspot}[fmt]
    samples, coco = loader(path)
    if not samples:
        raise ValueError(f"{path} holds no sample to evaluate")
    return Benchmark(path.stem, fmt, root, samples, coco)


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


def _load_jsonl(path: Path) -> tuple[list[BenchSample], None]:
    samples = []
    for number, entry in jsonl.values(path.read_text(encoding="utf-8"), path):
        missing = [k for k in ("image_path", "categories", "gt", "task_name", "dataset_name") if k not in entry]
        if missing:
            raise ValueError(f"{path}:{number} lacks {', '.join(missing)} (the evaluation JSONL's fields)")
        s = BenchSample(
            len(samples),
            entry["image_path"],
            entry["categories"],
            entry["gt"],
            entry["task_name"],
            entry["dataset_name"],
            {k: entry[k] for k in GUI_FIELDS if k in entry},
        )
        _check_sample(f"{path}:{number}", s)
        samples.append(s)
    return samples, None


def is_lvis(coco: dict) -> bool:
    return any("neg_category_ids" in img for img in coco["images"])


def coco_boxes(coco: dict) -> dict[int, list[tuple[int, list[float], bool]]]:
    """Annotations by image id: (category id, [x1, y1, x2, y2], crowd)."""
    out: dict[int, list] = defaultdict(list)
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        out[a["image_id"]].append((a["category_id"], [x, y, x + w, y + h], bool(a.get("iscrowd", 0))))
    return out


def _load_coco(path: Path) -> tuple[list[BenchSample], dict]:
    coco = read_json(path)
    names = {c["id"]: c["name"] for c in coco.get("categories", [])}
    task_name = COCO_TASKS[1] if is_lvis(coco) else COCO_TASKS[0]
    boxes = coco_boxes(coco)
    samples = []
    for img in sorted(coco["images"], key=lambda i: i["id"]):
        if "file_name" not in img:
            raise ValueError(f"{path}: image {img.get('id')} has no file_name")
        gt: dict[str, list] = {}
        for cat, box, crowd in sorted(boxes.get(img["id"], []), key=lambda a: a[0]):
            if cat not in names:
                raise ValueError(f"{path}: an annotation of image {img['id']} has unknown category_id {cat}")
            if not crowd:
                gt.setdefault(names[cat], []).append(box)
        if gt:  # images without objects have nothing to ask for
            samples.append(BenchSample(len(samples), img["file_name"], list(gt), gt, task_name, path.stem))
    return samples, coco


def _load_screenspot(path: Path) -> tuple[list[BenchSample], None]:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no ScreenSpot-Pro annotation files (*.json) in {path}")
    samples = []
    for file in files:
        items = read_json(file)
        if not isinstance(items, list):
            raise ValueError(f"{file}: ScreenSpot-Pro annotations are a JSON list of objects")
        for number, item in enumerate(items):
            missing = [k for k in ("img_filename", "bbox", "instruction") if k not in item]
            if missing:
                raise ValueError(f"{file} item {number} lacks {', '.join(missing)}")
            fields = {k: item[k] for k in GUI_FIELDS if k in item}
            s = BenchSample(
                len(samples), item["img_filename"], [item["instruction"]], list(item["bbox"]), "gui", path.stem, fields
            )
            _check_sample(f"{file} item {number}", s)
            samples.append(s)
    return samples, None


# --- Prompts ----------------------------------------------------------------------------------------------


def is_ocr(task_name: str) -> bool:
    return "ocr" in task_name or "text" in task_name


@dataclass(frozen=True)
class Query:
    task: str  # prompts.TASKS
    query: str | None
    key: str | None  # the category its objects are filed under; None: their own <ref> label


def queries(sample: BenchSample, gui_task: str = "point") -> list[Query]:
    """The requests the paper's evaluation asks for one sample."""
    t, cats = sample.task_name, sample.categories
    if t in POINT_TASKS:
        return [Query("point", c, c) for c in cats]
    if t == "gui":
        return [Query(gui_task, cats[0], cats[0])]
    if t == "referring_object_detection":
        task = "single" if sample.dataset_name.lower().startswith(SINGLE_INSTANCE_PREFIX) else "refer"
        return [Query(task, c, c) for c in cats]
    if is_ocr(t):
        return [Query("ocr", None, None)]
    # Detection, hallucination, ...: every category in one prompt (one string: a list would be many requests).
    return [Query("detect", CATEGORY_SEPARATOR.join(cats), None)]


# --- Predictions ------------------------------------------------------------------------------------------


def answer_line(sample: BenchSample, asked: list[Query], outcomes: list, mode: str, wall_s: float) -> dict:
    """The answer-file line of one sample from its requests' results (or `RequestError`s)."""
    preds: dict[str, list] = {}
    scores: dict[str, list] = {}
    texts, errors, passes, objects = [], [], 0, 0
    for q, r in zip(asked, outcomes, strict=True):
        if isinstance(r, RequestError):
            errors.append(str(r))
            continue
        texts.append(r.text)
        passes += r.stats["steps"]
        objects += len(r.objects)
        for o in r.objects:
            key = q.key if q.key is not None else (o.label or "")
            preds.setdefault(key, []).append(list(o.box if o.box is not None else o.point))
            scores.setdefault(key, []).append(o.confidence)
    gt = sample.gt["gt_mask"] if isinstance(sample.gt, dict) and "gt_mask" in sample.gt else sample.gt
    line = {
        "sample_index": sample.index,
        "image_path": sample.image_path,
        "question": "\n".join(task_text(q.task, q.query) for q in asked),
        "raw_response": "\n".join(texts),
        "extracted_predictions": preds,
        "gt": gt,
        "task_name": sample.task_name,
        "dataset_name": sample.dataset_name,
        "categories": sample.categories,
        **sample.fields,
        "scores": scores,
        "stats": {"mode": mode, "forward_passes": passes, "objects": objects, "wall_s": wall_s},
    }
    if errors:
        line["error"] = "; ".join(errors)
    return line


def resume_lines(path: Path, bench: Benchmark) -> set[int]:
    """Sample indexes already answered in `path`; a last line cut by an interruption is cut off the file."""
    if not path.exists():
        return set()
    done = set()
    for number, entry in jsonl.values(jsonl.whole_lines(path), path, jsonl.RESUME_HINT):
        i = entry.get("sample_index") if isinstance(entry, dict) else None
        s = bench.samples[i] if isinstance(i, int) and 0 <= i < len(bench.samples) else None
        if s is None or (s.image_path, s.task_name, s.dataset_name, s.categories) != tuple(
            entry.get(k) for k in ("image_path", "task_name", "dataset_name", "categories")
        ):
            raise ValueError(f"{path}:{number} is not an answer to {bench.name} (sample {i}); use another --out")
        done.add(i)
    return done


@dataclass(frozen=True)
class RunOptions:
    mode: str = "hybrid"
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    rendering: str = "A"
    max_rows: int | None = None
    gui_task: str = "point"
    limit: int | None = None


def predict(model, bench: Benchmark, path: Path, options: RunOptions, progress: bool = False) -> int:
    """Answer every sample of `bench` not yet in `path` (appended, one fsynced line per sample).

    Returns the number of samples answered now. Requests go through one engine, all submitted at once."""
    from tqdm import tqdm

    samples = bench.samples[: options.limit]
    done = resume_lines(path, bench)
    todo = [s for s in samples if s.index not in done]
    engine = model.engine(options.max_rows)
    asked = {s.index: queries(s, options.gui_task) for s in todo}
    outcomes: dict[int, list] = {i: [None] * len(q) for i, q in asked.items()}
    for s in todo:
        for k, q in enumerate(asked[s.index]):
            request = Request(
                bench.image_root / s.image_path,
                q.query,
                task=q.task,
                mode=options.mode,
                max_tokens=options.max_tokens,
                sampling=options.sampling,
                rendering=options.rendering,
                tag=(s.index, k),
            )
            engine.submit(request)
    total = len(samples)
    with (
        path.open("a", encoding="utf-8") as f,
        tqdm(total=total, initial=total - len(todo), disable=not progress, unit="sample") as bar,
    ):
        bar.set_description(f"{bench.name} {options.mode}")
        last = time.perf_counter()
        while not engine.idle:
            for event in engine.step():
                if event.kind not in (EventKind.DONE, EventKind.ERROR):
                    continue
                i, k = event.handle.request.tag
                outcomes[i][k] = event.result if event.kind == EventKind.DONE else event.error
                if any(o is None for o in outcomes[i]):
                    continue
                now = time.perf_counter()
                line = answer_line(bench.samples[i], asked[i], outcomes.pop(i), options.mode, now - last)
                last = now
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())
                bar.update()
    return len(todo)


# --- Answer files -----------------------------------------------------------------------------------------


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
        missing = [k for k in ("extracted_predictions", "gt", "task_name", "dataset_name") if k not in entry]
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
                mask = _extra("faster_coco_eval.core.mask", "decoding RLE masks")
                decoded.append(mask.decode({"size": r["size"], "counts": r["counts"]}))
            else:
                decoded.append(r)
        out[category] = decoded
    return out


# --- Scoring ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One dataset (the paper's `task_dataset` key) in one mode."""

    dataset: str
    task_name: str
    mode: str
    samples: int
    metric: str  # "box" (per-sample F1), "coco" (the COCO path), "pointing", "gui", "hallucination", "unscored"
    f1_50: float | None = None
    f1_95: float | None = None
    f1_mean: float | None = None
    f1: dict[str, float] | None = None  # by IoU threshold
    precision: dict[str, float] | None = None
    recall: dict[str, float] | None = None
    pointing: dict | None = None  # precision, recall, f1
    accuracy: float | None = None  # GUI or hallucination
    map: float | None = None  # COCO mAP@0.5:0.95 (faster-coco-eval)
    map50: float | None = None
    breakdown: dict = field(default_factory=dict)  # by_size, by_gt_count (F1@0.5); GUI: by_type, by_source, by_group
    empty_scored_zero: int = 0  # samples with categories but no GT box and no prediction: scored 0 (paper)
    without_empty: dict | None = None  # F1@0.5 and F1@mean with those samples left out
    sample_f1: dict | None = None  # COCO rows: the per-sample path's F1@0.5, F1@0.95, F1@mean
    errors: int = 0  # lines whose requests failed (left out, as the paper's scripts skip such images)
    malformed: int = 0  # prediction entries that were neither a box nor a point
    boxes_per_s: float | None = None
    passes_per_box: float | None = None
    s_per_image: float | None = None
    note: str | None = None


def _mean_dict(m: metrics.Mean) -> dict:
    return {"precision": m.precision, "recall": m.recall, "f1": m.f1, "samples": m.samples}


def _box_inputs(line: dict, preds: dict) -> tuple[dict, dict]:
    """GT and predictions as the box rules see them (referring pools every category)."""
    gt = {k.lower(): v for k, v in line["gt"].items()}
    pred = {k.lower(): v for k, v in preds.items()}
    if line["task_name"] == "referring_object_detection":
        return {"": [b for v in gt.values() for b in v]}, {"": [b for v in pred.values() for b in v]}
    return metrics.normalize_keys(gt, line["task_name"]), metrics.normalize_keys(pred, line["task_name"])


def _box_metrics(row: Row, lines: list[dict], preds: list[dict]) -> None:
    thresholds = metrics.IOU_THRESHOLDS
    per_t = {
        t: [metrics.sample_score(ln["task_name"], ln["gt"], p, t) for ln, p in zip(lines, preds, strict=True)]
        for t in thresholds
    }
    means = {t: metrics.mean_score(per_t[t]) for t in thresholds}
    row.f1 = {str(t): means[t].f1 for t in thresholds}
    row.precision = {str(t): means[t].precision for t in thresholds}
    row.recall = {str(t): means[t].recall for t in thresholds}
    row.f1_50, row.f1_95 = means[0.5].f1, means[0.95].f1
    row.f1_mean = float(np.mean([means[t].f1 for t in thresholds]))
    if row.task_name != "referring_object_detection":
        empty = [bool(ln["gt"]) and s.empty for ln, s in zip(lines, per_t[0.5], strict=True)]
        row.empty_scored_zero = sum(empty)
        if row.empty_scored_zero:
            kept = {t: metrics.mean_score(s for s, e in zip(per_t[t], empty, strict=True) if not e) for t in thresholds}
            row.without_empty = {
                "f1@0.5": kept[0.5].f1,
                "f1@mean": float(np.mean([kept[t].f1 for t in thresholds])),
                "samples": kept[0.5].samples,
            }
    sizes: dict[str, list] = defaultdict(list)
    counts: dict[str, list] = defaultdict(list)
    for ln, p, s in zip(lines, preds, per_t[0.5], strict=True):
        gt, pred = _box_inputs(ln, p)
        for bucket, score in metrics.size_scores(gt, pred, 0.5).items():
            if not score.empty:
                sizes[bucket].append(score)
        counts[metrics.gt_count_range(s.gt)].append(s)
    row.breakdown["by_size"] = {b: _mean_dict(metrics.mean_score(v)) for b, v in sizes.items()}
    row.breakdown["by_gt_count"] = {
        name: _mean_dict(metrics.mean_score(counts[name])) for _, name in metrics.GT_COUNT_RANGES if name in counts
    }


def coco_inputs(coco: dict, lines: list[dict]) -> tuple[dict, list[dict], list[int]]:
    """Per category id, the (GT, detections) of every answered image in image order, the detections as COCO
    results, and the answered image ids. As the paper converts answers: image by file name, category by
    lowercase name with '_' as space, boxes only (points dropped), only the categories an image has GT of."""
    by_name = {c["name"].lower().replace("_", " "): c["id"] for c in coco["categories"]}
    by_file = {os.path.basename(img["file_name"]): img["id"] for img in coco["images"]}
    gts: dict[tuple[int, int], list[metrics.CocoGt]] = defaultdict(list)
    for img_id, anns in coco_boxes(coco).items():
        for cat, box, crowd in anns:
            gts[(img_id, cat)].append(metrics.CocoGt(box, crowd))
    positive = defaultdict(set)
    for img_id, cat in gts:
        positive[img_id].add(cat)
    dets: dict[tuple[int, int], list] = defaultdict(list)
    results, answered = [], set()
    for line in lines:
        name = os.path.basename(line.get("image_path", ""))
        if name not in by_file:
            raise ValueError(f"answer image {line.get('image_path')!r} is not among the COCO file's images")
        img_id = by_file[name]
        answered.add(img_id)
        preds, _ = clean_predictions(line["extracted_predictions"])
        confidences = line.get("scores", {})
        for category, coords in preds.items():
            cat = by_name.get(category.lower().replace("_", " "))
            if cat is None or (img_id in positive and cat not in positive[img_id]):
                continue
            conf = confidences.get(category)
            if not isinstance(conf, list) or len(conf) != len(coords):  # no confidences: the constant score ranks
                conf = [None] * len(coords)
            for box, c in zip(coords, conf, strict=True):
                if len(box) != 4:
                    continue
                dets[(img_id, cat)].append(box)
                x1, y1, x2, y2 = box
                results.append({"image_id": img_id, "category_id": cat, "bbox": [x1, y1, x2 - x1, y2 - y1], "score": c})
    per_category: dict[int, list] = defaultdict(list)
    for img_id in sorted(answered):
        for cat in sorted({c for i, c in (*gts, *dets) if i == img_id}):
            per_category[cat].append((gts.get((img_id, cat), []), dets.get((img_id, cat), [])))
    return per_category, results, sorted(answered)


def coco_pr(per_category: dict) -> dict[int, dict[float, metrics.CocoPR]]:
    out = {}
    for cat, images in per_category.items():
        pr = {t: metrics.coco_category_pr(images, t) for t in metrics.IOU_THRESHOLDS}
        if pr[0.5] is not None:
            out[cat] = pr
    return out


def coco_map(coco: dict, results: list[dict], image_ids: list[int]) -> tuple[float, float]:
    """COCO mAP@0.5:0.95 and mAP@0.5 over `image_ids` from faster-coco-eval (LVIS rules for an LVIS file);
    confidences rank the boxes where every box has one, else the constant score."""
    if not results:
        return 0.0, 0.0
    fce = _extra("faster_coco_eval", "COCO mAP")
    if any(r["score"] is None for r in results):
        results = [{**r, "score": CONSTANT_SCORE} for r in results]
    gt = fce.COCO(coco, use_deepcopy=True)
    ev = fce.COCOeval_faster(
        gt, gt.loadRes(results), iouType="bbox", lvis_style=is_lvis(coco), print_function=lambda *a: None
    )
    ev.params.imgIds = image_ids
    ev.run()
    return float(ev.stats[0]), float(ev.stats[1])


def _coco_metrics(row: Row, coco: dict, lines: list[dict]) -> None:
    per_category, results, image_ids = coco_inputs(coco, lines)
    path = metrics.coco_path(coco_pr(per_category))
    row.sample_f1 = {"f1@0.5": row.f1_50, "f1@0.95": row.f1_95, "f1@mean": row.f1_mean}
    row.metric = "coco"
    row.f1 = {str(t): v for t, v in path.f1.items()}
    row.precision = {str(t): v for t, v in path.precision.items()}
    row.recall = {str(t): v for t, v in path.recall.items()}
    row.f1_50, row.f1_95, row.f1_mean = path.f1[0.5], path.f1[0.95], path.f1_mean
    row.map, row.map50 = coco_map(coco, results, image_ids)
    row.breakdown["coco_categories"] = {"with_gt": path.categories, "counted_at_0.5": path.categories_counted[0.5]}


def _timing(row: Row, lines: list[dict]) -> None:
    stats = [ln.get("stats") for ln in lines]
    if not stats or not all(isinstance(s, dict) and "wall_s" in s for s in stats):
        return
    wall = sum(s["wall_s"] for s in stats)
    objects = sum(s["objects"] for s in stats)
    row.s_per_image = wall / len(stats)
    row.boxes_per_s = objects / wall if wall > 0 else None
    row.passes_per_box = sum(s["forward_passes"] for s in stats) / objects if objects else None


def _gui_breakdown(lines: list[dict], correct: list[float]) -> dict:
    out = {}
    for name, key in (("by_type", "ui_type"), ("by_source", "application"), ("by_group", "group")):
        groups: dict[str, list] = defaultdict(list)
        for ln, c in zip(lines, correct, strict=True):
            if key in ln:
                groups[str(ln[key])].append(c)
        if groups:
            out[name] = {k: {"accuracy": float(np.mean(v)), "samples": len(v)} for k, v in sorted(groups.items())}
    return out


def score_lines(lines: list[dict], mode: str, coco: dict | None = None) -> list[Row]:
    """One row per `task_dataset` of the answer lines, sorted by name (lines are written as they finish)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for ln in lines:
        groups.setdefault((ln["task_name"], ln["dataset_name"]), []).append(ln)
    rows = []
    for (task, dataset), group in sorted(groups.items()):
        scored = [ln for ln in group if "error" not in ln]
        row = Row(f"{task}_{dataset}", task, mode, len(scored), "box", errors=len(group) - len(scored))
        cleaned = [clean_predictions(ln["extracted_predictions"]) for ln in scored]
        preds = [p for p, _ in cleaned]
        row.malformed = sum(m for _, m in cleaned)
        _timing(row, scored)
        if task in metrics.UNSUPPORTED_TASKS:
            row.metric, row.note = "unscored", f"task {task!r} needs a keypoint or polygon metric; not scored"
        elif task == "gui" or task == "hallucination":
            correct = [
                metrics.sample_score(task, ln["gt"], p, 0.5).precision for ln, p in zip(scored, preds, strict=True)
            ]
            row.metric, row.accuracy = task, float(np.mean(correct)) if correct else 0.0
            if task == "gui":
                row.breakdown = _gui_breakdown(scored, correct)
        elif task in POINT_TASKS:
            regions = [decode_regions(ln["gt"]) for ln in scored]
            m = metrics.mean_score(metrics.sample_score(task, g, p, 0.5) for g, p in zip(regions, preds, strict=True))
            row.metric, row.pointing = "pointing", _mean_dict(m)
        else:
            _box_metrics(row, scored, preds)
            if coco is not None and task in COCO_TASKS:
                _coco_metrics(row, coco, scored)
        rows.append(row)
    return rows


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


# --- Report -----------------------------------------------------------------------------------------------

COLUMNS = (  # header, Row attribute, format
    ("F1@0.5", "f1_50", ".3f"),
    ("F1@0.95", "f1_95", ".3f"),
    ("F1@mean", "f1_mean", ".3f"),
    ("point F1", "point_f1", ".3f"),
    ("GUI acc", "gui_acc", ".3f"),
    ("mAP", "map", ".3f"),
    ("boxes/s", "boxes_per_s", ".1f"),
    ("passes/box", "passes_per_box", ".2f"),
    ("s/image", "s_per_image", ".3f"),
)


def _cell(row: dict, key: str) -> float | None:
    if key == "point_f1":
        return (row.get("pointing") or {}).get("f1")
    if key == "gui_acc":
        return row.get("accuracy") if row.get("metric") in ("gui", "hallucination") else None
    return row.get(key)


def markdown_table(rows: list[dict]) -> str:
    head = ["dataset", "mode", "n", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        cells = [r["dataset"] + (" (COCO path)" if r["metric"] == "coco" else ""), r["mode"], str(r["samples"])]
        for _, key, fmt in COLUMNS:
            v = _cell(r, key)
            cells.append("-" if v is None else format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
        where = f"{r['dataset']} ({r['mode']})"
        if r["empty_scored_zero"]:
            w = r["without_empty"]
            notes.append(
                f"{where}: {r['empty_scored_zero']} samples asked for categories with no GT box and got no box: "
                f"scored 0 as the paper does (without them F1@0.5 {w['f1@0.5']:.3f}, F1@mean {w['f1@mean']:.3f})"
            )
        if r["errors"]:
            notes.append(f"{where}: {r['errors']} samples failed (unreadable image or prompt) and are left out")
        if r["malformed"]:
            notes.append(f"{where}: {r['malformed']} malformed prediction entries dropped")
        if r.get("note"):
            notes.append(f"{where}: {r['note']}")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def breakdown_table(rows: list[dict]) -> str:
    """F1@0.5 by object size and by GT count (box rows), GUI accuracy by data type and source."""
    sizes = [name for name, _ in metrics.SIZE_LIMITS]
    counts = [name for _, name in metrics.GT_COUNT_RANGES]
    head = ["dataset", "mode", *sizes, *(f"{c} GT" for c in counts)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    gui = []
    for r in rows:
        b = r["breakdown"]
        if "by_size" in b:
            cells = [b[key].get(name) for key, names in (("by_size", sizes), ("by_gt_count", counts)) for name in names]
            text = ["-" if c is None else f"{c['f1']:.3f} ({c['samples']})" for c in cells]
            lines.append("| " + " | ".join([r["dataset"], r["mode"], *text]) + " |")
        for key in ("by_type", "by_source"):
            if key in b:
                parts = ", ".join(f"{k} {v['accuracy']:.3f} ({v['samples']})" for k, v in b[key].items())
                gui.append(f"- {r['dataset']} ({r['mode']}), accuracy {key.replace('_', ' ')}: {parts}")
    out = (
        "F1@0.5 by object size and by GT count (samples in brackets):\n\n" + "\n".join(lines) if len(lines) > 2 else ""
    )
    return "\n\n".join(part for part in (out, "\n".join(gui)) if part)


def report_text(rows: list[dict]) -> str:
    """The printed report and report.md: the main table, then the breakdowns."""
    return "\n\n".join(part for part in (markdown_table(rows), breakdown_table(rows)) if part)


def plot_f1(rows: list[dict], path: Path) -> None:
    """F1 against the IoU threshold, one panel per dataset and one line per mode."""
    matplotlib = _extra("matplotlib", "the F1 plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows if r["f1"]))
    if not datasets:
        return
    cols = min(3, len(datasets))
    n_rows = (len(datasets) + cols - 1) // cols
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.5 * cols, 3.4 * n_rows), squeeze=False)
    for ax, name in zip(axes.flat, datasets, strict=False):
        for r in rows:
            if r["dataset"] == name and r["f1"]:
                ax.plot([float(t) for t in r["f1"]], list(r["f1"].values()), marker="o", label=r["mode"])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("IoU threshold")
        ax.set_ylabel("F1")
        ax.set_ylim(max(0.0, min(min(r["f1"].values()) for r in rows if r["dataset"] == name and r["f1"]) - 0.1), 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(datasets) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_reports(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Every row present in both reports, each column as A, B and B - A."""
    index_b = {(r["dataset"], r["mode"]): r for r in b["rows"]}
    lines = [f"| dataset | mode | metric | {names[0]} | {names[1]} | difference |", "|---|---|---|---|---|---|"]
    only_a = []
    for ra in a["rows"]:
        rb = index_b.pop((ra["dataset"], ra["mode"]), None)
        if rb is None:
            only_a.append(f"{ra['dataset']} ({ra['mode']})")
            continue
        for header, key, fmt in COLUMNS:
            va, vb = _cell(ra, key), _cell(rb, key)
            if va is None and vb is None:
                continue
            diff = "-" if va is None or vb is None else format(vb - va, "+" + fmt)
            cells = ["-" if v is None else format(v, fmt) for v in (va, vb)]
            lines.append(f"| {ra['dataset']} | {ra['mode']} | {header} | {cells[0]} | {cells[1]} | {diff} |")
    for label, missing in ((names[0], only_a), (names[1], [f"{d} ({m})" for d, m in index_b])):
        if missing:
            lines.append(f"\nonly in {label}: {', '.join(missing)}")
    return "\n".join(lines)


def check_report_free(folder: Path, overwrite: bool) -> None:
    existing = [name for name in REPORT_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ValueError(f"{folder} already has {', '.join(existing)}; pass --overwrite to replace them")


def write_report(folder: Path, report: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(report_text(report["rows"]) + "\n")
    plot_f1(report["rows"], folder / "f1_vs_iou.png")


# --- The synthetic benchmark ------------------------------------------------------------------------------

MASK_COLOR_DISTANCE = 60  # a shape's pixels are within this of its base colour (jitter is at most 18 a channel)


def _mask(scene, obj) -> np.ndarray:
    from .tuner.synthetic import COLORS

    pixels = np.asarray(scene.image, dtype=np.float32)
    x1, y1, x2, y2 = obj.box
    mask = np.zeros(pixels.shape[:2], dtype=np.uint8)
    crop = pixels[y1:y2, x1:x2]
    mask[y1:y2, x1:x2] = np.linalg.norm(crop - np.array(COLORS[obj.color]), axis=-1) < MASK_COLOR_DISTANCE
    return mask


def _rle(mask: np.ndarray) -> dict:
    mask_api = _extra("faster_coco_eval.core.mask", "exporting RLE masks")
    rle = mask_api.encode(np.asfortranarray(mask))
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}


EXPORT_FILES = ("synthetic.jsonl", "synthetic_coco.json", "synthetic_screenspot.json")


def export_benchmark(folder: str | Path, n: int, seed: int = 0, overwrite: bool = False) -> dict[str, Path]:
    """Write `n` held-out synthetic scenes (`tuner.synthetic`, split eval) as a benchmark in each input format:
    `synthetic.jsonl` (detection, referring and pointing samples, pointing GT as RLE masks),
    `synthetic_coco.json` (every shape of every scene) and `synthetic_screenspot.json` (one point instruction
    per scene with a unique colour and shape); images in `images/`."""
    from .tuner.synthetic import SHAPES, make_sample

    folder = Path(folder)
    existing = [name for name in EXPORT_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ValueError(f"{folder} already has {', '.join(existing)}; pass --overwrite to replace them")
    (folder / "images").mkdir(parents=True, exist_ok=True)
    jsonl, gui = [], []
    coco = {"images": [], "annotations": [], "categories": [{"id": k + 1, "name": s} for k, s in enumerate(SHAPES)]}
    for i in range(n):
        sample = make_sample(seed, i, "eval")
        scene, task = sample.scene, sample.task
        name = f"images/{i:05d}.png"
        scene.image.save(folder / name)
        w, h = scene.size
        coco["images"].append({"id": i + 1, "file_name": name, "width": w, "height": h})
        for o in scene.objects:
            x1, y1, x2, y2 = o.box
            ann = {"id": len(coco["annotations"]) + 1, "image_id": i + 1, "category_id": SHAPES.index(o.shape) + 1}
            ann.update(bbox=[x1, y1, x2 - x1, y2 - y1], area=(x2 - x1) * (y2 - y1), iscrowd=0)
            coco["annotations"].append(ann)
        entry = {"image_path": name, "dataset_name": "Synthetic"}
        if task.task == "detect":
            gt = {c: [list(t.box) for t in task.targets if t.label == c] for c in task.query}
            entry.update(categories=list(task.query), gt=gt, task_name="common_object_detection")
        elif task.task == "point":
            objects = {o.box: o for o in scene.objects}
            gt = {"gt_mask": {task.query: [_rle(_mask(scene, objects[t.box])) for t in task.targets]}}
            entry.update(categories=[task.query], gt=gt, task_name="pointing")
        else:
            gt = {task.query: [list(t.box) for t in task.targets]}
            entry.update(categories=[task.query], gt=gt, task_name="referring_object_detection")
        jsonl.append(entry)
        pairs = [(o.color, o.shape) for o in scene.objects]
        unique = [o for o in sorted(scene.objects, key=lambda o: o.box) if pairs.count((o.color, o.shape)) == 1]
        if unique:
            o = unique[0]
            gui.append(
                {
                    "id": f"synthetic_{i:05d}",
                    "img_filename": name,
                    "img_size": [w, h],
                    "bbox": list(o.box),
                    "instruction": f"{o.color} {o.shape}",
                    "ui_type": o.shape,
                    "application": f"{o.color} shapes",
                    "group": "Synthetic",
                    "platform": "synthetic",
                }
            )
    paths = {name: folder / name for name in EXPORT_FILES}
    paths["synthetic.jsonl"].write_text("".join(json.dumps(e) + "\n" for e in jsonl))
    paths["synthetic_coco.json"].write_text(json.dumps(coco))
    paths["synthetic_screenspot.json"].write_text(json.dumps(gui, indent=1))
    return paths


# --- Command line -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-eval",
        description="The LocateAnything paper's metrics (F1 over IoU thresholds, pointing, GUI accuracy, the COCO "
        "path and mAP) on its benchmark formats: run a model, score answer files, compare runs.",
    )
    what = p.add_argument_group("what to do (one of --data, --predictions, --compare, --export)")
    what.add_argument("--data", action="extend", nargs="+", metavar="PATH", help="benchmarks to run the model on")
    what.add_argument("--predictions", action="extend", nargs="+", metavar="FILE", help="answer JSONL files to score")
    what.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two report.json files: print the differences")
    what.add_argument("--export", metavar="DIR", help="write the synthetic benchmark in every input format")
    p.add_argument("--images", help="root of the benchmark's image paths (default: the data file's folder)")
    p.add_argument("--format", choices=FORMATS, default="auto", help="input format of --data (default: by content)")
    cli.add_model(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=["hybrid"], help="decoding modes (default: hybrid)")
    cli.add_max_tokens(p, DEFAULT_MAX_TOKENS)
    p.add_argument("--sampling", choices=list(SAMPLINGS), default="greedy", help="(default: %(default)s)")
    cli.add_rendering(p)
    cli.add_rows(p)
    p.add_argument("--gui-task", choices=("point", "gui"), default="point", help="GUI prompt: a point or a box")
    p.add_argument("--limit", type=cli.positive_int, help="only the first N samples of each benchmark")
    p.add_argument("--out", help="folder for answer files and report.json, report.md, f1_vs_iou.png")
    p.add_argument("--overwrite", action="store_true", help="replace existing report (or exported) files")
    p.add_argument("--n", type=cli.positive_int, default=100, help="--export: scenes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="--export: seed of the held-out stream (default: 0)")
    cli.add_progress(p)
    return p


def _mode_of(lines: list[dict], path: Path) -> str:
    stats = lines[0].get("stats")
    return stats["mode"] if isinstance(stats, dict) and "mode" in stats else path.stem


def run(args: argparse.Namespace) -> int:
    actions = [a for a in ("data", "predictions", "compare", "export") if getattr(args, a)]
    if not actions or (len(actions) > 1 and set(actions) != {"data", "predictions"}):
        raise ValueError(
            "give one of --data, --predictions, --compare or --export (--data with --predictions "
            "names the COCO file of the answers)"
        )
    if args.export:
        paths = export_benchmark(args.export, args.n, args.seed, args.overwrite)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    if args.compare:
        a, b = (read_json(Path(p)) for p in args.compare)
        print(compare_reports(a, b, tuple(args.compare)))
        return 0
    out = Path(args.out) if args.out else None
    if out is not None:
        check_report_free(out, args.overwrite)
    rows, sources = [], []
    if args.predictions:
        coco = None
        if args.data:
            benches = [load_benchmark(d, args.images, args.format) for d in args.data]
            coco = next((b.coco for b in benches if b.coco is not None), None)
            if coco is None:
                raise ValueError("with --predictions, --data names the COCO instances JSON of the answers")
        for path in map(Path, args.predictions):
            lines = read_answers(path)
            mode = _mode_of(lines, path)
            rows += score_lines(lines, mode, coco if coco is not None and answers_coco(lines, coco) else None)
            sources.append({"file": str(path), "mode": mode, "lines": len(lines)})
    else:
        if out is None:
            raise ValueError("--data needs --out (the folder for the answer files and the report)")
        benches = [load_benchmark(d, args.images, args.format) for d in args.data]
        out.mkdir(parents=True, exist_ok=True)
        for bench in benches:  # an answer file of another benchmark fails before the model loads
            for mode in args.modes:
                resume_lines(out / f"{bench.name}_{mode}.jsonl", bench)
        model = cli.load_model(args)
        for bench in benches:
            for mode in args.modes:
                options = RunOptions(
                    mode,
                    args.max_tokens,
                    SAMPLINGS[args.sampling],
                    args.rendering,
                    args.max_rows,
                    args.gui_task,
                    args.limit,
                )
                path = out / f"{bench.name}_{mode}.jsonl"
                predict(model, bench, path, options, progress=not args.no_progress)
                lines = read_answers(path)
                rows += score_lines(lines, mode, bench.coco)
                sources.append({"file": str(path), "mode": mode, "lines": len(lines), "data": str(bench.name)})
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    rows.sort(key=lambda r: (datasets.index(r.dataset), MODES.index(r.mode) if r.mode in MODES else len(MODES)))
    report = {"model": None if args.predictions else args.model, "sources": sources, "rows": [asdict(r) for r in rows]}
    print(report_text(report["rows"]))
    if out is not None:
        write_report(out, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
