"""The device pin cache's pool (fluxion_lite/sparse/device/pin_cache.py) on the CPU: entries follow slots, not rows; a batch change
reads the new slot's blocks only; the copied blocks equal the host store's; the index points each row at them."""
from __future__ import annotations

import numpy as np
import torch

from fluxion_lite.sparse.device.pin_cache import DevicePinPool
from fluxion_lite.plan.pins import PinnedBlocks
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from paged_span import paged_store

L, HKV, D, G, P = 2, 3, 8, 16, 64  # layers, KV heads, head dim, block tokens, page tokens


def make_pins(n_slots: int, n_tokens: int, seed: int) -> PinnedBlocks:
    groups = [[GroupPlan(False, G, 0.2), GroupPlan(True), GroupPlan(False, G, 0.4)] for _ in range(L)]
    pins = PinnedBlocks(SparsePlan(16, 32, groups, "t", pin_fraction=0.5, obs_window=4))
    rng = np.random.default_rng(seed)
    for slot in range(n_slots):
        for layer in range(L):
            pins.pin_by_mass(layer, slot, rng.random((HKV, n_tokens)), n_tokens + 1)
    return pins


def test_pool_entries_follow_slots_and_batch_changes_copy_only_new_pins() -> None:
    n_tokens, n_slots = 256, 4
    pins = make_pins(n_slots, n_tokens, seed=1)
    # every (layer, slot) one "slot" of the helper's span: its tables [L * S, pages] viewed [L, S, pages]
    span, tables, kv = paged_store(torch.Generator().manual_seed(2), L * n_slots, HKV, D, P, n_tokens // P,
                                   torch.float32)
    tables = tables.view(L, n_slots, -1)
    kv = kv.view(L, n_slots, 2, HKV, n_tokens, D)  # [L, S, K/V, Hkv, n, D]
    pool = DevicePinPool(G, HKV, D, P, torch.float32, torch.device("cpu"), share=0.5)
    nb = n_tokens // G
    count = {s: len(pins.slot_blocks(s)[0]) for s in range(n_slots)}
    assert all(c > 0 for c in count.values())

    def step(rows: list[int], key: tuple[object, ...]) -> tuple[torch.Tensor, tuple[object, ...]]:
        slots = np.array(rows)
        pool.reserve(pins, slots)
        pool.fill(span, tables)
        pin_slot = torch.full((L, len(rows), HKV, nb), -1, dtype=torch.int32)
        return pin_slot, pool.index(pin_slot, slots, key)

    pin_slot, key = step([0, 1, 2], ())
    assert pool.blocks_copied == count[0] + count[1] + count[2]
    entries_of_1 = pool.held[1].entry.copy()
    # every pinned block of every row points at an entry holding its K and V; nothing else is indexed
    mask = torch.from_numpy(pins.mask(np.array([0, 1, 2]), nb))
    assert torch.equal(pin_slot >= 0, mask)
    for layer, row, h, blk in torch.nonzero(mask).tolist():
        slot = [0, 1, 2][row]
        c = int(pin_slot[layer, row, h, blk])
        assert pool.kv is not None
        torch.testing.assert_close(pool.kv[c, 0], kv[layer, slot, 0, h, blk * G:(blk + 1) * G], rtol=0, atol=0)
        torch.testing.assert_close(pool.kv[c, 1], kv[layer, slot, 1, h, blk * G:(blk + 1) * G], rtol=0, atol=0)
    assert len(np.unique(np.concatenate([e.entry for e in pool.held.values()]))) == sum(count[s] for s in (0, 1, 2))

    copied = pool.blocks_copied
    pin_slot, key = step([2, 1], key)  # 0 ends, rows reorder: no copies, slot 1 keeps its entries
    assert pool.blocks_copied == copied and 0 not in pool.held
    assert np.array_equal(pool.held[1].entry, entries_of_1)
    assert torch.equal(pin_slot >= 0, torch.from_numpy(pins.mask(np.array([2, 1]), nb)))

    serial = pool.serial
    pin_slot, key = step([2, 1, 3], key)  # 3 arrives: only its pins are read, into entries 0 gave back
    assert pool.blocks_copied == copied + count[3]
    assert pool.serial == serial or count[3] > count[0]  # no regrowth when the freed entries suffice
    for layer, row, h, blk in torch.nonzero(pin_slot[:, 2:] >= 0).tolist():
        c = int(pin_slot[layer, 2, h, blk])
        torch.testing.assert_close(pool.kv[c, 0], kv[layer, 3, 0, h, blk * G:(blk + 1) * G], rtol=0, atol=0)

    rng = np.random.default_rng(9)  # slot 2's pins change: its blocks are read again, the others' are not
    for layer in range(L):
        pins.pin_by_mass(layer, 2, rng.random((HKV, n_tokens)), n_tokens + 1)
    copied = pool.blocks_copied
    pin_slot, key = step([2, 1, 3], key)
    assert pool.blocks_copied == copied + len(pins.slot_blocks(2)[0])
    assert torch.equal(pin_slot >= 0, torch.from_numpy(pins.mask(np.array([2, 1, 3]), nb)))


def test_pool_without_room_drops_itself() -> None:
    pins = make_pins(2, 256, seed=3)
    pool = DevicePinPool(G, HKV, D, P, torch.float32, torch.device("cpu"), share=0.0)
    pool.reserve(pins, np.array([0, 1]))
    assert not pool.enabled and pool.kv is None and pool.nbytes() == 0 and not pool.held
