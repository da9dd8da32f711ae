"""Shared by the hooked-decode tests: prefill the same prompts into an eager and a hooked model (each with its own
backend), then decode random tokens through both and require the same logits step by step."""
from __future__ import annotations

import torch

from fluxion_lite.model.attention import AttentionBackend, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.transformer import Transformer


def eager_and_hooked(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> tuple[Transformer, Transformer]:
    """Two models with the same random weights: one decoding eagerly, one through the decode hooks (DecodeGraphs
    without capture: the hooked step's host work runs on this CPU)."""
    from pathlib import Path

    from fluxion_lite.model.cuda_graphs import DecodeGraphs
    from fluxion_lite.model.gguf_loader import GGUFModel
    from tiny_model import random_weights

    w = random_weights(cfg, seed=seed)
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=dtype)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=dtype)
    runner.graphs = DecodeGraphs(runner, capture=False)
    return eager, runner


def prefill(models: tuple[Transformer, Transformer], backends: list[AttentionBackend], prompts: list[torch.Tensor],
            chunk: int | None = None) -> None:
    """Every prompt (sequence id = its index) into both models' backends, in chunks of `chunk` tokens (None: whole)."""
    for m, a in zip(models, backends):
        for sid, toks in enumerate(prompts):
            a.allocate(sid)
            step = chunk or len(toks)
            for s in range(0, len(toks), step):
                n = min(step, len(toks) - s)
                m.forward(toks[s : s + n], torch.arange(s, s + n), [SeqChunk(sid, s, n)], a)


def decode_and_compare(eager: Transformer, runner: Transformer, backends: list[AttentionBackend], lengths: list[int],
                       steps: int, gen: torch.Generator, vocab: int, tol: float = 2e-4) -> None:
    """`steps` decode steps of one random token per sequence, each sequence at its next position; the hooked model's
    logits must match the eager one's every step."""
    pos = list(lengths)
    for _ in range(steps):
        toks = torch.randint(0, vocab, (len(pos),), generator=gen)
        chunks = [SeqChunk(s, pos[s], 1) for s in range(len(pos))]
        positions = torch.tensor(pos)
        want = eager.forward(toks, positions, chunks, backends[0])
        got = runner.forward(toks, positions, chunks, backends[1])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        pos = [p + 1 for p in pos]
