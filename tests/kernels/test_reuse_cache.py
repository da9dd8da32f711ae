"""The reuse cache's bookkeeping in device_topk.select_top against a plain-Python model of the policy, over several
steps whose choices overlap: hits (also of blocks that skipped steps), misses taking entries in turn from a
rotating cursor and evicting their blocks, misses beyond the free entries read but not kept, pinned and -inf
blocks never cached. (That cached
entries hold the store's K/V and give the eager path's logits: tests/engine/test_device_graph.py, the reuse cases.)"""
from __future__ import annotations

import math
import pytest
import torch

from fluxion_lite.sparse.device import topk as device_topk
from fluxion_lite.sparse.device.summaries import PINNED_SCORE
from fluxion_lite.sparse.device.reuse_cache import DeviceReuseCache, PolicyModel
from test_device_topk import reference_top

pytestmark = pytest.mark.skipif(device_topk.triton is None, reason="Triton not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on a GPU, else interpreted


@pytest.mark.parametrize("entries_share,nb,width", [(0.5, 64, 10), (1.5, 64, 10), (0.5, 300, 33)])
def test_select_top_keeps_the_cache_like_the_policy(monkeypatch: pytest.MonkeyPatch, entries_share: float,
                                                    nb: int, width: int) -> None:
    monkeypatch.setattr("fluxion_lite.sparse.device.reuse_cache.REUSE_SHARE", entries_share)
    B, hkv = 2, 3
    cache = DeviceReuseCache(n_layers=2, hkv=hkv, g=16, d=8, dtype=torch.bfloat16, device=DEV)
    assert cache.ensure(B, nb, (width // 2, width))  # layer 1 is the wider one
    cache.start_step(("seq", 1))
    entries = cache.owner(1).shape[2]
    assert cache.owner(0).shape[2] < entries
    gen = torch.Generator().manual_seed(nb + width)
    base = torch.randn(B, hkv, nb, generator=gen) * 40.0
    pinned = torch.rand(B, hkv, nb, generator=gen) < 0.1
    models = [[PolicyModel(entries) for _ in range(hkv)] for _ in range(B)]
    k_row = torch.randint(width // 2, width + 3, (B, hkv), generator=gen)
    k_row[1, 2] = 0  # a streaming group
    total_hits = 0
    for step in range(8):  # neighbouring steps: the same scores, a little noise, so most choices repeat
        scores = base + torch.randn(B, hkv, nb, generator=gen) * 8.0
        scores = torch.where(pinned, torch.full_like(scores, PINNED_SCORE), scores)
        scores[..., :2] = float("-inf")
        scores[0, 0, 2:nb - 3] = float("-inf")  # a row with fewer eligible blocks than k
        ids = torch.empty(B, hkv, width, dtype=torch.long, device=DEV)
        vals = torch.empty(B, hkv, width, device=DEV)
        views = cache.views(layer=1, width=width)
        device_topk.select_top(scores.to(DEV), k_row.to(DEV), ids, vals, views)
        ids, entry, hit = ids.cpu(), views.entry.cpu(), views.hit.cpu()
        for b in range(B):
            for h in range(hkv):
                k = min(int(k_row[b, h]), width)
                row = scores[b, h]
                chosen = sorted(reference_top(row.numpy(), k))
                assert ids[b, h, :k].tolist() == chosen  # entries come out in block order
                cacheable = {i for i in chosen if torch.isfinite(row[i]) and not pinned[b, h, i]}
                want_entry, want_hits = models[b][h].step(chosen, cacheable)
                assert entry[b, h, :k].tolist() == [want_entry[i] for i in chosen], (step, b, h)
                assert hit[b, h, :k].tolist() == [int(i in want_hits) for i in chosen]
                assert (entry[b, h, k:] == -1).all() and (hit[b, h, k:] == 0).all()
                held = cache._tensors["held"][1, b, h].cpu()
                assert {i: int(held[i]) for i in torch.nonzero(held >= 0).flatten().tolist()} == models[b][h].held
                assert cache.owner(1)[b, h].tolist() == models[b][h].owner
                assert int(cache._tensors["cursor"][1, b, h]) == models[b][h].cursor
                total_hits += len(want_hits)
    assert total_hits > 0
    assert cache.take_hits() == total_hits and cache.take_hits() == 0
    assert int((cache._tensors["held"][0] >= 0).sum()) == 0  # another layer's state is untouched


def test_a_change_of_sequences_clears_the_cache() -> None:
    cache = DeviceReuseCache(n_layers=1, hkv=1, g=16, d=8, dtype=torch.bfloat16, device=DEV)
    assert cache.ensure(1, 32, (4,))
    cache.start_step((7,))
    scores = torch.arange(32, dtype=torch.float32).view(1, 1, 32).to(DEV)
    ids = torch.empty(1, 1, 4, dtype=torch.long, device=DEV)
    vals = torch.empty(1, 1, 4, device=DEV)
    k = torch.full((1, 1), 4, device=DEV)
    device_topk.select_top(scores, k, ids, vals, cache.views(0, 4))
    assert int((cache._tensors["held"] >= 0).sum()) == 2  # entries: half the width
    cache.start_step((7,))  # same sequence: kept
    assert int((cache._tensors["held"] >= 0).sum()) == 2
    cache.start_step((8,))  # another sequence in the row: cleared
    assert int((cache._tensors["held"] >= 0).sum()) == 0 and int((cache.owner(0) >= 0).sum()) == 0
    serial = cache.serial
    assert cache.ensure(2, 32, (4,)) and cache.serial == serial + 1  # a new structure: reallocated
    assert cache.nbytes() == cache.bytes_for(cache.shape)


def test_a_block_that_skips_a_step_still_hits() -> None:
    cache = DeviceReuseCache(n_layers=1, hkv=1, g=16, d=8, dtype=torch.bfloat16, device=DEV)
    assert cache.ensure(1, 16, (4,))  # two entries
    cache.start_step((1,))
    k = torch.full((1, 1), 1, device=DEV)  # one block per step

    def choose(best: int) -> tuple[int, int]:
        scores = torch.zeros(1, 1, 16)
        scores[0, 0, best] = 5.0
        ids = torch.empty(1, 1, 4, dtype=torch.long, device=DEV)
        vals = torch.empty(1, 1, 4, device=DEV)
        views = cache.views(0, 4)
        device_topk.select_top(scores.to(DEV), k.to(DEV), ids, vals, views)
        return int(views.entry[0, 0, 0]), int(views.hit[0, 0, 0])

    assert choose(3) == (0, 0)  # a miss, kept in entry 0
    assert choose(7) == (1, 0)  # another block: the next entry in turn, block 3 stays
    assert choose(3) == (0, 1)  # back after a step: read from the cache
    # first filled, first refilled (a hit does not renew an entry): entry 0 comes next, block 3 leaves
    assert choose(9) == (0, 0)
    assert choose(7) == (1, 1)  # block 7, filled at the second step, is still there
    assert choose(3) == (1, 0)  # block 3 left: a miss, into entry 1 (block 7 leaves)


def test_reuse_share_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUXION_REUSE_SHARE sizes the entries (an A/B knob); a bad value is an error naming the variable."""
    from fluxion_lite.sparse.device.reuse_cache import REUSE_SHARE, _entries, reuse_share

    monkeypatch.delenv("FLUXION_REUSE_SHARE", raising=False)
    assert reuse_share() == REUSE_SHARE and _entries(100) == math.ceil(REUSE_SHARE * 100)
    monkeypatch.setenv("FLUXION_REUSE_SHARE", "1.5")
    assert reuse_share() == 1.5 and _entries(100) == 150 and _entries(1) == 2
    for bad in ("0", "-1", "abc", "nan", "100"):
        monkeypatch.setenv("FLUXION_REUSE_SHARE", bad)
        with pytest.raises(ValueError, match="FLUXION_REUSE_SHARE"):
            reuse_share()
