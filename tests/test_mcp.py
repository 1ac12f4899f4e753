"""`mlx-locate-mcp` over stdio, driven by the `mcp` package's own client; answers against `model.locate`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BAD_MODELS, approx_tree, bad_model
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from PIL import Image

import mlx_locate
from mlx_locate.server.mcp import main as mcp_main
from mlx_locate.server.worker import Worker

pytestmark = pytest.mark.slow  # the MCP server as a subprocess

IMAGE = Path(mlx_locate.__file__).parent / "demo" / "example.png"


async def session_calls(calls: list[tuple[str, dict]]):
    """Start the MCP server as a subprocess (the same BLAS as this process: answers are compared exactly), list
    its tools, make `calls`; returns (tools, results)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mlx_locate.server.mcp", "--model", "demo", "--timeout", "60"],
        env={k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "MLX_LOCATE_CI", "LD_PRELOAD")},
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = {t.name: t for t in (await session.list_tools()).tools}
        results = [await session.call_tool(name, arguments) for name, arguments in calls]
    return tools, results


@pytest.fixture(scope="module")
def alone():
    model = mlx_locate.load("demo")
    ask = {"square": ("detect", 512), "circle": ("point", 64), "star": ("point", 64)}
    return {q: model.locate(IMAGE, q, task=task, max_tokens=n) for q, (task, n) in ask.items()}


def test_locate_and_ground_over_stdio(alone):
    image_b64 = base64.b64encode(IMAGE.read_bytes()).decode()
    calls = [
        ("locate", {"image_path": str(IMAGE), "query": "square"}),
        ("locate", {"image_base64": image_b64, "query": "square", "mode": "hybrid"}),
        ("ground", {"image_path": str(IMAGE), "instruction": "circle"}),
        ("ground", {"image_base64": f"data:image/png;base64,{image_b64}", "instruction": "star"}),
        ("locate", {"query": "square"}),
        ("locate", {"image_path": str(IMAGE.with_name("missing.png")), "query": "square"}),
        ("locate", {"image_path": str(IMAGE), "task": "detect"}),
        ("locate", {"image_path": str(IMAGE), "query": "square", "mode": "turbo"}),
    ]
    tools, results = asyncio.run(session_calls(calls))

    assert set(tools) == {"locate", "ground"}
    assert {"image_path", "image_base64", "query", "task", "mode"} <= set(tools["locate"].input_schema["properties"])
    assert {"image_path", "image_base64", "instruction"} <= set(tools["ground"].input_schema["properties"])
    assert "objects" in tools["locate"].output_schema["properties"]

    expected = [o.to_dict() for o in alone["square"].objects]
    for r in results[:2]:
        assert not r.is_error, r.content
        out = r.structured_content
        got = [{k: v for k, v in o.items() if v is not None or k == "label"} for o in out["objects"]]
        assert json.loads(json.dumps(got)) == approx_tree(json.loads(json.dumps(expected)))
        assert out["image"] == {"width": 224, "height": 224} and out["text"] == alone["square"].text

    found, missing = results[2].structured_content, results[3].structured_content
    point = [round(v, 3) for v in alone["circle"].objects[0].point]  # JSON pixels carry 3 decimals
    assert found["found"] is True and found["point"] == point
    assert missing == {**missing, "found": False, "point": None, "box": None}

    messages = [" ".join(c.text for c in r.content) for r in results[4:]]
    assert all(r.is_error for r in results[4:]), messages
    assert "exactly one of image_path and image_base64" in messages[0]
    assert "image file not found" in messages[1]
    assert "needs a non-empty query" in messages[2]
    assert "mode" in messages[3]


def test_a_rotated_jpeg_in_the_displayed_frame(tmp_path):
    """The MCP tool opens files with the same image policy as the API: a phone's portrait shot answers upright."""
    shown = Image.open(IMAGE).convert("RGB").crop((0, 28, 224, 196))  # 224 x 168, as a viewer shows it
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "portrait.jpg"
    shown.transpose(Image.Transpose.ROTATE_90).save(path, "JPEG", quality=95, exif=exif.tobytes())
    api = mlx_locate.load("demo").locate(path, "square")
    _, (result,) = asyncio.run(session_calls([("locate", {"image_path": str(path), "query": "square"})]))
    out = result.structured_content
    assert out["image"] == {"width": 224, "height": 168} and out["orientation"] == "exif" and out["warnings"] == []
    assert [o["box"] for o in out["objects"]] == approx_tree([list(o.box) for o in api.objects])


@pytest.mark.parametrize("kind", BAD_MODELS)
def test_a_model_that_cannot_load_is_one_error_line_and_status_2(tmp_path, kind):
    """Before, an exception group's traceback of 99 lines and status 1; stdout, the protocol's channel, stays clean."""
    folder = bad_model(tmp_path, kind)
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_locate.server.mcp", "--model", str(folder)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith(f"error: {folder}") and proc.stderr.count("\n") == 1, proc.stderr


def test_ctrl_c_while_the_model_loads_stops_it_quietly(monkeypatch, capsys):
    """Before, a KeyboardInterrupt traceback (as in the protocol's loop)."""

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Worker, "wait_ready", interrupted)
    assert mcp_main(["--model", "demo"]) == 130
    assert capsys.readouterr() == ("", "")
