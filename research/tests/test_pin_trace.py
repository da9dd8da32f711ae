"""research/pin_trace.py's bookkeeping: per-group block coverage with several block sizes, the first wrong output
token mapped back to the answer's prompt position and its decode step, and oracle pins (same count, ascending)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research"))
from pin_trace import Recorder, coverage, first_wrong  # noqa: E402

from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan  # noqa: E402


class CharTokenizer:
    """Token id t decodes to pieces[t]: as much of Tokenizer as pin_trace's text mapping uses."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[t] for t in ids)


def bare_recorder() -> Recorder:
    rec = Recorder.__new__(Recorder)  # no monkey-patching of the engine: only the bookkeeping is under test
    rec.pins, rec.steps, rec.oracle = {}, [], None
    return rec


def test_coverage_uses_each_groups_block_size() -> None:
    rec = bare_recorder()
    groups = [(0, 0, 16), (0, 1, 64), (1, 0, 32)]
    rec.pins = {0: [{3}, {0}], 1: [set()]}
    rec.steps = [{(0, 0): {3}, (0, 1): {0}, (1, 0): {1}}, {(0, 0): {3}, (0, 1): set(), (1, 0): {2}}]
    # position 50: block 3 at g=16, block 0 at g=64, block 1 at g=32
    pinned_in, read = coverage(rec, groups, 50)
    assert pinned_in == 2
    assert read == round(float(np.mean([1.0, 0.5, 0.5])), 3)
    # one step only: the second
    assert coverage(rec, groups, 50, [rec.steps[1]]) == (2, round(1 / 3, 3))


def test_first_wrong_maps_the_output_token_to_its_step_and_prompt_position() -> None:
    pieces = ["x", "ab", "-", "12", "34", "9", ": ", ".", "A", "B"]
    tok = CharTokenizer(pieces)
    prompt = [0] * 40 + [1, 2, 3, 4] + [0] * 20  # "ab-1234" at positions 40-43
    span = (40, 44)
    answer = "ab-1234"
    out = [6, 1, 2, 3, 5, 7]  # ": ab-129." : wrong at the '9' (answer char '3', prompt token 43 "34")
    rec = bare_recorder()
    groups = [(0, 0, 16), (0, 1, 8)]
    rec.pins = {0: [{2}, set()]}
    rec.steps = [{(0, 0): set(), (0, 1): set()} for _ in range(3)] + [{(0, 0): {2}, (0, 1): {4}}]
    rec.steps += [{(0, 0): set(), (0, 1): set()}]
    w = first_wrong(tok, rec, groups, prompt, span, answer, [pieces[t] for t in out])
    assert w is not None
    assert (w["output_token"], w["output_text"]) == (4, "9")
    assert (w["expected_at"], w["expected_text"]) == (3, "34")
    # output token 4 comes from decode step 3: position 43 is block 2 at g=16 (read, pinned), block 5 at g=8 (not)
    assert w["groups_pinned"] == 1 and w["share_of_groups_read"] == 0.5
    assert first_wrong(tok, rec, groups, prompt, span, answer, [": ", "ab", "-", "12", "34", "."]) is None
    assert first_wrong(tok, rec, groups, prompt, span, answer, [": ", "A", "B", "."])["output_token"] is None


def test_oracle_pins_put_the_answer_blocks_first_and_keep_the_count() -> None:
    plan = SparsePlan(sink=16, window=64, groups=[[GroupPlan(False, 16, 0.1), GroupPlan(False, 64, 0.1)]])
    rec = bare_recorder()
    rec.oracle = (plan, (100, 140))  # g=16: blocks 6-8; g=64: blocks 1-2
    pins = [np.array([1, 20, 30, 40], np.int32), np.array([5], np.int32)]
    got = rec._oracle_pins(0, pins)
    assert got[0].tolist() == [1, 6, 7, 8] and got[0].dtype == np.int32
    assert got[1].tolist() == [1]  # one pin: the answer's first block
    assert rec._oracle_pins(0, [np.array([], np.int32), np.array([], np.int32)])[0].tolist() == []
