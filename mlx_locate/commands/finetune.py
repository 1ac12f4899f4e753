"""mlx-locate-finetune: teach a LocateAnything checkpoint your own boxes with LoRA (next-token + block losses).

    mlx-locate-finetune --model demo --data train.jsonl --images images/ --out adapters/
    mlx-locate --model demo --adapter adapters/ --image shot.png --query "my part"

`--data` is LocateAnything SFT JSONL, a recipe JSON of such files, or COCO instances (`tuner/datasets.py`).
The training itself is `tuner/finetune.py`; replay, which keeps what the base knew, `tuner/replay.py`.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from ..decide import MODE_NAMES
from ..tuner.datasets import norm_label, read_data, split
from ..tuner.finetune import FinetuneOptions, finetune, fmt
from ..weights.loader import read_checkpoint
from ..weights.lora import DECODER_KEYS, VISION_KEYS, AdapterSpec, LoRASpec
from . import flags

DEFAULT_RANK, DEFAULT_ALPHA, DEFAULT_DROPOUT = 64, 128.0, 0.05  # NVIDIA's LoRA script
DEFAULT_HELD_OUT = 0.1
DEFAULT_REPLAY = FinetuneOptions.replay


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-locate-finetune", description=__doc__.split("\n\n")[0])
    flags.add_model(p, adapter=False)
    p.add_argument("--data", required=True, help="training data: SFT .jsonl, recipe .json or COCO instances .json")
    flags.add_images_root(p, "--data's and --val-data's")
    p.add_argument(
        "--out",
        required=True,
        type=flags.output_path,
        help="output folder: adapter, checkpoints, log.jsonl, training.png",
    )
    p.add_argument("--val-data", help="held-out data (default: a --val-fraction of --data's images)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_HELD_OUT, help="held-out share (default: 0.1)")
    p.add_argument("--categories-per-prompt", type=int, default=10, help="COCO: categories per detection prompt")

    t = p.add_argument_group("training")
    flags.add_training(
        t,
        steps=FinetuneOptions.steps,
        batch_size=FinetuneOptions.batch_size,
        lr=FinetuneOptions.lr,
        weight_decay=FinetuneOptions.weight_decay,
        clip=FinetuneOptions.clip,
        warmup=FinetuneOptions.warmup,
        warmup_help="warmup steps (default: a tenth of --steps, at most 500)",
        save_every=FinetuneOptions.save_every,
        save_help="checkpoint every N steps (default: at every evaluation)",
    )
    t.add_argument("--grad-checkpoint", action="store_true", help="recompute decoder activations (less memory)")

    r = p.add_argument_group("replay: keep what the base knew")
    r.add_argument(
        "--replay",
        type=float,
        default=DEFAULT_REPLAY,
        metavar="FRACTION",
        help=f"share of each batch that replays the base's own answers about the kept categories (default: "
        f"{DEFAULT_REPLAY}; 0: off)",
    )
    r.add_argument(
        "--keep-categories",
        metavar="A,B,...",
        help="categories to keep, comma-separated (default: those the model card names: the demo's shapes, "
        "COCO's 80 for LocateAnything-3B)",
    )

    lo = p.add_argument_group("LoRA")
    lo.add_argument("--rank", type=int, default=DEFAULT_RANK, help="decoder LoRA rank (default: 64)")
    lo.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="scale = alpha / rank (default: 128)")
    lo.add_argument("--dropout", type=float, default=DEFAULT_DROPOUT, help="LoRA input dropout (default: 0.05)")
    lo.add_argument("--lora-layers", type=int, help="LoRA on the last N decoder layers (default: all)")
    lo.add_argument("--lora-keys", nargs="+", choices=DECODER_KEYS, default=list(DECODER_KEYS), metavar="KEY")
    lo.add_argument("--vision-rank", type=int, default=0, help="LoRA on the vision tower too, this rank (0: frozen)")
    lo.add_argument("--vision-alpha", type=float, help="vision LoRA alpha (default: 2 x --vision-rank)")
    lo.add_argument("--vision-layers", type=int, help="vision LoRA on the last N blocks (default: all)")
    lo.add_argument("--freeze-connector", action="store_true", help="do not train the connector (mlp1)")

    e = p.add_argument_group("held-out evaluation, checkpoints")
    e.add_argument("--eval-every", type=int, default=100, help="score the held-out split every N steps (0: start, end)")
    e.add_argument("--eval-samples", type=int, default=64, help="held-out samples decoded for F1")
    e.add_argument("--eval-modes", nargs="+", choices=MODE_NAMES, default=list(MODE_NAMES))
    e.add_argument("--eval-max-tokens", type=int, default=256)
    e.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    flags.add_overwrite(e, "a non-empty --out")
    e.add_argument("--no-plot", action="store_true", help="do not draw training.png (needs matplotlib)")
    flags.add_progress(e)
    flags.add_json(e, "print the summary as JSON")
    return p


def specs(args: argparse.Namespace) -> AdapterSpec:
    decoder = LoRASpec(args.rank, args.alpha, args.dropout, args.lora_layers, tuple(args.lora_keys))
    vision = None
    if args.vision_rank:
        alpha = 2.0 * args.vision_rank if args.vision_alpha is None else args.vision_alpha
        vision = LoRASpec(args.vision_rank, alpha, args.dropout, args.vision_layers, VISION_KEYS)
    return AdapterSpec(decoder, vision, () if args.freeze_connector else ("mlp1",))


def options(args: argparse.Namespace) -> FinetuneOptions:
    for name in ("steps", "batch_size", "eval_samples", "eval_max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    return FinetuneOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip=args.clip,
        seed=args.seed,
        grad_checkpoint=args.grad_checkpoint,
        compile=not args.no_compile,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        eval_modes=tuple(args.eval_modes),
        eval_max_tokens=args.eval_max_tokens,
        save_every=args.save_every,
        replay=args.replay,
        keep_categories=None if args.keep_categories is None else tuple(args.keep_categories.split(",")),
    )


def summary_table(result) -> str:
    """Held-out F1@0.5 per mode before and after, of the data and of the kept categories (the forgetting line)."""
    kept = bool(result.after.get("kept"))
    lines = ["mode      data F1@0.5 before  after" + ("   kept F1@0.5 before  after" if kept else "")]
    for mode, after in result.after["f1"].items():
        cells = [result.before["f1"].get(mode, {}).get("f1@0.5"), after["f1@0.5"]]
        if kept:
            cells += [result.before["kept"][mode]["f1@0.5"], result.after["kept"][mode]["f1@0.5"]]
        lines.append(
            f"{mode:<8}" + "".join(f"{fmt(v):>{w}}" for v, w in zip(cells, (20, 7, 21, 7)[: len(cells)], strict=True))
        )
    if kept:  # the forgetting line, per kept category that the held-out set has (or the model answered)
        mode = next(iter(result.after["kept"]))
        before, after = (r["kept"][mode]["per_label"] for r in (result.before, result.after))
        names = [c for c in result.kept if norm_label(c) in before or norm_label(c) in after]
        cells = [f"{c} {fmt(before.get(norm_label(c)))} -> {fmt(after.get(norm_label(c)))}" for c in names[:8]]
        more = f", ... ({len(names)})" if len(names) > 8 else ""
        lines.append(f"kept categories, {mode}, F1 against {result.kept_truth}: {', '.join(cells)}{more}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec, opts = specs(args), options(args)
        records = read_data(args.data, args.images, args.categories_per_prompt, args.seed)
        if args.val_data:
            train, held = records, read_data(args.val_data, args.images, args.categories_per_prompt, args.seed)
        else:
            train, held = split(records, args.val_fraction, args.seed)
        base = read_checkpoint(args.model, args.dtype)
        result = finetune(
            base,
            train,
            held,
            args.out,
            spec,
            opts,
            resume=args.resume,
            force=args.overwrite,
            progress=not args.no_progress,
            draw=not args.no_plot,
            say=lambda line: tqdm.write(line, file=sys.stderr),
        )
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {
        "out": str(result.out),
        "before": result.before,
        "after": result.after,
        "steps_per_s": result.steps_per_s,
        "samples_per_s": result.samples_per_s,
        "peak_memory_bytes": result.peak_memory_bytes,
        "trainable_parameters": result.trainable_parameters,
        "replay_samples": result.replay_samples,
        "kept_categories": list(result.kept),
        "kept_truth": result.kept_truth,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(summary_table(result))
        speed = f"{result.steps_per_s:.2f} steps/s, " if result.steps_per_s else ""
        print(
            f"{speed}peak memory {result.peak_memory_bytes / 2**20:.0f} MiB; adapter in {result.out} "
            f"(mlx-locate --model {args.model} --adapter {result.out} ...)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
