"""`mlx-locate-batch --ray` on a local Ray cluster of two CPU actors with the demo model: an interrupted run
resumes, a killed worker loses and duplicates nothing, and the lines, COCO files and drawings end as those of
one process (one scenario, to start as few actor pools as possible)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray  # the [cluster] extra (in the test extra): without it these tests fail, they do not skip
from conftest import approx_tree
from PIL import Image

from mlx_locate.commands import batch, cluster
from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import folders as annotate
from mlx_locate.locate import load
from mlx_locate.weights.checkpoint import DEMO_DIR

pytestmark = pytest.mark.slow  # a local Ray cluster and its actor pools

RUN = ["--query", "square", "--mode", "fast", "--max-tokens", "16"]
RAY = ["--ray", "--actors", "2", "--images-per-task", "1"]


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running one
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Eight views of the demo image (flips and rotations, so the answers differ) and a file that is no image."""
    images = tmp_path_factory.mktemp("cluster") / "images"
    images.mkdir()
    source = Image.open(DEMO_DIR / "example.png")
    views = [source, source.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    views += [v.transpose(Image.Transpose.ROTATE_90) for v in views]
    for i, view in enumerate(views * 2):
        view.save(images / f"{i}.png")
    (images / "broken.png").write_text("no image")
    return images


def main(*args: str) -> int:
    return batch.main([*RUN, *args])


def answers(path) -> dict[str, dict]:
    """The lines by image, without their timings; two lines for one image fail."""
    by_image = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        for result in line.get("results", []):
            del result["stats"]
        assert line["image"] not in by_image, f"{line['image']} has two lines"
        by_image[line["image"]] = line
    return by_image


@pytest.fixture(scope="module")
def single(folder):
    """The single-process run: (jsonl, coco)."""
    out, coco = folder.parent / "single.jsonl", folder.parent / "single_coco.json"
    with pytest.MonkeyPatch.context() as mp:
        model = load("demo")
        mp.setattr(cli_module, "load", lambda path, dtype=None, adapter_path=None: model)
        assert main("--images", str(folder), "--out", str(out), "--coco-results", str(coco)) == 0
    return out, coco


def test_interrupted_then_resumed_with_a_worker_killed_it_ends_as_one_process_does(
    folder, single, tmp_path, capfd, monkeypatch
):
    real_lines, seen = cluster.ray_lines, []

    def interrupted(*args, **kwargs):
        for i, annotated in enumerate(real_lines(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield annotated

    def kill_the_first_worker(*args, **kwargs):
        for annotated in real_lines(*args, **kwargs):
            if not seen:
                os.kill(int(annotated.worker.rsplit(":", 1)[1]), signal.SIGKILL)
            seen.append(annotated.worker)
            yield annotated

    # Ctrl-C after the first line: it stays, and the run says how to go on.
    out, coco, drawings = tmp_path / "ray.jsonl", tmp_path / "coco.json", tmp_path / "drawn"
    monkeypatch.setattr(cluster, "ray_lines", interrupted)
    assert main("--images", str(folder), "--out", str(out), *RAY) == 130
    assert len(answers(out)) == 1 and "run the same command again to resume" in capfd.readouterr().err

    # The rerun sends only the other eight images; one worker is killed once its first line is back, while both
    # still hold batches.
    monkeypatch.setattr(cluster, "ray_lines", kill_the_first_worker)
    code = main("--images", str(folder), "--out", str(out), "--coco-results", str(coco), "--draw", str(drawings), *RAY)
    err = capfd.readouterr().err
    assert code == 0, err
    assert "9 images (8 run now by 3 Ray workers), 1 with errors" in err
    # Batches the killed worker had finished still arrive, those it held are redone by its restarted actor (the
    # third process); nothing is lost and the driver writes each image once.
    assert len(seen) > 1 and len(set(seen)) == 3
    assert answers(out) == approx_tree(answers(single[0]))
    assert "not a readable image" in answers(out)[str(folder / "broken.png")]["error"]
    assert sorted(json.loads(coco.read_text()), key=json.dumps) == approx_tree(
        sorted(json.loads(single[1].read_text()), key=json.dumps)
    )
    assert sorted(p.name for p in drawings.iterdir()) == sorted(f"{i}.png" for i in range(8))
    # The lines the workers made record the run's settings: a resume with others is refused, as a local one is.
    assert main("--images", str(folder), "--out", str(out), "--mode", "slow", *RAY) == 2
    assert 'mode: "fast" in the file, "slow" now' in capfd.readouterr().err


def test_a_good_run_logs_no_error_and_keeps_the_token_private(folder, single):
    """A fresh process that starts its own local cluster: Ray writes its token file owner-only and the run's
    stderr has no error-level line (Ray's C++ `[... E pid tid]` nor Python's `ERROR`)."""
    home, ray_dir = Path(tempfile.mkdtemp(prefix="home")), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # sockets: short
    out = home / "ray.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home), "RAY_TMPDIR": ray_dir}
    args = [*RUN, "--images", str(folder), "--out", str(out), "--ray", "local", "--actors", "1", "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_locate.commands.batch", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    errors = [line for line in done.stderr.splitlines() if re.search(r"^\[[^]]* E \d+ \d+\]|\bERROR\b", line)]
    assert errors == [], done.stderr
    token = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert answers(out) == approx_tree(answers(single[0]))


def test_only_the_known_line_is_dropped_from_stderr(capfd):
    known = b"[2026-01-01 00:00:00,000 E 1 1] core_worker.cc:2465: Actor with class name: 'MapWorker' and ID: 'x' "
    known += b"has constructor arguments in the object store and max_restarts > 0. If the arguments ...\n"
    with cluster.known_lines_dropped():
        os.write(2, b"[2026-01-01 00:00:00,000 E 1 1] raylet.cc:1: a real error\n" + known + b"progress 50%\r")
        os.write(2, b"tail, no newline")
    assert (
        capfd.readouterr().err
        == "[2026-01-01 00:00:00,000 E 1 1] raylet.cc:1: a real error\nprogress 50%\rtail, no newline"
    )


def test_a_line_that_comes_back_twice_is_written_once(folder, single, tmp_path, capfd, monkeypatch):
    lines = [annotate.Annotated(json.loads(text), None, "w:1") for text in single[0].read_text().splitlines()]
    monkeypatch.setattr(cluster, "ray_lines", lambda *args, **kwargs: (a for a in [*lines, *lines[:3]]))
    out = tmp_path / "ray.jsonl"
    assert main("--images", str(folder), "--out", str(out), "--ray") == 0, capfd.readouterr().err
    assert answers(out) == approx_tree(answers(single[0]))


def test_without_ray_the_error_names_the_extra(folder, tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main("--images", str(folder), "--out", str(tmp_path / "o.jsonl"), "--ray") == 2
    err = capfd.readouterr().err
    assert err.startswith("error: --ray needs Ray Data") and 'pip install "mlx-locate[cluster]"' in err
