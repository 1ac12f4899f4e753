"""Folders of images: `mlx-locate-batch --model M --images DIR_OR_GLOB --query Q [--query ...] --out results.jsonl`.

`python -m mlx_locate.batch` runs the same `main`. Each image is opened once (one `Session`) and asked every
`--query` in turn. Output formats:

- `--out results.jsonl`: one line per image, written, flushed and fsynced as soon as the image is done:
  `{"image": PATH, "size": [W, H], "results": [{"query": Q, ...Result.to_dict()}, ...]}` (lean: without
  `prompt_ids` and `token_probs` unless `--full`). An image that cannot be read gets
  `{"image": PATH, "error": "..."}` and the run goes on. Rerunning with the same `--out` resumes: images
  already in the file (answered or errored) are skipped; a last line cut short by an interruption is dropped
  and its image done again. Delete an error line to retry that image.
- `--coco out.json`: COCO detection results for every answered image of the run, `[{"image_id", "category_id",
  "bbox": [x, y, w, h], "score"}]`, in pixels; points are not boxes and are left out. `category_id` is the
  1-based position of the query in `--query`; `image_id` the 1-based position of the image in the sorted list
  of images. Both tables are written next to it as `out.images.json`: `{"images": [{"id", "file_name",
  "width", "height"}], "categories": [{"id", "name"}]}`, COCO's dataset layout.
- `--draw DIR`: `DIR/<image file name>.png` with every query's objects drawn. Images already in the JSONL whose
  drawing is missing are drawn from their JSONL line, without the model.

`--overwrite` lets `--coco` and `--draw` replace existing files; the JSONL is never overwritten, only resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .decide import Mode
from .draw import draw_objects
from .generate import DTYPES, positive_int
from .locate import LocateModel, load
from .parse import LocatedObject
from .preprocess import load_image
from .prompts import TASKS, task_text

DEFAULT_TASK = "detect"
DEFAULT_MODE = Mode.HYBRID.value
DEFAULT_MAX_TOKENS = 512
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LEAN_DROPPED = ("prompt_ids", "token_probs")  # per-token fields left out of the JSONL unless --full


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-batch",
        description="Run LocateAnything queries over a folder of images; resumable JSONL, COCO results, drawings.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder or Hugging Face hub id")
    p.add_argument(
        "--images",
        required=True,
        help=f"a folder (its files ending in {', '.join(IMAGE_SUFFIXES)}) or a glob pattern ('**' recurses)",
    )
    p.add_argument("--task", choices=TASKS, default=DEFAULT_TASK, help="prompt template (default: %(default)s)")
    p.add_argument("--query", action="append", help="what to find; repeat for several queries (COCO categories)")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=DEFAULT_MODE, help="(default: %(default)s)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="generated tokens (default: %(default)s)"
    )
    p.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    p.add_argument("--out", required=True, help="JSONL results, one line per image; an existing file is resumed")
    p.add_argument("--full", action="store_true", help=f"keep {' and '.join(LEAN_DROPPED)} in the JSONL")
    p.add_argument("--coco", metavar="PATH", help="also write COCO detection results (and PATH's .images.json)")
    p.add_argument("--draw", metavar="DIR", help="save each image with its objects drawn as DIR/<name>.png")
    p.add_argument("--overwrite", action="store_true", help="let --coco and --draw replace existing files")
    return p


def list_images(pattern: str) -> list[Path]:
    """The files of folder `pattern` with an image suffix, or the files matching glob `pattern`; sorted."""
    folder = Path(pattern).expanduser()
    if folder.is_dir():
        found = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    else:
        found = [Path(p) for p in glob.glob(str(folder), recursive=True) if Path(p).is_file()]
    if not found:
        raise FileNotFoundError(f"no image files in {pattern!r}; give a folder or a glob such as 'photos/*.jpg'")
    return sorted(found)


def drawing_path(folder: str | Path, image: Path) -> Path:
    return Path(folder) / f"{image.name}.png"


def read_done(path: Path) -> dict[str, dict]:
    """The lines already in the JSONL at `path`, by image; a last line without its newline (an interrupted
    write) is cut off the file. A complete line that is not JSON raises `ValueError`: nothing is rewritten."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with path.open("r+b") as f:
            f.truncate(len(complete))
            f.flush()
            os.fsync(f.fileno())
    done = {}
    for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{number} is not JSON ({e}); fix or remove that line, or use another --out"
            ) from None
        if not isinstance(entry, dict) or "image" not in entry:
            raise ValueError(f"{path}:{number} is not a line of mlx-locate-batch; use another --out")
        done[entry["image"]] = entry
    return done


def check_queries(path: Path, done: dict[str, dict], queries: list[str | None]) -> None:
    for entry in done.values():
        if "results" in entry and [r["query"] for r in entry["results"]] != queries:
            found = [r["query"] for r in entry["results"]]
            raise ValueError(f"{path} holds answers to queries {found}, not {queries}; use another --out to start over")


def image_line(
    model: LocateModel, image_path: Path, queries: list[str | None], args: argparse.Namespace
) -> tuple[dict, Image.Image | None, list[LocatedObject]]:
    """The JSONL entry of one image, the image and its objects; an unreadable image gives an error entry."""
    try:
        image = load_image(image_path)
        session = model.session(image)
        results = [session.locate(q, task=args.task, mode=args.mode, max_tokens=args.max_tokens) for q in queries]
    except (OSError, ValueError) as e:
        return {"image": str(image_path), "error": str(e)}, None, []
    entries = []
    for query, result in zip(queries, results, strict=True):
        entry = result.to_dict()
        if not args.full:
            for key in LEAN_DROPPED:
                del entry[key]
        entries.append({"query": query, **entry})
    line = {"image": str(image_path), "size": list(results[0].image_size), "results": entries}
    return line, image, [obj for r in results for obj in r.objects]


def objects_of(entry: dict) -> list[LocatedObject]:
    """The objects of a JSONL line, as `LocatedObject`s again (for drawing a resumed run)."""
    names = [f.name for f in dataclasses.fields(LocatedObject)]
    return [
        LocatedObject(**{n: tuple(o[n]) if isinstance(o.get(n), list) else o.get(n) for n in names})
        for result in entry["results"]
        for o in result["objects"]
    ]


def coco_tables(images: list[Path], done: dict[str, dict], queries: list[str | None], task: str) -> tuple[list, dict]:
    """COCO detection results and the image and category tables they refer to."""
    detections, table = [], []
    for image_id, path in enumerate(images, start=1):
        entry = done.get(str(path))
        if entry is None or "results" not in entry:
            continue
        width, height = entry["size"]
        table.append({"id": image_id, "file_name": str(path), "width": width, "height": height})
        for category_id, result in enumerate(entry["results"], start=1):
            for obj in result["objects"]:
                if "box" not in obj:
                    continue
                x1, y1, x2, y2 = obj["box"]
                x, y = min(x1, x2), min(y1, y2)
                bbox = [round(v, 2) for v in (x, y, abs(x2 - x1), abs(y2 - y1))]
                detections.append(
                    {"image_id": image_id, "category_id": category_id, "bbox": bbox, "score": obj["confidence"]}
                )
    categories = [{"id": i, "name": q if q is not None else task} for i, q in enumerate(queries, start=1)]
    return detections, {"images": table, "categories": categories}


def coco_tables_path(coco: str | Path) -> Path:
    coco = Path(coco)
    return coco.with_name(f"{coco.stem}.images.json")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.overwrite and not (args.coco or args.draw):
        parser.error("--overwrite only applies to --coco and --draw")
    queries = list(args.query or [None])
    out = Path(args.out)
    try:
        # Everything the user gave is checked before the (slow) model load.
        for query in queries:
            task_text(args.task, query)
        images = list_images(args.images)
        done = read_done(out)
        check_queries(out, done, queries)
        pending = [p for p in images if str(p) not in done]
        if args.coco and not args.overwrite:
            for path in (Path(args.coco), coco_tables_path(args.coco)):
                if path.exists():
                    raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
        if args.draw:
            names = [drawing_path(args.draw, p) for p in images]
            if len(set(names)) < len(names):
                raise ValueError(f"two images in {args.images!r} share a file name; --draw needs distinct names")
            clash = next((drawing_path(args.draw, p) for p in pending if drawing_path(args.draw, p).exists()), None)
            if clash is not None and not args.overwrite:
                raise FileExistsError(f"{clash} already exists; pass --overwrite to replace drawings")
            Path(args.draw).mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        model = load(args.model, dtype=args.dtype) if pending else None
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.draw:
        for path in images:
            entry = done.get(str(path), {})
            if "results" in entry and not drawing_path(args.draw, path).exists():
                draw_objects(load_image(path), objects_of(entry), drawing_path(args.draw, path))

    errors = 0
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(images), initial=len(images) - len(pending)) as bar:
        for path in pending:
            line, image, objects = image_line(model, path, queries, args)
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[str(path)] = line
            errors += "error" in line
            if args.draw and image is not None:
                draw_objects(image, objects, drawing_path(args.draw, path), overwrite=args.overwrite)
            bar.set_postfix(errors=errors)
            bar.update()

    if args.coco:
        detections, tables = coco_tables(images, done, queries, args.task)
        Path(args.coco).write_text(json.dumps(detections))
        coco_tables_path(args.coco).write_text(json.dumps(tables, indent=1))
    failed = sum("error" in done[str(p)] for p in images)
    print(f"{len(images)} images ({len(pending)} run now), {failed} unreadable; results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
