"""Tiling precision and recall, and video throughput, with a trained checkpoint (the bundled demo model by default).

    python benchmarks/tiles_video_bench.py [--scenes 8] [--scattered 12] [--seams 20] [--frames 24] \
        [--note "idle machine"] [--json out.json]

Tiling, on three kinds of synthetic scene (`synthetic.large_scenes`), each configuration's requests through one
batched engine (`locate_many`), boxes matched to the truth greedily at IoU 0.5 (recall, precision, F1, seconds
per image):
- dense: 560 x 560 pixels, a shape of 36-56 px in most cells of a 112 px grid (14-22 px after the resize to the
  demo model's 256-patch budget), "square" and "circle" asked; decoded whole, tiled with the whole image, and
  tiled only;
- scattered: 1200 x 900 pixels, 20-30 shapes of 25-45 px anywhere, so seams cross some of them; "square",
  "circle" and "triangle" asked; whole and tiled with the whole image;
- seam placements: one 40-45 px square across a seam of the 3 x 3 tiles of a 560 x 560 image, cut at 15-85 %,
  among circles and triangles: how often the square comes back as exactly one box (IoU >= 0.5), twice or
  more, or not at all (`--tiles auto`).

Video: frames of shapes moving in straight lines (`moving_frames`) fed straight to `video.locate_frames` (the
command's engine loop and tracker, no decoding), then, when PyAV is installed, the whole command on the same
clip written as H.264 (decoding, JSONL, the annotated clip). Frames per second of sampled frames, and how well
the tracks follow: the share of (frame, object) pairs whose track box has IoU >= 0.5 with the object, and the
number of track ids per object (1 is perfect).

Runs with only numpy, safetensors, tokenizers, pillow and mlx installed (the offline GPU machine): without
tqdm a silent stand-in is used, and without PyAV the command-level video run is skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

try:
    import tqdm  # noqa: F401
except ImportError:  # progress bars are not measured here; the offline GPU machine has no tqdm

    class _SilentBar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            pass

    sys.modules["tqdm"] = types.ModuleType("tqdm")
    sys.modules["tqdm"].tqdm = _SilentBar

from mlx_locate import Request  # noqa: E402
from mlx_locate.commands import video  # noqa: E402
from mlx_locate.locate import load  # noqa: E402
from mlx_locate.metrics import greedy_match, iou  # noqa: E402
from mlx_locate.synthetic.large_scenes import (  # noqa: E402
    DEMO_MOVERS,
    dense_scene,
    moving_frames,
    scattered_scene,
    seam_scene,
    write_clip,
)
from mlx_locate.tiles import tile_boxes  # noqa: E402

QUERIES = ("square", "circle")
SCATTERED_QUERIES = ("square", "circle", "triangle")
CONFIGS = {  # name -> Request fields
    "whole image": {},
    "tiles auto + whole": {"tiles": "auto"},
    "tiles auto only": {"tiles": "auto", "tile_whole": False},
}
MOVERS = DEMO_MOVERS
SOURCE_RATE = 10  # frames per second of the clip; sampled at 2, so 5 source frames between samples


def scored(model, scenes: list, queries: tuple[str, ...], configs: list[str], batch_size, max_tokens: int) -> dict:
    """Recall, precision, F1, views per request and seconds per image of each configuration."""
    out = {"scenes": len(scenes), "size": list(scenes[0].size), "queries": list(queries), "objects": 0}
    out["configs"] = {}
    for name in configs:
        requests = [
            Request(s.image, q, max_tokens=max_tokens, tag=i, **CONFIGS[name])
            for i, s in enumerate(scenes)
            for q in queries
        ]
        t0 = time.perf_counter()
        results = model.locate_many(requests, max_rows=batch_size)
        seconds = time.perf_counter() - t0
        tp = pred = gt = views = 0
        for request, result in zip(requests, results, strict=True):
            truth = [tuple(map(float, o.box)) for o in scenes[request.tag].objects if o.shape == request.query]
            boxes = [o.box for o in result.objects if o.box is not None]
            tp += len(greedy_match(boxes, truth, 0.5))
            pred, gt = pred + len(boxes), gt + len(truth)
            views += len(result.stats.get("tiles", [None]))
            out["tile_grid"] = result.stats.get("tile_grid", out.get("tile_grid"))
        recall, precision = tp / gt, tp / pred if pred else 0.0
        out["objects"] = gt
        out["configs"][name] = {
            "matched": tp,
            "predicted": pred,
            "recall": recall,
            "precision": precision,
            "f1": 2 * recall * precision / (recall + precision) if recall + precision else 0.0,
            "views_per_request": views / len(requests),
            "seconds_per_image": seconds / len(scenes),
        }
    return out


def seam_placements(model, n: int, batch_size, max_tokens: int) -> dict:
    """How often a square across a seam comes back as one box, as several, or not at all."""
    scenes = [seam_scene(seed, tile_boxes((560, 560), 3, 3, 0.2)) for seed in range(n)]
    requests = [Request(s.image, "square", tiles="auto", max_tokens=max_tokens) for s in scenes]
    counts = {"once": 0, "more": 0, "missed": 0}
    for scene, result in zip(scenes, model.locate_many(requests, max_rows=batch_size), strict=True):
        square = scene.objects[0].box
        overlapping = [o.box for o in result.objects if o.box is not None and iou(o.box, square) > 0]
        if len(overlapping) > 1:
            counts["more"] += 1
        else:
            counts["once" if overlapping and iou(overlapping[0], square) >= 0.5 else "missed"] += 1
    return {"placements": n, "size": list(scenes[0].size), **counts}


def tiling(model, scenes: int, scattered: int, seams: int, size: int, batch_size: int | None, max_tokens: int) -> dict:
    model.locate_many([Request(dense_scene(0).image, "square", max_tokens=max_tokens, **CONFIGS["tiles auto only"])])
    return {
        "dense": scored(
            model,
            [dense_scene(seed, (size, size)) for seed in range(scenes)],
            QUERIES,
            list(CONFIGS),
            batch_size,
            max_tokens,
        ),
        "scattered": scored(
            model,
            [scattered_scene(seed) for seed in range(scattered)],
            SCATTERED_QUERIES,
            ["whole image", "tiles auto + whole"],
            batch_size,
            max_tokens,
        ),
        "seams": seam_placements(model, seams, batch_size, max_tokens),
    }


def track_quality(lines: list[dict]) -> dict:
    """Share of (frame, mover) pairs followed by a track box at IoU >= 0.5, and track ids per followed mover."""
    followed, pairs, ids = 0, 0, {}
    for line in lines:
        objects = [o for entry in line["results"] for o in entry.get("objects", [])]
        for k, mover in enumerate(MOVERS):
            if mover.shape != QUERIES[0]:  # the query asked of the clip
                continue
            pairs += 1
            truth = mover.box(line["frame"])
            best = max(objects, key=lambda o: iou(o["box"], truth), default=None)
            if best is not None and iou(best["box"], truth) >= 0.5:
                followed += 1
                ids.setdefault(k, set()).add(best["track"])
    return {
        "followed": followed / pairs if pairs else None,
        "ids_per_object": sum(len(v) for v in ids.values()) / len(ids) if ids else None,
    }


def frames_of(n: int) -> list[video.Frame]:
    """`n` sampled frames at 2 per second of a 10 fps clip."""
    step = SOURCE_RATE // 2
    images = [image for image, _ in moving_frames(MOVERS, n * step)][::step]
    return [video.Frame(i * step, i * step / SOURCE_RATE, image) for i, image in enumerate(images)]


def video_run(model, n: int, batch_size: int | None, max_tokens: int) -> dict:
    settings = video.VideoSettings("detect", QUERIES[:1], None, "hybrid", max_tokens, 2.0, None, 0.2, True)
    frames = frames_of(n)
    list(video.locate_frames(model, frames[:2], settings, max_rows=batch_size))  # warm-up
    t0 = time.perf_counter()
    lines = [line for _, line, _ in video.locate_frames(model, frames, settings, max_rows=batch_size)]
    seconds = time.perf_counter() - t0
    out = {"frames": n, "size": list(frames[0].image.size), "queries": list(QUERIES[:1])}
    out["engine_loop"] = {"seconds": seconds, "frames_per_s": n / seconds, **track_quality(lines)}
    try:
        video.import_av()
    except video.VideoError:
        out["command"] = "skipped: PyAV not installed"
        return out
    with tempfile.TemporaryDirectory() as tmp:
        clip = write_clip(Path(tmp) / "clip.mp4", MOVERS, n * (SOURCE_RATE // 2), rate=SOURCE_RATE)
        args = ["--video", str(clip), "--query", QUERIES[0], "--fps", "2", "--max-tokens", str(max_tokens)]
        args += ["--out", f"{tmp}/frames.jsonl", "--annotated", f"{tmp}/annotated.mp4", "--no-progress"]
        args += ["--batch-size", str(batch_size)] if batch_size else []
        video.load = lambda path, **options: model  # time the command, not the model load
        t0 = time.perf_counter()
        code = video.main(args)
        seconds = time.perf_counter() - t0
        sampled = len(Path(f"{tmp}/frames.jsonl").read_text().splitlines()) - 1
    out["command"] = {"exit": code, "frames": sampled, "seconds": seconds, "frames_per_s": sampled / seconds}
    return out


def table(report: dict) -> str:
    rows = []
    for kind in ("dense", "scattered"):
        t = report["tiling"][kind]
        rows += [
            f"Tiling, {kind}: {t['scenes']} scenes of {t['size'][0]} x {t['size'][1]} px, {t['objects']} objects "
            f"asked ({', '.join(t['queries'])}), auto grid {t['tile_grid']}",
            "",
            "| decoding | recall | precision | F1 | views per request | s per image |",
            "|---|---|---|---|---|---|",
        ]
        for name, c in t["configs"].items():
            rows.append(
                f"| {name} | {c['recall']:.3f} ({c['matched']}/{t['objects']}) | {c['precision']:.3f} "
                f"({c['matched']}/{c['predicted']}) | {c['f1']:.3f} | {c['views_per_request']:.0f} | "
                f"{c['seconds_per_image']:.2f} |"
            )
        rows.append("")
    s = report["tiling"]["seams"]
    rows += [
        f"Tiling, seams: {s['placements']} squares of 40-45 px across a seam of {s['size'][0]} x {s['size'][1]} px "
        f"in 3 x 3 tiles: {s['once']} once, {s['more']} more than once, {s['missed']} missed",
    ]
    v = report["video"]
    loop = v["engine_loop"]
    rows += [
        "",
        f"Video: {v['frames']} sampled frames of {v['size'][0]} x {v['size'][1]} px, query {v['queries'][0]}",
        "",
        "| path | frames/s | tracked (IoU >= 0.5) | ids per object |",
        "|---|---|---|---|",
        f"| engine loop + tracker | {loop['frames_per_s']:.2f} | {loop['followed']:.3f} | {loop['ids_per_object']} |",
    ]
    if isinstance(v["command"], dict):
        rows.append(f"| mlx-locate-video (decode, JSONL, annotated clip) | {v['command']['frames_per_s']:.2f} | | |")
    else:
        rows.append(f"| mlx-locate-video | {v['command']} | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--scenes", type=int, default=8, help="dense scenes (default: 8)")
    p.add_argument("--scattered", type=int, default=12, help="scattered scenes (default: 12)")
    p.add_argument("--seams", type=int, default=20, help="squares across a seam (default: 20)")
    p.add_argument("--size", type=int, default=560, help="scene side in pixels (default: 560)")
    p.add_argument("--frames", type=int, default=24, help="sampled video frames (default: 24)")
    p.add_argument("--batch-size", type=int, help="engine rows (default: the engine's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--note", default="", help="the machine's state, stored with the figures")
    p.add_argument("--json", help="output (default: benchmarks/results/tiles_video_<cpu|gpu>.json)")
    args = p.parse_args(argv)
    model = load(args.model)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    report = {
        "model": args.model,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "note": args.note,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "tiling": tiling(model, args.scenes, args.scattered, args.seams, args.size, args.batch_size, args.max_tokens),
        "video": video_run(model, args.frames, args.batch_size, args.max_tokens),
    }
    text = table(report)
    print(text)
    out = Path(args.json or ROOT / "benchmarks" / "results" / f"tiles_video_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "table": text}, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
