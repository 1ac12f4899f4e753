"""The one scorer: answer lines to the paper's numbers, one `Row` per dataset (the paper's `task_dataset`
key) and mode.

Box tasks get F1 over the IoU thresholds (per sample, averaged), pointing its F1, GUI and hallucination their
accuracy, COCO/LVIS files the paper's COCO path and COCO mAP (faster-coco-eval). Every rule is a pure function
in `mlx_locate.metrics`; `located_f1` scores objects found against the truth by the same rules (fine-tuning's
held-out F1).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import metrics
from ..parse import LocatedObject
from .formats import (
    COCO_TASKS,
    POINT_TASKS,
    answers_coco,
    clean_predictions,
    coco_boxes,
    decode_regions,
    extra,
    is_lvis,
    read_answers,
)

CONSTANT_SCORE = 0.2  # the paper's score for every box on the COCO path
DETECTION, REFERRING = "common_object_detection", "referring_object_detection"


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
    capped: int | None = None  # requests that stopped at the token cap (None: the lines do not say)
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
    if line["task_name"] == REFERRING:
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
    if row.task_name != REFERRING:
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
    fce = extra("faster_coco_eval", "COCO mAP")
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


def _decoding(row: Row, lines: list[dict]) -> None:
    """Speed and decoding counts from our lines' `stats` (other tools' lines have none)."""
    stats = [ln.get("stats") for ln in lines]
    if not stats or not all(isinstance(s, dict) and "wall_s" in s for s in stats):
        return
    wall = sum(s["wall_s"] for s in stats)
    objects = sum(s["objects"] for s in stats)
    row.s_per_image = wall / len(stats)
    row.boxes_per_s = objects / wall if wall > 0 else None
    row.passes_per_box = sum(s["forward_passes"] for s in stats) / objects if objects else None
    if all("capped" in s for s in stats):
        row.capped = sum(s["capped"] for s in stats)


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
        _decoding(row, scored)
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


def mode_of(lines: list[dict], path: Path) -> str:
    """The decoding mode an answer file was written in (its stats), else its file name."""
    stats = lines[0].get("stats")
    return stats["mode"] if isinstance(stats, dict) and "mode" in stats else path.stem


def score_answers(paths: list[Path], coco: dict | None = None) -> tuple[list[Row], list[dict]]:
    """Rows and sources of answer files; those that answer `coco` get the COCO path too."""
    rows, sources = [], []
    for path in paths:
        lines = read_answers(path)
        mode = mode_of(lines, path)
        rows += score_lines(lines, mode, coco if coco is not None and answers_coco(lines, coco) else None)
        sources.append({"file": str(path), "mode": mode, "lines": len(lines)})
    return rows, sources


# --- Objects found against the truth (fine-tuning's held-out F1) ------------------------------------------


@dataclass(frozen=True)
class LocatedF1:
    f1: float | None  # F1@0.5, the detection rule: the truth's labels are the categories (None: nothing to score)
    box_f1: float | None  # F1@0.5 with the labels pooled (the referring rule)
    pred: int  # boxes found
    gt: int  # boxes in the truth


def _boxes_by_label(objects: Sequence[LocatedObject]) -> dict[str, list[list[int]]]:
    out: dict[str, list] = {}
    for o in objects:
        if o.box_norm is not None:
            x1, y1, x2, y2 = o.box_norm  # as the model wrote them: corners in any order
            out.setdefault(o.label or "", []).append([min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)])
    return out


def located_f1(pairs: Sequence[tuple[Sequence[LocatedObject], Sequence[LocatedObject]]]) -> LocatedF1:
    """F1@0.5 of the boxes found against the truth, one (truth, found) pair per sample, in 0..1000 space, scored
    by `score_lines`. A sample with no box on either side is left out (the report's `without_empty`)."""
    boxes = [(_boxes_by_label(truth), _boxes_by_label(found)) for truth, found in pairs]
    boxes = [(g, p) for g, p in boxes if g or p]

    def f1(task: str) -> float | None:
        lines = [{"gt": g, "extracted_predictions": p, "task_name": task, "dataset_name": ""} for g, p in boxes]
        return score_lines(lines, "")[0].f1_50 if lines else None

    count = sum(len(v) for _, p in boxes for v in p.values()), sum(len(v) for g, _ in boxes for v in g.values())
    return LocatedF1(f1(DETECTION), f1(REFERRING), *count)
