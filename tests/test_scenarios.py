"""The reference generate() loop on scripted logits (tests/data/golden/decisions.json `scenarios`).

A stand-in `step` returns the scripted rows of each forward, so the loop's control flow (mode switches,
AR classification, stops, the length-cap overshoot) is checked against the reference step by step.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import GOLDEN, golden_token_ids

from mlx_locate.decide import Mode
from mlx_locate.row_decoder import DecodeOptions, decode

DECISIONS = json.loads((GOLDEN / "decisions.json").read_text())
SCENARIOS = {s["name"]: s for s in DECISIONS["scenarios"]}


@pytest.fixture(scope="module")
def ids():
    return golden_token_ids()


def rows_to_logits(rows: list[dict]) -> mx.array:
    out = np.empty((len(rows), DECISIONS["vocab_size"]), dtype=np.float32)
    for i, row in enumerate(rows):
        out[i] = row["base"]
        for token, value in row["peaks"]:
            out[i, token] = value
    return mx.array(out)


class ScriptedModel:
    """Returns the scripted rows of each forward and records (kind, kv_len) as the reference reports them."""

    def __init__(self, scenario: dict):
        self.script = list(scenario["script"])
        self.filler = scenario["stop_filler"]
        self.cached = len(scenario["prompt_ids"])
        self.calls = []

    def next_rows(self, kind: str) -> mx.array:
        if self.script:
            entry = self.script.pop(0)
            assert entry["kind"] == kind, f"loop ran a {kind} step where the reference ran {entry['kind']}"
            return rows_to_logits(entry["rows"])
        return rows_to_logits(self.filler[kind])

    def first_logits(self, mode: Mode) -> mx.array:
        return self.next_rows("ar") if mode is Mode.SLOW else mx.zeros((1, DECISIONS["vocab_size"]))

    def step(self, ids: list[int], block: bool) -> mx.array:
        kind = "mtp" if block else "ar"
        self.calls.append((kind, self.cached + len(ids)))
        self.cached += len(ids) - 6 if block else len(ids)
        return self.next_rows(kind)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(ids, name):
    scenario = SCENARIOS[name]
    mode = Mode(scenario["mode"])
    model = ScriptedModel(scenario)
    first = model.first_logits(mode)
    options = DecodeOptions(mode=mode, max_new_tokens=scenario["max_new_tokens"], strict=True)
    out = decode(model.step, scenario["prompt_ids"], first, ids, options)
    assert out.tokens == scenario["generated_ids"]
    # The reference's kv length per forward (past_len + q_len); slow mode's first forward is our prefill.
    expected = [(s["kind"], s["past_len"] + s["q_len"]) for s in scenario["steps"]]
    if mode is Mode.SLOW:
        expected = expected[1:]
    assert model.calls == expected
    assert not model.script, "the reference ran more forwards than the loop"


def test_length_cap_overshoot_is_not_truncated(ids):
    scenario = SCENARIOS["fast_length_cap_overshoot"]
    model = ScriptedModel(scenario)
    out = decode(model.step, scenario["prompt_ids"], None, ids, DecodeOptions(mode=Mode.FAST, max_new_tokens=4))
    assert len(out.tokens) == 6 > scenario["max_new_tokens"]
    assert out.stats.stop_reason.value == "length_cap"
