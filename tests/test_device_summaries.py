"""DeviceSummaries (device_select.py) on the CPU: block min/max kept right while the capacity grows."""
from __future__ import annotations

import torch

from fluxion_lite.device_select import DeviceSummaries


def test_summaries_survive_growth_and_capacity_stays_near_the_need() -> None:
    hkv, d, g = 2, 8, 16
    ds = DeviceSummaries(n_layers=1, n_kv_heads=hkv, head_dim=d, g=g, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(5000, hkv, d, generator=gen, dtype=torch.float64)
    start = 0
    for n in (1000, 37, 3000, 963):  # chunks that end inside a block: the next one merges into it
        ds.append_chunk(0, 0, start, keys[start : start + n].float())
        start += n
        used = -(-start // g)
        cap = ds.layer(0).shape[2]
        assert used <= cap <= max(64, -(-(used * 5 // 4) // 64) * 64 + 64)  # grown by about a quarter, not doubled
    s = ds.layer(0)[0, :, : -(-start // g)].double()  # [Hkv, blocks, 2, D]
    pad = torch.full(((-start) % g, hkv, d), float("nan"), dtype=torch.float64)
    blocks = torch.cat([keys[:start], pad]).view(-1, g, hkv, d)  # [blocks, g, Hkv, D]
    want_min = blocks.nan_to_num(float("inf")).amin(1).transpose(0, 1)  # [Hkv, blocks, D]
    want_max = blocks.nan_to_num(float("-inf")).amax(1).transpose(0, 1)
    torch.testing.assert_close(s[:, :, 0], want_min.float().double())
    torch.testing.assert_close(s[:, :, 1], want_max.float().double())
