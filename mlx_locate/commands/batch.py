"""Folders of images: `mlx-locate-batch --images DIR_OR_GLOB_OR_LIST --query Q [--query ...] --out results.jsonl`.

`python -m mlx_locate.commands.batch` runs the same `main`. Every (image x question) is a `Request` to one batched
`Engine`; a bounded window of images is in flight, so memory does not grow with the folder. A question is a
`--query` under `--task`, or a raw `--prompt`. Output formats:

- `--out results.jsonl`: one line per image, written, flushed and fsynced as soon as all its questions are
  answered, then, once the run is done, in the sorted order of the image paths (`annotate.write_sorted`), so a
  run, a resumed run and merged shards write the same file: `{"image": PATH, "size": [W, H], "results": [{"task": T,
  "query": Q} or {"prompt": P}, ...Result.to_dict()}, ...]}`, results in the order of the questions (lean:
  without `prompt_ids` and `token_probs` unless `--full`). An image that cannot be read, decoded or
  preprocessed, or whose prompt does not fit, gets `{"image": PATH, "error": "..."}` and the run goes on;
  only a failure of the model or of the output stops it (exit 2; every line written stays). Every line ends
  with `"settings"`, what its answers were made with (`AnnotateSettings.record`). Rerunning with the same
  `--out` resumes by image path: images already in the file are skipped; a last line cut short by an
  interruption is dropped and its image done again; a file made with other settings is refused, naming them.
  Delete an error line to retry that image.
- Exports (`commands/exports.py`), written once the run is done from the whole JSONL, so a resumed run and `--merge`
  write them complete: `--coco F` a COCO dataset (images, categories in the order asked, annotations with
  scores), `--coco-results F` COCO detection results in the same ids, `--yolo DIR` a YOLO dataset, `--voc
  DIR` Pascal VOC XML, `--labelstudio F` Label Studio tasks with predictions (its labelling config printed).
  `image_id` is the 1-based position of the image in the sorted list of all images, `category_id` that of
  the question. Formats without points leave them out and say so.
- `--draw DIR`: `DIR/<image file name>` (same name and format; `.png` added to a name without an image
  suffix) with every question's objects drawn. Images already in the JSONL
  whose drawing is missing are drawn from their JSONL line, without the model.

Many machines: `--shard I/N` runs the I-th of N disjoint parts (a stable hash of each path), `--merge OUT
PART...` joins the parts' JSONL files (of one run's questions and settings), and `--ray [ADDRESS]` spreads the
images over a Ray cluster (`commands/cluster.py`). Exports a run wrote are listed in `OUT.exports.json` and
rewritten by its reruns; `--overwrite` lets exports and `--draw` replace other existing files; a JSONL is never
overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .. import jsonl
from ..draw import draw_objects
from ..parse import LocatedObject
from ..prompts import CATEGORY_SEPARATOR, task_text
from ..request import DEFAULT_TASK
from . import exports, flags
from .folders import (
    LEAN_DROPPED,
    Annotated,
    AnnotateSettings,
    Jsonl,
    OutputError,
    Question,
    annotate,
    output_lines,
    read_image,
    scan_output,
    write_sorted,
)

DEFAULT_IMAGES_PER_TASK = 16
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".heic", ".heif", ".avif")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-locate-batch",
        description="Run LocateAnything questions over a folder of images; resumable JSONL, COCO results, drawings; "
        "shards, merging and Ray clusters for many machines.",
    )
    flags.add_model(p)
    p.add_argument(
        "--images",
        help=f"a folder (its files ending in {', '.join(IMAGE_SUFFIXES)}), a glob pattern ('**' recurses) or a "
        '.jsonl list of paths (one JSON string or {"image": PATH} per line; relative to the list\'s folder)',
    )
    flags.add_questions(p)
    flags.add_categories(p)
    flags.add_max_pixels(p)
    flags.add_image_options(p)
    flags.add_rows(p)
    flags.add_progress(p)
    flags.add_decoding(p)
    flags.add_sampling(p)
    flags.add_tiling(p)
    p.add_argument(
        "--out", type=flags.output_path, help="JSONL results, one line per image; an existing file is resumed"
    )
    p.add_argument("--full", action="store_true", help=f"keep {' and '.join(LEAN_DROPPED)} in the JSONL")
    p.add_argument(
        "--coco", metavar="PATH", type=flags.output_path, help="also write a COCO dataset (instances JSON with scores)"
    )
    p.add_argument(
        "--coco-results",
        metavar="PATH",
        type=flags.output_path,
        help="also write COCO detection results, in --coco's ids",
    )
    p.add_argument(
        "--yolo",
        metavar="DIR",
        type=flags.output_path,
        help="also write a YOLO dataset: DIR/images, DIR/labels, DIR/data.yaml",
    )
    p.add_argument(
        "--voc", metavar="DIR", type=flags.output_path, help="also write one Pascal VOC XML per image into DIR"
    )
    p.add_argument(
        "--labelstudio", metavar="PATH", type=flags.output_path, help="also write Label Studio tasks with predictions"
    )
    p.add_argument(
        "--draw", metavar="DIR", type=flags.output_path, help="save each image with its objects drawn as DIR/<name>.png"
    )
    flags.add_overwrite(p, "existing export files this run did not write and --draw drawings")

    m = p.add_argument_group("many machines")
    m.add_argument("--shard", type=shard_spec, metavar="I/N", help="run only part I of N (1-based; a hash of the path)")
    m.add_argument(
        "--merge",
        nargs="+",
        metavar="PATH",
        help="OUT PART [PART ...]: join the JSONL files of shards into OUT without duplicates (with exports: "
        "write them from the joined lines)",
    )
    m.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on a Ray cluster (pip install 'mlx-locate[cluster]'): the cluster at ADDRESS, or without it "
        "the one `ray start` made on this machine, else a local one",
    )
    m.add_argument(
        "--actors", type=flags.positive_int, help="Ray: model copies (default: one per 'mlx' resource, GPU or node)"
    )
    m.add_argument(
        "--images-per-task",
        type=flags.positive_int,
        default=DEFAULT_IMAGES_PER_TASK,
        help="Ray: images sent to a worker at once; a dead worker's task is redone elsewhere (default: %(default)s)",
    )
    return p


def shard_spec(text: str) -> tuple[int, int]:
    """`"I/N"` -> (I, N) with 1 <= I <= N."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 1/4, got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"I/N needs 1 <= I <= N, got {text!r}")
    return index, count


def shard_of(path: str, count: int) -> int:
    """The 1-based shard of image `path` among `count`: a hash of the path's UTF-8 bytes, the same in every
    process and on every machine (unlike Python's salted `hash`)."""
    digest = hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count + 1


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot express; each exits with status 2 through `parser.error`."""
    if args.merge is not None:
        used = [
            f"--{n}"
            for n in ("images", "out", "query", "categories", "prompt", "draw", "shard", "ray")
            if getattr(args, n)
        ]
        if used:
            parser.error(f"--merge joins finished outputs; drop {', '.join(used)}")
        if len(args.merge) < 2:
            parser.error("--merge needs OUT and at least one PART")
        return
    if args.images is None or args.out is None:
        parser.error("--images and --out are required (or --merge OUT PART...)")
    flags.check_questions(parser, args)
    flags.check_decoding(parser, args)
    flags.check_tiling_flags(parser, args)
    if args.overwrite and not (export_targets(args) or args.draw):
        parser.error("--overwrite only applies to exports and --draw")
    if args.ray is None and args.actors is not None:
        parser.error("--actors only applies to --ray")


def settings_of(args: argparse.Namespace) -> AnnotateSettings:
    """The run's settings; every question's prompt text is checked (`ValueError`) before the model loads."""
    if args.prompt is not None:
        questions = tuple(Question(None, None, prompt) for prompt in args.prompt)
    else:
        task = args.task or DEFAULT_TASK
        categories = flags.categories_of(args)
        queries = [CATEGORY_SEPARATOR.join(categories)] if categories is not None else args.query or [None]
        questions = tuple(Question(task, query) for query in queries)
    for q in questions:
        if q.prompt is None:
            task_text(q.task, q.query)
    return AnnotateSettings(
        questions=questions,
        options={**flags.request_options(args), **flags.tiling_of(args)},
        max_pixels=args.max_pixels,
        full=args.full,
        max_rows=args.max_rows,
        model=flags.model_settings(args),
    )


def list_images(spec: str) -> list[str]:
    """The images of a folder (files with an image suffix), a glob pattern or a .jsonl list; sorted, unique."""
    source = Path(spec).expanduser()
    kinds = "give a folder, a glob such as 'photos/*.jpg' or a .jsonl list of paths"
    if not source.exists() and glob.escape(str(source)) == str(source):  # a path, not a pattern
        raise FileNotFoundError(f"{spec!r} does not exist; {kinds}")
    if source.is_dir():
        found = [p for p in source.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    elif source.suffix == ".jsonl" and source.is_file():
        found = read_image_list(source)
    else:
        found = [Path(p) for p in glob.glob(str(source), recursive=True) if Path(p).is_file()]
    if not found:
        raise FileNotFoundError(f"no image files in {spec!r}; {kinds}")
    return [str(p) for p in sorted(set(found))]


def read_image_list(path: Path) -> list[Path]:
    """The paths of a JSONL list: each line a JSON string or an object with an "image" key (so an output
    JSONL is a list too); relative paths are taken from the list's folder."""
    paths = []
    for number, entry in jsonl.values(path.read_text(encoding="utf-8"), path):
        image = entry.get("image") if isinstance(entry, dict) else entry
        if not isinstance(image, str) or not image:
            raise ValueError(f'{path}:{number} is neither a path string nor an object with an "image" path')
        paths.append(path.parent / Path(image).expanduser())
    return paths


def inputs_of(images: list[str], targets: dict[str, Path], owned: exports.Manifest, draw: str | None) -> list[str]:
    """`images` but the run's own outputs (a recursive glob over a folder that holds them): the files its JSONL's
    runs exported, those in its folder exports, and the drawings of the other images."""
    folders = [exports.key(t) for kind, t in targets.items() if kind in exports.FOLDERS]
    drawn = {exports.key(Path(p)): exports.key(drawing_path(draw, p)) for p in images} if draw else {}
    drawings = {drawing for image, drawing in drawn.items() if drawing != image}
    kept = []
    for image in images:
        path = exports.key(Path(image))
        if path not in owned and path not in drawings and not any(exports.inside(path, f) for f in folders):
            kept.append(image)
    if not kept:
        raise FileNotFoundError("the images given are all outputs of this run (exports, drawings); give others")
    if len(kept) < len(images):
        print(f"note: {len(images) - len(kept)} files of this run's outputs left out of --images", file=sys.stderr)
    return kept


def drawing_path(folder: str | Path, image: str) -> Path:
    """Where `--draw` saves an image's drawing: under its own file name, so in its own format (JPEG stays
    JPEG); a name without an image suffix gets `.png`."""
    name = Path(image).name
    return Path(folder) / (name if Path(name).suffix.lower() in IMAGE_SUFFIXES else f"{name}.png")


def objects_of(entry: dict) -> list[LocatedObject]:
    """The objects of a JSONL line, as `LocatedObject`s again (for drawing without the model)."""
    names = [f.name for f in dataclasses.fields(LocatedObject)]
    return [
        LocatedObject(**{n: tuple(o[n]) if isinstance(o.get(n), list) else o.get(n) for n in names})
        for result in entry["results"]
        for o in result["objects"]
    ]


def draw_line(
    line: dict,
    image: Image.Image | None,
    folder: str,
    max_pixels: int | None,
    overwrite: bool,
    orientation: str = "exif",
) -> None:
    """Draw an answered line's objects; `image` None reads it again (a resumed or remote line)."""
    if image is None:
        image = read_image(line["image"], max_pixels, orientation)
        if isinstance(image, dict):
            print(f"warning: not drawn: {image['error']}", file=sys.stderr)
            return
    try:
        draw_objects(image, objects_of(line), drawing_path(folder, line["image"]), overwrite=overwrite)
    except OSError as e:
        raise OutputError(f"cannot write {drawing_path(folder, line['image'])}: {e}") from e


def export_targets(args: argparse.Namespace) -> dict[str, Path]:
    """The exports asked for: kind -> path."""
    return {kind: Path(getattr(args, kind)) for kind in exports.FLAGS if getattr(args, kind)}


def owned_exports(jsonls: Iterable[Path]) -> exports.Manifest:
    """The export files that earlier runs writing these JSONL files recorded."""
    return {k: v for p in jsonls for k, v in exports.read_manifest(exports.manifest_path(p)).items()}


def write_exports(targets: dict[str, Path], out: Path, ids: dict[str, int], groups: list[list[str]]) -> None:
    """Write every export from the whole JSONL `out`, remove what earlier runs wrote in the folder exports that is
    no longer theirs, and record the files written beside it (those written before a failure too, so that the rerun
    may replace them); a failure leaves `out` intact."""
    if not targets:
        return
    ds = exports.dataset(output_lines(out), ids, groups, exports.images_root(ids))
    manifest = exports.manifest_path(out)
    owned = exports.read_manifest(manifest)
    written: exports.Manifest = {}
    removed: list[str] = []
    try:
        for kind, target in targets.items():
            for path, fingerprint in exports.write_export(kind, ds, target):
                written[path] = fingerprint
        removed = exports.remove_stale(targets, owned, written)
    except OSError as e:
        raise OutputError(
            f"cannot write {target}: {e}; {out} is intact, run the same command again to write the exports"
        ) from e
    finally:
        exports.record(manifest, owned, written, removed)
    notes = []
    if removed:
        notes.append(f"{len(removed)} files of earlier exports removed (their images are no longer in {out})")
    points = exports.count_points(ds)
    pointless = [exports.FLAGS[k] for k in targets if k in exports.POINTLESS]
    if points and pointless:
        notes.append(f"{points} points left out of {', '.join(pointless)} (no points in the format)")
    turned = [line["image"] for line in ds.lines if line["turn"] != 1]
    if turned and {"coco", "coco_results"} & set(targets):
        notes.append(
            f"{len(turned)} images (such as {turned[0]}) carry an EXIF orientation and are given in their stored "
            "frame (--orientation stored); COCO readers that turn images by it (OpenCV, browsers) show them turned"
        )
    if "coco_results" in targets and not exports.coco_results(ds):
        notes.append(f"no boxes: {targets['coco_results']} is an empty list, which pycocotools' loadRes refuses")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if "labelstudio" in targets:
        print("Label Studio labelling config (Settings > Labeling Interface > Code):", file=sys.stderr)
        print(exports.labelstudio_config(ds.categories, points=points > 0))


def check_new(paths: Iterable[Path], overwrite: bool, what: str) -> None:
    clash = next((p for p in paths if p.exists()), None)
    if clash is not None and not overwrite:
        raise FileExistsError(f"{clash} already exists; pass --overwrite to replace {what}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        if args.merge is not None:
            return merge(Path(args.merge[0]), [Path(p) for p in args.merge[1:]], export_targets(args), args.overwrite)
        return run(args)
    except (OSError, ValueError, ImportError, OutputError) as e:  # OSError: a path that cannot be read or made
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    # Everything the user gave is checked before the (slow) model load.
    settings = settings_of(args)
    out = Path(args.out)
    flags.check_file_path(out, "--out", "results.jsonl")
    targets = export_targets(args)
    owned = owned_exports([out])
    images = inputs_of(list_images(args.images), targets, owned, args.draw)
    part = images if args.shard is None else [p for p in images if shard_of(p, args.shard[1]) == args.shard[0]]
    scan = scan_output(out, [q.key() for q in settings.questions], settings.record())
    if scan.unrecorded:
        print(jsonl.unrecorded_note(scan.unrecorded, out), file=sys.stderr)
    done = scan.done
    pending = [p for p in part if p not in done]
    exports.check_targets(targets, owned, args.overwrite, [out])
    if set(exports.FOLDERS) & set(targets):
        exports.flat_names(images, exports.images_root(images))  # names that clash: refused now, not after the run
    if args.draw:
        flags.check_folder("--draw", Path(args.draw))
        names: dict[Path, str] = {}
        for p in part:
            if (other := names.setdefault(drawing_path(args.draw, p), p)) != p:
                raise ValueError(
                    f"{other} and {p} would both be drawn as {drawing_path(args.draw, p)}; --draw needs distinct "
                    "file names"
                )
        check_new((drawing_path(args.draw, p) for p in pending), args.overwrite, "drawings")
        Path(args.draw).mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.ray is not None:
        from . import cluster

        cluster.require_ray()
    if not pending:
        lines = None
    elif args.ray is not None:
        model = {"path_or_hub_id": args.model, "dtype": args.dtype, "adapter_path": args.adapter}
        lines = cluster.ray_lines(args.ray or None, pending, model, settings, args.actors, args.images_per_task)
    else:
        lines = annotate(flags.load_model(args), pending, settings)

    if args.draw and done:
        in_part = set(part)
        for line in output_lines(out):
            if line["image"] in in_part and "results" in line and not drawing_path(args.draw, line["image"]).exists():
                draw_line(line, None, args.draw, args.max_pixels, overwrite=False, orientation=args.orientation)
    workers = set()
    if lines is not None:
        bar = {"total": len(part), "initial": len(part) - len(pending)}
        code = write_lines(lines, out, done, args, bar, workers)
        if code:
            return code
        write_sorted(out, [out])  # done: the lines in the images' order, whatever order they finished in

    ids = {path: i for i, path in enumerate(images, start=1)}
    write_exports(targets, out, ids, [q.names() for q in settings.questions])
    failed = sum(not done[p] for p in part)
    where = f" by {len(workers)} Ray workers" if args.ray is not None and pending else ""
    print(
        f"{len(part)} images ({len(pending)} run now{where}), {failed} with errors; results in {out}"
        + (f", drawings in {args.draw}" if args.draw else ""),
        file=sys.stderr,
    )
    return 0


def write_lines(
    lines: Iterator[Annotated], out: Path, done: dict[str, bool], args: argparse.Namespace, bar: dict, workers: set
) -> int:
    """Append each new line to `out` (and draw it) as it comes, under a progress bar (`bar`: tqdm's arguments);
    0, or the exit status of a stopped run, said on stderr once the bar is closed."""
    jsonl = Jsonl(out)
    written = errors = 0
    try:
        with tqdm(unit="image", disable=args.no_progress, **bar) as progress:
            for line, image, worker in lines:
                if line["image"] in done:  # a task redone after a Ray worker died
                    continue
                jsonl.write(line)
                done[line["image"]] = "results" in line
                written, errors = written + 1, errors + ("error" in line)
                workers.add(worker)
                if args.draw and "results" in line:
                    draw_line(line, image, args.draw, args.max_pixels, args.overwrite)
                progress.set_postfix(errors=errors, refresh=False)
                progress.update()
        return 0
    except KeyboardInterrupt:
        print(f"interrupted: {written} lines written to {out}; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as e:  # the output, the model or the cluster failed: say so, without a traceback
        reason = str(e) if isinstance(e, OutputError) else f"the run stopped: {type(e).__name__}: {e}"
        print(
            f"error: {reason}\n{written} lines written to {out} in this run are kept; run the same command again "
            "to resume",
            file=sys.stderr,
        )
        return 2
    finally:
        lines.close()  # stops a Ray run's workers now, not when the generator is collected
        jsonl.close()


def merge(out: Path, parts: list[Path], targets: dict[str, Path], overwrite: bool) -> int:
    """Join the JSONL outputs `parts` into `out`, as one run over all their images writes it: one line per
    image (an answered line wins over an error line, else the first), in the images' sorted order; then the
    exports `targets` of the joined lines (ids: positions in their sorted list of images, the same as a single
    run over the whole folder)."""
    if out.exists():
        raise FileExistsError(f"{out} already exists; --merge writes a new file")
    for part in parts:
        if not part.is_file():
            raise FileNotFoundError(f"no such JSONL file: {part}")
    exports.check_targets(targets, owned_exports([out, *parts]), overwrite, [out, *parts])
    questions = settings = first = None
    unrecorded = 0
    for part in parts:  # every line as the first part's that says: one run's questions and settings
        against = "on its first line" if first is None else f"in {first}"
        scan = scan_output(part, questions, settings, False, against, "; merge the parts of one run")
        first = first or (part if scan.settings is not None else None)
        questions, settings, unrecorded = scan.questions, scan.settings, unrecorded + scan.unrecorded
    if unrecorded:
        print(jsonl.unrecorded_note(unrecorded, "the parts", "merged as they are"), file=sys.stderr)
    if set(exports.FOLDERS) & set(targets):
        images = sorted({line["image"] for part in parts for line in output_lines(part)})
        exports.flat_names(images, exports.images_root(images))  # names that clash: refused before `out` is written
    written, duplicates = write_sorted(out, parts)
    if targets:
        ids = {line["image"]: i for i, line in enumerate(output_lines(out), start=1)}
        questions = [Question(q.get("task"), q.get("query"), q.get("prompt")) for q in questions or []]
        write_exports(targets, out, ids, [q.names() for q in questions])
    print(f"{written} images from {len(parts)} files into {out} ({duplicates} duplicates dropped)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
