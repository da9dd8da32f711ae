"""DeviceSummaries (device_select.py) and the summary kernels (device_kernels.append_token, block_scores): block
min/max stored in bf16 with directed rounding (min toward -inf, max toward +inf), so the Quest bound stays an upper
bound of q.k for every key of a block. Checked against float64 references: an independent directed rounding (from
frexp, not the bit trick the code uses), the exact per-block min/max and the exact max of q.k per block. The kernel
tests run in Triton's interpreter without a GPU (conftest.py), compiled on CUDA."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from fluxion_lite.sparse.device.summaries import DeviceSummaries, round_down_bf16, round_up_bf16

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture()
def dk():  # type: ignore[no-untyped-def]
    """device_kernels, when Triton imports; without CUDA its kernels run in Triton's interpreter."""
    pytest.importorskip("triton")
    from fluxion_lite.sparse.device import kernels as device_kernels
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return device_kernels


def directed_ref(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float64 x (values of fp32) -> the nearest bf16 value toward +inf (up) or -inf, as float64: x / ulp rounded by
    ceil / floor, with ulp the bf16 step at x's binade (8 significant bits; subnormal steps below 2^-126)."""
    _, e = torch.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1: the leading bit is worth 2^(e-1)
    ulp = torch.exp2((e - 8).clamp(min=-133).double())
    steps = torch.ceil(x / ulp) if up else torch.floor(x / ulp)
    return torch.where(torch.isfinite(x), steps * ulp, x)


def block_minmax(keys: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n, Hkv, D] -> exact float64 per-block min, max [Hkv, blocks, D] (the last block may be partial)."""
    n, hkv, d = keys.shape
    pad = torch.full(((-n) % g, hkv, d), float("nan"), dtype=torch.float64)
    blocks = torch.cat([keys.double(), pad]).view(-1, g, hkv, d)  # [blocks, g, Hkv, D]
    mn = blocks.nan_to_num(float("inf")).amin(1).transpose(0, 1)
    mx = blocks.nan_to_num(float("-inf")).amax(1).transpose(0, 1)
    return mn, mx


def block_max_qk(keys: torch.Tensor, q: torch.Tensor, g: int) -> torch.Tensor:
    """keys [n, Hkv, D], q [Hkv, r, D] -> float64 max over each block's keys of q_j . k: [Hkv, r, blocks]."""
    n = keys.shape[0]
    qk = torch.einsum("hrd,nhd->hrn", q.double(), keys.double())
    qk = torch.cat([qk, torch.full((*qk.shape[:2], (-n) % g), float("-inf"), dtype=torch.float64)], dim=2)
    return qk.view(*qk.shape[:2], -1, g).amax(-1)


def per_head_bound(mn: torch.Tensor, mx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Summaries [Hkv, blocks, D] (float64), q [Hkv, r, D] -> sum_d max(q_d mn_d, q_d mx_d): [Hkv, r, blocks]."""
    q = q.double()[:, :, None, :]  # [Hkv, r, 1, D]
    return torch.maximum(q * mn[:, None], q * mx[:, None]).sum(-1)


def test_directed_rounding_matches_a_float64_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-130, 128, (20000,), generator=gen).double())  # every binade, subnormals too
    x = (torch.randn(20000, generator=gen, dtype=torch.float64) * scale).float()
    bf16_max = torch.finfo(torch.bfloat16).max
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, float("inf"), float("-inf"), bf16_max, -bf16_max,
                            3.3e38, -3.3e38, torch.finfo(torch.float32).max, 1e-45, -1e-45, 1.17549435e-38,
                            1.0000001, -1.0000001, 0.99999994, -0.99999994])  # 3.3e38: beyond bf16's max -> inf
    x = torch.cat([x, special, x.bfloat16().float()[:100]])  # bf16 values round to themselves
    x = x[x != 0].float()
    for up, fn in ((False, round_down_bf16), (True, round_up_bf16)):
        got = fn(x)
        assert got.dtype == torch.bfloat16
        want = directed_ref(x.double(), up).float()  # 2^128 (rounding up past bf16's max) -> inf
        assert torch.equal(got.float(), want), (up, x[got.float() != want][:5])
    assert (round_down_bf16(x).double() <= x.double()).all() and (round_up_bf16(x).double() >= x.double()).all()
    nan = torch.tensor([float("nan"), torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32).item()])
    assert round_down_bf16(nan).isnan().all() and round_up_bf16(nan).isnan().all()  # a NaN is not cut to inf
    assert torch.equal(round_down_bf16(torch.tensor([0.0, -0.0])).float(), torch.tensor([0.0, -0.0]))


def test_summaries_survive_growth_and_capacity_stays_near_the_need() -> None:
    hkv, d, g = 2, 8, 16
    ds = DeviceSummaries(n_layers=1, n_kv_heads=hkv, head_dim=d, g=g, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(5000, hkv, d, generator=gen, dtype=torch.float64).float()
    start = 0
    for n in (1000, 37, 3000, 963):  # chunks that end inside a block: the next one merges into it
        ds.append_chunk(0, 0, start, keys[start : start + n])
        start += n
        used = -(-start // g)
        cap = ds.layer(0).shape[2]
        assert used <= cap <= max(64, -(-(used * 5 // 4) // 64) * 64 + 64)  # grown by about a quarter, not doubled
    s = ds.layer(0)
    assert s.dtype == torch.bfloat16 and ds.bytes_used() == s.numel() * 2  # 2 bytes a value (was 4)
    got = s[0, :, : -(-start // g)].double()  # [Hkv, blocks, 2, D]
    mn, mx = block_minmax(keys[:start], g)
    assert torch.equal(got[:, :, 0], directed_ref(mn, up=False))
    assert torch.equal(got[:, :, 1], directed_ref(mx, up=True))


def keys_with_tight_blocks(gen: torch.Generator, n: int, hkv: int, d: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """Keys [n, Hkv, D] with per-dimension scales over many binades (K has outlier dims) and two blocks whose keys
    are all one key, where the bound is exactly q.k: round to nearest would break it there about half the time."""
    scale = torch.exp2(torch.randint(-6, 7, (hkv, d), generator=gen).double())
    keys = (torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) * scale).float()
    keys[g : 2 * g] = keys[g]
    keys[3 * g : 4 * g] = keys[3 * g + 5]
    return keys.to(dtype)


def scenario(gen: torch.Generator, g: int, hkv: int, d: int, dtype: torch.dtype) -> dict[str, Any]:
    """Two sequences (slots 1 and 0): a prefill in chunks that end inside blocks, then decode tokens."""
    lens = [(5 * g + 3, [2 * g + 1, 3 * g + 2]), (4 * g + 7, [4 * g + 7])]  # (prefill length, chunk sizes)
    decode = g + 3  # crosses a block boundary in both sequences
    keys = [keys_with_tight_blocks(gen, n + decode, hkv, d, g, dtype) for n, _ in lens]
    return {"slots": [1, 0], "lens": lens, "decode": decode, "keys": keys}


def prefill(ds: DeviceSummaries, sc: dict[str, Any]) -> None:
    for slot, (_, chunks), keys in zip(sc["slots"], sc["lens"], sc["keys"]):
        start = 0
        for c in chunks:
            ds.append_chunk(0, slot, start, keys[start : start + c].to(ds.device))
            start += c


def check_summaries(ds: DeviceSummaries, sc: dict[str, Any], g: int, q: torch.Tensor) -> None:
    """Stored min <= exact min, stored max >= exact max (tightest bf16 each); the per-head bound from the stored
    summaries >= max q.k over each block's keys, fp32 keys and their bf16 copies in the host store alike."""
    s = ds.layer(0).cpu()
    broken_by_nearest = 0
    for b, (slot, (n, _), keys) in enumerate(zip(sc["slots"], sc["lens"], sc["keys"])):
        n_all = n + sc["decode"]
        nb = -(-n_all // g)
        mn, mx = block_minmax(keys, g)  # [Hkv, nb, D]
        got_mn, got_mx = s[slot, :, :nb, 0].double(), s[slot, :, :nb, 1].double()
        assert (got_mn <= mn).all() and (got_mx >= mx).all()
        assert torch.equal(got_mn, directed_ref(mn, up=False)) and torch.equal(got_mx, directed_ref(mx, up=True))
        if keys.dtype == torch.bfloat16:  # min/max of bf16 keys are bf16: stored exactly
            assert torch.equal(got_mn, mn) and torch.equal(got_mx, mx)
        # float64's own rounding (sums in another order than q.k's) may put a tight bound a hair below q.k: a
        # slack of 1e-12 relative, far below a bf16 step (2^-9 relative), which the nearest check below relies on
        slack = 1e-12 * per_head_bound(-got_mn.abs().maximum(got_mx.abs()), got_mn.abs().maximum(got_mx.abs()), q[b])
        bound = per_head_bound(got_mn, got_mx, q[b]) + slack  # [Hkv, r, nb]
        assert (bound >= block_max_qk(keys, q[b], g)).all()
        assert (bound >= block_max_qk(keys.bfloat16(), q[b], g)).all()  # the keys the store holds (nearest)
        nearest = per_head_bound(mn.bfloat16().double(), mx.bfloat16().double(), q[b]) + slack
        broken_by_nearest += int((nearest < block_max_qk(keys, q[b], g)).sum())
    if sc["keys"][0].dtype == torch.float32:  # the test can tell: round to nearest breaks the bound here
        assert broken_by_nearest > 0


def reference_scores(ds: DeviceSummaries, sc: dict[str, Any], q: torch.Tensor,
                     n_blocks: int) -> torch.Tensor:
    """Quest score in float64 from the stored bf16 summaries: per-head bounds summed over the group's heads."""
    s = ds.layer(0).cpu().double()
    return torch.stack([per_head_bound(s[slot, :, :n_blocks, 0], s[slot, :, :n_blocks, 1], q[b]).sum(1)
                        for b, slot in enumerate(sc["slots"])])  # [B, Hkv, NB]


SHAPES = [(16, 32, 2, torch.float32), (16, 128, 1, torch.bfloat16), (32, 64, 2, torch.float32),
          (64, 32, 3, torch.float32), (16, 64, 2, torch.bfloat16), (32, 128, 2, torch.float32)]


@pytest.mark.parametrize("g,d,hkv,dtype", SHAPES)
def test_torch_path_keeps_the_bound(g: int, d: int, hkv: int, dtype: torch.dtype) -> None:
    """append_chunk (prefill) and append_tokens (decode) of DeviceSummaries, then its scores."""
    gen = torch.Generator().manual_seed(g * d + hkv)
    sc = scenario(gen, g, hkv, d, dtype)
    ds = DeviceSummaries(1, hkv, d, g, torch.device("cpu"))
    prefill(ds, sc)
    for t in range(sc["decode"]):
        pos = torch.tensor([n + t for n, _ in sc["lens"]])
        k = torch.stack([keys[int(p)] for keys, p in zip(sc["keys"], pos)])  # [B, Hkv, D]
        ds.append_tokens(0, torch.tensor(sc["slots"]), pos, max(sc["slots"]), int(pos.max()), k)
    q = torch.randn(2, hkv, 4, d, generator=gen)  # [B, Hkv, r, D]
    check_summaries(ds, sc, g, q)
    nb = -(-max(n for n, _ in sc["lens"]) // g) + 1
    lo, hi = torch.zeros(2, dtype=torch.long), torch.full((2,), nb)
    got = ds.scores(0, q, torch.tensor(sc["slots"]), lo, hi, nb)
    torch.testing.assert_close(got.double(), reference_scores(ds, sc, q, nb), rtol=1e-5, atol=1e-4)


# chunk sizes of one prefill, in units of g plus tokens: whole blocks only (the usual 8192-token chunk), a ragged
# end, starts inside a block, a chunk inside one block, single tokens
CHUNKINGS = [[(2, 0), (3, 0)], [(2, 0), (1, 5), (2, 0)], [(0, 3), (0, 4), (4, 1)], [(0, 1), (0, 1), (1, 0), (3, 9)]]


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("g,d,hkv,dtype", SHAPES[:4])
def test_append_chunk_of_any_alignment_matches_a_float64_reference(chunking: list[tuple[int, int]], g: int, d: int,
                                                                   hkv: int, dtype: torch.dtype) -> None:
    """append_chunk's stored bounds are the directed rounding of each block's exact float64 min / max, whether the
    chunks cover whole blocks (read in place) or start / end inside one (padded with the chunk's own first / last
    key), and for keys that are a non-contiguous view (a slice of a packed qkv-like buffer)."""
    gen = torch.Generator().manual_seed(g + 7 * d + 31 * hkv + 101 * len(chunking))
    sizes = [b * g + t for b, t in chunking]
    n = sum(sizes)
    packed = keys_with_tight_blocks(gen, n, 3 * hkv, d, g, dtype)  # [n, 3 Hkv, D]: k is the middle third
    keys = packed[:, hkv : 2 * hkv]
    assert not keys.is_contiguous()
    ds = DeviceSummaries(1, hkv, d, g, torch.device("cpu"))
    start = 0
    for c in sizes:
        ds.append_chunk(0, 1, start, keys[start : start + c])
        start += c
    mn, mx = block_minmax(keys, g)  # [Hkv, blocks, D]
    nb = mn.shape[1]
    got = ds.layer(0)[1, :, :nb].double()  # [Hkv, nb, 2, D]
    assert torch.equal(got[:, :, 0], directed_ref(mn, up=False))
    assert torch.equal(got[:, :, 1], directed_ref(mx, up=True))


@pytest.mark.parametrize("g,d,hkv,dtype", SHAPES)
def test_kernels_keep_the_bound(dk, g: int, d: int, hkv: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The decode tokens through append_token (the fused step's kernel) instead; block_scores over the result."""
    gen = torch.Generator().manual_seed(g * d + hkv + 1)
    sc = scenario(gen, g, hkv, d, dtype)
    ds = DeviceSummaries(1, hkv, d, g, DEV)
    prefill(ds, sc)
    B, ltot = 2, 8
    ds.reserve(1, max(sc["slots"]), max(n for n, _ in sc["lens"]) // g + 2)
    near = torch.zeros(2, 2, hkv, ltot, d, dtype=dtype, device=DEV)  # [slots, 2, Hkv, Ltot, D]
    stage = torch.zeros(B, 2, hkv, d, dtype=torch.bfloat16, device=DEV)
    slots = torch.tensor(sc["slots"], device=DEV)
    for t in range(sc["decode"]):
        pos = torch.tensor([n + t for n, _ in sc["lens"]])
        k = torch.stack([keys[int(p)] for keys, p in zip(sc["keys"], pos)]).to(DEV)  # [B, Hkv, D]
        dk.append_token(k, torch.zeros_like(k), near, stage, ds.layer(0), slots, pos.to(DEV),
                        torch.full((B,), t % ltot, device=DEV), g)
    q = torch.randn(2, hkv, 4, d, generator=gen)
    check_summaries(ds, sc, g, q)
    nb = -(-max(n for n, _ in sc["lens"]) // g) + 1
    bounds = torch.tensor([[0, 0], [nb, nb]], device=DEV)  # [2, B]: every block eligible
    got = dk.block_scores(q.to(DEV), ds.layer(0), slots, bounds, nb, None,
                          torch.empty(B, hkv, nb, device=DEV)).cpu()
    torch.testing.assert_close(got.double(), reference_scores(ds, sc, q, nb), rtol=1e-5, atol=1e-4)


def test_append_token_kernel_rounds_like_the_torch_helpers(dk) -> None:  # type: ignore[no-untyped-def]
    """Edge values through the kernel's bit trick: zeros, infinities, bf16's largest finite value and beyond, values
    just off a power of two, exact bf16 values; a block's first token, then a second one merged into it."""
    bf16_max = torch.finfo(torch.bfloat16).max
    edge = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 0.99999994, -0.99999994, bf16_max, -bf16_max,
                         3.3e38, -3.3e38, float("inf"), float("-inf"), 1.17549435e-38, -2.5, 3.140625, -7.3e-20])
    gen = torch.Generator().manual_seed(3)
    d, g = 32, 16
    first = torch.cat([edge, torch.randn(d - edge.numel(), generator=gen)])[None, None]  # [B=1, Hkv=1, D]
    second = torch.randn(1, 1, d, generator=gen) * 4
    s = torch.full((1, 1, 2, 2, d), float("nan"), dtype=torch.bfloat16, device=DEV)  # stale contents: reset
    near = torch.zeros(1, 2, 1, 4, d, device=DEV)
    stage = torch.zeros(1, 2, 1, d, dtype=torch.bfloat16, device=DEV)
    zero = torch.zeros(1, dtype=torch.long, device=DEV)
    dk.append_token(first.to(DEV), first.to(DEV), near, stage, s, zero, torch.tensor([g], device=DEV), zero, g)
    got = s[0, 0, 1].cpu()
    assert torch.equal(got[0].float(), round_down_bf16(first[0, 0]).float())
    assert torch.equal(got[1].float(), round_up_bf16(first[0, 0]).float())
    dk.append_token(second.to(DEV), second.to(DEV), near, stage, s, zero, torch.tensor([g + 1], device=DEV), zero, g)
    got = s[0, 0, 1].cpu()
    assert torch.equal(got[0].float(), round_down_bf16(torch.minimum(first, second)[0, 0]).float())
    assert torch.equal(got[1].float(), round_up_bf16(torch.maximum(first, second)[0, 0]).float())


def test_summary_bytes_are_half_of_fp32() -> None:
    """bytes_used counts 2 bytes a value: the 8B shape's per-layer tensor at 32K (2048 blocks of 16) in one slot."""
    ds = DeviceSummaries(n_layers=2, n_kv_heads=8, head_dim=128, g=16, device=torch.device("meta"))
    ds.reserve(2, 0, 2048)
    assert ds.layer(0).shape == (1, 8, 2048, 2, 128)
    assert ds.bytes_used() == 2 * (8 * 2048 * 2 * 128) * 2  # layers * values * bf16


@pytest.mark.parametrize("g,d,hkv,dtype", SHAPES[:3])
def test_midrange_scores_of_both_paths(dk, g: int, d: int, hkv: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """With midrange set (a plan's scoring "midrange"), DeviceSummaries.scores and the block_scores kernel both give
    the summed query heads . (min + max) / 2 of the stored summaries, in float64 terms."""
    gen = torch.Generator().manual_seed(g * d + hkv + 2)
    sc = scenario(gen, g, hkv, d, dtype)
    ds = DeviceSummaries(1, hkv, d, g, DEV)
    ds.midrange = True
    prefill(ds, sc)
    q = torch.randn(2, hkv, 4, d, generator=gen)  # [B, Hkv, r, D]
    nb = -(-max(n for n, _ in sc["lens"]) // g)
    s = ds.layer(0).cpu().double()[torch.tensor(sc["slots"])][:, :, :nb]  # [B, Hkv, NB, 2, D]
    want = torch.einsum("bhd,bhnd->bhn", q.double().sum(2), (s[..., 0, :] + s[..., 1, :]) / 2)
    slots = torch.tensor(sc["slots"], device=DEV)
    lo, hi = torch.zeros(2, dtype=torch.long, device=DEV), torch.full((2,), nb, device=DEV)
    torch.testing.assert_close(ds.scores(0, q.to(DEV), slots, lo, hi, nb).cpu().double(), want, rtol=1e-5, atol=1e-4)
    got = dk.block_scores(q.to(DEV), ds.layer(0), slots, torch.stack([lo, hi]), nb, None,
                          torch.empty(2, hkv, nb, device=DEV), midrange=True).cpu()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
