"""Frozen configuration dataclasses built from a checkpoint's `config.json`.

Fields the model needs have no default, so a config that lacks one fails when it is read,
naming the field, instead of mid-decode. Unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _from_dict(cls, data: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = sorted(required - data.keys())
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    merge_kernel_size: tuple[int, int] = (2, 2)
    # Fixed in the reference code, not in config.json.
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int = 6
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ModelConfig:
    vision: VisionConfig
    text: TextConfig
    raw: dict = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        for section in ("vision_config", "text_config"):
            if not isinstance(data.get(section), dict):
                raise ValueError(f"config.json: missing section {section}")
        vision = dict(data["vision_config"])
        if "merge_kernel_size" in vision:
            vision["merge_kernel_size"] = tuple(vision["merge_kernel_size"])
        config = cls(
            vision=_from_dict(VisionConfig, vision, "config.json vision_config"),
            text=_from_dict(TextConfig, data["text_config"], "config.json text_config"),
            raw=data,
        )
        if config.text.block_size != 6:
            raise ValueError(f"config.json text_config: block_size must be 6, got {config.text.block_size}")
        if config.vision.merge_kernel_size != (2, 2):
            raise ValueError(
                "config.json vision_config: merge_kernel_size must be [2, 2], "
                f"got {list(config.vision.merge_kernel_size)}"
            )
        if config.vision.head_dim % 4:
            raise ValueError(
                f"config.json vision_config: head_dim {config.vision.head_dim} must be a multiple of 4 for 2D RoPE"
            )
        return config
