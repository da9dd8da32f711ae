"""Teacher-forced logits from our own forward: logits at every position of a token sequence, in prefill chunks."""
from __future__ import annotations

import torch

from fluxion_lite.model.attention import AttentionBackend, SeqChunk
from fluxion_lite.model.transformer import Transformer


def teacher_forced_logits(
    model: Transformer, attn: AttentionBackend, tokens: list[int], chunk: int = 256, seq_id: int = -1,
    last_row_only: bool = False,
) -> torch.Tensor:
    """Logits [len(tokens), V] (row i predicts token i + 1), or [1, V] for the last token when `last_row_only`
    (a caller that needs one row at 32K would otherwise hold 32K x V fp32 rows, ~20 GB for a 152K vocab).
    Uses a temporary sequence slot in `attn`."""
    attn.allocate(seq_id)
    rows: list[torch.Tensor] = []
    try:
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            n = len(piece)
            if not last_row_only:
                wanted = torch.arange(n)
            elif start + n == len(tokens):
                wanted = torch.tensor([n - 1])
            else:
                wanted = torch.empty(0, dtype=torch.long)  # attention still runs; no vocab projection
            logits = model.forward(
                torch.tensor(piece), torch.arange(start, start + n), [SeqChunk(seq_id, start, n)], attn,
                logit_rows=wanted,
            )
            if wanted.numel():
                rows.append(logits.cpu())
    finally:
        attn.free(seq_id)
    return torch.cat(rows)
