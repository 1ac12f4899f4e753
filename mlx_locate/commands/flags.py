"""The command-line vocabulary the commands share, each flag declared once: the model to load, the questions,
decoding and sampling, tiling, image limits, engine rows, training, progress, and the checked argument types.

A command builds its parser from these groups (`add_model(p)`, `add_decoding(p)`, ...) and reads them back
with the matching functions (`load_model(args)`, `request_options(args)`, ...); its own flags stay in its
module.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import mlx.core as mx

from ..admission import MAX_SEED
from ..categories import category_names
from ..decide import MODE_NAMES, Guards
from ..locate import load
from ..preprocess import DEFAULT_MAX_PIXELS, ORIENTATIONS
from ..prompts import RENDERINGS, TASKS
from ..request import DEFAULT_MAX_TOKENS, DEFAULT_MODE, DEFAULT_TASK, MIN_IMAGE_TOKENS, Request
from ..sampling import Sampling
from ..tiles import check_tiling, parse_tiles
from ..weights.checkpoint import DEMO_IMAGE, DEMO_NAME, DTYPES, content_id

DEFAULT_MODEL = "demo"  # the bundled demo model (synthetic shapes); pass a folder or hub id for real images
DEMO_IMAGE_NAME = "demo:example"  # the bundled example image (checkpoint.DEMO_IMAGE), from any folder
DEFAULT_RENDERING = "A"
DEFAULT_SEED = 0

# --- checked argument types ---


def image_file(text: str) -> str:
    """An image file's path, or DEMO_IMAGE_NAME for the bundled example."""
    return str(DEMO_IMAGE) if text == DEMO_IMAGE_NAME else text


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


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


MAX_BYTES = 2**64 - 1  # the most bytes a size flag may name (MLX's memory limit is a 64-bit size)


def byte_size(unit: float):
    """The checked type of a size flag in `unit` bytes (2**20 for MB, 1e9 for GB): a positive number, at most
    MAX_BYTES in all (beyond, its bytes do not fit the integer sizes they become)."""
    most = MAX_BYTES / unit

    def size(text: str) -> float:
        value = positive_float(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:.6g}, got {text}")
        return value

    return size


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def output_path(text: str) -> str:
    """A path a command writes to: an empty one would write nothing, or into the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def image_tokens(text: str) -> int:
    value = _integer(text)
    if value < MIN_IMAGE_TOKENS:  # the engine's bound (`request.check_image_options`)
        raise argparse.ArgumentTypeError(f"must be at least {MIN_IMAGE_TOKENS} patches, got {value}")
    return value


def port_int(text: str) -> int:
    """A TCP port: 1 to 65535, or 0 for a free one the system picks."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port between 0 (any free port) and 65535, got {value}")
    return value


def seed_int(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= MAX_SEED:  # the engine's bound (`admission.check_request`)
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64 - 1, got {value}")
    return value


def tiles_arg(text: str) -> str | tuple[int, int]:
    try:
        return parse_tiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- the model ---


def add_model(p: argparse.ArgumentParser, adapter: bool = True) -> None:
    """--model, --dtype and (unless `adapter` is False) --adapter."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint folder, Hugging Face hub id (e.g. nvidia/LocateAnything-3B) or 'demo' (default: demo, "
        "the bundled tiny model trained on synthetic shapes)",
    )
    add_dtype(p)
    if adapter:
        p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder on top of --model (ours or PEFT's)")
    p.add_argument(
        "--no-tune",
        dest="tune",
        action="store_false",
        default=None,
        help="do not measure this device's choices or read their cache (as MLX_LOCATE_TUNE=0)",
    )


def add_dtype(p, default: str | None = None, what: str = "cast the weights (default: as stored; float32 on a CPU)"):
    p.add_argument("--dtype", choices=list(DTYPES), default=default, help=what)


def add_overwrite(p, what: str) -> None:
    """--overwrite (alias --force): let the command replace `what`; nothing the user owns is replaced without it."""
    p.add_argument("--overwrite", "--force", dest="overwrite", action="store_true", help=f"replace {what}")


def check_file_path(path: str | Path, flag: str, example: str) -> None:
    """`IsADirectoryError` when `path`, given to `flag` for a file the command writes, is a folder."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder; it needs a file name such as {example}")


def check_new_file(path: str | Path, flag: str, example: str, overwrite: bool) -> None:
    """A file the command is to write at `path`: not a folder (`check_file_path`), nor an existing file unless
    `overwrite` (`FileExistsError`)."""
    check_file_path(path, flag, example)
    if Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")


def check_folder(flag: str, path: Path) -> None:
    """Refuse, before any work, a folder to write into (`flag`'s) that is a file or lies under one."""
    above = path
    while not above.exists() and above.parent != above:
        above = above.parent
    if above.exists() and not above.is_dir():
        where = "is a file" if above == path else f"lies under {above}, which is a file"
        raise NotADirectoryError(f"{flag} {path} {where}; it needs a folder")


def add_json(p, what: str = "print one JSON object instead of text", path: bool = False) -> None:
    """--json: a switch, or with `path` the file a command writes its JSON to."""
    kind = {"metavar": "PATH", "type": output_path} if path else {"action": "store_true"}
    p.add_argument("--json", **kind, help=what)


def load_model(args: argparse.Namespace, folder: Path | None = None):
    """The model `add_model`'s flags name (a `locate.LocateModel`), within --memory-limit where given; from
    `folder` where the caller has resolved --model already (a hub id is then not looked up twice). An
    --image-tokens over the model's own patch budget raises `ValueError` naming the flag."""
    apply_memory_limit(args)
    tune = {"tune": False} if getattr(args, "tune", None) is False else {}  # --no-tune; else MLX_LOCATE_TUNE decides
    where = args.model if folder is None else folder
    model = load(where, dtype=args.dtype, adapter_path=getattr(args, "adapter", None), **tune)
    tokens, limit = getattr(args, "max_image_tokens", None), model.runtime.in_token_limit
    if tokens is not None and tokens > limit:
        raise ValueError(f"--image-tokens {tokens}: the model takes at most {limit:,} patches (its own budget)")
    return model


def model_settings(args: argparse.Namespace) -> dict:
    """The model `add_model`'s flags name, as a resumable run's files record it (`jsonl.check_settings`): --model
    and --adapter (a local folder by its content, `checkpoint.content_id`, so the same model at another path or
    on another machine of a sharded run is the same) and --dtype."""

    def identity(name: str | None) -> str | None:
        if name is None or name == DEMO_NAME or not Path(name).expanduser().is_dir():
            return name  # the demo, a hub id, or a path that loading will refuse
        return content_id(Path(name).expanduser())

    return {"model": identity(args.model), "adapter": identity(getattr(args, "adapter", None)), "dtype": args.dtype}


# --- questions ---


def add_questions(p: argparse.ArgumentParser, several_prompts: bool = True) -> None:
    """--task, repeatable --query, and --prompt (repeatable when `several_prompts`)."""
    p.add_argument("--task", choices=TASKS, help=f"prompt template (default: {DEFAULT_TASK})")
    p.add_argument(
        "--query", action="append", type=utf8_text, help="what to find; repeat to ask several separate questions"
    )
    p.add_argument(
        "--prompt",
        action="append" if several_prompts else "store",
        type=utf8_text,
        help="raw user text, sent as is; replaces --task and --query" + ("; repeatable" if several_prompts else ""),
    )


def check_questions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    categories = has_categories(args)
    if args.prompt is not None and (args.task is not None or args.query or categories):
        parser.error(
            "--prompt is the whole user text; it cannot be combined with --task or --query, nor with --categories"
        )
    if categories and (args.task or DEFAULT_TASK) != "detect":
        parser.error(f"--categories: only --task detect takes several categories, not --task {args.task}")
    if categories and args.query:
        parser.error("--categories make one detect request; ask separate questions with --query instead")
    if getattr(args, "joint_categories", False) and not categories:
        parser.error("--joint-categories only applies with --categories, --category or --categories-file")


def add_categories(p: argparse.ArgumentParser) -> None:
    """--categories, repeatable --category, --categories-file and --joint-categories: one detect request for
    several categories, decoded one category per row (or in one joint prompt)."""
    c = p.add_argument_group("categories (one detect request, one row per category unless --joint-categories)")
    c.add_argument("--categories", metavar="LIST", type=utf8_text, help='comma-separated categories, e.g. "car,person"')
    c.add_argument("--category", action="append", type=utf8_text, help="one category; repeatable")
    c.add_argument("--categories-file", metavar="PATH", help="a text file of categories, one per line")
    c.add_argument(
        "--joint-categories",
        action="store_true",
        help="ask every category in ONE prompt joined by </c>, as the reference does (also implied by --strict); "
        "by default each category decodes in its own row of the batch, sharing the image's work",
    )


def has_categories(args: argparse.Namespace) -> bool:
    given = ("categories", "category", "categories_file")
    return any(getattr(args, name, None) is not None for name in given)


def categories_of(args: argparse.Namespace) -> list[str] | None:
    """The categories `add_categories`' flags give, in order (--categories, --category, --categories-file), or
    None; `ValueError` for a missing, unreadable or empty file or a bad name (`categories.category_names`)."""
    if not has_categories(args):
        return None
    names = args.categories.split(",") if args.categories is not None else []
    names += args.category or []
    if args.categories_file is not None:
        path = Path(args.categories_file)
        if not path.is_file():
            raise FileNotFoundError(f"--categories-file {path}: {'not a file' if path.exists() else 'no such file'}")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"--categories-file {path}: not UTF-8 text") from None
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise ValueError(f"--categories-file {path} is empty; write one category per line")
        names += lines
    return category_names(names)


# --- decoding and sampling ---


def add_decoding(p: argparse.ArgumentParser, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    """The decoding group: --mode, --max-tokens, --strict, the guards, --redecode-labels, --rendering."""
    d = p.add_argument_group("decoding")
    d.add_argument(
        "--mode",
        choices=MODE_NAMES,
        default=DEFAULT_MODE,
        help="slow: token by token; fast: boxes in parallel; hybrid: parallel, token by token on doubt "
        "(default: %(default)s)",
    )
    add_max_tokens(d, max_tokens)
    d.add_argument(
        "--strict",
        action="store_true",
        help="the reference's decisions exactly: every guard off, several categories in one joint prompt",
    )
    d.add_argument("--no-end-guard", action="store_true", help="do not stop when <|im_end|> or <null> leads a block")
    d.add_argument("--no-loop-guard", action="store_true", help="do not stop when a box repeats the previous one")
    d.add_argument("--box-start-guard", action="store_true", help="block decoding fails unless <box> leads")
    d.add_argument(
        "--no-nucleus-guard",
        action="store_true",
        help="let block decoders take candidates outside each row's top-p 0.9 nucleus (the reference's greedy)",
    )
    d.add_argument(
        "--no-label-constraint",
        action="store_true",
        help="with --joint-categories, let labels be other than the asked categories (default: held to them)",
    )
    d.add_argument(
        "--redecode-labels",
        action=argparse.BooleanOptionalAction,
        help="re-decode uncertain label tokens one by one in hybrid mode (default: on for --task ocr)",
    )
    add_rendering(d)


def add_max_tokens(p, default: int = DEFAULT_MAX_TOKENS) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=default, help="generated tokens (default: %(default)s)")


def add_rendering(p) -> None:
    p.add_argument("--rendering", choices=RENDERINGS, default=DEFAULT_RENDERING, help="chat rendering (default: A)")


def add_sampling(p: argparse.ArgumentParser) -> None:
    """The sampling group: --official-sampling, --temperature, --top-p, --top-k, --repetition-penalty, --seed."""
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


def check_decoding(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.strict and args.box_start_guard:
        parser.error("--strict turns every guard off; drop --box-start-guard")


def sampling_of(args: argparse.Namespace) -> Sampling:
    """`Sampling()` (greedy) or `Sampling.OFFICIAL`, with each given flag replacing its field; `ValueError` for
    settings out of range."""
    base = Sampling.OFFICIAL if args.official_sampling else Sampling()
    names = ("temperature", "top_p", "top_k", "repetition_penalty")
    return dataclasses.replace(base, **{n: getattr(args, n) for n in names if getattr(args, n) is not None})


def guards_of(args: argparse.Namespace) -> Guards:
    return Guards(
        end_guard=not args.no_end_guard,
        loop_guard=not args.no_loop_guard,
        box_start_guard=args.box_start_guard,
        nucleus=None if args.no_nucleus_guard else Guards().nucleus,
        label_constraint=not args.no_label_constraint,
    )


def request_options(args: argparse.Namespace) -> dict:
    """The `Request` fields the decoding and sampling groups set."""
    return {
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "sampling": sampling_of(args),
        "strict": args.strict,
        "joint": getattr(args, "joint_categories", False),
        "guards": guards_of(args),
        "redecode_labels": args.redecode_labels,
        "rendering": args.rendering,
        "seed": args.seed,
        **image_options(args),
    }


# --- tiling, image limits, rows, progress ---


def add_tiling(p: argparse.ArgumentParser, what: str = "image") -> None:
    t = p.add_argument_group("tiling (large or dense images)")
    t.add_argument(
        "--tiles",
        type=tiles_arg,
        metavar="auto|ROWSxCOLS",
        help=f"decode overlapping tiles (and the whole {what}) as one batch and merge their objects; auto: the "
        "fewest tiles the model sees unscaled",
    )
    t.add_argument(
        "--tile-overlap",
        type=finite_float,
        help=f"fraction of a tile shared with its neighbour (default: {Request.tile_overlap})",
    )
    t.add_argument("--no-tile-whole", action="store_true", help=f"decode the tiles only, not the whole {what} too")


def check_tiling_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tiles is None and (args.no_tile_whole or args.tile_overlap is not None):
        parser.error("--tile-overlap and --no-tile-whole only apply with --tiles")


def tiling_of(args: argparse.Namespace) -> dict:
    """The `Request` fields of the tiling group (without --tiles: `tiles` None, the others their defaults);
    `ValueError` for a bad grid or overlap."""
    if args.tiles is None:
        return {"tiles": None, "tile_overlap": Request.tile_overlap, "tile_whole": Request.tile_whole}
    overlap = Request.tile_overlap if args.tile_overlap is None else args.tile_overlap
    check_tiling(args.tiles, overlap)
    return {"tiles": args.tiles, "tile_overlap": overlap, "tile_whole": not args.no_tile_whole}


def add_max_pixels(p: argparse.ArgumentParser, default: int | None = None) -> None:
    shown = default or DEFAULT_MAX_PIXELS
    p.add_argument(
        "--max-pixels",
        type=positive_int,
        default=default,
        help=f"refuse larger images, read from the header before decoding (default: {shown:,}); raise it for "
        "real large images",
    )


def add_image_options(p: argparse.ArgumentParser, orientation: str = "exif") -> None:
    """--orientation and --image-tokens: the frame of the answer and the patch budget (`image_options(args)`)."""
    p.add_argument(
        "--orientation",
        choices=ORIENTATIONS,
        default=orientation,
        help="exif: boxes in the frame a photo viewer shows (the EXIF orientation applied); stored: in the stored "
        "pixels, for labels made on them (default: %(default)s)",
    )
    p.add_argument(
        "--image-tokens",
        dest="max_image_tokens",
        type=image_tokens,
        metavar="N",
        help="scale images to at most N patches, below the model's own budget: faster vision and less memory on "
        "large photos, at some cost in small objects (default: the model's)",
    )


def image_options(args: argparse.Namespace) -> dict:
    """The `Request` fields of `add_image_options` ({} for a command without them)."""
    if not hasattr(args, "orientation"):
        return {}
    return {"orientation": args.orientation, "max_image_tokens": args.max_image_tokens}


def add_rows(p: argparse.ArgumentParser) -> None:
    """--max-rows (alias --batch-size) and --memory-limit: how much of the device one run takes."""
    p.add_argument(
        "--max-rows",
        "--batch-size",
        dest="max_rows",
        type=positive_int,
        help="sequences decoded together in one engine step (default: sized for the device's memory)",
    )
    add_memory_limit(p)


def add_memory_limit(p: argparse.ArgumentParser) -> None:
    """--memory-limit: the memory one run may use (`apply_memory_limit` sets it before the model loads)."""
    p.add_argument(
        "--memory-limit",
        type=byte_size(1e9),
        metavar="GB",
        help="memory this run may use (MLX's memory limit); rows, vision batches and prefill pieces are sized "
        "within it (default: what the device lends the GPU)",
    )


def apply_memory_limit(args: argparse.Namespace) -> None:
    """Set MLX's memory limit from --memory-limit (before the model loads: its budget is measured then)."""
    if getattr(args, "memory_limit", None) is not None:
        mx.set_memory_limit(int(args.memory_limit * 1e9))


# --- data files ---


def add_images_root(p, what: str = "the data file's") -> None:
    """--images: the folder a data file's relative image paths start from."""
    p.add_argument("--images", metavar="DIR", help=f"root of {what} image paths (default: the data file's folder)")


# --- training ---


def add_training(
    p,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    clip: float,
    warmup: int | None,
    warmup_help: str,
    save_every: int | None,
    save_help: str,
) -> None:
    """The flags both trainers take (the demo's `tuner.demo_recipe` and `mlx-locate-finetune`), with each one's
    defaults: --steps, --batch-size (samples per step), --lr, --warmup, --weight-decay, --clip, --seed
    (initialisation and data order), --save-every and --no-compile."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=batch_size, help="samples per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--weight-decay", type=float, default=weight_decay, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--clip", type=float, default=clip, help="gradient norm clip (default: %(default)s)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="initialisation and data-order seed (default: 0)")
    p.add_argument("--save-every", type=int, default=save_every, help=save_help)
    p.add_argument("--no-compile", action="store_true", help="run the training step uncompiled")


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
