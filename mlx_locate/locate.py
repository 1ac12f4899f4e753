"""The public entry point: `load(path_or_hub_id)` -> `LocateModel`, and `LocateModel.locate(image, query)`.

The data flow reads top to bottom: preprocess -> vision -> projector -> splice -> prefill -> decode -> parse.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from PIL import Image
from tqdm import tqdm

from .cache import KVCache
from .compiled import CompiledSteps, StepRunner
from .config import ModelConfig
from .decide import Guards, Mode
from .decode import DecodeOptions, decode
from .engine import Engine, EventKind, Request, RequestError, fit_max_tokens
from .language import fuse_projections
from .loader import build_model, read_json, resolve
from .model import LocateAnything
from .parse import LocatedObject, parse_tokens
from .preprocess import IN_TOKEN_LIMIT, Preprocessed, load_image, preprocess, to_rgb
from .prompts import prompt_ids, task_text
from .sampling import Sampling
from .tokenizer import Tokenizer
from .tuner.lora import apply_adapter, read_adapter


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


FEATURE_CACHE_SIZE = 8  # images whose vision features stay cached, by content


class LocateModel:
    """A loaded checkpoint: network, tokenizer, compiled step functions and a vision-feature cache.

    Takes over `network` for inference: its decoder's projections are fused (`language.fuse_projections`)."""

    def __init__(self, network: LocateAnything, tokenizer: Tokenizer, in_token_limit: int = IN_TOKEN_LIMIT):
        fuse_projections(network.language_model.model.layers)
        self.network = network
        self.tokenizer = tokenizer
        self.token_ids = network.token_ids
        self.in_token_limit = in_token_limit
        self.steps = CompiledSteps(network)
        self.features: OrderedDict[tuple, mx.array] = OrderedDict()

    @property
    def max_length(self) -> int:
        """Positions a prompt and its answer may use: the tokenizer's model_max_length, and the decoder's
        max_position_embeddings where the config gives it."""
        positions = self.network.config.raw.get("text_config", {}).get("max_position_embeddings")
        return min(self.tokenizer.model_max_length, positions or self.tokenizer.model_max_length)

    @property
    def compilations(self) -> int:
        """How many times a compiled step function was traced so far."""
        return self.steps.traces

    def new_cache(self) -> KVCache:
        t = self.network.config.text
        dtype = self.network.language_model.model.norm.weight.dtype
        return KVCache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, dtype)

    def image_features(self, rgb: Image.Image, pre: Preprocessed) -> tuple[mx.array, bool]:
        """Vision tower + connector for one image, cached by the image's content; returns (features, hit)."""
        key = (hashlib.sha256(rgb.tobytes()).hexdigest(), rgb.size, pre.grid)
        if key in self.features:
            self.features.move_to_end(key)
            return self.features[key], True
        features = self.network.image_features(mx.array(pre.patches), pre.grid)
        mx.eval(features)
        self.features[key] = features
        if len(self.features) > FEATURE_CACHE_SIZE:
            self.features.popitem(last=False)
        return features, False

    def session(self, image: str | Path | Image.Image, rendering: str = "A") -> Session:
        """Run the image through vision and the prompt prefix once; then ask many queries."""
        return Session(self, image, rendering)

    def engine(self, max_rows: int | None = None) -> Engine:
        """A batched engine over this model (see `engine.Engine`): submit requests, step, collect events."""
        return Engine(self, max_rows)

    def locate_many(
        self, requests: Iterable[Request], *, batch_size: int | None = None, progress: bool = False
    ) -> list[Result | RequestError]:
        """Run every request through one batched engine; results in request order. A request that cannot run
        gives its `RequestError` in its place and the others go on. `progress` shows a bar on stderr."""
        engine = self.engine(batch_size)
        handles = [engine.submit(r) for r in requests]
        with tqdm(total=len(handles), disable=not progress, unit="req") as bar:
            while not engine.idle:
                finished = sum(e.kind in (EventKind.DONE, EventKind.ERROR) for e in engine.step())
                bar.update(finished)
        return [h.result if h.result is not None else h.error for h in handles]

    def locate(
        self,
        image: str | Path | Image.Image,
        query: str | list[str] | None = None,
        *,
        rendering: str = "A",
        tiles: str | tuple[int, int] | None = None,
        tile_overlap: float = 0.2,
        tile_whole: bool = True,
        **kwargs,
    ) -> Result | list[Result]:
        """Find `query` in `image`; a list of queries gives a list of results, sharing the image's work.

        Keyword arguments are those of `Session.locate` (task, mode, max_tokens, sampling, ...). `tiles`
        ("auto" or (rows, cols)) decodes overlapping crops (and, with `tile_whole`, the whole image) as one
        batch and merges their objects in the image's pixels.
        """
        if tiles is not None:
            queries = query if isinstance(query, list) else [query]
            tiling = {"tiles": tiles, "tile_overlap": tile_overlap, "tile_whole": tile_whole}
            requests = [Request(image, q, rendering=rendering, **tiling, **kwargs) for q in queries]
            results = self.locate_many(requests)
            for r in results:
                if isinstance(r, RequestError):
                    raise r
            return results if isinstance(query, list) else results[0]
        session = self.session(image, rendering)
        if isinstance(query, list):
            return [session.locate(q, **kwargs) for q in query]
        return session.locate(query, **kwargs)


class Session:
    """One image and many queries: preprocessing, vision and the prompt prefix up to `</img>` run once;
    each query forks the cached prefix (no copy) and prefills only its own text."""

    def __init__(self, model: LocateModel, image: str | Path | Image.Image, rendering: str = "A"):
        self.model = model
        self.rendering = rendering
        network = model.network
        t0 = time.perf_counter()
        rgb = to_rgb(load_image(image))
        self.pre = preprocess(rgb, in_token_limit=model.in_token_limit, patch_size=network.config.vision.patch_size)
        prompt = prompt_ids(model.tokenizer, "", [self.pre.grid], rendering=rendering)
        self.prefix = prompt[: prompt.index(model.token_ids.img_end) + 1]
        self.timings = {"preprocess_s": time.perf_counter() - t0}

        t0 = time.perf_counter()
        features, self.vision_cached = model.image_features(rgb, self.pre)
        self.timings["vision_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.cache = model.new_cache()
        StepRunner(model.steps, self.cache).prefill(network.embed(self.prefix, features))
        mx.eval(self.cache.kv)
        self.timings["prefix_prefill_s"] = time.perf_counter() - t0

    def locate(
        self,
        query: str | list[str] | None = None,
        *,
        task: str = "detect",
        mode: str | Mode = Mode.HYBRID,
        max_tokens: int = 512,
        sampling: Sampling = Sampling(),
        strict: bool = False,
        guards: Guards = Guards(),
        redecode_labels: bool | None = None,
        prompt: str | None = None,
        seed: int = 0,
    ) -> Result:
        """Find `query` in the session's image. `task` picks the prompt template (MODEL.md §8.3); `prompt`
        replaces it with raw user text. Boxes and points come back in the pixels of the image as given.

        `redecode_labels` (hybrid) re-decodes uncertain label tokens autoregressively; default: on for OCR.
        """
        model, network = self.model, self.model.network
        if isinstance(mode, str):
            modes = {m.value: m for m in Mode}
            if mode not in modes:
                raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(modes)}")
            mode = modes[mode]
        user_text = prompt if prompt is not None else task_text(task, query)
        ids = prompt_ids(model.tokenizer, user_text, [self.pre.grid], rendering=self.rendering)
        assert ids[: len(self.prefix)] == self.prefix, "the prompt must extend the session's prefix"
        budget = fit_max_tokens(len(ids), max_tokens, model.max_length)
        options = DecodeOptions(
            mode=mode,
            max_new_tokens=budget,
            sampling=sampling,
            strict=strict,
            guards=guards,
            redecode_labels=(task == "ocr") if redecode_labels is None else redecode_labels,
            seed=seed,
        )

        t0 = time.perf_counter()
        runner = StepRunner(model.steps, self.cache.fork())
        no_features = mx.zeros((0, network.config.text.hidden_size))
        first_logits = runner.prefill(network.embed(ids[len(self.prefix) :], no_features))
        mx.eval(first_logits)
        prefill_s = time.perf_counter() - t0

        out = decode(runner.step, ids, first_logits, model.token_ids, options, model.max_length, runner.retract)
        parsed = parse_tokens(out.tokens, model.token_ids, model.tokenizer.decode, self.pre.original_size, out.probs)
        s = out.stats
        stats = {
            **self.timings,
            "vision_cached": self.vision_cached,
            "prefill_s": prefill_s,
            "decode_s": s.decode_s,
            "first_step_s": None if s.first_step_s is None else prefill_s + s.first_step_s,
            "first_box_s": None if s.first_box_s is None else prefill_s + s.first_box_s,
            "tokens": len(out.tokens),
            "steps": s.steps,
            "block_steps": s.block_steps,
            "ar_steps": s.ar_steps,
            "fallbacks": s.fallbacks,
            "label_redecodes": s.label_redecodes,
            "host_reads": s.host_reads,
            "stop_reason": s.stop_reason.value,
            "sources": s.sources,
            "compilations": model.compilations,
            "max_tokens": budget,
            "max_tokens_clipped": budget < max_tokens,
        }
        return Result(
            objects=parsed.objects,
            empty_labels=parsed.empty_labels,
            text=model.tokenizer.decode(out.tokens),
            prompt_ids=ids,
            token_ids=out.tokens,
            token_probs=out.probs,
            grid=list(self.pre.grid),
            image_size=self.pre.original_size,
            mode=mode.value,
            truncated=parsed.truncated,
            stats=stats,
        )


def load(path_or_hub_id: str | Path, dtype: str | None = None, adapter_path: str | Path | None = None) -> LocateModel:
    """Load a checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout).

    `dtype` ("bfloat16", "float16", "float32") casts the weights; by default they stay as stored.
    `adapter_path`: a LoRA adapter folder (`mlx-locate-finetune`'s, or a PEFT one) applied on top
    (`tuner.lora.apply_adapter`: merged into a float base, kept beside a quantized one); the base's files are
    only read.
    """
    folder = resolve(path_or_hub_id)
    raw = read_json(folder, "config.json")
    config = ModelConfig.from_dict(raw)
    tokenizer = Tokenizer.from_folder(folder)
    network = build_model(folder, config, tokenizer.token_ids(raw), dtype)
    if adapter_path is not None:
        apply_adapter(network, read_adapter(adapter_path))
    limit = IN_TOKEN_LIMIT
    if (folder / "preprocessor_config.json").is_file():
        limit = int(read_json(folder, "preprocessor_config.json").get("in_token_limit", IN_TOKEN_LIMIT))
    return LocateModel(network, tokenizer, in_token_limit=limit)
