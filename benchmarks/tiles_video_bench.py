"""Tiling recall and video throughput with a trained checkpoint (the bundled demo model by default).

    python benchmarks/tiles_video_bench.py [--scenes 8] [--frames 24] [--note "idle machine"] [--json out.json]

Tiling: dense synthetic scenes (`tuner.large_scenes.dense_scene`: 560 x 560 pixels, shapes of 36-56 px that the
resize to the demo model's 256-patch budget shrinks to 14-22 px), "square" and "circle" asked of each, decoded
whole, tiled with the whole image, and tiled only; each configuration's requests go through one batched engine
(`locate_many`). Boxes matched to the truth greedily at IoU 0.5: recall, precision, F1, and seconds per image.

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

from mlx_locate import Request, video  # noqa: E402
from mlx_locate.locate import load  # noqa: E402
from mlx_locate.metrics import greedy_match, iou  # noqa: E402
from mlx_locate.tuner.large_scenes import DEMO_MOVERS, dense_scene, moving_frames, write_clip  # noqa: E402

QUERIES = ("square", "circle")
CONFIGS = {  # name -> Request fields
    "whole image": {},
    "tiles auto + whole": {"tiles": "auto"},
    "tiles auto only": {"tiles": "auto", "tile_whole": False},
}
MOVERS = DEMO_MOVERS
SOURCE_RATE = 10  # frames per second of the clip; sampled at 2, so 5 source frames between samples


def tiling(model, scenes: int, size: int, batch_size: int | None, max_tokens: int) -> dict:
    images = [dense_scene(seed, (size, size)) for seed in range(scenes)]
    out = {"scenes": scenes, "size": [size, size], "queries": list(QUERIES), "objects": 0, "configs": {}}
    model.locate_many([Request(images[0].image, "square", max_tokens=max_tokens, **CONFIGS["tiles auto only"])])
    for name, fields in CONFIGS.items():
        requests = [
            Request(s.image, q, max_tokens=max_tokens, tag=i, **fields) for i, s in enumerate(images) for q in QUERIES
        ]
        t0 = time.perf_counter()
        results = model.locate_many(requests, max_rows=batch_size)
        seconds = time.perf_counter() - t0
        tp = pred = gt = views = 0
        for request, result in zip(requests, results, strict=True):
            truth = [tuple(map(float, o.box)) for o in images[request.tag].objects if o.shape == request.query]
            boxes = [o.box for o in result.objects if o.box is not None]
            tp += len(greedy_match(boxes, truth, 0.5))
            pred, gt = pred + len(boxes), gt + len(truth)
            views += len(result.stats.get("tiles", [None]))
        recall, precision = tp / gt, tp / pred if pred else 0.0
        out["objects"] = gt
        out["configs"][name] = {
            "matched": tp,
            "predicted": pred,
            "recall": recall,
            "precision": precision,
            "f1": 2 * recall * precision / (recall + precision) if recall + precision else 0.0,
            "views_per_request": views / len(requests),
            "seconds_per_image": seconds / scenes,
        }
    grid = results[0].stats.get("tile_grid")
    out["tile_grid"] = grid
    return out


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
    settings = video.Settings("detect", QUERIES[:1], None, "hybrid", max_tokens, 2.0, None, 0.2, True)
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
    t = report["tiling"]
    rows = [
        f"Tiling: {t['scenes']} scenes of {t['size'][0]} x {t['size'][1]} px, {t['objects']} objects asked "
        f"({', '.join(t['queries'])}), auto grid {t['tile_grid']}",
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
        "tiling": tiling(model, args.scenes, args.size, args.batch_size, args.max_tokens),
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
