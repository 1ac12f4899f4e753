"""Images/s of `mlx-locate-batch` over a folder, per --batch-size (issue 12's CPU line: batch 4 against batch 1).

    python benchmarks/batch_bench.py --model demo --batch 1 4                      # synthetic scenes, real boxes
    python benchmarks/batch_bench.py --preset medium --dtype float32 --batch 1 4  # random checkpoint (bench.py's)
    python benchmarks/batch_bench.py --model CKPT --folder photos/ --query car --batch 1 4 16

Each batch size runs the command's own `main` in this process over the same folder into a fresh JSONL (reading,
the engine, JSONL with fsync), after a warm-up run over the same folder; the model is loaded once and handed to
every run. Reports wall time, images/s, speed-up over the first batch size, forward steps and tokens summed
from the lines, compilations during the timed run and peak memory, and whether every batch size wrote the
same token ids. `--peer PYTHON` (a venv with mlx-vlm 0.7.10, random checkpoints only) also runs mlx-vlm over the
same folder image by image, one `peer_mlxvlm.py` process per image with our prompt ids; its images/s counts each
request's own time (preprocessing to the last step), not the process start or model load. Prints a table and
writes JSON (default benchmarks/results/batch_<model>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import peer_request  # noqa: E402

import mlx_locate  # noqa: E402
from mlx_locate.commands import batch  # noqa: E402
from mlx_locate.preprocess import preprocess  # noqa: E402
from mlx_locate.prompts import prompt_ids, task_text  # noqa: E402
from mlx_locate.synthetic.scenes import make_sample  # noqa: E402
from mlx_locate.weights.random_checkpoint import PRESETS, make_random_checkpoint  # noqa: E402

TOKENIZER_DIR = ROOT / "tests" / "data" / "golden" / "tokenizer"


def synthetic_folder(folder: Path, n: int) -> Path:
    """`n` held-out synthetic scenes (the demo model's evaluation stream) as PNG files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = folder / f"scene_{i:04d}.png"
        if not path.exists():
            make_sample(0, i, "eval").scene.image.save(path)
    return folder


def checkpoint_folder(args: argparse.Namespace) -> Path:
    folder = Path(args.workdir) / f"{args.preset}-{args.dtype or 'bfloat16'}"
    if not (folder / "config.json").is_file():
        make_random_checkpoint(folder, preset=args.preset, dtype=args.dtype or "bfloat16", tokenizer_dir=TOKENIZER_DIR)
    return folder


def load_model(args: argparse.Namespace) -> tuple[mlx_locate.LocateModel, str]:
    if args.model:
        return mlx_locate.load(args.model, dtype=args.dtype), args.model
    return mlx_locate.load(checkpoint_folder(args)), f"random-{args.preset}"


def peer_run(args: argparse.Namespace, model: mlx_locate.LocateModel, images: list[str]) -> dict:
    """mlx-vlm over `images` one at a time (a process each, our prompt ids): the sum of its request times."""
    seconds, steps = 0.0, 0
    text = task_text("detect", args.query[0] if args.query else "square")
    folder = checkpoint_folder(args)
    for image in images:
        ids = prompt_ids(model.runtime.tokenizer, text, [preprocess(image, model.runtime.in_token_limit).grid])
        out = peer_request(args.peer, folder, [image], ids, args.mode, args.max_tokens, args.dtype or "stored")
        seconds += out["timings_s"]["total"]
        steps += out["forwards"]["total"]
    return {"seconds": seconds, "images_per_s": len(images) / seconds, "steps": steps}


def run_cli(model: mlx_locate.LocateModel, cli: list[str], out: Path) -> float:
    """Seconds `mlx-locate-batch` takes for `cli` into `out`, with `model` instead of loading one, its feature and
    prefix caches emptied first (every run computes every image's vision and prefix)."""
    batch.load = lambda *args, **kwargs: model
    model.runtime.clear_caches()
    t0 = time.perf_counter()
    code = batch.main([*cli, "--out", str(out)])
    seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"mlx-locate-batch exited with {code}")
    return seconds


def summed(lines: list[dict], key: str) -> int:
    return sum(r["stats"][key] for line in lines for r in line.get("results", []))


def timed_run(model: mlx_locate.LocateModel, cli: list[str], out: Path) -> dict:
    """One run of `cli` into a fresh `out`: seconds, what its lines add up to, compilations, peak memory."""
    out.unlink(missing_ok=True)
    mx.reset_peak_memory()
    compilations = model.runtime.compilations
    seconds = run_cli(model, cli, out)
    lines = [json.loads(text) for text in out.read_text().splitlines()]
    return {
        "seconds": seconds,
        "steps": summed(lines, "steps"),
        "tokens": summed(lines, "tokens"),
        "errors": sum("error" in line for line in lines),
        "compilations": model.runtime.compilations - compilations,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "token_ids": {line["image"]: [r["token_ids"] for r in line.get("results", [])] for line in lines},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint folder, hub id or 'demo' (default: a random --preset checkpoint)")
    p.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--folder", help="images to run (default: --scenes synthetic scenes)")
    p.add_argument("--scenes", type=int, default=32, help="synthetic scenes when no --folder (default: 32)")
    p.add_argument("--query", action="append", help="repeatable (default: square)")
    p.add_argument("--mode", default="hybrid", choices=["slow", "fast", "hybrid"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes (default: 1 4)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per batch size, interleaved; the median counts")
    p.add_argument("--peer", help="python of a venv with mlx-vlm 0.7.10: also mlx-vlm image by image")
    p.add_argument("--workdir", default=str(ROOT / ".bench"))
    p.add_argument("--json", help="default: benchmarks/results/batch_<model>.json")
    args = p.parse_args(argv)

    model, name = load_model(args)
    folder = (
        Path(args.folder) if args.folder else synthetic_folder(Path(args.workdir) / f"scenes{args.scenes}", args.scenes)
    )
    queries = [a for q in args.query or ["square"] for a in ("--query", q)]
    options = [*queries, "--mode", args.mode, "--max-tokens", str(args.max_tokens)]
    images = batch.list_images(str(folder))
    n_images = len(images)

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.batch:  # a warm-up over the whole folder compiles every shape the timed runs meet
            run_cli(model, ["--images", str(folder), *options, "--batch-size", str(size)], Path(tmp) / f"w{size}.jsonl")
        timed: dict[int, list[dict]] = {size: [] for size in args.batch}
        for _ in range(args.repeat):  # interleaved, so a busy spell of the machine hits every batch size
            for size in args.batch:
                cli = ["--images", str(folder), *options, "--batch-size", str(size)]
                timed[size].append(timed_run(model, cli, Path(tmp) / f"b{size}.jsonl"))
        peer = peer_run(args, model, images) if args.peer and not args.model else None
    for size, each in timed.items():
        seconds = statistics.median(r["seconds"] for r in each)
        last = {k: v for k, v in each[-1].items() if k not in ("seconds", "token_ids")}
        runs.append(
            {
                "batch_size": size,
                "seconds": seconds,
                "images_per_s": n_images / seconds,
                **last,
                "seconds_each": [r["seconds"] for r in each],
            }
        )
    for r in runs:
        r["speedup"] = r["images_per_s"] / runs[0]["images_per_s"]
    report = {
        "model": name,
        "dtype": args.dtype or "as stored",
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "images": n_images,
        "folder": str(folder),
        "queries": args.query or ["square"],
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "same_tokens": all(r["token_ids"] == timed[args.batch[0]][0]["token_ids"] for e in timed.values() for r in e),
        "runs": runs,
        "peer_image_by_image": peer,
        "load_average_end": os.getloadavg(),  # other work on the machine while it ran
    }
    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"batch_{Path(name).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))

    print(f"\n{name} ({report['dtype']}) on {report['device']}, {n_images} images, {args.mode}, {report['queries']}")
    print("| batch size | s (median) | images/s | speed-up | steps | tokens | compilations | peak memory GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['batch_size']} | {r['seconds']:.2f} | {r['images_per_s']:.2f} | {r['speedup']:.2f}x | {r['steps']} "
            f"| {r['tokens']} | {r['compilations']} | {r['peak_memory_gb']:.2f} |"
        )
    if peer is not None:
        print(
            f"| mlx-vlm, image by image | {peer['seconds']:.2f} | {peer['images_per_s']:.2f} | "
            f"{peer['images_per_s'] / runs[0]['images_per_s']:.2f}x | {peer['steps']} | | | |"
        )
    print(f"same token ids at every batch size: {report['same_tokens']}; JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
