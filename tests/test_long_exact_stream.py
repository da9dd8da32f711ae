"""SparsePlan.long_exact_stream: long-only groups stream through the exact sink and window (a streaming group's)
below short_tokens instead of their block size's aligned ones, and are unchanged once they retrieve. Checked: the
step's rows, the backend's output against a float64 reference and against the plan with those groups streaming,
the graphed host step against the eager one, the predicted read against the step's own count, per-request rows,
the file format and plan_variant's flag."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from fluxion_lite.sparse.step import GVALS, LONG_ROW_OFFSET, bias_rows, build_step, group_rows, retrieval_tasks
from test_long_only import N0, _decode, _tiny_cfg
from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[1]


def plan(exact: bool = True, g: int = 64, long_only: bool = True) -> SparsePlan:
    """One layer: a streaming group, a retrieval group and a long-only one at block size g (long_only False: a
    streaming group in its place, what the exact plan must equal below short_tokens)."""
    third = GroupPlan(False, g, 0.04, True) if long_only else GroupPlan(True)
    row = [GroupPlan(True), GroupPlan(False, 16, 0.05), third]
    return SparsePlan(16, 64, [row], "t", short_tokens=N0, long_exact_stream=exact)


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_step_rows_are_exact_while_streaming_and_the_groups_own_once_retrieving(g: int) -> None:
    lengths = [100, 700, N0, N0 + 1, 1500, 2 * N0, 5000]
    key = tuple((i, n - 1) for i, n in enumerate(lengths))
    st = build_step(key, list(range(len(lengths))), 16, 64, 128, 64 + 128, torch.device("cpu"), None, N0, True, True)
    assert st.bias.shape[0] == bias_rows(True) == 2 * len(GVALS) - 1
    row = int(group_rows(np.array(g), np.array(True), True))
    assert row == GVALS.index(g) + LONG_ROW_OFFSET
    for b, n in enumerate(lengths):
        src = 0 if n <= N0 else GVALS.index(g)  # long_factor(n) is 0 up to N0
        assert st.sink_hi[row, b] == st.sink_hi[src, b] and st.win_lo[row, b] == st.win_lo[src, b], n
        assert torch.equal(st.bias[row, b], st.bias[src, b]) and st.stream_read[row, b] == st.stream_read[src, b]
    plain = build_step(key, list(range(len(lengths))), 16, 64, 128, 192, torch.device("cpu"), None, N0, True)
    assert torch.equal(plain.bias, st.bias[: len(GVALS)])  # the first rows are the usual ones
    # a row's retrieval tasks read the same bounds through either row, so they are the same tasks
    ret, g_arr, bud, lo = (a[:, None, :] for a in plan(g=g).arrays())
    exact = retrieval_tasks(st, group_rows(g_arr, lo, True), g_arr, ret, bud, lo)[0]
    aligned = retrieval_tasks(st, group_rows(g_arr), g_arr, ret, bud, lo)[0]
    assert np.array_equal(exact, aligned)


@pytest.mark.parametrize("n,g", [(700, 64), (N0 - 1, 16), (333, 128)])
def test_backend_below_n0_streams_exactly_and_equals_the_streaming_plan(n: int, g: int) -> None:
    """The long-only group's heads against float64 attention over the exact sink [0, 16) and the last 64 tokens,
    and the whole output and read against the plan with that group streaming."""
    out, q, k, v, stats = _decode(plan(g=g), n, seed=n)
    keep = torch.cat([torch.arange(16), torch.arange(n + 1 - 64, n + 1)])
    qh = q[0, 4:6].double()  # the long-only group's two query heads (group 2)
    w = torch.softmax(qh @ k[keep, 2].double().T / 4.0, dim=-1)
    assert torch.allclose(out[0, 4:6].double(), w @ v[keep, 2].double(), atol=1e-5)
    ref_out, *_, ref_stats = _decode(plan(g=g, long_only=False), n, seed=n)
    assert torch.equal(out, ref_out)
    assert stats["kv_read_fraction"] == ref_stats["kv_read_fraction"]
    assert stats["streaming_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("n", [1500, 2500])
def test_backend_past_n0_equals_the_aligned_plan(n: int) -> None:
    out, *_, stats = _decode(plan(True), n, seed=3)
    ref, *_, ref_stats = _decode(plan(False), n, seed=3)
    assert torch.equal(out, ref) and stats["kv_read_fraction"] == ref_stats["kv_read_fraction"]


def test_predicted_read_counts_exact_streaming_below_n0_and_is_unchanged_past_it() -> None:
    """Below short_tokens the step reads a streaming group's 80 tokens for the long-only group (no tasks), as the
    plan's predicted read says; past it exact and aligned plans predict alike."""
    ns = np.arange(600, N0 + 1)
    st = build_step(tuple((i, int(n) - 1) for i, n in enumerate(ns)), list(range(len(ns))), 16, 64, 128, 192,
                    torch.device("cpu"), None, N0, True, True)
    p = SparsePlan(16, 64, [[GroupPlan(True), GroupPlan(False, 64, 0.04, True)]], "t", short_tokens=N0,
                   long_exact_stream=True)
    ret, g, bud, lo = (a[:, None, :] for a in p.arrays())
    rows = group_rows(g, lo, True)
    assert len(retrieval_tasks(st, rows, g, ret, bud, lo)[0]) == 0
    read = st.stream_read[rows[0, 0][None, :], np.arange(len(ns))[:, None]].sum(1)  # [B] both groups
    assert (read == 2 * 80).all()
    assert [plan_bytes_fraction(p, int(n), 64)[0] * 2 * n for n in ns] == pytest.approx(read, rel=1e-12)
    p3 = plan()
    assert plan_bytes_fraction(p3, 800, 64) == plan_bytes_fraction(plan(long_only=False), 800, 64)
    assert plan_bytes_fraction(p3, 800, 64)[0] < plan_bytes_fraction(plan(False), 800, 64)[0]
    for n in (1500, 2 * N0, 9000):
        assert plan_bytes_fraction(p3, n, 64) == plan_bytes_fraction(plan(False), n, 64)


def test_graphed_host_step_matches_the_eager_one_across_short_tokens() -> None:
    """The captured step's mask buffer holds the extra rows: rows below and past short_tokens, graphed vs eager."""
    from fluxion_lite.model.cuda_graphs import DecodeGraphs
    from fluxion_lite.model.gguf_loader import GGUFModel
    from fluxion_lite.model.transformer import Transformer
    from fluxion_lite.sparse.backend import SparseAttention
    from decode_compare import decode_and_compare, prefill
    from test_decode_fastpath import make_cfg, random_weights

    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    w = random_weights(cfg, seed=4)
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner.graphs = DecodeGraphs(runner, capture=False)
    row = [GroupPlan(False, 16, 0.05), GroupPlan(False, 64, 0.04, True), GroupPlan(False, 32, 0.03, True)]
    p = SparsePlan(16, 48, [row, row], "t", short_tokens=256, long_exact_stream=True)
    backends = [SparseAttention(cfg, p, torch.float32, torch.device("cpu"), max_seqs=4, placement="cpu")
                for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    lengths = [200, 600, 250]  # one row past 2 x short_tokens, two below short_tokens (one crosses it)
    prefill((eager, runner), backends, [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths])
    decode_and_compare(eager, runner, backends, lengths, 9, g, cfg.vocab_size)
    assert backends[1].host_capture is not None and backends[1].state.bias_rows == 2 * len(GVALS) - 1
    assert backends[1].stats()["kv_read_fraction"] == pytest.approx(backends[0].stats()["kv_read_fraction"])
    for a in backends:
        a.executor.close()


def test_per_request_rows_take_the_long_only_rows_of_an_exact_plan() -> None:
    from fluxion_lite.plan.request_plan import RequestPlanner

    planner = RequestPlanner(None, plan(), _tiny_cfg(), [])  # type: ignore[arg-type]  # rows() never asks the predictor
    planner._plans[7] = tuple(a.copy() for a in planner._static)
    rp = planner.rows(object(), [7], torch.device("cpu"))
    assert rp is not None and rp.gidx.tolist() == [[[0, GVALS.index(16), GVALS.index(64) + LONG_ROW_OFFSET]]]


def test_file_format_round_trip_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "p.plan.json"
    plan(False).save(path)
    assert "long_exact_stream" not in path.read_text()  # files of plans without it stay as they were
    plan().save(path)
    back = SparsePlan.load(path)
    assert back.long_exact_stream and back.groups == plan().groups
    assert "(exact sink and window)" in back.explain() and "(block-aligned" in plan(False).explain()
    raw = json.loads(path.read_text())
    raw["long_exact_stream"] = "false"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelFileError, match="long_exact_stream must be true or false"):
        SparsePlan.load(path)


def test_plan_variant_flag_keeps_the_base_choice_unless_given(tmp_path: Path) -> None:
    base, out = tmp_path / "base.plan.json", tmp_path / "v.plan.json"
    plan(False).save(base)
    env = repo_env(ROOT)
    cmd = [sys.executable, str(ROOT / "bench" / "plan_variant.py"), "--base", str(base), "--out", str(out)]
    for extra, want in (([], False), (["--long-exact-stream"], True)):
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert SparsePlan.load(out).long_exact_stream is want
    replace(plan(), long_exact_stream=True).save(base)  # an exact base stays exact
    assert subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120).returncode == 0
    assert SparsePlan.load(out).long_exact_stream


@pytest.mark.parametrize("fused", [False, True])
def test_captured_device_step_matches_the_eager_device_path(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """Device selection, captured step (device_graph) against the eager device path with an exact-streaming plan:
    the device stream kernel reads the long-only rows of the mask (Triton's on a GPU, with fused)."""
    from fluxion_lite.sparse.device import capture as device_graph
    from fluxion_lite.sparse.device.capture import DeviceGraphedDecode
    from decode_compare import decode_and_compare, prefill
    from test_device_graph import _backends, _models

    device = torch.device("cpu")
    if fused:
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv("FLUXION_TRITON", "1" if fused else "0")
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    eager, runner = _models(seed=5, device=device)
    row = [GroupPlan(False, 16, 0.07), GroupPlan(False, 16, 0.05, True), GroupPlan(True)]
    p = SparsePlan(sink=20, window=33, groups=[row, row], source="t", short_tokens=256, long_exact_stream=True)
    backends = _backends(p, eager.cfg, device)
    g = torch.Generator().manual_seed(8)
    lengths = [250, 700, 180]  # below (one crossing) and past short_tokens
    prefill((eager, runner), backends, [torch.randint(0, eager.cfg.vocab_size, (n,), generator=g) for n in lengths])
    decode_and_compare(eager, runner, backends, lengths, 9, g, eager.cfg.vocab_size)
    hooked = backends[1].device_capture
    assert isinstance(hooked, DeviceGraphedDecode) and hooked.ds is not None
    assert hooked.ds.bias.shape[0] == backends[1].state.bias_rows == 2 * len(GVALS) - 1
    assert backends[1].stats()["kv_read_fraction"] == pytest.approx(backends[0].stats()["kv_read_fraction"])
    for a in backends:
        a.executor.close()
