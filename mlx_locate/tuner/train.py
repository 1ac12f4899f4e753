"""Train a tiny LocateAnything (same architecture, small sizes) from scratch on synthetic shapes.

docs/training.md §1-§4: every sample is ONE sequence `[x_0 .. x_{L-1}] ++ [block 0] ++ ... ++ [block K-1]` (the NTP
stream, then 6 rows per block: the clean anchor copy and 5 `<text_mask>`), under the docs/training.md §2.2 mask; one
float32 cross-entropy (token mean) over the supervised rows of both streams; AdamW with warmup and cosine decay.
The checkpoint is written in the original Hugging Face layout, so `mlx_locate.load(out)` runs it.

    python -m mlx_locate.tuner.train --out runs/demo --steps 20000 --batch-size 64 --workers 12

Fixed shapes: the vision tower runs batched over images padded to the largest patch grid (a key mask keeps
each image to itself), the LM over sequences padded to a length bucket, and the mask is built on the device
from three ints per row, so one compiled step serves each bucket. The same code runs on CPU and CUDA.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from tokenizers import AddedToken, models, trainers
from tokenizers import Tokenizer as _Tokenizer

from .. import cli
from ..cards import CONFIG_KEY, KnownCategories
from ..checkpoint import DEMO_DIR, DTYPES, read_weights
from ..config import ModelConfig
from ..language import DecoderLayer
from ..loader import sanitize
from ..masks import BLOCK
from ..model import LocateAnything
from ..preprocess import NORMALISED, PATCH_SIZE
from ..preprocess import patchify as cut_patches
from ..projector import run_connector
from ..prompts import prompt_ids, task_text
from ..random_checkpoint import Preset
from ..synthetic.scenes import COLORS, DETECT_CATEGORY_COUNTS, SHAPES, SIDES, Sample, make_sample
from ..tokenizer import Tokenizer, qwen2_byte_level
from ..tokens import TokenIds
from ..vision import bicubic_matrix, rope2d_tables

# docs/training.md §4.1 (about 4.5 M parameters with the demo vocabulary).
SIZES: dict[str, Preset] = {
    "demo": Preset(128, 4, 4, 512, 256, 4, 4, 2, 768, pos_emb=16),
    "small": Preset(64, 2, 4, 256, 128, 2, 4, 2, 384, pos_emb=16),  # CPU smoke runs
    "micro": Preset(32, 1, 2, 64, 64, 2, 4, 2, 128, pos_emb=16),  # tests
}
IN_TOKEN_LIMIT = 256  # patches: larger images are scaled down to about the training sizes (224 x 224)
MODEL_MAX_LENGTH = 2048
LENGTH_BUCKET = 64
IGNORE = -1
# Row kinds: 0 ignored, 1 NTP, 2 + j block slot j.
KIND_NTP = 1
NUM_KINDS = 2 + BLOCK
STAT_COLUMNS = NUM_KINDS + 2  # the kinds, then coordinate targets of the NTP and of the block stream


# --- The demo tokenizer -----------------------------------------------------------------------------------

# The demo tokenizer: a byte-level BPE over printable ASCII whose merges make every word below one token,
# in both forms (" red" inside a prompt or label, "red" right after <ref> or </c>).
BPE_SIZE = 210
LABEL_WORDS = (*COLORS, *SHAPES, "the", "any")
EXTRA_WORDS = (" shape", " in", " the", " image", "None", "none", "assistant", "system", "user", "image")
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # just below the added-token base S
# The checkpoint's added tokens from S on (docs/training.md §4.2, docs/model.md §3).
ADDED_TOKENS = (
    "<IMG_CONTEXT>",
    "<img>",
    "</img>",
    "<box>",
    "</box>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<interval>",
    "</interval>",
    "<text_mask>",
    *(f"<{v}>" for v in range(1001)),
    "<null>",
    "<switch>",
    "</c>",
)
_FIXED_TEXTS = (
    "You are a helpful assistant.\n",
    "system\n",
    "user\n<image 1>",
    "assistant\n",
    "Locate all the instances that matches the following description: ",
    "Locate a single instance that matches the following description: ",
    "Locate all the instances that match the following description: ",
    "Point to: ",
)


def build_tokenizer() -> _Tokenizer:
    """The demo model's tokenizer: Qwen2 pre-tokenizer and byte-level BPE, then the control and added tokens.

    Ids: BPE 0..BPE_SIZE-1, `<|endoftext|>` `<|im_start|>` `<|im_end|>`, then S = BPE_SIZE + 3 for
    `<IMG_CONTEXT>` and the rest of ADDED_TOKENS in the checkpoint's order. Deterministic.
    """
    tok = qwen2_byte_level(_Tokenizer(models.BPE()))
    alphabet = [tok.pre_tokenizer.pre_tokenize_str(chr(c))[0][0] for c in (*range(32, 127), 10)]
    words = [*(" " + w for w in LABEL_WORDS), *LABEL_WORDS, *EXTRA_WORDS]
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False
    )
    tok.train_from_iterator(words * 1000 + list(_FIXED_TEXTS) * 10, trainer)
    split = [w for w in words if len(tok.encode(w).ids) != 1]
    if tok.get_vocab_size() != BPE_SIZE or split:
        raise RuntimeError(f"demo BPE: {tok.get_vocab_size()} tokens (want {BPE_SIZE}); words not single: {split}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS + ADDED_TOKENS])
    return tok


# --- Checkpoint files -------------------------------------------------------------------------------------


def demo_tokenizer() -> _Tokenizer:
    """The bundled demo tokenizer (so a model trained anywhere gets the same ids), else a fresh build."""
    path = DEMO_DIR / "tokenizer.json"
    return _Tokenizer.from_file(str(path)) if path.is_file() else build_tokenizer()


def demo_config(tok: _Tokenizer, sizes: Preset, dtype: str = "float32") -> dict:
    """config.json with the release's field names, these sizes and every special id of this tokenizer."""
    tid = tok.token_to_id
    config = dataclasses.replace(sizes, vocab_size=tok.get_vocab_size()).config(dtype)
    config.update(
        image_token_index=tid("<IMG_CONTEXT>"),
        box_start_token_id=tid("<box>"),
        box_end_token_id=tid("</box>"),
        ref_start_token_id=tid("<ref>"),
        ref_end_token_id=tid("</ref>"),
        coord_start_token_id=tid("<0>"),
        coord_end_token_id=tid("<1000>"),
        none_token_id=tid("None"),
        eos_token_id=tid("<|im_end|>"),
    )
    config["text_config"].update(
        bos_token_id=tid("<|endoftext|>"),
        eos_token_id=tid("<|im_end|>"),
        text_mask_token_id=tid("<text_mask>"),
        null_token_id=tid("<null>"),
        switch_token_id=tid("<switch>"),
        max_position_embeddings=MODEL_MAX_LENGTH,
        sliding_window=MODEL_MAX_LENGTH,
    )
    config["text_config"].pop("_name_or_path", None)
    config["vision_config"].pop("_name_or_path", None)
    config["vision_config"].pop("auto_map", None)
    config[CONFIG_KEY] = KnownCategories(SHAPES, max(DETECT_CATEGORY_COUNTS)).to_config()
    return config


def side_files(tok: _Tokenizer) -> dict[str, dict]:
    """The tokenizer/processor JSON files of a checkpoint folder, besides tokenizer.json."""
    tid = tok.token_to_id
    return {
        "tokenizer_config.json": {
            "add_bos_token": False,
            "add_prefix_space": False,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": MODEL_MAX_LENGTH,
            "pad_token": "<|endoftext|>",
            "processor_class": "LocateAnythingProcessor",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
        "preprocessor_config.json": {
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "LocateAnythingImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "in_token_limit": IN_TOKEN_LIMIT,
            "merge_kernel_size": [2, 2],
            "patch_size": PATCH_SIZE,
            "processor_class": "LocateAnythingProcessor",
        },
        "processor_config.json": {
            "image_end_token": "</img>",
            "image_placeholder": "image",
            "image_start_token": "<img>",
            "image_token": "<IMG_CONTEXT>",
            "merge_kernel_size": [2, 2],
            "processor_class": "LocateAnythingProcessor",
        },
        "generation_config.json": {
            "bos_token_id": tid("<|endoftext|>"),
            "eos_token_id": [tid("<|im_end|>"), tid("<|endoftext|>")],
            "generation_mode": "hybrid",
            "max_new_tokens": 512,
            "n_future_tokens": BLOCK,
            "pad_token_id": tid("<|endoftext|>"),
        },
    }


def hf_weights(model: LocateAnything, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Parameters under the checkpoint's names and layouts (the patch embedding as an OIHW conv)."""
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name == "vision_model.patch_embed.proj.weight":
            value = value.reshape(value.shape[0], 3, PATCH_SIZE, PATCH_SIZE)
        weights[name] = value.astype(dtype)
    return weights


def save_checkpoint(model: LocateAnything, tok: _Tokenizer, out: Path, dtype: str = "float32") -> None:
    """Write config.json, model.safetensors, tokenizer.json and the processor files to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = model_sizes(model.config)
    (out / "config.json").write_text(json.dumps(demo_config(tok, sizes, dtype), indent=2) + "\n")
    for name, content in side_files(tok).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    mx.save_safetensors(str(out / "model.safetensors"), hf_weights(model, DTYPES[dtype]), metadata={"format": "pt"})


def model_sizes(config: ModelConfig) -> Preset:
    v, t = config.vision, config.text
    return Preset(
        v.hidden_size,
        v.num_hidden_layers,
        v.num_attention_heads,
        v.intermediate_size,
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        vocab_size=t.vocab_size,
        pos_emb=v.init_pos_emb_height,
    )


def coordinate_embeddings(dim: int, std: float) -> np.ndarray:
    """(1001, dim) sin/cos features of v = 0..1000 at frequencies from pi/1000 to pi/2 per unit, scaled to `std`.

    Through the tied head, neighbouring coordinates start with similar logits, so a near miss is rewarded
    from the first steps instead of only after every coordinate token has been learnt on its own.
    """
    freqs = np.pi / 1000 * np.geomspace(1, 500, dim // 2)
    angles = np.arange(1001)[:, None] * freqs[None, :]
    table = np.zeros((1001, dim), np.float32)
    table[:, : dim // 2], table[:, dim // 2 : 2 * (dim // 2)] = np.sin(angles), np.cos(angles)
    return table * np.float32(std * np.sqrt(2))


def init_model(
    tok: _Tokenizer, sizes: Preset, seed: int, std: float = 0.02, coord_init: str = "sincos"
) -> LocateAnything:
    """A fresh model: N(0, std) weights, zero biases, unit norm weights (docs/training.md §4.1); with
    `coord_init="sincos"` the <0>..<1000> embedding rows start from `coordinate_embeddings`."""
    raw = demo_config(tok, sizes)
    config = ModelConfig.from_dict(raw)
    model = LocateAnything(config, Tokenizer(tok).token_ids(raw))
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for i, (name, value) in enumerate(flat):
        if name.endswith(".bias"):
            value = mx.zeros_like(value)
        elif value.ndim == 1:  # LayerNorm / RMSNorm weights
            value = mx.ones_like(value)
        else:
            value = std * mx.random.normal(value.shape, key=keys[i])
        if name == "language_model.model.embed_tokens.weight" and coord_init == "sincos":
            start = model.token_ids.coord_start
            value[start : start + 1001] = mx.array(coordinate_embeddings(value.shape[1], std))
        params.append((name, value))
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


# --- Encoding samples (host, numpy) -----------------------------------------------------------------------


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


def patchify(image, patch: int = PATCH_SIZE) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 patches (h*w, 3*p*p) in `preprocess`'s layout; the image sides must be multiples of 2 * patch."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    H, W, _ = pixels.shape
    if H % (2 * patch) or W % (2 * patch):
        raise ValueError(f"image {W}x{H} must have sides that are multiples of {2 * patch}")
    patches, grid = cut_patches(pixels, patch)
    return np.ascontiguousarray(patches.reshape(len(patches), -1)), grid


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


def encode(sample: Sample, tokenizer: Tokenizer, ids: TokenIds) -> Encoded:
    """A synthetic sample: its patches and rows (one turn)."""
    pixels, grid = patchify(sample.scene.image)
    prompt = prompt_ids(tokenizer, task_text(sample.task.task, sample.task.query), [grid])
    x = prompt + tokenizer.encode(sample.task.answer + "<|im_end|>\n")
    out = encode_rows(x, [len(prompt) - 1], ids)
    out.pixels, out.grid = pixels, grid
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


def collate(samples: list[Encoded], tables: GridTables, pad_id: int) -> dict[str, np.ndarray]:
    """`collate_rows`, and the patches padded to the largest grid of `tables`."""
    batch = collate_rows(samples, pad_id)
    batch["pixels"] = np.zeros((len(samples), tables.patches, samples[0].pixels.shape[1]), np.uint8)
    batch["grid"] = np.array([tables.index(s.grid) for s in samples], np.int32)
    for b, s in enumerate(samples):
        batch["pixels"][b, : len(s.pixels)] = s.pixels
    return batch


class BatchMaker:
    """Batch `step` of the stream: samples step*B .. step*B+B-1 of `make_sample(seed, i)`. Picklable."""

    def __init__(self, tokenizer_json: str, seed: int, batch_size: int, split: str = "train"):
        self.tokenizer_json = tokenizer_json
        self.seed, self.batch_size, self.split = seed, batch_size, split
        self._state = None

    def _setup(self):
        if self._state is None:
            tok = _Tokenizer.from_str(self.tokenizer_json)
            tokenizer = Tokenizer(tok)
            raw = demo_config(tok, SIZES["micro"])
            self._state = (
                tokenizer,
                tokenizer.token_ids(raw),
                GridTables.for_sides(),
                tok.token_to_id("<|endoftext|>"),
            )
        return self._state

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        tokenizer, ids, tables, pad = self._setup()
        first = step * self.batch_size
        samples = [make_sample(self.seed, i, self.split) for i in range(first, first + self.batch_size)]
        return collate([encode(s, tokenizer, ids) for s in samples], tables, pad)


def batches(maker: BatchMaker, start: int, steps: int, workers: int):
    """Yield batches start..steps-1 in order; with workers > 0 a process pool keeps 2 per worker in flight."""
    if workers <= 0:
        for step in range(start, steps):
            yield maker(step)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork after MLX started its threads
    with ctx.Pool(workers) as pool:
        pending = []
        next_step = start
        for _ in range(start, steps):
            while next_step < steps and len(pending) < 2 * workers:
                pending.append(pool.apply_async(maker, (next_step,)))
                next_step += 1
            yield pending.pop(0).get()


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


def demo_tables(model: LocateAnything) -> dict[str, mx.array]:
    """The tower inputs of the synthetic training grids for `model`'s vision config."""
    v = model.config.vision
    return GridTables.for_sides().arrays(v.init_pos_emb_height, v.head_dim, v.rope_theta)


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


def train(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    tok = demo_tokenizer()
    model = init_model(tok, SIZES[args.sizes], args.seed, coord_init=args.coord_init)
    if args.init:
        # Continue from a checkpoint this script wrote (weights only; the optimizer starts afresh).
        weights = sanitize(read_weights(Path(args.init)), model.config.vision.patch_size)
        model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    options = TrainOptions(
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip=args.clip,
        compute_dtype=args.compute_dtype,
        compile=not args.no_compile,
    )
    trainer = Trainer(model, options)
    maker = BatchMaker(tok.to_str(), args.seed, args.batch_size)
    total, warmup = args.steps, max(1, min(args.warmup, args.steps // 2))
    print(
        f"device {mx.default_device()} | sizes {args.sizes}: {n_params / 1e6:.2f} M parameters, vocab "
        f"{tok.get_vocab_size()} | {total} steps x {args.batch_size} samples | workers {args.workers}",
        flush=True,
    )
    log = open(args.log, "a") if args.log else None  # noqa: SIM115
    acc, loss_sum, seen = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0
    t_start = t_last = time.perf_counter()
    t_probe = previous = None
    step = 0
    for batch in batches(maker, 0, args.steps, args.workers):
        if step >= total:
            break
        lr = learning_rate(step, total, args.lr, warmup)
        loss, stats, norm = trainer.step(batch, lr)
        if previous is not None:
            mx.eval(previous)  # at most two steps queued on the device
        previous = loss
        step += 1
        acc, loss_sum, seen = acc + stats, loss_sum + loss, seen + 1
        if args.minutes and step == 20:
            mx.eval(loss)
            t_probe = time.perf_counter()
        if args.minutes and step == warmup and t_probe is not None:
            # Fit the rest of the run into the time budget; the cosine starts only now, so nothing changes.
            mx.eval(loss)
            rate = (step - 20) / (time.perf_counter() - t_probe)
            left = args.minutes * 60 - (time.perf_counter() - t_start)
            total = max(step + 1, min(total, step + int(left * rate)))
            print(f"time budget {args.minutes} min at {rate:.1f} steps/s: {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            entry = {"step": step, "loss": round(loss_sum.item() / seen, 4)}
            entry.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in describe(np.array(acc)).items()})
            now = time.perf_counter()
            entry.update(
                grad_norm=round(norm.item(), 3),
                lr=round(lr, 7),
                samples_per_s=round(seen * args.batch_size / (now - t_last), 1),
                elapsed_s=round(now - t_start, 1),
            )
            print(json.dumps(entry), flush=True)
            if log:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            acc, loss_sum, seen, t_last = mx.zeros((3, STAT_COLUMNS)), mx.zeros(()), 0, now
        if args.save_every and step % args.save_every == 0 and step < total:
            save_checkpoint(model, tok, out, args.save_dtype)
    save_checkpoint(model, tok, out, args.save_dtype)
    if log:
        log.close()
    elapsed = time.perf_counter() - t_start
    print(
        f"saved {out}: {step} steps, {step * args.batch_size / elapsed:.1f} samples/s over {elapsed:.0f} s", flush=True
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_locate.tuner.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (original HF layout)")
    cli.add_training(
        p,
        steps=1000,
        batch_size=32,
        lr=TrainOptions.lr,
        weight_decay=TrainOptions.weight_decay,
        clip=TrainOptions.clip,
        warmup=500,
        warmup_help="warmup steps (at most half of --steps; at least 21 with --minutes)",
        save_every=0,
        save_help="also save every N steps (0: only at the end)",
    )
    p.add_argument("--sizes", choices=list(SIZES), default="demo")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights (same --sizes)")
    p.add_argument("--coord-init", choices=("sincos", "normal"), default="sincos", help="<0>..<1000> embeddings")
    p.add_argument("--compute-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--save-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--workers", type=int, default=0, help="data-generation processes (0: in this process)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--log", default=None, help="append JSON log lines to this file")
    p.add_argument("--minutes", type=float, default=0, help="fit the run into this many minutes (0: no limit)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        print("error: --steps and --batch-size must be at least 1", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
