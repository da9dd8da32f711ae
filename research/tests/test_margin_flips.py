"""research/margin_flips.py: the escalation bookkeeping on hand-worked cases, and its answer loop on the real
smollm2-135m (a forced pass along the greedy answer reproduces it; a sparse mode's flips are exactly its argmax leaving
it)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

from margin_flips import answer_steps, summarise  # noqa: E402


def _sample(margins: list[float], flips: list[bool]) -> dict[str, Any]:
    return {"sparse_margin": margins, "flip": flips}


def test_summarise_counts_escalations_and_rescues_by_hand() -> None:
    # token 0 (the prefill's) is left out: its margin 0.0 and flip must not count
    a = _sample([0.0, 0.3, 5.0, 0.8, 4.0], [True, True, False, False, False])  # one flip at margin 0.3
    b = _sample([9.0, 2.5, 0.1, 6.0], [False, True, False, True])  # flips at margins 2.5 and 6.0
    c = _sample([1.0, 7.0, 7.0], [False, False, False])  # never flips
    row = summarise([a, b, c], (0.5, 1.0, 3.0, 10.0))
    assert row["samples"] == 3 and row["decode_steps"] == 4 + 3 + 2 and row["flips"] == 3
    assert row["samples_flipped"] == 2
    by = row["by_threshold"]
    # steps below t among the 9 decode steps: margins 0.3, 5.0, 0.8, 4.0, 2.5, 0.1, 6.0, 7.0, 7.0
    assert by["0.5"] == {"escalated_share": 2 / 9, "flips_caught": 1, "samples_rescued": 1}
    assert by["1.0"] == {"escalated_share": 3 / 9, "flips_caught": 1, "samples_rescued": 1}
    assert by["3.0"] == {"escalated_share": 4 / 9, "flips_caught": 2, "samples_rescued": 1}  # b's 6.0 still missed
    assert by["10.0"] == {"escalated_share": 1.0, "flips_caught": 3, "samples_rescued": 2}


def test_summarise_counts_samples_a_larger_plan_brings_back() -> None:
    # a: one flip at margin 0.3, where the larger plan agrees with full -> follows from t = 0.5 on
    a = _sample([0.0, 0.3, 5.0], [True, True, False]) | {"escalated": {"x2": [True, True, True]}}
    # b: a flip at margin 0.4 the larger plan gets wrong too -> never follows
    b = _sample([1.0, 0.4, 6.0], [False, True, False]) | {"escalated": {"x2": [True, False, True]}}
    # c: the larger plan fixes the flip at 2.5 but gets the right step at 0.9 wrong, and a t that catches the flip
    # escalates that step too -> never follows; d: follows once t > 2.5 (no other step below)
    c = _sample([1.0, 2.5, 0.9], [False, True, False]) | {"escalated": {"x2": [True, True, False]}}
    d = _sample([1.0, 2.5, 7.0], [False, True, False]) | {"escalated": {"x2": [True, True, True]}}
    by = summarise([a, b, c, d], (0.25, 0.5, 3.0))["by_threshold"]
    assert [by[t]["samples_following_with_x2"] for t in ("0.25", "0.5", "3.0")] == [0, 1, 2]
    assert [by[t]["samples_rescued"] for t in ("0.25", "0.5", "3.0")] == [0, 2, 4]  # escalation to full


def test_summarise_end_shift_is_the_mean_log_odds_difference_over_decode_steps() -> None:
    # p(end) full 0.5 / 0.2 / 0.1, sparse 0.5 / 0.5 / 0.1 at the decode steps (token 0 left out)
    a = _sample([0.0, 1.0, 1.0, 1.0], [False] * 4) | {
        "full_end_logp": np.log([0.9, 0.5, 0.2, 0.1]).tolist(), "sparse_end_logp": np.log([0.1, 0.5, 0.5, 0.1]).tolist()}
    row = summarise([a], (1.0,))
    want = np.mean([0.0, np.log(0.5 / 0.5) - np.log(0.2 / 0.8), 0.0])  # token 0's 0.9 vs 0.1 must not count
    assert row["end_log_odds_shift_mean"] == pytest.approx(want)
    assert "end_log_odds_shift_mean" not in summarise([_sample([0.0, 1.0], [False, False])], (1.0,))


def test_summarise_random_cases_against_a_direct_count() -> None:
    gen = np.random.default_rng(7)
    samples = []
    for _ in range(12):
        n = int(gen.integers(2, 30))
        samples.append(_sample(gen.exponential(2.0, n).tolist(), (gen.random(n) < 0.2).tolist()))
    for t in (0.25, 1.0, 4.0):
        got = summarise(samples, (t,))["by_threshold"][str(t)]
        steps = [(m, f) for s in samples for m, f in zip(s["sparse_margin"][1:], s["flip"][1:])]
        assert got["escalated_share"] == pytest.approx(sum(m < t for m, _ in steps) / len(steps))
        assert got["flips_caught"] == sum(f and m < t for m, f in steps)
        rescued = sum(1 for s in samples if any(s["flip"][1:])
                      and all(m < t for m, f in zip(s["sparse_margin"][1:], s["flip"][1:]) if f))
        assert got["samples_rescued"] == rescued


@pytest.mark.slow
def test_answer_steps_forced_along_greedy_reproduces_it_on_smollm2() -> None:
    from fluxion_lite.engine.engine import Engine

    engine = Engine("smollm2-135m", attention="full", max_context=512, prefix_cache_entries=0)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(100, 20000, (150,), generator=gen).tolist()
    eog: set[int] = set()
    with torch.no_grad():
        greedy = answer_steps(engine.model, engine.attn, prompt, 12, eog, chunk=64)
        forced = answer_steps(engine.model, engine.attn, prompt, 12, eog, forced=greedy["taken"], chunk=64)
        engine.set_attention("fluxion")  # smollm2's shipped plan: decode steps read a part of the 150 tokens
        sparse = answer_steps(engine.model, engine.attn, prompt, 12, eog, forced=greedy["taken"], chunk=64)
    assert len(greedy["taken"]) == 12 and greedy["taken"] == greedy["argmax"]
    assert forced["taken"] == greedy["taken"] and forced["argmax"] == greedy["taken"]
    np.testing.assert_allclose(forced["top1"], greedy["top1"], atol=1e-5)
    assert all(a >= b for a, b in zip(greedy["top1"], greedy["top2"]))
    assert sparse["taken"] == greedy["taken"]  # forced: the sparse run follows full's answer whatever it predicts
    assert sparse["argmax"][0] == greedy["taken"][0]  # token 0 comes from the dense prefill in both modes
    assert greedy["end_logp"] == [float("-inf")] * 12  # no end-of-generation token given: ending is impossible
    end_id = next(t for t in range(engine.config.vocab_size - 1, 0, -1) if t not in greedy["taken"])
    with torch.no_grad():
        engine.set_attention("full")
        ends = answer_steps(engine.model, engine.attn, prompt, 12, {end_id}, forced=greedy["taken"], chunk=64)
    assert ends["taken"] == greedy["taken"] and len(ends["end_logp"]) == 12
    assert all(-80.0 < e < 0.0 for e in ends["end_logp"])  # log P(end_id) at every step, a real probability


@pytest.mark.parametrize("spec,want", [("16:0.05", (16, 0.05, None, "mean")), ("32:0.1:128", (32, 0.1, 128, "mean")),
                                       ("16:0.05:4096:oracle", (16, 0.05, 4096, "oracle"))])
def test_parse_simulate(spec: str, want: tuple) -> None:
    from margin_flips import parse_simulate

    assert parse_simulate(spec) == want


@pytest.mark.parametrize("spec", ["16", "16:0", "16:1.5", "0:0.05", "16:0.05:0", "a:b", "16:0.05:64:1",
                                  "16:0.05:64:mean:1"])
def test_parse_simulate_rejects_bad_specs(spec: str) -> None:
    from margin_flips import parse_simulate

    with pytest.raises(SystemExit, match="--simulate"):
        parse_simulate(spec)


@pytest.mark.slow
def test_simulated_topk_reading_everything_follows_full_on_smollm2() -> None:
    """--simulate's backend at budget 1 reads every block: teacher-forced along full's greedy answer it predicts it."""
    from background_fidelity import SimulatedTopK

    from fluxion_lite.model.attention import DenseAttention
    from fluxion_lite.engine.engine import Engine

    engine = Engine("smollm2-135m", attention="full", dtype="float32", max_context=512, prefix_cache_entries=0)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 20000, (200,), generator=gen).tolist()
    with torch.no_grad():
        greedy = answer_steps(engine.model, engine.attn, prompt, 10, set(), chunk=64)
        assert isinstance(engine.attn, DenseAttention)
        sim = SimulatedTopK(engine.attn, 16, 1.0, 4, 16, None)
        got = answer_steps(engine.model, sim, prompt, 10, set(), forced=greedy["taken"], chunk=64)
        narrow = SimulatedTopK(engine.attn, 16, 0.05, 4, 16, 64)  # the background term runs too
        small = answer_steps(engine.model, narrow, prompt, 10, set(), forced=greedy["taken"], chunk=64)
    assert got["argmax"] == greedy["taken"]
    np.testing.assert_allclose(got["top1"], greedy["top1"], atol=1e-3)
    assert min(sim.read) == pytest.approx(1.0) and max(narrow.read) < 1.0 and len(small["argmax"]) == 10


def test_full_answers_from_reads_an_earlier_run_and_names_mismatches(tmp_path) -> None:
    import argparse
    import json

    from margin_flips import full_answers_from

    rec = {"task": "cwe", "index": 1, "answer": [5, 6, 7], "full_margin": [1.0, 2.0, 0.5],
           "full_end_logp": [-9.0, -8.0, -0.1]}
    old = {"gguf": "qwen2.5-coder-0.5b", "length": 4096, "device": "cpu", "dtype": "bfloat16", "samples": {"cwe": [rec]}}
    path = tmp_path / "mf.json"
    path.write_text(json.dumps(old))
    meta = {"samples": [{"task": "cwe", "index": 0}, {"task": "cwe", "index": 1}]}
    args = argparse.Namespace(gguf="qwen2.5-coder-0.5b", length=4096, device="cpu", dtype="bfloat16")
    got = full_answers_from(path, meta, [1], args)
    assert got == {1: {"taken": [5, 6, 7], "margin": [1.0, 2.0, 0.5], "end_logp": [-9.0, -8.0, -0.1]}}
    with pytest.raises(SystemExit, match="no cwe #0"):
        full_answers_from(path, meta, [0, 1], args)
    with pytest.raises(SystemExit, match="its length is 4096"):
        full_answers_from(path, meta, [1], argparse.Namespace(**{**vars(args), "length": 8192}))
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="not a margin_flips result"):
        full_answers_from(path, meta, [1], args)


def test_picked_samples_takes_the_first_per_task_of_each_task_and_names_an_empty_pick() -> None:
    from ruler_split import picked_samples

    samples = [{"task": t, "index": i} for t in ("cwe", "vt", "qa_1") for i in range(4)]
    meta = {"length": 4096, "samples": samples}
    assert picked_samples(meta, ["vt", "cwe"], 2, "m") == [0, 1, 4, 5]
    assert picked_samples(meta, None, 1, "m") == [0, 4, 8]
    with pytest.raises(SystemExit, match="no sample of \\['fwe'\\] among m's exported samples at 4096"):
        picked_samples(meta, ["fwe"], 3, "m")
