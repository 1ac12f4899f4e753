"""Benchmarks of mlx_locate: per-phase timings, step costs, boxes, compilations, memory.

    python benchmarks/bench.py --preset medium [--peer .bench/venv/bin/python] [--json out.json]
    python benchmarks/bench.py --preset 3b --in-memory            # the GPU machine: no 7 GB file written
    python benchmarks/bench.py --model demo --images mlx_locate/demo/example.png --query square --peer ...
    python benchmarks/bench.py --preset 3b --in-memory --batch 1 2 4 8 16 32   # the batched engine's scaling

Prints a table last and writes full results as JSON. Random weights (a preset) make meaningless boxes: block
and AR step costs, prefill and vision times are what matter; decisions still run the real rules. A trained
checkpoint (`--model`, e.g. the bundled demo) writes real boxes, so time to first box and boxes/s mean
something. With --peer, the same inputs go through mlx-vlm (benchmarks/peer_mlxvlm.py) in that interpreter,
in the same run; with --batch, the folder goes through its `batch_generate` at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx_locate  # noqa: E402
from mlx_locate.commands.bench import measure_bandwidth, step_ms, timed_ms  # noqa: E402
from mlx_locate.commands.convert import PRESETS as QUANT_PRESETS  # noqa: E402
from mlx_locate.commands.convert import quantization_plan  # noqa: E402
from mlx_locate.compiled import Phase  # noqa: E402
from mlx_locate.config import ModelConfig  # noqa: E402
from mlx_locate.engine import Schedule  # noqa: E402
from mlx_locate.locate import LocateModel  # noqa: E402
from mlx_locate.network.model import LocateAnything  # noqa: E402
from mlx_locate.prompts import task_text  # noqa: E402
from mlx_locate.request import DEFAULT_TASK, Request  # noqa: E402
from mlx_locate.sampling import Features, RowSampling, Sampling, summary_functions  # noqa: E402
from mlx_locate.tokenizer import Tokenizer  # noqa: E402
from mlx_locate.weights.checkpoint import resolve  # noqa: E402
from mlx_locate.weights.loader import Checkpoint  # noqa: E402
from mlx_locate.weights.random_checkpoint import PRESETS, make_random_checkpoint  # noqa: E402

TOKENIZER_DIR = ROOT / "tests" / "data" / "golden" / "tokenizer"
IMAGES = {"640x480": ROOT / "tests/data/golden/images/shapes_640x480.png"}
QUERY = "red box"


def blas_name() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    return Path(preload).name if "blas" in preload else "mlx default (reference BLAS on Linux CPU)"


def make_image(size: tuple[int, int], out: Path) -> Path:
    """A deterministic test image of the given size (shapes on a gradient)."""
    if not out.exists():
        w, h = size
        rng = np.random.default_rng(0)
        x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
        y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
        img = np.concatenate([np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)), np.full((h, w, 1), 90)], -1)
        for _ in range(12):
            x0, y0 = rng.integers(0, w - 40), rng.integers(0, h - 40)
            img[y0 : y0 + rng.integers(20, 120), x0 : x0 + rng.integers(20, 120)] = rng.integers(0, 255, 3)
        out.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img.astype(np.uint8)).save(out)
    return out


def in_memory_model(preset: str, dtype: str, quantize: str | None = None) -> LocateModel:
    """The preset's architecture with random weights drawn on the device (no checkpoint file), quantized as the
    converter's `quantize` preset would (q8, mixed_4_8, ...) when given."""
    p = PRESETS[preset]
    raw = p.config(dtype)
    config = ModelConfig.from_dict(raw)
    tokenizer = Tokenizer.from_folder(TOKENIZER_DIR)
    network = LocateAnything(config, tokenizer.token_ids(raw))
    mx.random.seed(0)
    target = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[dtype]

    def draw(w):
        return (mx.random.normal(w.shape) * 0.02).astype(target)

    network.update(tree_map(draw, network.parameters()))
    mx.eval(network.parameters())
    if quantize is not None:
        plan, _ = quantization_plan(network, QUANT_PRESETS[quantize])
        nn.quantize(network, class_predicate=lambda path, module: plan[path].params() if path in plan else False)
        mx.eval(network.parameters())
    return LocateModel(Checkpoint(network, tokenizer), take_over=True)


def weight_bytes(model: LocateModel, decoder_only: bool = True) -> int:
    tree = model.runtime.network.language_model.parameters() if decoder_only else model.runtime.network.parameters()
    return sum(v.nbytes for _, v in tree_flatten(tree))


def batch_step_costs(model: LocateModel, context: int, batches: list[int], iters: int) -> dict:
    """ms per engine step for B sequences at `context` cached tokens each: the dense forward (block: 12 rows per
    sequence, 6 head rows; AR: 1), its compiled summary and the one host read, as the engine runs them: at the
    row count the engine takes for B (`Runtime.rows_for`, after `measure_rows` up to the largest B)."""
    runtime = model.runtime
    d = runtime.network.config.text.hidden_size
    dtype = runtime.network.language_model.model.norm.weight.dtype
    block_fn, ar_fn = summary_functions(Features(), runtime.token_ids)
    runtime.measure_rows(max(batches), context)
    out = {}
    for n in batches:
        B = runtime.rows_for(n, max(batches))
        cache = runtime.new_cache(B)
        mx.eval(list(runtime.prefill(cache, [(b, mx.zeros((context, d), dtype), 0) for b in range(B)]).values()))
        rs, keys, not_ar = RowSampling.of([Sampling()] * B), mx.zeros((B, 2), dtype=mx.uint32), mx.zeros((B,), mx.bool_)
        row = {"rows_run": B}
        for name, phase, ids in (("block", Phase.BLOCK, [1] * 6 + [2] * 6), ("ar", Phase.AR, [1])):
            inputs = mx.array([ids] * B, dtype=mx.int32)
            args = (phase, cache, inputs, list(range(B)), [context] * B, [len(ids)] * B, [name == "block"] * B, True)
            row[f"{name}_forward_ms"] = timed_ms(lambda args=args: mx.eval(runtime.steps.run(*args)), iters)
            fn, extra = (block_fn, (None, keys, rs, not_ar)) if phase is Phase.BLOCK else (ar_fn, (None, keys, rs))
            row[f"{name}_step_ms"] = timed_ms(  # the forward, its summary and the one host read
                lambda args=args, fn=fn, extra=extra: np.array(fn(runtime.steps.run(*args), *extra)), iters
            )
        row["block_seq_steps_per_s"] = 1e3 * n / row["block_step_ms"]
        row["ar_seq_steps_per_s"] = 1e3 * n / row["ar_step_ms"]
        row["kv_cache_mb"] = cache.nbytes / 2**20
        out[n] = row
        del cache
    base = out[batches[0]]
    for row in out.values():
        row["block_throughput_x"] = row["block_seq_steps_per_s"] / base["block_seq_steps_per_s"]
        row["ar_throughput_x"] = row["ar_seq_steps_per_s"] / base["ar_seq_steps_per_s"]
    return out


def folder_images(model_arg: str | None, size: tuple[int, int], n: int, work: Path) -> tuple[list[Path], str]:
    """`n` different images on disk: the demo model's own synthetic scenes (real boxes) or generated ones."""
    folder = work / f"folder-{n}-{size[0]}x{size[1]}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    if model_arg == "demo":
        from mlx_locate.synthetic.scenes import make_sample

        for i in range(n):
            path = folder / f"scene{i:03d}.png"
            if not path.exists():
                make_sample(0, i, "eval").scene.image.save(path)
            paths.append(path)
        return paths, "square"
    rng = np.random.default_rng(1)
    for i in range(n):
        path = folder / f"image{i:03d}.png"
        if not path.exists():
            img = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
            Image.fromarray(img).resize(size, Image.Resampling.NEAREST).save(path)
        paths.append(path)
    return paths, QUERY


def folder_run(model: LocateModel, requests: list[Request], rows: int, schedule: Schedule | None) -> dict:
    """`requests` through one engine of `rows` rows, twice (the first run compiles every shape it meets): the
    second run's images/s end to end (load, vision, prefill, decode), steps, blocks/s, boxes/s, compilations,
    reads, peak memory and token ids."""
    runtime = model.runtime
    runs = []
    for _ in range(2):
        runtime.clear_caches()
        mx.reset_peak_memory()
        before = runtime.compilations
        engine = model.engine(rows, schedule)
        handles = [engine.submit(r) for r in requests]
        t0 = time.perf_counter()
        engine.run()
        runs.append((time.perf_counter() - t0, engine, handles, runtime.compilations - before))
    seconds, engine, handles, compiled = runs[1]
    results = [h.result for h in handles]
    blocks = sum(r.stats["block_steps"] for r in results)
    boxes = sum(len(r.objects) for r in results)
    return {
        "images_per_s": len(requests) / seconds,
        "seconds": seconds,
        "tokens_per_image": sum(len(r.token_ids) for r in results) / len(results),
        "engine_steps": engine.steps,
        "ms_per_engine_step": 1e3 * seconds / max(engine.steps, 1),  # admission (vision, prefill) included
        "seq_steps_per_s": sum(r.stats["steps"] for r in results) / seconds,
        "blocks_per_s": blocks / seconds,
        "boxes": boxes,
        "boxes_per_s": boxes / seconds,
        "host_reads_per_step": engine.host_reads / max(engine.steps, 1),
        "compilations_warmup": runs[0][3],
        "compilations_after": compiled,
        "peak_memory_mb": mx.get_peak_memory() / 2**20,
        "engine_seconds": engine.seconds,
        "tower_image_blocks_behind_steps": engine.vision_ahead.blocks_run,
        "tokens": [r.token_ids for r in results],
    }


def run_batches(
    model: LocateModel,
    paths: list[Path],
    query: str,
    modes: list[str],
    batches: list[int],
    max_tokens: int,
    schedule: Schedule | None = None,
    peer: Callable[[int], dict] | None = None,
) -> tuple[dict, dict]:
    """A folder of images, one query each, through one engine per mode and batch size (`folder_run`), and the
    speed-up over the first batch size; with `peer` (batch size -> its row), the peer runs after our modes at
    each batch size, so a slow spell of the machine hits both sides of a ratio. Returns our rows by mode and
    batch size, and the peer's by batch size (each of ours then has the peer's images/s and ours over it). The
    engine's row counts are measured first (`Runtime.measure_rows`), as the server's warm-up does."""
    model.runtime.measure_rows(max(batches))
    out: dict = {mode: {} for mode in modes}
    theirs = {}
    for B in batches:
        for mode in modes:
            kinds = ["slow", "fast"] if mode == "mix" else [mode]  # "mix": every step has AR and block rows
            requests = [
                Request(p, query, mode=kinds[i % len(kinds)], max_tokens=max_tokens) for i, p in enumerate(paths)
            ]
            out[mode][B] = folder_run(model, requests, B, schedule)
        if peer is not None:
            theirs[B] = peer(B)
            for mode in modes:
                out[mode][B] |= versus_peer(out[mode][B], theirs[B])
    for rows in out.values():
        base = rows[batches[0]]
        for row in rows.values():
            row["images_per_s_x"] = row["images_per_s"] / base["images_per_s"]
            row["token_ids_equal_batch_1"] = row["tokens"] == base["tokens"]
            differing = [i for i, (a, b) in enumerate(zip(row["tokens"], base["tokens"], strict=True)) if a != b]
            row["images_differing_from_batch_1"] = len(differing)
            if differing:  # where the first one parts: how far the two agree
                a, b = row["tokens"][differing[0]], base["tokens"][differing[0]]
                row["first_difference"] = {"image": differing[0], "at_token": parting(a, b), "of": len(b)}
        for row in rows.values():
            del row["tokens"]
    return out, theirs


def parting(a: list[int], b: list[int]) -> int | None:
    """Where two token lists part: the first index that differs (the shorter one's length where one is the
    other's start), None where they are equal."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def tf32_setting() -> str:
    """MLX_ENABLE_TF32 as this process has it: whether a GPU's float32 products run in TF32."""
    return os.environ.get("MLX_ENABLE_TF32", "1 (MLX's default)")


def versus_peer(ours: dict, peer: dict) -> dict:
    """The peer's images/s beside one of our folder rows, and ours over it (> 1: ours is faster)."""
    theirs = peer.get("images_per_s")
    return {"mlx_vlm_images_per_s": theirs, "vs_mlx_vlm": ours["images_per_s"] / theirs if theirs else None}


def request_ms(stats: dict, key: str) -> float | None:
    """From the request's start (preprocessing) to `key` (seconds after the per-query prefill began)."""
    if stats[key] is None:
        return None
    return 1e3 * (stats["preprocess_s"] + stats["vision_s"] + stats["prefix_prefill_s"] + stats[key])


def run_modes(
    model: LocateModel, image: Path, query: str, modes: list[str], max_tokens: int, repeat: int, prompt: str | None
) -> dict:
    """Each mode in-process, warm: one request to compile every shape, then `repeat` more (the median reported);
    with `prompt`, strict greedy decoding of that raw text (as the whole-process run does)."""
    runtime = model.runtime
    results = {}
    ask = {"prompt": prompt, "task": "raw", "strict": True} if prompt else {}
    for mode in modes:
        model.locate(image, query, mode=mode, max_tokens=max_tokens, **ask)  # warm-up: compiles every bucket
        warm = runtime.compilations
        mx.reset_peak_memory()
        runs = []
        for _ in range(repeat):
            runtime.clear_caches()
            runs.append(model.locate(image, query, mode=mode, max_tokens=max_tokens, **ask))
        r = sorted(runs, key=lambda x: x.stats["decode_s"])[len(runs) // 2]  # the median run
        s = r.stats
        boxes = len(r.objects)
        decode_steps = max(s["steps"] - 1, 1)  # after the first step, as the peer counts
        decode_s = s["decode_s"] - (s["first_step_s"] - s["prefill_s"])
        request_s = s["preprocess_s"] + s["vision_s"] + s["prefix_prefill_s"] + s["prefill_s"] + s["decode_s"]
        results[mode] = {
            "preprocess_ms": 1e3 * s["preprocess_s"],
            "vision_ms": 1e3 * s["vision_s"],
            "prefill_ms": 1e3 * (s["prefix_prefill_s"] + s["prefill_s"]),
            "first_step_ms": request_ms(s, "first_step_s"),
            "first_box_ms": request_ms(s, "first_box_s"),
            "tokens": s["tokens"],
            "steps": s["steps"],
            "block_steps": s["block_steps"],
            "ar_steps": s["ar_steps"],
            "ms_per_step": 1e3 * decode_s / decode_steps,
            "tokens_per_s": s["tokens"] / s["decode_s"],
            "blocks_per_s": s["block_steps"] / s["decode_s"] if s["block_steps"] else None,
            "boxes": boxes,
            "boxes_per_s": boxes / request_s,  # over the whole request, as the peer reports it
            "host_reads_per_step": s["host_reads"] / max(s["steps"], 1),
            "compilations_warmup": warm,
            "compilations_after": runtime.compilations - warm,
            "peak_memory_mb": mx.get_peak_memory() / 2**20,
            "stop_reason": s["stop_reason"],
            "prompt_ids": r.prompt_ids,
            "token_ids": r.token_ids,
        }
    return results


def whole_process(
    model_dir: Path,
    image: Path,
    prompt: str,
    modes: list[str],
    short: int,
    long: int,
    dtype: str,
    peer: str | None,
    runs: int = 3,
) -> dict:
    """What a CLI user sees: each side run as a whole process (`mlx-locate` / mlx-vlm's PBD loop), `short` and
    `long` max tokens, the min of `runs` runs each, the sides taking turns (so a slow spell of the machine hits
    both); decode tokens/s = extra tokens / extra seconds (the delta method), so load, vision and prefill cancel
    out. Strict greedy decoding; the peer gets our prompt ids."""
    out = {}
    sides = ("ours", "mlx_vlm") if peer else ("ours",)
    ours = [sys.executable, "-m", "mlx_locate.commands.locate", "--model", str(model_dir), "--image", str(image)]
    ours += ["--prompt", prompt, "--dtype", dtype, "--strict", "--json"]
    ids: list[int] = []
    for mode in modes:
        best: dict[tuple[str, int], tuple[float, int]] = {}
        for _ in range(runs):
            for side in sides:  # ours first: the peer gets our prompt ids
                for n in (short, long):
                    t0 = time.perf_counter()
                    if side == "ours":
                        cmd = ours + ["--mode", mode, "--max-tokens", str(n)]
                        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                        if proc.returncode != 0:
                            raise RuntimeError(f"ours {mode} failed: {proc.stderr.strip()[-400:]}")
                        answer = json.loads(proc.stdout.strip().splitlines()[-1])
                        ids, tokens = answer["prompt_ids"], len(answer["token_ids"])
                    else:
                        tokens = peer_request(peer, model_dir, [image], ids, mode, n, dtype)["num_generated"]
                    seconds = time.perf_counter() - t0
                    best[side, n] = min(best.get((side, n), (seconds, tokens)), (seconds, tokens))
        result = {}
        for side in sides:
            (t_short, n_short), (t_long, n_long) = best[side, short], best[side, long]
            result[side] = {
                "seconds": {str(short): t_short, str(long): t_long},
                "tokens": {str(short): n_short, str(long): n_long},
                "decode_tokens_per_s": (n_long - n_short) / (t_long - t_short),
            }
        if peer:
            result["ratio"] = result["ours"]["decode_tokens_per_s"] / result["mlx_vlm"]["decode_tokens_per_s"]
        result["runs"] = runs
        out[mode] = result
    return out


def peer_request(
    python: str,
    model_dir: Path,
    images: list[Path],
    prompt: list[int] | str,
    mode: str,
    max_tokens: int,
    dtype: str,
    repeat: int = 1,
    batch_size: int | None = None,
) -> dict:
    """One run of mlx-vlm 0.7.10 (`peer_mlxvlm.py` in its own process): `prompt` is our prompt ids, or user text
    that mlx-vlm renders its own way; mode "batch" runs `images` through `batch_generate` in calls of
    `batch_size`. Its JSON report; `RuntimeError` with its last error line if it fails."""
    cmd = [python, str(ROOT / "benchmarks" / "peer_mlxvlm.py"), "--model", str(model_dir), "--image"]
    cmd += [str(image) for image in images]
    if isinstance(prompt, str):
        cmd += ["--query", prompt]
    else:
        ids_file = Path(os.environ.get("TMPDIR", "/tmp")) / "mlx_locate_bench_prompt.json"
        ids_file.write_text(json.dumps(prompt))
        cmd += ["--prompt-ids", str(ids_file)]
    cmd += ["--mode", mode, "--max-tokens", str(max_tokens), "--repeat", str(repeat), "--dtype", dtype]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer_batch(
    python: str, model_dir: Path, paths: list[Path], query: str, max_tokens: int, dtype: str, batch_size: int
) -> dict:
    """The folder through mlx-vlm's `batch_generate` at `batch_size`, with the user text our engine's requests
    get (the default task's, rendered the mlx-vlm way), normalised to our folder columns; `error` if it fails."""
    text = task_text(DEFAULT_TASK, query)
    try:
        peer = peer_request(python, model_dir, paths, text, "batch", max_tokens, dtype, batch_size=batch_size)
    except RuntimeError as e:
        return {"error": str(e)}
    tokens = peer["tokens_per_image"]
    return {
        "images_per_s": peer["images_per_s"],
        "seconds": peer["seconds"],
        "warmup_seconds": peer["warmup_seconds"],
        "tokens_per_image": sum(tokens) / len(tokens),
        "prompt_tokens_per_image": peer["mlxvlm_stats"]["prompt_tokens"] / len(tokens),
        "peak_memory_mb": peer["peak_memory_bytes"] / 2**20,
        "prompt_text": peer["prompt_text"],
        "versions": peer["versions"],
        "blas": peer["blas"]["effective"],
        "token_ids": peer["generated_ids"],
    }


def run_peer(python: str, model_dir: Path, image: Path, ours: dict, dtype: str, max_tokens: int, repeat: int) -> dict:
    """The same prompt ids through mlx-vlm 0.7.10, normalised to our columns."""
    out = {}
    for mode, mine in ours.items():
        try:
            peer = peer_request(python, model_dir, [image], mine["prompt_ids"], mode, max_tokens, dtype, repeat)
        except RuntimeError as e:
            out[mode] = {"error": str(e)}
            continue
        t = peer["timings_s"]
        forwards = peer["forwards"]
        out[mode] = {
            "preprocess_ms": 1e3 * t["preprocess"],
            "vision_ms": 1e3 * t["vision"],
            "prefill_ms": None,  # mlx-vlm times its prefill together with the first step
            "first_step_ms": 1e3 * (t["preprocess"] + t["vision"] + t["prefill"]),
            "first_box_ms": None if t["first_box"] is None else 1e3 * t["first_box"],
            "tokens": peer["num_generated"],
            "steps": forwards["total"],
            "block_steps": forwards["block"],
            "ar_steps": forwards["ar"],
            "ms_per_step": 1e3 / peer["forwards_per_s"] if peer["forwards_per_s"] else None,
            "tokens_per_s": peer["tokens_per_s"],
            "blocks_per_s": peer["blocks_per_s"] if forwards["block"] else None,
            "boxes": peer["boxes"],
            "boxes_per_s": peer["boxes_per_s"],
            "peak_memory_mb": peer["peak_memory_bytes"] / 2**20,
            "stop_reason": peer["stop"],
            "blas": peer["blas"]["effective"],
            "token_ids": peer["generated_ids"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--model", help="a checkpoint folder or 'demo' instead of a random --preset checkpoint")
    parser.add_argument("--query", default=QUERY)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--in-memory", action="store_true", help="random weights on the device, no checkpoint")
    parser.add_argument("--quantize", help="with --in-memory: quantize as mlx-locate-convert's preset (q8, ...)")
    parser.add_argument("--modes", nargs="+", default=["slow", "fast", "hybrid"], help="with --batch also 'mix'")
    parser.add_argument(
        "--images", nargs="+", default=["640x480"], help="golden 640x480, WxH (generated) or an image file"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512], help="cached lengths for step costs")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--peer", help="python of a venv with mlx-vlm 0.7.10: run the peer side by side (with --batch, the folder)"
    )
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes: the engine's scaling instead")
    parser.add_argument("--prompt", help="raw user text instead of --query (the whole-process run uses it too)")
    parser.add_argument(
        "--whole-process", type=int, nargs=2, metavar=("SHORT", "LONG"), help="also time whole processes (CLI)"
    )
    parser.add_argument("--whole-runs", type=int, default=3, help="with --whole-process: the min of this many")
    parser.add_argument("--folder", type=int, default=64, help="with --batch: images in the folder run (0: none)")
    parser.add_argument("--schedule", choices=["device", "mixed", "split"], default="device")
    parser.add_argument(
        "--tower-ahead", type=int, default=None, help="tower blocks queued behind each decode step (default: measured)"
    )
    parser.add_argument("--workdir", default=str(ROOT / ".bench"))
    parser.add_argument("--json", default=None, help="write results here (default benchmarks/results/<preset>.json)")
    args = parser.parse_args(argv)
    if args.peer and args.in_memory:
        parser.error("--peer loads a checkpoint on disk: drop --in-memory (a preset's is written under --workdir)")
    if args.peer and args.batch and not args.folder:
        parser.error("--peer with --batch runs the folder through mlx-vlm: give --folder N (N > 0)")

    work = Path(args.workdir)
    t0 = time.perf_counter()
    if args.model:
        model_dir = resolve(args.model)
        model = mlx_locate.load(model_dir, dtype=args.dtype)
    elif args.in_memory:
        model, model_dir = in_memory_model(args.preset, args.dtype, args.quantize), None
    else:
        model_dir = work / f"{args.preset}-{args.dtype}"
        if not (model_dir / "config.json").is_file():
            make_random_checkpoint(model_dir, preset=args.preset, dtype=args.dtype, tokenizer_dir=TOKENIZER_DIR)
        model = mlx_locate.load(model_dir)
    load_s = time.perf_counter() - t0

    images = {}
    for name in args.images:
        if name in IMAGES or Path(name).is_file():
            images[name] = IMAGES.get(name) or Path(name)
        else:
            images[name] = make_image(tuple(int(v) for v in name.split("x")), work / f"{name}.png")

    report = {
        "preset": args.model or args.preset + (f"-{args.quantize}" if args.quantize else ""),
        "query": args.query,
        "dtype": args.dtype,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "blas": blas_name(),
        "mlx_enable_tf32": tf32_setting(),
        "load_s": load_s,
        "decoder_weight_bytes": weight_bytes(model),
        "images": {},
        "steps": {},
    }
    if mx.default_device() == mx.gpu:
        bw = measure_bandwidth()
        report["bandwidth_gb_s"] = bw / 1e9
        report["step_floor_ms"] = 1e3 * report["decoder_weight_bytes"] / bw
    if args.batch:
        schedule = {"device": None, "mixed": Schedule(True, True), "split": Schedule(False, False)}[args.schedule]
        if args.tower_ahead is not None:
            schedule = replace(schedule or Schedule.for_device(), tower_ahead=args.tower_ahead)
        report["schedule"] = args.schedule
        report["tower_ahead"] = "measured" if args.tower_ahead is None else args.tower_ahead
        report["batch_steps"] = {c: batch_step_costs(model, c, args.batch, args.iters) for c in args.contexts}
        if args.folder:
            size = tuple(int(v) for v in args.images[0].split("x")) if "x" in args.images[0] else (640, 480)
            paths, query = folder_images(args.model, size, args.folder, work)
            report["folder"] = {"images": len(paths), "size": list(size), "query": query}
            peer = None
            if args.peer:
                peer = partial(run_peer_batch, args.peer, model_dir, paths, query, args.max_tokens, args.dtype)
            report["batches"], theirs = run_batches(
                model, paths, query, args.modes, args.batch, args.max_tokens, schedule, peer
            )
            if theirs:
                report["mlx_vlm_batches"] = theirs
        out = (
            Path(args.json)
            if args.json
            else ROOT / "benchmarks" / "results" / f"batch_{Path(report['preset']).name}.json"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print_batch_table(report)
        print(f"\nwrote {out}")
        return 0
    for context in args.contexts:
        report["steps"][context] = step_ms(model, context, args.iters)
    for name, path in images.items():
        ours, peer = {}, {}
        for mode in args.modes:  # each mode's two sides back to back, so a slow spell of the machine hits both
            ours |= run_modes(model, path, args.query, [mode], args.max_tokens, args.repeat, args.prompt)
            if args.peer:
                peer |= run_peer(
                    args.peer, model_dir, path, {mode: ours[mode]}, args.dtype, args.max_tokens, args.repeat
                )
        entry = {"ours": ours}
        if args.whole_process and model_dir is not None:
            prompt = args.prompt or task_text("detect", args.query)
            entry["whole_process"] = whole_process(
                model_dir, path, prompt, args.modes, *args.whole_process, args.dtype, args.peer, args.whole_runs
            )
        if peer:
            entry["mlx_vlm"], entry["ratios"] = peer, ratios(ours, peer)
        report["images"][name] = entry

    out = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / f"{Path(report['preset']).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out}")
    return 0


def ratios(ours: dict, peer: dict) -> dict:
    """Ours relative to mlx-vlm, per mode: speed-ups (> 1 is faster) and time/memory ratios (< 1 is better)."""
    out = {}
    for mode, mine in ours.items():
        other = peer.get(mode, {})
        if "error" in other:
            continue

        def div(a, b):
            return None if a is None or b is None or b == 0 else a / b

        out[mode] = {
            "step_speedup": div(other.get("ms_per_step"), mine["ms_per_step"]),
            "tokens_per_s_speedup": div(mine["tokens_per_s"], other.get("tokens_per_s")),
            "blocks_per_s_speedup": div(mine["blocks_per_s"], other.get("blocks_per_s")),
            "first_step_ratio": div(mine["first_step_ms"], other.get("first_step_ms")),
            "first_box_ratio": div(mine["first_box_ms"], other.get("first_box_ms")),
            "vision_ratio": div(mine["vision_ms"], other.get("vision_ms")),
            "peak_memory_ratio": div(mine["peak_memory_mb"], other.get("peak_memory_mb")),
            "same_tokens": mine["token_ids"] == other.get("token_ids"),
        }
    return out


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def print_batch_table(report: dict) -> None:
    floor = report.get("step_floor_ms")
    print(f"\npreset {report['preset']} {report['dtype']} on {report['device']} ({report['blas']})")
    if floor:
        print(f"read-only pass {report['bandwidth_gb_s']:.0f} GB/s; step floor {floor:.2f} ms")
    for context, rows in report["batch_steps"].items():
        print(f"\ncontext {context}: B, block step ms (x floor), block throughput x, AR step ms (x floor), AR x")
        for B, r in rows.items():
            bx = f" ({r['block_step_ms'] / floor:.1f}x)" if floor else ""
            ax = f" ({r['ar_step_ms'] / floor:.1f}x)" if floor else ""
            print(f"  {B:>3}  {r['block_step_ms']:8.2f}{bx}  {r['block_throughput_x']:6.1f}x"
                  f"  {r['ar_step_ms']:8.2f}{ax}  {r['ar_throughput_x']:6.1f}x")  # fmt: skip
    if "folder" not in report:
        return
    f = report["folder"]
    print(f"\nfolder of {f['images']} images {f['size'][0]}x{f['size'][1]}, query {f['query']!r}")
    cols = ["images_per_s", "images_per_s_x", "tokens_per_image", "ms_per_engine_step", "blocks_per_s",
            "boxes_per_s", "host_reads_per_step", "compilations_after", "peak_memory_mb",
            "token_ids_equal_batch_1"]  # fmt: skip
    print(f"{'mode':7} {'B':>3} " + " ".join(f"{c:>14.14}" for c in cols))
    for mode, rows in report["batches"].items():
        for B, r in rows.items():
            print(f"{mode:7} {B:>3} " + " ".join(f"{fmt(r[c], 2):>14}" for c in cols))
    if "mlx_vlm_batches" not in report:
        return
    modes = list(report["batches"])
    print("\nmlx-vlm batch_generate (greedy AR) over the same folder, prompt and max tokens; ours / mlx-vlm images/s")
    print(f"{'B':>3} {'images_per_s':>14} {'tokens_per_image':>16} {'peak_memory_mb':>14} "
          + " ".join(f"{m:>8}" for m in modes))  # fmt: skip
    for B, r in report["mlx_vlm_batches"].items():
        if "error" in r:
            print(f"{B:>3} error: {r['error']}")
            continue
        ratios = " ".join(f"{fmt(report['batches'][m][B]['vs_mlx_vlm'], 2) + 'x':>8}" for m in modes)
        print(f"{B:>3} {r['images_per_s']:14.2f} {r['tokens_per_image']:16.1f} {r['peak_memory_mb']:14.1f} {ratios}")


def print_table(report: dict) -> None:
    print(f"\npreset {report['preset']} {report['dtype']} on {report['device']} ({report['blas']})")
    if "step_floor_ms" in report:
        gb = report["decoder_weight_bytes"] / 1e9
        print(f"bandwidth {report['bandwidth_gb_s']:.0f} GB/s; decoder weights {gb:.2f} GB")
        print(f"step floor (weights / bandwidth) {report['step_floor_ms']:.2f} ms")
    for context, s in report["steps"].items():
        line = f"context {context}: AR step {s['ar_ms']:.2f} ms, block step {s['block_ms']:.2f} ms"
        if "step_floor_ms" in report:
            line += (
                f" ({s['ar_ms'] / report['step_floor_ms']:.2f}x / {s['block_ms'] / report['step_floor_ms']:.2f}x floor)"
            )
        print(line)
    cols = [
        "vision_ms",
        "prefill_ms",
        "first_step_ms",
        "first_box_ms",
        "ms_per_step",
        "tokens_per_s",
        "blocks_per_s",
        "host_reads_per_step",
        "compilations_after",
        "peak_memory_mb",
    ]
    for name, entry in report["images"].items():
        print(f"\nimage {name}")
        print(f"{'side':8} {'mode':7} " + " ".join(f"{c:>14}" for c in cols))
        for side in ("ours", "mlx_vlm"):
            for mode, r in entry.get(side, {}).items():
                if "error" in r:
                    print(f"{side:8} {mode:7} error: {r['error']}")
                    continue
                print(f"{side:8} {mode:7} " + " ".join(f"{fmt(r.get(c)):>14}" for c in cols))
        for mode, q in entry.get("ratios", {}).items():
            print(f"ratio    {mode:7} " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in q.items()))
        for mode, w in entry.get("whole_process", {}).items():
            sides = ", ".join(
                f"{side} {w[side]['decode_tokens_per_s']:.1f} tokens/s" for side in ("ours", "mlx_vlm") if side in w
            )
            print(f"whole process {mode:7} {sides}" + (f" ({w['ratio']:.2f}x)" if "ratio" in w else ""))


if __name__ == "__main__":
    raise SystemExit(main())
