"""Piecewise CUDA graphs for decode steps.

A decode step's dense part (norms, projections, RoPE, MLP) is ~15 small kernels per layer; launched one by one from
Python it costs far more host time than the GPU needs to run it (an 8B shape at batch 1: tens of ms of launches for
~3 ms of weight reads). Attention cannot go inside a graph: the dense cache grows every step and the hybrid backend
syncs with the host and runs CPU work. So a step is L + 1 graph replays with the backend's attention run eagerly in
between, each graph holding everything from one attention call to the next:

    graph 0        embedding, RoPE rows, layer 0 up to attention         -> q0, k0, v0
    graph i        layer i-1 after attention (reads o_in), layer i up to attention -> qi, ki, vi   (1 <= i < L)
    graph L        layer L-1 after attention, final norm, logits

The graphs run the very functions of the eager forward (Transformer.embed_tokens / pre_attention / post_attention /
logits), so both paths compute the same thing. One set of graphs per batch size, captured on first use; all sets
share one memory pool, which is safe because graphs that share a pool are replayed in the order they were captured.
The RoPE table is sized to the model's context once, so a captured gather never reads a table that was reallocated.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from .attention import AttentionBackend, SeqChunk

if TYPE_CHECKING:
    from .model import Transformer

MAX_GRAPH_SETS = 8  # batch sizes kept captured at once (least recently used dropped)
MAX_GRAPH_BATCH = 64  # larger decode batches are compute-bound enough to run eagerly


def graphs_wanted(device: torch.device, requested: bool | None) -> bool:
    """CUDA graphs are used on CUDA unless turned off (requested=False or FLUXION_CUDA_GRAPHS=0)."""
    if requested is not None:
        return requested and device.type == "cuda"
    return device.type == "cuda" and os.environ.get("FLUXION_CUDA_GRAPHS", "1") != "0"


class _Eager:
    """A segment run as plain torch calls where it would be replayed (no CUDA: tests of the plumbing)."""

    def __init__(self, segment):
        self.replay = segment


class _GraphSet:
    """The captured graphs of one batch size and their static input/output tensors."""

    def __init__(self, model: Transformer, batch: int, pool: tuple[int, int] | None):
        """pool None: no capture, the segments run eagerly on replay (the same plumbing, testable on the CPU)."""
        cfg, dev = model.cfg, model.device
        self.model, self.batch = model, batch
        self.inputs = torch.zeros(2, batch, dtype=torch.long, device=dev)  # [2, B]: tokens, positions
        self.o_in = torch.zeros(batch, cfg.n_heads, cfg.head_dim, dtype=model.dtype, device=dev)  # [B, Hq, D]
        self.x = self.cos = self.sin = torch.empty(0)
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.logits = torch.empty(0)
        self.graphs: list[torch.cuda.CUDAGraph | _Eager] = []
        segments = [self._first] + [self._middle(i) for i in range(1, cfg.n_layers)] + [self._last]
        if pool is None:
            self.graphs = [_Eager(seg) for seg in segments]
            return
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside capture: lazy library initialisation, workspace allocation
            for seg in segments:
                seg()
        torch.cuda.current_stream(dev).wait_stream(side)
        for seg in segments:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                seg()
            self.graphs.append(g)

    # Each segment stores its outputs on self; the tensors made during capture live in the graph pool at fixed
    # addresses, which the next segments (and the replays) read.
    def _first(self) -> None:
        m = self.model
        self.x, self.cos, self.sin = m.embed_tokens(self.inputs[0], self.inputs[1])
        self.qkv = [m.pre_attention(m.layers[0], self.x, self.cos, self.sin)]

    def _middle(self, i: int):
        def segment() -> None:
            m = self.model
            x = m.post_attention(m.layers[i - 1], self.x, self.o_in)
            assert x is self.x, "graphed layers must update the residual stream in place"
            self.qkv = self.qkv[:i] + [m.pre_attention(m.layers[i], self.x, self.cos, self.sin)]

        return segment

    def _last(self) -> None:
        m = self.model
        m.post_attention(m.layers[-1], self.x, self.o_in)
        self.logits = m.logits(self.x, None)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, chunks: list[SeqChunk],
            attn: AttentionBackend) -> torch.Tensor:
        host = torch.stack((tokens.to(torch.long), positions.to(torch.long)))  # [2, B]
        if host.device.type == "cpu" and self.inputs.is_cuda:
            host = host.pin_memory()  # a fresh pinned buffer per step: the async copy never races a later write
        self.inputs.copy_(host, non_blocking=True)
        self.graphs[0].replay()
        for i in range(self.model.cfg.n_layers):
            q, k, v = self.qkv[i]
            o = attn.attend(i, q, k, v, chunks)  # [B, Hq, D], eager: reads the static q/k/v of this layer
            self.o_in.copy_(o)
            self.graphs[i + 1].replay()
        return self.logits.clone()  # the static buffer is overwritten by the next step


class DecodeGraphs:
    """Runs pure decode steps (one token per sequence, every row's logits) of a CUDA model through piecewise graphs."""

    def __init__(self, model: Transformer, capture: bool = True):
        """capture False: the same runner without CUDA graphs (segments run eagerly), for CPU tests."""
        self.model = model
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.sets: OrderedDict[int, _GraphSet] = OrderedDict()
        self.table_ptr = -1

    def handles(self, chunks: list[SeqChunk]) -> bool:
        """A pure decode batch (every row's logits wanted) of a size worth graphing."""
        return (0 < len(chunks) <= MAX_GRAPH_BATCH and all(c.length == 1 for c in chunks)
                and max(c.start for c in chunks) < self.model.cfg.context_length)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, chunks: list[SeqChunk],
                attn: AttentionBackend) -> torch.Tensor:
        rope = self.model.rope
        rope.ensure(self.model.cfg.context_length)  # once: every position of the model's context is in the table
        if rope.table.data_ptr() != self.table_ptr:  # graphs read the table by address: recapture if it moved
            self.sets.clear()
            self.table_ptr = rope.table.data_ptr()
        b = len(chunks)
        graph_set = self.sets.get(b)
        if graph_set is None:
            if len(self.sets) >= MAX_GRAPH_SETS:
                self.sets.popitem(last=False)
            graph_set = self.sets[b] = _GraphSet(self.model, b, self.pool)
        self.sets.move_to_end(b)
        return graph_set.run(tokens, positions, chunks, attn)
