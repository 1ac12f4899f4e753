"""`mlx-locate-bench`: what this machine does with a model, in one Markdown table and one JSON file to send us.

It measures the read-only memory bandwidth and the decode step's floor (the decoder's weight bytes over that
bandwidth); the one-shot command from a cold process (`mlx-locate --json`, its phases, and its import's seconds);
batch-1 block and AR step milliseconds, each as a multiple of the floor; a folder's images per second at 1 and 16
rows with each phase's seconds; a 12 MP photo's vision seconds and peak memory; the attention paths and row buckets
this device chose (`tune.py`). `--ops-per-buffer N ...` runs the steps again under each MLX_MAX_OPS_PER_BUFFER
value, each in its own process. The JSON holds the machine (chip, memory, OS, MLX version) beside the figures.

    mlx-locate-bench --model nvidia/LocateAnything-3B --json my-mac.json
    mlx-locate-bench --model demo --quick          # under a minute on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from ..compiled import PREFILL_ROWS, StepRunner
from ..locate import READ_AHEAD_ENV, READ_AHEAD_THREADS, LocateModel, read_ahead_threads
from ..network.attention import backend
from ..request import Request
from ..synthetic.scenes import make_scene
from . import flags

OPS_ENV = "MLX_MAX_OPS_PER_BUFFER"
PHOTO = (4032, 3024)  # a 12 MP phone photo
QUERY = "red box"
DEFAULT_OUT = "mlx-locate-bench.json"


def measure_bandwidth(gigabytes: float = 6.4) -> float:
    """Bytes/s of a read-only pass (a sum) over `gigabytes` of bf16: the floor of a step is its weight bytes over
    this. A small copy (128 MB) understates it: the L2 cache and the write traffic distort it."""
    x = mx.ones((int(gigabytes * 1e9) // 2 // 4096, 4096), dtype=mx.bfloat16)  # a dimension is an int32
    mx.eval(x)
    for _ in range(2):
        mx.eval(mx.sum(x))
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(mx.sum(x))
    seconds = (time.perf_counter() - t0) / n
    return x.nbytes / seconds


def timed_ms(fn, iters: int) -> float:
    """Milliseconds per call of `fn` (which waits for its own work), after 3 untimed calls (compilation)."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - t0) / iters


def machine() -> dict:
    """Chip, memory, OS, MLX version and the device MLX runs on."""
    chip = platform.processor() or platform.machine()
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        chip = out.stdout.strip() or chip
        system = f"macOS {platform.mac_ver()[0]}"
    else:
        system = platform.platform()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    return {"chip": chip, "memory_gb": memory / 1e9 if memory else None, "os": system, "mlx": mx.__version__,
            "backend": backend(), "device": info, OPS_ENV: os.environ.get(OPS_ENV)}  # fmt: skip


def step_ms(model: LocateModel, context: int, iters: int) -> dict:
    """Batch-1 ms of an AR step (1 row) and a block step (12 rows) at `context` cached tokens, one wait each."""
    runtime = model.runtime
    runner = StepRunner(runtime.steps, runtime.new_cache())
    d = runtime.network.config.text.hidden_size
    dtype = runtime.network.language_model.model.norm.weight.dtype
    mx.eval(runner.prefill(mx.zeros((1, context, d), dtype)))
    base = runner.offset
    out = {}
    for name, ids, block in (("ar_ms", [1], False), ("block_ms", [1] * 6 + [2] * 6, True)):

        def step(ids=ids, block=block):
            mx.eval(runner.step(ids, block))
            runner.offset = base

        out[name] = timed_ms(step, iters)
    return out


def one_shot(model_flags: list[str], image: Path, max_tokens: int, read_ahead: int | None = None) -> dict:
    """The one-shot command in a new process: seconds from its start to its exit, and its phases; `import_s`: a
    process that only starts and imports the command, from its start to its exit. `read_ahead`: the threads that
    read the decoder's weights (`locate.READ_AHEAD_ENV`), else the default."""
    env = {**os.environ, READ_AHEAD_ENV: str(read_ahead)} if read_ahead is not None else None
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import mlx_locate.commands.locate"], check=True, capture_output=True)
    import_s = time.perf_counter() - t0
    cmd = [sys.executable, "-m", "mlx_locate.commands.locate", *model_flags, "--image", str(image)]
    cmd += ["--query", QUERY, "--json", "--max-tokens", str(max_tokens)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the one-shot command failed: {proc.stderr.strip()[-400:]}")
    stats = json.loads(proc.stdout)["stats"]
    phases = ("load_s", "compile_s", "preprocess_s", "vision_s", "prefix_prefill_s", "prefill_s", "decode_s")
    return {"seconds": seconds, "import_s": import_s, **{k: stats[k] for k in phases}}


def folder(model: LocateModel, images: list[Path], rows: int, max_tokens: int) -> dict:
    """A folder of images, one query each, at `rows` rows: images/s and the engine's seconds by phase."""
    model.runtime.clear_caches()
    engine = model.engine(rows)
    handles = [engine.submit(Request(p, QUERY, max_tokens=max_tokens)) for p in images]
    t0 = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - t0
    failed = [h.error for h in handles if h.result is None]
    if failed:
        raise RuntimeError(f"the folder run failed: {failed[0]}")
    return {"images_per_s": len(images) / seconds, "seconds": seconds, "phases_s": dict(engine.seconds)}


def photo(model: LocateModel, path: Path) -> dict:
    """A 12 MP photo's vision seconds (tower and connector) and the process's peak memory meanwhile."""
    runtime = model.runtime
    runtime.clear_caches()
    image = runtime.prepare(path)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    runtime.features_for([image])
    return {
        "vision_s": time.perf_counter() - t0,
        "grid": list(image.pre.grid),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


def choices(model: LocateModel) -> dict:
    runtime = model.runtime
    return {
        "step_attention": runtime.steps.attention.value,
        "tower_chunked_attention": runtime.network.vision_model.chunked_attention,
        "row_costs_ms": {str(r): 1e3 * s for r, s in sorted(runtime.row_costs.items())},
        "compile_after": runtime.steps.compile_after,
        "prefill_chunk": runtime.prefill_chunk or PREFILL_ROWS,
        "tuning_s": runtime.tuning_s,  # what measuring them took, by part, where this device measured them
    }


def write_images(work: Path, n: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        paths.append(work / f"scene_{i}.jpg")
        make_scene(rng).image.convert("RGB").resize((640, 480)).save(paths[-1], quality=90)
    big = np.random.default_rng(1).integers(0, 255, (PHOTO[1] // 8, PHOTO[0] // 8, 3), dtype=np.uint8)
    Image.fromarray(big).resize(PHOTO).save(work / "photo_12mp.jpg", quality=90)
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-locate-bench", description="Measure this machine with a model.")
    flags.add_model(p, adapter=False)
    p.add_argument("--quick", action="store_true", help="fewer runs, a smaller folder and bandwidth test")
    p.add_argument("--ops-per-buffer", type=flags.positive_int, nargs="+", metavar="N",
                   help=f"also run the steps under each {OPS_ENV} value, each in its own process")  # fmt: skip
    p.add_argument("--steps-only", action="store_true", help=argparse.SUPPRESS)  # the --ops-per-buffer children
    p.add_argument("--macs-rows", nargs="+", type=Path, metavar="JSON", help=argparse.SUPPRESS)  # maintainers:
    # print the benchmarks/README "Macs" table's rows of these files, measure nothing
    flags.add_json(p, f"write the results here (default: {DEFAULT_OUT})", path=True)
    flags.add_overwrite(p, "an existing --json file")
    return p


def model_flags(args: argparse.Namespace) -> list[str]:
    """`add_model`'s flags as given, for the commands this one runs in their own processes."""
    flags = ["--model", args.model, *(["--dtype", args.dtype] if args.dtype else [])]
    return flags + (["--no-tune"] if args.tune is False else [])


def steps_report(model: LocateModel, quick: bool) -> dict:
    bandwidth = measure_bandwidth(0.25 if quick else 6.4)
    weights = sum(v.nbytes for _, v in tree_flatten(model.runtime.network.language_model.parameters()))
    floor_ms = 1e3 * weights / bandwidth
    steps = step_ms(model, context=256 if quick else 1024, iters=5 if quick else 20)
    return {"bandwidth_gb_s": bandwidth / 1e9, "decoder_gb": weights / 1e9, "floor_ms": floor_ms, **steps,
            "ar_x_floor": steps["ar_ms"] / floor_ms, "block_x_floor": steps["block_ms"] / floor_ms}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError, RuntimeError) as e:  # a model that does not load, a file that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.macs_rows:
        print("\n".join(macs_row(json.loads(f.read_text()), f.name) for f in args.macs_rows))
        return 0
    out = Path(args.json or DEFAULT_OUT)
    flags.check_new_file(out, "--json", "my-mac.json", args.overwrite)  # before any measuring
    model = flags.load_model(args)
    if args.steps_only:
        out.write_text(json.dumps(steps_report(model, args.quick)))
        return 0
    report: dict = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "quick": args.quick, "machine": machine()}
    report["choices"] = choices(model)
    report["steps"] = steps_report(model, args.quick)
    max_tokens = 48
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        images = write_images(work, 4 if args.quick else 32)
        threads = read_ahead_threads()
        report["cold_start"] = {"read_ahead": threads, **one_shot(model_flags(args), images[0], max_tokens)}
        other = 0 if threads else READ_AHEAD_THREADS  # the same without the threads, or with them
        report["cold_start_other"] = {"read_ahead": other, **one_shot(model_flags(args), images[0], max_tokens, other)}
        report["folder"] = {str(r): folder(model, images, r, max_tokens) for r in (1, 16)}
        report["photo_12mp"] = photo(model, work / "photo_12mp.jpg")
        report["ops_per_buffer"] = {}
        for n in args.ops_per_buffer or []:
            child = work / f"ops_{n}.json"
            cmd = [
                sys.executable,
                "-m",
                "mlx_locate.commands.bench",
                *model_flags(args),
                "--steps-only",
                "--json",
                str(child),
            ]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True, env={**os.environ, OPS_ENV: str(n)})
            report["ops_per_buffer"][str(n)] = json.loads(child.read_text())
    out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"\nwrote {out}: please attach it to an issue (see the README, 'Measure your Mac')")
    return 0


def markdown(r: dict) -> str:
    m, s, c, o = r["machine"], r["steps"], r["cold_start"], r["cold_start_other"]
    rows = [
        ("machine", f"{m['chip']}, {m['memory_gb']:.0f} GB, {m['os']}, MLX {m['mlx']} ({m['backend']})"),
        ("bandwidth (read-only)", f"{s['bandwidth_gb_s']:.0f} GB/s; step floor {s['floor_ms']:.2f} ms"),
        ("batch-1 block step", f"{s['block_ms']:.2f} ms = {s['block_x_floor']:.1f} x floor"),
        ("batch-1 AR step", f"{s['ar_ms']:.2f} ms = {s['ar_x_floor']:.1f} x floor"),
        (
            "cold one-shot",
            f"{c['seconds']:.2f} s (import {c['import_s']:.2f}, load {c['load_s']:.2f}, compile {c['compile_s']:.2f}, "
            f"vision {c['vision_s']:.2f}, decode {c['decode_s']:.2f}); decoder read ahead by {c['read_ahead']} "
            f"threads (0: behind the tower)",
        ),
        (
            f"cold one-shot, read ahead by {o['read_ahead']}",
            f"{o['seconds']:.2f} s (load {o['load_s']:.2f}, vision {o['vision_s']:.2f})",
        ),  # fmt: skip
    ]
    for rows_, f in r["folder"].items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in f["phases_s"].items())
        rows.append((f"folder at {rows_} rows", f"{f['images_per_s']:.2f} images/s ({phases} s)"))
    p = r["photo_12mp"]
    rows.append(("12 MP photo vision", f"{p['vision_s']:.2f} s, peak {p['peak_memory_gb']:.2f} GB"))
    ch = r["choices"]
    rows.append(("chosen", f"step attention {ch['step_attention']}, tower chunked {ch['tower_chunked_attention']}, "
                 f"rows {list(ch['row_costs_ms'])}, compile after {ch['compile_after']} calls"))  # fmt: skip
    if ch["tuning_s"]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in ch["tuning_s"].items())
        rows.append(("measuring those, once", f"{sum(ch['tuning_s'].values()):.1f} s ({parts} s)"))
    for n, o in r["ops_per_buffer"].items():
        rows.append((f"{OPS_ENV}={n}", f"block {o['block_ms']:.2f} ms, AR {o['ar_ms']:.2f} ms"))
    return "\n".join(["| what | measured |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def macs_row(r: dict, name: str) -> str:
    """A row of benchmarks/README.md's "Macs" table from one `--json` file."""
    m, s, f = r["machine"], r["steps"], r["folder"]
    cells = [m["chip"], f"{m['memory_gb']:.0f} GB", m["os"], m["mlx"], f"{s['bandwidth_gb_s']:.0f}",
             f"{s['block_x_floor']:.1f}", f"{s['ar_x_floor']:.1f}", f"{r['cold_start']['seconds']:.2f}",
             f"{f['1']['images_per_s']:.2f} / {f['16']['images_per_s']:.2f}", f"{r['photo_12mp']['vision_s']:.2f}",
             r["choices"]["step_attention"], name]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    raise SystemExit(main())
