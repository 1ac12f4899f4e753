"""Each example in examples/ runs against the tiny_peaky golden checkpoint (the notebook executed headless)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import GOLDEN
from PIL import Image

import mlx_locate

pytestmark = pytest.mark.slow  # the examples and the notebook, end to end

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
IMAGE = GOLDEN / "images" / "rgba_400x300.png"  # the smallest golden image, the size of the mock screenshot
TOKENS = "16"


def example(name: str):
    """examples/NAME.py imported as a module (without running its `__main__` block)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(golden_dir) -> str:
    return str(golden_dir("tiny_peaky"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return mlx_locate.load(checkpoint)


@pytest.fixture
def cached(model, monkeypatch, checkpoint):
    """`mlx_locate.load(checkpoint)` returns the module's model: each example would otherwise recompile."""
    monkeypatch.setattr(mlx_locate, "load", lambda path, dtype=None: model if str(path) == checkpoint else None)
    return checkpoint


def test_locate_example(cached, tmp_path, capsys):
    drawn = tmp_path / "drawn.png"
    example("locate").main(
        [str(IMAGE), "red box", "car", "--model", cached, "--max-tokens", TOKENS, "--draw", str(drawn)]
    )
    out = capsys.readouterr().out
    assert out.startswith("red box: ") and "\ncar: " in out
    assert Image.open(drawn).size == Image.open(IMAGE).size


def test_desktop_example_headless(cached, tmp_path, capsys):
    desktop = example("desktop")
    assert "tkinter" not in desktop.__dict__  # Tk is imported only when the window opens
    out_json, out_png = tmp_path / "boxes.json", tmp_path / "boxes.png"
    args = ["--model", cached, "--max-tokens", TOKENS, "--mode", "fast", "--json", str(out_json), "--png", str(out_png)]
    desktop.main(["--headless", str(IMAGE), "red box", "car", *args])
    data = json.loads(out_json.read_text())
    assert data["image"] == str(IMAGE) and [q["query"] for q in data["queries"]] == ["red box", "car"]
    assert all(set(q) == {"query", "objects", "empty_labels", "stats"} for q in data["queries"])
    assert Image.open(out_png).size == Image.open(IMAGE).size
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["red box", "car"] and all(" found" in line for line in lines)
    with pytest.raises(SystemExit):
        desktop.main(["--headless", str(IMAGE), "--json", str(out_json)])  # no query


def test_screenshot_grounding_example(cached, tmp_path, capsys):
    grounding = example("screenshot_grounding")
    drawn = tmp_path / "grounded.png"
    rows = grounding.main(["--model", cached, "--max-tokens", TOKENS, "--draw", str(drawn)])
    assert [r["instruction"] for r in rows] == grounding.DEFAULT_INSTRUCTIONS
    assert all(set(r) == {"instruction", "click", "box", "seconds"} for r in rows)
    assert Image.open(drawn).size == grounding.mock_screenshot().size
    assert capsys.readouterr().out.count("click") == 2

    rows = grounding.main(["the red box", "--image", str(IMAGE), "--model", cached, "--max-tokens", TOKENS, "--json"])
    assert json.loads(capsys.readouterr().out) == rows[0]


def test_three_modes_notebook(checkpoint, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MLX_LOCATE_MODEL", checkpoint)
    monkeypatch.setenv("MLX_LOCATE_MAX_TOKENS", TOKENS)
    monkeypatch.setenv("MLX_LOCATE_IMAGE", str(IMAGE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(EXAMPLES / "three_modes.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the three drawings, inline
    (shown,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("model.locate(")]
    assert ["image/png" in o.get("data", {}) for o in shown.outputs] == [True]  # a Result shows itself
    (table,) = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert [row.split("|")[1].strip() for row in table.splitlines()[2:]] == ["slow", "fast", "hybrid"]


def test_measure_session_versus_separate_calls(model):
    """Prints (asserts nothing): N queries on one image through one session versus N fresh calls."""
    queries = ["red box", "car", "person", "the red door"]
    image = Image.open(IMAGE)
    options = {"mode": "fast", "max_tokens": int(TOKENS)}
    model.locate(image, queries[:2], **options)  # compile every shape bucket first

    model.runtime.clear_caches()
    t0 = time.perf_counter()
    together = model.locate(image, queries, **options)
    session_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    separate = []
    for query in queries:
        model.runtime.clear_caches()
        separate.append(model.locate(image, query, **options))
    separate_s = time.perf_counter() - t0
    assert [r.token_ids for r in together] == [r.token_ids for r in separate]
    print(
        f"\n{len(queries)} queries on {IMAGE.name} (tiny_peaky, fast, max {TOKENS} tokens, {sys.platform}): "
        f"one session {session_s:.3f}s, separate calls {separate_s:.3f}s, speed-up x{separate_s / session_s:.2f}"
    )
