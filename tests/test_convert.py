"""The converter (mlx_locate/commands/convert.py): round trips, presets, the mlx-vlm layout, bad input, the report."""

import hashlib
import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import TOKENIZER_DIR, slow_but
from PIL import Image, ImageDraw

from mlx_locate import load
from mlx_locate.commands import convert as cv
from mlx_locate.commands.convert import PRESETS, convert, main
from mlx_locate.compiled import StepRunner
from mlx_locate.preprocess import preprocess
from mlx_locate.prompts import prompt_ids, task_text
from mlx_locate.tokenizer import Tokenizer
from mlx_locate.weights import checkpoint
from mlx_locate.weights.random_checkpoint import make_random_checkpoint

MODES = ("slow", "fast", "hybrid")
_real_from_folder = Tokenizer.from_folder.__func__
_tokenizers: dict[str, Tokenizer] = {}


def _cached_from_folder(cls, path):
    """Tokenizer.from_folder, built once per distinct set of tokenizer files (it takes ~1 s on 2 cores)."""
    digest = hashlib.sha1()
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json"):
        f = path / name
        digest.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    key = digest.hexdigest()
    if key not in _tokenizers:
        _tokenizers[key] = _real_from_folder(cls, path)
    return _tokenizers[key]


@pytest.fixture(scope="module", autouse=True)
def fast_tokenizer():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "from_folder", classmethod(_cached_from_folder))
        yield


@pytest.fixture(scope="module")
def image() -> Image.Image:
    """56 x 84 pixels: a 4 x 6 patch grid, 6 image tokens."""
    img = Image.new("RGB", (56, 84), (235, 235, 230))
    ImageDraw.Draw(img).rectangle((8, 10, 40, 60), fill=(200, 30, 30))
    return img


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A float32 random checkpoint whose widths (64, 128, 256, 512) all divide into groups of 64."""
    return make_random_checkpoint(tmp_path_factory.mktemp("small") / "src", "small", seed=0, dtype="float32")


@pytest.fixture(scope="module")
def converted(small, tmp_path_factory):
    """`converted(preset)`: `small` converted to float32 with that preset, once per module."""
    root, done = tmp_path_factory.mktemp("presets"), {}

    def get(preset):
        if preset not in done:
            done[preset] = convert(small, root / (preset or "none").replace("+", "_"), "float32", preset)
        return done[preset]

    return get


def logits(model, image) -> mx.array:
    """The prefill's last row and the first block step's 6 rows, (7, V) float32."""
    runtime = model.runtime
    pre = preprocess(image, in_token_limit=runtime.in_token_limit, patch_size=runtime.network.config.vision.patch_size)
    ids = prompt_ids(runtime.tokenizer, task_text("detect", "red box"), [pre.grid])
    features = runtime.network.image_features(mx.array(pre.patches), pre.grid)
    runner = StepRunner(runtime.steps, runtime.new_cache())
    first = runner.prefill(runtime.network.embed(ids, features))
    block = runner.step([ids[-1]] + [runtime.token_ids.text_mask] * 5, True)
    return mx.concatenate([first, block])


# --- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip(golden_dir, tmp_path, image, dtype, capsys, monkeypatch):
    src = golden_dir("tiny_random")  # bfloat16, original HF layout
    monkeypatch.setattr(checkpoint, "MAX_SHARD_BYTES", 4 * 10**6)  # the embedding alone, then the rest
    dst = convert(src, tmp_path / "out", dtype)
    out = capsys.readouterr().out
    assert "stored head copy is bit-identical to embed_tokens" in out
    assert "reshape vision_model.patch_embed.proj.weight (64, 3, 14, 14) OIHW -> (64, 588) Linear" in out
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert "language_model.lm_head.weight" not in index["weight_map"]
    assert {v.dtype for v in mx.load(str(dst / "model-00002-of-00002.safetensors")).values()} == {getattr(mx, dtype)}
    config = json.loads((dst / "config.json").read_text())
    assert config["torch_dtype"] == dtype and "quantization" not in config
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.json",
        "README.md",
    ):
        assert (dst / name).is_file(), name
    assert not (dst / "vocab.json").exists()  # loading needs no BPE rebuild
    probe = "<|im_start|>user\n<img><IMG_CONTEXT></img>Locate: red box</c>cat.<|im_end|> <box><12><999></box>"
    fresh = Tokenizer.from_folder(dst)  # built from tokenizer.json (cached by file contents, not by folder)
    assert fresh is not Tokenizer.from_folder(src) and fresh.encode(probe) == Tokenizer.from_folder(src).encode(probe)

    ours, ref = load(dst, dtype="bfloat16") if dtype == "bfloat16" else load(dst), load(src, dtype=dtype)
    norm = ours.runtime.network.language_model.model.norm
    assert norm.weight.dtype == getattr(mx, dtype)  # as written (bf16 -> f32 exact)
    a, b = logits(ours, image), logits(ref, image)
    if dtype == "float32":
        assert mx.abs(a - b).max().item() <= 1e-5
    else:
        assert mx.array_equal(a, b).item()


# --- presets ------------------------------------------------------------------------------------------------


def test_preset_table():
    for name, p in PRESETS.items():
        assert p.linear.bits in (4, 8) and p.linear.group_size in (32, 64)
        # The tied embedding is the coordinate head: 8 bits or more unless the name says otherwise.
        assert p.embedding is not None and (p.embedding.bits >= 8 or name == "q4-unsafe"), name
        assert (p.vision is not None) == name.endswith("+vision8")
    assert {"q8", "mixed_4_8", "q4-unsafe", "q8+vision8"} <= PRESETS.keys()


@pytest.fixture(scope="module")
def small_logits(small, image):
    return logits(load(small), image)


@pytest.mark.parametrize("name", slow_but(list(PRESETS), ["q8", "mixed_4_8+vision8"]))
def test_preset_loads_and_runs(converted, small_logits, image, name):
    preset = PRESETS[name]
    model = load(converted(name))
    # Random weights with layer_std 0.5 amplify errors (logits ~0.16 std): 8 bits stay 10x closer than 4.
    error = mx.abs(logits(model, image) - small_logits).mean().item()
    assert error < (0.02 if preset.linear.bits == 8 else 0.1), error
    lm = model.runtime.network.language_model.model
    assert isinstance(lm.embed_tokens, nn.QuantizedEmbedding)
    assert (lm.embed_tokens.bits, lm.embed_tokens.group_size) == (preset.embedding.bits, preset.embedding.group_size)
    assert lm.embed_tokens.bits >= 8 or name == "q4-unsafe"
    for layer in lm.layers:
        # loading fuses q|k|v and gate|up: still quantized alike
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(m, nn.QuantizedLinear)
            assert (m.bits, m.group_size) == (preset.linear.bits, preset.linear.group_size)
    vision = model.runtime.network.vision_model
    assert isinstance(vision.encoder.blocks[0].mlp.fc1, nn.QuantizedLinear) == (preset.vision is not None)
    assert isinstance(model.runtime.network.mlp1[1], nn.QuantizedLinear) == (preset.vision is not None)
    assert not isinstance(vision.patch_embed.proj, nn.QuantizedLinear)  # 588 wide: no groups of 64
    for mode in MODES:
        result = model.locate(image, "red box", mode=mode, max_tokens=12)
        assert result.token_ids and result.stats["steps"] >= 1


def test_preset_needs_divisible_widths(golden_dir, tmp_path):
    with pytest.raises(ValueError, match=r"embed_tokens \(width 16 is not a multiple of 64\)"):
        convert(golden_dir("tiny_random"), tmp_path / "q", "float32", "q8")  # LM hidden 16
    assert not (tmp_path / "q").exists()


# --- mlx-vlm layout -----------------------------------------------------------------------------------------

VLM_NAMES = (  # ours -> mlx-vlm (docs/model.md §4), first match wins
    ("vision_model.encoder.", "vision_tower."),
    ("vision_model.", "vision_tower."),
    ("mlp1.0.", "multi_modal_projector.layer_norm."),
    ("mlp1.1.", "multi_modal_projector.linear_1."),
    ("mlp1.3.", "multi_modal_projector.linear_2."),
)


def to_mlx_vlm(ours, out, eos):
    """What mlx-vlm 0.7.10's converter writes for uniform 4-bit (checked against a real run on `small`)."""
    out.mkdir()
    weights = {}
    for key, value in mx.load(str(ours / "model.safetensors")).items():
        if key == "vision_model.patch_embed.proj.weight":
            value = value.reshape(value.shape[0], 3, 14, 14).transpose(0, 2, 3, 1)  # OHWI
        for old, new in VLM_NAMES:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        for name in (".wqkv.", ".wo."):
            key = key.replace(name, ".attn" + name) if key.startswith("vision_tower.blocks.") else key
        weights[key] = value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((ours / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(config))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copyfile(f, out / f.name)
    shutil.copyfile(ours / "tokenizer.json", out / "tokenizer.json")
    return out


def test_mlx_vlm_quantized_folder(converted, image, tmp_path, capsys):
    ours = converted("q4-unsafe")  # uniform 4-bit incl. the embedding, vision and connector float: mlx-vlm's
    ref = logits(load(ours), image)
    vlm = to_mlx_vlm(ours, tmp_path / "vlm", eos=151645)
    model = load(vlm)
    assert mx.array_equal(logits(model, image), ref).item()
    assert model.locate(image, "red box", mode="hybrid", max_tokens=12).token_ids

    # mlx-vlm also merges generation_config.json into config.json: eos_token_id becomes a list.
    vlm_list = to_mlx_vlm(ours, tmp_path / "vlm_list", eos=[151645, 151643])
    with pytest.raises(ValueError, match="already quantized"):
        convert(vlm_list, tmp_path / "requant", "float32", "q8")
    dst = convert(vlm_list, tmp_path / "back", "float32")
    out = capsys.readouterr().out
    assert "rename  vision_tower.blocks.{}.attn.wqkv -> vision_model.encoder.blocks.{}.wqkv" in out
    assert "rename  multi_modal_projector.linear_1 -> mlp1.1" in out
    assert "OHWI -> (128, 588) Linear" in out and "no stored head copy" in out
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["eos_token_id"] == 151645
    assert mx.array_equal(logits(load(dst), image), ref).item()


# --- bad input ----------------------------------------------------------------------------------------------


def edited_source(golden_dir, tmp_path, edit) -> str:
    src = golden_dir("tiny_random")
    out = tmp_path / "src"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f.resolve())
    weights = mx.load(str(src / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def test_missing_tensors_are_named(golden_dir, tmp_path):
    def drop(w):
        del w["language_model.model.layers.1.mlp.up_proj.weight"], w["mlp1.3.bias"]

    src = edited_source(golden_dir, tmp_path, drop)
    with pytest.raises(
        ValueError, match=r"missing tensors: language_model.model.layers.1.mlp.up_proj.weight, mlp1.3.bias"
    ):
        convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_wrong_shapes_are_named(golden_dir, tmp_path):
    def transpose(w):
        w["mlp1.1.weight"] = w["mlp1.1.weight"].T

    src = edited_source(golden_dir, tmp_path, transpose)
    with pytest.raises(ValueError, match=r"misshapen tensors: mlp1.1.weight \(256, 16\) \(expected \(16, 256\)\)"):
        convert(src, tmp_path / "out")


def test_head_copy_that_differs_is_reported(golden_dir, tmp_path, capsys):
    def perturb(w):
        w["language_model.lm_head.weight"] = w["language_model.lm_head.weight"] * 1.5

    convert(edited_source(golden_dir, tmp_path, perturb), tmp_path / "out")
    assert "WARNING: stored head copy differs from embed_tokens" in capsys.readouterr().out


def test_missing_files_are_named(golden_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        convert(src, tmp_path / "out")
    (src / "config.json").symlink_to(golden_dir("tiny_random") / "config.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer.*vocab.json, merges.txt"):
        convert(src, tmp_path / "out")
    for f in TOKENIZER_DIR.iterdir():
        (src / f.name).symlink_to(f)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        convert(src, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ValueError, match="would replace the source"):
        convert(golden_dir("tiny_random"), golden_dir("tiny_random"), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_existing_output_needs_force(golden_dir, tmp_path, capsys):
    src, dst = golden_dir("tiny_random"), tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main(["--hf-path", str(src), "--mlx-path", str(dst)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert main(["--hf-path", str(src), "--mlx-path", str(dst), "--force"]) == 0
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_leaves_nothing_half_written(golden_dir, tmp_path, monkeypatch):
    src, dst = golden_dir("tiny_random"), tmp_path / "out"

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(cv, "_write_readme", fail)  # after the weights and the tokenizer are written
    with pytest.raises(OSError, match="disk full"):
        convert(src, dst)
    assert list(tmp_path.iterdir()) == []
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(OSError, match="disk full"):
        convert(src, dst, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in dst.iterdir()] == ["keep.txt"]


# --- report -------------------------------------------------------------------------------------------------


def test_report(golden_dir, tmp_path, image, monkeypatch, capsys):
    monkeypatch.setattr(cv, "report_images", lambda: [("red", image)])
    monkeypatch.setattr(cv, "REPORT_PROMPTS", (("detect", "red box"),))
    monkeypatch.setattr(cv, "REPORT_MAX_TOKENS", 12)
    dst = tmp_path / "out"
    assert main(["--hf-path", str(golden_dir("tiny_random")), "--mlx-path", str(dst), "--report"]) == 0
    assert "block_step" in capsys.readouterr().out
    r = json.loads((dst / "report.json").read_text())
    assert r.keys() == {"source", "converted", "cases", "max_tokens", "weights_bytes", "speed_ms", "agreement", "modes"}
    assert r["cases"] == ["red detect"] and r["max_tokens"] == 12
    assert r["weights_bytes"]["source"] == r["weights_bytes"]["converted"]  # bf16 -> bf16, head not loaded
    assert set(r["speed_ms"]["converted"]) == {"prefill", "block_step", "ar_step"}
    for phase in ("prefill", "block_step", "ar_step"):  # the same weights: identical logits
        a = r["agreement"][phase]
        assert a["rows"] > 0 and a["top1_agreement"] == 1.0 and a["kl_max"] == 0.0
    assert set(r["modes"]) == set(MODES)
    for m in r["modes"].values():
        assert m["identical_tokens"] == 1.0 and m["box_iou_mean"] == 1.0


def test_no_progress_hides_the_bar(golden_dir, tmp_path, capsys):
    src = golden_dir("tiny_random")
    assert main(["--hf-path", str(src), "--mlx-path", str(tmp_path / "shown")]) == 0
    assert "converting" in capsys.readouterr().err
    assert main(["--hf-path", str(src), "--mlx-path", str(tmp_path / "hidden"), "--no-progress"]) == 0
    assert "converting" not in capsys.readouterr().err
