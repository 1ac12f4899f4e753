"""`mlx_locate.batch` over a small folder with the bundled demo model: JSONL lines, resume, COCO, drawings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_locate import batch
from mlx_locate.loader import DEMO_DIR
from mlx_locate.locate import load

IMAGE = DEMO_DIR / "example.png"
QUERIES = ["square", "circle"]  # the demo model finds both on IMAGE
RUN = ["--query", QUERIES[0], "--query", QUERIES[1], "--mode", "fast", "--max-tokens", "16"]
GOOD = ["a.png", "b.png", "c.png"]


@pytest.fixture(scope="module")
def model():
    return load("demo")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Three readable images (one flipped, so not every answer is the same), a corrupt one and a text file."""
    images = tmp_path_factory.mktemp("batch") / "images"
    images.mkdir()
    source = Image.open(IMAGE)
    source.save(images / "a.png")
    source.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(images / "b.png")
    source.save(images / "c.png")
    (images / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (images / "notes.txt").write_text("not an image, and not listed")
    return images


class Runner:
    """`runner(*args)` -> (exit code, stderr) of `batch.main` with the module's model and the standard queries."""

    def __init__(self, model, capfd):
        self.model, self.capfd, self.loads = model, capfd, 0

    def load(self, path, dtype=None):
        self.loads += 1
        return self.model

    def __call__(self, *args: str) -> tuple[int, str]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(batch, "load", self.load)
            code = batch.main(["--model", "demo", *RUN, *args])
        return code, self.capfd.readouterr().err if self.capfd else ""


@pytest.fixture
def run(model, capfd):
    return Runner(model, capfd)


@pytest.fixture(scope="module")
def finished(model, folder):
    """One complete run over `folder` with --coco and --draw: (jsonl, coco, drawings folder)."""
    root = folder.parent
    out, coco, drawings = root / "results.jsonl", root / "coco.json", root / "drawn"
    code, _ = Runner(model, None)(
        "--images", str(folder), "--out", str(out), "--coco", str(coco), "--draw", str(drawings)
    )
    assert code == 0
    return out, coco, drawings


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def answers(path) -> list[dict]:
    """The lines without their timings, which differ from run to run."""
    lines = lines_of(path)
    for line in lines:
        for result in line.get("results", []):
            del result["stats"]
    return lines


def test_lines_errors_and_lean_output(run, folder, finished, tmp_path):
    lines = answers(finished[0])
    assert [line["image"] for line in lines] == [str(folder / n) for n in ["a.png", "b.png", "bad.png", "c.png"]]
    bad = lines[2]
    assert set(bad) == {"image", "error"} and "not a readable image" in bad["error"]
    for line in lines[:2] + lines[3:]:
        assert line["size"] == list(Image.open(IMAGE).size)
        assert [r["query"] for r in line["results"]] == QUERIES
        assert all("prompt_ids" not in r and "token_probs" not in r and r["mode"] == "fast" for r in line["results"])
    assert lines[0]["results"][0]["objects"], "the demo model should find a square on its example image"
    assert lines[3]["results"] == lines[0]["results"]  # same content: same answers

    full = tmp_path / "full.jsonl"
    code, err = run("--images", str(folder / "a.*"), "--out", str(full), "--full")
    assert code == 0, err
    (line,) = lines_of(full)
    assert {"prompt_ids", "token_probs"} <= set(line["results"][0])


def test_resume_neither_duplicates_nor_loses_lines(run, folder, finished, tmp_path, monkeypatch):
    reference = finished[0].read_text().splitlines(keepends=True)
    expected = answers(finished[0])

    # A run stopped during the third image: the first two lines are on disk.
    out = tmp_path / "results.jsonl"
    real_image_line = batch.image_line
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_image_line(*args)

    monkeypatch.setattr(batch, "image_line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run("--images", str(folder), "--out", str(out))
    monkeypatch.undo()
    assert answers(out) == expected[:2]

    # Then a third line cut mid-way, as a kill during the write leaves it: resuming drops it and redoes that
    # image, keeps the first two lines byte for byte, and adds the rest once.
    written = out.read_bytes()
    with out.open("a") as f:
        f.write(reference[2][: len(reference[2]) // 2])
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 0, err
    assert "(2 run now)" in err
    assert out.read_bytes().startswith(written) and answers(out) == expected

    # Everything is done: a rerun writes nothing and does not even load the model.
    written, loads = out.read_bytes(), run.loads
    assert run("--images", str(folder), "--out", str(out))[0] == 0
    assert out.read_bytes() == written and run.loads == loads


def test_resume_refuses_other_queries_and_foreign_lines(run, folder, finished, tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text(finished[0].read_text().splitlines(keepends=True)[0])
    before = out.read_bytes()
    code = batch.main(["--model", "m", "--images", str(folder), "--query", "dog", "--out", str(out)])
    assert code == 2 and "use another --out" in run.capfd.readouterr().err
    out.write_bytes(before + b"{not json}\n" + b'{"image": "x"}\n')
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 2 and ":2 is not JSON" in err
    assert out.read_bytes() == before + b"{not json}\n" + b'{"image": "x"}\n'


def test_coco_results_format(run, folder, finished):
    out, coco, _ = finished
    detections = json.loads(coco.read_text())
    tables = json.loads(coco.with_name("coco.images.json").read_text())
    assert tables["categories"] == [{"id": i + 1, "name": q} for i, q in enumerate(QUERIES)]
    images = {entry["id"]: entry for entry in tables["images"]}
    # Image ids are positions in the sorted file list; the unreadable bad.png (id 3) has no entry.
    assert {i: e["file_name"] for i, e in images.items()} == {
        1: str(folder / "a.png"),
        2: str(folder / "b.png"),
        4: str(folder / "c.png"),
    }
    assert all(
        set(e) == {"id", "file_name", "width", "height"} and e["width"] == Image.open(IMAGE).width
        for e in images.values()
    )

    assert isinstance(detections, list) and detections
    expected = []
    for line in lines_of(out):
        if "error" in line:
            continue
        image_id = next(i for i, e in images.items() if e["file_name"] == line["image"])
        for category_id, result in enumerate(line["results"], start=1):
            for obj in result["objects"]:
                x1, y1, x2, y2 = obj["box"]
                bbox = [min(x1, x2), min(y1, y2), abs(x2 - x1), abs(y2 - y1)]
                expected.append((image_id, category_id, bbox, obj["confidence"]))
    assert len(detections) == len(expected)
    for det, (image_id, category_id, bbox, score) in zip(detections, expected, strict=True):
        assert set(det) == {"image_id", "category_id", "bbox", "score"}
        assert type(det["image_id"]) is int and type(det["category_id"]) is int and isinstance(det["score"], float)
        assert (det["image_id"], det["category_id"], det["score"]) == (image_id, category_id, score)
        assert len(det["bbox"]) == 4 and all(isinstance(v, (int, float)) and v >= 0 for v in det["bbox"])
        np.testing.assert_allclose(det["bbox"], bbox, atol=0.005)

    # The run is done, so these reruns only rewrite the COCO files from the JSONL.
    before = coco.read_bytes()
    code, err = run("--images", str(folder), "--out", str(out), "--coco", str(coco))
    assert code == 2 and "--overwrite" in err and coco.read_bytes() == before
    assert run("--images", str(folder), "--out", str(out), "--coco", str(coco), "--overwrite")[0] == 0
    assert coco.read_bytes() == before and run.loads == 0


def test_coco_bbox_from_reversed_box():
    line = {
        "image": "x.png",
        "size": [100, 50],
        "results": [{"query": "q", "objects": [{"label": "q", "box": [30.0, 40.0, 10.0, 5.0], "confidence": 0.5}]}],
    }
    detections, tables = batch.coco_tables([Path("x.png")], {"x.png": line}, ["q"], "detect")
    assert detections == [{"image_id": 1, "category_id": 1, "bbox": [10.0, 5.0, 20.0, 35.0], "score": 0.5}]
    assert tables["images"] == [{"id": 1, "file_name": "x.png", "width": 100, "height": 50}]


def test_draw_writes_one_png_per_image_and_never_overwrites(run, folder, finished, tmp_path):
    out = finished[0]
    drawings = tmp_path / "drawn"
    shutil.copytree(finished[2], drawings)
    assert sorted(p.name for p in drawings.iterdir()) == [f"{name}.png" for name in GOOD]
    drawn = np.asarray(Image.open(drawings / "a.png.png").convert("RGB"), dtype=np.int16)
    assert np.abs(drawn - np.asarray(Image.open(IMAGE).convert("RGB"), dtype=np.int16)).max() > 0

    # A missing drawing of a finished image is redrawn from its JSONL line, without the model.
    before = (drawings / "a.png.png").read_bytes()
    (drawings / "a.png.png").unlink()
    assert run("--images", str(folder), "--out", str(out), "--draw", str(drawings))[0] == 0
    assert (drawings / "a.png.png").read_bytes() == before and run.loads == 0

    # An image still to do whose drawing exists: refused before any work unless --overwrite.
    fresh = tmp_path / "fresh.jsonl"
    code, err = run("--images", str(folder / "a.png"), "--out", str(fresh), "--draw", str(drawings))
    assert code == 2 and "--overwrite" in err and not fresh.exists()
    assert run("--images", str(folder / "a.png"), "--out", str(fresh), "--draw", str(drawings), "--overwrite")[0] == 0
    assert (drawings / "a.png.png").read_bytes() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--images", "/nonexistent/*.png", "--out", "o.jsonl"], "no image files"),
        (["--images", ".", "--out", "o.jsonl", "--task", "ocr"], "takes no query"),
    ],
)
def test_user_errors_exit_2(run, args, message):
    code, err = run(*args)
    assert code == 2 and err.startswith("error:") and message in err
