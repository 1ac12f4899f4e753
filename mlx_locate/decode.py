"""The generation loop (MODEL.md §10): slow (AR), fast and hybrid (block steps), one host read per step.

`decode` only needs a `step(ids, block) -> logits` function, so tests can drive it with scripted logits.
Each step's logits go through one compiled summary function and are read back once; the rules in
`decide.py` then run on that small array in plain Python.

Given `retract`, an AR step also queues the next AR step before its read, fed the token it is picking (still
on the device), so the device runs that step while the host reads and decides. When the decision is to stop
or to switch to blocks, the queued step is dropped (`retract(1)` uncaches its token); its result is never read.
Block steps queue nothing: their committed tokens are often not the device's picks (§10.4 D_ref, D_box), so a
step queued on the picks would mostly be wasted and delay the one the host then asks for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from .decide import Guards, Mode, Next, StopReason, Thresholds, classify_ar, decide_block, loop_guard_trips
from .masks import BLOCK
from .sampling import Sampling, ar_summary, block_summary, mark_seen
from .tokens import TokenIds

StepFn = Callable[[list[int] | mx.array, bool], mx.array]


@dataclass(frozen=True)
class DecodeOptions:
    mode: Mode = Mode.HYBRID
    max_new_tokens: int = 512  # the loop runs while fewer were generated; a block may overshoot by 5
    sampling: Sampling = Sampling()  # greedy; Sampling.OFFICIAL is the model card's setting
    strict: bool = False  # the reference's decisions exactly: no guards
    guards: Guards = Guards()  # ignored when strict
    thresholds: Thresholds = Thresholds()
    redecode_labels: bool = False  # hybrid: re-decode uncertain label tokens autoregressively
    seed: int = 0  # for sampling

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(m.value for m in Mode)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


@dataclass
class DecodeStats:
    block_steps: int = 0
    ar_steps: int = 0
    fallbacks: int = 0  # hybrid switches from block steps to AR (error boxes)
    label_redecodes: int = 0  # hybrid text fix: labels handed to AR
    host_reads: int = 0
    stop_reason: StopReason = StopReason.LENGTH_CAP
    first_step_s: float | None = None  # from the loop's start to the first commit
    first_box_s: float | None = None  # from the loop's start to the first committed box end
    decode_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # block decisions by source

    @property
    def steps(self) -> int:
        return self.block_steps + self.ar_steps


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids
    probs: list[float]  # the decoder's probability of each generated id
    stats: DecodeStats


@lru_cache(maxsize=32)
def summary_functions(sampling: Sampling, ids: TokenIds):
    return (
        mx.compile(partial(block_summary, s=sampling, ids=ids)),
        mx.compile(partial(ar_summary, s=sampling)),
    )


def completed_box(seq: list[int], ids: TokenIds) -> tuple[int, ...] | None:
    """The box that `seq` ends with, as 4 normalized ints, if it ends with one."""
    tail = seq[-BLOCK:]
    if len(tail) == BLOCK and tail[0] == ids.box_start and tail[-1] == ids.box_end:
        coords = tail[1:-1]
        if all(ids.is_coord(t) for t in coords):
            return tuple(ids.coord_value(t) for t in coords)
    return None


def decode(
    step: StepFn,
    prompt_ids: list[int],
    first_logits: mx.array,
    ids: TokenIds,
    options: DecodeOptions,
    max_length: int | None = None,
    retract: Callable[[int], None] | None = None,
) -> DecodeResult:
    """Generate after a prefilled prompt. `first_logits` (1, V) is the prompt's last row (used by slow mode);
    `step(ids, block)` feeds the uncached committed ids (plus anchor and masks for a block) and returns the
    1 or 6 logit rows. `max_length` is the tokenizer's model_max_length. `retract(n)` uncaches the last n
    tokens fed; with it AR steps are queued ahead (see above)."""
    mode, s = options.mode, options.sampling
    guards = Guards.STRICT if options.strict else options.guards
    block_fn, ar_fn = summary_functions(s, ids)
    seq, probs = list(prompt_ids), []
    cap = len(seq) + options.max_new_tokens
    if max_length is not None:
        cap = min(cap, max_length)
    cached = len(seq)
    seen = mx.zeros((ids.vocab_size,), dtype=mx.bool_)
    penalize = s.repetition_penalty != 1.0
    if penalize:
        seen = mark_seen(seen, seq)
    key = mx.random.key(options.seed)
    sampled = s.temperature > 0
    stats = DecodeStats()
    boxes: list[tuple[int, ...]] = []
    state = Next.AR if mode is Mode.SLOW else Next.BLOCK
    label_redecode = False
    pending = first_logits if mode is Mode.SLOW else None  # the next AR step's row; slow mode's first: the prefill's
    ahead = None  # an AR step queued before the read, fed the token being picked
    start = time.perf_counter()

    while len(seq) < cap:
        key, sub = mx.random.split(key) if sampled else (key, key)
        if state is Next.BLOCK:
            rows = step(seq[cached:] + [seq[-1]] + [ids.text_mask] * (BLOCK - 1), True)
            cached = len(seq)
            decision = decide_block(
                np.array(block_fn(rows, seen, sub)), mode, ids, options.thresholds, guards, options.redecode_labels
            )
            stats.host_reads += 1
            stats.block_steps += 1
            stats.sources[decision.source.value] = stats.sources.get(decision.source.value, 0) + 1
            new, new_probs, nxt = decision.tokens, decision.probs, decision.next
            label_redecode = decision.label_redecode
            stats.label_redecodes += label_redecode
            stats.fallbacks += nxt is Next.AR and not label_redecode
            stop_reason = decision.stop_reason
        else:
            row = pending if pending is not None else step(seq[cached:], False)
            pending, cached = None, len(seq)
            summary = ar_fn(row, seen, sub)
            if retract is not None and len(seq) + 1 < cap:
                ahead = step(summary[0], False)  # the next AR step, fed the token being picked
                mx.async_eval(ahead)
            token, p = np.array(summary).tolist()
            stats.host_reads += 1
            stats.ar_steps += 1
            new, new_probs = [int(token)], [p]
            nxt = classify_ar(new[0], mode, ids, label_redecode)
            stop_reason = StopReason.IM_END if new[0] == ids.im_end else StopReason.HYBRID_AR_STOP
        seq += new
        probs += new_probs
        if ahead is not None:
            if nxt is Next.AR:
                pending, cached = ahead, len(seq)  # it was fed exactly the token committed
            else:
                retract(1)
            ahead = None
        if stats.first_step_s is None:
            stats.first_step_s = time.perf_counter() - start
        if penalize:
            seen = mark_seen(seen, new)
        box = completed_box(seq, ids) if new and new[-1] == ids.box_end else None
        if box is not None:
            if stats.first_box_s is None:
                stats.first_box_s = time.perf_counter() - start
            if guards.loop_guard and boxes and loop_guard_trips(boxes[-1], box):
                del seq[-BLOCK:], probs[-BLOCK:]
                stats.stop_reason = StopReason.LOOP_GUARD
                break
            boxes.append(box)
        if nxt is Next.STOP:
            stats.stop_reason = stop_reason
            break
        state = nxt
    stats.decode_s = time.perf_counter() - start
    generated = len(prompt_ids)
    return DecodeResult(tokens=seq[generated:], probs=probs, stats=stats)
