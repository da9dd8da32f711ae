"""The unread-background term on the device (device_background.py) and the device value sums it reads
(device_select.DeviceSummaries with value_sums): against the float64 reference computed token by token from the
keys and values (native_reference.background) and against the native term over a host store holding the same
tokens, across head_dim, GQA ratio, ragged lengths (a partial last 128-token block), gaps and selections (none,
some, all); the value sums against float64 sums whatever the chunking; and the in-place merges the captured step
folds the term in with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from fluxion_lite.hostkv import native
from fluxion_lite.sparse.device.background import background_term, merge_into_partial, merge_normalised, selected_blocks
from fluxion_lite.sparse.device.summaries import DeviceSummaries
from fluxion_lite.hostkv.store import HostKVStore
from fluxion_lite.sparse.attend import lse_merge

CPU = torch.device("cpu")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("chunks", [[(0, 300)], [(0, 5), (5, 123), (128, 1), (129, 200)], [(0, 17), (17, 1)]])
def test_value_sums_match_float64_sums_of_the_stored_values(chunks: list[tuple[int, int]]) -> None:
    """Prefill chunks of any alignment, then single tokens (append_tokens, two rows at once): each 128-token sum is
    the float64 sum of the bf16-rounded values, the partial last block included."""
    hkv, d = 2, 24
    gen = torch.Generator().manual_seed(len(chunks))
    ds = DeviceSummaries(1, hkv, d, 16, CPU, value_sums=True)
    total = sum(c for _, c in chunks)
    steps = 140  # crosses a 128-token boundary while decoding
    v = [torch.randn(total + steps, hkv, d, generator=gen) for _ in range(2)]
    k = [torch.randn(total + steps, hkv, d, generator=gen) for _ in range(2)]
    for slot in range(2):
        for start, c in chunks:
            ds.append_chunk(0, slot, start, k[slot][start:start + c], v[slot][start:start + c])
    for t in range(total, total + steps):
        pos = torch.tensor([t, t])
        ds.append_tokens(0, torch.tensor([0, 1]), pos, 1, t, torch.stack([k[0][t], k[1][t]]),
                         torch.stack([v[0][t], v[1][t]]))
    n = total + steps
    for slot in range(2):
        vals = _bf16(v[slot]).double().numpy()
        want = np.stack([vals[b:b + 128].sum(axis=0) for b in range(0, n, 128)], axis=1)  # [Hkv, blocks, D]
        got = ds.layer_values(0)[slot, :, :want.shape[1]].double().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_value_sums_need_the_values() -> None:
    ds = DeviceSummaries(1, 2, 8, 16, CPU, value_sums=True)
    with pytest.raises(ValueError, match="values are needed"):
        ds.append_chunk(0, 0, 0, torch.randn(20, 2, 8))
    assert DeviceSummaries(1, 2, 8, 16, CPU).bytes_used() == 0  # no sums without value_sums


def _gaps(n: int, rng: np.random.Generator) -> tuple[int, int]:
    """A gap [lo, hi) between sink and window, 16-aligned as a g = 16 group's (or empty)."""
    lo = int(rng.choice([0, 16, 32, 48]))
    hi = max(lo, (n - int(rng.integers(20, 120))) // 16 * 16)
    return lo, hi


@pytest.mark.parametrize("d,ratio,lengths", [(64, 7, [1000, 333]), (128, 4, [515, 2048]), (48, 1, [260, 129])])
def test_background_term_matches_the_float64_reference_and_the_native_term(d: int, ratio: int,
                                                                            lengths: list[int]) -> None:
    hkv, g = 2, 16
    rng = np.random.default_rng(d + ratio)
    gen = torch.Generator().manual_seed(d)
    n_blocks = -(-max(lengths) // 128) * 8 + 8  # room past the longest row: blocks beyond n are never background
    ds = DeviceSummaries(1, hkv, d, g, CPU, value_sums=True)
    store = HostKVStore(1, hkv, d, max_seqs=4, granularities=(16,), value_sums=True)
    keys, values, slots = [], [], []
    for n in lengths:
        k, v = _bf16(torch.randn(n, hkv, d, generator=gen)), _bf16(torch.randn(n, hkv, d, generator=gen))
        keys.append(k)
        values.append(v)
        slot = store.allocate()
        slots.append(slot)
        ds.append_chunk(0, slot, 0, k, v)
        store.append(0, slot, k.to(torch.bfloat16), v.to(torch.bfloat16))
    ds.reserve(1, max(slots), n_blocks)
    B = len(lengths)
    q = torch.randn(B, hkv * ratio, d, generator=gen) * 2
    scale = d**-0.5
    for mode in ("none", "some", "all"):
        bounds = np.zeros((2, B, hkv), np.int64)
        selected = torch.zeros(B, hkv, n_blocks, dtype=torch.bool)
        tasks, ids_rows, exclude = [], [], []
        for b, n in enumerate(lengths):
            for h in range(hkv):
                lo, hi = _gaps(n, rng)
                bounds[:, b, h] = lo // 16, hi // 16
                span = np.arange(lo // 16, hi // 16)
                pick = {"none": span[:0], "all": span,
                        "some": np.sort(rng.choice(span, size=len(span) // 3, replace=False))}[mode]
                selected[b, h, pick] = True
                tasks.append(native.make_tasks(slots[b], b, h, g, 0, exclude=[(0, lo), (hi, n)]))
                ids_rows.append(pick.astype(np.int32))
                exclude.append([(0, lo), (hi, n)])
        o, lse = background_term(q.view(B, hkv, ratio, d), ds.layer(0), ds.layer_values(0), torch.tensor(slots),
                                 torch.tensor(lengths), torch.from_numpy(bounds), selected, n_blocks, scale)
        k_cap = max(1, max(len(i) for i in ids_rows))
        ids = np.zeros((len(tasks), k_cap), np.int32)
        for i, row in enumerate(ids_rows):
            ids[i, :len(row)] = row
        counts = np.array([len(i) for i in ids_rows], np.int32)
        n_o, n_l = native.background(store.view(0), q.numpy(), np.concatenate(tasks), ids, counts, scale)
        for b, n in enumerate(lengths):
            for h in range(hkv):
                t = b * hkv + h
                want_o, want_l = ref.background(q[b, h * ratio:(h + 1) * ratio].double().numpy(),
                                                keys[b][:, h].double().numpy(), values[b][:, h].double().numpy(),
                                                g, exclude[t], ids_rows[t], scale)
                got_o, got_l = o[b, h].double().numpy(), lse[b, h].double().numpy()
                if np.isinf(want_l).all():
                    assert np.isneginf(got_l).all() and not got_o.any() and np.isneginf(n_l[t]).all()
                    continue
                tol = 2e-4 * max(1.0, np.abs(want_l).max())
                np.testing.assert_allclose(got_l, want_l, rtol=0, atol=tol)
                np.testing.assert_allclose(got_o, want_o, rtol=0, atol=2e-4)
                np.testing.assert_allclose(got_l, n_l[t], rtol=0, atol=tol)  # the native term, same tokens
                np.testing.assert_allclose(got_o, n_o[t], rtol=0, atol=2e-4)
        if mode == "all":
            assert torch.isneginf(lse).all()  # every gap block read: no background anywhere


def test_background_term_rejects_a_block_count_off_the_128_token_grid() -> None:
    ds = DeviceSummaries(1, 1, 8, 16, CPU, value_sums=True)
    ds.reserve(1, 0, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        background_term(torch.randn(1, 1, 2, 8), ds.layer(0), ds.layer_values(0), torch.tensor([0]),
                        torch.tensor([100]), torch.zeros(2, 1, 1, dtype=torch.long), None, 12, 0.3)


def test_selected_blocks_counts_valid_entries_only_whatever_their_order_and_repeats() -> None:
    ids = torch.tensor([[[5, 0, 2, 0, 0]]])  # invalid entries share block 0, a valid one holds it too
    valid = torch.tensor([[[True, True, True, False, False]]])
    got = selected_blocks(ids, valid, 8)
    assert got[0, 0].tolist() == [True, False, True, False, False, True, False, False]
    assert not selected_blocks(ids, torch.zeros_like(valid), 8).any()


def test_merges_fold_a_term_in_as_lse_merge_does_with_empty_sides() -> None:
    gen = torch.Generator().manual_seed(1)
    o_a, o_b = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    lse_a, lse_b = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    lse_a[0, :2] = float("-inf")  # an empty partial
    lse_b[1, :3] = float("-inf")  # an empty term
    lse_a[2, 0] = lse_b[2, 0] = float("-inf")  # both empty: stays empty
    o_a[0, :2] = 0.0
    both = lse_merge(o_a, lse_a, o_b, lse_b)
    live = torch.isfinite(torch.logaddexp(lse_a, lse_b))
    # normalised partial
    o, lse = o_a.clone(), lse_a.clone()
    merge_normalised(o, lse, o_b, lse_b)
    torch.testing.assert_close(o[live], both[live])
    torch.testing.assert_close(lse, torch.logaddexp(lse_a, lse_b))
    assert torch.isneginf(lse[2, 0])
    # unnormalised partial (o not divided by l, running max m and sum l): o_a stands for m = lse_a - 1, l = e
    m, l = lse_a - 1.0, torch.full_like(lse_a, float(np.e))
    o_un = o_a * l[..., None]
    l = torch.where(torch.isfinite(lse_a), l, torch.zeros_like(l))
    o_un[~torch.isfinite(lse_a)] = 0.0
    merge_into_partial(o_un, m, l, o_b, lse_b)
    torch.testing.assert_close((o_un / l[..., None])[live], both[live])
    torch.testing.assert_close((m + torch.log(l))[live], torch.logaddexp(lse_a, lse_b)[live])
    assert l[2, 0] == 0 and not o_un[2, 0].any()
