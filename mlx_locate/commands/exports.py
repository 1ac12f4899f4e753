"""Dataset exports of a results JSONL, for the tools annotators import into: a COCO dataset and COCO detection
results, a YOLO dataset, Pascal VOC XML and Label Studio tasks.

The formats are pure functions of the JSONL's answered lines (`Dataset`) that return file contents;
`write_export` writes them (each file under a temporary name, then renamed; the images of the YOLO and VOC
folders as links, copies where links fail, or the pixels the model saw where their readers would read the file
otherwise: `AsSeen`). What a run wrote is recorded in a manifest beside its JSONL (`manifest_path`), so the rerun
that resumes it regenerates its own exports, while `check_targets` keeps anything else at those paths from being
overwritten unless asked. Categories are the questions, in the order asked.
"""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from xml.sax.saxutils import quoteattr

from PIL import Image

from ..parse import PIXEL_DECIMALS, json_pixels
from ..preprocess import displayed_size, displayed_xy, load_image, open_header, photo_notes, to_rgb
from .flags import check_folder

FLAGS = {  # export -> its flag
    "coco": "--coco",
    "coco_results": "--coco-results",
    "yolo": "--yolo",
    "voc": "--voc",
    "labelstudio": "--labelstudio",
}
FOLDERS = ("yolo", "voc")  # exports that are a folder of files; the others are one file
POINTLESS = ("coco", "coco_results", "yolo", "voc")  # formats without points: theirs are left out
LABEL_STUDIO_IMAGES = "/data/local-files/?d="  # Label Studio's URL of a file under its local-files root
# The image suffixes the YOLO and VOC readers all take (supervision's `from_yolo` and `from_pascal_voc` list them,
# ultralytics' IMG_FORMATS holds them). They skip any other image, so HEIC, AVIF, GIF and MPO images are exported
# as JPEG.
READER_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")
JPEG_QUALITY = 95


@dataclass(frozen=True)
class Dataset:
    """The answered images of a JSONL, in its order, with their COCO ids and the category names."""

    lines: list[dict]  # {"image": PATH, "size": [W, H], "orientation": FRAME, "results": [{"objects": [...]}, ...]}
    ids: dict[str, int]  # image path -> COCO image id
    groups: list[list[str]]  # each question's category names (several for a detect question of several)
    root: Path  # the images' folder: file names are relative to it

    @property
    def categories(self) -> list[str]:
        """Every question's names, in the order asked."""
        return [name for names in self.groups for name in names]

    def objects(self, line: dict) -> Iterable[tuple[int, dict]]:
        """(0-based category, object) of every object of a line: its question's, or for a question of several
        categories the one its label names (an object labelled otherwise is left out)."""
        first = 0
        for names, result in zip(self.groups, line["results"], strict=True):
            for obj in result["objects"]:
                if len(names) == 1:
                    yield first, obj
                elif obj.get("label") in names:
                    yield first + names.index(obj["label"]), obj
            first += len(names)

    def relative(self, line: dict) -> str:
        return relative(line["image"], self.root)


def dataset(lines: Iterable[dict], ids: dict[str, int], groups: list[list[str]], root: Path) -> Dataset:
    """The answered lines of `lines` that have an id, kept to what the exports read (the frame of their boxes:
    "exif" in a JSONL written before lines had one), with the EXIF orientation a viewer turns that frame by
    ("turn": 1 but for a line in the stored frame of a tagged file)."""
    kept = []
    for line in lines:
        if "results" in line and line["image"] in ids:
            frame = next((r["orientation"] for r in line["results"] if "orientation" in r), "exif")
            kept.append(
                {
                    "image": line["image"],
                    "size": line["size"],
                    "orientation": frame,
                    "turn": 1 if frame == "exif" else file_orientation(Path(line["image"]), line["size"]),
                    "results": [{"objects": r["objects"]} for r in line["results"]],
                }
            )
    return Dataset(kept, ids, groups, root)


def file_orientation(path: Path, size: list[int]) -> int:
    """The EXIF orientation of the image file at `path` (1 where it cannot be read: an image on another machine)."""
    try:
        with path.open("rb") as fp:
            return photo_notes(open_header(fp, str(path), size[0] * size[1])).exif_orientation
    except (OSError, ValueError):
        return 1


def images_root(paths: Iterable[str]) -> Path:
    """The deepest folder that holds every image."""
    folders = {os.path.dirname(os.path.abspath(p)) for p in paths}
    return Path(os.path.commonpath(folders)) if folders else Path.cwd()


def count_points(ds: Dataset) -> int:
    return sum("point" in obj for line in ds.lines for _, obj in ds.objects(line))


def xywh(box: list[float]) -> list[float]:
    x1, y1, x2, y2 = box
    return list(json_pixels((x1, y1, x2 - x1, y2 - y1)))


# --- The formats: Dataset -> file contents ------------------------------------------------------------------


def coco_results(ds: Dataset) -> list[dict]:
    """COCO detection results (`COCOeval`'s `loadRes`), in the ids of `coco_dataset`; points left out."""
    return [
        {"image_id": ds.ids[line["image"]], "category_id": c + 1, "bbox": xywh(obj["box"]), "score": obj["confidence"]}
        for line in ds.lines
        for c, obj in ds.objects(line)
        if "box" in obj
    ]


def coco_dataset(ds: Dataset) -> dict:
    """A COCO instances JSON: images (file names relative to the images' folder), categories, annotations."""
    images = [
        {
            "id": ds.ids[line["image"]],
            "file_name": ds.relative(line),
            "width": line["size"][0],
            "height": line["size"][1],
        }
        for line in ds.lines
    ]
    annotations = []
    for result in coco_results(ds):
        _, _, w, h = result["bbox"]
        annotations.append({"id": len(annotations) + 1, **result, "area": round(w * h, PIXEL_DECIMALS), "iscrowd": 0})
    categories = [{"id": i, "name": name, "supercategory": "object"} for i, name in enumerate(ds.categories, 1)]
    return {"images": images, "categories": categories, "annotations": annotations}


def relative(image: str, root: Path) -> str:
    return Path(os.path.relpath(Path(image).absolute(), root.absolute())).as_posix()


def flat_names(images: Iterable[str], root: Path) -> dict[str, str]:
    """A file name in one folder for each image (paths under `root`): its own name; images whose stems clash (the
    same name in two subfolders, a.png beside a.jpg, A.png beside a.png: a Mac's disk does not tell case apart)
    take their subfolders into it (`sub__a.png`), then their suffix (`a_png.png`)."""
    names = {}
    for image in images:
        rel = Path(relative(image, root))
        names[image] = (rel.name, "__".join(rel.with_suffix("").parts), rel.suffix)

    def stems(chosen: dict[str, str]) -> Counter:
        return Counter(Path(n).stem.casefold() for n in chosen.values())

    chosen = {image: name for image, (name, _, _) in names.items()}
    for widen in (lambda flat, suffix: flat + suffix, lambda flat, suffix: f"{flat}_{suffix[1:]}{suffix}"):
        counts = stems(chosen)
        chosen = {i: widen(*names[i][1:]) if counts[Path(n).stem.casefold()] > 1 else n for i, n in chosen.items()}
    clashes = [image for image, name in chosen.items() if stems(chosen)[Path(name).stem.casefold()] > 1]
    if clashes:
        raise ValueError(
            f"{clashes[0]} and {clashes[1]} would both be exported as {Path(chosen[clashes[0]]).stem!r} (--yolo, "
            "--voc); rename one"
        )
    return chosen


@dataclass(frozen=True)
class AsSeen:
    """An exported image as the model saw it (`load_image` in the JSONL's frame), written when the export is."""

    source: Path
    orientation: str  # the frame of the JSONL line: "exif" or "stored"
    max_pixels: int  # its size in the JSONL: the run read it at that size


def folder_images(ds: Dataset) -> dict[str, tuple[str, Path | AsSeen]]:
    """The images of a folder export (YOLO, VOC), by JSONL path: (its file name in the export's images/, its
    content: a `Path` to link to, or `AsSeen`, the image as the model saw it, as <stem>.jpg for a format the
    readers skip)."""
    images = {}
    by_image = {line["image"]: line for line in ds.lines}
    for image, name in flat_names(by_image, ds.root).items():
        width, height = by_image[image]["size"]
        seen = AsSeen(Path(image), by_image[image]["orientation"], width * height)
        if Path(name).suffix.lower() not in READER_SUFFIXES:
            images[image] = (f"{Path(name).stem}.jpg", seen)  # stems are unique: no other image takes the name
        elif by_image[image]["turn"] != 1:
            # The readers turn an image by its EXIF orientation (cv2.imread, and Pillow's exif_transpose in
            # ultralytics and supervision), so they show the "exif" frame: a file of a line in the stored frame
            # that carries the tag is written without it.
            images[image] = (name, seen)
        else:
            images[image] = (name, Path(image))
    return images


def yaml_string(text: str) -> str:
    """`text` as a YAML double-quoted scalar: JSON's escapes, characters written as themselves (a YAML reader
    takes JSON's surrogate pairs for two characters), those YAML may not hold as themselves escaped."""
    return "".join(
        c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
        for c in json.dumps(text, ensure_ascii=False)
    )


def yolo_files(ds: Dataset, folder: Path) -> dict[str, str | Path | AsSeen]:
    """A YOLO dataset: images/<name> (`folder_images`), labels/<stem>.txt with `class cx cy w h` normalised to the
    image, and data.yaml (the same images for train and val)."""
    files: dict[str, str | Path | AsSeen] = {}
    by_image = {line["image"]: line for line in ds.lines}
    for image, (name, content) in folder_images(ds).items():
        width, height = by_image[image]["size"]
        files[f"images/{name}"] = content
        rows = []
        for category, obj in ds.objects(by_image[image]):
            if "box" in obj:
                x1, y1, x2, y2 = obj["box"]
                values = ((x1 + x2) / 2 / width, (y1 + y2) / 2 / height, (x2 - x1) / width, (y2 - y1) / height)
                rows.append(" ".join([str(category), *(f"{v:.6f}" for v in values)]))
        files[f"labels/{Path(name).stem}.txt"] = "".join(row + "\n" for row in rows)
    names = "\n".join(f"  {i}: {yaml_string(name)}" for i, name in enumerate(ds.categories))
    path = yaml_string(str(folder.absolute()))
    files["data.yaml"] = f"path: {path}\ntrain: images\nval: images\nnames:\n{names}\n"
    return files


def voc_files(ds: Dataset, folder: Path) -> dict[str, str | Path | AsSeen]:
    """Pascal VOC: images/<name> (`folder_images`) and one XML per image (<stem>.xml) naming it, with its size and
    boxes (1-based corners, VOC's rule)."""
    files: dict[str, str | Path | AsSeen] = {}
    images = folder_images(ds)
    for line in ds.lines:
        name, content = images[line["image"]]
        files[f"images/{name}"] = content
        width, height = line["size"]
        root = ET.Element("annotation")
        ET.SubElement(root, "folder").text = "images"
        ET.SubElement(root, "filename").text = name
        ET.SubElement(root, "path").text = str((folder / "images" / name).absolute())
        size = ET.SubElement(root, "size")
        for key, value in (("width", width), ("height", height), ("depth", 3)):
            ET.SubElement(size, key).text = str(value)
        for category, obj in ds.objects(line):
            if "box" not in obj:
                continue
            x1, y1, x2, y2 = obj["box"]
            element = ET.SubElement(root, "object")
            ET.SubElement(element, "name").text = ds.categories[category]
            for key in ("pose", "truncated", "difficult"):
                ET.SubElement(element, key).text = "Unspecified" if key == "pose" else "0"
            ET.SubElement(element, "score").text = str(obj["confidence"])
            xmin, ymin = round(x1) + 1, round(y1) + 1
            corners = (xmin, ymin, max(round(x2), xmin), max(round(y2), ymin))
            box = ET.SubElement(element, "bndbox")
            for key, value in zip(("xmin", "ymin", "xmax", "ymax"), corners, strict=True):
                ET.SubElement(box, key).text = str(value)
        ET.indent(root)
        files[f"{Path(name).stem}.xml"] = ET.tostring(root, encoding="unicode") + "\n"
    return files


def labelstudio_tasks(ds: Dataset) -> list[dict]:
    """Label Studio tasks with predictions: boxes as `rectanglelabels`, points as `keypointlabels`, in percent
    of the image; images as local-files URLs under the images' folder. Always in the frame a browser shows (the
    EXIF orientation applied), whatever the JSONL's frame."""
    tasks = []
    for line in ds.lines:
        size, turn = line["size"], line["turn"]
        width, height = displayed_size(size, turn)
        results, scores = [], []
        for category, obj in ds.objects(line):
            frame = {"original_width": width, "original_height": height, "image_rotation": 0}
            name = ds.categories[category]
            if "box" in obj:
                (ax, ay), (bx, by) = (displayed_xy(x, y, size, turn) for x, y in (obj["box"][:2], obj["box"][2:]))
                x1, x2, y1, y2 = min(ax, bx), max(ax, bx), min(ay, by), max(ay, by)
                value = {"x": x1 / width * 100, "y": y1 / height * 100, "width": (x2 - x1) / width * 100}
                value.update(height=(y2 - y1) / height * 100, rotation=0, rectanglelabels=[name])
                kind, control = "rectanglelabels", "label"
            else:
                x, y = displayed_xy(*obj["point"], size, turn)
                value = {"x": x / width * 100, "y": y / height * 100, "width": 0.5, "keypointlabels": [name]}
                kind, control = "keypointlabels", "keypoint"
            value = {k: round(v, 4) if isinstance(v, float) else v for k, v in value.items()}
            item = {"id": f"r{len(results) + 1}", "type": kind, "from_name": control, "to_name": "image", **frame}
            results.append({**item, "value": value, "score": obj["confidence"]})
            scores.append(obj["confidence"])
        prediction = {"model_version": "mlx-locate", "result": results}
        if scores:
            prediction["score"] = sum(scores) / len(scores)
        tasks.append({"data": {"image": LABEL_STUDIO_IMAGES + quote(ds.relative(line))}, "predictions": [prediction]})
    return tasks


def labelstudio_config(categories: list[str], points: bool) -> str:
    """The labelling config of a Label Studio project that reads `labelstudio_tasks`; a key point control only
    with `points` (with one, Label Studio's own COCO export puts every box in one category)."""
    labels = "".join(f"\n    <Label value={quoteattr(name)}/>" for name in categories)
    keypoints = f'  <KeyPointLabels name="keypoint" toName="image">{labels}\n  </KeyPointLabels>\n' if points else ""
    return (
        '<View>\n  <Image name="image" value="$image"/>\n'
        f'  <RectangleLabels name="label" toName="image">{labels}\n  </RectangleLabels>\n{keypoints}</View>'
    )


def export_files(kind: str, ds: Dataset, target: Path) -> dict[str, str | Path | AsSeen]:
    """The files of export `kind` at `target`: names relative to a folder export, "" for a file export."""
    if kind == "yolo":
        return yolo_files(ds, target)
    if kind == "voc":
        return voc_files(ds, target)
    content = {"coco": coco_dataset, "coco_results": coco_results, "labelstudio": labelstudio_tasks}[kind](ds)
    return {"": json.dumps(content) + "\n"}


# --- Writing, and what a run may overwrite ---------------------------------------------------------------------


def manifest_path(out: Path) -> Path:
    """Beside the JSONL `out`: the files its runs exported."""
    return out.with_name(out.name + ".exports.json")


Manifest = dict[str, "list[int] | None"]  # absolute path -> `fingerprint` as written (None: a manifest of paths only)


def fingerprint(path: Path) -> list[int]:
    """What a file's rewrite changes: its size and modification time (of a link, the link's own)."""
    status = os.lstat(path)
    return [status.st_size, status.st_mtime_ns]


def read_manifest(path: Path) -> Manifest:
    if not path.is_file():
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))["written"]
        if isinstance(written, list):  # written before fingerprints: paths alone
            return dict.fromkeys(map(str, written))
        return {str(k): v for k, v in written.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not a manifest of mlx-locate-batch exports; remove it") from None


def record(path: Path, owned: Manifest, written: Manifest, removed: Iterable[str] = ()) -> None:
    """Write the manifest at `path`: what it held (`owned`, as read before the run wrote), `written` added (or
    refreshed), `removed` left out."""
    entries = {**owned, **written}
    for gone in removed:
        entries.pop(gone, None)
    replace_text(path, json.dumps({"written": dict(sorted(entries.items()))}, indent=1) + "\n")


def key(path: Path) -> str:
    return str(path.absolute())


def inside(path: str, folder: str) -> bool:
    """Whether the absolute path `path` lies below the absolute folder `folder`."""
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def changed(path: Path, owned: Manifest) -> bool:
    """Whether a file a run wrote was changed since (by hand, or by an annotation tool)."""
    recorded = owned.get(key(path))
    return recorded is not None and fingerprint(path) != recorded


def writable(path: Path, folder: Path) -> None:
    """Raise an `OSError` naming `path` unless files can be made in `folder` (made if missing)."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {folder} is not writable")


def check_targets(targets: dict[str, Path], owned: Manifest, overwrite: bool, jsonls: Iterable[Path]) -> None:
    """Before any work: every export path is its own and none of `jsonls` (nor a manifest); no other path lies in a
    folder export; each can be written, is a folder where a folder is wanted (or a file where a file is), and holds
    nothing but what `owned` (the manifests) lists, as it was written, unless `overwrite`."""
    reserved = {key(p) for path in jsonls for p in (path, manifest_path(path))}
    seen: dict[str, str] = {}
    for kind, target in targets.items():
        flag = FLAGS[kind]
        if key(target) in reserved:
            raise ValueError(f"{flag} {target} is a results JSONL (or its manifest); choose another path")
        if (other := seen.setdefault(key(target), flag)) != flag:
            raise ValueError(f"{other} and {flag} both name {target}; give each its own path")
    others = {**{p: f"the results file {p}" for p in reserved}, **{p: f"{f} {p}" for p, f in seen.items()}}
    for kind, target in targets.items():
        for path, what in others.items():
            if kind in FOLDERS and inside(path, key(target)):
                raise ValueError(f"{what} lies inside {FLAGS[kind]} {target}; give it a path outside that folder")
    for kind, target in targets.items():
        flag = FLAGS[kind]
        if kind in FOLDERS:
            check_folder(flag, target)
            writable(target, target)
            found = sorted(p for p in target.rglob("*") if not p.is_dir()) if target.is_dir() else []
            for sub in [target, *(p for p in target.rglob("*") if p.is_dir())] if target.is_dir() else []:
                writable(target, sub)
        else:
            if target.is_dir():
                raise IsADirectoryError(f"{flag} {target} is a folder; it needs a file name")
            writable(target, target.absolute().parent)
            found = [target] if target.exists() or target.is_symlink() else []
        foreign = [p for p in found if key(p) not in owned]
        edited = [p for p in found if key(p) in owned and changed(p, owned)]
        if overwrite:
            continue
        if foreign:
            what = f"{target} already exists" if foreign == [target] else f"{target} holds {foreign[0]}"
            raise FileExistsError(
                f"{what}, which this run did not write; pass --overwrite to replace it, or choose another {flag}"
            )
        if edited:
            raise FileExistsError(
                f"{edited[0]} was changed after mlx-locate-batch wrote it; pass --overwrite to replace it, or "
                f"choose another {flag}"
            )


def remove_stale(targets: dict[str, Path], owned: Manifest, written: Manifest) -> list[str]:
    """Delete the files of earlier runs in the folder exports that this one did not write again (images gone from
    the folder, or renamed by a clash): a folder export holds the JSONL's images and nothing else of ours."""
    removed = []
    for kind, target in targets.items():
        if kind in FOLDERS:
            for path in sorted(owned):
                if inside(path, key(target)) and path not in written:
                    Path(path).unlink(missing_ok=True)
                    removed.append(path)
    return removed


def staged(path: Path, write: Callable[[Path], None]) -> None:
    """`write` the file under a temporary name beside `path`, then rename it to `path` (a failure leaves `path`
    as it was and no temporary file)."""
    temporary = path.with_name(path.name + ".partial")
    temporary.unlink(missing_ok=True)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def replace_text(path: Path, text: str) -> None:
    staged(path, lambda p: p.write_text(text, encoding="utf-8"))


def place_image(source: Path, path: Path) -> None:
    """`path` becomes a link to the image `source`, or a copy where a link cannot be made."""

    def link(p: Path) -> None:
        try:
            os.symlink(source.absolute(), p)
        except OSError:
            shutil.copy2(source, p)

    staged(path, link)


def place_as_seen(image: AsSeen, path: Path) -> None:
    """`path` becomes `image` as the model saw it, in the format its suffix names and without metadata (no
    orientation tag, sRGB)."""
    pixels = to_rgb(load_image(image.source, image.max_pixels, image.orientation)).copy()
    pixels.info.clear()  # a copy of the pixels alone: neither the file's EXIF nor its colour profile goes along
    kind = Image.registered_extensions()[path.suffix.lower()]
    staged(path, lambda p: pixels.save(p, kind, quality=JPEG_QUALITY))


def write_export(kind: str, ds: Dataset, target: Path) -> Iterator[tuple[str, list[int]]]:
    """Write export `kind` of `ds` at `target`, yielding each file's absolute path and `fingerprint` once it is
    written (so a failure part-way leaves the files before it known, to record)."""
    for name, content in export_files(kind, ds, target).items():
        path = target / name if name else target
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            place_image(content, path)
        elif isinstance(content, AsSeen):
            place_as_seen(content, path)
        else:
            replace_text(path, content)
        yield key(path), fingerprint(path)
