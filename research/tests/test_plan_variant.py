"""research/plan_variant.py (the tool that derives a plan file from a base plan, models/README.md): each flag lands
in the written plan, flags not given keep the base plan's values, and bad values are refused naming the flag.

These tests were in the product suite (tests/unit/test_budget_curve.py, test_short_scale.py, tests/engine/
test_long_only.py, test_long_exact_stream.py, test_pinned.py) next to the plan fields they set; the fields' own file
format checks stay there."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[2]
N0 = 1024  # short_tokens of the small plans below


def curve_row() -> list[GroupPlan]:
    """tests/unit/test_budget_curve.py's row: a streaming group, then two retrieval groups (g=16 and g=64)."""
    return [GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(False, 64, 0.1)]


def scale_plan(short_scale: float = 1.0, short_tokens: int = N0) -> SparsePlan:
    """tests/unit/test_short_scale.py's plan: a streaming group, then two retrieval groups (g=16 and g=64)."""
    row = [GroupPlan(True), GroupPlan(False, 16, 0.0625), GroupPlan(False, 64, 0.1)]
    return SparsePlan(16, 64, [row], "t", short_scale=short_scale, short_tokens=short_tokens)


def exact_plan(exact: bool = True) -> SparsePlan:
    """tests/engine/test_long_exact_stream.py's plan: a streaming group, a retrieval group and a long-only one."""
    row = [GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(False, 64, 0.04, True)]
    return SparsePlan(16, 64, [row], "t", short_tokens=N0, long_exact_stream=exact)


def test_plan_variant_sets_solves_and_checks_the_curve(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    base = tmp_path / "base.plan.json"
    long_only = GroupPlan(False, 64, 0.04, long_only=True)  # whose ramp (short_tokens) the curve must keep
    SparsePlan(16, 64, [curve_row() + [long_only]], "t", short_scale=1.7, short_tokens=2048).save(base)
    out = tmp_path / "v.plan.json"
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=repo_env(root), timeout=120)

    done = run("--budget-curve", "1024:1.7", "--read-target", "8192:0.06", "2048:0.12")
    assert done.returncode == 0, done.stderr
    got = SparsePlan.load(out)
    assert got.short_scale == 1.0 and got.short_tokens == 2048  # the curve replaces the scale, not the ramp
    assert [t for t, _ in got.budget_curve] == [1024, 2048, 8192] and got.budget_curve[0][1] == 1.7
    for n, target in ((2048, 0.12), (8192, 0.06)):
        assert target - (16 + 64 + 64) / n / 4 < plan_bytes_fraction(got, n, 64)[0] <= target  # within a block
    assert "budget curve" in got.source and "budgets by context" in done.stdout
    assert run().returncode == 0 and SparsePlan.load(out).short_scale == 1.7  # no flags: the base plan's scale
    assert SparsePlan.load(out).background == "off"
    assert run("--background", "all").returncode == 0 and SparsePlan.load(out).background == "all"
    refused = run("--background", "some")
    assert refused.returncode != 0 and "--background" in refused.stderr
    for args, flag in ((("--budget-curve", "1024"), "--budget-curve"), (("--budget-curve", "0:1"), "--budget-curve"),
                       (("--budget-curve", "1024:-1"), "--budget-curve"),
                       (("--read-target", "1024:1.5"), "--read-target"),
                       (("--read-target", "4096:0.0001"), "--read-target"),
                       (("--budget-curve", "1024:1", "--read-target", "1024:0.1"), "--read-target")):
        refused = run(*args)
        assert refused.returncode != 0 and flag in refused.stderr and "Traceback" not in refused.stderr, args


def test_plan_variant_sets_keeps_and_checks_the_short_scale(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    base = tmp_path / "base.plan.json"
    scale_plan(1.7, 8064).save(base)
    out = tmp_path / "v.plan.json"
    env = repo_env(root)
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)

    assert run().returncode == 0  # no flags: the base plan's scale
    assert (SparsePlan.load(out).short_scale, SparsePlan.load(out).short_tokens) == (1.7, 8064)
    done = run("--short-scale", "2", "--short-tokens", "4096")
    assert done.returncode == 0, done.stderr
    assert "x2 up to 4096 tokens" in done.stdout
    assert (SparsePlan.load(out).short_scale, SparsePlan.load(out).short_tokens) == (2.0, 4096)
    assert SparsePlan.load(out).groups == scale_plan().groups
    for flag, value in (("--short-scale", "0.5"), ("--short-tokens", "0")):
        refused = run(flag, value)
        assert refused.returncode != 0 and flag in refused.stderr


def test_plan_variant_long_only_flag(tmp_path: Path) -> None:
    base = tmp_path / "base.plan.json"
    SparsePlan(16, 64, [[GroupPlan(True), GroupPlan(False, 16, 0.05)]], "t").save(base)
    out = tmp_path / "v.plan.json"
    env = repo_env(ROOT)
    cmd = [sys.executable, str(ROOT / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]
    done = subprocess.run([*cmd, "--streaming-budget", "0.02", "--long-only", "--budget-scale", "0.5"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    made = SparsePlan.load(out)
    assert made.groups == [[GroupPlan(False, 16, 0.01, True), GroupPlan(False, 16, 0.025)]]
    refused = subprocess.run([*cmd, "--long-only"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--long-only needs --streaming-budget" in refused.stderr


def test_plan_variant_flag_keeps_the_base_choice_unless_given(tmp_path: Path) -> None:
    base, out = tmp_path / "base.plan.json", tmp_path / "v.plan.json"
    exact_plan(False).save(base)
    env = repo_env(ROOT)
    cmd = [sys.executable, str(ROOT / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]
    for extra, want in (([], False), (["--long-exact-stream"], True)):
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert SparsePlan.load(out).long_exact_stream is want
    replace(exact_plan(), long_exact_stream=True).save(base)  # an exact base stays exact
    assert subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120).returncode == 0
    assert SparsePlan.load(out).long_exact_stream


def test_plan_variant_writes_the_pin_span(tmp_path: Path) -> None:
    """research/plan_variant.py carries --pin-span (and --sink) into the plan file and keeps the base plan's split and
    budgets."""
    root = Path(__file__).resolve().parents[2]
    base = root / "models" / "qwen2.5-coder-0.5b.plan.json"
    out = tmp_path / "span3.plan.json"
    env = repo_env(root)
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(base), "--pin-fraction", "0.5",
           "--out", str(out)]
    done = subprocess.run([*cmd, "--pin-span", "3", "--pin-decay", "0.5"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    plan, shipped = SparsePlan.load(out), SparsePlan.load(base)
    assert (plan.pin_span, plan.pin_decay, plan.pin_fraction, plan.groups) == (3, 0.5, 0.5, shipped.groups)
    refused = subprocess.run([*cmd, "--pin-span", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--pin-span" in refused.stderr
    done = subprocess.run([*cmd, "--pin-span", "3", "--sink", "32"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    plan = SparsePlan.load(out)
    assert (plan.sink, plan.window, plan.groups) == (32, shipped.window, shipped.groups) and "sink 32" in plan.source
    refused = subprocess.run([*cmd, "--sink", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--sink" in refused.stderr


def test_plan_variant_floor_and_window(tmp_path: Path) -> None:
    """--min-budget lifts every retrieval budget below it to it before --budget-scale; streaming groups, block sizes
    and budgets above the floor (scaled only) are kept. --window changes the recent window alone."""
    root = Path(__file__).resolve().parents[2]
    base = root / "models" / "qwen2.5-coder-0.5b.plan.json"
    out = tmp_path / "floor.plan.json"
    env = repo_env(root)
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]
    done = subprocess.run([*cmd, "--min-budget", "0.02", "--budget-scale", "0.95"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    plan, shipped = SparsePlan.load(out), SparsePlan.load(base)
    for row, base_row in zip(plan.groups, shipped.groups):
        for gp, bp in zip(row, base_row):
            assert (gp.streaming, gp.g) == (bp.streaming, bp.g)
            if not bp.streaming:
                assert gp.budget == pytest.approx(max(bp.budget, 0.02) * 0.95)
    assert any(bp.budget < 0.02 for r in shipped.groups for bp in r if not bp.streaming)  # the floor did something
    assert "budgets >= 0.02 then x0.95" in plan.source
    assert "predicted per decode step at 4K / 8K / 16K / 32K: KV read" in done.stdout
    # flags not given keep the base plan's pins, scoring, sink and short-context scale
    kept = ("pin_fraction", "obs_window", "pin_span", "pin_decay", "scoring", "sink", "window", "short_scale",
            "short_tokens")
    assert [getattr(plan, f) for f in kept] == [getattr(shipped, f) for f in kept] and shipped.pin_fraction > 0
    refused = subprocess.run([*cmd, "--min-budget", "1.5"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--min-budget" in refused.stderr
    done = subprocess.run([*cmd, "--window", "128"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = SparsePlan.load(out)
    assert (plan.window, plan.sink, plan.groups, plan.pin_fraction) == (128, shipped.sink, shipped.groups,
                                                                       shipped.pin_fraction)
    assert "window 128" in plan.source
    refused = subprocess.run([*cmd, "--window", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--window" in refused.stderr
    missing = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(tmp_path / "none.plan.json"),
               "--out", str(out)]
    refused = subprocess.run(missing, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--base" in refused.stderr and "Traceback" not in refused.stderr


def test_plan_variant_streaming_budget(tmp_path: Path) -> None:
    """--streaming-budget turns every streaming group into a retrieval group at that budget (then scaled, as the
    others are) and the base plan's block size; the retrieval groups are scaled only."""
    root = Path(__file__).resolve().parents[2]
    base = root / "bench" / "results" / "plans" / "shipped_a62cb96.plan.json"  # the shipped plan before long-only groups
    out = tmp_path / "nostream.plan.json"
    env = repo_env(root)
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(base), "--out", str(out)]
    done = subprocess.run([*cmd, "--streaming-budget", "0.02", "--budget-scale", "0.9"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    plan, shipped = SparsePlan.load(out), SparsePlan.load(base)
    assert any(bp.streaming for r in shipped.groups for bp in r)  # the flag has something to turn
    for row, base_row in zip(plan.groups, shipped.groups):
        for gp, bp in zip(row, base_row):
            assert not gp.streaming
            expect = (16, 0.02 * 0.9) if bp.streaming else (bp.g, bp.budget * 0.9)
            assert (gp.g, gp.budget) == (expect[0], pytest.approx(expect[1]))
    assert "streaming groups retrieve at 0.02" in plan.source and plan.pin_fraction == shipped.pin_fraction
    refused = subprocess.run([*cmd, "--streaming-budget", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--streaming-budget" in refused.stderr and "Traceback" not in refused.stderr


def test_plan_variant_sets_and_keeps_the_pin_span_tokens(tmp_path: Path) -> None:
    """--pin-span-tokens into the plan file, the base plan's value when not given, out-of-range values refused (moved
    out of tests/engine/test_pinned.py's test_pin_spans_in_tokens_cover_the_same_stretch_at_every_block_size, whose
    plan this base is)."""
    groups = [[GroupPlan(False, 16, 0.1), GroupPlan(False, 32, 0.1), GroupPlan(False, 64, 0.2),
               GroupPlan(False, 128, 0.2)]]
    SparsePlan(16, 64, groups, "t", pin_fraction=1.0, pin_span=3, pin_span_tokens=80).save(tmp_path / "t.plan.json")
    root = Path(__file__).resolve().parents[2]
    env = repo_env(root)
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(tmp_path / "t.plan.json"),
           "--out", str(tmp_path / "v.plan.json")]
    done = subprocess.run([*cmd, "--pin-span-tokens", "64"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert SparsePlan.load(tmp_path / "v.plan.json").pin_span_tokens == 64
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)  # unset: the base's value
    assert done.returncode == 0 and SparsePlan.load(tmp_path / "v.plan.json").pin_span_tokens == 80
    refused = subprocess.run([*cmd, "--pin-span-tokens", "500"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "--pin-span-tokens" in refused.stderr


def test_the_plan_file_and_plan_variant_carry_the_pin_consensus(tmp_path: Path) -> None:
    path = tmp_path / "c.plan.json"
    SparsePlan(16, 64, [[GroupPlan(False, 16, 0.1)]], "t", pin_fraction=0.75, pin_consensus=0.5).save(path)
    back = SparsePlan.load(path)
    assert back.pin_consensus == 0.5 and "consensus" in back.explain()
    bad = SparsePlan(16, 64, [[GroupPlan(False, 16, 0.1)]], "t", pin_fraction=0.75, pin_consensus=1.5)
    with pytest.raises(ModelFileError, match="pin_consensus"):
        bad.validate(1, 1)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "v.plan.json"
    cmd = [sys.executable, str(root / "research" / "plan_variant.py"), "--base", str(path), "--out", str(out)]
    done = subprocess.run([*cmd, "--pin-consensus", "1"], capture_output=True, text=True, env=repo_env(root),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert SparsePlan.load(out).pin_consensus == 1.0
    refused = subprocess.run([*cmd, "--pin-consensus", "2"], capture_output=True, text=True, env=repo_env(root),
                             timeout=120)
    assert refused.returncode != 0 and "--pin-consensus" in refused.stderr
