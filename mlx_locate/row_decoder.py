"""The generation rules of one sequence (docs/model.md §10): slow (AR), fast and hybrid (block steps).

`RowDecoder` is one sequence's state: which step it needs next (`feed`), and the rules that commit tokens from
that step's summary (`take_block`, `take_ar`). The engine runs many of them per forward step with one host read
for the whole batch; `decode` drives one of them over a caller's `step(ids, block) -> logits` function (tests
feed scripted logits; the converter's report feeds two models in lockstep).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .decide import (
    Guards,
    Mode,
    Next,
    StopReason,
    Thresholds,
    classify_ar,
    decide_block,
    loop_guard_trips,
)
from .label_trie import OUTSIDE, LabelTrie
from .masks import BLOCK
from .sampling import Features, RowSampling, Sampling, label_mask, read_token, summary_functions
from .tokens import TokenIds

StepFn = Callable[[list[int], bool], mx.array]


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
    labels: LabelTrie | None = None  # the asked names labels are held to, unless the guards say not

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")

    @property
    def guards_in_force(self) -> Guards:
        """`guards`, or none of them (`Guards.STRICT`) when strict."""
        return Guards.STRICT if self.strict else self.guards

    @property
    def held_labels(self) -> LabelTrie | None:
        """The asked names labels are held to: `labels`, unless the guards in force say not."""
        return self.labels if self.guards_in_force.label_constraint else None


@dataclass
class DecodeStats:
    block_steps: int = 0
    ar_steps: int = 0
    fallbacks: int = 0  # hybrid switches from block steps to AR (error boxes)
    label_redecodes: int = 0  # hybrid text fix: labels handed to AR
    host_reads: int = 0  # reads of step summaries this sequence took part in (one per step)
    stop_reason: StopReason = StopReason.LENGTH_CAP
    first_step_s: float | None = None  # from `begin` to the first commit
    first_box_s: float | None = None  # from `begin` to the first committed box end
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


def completed_box(seq: list[int], ids: TokenIds) -> tuple[int, ...] | None:
    """The box that `seq` ends with, as 4 normalized ints, if it ends with one."""
    tail = seq[-BLOCK:]
    if len(tail) == BLOCK and tail[0] == ids.box_start and tail[-1] == ids.box_end:
        coords = tail[1:-1]
        if all(ids.is_coord(t) for t in coords):
            return tuple(ids.coord_value(t) for t in coords)
    return None


class RowDecoder:
    """One sequence after its prompt is prefilled: `cached` of its `seq` ids have their K|V in the cache."""

    def __init__(self, prompt_ids: list[int], ids: TokenIds, options: DecodeOptions, max_length: int | None = None):
        self.ids, self.options = ids, options
        self.guards = options.guards_in_force
        self.seq, self.probs = list(prompt_ids), []
        self.prompt_len = len(prompt_ids)
        self.cap = len(self.seq) + options.max_new_tokens
        if max_length is not None:
            self.cap = min(self.cap, max_length)
        self.cached = len(self.seq)
        self.next = Next.AR if options.mode is Mode.SLOW else Next.BLOCK
        self.label_redecode = False
        self.labels = options.held_labels
        self.label_state = OUTSIDE  # inside a label: the trie node it has spelled (docs/model.md §10.8)
        self.boxes: list[tuple[int, ...]] = []
        self.stats = DecodeStats()
        self.done = len(self.seq) >= self.cap
        self.start = time.perf_counter()

    def begin(self, prompt_logits: mx.array) -> mx.array | None:
        """Start the clock of first_step_s, first_box_s and decode_s. `prompt_logits` (1, V) are the prefilled
        prompt's last row: returned when the first step is an AR step (slow mode), which decides from them, else
        None (a block step feeds the last prompt token as its anchor)."""
        self.start = time.perf_counter()
        return prompt_logits if self.next is Next.AR else None

    def key(self) -> tuple[int, int]:
        """This step's sampling key: the seed and the step's index, so a draw depends on this sequence only."""
        return self.options.seed & 0xFFFFFFFF, self.stats.steps

    def feed(self) -> list[int]:
        """The ids of this sequence's next forward: its uncached tail, plus anchor and masks for a block."""
        tail = self.seq[self.cached :]
        if self.next is Next.BLOCK:
            return tail + [self.seq[-1]] + [self.ids.text_mask] * (BLOCK - 1)
        return tail

    def label_allowed(self) -> tuple[int, ...] | None:
        """The ids the next token may be while inside a label held to the asked names, else None."""
        if self.labels is None or self.label_state == OUTSIDE:
            return None
        return self.labels.allowed(self.label_state)

    def fed(self) -> None:
        """The forward of `feed()` was issued: the committed ids are cached; a block's window is not."""
        self.cached = len(self.seq)

    def take_block(self, summary: np.ndarray) -> list[int]:
        """Commit from this sequence's block summary (BLOCK_SUMMARY_SIZE floats); returns the committed ids."""
        o = self.options
        d = decide_block(
            summary, o.mode, self.ids, o.thresholds, self.guards, o.redecode_labels, self.labels, self.label_state
        )
        s = self.stats
        s.block_steps += 1
        s.sources[d.source.value] = s.sources.get(d.source.value, 0) + 1
        self.label_redecode = d.label_redecode
        s.label_redecodes += d.label_redecode
        s.fallbacks += d.next is Next.AR and not d.label_redecode
        return self._commit(d.tokens, d.probs, d.next, d.stop_reason)

    def take_ar(self, token: int, p: float) -> list[int]:
        """Commit one AR token (docs/model.md §10.5); returns the committed ids."""
        self.stats.ar_steps += 1
        nxt = classify_ar(token, self.options.mode, self.ids, self.label_redecode)
        stop = StopReason.IM_END if token == self.ids.im_end else StopReason.HYBRID_AR_STOP
        return self._commit([token], [p], nxt, stop)

    def _commit(self, new: list[int], probs: list[float], nxt: Next, stop: StopReason | None) -> list[int]:
        s = self.stats
        s.host_reads += 1
        if self.labels is not None:  # a box the loop guard takes back below lies outside any label
            self.label_state = self.labels.walk(self.label_state, new)
        self.seq += new
        self.probs += probs
        now = time.perf_counter() - self.start
        if s.first_step_s is None:
            s.first_step_s = now
        box = completed_box(self.seq, self.ids) if new and new[-1] == self.ids.box_end else None
        if box is not None:
            if s.first_box_s is None:
                s.first_box_s = now
            if self.guards.loop_guard and self.boxes and loop_guard_trips(self.boxes[-1], box):
                del self.seq[-BLOCK:], self.probs[-BLOCK:]
                return self._finish(StopReason.LOOP_GUARD, new[:-BLOCK])
            self.boxes.append(box)
        if nxt is Next.STOP:
            return self._finish(stop, new)
        self.next = nxt
        if len(self.seq) >= self.cap:
            return self._finish(StopReason.LENGTH_CAP, new)
        return new

    def _finish(self, reason: StopReason, committed: list[int]) -> list[int]:
        self.done = True
        self.stats.stop_reason = reason
        self.stats.decode_s = time.perf_counter() - self.start
        return committed

    def result(self) -> DecodeResult:
        return DecodeResult(tokens=self.seq[self.prompt_len :], probs=self.probs, stats=self.stats)


def decode(
    step: StepFn,
    prompt_ids: list[int],
    first_logits: mx.array,
    ids: TokenIds,
    options: DecodeOptions,
    max_length: int | None = None,
) -> DecodeResult:
    """Generate after a prefilled prompt, one sequence. `first_logits` (1, V) is the prompt's last row (used by
    slow mode); `step(ids, block)` feeds the uncached committed ids (plus anchor and masks for a block) and
    returns the 1 or 6 logit rows. `max_length` is the tokenizer's model_max_length."""
    row = RowDecoder(prompt_ids, ids, options, max_length)
    s = options.sampling
    features = Features.of([s])
    rs = RowSampling.of([s])
    seen = mx.zeros((1, ids.vocab_size), dtype=mx.bool_)
    if features.penalty:
        seen[0, mx.array(row.seq)] = True
    pending = row.begin(first_logits)
    not_ar = mx.array([False])
    while not row.done:
        keys = mx.array([row.key()], dtype=mx.uint32)
        block = row.next is Next.BLOCK
        floor = [options.thresholds.label_mass]
        held = label_mask([row.label_allowed()], [not block], floor, BLOCK if block else 1, ids.vocab_size)
        block_fn, ar_fn = summary_functions(features._replace(labels=held is not None), ids)
        if block:
            logits = step(row.feed(), True)
            row.fed()
            new = row.take_block(np.array(block_fn(logits[None], seen, keys, rs, not_ar, held))[0])
        else:
            logits = pending if pending is not None else step(row.feed(), False)
            pending = None
            row.fed()
            new = row.take_ar(*read_token(np.array(ar_fn(logits.reshape(1, 1, -1), seen, keys, rs, held))[0], False))
        if features.penalty and new:
            seen[0, mx.array(new)] = True
    return row.result()
