"""Choices measured on the device once and cached (`mlx_locate/tune.py`): a second process measures nothing, a
bad or stale cache file is ignored with a warning, and every path the tuner can choose keeps golden and batch
parity."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import golden_cases
from test_engine import MODES, check_golden, golden_request

import mlx_locate
from mlx_locate import tune
from mlx_locate.compiled import PREFILL_ROWS, Phase
from mlx_locate.memory import PROBE_PATCHES
from mlx_locate.network.attention import Path as TowerPath
from mlx_locate.network.language import AttentionPath

ROOT = Path(__file__).resolve().parents[1]
COUNT = "import mlx_locate, mlx_locate.tune as t; mlx_locate.load('demo'); print(t.measurements)"


def measurements_in_a_new_process(cache: Path, *extra: str) -> int:
    env = {**os.environ, "MLX_LOCATE_TUNE": "1", tune.CACHE_ENV: str(cache), "PYTHONPATH": str(ROOT)}
    for flag in extra:
        env.pop(flag, None)
    out = subprocess.run([sys.executable, "-c", COUNT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_second_process_reads_the_cache_and_measures_nothing(tmp_path):
    assert measurements_in_a_new_process(tmp_path) >= 4  # probes, step attention, rows, compile_after (CPU)
    (file,) = tmp_path.glob("tune-*.json")
    choices = tune.Choices.from_dict(json.loads(file.read_text())["choices"])
    assert choices.row_costs and choices.step_attention in {p.value for p in AttentionPath}
    assert measurements_in_a_new_process(tmp_path) == 0
    assert measurements_in_a_new_process(tmp_path / "another") > 0  # the folder is the variable's


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_no_tune_measures_nothing_and_writes_nothing(cache):
    before = tune.measurements
    runtime = mlx_locate.load("demo", tune=False).runtime
    assert tune.measurements == before and not list(cache.iterdir())
    assert runtime.steps.compile_after == 0 and runtime.steps.attention is AttentionPath.SDPA


def corrupt(file: Path) -> None:
    file.write_text(file.read_text()[:40])


def stale(file: Path) -> None:
    data = json.loads(file.read_text())
    data["device"]["mlx"] = "0.0.1"
    file.write_text(json.dumps(data))


def older_format(file: Path) -> None:
    data = json.loads(file.read_text())
    data["device"]["format"] = tune.FORMAT - 1
    file.write_text(json.dumps(data))


def bad_value(file: Path) -> None:
    data = json.loads(file.read_text())
    data["choices"]["step_attention"] = "magic"
    file.write_text(json.dumps(data))


def bad_record(file: Path) -> None:
    data = json.loads(file.read_text())
    data["choices"]["measured_s"]["row buckets"] = -1.0
    file.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "spoil, why",
    [
        (corrupt, "not a readable"),
        (stale, r"measured under mlx '0.0.1' \(here '"),
        (older_format, rf"measured under format {tune.FORMAT - 1} \(here {tune.FORMAT}\)"),
        (bad_value, "magic"),
        (bad_record, "measured_s"),
    ],
)
def test_a_bad_or_stale_cache_file_is_ignored_with_a_warning_and_replaced(cache, spoil, why):
    mlx_locate.load("demo", tune=True)
    (file,) = cache.glob("tune-*.json")
    good = json.loads(file.read_text())
    spoil(file)
    before = tune.measurements
    with pytest.warns(UserWarning, match=f"ignoring {file}.*{why}"):
        model = mlx_locate.load("demo", tune=True)
    assert tune.measurements > before  # measured again, not trusted
    assert json.loads(file.read_text())["device"] == good["device"]  # and replaced
    assert model.locate(ROOT / "tests/data/golden/images/shapes_640x480.png", "square").objects is not None


def test_measuring_shows_its_progress_and_keeps_what_each_part_took(cache, monkeypatch, capsys):
    """A slow device's first load measures for a while: a progress bar says so (once measuring has taken
    PROGRESS_AFTER_S), and the seconds of each part are kept with the choices, for `mlx-locate-bench` to report."""
    monkeypatch.setattr(tune, "PROGRESS_AFTER_S", 0.0)
    measured = mlx_locate.load("demo", tune=True).runtime.tuning_s
    assert "measuring this device once" in capsys.readouterr().err
    assert list(measured) == list(tune.PARTS) and all(v >= 0 for v in measured.values())
    assert sum(measured.values()) > 0
    (file,) = cache.glob("tune-*.json")
    assert json.loads(file.read_text())["choices"]["measured_s"] == measured
    assert mlx_locate.load("demo", tune=True).runtime.tuning_s == measured  # read back, not measured again
    assert "measuring" not in capsys.readouterr().err
    data = json.loads(file.read_text())
    del data["choices"]["measured_s"]  # a file from before the record: its choices still hold
    file.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mlx_locate.load("demo", tune=True).runtime.tuning_s == {}
    assert mlx_locate.load("demo", tune=False).runtime.tuning_s == {}


@pytest.mark.parametrize(
    "timings, probes, chosen",
    [
        ({(False, "small"): 1.0, (True, "small"): 2.0}, 2, False),  # fused wins the small: the largest is not run
        ({(False, "small"): 2.0, (True, "small"): 1.0, (False, "largest"): 1.0, (True, "largest"): 3.0}, 4, False),
        ({(False, "small"): 2.0, (True, "small"): 1.0, (False, "largest"): 3.0, (True, "largest"): 1.0}, 4, True),
    ],
)
def test_the_tower_takes_chunks_only_where_they_win_at_both_sizes(monkeypatch, timings, probes, chosen):
    """Where a fused kernel takes the tower's attention, the fallback's chunks are chosen only where they beat it at
    a small image and then at the largest; the largest image's block (the costliest probe) is run only where the
    chunks won the small one."""
    runtime = mlx_locate.load("demo", tune=False).runtime
    tower = runtime.network.vision_model
    monkeypatch.setattr(tune, "attention_path", lambda where, dtype, head_dim, queries: (TowerPath.FUSED, head_dim))
    runs = []

    sizes = {4 * PROBE_PATCHES: "small", int(runtime.in_token_limit**0.5) ** 2: "largest"}

    def best_of(run, repeats=tune.REPEATS):
        x, side = run.__defaults__  # the probe's input: (1, patches, width) on a side x side grid
        runs.append((tower.chunked_attention, sizes[x.shape[1]]))
        return timings[runs[-1]]

    monkeypatch.setattr(tune, "best_of", best_of)
    assert tune.measure_tower_chunked(runtime) is chosen
    assert len(runs) == probes and not tower.chunked_attention
    assert [size for _, size in runs] == ["small", "small", "largest", "largest"][:probes]


def test_a_step_function_runs_eagerly_until_compiling_pays(cache):
    runtime = mlx_locate.load("demo", tune=False).runtime
    runtime.steps.compile_after = 2
    run = tune.step_probe(runtime, Phase.BLOCK, 12)
    for calls in (1, 2):
        run()
        assert runtime.compilations == 0 and runtime.compile_s == 0, calls
    run()
    assert runtime.compilations == 1 and runtime.compile_s > 0
    run()
    assert runtime.compilations == 1  # compiled once


@pytest.mark.parametrize("first_call_s, chosen", [(0.2, 1024), (0.0, 512)])
def test_the_prefill_chunk_is_costed_with_the_first_call_of_each_shape(monkeypatch, first_call_s, chosen):
    """Each call of a chunked prompt is a shape of its own, and a shape's first call costs more (compiling, cuDNN's
    plans): 512-row chunks make 4 shapes of the demo's 2,036-row probe and 1,024-row ones 2. With first calls
    dear, the size with fewer shapes wins although its warm calls are slower; with none, the faster warm size. The
    kernels every prefill takes (the first call of all) are no candidate's cost."""
    runtime = mlx_locate.load("demo", tune=False).runtime
    runtime.budget = dataclasses.replace(runtime.budget, prefill_cap=None)  # a GPU's, which caps nothing
    clock, seen, warm = [0.0], set(), {512: 0.02, 1024: 0.12, PREFILL_ROWS: 0.5}

    def prefill(cache, items):
        chunk, rows = runtime.prefill_chunk or PREFILL_ROWS, items[0][1].shape[0]
        shapes = {(chunk, i) for i in range(-(-rows // chunk))}
        clock[0] += (0 if seen else 1.0) + first_call_s * len(shapes - seen) + warm[chunk]
        seen.update(shapes)
        return {}

    monkeypatch.setattr(runtime, "prefill", prefill)
    monkeypatch.setattr(tune.time, "perf_counter", lambda: clock[0])
    assert tune.measure_prefill_chunk(runtime) == chosen
    assert runtime.prefill_chunk is None


PATHS = [(p, after, chunked) for p in AttentionPath for after, chunked in ((0, False), (3, True))]


@pytest.fixture(scope="module")
def golden_models(golden_dir):
    return {name: mlx_locate.load(golden_dir(name), dtype="float32") for name in ("tiny_random", "tiny_peaky")}


@pytest.mark.parametrize("path, compile_after, tower_chunked", PATHS, ids=lambda v: str(getattr(v, "value", v)))
def test_golden_and_batch_parity_on_every_path_the_tuner_can_choose(golden_models, path, compile_after, tower_chunked):
    for checkpoint, model in golden_models.items():
        model.runtime.steps.functions.clear()
        model.runtime.clear_caches()
        tune.apply(
            model.runtime,
            tune.Choices(
                tune.probes_of(model.runtime), path.value, {1: 1.0}, tower_chunked, PREFILL_ROWS, compile_after
            ),
        )
        pairs = [(n, m) for n in golden_cases() if n.startswith(checkpoint) for m in MODES]
        for rows in (1, len(pairs)):  # alone, then every case in one batch
            engine = model.engine(rows)
            handles = [engine.submit(golden_request(n, m)) for n, m in pairs]
            engine.run()
            check_golden(engine, pairs, handles)
