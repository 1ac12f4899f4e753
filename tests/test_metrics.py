"""The paper's scoring rules (`mlx_locate.metrics`) against hand-computed cases, edge cases included."""

import numpy as np
import pytest

from mlx_locate import metrics
from mlx_locate.metrics import CocoGt, Score


def strip(x1: float, x2: float) -> list[float]:
    """A box 10 px high: its IoU with another strip is the overlap of the x ranges over their union."""
    return [x1, 0.0, x2, 10.0]


def test_iou_hand_cases():
    assert metrics.iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert metrics.iou((0, 0, 10, 10), (2, 2, 4, 4)) == pytest.approx(4 / 100)
    assert metrics.iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0  # touching edges
    assert metrics.iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert metrics.iou((0, 0, 0, 10), (0, 0, 0, 10)) == 0.0  # degenerate: no area, no overlap


def test_each_gt_in_turn_takes_its_best_unused_prediction():
    # GT A takes p1 (IoU 7/13 > p2's 6/14) although GT B needed it (9/11): 1 match, where a global
    # descending-IoU matching (the synthetic quick check's) finds 2.
    a, b = strip(0, 10), strip(4, 14)
    p1, p2 = strip(3, 13), strip(-4, 6)
    assert metrics.match_count([a, b], [p1, p2], 0.4) == 1
    assert len(metrics.greedy_match([p1, p2], [a, b], 0.4)) == 2
    assert metrics.match_count([b, a], [p1, p2], 0.4) == 2  # GT order matters


def test_equal_ious_go_to_the_first_prediction():
    # p1 and p2 tie on GT 1 (9/11): the first takes it, so GT 2 still finds p2 (IoU 1); taking the last would
    # leave GT 2 with p1 (8/12 < 0.7).
    g1, g2 = strip(0, 10), strip(1, 11)
    p1, p2 = strip(-1, 9), strip(1, 11)
    assert metrics.match_count([g1, g2], [p1, p2], 0.7) == 2


def test_threshold_is_inclusive_and_iou_must_be_positive():
    assert metrics.match_count([strip(0, 10)], [strip(0, 5)], 0.5) == 1  # IoU exactly 0.5
    assert metrics.match_count([strip(0, 10)], [strip(0, 4.9)], 0.5) == 0
    assert metrics.match_count([strip(0, 10)], [strip(20, 30)], 0.0) == 0


def test_box_score_edge_cases():
    a = strip(0, 10)
    assert metrics.box_score({}, {}, 0.5) == Score(1.0, 1.0, 0, 0)  # no category, no prediction: 1
    assert metrics.box_score({}, {"x": [a]}, 0.5) == Score(0.0, 0.0, 0, 1)
    # Categories asked, no GT box, no prediction: the paper scores 0.
    edge = metrics.box_score({"cat": []}, {}, 0.5)
    assert edge == Score(0.0, 0.0, 0, 0) and edge.empty
    assert metrics.box_score({"cat": [a]}, {}, 0.5) == Score(0.0, 0.0, 1, 0)
    assert metrics.box_score({"cat": []}, {"cat": [a]}, 0.5) == Score(0.0, 0.0, 0, 1)


def test_box_score_pools_categories_and_counts_every_prediction():
    a, b = strip(0, 10), strip(20, 30)
    # A prediction filed under another asked category still matches (categories pooled).
    assert metrics.box_score({"a": [a], "b": []}, {"b": [a]}, 0.5) == Score(1.0, 1.0, 1, 1)
    # A prediction of a category not asked counts as a prediction but never matches.
    assert metrics.box_score({"a": [a]}, {"a": [a], "zebra": [a]}, 0.5) == Score(0.5, 1.0, 1, 2)
    assert metrics.box_score({"a": [a, b]}, {"a": [a, strip(40, 50), strip(60, 70)]}, 0.5) == Score(1 / 3, 0.5, 2, 3)


def test_sample_score_dispatches_as_the_paper():
    a = strip(0, 10)
    # Detection tasks compare categories as lowercase letters only ...
    assert (
        metrics.sample_score("common_object_detection", {"Traffic Light": [a]}, {"traffic_light": [a]}, 0.5).recall == 1
    )
    # ... other box tasks drop spaces and underscores only.
    assert metrics.sample_score("dense_object_detection", {"a-b": [a]}, {"ab": [a]}, 0.5).recall == 1
    assert metrics.sample_score("doclaynet", {"page-header": [a]}, {"pageheader": [a]}, 0.5).recall == 0
    assert metrics.sample_score("doclaynet", {"Page Header": [a]}, {"page_header": [a]}, 0.5).recall == 1
    # Referring ignores category names, and no GT with no prediction scores 1 there (0 for detection).
    ref = "referring_object_detection"
    assert metrics.sample_score(ref, {"the man": [a]}, {"a man": [a]}, 0.5) == Score(1.0, 1.0, 1, 1)
    assert metrics.sample_score(ref, {"the man": []}, {}, 0.5) == Score(1.0, 1.0, 0, 0)
    assert metrics.sample_score("common_object_detection", {"man": []}, {}, 0.5) == Score(0.0, 0.0, 0, 0)
    assert metrics.sample_score("hallucination", {"unicorn": []}, {}, 0.5).precision == 1
    assert metrics.sample_score("hallucination", {"unicorn": []}, {"unicorn": [a]}, 0.5).precision == 0
    with pytest.raises(ValueError, match="keypoint"):
        metrics.sample_score("keypoint", {}, {}, 0.5)


def triangle_mask() -> np.ndarray:
    """A 10 x 10 mask: the lower-left triangle (x <= y)."""
    y, x = np.mgrid[0:10, 0:10]
    return (x <= y).astype(np.uint8)


def test_pointing_inside_the_mask_of_its_own_category():
    mask = triangle_mask()
    assert metrics.point_inside((2.9, 3.9), mask)  # pixel (2, 3): x <= y
    assert not metrics.point_inside((8.0, 1.0), mask)  # inside the bounding box, outside the triangle
    assert metrics.point_inside((-0.5, 3.0), mask)  # int() truncates towards 0, as the paper's check does
    assert not metrics.point_inside((-1.5, 3.0), mask) and not metrics.point_inside((3.0, 10.0), mask)
    assert metrics.point_inside((10, 10), [0, 0, 10, 10])  # a box region: edges included
    gt = {"cat": [mask], "dog": [[20, 20, 30, 30]]}
    assert metrics.point_score(gt, {"cat": [[2, 5]], "dog": [[25, 25]]}) == Score(1.0, 1.0, 2, 2)
    assert metrics.point_score(gt, {"cat": [[25, 25]], "dog": [[2, 5]]}) == Score(0.0, 0.0, 2, 2)  # swapped
    # One point serves one GT region; the first unused point inside is taken.
    two = {"cat": [mask, mask]}
    assert metrics.point_score(two, {"cat": [[2, 5]]}) == Score(1.0, 0.5, 2, 1)
    assert metrics.point_score(two, {"cat": [[8, 1], [2, 5], [3, 6]]}) == Score(2 / 3, 1.0, 2, 3)
    assert metrics.point_score({"cat": []}, {}) == Score(1.0, 1.0, 0, 0)  # nothing there, nothing pointed at
    assert metrics.point_score({"cat": []}, {"cat": [[1, 1]]}) == Score(0.0, 0.0, 0, 1)
    # pointing_referring: the first predicted category stands for the first GT category.
    assert metrics.sample_score("pointing_referring", {"the cat": [mask]}, {"cat": [[2, 5]]}, 0.5).recall == 1
    assert metrics.sample_score("pointing", {"the cat": [mask]}, {"cat": [[2, 5]]}, 0.5).recall == 0


def test_gui_point_or_box_centre_inside_the_target():
    target = [10, 10, 20, 20]
    assert metrics.gui_correct(target, {"save": [[20, 20]]})  # edge included
    assert metrics.gui_correct(target, {"save": [[30, 30], [15, 12]]})  # any prediction
    assert metrics.gui_correct(target, {"save": [[0, 0, 30, 30]]})  # box centre (15, 15)
    assert not metrics.gui_correct(target, {"save": [[0, 0, 12, 12]]})  # overlaps, centre (6, 6) outside
    assert not metrics.gui_correct(target, {})
    assert metrics.sample_score("gui", target, {"Save": [[15, 15]]}, 0.5) == Score(1.0, 1.0, 1, 1)


def test_mean_is_f1_of_the_averaged_precision_and_recall():
    m = metrics.mean_score([Score(1.0, 0.5, 2, 1), Score(0.5, 1.0, 1, 2)])
    assert (m.precision, m.recall, m.f1, m.samples) == (0.75, 0.75, pytest.approx(0.75), 2)
    # (the mean of the per-sample F1s would be 2/3)
    assert metrics.mean_score([]).f1 == 0.0


def test_size_buckets_and_gt_count_ranges():
    small, medium, large = [0, 0, 31, 33], [0, 0, 32, 32], [0, 0, 96, 96]  # areas 1023, 1024, 9216
    assert [metrics.size_bucket(b) for b in (small, medium, large)] == ["small", "medium", "large"]
    s = metrics.size_scores({"a": [small, medium]}, {"a": [small, [100, 100, 200, 200]]}, 0.5)
    assert s["small"] == Score(1.0, 1.0, 1, 1)
    assert s["medium"] == Score(0.0, 0.0, 1, 0)
    assert s["large"] == Score(0.0, 0.0, 0, 1)  # a large prediction and no large GT
    assert metrics.size_scores({"a": [small]}, {"a": [small]}, 0.5)["large"] == Score(1.0, 1.0, 0, 0)
    ranges = {n: metrics.gt_count_range(n) for n in (0, 1, 5, 6, 10, 11, 15, 16, 20, 21)}
    assert ranges == {0: "0", 1: "1-5", 5: "1-5", 6: "6-10", 10: "6-10", 11: "11-15", 15: "11-15", 16: "16-20",
                      20: "16-20", 21: "20+"}  # fmt: skip


def test_coco_matching_in_emission_order_with_crowd_regions():
    a, b = strip(0, 10), strip(20, 30)
    assert metrics.coco_match([CocoGt(a)], [a, a], 0.5) == [1, 0]  # the first emitted takes the GT
    # A detection takes the unmatched GT of highest IoU, not the first that clears the threshold: strip(1, 11)
    # takes GT 2 (IoU 1, GT 1 9/11), so strip(-1, 9) still finds GT 1 (9/11; GT 2 only 8/12).
    gts = [CocoGt(strip(0, 10)), CocoGt(strip(1, 11))]
    assert metrics.coco_match(gts, [strip(1, 11), strip(-1, 9)], 0.8) == [1, 1]
    # Of equal IoUs the last GT is taken: strip(1, 11) ties (9/11) on both, takes GT 2, and strip(0, 10) then
    # takes GT 1 (GT 2 would be 8/12).
    gts = [CocoGt(strip(0, 10)), CocoGt(strip(2, 12))]
    assert metrics.coco_match(gts, [strip(1, 11), strip(0, 10)], 0.75) == [1, 1]
    # A detection on a crowd region is ignored (-1), and the region can absorb several.
    crowd = CocoGt([0, 0, 100, 10], crowd=True)
    assert metrics.coco_match([CocoGt(b), crowd], [b, a, a], 0.5) == [1, -1, -1]
    assert metrics.coco_match([CocoGt(b)], [strip(0, 1)] * 150, 0.5) == [0] * metrics.MAX_DETECTIONS


def test_coco_precision_at_the_highest_recall_reached():
    a, b, c = strip(0, 10), strip(20, 30), strip(40, 50)
    miss = strip(100, 110)
    # Flags TP, FP, TP over 2 GT: recall 1, precision there 2/3.
    pr = metrics.coco_category_pr([([CocoGt(a), CocoGt(b)], [a, miss, b])], 0.5)
    assert pr.recall == 1.0 and pr.precision == pytest.approx(2 / 3)
    # TP, FP over 3 GT: recall 1/3; fastevaluate's envelope gives the precision of the first detection, 1.
    pr = metrics.coco_category_pr([([CocoGt(a), CocoGt(b), CocoGt(c)], [a, miss])], 0.5)
    assert pr.recall == pytest.approx(1 / 3) and pr.precision == pytest.approx(1.0)
    # Images in order; one without detections still counts its GT.
    pr = metrics.coco_category_pr([([CocoGt(a)], [miss, a]), ([CocoGt(b)], [])], 0.5)
    assert pr.recall == 0.5 and pr.precision == pytest.approx(0.5)
    # The envelope matters once recall steps are finer than the 0.01 thresholds (more than 100 GT): 148 TP,
    # 10 FP, then 2 TP over 150 GT in two images; at the first detection past recall 0.99 the precision is
    # 149/159, and the envelope raises it to the last detection's 150/160.
    many = [strip(20 * k, 20 * k + 10) for k in range(150)]
    second = many[75:148] + [strip(-50, -40)] * 10 + many[148:]
    images = [([CocoGt(g) for g in many[:75]], many[:75]), ([CocoGt(g) for g in many[75:]], second)]
    pr = metrics.coco_category_pr(images, 0.5)
    assert pr.recall == 1.0 and pr.precision == pytest.approx(150 / 160)
    assert metrics.coco_category_pr([([CocoGt(a)], [])], 0.5) == metrics.CocoPR(0.0, 0.0)
    assert metrics.coco_category_pr([([], [a])], 0.5) is None  # no GT: the category does not count


def test_coco_path_averages_only_categories_above_zero():
    assert metrics.safe_mean([0.0, 0.5, 1.0]) == 0.75 and metrics.safe_mean([0.0]) == 0.0
    pr = metrics.CocoPR
    per_category = {
        1: {0.5: pr(1.0, 1.0), 0.95: pr(0.5, 0.5)},
        2: {0.5: pr(0.5, 0.25), 0.95: pr(0.0, 0.0)},  # left out of the 0.95 means (safe_mean)
    }
    path = metrics.coco_path(per_category)
    assert path.precision == {0.5: 0.75, 0.95: 0.5} and path.recall == {0.5: 0.625, 0.95: 0.5}
    assert path.f1[0.5] == pytest.approx(2 * 0.75 * 0.625 / 1.375)
    # F1@mean: F1 of the category means of P and R over thresholds (coco_lvis_metric's "Avg F1").
    p, r = np.mean([0.75, 0.25]), np.mean([0.75, 0.125])
    assert path.f1_mean == pytest.approx(2 * p * r / (p + r))
    assert path.categories == 2 and path.categories_counted == {0.5: 2, 0.95: 1}
