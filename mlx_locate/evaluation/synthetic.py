"""The synthetic benchmark: held-out shape scenes (`synthetic.scenes`, split "eval", a stream training never
draws from) as the three input formats, in memory (`synthetic_benchmarks`, a data source of `mlx-locate-eval
--synthetic N`) or as files (`export_benchmark`, `--export DIR`). Both build the same content and read it with
the same format readers, so they score alike.

- `synthetic` (the evaluation JSONL): each scene's one task as a detection, referring or pointing sample,
  pointing GT as RLE masks of the shapes' pixels;
- `synthetic_coco` (a COCO instances JSON): every shape of every scene;
- `synthetic_screenspot` (ScreenSpot-Pro): one point instruction per scene with a unique colour and shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from ..synthetic.scenes import COLORS, SHAPES, Obj, Scene, make_sample
from .formats import Benchmark, coco_benchmark, extra, jsonl_benchmark, screenspot_benchmark

EXPORT_FILES = ("synthetic.jsonl", "synthetic_coco.json", "synthetic_screenspot.json")
NAMES = tuple(Path(name).stem for name in EXPORT_FILES)  # the benchmarks' names, as read from those files
MASK_COLOR_DISTANCE = 60  # a shape's pixels are within this of its base colour (jitter is at most 18 a channel)


def _mask(scene: Scene, obj: Obj) -> np.ndarray:
    pixels = np.asarray(scene.image, dtype=np.float32)
    x1, y1, x2, y2 = obj.box
    mask = np.zeros(pixels.shape[:2], dtype=np.uint8)
    crop = pixels[y1:y2, x1:x2]
    mask[y1:y2, x1:x2] = np.linalg.norm(crop - np.array(COLORS[obj.color]), axis=-1) < MASK_COLOR_DISTANCE
    return mask


def _rle(mask: np.ndarray) -> dict:
    mask_api = extra("faster_coco_eval.core.mask", "RLE masks of the synthetic benchmark")
    rle = mask_api.encode(np.asfortranarray(mask))
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}


def synthetic_content(n: int, seed: int = 0) -> tuple[list[dict], dict, list[dict], dict[str, Image.Image]]:
    """The benchmark's content: the JSONL entries, the COCO instances, the ScreenSpot-Pro items and the images
    by path (`images/00000.png`, ...)."""
    entries, gui, images = [], [], {}
    coco = {"images": [], "annotations": [], "categories": [{"id": k + 1, "name": s} for k, s in enumerate(SHAPES)]}
    for i in range(n):
        sample = make_sample(seed, i, "eval")
        scene, task = sample.scene, sample.task
        name = f"images/{i:05d}.png"
        images[name] = scene.image
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
        entries.append(entry)
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
    return entries, coco, gui, images


def synthetic_benchmarks(n: int, seed: int = 0) -> list[Benchmark]:
    """The `n` held-out scenes of stream `seed` as the three benchmarks, images in memory."""
    entries, coco, gui, images = synthetic_content(n, seed)
    where = f"the synthetic benchmark (--synthetic {n} --seed {seed})"
    numbered = list(enumerate(entries, start=1))
    return [
        jsonl_benchmark(NAMES[0], numbered, where, None, images),
        coco_benchmark(NAMES[1], coco, where, None, images),
        screenspot_benchmark(NAMES[2], [(where, gui)], where, None, images),
    ]


def export_benchmark(folder: str | Path, n: int, seed: int = 0, overwrite: bool = False) -> dict[str, Path]:
    """Write the `n` held-out scenes of stream `seed` as `EXPORT_FILES`, images in `folder/images/`."""
    folder = Path(folder)
    existing = [name for name in EXPORT_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ValueError(f"{folder} already has {', '.join(existing)}; pass --overwrite to replace them")
    entries, coco, gui, images = synthetic_content(n, seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for name, image in images.items():
        image.save(folder / name)
    paths = {name: folder / name for name in EXPORT_FILES}
    paths["synthetic.jsonl"].write_text("".join(json.dumps(e) + "\n" for e in entries))
    paths["synthetic_coco.json"].write_text(json.dumps(coco))
    paths["synthetic_screenspot.json"].write_text(json.dumps(gui, indent=1))
    return paths
