"""Random LocateAnything checkpoints in the original Hugging Face layout (docs/model.md §2, docs/model.md §4).

For tests and benchmarks: the folder looks like a download of `nvidia/LocateAnything-3B` (config.json with the
release's fields and token ids, bf16 safetensors with the release's tensor names and layouts, including the stored
head copy, and the tokenizer/processor files), only the sizes are a preset's and the weights are random.

    python -m mlx_locate.weights.random_checkpoint --preset tiny --out /tmp/tiny [--seed 0] [--dtype bfloat16] [--force]

Initialisation follows tests/data/golden/README.md: N(0, 0.02) for every tensor, norm weights 1 + N(0, 0.02),
and the language model's linear weights N(0, `layer_std`) (0.5 in the small presets, so that hidden states depend
on the context). The stored `language_model.lm_head.weight` equals `embed_tokens`, as in the golden checkpoints.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .checkpoint import DTYPES, RELEASE_CONFIG, plan_shards, shard_names, write_index

# Files of a checkpoint folder that come from the tokenizer folder; tokenizer.json is copied when present.
TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.json",
    "generation_config.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "vocab.json",
)
OPTIONAL_TOKENIZER_FILES = ("tokenizer.json",)
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "golden" / "tokenizer"


@dataclass(frozen=True)
class Preset:
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_mlp: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_mlp: int
    vocab_size: int = RELEASE_CONFIG["text_config"]["vocab_size"]
    pos_emb: int = 64  # init_pos_emb_height = width
    patch_size: int = 14
    std: float = 0.02
    layer_std: float = 0.5  # the language model's linear weights

    def config(self, dtype: str) -> dict:
        """The release config.json with this preset's sizes."""
        config = copy.deepcopy(RELEASE_CONFIG)
        config["torch_dtype"] = dtype
        config["text_config"].update(
            hidden_size=self.text_hidden,
            num_hidden_layers=self.text_layers,
            num_attention_heads=self.text_heads,
            num_key_value_heads=self.text_kv_heads,
            intermediate_size=self.text_mlp,
            vocab_size=self.vocab_size,
            torch_dtype=dtype,
        )
        config["vision_config"].update(
            hidden_size=self.vision_hidden,
            num_hidden_layers=self.vision_layers,
            num_attention_heads=self.vision_heads,
            intermediate_size=self.vision_mlp,
            init_pos_emb_height=self.pos_emb,
            init_pos_emb_width=self.pos_emb,
            patch_size=self.patch_size,
            torch_dtype=dtype,
        )
        return config


PRESETS: dict[str, Preset] = {
    # The golden tiny_random / tiny_peaky sizes.
    "tiny": Preset(64, 2, 4, 128, 16, 2, 4, 2, 128),
    "small": Preset(128, 2, 4, 256, 64, 2, 4, 2, 256),
    # About 0.47 B parameters (0.93 GB in bf16): the 3B's vision width and GQA 8:1, head_dim 64.
    "medium": Preset(1152, 4, 16, 4304, 1024, 8, 16, 2, 2816, layer_std=0.02),
    # The release (docs/model.md §2): 3.5 B parameters + the head copy, 7.66 GB in bf16.
    "3b": Preset(1152, 27, 16, 4304, 2048, 36, 16, 2, 11008, layer_std=0.02),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (N(0, std)), "layer" (N(0, layer_std)), "norm" (1 + N(0, std)), "head_copy"


def _check_sizes(p: Preset) -> None:
    if p.text_hidden % p.text_heads or p.text_heads % p.text_kv_heads:
        raise ValueError(
            f"text: hidden {p.text_hidden} must divide by heads {p.text_heads}, and heads by kv heads {p.text_kv_heads}"
        )
    if p.vision_hidden % p.vision_heads or (p.vision_hidden // p.vision_heads) % 4:
        raise ValueError(
            f"vision: hidden {p.vision_hidden} must divide by heads {p.vision_heads} "
            f"into a head_dim that is a multiple of 4 (2D RoPE)"
        )


def tensor_specs(p: Preset) -> list[TensorSpec]:
    """Every tensor of the checkpoint in the reference's state-dict order, with the docs/model.md §4 names and
    layouts."""
    _check_sizes(p)
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], init: str = "normal") -> None:
        out.append(TensorSpec(name, shape, init))

    def norm(prefix: str, width: int, bias: bool) -> None:
        add(f"{prefix}.weight", (width,), "norm")
        if bias:
            add(f"{prefix}.bias", (width,))

    v, t = p.vision_hidden, p.text_hidden
    add("vision_model.patch_embed.proj.weight", (v, 3, p.patch_size, p.patch_size))  # OIHW
    add("vision_model.patch_embed.proj.bias", (v,))
    add("vision_model.patch_embed.pos_emb.weight", (p.pos_emb, p.pos_emb, v))  # (H, W, C)
    for i in range(p.vision_layers):
        b = f"vision_model.encoder.blocks.{i}"
        norm(f"{b}.norm0", v, bias=True)
        norm(f"{b}.norm1", v, bias=True)
        for name, shape in (
            ("wqkv", (3 * v, v)),
            ("wo", (v, v)),
            ("mlp.fc0", (p.vision_mlp, v)),
            ("mlp.fc1", (v, p.vision_mlp)),
        ):
            add(f"{b}.{name}.weight", shape)
            add(f"{b}.{name}.bias", shape[:1])
    norm("vision_model.encoder.final_layernorm", v, bias=True)

    merged = 4 * v  # 2 x 2 merge
    norm("mlp1.0", merged, bias=True)
    add("mlp1.1.weight", (t, merged))
    add("mlp1.1.bias", (t,))
    add("mlp1.3.weight", (t, t))
    add("mlp1.3.bias", (t,))

    kv = p.text_kv_heads * (t // p.text_heads)
    add("language_model.model.embed_tokens.weight", (p.vocab_size, t))
    for i in range(p.text_layers):
        b = f"language_model.model.layers.{i}"
        for name, rows in (("q_proj", t), ("k_proj", kv), ("v_proj", kv)):
            add(f"{b}.self_attn.{name}.weight", (rows, t), "layer")
            add(f"{b}.self_attn.{name}.bias", (rows,))
        add(f"{b}.self_attn.o_proj.weight", (t, t), "layer")
        add(f"{b}.mlp.gate_proj.weight", (p.text_mlp, t), "layer")
        add(f"{b}.mlp.up_proj.weight", (p.text_mlp, t), "layer")
        add(f"{b}.mlp.down_proj.weight", (t, p.text_mlp), "layer")
        norm(f"{b}.input_layernorm", t, bias=False)
        norm(f"{b}.post_attention_layernorm", t, bias=False)
    norm("language_model.model.norm", t, bias=False)
    add("language_model.lm_head.weight", (p.vocab_size, t), "head_copy")
    return out


def _resolve_preset(preset: str | Preset, overrides: dict | None) -> Preset:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    if overrides:
        fields = {f.name for f in dataclasses.fields(Preset)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown override(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        preset = dataclasses.replace(preset, **overrides)
    return preset


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty; pass force=True (--force) to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _copy_tokenizer(src: Path, out: Path) -> None:
    missing = [name for name in TOKENIZER_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tokenizer folder {src} lacks {', '.join(missing)}; pass tokenizer_dir (--tokenizer) pointing to a "
            f"folder with the release's tokenizer and processor files (e.g. tests/data/golden/tokenizer)"
        )
    for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def _write_weights(out: Path, specs: list[TensorSpec], p: Preset, seed: int, dtype: str) -> None:
    """Draw the tensors in `specs` order and write them shard by shard (one shard in memory at a time)."""
    rng = np.random.default_rng(seed)
    itemsize = 2 if dtype == "bfloat16" else 4
    sizes = [int(np.prod(s.shape)) * itemsize for s in specs]
    plan = [[specs[i] for i in shard] for shard in plan_shards(sizes)]
    names = shard_names(len(plan))
    embed = None
    weight_map: dict[str, str] = {}
    for name, shard_specs in zip(names, plan, strict=True):
        shard: dict[str, mx.array] = {}
        for s in shard_specs:
            if s.init == "head_copy":
                shard[s.name] = embed
                continue
            std = p.layer_std if s.init == "layer" else p.std
            values = rng.standard_normal(s.shape, dtype=np.float32) * np.float32(std)
            if s.init == "norm":
                values += np.float32(1.0)
            shard[s.name] = mx.array(values).astype(DTYPES[dtype])
            mx.eval(shard[s.name])
            if s.name == "language_model.model.embed_tokens.weight":
                embed = shard[s.name]
        mx.save_safetensors(str(out / name), shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(plan) > 1:
        write_index(out, weight_map, sum(sizes))


def make_random_checkpoint(
    out: str | Path,
    preset: str | Preset = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    tokenizer_dir: str | Path | None = None,
    overrides: dict | None = None,
    force: bool = False,
) -> Path:
    """Write a random checkpoint in the original Hugging Face layout to `out` and return its path.

    Args:
        out: destination folder; must be missing or empty unless `force` (then it is replaced).
        preset: a key of `PRESETS` or a `Preset`.
        seed: numpy RNG seed; the same arguments give the same bytes.
        dtype: storage dtype, "bfloat16" (as released) or "float32".
        tokenizer_dir: folder with the tokenizer and processor files (default: tests/data/golden/tokenizer).
        overrides: `Preset` fields to replace, e.g. `{"text_layers": 4, "layer_std": 0.02}`.
        force: overwrite a non-empty `out`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    p = _resolve_preset(preset, overrides)
    specs = tensor_specs(p)
    src = Path(tokenizer_dir) if tokenizer_dir is not None else DEFAULT_TOKENIZER_DIR
    if not src.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder {src} not found; pass tokenizer_dir (--tokenizer) with the release's tokenizer files"
        )
    out = Path(out)
    _prepare_out(out, force)
    _copy_tokenizer(src, out)
    (out / "config.json").write_text(json.dumps(p.config(dtype), indent=2) + "\n")
    name = preset if isinstance(preset, str) else "custom"
    (out / "README.md").write_text(
        "---\nlicense: other\nlibrary_name: transformers\n---\n# LocateAnything random test checkpoint\n\n"
        f"Random weights (preset={name}, seed={seed}, dtype={dtype}, std={p.std}, layer_std={p.layer_std}); "
        "original nvidia/LocateAnything-3B file layout.\nNot a trained model.\n"
    )
    _write_weights(out, specs, p, seed, dtype)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_locate.weights.random_checkpoint",
        description="Write a random LocateAnything checkpoint in the original Hugging Face layout.",
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="destination folder (must be empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="(default: %(default)s)")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help=f"tokenizer folder (default {DEFAULT_TOKENIZER_DIR})"
    )
    parser.add_argument("--layer-std", type=float, default=None, help="std of the LM linear weights (preset default)")
    parser.add_argument(
        "--overwrite", "--force", dest="overwrite", action="store_true", help="replace a non-empty --out"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {"layer_std": args.layer_std} if args.layer_std is not None else None
    try:
        out = make_random_checkpoint(
            args.out, args.preset, args.seed, args.dtype, args.tokenizer, overrides=overrides, force=args.overwrite
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} (preset {args.preset}, seed {args.seed}, {args.dtype}, {size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
