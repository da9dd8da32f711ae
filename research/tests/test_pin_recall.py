"""research/pin_recall.py: the offline pin-rule score counts, per answer value, the pinning groups whose pins hold the
value's blocks, on hand-made masses where the answer is known."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

import pin_recall  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan  # noqa: E402


def test_recall_counts_groups_whose_pins_hold_each_value() -> None:
    g, n = 16, 1000  # 61 blocks at g = 16 before the window; budget 0.05 -> 4 blocks, 3 pinned at fraction 0.75
    plan = SparsePlan(16, 64, [[GroupPlan(False, g, 0.05), GroupPlan(False, g, 0.05)], [GroupPlan(True, g, 0.0),
                                                                                         GroupPlan(False, g, 0.05)]],
                      "t", pin_fraction=0.75, obs_window=8)
    mass = np.full((2, n - 1), 1e-3)
    mass[0, 20 * g + 3] = 5.0  # group (0, 0): a key in block 20; its value runs over blocks 20-21
    mass[1, 40 * g + 3] = 5.0  # group (0, 1): the other value's key only
    elsewhere = np.full((2, n - 1), 1e-3)
    elsewhere[:, 50 * g] = 5.0
    masses = {0: mass, 1: elsewhere}  # layer 1: its retrieval group looks at block 50, no value there
    spans = [(20 * g + 8, 21 * g + 8), (40 * g + 8, 40 * g + 12)]  # two values: the first crosses into block 21
    got = pin_recall.recall(plan, masses, n, spans, (0.75, 2, 1.0))  # spans of 2: key block + successor
    assert got["groups"] == 3  # the streaming group pins nothing and is not counted
    # value 1: its first block pinned in group (0, 0) only; value 2: in group (0, 1) only (successor 41 too)
    assert got["first"] == pytest.approx(1 / 3) and got["first_worst"] == pytest.approx(1 / 3)
    assert got["whole"] == pytest.approx(1 / 3)
    single = pin_recall.recall(plan, masses, n, spans, (0.75, 1, 1.0))  # span 1: the heaviest blocks alone
    assert single["first"] == pytest.approx(1 / 3)
    assert single["whole"] == pytest.approx(1 / 6) and single["whole_worst"] == 0.0  # value 1's block 21 is lost


def test_rules_skip_decays_that_span_one_ignores() -> None:
    rules = pin_recall.parse_rules([0.5, 1.0], [1, 3], [1.0, 0.5])
    assert (0.5, 1, 1.0) in rules and (0.5, 1, 0.5) not in rules and (1.0, 3, 0.5) in rules
    assert len(rules) == 2 * (1 + 2)


def test_consensus_blends_each_group_with_the_mean_of_all_normalised_retrieval_groups() -> None:
    plan = SparsePlan(4, 8, [[GroupPlan(False, 16, 0.1), GroupPlan(True)], [GroupPlan(False, 16, 0.1),
                                                                              GroupPlan(False, 16, 0.1)]], "t",
                      pin_fraction=0.75)
    rng = np.random.default_rng(0)
    n = 200
    masses = {0: rng.random((2, n - 1)) + 0.01, 1: rng.random((2, n - 1)) + 0.01}
    assert pinned.consensus_masses(plan, masses, n, 0.0) is masses  # share 0: the engine's own rule
    lo, hi = 4, n - 8
    norm = {(layer, h): masses[layer][h] / masses[layer][h][lo:hi].sum() for layer in (0, 1) for h in (0, 1)}
    mean = (norm[0, 0] + norm[1, 0] + norm[1, 1]) / 3  # the streaming group (0, 1) is no part of the consensus
    got = pinned.consensus_masses(plan, masses, n, 0.25)
    for (layer, h), own in norm.items():
        assert np.allclose(got[layer][h], 0.75 * own + 0.25 * mean, rtol=1e-12, atol=0)
    everyone = pinned.consensus_masses(plan, masses, n, 1.0)
    assert all(np.allclose(everyone[layer][h], mean, rtol=1e-12, atol=0) for layer in (0, 1) for h in (0, 1))
    assert pin_recall.rule_key(0.75, 3, 1.0, 0.0) == "0.75/3/1" and pin_recall.rule_key(0.75, 3, 1.0, 0.5) == \
        "0.75/3/1/c0.5"
