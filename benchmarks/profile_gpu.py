"""Where a 3B decode step's time goes on the GPU: bandwidth, GEMV efficiency, launch overhead.

    python benchmarks/profile_gpu.py [--json out.json]
    python benchmarks/profile_gpu.py --ablate [--preset 3b] [--json out.json]

Compares our compiled AR/block step with bare chains of the same matrix-vector products, so a step's
distance from the weight-bandwidth floor splits into kernel efficiency and everything else. `--ablate`
instead times the step with one piece at a time replaced by a no-op (attention, its mask, RoPE, the K/V
write, the MLP): what each piece costs inside the compiled step. Ablated steps compute wrong values; only
their time means something.
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

from mlx_locate import language  # noqa: E402
from mlx_locate.compiled import CompiledSteps, StepRunner  # noqa: E402


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


def fuse_projections(model) -> None:
    """q|k|v and gate|up as one matrix each (a preview: memory for both copies is spent)."""
    for layer in model.network.language_model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv = (
            mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            mx.concatenate([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
        )
        m.gate_up = mx.concatenate([m.gate_proj.weight, m.up_proj.weight])
        mx.eval(a.qkv, m.gate_up)

    def attention(self, x, cos, sin, mask, kv=None, c=None):
        B, T, _ = x.shape
        hd = self.q_proj.weight.shape[0] // self.n_heads
        qkv = mx.addmm(self.qkv[1], x, self.qkv[0].T)
        q, k, v = mx.split(qkv, [self.n_heads * hd, (self.n_heads + self.n_kv_heads) * hd], axis=-1)
        q = q.reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = language.apply_rope(q, cos, sin), language.apply_rope(k, cos, sin)
        start = mx.concatenate([mx.zeros((2,), mx.int32), c.reshape(1), mx.zeros((1,), mx.int32)])
        k = mx.slice_update(kv[0], k.astype(kv[0].dtype), start, axes=(0, 1, 2, 3))
        v = mx.slice_update(kv[1], v.astype(kv[1].dtype), start, axes=(0, 1, 2, 3))
        out = language.attend(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), (k, v)

    def mlp(self, x):
        gate, up = mx.split(x @ self.gate_up.T, 2, axis=-1)
        return self.down_proj(language.nn.silu(gate) * up)

    language.Attention.__call__, language.MLP.__call__ = attention, mlp


def scatter_update(buf, update, start, axes):
    """The K/V write as a scatter at slots c.. (instead of a dynamic slice update)."""
    buf[:, :, start[2] + mx.arange(update.shape[2]), :] = update
    return buf


def where_update(buf, update, start, axes):
    """The K/V write as one elementwise select over the whole buffer."""
    slot = mx.arange(buf.shape[2]) - start[2]
    inside = (slot >= 0) & (slot < update.shape[2])
    return mx.where(inside[:, None], mx.take(update, mx.clip(slot, 0, update.shape[2] - 1), axis=2), buf)


def prepared_runners(model, contexts, compile: bool = True) -> dict:
    """Fresh compiled steps traced now (under whatever patch is active) with a prefilled cache per context."""
    steps = CompiledSteps(model.network, compile=compile)
    d = model.network.config.text.hidden_size
    dtype = model.network.language_model.model.norm.weight.dtype
    runners = {}
    for context in contexts:
        runner = StepRunner(steps, model.new_cache())
        mx.eval(runner.prefill(mx.zeros((1, context, d), dtype)))
        base = runner.cache.offset

        def step(ids, block, runner=runner, base=base):
            logits = runner.step(ids, block)
            runner.cache.offset = base
            return logits

        mx.eval(step([1], False), step([1] * 12, True))  # trace both while the patch is active
        runners[context] = step
    return runners


def ablations(model, out: dict, contexts=(512, 2048), rounds: int = 5, iters: int = 20) -> None:
    """AR and block step times with one piece of every decoder layer replaced by a no-op.

    Every variant is traced first; then the variants are timed in interleaved rounds and each keeps its best
    round, so a machine that slows down for a while penalises all of them alike."""
    slice_update, apply_rope, mlp = mx.slice_update, language.apply_rope, language.MLP.__call__
    attention_call = language.Attention.__call__
    variants = {
        "": lambda: None,
        "_no_attention": lambda: setattr(language, "attend", lambda q, k, v, scale, mask: q),
        "_no_mask": lambda: setattr(
            language, "attend", lambda q, k, v, scale, mask: language_attend(q, k, v, scale, None)
        ),
        "_no_rope": lambda: setattr(language, "apply_rope", lambda x, cos, sin: x),
        "_no_kv_write": lambda: setattr(mx, "slice_update", lambda buf, update, start, axes: buf),
        "_no_mlp": lambda: setattr(language.MLP, "__call__", lambda self, x: x),
        "_kv_scatter": lambda: setattr(mx, "slice_update", scatter_update),
        "_kv_where": lambda: setattr(mx, "slice_update", where_update),
        "_fused_projections": lambda: fuse_projections(model),
    }
    prepared = {}
    for suffix, patch in variants.items():
        patch()
        try:
            prepared[suffix] = prepared_runners(model, contexts)
        finally:
            language.attend, language.apply_rope = language_attend, apply_rope
            language.Attention.__call__, language.MLP.__call__ = attention_call, mlp
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
        ablations(in_memory_model(args.preset, args.dtype), out, args.contexts, args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
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

    def grouped_attend(q, k, v, scale, mask):
        B, H, T, D = q.shape
        KV = k.shape[1]
        g = q.reshape(B, KV, H // KV * T, D) * scale
        scores = g @ k.swapaxes(-1, -2)  # (B, KV, H/KV*T, K)
        scores = mx.where(mx.tile(mask, (H // KV, 1)), scores, -mx.inf)
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
        return (probs @ v).reshape(B, H, T, D)

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
