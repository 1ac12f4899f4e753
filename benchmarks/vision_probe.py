"""Where the vision tower's time goes on a GPU: attention alone by head size, one block, the whole tower by
images per call and by blocks per evaluation. Prints one line per measurement."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import in_memory_model  # noqa: E402


def timed(fn, iters: int = 5) -> float:
    fn()
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters


def main() -> None:
    B, H, L = 16, 16, 1656
    for D in (64, 72, 80, 128):
        q, k, v = (mx.random.normal((B, H, L, D)).astype(mx.bfloat16) for _ in range(3))
        mx.eval(q, k, v)
        ms = timed(lambda q=q, k=k, v=v: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1)))
        print(f"sdpa B={B} H={H} L={L} D={D}: {ms:.2f} ms", flush=True)
    runtime = in_memory_model("3b", "bfloat16").runtime
    tower = runtime.network.vision_model
    grid = (36, 46)
    for images in (1, 16):
        x = mx.random.normal((images, L, 1152)).astype(mx.bfloat16)
        mx.eval(x)
        block = tower.encoder.blocks[0]
        from mlx_locate.network.vision import rope2d_tables

        cos, sin = rope2d_tables(*grid, 72, 10000.0)
        ms = timed(lambda x=x, block=block, cos=cos, sin=sin: mx.eval(block(x, cos[None], sin[None])))
        print(f"one block, {images} images: {ms:.2f} ms", flush=True)
        for per_eval in (1, 27):

            def run(x=x, per_eval=per_eval):
                y = x
                for first in range(0, 27, per_eval):
                    y = tower.run_blocks(y, grid, first, first + per_eval)
                    mx.eval(y)

            ms = timed(run, 2)
            print(
                f"tower, {images} images, {per_eval} blocks per eval: {ms:.1f} ms ({ms / images:.1f} per image)",
                flush=True,
            )
    qkv = mx.random.normal((16 * L, 1152)).astype(mx.bfloat16)
    w = mx.random.normal((3456, 1152)).astype(mx.bfloat16)
    mx.eval(qkv, w)
    ms = timed(lambda: mx.eval(qkv @ w.T))
    print(
        f"matmul {16 * L}x1152 @ 1152x3456: {ms:.2f} ms = {2 * 16 * L * 1152 * 3456 / ms / 1e9:.0f} TFLOP/s", flush=True
    )
    from mlx_locate.network.vision import apply_rope2d

    t = mx.random.normal((16, L, 16, 72)).astype(mx.bfloat16)
    c, s = rope2d_tables(*grid, 72, 10000.0)
    mx.eval(t)
    ms = timed(lambda: mx.eval(apply_rope2d(t, c[None], s[None])))
    print(f"rope2d on 16 images: {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
