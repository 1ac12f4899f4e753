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
from ..preprocess import load_image, open_header, photo_notes, to_rgb

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
        return Path(os.path.relpath(Path(line["image"]).absolute(), self.root.absolute())).as_posix()


def dataset(lines: Iterable[dict], ids: dict[str, int], groups: list[list[str]], root: Path) -> Dataset:
    """The answered lines of `lines` that have an id, kept to what the exports read (the frame of their boxes:
    "exif" in a JSONL written before lines had one)."""
    kept = [
        {
            "image": line["image"],
            "size": line["size"],
            "orientation": next((r["orientation"] for r in line["results"] if "orientation" in r), "exif"),
            "results": [{"objects": r["objects"]} for r in line["results"]],
        }
        for line in lines
        if "results" in line and line["image"] in ids
    ]
    return Dataset(kept, ids, groups, root)


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


def flat_names(ds: Dataset) -> dict[str, str]:
    """A file name in one folder for each image: its own name; images whose stems clash (the same name in two
    subfolders, a.png beside a.jpg) take their subfolders into it (`sub__a.png`), then their suffix
    (`a_png.png`)."""
    names = {}
    for line in ds.lines:
        rel = Path(ds.relative(line))
        names[line["image"]] = (rel.name, "__".join(rel.with_suffix("").parts), rel.suffix)
    chosen = {image: name for image, (name, _, _) in names.items()}
    for widen in (lambda flat, suffix: flat + suffix, lambda flat, suffix: f"{flat}_{suffix[1:]}{suffix}"):
        stems = Counter(Path(n).stem for n in chosen.values())
        chosen = {i: widen(*names[i][1:]) if stems[Path(n).stem] > 1 else n for i, n in chosen.items()}
    clashes = [n for n, k in Counter(Path(n).stem for n in chosen.values()).items() if k > 1]
    if clashes:
        raise ValueError(f"two images would both be exported as {clashes[0]!r}; rename one")
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
    for image, name in flat_names(ds).items():
        width, height = by_image[image]["size"]
        seen = AsSeen(Path(image), by_image[image]["orientation"], width * height)
        if Path(name).suffix.lower() not in READER_SUFFIXES:
            images[image] = (f"{Path(name).stem}.jpg", seen)  # stems are unique: no other image takes the name
        elif seen.orientation == "stored":
            # The readers turn an image by its EXIF orientation (cv2.imread, and Pillow's exif_transpose in
            # ultralytics and supervision), so they show the "exif" frame: a file of a line in the stored frame
            # that carries the tag is written without it (`place_as_seen`).
            images[image] = (name, seen)
        else:
            images[image] = (name, Path(image))
    return images


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
    names = "\n".join(f"  {i}: {json.dumps(name)}" for i, name in enumerate(ds.categories))
    path = json.dumps(str(folder.absolute()))
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
    of the image; images as local-files URLs under the images' folder."""
    tasks = []
    for line in ds.lines:
        width, height = line["size"]
        results, scores = [], []
        for category, obj in ds.objects(line):
            frame = {"original_width": width, "original_height": height, "image_rotation": 0}
            name = ds.categories[category]
            if "box" in obj:
                x1, y1, x2, y2 = obj["box"]
                value = {"x": x1 / width * 100, "y": y1 / height * 100, "width": (x2 - x1) / width * 100}
                value.update(height=(y2 - y1) / height * 100, rotation=0, rectanglelabels=[name])
                kind, control = "rectanglelabels", "label"
            else:
                x, y = obj["point"]
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


def labelstudio_config(categories: list[str]) -> str:
    """The labelling config of a Label Studio project that reads `labelstudio_tasks`."""
    labels = "".join(f"\n    <Label value={quoteattr(name)}/>" for name in categories)
    return (
        '<View>\n  <Image name="image" value="$image"/>\n'
        f'  <RectangleLabels name="label" toName="image">{labels}\n  </RectangleLabels>\n'
        f'  <KeyPointLabels name="keypoint" toName="image">{labels}\n  </KeyPointLabels>\n</View>'
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


def read_manifest(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    try:
        return set(json.loads(path.read_text(encoding="utf-8"))["written"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a manifest of mlx-locate-batch exports; remove it") from None


def record(path: Path, written: Iterable[str]) -> None:
    """Add `written` (absolute paths) to the manifest at `path`."""
    replace_text(path, json.dumps({"written": sorted(read_manifest(path) | set(written))}, indent=1) + "\n")


def key(path: Path) -> str:
    return str(path.absolute())


def writable(path: Path, folder: Path) -> None:
    """Raise an `OSError` naming `path` unless files can be made in `folder` (made if missing)."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {folder} is not writable")


def check_targets(targets: dict[str, Path], owned: set[str], overwrite: bool, jsonls: Iterable[Path]) -> None:
    """Before any work: every export path is its own, none of `jsonls` (nor a manifest), can be written, is a
    folder where a folder is wanted (or a file where a file is), and holds nothing but what `owned` (the
    manifests) lists, unless `overwrite`."""
    reserved = {key(p) for path in jsonls for p in (path, manifest_path(path))}
    seen: dict[str, str] = {}
    for kind, target in targets.items():
        flag = FLAGS[kind]
        if key(target) in reserved:
            raise ValueError(f"{flag} {target} is a results JSONL (or its manifest); choose another path")
        if (other := seen.setdefault(key(target), flag)) != flag:
            raise ValueError(f"{other} and {flag} both name {target}; give each its own path")
        if kind in FOLDERS:
            if target.exists() and not target.is_dir():
                raise NotADirectoryError(f"{flag} {target} is a file; it needs a folder")
            writable(target, target)
            found = sorted(p for p in target.rglob("*") if not p.is_dir()) if target.is_dir() else []
            foreign = [p for p in found if key(p) not in owned]
            for sub in [target, *(p for p in target.rglob("*") if p.is_dir())] if target.is_dir() else []:
                writable(target, sub)
        else:
            if target.is_dir():
                raise IsADirectoryError(f"{flag} {target} is a folder; it needs a file name")
            writable(target, target.absolute().parent)
            foreign = [target] if target.exists() and key(target) not in owned else []
        if foreign and not overwrite:
            what = f"{target} already exists" if foreign == [target] else f"{target} holds {foreign[0]}"
            raise FileExistsError(
                f"{what}, which this run did not write; pass --overwrite to replace it, or choose another {flag}"
            )


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
    orientation tag, sRGB); a link (`place_image`) where `path` keeps the file's suffix and the file has no
    orientation tag, so readers see those pixels in it."""
    if path.suffix == image.source.suffix:
        with image.source.open("rb") as fp:
            tag = photo_notes(open_header(fp, str(image.source), image.max_pixels)).exif_orientation
        if tag == 1:
            place_image(image.source, path)
            return
    pixels = to_rgb(load_image(image.source, image.max_pixels, image.orientation)).copy()
    pixels.info.clear()  # a copy of the pixels alone: neither the file's EXIF nor its colour profile goes along
    kind = Image.registered_extensions()[path.suffix.lower()]
    staged(path, lambda p: pixels.save(p, kind, quality=JPEG_QUALITY))


def write_export(kind: str, ds: Dataset, target: Path) -> Iterator[str]:
    """Write export `kind` of `ds` at `target`, yielding each file's absolute path once it is written (so a failure
    part-way leaves the files before it known, to record)."""
    for name, content in export_files(kind, ds, target).items():
        path = target / name if name else target
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            place_image(content, path)
        elif isinstance(content, AsSeen):
            place_as_seen(content, path)
        else:
            replace_text(path, content)
        yield key(path)
