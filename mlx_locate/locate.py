"""The public entry point: `load(path_or_hub_id)` -> `LocateModel`, and `LocateModel.locate(image, query)`.

Every request decodes through the batched engine (`engine.py`); a single `locate` is a batch of one. The model
(`runtime.Runtime`) keeps what requests share: compiled step functions, vision features by image content, and
prompt prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from PIL import Image
from tqdm import tqdm

from .checkpoint import read_json, resolve
from .config import ModelConfig
from .engine import Engine, EventKind, Schedule
from .loader import build_model
from .lora import apply_adapter, read_adapter
from .preprocess import IN_TOKEN_LIMIT
from .request import PreparedImage, Request, RequestError, Result
from .runtime import Runtime
from .tokenizer import Tokenizer
from .tune import cached, model_key, tuned
from .tune import enabled as tunes

__all__ = ["LocateModel", "Result", "Session", "load"]

CPU_DTYPE = "float32"  # what `load` computes in on the CPU backend unless told otherwise


class LocateModel(Runtime):
    """A loaded checkpoint (`runtime.Runtime`) with the public API: `locate`, `locate_many`, `session`, `engine`."""

    def engine(self, max_rows: int | None = None, schedule: Schedule | None = None) -> Engine:
        """A batched engine over this model (see `engine.Engine`): submit requests, step, collect events."""
        return Engine(self, max_rows, schedule)

    def locate_many(
        self,
        requests: Iterable[Request],
        *,
        max_rows: int | None = None,
        progress: bool = False,
        desc: str | None = None,
    ) -> list[Result | RequestError]:
        """Run every request through one batched engine; results in request order. A request that cannot run
        gives its `RequestError` in its place and the others go on. `progress` shows a bar on stderr, named
        `desc`."""
        engine = self.engine(max_rows)
        handles = [engine.submit(r) for r in requests]
        with tqdm(total=len(handles), disable=not progress, unit="req", desc=desc) as bar:
            while not engine.idle:
                bar.update(sum(e.kind in (EventKind.DONE, EventKind.ERROR) for e in engine.step()))
        return [h.result if h.result is not None else h.error for h in handles]

    def session(
        self,
        image: str | Path | Image.Image,
        rendering: str = "A",
        max_pixels: int | None = None,
        orientation: str = "exif",
        max_image_tokens: int | None = None,
    ) -> Session:
        """Run the image through vision and the prompt prefix once; then ask many queries."""
        return Session(self, image, rendering, max_pixels, orientation, max_image_tokens)

    def locate(
        self,
        image: str | Path | Image.Image | PreparedImage,
        query: str | list[str] | None = None,
        *,
        categories: list[str] | None = None,
        rendering: str = "A",
        **kwargs,
    ) -> Result | list[Result]:
        """Find `query` in `image`; a list of queries gives a list of results, decoded together as one batch.
        `categories` (instead of `query`): one detect `Result` for all of them, each category decoded in its own
        row of one batch (`joint=True`: in one prompt, as the reference), objects in category order.

        Keyword arguments are the fields of `engine.Request` (task, mode, max_tokens, sampling, strict, joint,
        guards, redecode_labels, prompt, seed, max_pixels, orientation, max_image_tokens, tiles, tile_overlap,
        tile_whole). Raises the request's `RequestError` (a ValueError) when it cannot run.
        """
        if categories is not None:
            if query is not None or kwargs.get("task", "detect") != "detect":
                raise RequestError("categories make one detect request; do not pass a query or another task")
            if isinstance(categories, str) or not categories:
                raise RequestError(f"categories must be a non-empty list of names, got {categories!r}")
            return self.locate(image, [list(categories)], rendering=rendering, **kwargs)[0]
        queries = query if isinstance(query, list) else [query]
        source = (image.rgb if isinstance(image, PreparedImage) else image, kwargs.get("max_pixels"))  # for draw()
        if isinstance(image, (str, Path)):
            image = self.prepare(  # loaded once for every query
                image, kwargs.get("max_pixels"), kwargs.get("orientation", "exif"), kwargs.get("max_image_tokens")
            )
        results = self.locate_many([Request(image, q, rendering=rendering, **kwargs) for q in queries])
        for r in results:
            if isinstance(r, RequestError):
                raise r
            r.source = source
        return results if isinstance(query, list) else results[0]


class Session:
    """One image and many queries: preprocessing, vision and the prompt prefix up to `</img>` run once;
    each query copies the cached prefix into its cache row and prefills only its own text. The first result
    reports that work in its stats (`preprocess_s`, `vision_s`, `vision_cached`, `prefix_prefill_s`); later
    ones reuse it."""

    def __init__(
        self,
        model: LocateModel,
        image: str | Path | Image.Image,
        rendering: str = "A",
        max_pixels: int | None = None,
        orientation: str = "exif",
        max_image_tokens: int | None = None,
    ):
        self.model = model
        self.rendering = rendering
        t0 = time.perf_counter()
        self.image = model.prepare(image, max_pixels, orientation, max_image_tokens)
        self.pre = self.image.pre
        prompt = model.prompt("", self.pre.grid, rendering)
        self.prefix = prompt[: prompt.index(model.token_ids.img_end) + 1]
        self.timings = {"preprocess_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        ((cached, features),) = model.features_for([self.image])
        self.vision_cached = cached
        self.timings["vision_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        key = (self.image.key, tuple(self.prefix))
        if key not in model.prefixes:
            model.store_prefix(key, model.compute_prefixes([(self.prefix, features)])[0])
        self.timings["prefix_prefill_s"] = time.perf_counter() - t0
        self.unreported = True  # the first result carries the work above

    def locate(self, query: str | list[str] | None = None, **kwargs) -> Result:
        """Find `query` in the session's image (a list: several detect categories, one row each); keyword
        arguments as `LocateModel.locate`. Boxes and points come back in the pixels of the image as given."""
        (result,) = self.model.locate_many([Request(self.image, query, rendering=self.rendering, **kwargs)])
        if isinstance(result, RequestError):
            raise result
        if self.unreported:  # the engine found the session's prefix ready; the session did its work
            stats = {k: result.stats.get(k, 0.0) + v for k, v in self.timings.items()}
            stats["vision_cached"] = self.vision_cached and result.stats.get("vision_cached", True)
            result = replace(result, stats={**result.stats, **stats})
            self.unreported = False
        return result


def image_settings(folder: Path) -> tuple[int, int]:
    """(in_token_limit, patch_size) of a checkpoint folder: what preparing an image needs, before the model
    loads (`runtime.Runtime.prepare`)."""
    limit = IN_TOKEN_LIMIT
    if (folder / "preprocessor_config.json").is_file():
        limit = int(read_json(folder, "preprocessor_config.json").get("in_token_limit", IN_TOKEN_LIMIT))
    return limit, ModelConfig.from_dict(read_json(folder, "config.json")).vision.patch_size


def load(
    path_or_hub_id: str | Path,
    dtype: str | None = None,
    adapter_path: str | Path | None = None,
    tune: bool | None = None,
) -> LocateModel:
    """Load a checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout).

    `dtype` ("bfloat16", "float16", "float32") casts the weights. By default they stay as stored, except on
    MLX's CPU backend, where they become float32: there half-precision matmuls and attention run MLX's own
    kernels instead of BLAS, many times slower than float32's, so float32 is the fast path (CPU_DTYPE).
    `adapter_path`: a LoRA adapter folder (`mlx-locate-finetune`'s, or a PEFT one) applied on top
    (`lora.apply_adapter`: merged into a float base, kept beside a quantized one); the base's files are
    only read. `tune`: measure this device's choices once and cache them (`tune.py`; default: unless
    MLX_LOCATE_TUNE=0).

    The tokenizer is built on a thread while the weights load; the tower's weights are read first and the
    decoder's load behind them (`loader.assemble_model`), so a caller's image and vision tower run while they
    do. `LocateModel.load_s` is the load's seconds, the wait of the first forward for the decoder included.
    """
    t0 = time.perf_counter()
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = CPU_DTYPE
    folder = resolve(path_or_hub_id)
    raw = read_json(folder, "config.json")
    config = ModelConfig.from_dict(raw)
    with ThreadPoolExecutor(1, thread_name_prefix="mlx-locate-tokenizer") as pool:
        tokenizer_job = pool.submit(lambda: Tokenizer.from_folder(folder).warm())
        network = build_model(folder, config, None, dtype)
        tokenizer = tokenizer_job.result()
    network.token_ids = tokenizer.token_ids(raw)
    if adapter_path is not None:
        apply_adapter(network, read_adapter(adapter_path))
    limit, _ = image_settings(folder)
    choices = None
    if tuning := tunes(tune):
        choices = cached(model_key(network))
    model = LocateModel(network, tokenizer, in_token_limit=limit, probes=choices.probes if choices else None)
    if tuning:
        tuned(model, choices)
    model.load_s = time.perf_counter() - t0
    return model
