"""How much memory a run may use, and how it is shared out, from what the device reports when the model loads.

- `device_limit()`: the bytes this process may use: MLX's memory limit (`--memory-limit` sets it, through
  `mx.set_memory_limit`), on Apple silicon also at most the GPU's recommended working set (macOS lends the GPU
  only part of the machine's memory).
- `Budget.measure(network)`: that limit less what the loaded weights hold, split into working memory for the
  transient work of the vision tower and the prefills (`working_bytes`) and the rest for the KV cache of the
  rows and the prompt prefixes kept ahead of them. What one patch costs a tower block and what one row, and one
  key it attends to, cost a prefill are measured once, on small inputs (what a device holds while it runs a
  product, a quantized one above all, and when it releases it, is the backend's own).

Going over a budget never fails: the engine admits fewer rows, and the tower and the prefills run in smaller
pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import kv_bucket
from .masks import step_mask
from .network.attention import SCORE_BUDGET
from .network.language import additive_mask, attend
from .network.model import LocateAnything

# Bytes of transient work at once (a few tower blocks, one prefill call) where half the free memory holds them: on
# a GPU, bigger pieces read the weights fewer times, so a GPU with much free memory lends its work a share of it
# (a prefill call of 16 prompts, benchmarks/README.md "H200"); on the CPU a product is bound by arithmetic, so
# bigger pieces buy no speed.
BASE_WORKING = {"gpu": 2 << 30, "cpu": 512 << 20}
GPU_WORKING_SHARE = 8  # a GPU's working memory: an eighth of the free memory where that is more than its base
RESERVE = 256 << 20  # left free of any budget: MLX's own buffers, the host's arrays, fragmentation
MIN_WORKING = 64 << 20
PROBE_PATCHES = 256  # the input the tower's per-patch cost is measured on
PROBE_ROWS = 128  # and the prefill's per-row cost
PROBE_KEYS = 1024  # keys its per-key cost is measured over
# A prefill call of many rows, compiled, holds a little more per row than the probes measure on few, uncompiled:
# the plan leaves this margin (tests/test_memory.py: a compiled call of three times the probe's rows).
PROBE_MARGIN = 1.125
# Prefill rows per call at most on the CPU: there a larger call buys no speed and its intermediates leave the
# caches (benchmarks/README.md, "CPU"); on a GPU each call costs a dispatch of the whole decoder, so calls take as
# many rows as the working memory holds.
CPU_PREFILL_ROWS = 512
GPU_ROWS, CPU_ROWS = 16, 4  # rows per step at most, where memory allows: a GPU step is bound by reading the
# weights, so rows ride along; a CPU step by arithmetic


def device_limit() -> int:
    """Bytes this process may use: MLX's memory limit, capped by Metal's recommended working set."""
    limit = mx.get_memory_limit()
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        limit = min(limit, mx.device_info().get("max_recommended_working_set_size", limit))
    return limit


def working_bytes(free: int, device: str) -> int:
    """Working memory out of `free` bytes on a "gpu" or "cpu" device: its base, on a GPU a share of the free memory
    where that is more, at most half of what is free (the KV cache gets the rest)."""
    want = BASE_WORKING[device]
    if device == "gpu":
        want = max(want, free // GPU_WORKING_SHARE)
    return max(MIN_WORKING, min(want, free // 2))


def peak_bytes(run) -> int:
    """Bytes above what is active now that evaluating `run()`'s outputs holds at its peak (MLX's high-water mark
    restarts here)."""
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(run())
    return mx.get_peak_memory() - base


def tower_bytes_per_patch(network: LocateAnything) -> int:
    """Peak bytes one patch costs a tower block, measured on `PROBE_PATCHES` patches (attention in single-row
    chunks where it falls back, so its scores do not count: `SCORE_BUDGET` bounds them apart)."""
    v = network.config.vision
    dtype = network.vision_model.patch_embed.proj.weight.dtype
    x = mx.zeros((1, PROBE_PATCHES, v.hidden_size), dtype)
    cos = mx.ones((1, PROBE_PATCHES, v.head_dim // 2))
    sin = mx.zeros((1, PROBE_PATCHES, v.head_dim // 2))
    mx.eval(x, cos, sin)
    held = peak_bytes(lambda: network.vision_model.encoder.blocks[0](x, cos, sin, score_budget=1))
    return max(1, held // PROBE_PATCHES)


def prefill_bytes_per_row(network: LocateAnything) -> int:
    """Peak bytes one prefill row holds while a call runs, measured on `PROBE_ROWS` rows of one sequence through
    the whole decoder, uncompiled (at least what the compiled call holds); its new K|V counts too."""
    t = network.config.text
    dtype = network.language_model.model.norm.weight.dtype
    x = mx.zeros((1, PROBE_ROWS, t.hidden_size), dtype)
    positions = mx.arange(PROBE_ROWS, dtype=mx.int32)
    mask = mx.tril(mx.ones((PROBE_ROWS, PROBE_ROWS), dtype=mx.bool_))
    mx.eval(x, positions, mask)

    def prefill():
        hidden, kv = network.language_model(x, positions, mask)
        return network.language_model.logits(hidden[:, -1:]), kv

    return max(1, peak_bytes(prefill) // PROBE_ROWS)


def prefill_bytes_per_key(network: LocateAnything) -> int:
    """What one prefill row holds per key it attends to, measured on a call's mask (`masks.step_mask`, made
    additive) and one layer's attention, for `PROBE_ROWS` rows at `PROBE_ROWS` keys and at `PROBE_KEYS` more:
    every score where the backend's attention falls back, little more than the mask where a fused kernel takes
    it. A call attends to its cache's capacity (`cache.kv_bucket` of its keys)."""
    t = network.config.text
    dtype = network.language_model.model.norm.weight.dtype
    rows = mx.array([PROBE_ROWS], mx.int32)

    def held(keys: int) -> int:
        q = mx.zeros((1, t.num_attention_heads, PROBE_ROWS, t.head_dim), dtype)
        k = mx.zeros((1, t.num_key_value_heads, keys, t.head_dim), dtype)
        first = mx.array([keys - PROBE_ROWS], mx.int32)
        mx.eval(q, k, first, rows)

        def call():
            mask = step_mask(first, rows, PROBE_ROWS, keys, mx.zeros((1,), mx.bool_))
            return attend(q, k, k, t.head_dim**-0.5, additive_mask(mask, dtype))

        return peak_bytes(call)

    grown = held(PROBE_ROWS + PROBE_KEYS) - held(PROBE_ROWS)
    return max(0, -(-grown // (PROBE_ROWS * PROBE_KEYS)))


def measure_probes(network: LocateAnything) -> dict[str, int]:
    """What the budget measures by running the network: a tower patch's and a prefill row's bytes."""
    return {
        "patch_bytes": tower_bytes_per_patch(network),
        "prefill_row_bytes": prefill_bytes_per_row(network),
        "prefill_key_bytes": prefill_bytes_per_key(network),
    }


def kv_bytes_per_slot(network: LocateAnything) -> int:
    t = network.config.text
    dtype = network.language_model.model.norm.weight.dtype
    return t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * dtype.size


@dataclass(frozen=True)
class Budget:
    """Bytes for the run's transient work and for its KV cache, and what each unit of work costs."""

    limit: int  # device_limit() when measured
    weights: int  # active memory with the model loaded
    working: int  # one tower group or one prefill call at a time
    kv: int  # every row's K|V plus the prompt prefixes kept ahead
    patch_bytes: int  # one patch through one tower block
    prefill_row_bytes: int  # one row of one prefill call (measured)
    prefill_key_bytes: int  # and per key it attends to, where attention falls back
    slot_bytes: int  # one cached token of one row
    prefill_cap: int | None  # rows per prefill call at most on this device (None: what the working memory holds)

    @classmethod
    def measure(cls, network: LocateAnything, probes: dict[str, int] | None = None) -> Budget:
        """The budget now; `probes` (`measure_probes`' result, kept by `tune.py`) skips running the probes."""
        limit = device_limit()
        params = sum(a.nbytes for _, a in tree_flatten(network.parameters()))
        weights = max(mx.get_active_memory(), params)  # weights still loading count as loaded
        free = max(0, limit - weights - RESERVE)
        device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        working = working_bytes(free, device)  # the tower runs, in pieces if need be
        return cls(
            limit=limit,
            weights=weights,
            working=working,
            kv=max(0, free - working),  # at least one row always runs (`Engine._fits`)
            **(probes or measure_probes(network)),
            slot_bytes=kv_bytes_per_slot(network),
            prefill_cap=CPU_PREFILL_ROWS if device == "cpu" else None,
        )

    @property
    def score_budget(self) -> int:
        """Bytes of attention scores one fallback call may hold."""
        return min(SCORE_BUDGET, self.working // 4)

    def tower_plan(self, images: int, patches: int, blocks: int) -> tuple[int, int]:
        """(images per tower call, blocks per evaluation) for `images` of `patches` each: as many images as
        one block of them fits the working memory, then as many blocks as fit."""
        room = max(1, self.working - self.score_budget)
        per_image_block = patches * self.patch_bytes
        batch = max(1, min(images, room // per_image_block))
        batch = -(-images // -(-images // batch))  # calls of even size: 8 + 8 rather than 13 + 3
        return batch, max(1, min(blocks, room // (batch * per_image_block)))

    def prefill_row_cost(self, keys: int) -> int:
        """Bytes the plan gives one prefill row attending to `keys` tokens: the probes' costs and `PROBE_MARGIN`."""
        return math.ceil(PROBE_MARGIN * (self.prefill_row_bytes + keys * self.prefill_key_bytes))

    def prefill_rows(self, bucket: int, keys: int, held: int = 0) -> int:
        """Rows one prefill call may take (sequences x padded rows) attending to at most `keys` cached tokens,
        beside `held` bytes the call holds whatever its rows: what the rest of the working memory holds, at most
        `prefill_cap`, in whole `bucket`s."""
        rows = max(0, self.working - held) // self.prefill_row_cost(keys)
        if self.prefill_cap is not None:
            rows = min(rows, self.prefill_cap)
        return max(bucket, rows // bucket * bucket)

    def kv_fits(self, buffer_rows: int, slots: int) -> bool:
        """Whether a KV cache of `buffer_rows` rows of `slots` cached tokens each fits the KV budget."""
        return buffer_rows * kv_bucket(slots) * self.slot_bytes <= self.kv

    def default_rows(self, longest_prompt: int) -> int:
        """Rows per step when the caller does not say: the device's cap, fewer where a cache of that many
        rows at `longest_prompt` tokens would not fit."""
        cap = GPU_ROWS if mx.default_device() == mx.gpu else CPU_ROWS
        rows = cap
        while rows > 1 and not self.kv_fits(rows + 1, longest_prompt):
            rows -= 1
        return rows
