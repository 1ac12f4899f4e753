"""The demo model's recipe: a tiny LocateAnything (same architecture, small sizes) trained from scratch on synthetic
shapes with the training library (`trainer.py`): its tokenizer, config and checkpoint files, its initialisation,
the synthetic batches, and the command.

The checkpoint is written in the original Hugging Face layout, so `mlx_locate.load(out)` runs it.

    python -m mlx_locate.tuner.demo_recipe --out runs/demo --steps 20000 --batch-size 64 --workers 12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken, models, trainers
from tokenizers import Tokenizer as _Tokenizer

from ..commands import flags
from ..config import ModelConfig
from ..masks import BLOCK
from ..network.model import LocateAnything
from ..preprocess import PATCH_SIZE
from ..preprocess import patchify as cut_patches
from ..prompts import prompt_ids, task_text
from ..synthetic.scenes import COLORS, DETECT_CATEGORY_COUNTS, SHAPES, Sample, make_sample
from ..tokenizer import Tokenizer, qwen2_byte_level
from ..tokens import TokenIds
from ..weights.cards import CONFIG_KEY, KnownCategories
from ..weights.checkpoint import DEMO_DIR, DTYPES, read_weights
from ..weights.loader import sanitize
from ..weights.random_checkpoint import Preset
from .trainer import (
    STAT_COLUMNS,
    Encoded,
    GridTables,
    Trainer,
    TrainOptions,
    collate,
    describe,
    encode_rows,
    learning_rate,
)

# docs/training.md §4.1 (about 4.5 M parameters with the demo vocabulary).
SIZES: dict[str, Preset] = {
    "demo": Preset(128, 4, 4, 512, 256, 4, 4, 2, 768, pos_emb=16),
    "small": Preset(64, 2, 4, 256, 128, 2, 4, 2, 384, pos_emb=16),  # CPU smoke runs
    "micro": Preset(32, 1, 2, 64, 64, 2, 4, 2, 128, pos_emb=16),  # tests
}
DEMO_IN_TOKEN_LIMIT = 256  # patches: larger images are scaled down to about the training sizes (224 x 224)
MODEL_MAX_LENGTH = 2048


# --- The demo tokenizer -----------------------------------------------------------------------------------

# The demo tokenizer: a byte-level BPE over printable ASCII whose merges make every word below one token,
# in both forms (" red" inside a prompt or label, "red" right after <ref> or </c>).
BPE_SIZE = 210
LABEL_WORDS = (*COLORS, *SHAPES, "the", "any")
EXTRA_WORDS = (" shape", " in", " the", " image", "None", "none", "assistant", "system", "user", "image")
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # just below the added-token base S
# The checkpoint's added tokens from S on (docs/training.md §4.2, docs/model.md §3).
ADDED_TOKENS = (
    "<IMG_CONTEXT>",
    "<img>",
    "</img>",
    "<box>",
    "</box>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<interval>",
    "</interval>",
    "<text_mask>",
    *(f"<{v}>" for v in range(1001)),
    "<null>",
    "<switch>",
    "</c>",
)
_FIXED_TEXTS = (
    "You are a helpful assistant.\n",
    "system\n",
    "user\n<image 1>",
    "assistant\n",
    "Locate all the instances that matches the following description: ",
    "Locate a single instance that matches the following description: ",
    "Locate all the instances that match the following description: ",
    "Point to: ",
)


def build_tokenizer() -> _Tokenizer:
    """The demo model's tokenizer: Qwen2 pre-tokenizer and byte-level BPE, then the control and added tokens.

    Ids: BPE 0..BPE_SIZE-1, `<|endoftext|>` `<|im_start|>` `<|im_end|>`, then S = BPE_SIZE + 3 for
    `<IMG_CONTEXT>` and the rest of ADDED_TOKENS in the checkpoint's order. Deterministic.
    """
    tok = qwen2_byte_level(_Tokenizer(models.BPE()))
    alphabet = [tok.pre_tokenizer.pre_tokenize_str(chr(c))[0][0] for c in (*range(32, 127), 10)]
    words = [*(" " + w for w in LABEL_WORDS), *LABEL_WORDS, *EXTRA_WORDS]
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False
    )
    tok.train_from_iterator(words * 1000 + list(_FIXED_TEXTS) * 10, trainer)
    split = [w for w in words if len(tok.encode(w).ids) != 1]
    if tok.get_vocab_size() != BPE_SIZE or split:
        raise RuntimeError(f"demo BPE: {tok.get_vocab_size()} tokens (want {BPE_SIZE}); words not single: {split}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS + ADDED_TOKENS])
    return tok


# --- Checkpoint files -------------------------------------------------------------------------------------


def demo_tokenizer() -> _Tokenizer:
    """The bundled demo tokenizer (so a model trained anywhere gets the same ids), else a fresh build."""
    path = DEMO_DIR / "tokenizer.json"
    return _Tokenizer.from_file(str(path)) if path.is_file() else build_tokenizer()


def demo_config(tok: _Tokenizer, sizes: Preset, dtype: str = "float32") -> dict:
    """config.json with the release's field names, these sizes and every special id of this tokenizer."""
    tid = tok.token_to_id
    config = dataclasses.replace(sizes, vocab_size=tok.get_vocab_size()).config(dtype)
    config.update(
        image_token_index=tid("<IMG_CONTEXT>"),
        box_start_token_id=tid("<box>"),
        box_end_token_id=tid("</box>"),
        ref_start_token_id=tid("<ref>"),
        ref_end_token_id=tid("</ref>"),
        coord_start_token_id=tid("<0>"),
        coord_end_token_id=tid("<1000>"),
        none_token_id=tid("None"),
        eos_token_id=tid("<|im_end|>"),
    )
    config["text_config"].update(
        bos_token_id=tid("<|endoftext|>"),
        eos_token_id=tid("<|im_end|>"),
        text_mask_token_id=tid("<text_mask>"),
        null_token_id=tid("<null>"),
        switch_token_id=tid("<switch>"),
        max_position_embeddings=MODEL_MAX_LENGTH,
        sliding_window=MODEL_MAX_LENGTH,
    )
    config["text_config"].pop("_name_or_path", None)
    config["vision_config"].pop("_name_or_path", None)
    config["vision_config"].pop("auto_map", None)
    config[CONFIG_KEY] = KnownCategories(SHAPES, max(DETECT_CATEGORY_COUNTS)).to_config()
    return config


def side_files(tok: _Tokenizer) -> dict[str, dict]:
    """The tokenizer/processor JSON files of a checkpoint folder, besides tokenizer.json."""
    tid = tok.token_to_id
    return {
        "tokenizer_config.json": {
            "add_bos_token": False,
            "add_prefix_space": False,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": MODEL_MAX_LENGTH,
            "pad_token": "<|endoftext|>",
            "processor_class": "LocateAnythingProcessor",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
        "preprocessor_config.json": {
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "LocateAnythingImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "in_token_limit": DEMO_IN_TOKEN_LIMIT,
            "merge_kernel_size": [2, 2],
            "patch_size": PATCH_SIZE,
            "processor_class": "LocateAnythingProcessor",
        },
        "processor_config.json": {
            "image_end_token": "</img>",
            "image_placeholder": "image",
            "image_start_token": "<img>",
            "image_token": "<IMG_CONTEXT>",
            "merge_kernel_size": [2, 2],
            "processor_class": "LocateAnythingProcessor",
        },
        "generation_config.json": {
            "bos_token_id": tid("<|endoftext|>"),
            "eos_token_id": [tid("<|im_end|>"), tid("<|endoftext|>")],
            "generation_mode": "hybrid",
            "max_new_tokens": 512,
            "n_future_tokens": BLOCK,
            "pad_token_id": tid("<|endoftext|>"),
        },
    }


def hf_weights(model: LocateAnything, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Parameters under the checkpoint's names and layouts (the patch embedding as an OIHW conv)."""
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name == "vision_model.patch_embed.proj.weight":
            value = value.reshape(value.shape[0], 3, PATCH_SIZE, PATCH_SIZE)
        weights[name] = value.astype(dtype)
    return weights


def save_checkpoint(model: LocateAnything, tok: _Tokenizer, out: Path, dtype: str = "float32") -> None:
    """Write config.json, model.safetensors, tokenizer.json and the processor files to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = model_sizes(model.config)
    (out / "config.json").write_text(json.dumps(demo_config(tok, sizes, dtype), indent=2) + "\n")
    for name, content in side_files(tok).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    mx.save_safetensors(str(out / "model.safetensors"), hf_weights(model, DTYPES[dtype]), metadata={"format": "pt"})


def model_sizes(config: ModelConfig) -> Preset:
    v, t = config.vision, config.text
    return Preset(
        v.hidden_size,
        v.num_hidden_layers,
        v.num_attention_heads,
        v.intermediate_size,
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        vocab_size=t.vocab_size,
        pos_emb=v.init_pos_emb_height,
    )


def coordinate_embeddings(dim: int, std: float) -> np.ndarray:
    """(1001, dim) sin/cos features of v = 0..1000 at frequencies from pi/1000 to pi/2 per unit, scaled to `std`.

    Through the tied head, neighbouring coordinates start with similar logits, so a near miss is rewarded
    from the first steps instead of only after every coordinate token has been learnt on its own.
    """
    freqs = np.pi / 1000 * np.geomspace(1, 500, dim // 2)
    angles = np.arange(1001)[:, None] * freqs[None, :]
    table = np.zeros((1001, dim), np.float32)
    table[:, : dim // 2], table[:, dim // 2 : 2 * (dim // 2)] = np.sin(angles), np.cos(angles)
    return table * np.float32(std * np.sqrt(2))


def init_model(
    tok: _Tokenizer, sizes: Preset, seed: int, std: float = 0.02, coord_init: str = "sincos"
) -> LocateAnything:
    """A fresh model: N(0, std) weights, zero biases, unit norm weights (docs/training.md §4.1); with
    `coord_init="sincos"` the <0>..<1000> embedding rows start from `coordinate_embeddings`."""
    raw = demo_config(tok, sizes)
    config = ModelConfig.from_dict(raw)
    model = LocateAnything(config, Tokenizer(tok).token_ids(raw))
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for i, (name, value) in enumerate(flat):
        if name.endswith(".bias"):
            value = mx.zeros_like(value)
        elif value.ndim == 1:  # LayerNorm / RMSNorm weights
            value = mx.ones_like(value)
        else:
            value = std * mx.random.normal(value.shape, key=keys[i])
        if name == "language_model.model.embed_tokens.weight" and coord_init == "sincos":
            start = model.token_ids.coord_start
            value[start : start + 1001] = mx.array(coordinate_embeddings(value.shape[1], std))
        params.append((name, value))
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


# --- Synthetic samples and batches ------------------------------------------------------------------------


def patchify(image, patch: int = PATCH_SIZE) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 patches (h*w, 3*p*p) in `preprocess`'s layout; the image sides must be multiples of 2 * patch."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    H, W, _ = pixels.shape
    if H % (2 * patch) or W % (2 * patch):
        raise ValueError(f"image {W}x{H} must have sides that are multiples of {2 * patch}")
    patches, grid = cut_patches(pixels, patch)
    return np.ascontiguousarray(patches.reshape(len(patches), -1)), grid


def encode(sample: Sample, tokenizer: Tokenizer, ids: TokenIds) -> Encoded:
    """A synthetic sample: its patches and rows (one turn)."""
    pixels, grid = patchify(sample.scene.image)
    prompt = prompt_ids(tokenizer, task_text(sample.task.task, sample.task.query), [grid])
    x = prompt + tokenizer.encode(sample.task.answer + "<|im_end|>\n")
    out = encode_rows(x, [len(prompt) - 1], ids)
    out.pixels, out.grid = pixels, grid
    return out


class BatchMaker:
    """Batch `step` of the stream: samples step*B .. step*B+B-1 of `make_sample(seed, i)`. Picklable."""

    def __init__(self, tokenizer_json: str, seed: int, batch_size: int, split: str = "train"):
        self.tokenizer_json = tokenizer_json
        self.seed, self.batch_size, self.split = seed, batch_size, split
        self._state = None

    def _setup(self):
        if self._state is None:
            tok = _Tokenizer.from_str(self.tokenizer_json)
            tokenizer = Tokenizer(tok)
            raw = demo_config(tok, SIZES["micro"])
            self._state = (
                tokenizer,
                tokenizer.token_ids(raw),
                GridTables.for_sides(),
                tok.token_to_id("<|endoftext|>"),
            )
        return self._state

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        tokenizer, ids, tables, pad = self._setup()
        first = step * self.batch_size
        samples = [make_sample(self.seed, i, self.split) for i in range(first, first + self.batch_size)]
        return collate([encode(s, tokenizer, ids) for s in samples], tables, pad)


def batches(maker: BatchMaker, start: int, steps: int, workers: int):
    """Yield batches start..steps-1 in order; with workers > 0 a process pool keeps 2 per worker in flight."""
    if workers <= 0:
        for step in range(start, steps):
            yield maker(step)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork after MLX started its threads
    with ctx.Pool(workers) as pool:
        pending = []
        next_step = start
        for _ in range(start, steps):
            while next_step < steps and len(pending) < 2 * workers:
                pending.append(pool.apply_async(maker, (next_step,)))
                next_step += 1
            yield pending.pop(0).get()


# --- The command -------------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    tok = demo_tokenizer()
    model = init_model(tok, SIZES[args.sizes], args.seed, coord_init=args.coord_init)
    if args.init:
        # Continue from a checkpoint this script wrote (weights only; the optimizer starts afresh).
        weights = sanitize(read_weights(Path(args.init)), model.config.vision.patch_size)
        model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    options = TrainOptions(
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip=args.clip,
        compute_dtype=args.compute_dtype,
        compile=not args.no_compile,
    )
    trainer = Trainer(model, options)
    maker = BatchMaker(tok.to_str(), args.seed, args.batch_size)
    total, warmup = args.steps, max(1, min(args.warmup, args.steps // 2))
    print(
        f"device {mx.default_device()} | sizes {args.sizes}: {n_params / 1e6:.2f} M parameters, vocab "
        f"{tok.get_vocab_size()} | {total} steps x {args.batch_size} samples | workers {args.workers}",
        flush=True,
    )
    log = open(args.log, "a") if args.log else None  # noqa: SIM115
    acc, loss_sum, seen = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0
    t_start = t_last = time.perf_counter()
    t_probe = previous = None
    step = 0
    for batch in batches(maker, 0, args.steps, args.workers):
        if step >= total:
            break
        lr = learning_rate(step, total, args.lr, warmup)
        loss, stats, norm = trainer.step(batch, lr)
        if previous is not None:
            mx.eval(previous)  # at most two steps queued on the device
        previous = loss
        step += 1
        acc, loss_sum, seen = acc + stats, loss_sum + loss, seen + 1
        if args.minutes and step == 20:
            mx.eval(loss)
            t_probe = time.perf_counter()
        if args.minutes and step == warmup and t_probe is not None:
            # Fit the rest of the run into the time budget; the cosine starts only now, so nothing changes.
            mx.eval(loss)
            rate = (step - 20) / (time.perf_counter() - t_probe)
            left = args.minutes * 60 - (time.perf_counter() - t_start)
            total = max(step + 1, min(total, step + int(left * rate)))
            print(f"time budget {args.minutes} min at {rate:.1f} steps/s: {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            entry = {"step": step, "loss": round(loss_sum.item() / seen, 4)}
            entry.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in describe(np.array(acc)).items()})
            now = time.perf_counter()
            entry.update(
                grad_norm=round(norm.item(), 3),
                lr=round(lr, 7),
                samples_per_s=round(seen * args.batch_size / (now - t_last), 1),
                elapsed_s=round(now - t_start, 1),
            )
            print(json.dumps(entry), flush=True)
            if log:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            acc, loss_sum, seen, t_last = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0, now
        if args.save_every and step % args.save_every == 0 and step < total:
            save_checkpoint(model, tok, out, args.save_dtype)
    save_checkpoint(model, tok, out, args.save_dtype)
    if log:
        log.close()
    elapsed = time.perf_counter() - t_start
    print(
        f"saved {out}: {step} steps, {step * args.batch_size / elapsed:.1f} samples/s over {elapsed:.0f} s", flush=True
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_locate.tuner.demo_recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (original HF layout)")
    flags.add_training(
        p,
        steps=1000,
        batch_size=32,
        lr=TrainOptions.lr,
        weight_decay=TrainOptions.weight_decay,
        clip=TrainOptions.clip,
        warmup=500,
        warmup_help="warmup steps (at most half of --steps; at least 21 with --minutes)",
        save_every=0,
        save_help="also save every N steps (0: only at the end)",
    )
    p.add_argument("--sizes", choices=list(SIZES), default="demo")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights (same --sizes)")
    p.add_argument("--coord-init", choices=("sincos", "normal"), default="sincos", help="<0>..<1000> embeddings")
    p.add_argument("--compute-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--save-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--workers", type=int, default=0, help="data-generation processes (0: in this process)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--log", default=None, help="append JSON log lines to this file")
    p.add_argument("--minutes", type=float, default=0, help="fit the run into this many minutes (0: no limit)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        print("error: --steps and --batch-size must be at least 1", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
