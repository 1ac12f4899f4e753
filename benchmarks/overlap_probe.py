"""Whether vision work queued beside decode steps costs the steps anything: a block step at 16 sequences alone,
tower blocks of 16 images alone, and both queued on the one stream before each step's read. Where the steps are
bound by the host, the device runs the tower while the host encodes the step. Prints one line per measurement
and writes them as JSON with --json."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import in_memory_model  # noqa: E402

from mlx_locate.compiled import BLOCK_FORWARD_ROWS, Phase  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="3b")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = in_memory_model(args.preset, "bfloat16")
    runtime = model
    tower = model.runtime.network.vision_model
    blocks = len(tower.encoder.blocks)
    grid = (34, 46)  # 640 x 480 at patch 14
    R, context = args.rows, 512
    cache = runtime.new_cache(R)
    step = (Phase.BLOCK, cache, mx.zeros((R, BLOCK_FORWARD_ROWS), mx.int32), list(range(R)), [context] * R)
    shape = ([BLOCK_FORWARD_ROWS] * R, [True] * R, True)
    dim = tower.config.hidden_size
    x0 = (mx.random.normal((args.images, grid[0] * grid[1], dim)) * 0.02).astype(mx.bfloat16)
    mx.eval(x0)
    found: dict[str, float] = {}

    def note(name: str, ms: float) -> None:
        found[name] = ms
        print(f"{name}: {ms:.2f} ms", flush=True)

    def steps(piece: int | None, first: bool = True) -> float:
        """ms per step of `args.steps` block steps, each with its read; `piece` tower blocks queued per step."""
        x, pending = x0, []
        t0 = time.perf_counter()
        for i in range(args.steps):
            if piece and first:
                x = tower.run_blocks(x, grid, i % blocks, i % blocks + piece) if i % blocks + piece <= blocks else x0
                mx.async_eval(x)
                pending.append(x)
            logits = runtime.run(*step, *shape)
            if piece and not first:
                mx.async_eval(logits)
                x = tower.run_blocks(x, grid, i % blocks, i % blocks + piece) if i % blocks + piece <= blocks else x0
                mx.async_eval(x)
                pending.append(x)
            mx.eval(logits)
        mx.eval(pending)
        return 1e3 * (time.perf_counter() - t0) / args.steps

    def tower_alone(piece: int) -> float:
        x = x0
        t0 = time.perf_counter()
        for i in range(args.steps):
            x = tower.run_blocks(x, grid, i % blocks, i % blocks + piece) if i % blocks + piece <= blocks else x0
            mx.eval(x)
        return 1e3 * (time.perf_counter() - t0) / args.steps

    for _ in range(2):  # compile and warm
        steps(1)
        steps(1, first=False)
    note(f"block step, {R} rows", steps(None))
    t_host = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits = runtime.run(*step, *shape)
        mx.async_eval(logits)
        t_host.append(time.perf_counter() - t0)
        mx.eval(logits)
    note(f"block step, {R} rows, host until queued", 1e3 * min(t_host))
    for piece in (1, 2, 4):
        alone = tower_alone(piece)
        note(f"{piece} tower blocks of {args.images} images alone", alone)
        note(f"step + {piece} blocks queued before it", steps(piece))
        note(f"step + {piece} blocks queued after it", steps(piece, first=False))
    if args.json:
        summary = {"preset": args.preset, "rows": R, "images": args.images, "ms": found}
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
