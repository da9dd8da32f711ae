"""Hybrid CPU/GPU execution on a CPU-only machine (the "GPU" side is torch on the CPU): any split of the retrieval
tasks gives the all-CPU output; full budget equals dense attention; device-side selection matches. Tiny random shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.model.attention import SeqChunk, causal_attention
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.engine.engine import fixed_plan, make_attention
from fluxion_lite.sparse.attend import block_attention, lse_merge
from fluxion_lite.sparse.cost_model import Costs
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan

# equal CPU and "PCIe" speed and a cheap gather: the scheduler splits the volume about evenly
SPLIT_COSTS = Costs(cpu_gbs=10.0, gather_gbs=1000.0, h2d_gbs=10.0)


def config(n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32, n_layers: int = 2) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=n_layers, d_model=n_heads * head_dim, d_ff=64, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=10, context_length=4096, rms_eps=1e-5,
                       rope_theta=1e4, rope_dim=head_dim, rope_style="interleaved")


def mixed_plan(cfg: ModelConfig, budget: float) -> SparsePlan:
    """Per layer: one streaming group when there are several, the others retrieval with varied g."""
    gs = (16, 32, 64, 128)
    groups = [[GroupPlan(True) if (h == 0 and cfg.n_kv_heads > 1 and layer == 0) else
               GroupPlan(False, gs[(layer + h) % 4], budget) for h in range(cfg.n_kv_heads)]
              for layer in range(cfg.n_layers)]
    return SparsePlan(sink=8, window=40, groups=groups, source="test")


def run(attn: object, cfg: ModelConfig, lengths: list[int], n_decode: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """Prefill random K/V for each sequence, then decode n_decode tokens for all of them together.
    Returns decode outputs [n_decode, L, B, Hq, D] and, for the dense reference, the K/V/q per layer."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    total = [n + n_decode for n in lengths]
    def bf16_exact(*shape: int) -> torch.Tensor:  # values the bf16 host store holds exactly: no rounding noise
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).float()

    kv = [[(bf16_exact(t, hkv, d), bf16_exact(t, hkv, d)) for t in total] for _ in range(L)]
    qs = [[torch.randn(t, hq, d, generator=gen) * 2 for t in total] for _ in range(L)]
    for b, n in enumerate(lengths):
        attn.allocate(b)  # type: ignore[attr-defined]
        for s in range(0, n, 100):
            e = min(n, s + 100)
            for layer in range(L):
                k, v = kv[layer][b]
                attn.attend(layer, qs[layer][b][s:e], k[s:e], v[s:e], [SeqChunk(b, s, e - s)])  # type: ignore[attr-defined]
    outs = []
    for i in range(n_decode):
        chunks = [SeqChunk(b, n + i, 1) for b, n in enumerate(lengths)]
        per_layer = []
        for layer in range(L):
            q = torch.stack([qs[layer][b][n + i] for b, n in enumerate(lengths)])
            k = torch.stack([kv[layer][b][0][n + i] for b, n in enumerate(lengths)])
            v = torch.stack([kv[layer][b][1][n + i] for b, n in enumerate(lengths)])
            per_layer.append(attn.attend(layer, q, k, v, chunks))  # type: ignore[attr-defined]
        outs.append(torch.stack(per_layer))
    return torch.stack(outs), [kv, qs]


def dense_reference(cfg: ModelConfig, lengths: list[int], n_decode: int, data: list) -> torch.Tensor:
    kv, qs = data
    out = torch.empty(n_decode, cfg.n_layers, len(lengths), cfg.n_heads, cfg.head_dim)
    for i in range(n_decode):
        for layer in range(cfg.n_layers):
            for b, n in enumerate(lengths):
                p = n + i
                k, v = kv[layer][b]
                kk, vv = (x[: p + 1].transpose(0, 1) for x in (k, v))
                out[i, layer, b] = causal_attention(qs[layer][b][p : p + 1], kk, vv, p, cfg.head_dim**-0.5)[0]
    return out


@pytest.mark.parametrize("placement", ["cpu", "gpu", "auto"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (3, 3)])
def test_full_budget_equals_dense_for_every_placement(placement: str, heads: tuple[int, int]) -> None:
    cfg = config(*heads)
    lengths, n_dec = [700, 333], 3
    attn = SparseAttention(cfg, mixed_plan(cfg, 1.0), torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False,
                           placement=placement, costs=SPLIT_COSTS)  # type: ignore[arg-type]
    out, data = run(attn, cfg, lengths, n_dec)
    ref = dense_reference(cfg, lengths, n_dec, data)
    # layer 0's streaming group reads only sink + window; every other group reads everything
    assert torch.allclose(out[:, 1], ref[:, 1], atol=1e-4, rtol=1e-4)
    retrieval_heads = slice(cfg.gqa_ratio, None) if cfg.n_kv_heads > 1 else slice(None)
    assert torch.allclose(out[:, 0, :, retrieval_heads], ref[:, 0, :, retrieval_heads], atol=1e-4, rtol=1e-4)
    s = attn.stats()
    if placement == "gpu":
        assert s["gpu_byte_fraction"] == 1.0
    if placement == "cpu":
        assert s["gpu_byte_fraction"] == 0.0
    if placement == "auto":
        assert 0.2 < s["gpu_byte_fraction"] < 0.8  # the scheduler really split the tasks


def test_hybrid_split_matches_all_cpu_at_sparse_budget() -> None:
    cfg = config(8, 2, 64, n_layers=3)
    lengths, n_dec = [900, 1300, 500], 4
    outs = {}
    for placement in ("cpu", "gpu", "auto"):
        attn = SparseAttention(cfg, mixed_plan(cfg, 0.1), torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False,
                               placement=placement, costs=SPLIT_COSTS)  # type: ignore[arg-type]
        outs[placement], _ = run(attn, cfg, lengths, n_dec, seed=1)
        s = attn.stats()
        assert s["steps"] == n_dec - 1  # the first decode call finishes the prefill, then steps are counted
        assert 0.0 <= s["gpu_wait_ratio"] <= 1.0 and s["cpu_topk_ms"] > 0
        assert s["kv_read_fraction"] < 0.5
    assert torch.allclose(outs["gpu"], outs["cpu"], atol=1e-4)
    assert torch.allclose(outs["auto"], outs["cpu"], atol=1e-4)


def test_device_selection_matches_native_selection() -> None:
    cfg = config(4, 2, 32)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=16, window=64)
    lengths, n_dec = [1000, 600], 4
    native_sel = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), 4, host_decode=False, placement="gpu", costs=SPLIT_COSTS)
    device_sel = make_attention("gpu-sparse", cfg, torch.float32, torch.device("cpu"), 4, "synthetic", plan=plan)
    a, _ = run(native_sel, cfg, lengths, n_dec, seed=2)
    b, _ = run(device_sel, cfg, lengths, n_dec, seed=2)
    # same Quest bound, fp32 on both sides: the same blocks, so the same output (ties aside)
    assert torch.allclose(a, b, atol=1e-4)
    assert device_sel.stats()["gpu_byte_fraction"] == 1.0


@pytest.mark.parametrize("host_decode", (False, True), ids=("hybrid", "host"))
def test_host_store_receives_decode_tokens_completely(host_decode: bool) -> None:
    """The hybrid step appends a decode token one step late (its streaming part reads the device slab meanwhile);
    the host decode path appends it before the layer reads the store."""
    cfg = config()
    assert make_attention("fixed", cfg, torch.float32, torch.device("cpu"), 2, "synthetic").host_decode is not None
    attn = SparseAttention(cfg, fixed_plan(cfg), torch.float32, torch.device("cpu"), max_seqs=2, placement="cpu",
                           host_decode=host_decode)  # host decode: the default on a CPU device
    lengths, n_dec = [300], 3
    _, data = run(attn, cfg, lengths, n_dec)
    assert attn.store.n_tokens(0, 0) == (303 if host_decode else 302)  # hybrid: the last token still queued
    attn.flush()
    k, v = attn.store.read(1, 0)
    assert k.shape[0] == 303
    assert torch.equal(k.float(), data[0][1][0][0].to(torch.bfloat16).float())
    attn.free(0)
    assert attn.store.bytes_used == 0


def test_modes_build_and_full_host_reads_everything() -> None:
    cfg = config()
    for mode in ("full", "full-gpu", "full-host", "fixed", "gpu-sparse"):
        make_attention(mode, cfg, torch.float32, torch.device("cpu"), 2, "synthetic")
    attn = make_attention("full-host", cfg, torch.float32, torch.device("cpu"), 2, "synthetic")
    out, data = run(attn, cfg, [800], 2)
    ref = dense_reference(cfg, [800], 2, data)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert attn.stats()["kv_read_fraction"] == pytest.approx(1.0)


def test_block_attention_and_merge_equal_one_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 10, 16, generator=gen), torch.randn(3, 10, 16, generator=gen)
    lens = torch.tensor([10, 4, 0])
    o, lse = block_attention(q, k, v, lens, 0.25)
    assert torch.isinf(lse[2]).all() and (o[2] == 0).all()  # empty task: weight 0 in a merge
    # split task 0's keys in two parts and merge: same as one softmax
    o1, l1 = block_attention(q[:1], k[:1, :6], v[:1, :6], torch.tensor([6]), 0.25)
    o2, l2 = block_attention(q[:1], k[:1, 6:], v[:1, 6:], torch.tensor([4]), 0.25)
    assert torch.allclose(lse_merge(o1, l1, o2, l2), o[:1], atol=1e-5)
    ref = torch.softmax(q[1] @ k[1, :4].T * 0.25, -1) @ v[1, :4]
    assert torch.allclose(o[1], ref, atol=1e-5)
    assert np.isfinite(lse_merge(o[2:], lse[2:], o[:1], lse[:1]).numpy()).all()


def test_mixed_prefill_decode_step_leaves_no_timer_marks_for_the_next_step() -> None:
    """A call with a prefill chunk and a decode row times its decode part but is not a counted step: its marks must
    be dropped at its last layer, or the next decode step would be charged for them (GPU wait > step time)."""
    cfg = config(8, 2, 64, n_layers=2)
    attn = SparseAttention(cfg, mixed_plan(cfg, 0.1), torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False,
                           placement="auto", costs=SPLIT_COSTS)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn.allocate(0)
    attn.allocate(1)
    for layer in range(cfg.n_layers):  # sequence 0: 600 tokens of prefill
        attn.attend(layer, torch.randn(600, hq, d, generator=gen), torch.randn(600, hkv, d, generator=gen),
                    torch.randn(600, hkv, d, generator=gen), [SeqChunk(0, 0, 600)])
    for layer in range(cfg.n_layers):  # one call: sequence 0 decodes while sequence 1 prefills
        attn.attend(layer, torch.randn(101, hq, d, generator=gen), torch.randn(101, hkv, d, generator=gen),
                    torch.randn(101, hkv, d, generator=gen), [SeqChunk(0, 600, 1), SeqChunk(1, 0, 100)])
    assert attn.timer._marks == [] and attn.timer._spans == []
    for i in range(2):  # the first ends sequence 1's prefill (a mixed call again); the second is a decode step
        for layer in range(cfg.n_layers):
            attn.attend(layer, torch.randn(2, hq, d, generator=gen), torch.randn(2, hkv, d, generator=gen),
                        torch.randn(2, hkv, d, generator=gen), [SeqChunk(0, 601 + i, 1), SeqChunk(1, 100 + i, 1)])
        assert attn.timer._marks == []
    s = attn.stats()
    assert s["steps"] == 1 and 0.0 <= s["gpu_wait_ms"] <= s["step_ms"]
    attn.executor.close()


def test_streaming_fraction_counts_the_groups_decode_actually_streamed() -> None:
    cfg = config(8, 2, 64, n_layers=3)
    plan = mixed_plan(cfg, 0.1)  # 1 streaming group of 6
    attn = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False)
    run(attn, cfg, [700, 300], 3, seed=2)
    assert attn.stats()["streaming_fraction"] == pytest.approx(1 / 6) == pytest.approx(plan.streaming_fraction)
    attn.reset_stats()
    assert attn.stats()["streaming_fraction"] == plan.streaming_fraction  # no decode yet: the plan's own share
    attn.executor.close()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("b,hkv,r,n_keys,d", [(1, 2, 6, 100, 128), (3, 2, 7, 515, 64), (2, 3, 3, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_biased_attention_matches_float64(b: int, hkv: int, r: int, n_keys: int, d: int, dtype: torch.dtype,
                                          device: str) -> None:
    """The streaming part against float64 softmax attention: bf16 within 3x the rounding floor of the exact output
    (sharp scores, as the sink gives), fp32 and fp64 tight; the LSE too. Each row attends a random subset. On CUDA
    the keys come as a device slab's K half (a non-contiguous view), as the engine passes them."""
    from fluxion_lite.sparse.attend import biased_attention
    g = torch.Generator().manual_seed(b * 1000 + n_keys)
    q = (torch.randn(b, hkv, r, d, generator=g) * 2.5).to(dtype)
    k = (torch.randn(b, hkv, n_keys, d, generator=g) * 2.5).to(dtype)
    v = torch.randn(b, hkv, n_keys, d, generator=g).to(dtype)
    keep = torch.rand(b, hkv, 1, n_keys, generator=g) < 0.6
    keep[..., 0] = True  # at least one attended slot per row
    bias = torch.zeros(b, hkv, 1, n_keys).masked_fill_(~keep, float("-inf"))
    scores = q.double() @ k.double().transpose(-1, -2) * d**-0.5 + bias.double()
    want_lse = torch.logsumexp(scores, dim=-1)
    want = torch.softmax(scores, dim=-1) @ v.double()
    slab = torch.stack([k, v], dim=1).to(device)  # [B, 2, Hkv, L, D]
    out, lse = biased_attention(q.to(device), slab[:, 0], slab[:, 1], bias.to(device), d**-0.5)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.float32 or dtype == torch.float64
    err = ((out.double() - want).norm() / want.norm()).item()
    if dtype == torch.bfloat16:
        floor = ((want.bfloat16().double() - want).norm() / want.norm()).item()
        assert err < 3 * floor
        assert (lse.double() - want_lse).abs().max() < 2e-3
    else:
        assert err < 1e-5
        assert (lse.double() - want_lse).abs().max() < 1e-4


@pytest.mark.parametrize("t,r,n_keys,d", [(1, 6, 100, 128), (5, 7, 515, 64), (3, 3, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", DEVICES)
def test_block_attention_matches_float64(t: int, r: int, n_keys: int, d: int, dtype: torch.dtype, device: str) -> None:
    """The GPU tasks' attention over gathered blocks (padding masked) against float64: bf16 within 3x the rounding
    floor of the exact output, so the scores stay fp32 (a bf16 matmul's scores fail this on sharp rows)."""
    from fluxion_lite.sparse.attend import block_attention
    g = torch.Generator().manual_seed(t * 100 + n_keys)
    q = (torch.randn(t, r, d, generator=g) * 2.5).to(dtype)
    k = (torch.randn(t, n_keys, d, generator=g) * 2.5).to(dtype)
    v = torch.randn(t, n_keys, d, generator=g).to(dtype)
    lens = torch.randint(1, n_keys + 1, (t,), generator=g)
    out, lse = block_attention(q.to(device), k.to(device), v.to(device), lens.to(device), d**-0.5)
    out, lse = out.cpu(), lse.cpu()
    for i in range(t):
        n = int(lens[i])
        scores = q[i].double() @ k[i, :n].double().T * d**-0.5  # [r, n]
        want = torch.softmax(scores, dim=-1) @ v[i, :n].double()
        err = ((out[i].double() - want).norm() / want.norm()).item()
        if dtype == torch.bfloat16:
            assert err < 3 * ((want.bfloat16().double() - want).norm() / want.norm()).item()
        else:
            assert err < 1e-5
        assert (lse[i].double() - torch.logsumexp(scores, dim=-1)).abs().max() < 2e-3
