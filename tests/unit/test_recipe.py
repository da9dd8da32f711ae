"""plan/recipe.py: the shaping steps behind the shipped plans, as the first-use calibration applies them."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.recipe import first_use_recipe, request_recipe
from fluxion_lite.plan.sparse_plan import SparsePlan

ROOT = Path(__file__).resolve().parents[2]
SELECTOR_05B = ROOT / "bench/results/plans/q05_selector_04da68b.plan.json"  # `git show 04da68b:models/...plan.json`
SHIPPED_05B = ROOT / "models/qwen2.5-coder-0.5b.plan.json"


def test_the_first_use_recipe_makes_the_shipped_05b_plan_from_its_selector_plan() -> None:
    got = first_use_recipe(SparsePlan.load(SELECTOR_05B), 4096)
    shipped = SparsePlan.load(SHIPPED_05B)
    for f in fields(SparsePlan):
        assert getattr(got, f.name) == getattr(shipped, f.name), f.name  # the source text included


def test_the_recipe_shapes_any_selector_plan_the_same_way() -> None:
    selector = SparsePlan.load(SELECTOR_05B)
    shaped = first_use_recipe(selector, 2048)
    for sel_row, row in zip(selector.groups, shaped.groups):
        for before, after in zip(sel_row, row):
            assert not after.streaming and after.g == 16  # streaming groups turn long-only retrieval groups
            assert after.long_only == before.streaming
            expected = 0.02 * 0.9 if before.streaming else min(1.0, before.budget * 0.6) * 0.9
            assert abs(after.budget - expected) < 1e-12
    assert shaped.short_tokens == 2 * 2048 - 128 and shaped.pin_fraction == 0.75 and shaped.pin_span == 3
    # budgets as selected up to ~2x the calibration context, x0.54 from ~4x on: reads fall with the context
    reads = [plan_bytes_fraction(shaped, n, 64)[0] for n in (2048, 4096, 8192, 16384)]
    assert reads == sorted(reads, reverse=True)


def test_a_requests_recipe_keeps_the_split_and_pins_nothing() -> None:
    selector = SparsePlan.load(SELECTOR_05B)
    shaped = request_recipe(selector, 4096)
    assert shaped.pin_fraction == 0.0
    assert [[g.streaming for g in row] for row in shaped.groups] == [[g.streaming for g in row]
                                                                      for row in selector.groups]
    assert all(g.g == 16 for row in shaped.groups for g in row if not g.streaming)
    assert float(shaped.budget_factor(4096)) == 1.7 and float(shaped.budget_factor(1 << 15)) == 1.0
