"""Where a batch's image side goes on a GPU: the tower and the prompt prefixes of 16 images as the engine runs
them (the budget's plan) and with more working memory, by piece, and whether a tower queued on a second stream
runs beside decode steps (the prefixes wait for their own calls, so they could not). Prints one line per
measurement; `--json` keeps them.

    python benchmarks/image_probe.py [--preset 3b] [--images 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import folder_images, in_memory_model  # noqa: E402

from mlx_locate.compiled import Phase  # noqa: E402
from mlx_locate.preprocess import NORMALISED  # noqa: E402
from mlx_locate.prompts import user_text  # noqa: E402


def timed(fn, iters: int = 3) -> tuple[float, float]:
    """(ms per call after one warm-up, peak GB above the memory active before the calls)."""
    fn()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters, (mx.get_peak_memory() - base) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="3b")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out: dict = {}

    def report(name: str, value) -> None:
        out[name] = value
        print(f"{name}: {value}", flush=True)

    runtime = in_memory_model(args.preset, "bfloat16").runtime
    budget = runtime.budget
    report("budget", {k: getattr(budget, k) for k in ("working", "kv", "patch_bytes", "prefill_row_bytes")})
    with tempfile.TemporaryDirectory() as work:
        paths, query = folder_images(None, (640, 480), args.images, Path(work))
        images = [runtime.prepare(p) for p in paths]
    grid = images[0].pre.grid
    blocks = len(runtime.network.vision_model.encoder.blocks)
    report("grid", grid)
    report("tower_plan", budget.tower_plan(len(images), grid[0] * grid[1], blocks))

    def vision():
        runtime.features.clear()
        runtime.features_for(images)

    for working in (budget.working, 8 << 30):
        runtime.budget = replace(budget, working=working)
        report(f"vision_{working >> 20}MiB_ms_peak_gb", timed(vision))
    runtime.budget = budget

    tower = runtime.network.vision_model
    normalised = mx.array(NORMALISED)

    def embed():
        return tower.embed(normalised[mx.array(np.stack([i.pre.pixels for i in images]))], grid)

    x0 = embed()
    mx.eval(x0)
    report("tower_embed_ms", timed(lambda: mx.eval(embed()))[0])
    for per_eval in (1, 3, blocks):

        def run_blocks(per_eval=per_eval):
            x = x0
            for first in range(0, blocks, per_eval):
                x = tower.run_blocks(x, grid, first, first + per_eval, budget.score_budget)
                mx.eval(x)
            return x

        report(f"tower_blocks_per_eval_{per_eval}_ms_peak_gb", timed(run_blocks))
    xb = tower.run_blocks(x0, grid, 0, blocks)
    mx.eval(xb)
    report("tower_finish_connect_ms", timed(lambda: mx.eval(runtime.network.connect(tower.finish(xb), grid)))[0])

    ids = runtime.prompt(user_text("detect", query), grid)
    prefix_len = ids.index(runtime.token_ids.img_end) + 1
    report("prefix_tokens", prefix_len)
    runtime.features.clear()
    feats = [f for _, f in runtime.features_for(images)]
    items = [(ids[:prefix_len], f) for f in feats]
    for working in (budget.working, 4 << 30, 8 << 30, 16 << 30):
        runtime.budget = replace(budget, working=working)
        report(f"prefix_rows_per_call_{working >> 20}MiB", runtime.prefill_rows(prefix_len))
        report(f"prefixes_{working >> 20}MiB_ms_peak_gb", timed(lambda: mx.eval(runtime.compute_prefixes(items))))
    runtime.budget = budget
    embed_ms = timed(lambda: mx.eval([runtime.network.embed(i, f)[0] for i, f in items]))[0]
    report("prefix_embed_ms", embed_ms)

    # Decode steps beside a tower queued on a second stream.
    rows, context, steps = 16, 512, 8
    d = runtime.network.config.text.hidden_size
    cache = runtime.new_cache(rows)
    mx.eval(list(runtime.prefill(cache, [(b, mx.zeros((context, d), mx.bfloat16), 0) for b in range(rows)]).values()))
    inputs = mx.array([[1] * 6 + [2] * 6] * rows, dtype=mx.int32)
    step_args = (Phase.BLOCK, cache, inputs, list(range(rows)), [context] * rows, [12] * rows, [True] * rows, True)

    def decode():
        for _ in range(steps):
            runtime.steps.run(*step_args)[:, 0, :8].tolist()  # one host read per step

    def tower_all(stream=None):
        with mx.stream(stream or mx.default_stream(mx.default_device())):
            x = tower.run_blocks(x0, grid, 0, blocks)
        return x

    report("decode_8_steps_ms", timed(decode)[0])
    report("tower_alone_ms", timed(lambda: mx.eval(tower_all()))[0])
    side = mx.new_stream(mx.default_device())

    def both(stream):
        x = tower_all(stream)
        mx.async_eval(x)
        decode()
        mx.eval(x)

    report("tower_then_decode_same_stream_ms", timed(lambda: both(None))[0])
    report("tower_beside_decode_side_stream_ms", timed(lambda: both(side))[0])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
