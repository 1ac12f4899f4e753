"""`mlx-locate-mcp` over stdio, driven by the `mcp` package's own client; answers against `model.locate`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import BAD_MODELS, approx_tree, bad_model
from mcp import Client, ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from PIL import Image

import mlx_locate
from mlx_locate.server.app import create_app, serve_in_thread
from mlx_locate.server.mcp import build_server
from mlx_locate.server.mcp import main as mcp_main
from mlx_locate.server.protocol import Settings
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


@pytest.fixture(scope="module")
def both():
    """The tools' answers and the HTTP server's, each on its own worker of the demo model: `both(tool, arguments)`
    gives the tool's result and the HTTP answer to the same fields (the image sent as `image`)."""
    load = lambda: mlx_locate.load("demo")  # noqa: E731
    worker = Worker(load, warmup=False).start()
    worker.wait_ready()
    app = create_app(load, Settings(warmup=False))
    try:
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:

            def ask(tool: str, arguments: dict):
                async def call():
                    async with Client(build_server(worker)) as client:
                        return await client.call_tool(tool, arguments)

                body = {k: v for k, v in arguments.items() if k != "image_base64"}
                return asyncio.run(call()), http.post(f"/v1/{tool}", json={"image": arguments["image_base64"], **body})

            yield ask
    finally:
        worker.stop()


B64 = base64.b64encode(IMAGE.read_bytes()).decode()
BAD_ARGUMENTS = [
    ("locate", {"query": "x", "mode": "turbo"}),
    ("locate", {"query": "x", "colour": "red"}),
    ("locate", {"query": "x", "max_tokens": 0}),
    ("locate", {"query": "x", "max_tokens": "64"}),
    ("locate", {"query": "x", "max_tokens": 64.0}),
    ("locate", {"query": "x", "max_tokens": True}),
    ("locate", {"query": "x", "temperature": "0.5"}),
    ("locate", {"query": "x", "top_p": 0}),
    ("locate", {"query": "x", "strict": "yes"}),
    ("locate", {"query": "x", "orientation": "sideways"}),
    ("locate", {"query": "x", "tiles": "2y2"}),
    ("locate", {"task": "detect"}),
    ("locate", {"task": "ocr", "query": "x"}),
    ("locate", {"categories": []}),
    ("locate", {"categories": ["a", 5]}),
    ("locate", {"categories": ["a", "b"], "query": "c"}),
    ("locate", {"categories": ["a", "b"], "task": "point"}),
    ("ground", {"instruction": ""}),
    ("ground", {"instruction": 5}),
    ("ground", {"instruction": "x", "max_tokens": 0}),
    ("ground", {"instruction": "x", "seed": -1}),
    ("ground", {"instruction": "x", "query": "y"}),
]


@pytest.mark.parametrize("tool, arguments", BAD_ARGUMENTS)
def test_a_bad_argument_gets_the_http_servers_error(both, tool, arguments):
    """The tools check their arguments with the HTTP server's code: the same one-line error, no pydantic dump.
    Before, the tools checked loosely ("64" taken for 64, unknown arguments and `tiles` ignored) and in
    pydantic's words."""
    result, response = both(tool, {"image_base64": B64, **arguments})
    assert response.status_code == 400, response.text
    assert result.is_error and [c.text for c in result.content] == [response.json()["error"]["message"]]


def test_the_http_servers_options_are_applied(both):
    """Tiles (spelled as on the command line), sampling, a line-wrapped unpadded image: the same answer."""
    wrapped = base64.encodebytes(IMAGE.read_bytes()).decode().rstrip("=\n")
    arguments = {"image_base64": wrapped, "query": "square", "tiles": "2x2", "temperature": 0.5, "seed": 3}
    result, response = both("locate", arguments)
    assert not result.is_error, result.content
    answer, expected = result.structured_content, response.json()
    assert answer["stats"]["tile_grid"] == expected["stats"]["tile_grid"] == [2, 2]
    objects = [{k: v for k, v in o.items() if v is not None or k == "label"} for o in answer["objects"]]
    assert objects == approx_tree(expected["objects"]) and answer["text"] == expected["text"]


@pytest.mark.parametrize("query", [["square", "circle"], "x" * 5000])
def test_a_query_is_one_string(both, query):
    """One answer a call: a list of queries, which `/v1/locate` answers under "queries", is refused."""
    result, _ = both("locate", {"image_base64": B64, "query": query})
    assert result.is_error and result.content[0].text == "query: expected a string of at most 4096 characters"


def test_an_unknown_tool_is_one_error_line():
    async def call():
        async with Client(build_server(Worker(lambda: None))) as client:
            return await client.call_tool("find", {"query": "x"})

    result = asyncio.run(call())
    assert result.is_error and [c.text for c in result.content] == ["no tool 'find'; the tools are locate, ground"]


def test_a_list_sent_as_its_json_text_is_read_as_the_list(both):
    """Some MCP clients (Claude Desktop) send a list argument as its JSON text: the tool reads it as the list, as
    the mcp package's own server does; any other string where a list belongs is still refused."""
    listed, _ = both("locate", {"image_base64": B64, "categories": ["square", "circle"]})
    as_text, _ = both("locate", {"image_base64": B64, "categories": '["square", "circle"]'})
    assert not as_text.is_error, as_text.content
    answer, expected = as_text.structured_content, listed.structured_content
    assert (answer["objects"], answer["text"]) == (expected["objects"], expected["text"]) and answer["objects"]
    result, response = both("locate", {"image_base64": B64, "categories": "square, circle"})
    assert result.is_error and [c.text for c in result.content] == [response.json()["error"]["message"]]
