"""A checkpoint's files: where a checkpoint is (a folder, the bundled demo, a hub id), its JSON files, and its
safetensors weights (checked before they are read; one file or shards with their index); the release's config.

Only safetensors files are read; no code from a checkpoint folder is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from ..network.attention import backend

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}  # float dtypes, by name
HF_WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.md"]

DEMO_NAME = "demo"
CONTENT_SAMPLE = 1 << 16  # bytes read at each end of a file by `content_id`
DEMO_DIR = Path(__file__).parents[1] / "demo"
DEMO_IMAGE = DEMO_DIR / "example.png"  # the demo's example scene, wherever the package is installed
# config.json of NVIDIA's release (as the golden checkpoints have it): random checkpoints take its fields, and a
# checkpoint of its architecture its model card's categories (`cards.is_release`)
RELEASE_CONFIG: dict = json.loads((Path(__file__).parents[1] / "release_config.json").read_text())


def resolve(path_or_id: str | Path) -> Path:
    """A local folder, "demo" (the bundled demo model), or a Hugging Face hub id downloaded (with a progress
    bar) into the hub cache."""
    if str(path_or_id) == DEMO_NAME:
        if not (DEMO_DIR / "config.json").is_file():
            raise FileNotFoundError(f"the bundled demo model is missing from {DEMO_DIR}")
        return DEMO_DIR
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model folder {name!r} does not exist (expected a folder or a hub id 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=HF_WEIGHT_PATTERNS))
    except Exception as e:  # the hub's errors (offline, unknown repo, gated) have no common base class
        words = " ".join(str(e).split())  # on one line: the hub's messages run over several
        raise FileNotFoundError(
            f"model {name!r} is not a local folder and could not be downloaded from the Hugging Face hub "
            f"({type(e).__name__}: {words})"
        ) from e


def read_json(folder: Path, name: str) -> dict:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: missing {name}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def check_safetensors(path: Path) -> dict:
    """Validate the header and the file size so a truncated file fails here, by name; the header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ValueError(
                f"{path}: not a safetensors file, or truncated (header of {header_len} bytes, file {size} bytes)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: not a safetensors file (unreadable header)") from None
    try:
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, IndexError, TypeError):
        raise ValueError(f"{path}: not a safetensors file (its header lists no tensors with data offsets)") from None
    if 8 + header_len + end > size:
        raise ValueError(
            f"{path}: truncated safetensors file (tensors need {8 + header_len + end} bytes, file has {size})"
        )
    return header


def content_id(folder: Path) -> str:
    """What tells a local checkpoint or adapter folder from another whatever its path: a digest of its JSON and
    safetensors files' names, sizes and first and last `CONTENT_SAMPLE` bytes (headers, and weights at both ends),
    so the same model copied to another machine or path is the same, and a retrained one is not."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(CONTENT_SAMPLE))
            f.seek(max(size - CONTENT_SAMPLE, 0))
            digest.update(f.read(CONTENT_SAMPLE))
    return f"local:{digest.hexdigest()[:16]}"


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(folder, index.name).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named by {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    return files


MAX_SHARD_BYTES = 5 * 10**9  # as transformers and mlx-lm shard
INDEX_NAME = "model.safetensors.index.json"


def plan_shards(sizes: list[int]) -> list[list[int]]:
    """Group tensor positions, in order, into shards of at most MAX_SHARD_BYTES (a larger tensor goes alone)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > MAX_SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """The shards' index, as the hub's sharded checkpoints have it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


_streams = threading.local()  # MLX streams belong to the thread that made them (a server's worker)


def loading_streams() -> tuple[mx.Stream, mx.Stream]:
    """The calling thread's streams for loading a checkpoint, made on its first call: (files, device). The files
    are read on a CPU stream (by MLX's own I/O threads, as MLX reads them itself on Metal and the CPU); the
    weights are copied (CUDA), cast and fused on a stream of the default device. Neither is the default stream,
    where requests run: work queued on a stream waits behind what was queued before it, so an image's tower
    would otherwise wait for the whole decoder to load instead of running while it does."""
    device = mx.default_device()
    if not hasattr(_streams, "pairs"):
        _streams.pairs = {}
    if str(device) not in _streams.pairs:
        _streams.pairs[str(device)] = (mx.new_stream(mx.cpu), mx.new_stream(device))
    return _streams.pairs[str(device)]


def read_weights(folder: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors, read on the loading CPU stream (`loading_streams`); on CUDA, where the GPU's
    memory is not the CPU's, each then copied on the loading device stream (read on a GPU stream, a tensor blocks
    the host until it is in; left where it was read, it would migrate page by page at its first use)."""
    files, device = loading_streams()
    weights = {}
    for path in weight_files(folder):
        check_safetensors(path)
        try:
            weights.update(mx.load(str(path), stream=files))
        except RuntimeError as e:  # MLX's reader: unknown dtype, offsets that do not match the shape, ...
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if backend() == "cuda":
        weights = {k: v if v.dtype == mx.bool_ else mx.multiply(v, 1, stream=device) for k, v in weights.items()}
    return weights


def check_dtype(dtype: str | None) -> None:
    """`ValueError` for a dtype name that is not one of DTYPES (None: the weights' own)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def cast(value: mx.array, dtype: str | None, stream: mx.Stream | None = None) -> mx.array:
    """`value` in `dtype` (a DTYPES name) when it is floating point and a dtype is given, else as it is."""
    if dtype is None or not mx.issubdtype(value.dtype, mx.floating):
        return value
    return value.astype(DTYPES[dtype], stream=stream)


_making_streams = threading.Lock()  # reading threads make their streams one at a time (`ReadAhead`)


class ReadAhead:
    """Tensors of a checkpoint read by threads of their own while the caller goes on (`loader.read_checkpoint`
    reads the decoder's so, for a network given up to inference). Each thread reads its share, by bytes, on
    streams it makes, and evaluates it: MLX lets an evaluated array be used on any thread, but not a stream on a
    thread that did not make it. On CUDA a thread reads on a GPU stream, straight into the GPU's memory; elsewhere
    on a CPU stream (MLX reads no file on a Metal stream), cast on the default device's. The caller's own thread
    is never held: MLX holds a thread that queues more than a few reads until they are nearly done."""

    def __init__(self, tensors: list[tuple[int, Path, str]], dtype: str | None, threads: int):
        """`tensors`: (bytes, file, name) each (`tensor_sizes`)."""
        shares: list[list[tuple[Path, str]]] = [[] for _ in range(max(1, min(threads, len(tensors))))]
        sizes = [0] * len(shares)
        for size, path, name in sorted(tensors, key=lambda t: -t[0]):  # the largest first, each to the lightest
            i = sizes.index(min(sizes))
            shares[i].append((path, name))
            sizes[i] += size
        pool = ThreadPoolExecutor(len(shares), thread_name_prefix="mlx-locate-reader")
        made = [threading.Event() for _ in shares]
        self._futures: list[Future] = [
            pool.submit(read_share, share, dtype, event) for share, event in zip(shares, made, strict=True)
        ]
        pool.shutdown(wait=False)
        for event in made:  # no two threads make MLX streams at once: the threads theirs, one by one, then this one
            event.wait()

    def take(self) -> dict[str, mx.array]:
        """Every tensor by its name in the files, once all are in; the caller's from then on (nothing here keeps
        them)."""
        futures, self._futures = self._futures, []
        tensors: dict[str, mx.array] = {}
        for future in futures:
            tensors.update(future.result())
        return tensors


def tensor_sizes(folder: Path) -> list[tuple[int, Path, str]]:
    """(bytes, file, name) of each tensor of the checkpoint's files, from their checked headers."""
    return [
        (entry["data_offsets"][1] - entry["data_offsets"][0], path, name)
        for path in weight_files(folder)
        for name, entry in check_safetensors(path).items()
        if name != "__metadata__"
    ]


def read_share(share: list[tuple[Path, str]], dtype: str | None, made: threading.Event) -> dict[str, mx.array]:
    """A reading thread's tensors (`ReadAhead`), cast and evaluated; `made` is set once its streams are made."""
    with _making_streams:
        try:
            device = mx.new_stream(mx.default_device())
            files = device if backend() == "cuda" else mx.new_stream(mx.cpu)
        finally:
            made.set()
    by_file: dict[Path, list[str]] = {}
    for path, name in share:
        by_file.setdefault(path, []).append(name)
    tensors = {}
    for path, names in by_file.items():
        try:
            arrays = mx.load(str(path), stream=files)
            part = {name: cast(arrays[name], dtype, device) for name in names}
            mx.eval(list(part.values()))
        except RuntimeError as e:  # MLX's reader: unknown dtype, offsets that do not match the shape, ...
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        tensors.update(part)
    return tensors
