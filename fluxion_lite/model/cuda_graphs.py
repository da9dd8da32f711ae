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

A backend may offer its decode attention in capturable form (AttentionBackend.captured_decode -> CapturedDecode, e.g.
sparse/host_capture.GraphedDecode): then its device work before and after the host part of attention is captured
into the same graphs, and only its host work runs between replays. Forms with `whole_step` set
(sparse/device/capture.DeviceGraphedDecode: no host work inside a step) get the whole step as one graph, one replay
per step, and `after_replay()` instead of host(i).
"""
from __future__ import annotations

import gc
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from fluxion_lite.model.attention import AttentionBackend, CapturedDecode, SeqChunk
from fluxion_lite.settings import Settings

if TYPE_CHECKING:
    from fluxion_lite.model.transformer import Transformer

MAX_GRAPH_SETS = 8  # batch sizes kept captured at once (least recently used dropped)
MAX_GRAPH_BATCH = 64  # larger decode batches are compute-bound enough to run eagerly


def graphs_wanted(device: torch.device, requested: bool | None, settings: Settings | None = None) -> bool:
    """CUDA graphs are used on CUDA unless turned off (requested=False, or with requested=None the setting
    FLUXION_CUDA_GRAPHS=0: settings.cuda_graphs; None: Settings.load())."""
    if requested is not None:
        return requested and device.type == "cuda"
    return device.type == "cuda" and (settings if settings is not None else Settings.load()).cuda_graphs


class _Eager:
    """A segment run as plain torch calls where it would be replayed (no CUDA: tests of the plumbing)."""

    def __init__(self, segment: Callable[[], None]):
        self.replay = segment


def _whole_step(hooks: CapturedDecode | None) -> bool:
    return hooks is not None and hooks.whole_step


class _GraphSet:
    """The graphs of one batch size (and, with hooks, one backend state) and their static input/output tensors.

    Captured on the first run, after that run's inputs (and the hooks' step) are in the static buffers: the
    warm-up pass writes the step's K/V where the real replay then writes them again."""

    def __init__(self, model: Transformer, batch: int, pool: tuple[int, int] | None, hooks: CapturedDecode | None):
        cfg, dev = model.cfg, model.device
        self.model, self.batch, self.pool, self.hooks = model, batch, pool, hooks
        self.inputs = torch.zeros(2, batch, dtype=torch.long, device=dev)  # [2, B]: tokens, positions
        self.o_in = torch.zeros(batch, cfg.n_heads, cfg.head_dim, dtype=model.dtype, device=dev)  # [B, Hq, D]
        self.x = self.cos = self.sin = torch.empty(0)
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.logits = torch.empty(0)
        self.graphs: list[torch.cuda.CUDAGraph | _Eager] = []
        self.segments = [self._first] + [self._middle(i) for i in range(1, cfg.n_layers)] + [self._last]

    def _capture(self) -> None:
        if self.pool is None:
            self.graphs = [_Eager(seg) for seg in self.segments]
            return
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside capture: lazy library initialisation, workspace allocation
            for seg in self.segments:
                seg()
        torch.cuda.current_stream(dev).wait_stream(side)
        # No garbage collection inside a capture: collecting a retired backend there frees its pinned and device
        # buffers, and the allocators' event work on such a free is not allowed while a stream captures (the
        # capture is invalidated: seen once on the H200 after 22 backend switches, bench/margin_flips.py).
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        # a whole-step backend is one graph over every segment; otherwise one graph per segment
        groups = [self.segments] if _whole_step(self.hooks) else [[seg] for seg in self.segments]
        try:
            for group in groups:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    for seg in group:
                        seg()
                self.graphs.append(g)
        finally:
            if gc_was_on:
                gc.enable()

    # Each segment stores its outputs on self; the tensors made during capture live in the graph pool at fixed
    # addresses, which the next segments (and the replays) read.
    def _pre(self, i: int) -> None:
        m = self.model
        q, k, v = m.pre_attention(m.layers[i], self.x, self.cos, self.sin)
        self.qkv = self.qkv[:i] + [(q, k, v)]
        if self.hooks is not None:
            self.hooks.prologue(i, q, k, v)

    def _post(self, i: int) -> None:
        m = self.model
        o = self.o_in if self.hooks is None else self.hooks.epilogue(i)
        x = m.post_attention(m.layers[i], self.x, o, self._ahead(i + 1))
        assert x is self.x, "graphed layers must update the residual stream in place"

    def _ahead(self, layer: int) -> Callable[[torch.Tensor], None] | None:
        """For hooks with early(): the call post_attention makes for `layer` (the next one) after its attention."""
        m = self.model
        early = getattr(self.hooks, "early", None)
        if early is None or layer >= m.cfg.n_layers:
            return None
        lw = m.layers[layer]
        return lambda x: early(layer, x, lambda snap: m.query_ahead(lw, snap, self.cos, self.sin))

    def _first(self) -> None:
        self.x, self.cos, self.sin = self.model.embed_tokens(self.inputs[0], self.inputs[1])
        self._pre(0)

    def _middle(self, i: int) -> Callable[[], None]:
        def segment() -> None:
            self._post(i - 1)
            self._pre(i)

        return segment

    def _last(self) -> None:
        self._post(self.model.cfg.n_layers - 1)
        self.logits = self.model.logits(self.x, None)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, chunks: list[SeqChunk],
            attn: AttentionBackend, defer_sync: bool = False) -> torch.Tensor:
        # tokens already on the device (the previous step's choice: async decode) are copied there; the rest of the
        # inputs travel from the host in one copy
        on_device = tokens.device == self.inputs.device
        host = (positions.to(torch.long)[None] if on_device
                else torch.stack((tokens.to(torch.long), positions.to(torch.long))))  # [1 or 2, B]
        if host.device.type == "cpu" and self.inputs.is_cuda:
            host = host.pin_memory()  # a fresh pinned buffer per step: the async copy never races a later write
        (self.inputs[1:] if on_device else self.inputs).copy_(host, non_blocking=True)
        if on_device:
            self.inputs[0].copy_(tokens)
        if self.hooks is not None:
            self.hooks.begin(chunks)
        if not self.graphs:
            self._capture()
        if _whole_step(self.hooks):
            for g in self.graphs:  # one graph (segments one by one where nothing is captured)
                g.replay()
            assert self.hooks is not None
            self.hooks.after_replay()
            # defer_sync: end() waits for the previous step instead of this one (DeviceGraphedDecode.end)
            self.hooks.end(defer_sync=defer_sync)
            return self.logits.clone()
        self.graphs[0].replay()
        for i in range(self.model.cfg.n_layers):
            if self.hooks is not None:
                self.hooks.host(i)
            else:
                q, k, v = self.qkv[i]
                o = attn.attend(i, q, k, v, chunks)  # [B, Hq, D], eager: reads the static q/k/v of this layer
                self.o_in.copy_(o)
            self.graphs[i + 1].replay()
        if self.hooks is not None:
            self.hooks.end()
        return self.logits.clone()  # the static buffer is overwritten by the next step


class DecodeGraphs:
    """Runs pure decode steps (one token per sequence, every row's logits) of a CUDA model through piecewise graphs."""

    def __init__(self, model: Transformer, capture: bool = True):
        """capture False: the same runner without CUDA graphs (segments run eagerly), for CPU tests."""
        self.model = model
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.sets: OrderedDict[Hashable, _GraphSet] = OrderedDict()
        self.table_ptr = -1
        self.captures = 0  # graph sets built (a new batch size or step structure), and the seconds of their steps
        self.capture_s = 0.0

    def release_backends(self) -> None:
        """Drop every graph set captured with a backend's hooks. Their hooks hold the backend's buffers (the
        device-selection step's feeder keeps an alias of every host-store slab): without this an old backend's host
        KV stays pinned until another hooked backend decodes, after the new one has allocated its own. Call it
        when a backend is retired (Engine.set_attention, benchmarks between cases)."""
        for key in [k for k, gs in self.sets.items() if gs.hooks is not None]:
            del self.sets[key]

    def _drop(self, key: Hashable) -> None:
        """Forget a graph set; after a deferred step (defer_sync) one of its graphs may still be running."""
        if self.pool is not None:
            torch.cuda.current_stream().synchronize()
        del self.sets[key]

    def handles(self, chunks: list[SeqChunk]) -> bool:
        """A pure decode batch (every row's logits wanted) of a size worth graphing."""
        return (0 < len(chunks) <= MAX_GRAPH_BATCH and all(c.length == 1 for c in chunks)
                and max(c.start for c in chunks) < self.model.cfg.context_length)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, chunks: list[SeqChunk],
                attn: AttentionBackend, defer_sync: bool = False) -> torch.Tensor:
        """Logits [B, V] of one decode token per chunk. tokens may be on the device (an earlier step's choice);
        defer_sync: return before this step's device work is done where the hooks allow it (a whole-step graph
        with no host work inside), so that the caller can launch the next step first (Engine's async decode)."""
        rope = self.model.rope
        rope.ensure(self.model.cfg.context_length)  # once: every position of the model's context is in the table
        if rope.table.data_ptr() != self.table_ptr:  # graphs read the table by address: recapture if it moved
            self.sets.clear()
            self.table_ptr = rope.table.data_ptr()
        b = len(chunks)
        hooks = attn.captured_decode(chunks)
        key: Hashable = ("plain", b) if hooks is None else ("hooked", hooks.key(b))
        if hooks is not None:  # one backend's graphs at a time: an old backend's sets would pin its buffers
            owner = hooks.owner_id()
            for stale in [k for k, gs in self.sets.items() if gs.hooks is not None and gs.hooks.owner_id() != owner]:
                self._drop(stale)
        graph_set = self.sets.get(key)
        t0 = None
        if graph_set is None:
            if len(self.sets) >= MAX_GRAPH_SETS:
                self._drop(next(iter(self.sets)))
            t0 = time.perf_counter()
            graph_set = self.sets[key] = _GraphSet(self.model, b, self.pool, hooks)
        self.sets.move_to_end(key)
        logits = graph_set.run(tokens, positions, chunks, attn, defer_sync)  # a new set captures first (warm-up, capture)
        if t0 is not None:
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
        return logits
