"""Synthetic shape scenes, grounding tasks in the real prompt grammar, and fine-tuning data made of them.

Everything here is deterministic: `make_sample(seed, index, split)` draws from a numpy generator keyed on
(split, seed, index), so a sample does not depend on how many were drawn before it or by which process.
Answers follow docs/model.md §9 and docs/training.md §4.3-§4.4.

    scene  = 0-4 shapes (circle, square, triangle, diamond, star) x 6 colours on a light background
    tasks  = detect (1-3 shape categories), refer (all matches), single (one match), point, negatives
    answer = "<ref>red circle</ref><box><120><340><410><620></box>..." (the tokenizer adds <|im_end|>)

    python -m mlx_locate.synthetic.scenes --word ring --out ring_data   # fine-tuning data about a new shape
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..prompts import task_text

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (45, 85, 215),
    "yellow": (230, 200, 30),
    "purple": (135, 55, 175),
    "orange": (240, 135, 25),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star")
# Drawn here but never in the demo's training data: what fine-tuning teaches it (`make_novel_sample`).
NOVEL_SHAPES = ("ring", "cross")
NOVEL_COLORS = {"black": (35, 35, 35)}
SIDES = (112, 140, 168, 196, 224)  # image sides: multiples of 28, so preprocessing never resizes
MAX_OBJECTS = 4
SIZE_RANGE = (0.18, 0.40)  # object side, as a fraction of the image's shorter side
COLOR_JITTER = 18
TASK_SHARES = {"detect": 0.35, "refer": 0.25, "single": 0.10, "point": 0.15, "negative": 0.15}
DETECT_CATEGORY_COUNTS = {1: 0.5, 2: 0.35, 3: 0.15}  # categories per detection prompt
SPLITS = {"train": 0, "eval": 1}

# --- Scenes -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Obj:
    shape: str
    color: str
    box: tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels (x2, y2 exclusive): the shape's tight extent

    @property
    def center(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.box
        return (x1 + x2) / 2, (y1 + y2) / 2


@dataclass(frozen=True)
class Scene:
    image: Image.Image
    objects: tuple[Obj, ...]

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def _polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]] | None:
    x1, y1, x2, y2 = box
    r, b = x2 - 1, y2 - 1  # PIL includes the last pixel
    cx, cy = (x1 + r) / 2, (y1 + b) / 2
    if shape == "triangle":
        return [(cx, y1), (r, b), (x1, b)]
    if shape == "diamond":
        return [(cx, y1), (r, cy), (cx, b), (x1, cy)]
    if shape == "cross":  # a plus sign, arms a third of the box wide
        x3, y3 = (r - x1) / 3, (b - y1) / 3
        xs, ys = (x1, x1 + x3, r - x3, r), (y1, y1 + y3, b - y3, b)
        return [
            (xs[1], ys[0]), (xs[2], ys[0]), (xs[2], ys[1]), (xs[3], ys[1]), (xs[3], ys[2]), (xs[2], ys[2]),
            (xs[2], ys[3]), (xs[1], ys[3]), (xs[1], ys[2]), (xs[0], ys[2]), (xs[0], ys[1]), (xs[1], ys[1]),
        ]  # fmt: skip
    if shape == "star":
        # Ten vertices scaled so that their extent is exactly the box.
        angles = [math.pi / 2 + k * math.pi / 5 for k in range(10)]
        radii = [1.0 if k % 2 == 0 else 0.45 for k in range(10)]
        xs = [rad * math.cos(a) for rad, a in zip(radii, angles, strict=True)]
        ys = [-rad * math.sin(a) for rad, a in zip(radii, angles, strict=True)]
        sx, sy = (r - x1) / (max(xs) - min(xs)), (b - y1) / (max(ys) - min(ys))
        return [(x1 + (x - min(xs)) * sx, y1 + (y - min(ys)) * sy) for x, y in zip(xs, ys, strict=True)]
    return None


def draw_object(draw: ImageDraw.ImageDraw, obj: Obj, fill: tuple[int, int, int]) -> None:
    """Draw `obj`'s shape over its box in `fill` (a ring as an outline, the rest filled)."""
    x1, y1, x2, y2 = obj.box
    if obj.shape == "circle":
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), fill=fill)
    elif obj.shape == "ring":  # a circle's outline, a fifth of its side wide
        draw.ellipse((x1, y1, x2 - 1, y2 - 1), outline=fill, width=max(2, (x2 - x1) // 5))
    elif obj.shape == "square":
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=fill)
    else:
        draw.polygon(_polygon(obj.shape, obj.box), fill=fill)


def overlaps(a: tuple[int, ...], b: tuple[int, ...], margin: int = 3) -> bool:
    """Whether boxes `a` and `b` (x1, y1, x2, y2) come closer than `margin` pixels."""
    return a[0] < b[2] + margin and b[0] < a[2] + margin and a[1] < b[3] + margin and b[1] < a[3] + margin


def make_scene(
    rng: np.random.Generator,
    n_objects: int | None = None,
    shapes: tuple[str, ...] = SHAPES,
    required: tuple[str, ...] = (),
    sides: tuple[int, ...] = SIDES,
    colors: dict[str, tuple[int, int, int]] = COLORS,
) -> Scene:
    """A W x H image (sides from `sides`) with `n_objects` (default 1-4, evenly) non-overlapping shapes drawn
    from a palette of `shapes` that holds `required` (shapes or colour names), in `colors`."""
    width, height = (int(rng.choice(sides)) for _ in range(2))
    if n_objects is None:
        n_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    # A small palette per scene, so that colours and shapes repeat and "all the red circles" means several.
    palette_colors = rng.choice(list(colors), size=int(rng.integers(1, 4)), replace=False).tolist()
    palette_shapes = rng.choice(shapes, size=int(rng.integers(1, min(4, len(shapes) + 1))), replace=False).tolist()
    palette_shapes += [s for s in required if s in shapes and s not in palette_shapes]
    palette_colors += [c for c in required if c in colors and c not in palette_colors]
    short = min(width, height)
    objects: list[Obj] = []
    for _ in range(n_objects):
        for _attempt in range(60):
            side = int(rng.uniform(*SIZE_RANGE) * short)
            shape = str(rng.choice(palette_shapes))
            w = side if shape in ("circle", "square", "ring") else int(side * rng.uniform(0.8, 1.25))
            w, h = min(w, width - 2), min(side, height - 2)
            x1, y1 = int(rng.integers(1, width - w)), int(rng.integers(1, height - h))
            box = (x1, y1, x1 + w, y1 + h)
            if not any(overlaps(box, o.box) for o in objects):
                objects.append(Obj(shape, str(rng.choice(palette_colors)), box))
                break

    background = tuple(int(v) for v in rng.integers(200, 250) + rng.integers(-8, 9, size=3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    if rng.random() < 0.5:  # clutter: grey lines and dots, never in a shape colour
        for _ in range(int(rng.integers(1, 8))):
            grey = int(rng.integers(90, 190))
            x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
            if rng.random() < 0.5:
                dx, dy = (int(v) for v in rng.integers(-40, 41, size=2))
                draw.line((x, y, x + dx, y + dy), fill=(grey, grey, grey), width=int(rng.integers(1, 3)))
            else:
                r = int(rng.integers(1, 4))
                draw.ellipse((x - r, y - r, x + r, y + r), fill=(grey, grey, grey))
    for obj in objects:
        fill = tuple(int(np.clip(c + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1), 0, 255)) for c in colors[obj.color])
        draw_object(draw, obj, fill)
    return Scene(image, tuple(objects))


# --- Tasks and answers ------------------------------------------------------------------------------------


def norm_coords(values: tuple[float, ...], size: tuple[int, int]) -> tuple[int, ...]:
    """Pixels -> 0..1000 (x by width, y by height): `round(v / W * 1000)`, clamped (docs/training.md §4.3)."""
    return tuple(min(max(round(v / size[i % 2] * 1000), 0), 1000) for i, v in enumerate(values))


def _coords_text(values: tuple[int, ...]) -> str:
    return "".join(f"<{v}>" for v in values)


@dataclass(frozen=True)
class Phrase:
    color: str | None
    shape: str | None
    text: str

    def matches(self, obj: Obj) -> bool:
        return (self.color is None or obj.color == self.color) and (self.shape is None or obj.shape == self.shape)


@dataclass(frozen=True)
class Target:
    """One ground-truth item of a sample: a box (or, for pointing, the box whose point is asked for)."""

    label: str | None  # the category or phrase it answers; None for pointing
    box: tuple[int, int, int, int]  # pixels
    box_norm: tuple[int, int, int, int]
    point_norm: tuple[int, int] | None  # pointing only


@dataclass(frozen=True)
class Task:
    task: str  # prompts.TASK_TEMPLATES key: detect, refer, single, point
    query: str | list[str]  # a phrase, or the detection categories
    answer: str  # the answer text without <|im_end|>
    targets: tuple[Target, ...]
    negative: bool  # some asked-for phrase or category is absent (its answer is <box>None</box>)


@dataclass(frozen=True)
class Sample:
    scene: Scene
    task: Task


def _order(objs: list[Obj]) -> list[Obj]:
    return sorted(objs, key=lambda o: (o.box[0], o.box[1]))  # ascending x1, then y1 (docs/training.md §4.3)


def _phrase(rng: np.random.Generator, color: str | None, shape: str | None, allow_long: bool = True) -> Phrase:
    if color is None:
        return Phrase(None, shape, shape)
    if shape is None:
        return Phrase(color, None, f"{color} shape")
    style = rng.random()
    if allow_long and style < 0.3:  # 7 tokens: trains continuation blocks of long labels
        return Phrase(color, shape, f"any {color} {shape} in the image")
    if style < 0.45:
        return Phrase(color, shape, f"the {color} {shape}")
    return Phrase(color, shape, f"{color} {shape}")


def _present_phrase(rng: np.random.Generator, objects: tuple[Obj, ...]) -> Phrase:
    anchor = objects[int(rng.integers(len(objects)))]
    kind = rng.random()
    if kind < 0.7:
        return _phrase(rng, anchor.color, anchor.shape)
    if kind < 0.85:
        return _phrase(rng, None, anchor.shape)
    return _phrase(rng, anchor.color, None)


def _absent_phrase(rng: np.random.Generator, objects: tuple[Obj, ...]) -> Phrase:
    """A colour-shape pair that no object has; half of the time a hard negative (its colour or shape is there)."""
    pairs = {(o.color, o.shape) for o in objects}
    absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in pairs]
    colors, shapes = {o.color for o in objects}, {o.shape for o in objects}
    hard = [(c, s) for c, s in absent if c in colors or s in shapes]
    pool = hard if hard and rng.random() < 0.5 else absent
    color, shape = pool[int(rng.integers(len(pool)))]
    kind = rng.random()
    if kind < 0.8 or not objects:
        return _phrase(rng, color, shape)
    if shape not in shapes:
        return _phrase(rng, None, shape)
    if color not in colors:
        return _phrase(rng, color, None)
    return _phrase(rng, color, shape)


def _target(label: str | None, obj: Obj, size: tuple[int, int], point: bool = False) -> Target:
    return Target(
        label,
        obj.box,
        norm_coords(obj.box, size),
        norm_coords(obj.center, size) if point else None,
    )


def _grounding(task: str, phrase: Phrase, scene: Scene) -> Task:
    size = scene.size
    matched = _order([o for o in scene.objects if phrase.matches(o)])
    if task == "point":
        targets = [_target(None, o, size, point=True) for o in matched]
        targets.sort(key=lambda t: t.point_norm)  # points in ascending x, then y
        body = "".join(f"<box>{_coords_text(t.point_norm)}</box>" for t in targets) or "<box>None</box>"
        return Task("point", phrase.text, body, tuple(targets), not matched)
    targets = [_target(phrase.text, o, size) for o in matched]
    boxes = "".join(f"<box>{_coords_text(t.box_norm)}</box>" for t in targets) or "<box>None</box>"
    return Task(task, phrase.text, f"<ref>{phrase.text}</ref>{boxes}", tuple(targets), not matched)


def _detection(rng: np.random.Generator, scene: Scene, negative: bool) -> Task:
    present = sorted({o.shape for o in scene.objects}, key=SHAPES.index)
    absent = [s for s in SHAPES if s not in present]
    n = int(rng.choice(list(DETECT_CATEGORY_COUNTS), p=list(DETECT_CATEGORY_COUNTS.values())))
    if negative or not present:
        chosen = rng.choice(absent, size=min(n, len(absent)), replace=False).tolist()
    else:
        k = min(n, len(present))
        chosen = rng.choice(present, size=k, replace=False).tolist()
        extra = [s for s in absent if rng.random() < 0.15][: n - k]  # an absent category keeps its place
        chosen += extra
        rng.shuffle(chosen)
    negative = any(not any(o.shape == c for o in scene.objects) for c in chosen)
    return Task("detect", chosen, *_detection_answer(scene, chosen), negative)


def _detection_answer(scene: Scene, categories: list[str]) -> tuple[str, tuple[Target, ...]]:
    """The answer to a detection prompt of `categories` (each one's boxes in reading order, or None) and its
    targets."""
    parts, targets = [], []
    for category in categories:
        matched = _order([o for o in scene.objects if o.shape == category])
        for o in matched:
            t = _target(category, o, scene.size)
            targets.append(t)
            parts.append(f"<ref>{category}</ref><box>{_coords_text(t.box_norm)}</box>")
        if not matched:
            parts.append(f"<ref>{category}</ref><box>None</box>")
    return "".join(parts), tuple(targets)


def make_task(rng: np.random.Generator, scene: Scene) -> Task:
    kind = str(rng.choice(list(TASK_SHARES), p=list(TASK_SHARES.values())))
    if kind == "detect":
        return _detection(rng, scene, negative=False)
    if kind == "negative" or not scene.objects:
        which = rng.random()
        if which < 0.25:
            return _detection(rng, scene, negative=True)
        task = "point" if which < 0.5 else ("single" if which < 0.6 else "refer")
        return _grounding(task, _absent_phrase(rng, scene.objects), scene)
    if kind == "single":
        counts: dict[tuple[str, str], int] = {}
        for o in scene.objects:
            counts[(o.color, o.shape)] = counts.get((o.color, o.shape), 0) + 1
        unique = [pair for pair, c in counts.items() if c == 1]
        if unique:
            color, shape = unique[int(rng.integers(len(unique)))]
            return _grounding("single", _phrase(rng, color, shape), scene)
        kind = "refer"
    return _grounding(kind, _present_phrase(rng, scene.objects), scene)


def make_sample(seed: int, index: int, split: str = "train") -> Sample:
    """Sample `index` of the stream `(split, seed)`; the same arguments always give the same sample."""
    rng = np.random.default_rng([SPLITS[split], seed, index])
    n_objects = 0 if rng.random() < 0.04 else None
    scene = make_scene(rng, n_objects)
    return Sample(scene, make_task(rng, scene))


NOVEL_SPLITS = {"train": 2, "eval": 3}  # streams of their own, apart from the demo's
NOVEL_SIDES = (112,)


def make_novel_sample(seed: int, index: int, split: str = "train", word: str = "ring") -> Sample:
    """A sample about `word`, a colour (`NOVEL_COLORS`) or shape (`NOVEL_SHAPES`) the demo model never saw,
    among the ones it knows; 112 x 112 images of 1-3 objects.

    A colour: referring phrases ("black square", "the black circle", "black shape", ...) for all matching
    objects; 15 % of the training ones ask for a `word` object that is absent (`<box>None</box>`). A shape:
    detection of `word`, 15 % of the training samples with a known shape too and 15 % without any `word`.
    Held-out samples always ask for something present.
    """
    rng = np.random.default_rng([NOVEL_SPLITS[split], seed, index])
    negative = split == "train" and rng.random() < 0.15
    colors = {**COLORS, **NOVEL_COLORS}
    if negative and word in NOVEL_SHAPES:
        scene = make_scene(rng, int(rng.integers(1, 4)), SHAPES, (), NOVEL_SIDES, colors)
    else:
        while True:  # the placement may drop every `word` object; draw again
            shapes = SHAPES + (word,) if word in NOVEL_SHAPES else SHAPES
            scene = make_scene(rng, int(rng.integers(1, 4)), shapes, (word,), NOVEL_SIDES, colors)
            if any(word in (o.color, o.shape) for o in scene.objects):
                break
    if word in NOVEL_COLORS:
        present = sorted({o.shape for o in scene.objects if o.color == word})
        if negative:
            absent = [s for s in SHAPES if s not in present]
            return Sample(scene, _grounding("refer", _phrase(rng, word, str(rng.choice(absent))), scene))
        shape = None if rng.random() < 0.2 else present[int(rng.integers(len(present)))]
        return Sample(scene, _grounding("refer", _phrase(rng, word, shape), scene))
    categories = [word]
    known = sorted({o.shape for o in scene.objects} - {word})
    if not negative and known and rng.random() < 0.18:
        categories.insert(int(rng.integers(2)), known[int(rng.integers(len(known)))])
    if negative and known and rng.random() < 0.5:
        categories.insert(int(rng.integers(2)), known[int(rng.integers(len(known)))])
    return Sample(scene, Task("detect", categories, *_detection_answer(scene, categories), negative))


WORD_ONLY_SPLITS = {"train": 4, "eval": 5}
DISTRACTORS = ("circle", "square")


def make_word_only_sample(
    seed: int, index: int, split: str = "train", word: str = "cross", distractors: tuple[str, ...] = DISTRACTORS
) -> Sample:
    """A scene of `word` (a shape of `NOVEL_SHAPES`) among `distractors` (known shapes) in which only `word` is
    labelled: detection of `word` alone, 15 % of the training samples without any (`<box>None</box>`). Data as a
    user has it: nothing in it reminds the model of the distractors' names. 112 x 112 images of 1-3 objects."""
    if word not in NOVEL_SHAPES or not distractors or not set(distractors) <= set(SHAPES):
        raise ValueError(f"word must be one of {NOVEL_SHAPES} and distractors known shapes ({', '.join(SHAPES)})")
    rng = np.random.default_rng([WORD_ONLY_SPLITS[split], seed, index])
    n = int(rng.integers(1, 4))
    if split == "train" and rng.random() < 0.15:
        scene = make_scene(rng, n, distractors, (), NOVEL_SIDES)
    else:
        while True:  # the placement may drop every `word` object; draw again
            scene = make_scene(rng, n, (word, *distractors), (word,), NOVEL_SIDES)
            if any(o.shape == word for o in scene.objects):
                break
    return Sample(scene, Task("detect", [word], *_detection_answer(scene, [word]), False))


def kept_tasks(scene: Scene, categories: tuple[str, ...]) -> list[Task]:
    """Detection of each of `categories` alone, answered from the scene (`<box>None</box>` when absent)."""
    return [Task("detect", [c], *_detection_answer(scene, [c]), False) for c in categories]


def _write_split(folder: Path, split: str, samples: list[tuple[Scene, list[Task]]]) -> None:
    (folder / split).mkdir(parents=True, exist_ok=True)
    with (folder / f"{split}.jsonl").open("w") as f:
        for i, (scene, tasks) in enumerate(samples):
            name = f"{split}/{i:05d}.png"
            scene.image.save(folder / name)
            for task in tasks:
                human = {"from": "human", "value": task_text(task.task, task.query)}
                answer = {"from": "gpt", "value": task.answer}
                f.write(json.dumps({"image": name, "conversations": [human, answer]}) + "\n")


def write_novel_data(folder: Path, word: str = "ring", train: int = 300, held_out: int = 24, seed: int = 0) -> Path:
    """`make_novel_sample`s as fine-tuning data: `train.jsonl` and `eval.jsonl` in LocateAnything's SFT format,
    images under `train/` and `eval/`. Returns `folder`."""
    for split, n in (("train", train), ("eval", held_out)):
        samples = [make_novel_sample(seed, i, split, word) for i in range(n)]
        _write_split(folder, split, [(s.scene, [s.task]) for s in samples])
    return folder


def write_word_only_data(
    folder: Path,
    word: str = "cross",
    distractors: tuple[str, ...] = DISTRACTORS,
    train: int = 300,
    held_out: int = 24,
    seed: int = 0,
) -> Path:
    """`make_word_only_sample`s as fine-tuning data (`train.jsonl`, `eval.jsonl`, images under `train/`, `eval/`).
    Each held-out image also asks for every distractor alone, answered from the scene: those records measure what
    the model forgets. Returns `folder`."""
    train_samples = [make_word_only_sample(seed, i, "train", word, distractors) for i in range(train)]
    _write_split(folder, "train", [(s.scene, [s.task]) for s in train_samples])
    held = [make_word_only_sample(seed, i, "eval", word, distractors) for i in range(held_out)]
    _write_split(folder, "eval", [(s.scene, [s.task, *kept_tasks(s.scene, distractors)]) for s in held])
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mlx_locate.synthetic.scenes",
        description="Write fine-tuning data about a shape or colour the demo model never saw (SFT JSONL + PNGs).",
    )
    p.add_argument("--out", required=True, type=Path, help="folder for train.jsonl, eval.jsonl, train/, eval/")
    p.add_argument("--word", default="ring", choices=[*NOVEL_SHAPES, *NOVEL_COLORS])
    p.add_argument("--train", type=int, default=300, help="training samples")
    p.add_argument("--eval", type=int, default=24, help="held-out samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only-word",
        nargs="*",
        metavar="SHAPE",
        help="label only --word (a shape) among these known shapes (default: circle square); eval.jsonl also asks "
        "for each of them, to measure forgetting",
    )
    args = p.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} already exists and is not empty", file=sys.stderr)
        return 2
    if args.only_word is None:
        write_novel_data(args.out, args.word, args.train, args.eval, args.seed)
    else:
        try:
            words = tuple(args.only_word or DISTRACTORS)
            write_word_only_data(args.out, args.word, words, args.train, args.eval, args.seed)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(f"wrote {args.train} + {args.eval} samples about {args.word!r} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
