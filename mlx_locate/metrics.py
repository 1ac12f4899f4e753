"""The scoring rules of the LocateAnything / Rex-Omni evaluation, as pure functions over pixel boxes and points.

Rules and edge cases follow IDEA-Research/Rex-Omni `evaluation/metrics/other_metric.py` (per-sample F1,
pointing, GUI, hallucination) and `coco_lvis_metric.py` with its C++ `fastevaluate` (the COCO/LVIS path):

- Boxes, per sample: the categories' boxes are pooled; each ground-truth box in turn takes the unused prediction
  (of a category the sample asks for) of highest IoU >= t, the first of equal ones; P = matches / predictions
  (of every category), R = matches / GT. A sample without categories scores 1 when it has no predictions, else
  0. A sample with categories but no GT box and no prediction scores **0** (the paper's rule, kept as is).
  Referring pools every category and scores 1 when there is neither GT nor prediction.
- Over samples: P and R are averaged, F1_t = 2PR / (P + R), F1@mean = the mean of F1_t over t = 0.50..0.95.
- Pointing: each GT region in turn takes the first unused point of its category inside it (a mask pixel
  `mask[int(y), int(x)]`, or a box, edges included); no GT and no point scores 1.
- GUI: correct when any predicted point, or the centre of any predicted box, lies inside the GT box.
- COCO path: COCO matching per image and category with a constant score (so the model's emission order ranks),
  P and R at the highest recall reached (fastevaluate's interpolated precision at its highest recall threshold),
  then the mean over the categories whose value is above 0 (the paper's `safe_mean`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Box = Sequence[float]  # x1, y1, x2, y2 in pixels
Point = Sequence[float]  # x, y in pixels

IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
RECALL_THRESHOLDS = tuple(i * 0.01 for i in range(101))  # as fastevaluate builds them
MAX_DETECTIONS = 100  # COCO's maxDets per image and category
SIZE_LIMITS = (("small", 32 * 32), ("medium", 96 * 96), ("large", float("inf")))  # COCO's area ranges
GT_COUNT_RANGES = ((0, "0"), (5, "1-5"), (10, "6-10"), (15, "11-15"), (20, "16-20"), (float("inf"), "20+"))
# Tasks whose categories are compared as lowercase letters only; others drop spaces and underscores.
LETTER_TASKS = ("common_object_detection", "long_tailed_object_detection", "dense_object_detection")
UNSUPPORTED_TASKS = ("keypoint", "task4_detect_all_in_polygon", "task2_detect_all_in_polygon_and_recog")


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes (x1, y1, x2, y2); 0 when they do not overlap."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


@dataclass(frozen=True)
class Score:
    """One sample's precision and recall, with the counts they come from."""

    precision: float
    recall: float
    gt: int
    pred: int

    @property
    def empty(self) -> bool:
        """Neither ground truth nor predictions."""
        return self.gt == 0 and self.pred == 0


def _score(matches: int, gt: int, pred: int) -> Score:
    return Score(matches / pred if pred else 0.0, matches / gt if gt else 0.0, gt, pred)


def match_count(gts: Sequence[Box], preds: Sequence[Box], t: float) -> int:
    """Each GT box in turn takes the unused prediction of highest IoU >= t (and > 0; the first of equal ones)."""
    used: set[int] = set()
    for g in gts:
        best, best_j = 0.0, -1
        for j, p in enumerate(preds):
            if j not in used:
                value = iou(g, p)
                if value > best and value >= t:
                    best, best_j = value, j
        if best_j >= 0:
            used.add(best_j)
    return len(used)


def normalize_category(category: str, task_name: str) -> str:
    """The paper's category key: lowercase; letters only for the detection tasks, else without spaces and '_'."""
    category = category.lower()
    if task_name in LETTER_TASKS:
        return "".join(c for c in category if c.isalpha())
    return category.replace("_", "").replace(" ", "")


def normalize_keys(boxes: dict[str, list], task_name: str) -> dict[str, list]:
    """Keys through `normalize_category`; on a collision the later category replaces the earlier (as the paper)."""
    return {normalize_category(c, task_name): v for c, v in boxes.items()}


def box_score(gt: dict[str, list[Box]], pred: dict[str, list[Box]], t: float) -> Score:
    """The paper's detection score of one sample at IoU threshold t (categories already normalised)."""
    n_gt = sum(len(v) for v in gt.values())
    n_pred = sum(len(v) for v in pred.values())
    if not gt:
        return Score(1.0, 1.0, 0, 0) if n_pred == 0 else Score(0.0, 0.0, 0, n_pred)
    if n_pred == 0:
        return Score(0.0, 0.0, n_gt, 0)  # also when no category has a GT box: the paper scores that 0
    pooled_gt = [b for c in gt for b in gt[c]]
    pooled_pred = [b for c in gt for b in pred.get(c, [])]
    return _score(match_count(pooled_gt, pooled_pred, t), n_gt, n_pred)


def referring_score(gt: dict[str, list[Box]], pred: dict[str, list[Box]], t: float) -> Score:
    """Referring: every category's boxes pooled on both sides; no GT and no prediction scores 1."""
    gts = [b for v in gt.values() for b in v]
    preds = [b for v in pred.values() for b in v]
    if not gts:
        return Score(1.0, 1.0, 0, 0) if not preds else Score(0.0, 0.0, 0, len(preds))
    if not preds:
        return Score(0.0, 0.0, len(gts), 0)
    return _score(match_count(gts, preds, t), len(gts), len(preds))


def point_inside(point: Point, region: np.ndarray | Box) -> bool:
    """A point in a binary mask (pixel `mask[int(y), int(x)]`) or in a box (edges included)."""
    if isinstance(region, np.ndarray):
        x, y = int(point[0]), int(point[1])
        return 0 <= y < region.shape[0] and 0 <= x < region.shape[1] and bool(region[y, x])
    x1, x2 = sorted((region[0], region[2]))
    y1, y2 = sorted((region[1], region[3]))
    return x1 <= point[0] <= x2 and y1 <= point[1] <= y2


def point_score(gt: dict[str, list[np.ndarray | Box]], pred: dict[str, list[Point]]) -> Score:
    """Pointing: each GT region in turn takes the first unused point of its own category that lies inside it."""
    n_gt = sum(len(v) for v in gt.values())
    n_pred = sum(len(v) for v in pred.values())
    if n_gt == 0:
        return Score(1.0, 1.0, 0, 0) if n_pred == 0 else Score(0.0, 0.0, 0, n_pred)
    if n_pred == 0:
        return Score(0.0, 0.0, n_gt, 0)
    points = [(c, p) for c, v in pred.items() for p in v]
    used: set[int] = set()
    for category, regions in gt.items():
        for region in regions:
            free = (j for j, (c, p) in enumerate(points) if j not in used and c == category and point_inside(p, region))
            j = next(free, None)
            if j is not None:
                used.add(j)
    return _score(len(used), n_gt, n_pred)


def gui_correct(gt_box: Box, pred: dict[str, list[Sequence[float]]]) -> bool:
    """GUI grounding: any predicted point, or any predicted box's centre, inside the GT box."""
    if len(gt_box) != 4:
        return False
    for coords in (c for v in pred.values() for c in v):
        if len(coords) == 4:
            coords = ((coords[0] + coords[2]) / 2, (coords[1] + coords[3]) / 2)
        if point_inside(coords, gt_box):
            return True
    return False


def sample_score(task_name: str, gt: dict | list, pred: dict[str, list], t: float) -> Score:
    """One sample of `task_name` at IoU threshold t, dispatched as the paper's evaluator does.

    `gt` is `{category: [box or region, ...]}` (GUI: one box); `pred` is `{category: [[x1, y1, x2, y2] | [x, y]]}`
    with malformed entries already removed. Raises `ValueError` for a task the paper scores otherwise.
    """
    if task_name in UNSUPPORTED_TASKS:
        raise ValueError(f"task {task_name!r} is not scored here (keypoints and polygons need their own metric)")
    pred = {k.lower(): v for k, v in pred.items()}
    if task_name == "gui":
        correct = float(gui_correct(gt, pred))
        return Score(correct, correct, 1, sum(len(v) for v in pred.values()))
    if task_name == "hallucination":
        n_pred = sum(len(v) for v in pred.values())
        correct = float(n_pred == 0)
        return Score(correct, correct, 0, n_pred)
    gt = {k.lower(): v for k, v in gt.items()}
    if task_name == "referring_object_detection":
        return referring_score(gt, pred, t)
    if task_name == "pointing":
        return point_score(gt, pred)
    if task_name == "pointing_referring":  # the first predicted category stands for the first GT category
        if pred and gt:
            pred = {next(iter(gt)): next(iter(pred.values()))}
        return point_score(gt, pred)
    return box_score(normalize_keys(gt, task_name), normalize_keys(pred, task_name), t)


def size_bucket(box: Box) -> str:
    area = (box[2] - box[0]) * (box[3] - box[1])
    return next(name for name, limit in SIZE_LIMITS if area < limit)


def size_scores(gt: dict[str, list[Box]], pred: dict[str, list[Box]], t: float) -> dict[str, Score]:
    """The paper's `calculate_size_metrics`: GT and predictions of each GT category split by their own area
    (small < 32^2, medium < 96^2, large), then matched within each bucket; an empty bucket scores 1."""
    buckets: dict[str, tuple[list[Box], list[Box]]] = {name: ([], []) for name, _ in SIZE_LIMITS}
    for category, boxes in gt.items():
        for b in boxes:
            buckets[size_bucket(b)][0].append(b)
        for b in pred.get(category, []):
            buckets[size_bucket(b)][1].append(b)
    out = {}
    for name, (gts, preds) in buckets.items():
        if not gts:
            out[name] = Score(1.0, 1.0, 0, 0) if not preds else Score(0.0, 0.0, 0, len(preds))
        elif not preds:
            out[name] = Score(0.0, 0.0, len(gts), 0)
        else:
            out[name] = _score(match_count(gts, preds, t), len(gts), len(preds))
    return out


def gt_count_range(n: int) -> str:
    """The paper's GT-count bins: 0, 1-5, 6-10, 11-15, 16-20, 20+."""
    return next(name for limit, name in GT_COUNT_RANGES if n <= limit)


@dataclass(frozen=True)
class Mean:
    precision: float
    recall: float
    f1: float
    samples: int


def mean_score(scores: Iterable[Score]) -> Mean:
    """P and R averaged over samples, F1 of the averages (the paper's aggregation)."""
    scores = list(scores)
    if not scores:
        return Mean(0.0, 0.0, 0.0, 0)
    p = float(np.mean([s.precision for s in scores]))
    r = float(np.mean([s.recall for s in scores]))
    return Mean(p, r, f1(p, r), len(scores))


# --- The COCO / LVIS path ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CocoGt:
    box: Box  # x1, y1, x2, y2
    crowd: bool = False


def coco_match(gts: Sequence[CocoGt], dets: Sequence[Box], t: float) -> list[int]:
    """COCO matching of one image and category, detections in ranking order (at most MAX_DETECTIONS).

    Returns per detection 1 (true positive), 0 (false positive) or -1 (ignored: it matched a crowd region).
    Each detection takes the unmatched GT of highest IoU >= t (the last of equal ones), non-crowd GT first;
    a crowd region's IoU is the intersection over the detection's area, and it can be matched again."""
    order = sorted(range(len(gts)), key=lambda g: gts[g].crowd)  # stable: non-crowd GT first
    taken = [False] * len(gts)
    out = []
    for d in dets[:MAX_DETECTIONS]:
        best, m = t, -1
        for g in order:
            gt = gts[g]
            if taken[g] and not gt.crowd:
                continue
            if m > -1 and not gts[m].crowd and gt.crowd:
                break
            value = _crowd_iou(d, gt.box) if gt.crowd else iou(d, gt.box)
            if value < best:
                continue
            best, m = value, g
        if m == -1:
            out.append(0)
        else:
            taken[m] = True
            out.append(-1 if gts[m].crowd else 1)
    return out


def _crowd_iou(det: Box, region: Box) -> float:
    w = min(det[2], region[2]) - max(det[0], region[0])
    h = min(det[3], region[3]) - max(det[1], region[1])
    area = (det[2] - det[0]) * (det[3] - det[1])
    return w * h / area if w > 0 and h > 0 and area > 0 else 0.0


@dataclass(frozen=True)
class CocoPR:
    precision: float  # at the highest recall reached
    recall: float  # the highest recall reached


def coco_category_pr(images: Sequence[tuple[Sequence[CocoGt], Sequence[Box]]], t: float) -> CocoPR | None:
    """One category over all images (in image order; detections in emission order, as a constant score ranks
    them): recall reached, and precision there as fastevaluate interpolates it (the precision envelope at the
    first detection whose recall exceeds the highest recall threshold below the final recall).
    None when the category has no non-crowd GT (it does not count)."""
    flags = [flag for gts, dets in images for flag in coco_match(gts, dets, t)]
    n_gt = sum(not g.crowd for gts, _ in images for g in gts)
    if n_gt == 0:
        return None
    if not flags:
        return CocoPR(0.0, 0.0)
    flags_a = np.array(flags)
    tp = np.cumsum(flags_a == 1).astype(float)
    fp = np.cumsum(flags_a == 0).astype(float)
    rc = tp / n_gt
    pr = tp / (tp + fp + np.spacing(1))
    pr = np.maximum.accumulate(pr[::-1])[::-1]  # the precision envelope
    q = []
    i = 0
    for thr in RECALL_THRESHOLDS:  # first detection whose recall exceeds each threshold (fastevaluate: strictly)
        while i < len(rc) and rc[i] <= thr:
            i += 1
        if i == len(rc):
            break
        q.append(pr[i])
    precision = next((float(v) for v in reversed(q) if v > 0), 0.0)
    return CocoPR(precision, float(rc[-1]))


def safe_mean(values: Iterable[float]) -> float:
    """The paper's mean over categories: only values above 0 count (0 when none does)."""
    kept = [v for v in values if v > 0]
    return float(np.mean(kept)) if kept else 0.0


@dataclass(frozen=True)
class CocoPath:
    precision: dict[float, float]  # by IoU threshold, over categories
    recall: dict[float, float]
    f1: dict[float, float]
    f1_mean: float  # F1 of the category means of P and R averaged over thresholds (coco_lvis_metric's "Avg F1")
    categories: int  # categories with GT
    categories_counted: dict[float, int]  # categories whose recall at t is above 0 (the ones safe_mean keeps)


def coco_path(per_category: dict[object, dict[float, CocoPR]]) -> CocoPath:
    """The paper's COCO/LVIS summary from per-category, per-threshold P and R (`coco_category_pr`)."""
    thresholds = sorted({t for v in per_category.values() for t in v})
    precision = {t: safe_mean(v[t].precision for v in per_category.values()) for t in thresholds}
    recall = {t: safe_mean(v[t].recall for v in per_category.values()) for t in thresholds}
    mean_p = safe_mean(np.mean([v[t].precision for t in thresholds]) for v in per_category.values())
    mean_r = safe_mean(np.mean([v[t].recall for t in thresholds]) for v in per_category.values())
    return CocoPath(
        precision=precision,
        recall=recall,
        f1={t: f1(precision[t], recall[t]) for t in thresholds},
        f1_mean=f1(mean_p, mean_r),
        categories=len(per_category),
        categories_counted={t: sum(v[t].recall > 0 for v in per_category.values()) for t in thresholds},
    )


# --- Hit counts outside the paper's scores (the tiling tests and benchmark) ---------------------------------------


def greedy_match(preds: list[tuple[float, ...]], gts: list[tuple[float, ...]], floor: float) -> list[float]:
    """IoUs of the pairs matched greedily by descending IoU (each box used once), keeping IoU >= floor.

    Matching at a higher threshold keeps exactly the pairs of this list at or above it.
    """
    pairs = sorted(
        ((iou(p, g), i, j) for i, p in enumerate(preds) for j, g in enumerate(gts)), key=lambda t: (-t[0], t[1], t[2])
    )
    used_p, used_g, matched = set(), set(), []
    for value, i, j in pairs:
        if value < floor:
            break
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            matched.append(value)
    return matched
