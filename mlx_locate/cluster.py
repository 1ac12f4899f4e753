"""`mlx-locate-batch ... --ray [ADDRESS]`: the images of a run spread over a Ray cluster with Ray Data.

The pending image paths become a Ray Dataset; `map_batches` runs `LocatePredictor` (Ray Data's callable-class
predictor: the model loads once in `__init__`, `__call__` annotates a batch of paths with the batched engine)
in a fixed pool of actors: one per `mlx` resource (Macs started with `ray start --resources '{"mlx": 1}'`),
else one per GPU, else `--actors` (default: one per node) CPU actors. Lines stream back to the driver, which
writes the JSONL, COCO and drawings as a local run does. A worker that dies is restarted and its unfinished
batches are redone (`RETRIES` times each); the driver drops a line it already has, so nothing is lost or
written twice. Every node reads the images by the same paths (a shared folder) and has mlx-locate installed.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from .annotate import Annotated, Settings, annotate
from .locate import load

RETRIES = 3  # restarts of a dead actor, and reruns of a batch whose actor died; a crash that repeats stops the run
EXTRA = 'pip install "mlx-locate[cluster]"'


def require_ray():
    """The `ray` module with Ray Data, or `ImportError` naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--ray needs Ray Data ({e}); install it with {EXTRA}") from None
    return ray


class LocatePredictor:
    """One model copy on a Ray worker. MLX work runs on one thread of its own: Ray calls `__init__` and
    `__call__` on different threads, and MLX streams belong to the thread that made them."""

    def __init__(self, model: dict, settings: Settings):
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.model = self.thread.submit(load, **model).result()
        self.settings = settings
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict) -> dict[str, list]:
        paths = [str(p) for p in batch["image"]]
        lines = self.thread.submit(lambda: [a.line for a in annotate(self.model, paths, self.settings)]).result()
        return {
            "image": [line["image"] for line in lines],
            "line": [json.dumps(line) for line in lines],
            "worker": [self.worker] * len(lines),
        }


def actor_resources(ray, actors: int | None) -> tuple[int, dict]:
    """(pool size, map_batches resource arguments) for the cluster `ray` is connected to."""
    total = ray.cluster_resources()
    if total.get("mlx", 0) >= 1:
        return actors or int(total["mlx"]), {"num_cpus": 1, "resources": {"mlx": 1}}
    if total.get("GPU", 0) >= 1:
        return actors or int(total["GPU"]), {"num_cpus": 1, "num_gpus": 1}
    return actors or max(1, sum(node["Alive"] for node in ray.nodes())), {"num_cpus": 1}


def actor_options() -> dict:
    """Ray's actor options for every model copy: spread over the nodes, restarted and its tasks redone when it
    dies, a bounded number of times: Ray Data's default is forever, so a crash that repeats would hang the run.
    Ray 2.60 warns that these pass-through options go in 2.64 and names no replacement (hence `<2.64`)."""
    return {"scheduling_strategy": "SPREAD", "max_restarts": RETRIES, "max_task_retries": RETRIES}


def ray_lines(
    address: str | None,
    paths: list[str],
    model: dict,
    settings: Settings,
    actors: int | None = None,
    images_per_task: int = 16,
) -> Iterator[Annotated]:
    """The lines of `paths`, annotated on the Ray cluster at `address` (None: the one found on this machine,
    else a new local one), as they come back; each worker loads `load(**model)`. A connection this call made
    is closed at the end."""
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the driver shows its own bar
        size, resources = actor_resources(ray, actors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # actor_options(): said once, in the docs
            blocks = -(-len(paths) // images_per_task)  # one block per task, so lines come back task by task
            items = ray.data.from_items([{"image": p} for p in paths], override_num_blocks=blocks)
            dataset = items.map_batches(
                LocatePredictor,
                fn_constructor_kwargs={"model": model, "settings": settings},
                batch_size=images_per_task,
                compute=ray.data.ActorPoolStrategy(size=size),
                **resources,
                **actor_options(),
            )
        for row in dataset.iter_rows():
            yield Annotated(json.loads(row["line"]), None, row["worker"])
    finally:
        if started:
            ray.shutdown()
