"""The unread-background term in the sparse backend (plan.background, native.background): where its estimate is
exact -- keys equal within each 16-token block, values equal within each 128-token block -- a sparse decode step with
the term is dense attention, in retrieval groups ("retrieval") and streaming groups too ("all"), for CPU and GPU-side
(torch on this CPU) execution of the read part; without the term it is not. The captured step (sparse_graph.py's
host work, run uncaptured on the CPU) gives the eager step's logits with the term. The plan field's file round trip
and the FLUXION_BACKGROUND override."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fluxion_lite.model.attention import SeqChunk, causal_attention
from fluxion_lite.errors import ModelFileError
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from test_hybrid import SPLIT_COSTS, config

LENGTHS = [703, 335]  # prompt tokens: the decode token makes 704 / 336, so the window starts on a 16-token boundary


def _plan(cfg, background: str) -> SparsePlan:  # type: ignore[no-untyped-def]
    """Layer 0: a streaming group and a retrieval group (g = 32); layer 1: retrieval groups at g = 16 and 128."""
    groups = [[GroupPlan(True), GroupPlan(False, 32, 0.05)], [GroupPlan(False, 16, 0.05), GroupPlan(False, 128, 0.2)]]
    return SparsePlan(sink=16, window=48, groups=groups, source="test", background=background)


def _structured(n: int, hkv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [n, Hkv, D], bf16-exact: keys repeat within 16-token blocks, values within 128-token blocks."""
    k = torch.randn(-(-n // 16), hkv, d, generator=gen).repeat_interleave(16, 0)[:n]
    v = torch.randn(-(-n // 128), hkv, d, generator=gen).repeat_interleave(128, 0)[:n]
    return k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()


def _decode_step(background: str, placement: str) -> tuple[torch.Tensor, torch.Tensor, SparseAttention]:
    """One decode step of both sequences after their prompts: (sparse out, dense reference) [L, B, Hq, D]."""
    cfg = config(8, 2, 64, n_layers=2)
    gen = torch.Generator().manual_seed(5)
    attn = SparseAttention(cfg, _plan(cfg, background), torch.float32, torch.device("cpu"), max_seqs=4,
                           placement=placement, costs=SPLIT_COSTS)  # type: ignore[arg-type]
    data = [[_structured(n + 1, cfg.n_kv_heads, cfg.head_dim, gen) for n in LENGTHS] for _ in range(cfg.n_layers)]
    qs = [[torch.randn(n + 1, cfg.n_heads, cfg.head_dim, generator=gen) * 2 for n in LENGTHS]
          for _ in range(cfg.n_layers)]
    for b, n in enumerate(LENGTHS):
        attn.allocate(b)
        for layer in range(cfg.n_layers):
            k, v = data[layer][b]
            attn.attend(layer, qs[layer][b][:n], k[:n], v[:n], [SeqChunk(b, 0, n)])
    chunks = [SeqChunk(b, n, 1) for b, n in enumerate(LENGTHS)]
    out, ref = [], []
    for layer in range(cfg.n_layers):
        q = torch.stack([qs[layer][b][n] for b, n in enumerate(LENGTHS)])
        k = torch.stack([data[layer][b][0][n] for b, n in enumerate(LENGTHS)])
        v = torch.stack([data[layer][b][1][n] for b, n in enumerate(LENGTHS)])
        out.append(attn.attend(layer, q, k, v, chunks))
        ref.append(torch.stack([
            causal_attention(qs[layer][b][n:n + 1], data[layer][b][0].transpose(0, 1),
                             data[layer][b][1].transpose(0, 1), n, cfg.head_dim**-0.5)[0]
            for b, n in enumerate(LENGTHS)]))
    return torch.stack(out), torch.stack(ref), attn


@pytest.mark.parametrize("placement", ["cpu", "gpu"])
def test_background_term_makes_the_sparse_step_dense_where_its_estimate_is_exact(placement: str) -> None:
    r = 4  # query heads per KV group: layer 0's streaming group is heads 0..3
    off, ref, _ = _decode_step("off", placement)
    assert (off - ref).abs().max() > 0.05  # the sparse step alone is far from dense
    ret, ref, _ = _decode_step("retrieval", placement)
    torch.testing.assert_close(ret[1], ref[1], atol=2e-5, rtol=1e-4)  # layer 1: retrieval groups only
    torch.testing.assert_close(ret[0, :, r:], ref[0, :, r:], atol=2e-5, rtol=1e-4)
    assert (ret[0, :, :r] - ref[0, :, :r]).abs().max() > 0.05  # the streaming group has no term here
    every, ref, attn = _decode_step("all", placement)
    torch.testing.assert_close(every, ref, atol=2e-5, rtol=1e-4)
    s = attn.stats()
    assert s["cpu_background_ms"] > 0 and s["kv_read_fraction"] < 0.5
    assert attn.store.value_sums


def test_background_field_round_trips_and_bad_values_are_refused(tmp_path: Path) -> None:
    cfg = config(8, 2, 64, n_layers=2)
    plan = _plan(cfg, "all")
    plan.save(tmp_path / "p.json")
    loaded = SparsePlan.load(tmp_path / "p.json")
    assert loaded.background == "all" and "every group" in loaded.explain()
    _plan(cfg, "off").save(tmp_path / "off.json")
    assert "background" not in (tmp_path / "off.json").read_text()  # plans without it keep their old form
    with pytest.raises(ModelFileError, match="background must be one of off, retrieval, all"):
        dataclasses.replace(plan, background="some").validate(2, 2)


def test_fluxion_background_env_overrides_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    every, _, _ = _decode_step("all", "cpu")
    monkeypatch.setenv("FLUXION_BACKGROUND", "all")
    forced, _, attn = _decode_step("off", "cpu")
    assert attn.plan.background == "all" and torch.equal(forced, every)
    monkeypatch.setenv("FLUXION_BACKGROUND", "everything")
    cfg = config(8, 2, 64, n_layers=2)
    with pytest.raises(ValueError, match="FLUXION_BACKGROUND='everything': use one of off, retrieval, all"):
        SparseAttention(cfg, _plan(cfg, "off"), torch.float32, torch.device("cpu"), max_seqs=2)


@pytest.mark.parametrize("placement", ["cpu", "gpu"])
def test_graphed_step_with_background_matches_eager(placement: str) -> None:
    """The hooked decode (GraphedDecode.host merges the term into the CPU result buffer) against the eager backend:
    all-CPU steps (the one-call path) and all-GPU ones (the term merged into rows whose CPU part is empty)."""
    from fluxion_lite.sparse.cost_model import Costs
    from decode_compare import decode_and_compare, eager_and_hooked, prefill
    from tiny_model import make_cfg

    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    eager, runner = eager_and_hooked(cfg, seed=8)
    groups = [[GroupPlan(False, 16, 0.07), GroupPlan(False, 64, 0.3), GroupPlan(True)],
              [GroupPlan(False, 32, 0.02), GroupPlan(True), GroupPlan(False, 16, 1.0)]]
    plan = SparsePlan(sink=20, window=33, groups=groups, source="test", background="all")
    costs = Costs(cpu_gbs=10.0, gather_gbs=1000.0, h2d_gbs=None, zero_copy=True, pcie_read_gbs=1.0, zc_fixed_s=10.0)
    backends = [SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False, placement=placement,
                                costs=costs, zero_copy=True) for _ in range(2)]  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(12)
    lengths = [250, 700, 180]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts)
    called = []
    hooked = backends[1]
    real = hooked.host_capture._background

    def counted(layer: int, lo: int, hi: int) -> None:
        called.append(layer)
        real(layer, lo, hi)

    hooked.host_capture._background = counted  # type: ignore[method-assign]
    decode_and_compare(eager, runner, backends, lengths, 6, g, cfg.vocab_size)
    assert len(called) == 5 * cfg.n_layers  # every hooked step's layers (the first step runs eagerly)
    s = hooked.stats()
    assert s["cpu_background_ms"] > 0 and (s["gpu_byte_fraction"] == 1.0 if placement == "gpu" else
                                           s["gpu_byte_fraction"] == 0.0)
    for a in backends:
        a.executor.close()


def test_predicted_bytes_count_the_terms_summaries_and_value_sums() -> None:
    """plan_bytes_fraction: the term leaves the KV read as it is and adds to the bytes touched, per group and step,
    D fp32 value sums per 128 tokens, plus the 16-token summaries for a group whose top-k does not scan them."""
    from fluxion_lite.plan.cost import plan_bytes_fraction

    cfg = config(8, 2, 64, n_layers=2)
    n, d = 8192, 64
    full = n * 2 * d * 2  # K+V bytes of one group
    sums, s16 = n / 128 * d * 4, n / 16 * 2 * d * 2
    off = plan_bytes_fraction(_plan(cfg, "off"), n, d)
    # _plan: 4 groups, one streaming, retrieval ones at g = 32, 16 and 128
    for mode, extra in (("retrieval", 3 * sums + 2 * s16), ("all", 4 * sums + 3 * s16)):
        kv, touched = plan_bytes_fraction(_plan(cfg, mode), n, d)
        assert kv == off[0]
        assert touched - off[1] == pytest.approx(extra / full / 4)
    assert "every group" in _plan(cfg, "all").explain()
