"""Shared fixtures: the golden reference data and checkpoint folders assembled from tests/data; the two tiers.

`python3 -m pytest` runs the fast tier (pyproject's addopts: `-m 'not slow'`, spread over the cores by
pytest-xdist); `python3 -m pytest -m slow` the slow tier; add `-n 0` to run in one process. A module of hypothesis
tests belongs to both: a share of their examples in the fast tier, all of them in the slow one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import mlx_locate
from mlx_locate.tokenizer import Tokenizer
from mlx_locate.tokens import TokenIds, token_ids_from_config

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"
TOKENIZER_DIR = GOLDEN / "tokenizer"
# Tests run on the defaults, never on choices measured on this machine (tests/test_tune.py turns tuning on)
os.environ["MLX_LOCATE_TUNE"] = "0"
FAST_SHARE = 8  # the fast tier runs 1/FAST_SHARE of a property test's examples (its @example cases always run)
SLOW_TIER = False  # set by pytest_configure: this run is `-m slow`


def pytest_configure(config):
    global SLOW_TIER
    SLOW_TIER = config.getoption("markexpr") == "slow"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """In the slow tier the tests of a module with hypothesis tests are slow too (there they run at full size)."""
    if SLOW_TIER:
        modules = {item.module for item in items if getattr(item.obj, "is_hypothesis_test", False)}
        for item in items:
            if item.module in modules:
                item.add_marker(pytest.mark.slow)


def slow_but(params: list, fast: list) -> list:
    """`params` for `pytest.mark.parametrize`, each marked slow but those in `fast` (the fast tier's cases)."""
    return [
        p if p in fast else pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow) for p in params
    ]


def property_settings(examples: int) -> settings:
    """Settings of a property test of `examples` examples: all of them in the slow tier, a share in the fast one;
    derandomized (CI runs the same ones every time), no database, no deadline (a loaded machine varies too much)."""
    return settings(
        max_examples=examples if SLOW_TIER else max(2, examples // FAST_SHARE),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def assemble_checkpoint(name: str, dest: Path) -> Path:
    """Lay out golden checkpoint `name` in the original HF layout under `dest` (tokenizer files are shared)."""
    dest.mkdir(parents=True, exist_ok=True)
    for src in [*TOKENIZER_DIR.iterdir(), *(GOLDEN / "checkpoints" / name).iterdir()]:
        (dest / src.name).symlink_to(src.resolve())
    return dest


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The release's tokenizer (real Qwen2 vocabulary and LocateAnything's added tokens)."""
    return Tokenizer.from_folder(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory) -> callable:
    """`golden_dir("tiny_random")` -> a folder in the original Hugging Face layout."""
    root = tmp_path_factory.mktemp("golden")

    def get(name: str) -> Path:
        dest = root / name
        return dest if dest.exists() else assemble_checkpoint(name, dest)

    return get


def golden_case(name: str) -> dict:
    return json.loads((GOLDEN / "cases" / f"{name}.json").read_text())


def golden_cases() -> list[str]:
    return sorted(p.stem for p in (GOLDEN / "cases").glob("*.json"))


@cache
def golden_token_ids() -> TokenIds:
    """The release's special ids, from the golden config and tokenizer files."""
    config = json.loads((GOLDEN / "checkpoints" / "tiny_random" / "config.json").read_text())
    added = json.loads((TOKENIZER_DIR / "added_tokens.json").read_text())
    vocab = json.loads((TOKENIZER_DIR / "vocab.json").read_text())
    return token_ids_from_config(config, added, vocab.get)


BATCH_REL = 1e-4  # a sequence's probabilities alone and in a batch agree to this relative difference


def approx_tree(value):
    """`value` (nested dicts, lists, tuples) with every float replaced by `pytest.approx(rel=BATCH_REL)`.

    On some BLASes (OpenBLAS on cores without AVX-512) a matrix product's bits depend on how many rows it has, so
    a sequence's probabilities alone and in a batch differ in their last digits: compare `a == approx_tree(b)`,
    which keeps tokens, boxes and text exact and lets probabilities differ by rounding."""
    if isinstance(value, float):
        return pytest.approx(value, rel=BATCH_REL, abs=1e-12)
    if isinstance(value, dict):
        return {k: approx_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(approx_tree(v) for v in value)
    return value


def loads_demo_as(demo, load: Callable) -> Callable:
    """A stand-in for the commands' `load`: the already loaded `demo` for --model demo (by its name, or by the
    folder a command resolves it to), `load` for any other model."""
    names = ("demo", str(mlx_locate.DEMO_IMAGE.parent))
    return lambda path, dtype=None, adapter_path=None: demo if str(path) in names else load(path, dtype, adapter_path)


def demo_waiting_before_steps(wait: Callable[[], object]):
    """A loader of the demo model whose engines call `wait()` before every step (a server test's way to hold or
    slow decoding on a machine of any speed)."""

    def load():
        model = mlx_locate.load("demo")
        make_engine = model.engine

        def engine(*args, **kwargs):
            engine = make_engine(*args, **kwargs)
            step = engine.step

            def waiting_step():
                wait()
                return step()

            engine.step = waiting_step
            return engine

        model.engine = engine
        return model

    return load


BAD_MODELS = {"an empty folder": None, "a config.json that is not JSON": "{not json"}  # config.json's text


def bad_model(root: Path, kind: str) -> Path:
    """A model folder of `kind` (a key of BAD_MODELS) under `root`: one a server is given by mistake."""
    folder = root / "model"
    folder.mkdir()
    if BAD_MODELS[kind] is not None:
        (folder / "config.json").write_text(BAD_MODELS[kind])
    return folder
