"""The public entry point: `load(path_or_hub_id)` -> `LocateModel`, and `LocateModel.locate(image, query)`.

The data flow reads top to bottom: preprocess -> vision -> projector -> splice -> prefill -> decode -> parse.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from PIL import Image

from .cache import KVCache
from .compiled import CompiledSteps, StepRunner
from .config import ModelConfig
from .decide import Guards, Mode
from .decode import DecodeOptions, decode
from .loader import build_model, read_json, resolve
from .model import LocateAnything
from .parse import LocatedObject, parse_tokens
from .preprocess import IN_TOKEN_LIMIT, load_image, preprocess, to_rgb
from .prompts import prompt_ids, task_text
from .sampling import Sampling
from .tokenizer import Tokenizer


@dataclass
class Result:
    objects: list[LocatedObject]
    empty_labels: list[str | None]  # labels the model answered with <box>None</box>
    text: str  # the generated text, special tokens included
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids
    token_probs: list[float]  # the decoder's probability of each generated id
    grid: list[int]  # [h, w] patches of the image
    image_size: tuple[int, int]  # (W0, H0) the pixel frame of every box and point
    mode: str
    truncated: bool  # the stream ended inside an item (length cap or stop)
    stats: dict = field(default_factory=dict)  # timings per phase (s), steps, host reads, stop reason

    def to_dict(self) -> dict:
        out = asdict(self)
        out["objects"] = [{k: v for k, v in asdict(o).items() if v is not None or k == "label"} for o in self.objects]
        return out


class LocateModel:
    """A loaded checkpoint: network, tokenizer and compiled step functions."""

    def __init__(self, network: LocateAnything, tokenizer: Tokenizer, in_token_limit: int = IN_TOKEN_LIMIT):
        self.network = network
        self.tokenizer = tokenizer
        self.token_ids = network.token_ids
        self.in_token_limit = in_token_limit
        self.steps = CompiledSteps(network)

    @property
    def compilations(self) -> int:
        """How many times a compiled step function was traced so far."""
        return self.steps.traces

    def new_cache(self) -> KVCache:
        t = self.network.config.text
        dtype = self.network.language_model.model.norm.weight.dtype
        return KVCache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, dtype)

    def locate(
        self,
        image: str | Path | Image.Image,
        query: str | list[str] | None = None,
        *,
        task: str = "detect",
        mode: str | Mode = Mode.HYBRID,
        max_tokens: int = 512,
        sampling: Sampling = Sampling(),
        strict: bool = False,
        guards: Guards = Guards(),
        redecode_labels: bool | None = None,
        rendering: str = "A",
        prompt: str | None = None,
        seed: int = 0,
    ) -> Result:
        """Find `query` in `image`. `task` picks the prompt template (MODEL.md §8.3); `prompt` replaces it
        with raw user text. Boxes and points come back in the pixels of the image as given.

        `redecode_labels` (hybrid) re-decodes uncertain label tokens autoregressively; default: on for OCR.
        """
        if isinstance(mode, str):
            modes = {m.value: m for m in Mode}
            if mode not in modes:
                raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(modes)}")
            mode = modes[mode]
        user_text = prompt if prompt is not None else task_text(task, query)
        options = DecodeOptions(
            mode=mode,
            max_new_tokens=max_tokens,
            sampling=sampling,
            strict=strict,
            guards=guards,
            redecode_labels=(task == "ocr") if redecode_labels is None else redecode_labels,
            seed=seed,
        )
        timings = {}
        t0 = time.perf_counter()
        rgb = to_rgb(load_image(image))
        pre = preprocess(rgb, in_token_limit=self.in_token_limit, patch_size=self.network.config.vision.patch_size)
        ids = prompt_ids(self.tokenizer, user_text, [pre.grid], rendering=rendering)
        timings["preprocess_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        features = self.network.image_features(mx.array(pre.patches), pre.grid)
        mx.eval(features)
        timings["vision_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        runner = StepRunner(self.steps, self.new_cache())
        first_logits = runner.prefill(self.network.embed(ids, features))
        mx.eval(first_logits)
        timings["prefill_s"] = time.perf_counter() - t0

        out = decode(runner.step, ids, first_logits, self.token_ids, options, self.tokenizer.model_max_length)
        parsed = parse_tokens(out.tokens, self.token_ids, self.tokenizer.decode, pre.original_size, out.probs)
        s = out.stats
        stats = {
            **timings,
            "decode_s": s.decode_s,
            "first_box_s": None if s.first_box_s is None else timings["prefill_s"] + s.first_box_s,
            "tokens": len(out.tokens),
            "steps": s.steps,
            "block_steps": s.block_steps,
            "ar_steps": s.ar_steps,
            "fallbacks": s.fallbacks,
            "label_redecodes": s.label_redecodes,
            "host_reads": s.host_reads,
            "stop_reason": s.stop_reason.value,
            "sources": s.sources,
            "compilations": self.compilations,
        }
        return Result(
            objects=parsed.objects,
            empty_labels=parsed.empty_labels,
            text=self.tokenizer.decode(out.tokens),
            prompt_ids=ids,
            token_ids=out.tokens,
            token_probs=out.probs,
            grid=list(pre.grid),
            image_size=pre.original_size,
            mode=mode.value,
            truncated=parsed.truncated,
            stats=stats,
        )


def load(path_or_hub_id: str | Path, dtype: str | None = None) -> LocateModel:
    """Load a checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout).

    `dtype` ("bfloat16", "float16", "float32") casts the weights; by default they stay as stored.
    """
    folder = resolve(path_or_hub_id)
    raw = read_json(folder, "config.json")
    config = ModelConfig.from_dict(raw)
    tokenizer = Tokenizer.from_folder(folder)
    network = build_model(folder, config, tokenizer.token_ids(raw), dtype)
    limit = IN_TOKEN_LIMIT
    if (folder / "preprocessor_config.json").is_file():
        limit = int(read_json(folder, "preprocessor_config.json").get("in_token_limit", IN_TOKEN_LIMIT))
    return LocateModel(network, tokenizer, in_token_limit=limit)
