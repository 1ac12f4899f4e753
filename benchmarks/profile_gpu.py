"""Where a 3B decode step's time goes on the GPU: bandwidth, GEMV efficiency, launch overhead.

    python benchmarks/profile_gpu.py [--json out.json]

Compares our compiled AR/block step with bare chains of the same matrix-vector products, so a step's
distance from the weight-bandwidth floor splits into kernel efficiency and everything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import in_memory_model  # noqa: E402

from mlx_locate.compiled import StepRunner  # noqa: E402


def timed(fn, iters: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0) / iters


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {}
    big = mx.random.normal((512 * 1024 * 1024,)).astype(mx.bfloat16)  # 1 GiB
    mx.eval(big)
    out["copy_gb_s"] = 2 * big.nbytes / timed(lambda: big * 1.0001, 10) / 1e6

    a = mx.random.normal((512, 512))
    exact = np.array(a, dtype=np.float64) @ np.array(a, dtype=np.float64)
    out["f32_matmul_rel_err"] = float(np.abs(np.array(a @ a) - exact).max() / np.abs(exact).max())

    d, f, layers, vocab = 2048, 11008, 36, 152681
    ws = []
    for _ in range(layers):
        ws.append(
            [
                (mx.random.normal(s) * 0.02).astype(mx.bfloat16)
                for s in [(d, d), (256, d), (256, d), (d, d), (f, d), (f, d), (d, f)]
            ]
        )
    head = (mx.random.normal((vocab, d)) * 0.02).astype(mx.bfloat16)
    mx.eval(ws, head)
    weight_bytes = sum(w.nbytes for layer in ws for w in layer) + head.nbytes
    out["weight_gb"] = weight_bytes / 1e9
    out["floor_ms"] = weight_bytes / (out["copy_gb_s"] * 1e6)

    def chain(x):
        for q, k, v, o, g, u, dn in ws:
            h = x @ q.T + (x @ k.T).sum() + (x @ v.T).sum()
            x = x + h @ o.T
            x = x + (mx.sigmoid(x @ g.T) * (x @ u.T)) @ dn.T
        return x @ head.T

    for rows in (1, 12):
        x = (mx.random.normal((1, rows, d)) * 0.1).astype(mx.bfloat16)
        out[f"gemv_chain_eager_{rows}_ms"] = timed(lambda x=x: chain(x))
        compiled = mx.compile(chain)
        out[f"gemv_chain_compiled_{rows}_ms"] = timed(lambda x=x, c=compiled: c(x))
    w = ws[0][4]
    x = mx.random.normal((1, d)).astype(mx.bfloat16)
    out["single_gemv_gb_s"] = w.nbytes / timed(lambda: x @ w.T, 200) / 1e6
    out["head_gemv_ms"] = timed(lambda: x @ head.T, 50)

    model = in_memory_model("3b", "bfloat16")
    for context in (512, 2048):
        runner = StepRunner(model.steps, model.new_cache())
        mx.eval(runner.prefill(mx.zeros((1, context, d), mx.bfloat16)))
        base = runner.cache.offset

        def step(ids, block, runner=runner, base=base):
            logits = runner.step(ids, block)
            runner.cache.offset = base
            return logits

        out[f"ar_step_{context}_ms"] = timed(lambda: step([1], False))
        out[f"block_step_{context}_ms"] = timed(lambda: step([1] * 12, True))
    model.steps.compile = False
    model.steps.functions.clear()
    runner = StepRunner(model.steps, model.new_cache())
    mx.eval(runner.prefill(mx.zeros((1, 512, d), mx.bfloat16)))
    base = runner.cache.offset

    def eager_step():
        logits = runner.step([1], False)
        runner.cache.offset = base
        return logits

    out["ar_step_512_eager_ms"] = timed(eager_step)
    for k, v in out.items():
        print(f"{k:32} {v:10.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
