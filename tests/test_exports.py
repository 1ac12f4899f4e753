"""`mlx-locate-batch` exports read back by the tools' own libraries (pycocotools, supervision): every box and label
of the JSONL, within 1.5 px; reruns that regenerate their own exports; other files protected; name clashes; photos
(HEIC, AVIF, EXIF orientation) in YOLO's images."""

from __future__ import annotations

import errno
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import supervision as sv
import test_batch
import test_photos
import yaml
from PIL import Image, ImageOps
from pycocotools.coco import COCO

from mlx_locate.commands import exports
from mlx_locate.locate import load
from mlx_locate.preprocess import displayed_size, displayed_xy
from mlx_locate.synthetic.scenes import make_scene

QUERIES = ["circle", "square"]
RUN = ["--query", QUERIES[0], "--query", QUERIES[1], "--mode", "fast", "--max-tokens", "24"]
IMAGES = ["a.png", "one/x.png", "two/x.png", "two/x.jpg"]  # x three times: two subfolders, two suffixes
TOLERANCE = 1.5  # px: VOC's whole pixels; the others keep 3 decimals


@pytest.fixture(scope="module")
def model():
    return load("demo")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Small drawn scenes of circles and squares, in subfolders."""
    root = tmp_path_factory.mktemp("exports") / "images"
    for seed, name in enumerate(IMAGES):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        scene = make_scene(np.random.default_rng(seed), n_objects=3, shapes=("circle", "square"))
        scene.image.save(root / name)
    return root


@pytest.fixture
def run(model, capfd):
    return test_batch.Runner(model, capfd)


def export_args(where: Path) -> list[str]:
    names = {"--coco": "coco.json", "--yolo": "yolo", "--voc": "voc", "--labelstudio": "tasks.json"}
    return [arg for flag, name in names.items() for arg in (flag, str(where / name))]


@pytest.fixture(scope="module")
def exported(model, folder):
    """One run over the folder with every export: the folder of its outputs."""
    where = folder.parent / "out"
    args = ["--images", f"{folder}/**/*.*", "--out", str(where / "results.jsonl"), *export_args(where)]
    code, _ = test_batch.Runner(model, None)(*args, questions=RUN)
    assert code == 0
    return where


def expected(out: Path, root: Path) -> dict[str, list[tuple[str, list[float]]]]:
    """Each answered image (relative to `root`) -> its (category, box) pairs, from the JSONL."""
    boxes = {}
    for line in test_batch.lines_of(out):
        assert "results" in line, line
        rel = Path(line["image"]).relative_to(root).as_posix()
        boxes[rel] = sorted(
            (QUERIES[i], obj["box"]) for i, result in enumerate(line["results"]) for obj in result["objects"]
        )
    return boxes


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for image, pairs in want.items():
        found = sorted(got[image])
        assert [name for name, _ in found] == [name for name, _ in pairs], image
        for (_, a), (_, b) in zip(found, pairs, strict=True):
            np.testing.assert_allclose(a, b, atol=TOLERANCE, err_msg=image)


def by_image(dataset: sv.DetectionDataset, name_of) -> dict:
    return {
        name_of(path): [(dataset.classes[c], list(map(float, box))) for box, c in zip(d.xyxy, d.class_id, strict=True)]
        for path, _, d in dataset
    }


def test_every_export_loads_in_the_tools_with_every_box(folder, exported):
    want = expected(exported / "results.jsonl", folder)
    assert sorted(want) == sorted(IMAGES) and sum(map(len, want.values())) >= 4  # the demo finds shapes

    coco = COCO(str(exported / "coco.json"))
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == QUERIES
    got = {}
    for image in coco.loadImgs(coco.getImgIds()):
        anns = coco.loadAnns(coco.getAnnIds(imgIds=image["id"]))
        assert all(
            a["iscrowd"] == 0 and a["area"] == pytest.approx(a["bbox"][2] * a["bbox"][3], abs=0.01) for a in anns
        )
        boxes = [
            (coco.cats[a["category_id"]]["name"], [*a["bbox"][:2], *np.add(a["bbox"][:2], a["bbox"][2:])]) for a in anns
        ]
        got[image["file_name"]] = boxes
    assert_same(got, want)
    assert sorted(a["id"] for a in coco.dataset["annotations"]) == list(range(1, len(coco.dataset["annotations"]) + 1))

    dataset = sv.DetectionDataset.from_coco(str(folder), str(exported / "coco.json"))
    assert dataset.classes == QUERIES
    assert_same(by_image(dataset, lambda p: Path(p).relative_to(folder).as_posix()), want)

    # YOLO and VOC: one flat folder each, the images linked under their new names.
    yolo = exported / "yolo"
    original = {
        name: Path(os.path.realpath(yolo / "images" / name)).relative_to(folder).as_posix()
        for name in os.listdir(yolo / "images")
    }
    assert sorted(original.values()) == sorted(IMAGES)
    dataset = sv.DetectionDataset.from_yolo(str(yolo / "images"), str(yolo / "labels"), str(yolo / "data.yaml"))
    assert dataset.classes == QUERIES
    assert_same(by_image(dataset, lambda p: original[Path(p).name]), want)
    voc = exported / "voc"
    assert sorted(os.listdir(voc / "images")) == sorted(original)  # the same names, linked to the same images
    assert all(os.path.realpath(voc / "images" / n) == os.path.realpath(yolo / "images" / n) for n in original)
    dataset = sv.DetectionDataset.from_pascal_voc(str(voc / "images"), str(voc))
    assert_same(by_image(dataset, lambda p: original[Path(p).name]), want)

    tasks = json.loads((exported / "tasks.json").read_text())
    got = {}
    for task in tasks:
        rel = task["data"]["image"].removeprefix(exports.LABEL_STUDIO_IMAGES)
        got[rel] = []
        for item in task["predictions"][0]["result"]:
            w, h = item["original_width"], item["original_height"]
            v = item["value"]
            box = [
                v["x"] * w / 100,
                v["y"] * h / 100,
                (v["x"] + v["width"]) * w / 100,
                (v["y"] + v["height"]) * h / 100,
            ]
            got[rel].append((v["rectanglelabels"][0], box))
    assert_same(got, want)


def test_label_studio_keeps_points_and_the_others_say_they_left_them_out(tmp_path):
    line = {
        "image": str(tmp_path / "p.png"),
        "size": [200, 100],
        "results": [
            {"objects": [{"label": None, "point": [50.0, 25.0], "point_norm": [250, 250], "confidence": 0.9}]},
            {
                "objects": [
                    {
                        "label": "b",
                        "box": [20.0, 10.0, 120.0, 60.0],
                        "box_norm": [100, 100, 600, 600],
                        "confidence": 0.8,
                    }
                ]
            },
        ],
    }
    ds = exports.dataset([line], {line["image"]: 1}, [["tip"], ["box"]], tmp_path)
    point, box = exports.labelstudio_tasks(ds)[0]["predictions"][0]["result"]
    assert point["type"] == "keypointlabels" and point["value"]["keypointlabels"] == ["tip"]
    assert (point["value"]["x"], point["value"]["y"]) == (25.0, 25.0)
    assert box["value"] | {} == {
        "x": 10.0,
        "y": 10.0,
        "width": 50.0,
        "height": 50.0,
        "rotation": 0,
        "rectanglelabels": ["box"],
    }
    assert "<KeyPointLabels" not in exports.labelstudio_config(["tip"], points=False)  # Label Studio's COCO export
    config = exports.labelstudio_config(["tip", 'say "hi"'], points=True)
    assert '<Label value="tip"/>' in config and "<Label value='say \"hi\"'/>" in config and "<KeyPointLabels" in config
    assert exports.count_points(ds) == 1
    assert [a["category_id"] for a in exports.coco_dataset(ds)["annotations"]] == [2]


def test_a_rerun_regenerates_its_exports_and_protects_other_files(run, folder, exported, tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    lines = (exported / "results.jsonl").read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]))  # as if interrupted before the last image
    args = ["--images", f"{folder}/**/*.*", "--out", str(out), *export_args(tmp_path)]
    code, err = run(*args, questions=RUN)  # a first run over this JSONL: new export paths
    assert code == 0, err
    coco = json.loads((tmp_path / "coco.json").read_text())
    assert len(coco["images"]) == len(IMAGES) and coco == json.loads((exported / "coco.json").read_text())
    assert run(*args, questions=RUN)[0] == 0 and len(run.loads) == 1  # the rerun: no --overwrite, no model

    # Someone else's files at export paths: refused before the model loads, left as they were.
    other = tmp_path / "other.jsonl"
    (tmp_path / "mine.json").write_text("mine")
    (tmp_path / "yolo" / "notes.txt").write_text("mine")
    code, err = run(*args, questions=RUN)  # this JSONL's own --yolo folder, now holding a file it did not write
    assert code == 2 and "notes.txt" in err and "--overwrite" in err
    cases = [
        (["--coco", str(tmp_path / "mine.json")], "mine.json already exists"),
        (["--yolo", str(tmp_path / "yolo")], "yolo holds"),  # another JSONL's export
        (["--coco", str(tmp_path / "coco.json")], "coco.json already exists"),  # another JSONL's export
        (["--voc", str(tmp_path / "mine.json")], "is a file; it needs a folder"),
        (["--labelstudio", str(tmp_path / "yolo")], "is a folder; it needs a file name"),
        (["--coco", str(tmp_path / "mine.json" / "c.json")], "is a file, not a folder"),
        (["--coco", str(other), "--overwrite"], "is a results JSONL"),
        (["--coco", str(tmp_path / "c.json"), "--coco-results", str(tmp_path / "c.json")], "both name"),
    ]
    for extra, message in cases:
        code, err = run("--images", str(folder), "--out", str(other), *extra, questions=RUN)
        assert code == 2 and message in err, (extra, err)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only folder (root may write anywhere)
    code, err = run("--images", str(folder), "--out", str(other), "--voc", str(tmp_path / "new"), questions=RUN)
    assert code == 2 and f"cannot write {tmp_path / 'new'}: {tmp_path} is not writable" in err
    assert run.loads == ["demo"] and not other.exists() and (tmp_path / "mine.json").read_text() == "mine"
    assert (tmp_path / "yolo" / "notes.txt").read_text() == "mine"


def test_points_go_to_label_studio_and_the_others_say_they_left_them_out(run, folder, tmp_path):
    args = ["--images", str(folder / "a.png"), "--out", str(tmp_path / "p.jsonl"), *export_args(tmp_path)]
    code, err = run(*args, questions=["--task", "point", "--query", "circle", "--mode", "fast"])
    assert code == 0, err
    points = [o["point"] for o in test_batch.lines_of(tmp_path / "p.jsonl")[0]["results"][0]["objects"]]
    assert points and f"note: {len(points)} points left out of --coco, --yolo, --voc (no points in the format)" in err
    (task,) = json.loads((tmp_path / "tasks.json").read_text())
    width, height = test_batch.lines_of(tmp_path / "p.jsonl")[0]["size"]
    got = [(r["value"]["x"] * width / 100, r["value"]["y"] * height / 100) for r in task["predictions"][0]["result"]]
    assert [r["value"]["keypointlabels"] for r in task["predictions"][0]["result"]] == [["circle"]] * len(points)
    np.testing.assert_allclose(got, points, atol=0.01)
    assert json.loads((tmp_path / "coco.json").read_text())["annotations"] == []


def test_a_full_disk_mid_export_keeps_the_jsonl_and_the_rerun_finishes(run, folder, exported, tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    out.write_text((exported / "results.jsonl").read_text())
    before = out.read_bytes()
    real = exports.replace_text

    def full(path, text):
        if path.name.endswith(".xml"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(exports, "replace_text", full)
    args = ["--images", f"{folder}/**/*.*", "--out", str(out), *export_args(tmp_path)]
    code, err = run(*args, questions=RUN)
    assert code == 2 and "No space left" in err and "run the same command again" in err
    assert out.read_bytes() == before and not list((tmp_path / "voc").glob("*.xml"))
    monkeypatch.setattr(exports, "replace_text", real)
    assert run(*args, questions=RUN)[0] == 0 and len(list((tmp_path / "voc").glob("*.xml"))) == len(IMAGES)


def test_flat_names_keep_every_image(tmp_path):
    paths = [str(tmp_path / p) for p in ["a.png", "one/x.png", "two/x.png", "two/x.jpg", "b.png", "sub/b.jpg"]]
    names = exports.flat_names(paths, tmp_path)
    assert list(names.values()) == ["a.png", "one__x.png", "two__x_png.png", "two__x_jpg.jpg", "b.png", "sub__b.jpg"]
    assert len({Path(n).stem for n in names.values()}) == len(paths)  # YOLO labels go by stem


# --- Photos in the YOLO and VOC exports: formats their readers skip, orientation they apply ---

PHOTO_RUN = ["--query", "square", "--mode", "slow"]


def read_back(export: Path) -> dict[str, tuple[tuple[int, int], list[list[float]]]]:
    """Each image of a YOLO or VOC export as supervision reads it: its name -> ((W, H) as loaded, boxes)."""
    images = str(export / "images")
    if (export / "data.yaml").is_file():
        dataset = sv.DetectionDataset.from_yolo(images, str(export / "labels"), str(export / "data.yaml"))
    else:
        dataset = sv.DetectionDataset.from_pascal_voc(images, str(export))
    return {Path(path).name: (image.shape[1::-1], sorted(d.xyxy.tolist())) for path, image, d in dataset}


def assert_read_back(export: Path, out: Path, names: dict[str, str]) -> None:
    """The export holds `names` (exported name -> image file name), each read at its JSONL size with its boxes."""
    got = read_back(export)
    want = {
        Path(line["image"]).name: (tuple(line["size"]), sorted(o["box"] for r in line["results"] for o in r["objects"]))
        for line in test_batch.lines_of(out)
    }
    assert sorted(got) == sorted(names)
    for name, image in names.items():
        size, boxes = want[image]
        assert got[name][0] == size and boxes, (name, got[name], want[image])  # boxes found: the frame is tested
        np.testing.assert_allclose(got[name][1], boxes, atol=TOLERANCE, err_msg=name)


def assert_copy_of(path: Path, pixels: Image.Image) -> None:
    """`path` is a JPEG of `pixels` (within JPEG's loss), without an orientation tag."""
    assert not path.is_symlink()
    with Image.open(path) as copy:
        assert copy.format == "JPEG" and copy.size == pixels.size and 0x0112 not in copy.getexif()
        assert np.abs(np.asarray(copy, dtype=np.int16) - np.asarray(pixels, dtype=np.int16)).mean() < 3


def test_yolo_and_voc_take_heic_and_avif_as_jpeg_copies_in_the_displayed_frame(run, tmp_path):
    """HEIC (rotated, as an iPhone stores it) and AVIF, which YOLO and VOC readers skip, are exported as JPEGs of
    the pixels the model saw; a PNG stays a link. supervision reads all three at the JSONL's sizes, with its boxes,
    from either export."""
    folder, out, yolo, voc = tmp_path / "photos", tmp_path / "results.jsonl", tmp_path / "yolo", tmp_path / "voc"
    folder.mkdir()
    shown = test_photos.scene()
    test_photos.save_heic(shown, 6, folder / "phone.heic")
    shown.save(folder / "phone.png")  # beside phone.heic: the copy must not take its name
    shown.save(folder / "web.avif", "AVIF", quality=95)
    args = ["--images", str(folder), "--out", str(out), "--yolo", str(yolo), "--voc", str(voc)]
    code, err = run(*args, questions=PHOTO_RUN)
    assert code == 0, err
    names = {"phone_heic.jpg": "phone.heic", "phone_png.png": "phone.png", "web.jpg": "web.avif"}
    written = exports.read_manifest(exports.manifest_path(out))
    for export in (yolo, voc):
        assert_read_back(export, out, names)
        assert (export / "images" / "phone_png.png").is_symlink()
        for name in ("phone_heic.jpg", "web.jpg"):
            assert_copy_of(export / "images" / name, shown)
        assert {exports.key(p) for p in (export / "images").iterdir()} <= written.keys()
    xml = ET.parse(voc / "phone_heic.xml").getroot()
    assert (xml.findtext("filename"), xml.findtext("path")) == ("phone_heic.jpg", str(voc / "images/phone_heic.jpg"))
    assert run(*args, questions=PHOTO_RUN)[0] == 0  # the rerun rewrites its own copies


def test_yolo_in_the_stored_frame_drops_the_orientation_readers_would_apply(run, tmp_path):
    """`--orientation stored`: a JPEG tagged with EXIF orientation 6, which YOLO readers would turn, is exported
    as a JPEG of its stored pixels without the tag, as is a HEIC whose rotation libheif applies; a PNG without a
    tag stays a link."""
    folder, out, yolo = tmp_path / "photos", tmp_path / "results.jsonl", tmp_path / "yolo"
    folder.mkdir()
    stored = test_photos.scene()
    turned = stored.transpose(Image.Transpose.ROTATE_270)  # as a viewer shows `stored` under tag 6
    (folder / "turned.jpg").write_bytes(test_photos.tagged(turned, 6))
    test_photos.save_heic(turned, 6, folder / "phone.heic")
    stored.save(folder / "upright.png")
    args = ["--images", str(folder), "--out", str(out), "--yolo", str(yolo), "--orientation", "stored"]
    code, err = run(*args, questions=PHOTO_RUN)
    assert code == 0, err
    assert {tuple(line["size"]) for line in test_batch.lines_of(out)} == {stored.size}
    assert_read_back(yolo, out, {"turned.jpg": "turned.jpg", "phone.jpg": "phone.heic", "upright.png": "upright.png"})
    assert (yolo / "images" / "upright.png").is_symlink()
    for name in ("turned.jpg", "phone.jpg"):
        assert_copy_of(yolo / "images" / name, stored)


# --- Reruns: what annotators changed, images gone, outputs in the input, names that clash ---


def test_a_rerun_keeps_hand_corrections_and_leaves_no_stale_files(run, folder, tmp_path):
    """A label file changed after the run wrote it (as labelImg or CVAT saves one) is refused by the rerun unless
    --overwrite; files of images no longer in the folder, or renamed by a new clash, are removed, so the readers
    see exactly the JSONL's images."""
    images = tmp_path / "images"
    for name in ("a.png", "one/x.png"):
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes((folder / name).read_bytes())
    out, yolo, voc = tmp_path / "results.jsonl", tmp_path / "yolo", tmp_path / "voc"
    args = ["--images", f"{images}/**/*.png", "--out", str(out), "--yolo", str(yolo), "--voc", str(voc)]
    assert run(*args, questions=RUN)[0] == 0
    corrected = yolo / "labels" / "a.txt"
    corrected.write_text(corrected.read_text() + "0 0.5 0.5 0.1 0.1\n")
    code, err = run(*args, questions=RUN)
    assert code == 2 and f"{corrected} was changed after mlx-locate-batch wrote it" in err and "--overwrite" in err
    assert corrected.read_text().endswith("0 0.5 0.5 0.1 0.1\n") and len(run.loads) == 1

    (images / "a.png").unlink()  # gone from the folder
    (images / "two").mkdir()
    (images / "two" / "x.png").write_bytes((folder / "two" / "x.png").read_bytes())  # one/x.png is now one__x.png
    code, err = run(*args, "--overwrite", questions=RUN)
    assert code == 0, err
    assert "files of earlier exports removed" in err
    want = {"one__x.png": "x.png", "two__x.png": "x.png"}
    assert sorted(p.name for p in (yolo / "images").iterdir()) == sorted(want)
    assert sorted(p.name for p in (yolo / "labels").iterdir()) == ["one__x.txt", "two__x.txt"]
    assert sorted(p.name for p in voc.glob("*.xml")) == ["one__x.xml", "two__x.xml"]
    for export in (yolo, voc):
        assert sorted(read_back(export)) == sorted(want)
    manifest = exports.read_manifest(exports.manifest_path(out))
    assert all(Path(p).exists() for p in manifest) and not any(Path(p).stem == "a" for p in manifest)
    assert run(*args, questions=RUN)[0] == 0  # and the next rerun finds everything as it wrote it


def test_a_recursive_glob_leaves_out_the_runs_own_outputs(run, folder, tmp_path):
    """Exports and drawings inside the images' folder are not taken for new images by the rerun."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes((folder / "a.png").read_bytes())
    out = tmp_path / "results.jsonl"
    args = ["--images", f"{images}/**/*.*", "--out", str(out), "--yolo", str(images / "yolo")]
    args += ["--draw", str(images / "drawn"), "--coco", str(images / "coco.json")]
    for _ in range(3):
        code, err = run(*args, questions=RUN)
        assert code == 0, err
        assert [Path(line["image"]).name for line in test_batch.lines_of(out)] == ["a.png"]
    assert "files of this run's outputs left out of --images" in err
    assert [p.name for p in (images / "yolo" / "images").iterdir()] == ["a.png"]


def test_names_that_would_clash_are_refused_before_the_model_loads(run, folder, tmp_path):
    images = tmp_path / "images"
    for name in ("sub/a.png", "other/a.png", "sub__a.png"):
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes((folder / "a.png").read_bytes())
    out = tmp_path / "results.jsonl"
    code, err = run("--images", f"{images}/**/*.png", "--out", str(out), "--yolo", str(tmp_path / "y"), questions=RUN)
    assert code == 2 and "would both be exported as 'sub__a_png'" in err and "rename one" in err
    assert run.loads == [] and not out.exists()


def test_an_export_inside_a_folder_export_is_refused(run, folder, tmp_path):
    out = tmp_path / "r.jsonl"
    cases = [
        (["--yolo", str(tmp_path / "y"), "--coco", str(tmp_path / "y" / "data.yaml")], "--coco"),
        (["--voc", str(tmp_path)], "the results file"),
        (["--yolo", str(tmp_path / "y"), "--voc", str(tmp_path / "y" / "voc")], "--voc"),
    ]
    for extra, what in cases:
        code, err = run("--images", str(folder), "--out", str(out), *extra, questions=RUN)
        assert code == 2 and what in err and "lies inside" in err, (extra, err)
    assert run.loads == [] and not out.exists()


def test_flat_names_tell_apart_only_what_a_macs_disk_does(tmp_path):
    paths = [str(tmp_path / p) for p in ["one/A.png", "two/a.png", "b.PNG", "c.png"]]
    assert list(exports.flat_names(paths, tmp_path).values()) == ["one__A.png", "two__a.png", "b.PNG", "c.png"]


def test_yolo_names_keep_any_character_for_the_readers(tmp_path):
    """Category names with emoji, quotes, line separators and control characters come back from data.yaml, as
    PyYAML (supervision's and ultralytics' reader) reads it, exactly as asked."""
    names = ["😀 square", 'say "hi"', "back\\slash", "line\u2028separator", "del\x7f", "中文 mug"]
    image = tmp_path / "a.png"
    Image.new("RGB", (20, 10)).save(image)
    box = {"label": None, "box": [2.0, 2.0, 8.0, 6.0], "box_norm": [0, 0, 0, 0], "confidence": 0.5}
    line = {"image": str(image), "size": [20, 10], "results": [{"objects": [box]}] + [{"objects": []}] * 5}
    ds = exports.dataset([line], {str(image): 1}, [[n] for n in names], tmp_path)
    list(exports.write_export("yolo", ds, tmp_path / "yolo"))
    assert yaml.safe_load((tmp_path / "yolo" / "data.yaml").read_text(encoding="utf-8"))["names"] == dict(
        enumerate(names)
    )
    read = sv.DetectionDataset.from_yolo(
        str(tmp_path / "yolo/images"), str(tmp_path / "yolo/labels"), str(tmp_path / "yolo/data.yaml")
    )
    assert read.classes == names


@pytest.mark.parametrize("tag", range(1, 9))
def test_displayed_xy_follows_the_viewers_transform(tag):
    """Independent of the mapping's table: a rectangle drawn in stored pixels, turned by Pillow's `exif_transpose`,
    covers the box the mapping gives, in an image of `displayed_size`."""
    stored, box = Image.new("L", (40, 30)), (5, 6, 15, 20)
    stored.paste(255, box)
    exif = Image.Exif()
    exif[0x0112] = tag
    stored.info["exif"] = exif.tobytes()
    shown = ImageOps.exif_transpose(stored)
    corners = [displayed_xy(x, y, stored.size, tag) for x, y in (box[:2], box[2:])]
    xs, ys = sorted(c[0] for c in corners), sorted(c[1] for c in corners)
    assert shown.size == displayed_size(stored.size, tag)
    assert shown.getbbox() == (xs[0], ys[0], xs[1], ys[1])


def test_label_studio_shows_a_stored_frame_run_as_the_browser_does(run, tmp_path):
    """Label Studio shows a photo turned by its EXIF tag (as every browser does), so a run in the stored frame gives
    it its boxes turned the same way (checked with Pillow's `exif_transpose` of each box drawn in stored pixels);
    COCO keeps the stored frame asked for, and says so."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "turned.jpg").write_bytes(test_photos.tagged(test_photos.scene(), 6))
    for frame in ("exif", "stored"):
        args = ["--images", str(folder), "--out", str(tmp_path / f"{frame}.jsonl"), "--orientation", frame]
        args += ["--labelstudio", str(tmp_path / f"{frame}.json"), "--coco", str(tmp_path / f"{frame}.coco.json")]
        code, err = run(*args, questions=PHOTO_RUN)
        assert code == 0, err
        assert ("carry an EXIF orientation and are given in their stored frame" in err) == (frame == "stored")
    (line,) = test_batch.lines_of(tmp_path / "stored.jsonl")
    (task,) = json.loads((tmp_path / "stored.json").read_text())
    results = task["predictions"][0]["result"]
    assert len(results) == len(line["results"][0]["objects"]) > 0  # the demo finds squares
    exif = Image.Exif()
    exif[0x0112] = 6
    for obj, result in zip(line["results"][0]["objects"], results, strict=True):
        mask = Image.new("L", tuple(line["size"]))
        mask.paste(255, tuple(round(v) for v in obj["box"]))
        mask.info["exif"] = exif.tobytes()
        shown = ImageOps.exif_transpose(mask)
        assert (result["original_width"], result["original_height"]) == shown.size
        value = result["value"]
        got = [value["x"], value["y"], value["x"] + value["width"], value["y"] + value["height"]]
        want = [100 * v / shown.size[i % 2] for i, v in enumerate(shown.getbbox())]
        np.testing.assert_allclose(got, want, atol=100 / min(shown.size))  # a pixel: the mask's rounding
