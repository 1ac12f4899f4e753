"""`mlx-locate-mcp --model M`: an MCP server over stdio with the tools `locate` and `ground`.

An agent's MCP client starts it as a subprocess; both tools take the image as a local path or as base64 and
answer in pixels of that image, with the same fields as the HTTP server's `/v1/locate` and `/v1/ground`. The
model runs on the same single MLX worker thread as the HTTP server, and is loaded before the protocol starts (a
model that is missing or bad is one `error:` line on stderr, status 2). stdout carries the protocol, so nothing
else is printed there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..request import DEFAULT_MAX_TOKENS, DEFAULT_MODE, DEFAULT_TASK
from .protocol import InputError, Settings, build_requests, ground_json, image_bytes, locate_json, open_image
from .worker import Job, ModelError, QueueFull, Worker, WorkerError

try:
    import anyio
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import BaseModel
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f'the MCP tool needs its extra: pip install "mlx-locate[server]" ({e})') from e

from .schemas import GROUND_MAX_TOKENS, Categories, Decoding, Instruction, MaxTokens, ModeName, TaskName, Text

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


def read_image(image_path: str | None, image_base64: str | None, settings: Settings):
    """The tool's image from exactly one of a local path or base64 (a data URL works too)."""
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
    return open_image(data, settings.max_pixels)


def build_server(worker: Worker, settings: Settings | None = None) -> MCPServer:
    """The MCP server over `worker`, which the caller starts and stops."""
    settings = settings or Settings()
    server = MCPServer("mlx-locate", instructions=INSTRUCTIONS)

    async def answer(image_path, image_base64, asks: list[tuple[str | None, str]], decoding: Decoding):
        """The results of (query, task) questions about one image; any failure is a `ToolError`."""
        options = decoding.options(settings)
        try:
            image = await anyio.to_thread.run_sync(read_image, image_path, image_base64, settings)
            vocab = worker.limits.vocab_size if worker.limits else None
            requests = [r for q, task in asks for r in build_requests(image, [q], task, vocab, **options)]
            async with Job(worker, requests, settings.timeout_s) as job:
                return await job.results()
        except (InputError, ValueError, TimeoutError, WorkerError, QueueFull) as e:
            raise ToolError(str(e)) from None

    @server.tool()
    async def locate(
        query: Text | None = None,
        image_path: str | None = None,
        image_base64: str | None = None,
        task: TaskName = DEFAULT_TASK,
        mode: ModeName = DEFAULT_MODE,
        max_tokens: MaxTokens = DEFAULT_MAX_TOKENS,
        categories: Categories | None = None,
    ) -> LocateAnswer:
        """Every box or point in the image that matches `query` (no query for task 'ocr'), in pixels.
        `categories` (instead of `query`, task detect): several categories at once, one answer in their order.

        Give the image as `image_path` (a local file) or `image_base64`. `task`: detect (all instances of a
        category), single, refer (a referring phrase), point, gui (a screen element's box), textground, ocr,
        raw (query = the whole prompt). `mode`: hybrid (default), fast (boxes in parallel) or slow.
        """
        if categories is not None and (query is not None or task != "detect"):
            raise ToolError("categories make one detect request; do not combine with query or another task")
        ask = (list(categories), "detect") if categories is not None else (query, task)
        (result,) = await answer(image_path, image_base64, [ask], Decoding(mode=mode, max_tokens=max_tokens))
        return LocateAnswer.model_validate(locate_json("", settings.model_name, task, mode, None, [result]))

    @server.tool()
    async def ground(
        instruction: Instruction,
        image_path: str | None = None,
        image_base64: str | None = None,
        mode: ModeName = DEFAULT_MODE,
    ) -> GroundAnswer:
        """Where to click for a GUI instruction ("the Save button") on a screenshot: `point` [x, y] in pixels
        (the model's click point, else the centre of the element's box) and the element's `box`; `found` is
        false and `point` null when the model finds nothing.
        """
        asks = [(instruction, "point"), (instruction, "gui")]
        point, region = await answer(image_path, image_base64, asks, Decoding(mode=mode, max_tokens=GROUND_MAX_TOKENS))
        return GroundAnswer.model_validate(ground_json(point, region))

    return server


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
        build_server(worker, settings).run("stdio")
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
