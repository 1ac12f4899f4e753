"""`mlx_locate.commands.batch` over a small folder with the bundled demo model: JSONL lines through the batched engine,
bad files as error lines, resume, COCO, drawings, shards and merging."""

from __future__ import annotations

import errno
import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import approx_tree
from PIL import Image

from mlx_locate.commands import batch, exports
from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import folders as annotate
from mlx_locate.engine import Engine, EngineEvent, EventKind, Handle
from mlx_locate.locate import load
from mlx_locate.parse import LocatedObject
from mlx_locate.prompts import task_text
from mlx_locate.weights.checkpoint import DEMO_DIR, content_id

IMAGE = DEMO_DIR / "example.png"
QUERIES = ["square", "circle"]  # the demo model finds both on IMAGE
RUN = ["--query", QUERIES[0], "--query", QUERIES[1], "--mode", "fast", "--max-tokens", "16"]
GOOD = ["a.png", "b.png"]
BAD = {  # file -> what its error line says
    "bad.png": "not a readable image",
    "bomb.png": "pixels",  # the wording is preprocess.load_image's (tests/test_preprocess.py)
    "chunk.png": "broken PNG file",  # Pillow raises SyntaxError for it while decoding
    "cut.jpg": "truncated",
    "text.png": "not a readable image",
}


def png(width: int, height: int, pixels: bytes, split: int | None = None) -> bytes:
    """A PNG whose header declares `width` x `height` RGB pixels, followed by `pixels` compressed; `split`
    cuts the data into two chunks, the second of an invalid chunk type."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    data = zlib.compress(pixels)
    parts = (
        chunk(b"IDAT", data) if split is None else chunk(b"IDAT", data[:split]) + chunk(b"\xf7\x1f?\xad", data[split:])
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + parts + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def model():
    return load("demo")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two readable images (one flipped, so not every answer is the same) among five bad files: a corrupt
    PNG header, a decompression bomb (a header of 100,000 x 100,000 pixels), a PNG with a broken chunk, a
    truncated JPEG and a text file named .png; and a .txt file that is not listed."""
    images = tmp_path_factory.mktemp("batch") / "images"
    images.mkdir()
    source = Image.open(IMAGE)
    source.save(images / "a.png")
    source.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(images / "b.png")
    (images / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (images / "bomb.png").write_bytes(png(100_000, 100_000, b""))
    (images / "chunk.png").write_bytes(png(32, 32, (b"\x00" + b"\xc8\x0a\x0a" * 32) * 32, split=10))
    jpeg = io.BytesIO()
    source.convert("RGB").save(jpeg, "JPEG")
    (images / "cut.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    (images / "text.png").write_text("a text file, named like an image")
    (images / "notes.txt").write_text("not an image, and not listed")
    return images


class Runner:
    """`runner(*args)` -> (exit code, stderr) of `batch.main` with the module's model and the standard queries."""

    def __init__(self, model, capfd):
        self.model, self.capfd, self.loads, self.adapters = model, capfd, [], []

    def load(self, path, dtype=None, adapter_path=None):
        self.loads.append(path)
        self.adapters.append(adapter_path)
        return self.model

    def __call__(self, *args: str, questions=RUN) -> tuple[int, str]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cli_module, "load", self.load)
            code = batch.main([*questions, *args])
        return code, self.capfd.readouterr().err if self.capfd else ""


@pytest.fixture
def run(model, capfd):
    return Runner(model, capfd)


@pytest.fixture(scope="module")
def finished(model, folder):
    """One complete run over `folder` with --coco-results, --coco (root/dataset.json) and --draw: (jsonl, coco
    results, drawings folder)."""
    root = folder.parent
    out, coco, drawings = root / "results.jsonl", root / "coco.json", root / "drawn"
    code, _ = Runner(model, None)(
        *(
            "--images",
            str(folder),
            "--out",
            str(out),
            "--coco-results",
            str(coco),
            "--coco",
            str(root / "dataset.json"),
        ),
        *("--draw", str(drawings), "--batch-size", "4"),
    )
    assert code == 0
    return out, coco, drawings


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def answers(path) -> dict[str, dict]:
    """The lines by image, without their timings, which differ from run to run."""
    by_image = {}
    for line in lines_of(path):
        for result in line.get("results", []):
            del result["stats"]
        assert line["image"] not in by_image, f"{line['image']} has two lines"
        by_image[line["image"]] = line
    return by_image


def test_lines_errors_and_lean_output(run, model, folder, finished, tmp_path):
    lines = answers(finished[0])
    assert list(lines) == [str(p) for p in sorted(folder / n for n in [*GOOD, *BAD])]
    wide = tmp_path / "wide.jsonl"  # 12 rows: every image in flight at once, the error lines written first
    assert run("--images", str(folder), "--out", str(wide), "--batch-size", "12")[0] == 0
    assert list(answers(wide)) == list(lines)  # finished: in the images' sorted order all the same
    settings = lines[str(folder / GOOD[0])]["settings"]
    assert settings["model"] == "demo" and settings["mode"] == "fast" and settings["max_tokens"] == 16
    for name, message in BAD.items():
        line = lines[str(folder / name)]
        assert set(line) == {"image", "error", "settings"} and message in line["error"] and name in line["error"]
        assert line["settings"] == settings
    for name in GOOD:
        line = lines[str(folder / name)]
        assert line["size"] == list(Image.open(IMAGE).size)
        assert [(r["task"], r["query"]) for r in line["results"]] == [("detect", q) for q in QUERIES]
        assert all("prompt_ids" not in r and "token_probs" not in r and r["mode"] == "fast" for r in line["results"])
        # Each result is what the single-request path decodes for its own query, in the order asked.
        session = model.session(Image.open(folder / name))
        for query, result in zip(QUERIES, line["results"], strict=True):
            single = session.locate(query, mode="fast", max_tokens=16)
            assert result["token_ids"] == single.token_ids and result["text"] == single.text
    first = lines[str(folder / "a.png")]["results"]
    assert first[0]["objects"], "the demo model should find a square on its example image"
    assert first[0]["token_ids"] != first[1]["token_ids"]
    assert lines[str(folder / "b.png")]["results"] != first

    full = tmp_path / "full.jsonl"
    code, err = run("--images", str(folder / "a.*"), "--out", str(full), "--full")
    assert code == 0, err
    (line,) = lines_of(full)
    assert {"prompt_ids", "token_probs"} <= set(line["results"][0])


def test_batch_size_1_and_4_write_the_same_lines(run, folder, finished, tmp_path):
    one = tmp_path / "one.jsonl"
    code, err = run("--images", str(folder), "--out", str(one), "--batch-size", "1")
    assert code == 0, err
    assert answers(one) == approx_tree(answers(finished[0]))


def test_prompts_keep_their_order(run, model, folder, tmp_path):
    prompts = [task_text("detect", "circle"), task_text("detect", "square")]
    out = tmp_path / "prompts.jsonl"
    code, err = run("--images", str(folder / "a.png"), "--out", str(out), questions=["--prompt", prompts[0],
                    "--prompt", prompts[1], "--mode", "fast", "--max-tokens", "16"])  # fmt: skip
    assert code == 0, err
    (line,) = lines_of(out)
    assert [r["prompt"] for r in line["results"]] == prompts and "query" not in line["results"][0]
    session = model.session(Image.open(folder / "a.png"))
    expected = [session.locate(prompt=p, mode="fast", max_tokens=16).token_ids for p in prompts]
    assert [r["token_ids"] for r in line["results"]] == expected and expected[0] != expected[1]


def test_flags_reach_every_request(run, folder, tmp_path, monkeypatch):
    seen = []
    real_submit = Engine.submit

    def submit(self, request, on_event=None):
        seen.append((self.max_rows, request))
        return real_submit(self, request, on_event)

    monkeypatch.setattr(Engine, "submit", submit)
    out = tmp_path / "flags.jsonl"
    flags = ["--strict", "--max-pixels", "60000", "--mode", "slow", "--max-tokens", "3", "--batch-size", "3",
             "--adapter", "my-adapter"]  # fmt: skip
    code, err = run("--images", str(folder / "[ab].png"), "--out", str(out), *flags, questions=["--query", "star"])
    assert code == 0, err
    assert len(seen) == 2 and {r.tag[0] for _, r in seen} == {str(folder / "a.png"), str(folder / "b.png")}
    for rows, r in seen:
        options = (r.query, r.task, r.strict, r.max_pixels, r.mode, r.max_tokens, r.tiles)
        assert rows == 3 and options == ("star", "detect", True, 60_000, "slow", 3, None)
    assert run.adapters == ["my-adapter"]


def test_tiled_lines_are_what_locate_with_tiles_returns(run, model, folder, tmp_path):
    out = tmp_path / "tiles.jsonl"
    questions = ["--query", "square", "--mode", "fast", "--max-tokens", "16"]
    tiling = ["--tiles", "1x2", "--tile-overlap", "0.1", "--no-tile-whole"]
    code, err = run("--images", str(folder / "a.png"), "--out", str(out), *tiling, questions=questions)
    assert code == 0, err
    (line,) = lines_of(out)
    (result,) = line["results"]
    assert result.pop("stats")["tile_grid"] == [1, 2]
    image = Image.open(folder / "a.png")
    tiled = model.locate(image, "square", tiles=(1, 2), tile_overlap=0.1, tile_whole=False, mode="fast", max_tokens=16)
    tiled = json.loads(json.dumps(tiled.to_dict()))
    for key in ("stats", *annotate.LEAN_DROPPED):
        del tiled[key]
    assert result == {"task": "detect", "query": "square", **tiled}


class OneAtATime:
    """An engine that answers its oldest request with `result` at each step (to watch the window)."""

    def __init__(self, rows: int, result):
        self.max_rows, self.result, self.waiting = rows, result, []

    def submit(self, request):
        self.waiting.append(Handle(len(self.waiting), request))

    @property
    def idle(self):
        return not self.waiting

    def step(self):
        return [EngineEvent(self.waiting.pop(0), EventKind.DONE, result=self.result)]


def test_images_in_flight_are_bounded(model, tmp_path, monkeypatch):
    result = model.locate(IMAGE, "square", mode="fast", max_tokens=1)
    events, real_read = [], annotate.read_image
    monkeypatch.setattr(annotate, "read_image", lambda *args: events.append("read") or real_read(*args))
    questions = tuple(annotate.Question("detect", q) for q in QUERIES)
    paths = [str(tmp_path / f"{i}.png") for i in range(8)]
    for path in paths:
        shutil.copy(IMAGE, path)
    for rows, window in [(1, 1), (2, 1), (3, 2), (4, 2), (16, 8)]:  # ceil(rows / questions) images at a time
        events.clear()
        monkeypatch.setattr(model, "engine", lambda max_rows: OneAtATime(max_rows, result))
        for _ in annotate.annotate(model, paths, annotate.AnnotateSettings(questions, max_rows=rows)):
            events.append("line")
        in_flight = np.cumsum([1 if e == "read" else -1 for e in events])
        assert in_flight.max() == min(window, len(paths)) and events.count("line") == len(paths)


def test_max_pixels_applies_to_every_image(run, folder, tmp_path):
    out = tmp_path / "small.jsonl"
    code, err = run("--images", str(folder / "a.png"), "--out", str(out), "--max-pixels", "1000")
    assert code == 0, err
    (line,) = lines_of(out)
    assert "224x224 = 50,176 pixels, over the limit of 1,000" in line["error"]


def test_resume_after_an_interrupted_run(run, folder, finished, tmp_path, monkeypatch):
    expected = answers(finished[0])
    out = tmp_path / "results.jsonl"

    # A run stopped (Ctrl-C) while writing its third line: two lines are on disk, and it says how to go on.
    real_write = annotate.Jsonl.write

    def interrupted(self, line):
        if len(out.read_text().splitlines()) == 2:
            raise KeyboardInterrupt
        real_write(self, line)

    monkeypatch.setattr(annotate.Jsonl, "write", interrupted)
    code, err = run("--images", str(folder), "--out", str(out))
    monkeypatch.undo()
    assert code == 130 and "run the same command again to resume" in err
    first_two = answers(out)
    assert len(first_two) == 2 and all(expected[image] == line for image, line in first_two.items())

    # Then a third line cut mid-way, as a kill during the write leaves it: resuming drops it and redoes that
    # image, keeps the first two lines byte for byte, and adds the rest once.
    written = out.read_bytes()
    missing = next(image for image in expected if image not in first_two)
    with out.open("a") as f:
        f.write(json.dumps(expected[missing])[:50])
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 0, err
    assert f"({len(expected) - 2} run now)" in err
    assert out.read_bytes().startswith(written) and answers(out) == expected

    # Everything is done: a rerun writes nothing and does not even load the model.
    written, loads = out.read_bytes(), len(run.loads)
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 0 and "(0 run now)" in err
    assert out.read_bytes() == written and len(run.loads) == loads


def test_model_failure_stops_and_keeps_what_was_written(run, folder, finished, tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    real_step, steps = Engine.step, []

    def failing(self):
        steps.append(1)
        if out.exists() and '"results"' in out.read_text():  # the first image is answered, then the model breaks
            raise RuntimeError("[metal] command buffer failed")
        return real_step(self)

    monkeypatch.setattr(Engine, "step", failing)
    code, err = run("--images", str(folder), "--out", str(out), "--batch-size", "2")  # one image in flight
    monkeypatch.undo()
    assert code == 2 and err.splitlines()[-2].startswith("error: the run stopped: RuntimeError: [metal]")
    assert "Traceback" not in err and "are kept" in err
    kept = answers(out)
    assert sum("results" in line for line in kept.values()) == 1  # the image done before the failure
    assert run("--images", str(folder), "--out", str(out))[0] == 0
    assert answers(out) == approx_tree(answers(finished[0]))


def test_output_failure_stops_and_keeps_what_was_written(run, folder, tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    real_fsync, calls = annotate.os.fsync, []

    def disk_full(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(annotate.os, "fsync", disk_full)
    code, err = run("--images", str(folder), "--out", str(out))
    monkeypatch.undo()
    assert code == 2 and f"error: cannot write {out}: [Errno 28] No space left on device" in err
    assert "Traceback" not in err and "1 lines written" in err
    assert len(lines_of(out)[0]) >= 2  # the first line is whole


def test_resume_refuses_other_questions_and_foreign_lines(run, folder, finished, tmp_path):
    out = tmp_path / "results.jsonl"
    first = next(line for line in finished[0].read_text().splitlines(keepends=True) if '"results"' in line)
    out.write_text(first)
    before = out.read_bytes()
    code, err = run("--images", str(folder), "--out", str(out), questions=["--query", "dog"])
    assert code == 2 and "use another --out" in err and run.loads == []
    code, err = run("--images", str(folder), "--out", str(out), questions=["--prompt", "square"])
    assert code == 2 and "use another --out" in err
    out.write_bytes(before + b"{not json}\n" + b'{"image": "x"}\n')
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 2 and ":2 is not JSON" in err
    out.write_bytes(before + b'{"image": "x"}\n')
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 2 and ":2 is not a line of mlx-locate-batch" in err
    assert out.read_bytes() == before + b'{"image": "x"}\n'


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--mode", "slow", "--max-tokens", "6"],
            'max_tokens: 16 in the file, 6 now; mode: "fast" in the file, "slow" now',
        ),
        (
            ["--temperature", "0.5", "--seed", "3"],
            "sampling.temperature: 0.0 in the file, 0.5 now; seed: 0 in the file, 3",
        ),
        (["--no-loop-guard"], "guards.loop_guard: true in the file, false now"),
        (["--tiles", "2x2"], "tiles: null in the file, [2, 2] now"),
        (
            ["--image-tokens", "64", "--orientation", "stored"],
            "max_image_tokens: null in the file, 64 now; orientation",
        ),
        (["--dtype", "float16"], 'dtype: null in the file, "float16" now'),
        (["--model", "MODEL"], 'model: "demo" in the file, "MODEL" now'),
        (["--adapter", "MODEL"], 'adapter: null in the file, "MODEL" now'),
    ],
)
def test_resume_refuses_other_settings_before_the_model_loads(run, folder, finished, tmp_path, flags, named):
    out = tmp_path / "results.jsonl"
    kept = "".join(finished[0].read_text().splitlines(keepends=True)[:3])  # answered with RUN: fast, 16 tokens
    out.write_text(kept)
    model = tmp_path / "model"  # a local folder is named by its content, wherever it is
    model.mkdir()
    flags = [str(model) if f == "MODEL" else f for f in flags]
    code, err = run("--images", str(folder), "--out", str(out), *flags)
    named = named.replace("MODEL", content_id(model))
    assert code == 2 and "written with other settings (" in err and named in err, err
    assert "use another --out" in err and out.read_text() == kept and run.loads == []


def test_a_local_model_is_the_same_at_any_path_and_another_once_retrained(tmp_path):
    """Sharded runs on two machines name one model by different paths: its identity is its content."""
    one, two, retrained = tmp_path / "one", tmp_path / "elsewhere" / "two", tmp_path / "retrained"
    for folder in (one, two, retrained):
        shutil.copytree(DEMO_DIR, folder, ignore=shutil.ignore_patterns("*.png"))
    data = bytearray((retrained / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one weight's last bit
    (retrained / "model.safetensors").write_bytes(bytes(data))
    assert content_id(one) == content_id(two) != content_id(retrained)


def test_settings_that_change_no_answer_resume(run, folder, finished, tmp_path):
    out = tmp_path / "results.jsonl"
    shutil.copy(finished[0], out)
    code, err = run(
        *("--images", str(folder), "--out", str(out), "--batch-size", "3", "--no-progress", "--full"),
        *("--max-pixels", "100000000", "--coco", str(tmp_path / "c.json"), "--draw", str(tmp_path / "d")),
    )
    assert code == 0 and "(0 run now)" in err and out.read_bytes() == finished[0].read_bytes()


def test_lines_without_settings_are_resumed_with_a_note(run, folder, finished, tmp_path):
    """An earlier version's JSONL records no settings: its lines are taken as made with the run's, and said so."""
    out = tmp_path / "results.jsonl"
    lines = lines_of(finished[0])
    for line in lines:
        del line["settings"]
    old = "".join(json.dumps(line) + "\n" for line in lines[1:])
    out.write_text(old)
    code, err = run("--images", str(folder), "--out", str(out))
    assert code == 0 and "(1 run now)" in err, err
    assert f"note: {len(lines) - 1} lines of {out} lack settings that this version records" in err
    assert out.read_text().endswith(old) and lines_of(out)[0]["settings"] == lines_of(finished[0])[0]["settings"]


def test_an_output_that_cannot_be_read_is_an_error(run, folder, tmp_path):
    code, err = run("--images", str(folder), "--out", str(tmp_path))
    assert code == 2 and err == f"error: --out {tmp_path} is a folder; it needs a file name such as results.jsonl\n"
    binary = tmp_path / "photo.jpg"
    binary.write_bytes(IMAGE.read_bytes())
    code, err = run("--images", str(folder), "--out", str(binary))
    assert code == 2 and "is not a JSONL of mlx-locate-batch" in err and binary.read_bytes() == IMAGE.read_bytes()
    notes = tmp_path / "notes.txt"  # no newline at all: not a line cut short by an interruption
    notes.write_text("my notes")
    code, err = run("--images", str(folder), "--out", str(notes))
    assert code == 2 and "does not end with a line of mlx-locate-batch" in err and notes.read_text() == "my notes"


def coco_expected(lines: dict[str, dict], ids: dict[str, int]) -> list[tuple]:
    """(image_id, category_id, [x, y, w, h], score) of every box, from the JSONL lines."""
    expected = []
    for image, line in lines.items():
        for category_id, result in enumerate(line.get("results", []), start=1):
            for obj in result["objects"]:
                x1, y1, x2, y2 = obj["box"]
                assert x1 <= x2 and y1 <= y2
                bbox = [x1, y1, x2 - x1, y2 - y1]
                expected.append((ids[image], category_id, bbox, obj["confidence"]))
    return sorted(expected, key=lambda e: (e[0], e[1], e[3]))


def test_coco_results_format(run, folder, finished):
    out, coco, _ = finished
    detections = json.loads(coco.read_text())
    tables = json.loads(coco.with_name("dataset.json").read_text())
    assert [(c["id"], c["name"]) for c in tables["categories"]] == [(i + 1, q) for i, q in enumerate(QUERIES)]
    # Image ids are positions in the sorted file list (a b bad bomb chunk cut.jpg text); bad files have none.
    images = {entry["id"]: entry for entry in tables["images"]}
    assert {i: e["file_name"] for i, e in images.items()} == {1: "a.png", 2: "b.png"}  # relative to the folder
    assert all(
        set(e) == {"id", "file_name", "width", "height"} and e["width"] == Image.open(IMAGE).width
        for e in images.values()
    )

    assert isinstance(detections, list) and detections
    ids = {str(folder / e["file_name"]): i for i, e in images.items()}
    lines = {image: line for image, line in answers(out).items() if "results" in line}
    got = sorted(detections, key=lambda d: (d["image_id"], d["category_id"], d["score"]))
    expected = coco_expected(lines, ids)
    assert len(got) == len(expected)
    for det, (image_id, category_id, bbox, score) in zip(got, expected, strict=True):
        assert set(det) == {"image_id", "category_id", "bbox", "score"}
        assert type(det["image_id"]) is int and type(det["category_id"]) is int and isinstance(det["score"], float)
        assert (det["image_id"], det["category_id"], det["score"]) == (image_id, category_id, score)
        assert len(det["bbox"]) == 4 and all(isinstance(v, (int, float)) and v >= 0 for v in det["bbox"])
        np.testing.assert_allclose(det["bbox"], bbox, atol=0.005)

    # The run is done, so this rerun only rewrites the COCO files it wrote from the JSONL, without --overwrite.
    before = coco.read_bytes()
    assert run("--images", str(folder), "--out", str(out), "--coco-results", str(coco))[0] == 0
    assert coco.read_bytes() == before and run.loads == []


def test_an_inverted_model_box_is_ordered_in_the_line_and_in_coco():
    written = LocatedObject("q", (30.0, 40.0, 10.0, 5.0), (300, 800, 100, 100), None, None, 0.5)  # as parsed
    objects = json.loads(json.dumps([written.to_dict()]))
    assert objects[0]["box"] == [10.0, 5.0, 30.0, 40.0] and objects[0]["box_norm"] == [300, 800, 100, 100]
    line = {"image": "x.png", "size": [100, 50], "results": [{"query": "q", "objects": objects}]}
    detections = exports.coco_results(exports.dataset([line], {"x.png": 7}, ["q"], Path(".")))
    assert detections == [{"image_id": 7, "category_id": 1, "bbox": [10.0, 5.0, 20.0, 35.0], "score": 0.5}]


def test_draw_writes_one_png_per_image_and_never_overwrites(run, folder, finished, tmp_path):
    out = finished[0]
    drawings = tmp_path / "drawn"
    shutil.copytree(finished[2], drawings)
    assert sorted(p.name for p in drawings.iterdir()) == GOOD  # each image's own name: a.png, not a.png.png
    drawn = np.asarray(Image.open(drawings / "a.png").convert("RGB"), dtype=np.int16)
    assert np.abs(drawn - np.asarray(Image.open(IMAGE).convert("RGB"), dtype=np.int16)).max() > 0

    # A missing drawing of a finished image is redrawn from its JSONL line, without the model.
    before = (drawings / "a.png").read_bytes()
    (drawings / "a.png").unlink()
    code, err = run("--images", str(folder), "--out", str(out), "--draw", str(drawings))
    assert code == 0 and f"drawings in {drawings}\n" in err
    assert (drawings / "a.png").read_bytes() == before and run.loads == []

    # An image still to do whose drawing exists: refused before any work unless --overwrite.
    fresh = tmp_path / "fresh.jsonl"
    code, err = run("--images", str(folder / "a.png"), "--out", str(fresh), "--draw", str(drawings))
    assert code == 2 and "--overwrite" in err and not fresh.exists()
    assert run("--images", str(folder / "a.png"), "--out", str(fresh), "--draw", str(drawings), "--overwrite")[0] == 0
    assert (drawings / "a.png").read_bytes() == before


def test_drawings_keep_the_name_and_format_of_their_image(run, tmp_path):
    assert batch.drawing_path("d", "photos/x.png") == Path("d/x.png")
    assert batch.drawing_path("d", "photos/x.JPG") == Path("d/x.JPG")  # saved as a JPEG, as the source is
    assert batch.drawing_path("d", "scans/page") == Path("d/page.png")  # no image suffix: a PNG
    folder = tmp_path / "nested"
    for sub in ("one", "two"):
        (folder / sub).mkdir(parents=True)
        Image.open(IMAGE).convert("RGB").save(folder / sub / "x.jpg")
    code, err = run(
        "--images", str(folder / "one" / "x.jpg"), "--out", str(tmp_path / "o.jsonl"), "--draw", str(folder)
    )
    assert code == 0, err
    assert Image.open(folder / "x.jpg").format == "JPEG"
    code, err = run("--images", f"{folder}/**/*.jpg", "--out", str(tmp_path / "p.jsonl"), "--draw", str(tmp_path / "d"))
    assert code == 2
    assert f"{folder / 'one' / 'x.jpg'} and {folder / 'two' / 'x.jpg'} would both be drawn as" in err


def test_model_defaults_to_demo(run, folder, finished):
    assert run("--images", str(folder), "--out", str(finished[0]))[0] == 0  # nothing to do: no load
    code, _ = run("--images", str(folder / "a.png"), "--out", str(finished[0].with_name("default.jsonl")))
    assert code == 0 and run.loads == ["demo"]


def test_a_jsonl_list_of_paths_is_a_manifest(run, folder, finished, tmp_path):
    manifest = folder.parent / "list.jsonl"
    names = [f"images/{name}" for name in [*GOOD, *BAD]]
    manifest.write_text("".join(json.dumps(n if i % 2 else {"image": n}) + "\n" for i, n in enumerate(names)))
    assert batch.list_images(str(manifest)) == batch.list_images(str(folder))
    code, err = run("--images", str(manifest), "--out", str(finished[0]))
    assert code == 0 and "(0 run now)" in err  # the same images as the folder: all done
    assert batch.list_images(str(finished[0])) == batch.list_images(str(folder))  # an output is a list too

    broken = tmp_path / "broken.jsonl"
    broken.write_text('"a.png"\n{"path": "b.png"}\n')
    code, err = run("--images", str(broken), "--out", str(tmp_path / "o.jsonl"))
    assert code == 2 and 'broken.jsonl:2 is neither a path string nor an object with an "image" path' in err


def test_shard_of_is_a_fixed_hash_of_the_path():
    # Pinned values: a changed hash would re-shard folders that are half done on other machines.
    paths = [f"photos/{i:04d}.jpg" for i in range(8)]
    assert [batch.shard_of(p, 4) for p in paths] == [2, 4, 3, 1, 4, 4, 3, 4]
    assert batch.shard_of("", 1) == 1


def test_shards_are_disjoint_and_complete_and_merge_equals_one_run(run, folder, finished, tmp_path, monkeypatch):
    monkeypatch.chdir(folder.parent)  # relative paths, so the shards (a hash of each path) are the same every run
    parts = [tmp_path / f"part{i}.jsonl" for i in (1, 2, 3)]
    for i, part in enumerate(parts, start=1):
        code, err = run(
            "--images", "images", "--out", str(part), "--shard", f"{i}/3", "--coco-results", f"{part}.coco.json"
        )
        assert code == 0, err
    images = [{Path(image).name for image in answers(part)} for part in parts]
    assert images == [{"b.png", "bomb.png", "chunk.png"}, {"cut.jpg"}, {"a.png", "bad.png", "text.png"}]

    merged, coco = tmp_path / "merged.jsonl", tmp_path / "merged_coco.json"
    merged_args = ("--coco-results", str(coco), "--coco", str(tmp_path / "dataset.json"))
    code, err = run("--merge", str(merged), *map(str, parts), str(parts[2]), *merged_args, questions=[])
    assert code == 0, err
    assert "7 images from 4 files" in err and "(3 duplicates dropped)" in err
    relative = tmp_path / "relative.jsonl"  # the single run, its paths relative to the working directory
    relative.write_text(finished[0].read_text().replace(f"{folder.parent}/", ""))
    # In the single run's order: its lines, detections and tables in the same sequence (probabilities to BLAS
    # rounding: the shards decoded in other company).
    assert list(answers(merged).items()) == approx_tree(list(answers(relative).items()))
    assert json.loads(coco.read_text()) == approx_tree(json.loads(finished[1].read_text()))
    assert (tmp_path / "dataset.json").read_text() == finished[1].with_name("dataset.json").read_text()
    # Each shard's own COCO file uses the image ids of the single run.
    shard_detections = [d for part in parts for d in json.loads(Path(f"{part}.coco.json").read_text())]
    assert sorted(shard_detections, key=json.dumps) == approx_tree(sorted(json.loads(coco.read_text()), key=json.dumps))

    code, err = run("--merge", str(merged), str(parts[0]), questions=[])
    assert code == 2 and "already exists" in err


def test_merge_writes_the_single_run_byte_for_byte(run, finished, tmp_path):
    """Parts holding a single run's lines in any order merge into that run's JSONL and COCO files exactly."""
    lines = finished[0].read_text().splitlines(keepends=True)
    parts = [tmp_path / "odd.jsonl", tmp_path / "even.jsonl"]
    parts[0].write_text("".join(reversed(lines[1::2])))
    parts[1].write_text("".join(lines[::2]))
    merged, coco, dataset = tmp_path / "merged.jsonl", tmp_path / "merged.json", tmp_path / "dataset.json"
    merged_args = ("--coco-results", str(coco), "--coco", str(dataset))
    assert run("--merge", str(merged), *map(str, parts), *merged_args, questions=[])[0] == 0
    assert merged.read_bytes() == finished[0].read_bytes()
    assert coco.read_bytes() == finished[1].read_bytes()
    assert dataset.read_bytes() == finished[1].with_name("dataset.json").read_bytes()


def test_merge_refuses_parts_of_other_settings(run, finished, tmp_path):
    lines = finished[0].read_text().splitlines(keepends=True)
    parts = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    parts[0].write_text("".join(lines[:3]))
    other = json.loads(lines[3])
    other["settings"]["mode"] = "slow"
    parts[1].write_text(lines[4] + json.dumps(other) + "\n")
    merged = tmp_path / "merged.jsonl"
    code, err = run("--merge", str(merged), *map(str, parts), questions=[])
    assert code == 2 and not merged.exists()
    assert f'{parts[1]} was written with other settings (mode: "slow" in the file, "fast" in {parts[0]})' in err
    parts[1].write_text(lines[4])
    assert run("--merge", str(merged), *map(str, parts), questions=[])[0] == 0

    # Parts of an earlier version, without settings, merge as they are, with a note.
    old = tmp_path / "old.jsonl"
    old.write_text(
        "".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "settings"}) + "\n" for line in lines[5:])
    )
    code, err = run("--merge", str(tmp_path / "all.jsonl"), *map(str, parts), str(old), questions=[])
    assert code == 0 and f"note: {len(lines) - 5} lines of the parts lack settings that this version records" in err


def test_merge_prefers_an_answer_to_an_error_line(run, finished, tmp_path):
    lines = finished[0].read_text().splitlines(keepends=True)
    answered = next(line for line in lines if '"results"' in line)
    image = json.loads(answered)["image"]
    errored, whole = tmp_path / "errored.jsonl", tmp_path / "whole.jsonl"
    errored.write_text(json.dumps({"image": image, "error": "disk was offline"}) + "\n")
    whole.write_text(answered)
    merged = tmp_path / "merged.jsonl"
    assert run("--merge", str(merged), str(errored), str(whole), questions=[])[0] == 0
    assert merged.read_text() == answered


@pytest.mark.parametrize(
    "args, message",
    [
        (["--images", "/nonexistent/*.png", "--out", "o.jsonl"], "no image files in '/nonexistent/*.png'"),
        (["--images", "/nonexistent", "--out", "o.jsonl"], "'/nonexistent' does not exist; give a folder"),
        (["--images", ".", "--out", "o.jsonl", "--task", "ocr"], "takes no query"),
        (["--images", ".", "--out", "o.jsonl", "--prompt", "x"], "cannot be combined with --task or --query"),
        (["--images", "."], "--images and --out are required"),
        (["--merge", "o.jsonl", "a.jsonl", "--images", "."], "drop --images"),
        (["--merge", "o.jsonl"], "needs OUT and at least one PART"),
        (["--images", ".", "--out", "o.jsonl", "--shard", "3/2"], "1 <= I <= N"),
        (["--images", ".", "--out", "o.jsonl", "--actors", "2"], "--actors only applies to --ray"),
    ],
)
def test_user_errors_exit_2(run, args, message):
    try:
        code, err = run(*args, questions=[] if "--merge" in args else RUN)
    except SystemExit as e:  # argparse's own errors
        code, err = e.code, run.capfd.readouterr().err
    assert code == 2 and "error:" in err and message in err, err


def test_a_file_given_as_the_drawings_folder_is_named(run, folder, tmp_path):
    taken = tmp_path / "exists.png"
    taken.write_bytes(b"mine")
    for draw, says in ((taken, "is a file"), (taken / "sub", f"lies under {taken}, which is a file")):
        code, err = run("--images", str(folder), "--out", str(tmp_path / "o.jsonl"), "--draw", str(draw))
        assert code == 2 and err == f"error: --draw {draw} {says}; it needs a folder\n"
    assert taken.read_bytes() == b"mine" and run.loads == []
