"""`mlx-locate-bench --model demo --quick --json F` (slow tier): its JSON holds every field the README asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_locate import tune

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_is_installed():
    assert 'mlx-locate-bench = "mlx_locate.commands.bench:main"' in (ROOT / "pyproject.toml").read_text()


def test_a_model_that_does_not_load_is_one_error_line(tmp_path, capsys):
    from mlx_locate.commands.bench import main

    assert main(["--model", str(tmp_path / "missing"), "--quick", "--json", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err and err.count("\n") == 1
    assert not (tmp_path / "out.json").exists()


def test_an_existing_json_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    from mlx_locate.commands import bench, flags

    monkeypatch.setattr(flags, "load", lambda *a, **k: pytest.fail("measured before refusing"))
    png = tmp_path / "photo.png"
    png.write_bytes(b"\x89PNG mine")
    assert bench.main(["--quick", "--json", str(png)]) == 2
    assert capsys.readouterr().err == f"error: {png} already exists; pass --overwrite to replace it\n"
    assert png.read_bytes() == b"\x89PNG mine"
    monkeypatch.chdir(tmp_path)  # the default file too
    Path(bench.DEFAULT_OUT).write_text("last week's")
    assert bench.main(["--quick"]) == 2 and "already exists; pass --overwrite" in capsys.readouterr().err
    assert bench.main(["--quick", "--json", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"error: --json {tmp_path} is a folder; it needs a file name such as my-mac.json\n"
    )


@pytest.mark.slow
def test_bench_quick_on_the_demo_writes_every_field(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_LOCATE_TUNE": "1", "MLX_LOCATE_CACHE_DIR": str(tmp_path)}
    cmd = [
        sys.executable,
        "-m",
        "mlx_locate.commands.bench",
        "--model",
        "demo",
        "--quick",
        "--ops-per-buffer",
        "20",
        "60",
    ]
    proc = subprocess.run([*cmd, "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("| what | measured |")
    r = json.loads(out.read_text())
    assert {"chip", "memory_gb", "os", "mlx", "backend"} <= set(r["machine"])
    s = r["steps"]
    assert s["bandwidth_gb_s"] > 0 and s["floor_ms"] > 0
    assert s["block_x_floor"] == pytest.approx(s["block_ms"] / s["floor_ms"])
    assert s["ar_x_floor"] == pytest.approx(s["ar_ms"] / s["floor_ms"])
    assert r["cold_start"]["seconds"] > r["cold_start"]["load_s"] > 0 and "compile_s" in r["cold_start"]
    assert r["cold_start"]["seconds"] > r["cold_start"]["import_s"] > 0
    other = r["cold_start_other"]  # the CPU reads no decoder ahead by default: the other run does, on 8 threads
    assert (r["cold_start"]["read_ahead"], other["read_ahead"]) == (0, 8) and other["seconds"] > other["load_s"] > 0
    assert "| cold one-shot, read ahead by 8 |" in proc.stdout
    for rows in ("1", "16"):
        f = r["folder"][rows]
        assert f["images_per_s"] > 0 and {"vision", "prefill", "decode"} <= set(f["phases_s"])
    assert r["photo_12mp"]["vision_s"] > 0 and r["photo_12mp"]["peak_memory_gb"] > 0
    assert r["photo_12mp"]["grid"][0] * r["photo_12mp"]["grid"][1] > 0
    c = r["choices"]
    assert c["step_attention"] in ("sdpa", "padded", "unfused") and c["row_costs_ms"]
    assert set(c["tuning_s"]) == set(tune.PARTS)  # the bench's own cache folder: measured in its load
    assert "| measuring those, once |" in proc.stdout
    assert set(r["ops_per_buffer"]) == {"20", "60"}
    assert all(o["block_ms"] > 0 and o["ar_ms"] > 0 for o in r["ops_per_buffer"].values())
    rows = subprocess.run([*cmd[:3], "--macs-rows", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert rows.returncode == 0 and rows.stdout.count("|") == 13 and rows.stdout.strip().endswith("bench.json |")
