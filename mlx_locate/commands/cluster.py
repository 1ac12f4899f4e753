"""`mlx-locate-batch ... --ray [ADDRESS]`: the images of a run spread over a Ray cluster with Ray Data.

The pending image paths become a Ray Dataset; `map_batches` runs `LocatePredictor` (Ray Data's callable-class
predictor: the model loads once in `__init__`, `__call__` annotates a batch of paths with the batched engine)
in a fixed pool of actors: one per `mlx` resource (Macs started with `ray start --resources '{"mlx": 1}'`),
else one per GPU, else `--actors` (default: one per node) CPU actors. Lines stream back to the driver, which
writes the JSONL, COCO and drawings as a local run does. A worker that dies is restarted and its unfinished
batches are redone (`RETRIES` times each); the driver drops a line it already has, so nothing is lost or
written twice. Every node reads the images by the same paths (a shared folder) and has mlx-locate installed.
A local cluster this call starts gets an owner-only token file (`private_token`); Ray's one error line that
does not apply here is dropped from stderr (`known_lines_dropped`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ..locate import load
from .folders import Annotated, AnnotateSettings, annotate

RETRIES = 3  # restarts of a dead actor, and reruns of a batch whose actor died; a crash that repeats stops the run
EXTRA = 'pip install "mlx-locate[cluster]"'
# Error lines Ray's C++ core worker writes to the driver's stderr that are no error here (see `known_lines_dropped`).
KNOWN_LINES = (
    re.compile(rb"core_worker\.cc:\d+: Actor .* has constructor arguments in the object store and max_restarts > 0"),
)


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

    def __init__(self, model: dict, settings: AnnotateSettings):
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


def private_token(address: str | None) -> None:
    """Write Ray's token file owner-only (0600, in a 0700 ~/.ray) when `ray.init(address)` is about to start a
    new cluster and would write it itself: Ray 2.60 makes it with the process umask, readable by every user.
    A token the user set up (the file, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) or RAY_AUTH_MODE=disabled is left
    as it is."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(
        os.environ
    ):
        return
    from ray._private.services import canonicalize_bootstrap_address  # ray.init's own test: a new cluster?

    path = Path.home() / ".ray" / "auth_token"
    if path.exists() or canonicalize_bootstrap_address(address, None) is not None:
        return
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one


@contextmanager
def known_lines_dropped() -> Iterator[None]:
    """This process's stderr (file descriptor 2, where Ray's C++ logs go) without the lines of `KNOWN_LINES`;
    every other byte passes through. The one line there: Ray Data hands each actor its context and function by
    object reference, and with `max_restarts` > 0 Ray warns, at error level, that a restart fails once those
    objects are gone (ray-project/ray#53727). The driver holds them until the dataset is done, so restarts work
    (tests/test_cluster.py kills a worker)."""
    saved, (read_end, write_end) = os.dup(2), os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            *lines, pending = re.split(rb"(?<=[\n\r])", pending + chunk)
            for line in lines:
                if not any(known.search(line) for known in KNOWN_LINES):
                    os.write(saved, line)
        if pending:
            os.write(saved, pending)

    thread = threading.Thread(target=forward, name="stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: `forward` reads to its end and stops
        thread.join(timeout=10)
        if not thread.is_alive():  # else a child process holds the pipe: `forward` keeps serving it
            os.close(read_end)
            os.close(saved)


def ray_lines(
    address: str | None,
    paths: list[str],
    model: dict,
    settings: AnnotateSettings,
    actors: int | None = None,
    images_per_task: int = 16,
) -> Iterator[Annotated]:
    """The lines of `paths`, annotated on the Ray cluster at `address` (None: the one found on this machine,
    else a new local one), as they come back; each worker loads `load(**model)`. A connection this call made
    is closed at the end."""
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        private_token(address)
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
        with known_lines_dropped():
            for row in dataset.iter_rows():
                yield Annotated(json.loads(row["line"]), None, row["worker"])
    finally:
        if started:
            ray.shutdown()
