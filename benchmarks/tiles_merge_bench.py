"""How the tiles' merge does on scenes drawn here, independently of `mlx_locate.synthetic`: precision, recall and
objects across a seam given once, for `merge_results` and for SAHI's greedy merge on the same decoded views.

    python benchmarks/tiles_merge_bench.py [--dense 30] [--seams 24] [--large 10] [--seed 0] [--overlap 0.2] \
        [--views /tmp/views] [--confidences] [--note "..."] [--json benchmarks/results/tiles_merge_cpu.json]

Scenes (drawn by this file, not by the project's generators; deterministic in `--seed`):
- dense: 1200 x 900 pixels, 30-45 shapes (square, circle, triangle, diamond, star) of 25-60 px, triangles,
  diamonds and stars 0.8-1.25 as wide as high, at random places 3-10 px apart (no grid), in random saturated
  colours on a lightly shaded, noisy background; one shape asked of each: "square" of every other scene (even
  seeds), circle, triangle, diamond and star in turn of the others;
- seam placements: an image of random size (600-1300 x 450-1000 px) whose tiles are those `split_request`
  chooses (`tiles="auto"`, the model's budget), one shape of 25-60 px (a square for an even seed, the other
  shapes in turn for odd ones) across an inner tile edge (cut at 15-85 %), a quarter of them across a vertical
  and a horizontal edge at once (a tile corner), among 10-20 other shapes kept 10 px away; its shape asked.
  Once: exactly one box overlaps it, with IoU >= 0.5;
- large: 1200 x 900 pixels, 3-6 shapes of 110-220 px (about a tile: the whole image sees them at 20-40 px), 20 px
  apart, the first one's shape asked: what the whole image is in the request for.

Each request's views (`tiles.split_request`, the whole image first) are decoded together through one engine
(`locate_many`); `--views PREFIX` keeps them in PREFIX-dense.pkl, PREFIX-seams.pkl and PREFIX-large.pkl, so
another merge (another checkout running this file) can be replayed on the same views. Then:
- "merge_results": the project's merge (`tiles.merge_results`, what `tiles="auto"` returns);
- "SAHI greedy NMM": SAHI's default postprocess for sliced prediction (GREEDYNMM, IOS >= 0.5, per label): the
  most confident box takes every box of its label whose intersection is at least half of the smaller box, and
  grows to their union;
- "whole image": the first view alone, what the request without tiles answers.
The model's own false boxes (dense scenes): each tile's view is its crop decoded as a plain image; a box of the
asked shape that the tile holds (`tiles.holds`: clear of its inner edges) and that matches no object is the
model's error on that crop, whatever the merge. Where no other tile holds it, no tile can outvote it: those bound
from above the precision of a merge that decides by geometry alone (matched / (matched + those)).
`--confidences`: each view's boxes of the asked shape with their confidence, true (IoU >= 0.5 with an object of
the shape) or false (of the kinds below, a duplicate being a second box of its view on one object), for tiles
(held or not, held by no other tile) and the whole image, and the objects `tiles.merged_groups` keeps, by how many
views found them; the quantiles of each, of the confidence and of it over the median confidence of the request's
boxes of the shape, every view's (what `tiles.unconfirmed` compares with `LONE_CONFIDENCE`).
Boxes are matched to the truth greedily at IoU 0.5. A false box is called a duplicate (it overlaps a found
object by IoU >= 0.5 or lies inside it), a piece (lies mostly inside a true object of the label), another shape
(mostly inside an object of another label) or nothing.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import math
import pickle
import platform
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_locate import Request  # noqa: E402
from mlx_locate.locate import load  # noqa: E402
from mlx_locate.metrics import greedy_match, iou  # noqa: E402
from mlx_locate.tiles import (  # noqa: E402
    auto_grid,
    holds,
    merge_results,
    merged_groups,
    parse_tiles,
    seams,
    split_request,
    tile_boxes,
    to_image,
)

SHAPES = ("square", "circle", "triangle", "diamond", "star")
SIDE = (25, 60)  # object sides in pixels
LARGE_SIDE = (110, 220)  # object sides in a large scene
LARGE_COUNT = (3, 6)
DENSE_SIZE = (1200, 900)
DENSE_COUNT = (30, 45)
SEAM_SIZES = ((600, 1300), (450, 1000))  # width and height ranges of a seam scene
OTHERS = (10, 20)  # other shapes in a seam scene
CUT = (0.15, 0.85)  # where the seam crosses the object, as a fraction of its side
MATCH = 0.5  # IoU of a found object
SAHI_IOS = 0.5  # SAHI's default match threshold


# --- Scenes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thing:
    shape: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1, exclusive


@dataclass(frozen=True)
class Drawn:
    image: Image.Image
    things: tuple[Thing, ...]
    target: int | None = None  # index of the seam object


def colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """A random saturated colour."""
    r, g, b = colorsys.hsv_to_rgb(rng.uniform(0, 1), rng.uniform(0.55, 0.95), rng.uniform(0.5, 0.9))
    return round(r * 255), round(g * 255), round(b * 255)


def background(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A light background shaded from one corner to the other, with pixel noise."""
    width, height = size
    a, b = rng.uniform(205, 245, size=3), rng.uniform(205, 245, size=3)
    t = (np.linspace(0, 1, width)[None, :] + np.linspace(0, 1, height)[:, None]) / 2
    pixels = a + (b - a) * t[..., None] + rng.normal(0, 3, size=(height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def outline(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]]:
    """The polygon of a triangle, diamond or star spanning `box` (the last pixel included)."""
    x0, y0, x1, y1 = box[0], box[1], box[2] - 1, box[3] - 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    points = []  # a five-pointed star, inner radius 0.45, stretched to the box
    for k in range(10):
        r, a = (1.0 if k % 2 == 0 else 0.45), math.pi / 2 + k * math.pi / 5
        points.append((r * math.cos(a), -r * math.sin(a)))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    sx, sy = (x1 - x0) / (max(xs) - min(xs)), (y1 - y0) / (max(ys) - min(ys))
    return [(x0 + (x - min(xs)) * sx, y0 + (y - min(ys)) * sy) for x, y in points]


def paint(image: Image.Image, things: list[Thing], rng: np.random.Generator) -> Image.Image:
    draw = ImageDraw.Draw(image)
    for t in things:
        fill = colour(rng)
        x0, y0, x1, y1 = t.box
        if t.shape == "square":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif t.shape == "circle":
            draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            draw.polygon(outline(t.shape, t.box), fill=fill)
    return image


def thing_box(rng: np.random.Generator, shape: str, x: int, y: int, sides=SIDE) -> tuple[int, int, int, int]:
    side = int(rng.integers(sides[0], sides[1] + 1))
    if shape in ("square", "circle"):
        return x, y, x + side, y + side
    width = max(sides[0], min(sides[1], round(side * rng.uniform(0.8, 1.25))))
    return x, y, x + width, y + side


def apart(a: tuple[int, ...], b: tuple[int, ...], gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def scatter(rng, size, things: list[Thing], n: int, gap: int, keep_off=(), keep_gap=0, sides=SIDE) -> None:
    """Add up to `n` shapes of `sides` at random places, `gap` px from each other and `keep_gap` from the boxes
    `keep_off`."""
    for _ in range(n):
        for _attempt in range(200):
            shape = str(rng.choice(SHAPES))
            x, y = int(rng.integers(0, size[0] - sides[1])), int(rng.integers(0, size[1] - sides[1]))
            box = thing_box(rng, shape, x, y, sides)
            if all(apart(box, t.box, gap) for t in things) and all(apart(box, k, keep_gap) for k in keep_off):
                things.append(Thing(shape, box))
                break


def asked(seed: int) -> str:
    """The shape asked of a scene: a square for an even seed, the other shapes in turn for odd ones."""
    return "square" if seed % 2 == 0 else SHAPES[1 + seed // 2 % 4]


def dense(seed: int) -> Drawn:
    rng = np.random.default_rng([41, 5, seed])
    things: list[Thing] = []
    scatter(rng, DENSE_SIZE, things, int(rng.integers(DENSE_COUNT[0], DENSE_COUNT[1] + 1)), int(rng.integers(3, 11)))
    return Drawn(paint(background(rng, DENSE_SIZE), things, rng), tuple(things))


def large(seed: int) -> Drawn:
    rng = np.random.default_rng([41, 7, seed])
    things: list[Thing] = []
    scatter(rng, DENSE_SIZE, things, int(rng.integers(LARGE_COUNT[0], LARGE_COUNT[1] + 1)), 20, sides=LARGE_SIDE)
    return Drawn(paint(background(rng, DENSE_SIZE), things, rng), tuple(things))


def seam(seed: int, in_token_limit: int, patch: int, overlap: float) -> Drawn:
    """One shape across an inner edge of the tiles `tiles="auto"` gives this image (a tile corner in a quarter)."""
    rng = np.random.default_rng([41, 6, seed])
    while True:
        size = tuple(int(rng.integers(lo, hi + 1)) for lo, hi in SEAM_SIZES)
        rows, cols = auto_grid(size, in_token_limit, patch, overlap)
        if rows > 1 and cols > 1:
            break
    tiles = tile_boxes(size, rows, cols, overlap)
    edges = [
        sorted({b[a] for b in tiles if b[a] > 0} | {b[a + 2] for b in tiles if b[a + 2] < size[a]}) for a in (0, 1)
    ]
    shape = asked(seed)
    corner = rng.random() < 0.25
    axis = int(rng.integers(0, 2))
    box = thing_box(rng, shape, 0, 0)
    sides = (box[2], box[3])
    start = [0, 0]
    for a in (0, 1):
        if a == axis or corner:
            edge = int(rng.choice(edges[a]))
            start[a] = edge - round(rng.uniform(*CUT) * sides[a])
        else:
            start[a] = int(rng.integers(0, size[a] - sides[a] + 1))
        start[a] = min(max(start[a], 0), size[a] - sides[a])
    target = Thing(shape, (start[0], start[1], start[0] + sides[0], start[1] + sides[1]))
    things = [target]
    scatter(rng, size, things, int(rng.integers(OTHERS[0], OTHERS[1] + 1)), 4, (target.box,), 10)
    return Drawn(paint(background(rng, size), things, rng), tuple(things), target=0)


# --- Decoding and merging ----------------------------------------------------------------------------------


def decode(model, jobs: list[tuple[Drawn, str]], args) -> list[tuple]:
    """Each (scene, query) as a tiled request: its views and their results, decoded through one engine."""
    parents, children = [], []
    for scene, query in jobs:
        parent = Request(scene.image, query, tiles=args.tiles, tile_overlap=args.overlap, max_tokens=args.max_tokens)
        views = split_request(parent, scene.image, model.runtime.in_token_limit, model.runtime.patch_size)
        parents.append((parent, [replace(v, image=None) for v in views]))  # kept without their crops
        children += views
    results = model.locate_many(children, max_rows=args.batch_size)
    out, at = [], 0
    for parent, views in parents:
        out.append((parent, views, results[at : at + len(views)]))
        at += len(views)
    return out


def views(model, jobs: list[tuple[Drawn, str]], part: str, args) -> list[tuple]:
    """The decoded views of `jobs`, read from `{args.views}-{part}.pkl` when it holds these scenes, else decoded
    (and written there)."""
    if not jobs:
        return []
    key = (args.model, part, len(jobs), args.seed, args.max_tokens, args.overlap, args.tiles)
    path = Path(f"{args.views}-{part}.pkl") if args.views else None
    if path is not None and path.exists():
        cached = pickle.loads(path.read_bytes())
        if cached["key"] != key:
            raise SystemExit(f"{path} holds views of other scenes: {cached['key']} != {key}")
        return cached["decoded"]
    decoded = decode(model, jobs, args)
    if path is not None:
        path.write_bytes(pickle.dumps({"key": key, "decoded": decoded}))
    return decoded


def sahi_greedy_nmm(request, image, views, results) -> list[tuple[str, tuple[float, ...]]]:
    """SAHI's GREEDYNMM with IOS on every view's boxes in image pixels: (label, box) kept."""
    boxes = []
    for view, result in zip(views, results, strict=True):
        x0, y0 = (0, 0) if view.tag.whole else view.tag.box[:2]
        for o in result.objects:
            if o.box is not None:
                b = (o.box[0] + x0, o.box[1] + y0, o.box[2] + x0, o.box[3] + y0)
                boxes.append((o.confidence or 0.0, o.label, b))
    boxes.sort(key=lambda t: -t[0])
    kept = []
    while boxes:
        score, label, box = boxes.pop(0)
        merged, rest = list(box), []
        for other in boxes:
            b = other[2]
            inter = max(0, min(box[2], b[2]) - max(box[0], b[0])) * max(0, min(box[3], b[3]) - max(box[1], b[1]))
            smaller = min((box[2] - box[0]) * (box[3] - box[1]), (b[2] - b[0]) * (b[3] - b[1]))
            if other[1] == label and smaller > 0 and inter / smaller >= SAHI_IOS:
                merged = [min(merged[0], b[0]), min(merged[1], b[1]), max(merged[2], b[2]), max(merged[3], b[3])]
            else:
                rest.append(other)
        boxes = rest
        kept.append((label, tuple(merged)))
    return kept


METHODS = {
    "merge_results": lambda r, i, v, res: [(o.label, o.box) for o in merge_results(r, i, v, res).objects if o.box],
    "SAHI greedy NMM": sahi_greedy_nmm,
    "whole image": lambda r, i, v, res: [(o.label, o.box) for o in res[0].objects if o.box is not None],
}


def inside(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """How much of box `a` lies inside box `b`."""
    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
    return inter / max((a[2] - a[0]) * (a[3] - a[1]), 1e-9)


def false_kind(box, truth: list, found: list, others: list) -> str:
    if any(iou(box, f) >= MATCH or inside(box, f) >= 0.8 for f in found):
        return "duplicate"
    if any(inside(box, t) >= 0.5 for t in truth):
        return "piece"
    if any(inside(box, t) >= 0.5 for t in others):
        return "another shape"
    return "nothing"


def scored(decoded: list[tuple], jobs: list[tuple[Drawn, str]], method) -> dict:
    tp = pred = gt = 0
    kinds = {"duplicate": 0, "piece": 0, "another shape": 0, "nothing": 0}
    for (request, views, results), (scene, query) in zip(decoded, jobs, strict=True):
        boxes = [b for label, b in method(request, scene.image, views, results) if label == query]
        truth = [tuple(map(float, t.box)) for t in scene.things if t.shape == query]
        others = [tuple(map(float, t.box)) for t in scene.things if t.shape != query]
        pairs = sorted(((iou(p, g), i, j) for i, p in enumerate(boxes) for j, g in enumerate(truth)), reverse=True)
        used_p, used_g = set(), set()
        for value, i, j in pairs:
            if value >= MATCH and i not in used_p and j not in used_g:
                used_p.add(i)
                used_g.add(j)
        assert len(used_p) == len(greedy_match(boxes, truth, MATCH))
        found = [truth[j] for j in used_g]
        for i, b in enumerate(boxes):
            if i not in used_p:
                kinds[false_kind(b, truth, found, others)] += 1
        tp, pred, gt = tp + len(used_p), pred + len(boxes), gt + len(truth)
    recall, precision = tp / gt if gt else 0.0, tp / pred if pred else 0.0
    return {"matched": tp, "predicted": pred, "objects": gt, "recall": recall, "precision": precision, "false": kinds}


def own_errors(decoded: list[tuple], jobs: list[tuple[Drawn, str]], matched: int) -> dict:
    """The model's own false boxes: boxes of the asked shape a tile holds and no object matches, those of them no
    other tile holds, and the precision a merge that dropped every other false box would reach."""
    held = false = alone = 0
    for (_, views, results), (scene, query) in zip(decoded, jobs, strict=True):
        truth = [t.box for t in scene.things if t.shape == query]
        tiles = [v.tag for v in views if not v.tag.whole]
        for view, result in zip(views, results, strict=True):
            for o in result.objects:
                box = to_image(o, view.tag, scene.image.size).box
                if view.tag.whole or box is None or o.label != query or not holds(view.tag, box, scene.image.size):
                    continue
                held += 1
                if not any(iou(box, t) >= MATCH for t in truth):
                    false += 1
                    alone += sum(holds(t, box, scene.image.size) for t in tiles) == 1
    return {
        "held": held,
        "false": false,
        "held by no other tile": alone,
        "precision bound": matched / (matched + alone),
    }


def seam_counts(decoded: list[tuple], scenes: list[Drawn], method) -> dict:
    """Placements whose object comes back once, more than once, or not at all (no box of IoU >= 0.5); of the
    missed, those no view drew at IoU >= 0.5 (no merge can give them), and the same by shape."""
    counts = {"once": 0, "more": 0, "missed": 0, "no view drew it": 0, "by shape": {}}
    for (request, views, results), scene in zip(decoded, scenes, strict=True):
        target = scene.things[scene.target]
        boxes = [b for label, b in method(request, scene.image, views, results) if label == target.shape]
        over = [b for b in boxes if iou(b, target.box) > 0]
        if len(over) > 1:
            outcome = "more"
        else:
            outcome = "once" if over and iou(over[0], target.box) >= MATCH else "missed"
        counts[outcome] += 1
        shape = counts["by shape"].setdefault(target.shape, {"once": 0, "placements": 0})
        shape["once"] += outcome == "once"
        shape["placements"] += 1
        drawn = [
            (o.box[0] + v.tag.box[0] * (not v.tag.whole), o.box[1] + v.tag.box[1] * (not v.tag.whole))
            + (o.box[2] + v.tag.box[0] * (not v.tag.whole), o.box[3] + v.tag.box[1] * (not v.tag.whole))
            for v, r in zip(views, results, strict=True)
            for o in r.objects
            if o.box is not None and o.label == target.shape
        ]
        counts["no view drew it"] += outcome == "missed" and not any(iou(b, target.box) >= MATCH for b in drawn)
    return counts


# --- Confidences -------------------------------------------------------------------------------------------

QUANTILES = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def matched_pairs(boxes: list, truth: list) -> dict[int, int]:
    """Greedy matching at IoU `MATCH`, highest first: box index -> truth index."""
    pairs = sorted(((iou(p, g), i, j) for i, p in enumerate(boxes) for j, g in enumerate(truth)), reverse=True)
    out: dict[int, int] = {}
    for value, i, j in pairs:
        if value >= MATCH and i not in out and j not in out.values():
            out[i] = j
    return out


def median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def confidence_records(decoded: list[tuple], jobs: list[tuple[Drawn, str]], part: str) -> list[dict]:
    """One record per box of the asked shape, of every view ("tile" or "whole") and of the groups the merge
    keeps ("merged"): its confidence, over the median of the request's boxes ("relative"), and what it is."""
    records = []
    for index, ((_, views, results), (scene, query)) in enumerate(zip(decoded, jobs, strict=True)):
        records += scene_records(views, results, scene, query, {"part": part, "scene": index})
    return records


def scene_records(views: list, results: list, scene: Drawn, query: str, where: dict) -> list[dict]:
    size = scene.image.size
    truth = [tuple(map(float, t.box)) for t in scene.things if t.shape == query]
    others = [tuple(map(float, t.box)) for t in scene.things if t.shape != query]
    tiles = [v.tag for v in views if not v.tag.whole]
    reference = median(  # `tiles.label_medians`: every view's objects of the label
        [o.confidence for r in results for o in r.objects if o.label == query and o.confidence is not None]
    )
    records = []

    def record(boxes: list, confidences: list, source: str, more: list[dict]) -> None:
        """`boxes` of one view (or the merge's): true when the greedy matching gives them an object, else of a
        false kind, a duplicate when another of `boxes` took its object."""
        pairs = matched_pairs(boxes, truth)
        for i, (box, conf) in enumerate(zip(boxes, confidences, strict=True)):
            found = [truth[j] for k, j in pairs.items() if k != i]
            what = "true" if i in pairs else false_kind(box, truth, found, others)
            relative = None if conf is None or not reference else conf / reference
            records.append(where | {"source": source, "confidence": conf, "relative": relative, "what": what} | more[i])

    for view, result in zip(views, results, strict=True):
        objects = [to_image(o, view.tag, size) for o in result.objects if o.label == query and o.box is not None]
        boxes, confidences = [o.box for o in objects], [o.confidence for o in objects]
        if view.tag.whole:
            record(boxes, confidences, "whole", [{} for _ in boxes])
            continue
        more = []
        for box in boxes:
            on, covers = seams(box, view.tag, size)
            held = holds(view.tag, box, size)
            alone = held and sum(holds(t, box, size) for t in tiles) == 1
            more.append({"held": held, "alone": alone, "cut": any(on), "covers": covers})
        record(boxes, confidences, "tile", more)
    groups, _, _ = merged_groups(views, results, size)
    groups = [g for g in groups if g.best.object.label == query and g.best.object.box is not None]
    confidences = []
    for g in groups:
        values = [m.object.confidence for m in g.members if m.object.confidence is not None]
        confidences.append(max(values) if values else None)
    more = [{"views": len({m.view for m in g.members}), "whole": any(m.tile.whole for m in g.members)} for g in groups]
    record([g.best.object.box for g in groups], confidences, "merged", more)
    return records


def quantiles(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {"n": len(values)} | {f"q{round(q * 100)}": round(float(np.quantile(values, q)), 3) for q in QUANTILES}


CONFIDENCE_SETS = {
    "tile boxes, true": lambda r: r["source"] == "tile" and r["what"] == "true",
    "tile boxes, false": lambda r: r["source"] == "tile" and r["what"] != "true",
    "tile boxes held, true": lambda r: r["source"] == "tile" and r["held"] and r["what"] == "true",
    "tile boxes held, false (the model's own)": lambda r: r["source"] == "tile" and r["held"] and r["what"] != "true",
    "... held by no other tile": lambda r: r["source"] == "tile" and r["alone"] and r["what"] != "true",
    "tile boxes not held (near an inner edge), true": lambda r: (
        r["source"] == "tile" and not r["held"] and r["what"] == "true"
    ),
    "tile boxes not held, false": lambda r: r["source"] == "tile" and not r["held"] and r["what"] != "true",
    **{
        f"tile boxes, false: {kind}": (lambda k: lambda r: r["source"] == "tile" and r["what"] == k)(kind)
        for kind in ("duplicate", "piece", "another shape", "nothing")
    },
    "whole image, true": lambda r: r["source"] == "whole" and r["what"] == "true",
    "whole image, false": lambda r: r["source"] == "whole" and r["what"] != "true",
    "merged, one view, true": lambda r: r["source"] == "merged" and r["views"] == 1 and r["what"] == "true",
    "merged, one view, false": lambda r: r["source"] == "merged" and r["views"] == 1 and r["what"] != "true",
    "merged, several views, true": lambda r: r["source"] == "merged" and r["views"] > 1 and r["what"] == "true",
    "merged, several views, false": lambda r: r["source"] == "merged" and r["views"] > 1 and r["what"] != "true",
}


def confidence_report(records: list[dict]) -> dict:
    """Quantiles of the confidence and of the relative confidence, per part and set of boxes."""
    out = {}
    for part in ("dense", "seams", "large"):
        mine = [r for r in records if r["part"] == part]
        out[part] = {
            name: {
                "confidence": quantiles([r["confidence"] for r in mine if test(r)]),
                "relative": quantiles([r["relative"] for r in mine if test(r)]),
            }
            for name, test in CONFIDENCE_SETS.items()
        }
        out[part]["no confidence"] = sum(r["confidence"] is None for r in mine)
    return out


def confidence_table(report: dict) -> str:
    rows = []
    for part, sets in report.items():
        rows += [
            "",
            f"Confidences, {part} (q0 / q5 / q10 / q25 / q50 / q75 / q90 / q100; relative: over the median of the "
            f"request's boxes, every view's; {sets['no confidence']} boxes without a confidence)",
            "",
            "| boxes | n | confidence | relative |",
            "|---|---|---|---|",
        ]
        for name in CONFIDENCE_SETS:
            c, r = sets[name]["confidence"], sets[name]["relative"]
            if not c["n"]:
                continue
            spell = lambda q: " / ".join(f"{q[f'q{round(x * 100)}']:.2f}" for x in QUANTILES)  # noqa: E731
            rows.append(f"| {name} | {c['n']} | {spell(c)} | {spell(r) if r['n'] else ''} |")
    return "\n".join(rows)


def table(report: dict) -> str:
    d, s, g = report["dense"], report["seams"], report["large"]
    own = d["own errors"]
    rows = [
        f"Dense: {d['scenes']} scenes of {DENSE_SIZE[0]} x {DENSE_SIZE[1]} px, {d['requests']} requests "
        f"(square in every other scene, the other shapes in turn), {d['views']} views, {d['objects']} objects asked; "
        f"seams: {s['placements']} placements; large: {g['scenes']} scenes, {g['objects']} objects asked; "
        f"tiles {report['tiles']}, overlap {report['overlap']}",
        f"The model's own: {own['false']} of the {own['held']} boxes tiles held match no object, "
        f"{own['held by no other tile']} of them held by no other tile "
        f"(precision at most {own['precision bound']:.3f})",
        "",
        "| merge | recall | precision | false: duplicate / piece / another shape / nothing | seam object once | "
        "seam squares once | large: recall / precision |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        m, c, big = d["methods"][name], s["methods"][name], g["methods"][name]
        squares = c["by shape"].get("square", {})
        f = m["false"]
        rows.append(
            f"| {name} | {m['recall']:.3f} ({m['matched']}/{m['objects']}) | {m['precision']:.3f} "
            f"({m['matched']}/{m['predicted']}) | {f['duplicate']} / {f['piece']} / {f['another shape']} / "
            f"{f['nothing']} | {c['once']} of {s['placements']} ({c['more']} more, {c['missed']} missed, "
            f"{c['no view drew it']} of them drawn by no view) | "
            f"{squares.get('once', 0)} of {squares.get('placements', 0)} | "
            f"{big['recall']:.3f} ({big['matched']}/{big['objects']}) / {big['precision']:.3f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--dense", type=int, default=30, help="dense scenes (default: 30)")
    p.add_argument("--seams", type=int, default=24, help="seam placements (default: 24)")
    p.add_argument("--large", type=int, default=10, help="large-shape scenes (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="first scene seed (default: 0)")
    p.add_argument(
        "--overlap", type=float, default=Request(None, "").tile_overlap, help="tile_overlap (default: the Request's)"
    )
    p.add_argument(
        "--tiles",
        type=parse_tiles,
        default="auto",
        help="auto or ROWSxCOLS (default: auto); seam placements follow the auto grid, so give --seams 0 with a grid",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, help="engine rows (default: the engine's)")
    p.add_argument(
        "--views",
        help="PREFIX of files of decoded views (PREFIX-dense.pkl, -seams.pkl, -large.pkl): read when "
        "they exist (the same scenes), else written",
    )
    p.add_argument(
        "--confidences",
        action="store_true",
        help="also the confidences of the views' boxes and of the merged objects, true vs false (quantiles)",
    )
    p.add_argument("--note", default="", help="the machine's state, stored with the figures")
    p.add_argument("--json", help="output JSON (default: none)")
    args = p.parse_args(argv)
    model = load(args.model)
    seeds = range(args.seed, args.seed + max(args.dense, args.seams, args.large))
    dense_jobs = [(dense(s), asked(s)) for s in seeds[: args.dense]]
    limit, patch = model.runtime.in_token_limit, model.runtime.patch_size
    seam_scenes = [seam(s, limit, patch, args.overlap) for s in seeds[: args.seams]]
    large_jobs = [(scene, scene.things[0].shape) for scene in map(large, seeds[: args.large])]
    seam_jobs = [(scene, scene.things[scene.target].shape) for scene in seam_scenes]
    t0 = time.perf_counter()
    dense_decoded = views(model, dense_jobs, "dense", args)
    seam_decoded = views(model, seam_jobs, "seams", args)
    large_decoded = views(model, large_jobs, "large", args)
    decode_s = time.perf_counter() - t0
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/tiles_merge_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "machine": f"{platform.machine()} {platform.processor()} {platform.system()}",
        "note": args.note,
        "max_tokens": args.max_tokens,
        "overlap": args.overlap,
        "tiles": args.tiles,
        "decode_s": decode_s,
        "dense": {
            "scenes": args.dense,
            "requests": len(dense_jobs),
            "views": sum(len(v) for _, v, _ in dense_decoded),
            "objects": sum(1 for s, q in dense_jobs for t in s.things if t.shape == q),
            "methods": {name: scored(dense_decoded, dense_jobs, m) for name, m in METHODS.items()},
        },
        "large": {
            "scenes": args.large,
            "objects": sum(1 for s, q in large_jobs for t in s.things if t.shape == q),
            "methods": {name: scored(large_decoded, large_jobs, m) for name, m in METHODS.items()},
        },
        "seams": {
            "placements": args.seams,
            "sizes": [list(s.image.size) for s in seam_scenes],
            "shapes": [s.things[s.target].shape for s in seam_scenes],
            "methods": {name: seam_counts(seam_decoded, seam_scenes, m) for name, m in METHODS.items()},
        },
    }
    matched = report["dense"]["methods"]["merge_results"]["matched"]
    report["dense"]["own errors"] = own_errors(dense_decoded, dense_jobs, matched)
    text = table(report)
    if args.confidences:
        records = (
            confidence_records(dense_decoded, dense_jobs, "dense")
            + confidence_records(seam_decoded, seam_jobs, "seams")
            + confidence_records(large_decoded, large_jobs, "large")
        )
        report["confidences"] = confidence_report(records)
        text += "\n" + confidence_table(report["confidences"])
    print(text)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "table": text}, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
