"""The training library both trainers share (the demo's from scratch, `demo_recipe.py`, and LoRA fine-tuning,
`commands/finetune.py`): docs/training.md §1-§4.

Every sample is ONE sequence `[x_0 .. x_{L-1}] ++ [block 0] ++ ... ++ [block K-1]` (the NTP stream, then 6 rows per
block: the clean anchor copy and 5 `<text_mask>`), under the docs/training.md §2.2 mask; one float32 cross-entropy
(token mean) over the supervised rows of both streams; AdamW with warmup and cosine decay (`Trainer`).

Fixed shapes: the vision tower runs batched over images padded to the largest patch grid (a key mask keeps
each image to itself), the LM over sequences padded to a length bucket, and the mask is built on the device
from three ints per row, so one compiled step serves each bucket. The same code runs on CPU and CUDA.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from ..masks import BLOCK
from ..network.language import DecoderLayer
from ..network.model import LocateAnything
from ..network.projector import run_connector
from ..network.vision import bicubic_matrix, rope2d_tables
from ..preprocess import NORMALISED, PATCH_SIZE
from ..synthetic.scenes import SIDES
from ..tokens import TokenIds
from ..weights.checkpoint import DTYPES

LENGTH_BUCKET = 64
IGNORE = -1
# Row kinds: 0 ignored, 1 NTP, 2 + j block slot j.
KIND_NTP = 1
NUM_KINDS = 2 + BLOCK
STAT_COLUMNS = NUM_KINDS + 2  # the kinds, then coordinate targets of the NTP and of the block stream


# --- Samples as rows (host, numpy) ------------------------------------------------------------------------


@dataclass
class Encoded:
    """One training sample as rows: NTP rows 0..L-1, then 6 rows per block."""

    ids: np.ndarray  # (R,) int32 input ids
    positions: np.ndarray  # (R,) int32
    targets: np.ndarray  # (R,) int32, IGNORE where unsupervised
    kinds: np.ndarray  # (R,) int32: 0 ignored, 1 NTP, 2 + j block slot j
    clean_lim: np.ndarray  # (R,) row r attends keys t < clean_lim[r] ...
    own_lo: np.ndarray  # ... and own_lo[r] <= t < own_hi[r] (docs/training.md §2.2)
    own_hi: np.ndarray
    image_slot: np.ndarray  # (R,) merged image row spliced at this row, or -1
    length: int  # L
    pixels: np.ndarray | None = None  # (h*w, 3*p*p) uint8 patches in raster order (the synthetic path)
    grid: tuple[int, int] | None = None


# --- Blocks -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    anchor: int  # index of the clean token the block is anchored on (slot 0 copies it)
    targets: tuple[int, ...]  # BLOCK ids: the block's tokens, then <null>s


def cut_blocks(seq: list[int], start: int, ids: TokenIds) -> list[Block]:
    """Cut the answer `seq[start:]` (through its `<|im_end|>`) into blocks, docs/training.md §1.2.

    Block 0 is anchored on `seq[start - 1]` (the `\\n` after `assistant`); each block is cut after the first
    `</ref>` or `</box>` and before `<|im_end|>`, and the answer ends with exactly one end block.
    Raises `ValueError` if the answer has no `<|im_end|>`.
    """
    if ids.im_end not in seq[start:]:
        raise ValueError("the answer must end with <|im_end|>")
    blocks, begin = [], start
    while True:
        window = seq[begin : begin + BLOCK]
        if window[0] == ids.im_end:
            blocks.append(Block(begin - 1, (ids.im_end,) + (ids.null,) * (BLOCK - 1)))
            return blocks
        length = BLOCK
        for j, t in enumerate(window):
            if t in (ids.ref_end, ids.box_end):
                length = min(length, j + 1)
                break
            if t == ids.im_end:
                length = min(length, j)
                break
        blocks.append(Block(begin - 1, tuple(window[:length]) + (ids.null,) * (BLOCK - length)))
        begin += length


def encode_rows(x: list[int], anchors: list[int], ids: TokenIds) -> Encoded:
    """The rows of a token sequence `x` whose answers start after `x[s]` for each s in `anchors` (the "\n"
    after each turn's `assistant`) and end with their `<|im_end|>` (docs/training.md §1-§2)."""
    L = len(x)
    turns = [(s, x.index(ids.im_end, s)) for s in anchors]  # the answers' <|im_end|>
    blocks = [block for s, _ in turns for block in cut_blocks(x, s + 1, ids)]
    R = L + BLOCK * len(blocks)

    rows = np.arange(R, dtype=np.int32)
    out = Encoded(
        ids=np.empty(R, np.int32),
        positions=np.empty(R, np.int32),
        targets=np.full(R, IGNORE, np.int32),
        kinds=np.zeros(R, np.int32),
        clean_lim=np.empty(R, np.int32),
        own_lo=np.zeros(R, np.int32),
        own_hi=np.zeros(R, np.int32),
        image_slot=np.full(R, -1, np.int32),
        length=L,
    )
    out.ids[:L] = x
    out.positions[:L] = rows[:L]
    out.clean_lim[:L] = rows[:L] + 1  # causal
    for s, e in turns:
        out.targets[s:e] = x[s + 1 : e + 1]  # rows s..e-1 predict the answer through <|im_end|>
        out.kinds[s:e] = KIND_NTP
    image_rows = np.flatnonzero(np.array(x) == ids.image)
    out.image_slot[image_rows] = np.arange(len(image_rows), dtype=np.int32)
    for k, block in enumerate(blocks):
        r = L + BLOCK * k
        out.ids[r : r + BLOCK] = [x[block.anchor]] + [ids.text_mask] * (BLOCK - 1)
        out.positions[r : r + BLOCK] = block.anchor + np.arange(BLOCK)
        out.targets[r : r + BLOCK] = block.targets
        out.kinds[r : r + BLOCK] = 2 + np.arange(BLOCK)
        out.clean_lim[r : r + BLOCK] = block.anchor  # clean keys strictly before the anchor
        out.own_lo[r : r + BLOCK] = r
        out.own_hi[r : r + BLOCK] = r + BLOCK
    return out


ROW_FIELDS = ("ids", "positions", "targets", "kinds", "clean_lim", "own_lo", "own_hi", "image_slot")


def collate_rows(samples: list[Encoded], pad_id: int, bucket: int = LENGTH_BUCKET) -> dict[str, np.ndarray]:
    """The rows of `samples`, padded to a `bucket` multiple; padding rows see only themselves."""
    B = len(samples)
    T = -(-max(len(s.ids) for s in samples) // bucket) * bucket
    batch = {
        "ids": np.full((B, T), pad_id, np.int32),
        "positions": np.zeros((B, T), np.int32),
        "targets": np.full((B, T), IGNORE, np.int32),
        "kinds": np.zeros((B, T), np.int32),
        "clean_lim": np.zeros((B, T), np.int32),
        "own_lo": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        "own_hi": np.tile(np.arange(1, T + 1, dtype=np.int32), (B, 1)),
        "image_slot": np.full((B, T), -1, np.int32),
    }
    for b, s in enumerate(samples):
        for name in ROW_FIELDS:
            batch[name][b, : len(s.ids)] = getattr(s, name)
    # The supervised rows, padded with row 0 (never supervised): the head and the loss run on these only.
    counts = [int((s.targets >= 0).sum()) for s in samples]
    S = -(-max(counts) // bucket) * bucket
    batch["supervised"] = np.zeros((B, S), np.int32)
    for b, s in enumerate(samples):
        batch["supervised"][b, : counts[b]] = np.flatnonzero(s.targets >= 0)
    return batch


# --- The synthetic grids (the demo's images) --------------------------------------------------------------


@dataclass(frozen=True)
class GridTables:
    """Per patch grid (h, w) of the training sizes, padded to the largest grid: pos-emb resize, 2D RoPE,
    the valid patches and the 2 x 2 merge gather. Indexed on the device by a grid id per image."""

    grids: tuple[tuple[int, int], ...]
    patches: int  # padded patch count N
    merged: int  # padded merged-token count M = N / 4

    @staticmethod
    def for_sides(sides: tuple[int, ...] = SIDES, patch: int = PATCH_SIZE) -> GridTables:
        grids = tuple((h // patch, w // patch) for h in sides for w in sides)
        n = max(h * w for h, w in grids)
        return GridTables(grids, n, n // 4)

    def index(self, grid: tuple[int, int]) -> int:
        if grid not in self.grids:
            raise ValueError(f"patch grid {grid} is not one of the training grids {self.grids}")
        return self.grids.index(grid)

    def arrays(self, table: int, head_dim: int, theta: float) -> dict[str, mx.array]:
        n, m = self.patches, self.merged
        count = len(self.grids)
        pos = np.zeros((count, n, table * table), np.float32)
        cos = np.ones((count, n, head_dim // 2), np.float32)
        sin = np.zeros((count, n, head_dim // 2), np.float32)
        valid = np.zeros((count, n), bool)
        merge = np.zeros((count, 4 * m), np.int32)
        for g, (h, w) in enumerate(self.grids):
            pos[g, : h * w] = np.kron(bicubic_matrix(table, h), bicubic_matrix(table, w))
            c, s = rope2d_tables(h, w, head_dim, theta)
            cos[g, : h * w], sin[g, : h * w] = np.array(c), np.array(s)
            valid[g, : h * w] = True
            i, j = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
            top = (2 * i * w + 2 * j).reshape(-1, 1)
            quad = np.concatenate([top, top + 1, top + w, top + w + 1], axis=1)  # merge_2x2's order
            merge[g, : h * w] = quad.reshape(-1)
        return {k: mx.array(v) for k, v in dict(pos=pos, cos=cos, sin=sin, valid=valid, merge=merge).items()}


def collate(samples: list[Encoded], tables: GridTables, pad_id: int) -> dict[str, np.ndarray]:
    """`collate_rows`, and the patches padded to the largest grid of `tables`."""
    batch = collate_rows(samples, pad_id)
    batch["pixels"] = np.zeros((len(samples), tables.patches, samples[0].pixels.shape[1]), np.uint8)
    batch["grid"] = np.array([tables.index(s.grid) for s in samples], np.int32)
    for b, s in enumerate(samples):
        batch["pixels"][b, : len(s.pixels)] = s.pixels
    return batch


def demo_tables(model: LocateAnything) -> dict[str, mx.array]:
    """The tower inputs of the synthetic training grids for `model`'s vision config."""
    v = model.config.vision
    return GridTables.for_sides().arrays(v.init_pos_emb_height, v.head_dim, v.rope_theta)


# --- Device forward and loss ------------------------------------------------------------------------------


def vision_features(model: LocateAnything, pixels: mx.array, grid: mx.array, tables: dict) -> mx.array:
    """(B, N, 3*p*p) uint8 patches of padded images -> (B, M, D) connector rows (merged raster order)."""
    tower = model.vision_model
    table = tower.patch_embed.pos_emb.weight.astype(mx.float32).reshape(-1, tower.config.hidden_size)
    x = mx.array(NORMALISED)[pixels]  # the preprocess normalisation, the reference's float32 values
    pos = tables["pos"][grid] @ table
    return tower_features(
        model, x, pos, tables["cos"][grid], tables["sin"][grid], tables["valid"][grid], tables["merge"][grid]
    )


def tower_features(
    model: LocateAnything,
    patches: mx.array,  # (B, N, 3*p*p) normalised
    pos: mx.array,  # (B, N, C) position embeddings (the table resized to each grid)
    cos: mx.array,  # (B, N, D/2) 2D RoPE
    sin: mx.array,
    valid: mx.array,  # (B, N) bool: the image's own patches
    merge: mx.array,  # (B, 4M) int32: the 2 x 2 merge gather
) -> mx.array:
    """Padded images through the vision tower, merge and connector -> (B, M, D) connector rows."""
    tower = model.vision_model
    B = patches.shape[0]
    x = tower.patch_embed.proj(patches.astype(tower.patch_embed.proj.weight.dtype))
    C = x.shape[-1]
    x = x + pos.astype(x.dtype)
    mask = valid[:, None, None, :]  # keys of the image's own patches only
    for block in tower.encoder.blocks:
        x = block(x, cos, sin, mask)
    x = tower.encoder.final_layernorm(x)
    merged = mx.take_along_axis(x, merge[..., None], axis=1).reshape(B, merge.shape[1] // 4, 4 * C)
    return run_connector(model.mlp1, merged)


def training_mask_rows(clean_lim: mx.array, own_lo: mx.array, own_hi: mx.array) -> mx.array:
    """(B, 1, T, T) bool from per-row limits: t < clean_lim[r] or own_lo[r] <= t < own_hi[r]."""
    t = mx.arange(clean_lim.shape[1], dtype=mx.int32)[None, None, :]
    lim, lo, hi = clean_lim[..., None], own_lo[..., None], own_hi[..., None]
    return ((t < lim) | ((t >= lo) & (t < hi)))[:, None]


def forward_hidden(model: LocateAnything, batch: dict, tables: dict) -> mx.array:
    """Final hidden states (B, T, D), before the final norm, of a collated batch: rows (`collate_rows`) and the
    input of the first decoder layer as `hidden` (B, T, D), or the image in one of three forms (see below)."""
    lm = model.language_model
    mask = training_mask_rows(batch["clean_lim"], batch["own_lo"], batch["own_hi"])
    if "hidden" in batch:  # the output of frozen lower layers, computed beforehand (`model` holds the rest)
        return lm(batch["hidden"], batch["positions"], mask)[0]
    if "merged" in batch:  # a frozen tower's merged rows (B, M, 4C), computed beforehand
        features = run_connector(model.mlp1, batch["merged"])
    elif "patches" in batch:  # float patches with their own tower inputs (any grids)
        fields = ("patches", "pos", "cos", "sin", "valid", "merge")
        features = tower_features(model, *(batch[k] for k in fields))
    else:  # uint8 patches of the synthetic grids, tower inputs from `tables`
        features = vision_features(model, batch["pixels"], batch["grid"], tables)
    embeds = lm.model.embed_tokens(batch["ids"])
    slot = batch["image_slot"]
    image = mx.take_along_axis(features, mx.maximum(slot, 0)[..., None], axis=1)
    x = mx.where((slot >= 0)[..., None], image.astype(embeds.dtype), embeds)
    return lm(x, batch["positions"], mask)[0]


def layer_view(model: LocateAnything, layers: slice) -> LocateAnything:
    """`model` with only `layers` of its decoder: a shallow view sharing every module and array."""
    view, lm, inner = copy.copy(model), copy.copy(model.language_model), copy.copy(model.language_model.model)
    inner.layers = model.language_model.model.layers[layers]
    lm.model = inner
    view.language_model = lm
    return view


def loss_and_stats(model: LocateAnything, batch: dict, tables: dict) -> tuple[mx.array, mx.array]:
    """Token-mean float32 cross-entropy over supervised rows.

    Stats (3, STAT_COLUMNS): CE sum, count and correct argmax per row kind, then for coordinate targets of
    the NTP and the block stream (docs/training.md §5: block coordinates should stay above NTP ones).
    """
    rows = batch["supervised"]  # (B, S): the head's rows, as fused linear + cross-entropy would skip the rest
    hidden = mx.take_along_axis(forward_hidden(model, batch, tables), rows[..., None], axis=1)
    logits = model.language_model.logits(hidden)  # (B, S, V) float32
    targets = mx.take_along_axis(batch["targets"], rows, axis=1)
    valid = targets >= 0
    picked = mx.take_along_axis(logits, mx.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    ce = (mx.logsumexp(logits, axis=-1) - picked) * valid
    loss = ce.sum() / mx.maximum(valid.sum(), 1)
    kinds = mx.take_along_axis(batch["kinds"], rows, axis=1)[..., None]
    ids = model.token_ids
    coord = ((targets >= ids.coord_start) & (targets <= ids.coord_end))[..., None]
    columns = mx.concatenate(
        [kinds == mx.arange(NUM_KINDS), coord & (kinds == KIND_NTP), coord & (kinds > KIND_NTP)], axis=-1
    )
    onehot = columns.astype(mx.float32)  # (B, T, STAT_COLUMNS)
    correct = ((mx.argmax(logits, axis=-1) == targets) & valid).astype(mx.float32)
    stats = mx.stack(
        [
            (ce[..., None] * onehot).sum(axis=(0, 1)),
            onehot.sum(axis=(0, 1)),
            (correct[..., None] * onehot).sum(axis=(0, 1)),
        ]
    )
    return loss, mx.stop_gradient(stats)


def learning_rate(step: int, total: int, lr: float, warmup: int, final_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `final_ratio * lr` at step `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + np.cos(np.pi * progress)))


@dataclass(frozen=True)
class TrainOptions:
    lr: float = 1e-3
    weight_decay: float = 0.05
    clip: float = 1.0
    compute_dtype: str = "float32"  # bfloat16: forward/backward in bf16 on float32 master weights
    compile: bool = True
    grad_checkpoint: bool = False  # recompute each decoder layer's activations in the backward pass


class CheckpointedLayer(DecoderLayer):
    """A decoder layer under `mx.checkpoint`: its activations are recomputed for the gradient, not kept.
    Steps with a KV cache (inference) run it as a plain layer."""

    def __call__(self, x, cos, sin, mask, *cache):
        if any(c is not None for c in cache):
            return super().__call__(x, cos, sin, mask, *cache)

        # The rotary tables and the mask are closed over, not inputs: no gradient is asked of them (MLX CUDA has no
        # attention VJP with respect to a mask).
        def run(params, x):
            self.update(params)
            return DecoderLayer.__call__(self, x, cos, sin, mask)[0]

        return mx.checkpoint(run)(self.trainable_parameters(), x), None


def checkpoint_layers(model: LocateAnything) -> None:
    """Gradient checkpointing for every decoder layer (their parameters keep their names)."""
    for layer in model.language_model.model.layers:
        layer.__class__ = CheckpointedLayer


class Trainer:
    """One compiled AdamW step per call on `model.trainable_parameters()` (everything, or LoRA and what a
    fine-tune unfroze); the learning rate is an input, so the schedule is plain Python. `tables`: the tower
    inputs of batches that index them (default: the synthetic grids)."""

    def __init__(
        self,
        model: LocateAnything,
        options: TrainOptions,
        tables: dict | None = None,
        forward_model: LocateAnything | None = None,
    ):
        """`forward_model`: what the loss runs, sharing `model`'s modules (a `layer_view` of its upper layers
        when batches carry their `hidden` input); default `model`."""
        self.model = model
        forward_model = model if forward_model is None else forward_model
        self.tables = demo_tables(model) if tables is None else tables
        self.optimizer = optim.AdamW(learning_rate=options.lr, betas=[0.9, 0.999], weight_decay=options.weight_decay)
        self.optimizer.init(model.trainable_parameters())
        if options.grad_checkpoint:
            checkpoint_layers(model)
        compute = DTYPES[options.compute_dtype]

        def loss_fn(params, batch, tables):
            if compute != mx.float32:
                params = tree_map(lambda p: p.astype(compute), params)
            model.update(params)
            return loss_and_stats(forward_model, batch, tables)

        grad_fn = mx.value_and_grad(loss_fn)

        def step(batch, tables):
            params = model.trainable_parameters()
            (loss, stats), grads = grad_fn(params, batch, tables)
            model.update(params)
            grads, norm = optim.clip_grad_norm(grads, options.clip)
            self.optimizer.update(model, grads)
            return loss, stats, norm

        # The random state goes in and out too: LoRA dropout draws from it.
        state = [model.state, self.optimizer.state, mx.random.state]
        self.step_fn = partial(mx.compile, inputs=state, outputs=state)(step) if options.compile else step
        score = partial(loss_and_stats, forward_model)
        self.score_fn = partial(mx.compile, inputs=[model.state])(score) if options.compile else score

    def step(self, batch: dict[str, np.ndarray], lr: float | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Queue one step; returns (loss, stats, grad norm) without waiting for them."""
        if lr is not None:
            self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        arrays = {k: mx.array(v) for k, v in batch.items()}
        out = self.step_fn(arrays, self.tables)
        mx.async_eval(out, self.model.state, self.optimizer.state)
        return out

    def score(self, batch: dict[str, np.ndarray]) -> tuple[mx.array, mx.array]:
        """(loss, stats) of a batch without a step (held-out data); the model in eval mode (no dropout)."""
        self.model.eval()
        try:
            return self.score_fn({k: mx.array(v) for k, v in batch.items()}, self.tables)
        finally:
            self.model.train()


def describe(stats: np.ndarray) -> dict:
    """Per-stream losses and accuracies from summed stats (3, STAT_COLUMNS)."""
    ce, n, ok = stats
    blk = slice(2, NUM_KINDS)

    def ratio(a, b):
        return float(a / b) if b else float("nan")

    return {
        "ntp_loss": ratio(ce[KIND_NTP], n[KIND_NTP]),
        "block_loss": ratio(ce[blk].sum(), n[blk].sum()),
        "ntp_acc": ratio(ok[KIND_NTP], n[KIND_NTP]),
        "block_acc": ratio(ok[blk].sum(), n[blk].sum()),
        "ntp_coord_loss": ratio(ce[NUM_KINDS], n[NUM_KINDS]),
        "block_coord_loss": ratio(ce[NUM_KINDS + 1], n[NUM_KINDS + 1]),
        "slot_loss": [round(ratio(ce[2 + j], n[2 + j]), 4) for j in range(BLOCK)],
    }
