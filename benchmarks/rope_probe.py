"""What RoPE costs on this device, by how its rotation is written: `x * cos + rotate(x) * sin` with rotate(x) a
reversed view of x (a negative stride: MLX's compiled kernels then index in 64 bits, element by element) against
the same arithmetic on forward views (`language.apply_rope`, `vision.apply_rope2d`), with `mx.fast.rope` (1-D
positions only, so not usable here) as the speed of a dedicated kernel. Shapes: the tower's q of 16 images of 640 x
480, the decoder's q|k|v for 16 prompt prefixes of ~420 tokens, and one block step of 16 rows. Prints one line per
measurement, checks both forms give equal values, and writes JSON with --json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import timed_ms  # noqa: E402

from mlx_locate.network.language import apply_rope, qkv_tables, rope_tables  # noqa: E402
from mlx_locate.network.vision import apply_rope2d, rope2d_tables  # noqa: E402

ITERS = 20


@mx.compile
def reversed_view_rope2d(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """The tower's RoPE with its rotation as a reversed view (the form before forward views)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    swapped = pairs[..., ::-1] * mx.array([-1, 1], dtype=x.dtype)
    cos, sin = cos[..., None, :, None], sin[..., None, :, None]
    out = pairs.astype(mx.float32) * cos + swapped.astype(mx.float32) * sin
    return out.astype(x.dtype).reshape(x.shape)


def reversed_view_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """The decoder's RoPE with its rotation as a reversed view (the form before forward views)."""
    *lead, D = x.shape
    halves = x.reshape(*lead, 2, D // 2)
    rotated = halves[..., ::-1, :] * mx.array([[-1], [1]], dtype=x.dtype)
    return (halves * cos + rotated * sin).reshape(*lead, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    results: dict[str, float] = {}

    def timed(fn) -> float:  # ms per evaluation of what fn builds
        return timed_ms(lambda: mx.eval(fn()), ITERS)

    def report(name: str, ms: float) -> None:
        results[name] = ms
        print(f"{name}: {ms:.3f} ms", flush=True)

    # The tower: q of 16 images of 640 x 480 (36 x 46 patches), as the strided slice of qkv the block takes.
    grid, heads, hd = (36, 46), 16, 72
    L = grid[0] * grid[1]
    qkv = mx.random.normal((16, L, 3, heads, hd)).astype(dtype)
    cos, sin = rope2d_tables(*grid, hd, 10000.0)
    cos, sin = cos[None], sin[None]
    mx.eval(qkv, cos, sin)
    new, old = apply_rope2d(qkv[:, :, 0], cos, sin), reversed_view_rope2d(qkv[:, :, 0], cos, sin)
    results["tower_max_abs_diff"] = mx.abs(new.astype(mx.float32) - old.astype(mx.float32)).max().item()
    report("tower_q_reversed_view_ms", timed(lambda: reversed_view_rope2d(qkv[:, :, 0], cos, sin)))
    report("tower_q_forward_views_ms", timed(lambda: apply_rope2d(qkv[:, :, 0], cos, sin)))
    q = qkv[:, :, 0].transpose(0, 2, 1, 3)
    mx.eval(q)
    report(
        "tower_q_fast_rope_1d_ms",
        timed(lambda: mx.fast.rope(q, hd, traditional=True, base=10000.0, scale=1.0, offset=0)),
    )

    # The decoder: q|k|v heads (16 + 2 + 2) x 128 for `rows` rows of `tokens` tokens.
    for name, rows, tokens in (("prefix_16x420", 16, 420), ("block_step_16x6", 16, 6)):
        x = mx.random.normal((rows, tokens, 20, 128)).astype(dtype)
        positions = mx.broadcast_to(mx.arange(tokens)[None], (rows, tokens))
        c, s = qkv_tables(*rope_tables(positions, 128, 1e6, dtype), 18, 2)
        mx.eval(x, c, s)
        fn_new, fn_old = mx.compile(apply_rope), mx.compile(reversed_view_rope)
        diff = mx.abs(fn_new(x, c, s).astype(mx.float32) - fn_old(x, c, s).astype(mx.float32)).max().item()
        results[f"{name}_max_abs_diff"] = diff
        report(f"{name}_reversed_view_ms", timed(lambda x=x, c=c, s=s, f=fn_old: f(x, c, s)))
        report(f"{name}_forward_views_ms", timed(lambda x=x, c=c, s=s, f=fn_new: f(x, c, s)))
        xt = x.transpose(0, 2, 1, 3)
        mx.eval(xt)
        report(
            f"{name}_fast_rope_ms",
            timed(lambda xt=xt: mx.fast.rope(xt, 128, traditional=False, base=1e6, scale=1.0, offset=0)),
        )
    print({k: v for k, v in results.items() if k.endswith("diff")}, flush=True)
    if args.json:
        meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "dtype": args.dtype}
        args.json.write_text(json.dumps({**meta, **results}, indent=1) + "\n")
    assert all(v == 0 for k, v in results.items() if k.endswith("diff")), "the two forms differ"


if __name__ == "__main__":
    main()
