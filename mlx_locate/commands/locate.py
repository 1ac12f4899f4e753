"""Command line: `mlx-locate --model M --image I --query Q [--query Q2 ...] [--json] [--draw out.png]`.

Each `--query` is its own question about the image: the image goes through vision and the prompt prefix once
(one `Session`) and each query decodes on its own. `--categories "car,person"` (or repeated `--category`, or
`--categories-file`) asks one detect question of several categories: one row each, or one prompt joined by `</c>`
with `--joint-categories`. `--json` prints one result's object, or for several
queries `{"queries": [{"query": Q, ...}, ...]}`. `python -m mlx_locate.commands.locate` runs the same `main`.

Errors a user can cause (a missing, unreadable or too large image, a missing model folder, a bad config, an
unknown task, a prompt too long for the model) print one `error: ...` line and exit with status 2; anything else
prints one `error: internal error ...` line and exits with 1. Never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

from ..draw import check_drawing_path, draw_objects
from ..preprocess import FORMATS, load_image, photo_notes
from ..prompts import task_text
from ..request import DEFAULT_TASK, Result, prepare_image
from ..weights.checkpoint import resolve
from ..weights.loader import image_settings
from . import flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate",
        description="Locate objects, text or GUI elements in an image with LocateAnything on MLX.",
    )
    flags.add_model(p)
    p.add_argument(
        "--image",
        required=True,
        type=flags.image_file,
        help=f"image file ({', '.join(FORMATS)}); {flags.DEMO_IMAGE_NAME} for the bundled example",
    )
    flags.add_max_pixels(p)
    flags.add_image_options(p)
    flags.add_questions(p, several_prompts=False)
    flags.add_categories(p)
    flags.add_decoding(p)
    flags.add_sampling(p)
    flags.add_tiling(p)
    o = p.add_argument_group("output")
    flags.add_json(o)
    o.add_argument(
        "--draw", metavar="PATH", type=flags.output_path, help="save the image with the boxes, points and labels drawn"
    )
    flags.add_overwrite(o, "an existing --draw file")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot express; each exits with status 2 through `parser.error`."""
    flags.check_questions(parser, args)
    flags.check_decoding(parser, args)
    flags.check_tiling_flags(parser, args)
    if args.overwrite and not args.draw:
        parser.error("--overwrite only applies to --draw")


def task_and_queries(args: argparse.Namespace) -> tuple[str, list[str | list[str] | None]]:
    """The task and one entry per prompt: a phrase, a list of categories (one detect prompt) or None (ocr)."""
    if args.prompt is not None:
        return "raw", [args.prompt]
    task = args.task or DEFAULT_TASK
    categories = flags.categories_of(args)
    if categories is not None:
        return task, [categories]
    return task, list(args.query or [None])


def format_text(result: Result) -> str:
    """One line per object (label, pixel box or point, confidence), then a one-line summary."""
    lines = []
    for obj in result.objects:
        label = obj.label if obj.label is not None else "-"
        where = obj.box if obj.box is not None else obj.point
        kind = "box" if obj.box is not None else "point"
        coords = ", ".join(f"{v:.1f}" for v in where)
        confidence = "" if obj.confidence is None else f"  {obj.confidence:.3f}"
        lines.append(f"{label}  {kind} [{coords}]{confidence}")
    lines.extend(f"{label if label is not None else '-'}  not found" for label in result.empty_labels)
    if not lines:
        lines.append("no objects found")
    s = result.stats
    timings = ", ".join(f"{k[:-2]} {s[k]:.2f}s" for k in ("preprocess_s", "vision_s", "prefill_s", "decode_s"))
    summary = (
        f"[{result.mode}] {s['steps']} steps ({s['block_steps']} block, {s['ar_steps']} AR), {s['tokens']} tokens; "
        f"{timings}; stop: {s['stop_reason']}{' (truncated)' if result.truncated else ''}"
    )
    return "\n".join([*lines, summary])


def format_many(queries: list[str | list[str] | None], results: list[Result]) -> str:
    """`format_text` of one result; for several queries, each block under a `== query ==` header."""
    if len(results) == 1:
        return format_text(results[0])
    blocks = [f"== {q} ==\n{format_text(r)}" for q, r in zip(queries, results, strict=True)]
    return "\n\n".join(blocks)


def format_json(queries: list[str | list[str] | None], results: list[Result]) -> str:
    """One result's `to_dict()`; for several queries `{"queries": [{"query": ..., **to_dict()}, ...]}`."""
    if len(results) == 1:
        return json.dumps(results[0].to_dict())
    return json.dumps({"queries": [{"query": q, **r.to_dict()} for q, r in zip(queries, results, strict=True)]})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # Warnings (Pillow's on odd files, say) print as one line each; every failure as one `error:` line.
    with warnings.catch_warnings(record=True) as caught:
        try:
            text, code = run(args), 0
        except (OSError, ValueError) as e:  # the user's input: files, model folders, options, prompt length
            text, code = f"error: {e}", 2
        except MemoryError:
            text, code = "error: out of memory; use a smaller image or --max-pixels, or a smaller --dtype", 2
        except KeyboardInterrupt:
            text, code = "error: interrupted", 130
        except Exception as e:  # a bug, not the input: still one line, never a traceback
            text, code = f"error: internal error, please report it: {type(e).__name__}: {e}", 1
    for w in caught:
        print(f"warning: {w.category.__name__}: {w.message}", file=sys.stderr)
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


def command() -> None:
    """`mlx-locate` and `python -m mlx_locate.generate`: `main`, then out of the process once what it wrote is
    flushed, without the interpreter's teardown (a loaded model's buffers freed one by one, a GPU's context torn
    down), which the answer no longer waits for. Callers in a process of their own call `main`."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`| head`), a stream closed
            stream.flush()
    os._exit(code)


def run(args: argparse.Namespace) -> str:
    """The results of `args` as the text or JSON to print."""
    task, queries = task_and_queries(args)
    # Everything the user gave is checked before the (slow) model load.
    for query in queries:
        task_text(task, query)
    options = {"task": task, **flags.request_options(args)}
    tiling = flags.tiling_of(args)
    image = load_image(args.image, args.max_pixels, args.orientation)
    for warning in photo_notes(image).warnings:
        print(f"warning: {args.image}: {warning}", file=sys.stderr)
    if args.draw is not None:
        flags.check_new_file(args.draw, "--draw", "out.png", args.overwrite)
        check_drawing_path(args.draw)
    # The image is resized and cut into patches on a thread while the model loads.
    with ThreadPoolExecutor(1, thread_name_prefix="mlx-locate-image") as pool:
        folder = resolve(args.model)
        settings = image_settings(folder)
        frame = flags.image_options(args)
        prepared = None if tiling["tiles"] else pool.submit(prepare_image, image, args.max_pixels, *settings, **frame)
        model = flags.load_model(args, folder)
    if tiling["tiles"]:
        results = model.locate(image, queries, **tiling, **options)
    else:
        for key in frame:  # the prepared image's, so its session's; a session's query refuses them
            del options[key]
        session = model.session(prepared.result(), options.pop("rendering"), args.max_pixels, **frame)
        results = [session.locate(query, **options) for query in queries]
    if args.draw:
        objects = [obj for result in results for obj in result.objects]
        draw_objects(image, objects, args.draw, overwrite=args.overwrite)
        print(f"drawn: {args.draw}", file=sys.stderr)
    return format_json(queries, results) if args.json else format_many(queries, results)


if __name__ == "__main__":
    command()
