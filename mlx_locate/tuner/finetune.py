"""Fine-tune a LocateAnything checkpoint with LoRA on the next-token and block objectives (docs/training.md).

NVIDIA's LoRA recipe on MLX: LoRA on every decoder projection (`lora.DECODER_KEYS`, rank 64, alpha 128), the
connector trained whole, the vision tower frozen (or with LoRA of its own), the base float or quantized (a q8 or
mixed_4_8 conversion) and never written. Each step is `trainer.Trainer`'s: the NTP and block streams of every
sample in one sequence under the docs/training.md §2.2 mask, one float32 cross-entropy, AdamW with warmup and cosine
decay.

By default a share of every batch replays the base's own answers about the categories it should keep
(`replay.py`), so that it does not forget them. A frozen tower runs once per image (its merged rows are cached)
and only the connector and the decoder run in the step. Every `eval_every` steps the held-out split is scored:
its loss per stream, and F1@0.5 per decoding mode through the engine (`LocateModel.locate_many`) on a view of
the network being trained, for the data's records and for the kept categories. The output folder gets the
adapter (`adapters.safetensors` + `adapter_config.json`), checkpoints to resume from, `log.jsonl`,
`replay.jsonl` and `training.png`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..decide import MODE_NAMES
from ..evaluation.score import located_f1
from ..locate import LocateModel
from ..network.projector import merge_2x2
from ..network.vision import rope2d_tables
from ..preprocess import preprocess
from ..request import Request, RequestError, Result
from ..weights.loader import Checkpoint
from ..weights.lora import ADAPTER_FILE, AdapterSpec, LoRASpec, add_lora, save_adapter
from . import replay as rp
from .datasets import Example, Record, encode_record, norm_label, record_labels, truth_of
from .trainer import (
    KIND_NTP,
    NUM_KINDS,
    STAT_COLUMNS,
    Trainer,
    TrainOptions,
    collate_rows,
    describe,
    forward_hidden,
    layer_view,
    learning_rate,
)

ROW_BUCKET = 64  # merged image rows (and patches / 4) are padded to a multiple of this: few compiled shapes
CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 3  # as NVIDIA's save_total_limit
LOG_FILE = "log.jsonl"
PLOT_FILE = "training.png"


@dataclass(frozen=True)
class FinetuneOptions:
    steps: int = 1000
    batch_size: int = 4
    lr: float = 1e-4
    warmup: int | None = None  # None: a tenth of the steps, at most NVIDIA's 500
    weight_decay: float = 0.01  # NVIDIA's
    clip: float = 1.0
    seed: int = 0
    grad_checkpoint: bool = False
    compile: bool = True
    log_every: int = 10
    eval_every: int = 100  # also at step 0 and at the end; 0: only then
    eval_samples: int = 64  # held-out samples scored for F1 (the loss uses all of them)
    eval_modes: tuple[str, ...] = MODE_NAMES
    eval_max_tokens: int = 256
    save_every: int | None = None  # checkpoints; None: at every evaluation
    replay: float = 0.3  # share of each batch answered by the base on kept categories (0: off)
    keep_categories: tuple[str, ...] | None = None  # None: the checkpoint's (`cards.known_categories`)
    feature_cache_mb: int = 4096  # frozen-tower rows kept in memory
    row_bucket: int = 32  # sequences are padded to a multiple of this (each length compiles once)

    def warmup_steps(self) -> int:
        return min(500, max(1, self.steps // 10)) if self.warmup is None else self.warmup


# The README's walk-through, the test and the benchmark: the demo model learns a shape it never saw
# (`synthetic.scenes.write_novel_data`: "ring", 300 scenes), LoRA on every decoder projection, the connector frozen.
DEMO_WORD = "ring"
DEMO_SPEC = AdapterSpec(LoRASpec(rank=8, alpha=16, dropout=0.0), trainable=())
DEMO_OPTIONS = FinetuneOptions(
    steps=150, batch_size=8, lr=1e-3, warmup=15, eval_every=0, eval_samples=24, eval_max_tokens=64, save_every=75
)
# The README's forgetting table, its test and the benchmark: data that labels only "cross" among circles and
# squares (`synthetic.scenes.write_word_only_data`: 300 scenes, and held-out ones each also asked for every shape).
WORD_ONLY = "cross"
WORD_ONLY_HELD_OUT = 48


@dataclass
class FinetuneResult:
    out: Path
    history: list[dict]  # log lines: training steps and evaluations
    before: dict  # the first evaluation (step 0)
    after: dict  # the last one
    steps_per_s: float | None  # None when a resumed run had nothing left to do
    samples_per_s: float | None
    peak_memory_bytes: int
    trainable_parameters: int
    train_samples: int
    eval_samples: int
    replay_samples: int  # the base's answers mixed into the batches
    kept: tuple[str, ...]  # the kept categories
    kept_truth: str | None  # what the kept categories' F1 is measured against (None: not measured)
    skipped: dict = field(default_factory=dict)  # records left out, by reason


# --- Images ---------------------------------------------------------------------------------------------------


def padded(n: int) -> int:
    return -(-n // ROW_BUCKET) * ROW_BUCKET


class RowCache:
    """Arrays by key, each computed once and kept up to a byte budget (least recently used out first; the newest
    always stays)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.rows: OrderedDict[Hashable, mx.array] = OrderedDict()
        self.bytes = 0

    def get(self, key: Hashable, compute: Callable[[], mx.array]) -> mx.array:
        if key in self.rows:
            self.rows.move_to_end(key)
            return self.rows[key]
        rows = compute()
        mx.eval(rows)
        self.rows[key] = rows
        self.bytes += rows.nbytes
        while self.bytes > self.budget and len(self.rows) > 1:
            self.bytes -= self.rows.popitem(last=False)[1].nbytes
        return rows


class TowerRows:
    """The frozen tower's merged rows (M, 4C) per image, computed once and kept up to a byte budget (LRU)."""

    def __init__(self, base: Checkpoint, budget_bytes: int):
        self.base = base
        self.cache = RowCache(budget_bytes)

    def __call__(self, image: Path) -> mx.array:
        return self.cache.get(image, lambda: self._compute(image))

    def _compute(self, image: Path) -> mx.array:
        network = self.base.network
        pre = preprocess(image, self.base.in_token_limit, network.config.vision.patch_size)
        return merge_2x2(network.vision_model(mx.array(pre.patches), pre.grid), pre.grid)


def merged_batch(rows: list[mx.array]) -> mx.array:
    """(B, M, 4C) with M padded to ROW_BUCKET (the padding rows are never spliced)."""
    m = padded(max(r.shape[0] for r in rows))
    return mx.stack([mx.pad(r, [(0, m - r.shape[0]), (0, 0)]) for r in rows])


def tower_inputs(base: Checkpoint, images: list[Path]) -> dict[str, np.ndarray | mx.array]:
    """Padded patches and per-image tower inputs for a tower that trains (LoRA): `trainer.tower_features`."""
    network = base.network
    v = network.config.vision
    pres = [preprocess(p, base.in_token_limit, v.patch_size) for p in images]
    n = 4 * padded(max(pre.pixels.shape[0] for pre in pres) // 4)
    B = len(pres)
    patches = np.zeros((B, n, 3 * v.patch_size**2), np.float32)
    cos = np.ones((B, n, v.head_dim // 2), np.float32)
    sin = np.zeros((B, n, v.head_dim // 2), np.float32)
    valid = np.zeros((B, n), bool)
    merge = np.zeros((B, n), np.int32)
    pos = []
    for b, pre in enumerate(pres):
        h, w = pre.grid
        patches[b, : h * w] = pre.patches.reshape(h * w, -1)
        c, s = rope2d_tables(h, w, v.head_dim, v.rope_theta)
        cos[b, : h * w], sin[b, : h * w], valid[b, : h * w] = np.array(c), np.array(s), True
        i, j = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
        top = (2 * i * w + 2 * j).reshape(-1, 1)
        merge[b, : h * w] = np.concatenate([top, top + 1, top + w, top + w + 1], axis=1).reshape(-1)
        table = network.vision_model.patch_embed.pos_emb(h, w)
        pos.append(mx.pad(table, [(0, n - h * w), (0, 0)]))
    return {"patches": patches, "pos": mx.stack(pos), "cos": cos, "sin": sin, "valid": valid, "merge": merge}


# --- Examples -------------------------------------------------------------------------------------------------


def encode_examples(base: Checkpoint, records: list[Record], max_length: int) -> tuple[list[Example], dict[str, int]]:
    """Records as examples; those whose image cannot be read or whose rows exceed `max_length` are counted out."""
    from ..preprocess import load_image, target_size

    network, tok = base.network, base.tokenizer
    patch = network.config.vision.patch_size
    examples, skipped = [], {}
    sizes: dict[Path, tuple[int, int]] = {}
    for record in records:
        if record.image not in sizes:
            if not record.image.is_file():
                raise FileNotFoundError(f"{record.where}: image {record.image} does not exist")
            sizes[record.image] = load_image(record.image).size
        size = sizes[record.image]
        final = target_size(*size, in_token_limit=base.in_token_limit, patch=patch).final
        grid = (final[1] // patch, final[0] // patch)
        rows = encode_record(record, grid, tok, network.token_ids)
        if len(rows.ids) > max_length:
            skipped[f"longer than {max_length} rows"] = skipped.get(f"longer than {max_length} rows", 0) + 1
            continue
        truth = truth_of(record.turns[0].answer, tok, network.token_ids, size)
        examples.append(Example(record, rows, grid, truth))
    return examples, skipped


class Batches:
    """Batch `step`: the share `replay` of its samples from the replay pool (`replay.replayed`), the rest from the
    data, each read from a stream of epoch-wise seeded shuffles, so the same steps give the same batches after a
    resume."""

    def __init__(self, n: int, batch_size: int, seed: int, n_replay: int = 0, replay: float = 0.0):
        if n < batch_size:
            raise ValueError(f"{n} training samples are fewer than the batch size {batch_size}")
        self.n, self.n_replay, self.batch_size, self.seed = n, n_replay, batch_size, seed
        self.replay = replay if n_replay else 0.0
        self.orders: dict[int, tuple[int, np.ndarray]] = {}  # per stream: its current epoch's order

    def _take(self, stream: int, n: int, start: int, stop: int) -> list[int]:
        out = []
        for j in range(start, stop):
            epoch, k = divmod(j, n)
            if self.orders.get(stream, (None,))[0] != epoch:
                self.orders[stream] = (epoch, np.random.default_rng([self.seed, stream, epoch]).permutation(n))
            out.append(int(self.orders[stream][1][k]))
        return out

    def indices(self, step: int) -> tuple[list[int], list[int]]:
        """(data indices, replay indices) of batch `step`."""
        r0, r1 = (rp.replayed(s, self.batch_size, self.replay) for s in (step, step + 1))
        d0, d1 = step * self.batch_size - r0, (step + 1) * self.batch_size - r1
        return self._take(0, self.n, d0, d1), self._take(1, self.n_replay, r0, r1)


def frozen_layers(base: Checkpoint, spec: AdapterSpec) -> int:
    """How many decoder layers lie below everything `spec` trains (their outputs never change): 0 unless the
    tower and the connector are frozen and LoRA sits on the last layers only."""
    if spec.vision is not None or spec.trainable or spec.decoder is None or spec.decoder.num_layers is None:
        return 0
    return len(base.network.language_model.model.layers) - spec.decoder.num_layers


class LowerRows:
    """The output (R, D) of the frozen lower decoder layers per example, computed once (LRU up to a budget)."""

    def __init__(self, base: Checkpoint, layers: int, tower: TowerRows, pad_id: int, budget_bytes: int):
        self.lower = layer_view(base.network, slice(0, layers))
        self.tower, self.pad = tower, pad_id
        self.cache = RowCache(budget_bytes)

    def __call__(self, example: Example) -> mx.array:
        return self.cache.get(id(example), lambda: self._compute(example))

    def _compute(self, example: Example) -> mx.array:
        batch = {k: mx.array(v) for k, v in collate_rows([example.rows], self.pad, 1).items()}
        batch["merged"] = self.tower(example.record.image)[None]
        return forward_hidden(self.lower, batch, {})[0]


def make_batch(
    examples: list[Example], base: Checkpoint, inputs: TowerRows | LowerRows | None, pad: int, bucket: int
) -> dict:
    """Rows and the model input: the frozen lower layers' output, the frozen tower's rows, or tower inputs."""
    batch = collate_rows([e.rows for e in examples], pad, bucket)
    images = [e.record.image for e in examples]
    if isinstance(inputs, LowerRows):
        T = batch["ids"].shape[1]
        batch["hidden"] = mx.stack([mx.pad(r, [(0, T - r.shape[0]), (0, 0)]) for r in map(inputs, examples)])
    elif isinstance(inputs, TowerRows):
        batch["merged"] = merged_batch([inputs(p) for p in images])
    else:
        batch.update(tower_inputs(base, images))
    return batch


# --- Evaluation ------------------------------------------------------------------------------------------------


def mode_scores(pairs: list[tuple[Example, Result | RequestError]]) -> dict:
    """F1@0.5 by the paper's rules (`evaluation.score.located_f1`) within the truth's labels (`f1@0.5`, and per
    label: `per_label`, a label the model wrote instead of the asked one included) and regardless of them
    (`box_f1@0.5`), the counts, how often decoding ended by itself, and failed requests, over (example, result)
    pairs."""
    located = [(e.truth, [] if isinstance(r, RequestError) else r.objects) for e, r in pairs]
    scores = located_f1(located)
    labels = {norm_label(o.label) for truth, found in located for o in (*truth, *found) if o.box_norm is not None}
    per_label = {
        label: located_f1(
            [tuple([o for o in objects if norm_label(o.label) == label] for objects in pair) for pair in located]
        ).f1
        for label in sorted(labels)
    }
    done = [r for _, r in pairs if not isinstance(r, RequestError)]
    return {
        "f1@0.5": scores.f1,
        "box_f1@0.5": scores.box_f1,
        "per_label": per_label,
        "boxes_pred": scores.pred,
        "boxes_gt": scores.gt,
        "ended_rate": sum(r.stats["stop_reason"] != "length_cap" for r in done) / len(pairs) if pairs else None,
        "errors": len(pairs) - len(done),
    }


def f1_scores(
    model: LocateModel,
    groups: dict[str, list[Example]],
    modes: tuple[str, ...],
    max_tokens: int,
    progress: bool = False,
    desc: str | None = None,
) -> dict[str, dict[str, dict]]:
    """Per group of examples and per mode, `mode_scores` of their answers, all decoded in one batch by the engine
    (a progress bar named `desc`)."""
    jobs = [(g, mode, e) for g, examples in groups.items() for mode in modes for e in examples]
    requests = [
        Request(e.record.image, prompt=e.record.turns[0].user, mode=m, max_tokens=max_tokens) for _, m, e in jobs
    ]
    results = model.locate_many(requests, progress=progress, desc=desc)
    return {
        g: {
            mode: mode_scores([(e, r) for (h, m, e), r in zip(jobs, results, strict=True) if (h, m) == (g, mode)])
            for mode in modes
        }
        for g in groups
    }


def held_out_loss(
    trainer: Trainer, examples: list[Example], base: Checkpoint, inputs, options: FinetuneOptions, pad: int
) -> dict:
    stats = mx.zeros((3, STAT_COLUMNS))
    size = options.batch_size
    for i in range(0, len(examples), size):
        _, s = trainer.score(make_batch(examples[i : i + size], base, inputs, pad, options.row_bucket))
        stats = stats + s
    d = describe(np.array(stats))
    ce, n, _ = np.array(stats)
    d["loss"] = float(ce[KIND_NTP:NUM_KINDS].sum() / max(n[KIND_NTP:NUM_KINDS].sum(), 1))
    return d


def is_kept(record: Record, keep: rp.Keep) -> bool:
    """The record asks about kept categories only."""
    labels = record_labels(record)
    return bool(labels) and all(keep.keeps(label) for label in labels)


def base_answers(
    base: Checkpoint,
    keep: rp.Keep,
    train_records: list[Record],
    held: list[Example],
    options: FinetuneOptions,
    out: Path,
    resume: bool,
    progress: bool,
    say,
) -> tuple[list[Example], list[Example], str | None]:
    """The replay pool (the base's answers on the training images, `replay.py`) and the held-out examples of kept
    categories with what their truth is: the held-out data's own records about kept categories only, else the
    base's answers on the held-out images. Both are labelled in one batch by the network as it is now (LoRA at
    zero: the base), or read back from the cache by a resumed run."""
    if not keep.categories:
        if options.replay:
            say("[WARN] replay is off: the checkpoint names no categories it knows; pass --keep-categories")
        return [], [], None
    new = f"; new in the data, never asked: {', '.join(keep.new)}" if keep.new else ""
    shown = ", ".join(keep.categories[:8]) + (f", ... ({len(keep.categories)})" if len(keep.categories) > 8 else "")
    say(f"[INFO] kept categories ({keep.source}): {shown}{new}")
    kept_held = [e for e in held if is_kept(e.record, keep)]
    train_asks = rp.plan_asks(train_records, keep, options.seed, 0) if options.replay else []
    held_asks = []
    if not kept_held:
        images = list(dict.fromkeys(e.record.image for e in held))[: options.eval_samples]
        held_asks = rp.plan_asks([e.record for e in held], keep, options.seed, 1, images)
    if not train_asks + held_asks:
        return [], kept_held, "the held-out data" if kept_held else None
    answers = rp.label(
        LocateModel(base),
        train_asks + held_asks,
        out / rp.CACHE_FILE,
        rp.cache_key(base.path),
        resume,
        progress,
        say,
    )
    new_boxes = rp.new_word_boxes(
        train_records + [e.record for e in held], keep, base.tokenizer, base.network.token_ids
    )
    max_length = base.max_length
    pool = []
    if train_asks:
        records, n = rp.replay_set(train_asks, answers[: len(train_asks)], new_boxes, keep.per_prompt, options.seed, 0)
        pool, _ = encode_examples(base, records, max_length)
        say(
            f"[INFO] replay: {len(pool)} samples from the base's answers ({n['found']} categories found, "
            f"{n['absent']} answered None; {n['cut']} answers cut or failed, {n['dropped']} boxes on new words "
            "dropped)"
        )
    if not held_asks:
        return pool, kept_held, "the held-out data" if kept_held else None
    records, _ = rp.replay_set(held_asks, answers[len(train_asks) :], new_boxes, keep.per_prompt, options.seed, 1)
    kept_held, _ = encode_examples(base, records, max_length)
    return pool, kept_held, "the base's answers"


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def eval_line(entry: dict) -> str:
    """One evaluation for the console: held-out loss, F1@0.5 per mode of the data and of the kept categories."""
    e = entry["eval"]
    parts = [f"[EVAL] step {entry['step']}"]
    if e["loss"] is not None:
        parts.append(f"held-out loss {e['loss']:.4f}")
    for group, name in (("f1", "F1@0.5"), ("kept", "kept categories F1@0.5")):
        if e.get(group):
            parts.append(f"{name} " + " ".join(f"{m} {fmt(v['f1@0.5'])}" for m, v in e[group].items()))
    return "; ".join(parts)


# --- Checkpoints ------------------------------------------------------------------------------------------------


def checkpoint_dirs(out: Path) -> list[Path]:
    return sorted((out / CHECKPOINTS).glob("step-*"))


def save_checkpoint(out: Path, step: int, base: Checkpoint, trainer: Trainer, spec: AdapterSpec, state: dict) -> None:
    """Adapter, optimizer state and the run's state as `checkpoints/step-N/` (the last few kept)."""
    folder = out / CHECKPOINTS / f"step-{step:07d}"
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(tmp, base.network, spec, base_model=base.path, step=step)
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(trainer.optimizer.state)))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    for old in checkpoint_dirs(out)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)


def restore_checkpoint(folder: Path, base: Checkpoint, trainer: Trainer) -> dict:
    """Load a checkpoint's trained tensors and optimizer state; returns its run state."""
    weights = mx.load(str(folder / ADAPTER_FILE))
    trainable = dict(tree_flatten(base.network.trainable_parameters()))
    if weights.keys() != trainable.keys():
        raise ValueError(f"{folder}: the checkpoint's tensors do not match this run's LoRA settings")
    base.network.update(tree_unflatten([(k, v.astype(trainable[k].dtype)) for k, v in weights.items()]))
    for key, value in mx.load(str(folder / "optimizer.safetensors")).items():
        node, *path, leaf = [trainer.optimizer.state, *key.split(".")]
        for part in path:  # in place: the compiled step holds this very tree
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(leaf) if isinstance(node, list) else leaf] = value
    return json.loads((folder / "state.json").read_text())


# --- The plot ---------------------------------------------------------------------------------------------------


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            'the training plot needs matplotlib: pip install "mlx-locate[finetune]" (or pass --no-plot)'
        ) from e
    return plt


def plot(history: list[dict], path: Path) -> None:
    """Training and held-out loss, and held-out F1@0.5 per mode (the data's and the kept categories'), against the
    step (matplotlib, `[finetune]`)."""
    plt = require_matplotlib()
    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval" in h and h["eval"]["loss"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for key, name in (("loss", "train"), ("ntp_loss", "train NTP"), ("block_loss", "train block")):
        left.plot([h["step"] for h in train], [h[key] for h in train], label=name, lw=1)
    left.plot([h["step"] for h in evals], [h["eval"]["loss"] for h in evals], "o-", label="held-out", lw=1.5)
    left.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="loss")
    left.legend()
    for group, style, suffix in (("f1", "o-", ""), ("kept", "s--", " (kept categories)")):
        for k, mode in enumerate(evals[0]["eval"].get(group, {}) if evals else ()):
            values = [h["eval"][group][mode]["f1@0.5"] or 0.0 for h in evals]
            right.plot([h["step"] for h in evals], values, style, color=f"C{k}", label=mode + suffix)
    right.set(xlabel="step", ylabel="F1@0.5", ylim=(-0.02, 1.02), title="held-out F1@0.5")
    if evals:
        right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- The run ----------------------------------------------------------------------------------------------------


def check_out(out: Path, resume: bool, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if resume:
        if not checkpoint_dirs(out):
            raise FileNotFoundError(f"{out}: no checkpoint to resume from")
    elif out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} already exists; pass --resume to continue its run or --force to replace it")


def finetune(
    base: Checkpoint,
    train_records: list[Record],
    eval_records: list[Record],
    out: str | Path,
    spec: AdapterSpec | None = None,
    options: FinetuneOptions | None = None,
    *,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    draw: bool = True,
    say=print,
) -> FinetuneResult:
    """Train `spec`'s adapter on `base` (which it changes: LoRA layers, unfrozen connector) and write `out`."""
    spec = AdapterSpec() if spec is None else spec
    options = FinetuneOptions() if options is None else options
    out = Path(out).expanduser()
    check_out(out, resume, force)
    if draw:
        require_matplotlib()
    for mode in options.eval_modes:
        if mode not in MODE_NAMES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODE_NAMES)}")
    if not 0 <= options.replay < 1:
        raise ValueError(f"replay must be a share of the batch in [0, 1), got {options.replay}")
    mx.random.seed(options.seed)
    trainable = add_lora(base.network, spec)
    max_length = base.max_length
    train, skipped = encode_examples(base, train_records, max_length)
    held, held_skipped = encode_examples(base, eval_records, max_length)
    for reason, n in {**skipped, **held_skipped}.items():
        say(f"[INFO] left out {n} sample(s): {reason}")
    out.mkdir(parents=True, exist_ok=True)
    keep = rp.resolve_keep(options.keep_categories, base.known, train_records)
    pool, kept_held, kept_truth = base_answers(base, keep, train_records, held, options, out, resume, progress, say)
    batches = Batches(len(train), options.batch_size, options.seed, len(pool), options.replay)
    pad = base.tokenizer.added_tokens.get("<|endoftext|>", base.network.token_ids.im_end)  # padding rows' input
    budget = options.feature_cache_mb * 2**20
    tower = None if spec.vision is not None else TowerRows(base, budget)
    frozen = frozen_layers(base, spec)
    inputs = LowerRows(base, frozen, tower, pad, budget) if frozen else tower
    if frozen:
        say(f"[INFO] the {frozen} lower decoder layers are frozen: their outputs are computed once per sample")
    trainer = Trainer(
        base.network,
        TrainOptions(
            options.lr, options.weight_decay, options.clip, "float32", options.compile, options.grad_checkpoint
        ),
        tables={},
        forward_model=layer_view(base.network, slice(frozen, None)),
    )
    state = {"history": [], "options": asdict(options), "spec": json.loads(json.dumps(asdict(spec)))}
    start = 0
    if resume:
        last = checkpoint_dirs(out)[-1]
        saved = restore_checkpoint(last, base, trainer)
        if saved["spec"] != state["spec"]:
            raise ValueError(f"{last}: saved with other LoRA settings ({saved['spec']})")
        state["history"], start = saved["history"], saved["step"]
        say(f"[INFO] resuming from {last} (step {start})")
    share = f", {batches.replay:.0%} of them the base's answers" if batches.replay else ""
    say(
        f"[INFO] {len(train)} training and {len(held)} held-out samples; {trainable / 1e6:.2f} M trainable "
        f"parameters; {options.steps} steps x {options.batch_size}{share}"
    )
    kept_ids = {id(e) for e in kept_held}
    groups = {"f1": [e for e in held if id(e) not in kept_ids][: options.eval_samples]}
    if kept_held:
        groups["kept"] = kept_held[: options.eval_samples]

    def evaluate(step: int) -> dict:
        entry = {"step": step, "eval": {"loss": None, **{g: {} for g in groups}}}
        if held:
            entry["eval"].update(held_out_loss(trainer, held, base, inputs, options, pad))
        if any(groups.values()):
            scores = f1_scores(
                LocateModel(base),
                groups,
                options.eval_modes,
                options.eval_max_tokens,
                progress,
                f"held-out F1, step {step}",
            )
            entry["eval"].update(scores)
        if held or kept_held:
            say(eval_line(entry))
        return entry

    def record(entry: dict) -> None:
        state["history"].append(entry)
        with (out / LOG_FILE).open("a") as f:
            f.write(json.dumps(entry) + "\n")

    if start == 0:
        record(evaluate(0))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=options.steps, initial=start, unit="step", desc="fine-tuning")
    warmup = options.warmup_steps()
    save_every = options.save_every or options.eval_every or options.steps
    acc, loss_sum, seen = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0
    t_start = t_last = time.perf_counter()
    previous = None
    mx.reset_peak_memory()
    for step in range(start, options.steps):
        data, replayed = batches.indices(step)
        examples = [train[i] for i in data] + [pool[i] for i in replayed]
        batch = make_batch(examples, base, inputs, pad, options.row_bucket)
        lr = learning_rate(step, options.steps, options.lr, warmup)
        mx.random.seed(options.seed * 1_000_003 + step)  # dropout: the same draws after a resume
        loss, stats, norm = trainer.step(batch, lr)
        if previous is not None:
            mx.eval(previous)  # at most two steps queued
        previous = loss
        acc, loss_sum, seen = acc + stats, loss_sum + loss, seen + 1
        done = step + 1
        if done % options.log_every == 0 or done == options.steps:
            now = time.perf_counter()
            entry = {"step": done, "loss": loss_sum.item() / seen, **describe(np.array(acc))}
            entry.update(grad_norm=norm.item(), lr=lr, samples_per_s=seen * options.batch_size / (now - t_last))
            record(entry)
            if bar is not None:
                bar.set_postfix(loss=f"{entry['loss']:.3f}")
            acc, loss_sum, seen, t_last = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0, now
        if bar is not None:
            bar.update(1)
        if (options.eval_every and done % options.eval_every == 0) or done == options.steps:
            record(evaluate(done))
            if draw:
                plot(state["history"], out / PLOT_FILE)
        if done % save_every == 0 or done == options.steps:
            save_checkpoint(out, done, base, trainer, spec, state)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    ran = options.steps - start
    save_adapter(out, base.network, spec, base_model=base.path, steps=options.steps, options=asdict(options))
    evals = [h for h in state["history"] if "eval" in h]
    return FinetuneResult(
        out=out,
        history=state["history"],
        before=evals[0]["eval"],
        after=evals[-1]["eval"],
        steps_per_s=ran / elapsed if ran else None,
        samples_per_s=ran * options.batch_size / elapsed if ran else None,
        peak_memory_bytes=mx.get_peak_memory(),
        trainable_parameters=trainable,
        train_samples=len(train),
        eval_samples=len(held),
        replay_samples=len(pool),
        kept=keep.categories,
        kept_truth=kept_truth,
        skipped={**skipped, **held_skipped},
    )
