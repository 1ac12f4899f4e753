"""`mlx-locate-video` on clips of moving shapes written here with PyAV: frame sampling by time, the IoU tracker,
tracks that follow their objects with stable ids, the MOT file, the annotated clip, resume, and bad input."""

from __future__ import annotations

import json
import os
import sys
import wave

import numpy as np
import pytest
from conftest import approx_tree
from PIL import Image

from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import video
from mlx_locate.draw import draw_objects
from mlx_locate.locate import load
from mlx_locate.metrics import iou
from mlx_locate.parse import LocatedObject
from mlx_locate.synthetic.large_scenes import DEMO_MOVERS, write_clip

try:
    import av
except ImportError:  # the [video] extra; under CI (.ci/run) its absence is a failure
    if os.environ.get("MLX_LOCATE_CI"):
        raise
    pytest.skip('PyAV is not installed (pip install "mlx-locate[video]")', allow_module_level=True)

RATE, N_FRAMES = 10, 30  # the clip: 3 s at 10 frames per second
MOVERS = DEMO_MOVERS  # two squares (asked for) and a circle (not asked for)
SQUARES = [m for m in MOVERS if m.shape == "square"]


def decode_all(path):
    with av.open(str(path)) as container:
        return [f.to_image() for f in container.decode(container.streams.video[0])]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("video") / "shapes.mp4", MOVERS, N_FRAMES, rate=RATE)


@pytest.fixture(scope="module")
def model():
    return load("demo")


class Runner:
    """`runner(*args)` -> (exit code, stderr) of `video.main` with the module's model; counts model loads."""

    def __init__(self, model, capfd):
        self.model, self.capfd, self.loads = model, capfd, 0

    def load(self, path, **options):
        self.loads += 1
        return self.model

    def __call__(self, *args: str) -> tuple[int, str]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cli_module, "load", self.load)
            code = video.main(["--no-progress", *args])
        return code, self.capfd.readouterr().err


@pytest.fixture
def run(model, capfd):
    return Runner(model, capfd)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- Sampling and tracking, without the model ------------------------------------------------------------


def test_frames_are_sampled_by_time(clip):
    sampler = video.Sampler(clip, 2)
    frames = list(sampler)
    assert [f.index for f in frames] == [0, 5, 10, 15, 20, 25]
    assert [f.time for f in frames] == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])
    assert all(f.image.mode == "RGB" and f.image.size == (224, 224) for f in frames)
    assert sampler.problem() is None and sampler.decoded == N_FRAMES
    assert [f.index for f in video.Sampler(clip, 3)] == [0, 3, 7, 10, 13, 17, 20, 23, 27]  # nearest to k/3
    assert len(list(video.Sampler(clip, 100))) == N_FRAMES  # faster than the source: every frame
    info = video.video_info(clip)
    assert info.size == (224, 224) and info.rate == RATE and info.duration == pytest.approx(3.0, abs=0.11)
    assert info.frames == N_FRAMES


def test_tracker_keeps_ids_and_predicts_motion():
    tracker = video.IouTracker((200, 200))
    a, b = ("q", "square"), ("q", "circle")
    # Two objects of one key moving apart, one of another key in the same place as the first.
    for dx in (0, 10, 35, 60, 85, 110):  # 10 px, then 25 px a frame on 30 px boxes: IoU 0.09 with the last box
        ids = tracker.update(
            [(a, (10 + dx, 10, 40 + dx, 40)), (a, (150 - dx, 100, 180 - dx, 130)), (b, (10, 10, 40, 40))]
        )
        assert ids == [1, 2, 3]
    # A detection far from every track starts a new one; one key never continues another key's track.
    assert tracker.update([(a, (10, 150, 40, 180)), (b, (90, 10, 120, 40))]) == [4, 5]
    # Tracks unseen for more than TRACK_MAX_AGE frames end: the same place later is a new track.
    for _ in range(video.TRACK_MAX_AGE + 1):
        tracker.update([])
    assert tracker.update([(a, (10, 150, 40, 180))]) == [6]


def test_tracker_points_and_order():
    tracker = video.IouTracker((200, 200))  # point radius: 5 % of 200 = 10 px
    key = (None, None)
    assert tracker.update([(key, (50, 50)), (key, (100, 100))]) == [1, 2]
    assert tracker.update([(key, (104, 103)), (key, (56, 50))]) == [2, 1]  # matched by place, not order
    assert tracker.update([(key, (80, 80))]) == [3]


def test_draw_labels_fix_the_colours():
    image = Image.new("RGB", (100, 60), (255, 255, 255))
    first = LocatedObject("#1 a", (10, 10, 40, 40), None, None, None, None)
    second = LocatedObject("#2 a", (60, 10, 90, 40), None, None, None, None)
    alone = np.asarray(draw_objects(image, [second]))
    fixed = np.asarray(draw_objects(image, [second], labels=["#1 a", "#2 a"]))
    both = np.asarray(draw_objects(image, [first, second]))
    assert tuple(fixed[25, 60]) == tuple(both[25, 60]) != tuple(alone[25, 60])


# --- The command, with the demo model --------------------------------------------------------------------


def cli(clip, out, *extra, query="square"):
    return ["--video", str(clip), "--query", query, "--fps", "2", "--mode", "fast", "--max-tokens", "48"] + [
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def tracked(model, clip, tmp_path_factory):
    """One full run: square asked at 2 frames per second, with the annotated clip and the MOT file."""
    folder = tmp_path_factory.mktemp("tracked")
    paths = {name: folder / name for name in ("frames.jsonl", "annotated.mp4", "tracks.txt")}
    args = cli(
        clip, paths["frames.jsonl"], "--annotated", str(paths["annotated.mp4"]), "--mot", str(paths["tracks.txt"])
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_module, "load", lambda path, **options: model)
        assert video.main(["--no-progress", *args]) == 0
    return paths


def test_tracks_follow_their_objects(tracked):
    paths = tracked
    header, *lines = read_jsonl(paths["frames.jsonl"])
    assert header["video"].endswith("shapes.mp4") and header["queries"] == ["square"] and header["size"] == [224, 224]
    assert header["complete"] is True  # every sampled frame was read
    assert [line["frame"] for line in lines] == [0, 5, 10, 15, 20, 25]
    assert [line["time"] for line in lines] == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])
    owner = {}  # track id -> the mover it follows
    for line in lines:
        (entry,) = line["results"]
        assert entry["query"] == "square" and len(entry["objects"]) == len(SQUARES)
        for o in entry["objects"]:
            overlaps = [iou(o["box"], m.box(line["frame"])) for m in MOVERS]
            best = int(np.argmax(overlaps))
            assert overlaps[best] >= 0.8, (line["frame"], o)
            assert owner.setdefault(o["track"], best) == best  # a track never jumps to another object
    assert sorted(owner) == [1, 2]  # stable ids: one per square over the whole clip


def test_mot_file_matches_the_jsonl(tracked):
    paths = tracked
    rows = [r.split(",") for r in paths["tracks.txt"].read_text().splitlines()]
    _, *lines = read_jsonl(paths["frames.jsonl"])
    expected = [(line["frame"] + 1, o) for line in lines for o in line["results"][0]["objects"]]
    assert len(rows) == len(expected) == 12
    for row, (frame, o) in zip(rows, expected, strict=True):
        x1, y1, x2, y2 = o["box"]
        assert int(row[0]) == frame and int(row[1]) == o["track"]
        assert [float(v) for v in row[2:6]] == pytest.approx([x1, y1, x2 - x1, y2 - y1], abs=0.006)
        assert float(row[6]) == pytest.approx(o["confidence"], abs=1e-4) and row[7:] == ["-1", "-1", "-1"]


def test_annotated_clip_has_the_boxes(tracked, clip):
    paths = tracked
    drawn, source = decode_all(paths["annotated.mp4"]), decode_all(clip)
    _, *lines = read_jsonl(paths["frames.jsonl"])
    assert len(drawn) == len(lines) and drawn[0].size == (224, 224)
    assert not paths["annotated.mp4"].with_name("annotated.partial.mp4").exists()
    for image, line in zip(drawn, lines, strict=True):
        pixels = np.asarray(image, dtype=np.int32)
        clean = np.asarray(source[line["frame"]], dtype=np.int32)
        for o in line["results"][0]["objects"]:
            x1, y1 = (round(v) for v in o["box"][:2])
            caption = (slice(y1 - 9, y1 - 3), slice(x1 + 2, x1 + 20))  # filled, above the box, on the background
            assert np.abs(pixels[caption] - clean[caption]).mean() > 40
        assert np.abs(pixels[200:215, 5:60] - clean[200:215, 5:60]).mean() < 4  # elsewhere: the frame itself


def test_resume_redoes_only_missing_frames(tracked, run, clip, tmp_path):
    full = tracked["frames.jsonl"].read_text().splitlines(keepends=True)
    out = tmp_path / "frames.jsonl"
    out.write_text("".join(full[:4]) + full[4][:30])  # header, 3 frames and a cut line
    code, err = run(*cli(clip, out))
    assert code == 0 and "3 frames located, 3 resumed" in err
    resumed = out.read_text().splitlines(keepends=True)
    assert resumed[:4] == full[:4]  # the lines kept are kept byte for byte
    assert [json.loads(line) for line in resumed] == approx_tree([json.loads(line) for line in full])  # track ids too
    full = resumed
    code, err = run(*cli(clip, out))  # nothing left to do: the file stays as it is
    assert code == 0 and "0 frames located, 6 resumed" in err and out.read_text() == "".join(full)
    code, err = run(*cli(clip, out, query="circle"))
    assert code == 2 and 'written with other settings (queries: ["square"] in the file, ["circle"] now)' in err
    code, err = run(*cli(clip, out, "--model", str(tmp_path), "--temperature", "0.5"))
    assert (
        code == 2
        and '(decoding.sampling.temperature: 0.0 in the file, 0.5 now; model: "demo" in the file, "local:' in err
    )
    assert out.read_text() == "".join(full) and run.loads == 2

    # A header of an earlier version, without the model: resumed with a note, and then it records the model.
    header, *frames = full
    old = {k: v for k, v in json.loads(header).items() if k not in ("model", "adapter", "dtype")}
    out.write_text(json.dumps(old) + "\n" + "".join(frames))
    code, err = run(*cli(clip, out))
    assert code == 0 and f"note: 1 line of {out} lacks settings that this version records" in err
    assert out.read_text().splitlines(keepends=True)[1:] == frames and read_jsonl(out)[0] == json.loads(header)


def test_bad_input_is_a_clear_error(run, clip, tmp_path):
    out = ["--out", str(tmp_path / "out.jsonl"), "--query", "square"]
    code, err = run("--video", str(tmp_path / "missing.mp4"), *out)
    assert code == 2 and err.strip() == f"error: video file not found: {tmp_path / 'missing.mp4'}"
    (tmp_path / "noise.mp4").write_bytes(b"\x00\x01 not a video" * 100)
    code, err = run("--video", str(tmp_path / "noise.mp4"), *out)
    assert code == 2 and "noise.mp4 is not a video: FFmpeg reads no format in it" in err and "Traceback" not in err
    with wave.open(str(tmp_path / "tone.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\x00\x00" * 800)
    code, err = run("--video", str(tmp_path / "tone.wav"), *out)
    assert code == 2 and "tone.wav has no video stream" in err
    (tmp_path / "taken.mp4").write_bytes(b"mine")
    code, err = run("--video", str(clip), *out, "--annotated", str(tmp_path / "taken.mp4"))
    assert code == 2 and "taken.mp4 already exists; pass --overwrite" in err
    assert (tmp_path / "taken.mp4").read_bytes() == b"mine"
    code, err = run("--video", str(clip), *out, "--annotated", str(tmp_path / "clip.notavideo"))
    assert code == 2 and "error: cannot write" in err
    assert run.loads == 0 and not (tmp_path / "out.jsonl").exists()  # all refused before the model loads


def test_files_that_are_no_video_are_named_in_words(run, clip, tmp_path):
    """An empty file, a text file named .mp4 and an MP4 cut before its index: one error line each, exit 2,
    never FFmpeg's errno."""
    out = ["--out", str(tmp_path / "out.jsonl"), "--query", "square"]
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "notes.mp4").write_text("these are my notes, not a video\n" * 5)
    data = clip.read_bytes()  # write_clip puts the index at the end: a cut file has none
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) * 6 // 10])
    expected = {
        "empty.mp4": "empty.mp4 is empty (0 bytes); expected a video file (MP4, MKV, WebM, ...)",
        "notes.mp4": "notes.mp4 is not a video: FFmpeg reads no format in it (Invalid data found when processing "
        "input; it starts with b'these ar')",
        "cut.mp4": "cut.mp4 is truncated or damaged: it starts as an MP4 or MOV file, but FFmpeg cannot open it "
        "(Invalid data found when processing input)",
    }
    for name, message in expected.items():
        code, err = run("--video", str(tmp_path / name), *out)
        assert code == 2 and err.strip() == f"error: {tmp_path / name} " + message.split(" ", 1)[1]
        assert "Errno" not in err
    assert run.loads == 0 and not (tmp_path / "out.jsonl").exists()


def test_an_out_that_is_not_ours_is_refused_unchanged(run, clip, tmp_path):
    """--out a CSV, a PNG, text without a newline or a folder: one error line naming it, exit 2, before the model
    loads; the file keeps every byte (its last line too, which is no frame line cut short)."""
    png = tmp_path / "photo.png"
    Image.new("RGB", (8, 8), "red").save(png)
    (tmp_path / "data.csv").write_bytes(b"a,b\n1,2\n3,4")
    (tmp_path / "notes.txt").write_bytes(b"my notes")
    (tmp_path / "folder").mkdir()
    expected = {
        "data.csv": "is not a JSONL of mlx-locate-video; use another --out",
        "photo.png": "is not a JSONL of mlx-locate-video ('utf-8' codec can't decode byte 0x89 in position 0",
        "notes.txt": "does not end with a line of mlx-locate-video; use another --out",
    }
    for name, message in expected.items():
        before = (tmp_path / name).read_bytes()
        code, err = run("--video", str(clip), "--query", "square", "--out", str(tmp_path / name))
        assert code == 2 and err.startswith(f"error: {tmp_path / name} {message}") and err.count("\n") == 1, err
        assert (tmp_path / name).read_bytes() == before
    code, err = run("--video", str(clip), "--query", "square", "--out", str(tmp_path / "folder"))
    assert (
        code == 2
        and err == f"error: --out {tmp_path / 'folder'} is a folder; it needs a file name such as frames.jsonl\n"
    )
    assert run.loads == 0 and not any((tmp_path / "folder").iterdir())


@pytest.fixture(scope="module")
def front_indexed(tmp_path_factory):
    """The clip with its index at the front (as for streaming): a cut file still opens."""
    return write_clip(tmp_path_factory.mktemp("front") / "front.mp4", MOVERS, N_FRAMES, rate=RATE, faststart=True)


def test_a_truncated_video_is_located_as_far_as_it_goes(run, front_indexed, tmp_path):
    data = front_indexed.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) * 6 // 10])
    out = tmp_path / "frames.jsonl"
    code, err = run(*cli(cut, out))
    header, *lines = read_jsonl(out)
    assert code == 1 and header["complete"] is False and 0 < len(lines) < 6
    (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warning.startswith(f"warning: {cut} is truncated: decoding ended at ")
    assert f'; {len(lines)} of 6 sampled frames read; the header says "complete": false' in warning
    assert "Errno" not in err
    assert [line["frame"] for line in lines] == [0, 5, 10, 15, 20, 25][: len(lines)]
    code, err = run(*cli(cut, out))  # resumed: still cut, still incomplete
    assert code == 1 and "0 frames located" in err and read_jsonl(out)[0]["complete"] is False
    full = tmp_path / "full.jsonl"
    assert run(*cli(front_indexed, full))[0] == 0 and read_jsonl(full)[0]["complete"] is True


def test_a_damaged_video_skips_what_does_not_decode(run, front_indexed, tmp_path):
    data = bytearray(front_indexed.read_bytes())
    at = len(data) * 7 // 10
    data[at : at + 100] = bytes((i * 37) % 256 for i in range(100))
    damaged = tmp_path / "damaged.mp4"
    damaged.write_bytes(bytes(data))
    code, err = run(*cli(damaged, tmp_path / "frames.jsonl"))
    header, *lines = read_jsonl(tmp_path / "frames.jsonl")
    assert code == 1 and header["complete"] is False and lines
    assert f"warning: {damaged} is damaged: " in err and "did not decode" in err and "Errno" not in err


def test_missing_pyav_names_the_extra(run, clip, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    code, err = run("--video", str(clip), "--out", str(tmp_path / "out.jsonl"), "--query", "square")
    assert code == 2 and err.strip() == 'error: mlx-locate-video needs PyAV: pip install "mlx-locate[video]"'


def test_frames_in_flight_stay_bounded(model):
    """At most `2 * rows` frames are taken from the video ahead of the last line given back, resumed or new."""
    settings = video.VideoSettings("detect", ("square",), None, "fast", 8, 2.0, None, 0.2, True)
    taken = []

    def frames(n):
        for i in range(n):
            taken.append(i)
            yield video.Frame(i, i / 2, Image.new("RGB", (56, 56), (230, 230, 230)))

    empty = {"results": [{"query": "square", "objects": [], "empty_labels": ["square"]}]}
    done = {i: {"frame": i, "time": i / 2, **json.loads(json.dumps(empty))} for i in range(40)}
    ahead = []
    for frame, line, new in video.locate_frames(model, frames(44), settings, done, max_rows=1):
        assert line["frame"] == frame.index and new == (frame.index >= 40)
        ahead.append(len(taken) - frame.index - 1)
    assert len(ahead) == 44 and max(ahead) <= 2  # window: 2 rows x 1
