"""The public entry point: `load(path_or_hub_id)` -> `LocateModel`, and `LocateModel.locate(image, query)`.

Every request decodes through the batched engine (`engine.py`); a single `locate` is a batch of one. The model holds
a runtime (`runtime.Runtime`, the engine's side), which keeps what requests share: compiled step functions, vision
features by image content, and prompt prefixes.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from PIL import Image
from tqdm import tqdm

from .engine import Engine, EventKind, Schedule
from .request import PreparedImage, Request, RequestError, Result
from .runtime import Runtime
from .tune import cached, model_key, tuned
from .tune import enabled as tunes
from .weights.loader import Checkpoint, read_checkpoint

# Threads that read the decoder's weights from the start on a GPU (`loader.read_checkpoint`'s read_ahead), so
# that a cold one-shot's decoder is in by the time the first image's tower is done; READ_AHEAD_ENV sets another
# number (0: none), as `mlx-locate-bench` does to measure the cold one-shot without them.
READ_AHEAD_THREADS = 8
READ_AHEAD_ENV = "MLX_LOCATE_READ_AHEAD"


def read_ahead_threads() -> int:
    """READ_AHEAD_ENV's number where it is a whole number from 0 to 64 (else a warning), READ_AHEAD_THREADS on a
    GPU, 0 elsewhere."""
    value = os.environ.get(READ_AHEAD_ENV, "").strip()
    if value:
        if value.isdigit() and int(value) <= 64:
            return int(value)
        warnings.warn(f"{READ_AHEAD_ENV}={value!r} is not a whole number from 0 to 64; ignored", stacklevel=2)
    return READ_AHEAD_THREADS if mx.default_device() == mx.gpu else 0


__all__ = ["LocateModel", "Result", "Session", "load"]


class LocateModel:
    """A loaded checkpoint with the public API: `locate`, `locate_many`, `session`, `engine`.

    `runtime` is the engine's side (`runtime.Runtime`: the network it runs, its caches, budget and timings), for
    the engine, the benchmarks and the tests. `probes` (the budget's measurements, `tune.py`) and `take_over` (the
    caller gives the checkpoint's network up, as `load` does) go to the runtime."""

    def __init__(self, checkpoint: Checkpoint, probes: dict[str, int] | None = None, take_over: bool = False):
        self.runtime = Runtime(checkpoint, probes, take_over)

    def engine(self, max_rows: int | None = None, schedule: Schedule | None = None) -> Engine:
        """A batched engine over this model (see `engine.Engine`): submit requests, step, collect events."""
        return Engine(self.runtime, max_rows, schedule)

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
            if isinstance(categories, str):
                raise RequestError(f"categories must be a non-empty list of names, got {categories!r}")
            return self.locate(image, [list(categories)], rendering=rendering, **kwargs)[0]
        queries = query if isinstance(query, list) else [query]
        path = image if isinstance(image, str | Path) else None
        if not isinstance(image, Image.Image | PreparedImage):  # a path or a file: read once for every query
            image = self.runtime.prepare(
                image, kwargs.get("max_pixels"), kwargs.get("orientation", "exif"), kwargs.get("max_image_tokens")
            )
        # for draw(): a path is read again, anything else kept as the pixels it gave
        source = (path or (image.rgb if isinstance(image, PreparedImage) else image), kwargs.get("max_pixels"))
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
        self.image_options = {
            "max_pixels": max_pixels,
            "orientation": orientation,
            "max_image_tokens": max_image_tokens,
        }
        runtime = model.runtime
        t0 = time.perf_counter()
        self.image = runtime.prepare(image, **self.image_options)
        self.pre = self.image.pre
        prompt = runtime.prompt("", self.pre.grid, rendering)
        self.prefix = prompt[: prompt.index(runtime.token_ids.img_end) + 1]
        self.timings = {"preprocess_s": time.perf_counter() - t0}
        t0 = runtime.weights.clock()  # the first image's vision and prefix may wait for the weights (`load_s`)
        ((cached, features),) = runtime.features_for([self.image])
        self.vision_cached = cached
        self.timings["vision_s"] = runtime.weights.clock() - t0
        t0 = runtime.weights.clock()
        key = (self.image.key, tuple(self.prefix))
        if key not in runtime.prefixes:
            runtime.store_prefix(key, runtime.compute_prefixes([(self.prefix, features)])[0])
        self.timings["prefix_prefill_s"] = runtime.weights.clock() - t0
        self.unreported = True  # the first result carries the work above

    def locate(self, query: str | list[str] | None = None, **kwargs) -> Result:
        """Find `query` in the session's image (a list: several detect categories, one row each); keyword
        arguments as `LocateModel.locate`, less the image's own (`model.session`'s, refused here: the image is
        loaded). Boxes and points come back in the pixels of the image as given."""
        if given := [k for k in self.image_options if k in kwargs]:
            raise RequestError(f"{', '.join(given)}: the session's image is loaded; pass them to model.session()")
        request = Request(self.image, query, rendering=self.rendering, **self.image_options, **kwargs)
        (result,) = self.model.locate_many([request])
        if isinstance(result, RequestError):
            raise result
        if self.unreported:  # the engine found the session's prefix ready; the session did its work
            stats = {k: result.stats.get(k, 0.0) + v for k, v in self.timings.items()}
            stats["vision_cached"] = self.vision_cached and result.stats.get("vision_cached", True)
            result = replace(result, stats={**result.stats, **stats})
            self.unreported = False
        return result


def load(
    path_or_hub_id: str | Path,
    dtype: str | None = None,
    adapter_path: str | Path | None = None,
    tune: bool | None = None,
) -> LocateModel:
    """Load a checkpoint folder or hub id (original Hugging Face, mlx-vlm or converted layout) as
    `loader.read_checkpoint` reads it, for inference.

    `dtype` ("bfloat16", "float16", "float32") casts the weights; by default they stay as stored, float32 on MLX's
    CPU backend (`loader.CPU_DTYPE`). `adapter_path`: a LoRA adapter folder (`mlx-locate-finetune`'s, or a PEFT one)
    applied on top (`lora.apply_adapter`: merged into a float base, kept beside a quantized one); the base's files
    are only read. `tune`: measure this device's choices once and cache them (`tune.py`; default: unless
    MLX_LOCATE_TUNE=0).

    The tokenizer is built on a thread while the tower's weights load. On a GPU the decoder's are read from the
    start by threads of their own (`checkpoint.ReadAhead`, `read_ahead_threads`); elsewhere, or with an adapter,
    behind the first image's tower, which runs while they load (`runtime.DecoderLoad`). `load_s` in a result's
    stats is the load's seconds, the host's waits for the decoder's weights included.
    """
    t0 = time.perf_counter()
    checkpoint = read_checkpoint(path_or_hub_id, dtype, adapter_path, read_ahead=read_ahead_threads())
    choices = None
    if tuning := tunes(tune):
        choices = cached(model_key(checkpoint.network))
    model = LocateModel(checkpoint, choices.probes if choices else None, take_over=True)
    if tuning:
        tuned(model.runtime, choices)
    model.runtime.weights.seconds = time.perf_counter() - t0
    return model
