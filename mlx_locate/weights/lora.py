"""LoRA for LocateAnything, in mlx-lm's pattern (`LoRALinear.from_base`, `adapters.safetensors` +
`adapter_config.json`), and NVIDIA's PEFT adapters (`adapter_model.safetensors`, `lora_A` / `lora_B`).

A LoRA layer adds `scale * (x @ lora_a) @ lora_b` to its frozen base (`nn.Linear` or `nn.QuantizedLinear`);
`scale = alpha / rank` as in PEFT (NVIDIA: rank 64, alpha 128). An adapter folder holds the low-rank pairs under
the network's module paths (`language_model.model.layers.3.self_attn.q_proj.lora_a`) and every other trained
tensor (the connector, `mlp1.*`) under its parameter name.

For inference (`apply_adapter`) a float base takes the adapter merged into its weights, so the decoder runs as
fast as without one and `fuse_projections` fuses q|k|v and gate|up as usual. A quantized base keeps its weights
and the low-rank pairs beside them, fused the same way: q|k|v (and gate|up) become one quantized product plus one
pair `x @ [a_q a_k a_v]` then a block-diagonal `b` (`FusedLoRALinear`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..network.language import FUSED, fuse_linears
from .checkpoint import check_safetensors

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_ADAPTER_FILE = "adapter_model.safetensors"
# NVIDIA's targets (wrap_llm_lora): every projection of every decoder layer.
DECODER_KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
VISION_KEYS = ("wqkv", "wo", "mlp.fc0", "mlp.fc1")  # MoonViT's block linears
DECODER_PREFIX = "language_model.model.layers"
VISION_PREFIX = "vision_model.encoder.blocks"
CONNECTOR = "mlp1"


@dataclass(frozen=True)
class LoRASpec:
    """Where LoRA goes and its size: `rank`, `alpha` (scale = alpha / rank), `dropout` on the layer input,
    `num_layers` (the last N layers; None: all), `keys` (module paths inside a layer)."""

    rank: int = 64
    alpha: float = 128.0
    dropout: float = 0.05
    num_layers: int | None = None
    keys: tuple[str, ...] = DECODER_KEYS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"LoRA layers must be at least 1 (or all), got {self.num_layers}")


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input, output) widths of an `nn.Linear` or `nn.QuantizedLinear`."""
    out_dims, packed = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        return packed * 32 // linear.bits, out_dims
    return packed, out_dims


class LoRALinear(nn.Module):
    """`linear(x) + scale * (dropout(x) @ lora_a) @ lora_b`, with `lora_b` zero at the start (mlx-lm's init)."""

    @staticmethod
    def from_base(linear: nn.Module, rank: int, scale: float, dropout: float = 0.0) -> LoRALinear:
        in_dims, out_dims = linear_dims(linear)
        lora = LoRALinear(in_dims, out_dims, rank, scale, dropout)
        lora.linear = linear
        return lora

    def __init__(self, in_dims: int, out_dims: int, rank: int, scale: float, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        bound = 1 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (in_dims, rank))
        self.lora_b = mx.zeros((rank, out_dims))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        return y + (self.scale * z).astype(y.dtype)

    def delta(self) -> mx.array:
        """The weight update (out, in) in float32."""
        return (self.scale * (self.lora_a.astype(mx.float32) @ self.lora_b.astype(mx.float32))).T

    def fuse(self) -> nn.Module:
        """The base with the update merged in: a float base in its dtype, a quantized one dequantized, summed and
        quantized again with its own settings."""
        base = self.linear
        if isinstance(base, nn.QuantizedLinear):
            weight = mx.dequantize(
                base.weight, base.scales, base.get("biases"), base.group_size, base.bits, mode=base.mode
            )
            dtype = base.scales.dtype
        else:
            weight, dtype = base.weight, base.weight.dtype
        in_dims, out_dims = linear_dims(base)
        fused = nn.Linear(in_dims, out_dims, bias="bias" in base)
        fused.weight = (weight.astype(mx.float32) + self.delta()).astype(dtype)
        if "bias" in base:
            fused.bias = base.bias
        if isinstance(base, nn.QuantizedLinear):
            return nn.QuantizedLinear.from_linear(fused, base.group_size, base.bits, mode=base.mode)
        return fused


class FusedLoRALinear(nn.Module):
    """Several projections of one input side by side (q|k|v, gate|up): one base product (`fuse_linears`) plus
    `(x @ lora_a) @ lora_b`, `lora_a` the parts' `a`s side by side and `lora_b` block diagonal with each part's
    scale folded in. A part without LoRA adds no columns to `lora_a`."""

    def __init__(self, linear: nn.Module, lora_a: mx.array, lora_b: mx.array):
        super().__init__()
        self.linear = linear
        self.lora_a = lora_a  # (in, sum of ranks)
        self.lora_b = lora_b  # (sum of ranks, sum of outputs)

    @staticmethod
    def from_parts(parts: list[nn.Module], dtype: mx.Dtype) -> FusedLoRALinear | None:
        """None when the bases are not alike (see `fuse_linears`)."""
        base = fuse_linears([p.linear if isinstance(p, LoRALinear) else p for p in parts])
        if base is None:
            return None
        outs = [linear_dims(p.linear if isinstance(p, LoRALinear) else p)[1] for p in parts]
        loras = [(p, sum(outs[:i])) for i, p in enumerate(parts) if isinstance(p, LoRALinear)]
        rank = sum(p.lora_a.shape[1] for p, _ in loras)
        b = mx.zeros((rank, sum(outs)), mx.float32)
        row = 0
        for p, col in loras:
            r, out = p.lora_b.shape
            b[row : row + r, col : col + out] = p.scale * p.lora_b.astype(mx.float32)
            row += r
        a = mx.concatenate([p.lora_a for p, _ in loras], axis=1)
        return FusedLoRALinear(base, a.astype(dtype), b.astype(dtype))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        return y + ((x @ self.lora_a) @ self.lora_b).astype(y.dtype)


# --- Adding LoRA for training -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterSpec:
    """What a fine-tune trains: LoRA on the decoder and (optionally) the vision tower, and whole modules."""

    decoder: LoRASpec | None = LoRASpec()
    vision: LoRASpec | None = None
    trainable: tuple[str, ...] = (CONNECTOR,)


def layer_targets(network: nn.Module, spec: LoRASpec, prefix: str) -> list[tuple[str, nn.Module]]:
    """(path, linear) of `spec.keys` in the last `spec.num_layers` layers under `prefix`."""
    modules = dict(network.named_modules())
    count = sum(1 for p in modules if re.fullmatch(rf"{re.escape(prefix)}\.\d+", p))
    if spec.num_layers is not None and spec.num_layers > count:
        raise ValueError(f"LoRA on {spec.num_layers} layers, but {prefix} has {count}")
    first = 0 if spec.num_layers is None else count - spec.num_layers
    targets = []
    for i in range(first, count):
        for key in spec.keys:
            path = f"{prefix}.{i}.{key}"
            module = modules.get(path)
            if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
                found = type(module).__name__ if module is not None else "nothing"
                raise ValueError(f"LoRA target {path}: expected a linear layer, found {found}")
            targets.append((path, module))
    return targets


def float_linear(module: nn.Module) -> nn.Module:
    """A quantized linear as a float `nn.Linear` (to train it); anything else as it is."""
    if not isinstance(module, nn.QuantizedLinear):
        return module
    in_dims, out_dims = linear_dims(module)
    linear = nn.Linear(in_dims, out_dims, bias="bias" in module)
    linear.weight = mx.dequantize(
        module.weight, module.scales, module.get("biases"), module.group_size, module.bits, mode=module.mode
    )
    if "bias" in module:
        linear.bias = module.bias
    return linear


def add_lora(network: nn.Module, spec: AdapterSpec) -> int:
    """Freeze `network`, wrap the targets in `LoRALinear` (float32 pairs) and unfreeze `spec.trainable` (a
    quantized module there is dequantized first). Returns the number of trainable parameters."""
    network.freeze()
    wrapped = []
    for lora, prefix in ((spec.decoder, DECODER_PREFIX), (spec.vision, VISION_PREFIX)):
        if lora is not None:
            wrapped += [
                (path, LoRALinear.from_base(m, lora.rank, lora.scale, lora.dropout))
                for path, m in layer_targets(network, lora, prefix)
            ]
    under = {
        name: [p for p in dict(network.named_modules()) if p == name or p.startswith(name + ".")]
        for name in spec.trainable
    }
    for name, paths in under.items():
        if not paths:
            raise ValueError(f"trainable module {name!r} is not part of the network")
    modules = dict(network.named_modules())
    wrapped += [
        (p, float_linear(modules[p]))
        for paths in under.values()
        for p in paths
        if isinstance(modules[p], nn.QuantizedLinear)
    ]
    network.update_modules(tree_unflatten(wrapped))
    modules = dict(network.named_modules())
    for paths in under.values():
        for p in paths:
            modules[p].unfreeze()
    return sum(v.size for _, v in tree_flatten(network.trainable_parameters()))


# --- Adapter files --------------------------------------------------------------------------------------------


def _spec_json(spec: LoRASpec | None) -> dict | None:
    if spec is None:
        return None
    out = asdict(spec)
    out["keys"] = list(spec.keys)
    out["scale"] = spec.scale
    return out


def _spec_from_json(data: dict | None, num_layers: int | None, default_keys: tuple[str, ...]) -> LoRASpec | None:
    if data is None:
        return None
    rank = int(data["rank"])
    # mlx-lm writes `scale` only; PEFT's alpha = scale * rank.
    alpha = float(data["alpha"]) if "alpha" in data else float(data["scale"]) * rank
    return LoRASpec(
        rank=rank,
        alpha=alpha,
        dropout=float(data.get("dropout", 0.0)),
        num_layers=data.get("num_layers", num_layers),
        keys=tuple(data.get("keys") or default_keys),
    )


def adapter_config(spec: AdapterSpec, **record) -> dict:
    """adapter_config.json: mlx-lm's fields (`fine_tune_type`, `num_layers`, `lora_parameters`) and ours."""
    decoder = _spec_json(spec.decoder)
    return {
        "format": "mlx-locate",
        "fine_tune_type": "lora",
        "num_layers": None if spec.decoder is None else spec.decoder.num_layers,
        "lora_parameters": decoder,
        "vision_lora_parameters": _spec_json(spec.vision),
        "trainable": list(spec.trainable),
        **record,
    }


def save_adapter(folder: Path, network: nn.Module, spec: AdapterSpec, **record) -> None:
    """Write the trainable tensors (float32) and adapter_config.json into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(network.trainable_parameters())}
    mx.save_safetensors(str(folder / ADAPTER_FILE), weights, metadata={"format": "mlx"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(spec, **record), indent=2) + "\n")


@dataclass
class Adapter:
    """A read adapter: low-rank pairs by module path (a (in, r), b (r, out), scale) and whole tensors by name."""

    pairs: dict[str, tuple[mx.array, mx.array, float]]
    tensors: dict[str, mx.array]
    spec: AdapterSpec | None  # None for a PEFT adapter (its targets are whatever its tensors name)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _load_tensors(path: Path) -> dict[str, mx.array]:
    check_safetensors(path)
    return mx.load(str(path))


def read_adapter(folder: str | Path) -> Adapter:
    """Our adapter folder (`adapters.safetensors` + `adapter_config.json`) or a PEFT one
    (`adapter_model.safetensors` + `adapter_config.json` with `peft_type` "LORA")."""
    folder = Path(folder).expanduser()
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise FileNotFoundError(f"adapter folder {folder} does not exist")
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: missing {CONFIG_FILE} (not an adapter folder)")
    config = _read_json(config_path)
    if "peft_type" in config:
        return _read_peft(folder, config)
    if config.get("fine_tune_type", "lora") != "lora":
        raise ValueError(f"{config_path}: fine_tune_type {config['fine_tune_type']!r} is not supported (only lora)")
    if not (folder / ADAPTER_FILE).is_file():
        raise FileNotFoundError(f"{folder}: missing {ADAPTER_FILE}")
    decoder = _spec_from_json(config.get("lora_parameters"), config.get("num_layers"), DECODER_KEYS)
    vision = _spec_from_json(config.get("vision_lora_parameters"), None, VISION_KEYS)
    spec = AdapterSpec(decoder, vision, tuple(config.get("trainable", ())))
    weights = _load_tensors(folder / ADAPTER_FILE)
    pairs, tensors = {}, {}
    for key, value in weights.items():
        path, _, leaf = key.rpartition(".")
        if leaf == "lora_a":
            lora = spec.vision if path.startswith("vision_model.") else spec.decoder
            if lora is None or f"{path}.lora_b" not in weights:
                raise ValueError(f"{folder / ADAPTER_FILE}: {key} has no matching lora_b or LoRA parameters")
            pairs[path] = (value, weights[f"{path}.lora_b"], lora.scale)
        elif leaf != "lora_b":
            tensors[key] = value
        elif f"{path}.lora_a" not in weights:
            raise ValueError(f"{folder / ADAPTER_FILE}: {key} has no matching lora_a")
    return Adapter(pairs, tensors, spec)


def peft_name(key: str) -> str:
    """A PEFT tensor name as our module path: `base_model.model.` wrappers, the adapter name (`.default`) and
    `modules_to_save` dropped; names relative to the decoder (`model.layers...`) put under `language_model.`."""
    key = key.replace("base_model.model.", "")
    key = re.sub(r"\.(lora_[AB])\.default\.", r".\1.", key)
    key = key.replace(".modules_to_save.default.", ".").replace(".modules_to_save.", ".")
    if key.startswith(("model.", "lm_head.")):
        key = "language_model." + key
    return key


def _read_peft(folder: Path, config: dict) -> Adapter:
    where = folder / CONFIG_FILE
    if config["peft_type"] != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise ValueError(f"{where}: {flag} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("alpha_pattern"):
        raise ValueError(f"{where}: alpha_pattern is not supported")
    path = folder / PEFT_ADAPTER_FILE
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir()))
        raise FileNotFoundError(f"{folder}: missing {PEFT_ADAPTER_FILE} (only safetensors are read; found {found})")
    alpha = float(config.get("lora_alpha", 8))
    weights = {peft_name(k): v for k, v in _load_tensors(path).items()}
    pairs, tensors = {}, {}
    for key, value in weights.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            b = weights.get(f"{module}.lora_B.weight")
            if b is None:
                raise ValueError(f"{path}: {key} has no matching lora_B")
            rank = value.shape[0]
            scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            pairs[module] = (value.T, b.T, scale)  # PEFT: A (r, in), B (out, r)
        elif not key.endswith(".lora_B.weight"):
            tensors[key] = value
        elif key.replace(".lora_B.", ".lora_A.") not in weights:
            raise ValueError(f"{path}: {key} has no matching lora_A")
    return Adapter(pairs, tensors, None)


# --- Applying an adapter for inference ------------------------------------------------------------------------


def _expected_shape(modules: dict, params: dict, name: str) -> tuple[int, ...] | None:
    """The shape a float tensor `name` must have; a quantized linear's weight and bias count as float ones."""
    if name in params:
        owner = modules.get(name.rpartition(".")[0])
        if not isinstance(owner, nn.QuantizedLinear):
            return tuple(params[name].shape)
    owner = modules.get(name.rpartition(".")[0])
    if isinstance(owner, nn.QuantizedLinear):
        in_dims, out_dims = linear_dims(owner)
        return {"weight": (out_dims, in_dims), "bias": (out_dims,)}.get(name.rpartition(".")[2])
    return None


def apply_adapter(network: nn.Module, adapter: Adapter, merge: bool | None = None) -> dict[str, int]:
    """Put `adapter` into `network` for inference. Whole tensors replace the network's (cast to its dtype; a
    quantized module they name becomes a float one). Each low-rank pair is merged into a float base (with
    `merge=True` into any base, re-quantizing a quantized one) or kept beside a quantized base, q|k|v and gate|up
    fused (`FusedLoRALinear`). Strict: every name must exist with the expected shape, or nothing changes.
    Returns how many pairs were merged and kept and how many tensors replaced."""
    modules = dict(network.named_modules())
    params = dict(tree_flatten(network.parameters()))
    problems = []
    for path, (a, b, _) in adapter.pairs.items():
        base = modules.get(path)
        if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            problems.append(f"{path} (no linear layer there)")
        elif (a.shape[0], b.shape[1]) != linear_dims(base) or a.shape[1] != b.shape[0]:
            problems.append(f"{path} (pair {tuple(a.shape)} x {tuple(b.shape)} for a {linear_dims(base)} layer)")
    for name, value in adapter.tensors.items():
        expected = _expected_shape(modules, params, name)
        if expected is None:
            problems.append(f"{name} (no such tensor)")
        elif tuple(value.shape) != expected:
            problems.append(f"{name} {tuple(value.shape)} (expected {expected})")
    if problems:
        shown = ", ".join(problems[:8]) + (f", ... ({len(problems)} in all)" if len(problems) > 8 else "")
        raise ValueError(f"the adapter does not fit the model: {shown}")

    dtype = network.language_model.model.norm.weight.dtype
    owners = sorted({n.rpartition(".")[0] for n in adapter.tensors})
    network.update_modules(
        tree_unflatten([(p, float_linear(modules[p])) for p in owners if isinstance(modules[p], nn.QuantizedLinear)])
    )
    params = dict(tree_flatten(network.parameters()))
    network.update(tree_unflatten([(k, v.astype(params[k].dtype)) for k, v in adapter.tensors.items()]))

    merged, kept = [], []
    for path, (a, b, scale) in adapter.pairs.items():
        lora = LoRALinear.from_base(modules[path], a.shape[1], scale)
        lora.lora_a, lora.lora_b = a.astype(mx.float32), b.astype(mx.float32)
        quantized = isinstance(modules[path], nn.QuantizedLinear)
        if merge or (merge is None and not quantized):
            merged.append((path, lora.fuse()))
        else:
            kept.append((path, lora))
    network.update_modules(tree_unflatten(merged + kept))
    fuse_lora_projections(network, dtype)
    mx.eval(network.parameters())
    return {"merged": len(merged), "kept": len(kept), "replaced": len(adapter.tensors)}


def fuse_lora_projections(network: nn.Module, dtype: mx.Dtype) -> None:
    """q|k|v and gate|up with LoRA kept beside them as one `FusedLoRALinear` each, layer by layer."""
    for layer in network.language_model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            for fused_name, names in FUSED.items():
                if not all(n in module for n in names) or not any(isinstance(module[n], LoRALinear) for n in names):
                    continue
                fused = FusedLoRALinear.from_parts([module[n] for n in names], dtype)
                if fused is None:
                    continue
                mx.eval(fused.parameters())
                for n in names:
                    del module[n]
                module[fused_name] = fused
