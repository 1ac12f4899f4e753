"""Where a 3B decode step's time goes on the GPU: bandwidth, GEMV efficiency, launch overhead.

    python benchmarks/profile_gpu.py [--json out.json]
    python benchmarks/profile_gpu.py --ablate [--preset 3b] [--json out.json]

Compares our compiled AR/block step with bare chains of the same matrix-vector products, so a step's
distance from the weight-bandwidth floor splits into kernel efficiency and everything else. `--ablate`
instead times the step with one piece at a time removed or done another way (attention, its mask, the mask
boolean, attention by hand, RoPE, the K|V write, the MLP): what each piece costs inside the compiled step.
Ablated steps compute wrong values; only their time means something.
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

from bench import in_memory_model, measure_bandwidth  # noqa: E402

from mlx_locate.compiled import CompiledSteps, StepRunner  # noqa: E402
from mlx_locate.network import language  # noqa: E402


def timed(fn, iters: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0) / iters


language_attend = language.attend


def measure_steps(model, out: dict, suffix: str, contexts=(512, 2048)) -> None:
    for context, step in prepared_runners(model, contexts).items():
        out[f"ar_step_{context}{suffix}_ms"] = timed(lambda step=step: step([1], False))
        out[f"block_step_{context}{suffix}_ms"] = timed(lambda step=step: step([1] * 12, True))


def grouped_attend(q, k, v, scale, mask):
    """Attention by hand: GQA as a reshape (no repeated K/V), additive or boolean mask, float32 softmax."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    g = q.reshape(B, KV, H // KV * T, D) * scale
    scores = (g @ k.swapaxes(-1, -2)).reshape(B, KV, H // KV, T, -1)  # (B, KV, H/KV, T, K)
    if mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, -mx.inf)
    else:
        scores = scores + mask
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype).reshape(B, KV, H // KV * T, -1)
    return (probs @ v).reshape(B, H, T, D)


def op_overhead_us(ops: int = 400) -> float:
    """Microseconds per primitive in a compiled chain of small unfusable ops (RMSNorm of one 2048 row)."""
    x = mx.ones((1, 2048), mx.bfloat16)

    def chain(x):
        for _ in range(ops):
            x = mx.fast.rms_norm(x, None, 1e-6)
        return x

    compiled = mx.compile(chain)
    return 1e3 * timed(lambda: compiled(x)) / ops


def prepared_runners(model, contexts, compile: bool = True) -> dict:
    """Fresh compiled steps traced now (under whatever patch is active) with a prefilled cache per context."""
    runtime = model.runtime
    steps = CompiledSteps(runtime.network, compile=compile)
    d = runtime.network.config.text.hidden_size
    dtype = runtime.network.language_model.model.norm.weight.dtype
    runners = {}
    for context in contexts:
        runner = StepRunner(steps, runtime.new_cache())
        mx.eval(runner.prefill(mx.zeros((1, context, d), dtype)))
        base = runner.offset

        def step(ids, block, runner=runner, base=base):
            logits = runner.step(ids, block)
            runner.offset = base
            return logits

        mx.eval(step([1], False), step([1] * 12, True))  # trace both while the patch is active
        runners[context] = step
    return runners


def ablations(model, out: dict, contexts=(512, 2048), rounds: int = 5, iters: int = 20) -> None:
    """AR and block step times with one piece of every decoder layer replaced by a no-op.

    Every variant is traced first; then the variants are timed in interleaved rounds and each keeps its best
    round, so a machine that slows down for a while penalises all of them alike."""
    slice_update, apply_rope, mlp = mx.slice_update, language.apply_rope, language.MLP.__call__
    additive_mask = language.additive_mask
    variants = {
        "": lambda: None,
        "_no_attention": lambda: setattr(language, "attend", lambda q, k, v, scale, mask: q),
        "_no_mask": lambda: setattr(
            language, "attend", lambda q, k, v, scale, mask: language_attend(q, k, v, scale, None)
        ),
        "_bool_mask": lambda: setattr(language, "additive_mask", lambda mask, dtype: mask),
        "_by_hand_attention": lambda: setattr(language, "attend", grouped_attend),
        "_no_rope": lambda: setattr(language, "apply_rope", lambda x, cos, sin: x),
        "_no_kv_write": lambda: setattr(mx, "slice_update", lambda buf, update, start, axes: buf),
        "_no_mlp": lambda: setattr(language.MLP, "__call__", lambda self, x: x),
    }
    prepared = {}
    for suffix, patch in variants.items():
        patch()
        try:
            prepared[suffix] = prepared_runners(model, contexts)
        finally:
            language.attend, language.apply_rope, language.additive_mask = language_attend, apply_rope, additive_mask
            language.MLP.__call__ = mlp
            mx.slice_update = slice_update
    for _ in range(rounds):
        for suffix, runners in prepared.items():
            for context, step in runners.items():
                for name, ids, block in (("ar", [1], False), ("block", [1] * 12, True)):
                    key = f"{name}_step_{context}{suffix}_ms"
                    ms = timed(lambda step=step, ids=ids, block=block: step(ids, block), iters)
                    out[key] = min(out.get(key, ms), ms)
    for suffix in prepared:
        keys = [f"{name}_step_{context}{suffix}_ms" for context in contexts for name in ("ar", "block")]
        print(
            f"{suffix or '_base':20}", "  ".join(f"{k.split('_step')[0]} {k.split('_')[2]}: {out[k]:.2f}" for k in keys)
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--ablate", action="store_true", help="only the per-piece ablation of the step")
    parser.add_argument("--preset", default="3b", help="random_checkpoint preset for --ablate")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="cached lengths for --ablate")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds for --ablate")
    args = parser.parse_args()
    out = {}
    if args.ablate:
        out["op_overhead_us"] = op_overhead_us()
        print(f"compiled chain of small ops: {out['op_overhead_us']:.1f} us per op")
        ablations(in_memory_model(args.preset, args.dtype), out, args.contexts, args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    out["read_gb_s"] = measure_bandwidth() / 1e9  # a read-only pass over 6.4 GB, as bench.py's floor

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
    out["floor_ms"] = weight_bytes / (out["read_gb_s"] * 1e6)

    def chain(x):
        for q, k, v, o, g, u, dn in ws:
            h = x @ q.T + (x @ k.T).sum() + (x @ v.T).sum()
            x = x + h @ o.T
            x = x + (mx.sigmoid(x @ g.T) * (x @ u.T)) @ dn.T
        return x @ head.T

    fused = [
        (mx.concatenate([q, k, v]), o, mx.concatenate([g, u]), dn) for q, k, v, o, g, u, dn in ws
    ]  # q|k|v and gate|up as one matrix each
    mx.eval(fused)

    def chain_fused(x):
        for qkv, o, gu, dn in fused:
            h = x @ qkv.T
            x = x + h[..., :d] @ o.T
            gate_up = x @ gu.T
            x = x + (mx.sigmoid(gate_up[..., :f]) * gate_up[..., f:]) @ dn.T
        return x @ head.T

    compiled_fused = mx.compile(chain_fused)
    for rows in (1, 12):
        x = (mx.random.normal((1, rows, d)) * 0.1).astype(mx.bfloat16)
        out[f"gemv_chain_fused_compiled_{rows}_ms"] = timed(lambda x=x: compiled_fused(x))
    for rows in (1, 12):
        x = (mx.random.normal((1, rows, d)) * 0.1).astype(mx.bfloat16)
        out[f"gemv_chain_eager_{rows}_ms"] = timed(lambda x=x: chain(x))
        compiled = mx.compile(chain)
        out[f"gemv_chain_compiled_{rows}_ms"] = timed(lambda x=x, c=compiled: c(x))
    w = ws[0][4]
    x = mx.random.normal((1, d)).astype(mx.bfloat16)
    out["single_gemv_gb_s"] = w.nbytes / timed(lambda: x @ w.T, 200) / 1e6
    out["head_gemv_ms"] = timed(lambda: x @ head.T, 50)

    # One layer's attention at a bucketed cache view: fused SDPA with a boolean mask (ours), without a mask,
    # and by hand with GQA as a reshape (no repeated K/V).
    H, KV, hd = 16, 2, 128
    for U in (768, 2304):
        q = mx.random.normal((1, H, 1, hd)).astype(mx.bfloat16)
        k = mx.random.normal((1, KV, U, hd)).astype(mx.bfloat16)
        v = mx.random.normal((1, KV, U, hd)).astype(mx.bfloat16)
        mask = mx.arange(U)[None, :] < U - 100

        def fused(q=q, k=k, v=v, mask=mask):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5, mask=mask)

        def unmasked(q=q, k=k, v=v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)

        def by_hand(q=q, k=k, v=v, mask=mask):
            g = q.reshape(1, KV, H // KV, hd) * hd**-0.5
            scores = mx.where(mask, g @ k.swapaxes(-1, -2), -mx.inf)
            return (mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype) @ v).reshape(1, H, 1, hd)

        for name, fn in (("sdpa_mask", fused), ("sdpa_nomask", unmasked), ("by_hand", by_hand)):
            out[f"attn_{name}_{U}_x36_ms"] = 36 * timed(mx.compile(fn), 50)

    model = in_memory_model("3b", "bfloat16")
    measure_steps(model, out, "")

    language.attend = grouped_attend
    measure_steps(model, out, "_grouped")
    language.attend = language_attend
    eager_step = prepared_runners(model, [512], compile=False)[512]
    out["ar_step_512_eager_ms"] = timed(lambda: eager_step([1], False))
    for k, v in out.items():
        print(f"{k:32} {v:10.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
