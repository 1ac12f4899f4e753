"""Strict checkpoint loading (docs/model.md §4): every bad input fails with an error that names the problem, and every
accepted layout (one file, shards + index, mlx-vlm names, no head copy, extra rotary buffers) gives the same model.

Variants are small copies of the golden `tiny_random` weights (10 MB) rewritten with `mx.save_safetensors`.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import GOLDEN, TOKENIZER_DIR
from mlx.utils import tree_flatten

from mlx_locate.config import ModelConfig
from mlx_locate.locate import load
from mlx_locate.request import Request
from mlx_locate.runtime import Runtime
from mlx_locate.tokenizer import Tokenizer
from mlx_locate.weights.loader import build_model

SOURCE = GOLDEN / "checkpoints" / "tiny_random"
HEAD = "language_model.lm_head.weight"


@pytest.fixture(scope="module")
def weights() -> dict[str, mx.array]:
    return mx.load(str(SOURCE / "model.safetensors"))


@pytest.fixture(scope="module")
def raw_config() -> dict:
    return json.loads((SOURCE / "config.json").read_text())


@pytest.fixture(scope="module")
def token_ids(raw_config):
    return Tokenizer.from_folder(TOKENIZER_DIR).token_ids(raw_config)


def write_checkpoint(folder: Path, tensors: dict[str, mx.array], config: dict | None = None) -> Path:
    """config.json (the golden one unless given) + model.safetensors; no tokenizer (build_model needs none)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or json.loads((SOURCE / "config.json").read_text())))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    return folder


def build(folder: Path, token_ids, dtype: str | None = "float32"):
    raw = json.loads((folder / "config.json").read_text())
    return build_model(folder, ModelConfig.from_dict(raw), token_ids, dtype)


def signature(net) -> np.ndarray:
    """Vision tower -> connector -> splice -> LM -> last-row logits, on fixed random input (2x2 merged tokens)."""
    rng = np.random.default_rng(0)
    patches = mx.array(rng.normal(size=(16, 3, 14, 14)).astype(np.float32))
    features = net.image_features(patches, (4, 4))
    ids = [151644, 872, 198] + [net.token_ids.image] * 4 + [9707, 198]
    embeds = net.embed(ids, features)
    T = len(ids)
    lm = net.language_model
    hidden, _ = lm(embeds, mx.arange(T), mx.tril(mx.ones((T, T), dtype=mx.bool_)))
    return np.array(lm.logits(hidden[:, -1]))


@pytest.fixture(scope="module")
def reference(weights, token_ids, tmp_path_factory) -> np.ndarray:
    return signature(build(write_checkpoint(tmp_path_factory.mktemp("ref"), weights), token_ids))


# ---------------------------------------------------------------- folders and config.json


def test_missing_folder(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + ".*does not exist"):
        load(missing)


def test_missing_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path}: missing config.json")):
        load(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{'text_config': ")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("section", "field", "message"),
    [
        ("text_config", "hidden_size", r"text_config: missing field\(s\) hidden_size"),
        ("text_config", "num_key_value_heads", r"text_config: missing field\(s\) num_key_value_heads"),
        ("vision_config", "patch_size", r"vision_config: missing field\(s\) patch_size"),
        (None, "vision_config", "missing section vision_config"),
    ],
)
def test_config_missing_field(tmp_path, raw_config, section, field, message):
    config = json.loads(json.dumps(raw_config))
    del (config[section] if section else config)[field]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(tmp_path)


# ---------------------------------------------------------------- weight files


def test_truncated_safetensors(tmp_path, weights, token_ids):
    folder = write_checkpoint(tmp_path / "cut", weights)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # header intact, tensor data cut
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": truncated safetensors file \(tensors need"):
        build(folder, token_ids)
    path.write_bytes(data[:100])  # inside the header
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": not a safetensors file, or truncated \(header of"):
        build(folder, token_ids)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": truncated safetensors file .*no header"):
        build(folder, token_ids)


def test_not_a_safetensors_file(tmp_path, token_ids):
    folder = write_checkpoint(tmp_path / "junk", {"x": mx.zeros((1,))})
    path = folder / "model.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b"this is not json at all, sorry")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": not a safetensors file"):
        build(folder, token_ids)
    # A file of another kind (here a PNG) reads as a huge header length.
    shutil.copy(GOLDEN / "images" / "shapes_448x448.png", path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": not a safetensors file, or truncated"):
        build(folder, token_ids)


def test_no_weights(tmp_path, token_ids):
    folder = write_checkpoint(tmp_path / "none", {"x": mx.zeros((1,))})
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        build(folder, token_ids)


# ---------------------------------------------------------------- names and shapes


def test_missing_tensor_is_named(tmp_path, weights, token_ids):
    gone = ["language_model.model.layers.1.mlp.up_proj.weight", "vision_model.encoder.blocks.0.wqkv.bias"]
    folder = write_checkpoint(tmp_path / "m", {k: v for k, v in weights.items() if k not in gone})
    with pytest.raises(ValueError, match="missing tensors: " + re.escape(", ".join(sorted(gone)))) as err:
        build(folder, token_ids)
    assert "unexpected" not in str(err.value) and "misshapen" not in str(err.value)


def test_wrong_shape_is_named(tmp_path, weights, token_ids):
    bad = dict(weights)
    bad["mlp1.1.weight"] = bad["mlp1.1.weight"].T
    folder = write_checkpoint(tmp_path / "s", bad)
    expected = "misshapen tensors: mlp1.1.weight (256, 16) (expected (16, 256))"
    with pytest.raises(ValueError, match=re.escape(expected)):
        build(folder, token_ids)


def test_unexpected_tensor_is_named(tmp_path, weights, token_ids):
    extra = "language_model.model.layers.0.self_attn.q_norm.weight"
    folder = write_checkpoint(tmp_path / "u", {**weights, extra: mx.ones((4,))})
    with pytest.raises(ValueError, match="unexpected tensors: " + re.escape(extra)):
        build(folder, token_ids)


def test_head_copy_and_rotary_buffers_dropped(tmp_path, weights, token_ids, reference):
    """No head copy, a head copy that differs (the head is tied to embed_tokens), and rotary buffers: all silent."""
    rotary = {
        "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((2,)),
        "language_model.model.rotary_emb.inv_freq": mx.ones((2,)),
        "vision_model.encoder.blocks.1.rotary_emb.cos_cached": mx.ones((4, 4)),
    }
    no_head = {k: v for k, v in weights.items() if k != HEAD}
    np.testing.assert_array_equal(signature(build(write_checkpoint(tmp_path / "a", no_head), token_ids)), reference)
    other_head = {**weights, **rotary, HEAD: mx.zeros_like(weights[HEAD])}
    np.testing.assert_array_equal(signature(build(write_checkpoint(tmp_path / "b", other_head), token_ids)), reference)


# ---------------------------------------------------------------- shards


def write_shards(folder: Path, weights: dict[str, mx.array]) -> dict:
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    write_checkpoint(folder, {"x": mx.zeros((1,))})
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for file, keys in shards.items():
        mx.save_safetensors(str(folder / file), {k: weights[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_shards_through_the_index(tmp_path, weights, token_ids, reference):
    folder = tmp_path / "sharded"
    write_shards(folder, weights)
    (folder / "stray.safetensors").write_bytes(b"not read: only the index's files are")
    np.testing.assert_array_equal(signature(build(folder, token_ids)), reference)


def test_shard_named_in_index_but_missing(tmp_path, weights, token_ids):
    folder = tmp_path / "sharded"
    write_shards(folder, weights)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json.*model-00002-of-00002\.safetensors"):
        build(folder, token_ids)


# ---------------------------------------------------------------- the mlx-vlm layout


def to_mlx_vlm(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """docs/model.md §4: vision_model.{encoder.,} -> vision_tower., blocks' wqkv/wo -> attn.*, OHWI patch weight,
    mlp1.{0,1,3} -> multi_modal_projector.{layer_norm,linear_1,linear_2}, no head copy."""
    out = {}
    projector = {"mlp1.0.": "layer_norm.", "mlp1.1.": "linear_1.", "mlp1.3.": "linear_2."}
    for key, value in weights.items():
        if key == HEAD:
            continue
        if key == "vision_model.patch_embed.proj.weight":
            value = value.transpose(0, 2, 3, 1)
        key = re.sub(r"^vision_model\.(encoder\.)?", "vision_tower.", key)
        key = re.sub(r"^(vision_tower\.blocks\.\d+\.)(wqkv|wo)\.", r"\1attn.\2.", key)
        for old, new in projector.items():
            if key.startswith(old):
                key = "multi_modal_projector." + new + key[len(old) :]
        out[key] = value
    return out


def test_mlx_vlm_layout(tmp_path, weights, token_ids, reference):
    converted = to_mlx_vlm(weights)
    assert "vision_tower.blocks.1.attn.wqkv.weight" in converted
    assert "vision_tower.final_layernorm.bias" in converted
    assert converted["vision_tower.patch_embed.proj.weight"].shape == (64, 14, 14, 3)
    assert "multi_modal_projector.linear_2.bias" in converted and HEAD not in converted
    net = build(write_checkpoint(tmp_path / "vlm", converted), token_ids)
    np.testing.assert_array_equal(signature(net), reference)


# ---------------------------------------------------------------- dtypes


def test_dtypes(tmp_path, weights, token_ids, reference):
    folder = write_checkpoint(tmp_path / "d", weights)
    stored = build(folder, token_ids, dtype=None)
    params = dict(tree_flatten(stored.parameters()))
    assert {p.dtype for p in params.values()} == {mx.bfloat16}  # as stored: no float32 copy
    assert sum(p.nbytes for p in params.values()) == sum(v.nbytes for k, v in weights.items() if k != HEAD)
    cast = build(folder, token_ids, dtype="float32")
    assert {p.dtype for p in dict(tree_flatten(cast.parameters())).values()} == {mx.float32}
    for bad in ("float64", "fp8", "bf16"):
        with pytest.raises(ValueError, match=f"unknown dtype '{bad}'; choose one of bfloat16, float16, float32"):
            build(folder, token_ids, dtype=bad)


def test_load_end_to_end(golden_dir):
    """The public `load` on the golden folder (config, tokenizer, weights, preprocessor limit)."""
    model = load(golden_dir("tiny_random"))
    assert model.runtime.network.language_model.model.norm.weight.dtype == mx.float32  # the CPU backend's fast path
    stored = load(golden_dir("tiny_random"), dtype="bfloat16")
    assert stored.runtime.network.language_model.model.norm.weight.dtype == mx.bfloat16
    assert model.runtime.in_token_limit == 25600 and model.runtime.token_ids.image == 151665


def test_one_way_in_gives_inference_and_training_the_same_record():
    """`read_checkpoint` is what `load` and fine-tuning start from: the demo's patch limit, positions, path and
    known categories (its five shapes); `LocateModel` over the record answers as `load` does."""
    from mlx_locate.locate import LocateModel
    from mlx_locate.weights.cards import known_categories
    from mlx_locate.weights.checkpoint import DEMO_DIR
    from mlx_locate.weights.loader import read_checkpoint

    checkpoint = read_checkpoint("demo")
    raw = json.loads((DEMO_DIR / "config.json").read_text())
    assert (checkpoint.in_token_limit, checkpoint.max_length, checkpoint.path) == (256, 2048, "demo")
    assert checkpoint.known == known_categories(raw) and checkpoint.config.raw == raw
    model = load("demo")
    assert model.runtime.max_length == checkpoint.max_length and model.runtime.in_token_limit == 256
    image = DEMO_DIR / "example.png"
    want = model.locate(image, "square", mode="fast", max_tokens=32).token_ids
    assert LocateModel(checkpoint).locate(image, "square", mode="fast", max_tokens=32).token_ids == want


def test_the_public_model_shows_the_api_and_holds_the_engines_side():
    """`LocateModel` holds its runtime (the engine's side, `model.runtime`) instead of being one: its public names
    are the API's."""
    model = load("demo")
    assert {name for name in dir(model) if not name.startswith("_")} == {
        "engine", "locate", "locate_many", "runtime", "session"
    }  # fmt: skip
    assert not isinstance(model, Runtime) and isinstance(model.runtime, Runtime)


def test_the_runtime_fuses_a_view_and_leaves_the_checkpoints_network_as_it_was():
    """A model over a checkpoint someone keeps (fine-tuning trains it) works on a view: the checkpoint's
    projections stay unfused, its head as stored and its modules in training mode."""
    from mlx_locate.locate import LocateModel
    from mlx_locate.weights.loader import read_checkpoint

    checkpoint = read_checkpoint("demo")
    network = checkpoint.network
    network.train()
    model = LocateModel(checkpoint)
    mine, theirs = model.runtime.network.language_model.model, network.language_model.model
    assert "qkv_proj" in mine.layers[0].self_attn and "gate_up_proj" in mine.layers[0].mlp
    assert "qkv_proj" not in theirs.layers[0].self_attn and "q_proj" in theirs.layers[0].self_attn
    assert "gate_up_proj" not in theirs.layers[0].mlp and type(theirs.embed_tokens) is nn.Embedding
    assert network.training and not model.runtime.network.training
    assert mine.norm.weight is theirs.norm.weight  # a view: the arrays are shared


def test_load_gives_the_network_over_so_its_peak_holds_one_copy_of_the_projections():
    """`load` hands its checkpoint over (`take_over`): the unfused projections are freed as the fused ones load, so
    the load's peak stays below the weights plus the decoder's projections, which a view of a kept network holds
    twice."""
    from mlx_locate.locate import LocateModel
    from mlx_locate.weights.loader import read_checkpoint

    projections = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    decoder = read_checkpoint("demo").network.language_model.model.parameters()
    twice = sum(v.nbytes for k, v in tree_flatten(decoder) if any(f".{p}." in k for p in projections))

    def peak_and_weights(make) -> tuple[int, int]:
        """The peak while `make()` loads a model, and the model's weights, above what was held before."""
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        model = make()
        mx.eval(model.runtime.network.parameters())
        weights = sum(v.nbytes for _, v in tree_flatten(model.runtime.network.parameters()))
        return mx.get_peak_memory() - base, weights

    loaded, weights = peak_and_weights(lambda: load("demo"))
    kept = []
    viewed, _ = peak_and_weights(lambda: LocateModel(kept.append(read_checkpoint("demo")) or kept[0]))
    assert loaded - weights < twice <= viewed - weights


def test_a_checkpoint_loads_on_streams_of_its_own_not_the_requests(monkeypatch):
    """The files are read on the loading CPU stream; the model is built (cast, copied) and its projections fused on
    the loading device stream (`checkpoint.loading_streams`). Work queued on the requests' default stream would
    wait behind the decoder's load there, and the tower could not run while the decoder loads."""
    import mlx_locate.runtime as runtime_module
    from mlx_locate.weights import checkpoint, loader

    files, device = checkpoint.loading_streams()
    assert device != mx.default_stream(mx.default_device()) and files != mx.default_stream(mx.cpu)
    seen: dict[str, set] = {}
    read = mx.load

    def read_on(path, stream=None):
        seen.setdefault("read", set()).add(stream == files)
        return read(path, stream=stream)

    def on_stream(name, f):
        def run(*args, **kwargs):
            seen.setdefault(name, set()).add(mx.default_stream(mx.default_device()) == device)
            return f(*args, **kwargs)

        return run

    monkeypatch.setattr(mx, "load", read_on)
    monkeypatch.setattr(loader, "assemble_model", on_stream("build", loader.assemble_model))
    monkeypatch.setattr(runtime_module, "fuse_projections", on_stream("fuse", runtime_module.fuse_projections))
    model = load("demo")
    assert seen == {"read": {True}, "build": {True}, "fuse": {True}}
    assert mx.default_stream(mx.default_device()) != device  # the load leaves the default stream as it was
    assert model.locate(checkpoint.DEMO_IMAGE, "square", mode="fast", max_tokens=32).objects


def test_the_tokenizer_is_built_while_the_towers_weights_are_read(monkeypatch):
    """The tokenizers library holds the interpreter while it builds a tokenizer: built on a thread that starts at
    once, it kept the loading thread from queuing any read for as long. So the thread waits until the tower's
    weights are queued and the host is about to wait for them, and no longer."""
    import threading

    from mlx_locate.weights import checkpoint as files
    from mlx_locate.weights import loader

    log: list[str] = []
    queued = threading.Event()
    build, evaluate, from_folder = loader.build_model, mx.eval, Tokenizer.from_folder

    def build_logged(*args, meanwhile=None, **kwargs):
        def hook():
            log.append("tower queued")
            queued.set()
            meanwhile()

        return build(*args, meanwhile=hook, **kwargs)

    def eval_logged(*arrays):
        if not queued.is_set():
            log.append("eval before the hook")
        return evaluate(*arrays)

    def tokenizer_logged(folder):
        log.append("tokenizer" if queued.is_set() else "tokenizer before the tower was queued")
        return from_folder(folder)

    monkeypatch.setattr(loader, "build_model", build_logged)
    monkeypatch.setattr(mx, "eval", eval_logged)
    monkeypatch.setattr(Tokenizer, "from_folder", tokenizer_logged)
    checkpoint = loader.read_checkpoint("demo")
    assert log == ["tower queued", "tokenizer"]
    assert checkpoint.tokenizer.encode("square") and checkpoint.network.token_ids == checkpoint.tokenizer.token_ids(
        json.loads((files.DEMO_DIR / "config.json").read_text())
    )


def test_eos_list_in_config_reads_its_first_id(tmp_path, weights, raw_config):
    """mlx-vlm's converter writes generation_config.json's eos list into config.json."""
    config = {**raw_config, "eos_token_id": [151645, 151643]}
    folder = write_checkpoint(tmp_path / "ck", weights, config)
    for name in ("added_tokens.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    assert load(folder).runtime.token_ids.im_end == raw_config["eos_token_id"] == 151645


def test_unknown_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"'someone/missing' is not a local folder .*no network"):
        load("someone/missing")


@pytest.mark.parametrize(
    ("name", "dtype"), [("tiny_random", "float32"), ("tiny_peaky", "float32"), ("tiny_random", "bfloat16")]
)
def test_a_decoder_read_ahead_answers_as_the_loader_does(golden_dir, monkeypatch, name, dtype):
    """Threads read the decoder's weights from the start (`checkpoint.ReadAhead`, what `load` does on a GPU),
    and the network holds stand-ins until its first use. The stand-ins are NaN here: any use of one before the
    threads' weights take their place (the prefix's embedding, the budget's probes, a step) would change the
    answer. Every mode, and a batch, gives the loader's tokens."""
    from mlx_locate.locate import LocateModel
    from mlx_locate.tune import probes_of
    from mlx_locate.weights import loader

    folder = golden_dir(name)
    image = GOLDEN / "images" / sorted(p.name for p in (GOLDEN / "images").iterdir())[0]
    asks = [(mode, query) for mode in ("fast", "hybrid", "slow") for query in ("red box", "square")]

    def answers(model):
        lone = [model.locate(image, q, mode=mode, max_tokens=40).token_ids for mode, q in asks]
        requests = [Request(image, q, mode=mode, max_tokens=40) for mode, q in asks]
        return lone, [r.token_ids for r in model.locate_many(requests)]

    loaded = load(folder, dtype=dtype, tune=False)
    probes = probes_of(loaded.runtime)  # as a cache file gives them: a first load's probes run the decoder
    want = answers(loaded)
    read = loader.read_weights

    def stand_ins(folder):
        return {k: mx.full(v.shape, np.nan, v.dtype) if loader.is_decoders(k) else v for k, v in read(folder).items()}

    monkeypatch.setattr(loader, "read_weights", stand_ins)
    poisoned = LocateModel(loader.read_checkpoint(folder, dtype, read_ahead=3), probes, take_over=True)
    assert poisoned.runtime.weights.ahead is not None  # nothing has used the decoder yet
    assert answers(poisoned) == want
    assert poisoned.runtime.weights.ahead is None and not any(
        np.isnan(np.array(v.astype(mx.float32))).any()
        for _, v in tree_flatten(poisoned.runtime.network.language_model.parameters())
    )
    # A first load on a device runs the budget's probes through the decoder: its weights are put in before.
    first_load = LocateModel(loader.read_checkpoint(folder, dtype, read_ahead=3), take_over=True)
    assert first_load.runtime.weights.ahead is None and answers(first_load) == want
    # Without the threads' weights in their place, the stand-ins answer (the check above can fail).
    assert answers(LocateModel(loader.read_checkpoint(folder, dtype), probes, take_over=True)) != want


def test_no_read_ahead_where_loading_changes_the_decoders_weights(golden_dir, tmp_path):
    """An adapter, or PEFT pairs in the checkpoint, change the decoder's weights as they load: those load as
    the network is built, whatever `read_ahead` asks."""
    from mlx_locate.weights import loader

    folder = golden_dir("tiny_random")
    assert loader.read_checkpoint(folder, "float32", read_ahead=2).ahead is not None
    peft = tmp_path / "peft"
    shutil.copytree(folder, peft)
    weights = mx.load(str(peft / "model.safetensors"))
    dims = weights["language_model.model.layers.0.self_attn.q_proj.weight"].shape
    weights["language_model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] = mx.zeros((2, dims[1]))
    weights["language_model.model.layers.0.self_attn.q_proj.lora_B.default.weight"] = mx.zeros((dims[0], 2))
    mx.save_safetensors(str(peft / "model.safetensors"), weights)
    config = json.loads((peft / "config.json").read_text())
    (peft / "config.json").write_text(json.dumps({**config, "use_llm_lora": 2}))
    assert loader.read_checkpoint(peft, "float32", read_ahead=2).ahead is None


def test_read_ahead_threads_from_the_environment(monkeypatch):
    """MLX_LOCATE_READ_AHEAD sets the reading threads (the bench's cold one-shot without them sets 0); a value
    that is no whole number from 0 to 64 is ignored with a warning. On the CPU backend none by default."""
    from mlx_locate import locate

    monkeypatch.delenv(locate.READ_AHEAD_ENV, raising=False)
    assert locate.read_ahead_threads() == 0
    monkeypatch.setenv(locate.READ_AHEAD_ENV, "3")
    assert locate.read_ahead_threads() == 3
    for bad in ("-1", "two", "65"):
        monkeypatch.setenv(locate.READ_AHEAD_ENV, bad)
        with pytest.warns(UserWarning, match=f"MLX_LOCATE_READ_AHEAD={bad!r} is not a whole number from 0 to 64"):
            assert locate.read_ahead_threads() == 0
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setenv(locate.READ_AHEAD_ENV, "")
    assert locate.read_ahead_threads() == locate.READ_AHEAD_THREADS
