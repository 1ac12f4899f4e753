"""The one-shot command from a cold process: `mlx-locate --image X --query "red box" --json`, each run a new
process, timed from its start to its exit, with the phases its JSON reports. With `--before DIR` (another
checkout of the package, e.g. `git worktree`/`git archive` of an older commit) the two sides take turns, run by
run, in one invocation.

    python benchmarks/cold_start.py --model DIR --images small.jpg big.jpg --runs 3 [--before /tmp/old] \
        --json benchmarks/results/cold_start.json

Each side first runs once untimed (`first_use_s`): MLX's kernel caches (and our tuning cache, `tune.py`) are
filled there, as they are by a user's first run; the timed runs are the ones a user sees every day after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlx_locate.prompts import task_text
from mlx_locate.request import DEFAULT_TASK

ROOT = Path(__file__).resolve().parents[1]
QUERY = "red box"
PHASES = ("load_s", "compile_s", "preprocess_s", "vision_s", "prefix_prefill_s", "prefill_s", "decode_s")


def one_shot(side: Path, model: str, image: Path, max_tokens: int, mode: str) -> dict:
    cmd = [sys.executable, "-m", "mlx_locate.commands.locate", "--model", model, "--image", str(image)]
    cmd += ["--query", QUERY, "--json", "--max-tokens", str(max_tokens), "--mode", mode]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(side), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=side)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{side}: {proc.stderr.strip()[-600:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    return {"seconds": seconds, **{k: stats.get(k) for k in PHASES}, "tokens": stats.get("tokens")}


def peer_one_shot(python: str, model: str, image: Path, max_tokens: int) -> dict:
    """mlx-vlm's one-shot command on the same request, timed from its start to its exit."""
    cmd = [python, "-m", "mlx_vlm.generate", "--model", model, "--image", str(image)]
    cmd += ["--prompt", task_text(DEFAULT_TASK, QUERY), "--max-tokens", str(max_tokens), "--temperature", "0"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"mlx-vlm: {proc.stderr.strip()[-600:]}")
    return {"seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--images", nargs="+", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--before", type=Path, help="another checkout of the package: its side runs first each turn")
    p.add_argument("--peer", help="a python with mlx-vlm 0.7.10: its `mlx_vlm.generate` runs last each turn")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--mode", default="hybrid")
    p.add_argument("--note", default="")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": ROOT} if args.before else {"after": ROOT}
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "note": args.note},
        "blas": os.environ.get("LD_PRELOAD", "") or "mlx default",
        "results": {},
    }
    for image in args.images:

        def run(side: str, image: Path = image) -> dict:
            if side == "mlx_vlm":
                return peer_one_shot(args.peer, args.model, image, args.max_tokens)
            return one_shot(sides[side], args.model, image, args.max_tokens, args.mode)

        names = [*sides, *(["mlx_vlm"] if args.peer else [])]
        runs: dict[str, list[dict]] = {side: [] for side in names}
        first = {side: run(side) for side in names}
        for _ in range(args.runs):
            for side in names:
                runs[side].append(run(side))
        entry = {}
        for side in names:
            seconds = [r["seconds"] for r in runs[side]]
            entry[side] = {
                "seconds": seconds,
                "median_s": statistics.median(seconds),
                "first_use_s": first[side]["seconds"],
                "runs": runs[side],
            }
            phases = [f"{k[:-2]} {runs[side][-1][k]:.2f}" for k in PHASES if runs[side][-1].get(k) is not None]
            print(
                f"{image.name} {side}: "
                + ", ".join(f"{s:.2f}" for s in seconds)
                + " s"
                + (f"; phases of the last: {', '.join(phases)}" if phases else "")
            )
        if args.before:
            entry["before_over_after"] = entry["before"]["median_s"] / entry["after"]["median_s"]
        if args.peer:
            entry["mlx_vlm_over_after"] = entry["mlx_vlm"]["median_s"] / entry["after"]["median_s"]
        report["results"][image.name] = entry
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
