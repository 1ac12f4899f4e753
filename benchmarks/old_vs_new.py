"""This checkout against another commit's code on one random checkpoint: the tokens and the peak memory above the
weights of one 1920 x 1080 image and one 4032 x 3024 photo, each side in a process of its own.

    git worktree add /tmp/old <commit> && python benchmarks/old_vs_new.py /tmp/old --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("1920x1080", "4032x3024")


def measure(checkpoint: str, images: str, max_tokens: int) -> dict:
    """One side (run in its own process, its code first on the path): tokens, peak GB above weights, seconds."""
    import mlx.core as mx

    import mlx_locate

    model = mlx_locate.load(checkpoint)
    mx.eval(mx.zeros(1))
    weights = mx.get_active_memory()
    out = {"code": mlx_locate.__file__, "weights_gb": weights / 1e9}
    for size in SIZES:
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        r = model.locate(f"{images}/{size}.png", "red box", mode="fast", max_tokens=max_tokens)
        out[size] = {
            "tokens": list(r.token_ids),
            "peak_gb": (mx.get_peak_memory() - weights) / 1e9,
            "s": time.perf_counter() - t0,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="a folder holding the other commit's mlx_locate package")
    p.add_argument("--preset", default="3b")
    p.add_argument("--work", default="/tmp/old_vs_new", help="folder for the checkpoint and the images")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("--side", nargs=2, metavar=("CHECKPOINT", "IMAGES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(measure(*args.side, args.max_tokens)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench import make_image

    from mlx_locate.weights.random_checkpoint import make_random_checkpoint

    work = Path(args.work)
    checkpoint = work / f"random-{args.preset}"
    if not checkpoint.exists():
        make_random_checkpoint(checkpoint, args.preset, seed=0, dtype="bfloat16")
    for size in SIZES:
        make_image(tuple(int(v) for v in size.split("x")), work / f"{size}.png")
    report = {}
    for side, code in (("new", ROOT), ("old", Path(args.old).resolve())):
        path = os.pathsep.join([str(code), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
        cmd = [sys.executable, "-P", __file__, args.old, "--side", str(checkpoint), str(work)]
        cmd += ["--max-tokens", str(args.max_tokens)]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True)
        report[side] = json.loads(done.stdout.strip().splitlines()[-1])
    report["same_tokens"] = {s: report["new"][s]["tokens"] == report["old"][s]["tokens"] for s in SIZES}
    print("| image | old peak GB | new peak GB | same tokens |\n|---|---|---|---|")
    for s in SIZES:
        old, new = report["old"][s]["peak_gb"], report["new"][s]["peak_gb"]
        print(f"| {s} | {old:.2f} | {new:.2f} | {report['same_tokens'][s]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
