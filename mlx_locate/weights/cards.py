"""What a checkpoint was trained to find (`loader.Checkpoint.known`): the categories fine-tuning keeps by default
(replay, `tuner/replay.py`).

A checkpoint names them in its config.json, `"known_categories": {"names": [...], "per_prompt": N}` (N: the most
categories one detection prompt of its training asked for), as the demo's does (its five shapes, written by
`tuner.demo_recipe.demo_config`). NVIDIA's release has no such field; for a checkpoint of its architecture (a download,
a conversion, a quantized copy) its model card's detection set applies: COCO's 80 categories.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import RELEASE_CONFIG

CONFIG_KEY = "known_categories"
RELEASE_PER_PROMPT = 10  # categories per detection prompt for the release (and for a list without a checkpoint's)
COCO_CATEGORIES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)  # fmt: skip
RELEASE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers")  # text_config fields that tell the release


@dataclass(frozen=True)
class KnownCategories:
    names: tuple[str, ...]
    per_prompt: int  # categories per detection prompt when the base is asked about them

    def to_config(self) -> dict:
        return {"names": list(self.names), "per_prompt": self.per_prompt}


def is_release(raw_config: dict) -> bool:
    """The checkpoint has NVIDIA's LocateAnything-3B architecture (its language model's sizes and vocabulary)."""
    text, release = raw_config.get("text_config", {}), RELEASE_CONFIG["text_config"]
    return raw_config.get("model_type") == RELEASE_CONFIG["model_type"] and all(
        text.get(k) == release[k] for k in RELEASE_SIZES
    )


def known_categories(raw_config: dict) -> KnownCategories | None:
    """The checkpoint's own list (config.json), the release's model card's for the 3B, or None."""
    entry = raw_config.get(CONFIG_KEY)
    if entry is None:
        return KnownCategories(COCO_CATEGORIES, RELEASE_PER_PROMPT) if is_release(raw_config) else None
    names = entry.get("names") if isinstance(entry, dict) else None
    per_prompt = entry.get("per_prompt") if isinstance(entry, dict) else None
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(n, str) and n.strip() for n in names)
        or not isinstance(per_prompt, int)
        or per_prompt < 1
    ):
        raise ValueError(
            f'config.json: "{CONFIG_KEY}" must be {{"names": [non-empty strings], "per_prompt": a positive '
            f"integer}}; found {entry!r}"
        )
    return KnownCategories(tuple(n.strip() for n in names), per_prompt)
