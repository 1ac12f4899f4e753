"""The command line through `main([...])` on the tiny_peaky golden checkpoint, with short generations."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import GOLDEN
from PIL import Image

import mlx_locate
from mlx_locate.commands import flags as cli_module
from mlx_locate.commands import locate as generate
from mlx_locate.locate import load
from mlx_locate.sampling import Sampling

IMAGE = GOLDEN / "images" / "rgba_400x300.png"  # the smallest golden image (165 image tokens), not square
# Fast mode on this image and these categories (one detect prompt) commits one box (greedy, so always the same one).
# Random weights write only faint boxes, which the nucleus guard keeps out; the reference's greedy takes them. The
# box has no label, which a joint prompt's labels held to the categories would drop.
WITH_BOX = [
    *("--categories", "red box,green circle", "--joint-categories", "--mode", "fast"),
    *("--no-nucleus-guard", "--no-label-constraint"),
]
QUERIES = ["--query", "red box", "--query", "green circle", "--query", "blue square"]
_models = {}


def cached_load(path, dtype=None, adapter_path=None):
    """`load` once per checkpoint for the whole module: each CLI run would otherwise reload and recompile."""
    key = (str(path), dtype, adapter_path)
    if key not in _models:
        _models[key] = load(path, dtype, adapter_path)
    return _models[key]


@pytest.fixture
def cli(golden_dir, monkeypatch, capsys):
    """`cli(*args)` -> (exit code, stdout, stderr) of `main` with `--model tiny_peaky --image IMAGE --max-tokens 16`."""
    monkeypatch.setattr(cli_module, "load", cached_load)
    model = str(golden_dir("tiny_peaky"))

    def run(*args: str, image=IMAGE, model=model) -> tuple[int, str, str]:
        argv = ["--model", model, "--image", str(image), "--max-tokens", "16", *args]
        code = generate.main(argv)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_text_output(cli):
    code, out, err = cli(*WITH_BOX)
    assert code == 0, err
    *objects, summary = out.strip().splitlines()
    assert len(objects) == 1
    label, kind, *rest = objects[0].split()
    assert kind == "box" and rest[0].startswith("[") and rest[3].endswith("]")
    assert float(rest[4]) > 0  # confidence
    assert summary.startswith("[fast]") and "steps" in summary and "stop:" in summary and "decode" in summary


def test_json_output(cli):
    code, out, err = cli(*WITH_BOX, "--json")
    assert code == 0, err
    data = json.loads(out)
    keys = ["prompt_ids", "token_ids", "token_probs", "text", "grid", "mode", "objects", "empty_labels"]
    assert set(keys + ["truncated", "stats"]) <= set(data)
    assert data["mode"] == "fast"
    assert len(data["grid"]) == 2 and len(data["token_probs"]) == len(data["token_ids"]) <= 16
    assert data["stats"]["steps"] >= 1 and data["stats"]["stop_reason"]
    width, height = Image.open(IMAGE).size
    assert data["objects"]
    for obj in data["objects"]:
        assert {"label", "confidence"} <= set(obj)
        pixels, norm = (obj["box"], obj["box_norm"]) if "box" in obj else (obj["point"], obj["point_norm"])
        sizes = [width, height] * (len(norm) // 2)
        assert all(0 <= v <= 1000 for v in norm)
        mapped = [v / 1000 * s for v, s in zip(norm, sizes, strict=True)]
        if len(mapped) == 4:  # the pixel box is ordered; box_norm stays as the model wrote it
            x1, y1, x2, y2 = mapped
            mapped = [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]
        np.testing.assert_allclose(pixels, mapped, atol=1e-6)


def test_categories_make_one_detect_result(cli, golden_dir):
    """One result for the categories: one row each by default, one prompt joined by </c> with --joint-categories."""
    separator = cached_load(str(golden_dir("tiny_peaky"))).runtime.tokenizer.added_tokens["</c>"]
    code, out, err = cli("--query", "red box", "--json", "--mode", "slow")
    assert code == 0, err
    assert separator not in json.loads(out)["prompt_ids"]
    for args in (["--categories", "red box, green circle"], ["--category", "red box", "--category", "green circle"]):
        code, out, err = cli(*args, "--json", "--mode", "slow")
        assert code == 0, err
        data = json.loads(out)
        assert "queries" not in data and [c["category"] for c in data["stats"]["categories"]] == [
            "red box",
            "green circle",
        ]
        code, out, err = cli(*args, "--joint-categories", "--json", "--mode", "slow")
        assert code == 0, err
        data = json.loads(out)
        assert "queries" not in data and data["prompt_ids"].count(separator) == 1


def test_stats_say_whether_the_vision_tower_ran(cli, golden_dir):
    """One image, one query: the session ran the tower, so the result says so (not the engine's view, which
    found the session's prefix ready); a second run of the same image is served from the vision cache."""
    cached_load(str(golden_dir("tiny_peaky"))).runtime.clear_caches()
    stats = []
    for _ in range(2):
        code, out, err = cli("--query", "red box", "--json", "--mode", "fast")
        assert code == 0, err
        stats.append(json.loads(out)["stats"])
    assert stats[0]["vision_cached"] is False and stats[0]["vision_s"] > 0 and stats[0]["prefix_prefill_s"] > 0
    assert stats[1]["vision_cached"] is True


def test_several_queries_are_separate_prompts_on_one_session(cli):
    code, out, err = cli(*QUERIES, "--json", "--mode", "fast")
    assert code == 0, err
    data = json.loads(out)
    assert [q["query"] for q in data["queries"]] == ["red box", "green circle", "blue square"]
    first, *rest = data["queries"]
    assert all(q["stats"]["vision_cached"] and q["stats"]["vision_s"] == 0 for q in rest)  # vision ran once
    for entry in data["queries"]:
        code, out, err = cli("--query", entry["query"], "--json", "--mode", "fast")
        alone = json.loads(out)
        assert alone["prompt_ids"] == entry["prompt_ids"] and alone["token_ids"] == entry["token_ids"]

    code, out, err = cli(*QUERIES, "--mode", "fast")
    assert code == 0, err
    blocks = out.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["== red box ==", "== green circle ==", "== blue square =="]
    assert all(b.splitlines()[-1].startswith("[fast]") for b in blocks)


def test_draw_shows_every_query(cli, tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(generate, "draw_objects", lambda image, objects, path, overwrite: drawn.append(objects))
    code, out, err = cli(*QUERIES, "--mode", "fast", "--json", "--draw", str(tmp_path / "all.png"))
    assert code == 0, err
    assert len(drawn) == 1
    boxes = [obj["box"] for q in json.loads(out)["queries"] for obj in q["objects"]]
    assert [list(obj.box) for obj in drawn[0]] == boxes


def test_draw(cli, tmp_path):
    path = tmp_path / "drawn.png"
    code, _, err = cli(*WITH_BOX, "--draw", str(path))
    assert code == 0, err
    assert f"drawn: {path}\n" in err
    drawn = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    source = np.asarray(Image.open(IMAGE).convert("RGB"), dtype=np.int16)
    assert drawn.shape == source.shape and np.abs(drawn - source).max() > 0

    before = path.read_bytes()
    code, _, err = cli(*WITH_BOX, "--draw", str(path))
    assert code == 2 and err.startswith("error:") and "--overwrite" in err
    assert path.read_bytes() == before
    code, _, err = cli(*WITH_BOX, "--draw", str(path), "--overwrite")
    assert code == 0, err


def test_draw_needs_a_file_name_pillow_writes(cli, tmp_path, monkeypatch):
    """A folder, a suffix Pillow does not write (an unknown one, XBM: 1-bit only) and none: refused before the model
    loads; a folder without suggesting --overwrite."""
    monkeypatch.setattr(cli_module, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    folder = tmp_path / "drawings"
    folder.mkdir()
    for overwrite in ([], ["--overwrite"]):
        code, _, err = cli("--query", "red box", "--draw", str(folder), *overwrite)
        assert code == 2 and err == f"error: --draw {folder} is a folder; it needs a file name such as out.png\n"
    for name, what in (("out.xyz", "a .xyz file"), ("out.XBM", "a .xbm file"), ("drawing", "a file without a suffix")):
        code, _, err = cli("--query", "red box", "--draw", str(tmp_path / name))
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {tmp_path / name}: Pillow cannot write a drawing as {what}; end its name with ")
        taken = err.split("end its name with one of ")[1].strip().split(", ")
        assert {".jpg", ".png", ".webp"} <= set(taken) and ".xbm" not in taken
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drawings"] and not any(folder.iterdir())


@pytest.mark.parametrize("args", [["--strict"], ["--mode", "slow"], ["--mode", "fast", "--no-loop-guard"]])
def test_modes_and_strict(cli, args):
    code, out, err = cli("--query", "red box", "--json", *args)
    assert code == 0, err
    data = json.loads(out)
    assert data["mode"] == (args[1] if args[0] == "--mode" else "hybrid")
    if args[1:2] == ["slow"]:
        assert data["stats"]["block_steps"] == 0


def test_prompt_and_sampling_flags(cli):
    args = ["--prompt", "Point to: the red box.", "--official-sampling", "--top-k", "5", "--seed", "3"]
    code, out, err = cli(*args, "--rendering", "B", "--no-redecode-labels", "--no-end-guard", "--json")
    assert code == 0, err
    assert json.loads(out)["mode"] == "hybrid"


def test_sampling_of():
    args = generate.build_parser().parse_args(["--image", "x", "--official-sampling", "--temperature", "0.3"])
    assert cli_module.sampling_of(args) == Sampling(temperature=0.3, top_p=0.9, top_k=0, repetition_penalty=1.1)
    args = generate.build_parser().parse_args(["--image", "x", "--top-k", "4"])
    assert cli_module.sampling_of(args) == Sampling(top_k=4)


def test_user_errors_exit_2(cli, tmp_path):
    not_image = tmp_path / "notes.png"
    not_image.write_text("not a picture")
    bad_config = tmp_path / "bad_model"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{ nope")
    cases = [
        ([], {"image": tmp_path / "missing.png"}, "image file not found"),
        ([], {"image": not_image}, "not a readable image"),
        ([], {"model": str(tmp_path / "no_model")}, "does not exist"),
        ([], {"model": str(bad_config)}, "not valid JSON"),
        (["--top-p", "0"], {}, "invalid sampling settings"),
        (["--task", "ocr"], {}, "takes no query"),
        (["--query", ""], {}, "non-empty query"),
    ]
    for args, kwargs, message in cases:
        code, out, err = cli("--query", "red box", *args, **kwargs)
        assert code == 2 and out == ""
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "medium"], "invalid choice"),
        (["--max-tokens", "0"], "must be at least 1"),
        (["--task", "segment"], "invalid choice"),
        (["--task", "refer", "--categories", "a,b"], "only --task detect"),
        (["--category", "a"], "--query instead"),
        (["--prompt", "hi", "--query", "a"], "--prompt"),
        (["--strict", "--box-start-guard"], "--strict"),
    ],
)
def test_argument_errors(cli, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        cli("--query", "red box", *args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_hub_id_is_looked_up_once(cli, golden_dir, monkeypatch):
    """The one-shot command resolves --model once: the image settings and the load read the same folder."""
    import huggingface_hub

    calls = []

    def download(**kwargs):
        calls.append(kwargs["repo_id"])
        return str(golden_dir("tiny_peaky"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    code, out, err = cli(*WITH_BOX, "--json", model="someone/tiny")
    assert code == 0, err
    assert calls == ["someone/tiny"] and len(json.loads(out)["objects"]) == 1


def test_a_hub_id_that_cannot_be_fetched_is_one_error_line(cli, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(**kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError\nAn error happened while trying to locate the files.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    code, out, err = cli("--query", "red box", model="someone/tiny")
    assert code == 2 and out == ""
    assert err == (
        "error: model 'someone/tiny' is not a local folder and could not be downloaded from the Hugging Face hub "
        "(LocalEntryNotFoundError: Got: ConnectError An error happened while trying to locate the files.)\n"
    )


def test_default_model_is_the_bundled_demo_and_demo_example_its_image_from_any_folder(capsys, tmp_path, monkeypatch):
    demo = Path(mlx_locate.__file__).parent / "demo"
    code = generate.main(["--image", str(demo / "example.png"), "--query", "square", "--max-tokens", "24", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prompt_ids"] and data["mode"] == "hybrid"
    monkeypatch.chdir(tmp_path)  # no mlx_locate/ folder here
    assert generate.main(["--image", "demo:example", "--query", "square", "--max-tokens", "24", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["objects"], again["token_ids"]) == (data["objects"], data["token_ids"]) and data["objects"]
    assert mlx_locate.DEMO_IMAGE == demo / "example.png"


def test_module_help():
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_locate.generate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--model",
        "--image",
        "--query",
        "--categories",
        "--category",
        "--json",
        "--draw",
        "--official-sampling",
        "--redecode-labels",
    ):
        assert flag in proc.stdout


def test_the_command_ends_without_teardown_and_loses_nothing(tmp_path):
    """`mlx-locate` ends its process with `os._exit` once it has answered (`commands.locate.command`): what it
    printed to a pipe (buffered: no PYTHONUNBUFFERED) is flushed first, whole, and its exit code is `main`'s."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

    def command(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "mlx_locate.generate", "--image", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)

    answer = command("demo:example", "--query", "square", "--json", "--max-tokens", "24")
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["objects"]
    drawn = command("demo:example", "--query", "square", "--draw", str(tmp_path / "a.png"))
    assert drawn.returncode == 0 and "square" in drawn.stdout and f"drawn: {tmp_path / 'a.png'}" in drawn.stderr
    assert Image.open(tmp_path / "a.png").size == Image.open(mlx_locate.DEMO_IMAGE).size
    missing = command(str(tmp_path / "none.jpg"), "--query", "square")
    assert missing.returncode == 2 and missing.stderr.startswith("error:")


def test_every_command_shows_its_installed_name(capsys):
    """--help and argparse's errors name the command as it is installed (pyproject's scripts), not its module."""
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]")[1].split("\n[")[0]
    scripts = re.findall(r'^(mlx-locate[\w-]*) = "([\w.]+):\w+"', section, re.M)
    assert len(scripts) == section.count(" = ")
    for name, target in scripts:
        parser = importlib.import_module(target).build_parser()
        assert parser.prog == name, target
        with pytest.raises(SystemExit):
            parser.parse_args(["--no-such-flag"])
        assert capsys.readouterr().err.startswith(f"usage: {name} "), name


OUTPUT_PATHS = {  # every flag naming a file or folder a command writes
    "locate": ["--draw"],
    "video": ["--out", "--annotated", "--mot"],
    "batch": ["--out", "--coco", "--coco-results", "--yolo", "--voc", "--labelstudio", "--draw"],
    "bench": ["--json"],
    "evaluate": ["--out", "--export"],
    "finetune": ["--out"],
    "convert": ["--mlx-path"],
}


@pytest.mark.parametrize("command, flag", [(c, f) for c, flags in OUTPUT_PATHS.items() for f in flags])
def test_an_empty_output_path_is_an_error(command, flag, capsys):
    """An empty path would write nothing (a flag silently ignored) or into the current folder."""
    parser = importlib.import_module(f"mlx_locate.commands.{command}").build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([flag, ""])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {flag}: expected a path, got an empty string\n")


def test_every_command_with_a_progress_bar_takes_no_progress():
    with_bar = {
        "mlx_locate.commands.batch",
        "mlx_locate.commands.video",
        "mlx_locate.commands.convert",
        "mlx_locate.commands.evaluate",
    }
    with_bar.add("mlx_locate.commands.finetune")  # the training loop's bar (tuner.finetune)
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]")[1].split("\n[")[0]
    for target in re.findall(r'^mlx-locate[\w-]* = "([\w.]+):main"', section, re.M):
        module = importlib.import_module(target)
        assert "tqdm" not in inspect.getsource(module) or module.__name__ in with_bar, module.__name__
    for name in with_bar:
        assert "--no-progress" in importlib.import_module(name).build_parser().format_help(), name


# Flags declared in more than one place on purpose: the name means something else in each command, or the module
# sits on a floor below commands/flags.py (random_checkpoint: weights; synthetic.scenes: host-side data) and cannot
# import it.
SAME_NAME_OTHER_MEANING = {
    "--out": "a JSONL file, a folder of answers, an adapter or a checkpoint folder, per command",
    "--seed": "sampling (cli), training (cli), a synthetic stream (evaluate, synthetic.scenes), random weights",
    "--data": "benchmarks to run (evaluate) or training data (finetune)",
    "--draw": "one image (generate) or a folder of them (batch)",
    "--images": "the images to annotate (batch) or the root of a data file's image paths (cli.add_images_root)",
    "--batch-size": "engine rows (cli.add_rows' alias of --max-rows) or samples per training step (add_training)",
    "--adapter": "convert: the adapter fused into the weights (needs --fuse), not one applied at load",
    "--dtype": "random_checkpoint: the stored dtype, below the flags' floor",
    "--overwrite": "random_checkpoint, below the flags' floor",
    "--force": "random_checkpoint, below the flags' floor (the alias of --overwrite)",
}


def test_each_shared_flag_is_declared_once():
    """Every flag of the package's parsers is declared in one place (commands/flags.py composes the shared ones), apart
    from SAME_NAME_OTHER_MEANING."""
    package = Path(mlx_locate.__file__).parent
    declared: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for names in re.findall(r'add_argument\(\s*((?:"--[\w-]+",\s*)*"--[\w-]+")', path.read_text()):
            for flag in re.findall(r'"(--[\w-]+)"', names):
                declared.setdefault(flag, []).append(str(path.relative_to(package)))
    assert declared["--steps"] == ["commands/flags.py"] and declared["--json"] == ["commands/flags.py"]
    twice = {flag: where for flag, where in declared.items() if len(where) > 1 and flag not in SAME_NAME_OTHER_MEANING}
    assert not twice, f"declare these once in commands/flags.py and compose them: {twice}"


def test_both_trainers_take_the_training_flags():
    """`mlx-locate-finetune` and the demo trainer share cli.add_training (each with its defaults); finetune's
    --force is --overwrite's alias."""
    from mlx_locate.commands import finetune
    from mlx_locate.tuner import demo_recipe
    from mlx_locate.tuner.finetune import FinetuneOptions
    from mlx_locate.tuner.trainer import TrainOptions

    shared = ["--steps", "3", "--batch-size", "2", "--lr", "0.5", "--warmup", "1", "--weight-decay", "0.2"]
    shared += ["--clip", "0.3", "--seed", "7", "--save-every", "2", "--no-compile"]
    for parser, required in (
        (finetune.build_parser(), ["--data", "d", "--out", "o"]),
        (demo_recipe.build_parser(), ["--out", "o"]),
    ):
        args = vars(parser.parse_args([*required, *shared]))
        assert {k: args[k] for k in ("steps", "batch_size", "lr", "warmup", "weight_decay", "clip", "seed")} == {
            "steps": 3, "batch_size": 2, "lr": 0.5, "warmup": 1, "weight_decay": 0.2, "clip": 0.3, "seed": 7
        }  # fmt: skip
        assert args["save_every"] == 2 and args["no_compile"] is True
    ft = finetune.build_parser().parse_args(["--data", "d", "--out", "o", "--force"])
    assert ft.overwrite is True and (ft.lr, ft.weight_decay, ft.save_every) == (
        FinetuneOptions.lr,
        FinetuneOptions.weight_decay,
        FinetuneOptions.save_every,
    )
    demo = demo_recipe.build_parser().parse_args(["--out", "o"])
    assert (demo.lr, demo.weight_decay, demo.clip, demo.batch_size) == (
        TrainOptions.lr,
        TrainOptions.weight_decay,
        TrainOptions.clip,
        32,
    )
