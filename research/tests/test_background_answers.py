"""research/background_answers.py: a plan's simulated selection (pins, top-k, background term) as a decode backend."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

from background_answers import PlanSimulated, parse_background  # noqa: E402
from margin_flips import answer_steps  # noqa: E402

from fluxion_lite.model.attention import DenseAttention  # noqa: E402
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan  # noqa: E402


@pytest.mark.parametrize("spec,want", [("none", (None, "mean", "unread")), ("128:oracle", (128, "oracle", "unread")),
                                       ("64:minmax", (64, "minmax", "unread")),
                                       ("128:midrange", (128, "midrange", "unread")),
                                       ("128:midrange:block", (128, "midrange", "block"))])
def test_parse_background(spec: str, want: tuple) -> None:
    assert parse_background(spec) == want


@pytest.mark.parametrize("spec", ["128", "0:mean", "x:mean", "128:median", "128:mean:1", "128:mean:block:x"])
def test_parse_background_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(SystemExit, match="--background"):
        parse_background(spec)


def _plan(n_layers: int, n_groups: int, budget: float) -> SparsePlan:
    groups = [[GroupPlan(h == 1 and layer % 2 == 0, 16, budget) for h in range(n_groups)] for layer in range(n_layers)]
    return SparsePlan(sink=4, window=16, groups=groups, pin_fraction=0.5, obs_window=8, pin_span=2)


@pytest.mark.slow
def test_plan_simulated_follows_dense_when_it_reads_everything_and_reads_less_otherwise() -> None:
    from fluxion_lite.engine.engine import Engine

    engine = Engine("smollm2-135m", attention="full", dtype="float32", max_context=512, prefix_cache_entries=0)
    cfg = engine.config
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, 20000, (300,), generator=gen).tolist()
    with torch.no_grad():
        greedy = answer_steps(engine.model, engine.attn, prompt, 10, set(), chunk=128)
        assert isinstance(engine.attn, DenseAttention)
        # every group retrieval with a budget past the context: pins + top-k cover every block
        everything = SparsePlan(sink=4, window=16, groups=[[GroupPlan(False, 16, 1.5)] * cfg.n_kv_heads
                                                           for _ in range(cfg.n_layers)], pin_fraction=0.5,
                                obs_window=8)
        for summary_g, mass in ((None, "mean"), (64, "oracle")):
            sim = PlanSimulated(engine.attn, everything, summary_g, mass)
            sim.start(len(prompt))
            got = answer_steps(engine.model, sim, prompt, 10, set(), forced=greedy["taken"], chunk=128)
            assert got["argmax"] == greedy["taken"]
            assert min(sim.read) == pytest.approx(1.0)
        streaming = SparsePlan(sink=4, window=16, groups=[[GroupPlan(True)] * cfg.n_kv_heads
                                                          for _ in range(cfg.n_layers)])
        plain = PlanSimulated(engine.attn, streaming, None)
        plain.start(len(prompt))
        want = answer_steps(engine.model, plain, prompt, 4, set(), forced=greedy["taken"][:4], chunk=128)
        skipped = PlanSimulated(engine.attn, streaming, 64, "midrange", retrieval_only=True)
        skipped.start(len(prompt))
        got = answer_steps(engine.model, skipped, prompt, 4, set(), forced=greedy["taken"][:4], chunk=128)
        assert got["top1"] == want["top1"]  # no retrieval group: the term is never added
        small = PlanSimulated(engine.attn, _plan(cfg.n_layers, cfg.n_kv_heads, 0.05), 64, "mean")
        small.start(len(prompt))
        answer_steps(engine.model, small, prompt, 4, set(), chunk=128)  # free-running, the term on
    assert set(small.masses) == set(range(cfg.n_layers))  # every layer observed the prompt's end
    assert all(m.shape == (cfg.n_kv_heads, len(prompt)) for m in small.masses.values())
    assert max(small.read) < 0.5
