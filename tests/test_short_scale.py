"""The short-context budget scale of a sparse plan (SparsePlan.short_scale / short_tokens): the factor itself, the
top-k block counts a decode step derives from it, the pin counts, the predicted read, validation and the file format."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.pins import PinnedBlocks
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan, short_factor
from fluxion_lite.sparse.step import GVALS, build_step, retrieval_tasks
from subprocess_env import repo_env

MODELS = Path(__file__).resolve().parent.parent / "models"
N0 = 1024
BUDGET, G = 0.0625, 16  # budget x n / g is a whole number for every n below that is a multiple of 256


def plan(short_scale: float = 1.0, short_tokens: int = N0, pin_fraction: float = 0.0) -> SparsePlan:
    """One layer: a streaming group, then two retrieval groups (g=16 and g=64)."""
    row = [GroupPlan(True), GroupPlan(False, G, BUDGET), GroupPlan(False, 64, 0.1)]
    return SparsePlan(16, 64, [row], "t", pin_fraction=pin_fraction, short_scale=short_scale,
                      short_tokens=short_tokens)


def step_k(p: SparsePlan, lengths: list[int]) -> np.ndarray:
    """k (blocks) of each retrieval task of one step whose rows hold `lengths` tokens: int64 [rows, 2], the two
    retrieval groups in plan order."""
    key = tuple((i, n - 1) for i, n in enumerate(lengths))
    st = build_step(key, list(range(len(lengths))), p.sink, p.window, 16, 128, torch.device("cpu"),
                    budget_factor=p.budget_factor if p.scales_budgets else None)
    row = p.groups[0]
    gi = np.array([[[GVALS.index(1 if gp.streaming else gp.g) for gp in row]]])  # [1, 1, Hkv]
    g = np.array([[[1 if gp.streaming else gp.g for gp in row]]])
    ret = np.array([[[not gp.streaming for gp in row]]])
    bud = np.array([[[gp.budget for gp in row]]])
    _, _, bi, h, k, _, _ = retrieval_tasks(st, gi, g, ret, bud)
    assert bi.tolist() == np.repeat(np.arange(len(lengths)), 2).tolist() and (h > 0).all()
    return k.reshape(len(lengths), 2)


def test_factor_is_the_scale_up_to_n0_one_from_twice_n0_and_falls_in_between() -> None:
    n = np.arange(1, 4 * N0)
    f = short_factor(n, 1.7, N0)
    assert (f[n <= N0] == 1.7).all() and (f[n >= 2 * N0] == 1.0).all()
    between = f[(n >= N0) & (n <= 2 * N0)]
    assert (np.diff(between) <= 0).all() and (np.diff(between) < 0).any()
    assert float(short_factor(N0 * math.sqrt(2), 1.7, N0)) == pytest.approx(1.35)  # linear in log2(n)
    assert (short_factor(n, 1.0, N0) == 1.0).all()


def test_step_k_is_scale_times_k_up_to_n0_and_unchanged_from_twice_n0() -> None:
    lengths = [512, 768, N0, 2 * N0, 3 * N0]
    plain, scaled = step_k(plan(), lengths), step_k(plan(2.0), lengths)
    assert plain[:, 0].tolist() == [n * BUDGET / G for n in lengths]  # ceil(budget x n / g), no rounding here
    assert scaled[:3, 0].tolist() == (2 * plain[:3, 0]).tolist()  # exactly S x k where k needs no rounding
    assert scaled[:3, 1].tolist() == [math.ceil(2 * 0.1 * n / 64) for n in lengths[:3]]  # else S x the budget
    assert scaled[3:].tolist() == plain[3:].tolist()


def test_step_k_between_n0_and_twice_n0_follows_the_factor() -> None:
    lengths = list(range(N0, 2 * N0 + 1, 64))
    plain, scaled = step_k(plan(), lengths), step_k(plan(2.0), lengths)
    n, f = np.array(lengths)[:, None], short_factor(np.array(lengths), 2.0, N0)[:, None]
    assert scaled.tolist() == np.ceil(np.array([BUDGET, 0.1]) * n * f / np.array([G, 64])).astype(int).tolist()
    assert (plain <= scaled).all() and (scaled <= 2 * plain).all()
    assert (scaled[0] == 2 * plain[0]).all() and (scaled[-1] == plain[-1]).all()
    for n, k in zip(lengths, scaled):  # the plan's own count (pins, printouts) agrees with the step's
        assert [plan(2.0).block_count(gp, n) for gp in plan().groups[0][1:]] == k.tolist()


def test_default_plans_keep_their_block_counts() -> None:
    p = plan()
    st = build_step(((0, 4095),), [0], 16, 64, 16, 128, torch.device("cpu"))
    assert st.budget_scale is None  # no scale: the step multiplies nothing
    assert step_k(p, [4096, 1000]).tolist() == [[math.ceil(b * n / g) for g, b in ((G, BUDGET), (64, 0.1))]
                                               for n in (4096, 1000)]
    for path in MODELS.glob("*.plan.json"):
        raw = json.loads(path.read_text())
        loaded = SparsePlan.load(path)
        assert loaded.short_scale == raw.get("short_scale", 1.0)
        if "short_scale" not in raw:  # a plan file without the fields reads as before: factor 1 everywhere
            assert (loaded.budget_factor(np.array([1, 4096, 10**6])) == 1.0).all()


@pytest.mark.parametrize("field,value", [
    ("short_scale", 0.5), ("short_scale", float("nan")), ("short_scale", float("inf")), ("short_scale", "2"),
    ("short_scale", True), ("short_tokens", 0), ("short_tokens", -8), ("short_tokens", 8192.5),
    ("short_tokens", "8192")])
def test_bad_values_are_rejected_naming_the_field(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        replace(plan(), **{field: value})
    data: dict[str, object] = {"sink": 16, "window": 64, "groups": [[{"streaming": True}]], "short_scale": 2.0,
                               "short_tokens": 4096}
    data[field] = value  # NaN / Infinity go through json as such
    path = tmp_path / "bad.plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelFileError, match=f"bad.plan.json.*{field}"):
        SparsePlan.load(path)
    p = plan()
    setattr(p, field, value)  # set after construction: validate() catches it too
    with pytest.raises(ModelFileError, match=field):
        p.validate(1, 3)


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.plan.json"
    plan(1.7, 8064, pin_fraction=0.75).save(path)
    back = SparsePlan.load(path)
    assert (back.short_scale, back.short_tokens, back.pin_fraction) == (1.7, 8064, 0.75)
    assert back.groups == plan().groups
    assert "x1.7 up to 8064 tokens" in back.explain()
    plan().save(path)  # off: the file is as before the fields existed
    assert "short_scale" not in json.loads(path.read_text())
    assert SparsePlan.load(path).short_scale == 1.0


def test_pin_counts_follow_the_scaled_budget_and_never_exceed_a_step_k() -> None:
    n = 768  # <= N0: factor 2
    p = plan(2.0, pin_fraction=1.0)
    pins = PinnedBlocks(p)
    mass = np.random.default_rng(0).random((3, n))
    pins.pin_by_mass(0, slot=0, mass=mass, n=n)
    assert pins._counts[0, 0].tolist() == [0] + step_k(p, [n])[0].tolist()
    tasks = np.zeros((2, 9), np.int32)  # slot 0, KV heads 1 and 2, k below / above the pinned count
    tasks[:, 2], tasks[:, 4] = (1, 2), (3, 100)
    _, counts = pins.table(0, tasks)
    assert counts.tolist() == [3, int(pins._counts[0, 0, 2])]


def test_predicted_read_grows_below_twice_n0_only() -> None:
    off, on = plan(), plan(1.7)
    for n in (512, N0):
        assert plan_bytes_fraction(on, n, 64)[0] > plan_bytes_fraction(off, n, 64)[0]
    for n in (2 * N0, 8 * N0):
        assert plan_bytes_fraction(on, n, 64) == plan_bytes_fraction(off, n, 64)


def test_plan_variant_sets_keeps_and_checks_the_short_scale(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    base = tmp_path / "base.plan.json"
    plan(1.7, 8064).save(base)
    out = tmp_path / "v.plan.json"
    env = repo_env(root)
    cmd = [sys.executable, str(root / "bench" / "plan_variant.py"), "--base", str(base), "--out", str(out)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)

    assert run().returncode == 0  # no flags: the base plan's scale
    assert (SparsePlan.load(out).short_scale, SparsePlan.load(out).short_tokens) == (1.7, 8064)
    done = run("--short-scale", "2", "--short-tokens", "4096")
    assert done.returncode == 0, done.stderr
    assert "x2 up to 4096 tokens" in done.stdout
    assert (SparsePlan.load(out).short_scale, SparsePlan.load(out).short_tokens) == (2.0, 4096)
    assert SparsePlan.load(out).groups == plan().groups
    for flag, value in (("--short-scale", "0.5"), ("--short-tokens", "0")):
        refused = run(flag, value)
        assert refused.returncode != 0 and flag in refused.stderr


def backend_step(plan: SparsePlan, n: int = 1500) -> tuple[list[int], float]:
    """Through SparseAttention (eager CPU decode, one layer, two KV groups of 16 dims): one decode step after an
    imported n-token context; each retrieval group's k (blocks) and the step's KV read fraction."""
    from fluxion_lite.model.attention import SeqChunk
    from fluxion_lite.model.config import ModelConfig
    from fluxion_lite.sparse.backend import SparseAttention

    cfg = ModelConfig(arch="llama", n_layers=1, d_model=32, d_ff=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=10, context_length=4096, rms_eps=1e-5, rope_theta=10000.0, rope_dim=16,
                      rope_style="interleaved", qkv_bias=False, tied_embeddings=True)
    a = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=2, placement="cpu")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)
    a.allocate(0)
    a.import_kv(0, 0, 0, k, v)
    a.state.prefilling.discard(0)
    a.attend(0, torch.randn(1, 4, 16, generator=g), k[:1], v[:1], [SeqChunk(0, n, 1)])
    st = a.state.step
    assert st is not None
    _, _, _, _, k_blocks, _, _ = retrieval_tasks(st, a.state.gidx[:, None, :], a.state.g[:, None, :],
                                                 a.state.retrieval[:, None, :], a.state.budget[:, None, :])
    read = a.stats()["kv_read_fraction"]
    a.executor.close()
    return k_blocks.tolist(), read


def test_the_scale_reaches_the_decode_steps_of_the_backend() -> None:
    """The same prompt reads more with a short-context scale of 2 than without, and each retrieval group's k is the
    plan's block_count at that length."""
    reads = []
    for scale in (1.0, 2.0):
        plan = SparsePlan(16, 32, [[GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.1)]], "t", short_scale=scale,
                          short_tokens=4096)
        k_blocks, read = backend_step(plan)
        assert k_blocks == [plan.block_count(gp, 1501) for gp in plan.groups[0]]
        reads.append(read)
    stream = (16 + 32) / 1501  # sink + window share, the same in both
    assert reads[1] - stream == pytest.approx(2 * (reads[0] - stream), rel=0.1)
