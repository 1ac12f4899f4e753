"""Strict loading of LocateAnything checkpoints: original Hugging Face layout, mlx-vlm layout, our own; the one way
in from a checkpoint (`read_checkpoint`), which inference (`locate.load`) and fine-tuning share.

Only safetensors files are read; no code from a checkpoint folder is ever executed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import ModelConfig
from ..network.model import LocateAnything
from ..preprocess import IN_TOKEN_LIMIT
from ..tokenizer import Tokenizer
from .cards import KnownCategories, known_categories
from .checkpoint import ReadAhead, cast, check_dtype, loading_streams, read_json, read_weights, resolve, tensor_sizes
from .lora import Adapter, apply_adapter, peft_name, read_adapter

CPU_DTYPE = "float32"  # what a checkpoint computes in on the CPU backend unless told otherwise (`read_checkpoint`)

# mlx-vlm's renames (docs/model.md §4), applied in order to key prefixes.
MLX_VLM_RENAMES = (
    ("vision_tower.patch_embed.", "vision_model.patch_embed."),
    ("vision_tower.", "vision_model.encoder."),
    ("multi_modal_projector.layer_norm.", "mlp1.0."),
    ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
)
DROPPED = ("language_model.lm_head.weight",)


def rename(key: str) -> str | None:
    """Our name for a HF or mlx-vlm tensor name; None for a tensor we drop (head copy, rotary buffers)."""
    if key in DROPPED or "rotary_emb" in key or key.endswith("inv_freq"):
        return None
    for old, new in MLX_VLM_RENAMES:
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    if key.startswith("vision_model.encoder.blocks.") and ".attn." in key:
        key = key.replace(".attn.", ".")
    return key


def sanitize(weights: dict[str, mx.array], patch_size: int) -> dict[str, mx.array]:
    """Map the HF or mlx-vlm names and layouts onto ours; drop the head copy and rotary buffers."""
    out = {}
    for key, value in weights.items():
        key = rename(key)
        if key is None:
            continue
        if key == "vision_model.patch_embed.proj.weight":
            if value.ndim == 4 and value.shape[-1] == 3 and value.shape[1] == patch_size:
                value = value.transpose(0, 3, 1, 2)  # OHWI (mlx-vlm) -> OIHW
            value = value.reshape(value.shape[0], -1)
        out[key] = value
    return out


def check_names_and_shapes(model: nn.Module, weights: dict[str, mx.array], folder: Path | str) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    misshapen = [
        f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in sorted(expected.keys() & weights.keys())
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label} tensors: {shown}")
    if problems:
        raise ValueError(f"{folder}: weights do not match the config: " + "; ".join(problems))


def build_model(
    folder: Path, config: ModelConfig, token_ids, dtype: str | None = None, meanwhile: Callable[[], None] | None = None
) -> LocateAnything:
    """The checkpoint in `folder` as a model, its tower's weights read (`assemble_model`, which calls `meanwhile`)."""
    weights, adapter = split_peft_checkpoint(read_weights(folder), config.raw, folder)
    model = assemble_model(sanitize(weights, config.vision.patch_size), config, token_ids, dtype, folder, meanwhile)
    if adapter is not None:
        apply_adapter(model, adapter)
    return model


# NVIDIA's training (`eaglevl`) records LoRA ranks in config.json and wraps with lora_alpha = 2 * rank.
PEFT_RANK_FIELDS = {"language_model.": "use_llm_lora", "vision_model.": "use_backbone_lora"}


def split_peft_checkpoint(weights: dict[str, mx.array], raw_config: dict, folder: Path) -> tuple[dict, Adapter | None]:
    """A whole checkpoint saved while PEFT wrapped the decoder (NVIDIA's LoRA script): base weights under
    `...q_proj.base_layer.weight`, pairs under `...q_proj.lora_A.default.weight`. Returns the base weights under
    their plain names and the pairs as an adapter to merge; other checkpoints pass through unchanged."""
    if not any(".lora_A." in k for k in weights):
        return weights, None
    base, lora = {}, {}
    for key, value in weights.items():
        name = peft_name(key).replace(".base_layer.", ".")
        (lora if ".lora_A." in name or ".lora_B." in name else base)[name] = value
    pairs = {}
    for name, a in lora.items():
        if name.endswith(".lora_B.weight") and name.replace(".lora_B.", ".lora_A.") not in lora:
            raise ValueError(f"{folder}: LoRA tensor {name} has no lora_A")
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[: -len(".lora_A.weight")]
        field = next((f for prefix, f in PEFT_RANK_FIELDS.items() if module.startswith(prefix)), None)
        rank = int(raw_config.get(field) or 0) if field else 0
        if f"{module}.lora_B.weight" not in lora or rank != a.shape[0]:
            raise ValueError(
                f"{folder}: LoRA tensor {name} ({a.shape[0]} ranks) needs its lora_B and config.json's "
                f"{field or 'use_llm_lora'} = {a.shape[0]}"
            )
        pairs[module] = (a.T, lora[f"{module}.lora_B.weight"].T, 2.0)  # alpha 2r over rank r
    return base, Adapter(pairs, {}, None)


def assemble_model(
    weights: dict[str, mx.array],
    config: ModelConfig,
    token_ids,
    dtype: str | None = None,
    where: Path | str = "",
    meanwhile: Callable[[], None] | None = None,
) -> LocateAnything:
    """The model from sanitized `weights`, quantized as `config.raw["quantization"]` says; strict. `meanwhile` is
    called as the host starts to wait for the tower's weights: work another thread may do while they are read."""
    check_dtype(dtype)
    model = LocateAnything(config, token_ids)
    quant = config.raw.get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            # Per-module settings (mixed presets) override the defaults, as in mlx-lm.
            class_predicate=lambda path, module: f"{path}.scales" in weights and quant.get(path, True),
        )
    if dtype is not None:
        weights = {k: cast(v, dtype) for k, v in weights.items()}
    check_names_and_shapes(model, weights, where)
    model.load_weights(list(weights.items()), strict=True)
    # The tower's weights are read now; the decoder's when first needed: inference schedules them behind the
    # first image's tower (`runtime.DecoderLoad`). A compiled step waits for them before it traces: a
    # lazy weight captured by several compiled steps would be loaded by each (`compiled.CompiledSteps`).
    params = model.parameters()
    if meanwhile is not None:
        meanwhile()
    mx.eval(params["vision_model"], params["mlp1"])
    model.eval()
    return model


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its network (unfused, as training wants it; `runtime.Runtime` fuses a view of it for
    inference), tokenizer and patch limit, where it came from, and what it was trained to find (`cards`)."""

    network: LocateAnything
    tokenizer: Tokenizer
    in_token_limit: int = IN_TOKEN_LIMIT  # patches an image may have (preprocessor_config.json)
    path: str = ""  # the folder or hub id it was read from
    known: KnownCategories | None = None
    ahead: ReadAhead | None = None  # the decoder's weights, being read by threads (`read_checkpoint`'s read_ahead)

    @property
    def config(self) -> ModelConfig:
        return self.network.config

    @property
    def max_length(self) -> int:
        """Positions a prompt and its answer may use: the tokenizer's model_max_length, and the decoder's
        max_position_embeddings where the config gives it."""
        positions = self.config.raw.get("text_config", {}).get("max_position_embeddings")
        return min(self.tokenizer.model_max_length, positions or self.tokenizer.model_max_length)


def in_token_limit(folder: Path) -> int:
    """The patches an image of this checkpoint may have: preprocessor_config.json's, else the release's."""
    if not (folder / "preprocessor_config.json").is_file():
        return IN_TOKEN_LIMIT
    return int(read_json(folder, "preprocessor_config.json").get("in_token_limit", IN_TOKEN_LIMIT))


def image_settings(folder: Path) -> tuple[int, int]:
    """(in_token_limit, patch_size) of a checkpoint folder: what preparing an image needs, before the model
    loads (`runtime.Runtime.prepare`)."""
    return in_token_limit(folder), read_config(folder).vision.patch_size


def read_config(folder: Path) -> ModelConfig:
    """The checkpoint's config.json, its errors naming the folder."""
    raw = read_json(folder, "config.json")
    try:
        return ModelConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None


def read_checkpoint(
    path_or_hub_id: str | Path,
    dtype: str | None = None,
    adapter_path: str | Path | None = None,
    read_ahead: int = 0,
) -> Checkpoint:
    """A checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout) as a `Checkpoint`.

    `dtype` ("bfloat16", "float16", "float32") casts the weights. By default they stay as stored, except on
    MLX's CPU backend, where they become float32: there half-precision matmuls and attention run MLX's own
    kernels instead of BLAS, many times slower than float32's, so float32 is the fast path (CPU_DTYPE).
    `adapter_path`: a LoRA adapter folder applied on top (`lora.apply_adapter`); the base's files are only read.
    The tokenizer is built on a thread while the tower's weights are read, and not before: the tokenizers library
    holds the interpreter while it builds, so a thread that started at once would keep this one from queuing the
    reads. The decoder's weights are read when first needed (`assemble_model`), on the loading streams
    (`checkpoint.loading_streams`), not the default one; or, with `read_ahead` threads, by those threads from the
    start (`checkpoint.ReadAhead`, in `Checkpoint.ahead`), while the network holds their unread stand-ins: for a
    network given up to inference, which puts them in at its first use (`runtime.DecoderLoad`). Not for a
    checkpoint saved with PEFT pairs or with an adapter applied: those change the decoder's weights as they load."""
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = CPU_DTYPE
    folder = resolve(path_or_hub_id)
    config = read_config(folder)
    raw = config.raw
    reading = threading.Event()
    ahead = None
    loading_streams()  # made before the reading threads make theirs
    check_dtype(dtype)  # before any thread reads
    if read_ahead and adapter_path is None:
        tensors = tensor_sizes(folder)
        if not any(".lora_A." in name for _, _, name in tensors):
            ahead = ReadAhead([t for t in tensors if is_decoders(t[2])], dtype, read_ahead)

    def build_tokenizer() -> Tokenizer:
        reading.wait()
        return Tokenizer.from_folder(folder).warm()

    with ThreadPoolExecutor(1, thread_name_prefix="mlx-locate-tokenizer") as pool, mx.stream(loading_streams()[1]):
        tokenizer_job = pool.submit(build_tokenizer)
        try:
            network = build_model(folder, config, None, dtype, meanwhile=reading.set)
        finally:
            reading.set()  # a build that fails before the tower is read: let the thread go, or the pool never shuts
        tokenizer = tokenizer_job.result()
        network.token_ids = tokenizer.token_ids(raw)
        if adapter_path is not None:
            apply_adapter(network, read_adapter(adapter_path))
    return Checkpoint(network, tokenizer, in_token_limit(folder), str(path_or_hub_id), known_categories(raw), ahead)


def is_decoders(name: str) -> bool:
    """Whether a tensor of the files is the decoder's (`language_model.*` once renamed)."""
    ours = rename(name)
    return ours is not None and ours.startswith("language_model.")
