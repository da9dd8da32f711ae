"""A zero-copy span as the device step reads it, built from a random logical cache, for tests on the CPU."""
from __future__ import annotations

import torch

from fluxion_lite.hostkv.store import CHUNK_TOKENS


def paged_store(gen: torch.Generator, slots: int, hkv: int, d: int, page_tokens: int, pages: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span of shuffled pages: span [chunks, CHUNK_TOKENS * D]; tables [slots, pages] (each page's first chunk);
    the logical cache kv [slots, 2, Hkv, pages * page_tokens, D] it holds."""
    cph = page_tokens // CHUNK_TOKENS
    per_page = 2 * hkv * cph  # chunks: K of every head, then V
    order = torch.randperm(slots * pages, generator=gen)
    tables = (order.view(slots, pages) * per_page + 1).long()  # + 1: row 0 of the span belongs to no page
    n = pages * page_tokens
    kv = torch.randn(slots, 2, hkv, n, d, generator=gen).to(dtype)
    span = torch.full((slots * pages * per_page + 1, CHUNK_TOKENS * d), float("nan"), dtype=dtype)
    for s in range(slots):
        for p in range(pages):
            for part in range(2):
                for h in range(hkv):
                    for c in range(cph):
                        tok = p * page_tokens + c * CHUNK_TOKENS
                        row = int(tables[s, p]) + part * hkv * cph + h * cph + c
                        span[row] = kv[s, part, h, tok: tok + CHUNK_TOKENS].reshape(-1)
    return span, tables, kv
