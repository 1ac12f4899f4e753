"""`mlx-locate-mcp --model M`: an MCP server over stdio with the tools `locate` and `ground`.

An agent's MCP client starts it as a subprocess; both tools take the image as a local path or as base64 and
answer in pixels of that image, with the same options and fields as the HTTP server's `/v1/locate` and
`/v1/ground`, their arguments checked by the same code (`schemas.parse`). The
model runs on the same single MLX worker thread as the HTTP server, and is loaded before the protocol starts (a
model that is missing or bad is one `error:` line on stderr, status 2). stdout carries the protocol, so nothing
else is printed there.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .protocol import InputError, Settings, build_requests, ground_json, image_bytes, locate_json, open_image
from .worker import Job, ModelError, QueueFull, Worker, WorkerError

try:
    import anyio
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server
    from pydantic import BaseModel
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f'the MCP tool needs its extra: pip install "mlx-locate[server]" ({e})') from e

from .schemas import GroundTool, LocateTool, parse

INSTRUCTIONS = (
    "Find things in images. `locate` returns every box or point matching a phrase (task 'detect', 'refer', "
    "'point', 'gui', ...); `ground` returns where to click for a GUI instruction. Coordinates are pixels of "
    "the image given."
)


class ImageSize(BaseModel):
    width: int
    height: int


class Found(BaseModel):
    label: str | None
    box: list[float] | None = None  # x1, y1, x2, y2 in pixels
    box_norm: list[int] | None = None  # the model's 0..1000 values
    point: list[float] | None = None  # x, y in pixels
    point_norm: list[int] | None = None
    confidence: float | None = None


class LocateAnswer(BaseModel):
    task: str
    mode: str
    image: ImageSize
    objects: list[Found]
    empty_labels: list[str | None]  # labels the model answered "none" for
    truncated: bool
    text: str  # the model's raw answer
    orientation: str  # the frame of the pixels: "exif" (as a viewer shows the image) or "stored"
    warnings: list[str]  # about the image (only its first frame used, a colour profile not applied)
    stats: dict[str, Any]


class GroundAnswer(BaseModel):
    found: bool
    point: list[float] | None  # where to click, in pixels
    point_norm: list[float] | None  # the same point in the model's 0..1000 units
    box: list[float] | None  # the element's box, in pixels
    confidence: float | None
    image: ImageSize


@dataclass(frozen=True)
class Tool:
    """A tool: its arguments (a model of `schemas.py`, checked as the HTTP bodies are), its answer, and `run`,
    whose docstring is its description."""

    arguments: type[BaseModel]
    answer: type[BaseModel]
    run: Callable[[Any], Awaitable[dict]]

    def listed(self, name: str) -> types.Tool:
        return types.Tool(
            name=name,
            description=inspect.getdoc(self.run),
            input_schema=self.arguments.model_json_schema(),
            output_schema=self.answer.model_json_schema(),
        )


def read_image(image_path: str | None, image_base64: str | None, orientation: str, settings: Settings):
    """The tool's image from exactly one of a local path or base64 (a data URL works too), in `orientation`'s
    frame."""
    if (image_path is None) == (image_base64 is None):
        raise InputError("invalid_request", "give exactly one of image_path and image_base64")
    if image_path is not None:
        path = Path(image_path).expanduser()
        if not path.is_file():
            raise InputError("invalid_request", f"image file not found: {path}")
        limit = int(settings.max_body_mb * 1024 * 1024)
        if path.stat().st_size > limit:
            raise InputError("image_too_large", f"{path} is over {limit:,} bytes")
        data = path.read_bytes()
    else:
        data = image_bytes(image_base64)
    return open_image(data, settings.max_pixels, orientation)


@functools.cache
def list_arguments(model: type[BaseModel]) -> frozenset[str]:
    """The arguments of a tool's `model` that take a list (an array in its JSON schema), found once."""
    properties = model.model_json_schema().get("properties", {})
    return frozenset(
        name
        for name, schema in properties.items()
        if any(s.get("type") == "array" for s in [schema, *schema.get("anyOf", [])])
    )


def lists_from_json(model: type[BaseModel], arguments: dict) -> dict:
    """`arguments` with a list argument that came as its JSON text (as some clients, Claude Desktop among them,
    send one) read as that list; every other value as it came."""
    out = dict(arguments)
    for name, value in arguments.items():
        if isinstance(value, str) and value.lstrip().startswith("[") and name in list_arguments(model):
            try:
                listed = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(listed, list):
                out[name] = listed
    return out


def build_server(worker: Worker, settings: Settings | None = None) -> Server:
    """The MCP server over `worker`, which the caller starts and stops. The tools' arguments are checked by the
    HTTP server's code (`schemas.parse`): the same bad argument gets the same one-line error. (The low-level
    server: `MCPServer` checks a tool's arguments itself, loosely and in pydantic's words.)"""
    settings = settings or Settings()

    async def answer(args: LocateTool | GroundTool, asks: list[tuple[str | list[str] | None, str]]) -> list:
        """The results of (query, task) questions about the tool's image."""
        image = await anyio.to_thread.run_sync(
            read_image, args.image_path, args.image_base64, args.orientation, settings
        )
        vocab = worker.limits.vocab_size if worker.limits else None
        options = args.options(settings)
        requests = [r for q, task in asks for r in build_requests(image, [q], task, vocab, **options)]
        async with Job(worker, requests, settings.timeout_s) as job:
            return await job.results()

    async def locate(args: LocateTool) -> dict:
        """Every box or point in the image that matches `query` (no query for task 'ocr'), in pixels.
        `categories` (instead of `query`, task detect): several categories at once, one answer in their order.

        Give the image as `image_path` (a local file) or `image_base64`. `task`: detect (all instances of a
        category), single, refer (a referring phrase), point, gui (a screen element's box), textground, ocr,
        raw (query = the whole prompt). `mode`: hybrid (default), fast (boxes in parallel) or slow. The other
        arguments are `/v1/locate`'s.
        """
        (query,) = args.queries()
        (result,) = await answer(args, [(query, args.task)])
        return locate_json("", settings.model_name, args.task, args.mode, None, [result])

    async def ground(args: GroundTool) -> dict:
        """Where to click for a GUI instruction ("the Save button") on a screenshot: `point` [x, y] in pixels
        (the model's click point, else the centre of the element's box) and the element's `box`; `found` is
        false and `point` null when the model finds nothing. The other arguments are `/v1/ground`'s.
        """
        point, region = await answer(args, [(args.instruction, "point"), (args.instruction, "gui")])
        return ground_json(point, region)

    tools = {"locate": Tool(LocateTool, LocateAnswer, locate), "ground": Tool(GroundTool, GroundAnswer, ground)}

    async def list_tools(context, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool.listed(name) for name, tool in tools.items()])

    async def call_tool(context, params: types.CallToolRequestParams) -> types.CallToolResult:
        """The tool's answer; a failure the caller can act on is an error result of one line."""
        try:
            tool = tools.get(params.name)
            if tool is None:
                raise InputError("invalid_request", f"no tool {params.name!r}; the tools are {', '.join(tools)}")
            found = await tool.run(parse(tool.arguments, lists_from_json(tool.arguments, params.arguments or {})))
        except (InputError, ValueError, TimeoutError, WorkerError, QueueFull) as e:
            return types.CallToolResult(content=[types.TextContent(type="text", text=str(e))], is_error=True)
        out = tool.answer.model_validate(found).model_dump(mode="json")
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(out))], structured_content=out
        )

    return Server("mlx-locate", instructions=INSTRUCTIONS, on_list_tools=list_tools, on_call_tool=call_tool)


async def serve_stdio(server: Server) -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def build_parser() -> argparse.ArgumentParser:
    from .__main__ import add_model_flags

    p = argparse.ArgumentParser(
        prog="mlx-locate-mcp", description="An MCP server over stdio with the tools locate and ground."
    )
    add_model_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from .__main__ import model_loader

    args = build_parser().parse_args(argv)
    try:
        load = model_loader(args)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = Settings(
        model_name=args.model,
        max_pixels=args.max_pixels,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        max_rows=args.max_rows,
        warmup=not args.no_warmup,
    )
    worker = Worker(load, max_queue=settings.max_queue, max_rows=settings.max_rows, warmup=settings.warmup)
    try:
        worker.start().wait_ready()  # before the protocol starts: a model that fails to load is one line
        anyio.run(serve_stdio, build_server(worker, settings))
    except WorkerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ModelError) else 1
    except KeyboardInterrupt:  # Ctrl-C, loading or serving
        return 130
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
