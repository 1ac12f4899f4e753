"""Held-out accuracy of a checkpoint on synthetic shape scenes, in every decoding mode.

    python -m mlx_locate.eval --model demo --n 200 --seed 0 --modes slow fast hybrid --json eval.json

Scenes come from `synthetic.make_sample(seed, i, split="eval")`, a stream the training never draws from.
A quick check with pooled counts (the paper's per-sample metrics on the paper's formats are `mlx-locate-eval`;
both take their rules from `metrics`): predictions of box tasks (detect, refer, single) are matched to ground
truth greedily by descending IoU (per category for detection), F1 = 2 matches / (predictions + GT) at IoU 0.5
and its mean over 0.5:0.95, and the mean IoU of the boxes matched at 0.5. Points count when they fall inside an
unmatched ground-truth box.
Each absent phrase or category should be answered `<box>None</box>`. Passes per box are decode forward steps
(prefill excluded) per predicted box or point; "ended" means the stream stopped by itself, not at the cap.
Seconds per sample cover the query's prefill and decoding; the image's vision and prefix run once per sample.
Decoding is the product default, greedy with the default guards, unless `--sampling` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import cli
from .evaluate import MODES, SAMPLINGS
from .locate import LocateModel
from .metrics import IOU_THRESHOLDS, greedy_match, iou, match_points
from .request import Result
from .sampling import Sampling
from .tuner.synthetic import Sample, make_sample

__all__ = ["evaluate", "greedy_match", "iou", "main", "match_points"]


@dataclass
class Tally:
    """Counts for one mode, summed over samples."""

    box_pred: int = 0
    box_gt: int = 0
    matched_ious: list[float] = field(default_factory=list)  # matched at IoU >= 0.5
    point_pred: int = 0
    point_gt: int = 0
    point_hits: int = 0
    absent: int = 0  # absent phrases or categories asked for
    absent_none: int = 0  # ... answered <box>None</box>
    objects: int = 0  # boxes and points predicted
    steps: int = 0
    samples: int = 0
    ended: int = 0
    exact: int = 0
    fallbacks: int = 0
    seconds: float = 0.0
    stop_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, sample: Sample, result: Result, expected_ids: list[int], seconds: float) -> None:
        task = sample.task
        gts = [t for t in task.targets]
        objects = result.objects
        if task.task == "point":
            points = [o.point for o in objects if o.point is not None]
            self.point_pred += len(points) + sum(o.box is not None for o in objects)
            self.point_gt += len(gts)
            self.point_hits += match_points(points, [tuple(map(float, t.box)) for t in gts])
        else:
            self.box_pred += sum(o.box is not None or o.point is not None for o in objects)
            self.box_gt += len(gts)
            groups = {t.label for t in gts} | {o.label for o in objects} if task.task == "detect" else {None}
            for group in groups:
                preds = [o.box for o in objects if o.box is not None and (group is None or o.label == group)]
                truth = [tuple(map(float, t.box)) for t in gts if group is None or t.label == group]
                self.matched_ious += greedy_match(preds, truth, IOU_THRESHOLDS[0])
        for label in absent_labels(sample):
            self.absent += 1
            empty = [(e or "").strip() for e in result.empty_labels]
            self.absent_none += (label or "") in empty
        s = result.stats
        self.objects += len(objects)
        self.steps += s["steps"]
        self.samples += 1
        self.ended += s["stop_reason"] != "length_cap"
        self.exact += result.token_ids == expected_ids
        self.fallbacks += s["fallbacks"]
        self.seconds += seconds
        self.stop_reasons[s["stop_reason"]] = self.stop_reasons.get(s["stop_reason"], 0) + 1

    def summary(self) -> dict:
        def f1(tp: int, pred: int, gt: int) -> float | None:
            return 2 * tp / (pred + gt) if pred + gt else None

        ious = np.array(self.matched_ious)
        f1s = [f1(int((ious >= t).sum()), self.box_pred, self.box_gt) for t in IOU_THRESHOLDS]
        return {
            "f1@0.5": f1s[0],
            "f1@0.5:0.95": None if f1s[0] is None else float(np.mean(f1s)),
            "f1_by_iou": dict(zip(map(str, IOU_THRESHOLDS), f1s, strict=True)),
            "mean_iou": float(ious.mean()) if len(ious) else None,
            "boxes_pred": self.box_pred,
            "boxes_gt": self.box_gt,
            "point_f1": f1(self.point_hits, self.point_pred, self.point_gt),
            "none_rate": self.absent_none / self.absent if self.absent else None,
            "absent_items": self.absent,
            "passes_per_box": self.steps / self.objects if self.objects else None,
            "ended_rate": self.ended / self.samples if self.samples else None,
            "exact_rate": self.exact / self.samples if self.samples else None,
            "fallbacks": self.fallbacks,
            "stop_reasons": self.stop_reasons,
            "seconds_per_sample": self.seconds / self.samples if self.samples else None,
        }


def absent_labels(sample: Sample) -> list[str | None]:
    """Phrases or categories of `sample` whose answer is `<box>None</box>` (None: an absent pointing target)."""
    task = sample.task
    if task.task == "detect":
        present = {t.label for t in task.targets}
        return [c for c in task.query if c not in present]
    if task.targets:
        return []
    return [None] if task.task == "point" else [task.query]


def evaluate(
    model: LocateModel,
    n: int,
    seed: int = 0,
    modes: tuple[str, ...] = MODES,
    max_tokens: int = 256,
    sampling: Sampling = SAMPLINGS["greedy"],
    **locate_kw,
) -> tuple[dict[str, dict], list[dict]]:
    """Run `n` held-out samples in each mode. Returns the summary per mode and one record per sample and mode.

    `locate_kw` goes to `Session.locate` (guards, strict, ...)."""
    tallies = {mode: Tally() for mode in modes}
    records = []
    for i in range(n):
        sample = make_sample(seed, i, "eval")
        task = sample.task
        expected = model.tokenizer.encode(task.answer + "<|im_end|>")
        session = model.session(sample.scene.image)  # vision and the image prefix once for every mode
        for mode in modes:
            t0 = time.perf_counter()
            result = session.locate(
                task.query, task=task.task, mode=mode, max_tokens=max_tokens, sampling=sampling, **locate_kw
            )
            seconds = time.perf_counter() - t0
            tallies[mode].add(sample, result, expected, seconds)
            records.append(
                {
                    "index": i,
                    "mode": mode,
                    "task": task.task,
                    "query": task.query,
                    "image_size": list(sample.scene.size),
                    "expected": task.answer,
                    "output": result.text,
                    "objects": [
                        {"label": o.label, "box": o.box, "point": o.point, "confidence": o.confidence}
                        for o in result.objects
                    ],
                    "targets": [{"label": t.label, "box": list(t.box)} for t in task.targets],
                    "steps": result.stats["steps"],
                    "stop_reason": result.stats["stop_reason"],
                }
            )
    return {mode: tally.summary() for mode, tally in tallies.items()}, records


def coco_files(records: list[dict], modes: tuple[str, ...]) -> dict[str, dict | list]:
    """Ground truth and detections (box tasks only) in COCO format; a category per label string."""
    categories: dict[str, int] = {}
    images, annotations, detections = [], [], {mode: [] for mode in modes}

    def category(label: str | None) -> int:
        return categories.setdefault(label or "", len(categories) + 1)

    for r in records:
        if r["task"] == "point":
            continue
        if r["mode"] == modes[0]:
            w, h = r["image_size"]
            images.append({"id": r["index"], "width": w, "height": h, "file_name": f"eval_{r['index']:05d}.png"})
            for t in r["targets"]:
                x1, y1, x2, y2 = t["box"]
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": r["index"],
                        "category_id": category(t["label"]),
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "area": (x2 - x1) * (y2 - y1),
                        "iscrowd": 0,
                    }
                )
        for o in r["objects"]:
            if o["box"] is None:
                continue
            x1, y1, x2, y2 = o["box"]
            detections[r["mode"]].append(
                {
                    "image_id": r["index"],
                    "category_id": category(o["label"]),
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "score": o["confidence"] if o["confidence"] is not None else 1.0,
                }
            )
    gt = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i, "name": name} for name, i in categories.items()],
    }
    return {"gt.json": gt, **{f"dets_{mode}.json": dets for mode, dets in detections.items()}}


def table(summary: dict[str, dict]) -> str:
    columns = (
        ("F1@.5", "f1@0.5"),
        ("F1@.5:.95", "f1@0.5:0.95"),
        ("mIoU", "mean_iou"),
        ("pointF1", "point_f1"),
        ("None", "none_rate"),
        ("pass/box", "passes_per_box"),
        ("ended", "ended_rate"),
        ("exact", "exact_rate"),
        ("s/sample", "seconds_per_sample"),
    )
    lines = ["mode    " + "".join(f"{name:>10}" for name, _ in columns)]
    for mode, s in summary.items():
        cells = "".join(f"{s[key]:>10.3f}" if s[key] is not None else f"{'-':>10}" for _, key in columns)
        lines.append(f"{mode:<8}{cells}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_locate.eval", description=__doc__.split("\n\n")[0])
    cli.add_model(p)
    p.add_argument("--n", type=int, default=200, help="held-out samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out stream")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    cli.add_max_tokens(p, 256)
    p.add_argument("--sampling", choices=list(SAMPLINGS), default="greedy", help="decoding (see SAMPLINGS)")
    p.add_argument("--json", default=None, help="write the summary and per-sample records here")
    p.add_argument("--coco", default=None, help="folder for COCO-format gt.json and dets_<mode>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1:
        print("error: --n must be at least 1", file=sys.stderr)
        return 2
    model = cli.load_model(args)
    modes = tuple(args.modes)
    summary, records = evaluate(model, args.n, args.seed, modes, args.max_tokens, sampling=SAMPLINGS[args.sampling])
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "records": records}, indent=1))
    if args.coco:
        folder = Path(args.coco)
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in coco_files(records, modes).items():
            (folder / name).write_text(json.dumps(content))
    return 0


if __name__ == "__main__":
    sys.exit(main())
