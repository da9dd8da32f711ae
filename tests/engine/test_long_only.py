"""Long-only groups (GroupPlan.long_only): retrieval groups that stream (sink + window only) up to the plan's
short_tokens and retrieve their budget from twice that on. The factor, the decode step's tasks for mixed batches,
the shipped qwen2.5-coder-0.5b plan against the two plans measured on RULER, the backend's output against a float64
reference, the predicted read and the file format (research/plan_variant.py's flag: research/tests/
test_plan_variant.py)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.pins import PinnedBlocks
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan, long_factor
from fluxion_lite.sparse.step import GVALS, active_retrieval, build_step, retrieval_tasks

ROOT = Path(__file__).resolve().parents[2]
N0 = 1024


def plan(long_only: bool = True, short_scale: float = 1.0, pin_fraction: float = 0.0) -> SparsePlan:
    """One layer: a streaming group, a regular retrieval group and a long-only one (or a regular one in its place)."""
    row = [GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.03, long_only)]
    return SparsePlan(16, 64, [row], "t", pin_fraction=pin_fraction, short_scale=short_scale, short_tokens=N0)


def step_tasks(p: SparsePlan, lengths: list[int]) -> tuple[np.ndarray, ...]:
    """(tasks, row, group, k) of one step whose rows hold `lengths` tokens, through the plan's [L, Hkv] arrays."""
    key = tuple((i, n - 1) for i, n in enumerate(lengths))
    st = build_step(key, list(range(len(lengths))), p.sink, p.window, 16, p.window + 128, torch.device("cpu"),
                    p.budget_factor if p.scales_budgets else None, p.short_tokens, p.has_long_only)
    ret, g, bud, long_only = (a[:, None, :] for a in p.arrays())
    gi = np.searchsorted(np.array(GVALS), g)
    tasks, _, bi, h, k, _, _ = retrieval_tasks(st, gi, g, ret, bud, long_only if p.has_long_only else None)
    return tasks, bi, h, k


def test_factor_is_zero_up_to_n0_one_from_twice_n0_and_linear_in_log2_between() -> None:
    n = np.arange(1, 4 * N0)
    f = long_factor(n, N0)
    assert (f[n <= N0] == 0.0).all() and (f[n >= 2 * N0] == 1.0).all()
    between = f[(n > N0) & (n < 2 * N0)]
    assert (np.diff(between) > 0).all() and (between > 0).all() and (between < 1).all()
    for m in (1100, 1448, 2000):  # float64 reference
        assert float(long_factor(m, N0)) == pytest.approx(math.log2(m / N0), abs=1e-15)


def test_a_long_only_group_has_tasks_only_in_the_rows_past_n0() -> None:
    lengths = [600, N0, 1500, 2 * N0, 5000]
    _, bi, h, k = step_tasks(plan(), lengths)
    by_row = {r: sorted(h[bi == r].tolist()) for r in range(len(lengths))}
    assert by_row == {0: [1], 1: [1], 2: [1, 2], 3: [1, 2], 4: [1, 2]}
    p = plan()
    for r, n in enumerate(lengths):  # k: ceil(budget x n x factor / g), the plan's own block_count
        want = [p.block_count(gp, n) for gp in p.groups[0][1:] if p.block_count(gp, n) > 0]
        assert k[bi == r].tolist() == want
    assert p.block_count(p.groups[0][2], 1500) == math.ceil(0.03 * 1500 * math.log2(1500 / N0) / 16)
    assert p.block_count(p.groups[0][2], 5000) == math.ceil(0.03 * 5000 / 16)


def test_from_twice_n0_on_a_long_only_group_is_a_plain_retrieval_group() -> None:
    lengths = [2 * N0, 3000, 7777]
    a, b = step_tasks(plan(True), lengths), step_tasks(plan(False), lengths)
    assert np.array_equal(a[0], b[0])  # the native task tables themselves


def test_active_retrieval_counts_long_only_groups_as_streaming_where_they_stream() -> None:
    p = plan()
    key = ((0, 499), (1, 4999))
    st = build_step(key, [0, 1], 16, 64, 16, 192, torch.device("cpu"), None, N0, True)
    ret, _, _, long_only = (x[:, None, :] for x in p.arrays())
    assert active_retrieval(st, ret, long_only).tolist() == [[[False, True, False], [False, True, True]]]


def _plan_file(name: str) -> SparsePlan:
    return SparsePlan.load(ROOT / name)


@pytest.mark.parametrize("lengths,reference", [
    ([1000, 4096, 5000, 8064], "bench/results/plans/shipped_a62cb96.plan.json"),
    ([3000, 4100, 7000, 8000], "bench/results/plans/shipped_a62cb96.plan.json"),
    ([16128, 16384, 20000, 32768], "bench/results/plans/nostream02x09.plan.json"),
    ([16200, 24576, 30000, 32700], "bench/results/plans/nostream02x09.plan.json"),
])
def test_shipped_qwen05_plan_steps_as_the_two_measured_plans(lengths: list[int], reference: str) -> None:
    """The shipped plan's decode steps (every layer) make the same task tables as the previous shipped plan up to
    8064 tokens and as nostream02x09 from 16128 on: the RULER runs of those two plans (4K; 16K, 32K) hold for it."""
    shipped, ref = _plan_file("models/qwen2.5-coder-0.5b.plan.json"), _plan_file(reference)
    assert shipped.has_long_only
    for n in lengths:
        a, b = step_tasks(shipped, [n]), step_tasks(ref, [n])
        assert np.array_equal(a[0], b[0]), n
    for n in range(1000, 8065, 97):  # pins too: each group's count at prefill end
        if "shipped" in reference:
            assert [[shipped.block_count(gp, n) for gp in row] for row in shipped.groups] == \
                   [[ref.block_count(gp, n) for gp in row] for row in ref.groups], n


def test_predicted_read_is_the_streaming_plans_below_n0_and_the_retrieval_plans_from_twice_n0() -> None:
    """Below n0 the long-only group streams, through its g's block-aligned sink and window (16 + 64 + 7.5 tokens
    on average at g = 16, not a streaming group's 80); from 2 n0 on it is the regular retrieval group."""
    streaming = SparsePlan(16, 64, [[GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(True)]], "t",
                           short_tokens=N0)
    for n in (512, N0):
        aligned_extra = (16 + 64 + 7.5 - 80) / n / 3  # per group of the three
        assert plan_bytes_fraction(plan(), n, 64)[0] == pytest.approx(plan_bytes_fraction(streaming, n, 64)[0]
                                                                      + aligned_extra, rel=1e-12)
        assert plan_bytes_fraction(plan(), n, 64)[1] == pytest.approx(plan_bytes_fraction(streaming, n, 64)[1]
                                                                      + aligned_extra, rel=1e-12)
    for n in (2 * N0, 8 * N0):
        assert plan_bytes_fraction(plan(), n, 64) == plan_bytes_fraction(plan(False), n, 64)
    assert plan_bytes_fraction(streaming, 1500, 64)[0] < plan_bytes_fraction(plan(), 1500, 64)[0] \
        < plan_bytes_fraction(plan(False), 1500, 64)[0]


def test_pins_of_a_long_only_group_follow_its_factor() -> None:
    p = plan(pin_fraction=1.0)
    pins = PinnedBlocks(p)
    rng = np.random.default_rng(3)
    for slot, n in enumerate((900, 4000)):
        pins.pin_by_mass(0, slot=slot, mass=rng.random((3, n)), n=n)
    assert pins._counts[0, 0].tolist() == [0, p.block_count(p.groups[0][1], 900), 0]
    assert pins._counts[0, 1].tolist() == [0] + [p.block_count(gp, 4000) for gp in p.groups[0][1:]]


def test_file_format_round_trip_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "p.plan.json"
    plan().save(path)
    raw = json.loads(path.read_text())
    assert [("long_only" in gp) for gp in raw["groups"][0]] == [False, False, True]  # only where set
    back = SparsePlan.load(path)
    assert back.groups == plan().groups and back.has_long_only
    assert (back.short_scale, back.short_tokens) == (1.0, N0)  # the ramp's tokens, kept without a short scale
    assert "long-only groups" in back.explain() and "b=0.030*" in back.explain()
    plan(False).save(path)
    assert "long_only" not in path.read_text() and not SparsePlan.load(path).has_long_only
    raw["groups"][0][2]["long_only"] = "yes"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelFileError, match="long_only"):
        SparsePlan.load(path)
    bad = SparsePlan(16, 64, [[GroupPlan(True, long_only=True)]], "t")
    with pytest.raises(ModelFileError, match="long_only"):
        bad.validate(1, 1)


def _tiny_cfg():  # type: ignore[no-untyped-def]
    """One layer, 3 KV groups of 2 query heads each: the plan() rows' shape."""
    from fluxion_lite.model.config import ModelConfig

    return ModelConfig(arch="llama", n_layers=1, d_model=48, d_ff=64, n_heads=6, n_kv_heads=3, head_dim=16,
                       vocab_size=10, context_length=8192, rms_eps=1e-5, rope_theta=10000.0, rope_dim=16,
                       rope_style="interleaved", qkv_bias=False, tied_embeddings=True)


def _backend(p: SparsePlan):  # type: ignore[no-untyped-def]
    from fluxion_lite.sparse.backend import SparseAttention

    return SparseAttention(_tiny_cfg(), p, torch.float32, torch.device("cpu"), max_seqs=2, placement="cpu")


def _decode(p: SparsePlan, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        dict[str, float]]:
    """One eager CPU decode step after an imported n-token context: (out [1, Hq, D], q, k, v, stats)."""
    from fluxion_lite.model.attention import SeqChunk

    a = _backend(p)
    g = torch.Generator().manual_seed(seed)
    # bf16 values: the host store's precision, so the CPU decode path's sink and window reads are exact
    k, v = (torch.randn(n + 1, 3, 16, generator=g).bfloat16().float() for _ in range(2))
    q = torch.randn(1, 6, 16, generator=g)
    a.allocate(0)
    a.import_kv(0, 0, 0, k[:n], v[:n])
    a.state.prefilling.discard(0)
    out = a.attend(0, q, k[n:], v[n:], [SeqChunk(0, n, 1)])
    stats = a.stats()
    a.executor.close()
    return out, q, k, v, stats


def test_backend_below_n0_a_long_only_group_attends_sink_and_window_only() -> None:
    """Against float64 attention over the group's block-aligned sink [0, 16) and window [floor((n - 64) / 16) x 16,
    n]: a long-only group keeps g=16, so its window is block-aligned like a retrieval group's (64-79 tokens)."""
    n = 700
    out, q, k, v, stats = _decode(plan(), n, seed=11)
    lo = (n + 1 - 64) // 16 * 16
    keep = torch.cat([torch.arange(16), torch.arange(lo, n + 1)])
    qh = q[0, 4:6].double()  # the long-only group's two query heads (group 2)
    kk, vv = k[keep, 2].double(), v[keep, 2].double()
    w = torch.softmax(qh @ kk.T / 4.0, dim=-1)
    assert torch.allclose(out[0, 4:6].double(), w @ vv, atol=1e-5)
    assert stats["streaming_fraction"] == pytest.approx(2 / 3)


def test_backend_from_twice_n0_a_long_only_group_decodes_as_a_retrieval_group() -> None:
    n = 2500
    a_out, *_, a_stats = _decode(plan(True), n, seed=5)
    b_out, *_, b_stats = _decode(plan(False), n, seed=5)
    assert torch.equal(a_out, b_out)
    assert a_stats["kv_read_fraction"] == b_stats["kv_read_fraction"]
    assert a_stats["streaming_fraction"] == pytest.approx(1 / 3)


def test_tpot_draws_long_only_groups_and_the_context_scaling_from_the_shipped_plan() -> None:
    """bench/tpot.py's plan for the 8B shape copies groups of the shipped plan, long-only flags included, and keeps
    its short_scale / short_tokens, so the drawn plan streams and retrieves at the same contexts as its source."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tpot

    from fluxion_lite.model.config import ModelConfig

    cfg = ModelConfig(**tpot.SHAPES["llama3.1-8b"], context_length=131072, rms_eps=1e-5, rope_dim=128)
    src = SparsePlan.load(ROOT / "models" / "qwen2.5-coder-0.5b.plan.json")
    drawn = tpot.borrowed_plan(cfg, ROOT / "models" / "qwen2.5-coder-0.5b.plan.json")
    drawn.validate(cfg.n_layers, cfg.n_kv_heads)
    assert drawn.has_long_only and (drawn.short_scale, drawn.short_tokens) == (src.short_scale, src.short_tokens)
    source_groups = {gp for row in src.groups for gp in row}
    assert all(gp in source_groups for row in drawn.groups for gp in row)


def test_per_request_rows_keep_the_static_long_only_flags_where_a_row_has_no_plan_of_its_own() -> None:
    """request_plan.RequestPlanner.rows: a sequence the predictor planned has no long-only groups (its layers are
    replaced whole); one it did not plan keeps the static plan's flags, so its long-only groups still stream below
    short_tokens."""
    from fluxion_lite.plan.request_plan import RequestPlanner

    planner = RequestPlanner(None, plan(), _tiny_cfg(), [])  # type: ignore[arg-type]  # rows() never asks the predictor
    ret, g, bud, long_only = (a.copy() for a in planner._static)
    long_only[:] = False  # what prefill_done writes for a planned layer
    planner._plans[7] = (ret, g, bud, long_only)
    rp = planner.rows(object(), [7, 8], torch.device("cpu"))
    assert rp is not None and rp.long_only is not None
    assert rp.long_only.tolist() == [[[False, False, False], [False, False, True]]]  # [L, B, Hkv]
    assert planner.plan_of(7).groups == [[GroupPlan(True), GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.03)]]
