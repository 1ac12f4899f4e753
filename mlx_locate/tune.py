"""Choices measured on this device once, and cached (`tuned`).

What the runtime would otherwise assume is measured when a model first loads on a device: the budget's probes
(`memory.measure_probes`), the AR and block steps' attention path (`language.AttentionPath`), the row buckets
(`Runtime.measure_rows`), the tower's attention (fused where a kernel takes it, or the fallback's chunks), the
prefill chunk (on a GPU; the CPU caps its prefill calls) and how many eager calls a step function makes before it
is compiled (`compiled.CompiledSteps.compile_after`: where compiling costs more than the steps it speeds up).

The choices are kept in a JSON file per model shape and dtype under the user's cache folder (MLX_LOCATE_CACHE_DIR,
else $XDG_CACHE_HOME/mlx-locate, else ~/.cache/mlx-locate), with the device, the MLX version and the format they
were measured under; a later process reads them instead of measuring. A file that cannot be read, or was measured
elsewhere (another device, MLX version or format) or holds a bad value, is ignored with a warning, measured again
and replaced. MLX_LOCATE_TUNE=0 (the commands' `--no-tune`, `load(tune=False)`) turns measuring and the cache off.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from .compiled import BLOCK_FORWARD_ROWS, PREFILL_BUCKET, PREFILL_ROWS, Phase
from .masks import BLOCK
from .memory import PROBE_PATCHES
from .network.attention import Path as TowerPath
from .network.attention import attention_path, backend
from .network.language import AttentionPath
from .network.model import LocateAnything
from .runtime import Runtime

TUNE_ENV = "MLX_LOCATE_TUNE"  # "0": measure nothing, read and write no cache
CACHE_ENV = "MLX_LOCATE_CACHE_DIR"
FORMAT = 3  # the cache file's layout and how its choices were made; a file of another format is measured again
PROBE_CONTEXT = 256  # cached tokens per row in the step probes
REPEATS = 3  # timed runs per probe (the fastest counts), after one untimed
PREFILL_CHUNKS = (512, 1024, PREFILL_ROWS)  # prefill chunk candidates, on a GPU
NEVER = 1 << 30  # compile_after where a compiled step is no faster than an eager one
PROGRESS_AFTER_S = 1.0  # measuring shows a progress bar (stderr) once it has taken this long
PARTS = ("step attention", "row buckets", "compiling", "tower attention", "prefill chunk")  # what `measure` times

measurements = 0  # choices this process measured (a process that reads the cache measures none)


@dataclass(frozen=True)
class Choices:
    probes: dict[str, int]  # `memory.measure_probes`
    step_attention: str  # `language.AttentionPath` value of the AR and block steps
    row_costs: dict[int, float]  # seconds of a block step by rows (`Runtime.measure_rows`)
    tower_chunked: bool  # the tower's attention in the fallback's chunks even where a fused kernel runs
    prefill_chunk: int  # one sequence's rows per prefill call at most
    compile_after: int  # eager calls of a step function before it is compiled
    measured_s: dict[str, float] = field(default_factory=dict)  # seconds each of PARTS took to measure (a record)

    @classmethod
    def from_dict(cls, d: dict) -> Choices:
        """Checked: every field present with a value of its kind, else ValueError naming it."""
        probes = d["probes"]
        if not isinstance(probes, dict) or sorted(probes) != ["patch_bytes", "prefill_key_bytes", "prefill_row_bytes"]:
            raise ValueError("probes")
        if not all(isinstance(v, int) and v >= 0 for v in probes.values()):
            raise ValueError("probes")
        rows = {int(r): float(s) for r, s in d["row_costs"].items()}
        if not rows or not all(r >= 1 and s > 0 and math.isfinite(s) for r, s in rows.items()):
            raise ValueError("row_costs")
        chunk, after = d["prefill_chunk"], d["compile_after"]
        if not isinstance(chunk, int) or not 1 <= chunk <= PREFILL_ROWS or not isinstance(after, int) or after < 0:
            raise ValueError("prefill_chunk or compile_after")
        if not isinstance(d["tower_chunked"], bool):
            raise ValueError("tower_chunked")
        seconds = d.get("measured_s", {})
        if not isinstance(seconds, dict) or not all(
            isinstance(v, (int, float)) and v >= 0 and math.isfinite(v) for v in seconds.values()
        ):
            raise ValueError("measured_s")
        step_attention = AttentionPath(d["step_attention"]).value
        return cls(
            probes,
            step_attention,
            rows,
            d["tower_chunked"],
            chunk,
            after,
            {str(k): float(v) for k, v in seconds.items()},
        )


def enabled(tune: bool | None = None) -> bool:
    """`tune` if given, else whether MLX_LOCATE_TUNE is not "0"."""
    return tune if tune is not None else os.environ.get(TUNE_ENV, "1") != "0"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-locate"


def device_key() -> dict:
    """What the choices were measured on: backend, device, its memory, MLX version, cache format."""
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or "unknown"
    return {
        "backend": backend(),
        "device": name,
        "memory": info.get("memory_size"),
        "mlx": mx.__version__,
        "format": FORMAT,
    }


def model_key(network: LocateAnything) -> dict:
    """The model's shapes, dtype and quantization: what names its cache file (JSON values)."""
    config = network.config
    dtype = network.language_model.model.norm.weight.dtype
    key = {
        "vision": asdict(config.vision),
        "text": asdict(config.text),
        "dtype": str(dtype),
        "quantization": config.raw.get("quantization"),
    }
    return json.loads(json.dumps(key, default=str))


def cache_file(model: dict) -> Path:
    digest = hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / f"tune-{digest}.json"


def read(path: Path, device: dict, model: dict) -> Choices | None:
    """The choices in `path` if it holds this device's and model's; None, with a warning for a bad file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        theirs = data.get("device") if isinstance(data.get("device"), dict) else {}
        if theirs != device:
            differ = [f"{k} {theirs.get(k)!r} (here {v!r})" for k, v in device.items() if theirs.get(k) != v]
            why = "it was measured under " + (", ".join(differ) if differ else repr(data.get("device")))
        elif data.get("model") != model:
            why = "it holds another model's choices"
        else:
            return Choices.from_dict(data["choices"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"it is not a readable tuning cache ({type(e).__name__}: {e})"
    warnings.warn(f"ignoring {path}: {why}; measuring this device again", stacklevel=2)
    return None


def write(path: Path, device: dict, model: dict, choices: Choices) -> None:
    """Write the cache file (atomically); a folder that cannot be written gives a warning, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"device": device, "model": model, "choices": asdict(choices)}, default=str))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not keep the tuning cache in {path.parent} ({e}); set {CACHE_ENV}", stacklevel=2)


def apply(runtime: Runtime, choices: Choices) -> None:
    """Make `runtime` run as `choices` say (the budget's probes are taken when the runtime is built)."""
    runtime.steps.attention = AttentionPath(choices.step_attention)
    runtime.steps.compile_after = choices.compile_after
    runtime.row_costs.update(choices.row_costs)
    runtime.network.vision_model.chunked_attention = choices.tower_chunked
    runtime.prefill_chunk = choices.prefill_chunk
    runtime.tuning_s = dict(choices.measured_s)


def cached(model: dict) -> Choices | None:
    """The choices cached for this device and `model` (`model_key`), if any (warning about a bad file)."""
    return read(cache_file(model), device_key(), model)


def tuned(runtime: Runtime, choices: Choices | None = None) -> Choices:
    """`choices` (read from the cache), else measured now and cached; applied to `runtime`."""
    if choices is None:
        choices = measure(runtime)
        model = model_key(runtime.network)
        write(cache_file(model), device_key(), model, choices)
    apply(runtime, choices)
    return choices


# --- measurements ---


def first_and_best(run, repeats: int = REPEATS) -> tuple[float, float]:
    """Seconds of the first run of `run()` (evaluated) and of the fastest of `repeats` timed runs after it."""
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - t0)
    return times[0], min(times[1:])


def best_of(run, repeats: int = REPEATS) -> float:
    """Seconds of the fastest of `repeats` timed runs of `run()` (evaluated), after one untimed."""
    return first_and_best(run, repeats)[1]


def step_probe(runtime: Runtime, phase: Phase, q: int, context: int = PROBE_CONTEXT):
    """A function running one sequence's `phase` step of `q` rows at `context` cached tokens."""
    cache = runtime.new_cache(1)
    inputs = mx.zeros((1, BLOCK_FORWARD_ROWS if phase is Phase.BLOCK else (1 if q == 1 else BLOCK)), mx.int32)

    def run():
        return runtime.run(phase, cache, inputs, [0], [context], [q], [phase is Phase.BLOCK], True), cache.kv

    return run


def measure(runtime: Runtime) -> Choices:
    """Every choice, measured on this device now; each of PARTS timed (`Choices.measured_s`), with a progress bar
    on stderr once measuring has taken PROGRESS_AFTER_S."""
    global measurements
    steps = runtime.steps
    seconds: dict[str, float] = {}
    last = time.perf_counter()
    with tqdm(total=len(PARTS), desc="measuring this device once", unit="part", delay=PROGRESS_AFTER_S) as bar:

        def done(part: str) -> None:
            nonlocal last
            now = time.perf_counter()
            seconds[part], last = now - last, now
            bar.update()

        saved = steps.compile_after
        steps.compile_after = 0
        # the AR and block steps' attention: a block step and a 6-row AR step on each path
        times = {}
        for path in AttentionPath:
            steps.attention = path
            steps.functions.clear()
            times[path] = best_of(step_probe(runtime, Phase.BLOCK, BLOCK_FORWARD_ROWS)) + best_of(
                step_probe(runtime, Phase.AR, BLOCK)
            )
        step_attention = min(times, key=times.get)
        steps.attention = step_attention
        steps.functions.clear()
        measurements += 1
        done("step attention")
        # row buckets
        row_costs = runtime.measure_rows(runtime.default_rows, context=PROBE_CONTEXT)
        measurements += 1
        done("row buckets")
        # compiling against running eagerly: a block step's compilation (a shape not compiled yet) against what the
        # compiled step saves per call
        first, compiled_s = first_and_best(
            step_probe(runtime, Phase.BLOCK, BLOCK_FORWARD_ROWS, context=2 * PROBE_CONTEXT)
        )
        steps.compile = False
        steps.functions.clear()
        eager_s = best_of(step_probe(runtime, Phase.BLOCK, BLOCK_FORWARD_ROWS, context=2 * PROBE_CONTEXT))
        steps.compile = True
        steps.functions.clear()
        saved_per_call = eager_s - compiled_s
        compile_after = NEVER if saved_per_call <= 0 else math.ceil(max(0.0, first - compiled_s) / saved_per_call)
        measurements += 1
        steps.compile_after = saved
        done("compiling")
        tower_chunked = measure_tower_chunked(runtime)
        done("tower attention")
        prefill_chunk = measure_prefill_chunk(runtime)
        done("prefill chunk")
    runtime.idle()
    measurements += 1  # the budget's probes, measured when the runtime was built
    return Choices(
        probes_of(runtime), step_attention.value, row_costs, tower_chunked, prefill_chunk, compile_after, seconds
    )


def measure_tower_chunked(runtime: Runtime) -> bool:
    """Whether the tower's attention should run in the fallback's chunks even where a fused (or padded) kernel takes
    it: only where the chunks win at a small image's patches and then at the largest image's. The fused kernel's
    lead grows with the patches (benchmarks/README.md, "Cold start"), so the largest image's block, the costliest
    probe on a slow device, runs only where the chunks won the small one."""
    global measurements
    tower = runtime.network.vision_model
    v = runtime.network.config.vision
    dtype = tower.patch_embed.proj.weight.dtype
    if attention_path(backend(), dtype, v.head_dim, PROBE_PATCHES)[0] is TowerPath.CHUNKED:
        return False
    measurements += 1
    score_budget = runtime.budget.score_budget
    try:
        for patches in (4 * PROBE_PATCHES, runtime.in_token_limit):
            side = int(patches**0.5)
            x = mx.zeros((1, side * side, v.hidden_size), dtype)
            block_times = {}
            for chunked in (False, True):
                tower.chunked_attention = chunked
                block_times[chunked] = best_of(lambda x=x, s=side: tower.run_blocks(x, (s, s), 0, 1, score_budget))
            if block_times[True] >= block_times[False]:
                return False
        return True
    finally:
        tower.chunked_attention = False


def measure_prefill_chunk(runtime: Runtime) -> int:
    """One sequence's rows per prefill call: on a GPU (the CPU caps its prefill calls), a long prompt in chunks of
    each candidate size, each size costed as a cold process meets it plus a warm one. Each call of a chunked
    prompt attends to more keys, so a prompt makes as many shapes as calls, and a shape's first call pays for
    itself (compiling; on CUDA, building cuDNN's attention plans). Kernels every prefill takes are loaded
    first, by a call of a shape no candidate makes, so that no candidate pays for them."""
    global measurements
    rows = min(PREFILL_ROWS, runtime.max_length - BLOCK_FORWARD_ROWS)
    if runtime.budget.prefill_cap is not None or rows < PREFILL_CHUNKS[0]:
        return PREFILL_ROWS
    t = runtime.network.config.text
    x = mx.zeros((rows, t.hidden_size), runtime.network.language_model.model.norm.weight.dtype)
    mx.eval(list(runtime.prefill(runtime.new_cache(1), [(0, x[:PREFILL_BUCKET], 0)]).values()))
    costs = {}
    for chunk in (c for c in PREFILL_CHUNKS if c <= rows):
        runtime.prefill_chunk = chunk
        cache = runtime.new_cache(1)
        first, best = first_and_best(lambda c=cache: list(runtime.prefill(c, [(0, x, 0)]).values()), repeats=1)
        costs[chunk] = first + best
    runtime.prefill_chunk = None
    measurements += 1
    return min(costs, key=costs.get)


def probes_of(runtime: Runtime) -> dict[str, int]:
    """The budget's probes as `memory.measure_probes` gave them."""
    b = runtime.budget
    return {
        "patch_bytes": b.patch_bytes,
        "prefill_row_bytes": b.prefill_row_bytes,
        "prefill_key_bytes": b.prefill_key_bytes,
    }
