"""A sparse plan's budget curve (SparsePlan.budget_curve): a budget factor per context length. The factor against a
float64 reference, the step's top-k block counts, the bound the device path sizes its buffers by, validation, the
file format and the read-target solver (policy.scale_for_read). research/plan_variant.py's flags: research/tests/
test_plan_variant.py."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.cost import plan_bytes_fraction, scale_for_read
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan, curve_factor, short_factor
from test_short_scale import backend_step, step_k

RISING = ((1024, 1.5), (2048, 2.5), (4096, 1.0))  # up from 1K to 2K, then down: what a per-length read limit asks


def plan(curve: tuple[tuple[int, float], ...] = RISING, pin_fraction: float = 0.0) -> SparsePlan:
    """One layer: a streaming group, then two retrieval groups (g=16 and g=64)."""
    row = [GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(False, 64, 0.1)]
    return SparsePlan(16, 64, [row], "t", pin_fraction=pin_fraction, budget_curve=curve)


def reference_factor(n: float, curve: list[tuple[int, float]]) -> float:
    """float64, knot by knot: the scale of the first / last knot outside them, linear in log2(n) between."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (t0, s0), (t1, s1) in zip(curve, curve[1:]):
        if n <= t1:
            w = (math.log2(n) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return s0 + w * (s1 - s0)
    return curve[-1][1]


def random_curve(rng: np.random.Generator) -> tuple[tuple[int, float], ...]:
    tokens = np.sort(rng.choice(np.arange(64, 70000), size=int(rng.integers(1, 6)), replace=False))
    return tuple((int(t), float(rng.uniform(0.2, 3.0))) for t in tokens)


def test_factor_matches_the_reference_on_random_curves_and_lengths() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        curve = random_curve(rng)
        n = rng.integers(1, 100000, size=200)
        got = curve_factor(n, curve)
        assert got.shape == n.shape
        assert np.allclose(got, [reference_factor(float(x), list(curve)) for x in n], rtol=0, atol=1e-12)
        assert curve_factor(curve[0][0], curve) == pytest.approx(curve[0][1])  # each knot's own scale
        assert curve_factor(curve[-1][0] * 8, curve) == pytest.approx(curve[-1][1])  # flat past the last


def test_the_two_knot_curve_is_the_short_scale() -> None:
    n = np.arange(1, 40000, 7)
    assert np.allclose(curve_factor(n, ((8064, 1.7), (16128, 1.0))), short_factor(n, 1.7, 8064), atol=1e-12)


def test_step_k_follows_the_curve_where_it_rises_and_falls() -> None:
    p = plan()
    lengths = list(range(512, 6000, 173))
    k = step_k(p, lengths)
    n = np.array(lengths, np.float64)[:, None]
    f = np.array([reference_factor(x, list(RISING)) for x in lengths])[:, None]
    assert k.tolist() == np.ceil(np.array([0.05, 0.1]) * n * f / np.array([16, 64]) - 1e-9).astype(int).tolist()
    for length, row in zip(lengths, k):  # the plan's own count (pins, printouts) agrees with the step's
        assert [p.block_count(gp, length) for gp in p.groups[0][1:]] == row.tolist()
    at = {x: i for i, x in enumerate(lengths)}
    assert k[at[1896], 0] > 1896 * 0.05 * 1.5 / 16  # between the first knots the factor is above the first's


def test_max_factor_bounds_every_length_of_a_range_and_is_reached() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        p = plan(random_curve(rng))
        lo = int(rng.integers(1, 60000))
        hi = lo + int(rng.integers(0, 5000))
        every = p.budget_factor(np.arange(lo, hi + 1))
        assert p.max_budget_factor(lo, hi) == pytest.approx(float(every.max()), rel=1e-12)


def test_curve_and_short_scale_are_exclusive_and_bad_curves_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        replace(plan(), short_scale=1.5)
    bad_curves: list[object] = [[[0, 1.0]], [[100, 1.0], [100, 2.0]], [[200, 1.0], [100, 2.0]],
                                [[100, 0.0]], [[100, -1.0]], [[100, float("nan")]], [[100.5, 1.0]],
                                [["100", 1.0]], [[100, "1"]], [[100, True]], [[100]], "x"]
    for curve in bad_curves:  # ([] is a plan without a curve, as a file without the field)
        data = {"sink": 16, "window": 64, "groups": [[{"streaming": True}]], "budget_curve": curve}
        path = tmp_path / "bad.plan.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ModelFileError, match="bad.plan.json.*budget_curve"):
            SparsePlan.load(path)
    p = plan()
    p.budget_curve = ((100, 1.0), (50, 1.0))  # set after construction: validate() catches it too
    with pytest.raises(ModelFileError, match="budget_curve"):
        p.validate(1, 3)


def test_save_load_round_trip_and_explain(tmp_path: Path) -> None:
    path = tmp_path / "p.plan.json"
    plan(pin_fraction=0.5).save(path)
    assert json.loads(path.read_text())["budget_curve"] == [[1024, 1.5], [2048, 2.5], [4096, 1.0]]
    back = SparsePlan.load(path)
    assert back.budget_curve == RISING and back.short_scale == 1.0 and back.groups == plan().groups
    assert "x2.5 at 2048" in back.explain()
    replace(plan(), budget_curve=()).save(path)  # off: no field in the file
    assert "budget_curve" not in json.loads(path.read_text())
    assert not SparsePlan.load(path).scales_budgets


def test_scale_for_read_hits_the_target_and_refuses_what_no_scale_reaches() -> None:
    p = plan(())
    for n, target in ((4096, 0.10), (8192, 0.097), (32768, 0.049), (2000, 0.5)):
        scale = scale_for_read(p, n, target)

        def read(s: float) -> float:
            return plan_bytes_fraction(replace(p, budget_curve=((n, s),)), n, 64)[0]

        # the largest scale within the target: a hair more reads a block more, and that block is the step
        assert read(scale) <= target < read(scale * (1 + 1e-9))
        assert target - read(scale) < (16 + 64) / n / 3  # less than a block of each retrieval group
    with pytest.raises(ValueError, match="no budget factor"):
        scale_for_read(p, 4096, 0.001)  # below what the sink and window alone read
    with pytest.raises(ValueError, match="no budget factor"):
        scale_for_read(replace(p, groups=[[GroupPlan(True), GroupPlan(True), GroupPlan(True)]]), 4096, 0.5)


def test_the_curve_reaches_the_decode_steps_of_the_backend() -> None:
    """Through SparseAttention (eager CPU decode): each retrieval group's k is the plan's block_count at the length
    decoded, on the rising part of a curve."""
    curve = ((1000, 1.0), (2000, 3.0))
    p = SparsePlan(16, 32, [[GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.1)]], "t", budget_curve=curve)
    k_blocks, _ = backend_step(p, n=1500)
    assert k_blocks == [p.block_count(gp, 1501) for gp in p.groups[0]]
    assert k_blocks == [math.ceil(b * 1501 * reference_factor(1501, list(curve)) / 16) for b in (0.05, 0.1)]


def test_the_shipped_1_5b_curve_decodes_as_the_plans_measured_at_each_length() -> None:
    """models/qwen2.5-coder-1.5b.plan.json raises the budgets at 8K only: every group's top-k block count equals the
    floor plan's (measured on RULER at 4K / 16K / 32K) up to 4096 tokens and from 12288 on, and the curve plan's
    measured at 8K (q15_floor02_x085_curve98_49, reads 9.8%) on the 8K prompts' span (8050-8192 tokens)."""
    root = Path(__file__).resolve().parents[2]
    plans = root / "bench" / "results" / "plans"
    shipped = SparsePlan.load(root / "models" / "qwen2.5-coder-1.5b.plan.json")
    floor = SparsePlan.load(plans / "q15_floor02_x085_s165.plan.json")
    at_8k = SparsePlan.load(plans / "q15_floor02_x085_curve98_49.plan.json")
    assert shipped.groups == floor.groups == at_8k.groups and shipped.short_tokens == floor.short_tokens
    for other, lengths in ((floor, range(1, 4097, 5)), (at_8k, range(4000, 8193)), (floor, range(12288, 40000, 11))):
        for n in lengths:
            for row in shipped.groups:
                for gp in row:
                    assert shipped.block_count(gp, n) == other.block_count(gp, n), (n, gp)
    assert plan_bytes_fraction(shipped, 8192, 64)[0] <= 0.10 and plan_bytes_fraction(shipped, 16384, 64)[0] <= 0.05
