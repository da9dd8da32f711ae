"""research/end_path.py: the path bookkeeping on hand-worked cases, and its loop on the real smollm2-135m (along full's
own greedy answer, cut where a chosen token stands for the end, full ends there too and never leaves the path)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

from end_path import describe, ended_path, path_record, pick_paths, summarise  # noqa: E402


def test_ended_path_cuts_at_the_first_end_and_skips_answers_that_run_out() -> None:
    assert ended_path([5, 6, 9, 7, 9], {9, 10}) == [5, 6, 9]
    assert ended_path([10], {9, 10}) == [10]
    assert ended_path([5, 6, 7], {9}) is None


def _steps(argmax: list[int], top1: list[float], top2: list[float], end: list[float]) -> dict[str, list]:
    return {"argmax": argmax, "top1": top1, "top2": top2, "end_logp": end, "taken": []}


def test_path_record_and_summary_by_hand() -> None:
    eog = {0}
    # a: full takes another token at step 1 (margin 0.5) and ends where the answer ends
    full_a = _steps([4, 8, 6, 0], [-0.1, -0.4, -0.2, -0.05], [-3.0, -0.9, -2.0, -4.0],
                    np.log([1e-3, 0.01, 0.02, 0.9]).tolist())
    sparse_a = _steps([4, 5, 6, 0], [0.0] * 4, [-1.0] * 4, np.log([1e-3, 0.01, 0.05, 0.95]).tolist())
    a = path_record([4, 5, 6, 0], full_a, sparse_a, eog)
    assert a["leaves"] == [1] and a["full_ends_too"] and a["full_margin"][1] == pytest.approx(0.5)
    # b: follows full's path all along, but full would go on (token 7) where the answer ends
    full_b = _steps([3, 7], [-0.2, -0.3], [-2.0, -1.5], np.log([1e-4, 0.2]).tolist())
    b = path_record([3, 0], full_b, _steps([3, 0], [0.0, 0.0], [-1.0, -1.0], np.log([1e-4, 0.7]).tolist()), eog)
    assert b["leaves"] == [] and not b["full_ends_too"]
    got = summarise([a, b])
    assert got == {"samples": 2, "full_ends_too": 1, "full_end_prob_mean": pytest.approx((0.9 + 0.2) / 2),
                   "sparse_end_prob_mean": pytest.approx((0.95 + 0.7) / 2), "left_full_path_before_end": 1}
    assert summarise([]) == {"samples": 0}
    lines = describe(a | {"task": "cwe", "index": 3}, lambda ids: f"<{ids[0]}>")
    assert lines.startswith("cwe#3: 4 tokens; at its end full's P(end) 0.900 (argmax '<end>', margin 3.95)")
    assert "left full's path at step 1 ('<5>' where full had '<8>', full margin 0.50; 1 steps in all)" in lines


def test_pick_paths_takes_the_first_ended_answers_of_each_task() -> None:
    meta = {"samples": [{"task": t} for t in ("a", "a", "b", "a", "b")]}
    run = {"answered": [0, 1, 2, 3, 4], "outputs": [[5, 0, 7], [5, 6], [9, 0], [4, 0], [8, 8, 0]]}
    # sample 1 never ends; per task at most one
    assert pick_paths(run, meta, {0}, None, 1) == {0: [5, 0], 2: [9, 0]}
    assert pick_paths(run, meta, {0}, ["a"], 5) == {0: [5, 0], 3: [4, 0]}


@pytest.mark.slow
def test_full_ends_along_its_own_answer_on_smollm2() -> None:
    from margin_flips import answer_steps

    from fluxion_lite.engine.engine import Engine

    engine = Engine("smollm2-135m", attention="full", max_context=512, prefix_cache_entries=0)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, 20000, (160,), generator=gen).tolist()
    with torch.no_grad():
        greedy = answer_steps(engine.model, engine.attn, prompt, 12, set(), chunk=64)["taken"]
        # the first token greedy does not take before: standing in for the end, it ends the answer right there
        cut = next(j for j in range(3, 12) if greedy[j] not in greedy[:j])
        end_id, path = greedy[cut], greedy[: cut + 1]
        full = answer_steps(engine.model, engine.attn, prompt, len(path), {end_id}, forced=path, chunk=64)
        engine.set_attention("fluxion")
        sparse = answer_steps(engine.model, engine.attn, prompt, len(path), {end_id}, forced=path, chunk=64)
    rec = path_record(path, full, sparse, {end_id})
    assert rec["leaves"] == [] and rec["full_ends_too"]
    assert len(rec["sparse_end_logp"]) == len(path) and all(e <= 0.0 for e in rec["sparse_end_logp"])
    assert rec["full_end_logp"][-1] == pytest.approx(full["top1"][-1])  # the end token is full's argmax there
