"""Teacher-forced logits from our own forward: logits at every position of a token sequence, in prefill chunks."""
from __future__ import annotations

import torch

from .attention import AttentionBackend, SeqChunk
from .model import Transformer


def teacher_forced_logits(
    model: Transformer, attn: AttentionBackend, tokens: list[int], chunk: int = 256, seq_id: int = -1
) -> torch.Tensor:
    """Logits [len(tokens), V] (row i predicts token i + 1). Uses a temporary sequence slot in `attn`."""
    attn.allocate(seq_id)
    rows: list[torch.Tensor] = []
    try:
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            n = len(piece)
            logits = model.forward(
                torch.tensor(piece), torch.arange(start, start + n), [SeqChunk(seq_id, start, n)], attn,
                logit_rows=torch.arange(n),
            )
            rows.append(logits.cpu())
    finally:
        attn.free(seq_id)
    return torch.cat(rows)
