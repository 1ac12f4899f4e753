"""Fine-tuning figures: the demo model learning a new shape end to end, and LoRA steps at LocateAnything-3B's shapes.

    python benchmarks/finetune_bench.py                       # all; JSON in benchmarks/results/finetune_<device>.json
    python benchmarks/finetune_bench.py --only demo           # or --only forgetting, --only inference, --only 3b

- demo: the README's walk-through (the test's run, `tuner.finetune.DEMO_SPEC` / `DEMO_OPTIONS`): the bundled demo
  model learns "ring" from 300 synthetic scenes; held-out F1@0.5 per mode before and after, steps/s, samples/s,
  peak memory.
- forgetting: the user's case of issue 26 (`synthetic.write_word_only_data`): 300 scenes of a new word, "cross",
  among circles and squares, only the crosses labelled; the walk-through's settings, with replay (the default share)
  and without (`replay=0`). Held-out F1@0.5 per mode before and after, of the new word (48 scenes) and of the kept
  words (each held-out scene asked for circles and for squares, answered from the scene): the slow test's run.
- inference: decode step costs (`mlx-locate-bench`'s `step_ms`: AR and block step at 512 cached tokens) of the 3B shapes
  without an adapter and with a rank-64 one on every projection: merged into the bf16 weights (what `load`
  does for a float base: the same cost by construction), and beside q8 / mixed_4_8 weights, fused
  (`FusedLoRALinear`, what `load` does) and unfused (`LoRALinear` per projection, for comparison).
- 3b: random weights of the 3B model's shapes drawn on the device (bfloat16; q8 and mixed_4_8 quantized in
  memory as `mlx-locate-convert --quantize` does), NVIDIA's recipe (LoRA rank 64, alpha 128 on every decoder
  projection, the connector trained), samples of one synthetic image with 8 boxes in a detection answer, with and
  without gradient checkpointing: steps/s, samples/s, rows (tokens) per second, peak memory. The loss of random
  weights means nothing; the speed and memory do.

Needs numpy, safetensors, tokenizers, pillow and mlx (and tqdm, which `mlx_locate` imports); no plot, no bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map, tree_unflatten
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_locate.commands.convert import PRESETS as QUANT_PRESETS  # noqa: E402
from mlx_locate.commands.convert import quantization_plan  # noqa: E402
from mlx_locate.config import ModelConfig  # noqa: E402
from mlx_locate.locate import LocateModel  # noqa: E402
from mlx_locate.network.model import LocateAnything  # noqa: E402
from mlx_locate.prompts import task_text  # noqa: E402
from mlx_locate.synthetic.scenes import DISTRACTORS, write_novel_data, write_word_only_data  # noqa: E402
from mlx_locate.tokenizer import Tokenizer  # noqa: E402
from mlx_locate.tuner.datasets import Record, Turn  # noqa: E402
from mlx_locate.tuner.finetune import (  # noqa: E402
    DEMO_OPTIONS,
    DEMO_SPEC,
    DEMO_WORD,
    WORD_ONLY,
    WORD_ONLY_HELD_OUT,
    FinetuneOptions,
    finetune,
)
from mlx_locate.weights.loader import Checkpoint, read_checkpoint  # noqa: E402
from mlx_locate.weights.lora import (  # noqa: E402
    DECODER_PREFIX,
    Adapter,
    AdapterSpec,
    LoRALinear,
    LoRASpec,
    apply_adapter,
    layer_targets,
    linear_dims,
)
from mlx_locate.weights.random_checkpoint import DEFAULT_TOKENIZER_DIR, PRESETS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def quiet(*_) -> None:
    pass


def steady(history: list[dict], skip: int) -> float | None:
    """Median samples/s of the training log lines after the first `skip` (compilation, warm-up)."""
    rates = [h["samples_per_s"] for h in history if "samples_per_s" in h][skip:]
    return statistics.median(rates) if rates else None


def run_demo(work: Path, dtype: str) -> dict:
    data = write_novel_data(work / "ring", DEMO_WORD)
    from mlx_locate.tuner.datasets import read_data

    base = read_checkpoint("demo", dtype)
    t0 = time.perf_counter()
    result = finetune(
        base,
        read_data(data / "train.jsonl"),
        read_data(data / "eval.jsonl"),
        work / "demo_adapter",
        DEMO_SPEC,
        DEMO_OPTIONS,
        progress=False,
        draw=False,
        say=quiet,
    )
    return {
        "dtype": dtype,
        "steps": DEMO_OPTIONS.steps,
        "batch_size": DEMO_OPTIONS.batch_size,
        "train_samples": result.train_samples,
        "held_out_samples": result.eval_samples,
        "wall_s": time.perf_counter() - t0,
        "steps_per_s": result.steps_per_s,
        "samples_per_s": result.samples_per_s,
        "steady_samples_per_s": steady(result.history, 2),
        "peak_memory_bytes": result.peak_memory_bytes,
        "trainable_parameters": result.trainable_parameters,
        "before": result.before,
        "after": result.after,
    }


def run_forgetting(work: Path, dtype: str) -> list[dict]:
    from mlx_locate.tuner.datasets import read_data

    data = write_word_only_data(work / WORD_ONLY, WORD_ONLY, DISTRACTORS, held_out=WORD_ONLY_HELD_OUT)
    train, held = read_data(data / "train.jsonl"), read_data(data / "eval.jsonl")
    rows = []
    for replay in (DEMO_OPTIONS.replay, 0.0):
        options = dataclasses.replace(DEMO_OPTIONS, replay=replay, eval_samples=len(held))
        t0 = time.perf_counter()
        result = finetune(
            read_checkpoint("demo", dtype), train, held, work / f"cross_{replay}", DEMO_SPEC, options,
            progress=False, draw=False, say=quiet,
        )  # fmt: skip
        row = {"replay": replay, "wall_s": time.perf_counter() - t0, "replay_samples": result.replay_samples}
        row["steps_per_s"] = result.steps_per_s
        for mode in options.eval_modes:
            for group, key in (("f1", "cross"), ("kept", "kept")):
                row[f"{mode} {key}"] = [result.before[group][mode]["f1@0.5"], result.after[group][mode]["f1@0.5"]]
            for word in DISTRACTORS:
                row[f"{mode} {word}"] = [result.before["kept"][mode]["per_label"].get(word),
                                         result.after["kept"][mode]["per_label"].get(word)]  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    return rows


def forgetting_table(rows: list[dict]) -> str:
    lines = [
        "| replay | mode | cross before -> after | circle before -> after | square before -> after |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        for mode in DEMO_OPTIONS.eval_modes:
            cells = [" -> ".join(f"{v:.2f}" for v in row[f"{mode} {k}"]) for k in ("cross", *DISTRACTORS)]
            lines.append(f"| {row['replay']} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def random_model(preset: str, quantize: str | None, dtype: str = "bfloat16") -> Checkpoint:
    """A preset's architecture (the 3B's by default), N(0, 0.02) weights drawn on the device, optionally
    quantized."""
    raw = PRESETS[preset].config(dtype)
    tokenizer = Tokenizer.from_folder(DEFAULT_TOKENIZER_DIR)
    network = LocateAnything(ModelConfig.from_dict(raw), tokenizer.token_ids(raw))
    mx.random.seed(0)
    target = getattr(mx, dtype)
    network.update(tree_map(lambda w: (mx.random.normal(w.shape) * 0.02).astype(target), network.parameters()))
    mx.eval(network.parameters())
    if quantize is not None:
        plan, _ = quantization_plan(network, QUANT_PRESETS[quantize])
        nn.quantize(network, class_predicate=lambda path, m: plan[path].params() if path in plan else False)
        mx.eval(network.parameters())
    return Checkpoint(network, tokenizer, 25600, f"random {preset} ({quantize or 'bfloat16'})")


def detection_records(folder: Path, n: int, size: tuple[int, int], boxes: int) -> list[Record]:
    """`n` images of coloured rectangles, each with a one-category detection answer of `boxes` boxes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        image = Image.new("RGB", size, (230, 230, 225))
        draw = ImageDraw.Draw(image)
        coords = []
        for _ in range(boxes):
            x1, y1 = rng.integers(0, 800, 2)
            x2, y2 = x1 + rng.integers(50, 200), y1 + rng.integers(50, 200)
            coords.append((int(x1), int(y1), int(x2), int(y2)))
            draw.rectangle(
                (x1 * size[0] // 1000, y1 * size[1] // 1000, x2 * size[0] // 1000, y2 * size[1] // 1000),
                fill=tuple(int(v) for v in rng.integers(0, 255, 3)),
            )
        path = folder / f"{i}.png"
        image.save(path)
        answer = "".join(f"<ref>part</ref><box><{a}><{b}><{c}><{d}></box>" for a, b, c, d in sorted(coords))
        records.append(Record(path, (Turn(task_text("detect", "part"), answer),), str(path)))
    return records


def run_3b(work: Path, preset: str, quantize: str | None, batch: int, checkpoint: bool, steps: int) -> dict:
    size = (640, 480)
    base = random_model(preset, quantize)
    records = detection_records(work / f"images_{size[0]}x{size[1]}", max(batch, 4), size, 8)
    spec = AdapterSpec(LoRASpec(rank=64, alpha=128, dropout=0.05))  # NVIDIA's LoRA script
    options = FinetuneOptions(
        steps=steps, batch_size=batch, lr=2e-5, warmup=1, eval_every=0, log_every=1, grad_checkpoint=checkpoint
    )
    mx.reset_peak_memory()
    out = work / f"adapter_{quantize}_{batch}_{checkpoint}"
    result = finetune(base, records, [], out, spec, options, progress=False, draw=False, say=quiet)
    from mlx_locate.tuner.finetune import encode_examples

    examples, _ = encode_examples(base, records[:1], 10**6)
    rate = steady(result.history, 2)
    return {
        "preset": preset,
        "quantize": quantize or "none (bfloat16)",
        "batch_size": batch,
        "grad_checkpoint": checkpoint,
        "image": list(size),
        "rows_per_sample": len(examples[0].rows.ids),
        "steps": steps,
        "steady_samples_per_s": rate,
        "steady_steps_per_s": None if rate is None else rate / batch,
        "rows_per_s": None if rate is None else rate * len(examples[0].rows.ids),
        "peak_memory_bytes": result.peak_memory_bytes,
        "trainable_parameters": result.trainable_parameters,
        "final_loss": next(h["loss"] for h in reversed(result.history) if "loss" in h),
    }


def random_adapter(network: nn.Module, rank: int = 64, alpha: float = 128.0) -> Adapter:
    """Random low-rank pairs on every decoder projection (their values do not change the cost)."""
    pairs = {}
    keys = iter(mx.random.split(mx.random.key(1), 1000))
    for path, linear in layer_targets(network, LoRASpec(rank, alpha), DECODER_PREFIX):
        in_dims, out_dims = linear_dims(linear)
        a = mx.random.normal((in_dims, rank), key=next(keys)) * in_dims**-0.5
        pairs[path] = (a, mx.random.normal((rank, out_dims), key=next(keys)) * 0.01, alpha / rank)
    return Adapter(pairs, {}, None)


def run_inference(preset: str, dtype: str, iters: int) -> list[dict]:
    from mlx_locate.commands.bench import step_ms

    rows = []
    for quantize in (None, "q8", "mixed_4_8"):
        variants = ("no adapter", "merged") if quantize is None else ("no adapter", "kept, fused", "kept, unfused")
        for variant in variants:
            base = random_model(preset, quantize, dtype)
            network = base.network
            if variant in ("merged", "kept, fused"):
                apply_adapter(network, random_adapter(network))
            elif variant == "kept, unfused":
                updates = []
                for path, (a, b, scale) in random_adapter(network).pairs.items():
                    lora = LoRALinear.from_base(dict(network.named_modules())[path], a.shape[1], scale)
                    lora.lora_a, lora.lora_b = a, b
                    updates.append((path, lora))
                network.update_modules(tree_unflatten(updates))
            model = LocateModel(base, take_over=True)
            row = {"preset": preset, "dtype": dtype, "quantize": quantize or "none", "adapter": variant}
            row.update(step_ms(model, 512, iters))
            rows.append(row)
            print(json.dumps(row))
            del model, network, base
            mx.clear_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("demo", "forgetting", "inference", "3b"), help="one part only")
    p.add_argument("--demo-dtype", default="float32", help="the demo base's dtype (default float32)")
    p.add_argument("--checkpointed-only", action="store_true", help="3b: only the gradient-checkpointing rows")
    p.add_argument("--steps", type=int, default=8, help="3b: steps per configuration (the first 2 are warm-up)")
    p.add_argument("--preset", choices=list(PRESETS), default="3b", help="inference, 3b: the sizes (small: a check)")
    p.add_argument("--dtype", default="bfloat16", help="inference: float dtype of the random weights")
    p.add_argument("--iters", type=int, default=20, help="inference: timed steps per measurement")
    p.add_argument("--json", type=Path, help="output (default benchmarks/results/finetune_<device>.json)")
    args = p.parse_args(argv)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    report = {"device": str(mx.default_device()), "platform": platform.platform(), "mlx": mx.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "demo"):
            report["demo"] = run_demo(work, args.demo_dtype)
            print(json.dumps({k: report["demo"][k] for k in ("steps_per_s", "samples_per_s", "peak_memory_bytes")}))
            for mode, after in report["demo"]["after"]["f1"].items():
                print(
                    f"demo {mode}: F1@0.5 {report['demo']['before']['f1'][mode]['f1@0.5']:.3f} -> {after['f1@0.5']:.3f}"
                )
        if args.only in (None, "forgetting"):
            report["forgetting"] = run_forgetting(work, args.demo_dtype)
        if args.only in (None, "inference"):
            report["inference"] = run_inference(args.preset, args.dtype, args.iters)
        if args.only in (None, "3b"):
            report["3b"] = []
            for quantize in (None, "q8", "mixed_4_8"):
                for batch, checkpoint in ((1, False), (4, False), (4, True)):
                    if args.checkpointed_only and not checkpoint:
                        continue
                    row = run_3b(work, args.preset, quantize, batch, checkpoint, args.steps)
                    report["3b"].append(row)
                    print(json.dumps(row))
                    mx.clear_cache()
    out = args.json or RESULTS / f"finetune_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    if "forgetting" in report:
        print(forgetting_table(report["forgetting"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
