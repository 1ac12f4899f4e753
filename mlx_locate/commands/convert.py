"""Convert a LocateAnything checkpoint (original Hugging Face or mlx-vlm layout) into an MLX checkpoint folder.

    mlx-locate-convert --hf-path nvidia/LocateAnything-3B --mlx-path LocateAnything-3B-q8 \
        [--dtype bfloat16] [--quantize q8] [--report] [--force]

(`python -m mlx_locate.commands.convert` runs the same `main`.)

The output folder holds our tensor names (docs/model.md §4: the HF names, the patch conv as a Linear (C, 3*p*p), no
head copy) in the chosen dtype, safetensors shards of at most 5 GB, `config.json` with the quantization recorded
the mlx-lm way (defaults plus per-module overrides), `tokenizer.json` (so loading builds no BPE), the processor
files and a short model card. It is written into a hidden temporary folder next to the destination and renamed
at the end, so an error leaves nothing half-written.

Quantization comes as named presets (`PRESETS`). The tied embedding is also the output head, and 4 bits there
move coordinates (docs/model.md §4), so it stays at 8 bits except in the preset that says `unsafe`.
`--report` compares the result with its source on fixed images and prompts (see `report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import shutil
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..compiled import StepRunner
from ..config import ModelConfig
from ..decide import Mode
from ..locate import LocateModel, load
from ..metrics import iou
from ..network.model import LocateAnything
from ..parse import LocatedObject, parse_tokens
from ..preprocess import preprocess, to_rgb
from ..prompts import prompt_ids, task_text
from ..row_decoder import DecodeOptions, decode
from ..tokenizer import Tokenizer
from ..weights.checkpoint import (
    DTYPES,
    plan_shards,
    read_json,
    read_weights,
    resolve,
    shard_names,
    weight_files,
    write_index,
)
from ..weights.loader import assemble_model, rename, sanitize, split_peft_checkpoint
from ..weights.lora import apply_adapter, read_adapter
from . import flags

DEFAULT_DTYPE = "bfloat16"
# Copied as they are when the source has them; tokenizer.json is written, not copied.
COPIED_FILES = (
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
)
EXPECTED_FILES = COPIED_FILES[:4]  # named when missing; loading falls back to defaults without them
HEAD = "language_model.lm_head.weight"
EMBED = "language_model.model.embed_tokens.weight"


# --- quantization presets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int

    def params(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}


@dataclass(frozen=True)
class QuantPreset:
    linear: QuantSpec  # the language model's Linear layers
    embedding: QuantSpec | None  # the tied embedding / output head; None keeps it in the float dtype
    vision: QuantSpec | None  # the vision tower's block Linears and the connector's; None keeps them float
    description: str


Q8, Q4, Q4_G32 = QuantSpec(8, 64), QuantSpec(4, 64), QuantSpec(4, 32)
_BASE_PRESETS = {
    "q8": QuantPreset(Q8, Q8, None, "LM linears and tied embedding/head 8-bit (g64); reported box-identical"),
    "mixed_4_8": QuantPreset(Q4, Q8, None, "LM linears 4-bit (g64), tied embedding/head 8-bit (g64)"),
    "mixed_4_8-g32": QuantPreset(Q4_G32, Q8, None, "LM linears 4-bit (g32), tied embedding/head 8-bit (g64)"),
    "q4-unsafe": QuantPreset(Q4, Q4, None, "LM linears and tied embedding/head 4-bit (g64): coordinates drift"),
}
# The safe presets also come with the vision tower's and the connector's Linears at 8 bits.
PRESETS: dict[str, QuantPreset] = {
    **_BASE_PRESETS,
    **{
        f"{name}+vision8": dataclasses.replace(p, vision=Q8, description=p.description + "; vision + connector 8-bit")
        for name, p in _BASE_PRESETS.items()
        if name != "q4-unsafe"
    },
}


def quantization_plan(model: LocateAnything, preset: QuantPreset) -> tuple[dict[str, QuantSpec], list[str]]:
    """The modules `preset` quantizes, by path, and the vision ones it leaves float because their input width does
    not divide into groups (such as the 3B tower's fc1, 4304 wide). The language model must divide."""
    plan, skipped = {}, []
    for path, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if path == "language_model.model.embed_tokens":
            spec = preset.embedding
        elif isinstance(module, nn.Linear) and path.startswith("language_model."):
            spec = preset.linear
        elif isinstance(module, nn.Linear) and path.startswith(("vision_model.encoder.", "mlp1.")):
            spec = preset.vision
        else:
            continue
        if spec is None:
            continue
        if module.weight.shape[-1] % spec.group_size == 0:
            plan[path] = spec
            continue
        problem = f"{path} (width {module.weight.shape[-1]} is not a multiple of {spec.group_size})"
        if path.startswith("language_model."):
            raise ValueError(f"the language model does not divide into quantization groups: {problem}")
        skipped.append(problem)
    return plan, skipped


def quantized_modules(model: nn.Module) -> dict[str, tuple[int, int, str]]:
    """(group_size, bits, mode) of every quantized module, by path."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return {
        path: (m.group_size, m.bits, m.mode)
        for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if isinstance(m, kinds)
    }


def quantization_summary(model: nn.Module) -> str:
    """For example "14 modules at 4-bit g64, 1 at 8-bit g64"."""
    settings = Counter((bits, group_size) for group_size, bits, _ in quantized_modules(model).values())
    if not settings:
        return "none"
    parts = [f"{n} at {bits}-bit g{group}" for (bits, group), n in sorted(settings.items())]
    return f"{sum(settings.values())} modules: " + ", ".join(parts)


def quantization_record(model: nn.Module) -> dict | None:
    """config.json's "quantization", mlx-lm style: the most common setting, then every module that differs."""
    settings = quantized_modules(model)
    if not settings:
        return None
    default = Counter(settings.values()).most_common(1)[0][0]
    record = {"group_size": default[0], "bits": default[1], "mode": default[2]}
    for path, (group_size, bits, mode) in settings.items():
        if (group_size, bits, mode) != default:
            record[path] = {"group_size": group_size, "bits": bits, "mode": mode}
    return record


# --- conversion ----------------------------------------------------------------------------------------------


def _pattern(name: str) -> str:
    return re.sub(r"(layers|blocks)\.\d+\.", r"\1.{}.", name)


def _describe_names(raw: dict[str, mx.array], patch_size: int) -> list[str]:
    """What sanitize does to these names, one line per rule (layer indices folded into `{}`)."""
    lines = []
    # One line per module: the last name part (weight, bias, scales, biases) never changes.
    renames = {
        (_pattern(k).rsplit(".", 1)[0], _pattern(new).rsplit(".", 1)[0])
        for k in raw
        if (new := rename(k)) is not None and new != k
    }
    lines += [f"  rename  {old} -> {new}" for old, new in sorted(renames)]
    lines += [f"  drop    {k}" for k in sorted(k for k in raw if rename(k) is None)]
    patch = next((k for k in raw if rename(k) == "vision_model.patch_embed.proj.weight"), None)
    if patch is not None and raw[patch].ndim == 4:
        layout = "OHWI" if raw[patch].shape[-1] == 3 and raw[patch].shape[1] == patch_size else "OIHW"
        c = raw[patch].shape[0]
        lines.append(f"  reshape {patch} {tuple(raw[patch].shape)} {layout} -> ({c}, {3 * patch_size**2}) Linear")
    kept = sum(1 for k in raw if rename(k) == k)
    lines.append(f"  keep    {kept} tensors under their names")
    return lines


def compare_head(raw: dict[str, mx.array]) -> str:
    """docs/model.md §14 Q1: is the stored head copy bit-identical to embed_tokens? One line saying what was found."""
    if HEAD not in raw:
        return "no stored head copy (the head is tied to embed_tokens)"
    head, embed = raw[HEAD], raw.get(EMBED)
    if embed is None or head.shape != embed.shape or head.dtype != embed.dtype:
        found = "missing" if embed is None else f"{tuple(embed.shape)} {embed.dtype}"
        return f"stored head copy {tuple(head.shape)} {head.dtype} does not match embed_tokens ({found})"
    if mx.array_equal(head.view(mx.uint8), embed.view(mx.uint8)).item():
        return "stored head copy is bit-identical to embed_tokens (dropped; the head is tied)"
    diff = mx.abs(head.astype(mx.float32) - embed.astype(mx.float32)).max().item()
    return f"WARNING: stored head copy differs from embed_tokens (max |diff| {diff:.3g}); using the tied head"


def _write_weights(out: Path, params: dict[str, mx.array], progress: bool = True) -> list[str]:
    """Materialize and save the tensors shard by shard (under a progress bar); returns the file names."""
    keys = sorted(params)
    plan = [[keys[i] for i in shard] for shard in plan_shards([params[k].nbytes for k in keys])]
    names = shard_names(len(plan))
    total = sum(v.nbytes for v in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress) as bar:
        for name, keys in zip(names, plan, strict=True):
            shard = {}
            for key in keys:
                mx.eval(params[key])
                shard[key] = params[key]
                bar.update(params[key].nbytes)
            mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
    if len(plan) > 1:
        weight_map = {key: name for name, keys in zip(names, plan, strict=True) for key in keys}
        write_index(out, weight_map, total)
    return names


def _output_config(raw_config: dict, dtype: str, quantization: dict | None) -> dict:
    config = json.loads(json.dumps(raw_config))
    for section in (config, config["text_config"], config["vision_config"]):
        section["torch_dtype"] = dtype
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization"] = quantization
    return config


def _component_sizes(params: dict[str, mx.array]) -> dict[str, int]:
    sizes = Counter()
    for name, value in params.items():
        part = "vision" if name.startswith("vision_model.") else "connector" if name.startswith("mlp1.") else "language"
        sizes[part] += value.nbytes
    return dict(sizes)


def _write_readme(out: Path, name: str, source: str, dtype: str, quantize: str | None, info: dict) -> None:
    preset = f"{quantize} ({PRESETS[quantize].description})" if quantize else "none"
    if not quantize and info["quantization"] != "none":
        preset = "none (the source's quantization is kept)"
    sizes = info["sizes"]
    rows = "\n".join(f"| {part} | {sizes.get(part, 0) / 1e6:,.2f} MB |" for part in ("vision", "connector", "language"))
    out.joinpath("README.md").write_text(
        f"""---
library_name: mlx
tags: [mlx, mlx-locate, grounding, object-detection]
base_model: {source}
---
# LocateAnything for MLX ({quantize or dtype})

Converted with `mlx-locate-convert` on {info["date"]}.

- source: `{source}` ({info["source_bytes"] / 1e9:.3f} GB on disk)
- dtype: {dtype}
- quantization preset: {preset}
- quantized: {info["quantization"]} (config.json "quantization" has the details)
- weights: {info["bytes"] / 1e9:.3f} GB in {info["files"]} file(s)
- head: {info["head"]}
- LoRA adapter merged: {info["adapter"] or "none"}

| part | weights |
|---|---|
{rows}

```python
import mlx_locate

model = mlx_locate.load("{name}")
result = model.locate("image.jpg", "red box", task="detect")
```
"""
    )


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents:
        raise ValueError(f"--mlx-path {dst} would replace the source {src}; choose another folder")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise FileExistsError(f"{dst} already exists; pass --force to replace it")


def _publish(tmp: Path, dst: Path) -> None:
    """Move the finished folder into place; an existing destination is replaced only once the new one is whole."""
    if not dst.exists():
        tmp.rename(dst)
        return
    old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    shutil.rmtree(old)


def _normalize_config(raw_config: dict) -> dict:
    """mlx-vlm merges generation_config.json into config.json, making `eos_token_id` a list ([<|im_end|>,
    <|endoftext|>]); the model's end token is its first entry (docs/model.md §2)."""
    eos = raw_config.get("eos_token_id")
    if isinstance(eos, list):
        if not eos:
            raise ValueError("config.json: eos_token_id is an empty list")
        print(f"[INFO] config.json: eos_token_id {eos} -> {eos[0]} (<|im_end|>; the list is mlx-vlm's)")
        raw_config = {**raw_config, "eos_token_id": eos[0]}
    return raw_config


def _read_source(src: Path) -> tuple[dict, ModelConfig, Tokenizer, dict[str, mx.array]]:
    raw_config = _normalize_config(read_json(src, "config.json"))
    config = ModelConfig.from_dict(raw_config)
    tokenizer = Tokenizer.from_folder(src)
    missing = [name for name in EXPECTED_FILES if not (src / name).is_file()]
    if missing:
        print(f"[INFO] note: {src} lacks {', '.join(missing)}; the converted folder will too (loading uses defaults)")
    raw = read_weights(src)
    return raw_config, config, tokenizer, raw


def convert(
    hf_path: str | Path,
    mlx_path: str | Path,
    dtype: str = DEFAULT_DTYPE,
    quantize: str | None = None,
    force: bool = False,
    adapter: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Convert `hf_path` (folder or hub id; HF or mlx-vlm layout) into the MLX checkpoint folder `mlx_path`.

    Args:
        dtype: "bfloat16", "float16" or "float32" for every float tensor (scales included).
        quantize: a key of `PRESETS`, or None. A quantized source keeps its quantization and takes no preset.
        force: replace an existing, non-empty `mlx_path`.
        adapter: a LoRA adapter folder merged into the weights before quantizing (`lora.apply_adapter`
            with `merge=True`; into a quantized source by dequantizing, adding and quantizing again).

    Raises `ValueError`/`FileNotFoundError` naming what is wrong or missing in the source, and
    `FileExistsError` when `mlx_path` exists without `force`. Nothing is written unless the conversion succeeds.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantize is not None and quantize not in PRESETS:
        raise ValueError(f"unknown quantization preset {quantize!r}; choose one of {', '.join(PRESETS)}")
    src = resolve(hf_path)
    dst = Path(mlx_path).expanduser()
    _check_destination(src, dst, force)
    raw_config, config, tokenizer, raw = _read_source(src)
    if raw_config.get("quantization") and quantize is not None:
        raise ValueError(
            f"{src} is already quantized ({json.dumps(raw_config['quantization'])[:80]}); "
            "convert without --quantize, or start from the unquantized checkpoint"
        )
    files = weight_files(src)
    print(f"[INFO] reading {len(raw)} tensors from {len(files)} file(s) in {src}")
    for line in _describe_names(raw, config.vision.patch_size):
        print(line)
    head = compare_head(raw)
    print(f"[INFO] lm_head: {head}")
    raw, trained = split_peft_checkpoint(raw, raw_config, src)
    model = assemble_model(sanitize(raw, config.vision.patch_size), config, tokenizer.token_ids(raw_config), dtype, src)
    if trained is not None:
        apply_adapter(model, trained, merge=True)
        print(f"[INFO] LoRA layers of a PEFT-wrapped checkpoint: {len(trained.pairs)} pairs merged")
    if adapter is not None:
        counts = apply_adapter(model, read_adapter(adapter), merge=True)
        print(f"[INFO] adapter {adapter}: {counts['merged']} LoRA pairs merged, {counts['replaced']} tensors replaced")
    if quantize is not None:
        plan, skipped = quantization_plan(model, PRESETS[quantize])
        nn.quantize(model, class_predicate=lambda path, module: plan[path].params() if path in plan else False)
        print(f"[INFO] quantize {quantize}: {quantization_summary(model)}")
        for line in sorted({_pattern(s) for s in skipped}):
            print(f"  float   {line}")
    params = dict(tree_flatten(model.parameters()))
    quantization = quantization_record(model)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        written = _write_weights(tmp, params, progress)
        tokenizer.save_json(tmp / "tokenizer.json")
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        out_config = _output_config(raw_config, dtype, quantization)
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
        info = {
            "date": datetime.date.today().isoformat(),
            "source_bytes": sum(f.stat().st_size for f in files),
            "bytes": sum((tmp / name).stat().st_size for name in written),
            "files": len(written),
            "sizes": _component_sizes(params),
            "quantization": quantization_summary(model),
            "head": head,
            "adapter": None if adapter is None else str(adapter),
        }
        _write_readme(tmp, dst.name, str(hf_path), dtype, quantize, info)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"[INFO] wrote {dst}: {info['bytes'] / 1e9:.3f} GB in {len(written)} file(s), {dtype}, "
        f"quantization {quantize or ('as in the source' if quantization else 'none')} "
        f"(source {info['source_bytes'] / 1e9:.3f} GB)"
    )
    return dst


# --- report ---------------------------------------------------------------------------------------------------

REPORT_IMAGES_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "golden" / "images"
REPORT_PROMPTS = (("detect", "red box"), ("refer", "the blue square"), ("point", "the yellow circle"))
REPORT_MAX_TOKENS = 64


def report_images() -> list[tuple[str, Image.Image]]:
    """The golden test images from a checkout; two drawn images when the package runs without one."""
    files = sorted(REPORT_IMAGES_DIR.glob("*.png"))
    if files:
        return [(f.name, Image.open(f)) for f in files]
    images = []
    for w, h in ((448, 448), (640, 480)):
        image = Image.new("RGB", (w, h), (235, 235, 230))
        draw = ImageDraw.Draw(image)
        draw.rectangle((w // 8, h // 6, w // 2, h // 2), fill=(200, 30, 30))
        draw.ellipse((w // 2, h // 2, 7 * w // 8, 5 * h // 6), fill=(230, 200, 20))
        draw.rectangle((w // 10, 2 * h // 3, w // 3, 9 * h // 10), fill=(30, 60, 200))
        images.append((f"drawn_{w}x{h}", image))
    return images


def compare_rows(a: mx.array, b: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Per row of two logit arrays (R, V): top-1 equal, and KL(softmax(a) || softmax(b)) in float32."""
    la = a.astype(mx.float32) - mx.logsumexp(a.astype(mx.float32), axis=-1, keepdims=True)
    lb = b.astype(mx.float32) - mx.logsumexp(b.astype(mx.float32), axis=-1, keepdims=True)
    kl = mx.maximum(mx.sum(mx.exp(la) * (la - lb), axis=-1), 0.0)
    agree = mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)
    return np.array(agree), np.array(kl)


def object_ious(ref: list[LocatedObject], other: list[LocatedObject]) -> list[float]:
    """IoU of the k-th object of each list (normalized boxes; points count 1 when equal); a missing one is 0."""
    out = []
    for k in range(max(len(ref), len(other))):
        if k >= len(ref) or k >= len(other):
            out.append(0.0)
        elif ref[k].box_norm is not None and other[k].box_norm is not None:
            a, b = ref[k].box_norm, other[k].box_norm
            out.append(1.0 if a == b else iou(a, b))  # equal boxes match even when degenerate
        else:
            out.append(float(ref[k].point_norm == other[k].point_norm and ref[k].box_norm == other[k].box_norm))
    return out


def _weights_bytes(model: LocateModel) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.runtime.network.parameters()))


def _stats(agree: list, kl: list) -> dict:
    if not agree:
        return {"rows": 0, "top1_agreement": None, "kl_mean": None, "kl_max": None}
    a, k = np.concatenate(agree), np.concatenate(kl)
    return {
        "rows": int(a.size),
        "top1_agreement": float(a.mean()),
        "kl_mean": float(k.mean()),
        "kl_max": float(k.max()),
    }


def _median_ms(seconds: list[float]) -> float | None:
    return float(np.median(seconds) * 1e3) if seconds else None


def report(
    source: str | Path,
    converted: str | Path,
    images: list[tuple[str, Image.Image]] | None = None,
    prompts: tuple[tuple[str, str], ...] | None = None,
    max_tokens: int | None = None,
    adapter: str | Path | None = None,
) -> dict:
    """Compare `converted` with `source` (greedy decoding) on every image x prompt x mode (defaults:
    `report_images()`, `REPORT_PROMPTS`, `REPORT_MAX_TOKENS`).

    The logits comparison is teacher-forced: both models are fed the source's decisions step by step, so
    prefill, block-step and AR rows line up (top-1 agreement, KL(source || converted)). The box IoU compares
    the source's objects with those of the converted model decoding on its own. Step times are per forward,
    synchronised; weights are the bytes of the loaded parameters. With `adapter`, the source runs with it.
    """
    src, conv = load(source, adapter_path=adapter), load(converted)
    src_rt, conv_rt = src.runtime, conv.runtime
    images = report_images() if images is None else images
    prompts = REPORT_PROMPTS if prompts is None else prompts
    max_tokens = REPORT_MAX_TOKENS if max_tokens is None else max_tokens
    agree = {"prefill": [], "block_step": [], "ar_step": []}
    kl = {"prefill": [], "block_step": [], "ar_step": []}
    times = {"source": {"prefill": [], "block_step": [], "ar_step": []}}
    times["converted"] = {k: [] for k in times["source"]}
    modes = {m.value: {"ious": [], "identical": 0, "objects_source": 0, "objects_converted": 0} for m in Mode}
    cases = []
    for image_name, image in images:
        rgb = to_rgb(image)
        pre = preprocess(rgb, in_token_limit=src_rt.in_token_limit, patch_size=src_rt.patch_size)
        for task, query in prompts:
            cases.append(f"{image_name} {task}")
            ids = prompt_ids(src_rt.tokenizer, task_text(task, query), [pre.grid])
            patches = mx.array(pre.patches)
            embeds = [m.network.embed(ids, m.network.image_features(patches, pre.grid)) for m in (src_rt, conv_rt)]
            for mode in Mode:
                runners = [StepRunner(m.steps, m.new_cache()) for m in (src_rt, conv_rt)]
                logits = []
                for who, runner, e in zip(("source", "converted"), runners, embeds, strict=True):
                    t0 = time.perf_counter()
                    logits.append(runner.prefill(e))
                    mx.eval(logits[-1])
                    times[who]["prefill"].append(time.perf_counter() - t0)
                if mode is Mode.SLOW:  # the same prompt in every mode: count its row once
                    for store, value in zip((agree, kl), compare_rows(*logits), strict=True):
                        store["prefill"].append(value)

                def paired_step(step_ids: list[int], block: bool, runners=runners) -> mx.array:
                    phase = "block_step" if block else "ar_step"
                    out = []
                    for who, runner in zip(("source", "converted"), runners, strict=True):
                        t0 = time.perf_counter()
                        out.append(runner.step(step_ids, block))
                        mx.eval(out[-1])
                        times[who][phase].append(time.perf_counter() - t0)
                    for store, value in zip((agree, kl), compare_rows(*out), strict=True):
                        store[phase].append(value)
                    return out[0]

                options = DecodeOptions(mode=mode, max_new_tokens=max_tokens)
                ref = decode(paired_step, ids, logits[0], src_rt.token_ids, options, src_rt.tokenizer.model_max_length)
                ref_objects = parse_tokens(
                    ref.tokens, src_rt.token_ids, src_rt.tokenizer.decode, pre.original_size, ref.probs
                ).objects
                result = conv.locate(rgb, query, task=task, mode=mode, max_tokens=max_tokens)
                m = modes[mode.value]
                m["ious"] += object_ious(ref_objects, result.objects) or [1.0]  # both empty: identical
                m["identical"] += result.token_ids == ref.tokens
                m["objects_source"] += len(ref_objects)
                m["objects_converted"] += len(result.objects)
    return {
        "source": str(source),
        "converted": str(converted),
        "cases": cases,
        "max_tokens": max_tokens,
        "weights_bytes": {"source": _weights_bytes(src), "converted": _weights_bytes(conv)},
        "speed_ms": {who: {k: _median_ms(v) for k, v in t.items()} for who, t in times.items()},
        "agreement": {phase: _stats(agree[phase], kl[phase]) for phase in agree},
        "modes": {
            name: {
                "identical_tokens": m["identical"] / len(cases),
                "box_iou_mean": float(np.mean(m["ious"])),
                "box_iou_min": float(np.min(m["ious"])),
                "objects_source": m["objects_source"],
                "objects_converted": m["objects_converted"],
            }
            for name, m in modes.items()
        },
    }


def format_report(r: dict) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    w, s = r["weights_bytes"], r["speed_ms"]
    lines = [
        f"report: {r['converted']} against {r['source']} ({len(r['cases'])} cases, max {r['max_tokens']} tokens)",
        f"{'':22}{'source':>12}{'converted':>12}",
        f"{'weights (MB)':22}{w['source'] / 1e6:12.1f}{w['converted'] / 1e6:12.1f}",
    ]
    for phase in ("prefill", "block_step", "ar_step"):
        lines.append(f"{phase + ' (ms)':22}{num(s['source'][phase], '12.2f')}{num(s['converted'][phase], '12.2f')}")
    lines.append(f"{'logits':22}{'rows':>8}{'top-1':>10}{'KL mean':>12}{'KL max':>12}")
    for phase, a in r["agreement"].items():
        lines.append(
            f"{phase:22}{a['rows']:8d}{num(a['top1_agreement'], '10.2%')}"
            f"{num(a['kl_mean'], '12.3g')}{num(a['kl_max'], '12.3g')}"
        )
    lines.append(f"{'mode':22}{'same ids':>10}{'IoU mean':>10}{'IoU min':>10}{'objects':>12}")
    for mode, m in r["modes"].items():
        lines.append(
            f"{mode:22}{m['identical_tokens']:10.2%}{m['box_iou_mean']:10.4f}{m['box_iou_min']:10.4f}"
            f"{m['objects_source']:>6}/{m['objects_converted']:<5}"
        )
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {name:22} {p.description}" for name, p in PRESETS.items())
    parser = argparse.ArgumentParser(
        prog="mlx-locate-convert",
        description="Convert a LocateAnything checkpoint (Hugging Face or mlx-vlm layout) to an MLX checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"quantization presets:\n{presets}",
    )
    parser.add_argument("--hf-path", required=True, help="source folder or Hugging Face hub id")
    parser.add_argument("--mlx-path", required=True, type=flags.output_path, help="destination folder")
    flags.add_dtype(parser, DEFAULT_DTYPE, "float dtype of the output (default: %(default)s)")
    parser.add_argument(
        "-q",
        "--quantize",
        choices=list(PRESETS),
        default=None,
        metavar="PRESET",
        help="quantization preset (see below)",
    )
    parser.add_argument("--report", action="store_true", help="compare the result with the source; writes report.json")
    flags.add_overwrite(parser, "an existing --mlx-path")
    parser.add_argument("--adapter", help="LoRA adapter folder (mlx-locate-finetune's or PEFT's); needs --fuse")
    parser.add_argument("--fuse", action="store_true", help="merge --adapter into the written weights")
    flags.add_progress(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.adapter) != args.fuse:
        parser.error("--adapter and --fuse go together (to run an unmerged adapter: mlx-locate --adapter)")
    try:
        dst = convert(
            args.hf_path, args.mlx_path, args.dtype, args.quantize, args.overwrite, args.adapter, not args.no_progress
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report:
        result = report(args.hf_path, dst, adapter=args.adapter)
        print(format_report(result))
        (dst / "report.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"[INFO] wrote {dst / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
