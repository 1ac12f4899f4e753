"""LocateAnything: vision tower -> connector -> splice -> Qwen2.5 decoder (docs/model.md §1, docs/model.md §7)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from ..tokens import TokenIds
from .language import LanguageModel
from .projector import make_connector, merge_2x2, run_connector
from .vision import VisionTower


class LocateAnything(nn.Module):
    def __init__(self, config: ModelConfig, token_ids: TokenIds):
        super().__init__()
        self.config = config
        self.token_ids = token_ids
        v, t = config.vision, config.text
        self.vision_model = VisionTower(v)
        self.mlp1 = make_connector(4 * v.hidden_size, t.hidden_size, eps=v.layer_norm_eps)
        self.language_model = LanguageModel(config.text)

    def image_features(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """Patches (h*w, 3, p, p) of one image -> its (h*w/4, D) rows for the <IMG_CONTEXT> slots; (B, h*w, 3,
        p, p) of B images of the same grid -> (B, h*w/4, D)."""
        return self.connect(self.vision_model(patches, grid), grid)

    def connect(self, tower: mx.array, grid: tuple[int, int]) -> mx.array:
        """The tower's output (..., h*w, C) -> the connector's rows (..., h*w/4, D)."""
        return run_connector(self.mlp1, merge_2x2(tower, grid))

    def embed(self, input_ids: list[int], features: mx.array) -> mx.array:
        """Token embeddings (1, P, D) with the k-th <IMG_CONTEXT> replaced by feature row k."""
        slots = [i for i, t in enumerate(input_ids) if t == self.token_ids.image]
        if len(slots) != features.shape[0]:
            raise ValueError(
                f"prompt has {len(slots)} <IMG_CONTEXT> tokens but the images give {features.shape[0]} feature rows"
            )
        embeds = self.language_model.model.embed_tokens(mx.array(input_ids, dtype=mx.int32))
        if slots:
            embeds[mx.array(slots, dtype=mx.int32)] = features.astype(embeds.dtype)
        return embeds[None]
