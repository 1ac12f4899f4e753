"""The package as users get it: the sdist built, a wheel built from it, installed in a fresh venv, and the
README's first example run from an empty folder. Slow: it builds and installs (dependencies from PyPI or pip's
cache)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from mlx_locate.weights.checkpoint import DEMO_IMAGE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = "https://github.com/mlx-locate/mlx-locate"


def first_example(readme: str) -> list[str]:
    """The README's first command: the one after its install command in its first bash block."""
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip()
    install, command = block.split(" && ", 1)
    assert install.startswith("python3 -m pip install "), install
    return shlex.split(command)


def run(args: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_wheel_from_the_sdist_runs_the_readme_first_example_from_an_empty_folder(tmp_path):
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout:
        pytest.skip("needs a git checkout (its tracked files are what the sdist is built from)")
    source = tmp_path / "source"  # the tracked files only: nothing the build leaves behind lands in the checkout
    for name in listed.stdout.split("\0"):
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # the venv's package only
    venv, dist, empty = tmp_path / "venv", tmp_path / "dist", tmp_path / "empty"
    empty.mkdir()
    run([sys.executable, "-m", "venv", venv], tmp_path, env)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "-U", "pip", "build"], tmp_path, env)  # pip >= 25 shows the licence
    run([python, "-m", "build", "--outdir", dist, source], tmp_path, env)  # the sdist, then a wheel from it

    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "LICENSE" in names and "mlx_locate/demo/example.png" in names
    assert not [n for n in names if n.startswith("tests/")]  # they need the checkout's tests/data
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        licence = next(n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
        assert whl.read(licence) == (ROOT / "LICENSE").read_bytes()

    run([python, "-m", "pip", "install", "-q", wheel], tmp_path, env)
    command = first_example((ROOT / "README.md").read_text(encoding="utf-8"))
    out = run(command, empty, env)
    drawn = command[command.index("--draw") + 1]
    assert f"drawn: {drawn}" in out.stderr and "square" in out.stdout
    assert Image.open(empty / drawn).size == Image.open(DEMO_IMAGE).size
    assert sorted(p.name for p in empty.iterdir()) == [drawn]

    show = run([python, "-m", "pip", "show", "-v", "mlx-locate"], tmp_path, env).stdout
    assert "License-Expression: Apache-2.0" in show and "Author: mlx_locate developers" in show
    for url in (f"Repository, {REPOSITORY}", f"Issues, {REPOSITORY}/issues"):
        assert url in show
    assert "Topic :: Scientific/Engineering :: Image Recognition" in show
