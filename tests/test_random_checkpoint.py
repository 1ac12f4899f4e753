import json

import numpy as np
import pytest
from conftest import GOLDEN
from safetensors import safe_open

from mlx_locate.weights import checkpoint, random_checkpoint
from mlx_locate.weights.random_checkpoint import PRESETS, make_random_checkpoint, tensor_specs


def _shapes(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="numpy") as f:
        return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("rc") / "tiny", "tiny", seed=3)


def test_tiny_matches_golden_layout(tiny):
    golden = GOLDEN / "checkpoints" / "tiny_random"
    assert _shapes(tiny / "model.safetensors") == _shapes(golden / "model.safetensors")
    with safe_open(str(tiny / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    assert json.loads((tiny / "config.json").read_text()) == json.loads((golden / "config.json").read_text())
    for src in (GOLDEN / "tokenizer").iterdir():
        assert (tiny / src.name).read_bytes() == src.read_bytes()


def test_tiny_initialisation(tiny):
    import mlx.core as mx

    w = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(tiny / "model.safetensors")).items()}
    assert np.array_equal(w["language_model.lm_head.weight"], w["language_model.model.embed_tokens.weight"])
    assert abs(w["language_model.model.norm.weight"].mean() - 1) < 0.02
    assert 0.4 < w["language_model.model.layers.0.mlp.up_proj.weight"].std() < 0.6
    assert 0.015 < w["vision_model.encoder.blocks.0.wqkv.weight"].std() < 0.025


def test_refuses_overwrite_unless_forced(tiny, tmp_path):
    with pytest.raises(FileExistsError, match="not empty"):
        make_random_checkpoint(tiny, "tiny")
    out = tmp_path / "x"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert random_checkpoint.main(["--out", str(out)]) == 2
    assert random_checkpoint.main(["--out", str(out), "--seed", "3", "--force"]) == 0
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()  # seed -> bytes


def test_sharded_index(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "MAX_SHARD_BYTES", 4 * 10**6)
    out = make_random_checkpoint(tmp_path / "sharded", "tiny", dtype="float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    shapes = {}
    for name in files:
        shapes.update(_shapes(out / name))
    assert set(shapes) == set(index["weight_map"])
    assert {dtype for dtype, _ in shapes.values()} == {"F32"}


def test_presets_and_errors(tmp_path):
    specs = tensor_specs(PRESETS["3b"])  # docs/model.md §4: 770 tensors, 7.661 GB in bf16
    assert len(specs) == 770
    assert sum(int(np.prod(s.shape)) for s in specs) * 2 == 7_661_331_936
    shapes = {s.name: s.shape for s in specs}
    assert shapes["vision_model.encoder.blocks.26.wqkv.weight"] == (3456, 1152)
    assert shapes["language_model.model.layers.35.self_attn.k_proj.weight"] == (256, 2048)
    assert shapes["mlp1.1.weight"] == (2048, 4608)
    with pytest.raises(ValueError, match="unknown preset"):
        make_random_checkpoint(tmp_path / "a", "huge")
    with pytest.raises(ValueError, match="kv heads"):
        make_random_checkpoint(tmp_path / "b", "tiny", overrides={"text_kv_heads": 3})
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        make_random_checkpoint(tmp_path / "c", "tiny", tokenizer_dir=tmp_path)
