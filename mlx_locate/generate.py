"""Command line: `mlx-locate --model M --image I --query Q [--query Q2 ...] [--json] [--draw out.png]`.

Each `--query` is its own question about the image: the image goes through vision and the prompt prefix once
(one `Session`) and each query decodes on its own. `--categories "car,person"` (or repeated `--category`) asks
one detect prompt for several categories, joined by `</c>`. `--json` prints one result's object, or for several
queries `{"queries": [{"query": Q, ...}, ...]}`. `python -m mlx_locate.generate` runs the same `main`.

Errors a user can cause (a missing, unreadable or too large image, a missing model folder, a bad config, an
unknown task, a prompt too long for the model) print one `error: ...` line and exit with status 2; anything else
prints one `error: internal error ...` line and exits with 1. Never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path

from .decide import Guards, Mode
from .draw import draw_objects
from .locate import load
from .preprocess import DEFAULT_MAX_PIXELS, FORMATS, load_image
from .prompts import RENDERINGS, TASKS, task_text
from .request import Result
from .sampling import Sampling
from .tiles import check_tiling, parse_tiles

DEFAULT_MODEL = "demo"  # the bundled demo model (synthetic shapes); pass a folder or hub id for real images
DEFAULT_TASK = "detect"
DEFAULT_MODE = Mode.HYBRID.value
DEFAULT_MAX_TOKENS = 512
DEFAULT_RENDERING = "A"
DEFAULT_SEED = 0
DTYPES = ("bfloat16", "float16", "float32")


def utf8_text(text: str) -> str:
    """Text given on a command line; bytes that are not UTF-8 arrive as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text: {text!r}") from None
    return text


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def seed_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64 - 1, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def tiles_arg(text: str) -> str | tuple[int, int]:
    try:
        return parse_tiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate",
        description="Locate objects, text or GUI elements in an image with LocateAnything on MLX.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint folder, Hugging Face hub id (e.g. nvidia/LocateAnything-3B) or 'demo' (default: demo, "
        "the bundled tiny model trained on synthetic shapes)",
    )
    p.add_argument("--adapter", help="LoRA adapter folder on top of --model (mlx-locate-finetune's, or PEFT's)")
    p.add_argument("--image", required=True, help=f"image file ({', '.join(FORMATS)})")
    p.add_argument(
        "--max-pixels",
        type=positive_int,
        help=f"refuse larger images, read from the header before decoding (default: {DEFAULT_MAX_PIXELS:,}, "
        "Pillow's decompression-bomb threshold); raise it for real large images",
    )
    p.add_argument("--task", choices=TASKS, help=f"prompt template (default: {DEFAULT_TASK})")
    p.add_argument(
        "--query",
        action="append",
        type=utf8_text,
        help="what to find; repeat to ask several separate questions about the same image",
    )
    p.add_argument(
        "--categories",
        metavar="LIST",
        type=utf8_text,
        help='comma-separated categories asked in ONE detect prompt, e.g. "car,person" (joined by </c>)',
    )
    p.add_argument("--category", action="append", type=utf8_text, help="one category of that detect prompt; repeatable")
    p.add_argument("--prompt", type=utf8_text, help="raw user text, sent as is; replaces --task and --query")

    d = p.add_argument_group("decoding")
    d.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=DEFAULT_MODE,
        help="slow: token by token; fast: boxes in parallel; hybrid: parallel, token by token on doubt "
        "(default: %(default)s)",
    )
    d.add_argument(
        "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="generated tokens (default: %(default)s)"
    )
    d.add_argument("--strict", action="store_true", help="the reference's decisions exactly: every guard off")
    d.add_argument("--no-end-guard", action="store_true", help="do not stop when <|im_end|> or <null> leads a block")
    d.add_argument("--no-loop-guard", action="store_true", help="do not stop when a box repeats the previous one")
    d.add_argument("--box-start-guard", action="store_true", help="block decoding fails unless <box> leads")
    d.add_argument(
        "--no-nucleus-guard",
        action="store_true",
        help="let block decoders take candidates outside each row's top-p 0.9 nucleus (the reference's greedy)",
    )
    d.add_argument(
        "--redecode-labels",
        action=argparse.BooleanOptionalAction,
        help="re-decode uncertain label tokens one by one in hybrid mode (default: on for --task ocr)",
    )
    d.add_argument("--rendering", choices=RENDERINGS, default=DEFAULT_RENDERING, help="chat rendering (default: A)")
    d.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")

    s = p.add_argument_group("sampling (default: greedy)")
    official = Sampling.OFFICIAL
    s.add_argument(
        "--official-sampling",
        action="store_true",
        help=f"the model card's settings: temperature {official.temperature}, top-p {official.top_p}, "
        f"repetition penalty {official.repetition_penalty}; the flags below override single values",
    )
    s.add_argument("--temperature", type=finite_float, help="0 = greedy")
    s.add_argument("--top-p", type=finite_float, help="nucleus mass; 1 = off")
    s.add_argument("--top-k", type=int, help="0 = off")
    s.add_argument("--repetition-penalty", type=finite_float, help="1 = off")
    s.add_argument("--seed", type=seed_int, default=DEFAULT_SEED, help="random seed (default: %(default)s)")

    t = p.add_argument_group("tiling (large or dense images)")
    t.add_argument(
        "--tiles",
        type=tiles_arg,
        metavar="auto|ROWSxCOLS",
        help="decode overlapping tiles (and the whole image) as one batch and merge their objects; auto: the "
        "fewest tiles the model sees unscaled",
    )
    t.add_argument(
        "--tile-overlap", type=finite_float, help="fraction of a tile shared with its neighbour (default: 0.2)"
    )
    t.add_argument("--no-tile-whole", action="store_true", help="decode the tiles only, not the whole image too")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--draw", metavar="PATH", help="save the image with the boxes, points and labels drawn")
    o.add_argument("--overwrite", action="store_true", help="let --draw replace an existing file")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot express; each exits with status 2 through `parser.error`."""
    categories = args.categories is not None or args.category
    if args.prompt is not None and (args.task is not None or args.query or categories):
        parser.error("--prompt is the whole user text; it cannot be combined with --task, --query or --categories")
    if categories and (args.task or DEFAULT_TASK) != "detect":
        parser.error(f"--categories/--category: only --task detect takes several categories, not --task {args.task}")
    if categories and args.query:
        parser.error("--categories/--category make one detect prompt; ask separate questions with --query instead")
    if args.strict and args.box_start_guard:
        parser.error("--strict turns every guard off; drop --box-start-guard")
    if args.overwrite and not args.draw:
        parser.error("--overwrite only applies to --draw")
    if args.tiles is None and (args.no_tile_whole or args.tile_overlap is not None):
        parser.error("--tile-overlap and --no-tile-whole only apply with --tiles")


def task_and_queries(args: argparse.Namespace) -> tuple[str, list[str | list[str] | None]]:
    """The task and one entry per prompt: a phrase, a list of categories (one detect prompt) or None (ocr)."""
    if args.prompt is not None:
        return "raw", [args.prompt]
    task = args.task or DEFAULT_TASK
    if args.categories is not None or args.category:
        listed = args.categories.split(",") if args.categories is not None else []
        return task, [[c.strip() for c in [*listed, *(args.category or [])]]]
    return task, list(args.query or [None])


def sampling_of(args: argparse.Namespace) -> Sampling:
    """`Sampling()` (greedy) or `Sampling.OFFICIAL`, with each given flag replacing its field."""
    base = Sampling.OFFICIAL if args.official_sampling else Sampling()
    names = ("temperature", "top_p", "top_k", "repetition_penalty")
    return dataclasses.replace(base, **{n: getattr(args, n) for n in names if getattr(args, n) is not None})


def guards_of(args: argparse.Namespace) -> Guards:
    return Guards(
        end_guard=not args.no_end_guard,
        loop_guard=not args.no_loop_guard,
        box_start_guard=args.box_start_guard,
        nucleus=None if args.no_nucleus_guard else Guards().nucleus,
    )


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


def run(args: argparse.Namespace) -> str:
    """The results of `args` as the text or JSON to print."""
    task, queries = task_and_queries(args)
    # Everything the user gave is checked before the (slow) model load.
    for query in queries:
        task_text(task, query)
    sampling = sampling_of(args)
    image = load_image(args.image, args.max_pixels)
    if args.draw and Path(args.draw).exists() and not args.overwrite:
        raise FileExistsError(f"{args.draw} already exists; pass --overwrite to replace it")
    tiling = {}
    if args.tiles is not None:
        tiling = {"tiles": args.tiles, "tile_whole": not args.no_tile_whole}
        if args.tile_overlap is not None:
            tiling["tile_overlap"] = args.tile_overlap
        check_tiling(args.tiles, tiling.get("tile_overlap", 0))
    model = load(args.model, dtype=args.dtype, adapter_path=args.adapter)
    options = {
        "task": task,
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "sampling": sampling,
        "strict": args.strict,
        "guards": guards_of(args),
        "redecode_labels": args.redecode_labels,
        "seed": args.seed,
    }
    if tiling:
        results = model.locate(image, queries, rendering=args.rendering, **tiling, **options)
    else:
        session = model.session(image, rendering=args.rendering)
        results = [session.locate(query, **options) for query in queries]
    if args.draw:
        objects = [obj for result in results for obj in result.objects]
        draw_objects(image, objects, args.draw, overwrite=args.overwrite)
    return format_json(queries, results) if args.json else format_many(queries, results)


if __name__ == "__main__":
    raise SystemExit(main())
