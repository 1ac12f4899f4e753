"""The folder benchmark's mlx-vlm peer: one command line for every peer run, the batch mode's checks and
bookkeeping, and the side-by-side rows (benchmarks/bench.py, benchmarks/peer_mlxvlm.py; no mlx-vlm needed)."""

from __future__ import annotations

import json
import sys
from collections import namedtuple
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402
import peer_mlxvlm  # noqa: E402

from mlx_locate.prompts import task_text  # noqa: E402

IMAGE = ROOT / "tests/data/golden/images/shapes_640x480.png"

# Stands in for the peer's python: echoes its arguments (and the ids file's content) with $FAKE_REPLY's fields,
# and writes them to $FAKE_ARGV.
FAKE = """import json, os, sys
args = sys.argv[1:]
if os.environ.get("FAKE_FAIL"):
    sys.stderr.write("Traceback (most recent call last):\\nValueError: the last line\\n")
    sys.exit(1)
ids = json.loads(open(args[args.index("--prompt-ids") + 1]).read()) if "--prompt-ids" in args else None
if os.environ.get("FAKE_ARGV"):
    open(os.environ["FAKE_ARGV"], "w").write(json.dumps(args))
print("a line of chatter")
print(json.dumps({"argv": args, "ids": ids, **json.loads(os.environ.get("FAKE_REPLY", "{}"))}))
"""


@pytest.fixture
def fake_peer(tmp_path) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(0o755)
    return str(path)


def after(argv: list[str], flag: str) -> list[str]:
    """The values that follow `flag` in `argv`, up to the next flag."""
    i = argv.index(flag) + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


def test_peer_request_batch_passes_every_image_the_text_and_the_batch_size(fake_peer, tmp_path):
    images = [tmp_path / "a.png", tmp_path / "b.png"]
    out = bench.peer_request(fake_peer, tmp_path / "ckpt", images, "find it.", "batch", 48, "float32", batch_size=4)
    argv = out["argv"]
    assert argv[0].endswith("benchmarks/peer_mlxvlm.py")
    assert after(argv, "--image") == [str(p) for p in images]
    assert after(argv, "--query") == ["find it."] and "--prompt-ids" not in argv
    assert after(argv, "--mode") == ["batch"] and after(argv, "--batch-size") == ["4"]
    assert after(argv, "--max-tokens") == ["48"] and after(argv, "--dtype") == ["float32"]
    # the command line parses as the peer's own
    args = peer_mlxvlm.build_parser().parse_args(argv[1:])
    assert args.image == images and args.batch_size == 4 and args.query == "find it."


def test_peer_request_with_ids_writes_them_and_sends_no_batch_size(fake_peer, tmp_path):
    out = bench.peer_request(fake_peer, tmp_path, [IMAGE], [1, 2, 3], "fast", 8, "stored", repeat=3)
    assert out["ids"] == [1, 2, 3] and "--query" not in out["argv"] and "--batch-size" not in out["argv"]
    assert after(out["argv"], "--repeat") == ["3"] and after(out["argv"], "--image") == [str(IMAGE)]


def test_peer_request_failure_names_the_last_error_line(fake_peer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(RuntimeError, match="^ValueError: the last line$"):
        bench.peer_request(fake_peer, tmp_path, [IMAGE], "x", "batch", 8, "stored", batch_size=1)


def test_run_peer_batch_sends_the_engines_user_text_and_normalises(fake_peer, tmp_path, monkeypatch):
    reply = {
        "images_per_s": 2.0,
        "seconds": 4.0,
        "warmup_seconds": 1.0,
        "tokens_per_image": [48, 40, 48, 44],
        "generated_ids": [[1], [2], [3], [4]],
        "peak_memory_bytes": 3 * 2**20,
        "mlxvlm_stats": {"prompt_tokens": 400},
        "prompt_text": "rendered",
        "versions": {"mlx_vlm": "0.7.10"},
        "blas": {"effective": "openblas"},
    }
    monkeypatch.setenv("FAKE_REPLY", json.dumps(reply))
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    row = bench.run_peer_batch(fake_peer, tmp_path, [IMAGE] * 4, "red box", 48, "float32", 2)
    assert "argv" not in row  # normalised to our columns, not the raw report
    assert row["images_per_s"] == 2.0 and row["tokens_per_image"] == 45.0 and row["prompt_tokens_per_image"] == 100
    assert row["peak_memory_mb"] == 3.0 and row["token_ids"] == [[1], [2], [3], [4]] and row["blas"] == "openblas"
    sent = json.loads((tmp_path / "argv.json").read_text())
    assert after(sent, "--query") == [task_text("detect", "red box")]
    assert after(sent, "--query") == ["Locate all the instances that matches the following description: red box."]
    assert after(sent, "--mode") == ["batch"] and after(sent, "--batch-size") == ["2"]
    monkeypatch.setenv("FAKE_FAIL", "1")
    assert bench.run_peer_batch(fake_peer, tmp_path, [IMAGE], "red box", 48, "float32", 2) == {
        "error": "ValueError: the last line"
    }


def test_run_batches_runs_the_peer_after_our_modes_at_each_batch_size(monkeypatch):
    calls = []
    speeds = {("fast", 1): 1.0, ("slow", 1): 0.5, ("fast", 4): 3.0, ("slow", 4): 2.0}

    def folder_run(model, requests, rows, schedule):
        mode = requests[0].mode
        calls.append((mode, rows))
        return {"images_per_s": speeds[mode, rows], "tokens": [[rows]]}

    def peer(rows):
        calls.append(("peer", rows))
        return {"images_per_s": 0.5} if rows == 1 else {"error": "boom"}

    class Runtime:  # the engine's row counts are measured before the runs
        def measure_rows(self, rows):
            calls.append(("measure", rows))

    class Model:
        runtime = Runtime()

    monkeypatch.setattr(bench, "folder_run", folder_run)
    ours, theirs = bench.run_batches(Model(), [IMAGE], "q", ["fast", "slow"], [1, 4], 48, None, peer)
    assert calls == [("measure", 4), ("fast", 1), ("slow", 1), ("peer", 1), ("fast", 4), ("slow", 4), ("peer", 4)]
    assert theirs == {1: {"images_per_s": 0.5}, 4: {"error": "boom"}}
    assert ours["fast"][1]["vs_mlx_vlm"] == 2.0 and ours["slow"][1]["vs_mlx_vlm"] == 1.0
    assert ours["fast"][4]["mlx_vlm_images_per_s"] is None and ours["fast"][4]["vs_mlx_vlm"] is None
    assert ours["slow"][4]["images_per_s_x"] == 4.0 and ours["fast"][4]["token_ids_equal_batch_1"] is False
    calls.clear()
    ours, theirs = bench.run_batches(Model(), [IMAGE], "q", ["fast"], [1], 48)
    assert calls == [("measure", 1), ("fast", 1)] and theirs == {} and "vs_mlx_vlm" not in ours["fast"][1]


def test_batch_table_prints_the_peer_and_our_ratio(capsys):
    row = {c: 1.0 for c in ("images_per_s", "images_per_s_x", "tokens_per_image", "ms_per_engine_step")}
    row |= {c: 1.0 for c in ("blocks_per_s", "boxes_per_s", "host_reads_per_step", "peak_memory_mb")}
    row |= {"compilations_after": 0, "token_ids_equal_batch_1": True}
    report = {"preset": "p", "dtype": "float32", "device": "cpu", "blas": "b", "batch_steps": {}}
    report["folder"] = {"images": 8, "size": [640, 480], "query": "red box"}
    report["batches"] = {"fast": {1: row | {"vs_mlx_vlm": 2.5}, 4: row | {"vs_mlx_vlm": None}}}
    report["mlx_vlm_batches"] = {
        1: {"images_per_s": 0.4, "tokens_per_image": 48.0, "peak_memory_mb": 100.0},
        4: {"error": "ValueError: no"},
    }
    bench.print_batch_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["1", "0.40", "48.0", "100.0", "2.50x"]
    assert lines[-1].split() == ["4", "error:", "ValueError:", "no"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--peer", "py", "--in-memory"], "--peer loads a checkpoint on disk: drop --in-memory"),
        (["--peer", "py", "--batch", "1", "--folder", "0"], "--peer with --batch runs the folder through mlx-vlm"),
    ],
)
def test_bench_refuses_a_peer_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--preset", "tiny", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mode", "batch", "--prompt-ids", "[1]"], "--mode batch needs --query"),
        (["--mode", "generate", "--prompt-ids", "[1]"], "--mode generate needs --query"),
        (["--mode", "slow", "--query", "q", "--image", str(IMAGE)], "--mode slow takes one --image"),
        (["--mode", "fast", "--query", "q", "--batch-size", "2"], "--batch-size is for --mode batch"),
        (["--mode", "batch", "--query", "q", "--repeat", "3"], "no --repeat or --trace"),
        (["--mode", "batch", "--query", "q", "--trace"], "no --repeat or --trace"),
        (["--mode", "batch", "--query", "q", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--mode", "batch", "--query", "q", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--mode", "batch", "--query", "q", "--image", "/no/such.png"], "--image: no such file: /no/such.png"),
    ],
)
def test_peer_refuses_what_a_mode_cannot_do(extra, message, capsys):
    argv = ["--model", "m", "--image", str(IMAGE)]
    if "--image" in extra:  # the extra images follow the first
        i = extra.index("--image")
        argv += extra[i + 1 : i + 2]
        extra = extra[:i] + extra[i + 2 :]
    with pytest.raises(SystemExit) as e:
        peer_mlxvlm.main(argv + extra)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_batches_and_ids_by_image():
    assert peer_mlxvlm.batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert peer_mlxvlm.batches([1, 2], 16) == [[1, 2]]
    # two shape groups, run in batch_generate's order: images 1 and 3 first, then 0 and 2
    rows = [[[10], [30]], [[0], [20, 21]]]
    assert peer_mlxvlm.ids_by_image([[1, 3], [0, 2]], rows) == [[0], [10], [20, 21], [30]]
    with pytest.raises(ValueError, match=r"groups of \[2, 1\] rows for images \[\[1, 3\], \[0, 2\]\]"):
        peer_mlxvlm.ids_by_image([[1, 3], [0, 2]], [[[10], [30]], [[0]]])


def test_recording_generator_keeps_each_rows_ids_but_the_stop_token():
    Response = namedtuple("Response", "uid token finish_reason")

    class Base:  # what BatchGenerator offers batch_generate: insert returns uids, next the responses
        def __init__(self, script):
            self.script = list(script)

        def insert(self, prompts, max_tokens):
            return [7, 3][: len(prompts)]

        def next(self):
            return [], self.script.pop(0)

    made = []
    gen = peer_mlxvlm.recording_generator(Base, made)(
        [
            [Response(7, 11, None), Response(3, 31, None)],
            [Response(7, 12, "stop"), Response(3, 32, "length")],
        ]
    )
    assert gen.insert(["a", "b"], 2) == [7, 3]
    gen.next()
    gen.next()
    assert made == [gen] and gen.rows() == [[11], [31, 32]]


def test_parting_is_where_two_token_lists_first_differ():
    assert bench.parting([1, 2, 3], [1, 2, 3]) is None
    assert bench.parting([1, 2, 3], [1, 5, 3]) == 1
    assert bench.parting([1, 2], [1, 2, 3]) == 2  # one is the other's start: they part where the shorter ends
