"""The CPU device's decode path (sparse/host_decode.py) against the hybrid step on the same inputs: with K/V that the
bf16 host store holds exactly, both read the same tokens (sink and window from the store here, from the device slab
there), so every decode layer's output and the read fraction agree; across plans with streaming and retrieval
groups at every block size, pinned blocks, the unread-background term, long-only groups, per-request budgets and a
batch of ragged sequences, and through a mixed step (a prompt chunk beside decode rows)."""
from __future__ import annotations

import pytest
import torch

from test_hybrid import config, mixed_plan, run
from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from fluxion_lite.sparse.backend import SparseAttention


def _plans(cfg) -> dict[str, SparsePlan]:  # type: ignore[no-untyped-def]
    base = mixed_plan(cfg, 0.1)
    long_row = [GroupPlan(True), GroupPlan(False, 32, 0.06), GroupPlan(False, 16, 0.05, True)]
    return {
        "mixed": base,
        "pinned": SparsePlan(sink=8, window=40, groups=base.groups, source="test", pin_fraction=0.3),
        "background": SparsePlan(sink=8, window=40, groups=base.groups, source="test", background="all"),
        "long-only": SparsePlan(16, 64, [long_row] * cfg.n_layers, "test", short_tokens=512),
        "exact-long": SparsePlan(16, 64, [long_row] * cfg.n_layers, "test", short_tokens=512,
                                 long_exact_stream=True),
    }


@pytest.mark.parametrize("name", ["mixed", "pinned", "background", "long-only", "exact-long"])
def test_host_decode_equals_the_hybrid_step(name: str) -> None:
    cfg = config(n_heads=6, n_kv_heads=3) if "long" in name else config()
    p = _plans(cfg)[name]
    lengths, n_dec = [300, 700, 1030], 4
    outs, stats = [], []
    for host in (False, True):
        a = SparseAttention(cfg, p, torch.float32, torch.device("cpu"), max_seqs=4, placement="cpu",
                            host_decode=host)
        assert (a.host_decode is not None) == host
        out, _ = run(a, cfg, lengths, n_dec, seed=3)
        outs.append(out)
        stats.append(a.stats())
        a.executor.close()
    # The background term's mean value of a 128-token block counts the newest token on the host path, which
    # appends it before the layer reads the store; the hybrid step appends it a step later (the window covers it):
    # where a term's block holds that token the two estimates differ slightly.
    tol = 5e-3 if name == "background" else 1e-5
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    assert stats[1]["kv_read_fraction"] == pytest.approx(stats[0]["kv_read_fraction"], rel=1e-6)
    assert stats[1]["streaming_fraction"] == pytest.approx(stats[0]["streaming_fraction"], rel=1e-6)
    assert 0.0 < stats[1]["kv_read_fraction"] < 1.0


def test_host_decode_rows_of_a_mixed_step_equal_the_hybrid_step() -> None:
    """A step that prefills one sequence while two decode: the decode rows' K/V reach the store with the chunk's,
    and the host path attends them from there."""
    cfg = config()
    p = mixed_plan(cfg, 0.1)
    g = torch.Generator().manual_seed(5)
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def exact(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16().float()

    lengths, chunk = [400, 650], 120
    prompt = [(exact(n + 1, hkv, d), exact(n + 1, hkv, d), torch.randn(n + 1, hq, d, generator=g)) for n in lengths]
    new = (exact(chunk, hkv, d), exact(chunk, hkv, d), torch.randn(chunk, hq, d, generator=g))
    results = []
    for host in (False, True):
        a = SparseAttention(cfg, p, torch.float32, torch.device("cpu"), max_seqs=4, placement="cpu",
                            host_decode=host)
        for b, (k, v, q) in enumerate(prompt):
            a.allocate(b)
            n = lengths[b]
            for layer in range(cfg.n_layers):
                a.attend(layer, q[:n], k[:n], v[:n], [SeqChunk(b, 0, n)])
        a.allocate(2)
        chunks = [SeqChunk(0, lengths[0], 1), SeqChunk(2, 0, chunk), SeqChunk(1, lengths[1], 1)]
        per_layer = []
        for layer in range(cfg.n_layers):
            q = torch.cat([prompt[0][2][-1:], new[2], prompt[1][2][-1:]])
            k = torch.cat([prompt[0][0][-1:], new[0], prompt[1][0][-1:]])
            v = torch.cat([prompt[0][1][-1:], new[1], prompt[1][1][-1:]])
            per_layer.append(a.attend(layer, q, k, v, chunks))
        results.append(torch.stack(per_layer))
        a.executor.close()
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_host_decode_needs_a_cpu_device_and_cpu_selection() -> None:
    cfg = config()
    with pytest.raises(ValueError, match="host_decode needs a CPU device and selection='cpu'"):
        SparseAttention(cfg, SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=8, window=40),
                        torch.float32, torch.device("cpu"), max_seqs=2, selection="gpu", host_decode=True)
