"""The public entry point: `load(path_or_hub_id)` -> `LocateModel`, and `LocateModel.locate(image, query)`.

Every request decodes through the batched engine (`engine.py`); a single `locate` is a batch of one. The model
keeps what requests share: compiled step functions, vision features by image content, and prompt prefixes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image
from tqdm import tqdm

from .cache import SlotCache
from .compiled import CompiledSteps
from .config import ModelConfig
from .engine import (
    Engine,
    EventKind,
    PreparedImage,
    Request,
    RequestError,
    Result,
    Schedule,
    compute_prefixes,
    prepare_image,
)
from .language import fuse_projections, store_input_major
from .loader import build_model, read_json, resolve
from .model import LocateAnything
from .preprocess import IN_TOKEN_LIMIT
from .prompts import prompt_ids
from .tokenizer import Tokenizer
from .tuner.lora import apply_adapter, read_adapter

__all__ = ["LocateModel", "Result", "Session", "load"]

FEATURE_CACHE_SIZE = 8  # images whose vision features stay cached, by content
PREFIX_CACHE_SIZE = 8  # images whose prompt prefix (K|V up to </img>) stays cached
PREFIX_CACHE_BYTES = 2 << 30
CPU_DTYPE = "float32"  # what `load` computes in on the CPU backend unless told otherwise


class LocateModel:
    """A loaded checkpoint: network, tokenizer, compiled step functions, and caches of vision features and
    prompt prefixes by image content.

    Takes over `network` for inference: its decoder's projections are fused (`language.fuse_projections`) and,
    on the CPU backend, its wide ones and the head stored input-major (`language.store_input_major`)."""

    def __init__(self, network: LocateAnything, tokenizer: Tokenizer, in_token_limit: int = IN_TOKEN_LIMIT):
        fuse_projections(network.language_model.model.layers)
        if mx.default_device() == mx.cpu:
            store_input_major(network.language_model.model)
        self.network = network
        self.tokenizer = tokenizer
        self.token_ids = network.token_ids
        self.in_token_limit = in_token_limit
        self.steps = CompiledSteps(network)
        self.features: OrderedDict[tuple, mx.array] = OrderedDict()
        self.prefixes: OrderedDict[tuple, list[mx.array]] = OrderedDict()

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

    def new_cache(self, slots: int = 1) -> SlotCache:
        """An empty KV cache with a row per sequence for `slots` sequences."""
        t = self.network.config.text
        dtype = self.network.language_model.model.norm.weight.dtype
        return SlotCache(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, dtype, slots)

    def features_for(self, images: list[PreparedImage]) -> list[tuple[bool, mx.array]]:
        """Vision tower + connector per image, cached by content: (cached, (h*w/4, D) features) each. Images
        of the same patch grid go through the tower as one batch."""
        out: dict[tuple, mx.array] = {}
        todo: dict[tuple[int, int], list[PreparedImage]] = {}
        for image in images:
            if image.key in self.features:
                self.features.move_to_end(image.key)
            elif image.key not in {i.key for group in todo.values() for i in group}:
                todo.setdefault(image.pre.grid, []).append(image)
        for grid, group in todo.items():
            patches = mx.array(np.stack([image.pre.patches for image in group]))
            features = self.network.image_features(patches, grid)
            mx.eval(features)
            for image, f in zip(group, features, strict=True):
                out[image.key] = self.features[image.key] = f
            while len(self.features) > FEATURE_CACHE_SIZE:
                self.features.popitem(last=False)
        return [(image.key not in out, out.get(image.key, self.features.get(image.key))) for image in images]

    def clear_caches(self) -> None:
        """Forget cached vision features and prompt prefixes (the next request of an image computes them again)."""
        self.features.clear()
        self.prefixes.clear()

    def store_prefix(self, key: tuple, prefix: list[mx.array]) -> None:
        self.prefixes[key] = prefix
        while len(self.prefixes) > 1 and (
            len(self.prefixes) > PREFIX_CACHE_SIZE
            or sum(a.nbytes for p in self.prefixes.values() for a in p) > PREFIX_CACHE_BYTES
        ):
            self.prefixes.popitem(last=False)

    def prefix(self, key: tuple) -> list[mx.array]:
        self.prefixes.move_to_end(key)
        return self.prefixes[key]

    def engine(self, max_rows: int | None = None, schedule: Schedule | None = None) -> Engine:
        """A batched engine over this model (see `engine.Engine`): submit requests, step, collect events."""
        return Engine(self, max_rows, schedule)

    def locate_many(
        self,
        requests: Iterable[Request],
        *,
        batch_size: int | None = None,
        progress: bool = False,
        desc: str | None = None,
    ) -> list[Result | RequestError]:
        """Run every request through one batched engine; results in request order. A request that cannot run
        gives its `RequestError` in its place and the others go on. `progress` shows a bar on stderr, named
        `desc`."""
        engine = self.engine(batch_size)
        handles = [engine.submit(r) for r in requests]
        with tqdm(total=len(handles), disable=not progress, unit="req", desc=desc) as bar:
            while not engine.idle:
                bar.update(sum(e.kind in (EventKind.DONE, EventKind.ERROR) for e in engine.step()))
        return [h.result if h.result is not None else h.error for h in handles]

    def session(self, image: str | Path | Image.Image, rendering: str = "A", max_pixels: int | None = None) -> Session:
        """Run the image through vision and the prompt prefix once; then ask many queries."""
        return Session(self, image, rendering, max_pixels)

    def locate(
        self,
        image: str | Path | Image.Image | PreparedImage,
        query: str | list[str] | None = None,
        *,
        rendering: str = "A",
        **kwargs,
    ) -> Result | list[Result]:
        """Find `query` in `image`; a list of queries gives a list of results, decoded together as one batch.

        Keyword arguments are the fields of `engine.Request` (task, mode, max_tokens, sampling, strict, guards,
        redecode_labels, prompt, seed, max_pixels, tiles, tile_overlap, tile_whole). Raises the request's
        `RequestError` (a ValueError) when it cannot run.
        """
        queries = query if isinstance(query, list) else [query]
        if isinstance(image, (str, Path)):
            image = prepare_image(self, image, kwargs.get("max_pixels"))  # loaded once for every query
        results = self.locate_many([Request(image, q, rendering=rendering, **kwargs) for q in queries])
        for r in results:
            if isinstance(r, RequestError):
                raise r
        return results if isinstance(query, list) else results[0]


class Session:
    """One image and many queries: preprocessing, vision and the prompt prefix up to `</img>` run once;
    each query copies the cached prefix into its cache row and prefills only its own text."""

    def __init__(
        self, model: LocateModel, image: str | Path | Image.Image, rendering: str = "A", max_pixels: int | None = None
    ):
        self.model = model
        self.rendering = rendering
        t0 = time.perf_counter()
        self.image = prepare_image(model, image, max_pixels)
        self.pre = self.image.pre
        prompt = prompt_ids(model.tokenizer, "", [self.pre.grid], rendering=rendering)
        self.prefix = prompt[: prompt.index(model.token_ids.img_end) + 1]
        self.timings = {"preprocess_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        ((cached, features),) = model.features_for([self.image])
        self.vision_cached = cached
        self.timings["vision_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        key = (self.image.key, tuple(self.prefix))
        if key not in model.prefixes:
            model.store_prefix(key, compute_prefixes(model, [(self.prefix, features)])[0])
        self.timings["prefix_prefill_s"] = time.perf_counter() - t0

    def locate(self, query: str | list[str] | None = None, **kwargs) -> Result:
        """Find `query` in the session's image (a list: several categories of one detect prompt); keyword
        arguments as `LocateModel.locate`. Boxes and points come back in the pixels of the image as given."""
        (result,) = self.model.locate_many([Request(self.image, query, rendering=self.rendering, **kwargs)])
        if isinstance(result, RequestError):
            raise result
        return result


def load(path_or_hub_id: str | Path, dtype: str | None = None, adapter_path: str | Path | None = None) -> LocateModel:
    """Load a checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout).

    `dtype` ("bfloat16", "float16", "float32") casts the weights. By default they stay as stored, except on
    MLX's CPU backend, where they become float32: there half-precision matmuls and attention run MLX's own
    kernels instead of BLAS (a 1152 x 3456 projection of 1,656 vision rows: 2.5 s in bf16 against 0.15 s in
    float32), so float32 is the fast path (CPU_DTYPE).
    `adapter_path`: a LoRA adapter folder (`mlx-locate-finetune`'s, or a PEFT one) applied on top
    (`tuner.lora.apply_adapter`: merged into a float base, kept beside a quantized one); the base's files are
    only read.
    """
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = CPU_DTYPE
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
