"""Peak memory: one image at a time by phase (vision tower, prompt prefix, the whole request), and a folder of
images through one engine at each row count.

    python benchmarks/memory_bench.py --preset 3b --in-memory --images 640x480 1920x1080 4032x3024 \
        --rows 1 4 16 --folder 32 --folder-sizes 640x480 1920x1080 --json out.json     # the GPU machine
    python benchmarks/memory_bench.py --preset 3b --in-memory --memory-limit 16 --alone \
        --images 1008x756 1424x1068 2016x1512 4032x3024 --json out.json             # each size in its own process
    LD_PRELOAD=$OPENBLAS python benchmarks/memory_bench.py --preset medium --dtype float32 --images 640x480 \
        --rows 1 4 --folder 4                                                       # this CPU

Memory is MLX's own account (`mx.get_peak_memory`, reset before each measurement), reported above the weights
(`mx.get_active_memory` once the model is loaded). Each image also records what the budget planned for it (the
tower's pieces, the prompt prefix's prefill calls, at the unit costs measured when the model loaded) and the
peak of each phase of its request. `--alone` measures each size, and the folder runs, in a process of its own
(a peak then holds nothing of an earlier image: no cached prefix, no allocator cache). Prints a table last and
writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import folder_images, in_memory_model, make_image  # noqa: E402

import mlx_locate  # noqa: E402
from mlx_locate.cache import kv_bucket  # noqa: E402
from mlx_locate.commands.flags import add_memory_limit, apply_memory_limit  # noqa: E402
from mlx_locate.compiled import PREFILL_ROWS  # noqa: E402
from mlx_locate.request import Request  # noqa: E402
from mlx_locate.runtime import cache_copies_bytes  # noqa: E402

GB = 1e9
QUERY = "red box"


def peak_of(fn) -> tuple[float, float]:
    """(peak bytes while `fn` ran, seconds)."""
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    fn()
    return mx.get_peak_memory(), time.perf_counter() - t0


def plan_of(model, grid: tuple[int, int], prefix_len: int) -> dict:
    """What the budget plans for one image of `grid` patches: the tower's images per call and blocks per
    evaluation, and the prompt prefix's rows per prefill call (beside its cache's copies), each with the bytes
    the load-time unit costs give."""
    runtime = model.runtime
    budget, patches = runtime.budget, grid[0] * grid[1]
    batch, per_eval = budget.tower_plan(1, patches, len(runtime.network.vision_model.encoder.blocks))
    cache = runtime.new_cache(1)
    copies = cache_copies_bytes(cache, prefix_len, runtime.budget)
    rows = min(runtime.prefill_rows(prefix_len, cache), PREFILL_ROWS)
    return {
        "tower_images": batch,
        "tower_blocks_per_eval": per_eval,
        "tower_piece_gb": patches * budget.patch_bytes * per_eval / GB,
        "prefill_rows_per_call": rows,
        "prefill_call_gb": (rows * budget.prefill_row_cost(kv_bucket(prefix_len)) + copies) / GB,
        "prefill_calls": -(-prefix_len // rows),
    }


def one_image(model, path: Path, max_tokens: int, image_tokens: int | None = None) -> dict:
    """Peaks of one image's vision tower, its prompt prefix and its whole request (fresh caches each; the
    request's by phase too), and the budget's plan for it; `image_tokens`: a patch budget below the model's."""
    runtime = model.runtime
    weights = mx.get_active_memory()
    image = runtime.prepare(path, max_image_tokens=image_tokens)
    prefix = runtime.prompt("", image.pre.grid)
    prefix = prefix[: prefix.index(runtime.token_ids.img_end) + 1]
    runtime.clear_caches()
    vision, vision_s = peak_of(lambda: mx.eval(runtime.features_for([image])[0][1]))
    features = runtime.features_for([image])[0][1]
    prefix_peak, prefix_s = peak_of(lambda: mx.eval(runtime.compute_prefixes([(prefix, features)])))
    runtime.clear_caches()
    engine = model.engine()
    phases = PhasePeaks(model.runtime, engine, weights)
    try:
        asked = Request(image, QUERY, mode="fast", max_tokens=max_tokens, max_image_tokens=image_tokens)
        request_fn = lambda: engine.submit(asked) and engine.run()  # noqa: E731
        request, request_s = peak_of(request_fn)
    finally:
        phases.remove(model.runtime)
    result = model.locate(image, QUERY, mode="fast", max_tokens=max_tokens, max_image_tokens=image_tokens)
    return {
        "grid": list(image.pre.grid),
        "image_tokens": image.pre.grid[0] * image.pre.grid[1] // 4,
        "vision_gb": (vision - weights) / GB,
        "vision_s": vision_s,
        "prefix_gb": (prefix_peak - weights) / GB,
        "prefix_s": prefix_s,
        "request_gb": (max(request, phases.peak) - weights) / GB,
        "request_s": request_s,
        "request_phases": phases.phases,
        "plan": plan_of(model, image.pre.grid, len(prefix)),
        "token_ids": result.token_ids,
    }


def attention_probe(model, lengths: list[int]) -> dict:
    """Peak of one fused-attention call over the tower's head shape at each sequence length, and of one block."""
    runtime = model.runtime
    v = runtime.network.config.vision
    dtype = runtime.network.vision_model.patch_embed.proj.weight.dtype
    block = runtime.network.vision_model.encoder.blocks[0]
    out = {}
    for L in lengths:
        q, k, w = (mx.random.normal((1, v.num_attention_heads, L, v.head_dim)).astype(dtype) for _ in range(3))
        x = mx.random.normal((1, L, v.hidden_size)).astype(dtype)
        cos, sin = mx.zeros((1, L, v.head_dim // 2)), mx.ones((1, L, v.head_dim // 2))
        mx.eval(q, k, w, x, cos, sin)
        base = mx.get_active_memory()
        sdpa, _ = peak_of(lambda q=q, k=k, w=w: mx.eval(mx.fast.scaled_dot_product_attention(q, k, w, scale=0.1)))
        one, _ = peak_of(lambda x=x, cos=cos, sin=sin: mx.eval(block(x, cos, sin)))
        out[L] = {"sdpa_gb": (sdpa - base) / GB, "block_gb": (one - base) / GB}
        print("attention", L, out[L], flush=True)
    return out


def prefill_probe(model, calls: list[str]) -> dict:
    """Peak of one prefill call of R rows after K cached keys of one sequence ("RxK"; the working memory lifted so
    that it is one call), above what is held before it, beside what the budget plans for such a call (rows x (row
    bytes + keys x key bytes), and its cache's copies): whether a call's memory grows as the budget says."""
    runtime = model.runtime
    budget, t = runtime.budget, runtime.network.config.text
    dtype = runtime.network.language_model.model.norm.weight.dtype
    out = {}
    runtime.budget = dataclasses.replace(budget, working=1 << 50, prefill_cap=None)  # one call of R <= PREFILL_ROWS
    for call in calls:
        R, K = (int(v) for v in call.split("x"))
        cache = runtime.new_cache(1)
        if K:
            runtime.prefill(cache, [(0, mx.zeros((K, t.hidden_size), dtype), 0)])
        x = mx.zeros((R, t.hidden_size), dtype)
        mx.eval(x, cache.kv)
        held = mx.get_active_memory()
        peak, seconds = peak_of(
            lambda x=x, K=K, cache=cache: mx.eval(list(runtime.prefill(cache, [(0, x, K)]).values()))
        )
        planned = R * budget.prefill_row_cost(kv_bucket(K + R))
        planned += cache_copies_bytes(cache, K + R, runtime.budget)
        out[call] = {"peak_gb": (peak - held) / GB, "planned_gb": planned / GB, "seconds": seconds}
        print("prefill", call, out[call], flush=True)
    runtime.budget = budget
    return out


class PhasePeaks:
    """The engine's phases (vision, prompt prefixes, prefills, decode steps) wrapped on one engine: each phase's
    highest peak above the weights, and what was held when it began. A phase called inside another (the prompt
    prefixes' own prefill) counts as part of the outer one."""

    PHASES = {"vision": "features_for", "prefix": "compute_prefixes", "prefill": "prefill"}

    def __init__(self, runtime, engine, weights: int):
        self.weights, self.peak, self.inside = weights, 0, False
        self.phases: dict[str, dict[str, float]] = {}
        for name, attr in self.PHASES.items():
            setattr(runtime, attr, self.wrap(name, getattr(runtime, attr)))
        engine.decode_rows = self.wrap("decode", engine.decode_rows)

    @staticmethod
    def remove(runtime) -> None:
        """The runtime's own methods again."""
        for attr in PhasePeaks.PHASES.values():
            delattr(runtime, attr)

    def wrap(self, name: str, fn):
        def run(*args, **kwargs):
            if self.inside:
                return fn(*args, **kwargs)
            self.peak = max(self.peak, mx.get_peak_memory())
            held = mx.get_active_memory()
            mx.reset_peak_memory()
            self.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = False
                peak = mx.get_peak_memory()
                self.peak = max(self.peak, peak)
                phase = self.phases.setdefault(name, {"peak_gb": 0.0, "held_gb": 0.0})
                phase["peak_gb"] = max(phase["peak_gb"], (peak - self.weights) / GB)
                phase["held_gb"] = max(phase["held_gb"], (held - self.weights) / GB)

        return run


def folder(model, paths: list[Path], rows: int, max_tokens: int) -> dict:
    """A folder through one engine of `rows` rows (a warm-up run first): peak above the weights, images/s, and
    each phase's peak (`PhasePeaks`)."""
    weights = mx.get_active_memory()
    requests = [Request(p, QUERY, mode="fast", max_tokens=max_tokens) for p in paths]
    model.runtime.clear_caches()
    model.locate_many(requests, max_rows=rows)
    model.runtime.clear_caches()
    engine = model.engine(rows)
    phases = PhasePeaks(model.runtime, engine, weights)
    try:
        peak, seconds = peak_of(lambda: [engine.submit(r) for r in requests] and engine.run())
    finally:
        phases.remove(model.runtime)
    return {
        "rows": engine.max_rows,
        "peak_gb": (max(peak, phases.peak) - weights) / GB,
        "images_per_s": len(paths) / seconds,
        "engine_seconds": engine.seconds,
        "phases": phases.phases,
    }


def alone(args: argparse.Namespace) -> dict:
    """Each `--images` size in a process of its own, and the folder and attention runs in one more; their reports
    merged (each image keeps the weights and working memory of its process)."""
    base = [sys.executable, __file__, "--preset", args.preset, "--dtype", args.dtype, "--work", args.work]
    base += ["--max-tokens", str(args.max_tokens)]
    for flag, value in (("--model", args.model), ("--quantize", args.quantize), ("--memory-limit", args.memory_limit)):
        base += [] if value is None else [flag, str(value)]
    base += ["--in-memory"] if args.in_memory else []
    runs = [
        ["--images", size, *(["--image-tokens", str(t)] if t else [])]
        for size in args.images
        for t in args.image_tokens or [None]
    ]
    if args.rows or args.attention or args.prefill_probe:
        rest = ["--images", "--rows", *map(str, args.rows), "--folder", str(args.folder)]
        rest += ["--folder-sizes", *args.folder_sizes, "--working", *map(str, args.working)]
        runs.append(rest + ["--attention", *map(str, args.attention), "--prefill-probe", *args.prefill_probe])
    report = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, run in enumerate(runs):
            out = Path(tmp) / f"{i}.json"
            subprocess.run([*base, *run, "--json", str(out)], check=True)
            part = json.loads(out.read_text())
            for r in part["images"].values():
                r["process"] = {k: part[k] for k in ("weights_gb", "working_gb", "budget")}
            if report is None:
                report = part
            else:
                report["images"] |= part["images"]
                report["folder"] |= part["folder"]
                report["attention"] |= part["attention"]
                report["prefill_probe"] |= part["prefill_probe"]
    report["alone"] = True
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or 'demo' (default: --preset's random weights)")
    p.add_argument("--preset", default="3b")
    p.add_argument("--in-memory", action="store_true", help="random weights drawn on the device")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", help="with --in-memory: a converter preset (q8, mixed_4_8)")
    p.add_argument("--images", nargs="*", default=["640x480"], help="WxH sizes measured one at a time")
    p.add_argument(
        "--image-tokens", nargs="*", type=int, default=[], help="patch budgets below the model's, each image at each"
    )
    p.add_argument("--alone", action="store_true", help="each size (and the folder runs) in a process of its own")
    p.add_argument("--rows", nargs="*", type=int, default=[], help="engine rows for the folder runs")
    p.add_argument("--folder", type=int, default=16, help="images in the folder runs (640x480)")
    p.add_argument("--folder-sizes", nargs="+", default=["640x480"], help="image sizes of the folder runs")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--work", default=".bench", help="folder for generated images")
    p.add_argument("--attention", nargs="*", type=int, default=[], help="sequence lengths for attention_probe")
    p.add_argument("--prefill-probe", nargs="*", default=[], metavar="RxK", help="prefill calls of R rows after K keys")
    p.add_argument(
        "--working",
        nargs="*",
        type=float,
        default=[],
        help="GB of working memory for the folder runs, each in turn (default: the budget measured at load)",
    )
    add_memory_limit(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    report = alone(args) if args.alone else measure(args)
    report["command"] = " ".join(["python", "benchmarks/memory_bench.py", *(sys.argv[1:] if argv is None else argv)])
    print_report(report, args.folder)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Every measurement `args` asks for, in this process."""
    apply_memory_limit(args)
    work = Path(args.work)
    if args.model:
        model = mlx_locate.load(args.model, dtype=args.dtype)
    else:
        model = in_memory_model(args.preset, args.dtype, args.quantize)
    mx.eval(mx.zeros(1))
    budget = model.runtime.budget
    report = {
        "device": str(mx.default_device()),
        "device_info": {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))},
        "memory_limit_gb": mx.get_memory_limit() / GB,
        "working_gb": budget.working / GB,
        "weights_gb": mx.get_active_memory() / GB,
        "budget": {k: getattr(budget, k) for k in ("limit", "weights", "working", "kv", "patch_bytes")}
        | {k: getattr(budget, k) for k in ("prefill_row_bytes", "prefill_key_bytes", "slot_bytes")},
        "preset": args.model or args.preset,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "images": {},
        "folder": {},
    }
    report["attention"] = attention_probe(model, args.attention)
    report["prefill_probe"] = prefill_probe(model, args.prefill_probe)
    for size in args.images:
        w, h = (int(v) for v in size.split("x"))
        path = make_image((w, h), work / f"memory_{size}.png")
        for tokens in args.image_tokens or [None]:
            key = size if tokens is None else f"{size}@{tokens}"
            report["images"][key] = one_image(model, path, args.max_tokens, tokens)
            print(key, {k: v for k, v in report["images"][key].items() if k != "token_ids"}, flush=True)
    for size in args.folder_sizes if args.rows else []:
        w, h = (int(v) for v in size.split("x"))
        paths, _ = folder_images(None, (w, h), args.folder, work)
        report["folder"][size] = {}
        measured = model.runtime.budget
        for working in args.working or [None]:
            if working is not None:
                model.runtime.budget = dataclasses.replace(measured, working=int(working * GB))
            for rows in args.rows:
                key = f"{rows}" if working is None else f"{rows}@{working:g}GB"
                report["folder"][size][key] = folder(model, paths, rows, args.max_tokens)
                print(size, key, report["folder"][size][key], flush=True)
        model.runtime.budget = measured
    return report


def print_report(report: dict, folder_count: int) -> None:
    print(f"\nweights {report['weights_gb']:.2f} GB on {report['device']} ({report['preset']}, {report['dtype']})")
    print(
        "| image | image tokens | vision GB | prefix GB | request GB | request s | tower blocks per evaluation "
        "(GB planned) | prefill rows per call (GB planned) |\n|---|---|---|---|---|---|---|---|"
    )
    for size, r in report["images"].items():
        plan = r["plan"]
        print(
            f"| {size} | {r['image_tokens']} | {r['vision_gb']:.2f} | {r['prefix_gb']:.2f} | {r['request_gb']:.2f} "
            f"| {r['request_s']:.2f} | {plan['tower_blocks_per_eval']} ({plan['tower_piece_gb']:.2f}) "
            f"| {plan['prefill_rows_per_call']} ({plan['prefill_call_gb']:.2f}) |"
        )
    if report["folder"]:
        print(
            f"\n| images ({folder_count} a folder) | rows | peak GB above weights | images/s | by phase |\n"
            "|---|---|---|---|---|"
        )
        for size, runs in report["folder"].items():
            for rows, r in runs.items():
                phases = ", ".join(f"{k} {v['peak_gb']:.2f}" for k, v in r["phases"].items())
                print(f"| {size} | {rows} | {r['peak_gb']:.2f} | {r['images_per_s']:.2f} | {phases} |")


if __name__ == "__main__":
    raise SystemExit(main())
