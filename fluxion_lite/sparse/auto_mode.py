"""Attention mode `auto` (the default): each request runs dense or fluxion attention, whichever is faster for it.

Dense attention over a short KV costs less than fluxion's fixed work per step (building the step's task table,
selection, the sink/window merge); past a crossover the KV read dominates and fluxion, which reads a few percent of
it, wins. The prompt decides: a request whose prompt has at most `dense_tokens` tokens gets a dense KV cache on the
compute device (DenseAttention, as mode `full`), a longer one the host store and the fluxion plan (SparseAttention).
A sequence keeps its side for its life: a dense one that outgrows the crossover while decoding stays dense (moving
its KV mid-request would cost more than the few steps it runs past the crossover in a chat turn).

Crossovers, batch-1 decode TPOT of the two modes on one loaded model (research/cpu_crossover.py; docs/engine.md has
the table): on a CPU (2-core Xeon VM, 2 threads) smollm2-135m crosses between 1K and 2K tokens, the 1.5b's modes
are within 4% up to 2K and the 0.5b's dense step stays ahead by 2-6% up to 4K; past 4K fluxion is ahead on all three,
so prompts up to 2,048 tokens run dense there. On CUDA the
fluxion step was faster than dense attention with the KV on the GPU at every length measured, from 512 tokens on
(Llama-3.1-8B shape, batch 1, H100: 6.71 vs 7.55 ms at 512, 7.04 vs 7.74 at 2K, 6.98 vs 10.15 at 8K;
bench/results/tpot_llama3.1-8b_auto_crossover_h100.json), so there every prompt runs fluxion until the dense decode
kernels catch up. The setting FLUXION_AUTO_DENSE_TOKENS replaces the device kind's value.

The fluxion side is built when the first long prompt arrives if its plan must be calibrated first (a model file
with no shipped or cached plan: plan/auto_plan.py), so that short-prompt users never wait for a calibration; a model
with a plan gets both sides at load. Dense sequences keep the prefix cache (a chat's next turn reuses its KV); the
host store cannot truncate a sequence, so fluxion sequences are freed when they end.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from fluxion_lite.hostkv.layer import NativeDecoder
from fluxion_lite.model.attention import AttentionBackend, CapturedDecode, DenseAttention, SeqChunk
from fluxion_lite.sparse.backend import SparseAttention

# the longest prompt that runs dense, per device kind (module docstring; measured, batch 1)
DENSE_TOKENS = {"cpu": 2048, "cuda": 0}


def dense_tokens_for(device: torch.device, setting: int | None) -> int:
    """The crossover for this device: the setting's value, else the device kind's measured one."""
    return setting if setting is not None else DENSE_TOKENS.get(device.type, DENSE_TOKENS["cpu"])


class AutoAttention(AttentionBackend):
    """Routes each sequence to a dense or a fluxion backend by its prompt length (module docstring)."""

    def __init__(self, dense: DenseAttention, make_sparse: Callable[[], SparseAttention], dense_tokens: int,
                 sparse: SparseAttention | None = None) -> None:
        """make_sparse: builds the fluxion side (called once, at the first long prompt, unless `sparse` is given)."""
        self.dense, self.sparse, self._make_sparse = dense, sparse, make_sparse
        self.dense_tokens = dense_tokens
        self._side: dict[int, AttentionBackend] = {}  # sequence -> the backend that holds its KV

    def side_for(self, prompt_tokens: int) -> str:
        """"dense" or "fluxion": where a prompt of this length runs."""
        return "dense" if prompt_tokens <= self.dense_tokens else "fluxion"

    def side_of(self, seq_id: int) -> str:
        """"dense" or "fluxion": where an allocated sequence attends."""
        return "dense" if self._side[seq_id] is self.dense else "fluxion"

    def fluxion(self) -> SparseAttention:
        """The fluxion side, built now if it was not yet (its plan may be calibrated here: plan/auto_plan.py)."""
        if self.sparse is None:
            self.sparse = self._make_sparse()
        return self.sparse

    # ---- sequence lifecycle ---------------------------------------------------------------------------------------
    def allocate(self, seq_id: int, prompt_tokens: int = 0) -> None:
        if seq_id in self._side:
            raise ValueError(f"sequence {seq_id} already has a KV cache")
        side: AttentionBackend = self.dense if self.side_for(prompt_tokens) == "dense" else self.fluxion()
        side.allocate(seq_id, prompt_tokens)
        self._side[seq_id] = side

    def free(self, seq_id: int) -> None:
        side = self._side.pop(seq_id, None)
        if side is not None:
            side.free(seq_id)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        self._side[seq_id].truncate(seq_id, n_tokens)

    def can_reuse(self, seq_id: int, prompt_tokens: int) -> bool:
        # a dense sequence continued by a prompt that would itself run dense; anything longer goes to fluxion
        return self._side.get(seq_id) is self.dense and self.side_for(prompt_tokens) == "dense"

    def seq_len(self, seq_id: int) -> int:
        return self._side[seq_id].seq_len(seq_id)

    def bytes_used(self) -> tuple[int, int]:
        host, gpu = self.dense.bytes_used()
        if self.sparse is not None:
            h, g = self.sparse.bytes_used()
            host, gpu = host + h, gpu + g
        return host, gpu

    def sides(self) -> tuple[int, int]:
        """Live sequences on each side: (dense, fluxion)."""
        dense = sum(side is self.dense for side in self._side.values())
        return dense, len(self._side) - dense

    # ---- attention ------------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        first = self._side[chunks[0].seq_id]
        if all(self._side[c.seq_id] is first for c in chunks):
            return first.attend(layer, q, k, v, chunks)
        # a batch with sequences on both sides: each side attends over its rows (in chunk order), one scatter back
        out = torch.empty_like(q)  # [T, Hq, D]
        for side in (self.dense, self.sparse):
            rows: list[torch.Tensor] = []
            mine: list[SeqChunk] = []
            offset = 0
            for c in chunks:
                if self._side[c.seq_id] is side:
                    rows.append(torch.arange(offset, offset + c.length))
                    mine.append(c)
                offset += c.length
            if mine and side is not None:
                idx = torch.cat(rows).to(q.device)
                out[idx] = side.attend(layer, q[idx], k[idx], v[idx], mine)
        return out

    def dense_decode_cache(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(chunks) == 1 and self._side.get(chunks[0].seq_id) is self.dense:
            return self.dense.dense_decode_cache(chunks)
        return None

    def native_decode_step(self, decoder: NativeDecoder, x: torch.Tensor, rope_rows: torch.Tensor, rope_stride: int,
                           chunks: list[SeqChunk]) -> bool:
        if self.sparse is not None and all(self._side.get(c.seq_id) is self.sparse for c in chunks):
            return self.sparse.native_decode_step(decoder, x, rope_rows, rope_stride, chunks)
        return False

    def captured_decode(self, chunks: list[SeqChunk]) -> CapturedDecode | None:
        # the fluxion side's captured step where every row is its own; else attention runs eagerly between replays
        if self.sparse is not None and all(self._side.get(c.seq_id) is self.sparse for c in chunks):
            return self.sparse.captured_decode(chunks)
        return None

    def stats(self) -> dict[str, float]:
        dense, fluxion = self.sides()
        base = self.sparse.stats() if self.sparse is not None else {}
        return {**base, "dense_sequences": float(dense), "fluxion_sequences": float(fluxion)}

    def reset_stats(self) -> None:
        if self.sparse is not None:
            self.sparse.reset_stats()

    def describe(self) -> str:
        """The routing in words (Engine.explain)."""
        if self.dense_tokens == 0:
            return "attention auto: every prompt runs fluxion over the host KV store (crossover 0 on this device)"
        kind = self.dense.cache.device.type
        return (f"attention auto: prompts of up to {self.dense_tokens} tokens run dense attention (KV on the "
                f"{'GPU' if kind == 'cuda' else 'CPU'}), longer prompts fluxion over the host KV store")
