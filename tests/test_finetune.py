"""Fine-tuning: LoRA layers against numpy, adapter files (ours and PEFT's), the data formats, and a real fine-tune of
the demo model on a colour it never saw (before/after F1 in every mode, the adapter loaded, fused and quantized)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_locate.locate import load
from mlx_locate.tuner.datasets import Record, Turn, encode_record, read_data, split
from mlx_locate.weights import lora
from mlx_locate.weights.checkpoint import DEMO_DIR
from mlx_locate.weights.lora import (
    ADAPTER_FILE,
    CONFIG_FILE,
    AdapterSpec,
    FusedLoRALinear,
    LoRALinear,
    LoRASpec,
    add_lora,
    save_adapter,
)

IMAGE = DEMO_DIR / "example.png"


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _lora(base: nn.Module, rank: int, scale: float, seed: int) -> LoRALinear:
    layer = LoRALinear.from_base(base, rank, scale)
    in_dims, out_dims = lora.linear_dims(base)
    layer.lora_b = mx.random.normal((rank, out_dims), key=mx.random.key(seed)) * 0.1
    return layer


def test_lora_linear_against_numpy():
    """y = x W^T + b + scale (x A) B, float and quantized bases (tolerance 1e-5 relative to the output scale)."""
    mx.random.seed(0)
    x = mx.random.normal((3, 5, 64))
    for base in (nn.Linear(64, 48), nn.QuantizedLinear.from_linear(nn.Linear(64, 128, bias=False), 32, 8)):
        layer = _lora(base, 4, 2.0, seed=1)
        if isinstance(base, nn.QuantizedLinear):
            w = _np(mx.dequantize(base.weight, base.scales, base.biases, base.group_size, base.bits))
        else:
            w = _np(base.weight)
        ref = (
            _np(x) @ w.T
            + (_np(base.bias) if "bias" in base else 0)
            + 2.0 * (_np(x) @ _np(layer.lora_a)) @ _np(layer.lora_b)
        )
        np.testing.assert_allclose(_np(layer(x)), ref, atol=1e-5 * np.abs(ref).max())
        # Merged into the weights: the same outputs (a quantized base re-quantizes, so to its rounding).
        fused = layer.fuse()
        assert type(fused) is type(base)
        tol = 1e-5 if isinstance(base, nn.Linear) else 2e-2
        np.testing.assert_allclose(_np(fused(x)), ref, atol=tol * np.abs(ref).max())


def test_fused_lora_projections_equal_their_parts():
    """q|k|v with LoRA on q and v only: one base product plus one block-diagonal pair == the three outputs."""
    mx.random.seed(2)
    x = mx.random.normal((2, 7, 64))
    for quantize in (False, True):
        bases = [nn.Linear(64, n) for n in (64, 32, 32)]
        if quantize:
            bases = [nn.QuantizedLinear.from_linear(b, 64, 4) for b in bases]
        parts = [_lora(bases[0], 4, 2.0, 3), bases[1], _lora(bases[2], 8, 0.5, 4)]
        fused = FusedLoRALinear.from_parts(parts, mx.float32)
        assert fused.lora_a.shape == (64, 12) and fused.lora_b.shape == (12, 128)
        np.testing.assert_allclose(
            np.array(fused(x)), np.concatenate([np.array(p(x)) for p in parts], axis=-1), atol=1e-5
        )
    unlike = [_lora(nn.Linear(64, 64), 4, 1.0, 5), nn.QuantizedLinear.from_linear(nn.Linear(64, 32), 64, 4)]
    assert FusedLoRALinear.from_parts(unlike, mx.float32) is None


def _demo_network(dtype="float32"):
    from mlx_locate.weights.loader import read_checkpoint

    return read_checkpoint("demo", dtype)


def _random_adapter(tmp_path, spec: AdapterSpec, seed: int = 0, strength: float = 0.05):
    """The demo network with `spec`'s LoRA, every pair and the connector moved away from the base."""
    base = _demo_network()
    add_lora(base.network, spec)
    keys = iter(mx.random.split(mx.random.key(seed), 1000))
    updates = []
    for name, value in tree_flatten(base.network.trainable_parameters()):
        noise = mx.random.normal(value.shape, key=next(keys))
        updates.append((name, value + strength * noise if not name.endswith("lora_b") else strength * noise))
    from mlx.utils import tree_unflatten

    base.network.update(tree_unflatten(updates))
    folder = tmp_path / "adapter"
    save_adapter(folder, base.network, spec)
    return base, folder


def _peft_copy(ours, dest):
    """Our adapter rewritten the way PEFT saves NVIDIA's (`language_model` wrapped by get_peft_model)."""
    from mlx_locate.weights.lora import read_adapter

    adapter = read_adapter(ours)
    dest.mkdir()
    tensors = {}
    for path, (a, b, _) in adapter.pairs.items():
        key = "base_model.model." + path.removeprefix("language_model.")
        tensors[f"{key}.lora_A.weight"] = a.T
        tensors[f"{key}.lora_B.weight"] = b.T
    rank, scale = a.shape[1], next(iter(adapter.pairs.values()))[2]
    mx.save_safetensors(str(dest / "adapter_model.safetensors"), tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.05,
        "target_modules": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"],
        "bias": "none",
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def test_adapter_loads_merged_kept_and_peft(tmp_path):
    """load(adapter_path=) merges into a float base and gives the tokens of the unmerged training-time network;
    a PEFT adapter with the same pairs gives the same tokens; the base files are only read."""
    from mlx_locate.locate import LocateModel

    spec = AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.0, keys=lora.DECODER_KEYS[:4]), trainable=())
    base, folder = _random_adapter(tmp_path, spec)
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["scale"] == 2.0
    before = hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest()
    trained = LocateModel(base)
    merged = load("demo", dtype="float32", adapter_path=folder)
    peft = load("demo", dtype="float32", adapter_path=_peft_copy(folder, tmp_path / "peft"))
    plain = load("demo", dtype="float32")
    layer, plain_layer = (m.runtime.network.language_model.model.layers[0] for m in (merged, plain))
    assert type(layer.self_attn.qkv_proj) is type(plain_layer.self_attn.qkv_proj)  # merged, then fused as plain
    for mode in ("slow", "fast", "hybrid"):
        want = trained.locate(IMAGE, "square", mode=mode, max_tokens=48)
        assert merged.locate(IMAGE, "square", mode=mode, max_tokens=48).token_ids == want.token_ids, mode
        assert peft.locate(IMAGE, "square", mode=mode, max_tokens=48).token_ids == want.token_ids, mode
    # The adapter is applied: it moves the answer's probabilities (a small one need not change a token; whether
    # it does may turn on the last bits of the kernels the tuner chose).
    adapted, base_answer = (m.locate(IMAGE, "square", max_tokens=48) for m in (merged, plain))
    assert (adapted.token_ids, adapted.token_probs) != (base_answer.token_ids, base_answer.token_probs)
    assert hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest() == before


def test_adapter_errors(tmp_path):
    spec = AdapterSpec(LoRASpec(rank=2, alpha=4, dropout=0.0, keys=("self_attn.q_proj",)))
    _, folder = _random_adapter(tmp_path, spec)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("demo", adapter_path=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load("demo", adapter_path=DEMO_DIR)
    weights = mx.load(str(folder / ADAPTER_FILE))
    name = "language_model.model.layers.0.self_attn.q_proj.lora_a"
    weights[name] = mx.zeros((100, 2))
    mx.save_safetensors(str(folder / ADAPTER_FILE), weights)
    with pytest.raises(ValueError, match=r"does not fit the model: language_model\.model\.layers\.0\.self_attn"):
        load("demo", adapter_path=folder)
    weights["mlp1.9.weight"] = mx.zeros((2, 2))
    del weights[name]
    mx.save_safetensors(str(folder / ADAPTER_FILE), weights)
    with pytest.raises(ValueError, match="lora_b"):
        load("demo", adapter_path=folder)
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        load("demo", adapter_path=folder)


def test_add_lora_targets_and_freezing():
    base = _demo_network()
    spec = AdapterSpec(LoRASpec(rank=4, alpha=8, num_layers=2), LoRASpec(rank=2, alpha=4, keys=lora.VISION_KEYS))
    n = add_lora(base.network, spec)
    trainable = dict(tree_flatten(base.network.trainable_parameters()))
    t = base.network.config.text
    lm = [k for k in trainable if k.startswith("language_model.")]
    assert len(lm) == 2 * 7 * 2 and all(f"layers.{t.num_hidden_layers - 1}." in k or "layers.2." in k for k in lm)
    assert len([k for k in trainable if k.startswith("vision_model.")]) == 4 * 4 * 2
    connector = {k for k in trainable if k.startswith("mlp1.")}
    assert connector == {f"mlp1.{i}.{p}" for i in (0, 1, 3) for p in ("weight", "bias")}
    assert n == sum(v.size for v in trainable.values())
    with pytest.raises(ValueError, match="LoRA on 9 layers"):
        add_lora(_demo_network().network, AdapterSpec(LoRASpec(num_layers=9)))


# --- Data ----------------------------------------------------------------------------------------------------


def _write(path, text):
    path.write_text(text)
    return path


def test_sft_jsonl_and_multi_turn_rows(tmp_path):
    """Each turn's answer is supervised in both streams; the image sits in the first user turn."""
    from mlx_locate.tokenizer import Tokenizer

    line = {
        "image": "example.png",
        "conversations": [
            {"from": "human", "value": "Locate all the instances that matches the following description: square."},
            {"from": "gpt", "value": "<ref>square</ref><box><10><20><30><40></box>"},
            {"from": "human", "value": "Point to: circle."},
            {"from": "gpt", "value": "<box>None</box>"},
        ],
    }
    data = _write(tmp_path / "d.jsonl", json.dumps(line) + "\n\n" + json.dumps({**line, "image": "b.png"}) + "\n")
    records = read_data(data, DEMO_DIR)
    assert [r.image.name for r in records] == ["example.png", "b.png"] and len(records[0].turns) == 2
    tok = Tokenizer.from_folder(DEMO_DIR)
    ids = load("demo").runtime.token_ids
    rows = encode_record(records[0], (4, 4), tok, ids)
    x = rows.ids[: rows.length].tolist()
    assert x.count(ids.image) == 4 and x.count(ids.im_end) == 5  # system, user, answer, user, answer
    supervised = tok.decode([int(t) for t, k in zip(rows.targets, rows.kinds, strict=True) if k == 1])
    assert supervised == "<ref>square</ref><box><10><20><30><40></box><|im_end|><box>None</box><|im_end|>"
    assert sum(rows.kinds > 1) == 6 * (3 + 2)  # blocks: ref, box, end; None, end


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"image": "a.png", "conversations": [{"from": "gpt", "value": "x"}]}', "alternate"),
        ('{"image": "a.png", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": '
         '"<box><1><2><3></box>"}]}', "4 \\(box\\) or 2"),
        ('{"image": "a.png", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": '
         '"<box><1><2><3><1200></box>"}]}', "<0>..<1000>"),
        ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}]}', "image"),
        ('{"image_list": ["a", "b"], "conversations": []}', "one image"),
        ("not json", "line 1|:1: not valid JSON"),
    ],
)  # fmt: skip
def test_sft_jsonl_errors_name_the_line(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_data(_write(tmp_path / "d.jsonl", line + "\n"))


def test_coco_instances_with_absent_categories(tmp_path):
    coco = {
        "images": [{"id": 1, "file_name": "a.png", "width": 200, "height": 100}],
        "categories": [{"id": 1, "name": "bolt"}, {"id": 2, "name": "nut"}, {"id": 3, "name": "gear"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [100, 10, 50, 20]},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [10, 50, 20, 40]},
            {"id": 3, "image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5], "iscrowd": 1},
        ],
    }
    data = _write(tmp_path / "instances.json", json.dumps(coco))
    (record,) = read_data(data, categories_per_prompt=3)
    turn = record.turns[0]
    order = turn.user.split(": ")[1].rstrip(".").split("</c>")
    assert sorted(order) == ["bolt", "gear", "nut"]
    answers = {
        "bolt": "<ref>bolt</ref><box><50><500><150><900></box><box><500><100><750><300></box>",
        "nut": "<ref>nut</ref><box>None</box>",  # its only box is a crowd
        "gear": "<ref>gear</ref><box>None</box>",
    }
    assert turn.answer == "".join(answers[c] for c in order)
    (one,) = read_data(data, categories_per_prompt=1)
    assert one.turns[0].answer == answers["bolt"]


def test_recipe_and_split(tmp_path):
    line = '{"image": "%s", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n'
    _write(tmp_path / "a.jsonl", "".join(line % f"{i % 5}.png" for i in range(10)))
    recipe = _write(tmp_path / "r.json", json.dumps({"x": {"annotation": "a.jsonl", "root": "im", "repeat_time": 1.5}}))
    records = read_data(recipe)
    assert len(records) == 15 and records[0].image == tmp_path / "im" / "0.png"
    train, held = split(records, 0.2, seed=0)
    assert len({r.image for r in held}) == 1 and not {r.image for r in held} & {r.image for r in train}
    assert len(train) + len(held) == 15
    with pytest.raises(ValueError, match="neither COCO"):
        read_data(_write(tmp_path / "x.json", "[1]"))


def test_record_prompt_matches_inference(tmp_path):
    """The training prompt of a one-turn record is the prompt `locate` builds for the same text."""
    from mlx_locate.tokenizer import Tokenizer

    model = load("demo")
    text = "Locate all the instances that match the following description: red circle."
    result = model.locate(IMAGE, prompt=text, max_tokens=4)
    record = Record(IMAGE, (Turn(text, "<box>None</box>"),), "t")
    rows = encode_record(record, tuple(result.grid), Tokenizer.from_folder(DEMO_DIR), model.runtime.token_ids)
    assert rows.ids[: len(result.prompt_ids)].tolist() == result.prompt_ids
    assert math.isfinite(len(result.prompt_ids))


# --- A real fine-tune: the demo model learns a shape it never saw ---------------------------------------------

TRAIN_SAMPLES, HELD_OUT = 300, 24


@pytest.fixture(scope="module")
def novel_files(tmp_path_factory):
    from mlx_locate.synthetic.scenes import write_novel_data
    from mlx_locate.tuner.finetune import DEMO_WORD

    folder = write_novel_data(tmp_path_factory.mktemp("novel"), DEMO_WORD, TRAIN_SAMPLES, HELD_OUT)
    return folder / "train.jsonl", folder / "eval.jsonl"


@pytest.fixture(scope="module")
def novel_data(novel_files):
    return read_data(novel_files[0]), read_data(novel_files[1])


@pytest.fixture(scope="module")
def tuned(novel_data, tmp_path_factory):
    """The README's walk-through: the demo model learns "ring" (a shape it never saw; 3 tokens in its vocabulary)."""
    from mlx_locate.tuner.finetune import DEMO_OPTIONS, DEMO_SPEC, finetune

    base_hash = hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest()
    base = _demo_network()
    out = tmp_path_factory.mktemp("tuned") / "adapter"
    result = finetune(base, *novel_data, out, DEMO_SPEC, DEMO_OPTIONS, progress=False, say=lambda *_: None)
    return base, result, base_hash


@pytest.mark.slow
def test_finetune_teaches_a_new_shape(tuned):
    """Held-out F1@0.5 (boxes with the right label) about 0 before, at least 0.8 after, in every mode."""
    _, result, _ = tuned
    for mode in ("slow", "fast", "hybrid"):
        assert result.before["f1"][mode]["f1@0.5"] <= 0.1, result.before["f1"]
        assert result.after["f1"][mode]["f1@0.5"] >= 0.8, (mode, result.after["f1"])
        assert result.after["f1"][mode]["ended_rate"] == 1.0
    assert result.after["loss"] < result.before["loss"] / 5
    out = result.out
    assert {p.name for p in out.iterdir()} >= {ADAPTER_FILE, CONFIG_FILE, "log.jsonl", "training.png", "checkpoints"}
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in lines if "eval" in h] == [0, result.history[-1]["step"]]
    assert len([p for p in (out / "checkpoints").iterdir()]) == 2


def assert_loaded_and_fused_give_training_time_tokens(base, adapter, requests, tmp_path):
    """The network as trained (LoRA beside the weights), `load(adapter_path=)` (merged) and the checkpoint that
    `mlx-locate-convert --adapter --fuse` writes produce the same tokens; the base files never change."""
    from mlx_locate.commands.convert import main as convert_main
    from mlx_locate.locate import LocateModel

    base_hash = hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest()
    fused = tmp_path / "fused"
    argv = ["--hf-path", "demo", "--mlx-path", str(fused), "--dtype", "float32", "--adapter", str(adapter)]
    assert convert_main([*argv, "--fuse"]) == 0
    models = [LocateModel(base), load("demo", "float32", adapter_path=adapter), load(fused)]
    tokens = [[r.token_ids for r in m.locate_many(requests)] for m in models]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest() == base_hash
    return tokens[0]


def held_out_requests(records, max_tokens: int) -> list:
    from mlx_locate.request import Request

    return [
        Request(r.image, prompt=r.turns[0].user, mode=mode, max_tokens=max_tokens)
        for r in records
        for mode in ("slow", "fast", "hybrid")
    ]


@pytest.mark.slow
def test_adapter_loaded_and_fused_give_training_time_tokens(tuned, novel_data, tmp_path):
    base, result, base_hash = tuned
    requests = held_out_requests(novel_data[1][:8], 64)
    assert_loaded_and_fused_give_training_time_tokens(base, result.out, requests, tmp_path)
    assert hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest() == base_hash


def test_a_random_adapter_loaded_and_fused_gives_the_training_time_tokens(tmp_path):
    """The fast tier's check of the rule above, on an adapter of random pairs (which changes the answers)."""
    from mlx_locate.request import Request

    base, folder = _random_adapter(tmp_path, AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.0)))
    requests = [Request(IMAGE, "square", mode=mode, max_tokens=48) for mode in ("slow", "fast", "hybrid")]
    tokens = assert_loaded_and_fused_give_training_time_tokens(base, folder, requests, tmp_path)
    assert [r.token_ids for r in load("demo", "float32").locate_many(requests)] != tokens


def _small_run(novel_data, out, spec, steps, base=None, resume=False, **options):
    from mlx_locate.tuner.finetune import FinetuneOptions, finetune

    options = FinetuneOptions(steps=steps, batch_size=2, lr=1e-3, warmup=1, eval_every=0, log_every=1, **options)
    base = base or _demo_network()
    records = novel_data[0][:12]
    result = finetune(base, records, [], out, spec, options, resume=resume, progress=False, draw=False, say=print)
    return base, result


@pytest.mark.slow
def test_resume_continues_the_same_run(novel_data, tmp_path, monkeypatch):
    """Stopped after 2 of 4 steps and resumed (dropout on: the random state is restored; replay on), the run ends
    with the same adapter as one that never stopped, and reads the base's answers back instead of labelling."""
    import shutil

    from mlx_locate.locate import LocateModel
    from mlx_locate.tuner.replay import CACHE_FILE

    spec = AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.1))
    _, straight = _small_run(novel_data, tmp_path / "straight", spec, 4, save_every=2)
    assert straight.replay_samples > 0
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-0000002", stopped / "checkpoints" / "step-0000002")
    shutil.copy(tmp_path / "straight" / CACHE_FILE, stopped / CACHE_FILE)

    def no_labelling(*args, **kwargs):
        raise AssertionError("a resumed run labels again")

    monkeypatch.setattr(LocateModel, "locate_many", no_labelling)
    _, resumed = _small_run(novel_data, stopped, spec, 4, save_every=2, resume=True)
    a, b = mx.load(str(tmp_path / "straight" / ADAPTER_FILE)), mx.load(str(stopped / ADAPTER_FILE))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=1e-6, err_msg=k)
    assert [h["step"] for h in resumed.history if "loss" in h] == [1, 2, 3, 4]
    with pytest.raises(FileExistsError, match="--resume"):
        _small_run(novel_data, stopped, spec, 4)


@pytest.mark.slow
def test_quantized_base_trains_and_keeps_lora_beside_it(novel_data, tmp_path):
    """A mixed_4_8+vision8 base: LoRA trains through the quantized layers (the connector dequantized to train),
    the quantized weights stay as they were, and loading keeps the pairs beside them, q|k|v and gate|up fused,
    with the training-time tokens."""
    from mlx_locate.commands.convert import convert
    from mlx_locate.locate import LocateModel
    from mlx_locate.request import Request
    from mlx_locate.weights.loader import read_checkpoint

    q = convert("demo", tmp_path / "q", dtype="float32", quantize="mixed_4_8+vision8")
    base = read_checkpoint(q)
    frozen = np.array(base.network.language_model.model.layers[0].mlp.down_proj.weight)
    spec = AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.0))
    _, result = _small_run(novel_data, tmp_path / "a", spec, 3, base=base, compile=False)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert losses[-1] < losses[0]
    assert isinstance(base.network.language_model.model.layers[0].mlp.down_proj.linear, nn.QuantizedLinear)
    np.testing.assert_array_equal(
        np.array(base.network.language_model.model.layers[0].mlp.down_proj.linear.weight), frozen
    )
    loaded = load(q, adapter_path=tmp_path / "a")
    layer = loaded.runtime.network.language_model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FusedLoRALinear) and isinstance(layer.mlp.gate_up_proj, FusedLoRALinear)
    assert isinstance(layer.self_attn.qkv_proj.linear, nn.QuantizedLinear)
    assert isinstance(loaded.runtime.network.mlp1[1], nn.Linear)  # the trained connector, float
    requests = [
        Request(r.image, prompt=r.turns[0].user, mode=m, max_tokens=48)
        for r in novel_data[1][:2]
        for m in ("slow", "fast")
    ]
    want = [r.token_ids for r in LocateModel(base).locate_many(requests)]
    assert [r.token_ids for r in loaded.locate_many(requests)] == want
    assert [r.token_ids for r in load(q).locate_many(requests)] != want


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_checkpointing_gives_the_same_step(novel_data, compiled):
    from mlx_locate.tuner.finetune import TowerRows, encode_examples, make_batch
    from mlx_locate.tuner.trainer import Trainer, TrainOptions

    results = []
    for checkpoint in (False, True):
        mx.random.seed(3)
        base = _demo_network()
        add_lora(base.network, AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.0)))
        examples, _ = encode_examples(base, novel_data[0][:4], 2048)
        batch = make_batch(examples, base, TowerRows(base, 2**30), 0, 32)
        trainer = Trainer(base.network, TrainOptions(lr=1e-3, compile=compiled, grad_checkpoint=checkpoint), tables={})
        loss, _, norm = trainer.step(batch)
        results.append((loss.item(), norm.item(), dict(tree_flatten(base.network.trainable_parameters()))))
    (loss0, norm0, p0), (loss1, norm1, p1) = results
    assert loss0 == pytest.approx(loss1, rel=1e-5) and norm0 == pytest.approx(norm1, rel=1e-4)
    for k in p0:
        np.testing.assert_allclose(np.array(p0[k]), np.array(p1[k]), atol=1e-6, err_msg=k)


@pytest.fixture
def cli(novel_files, tmp_path):
    """(main, argv, small): `mlx-locate-finetune` on the first samples of each file, written beside it (image
    paths are relative to the data file)."""
    from mlx_locate.commands.finetune import main

    data = []
    for path, n in zip(novel_files, (4, 2), strict=True):
        data.append(path.with_name(f"first_{path.name}"))
        data[-1].write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    out = tmp_path / "out"
    argv = ["--data", str(data[0]), "--val-data", str(data[1]), "--out", str(out), "--dtype", "float32"]
    small = ["--steps", "2", "--batch-size", "2", "--rank", "4", "--eval-samples", "2", "--eval-modes", "fast"]
    return main, argv, small, out


def test_cli_runs_and_refuses_to_overwrite(cli, tmp_path, capsys):
    main, argv, small, out = cli
    assert main([*argv, *small, "--eval-max-tokens", "16", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["before"]["f1"]) == {"fast"} and summary["trainable_parameters"] > 0
    assert (out / ADAPTER_FILE).is_file() and (out / "training.png").is_file()
    assert summary["kept_categories"] == ["circle", "square", "triangle", "diamond", "star"]
    assert main([*argv, *small]) == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert main([*argv, *small, "--replay", "1", "--force"]) == 2
    assert "replay must be a share of the batch in [0, 1)" in capsys.readouterr().err
    assert main(["--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_keeps_the_categories_it_is_given(cli, capsys):
    main, argv, small, _ = cli
    keep = ["--keep-categories", "star,Circle", "--replay", "0.5", "--json", "--no-progress"]
    assert main([*argv, *small, *keep]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kept_categories"] == ["star", "Circle"] and summary["replay_samples"] > 0


def test_trained_tower_inputs_match_the_frozen_tower(novel_data):
    """Vision LoRA runs the tower inside the step on padded images with their own tables (`tower_inputs`): with
    the pairs at zero it gives the hidden states of the frozen path (the tower per image, `TowerRows`)."""
    from mlx_locate.tuner.finetune import TowerRows, encode_examples, make_batch
    from mlx_locate.tuner.trainer import forward_hidden

    base = _demo_network()
    add_lora(base.network, AdapterSpec(None, LoRASpec(rank=2, alpha=4, dropout=0.0, keys=lora.VISION_KEYS)))
    examples, _ = encode_examples(base, novel_data[0][:3] + novel_data[1][:1], 2048)
    frozen = {k: mx.array(v) for k, v in make_batch(examples, base, TowerRows(base, 2**30), 0, 32).items()}
    trained = {k: mx.array(v) for k, v in make_batch(examples, base, None, 0, 32).items()}
    assert "patches" in trained and "merged" in frozen
    a, b = forward_hidden(base.network, frozen, {}), forward_hidden(base.network, trained, {})
    rows = frozen["targets"] >= 0
    np.testing.assert_allclose(np.array(a)[np.array(rows)], np.array(b)[np.array(rows)], atol=2e-4)


@pytest.mark.slow
def test_vision_lora_trains_and_loads(novel_data, tmp_path):
    spec = AdapterSpec(LoRASpec(rank=2, alpha=4, dropout=0.0), LoRASpec(rank=2, alpha=4, keys=lora.VISION_KEYS))
    base, result = _small_run(novel_data, tmp_path / "v", spec, 2, compile=False)
    tower = base.network.vision_model.encoder.blocks[0].wqkv
    assert isinstance(tower, LoRALinear) and float(mx.abs(tower.lora_b).max()) > 0
    loaded = load("demo", adapter_path=tmp_path / "v")
    merged = loaded.runtime.network.vision_model.encoder.blocks[0].wqkv
    assert isinstance(merged, nn.Linear)
    np.testing.assert_allclose(np.array(merged.weight), np.array(tower.linear.weight + tower.delta()), atol=1e-6)


def test_nvidia_lora_checkpoint_loads_merged(tmp_path):
    """NVIDIA's LoRA script saves the whole model with PEFT's names (`language_model.base_model.model...`,
    `q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`) and `use_llm_lora` (the rank, alpha = 2 x rank) in
    config.json: `load` and `mlx-locate-convert` merge it, giving the tokens of the same pairs as an adapter."""
    import shutil

    from mlx_locate.commands.convert import convert
    from mlx_locate.weights.lora import read_adapter

    spec = AdapterSpec(LoRASpec(rank=4, alpha=8, dropout=0.0, keys=lora.DECODER_KEYS[:4]), trainable=())
    _, folder = _random_adapter(tmp_path, spec, strength=0.3)
    pairs = read_adapter(folder).pairs
    nvidia = tmp_path / "nvidia"
    shutil.copytree(DEMO_DIR, nvidia)
    weights = {}
    for key, value in mx.load(str(DEMO_DIR / "model.safetensors")).items():
        module = key.rpartition(".")[0]
        if key.startswith("language_model."):
            inner = key.removeprefix("language_model.")
            key = f"language_model.base_model.model.{inner}"
            if module in pairs:
                key = key.replace(f".{key.rpartition('.')[2]}", f".base_layer.{key.rpartition('.')[2]}")
        weights[key] = value
    for module, (a, b, _) in pairs.items():
        peft = "language_model.base_model.model." + module.removeprefix("language_model.")
        weights[f"{peft}.lora_A.default.weight"] = a.T
        weights[f"{peft}.lora_B.default.weight"] = b.T
    mx.save_safetensors(str(nvidia / "model.safetensors"), weights)
    config = json.loads((nvidia / "config.json").read_text())
    (nvidia / "config.json").write_text(json.dumps({**config, "use_llm_lora": 4}))
    want = load("demo", adapter_path=folder).locate(IMAGE, "square", mode="fast", max_tokens=48).token_ids
    assert load("demo").locate(IMAGE, "square", mode="fast", max_tokens=48).token_ids != want
    assert load(nvidia).locate(IMAGE, "square", mode="fast", max_tokens=48).token_ids == want
    merged = convert(nvidia, tmp_path / "merged", dtype="float32")
    assert load(merged).locate(IMAGE, "square", mode="fast", max_tokens=48).token_ids == want
    (nvidia / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_llm_lora = 4"):
        load(nvidia)


def test_row_cache_keeps_a_byte_budget_least_recent_out_first():
    from mlx_locate.tuner.finetune import RowCache

    made = []

    def make(key, n):
        def compute():
            made.append(key)
            return mx.zeros((n,), dtype=mx.float32)

        return compute

    cache = RowCache(budget_bytes=3 * 4 * 10)  # three arrays of 10 float32
    for key in "abc":
        cache.get(key, make(key, 10))
    cache.get("a", make("a", 10))  # a hit: "a" becomes the most recent
    cache.get("d", make("d", 10))  # over the budget: "b", the least recent, goes
    assert made == ["a", "b", "c", "d"] and list(cache.rows) == ["c", "a", "d"] and cache.bytes == 120
    cache.get("e", make("e", 100))  # larger than the budget alone: it stays, everything else goes
    assert list(cache.rows) == ["e"] and cache.bytes == 400


# --- Replay: fine-tuning keeps what the base knew -------------------------------------------------------------


def _detect(image, categories, answer):
    from mlx_locate.prompts import task_text

    return Record(image, (Turn(task_text("detect", categories), answer),), str(image))


def test_known_categories_of_the_demo_and_the_release():
    """The demo's config.json names its shapes (as `tuner.demo_recipe` writes it); NVIDIA's release architecture gets
    COCO's 80; a malformed entry is an error naming the field."""
    from mlx_locate.config import ModelConfig
    from mlx_locate.synthetic.scenes import DETECT_CATEGORY_COUNTS, SHAPES
    from mlx_locate.tuner.demo_recipe import build_tokenizer, demo_config, model_sizes
    from mlx_locate.weights.cards import COCO_CATEGORIES, CONFIG_KEY, KnownCategories, known_categories
    from mlx_locate.weights.checkpoint import RELEASE_CONFIG
    from mlx_locate.weights.random_checkpoint import PRESETS

    raw = json.loads((DEMO_DIR / "config.json").read_text())
    assert known_categories(raw) == KnownCategories(SHAPES, max(DETECT_CATEGORY_COUNTS)) == _demo_network().known
    assert demo_config(build_tokenizer(), model_sizes(ModelConfig.from_dict(raw)), "bfloat16") == raw
    release = known_categories(RELEASE_CONFIG)
    assert release.names == COCO_CATEGORIES and len(set(COCO_CATEGORIES)) == 80 and release.per_prompt == 10
    assert known_categories(PRESETS["tiny"].config("bfloat16")) is None  # another architecture names nothing
    with pytest.raises(ValueError, match='"known_categories" must be'):
        known_categories({CONFIG_KEY: {"names": [], "per_prompt": 3}})


def test_kept_categories_and_their_prompts_never_ask_new_words():
    from mlx_locate.tuner import replay as rp
    from mlx_locate.weights.cards import KnownCategories

    a, b = IMAGE.with_name("a.png"), IMAGE.with_name("b.png")
    records = [
        _detect(a, ["cross"], "<ref>cross</ref><box>None</box>"),
        _detect(b, ["Circle", "cross"], "<ref>Circle</ref><box>None</box><ref>cross</ref><box>None</box>"),
    ]
    known = KnownCategories(("circle", "square", "triangle", "diamond", "star"), 3)
    keep = rp.resolve_keep(None, known, records)
    assert keep.categories == known.names and keep.new == ("cross",) and keep.per_prompt == 3
    asks = rp.plan_asks(records, keep, seed=0, split=0)
    assert asks == rp.plan_asks(records, keep, seed=0, split=0) != rp.plan_asks(records, keep, seed=0, split=1)
    for image, want in ((a, set(known.names)), (b, set(known.names) - {"circle"})):  # b's data asks for circles
        mine = [x.categories for x in asks if x.image == image]
        assert sorted(c for cats in mine for c in cats) == sorted(want)  # each once, 3 to a prompt
        assert [len(c) for c in mine] == [3, len(want) - 3]
    explicit = rp.resolve_keep(("square", " Square", "cross"), known, records)
    assert explicit.categories == ("square", "cross") and explicit.new == ("circle",) and explicit.per_prompt == 3
    assert rp.resolve_keep(None, None, records).categories == ()
    with pytest.raises(ValueError, match="--keep-categories needs"):
        rp.resolve_keep(("circle", " "), known, records)


def test_replay_samples_are_the_base_answers_in_the_data_grammar():
    """Boxes with ordered corners in ascending x1; only the base's own Nones; a category it did not answer, or
    answered only with boxes lying on a new word's object (slivers too), is never asked; a cut answer gives
    nothing; the samples ask about what it found and about its Nones, each answer its parts in the prompt's
    order."""
    from mlx_locate.prompts import parse_task_text
    from mlx_locate.tokenizer import Tokenizer
    from mlx_locate.tuner import replay as rp

    first, second = rp.Ask(IMAGE, ("square", "circle", "star")), rp.Ask(IMAGE, ("diamond", "triangle"))
    answers = [
        (
            first,
            rp.Answer(
                {"square": [(600, 700, 500, 300), (100, 100, 200, 200), (0, 0, 500, 500)], "star": [(40, 40, 60, 60)]},
                ("circle",),
                True,
            ),
        ),  # fmt: skip
        (second, rp.Answer({"diamond": [(10, 10, 110, 110)]}, ("triangle", "diamond"), True)),
    ]
    know = rp.knowledge(answers, new_boxes=[(12, 8, 108, 112)])
    squares = "".join(f"<ref>square</ref><box>{b}</box>" for b in ("<0><0><500><500>", "<100><100><200><200>",
                                                                   "<500><300><600><700>"))  # fmt: skip
    # The star sliver and the diamond lie on the new word's object; the large square only holds it.
    assert know.found == {"square": squares} and know.dropped == 2
    assert know.absent == {
        "circle": "<ref>circle</ref><box>None</box>",
        "triangle": "<ref>triangle</ref><box>None</box>",
    }
    cut = rp.knowledge([(first, rp.Answer(answers[0][1].boxes, (), False))], [])
    assert (cut.found, cut.absent, cut.cut) == ({}, {}, 1)
    records = rp.replay_records(IMAGE, know, 3, np.random.default_rng(0))
    prompts = [parse_task_text(r.turns[0].user)[1] for r in records]
    assert "square" in prompts[0] and set(prompts[-1]) <= {"circle", "triangle"}  # found first, then Nones alone
    parts = {**know.found, **know.absent}
    assert [r.turns[0].answer for r in records] == ["".join(parts[c] for c in p) for p in prompts]
    # Only detection records name new words' objects: a referring phrase ("black shape") drops nothing.
    keep = rp.Keep(("triangle",), 3, ("black shape", "cross"), "test")
    refer = Record(IMAGE, (Turn("Locate all the instances that match the following description: black shape.",
                                "<ref>black shape</ref><box><1><2><3><4></box>"),), "r")  # fmt: skip
    detect = _detect(IMAGE, ["cross"], "<ref>cross</ref><box><5><6><7><8></box>")
    boxes = rp.new_word_boxes([refer, detect], keep, Tokenizer.from_folder(DEMO_DIR), load("demo").runtime.token_ids)
    assert boxes == {IMAGE: [(5, 6, 7, 8)]}


def test_batches_mix_the_replay_share_and_resume_alike():
    from mlx_locate.tuner.finetune import Batches

    batches = Batches(10, 4, seed=0, n_replay=7, replay=0.3)
    steps = [batches.indices(s) for s in range(20)]
    assert all(len(d) + len(r) == 4 for d, r in steps)
    assert sum(len(r) for _, r in steps) == math.floor(20 * 4 * 0.3)
    data = [i for d, _ in steps for i in d]
    assert sorted(data[:10]) == list(range(10)) and sorted(data[10:20]) == list(range(10))  # epochs
    assert Batches(10, 4, 0, 7, 0.3).indices(13) == steps[13]  # a resumed run draws the same batch
    assert all(r == [] and len(d) == 4 for d, r in map(Batches(10, 4, 0, 0, 0.3).indices, range(5)))


@pytest.mark.slow
def test_replay_is_on_by_default_and_batches_hold_the_base_answers(tmp_path, monkeypatch):
    """Default options: before training the base labels the training images for its known shapes, and the
    batches hold those answers, encoded like the data (the base asked again gives the same boxes and Nones); no
    replay prompt asks for the new word; the held-out report has the kept categories' F1, also on the console."""
    from mlx_locate.commands.finetune import build_parser
    from mlx_locate.commands.finetune import options as cli_options
    from mlx_locate.prompts import parse_task_text, task_text
    from mlx_locate.synthetic.scenes import SHAPES, write_word_only_data
    from mlx_locate.tokenizer import Tokenizer
    from mlx_locate.tuner import finetune as ft
    from mlx_locate.tuner.replay import share_on
    from mlx_locate.weights.loader import read_checkpoint

    assert cli_options(build_parser().parse_args(["--data", "x", "--out", "y"])).replay == ft.FinetuneOptions.replay
    assert ft.FinetuneOptions.replay >= 0.2
    folder = write_word_only_data(tmp_path / "data", "cross", train=8, held_out=2)
    train, held = read_data(folder / "train.jsonl"), read_data(folder / "eval.jsonl")
    held = [r for r in held if "cross" in r.turns[0].user]  # as a user's: the new word only
    batches = []
    make_batch = ft.make_batch
    monkeypatch.setattr(ft, "make_batch", lambda examples, *a: batches.append(examples) or make_batch(examples, *a))
    options = ft.FinetuneOptions(
        steps=4, batch_size=4, lr=1e-3, warmup=1, eval_every=0, eval_samples=2, eval_modes=("fast",),
        eval_max_tokens=32, log_every=2,
    )  # fmt: skip
    lines = []
    spec = AdapterSpec(LoRASpec(rank=2, alpha=4, dropout=0.0), trainable=())
    result = ft.finetune(_demo_network(), train, held, tmp_path / "out", spec, options, draw=False, progress=False,
                         say=lines.append)  # fmt: skip
    replayed = [e for b in batches for e in b if e.record.where.startswith("replay:")]
    assert len(replayed) == math.floor(4 * 4 * options.replay) and result.replay_samples > 0
    tok, ids = Tokenizer.from_folder(DEMO_DIR), load("demo").runtime.token_ids
    cache = [json.loads(line) for line in (result.out / "replay.jsonl").read_text().splitlines()]
    assert cache[0]["replay"]["mode"] == "slow"
    model = ft.LocateModel(read_checkpoint("demo"))
    crosses = {r.image: [o.box_norm for o in ft.truth_of(r.turns[0].answer, tok, ids, (1, 1))] for r in train + held}
    said = {}  # (image, category) -> the base's answer about it, asked again
    for d in cache[1:]:
        image, categories = Path(d["image"]), d["categories"]
        assert set(categories) <= set(SHAPES)  # never "cross"
        base = model.locate(image, prompt=task_text("detect", categories), mode="slow", max_tokens=512)
        for c in categories:
            boxes = {(min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3]))
                     for b in (o.box_norm for o in base.objects if o.label == c)}  # fmt: skip
            mine = [b for b in sorted(boxes) if not any(share_on(b, x) >= 0.5 for x in crosses[image])]
            said[image, c] = "".join(f"<ref>{c}</ref><box>{''.join(f'<{v}>' for v in b)}</box>" for b in mine)
            said[image, c] = said[image, c] or (
                f"<ref>{c}</ref><box>None</box>" if not boxes and c in base.empty_labels else None
            )
    for e in replayed:
        want = "".join(said[e.record.image, c] for c in parse_task_text(e.record.turns[0].user)[1])
        assert e.record.turns[0].answer == want
        rows = encode_record(e.record, e.grid, tok, ids)
        assert rows.ids.tolist() == e.rows.ids.tolist() and rows.targets.tolist() == e.rows.targets.tolist()
        supervised = [int(t) for t, k in zip(e.rows.targets, e.rows.kinds, strict=True) if k == 1]
        assert tok.decode(supervised) == want + "<|im_end|>"
    assert result.kept == SHAPES and result.kept_truth == "the base's answers"
    assert set(result.before["kept"]) == set(result.after["kept"]) == {"fast"}
    evals = [line for line in lines if line.startswith("[EVAL]")]
    assert len(evals) == 2 and all("F1@0.5 fast" in line and "kept categories F1@0.5 fast" in line for line in evals)


@pytest.mark.slow
def test_data_of_a_new_word_only_keeps_the_known_words(tmp_path):
    """Issue 26's case, the README's forgetting table: the data labels only crosses, among circles and squares (the
    walk-through's settings). With the default replay, the new word's held-out F1@0.5 is at least 0.8 in every
    mode after training, and circles and squares each keep at least 90 % of their F1 before (held-out scenes
    asked for each, answered from the scene)."""
    import dataclasses

    from mlx_locate.decide import MODE_NAMES
    from mlx_locate.synthetic.scenes import DISTRACTORS, write_word_only_data
    from mlx_locate.tuner.finetune import DEMO_OPTIONS, DEMO_SPEC, WORD_ONLY, WORD_ONLY_HELD_OUT, finetune

    folder = write_word_only_data(tmp_path / "data", WORD_ONLY, DISTRACTORS, held_out=WORD_ONLY_HELD_OUT)
    train, held = read_data(folder / "train.jsonl"), read_data(folder / "eval.jsonl")
    assert all(r.turns[0].user.endswith(f"{WORD_ONLY}.") for r in train)
    options = dataclasses.replace(DEMO_OPTIONS, eval_samples=len(held))
    result = finetune(_demo_network(), train, held, tmp_path / "out", DEMO_SPEC, options, progress=False, draw=False,
                      say=lambda *_: None)  # fmt: skip
    assert result.kept_truth == "the held-out data" and result.replay_samples > 0
    for mode in MODE_NAMES:
        assert result.before["f1"][mode]["f1@0.5"] <= 0.1, (mode, result.before["f1"][mode])
        assert result.after["f1"][mode]["f1@0.5"] >= 0.8, (mode, result.after["f1"][mode])
        for word in DISTRACTORS:
            before, after = (r["kept"][mode]["per_label"][word] for r in (result.before, result.after))
            assert before >= 0.8 and after >= 0.9 * before, (mode, word, before, after)
