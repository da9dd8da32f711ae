"""Sparse decode attention over a host-memory KV store (modes full-host, fixed, gpu-sparse, fluxion).

Prefill is dense (a scratch KV on the compute device, dropped when decoding starts). Every token's K/V also goes to the
host store (native page layout, bf16, block summaries). A decode step then attends, per (layer, KV group):
  streaming part  sink + recent window, kept on the compute device, for every group        -> (o_s, lse_s)
  retrieval part  top-k blocks of granularity g by the Quest bound over host KV, for the plan's retrieval groups:
                  selection on the CPU (native top-k) or on the device (mirrored summaries, `selection="gpu"`),
                  then the hybrid executor runs each task on the CPU or the GPU as the scheduler splits them
                  (fluxion_lite/sparse/hybrid.py, scheduler.py)                                    -> (o_r, lse_r)
and merges the two by log-sum-exp. The two parts cover disjoint tokens: the native top-k skips blocks that touch the
sink or the window, so for a group with block size g the streaming part covers the sink rounded up to g and the
window rounded down to g (the device buffers keep 128 spare tokens for that).

A decode token's K/V reaches the host store one step late: its D2H copy is queued (pinned, non_blocking) and the
native append runs when the same layer comes round again (or on free/prefill). Nothing misses it meanwhile: the
window (>= 1 token) covers it on the device, and top-k never selects a block touching the window.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
from torch.profiler import record_function

from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.layer import MAX_ROWS, NativeDecoder
from fluxion_lite.model.attention import AttentionBackend, SeqChunk, causal_attention
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.sparse.device.summaries import DeviceSummaries
from fluxion_lite.errors import SettingError
from fluxion_lite.settings import Settings
from fluxion_lite.hostkv.store import HostKVStore
from fluxion_lite.sparse.hybrid import HybridExecutor, Timer
from fluxion_lite.sparse.attend import biased_attention, lse_merge_parts
from fluxion_lite.model.kv_cache import DenseKVCache
from fluxion_lite.plan.pins import PinnedBlocks
from fluxion_lite.plan.request_plan import RequestPlanner, RowPlan
from fluxion_lite.sparse.cost_model import Costs, CostModel, Placement, measure_costs
from fluxion_lite.plan.sparse_plan import GRANULARITIES, SparsePlan, with_background_override
from fluxion_lite.sparse.device.capture import DeviceGraphedDecode
from fluxion_lite.sparse.host_capture import GraphedDecode
from fluxion_lite.sparse.host_decode import HostDecode
from fluxion_lite.sparse.state import SparseState
from fluxion_lite.sparse.step import (BACKGROUND_G, DecodeStep, active_retrieval, background_tasks,
                                      retrieval_tasks)
from fluxion_lite.sparse import zero_copy as zc

_serials = itertools.count()  # identifies a backend in the CUDA-graph cache (an id() could be reused)
Selection = Literal["cpu", "gpu"]



class SparseAttention(AttentionBackend):
    def __init__(self, cfg: ModelConfig, plan: SparsePlan, dtype: torch.dtype, device: torch.device, max_seqs: int,
                 placement: Placement = "auto", selection: Selection = "cpu", costs: Costs | None = None,
                 zero_copy: bool | None = None, topk_scoring: str | None = None,
                 mixed_select: Literal["host", "device"] | None = None, settings: Settings | None = None,
                 host_decode: bool | None = None):
        """host_decode: decode layers read everything from the host store in three native calls (host_decode.py);
        None = on a CPU device with CPU selection, where the hybrid step's "GPU side" is this same CPU. False keeps
        the hybrid step there (tests of its scheduler and feeders)."""
        self.settings = settings if settings is not None else Settings.load()  # FLUXION_* knobs (settings.py)
        plan = with_background_override(plan, self.settings)  # the plan's background term, or FLUXION_BACKGROUND's
        plan.validate(cfg.n_layers, cfg.n_kv_heads)
        if plan.window < 1:
            raise ValueError("the sparse backend needs window >= 1 (the newest token is attended on the device)")
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        self.placement, self.selection = placement, selection
        self.scale = cfg.head_dim**-0.5
        self.r = cfg.n_heads // cfg.n_kv_heads
        self.store = HostKVStore(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16, max_seqs=max_seqs,
                                 page_tokens=256, granularities=GRANULARITIES,
                                 value_sums=plan.background != "off", hugepages=self.settings.hugepages)
        # what the eager and the captured forms of the decode step share (sparse/state.py)
        self.state = SparseState(cfg, plan, dtype, device)
        self.scratch = DenseKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype, device)
        self.summaries: DeviceSummaries | None = None
        # per-request plans from the head-property predictor (request_plan.py); None: the static plan for all
        self.planner: RequestPlanner | None = None
        # blocks pinned at prefill end by the prompt's own attention (pinned.py); static plan only
        self.pins = PinnedBlocks(plan) if plan.pin_fraction > 0 else None
        if selection == "gpu":
            gs = set(self.state.g[self.state.retrieval].tolist())
            if len(gs) > 1:
                raise ValueError(f"selection='gpu' mirrors one granularity; the plan uses {sorted(gs)}")
            g_dev = gs.pop() if gs else 16
            # with the unread-background term and g = 16 the device keeps value sums too, so the captured step
            # computes the term there (device_background.py); other block sizes compute it eagerly on the host
            self.summaries = DeviceSummaries(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, g_dev, device,
                                         value_sums=plan.background != "off" and g_dev == BACKGROUND_G)
        # With device selection, the decode rows of a step that holds a prompt chunk (an eager step: the captured
        # step runs decode rows only) select on the host and split their tasks between CPU and GPU, as CPU selection
        # does: the eager device path brings each layer's block ids to the host anyway, and issues ~150 more small
        # torch ops per layer. bench/mixed_step.py, 32K, batch 64, H200 (docs/hybrid.md): 206 -> 167 ms a mixed step
        # (CPU selection 160 ms). mixed_select="device" (the gpu-sparse baseline: every selected block over PCIe)
        # or FLUXION_MIXED_SELECT=device (for A/B) keeps the device path there.
        mixed = mixed_select or self.settings.experimental.mixed_select
        if mixed not in ("host", "device"):
            raise SettingError(f"mixed_select / FLUXION_MIXED_SELECT={mixed!r}: use host or device")
        self.mixed_host_select = self.summaries is not None and mixed == "host"
        cuda = device.type == "cuda"
        # new K/V per layer waiting for the host store: [L, 2, rows, Hkv, D] (pinned), (slots, rows, event) per layer
        self._kv_out = torch.empty(cfg.n_layers, 2, 0, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        self._q_out = torch.empty(0, cfg.n_heads, cfg.head_dim, pin_memory=cuda)  # q for the CPU kernels
        # a mixed step's K/V on their way to the host store, one layer at a time: [2, rows, Hkv, D] bf16 (pinned)
        self._chunk_out = torch.empty(2, 0, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16, pin_memory=cuda)
        # False: a mixed step appends to the host store first, after a blocking copy (the older order;
        # research/mixed_step.py's "+blocking-append" variants, for A/B)
        self.overlap_chunk_append = True
        self.timer = Timer(device)
        if host_decode is None:
            host_decode = not cuda and selection == "cpu"
        elif host_decode and (cuda or selection != "cpu"):
            raise ValueError("host_decode needs a CPU device and selection='cpu'")
        # the hybrid step's scheduler places tasks by measured rates; host_decode has one side and never asks, so it
        # skips the ~1 s bandwidth probe (zero rates: stats() shows them unmeasured)
        base = costs or (Costs(0.0, 0.0, None) if host_decode else measure_costs(str(device) if cuda else "cpu"))
        if not cuda and costs is None:  # the "GPU" side is torch on this CPU: model it as a slow but usable side
            base = Costs(base.cpu_gbs, base.gather_gbs, h2d_gbs=base.cpu_gbs, cpu_fixed_s=base.cpu_fixed_s,
                         gather_fixed_s=base.gather_fixed_s)
        # zero-copy GPU feeder (zero_copy.py): None = where the alias check passes on CUDA (FLUXION_ZERO_COPY=1 on
        # a CPU device, where the "alias" is the host memory itself); False = staging; True = wherever it works
        self.zero_copy = placement != "cpu" and self._want_zero_copy(zero_copy)
        if self.zero_copy and not base.zero_copy:
            if cuda:
                pcie_gbs, attn_gbs, zc_fixed = zc.probe(device, head_dim=cfg.head_dim)
            else:  # the CPU "GPU side" reads host memory at the rate the staging model gave it
                pcie_gbs, attn_gbs, zc_fixed = base.h2d_gbs or base.cpu_gbs, None, base.h2d_fixed_s
            base = replace(base, zero_copy=True, pcie_read_gbs=pcie_gbs, gpu_attn_gbs=attn_gbs, zc_fixed_s=zc_fixed)
        elif not self.zero_copy and base.zero_copy:
            base = replace(base, zero_copy=False)
        self.costs = CostModel(base)
        self.executor = HybridExecutor(device, torch.bfloat16, cfg.head_dim, self.r, self.costs, placement,
                                       self.timer, self.state.stats,
                                       feeder=zc.ZeroCopyFeeder(self.store, device) if self.zero_copy else None)
        self._zc_seen = (0.0, 0)  # zero-copy bytes and GPU calls at the last step's end (for the online rate)
        self._t_step = 0.0
        self.serial = next(_serials)
        self.host_capture = GraphedDecode(self)
        self.host_decode = HostDecode(self) if host_decode else None
        self.device_capture: DeviceGraphedDecode | None = None  # made at the first graphable device-selection step
        # block scoring of the native top-k (native.SCORINGS), for the eager and the graphed decode paths alike:
        # the argument, else FLUXION_TOPK, else the plan's (plan files can name it: policy variants)
        env = self.settings.topk
        try:
            self.topk_scoring = topk_scoring or env or plan.scoring
        except ValueError as e:
            raise SettingError(f"FLUXION_TOPK={env!r}: {e}" if topk_scoring is None else str(e)) from None

    @property
    def topk_scoring(self) -> str:
        """How the native top-k scores a retrieval group's blocks: "group" (the Quest bound of the summed query
        heads), "per-head" (each head's bound as a gap to its own best block, best over the heads) or "midrange"
        (the summed query heads against each block's (min + max) / 2)."""
        return self._topk_scoring

    @topk_scoring.setter
    def topk_scoring(self, value: str) -> None:
        value = "group" if value == "native" else value  # "native": the group scoring's old FLUXION_TOPK name
        if value not in native.SCORINGS:
            raise ValueError(f"topk_scoring must be one of {native.SCORINGS}, got {value!r}")
        if value == "per-head" and self.selection != "cpu":
            raise ValueError(f"topk_scoring={value!r} needs selection='cpu' (the device-side selection scores "
                             f"blocks by the group bound or the midrange)")
        self._topk_scoring = value
        if self.summaries is not None:
            self.summaries.midrange = value == "midrange"
            self.device_capture = None  # its captures hold the old scoring

    def captured_decode(self, chunks: list[SeqChunk]) -> GraphedDecode | DeviceGraphedDecode | None:
        """The captured form of this decode step (sparse_graph.py; device_graph.py for device-side selection with
        the zero-copy feeder), or None where it must run eagerly: prefill chunks or a sequence's first decode step,
        a token still landing in the sink, per-request plans, device selection without the zero-copy feeder or with
        the unread-background term at a retrieval block size other than 16 (the device term reads g = 16
        summaries), or decode layers on the host (host_decode: no device work to capture)."""
        if (self.planner is not None and self.planner.active()) or self.host_decode is not None:
            return None
        if any(c.length != 1 or c.seq_id in self.state.prefilling or c.start < self.state.sink_cap for c in chunks):
            return None
        if self.selection == "cpu":
            return self.host_capture
        if self.executor.feeder is None:
            return None
        if self.plan.background != "off" and not (self.summaries is not None and self.summaries.value_sums):
            return None  # the term's device form needs g = 16 (device_background.py): eager, on the host
        if self.device_capture is None:
            self.device_capture = DeviceGraphedDecode(self)
        self.device_capture.prepare(chunks)
        return self.device_capture

    def ensure_decode_buffers(self, batch: int) -> None:
        """Pinned q and new-K/V buffers of the eager decode path with room for `batch` rows (grown by doubling)."""
        if self._kv_out.shape[2] < batch:
            self.flush()  # the old buffer's rows are about to go
            shape = list(self._kv_out.shape)
            shape[2] = max(batch, 2 * shape[2])
            self._kv_out = torch.empty(shape, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")
        if self._q_out.shape[0] < batch:
            self._q_out = torch.empty(max(batch, 2 * self._q_out.shape[0]), *self._q_out.shape[1:],
                                      pin_memory=self.device.type == "cuda")

    def _want_zero_copy(self, requested: bool | None) -> bool:
        if requested is False:
            return False
        if self.device.type != "cuda":
            return bool(requested) or self.settings.zero_copy is True
        ok, why = zc.check(self.device, self.settings.zero_copy is not False)
        if not ok:
            zc.log_fallback(why)
        return ok

    # ---- sequence lifecycle ---------------------------------------------------------------------------------------
    def allocate(self, seq_id: int, prompt_tokens: int = 0) -> None:
        if seq_id in self.state.slot:
            raise ValueError(f"sequence {seq_id} already has a KV cache")
        slot = self.store.allocate()
        self.state.slot[seq_id] = slot
        self.scratch.allocate(seq_id)
        self.state.prefilling.add(seq_id)
        if prompt_tokens > 0:
            self.state.prompt_tokens[seq_id] = prompt_tokens
        if slot >= self.state.near.shape[1]:
            self.state.grow_near(slot + 1)
        self.state.near[:, slot].zero_()
        self.state.length[seq_id] = 0

    def free(self, seq_id: int) -> None:
        self.flush()
        slot = self.state.slot.pop(seq_id, None)
        if slot is not None:
            if self.zero_copy:  # the GPU may still read this slot's pages through the alias
                self.executor.wait_idle()
            self.store.release(slot)
        self.scratch.free(seq_id)
        if self.pins is not None:
            self.pins.forget(seq_id, slot)
        self.state.length.pop(seq_id, None)
        self.state.prefilling.discard(seq_id)
        self.state.prompt_tokens.pop(seq_id, None)
        self.state.step = None
        if self.planner is not None:
            self.planner.forget(seq_id)

    def assign_plan(self, seq_id: int, plan: SparsePlan) -> None:
        """An allocated sequence runs `plan` instead of the static one (a request's own epsilon). Needs CPU
        selection: the device step runs one plan for the whole batch."""
        if self.selection != "cpu":
            raise ValueError("a per-request plan needs CPU selection (FLUXION_SELECTION=cpu); the device step runs "
                             "one plan for every sequence")
        if self.planner is None:
            self.planner = RequestPlanner(None, self.plan, self.cfg, [])
        self.planner.assign(seq_id, plan)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        raise NotImplementedError("the sparse backend does not support prefix reuse yet")

    def seq_len(self, seq_id: int) -> int:
        return self.state.length[seq_id]

    def bytes_used(self) -> tuple[int, int]:
        # the slab's rows of live sequences (free rows are kept for reuse, like a pool)
        per_seq = self.state.near[:, :1].numel() * self.state.near.element_size()
        device_bytes = self.scratch.bytes_used() + per_seq * len(self.state.slot)
        if self.summaries is not None:
            device_bytes += self.summaries.bytes_used()
        if self.device_capture is not None:  # its pin and reuse caches (FLUXION_PIN_CACHE / _REUSE_CACHE=0: off)
            device_bytes += self.device_capture.pin_cache_bytes() + self.device_capture.reuse_cache_bytes()
        if self.device.type == "cuda":
            return self.store.bytes_used, device_bytes
        return self.store.bytes_used + device_bytes, 0

    def stats(self) -> dict[str, float]:
        frac = self.state.read_tokens / self.state.context_tokens if self.state.context_tokens else 0.0
        c = self.costs.costs
        streaming = self.state.stream_groups / self.state.all_groups if self.state.all_groups else self.plan.streaming_fraction
        return {"kv_read_fraction": frac, "streaming_fraction": streaming, **self.state.stats.as_dict(),
                "cpu_gbs": c.cpu_gbs, "gather_gbs": c.gather_gbs, "h2d_gbs": c.h2d_gbs or 0.0,
                "zero_copy": float(self.zero_copy), "pcie_read_gbs": c.pcie_read_gbs or 0.0,
                "gpu_attn_gbs": c.gpu_attn_gbs or 0.0}

    def reset_stats(self) -> None:
        self.state.reset_counts()
        self._zc_seen = (0.0, self.executor.zc_calls)
        self.timer.collect()

    def flush(self) -> None:
        """Append every queued decode K/V to the host store (tests and free() need the store complete)."""
        for layer in range(self.cfg.n_layers):
            self.flush_layer(layer)

    def import_kv(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V computed elsewhere (a prefill node, a benchmark's synthetic context) without attending over it:
        k, v [n, Hkv, D] at positions start..start+n-1 of an allocated sequence, layer by layer, in order."""
        self.flush_layer(layer)
        slot, n = self.state.slot[seq_id], k.shape[0]
        self.store.append(layer, slot, k.to(torch.bfloat16).cpu(), v.to(torch.bfloat16).cpu())
        if self.summaries is not None:
            self.summaries.append_chunk(layer, slot, start, k.to(self.device), v.to(self.device))
        head = max(0, min(n, self.state.sink_cap - start))  # only the sink's and the ring's tokens go to the device
        if head:
            self._write_near(layer, slot, start, k[:head].to(self.device), v[:head].to(self.device))
        tail = min(n, self.state.ring_cap)
        self._write_near(layer, slot, start + n - tail, k[n - tail :].to(self.device), v[n - tail :].to(self.device))
        if layer == self.cfg.n_layers - 1:
            self.state.length[seq_id] = start + n

    # ---- attention ------------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        self.flush_layer(layer)
        if all(c.length == 1 and c.seq_id not in self.state.prefilling for c in chunks):
            out = self._decode(layer, q, k, v, chunks)  # the hot path: every row a decode token
        else:
            out = self._mixed(layer, q, k, v, chunks)
        if layer == self.cfg.n_layers - 1:
            for c in chunks:
                self.state.length[c.seq_id] = c.start + c.length
        return out

    def _pins_due(self, layer: int, c: SeqChunk) -> bool:
        """Whether this prefill chunk ends the prompt (its length known from allocate) at the layer that pins:
        each layer for itself, or the last one where the plan's pin_consensus pins every layer from all of them."""
        end = self.state.prompt_tokens.get(c.seq_id)
        last_layer = not self.plan.pin_consensus or layer == self.cfg.n_layers - 1
        return end is not None and c.start + c.length == end and last_layer

    def _pin(self, layer: int, seq_id: int, slot: int, n: int, keys_of: Callable[[int], torch.Tensor]) -> None:
        """Pin a sequence's blocks from its observed prompt queries (plan/pins.py) for a first decode step of n
        tokens; keys_of(i): layer i's prompt keys [Hkv, n - 1, D]. Pins belong to the static plan: made for every sequence unless a predictor plans them all (a step
        reads them only while no row in it has a plan of its own). The second call for a layer finds nothing to do.
        Made at the end of the prompt's last chunk, the prompt attention's cost (a softmax over every prompt key,
        0.3 s for the 0.5b at 16K on 2 cores) is part of the prefill rather than of the first decode step."""
        if self.planner is None or not self.planner.predicts:
            self.pins.pin(layer, seq_id, slot, keys_of, n, self.scale)

    def _mixed(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        """A call with prefill chunks: dense prefill of the chunks, the host append (overlapping the chunks' device
        work on CUDA), then the decode rows as a decode step runs them."""
        slots = [self.state.slot[c.seq_id] for c in chunks]
        k_host, v_host, copied = self._copy_to_host(k, v)
        if not self.overlap_chunk_append:
            self._append_chunk_kv(layer, chunks, slots, k_host, v_host, copied)
        out = torch.empty_like(q)
        rows, dec = [], []
        offset = 0
        for c, slot in zip(chunks, slots):
            sl = slice(offset, offset + c.length)
            if c.length > 1:
                if c.seq_id not in self.state.prefilling:
                    raise ValueError(f"sequence {c.seq_id}: a prefill chunk after decoding started is not supported")
                with record_function("fluxion::mixed_chunk"):
                    self._write_near(layer, slot, c.start, k[sl], v[sl])
                    if self.summaries is not None:
                        self.summaries.append_chunk(layer, slot, c.start, k[sl], v[sl])
                    keys, values = self.scratch.append(layer, c.seq_id, c.start, k[sl], v[sl])
                    out[sl] = causal_attention(q[sl], keys, values, c.start, self.scale)
                    if self.planner is not None:
                        self.planner.record(layer, c.seq_id, q[sl])
                    if self.pins is not None:
                        self.pins.observe(layer, c.seq_id, c.start, q[sl])
                        if self._pins_due(layer, c):  # the prompt's last chunk: pin now, as part of prefill
                            # this layer's keys as appended above: the cache's own length moves at the last layer
                            self._pin(layer, c.seq_id, slot, c.start + c.length + 1,
                                      lambda i, s=c.seq_id, own=keys: own if i == layer else self.scratch.view(i, s)[0])
            else:
                rows.append(offset)
                dec.append(c)
                if self.planner is not None and c.seq_id in self.state.prefilling:  # prefill ended: plan this layer
                    self.planner.prefill_done(layer, c.seq_id, lambda i, s=c.seq_id: self.scratch.view(i, s))
                if self.pins is not None and c.seq_id in self.state.prefilling:  # unless pinned at prefill end
                    self._pin(layer, c.seq_id, slot, c.start + 1, lambda i, s=c.seq_id: self.scratch.view(i, s)[0])
                if layer == self.cfg.n_layers - 1 and c.seq_id in self.state.prefilling:
                    self.state.prefilling.discard(c.seq_id)  # decoding started: the dense scratch goes
                    self.scratch.free(c.seq_id)
            offset += c.length
        # The host store takes this layer's K/V while the device runs the chunk's attention queued above (the copy
        # was queued before it): before the decode rows, whose host-side attention reads the store.
        if self.overlap_chunk_append:
            self._append_chunk_kv(layer, chunks, slots, k_host, v_host, copied)
        if dec:  # the one-token rows together, as a decode step writes them (not one small copy per row)
            with record_function("fluxion::mixed_decode_rows"):
                st = self.state.step_for(dec)
                idx = torch.tensor(rows, device=q.device)
                if self.host_decode is not None:  # their K/V went to the host store with the chunks' above
                    out[idx] = self.host_decode.layer(layer, q[idx], st, self._row_plan(st))
                else:
                    self._write_tokens(layer, st, k[idx], v[idx])
                    out[idx] = self._attend_decode(layer, q[idx], st, host_select=self.mixed_host_select)
        if layer == self.cfg.n_layers - 1:
            # Mixed steps are not counted as decode steps: drop their timer marks, or their spans would be charged
            # to the next pure decode step (its GPU wait could then exceed its own duration).
            self.timer.collect()
        return out

    def _append_chunk_kv(self, layer: int, chunks: list[SeqChunk], slots: list[int], k_host: torch.Tensor,
                         v_host: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        # record_function labels: bench/mixed_step.py's profile splits the mixed step by them (~1 us each otherwise)
        with record_function("fluxion::mixed_host_append"):
            if copied is not None:
                copied.synchronize()
            self.store.append_batch(layer, slots, k_host, v_host, counts=[c.length for c in chunks])

    def _copy_to_host(self, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """A mixed step's K/V (k, v [N, Hkv, D]) as bf16 on the host. On CUDA the copy is queued into the pinned
        staging buffer and the event marks its end: the caller queues more device work, then waits for the event
        only (a blocking .cpu() here would leave the device idle while the host store appends)."""
        if self.device.type != "cuda" or not self.overlap_chunk_append:
            return k.to(torch.bfloat16).cpu(), v.to(torch.bfloat16).cpu(), None
        n = k.shape[0]
        if self._chunk_out.shape[1] < n:  # the previous layer's append has finished: the old buffer is free
            self._chunk_out = torch.empty(2, max(n, 2 * self._chunk_out.shape[1]), *self._chunk_out.shape[2:],
                                          dtype=torch.bfloat16, pin_memory=True)
        out = self._chunk_out[:, :n]
        out[0].copy_(k, non_blocking=True)  # dtype conversion included
        out[1].copy_(v, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return out[0], out[1], ev

    def _write_near(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sink and ring slots of a chunk's tokens (k, v [n, Hkv, D] at positions start..)."""
        n, end = k.shape[0], start + k.shape[0]
        near = self.state.near[layer, slot]  # [2, Hkv, Ltot, D]
        kv = torch.stack([k, v]).transpose(1, 2).to(self.dtype)  # [2, Hkv, n, D]
        if start < self.state.sink_cap:
            m = min(end, self.state.sink_cap) - start
            near[:, :, start : start + m] = kv[:, :, :m]
        lo = max(start, end - self.state.ring_cap)
        ring = self.state.sink_cap + torch.arange(lo, end, device=k.device) % self.state.ring_cap
        near[:, :, ring] = kv[:, :, lo - start :]

    def native_decode_step(self, decoder: NativeDecoder, x: torch.Tensor, rope_rows: torch.Tensor, rope_stride: int,
                           chunks: list[SeqChunk]) -> bool:
        """On a CPU device, a static-plan step of decode rows without the unread-background term: every layer in one
        native call (HostDecode.native_step); per-request plans and the background term keep the per-layer path."""
        if (self.host_decode is None or self.plan.background != "off" or len(chunks) > MAX_ROWS
                or not all(c.length == 1 and c.seq_id not in self.state.prefilling for c in chunks)):
            return False
        st = self.state.step_for(chunks)
        if self._row_plan(st) is not None:
            return False
        t0 = time.perf_counter()
        self.flush()
        self.host_decode.native_step(decoder, x, rope_rows, rope_stride, st)
        for c in chunks:
            self.state.length[c.seq_id] = c.start + c.length
        s = self.state.stats
        s.steps += 1
        s.step_s += time.perf_counter() - t0
        return True

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        if layer == 0:
            self._t_step = time.perf_counter()
        st = self.state.step_for(chunks)
        if self.host_decode is not None:
            out = self.host_decode.layer(layer, q, st, self._row_plan(st), k, v)
        else:
            self._write_tokens(layer, st, k, v)
            self._queue_host_append(layer, st, k, v)
            out = self._attend_decode(layer, q, st)
        if layer == self.cfg.n_layers - 1:
            spans = self.timer.collect()
            s = self.state.stats
            s.steps += 1
            s.step_s += time.perf_counter() - self._t_step
            s.gpu_compute_s += spans.get("stream", 0.0) + spans.get("gpu_tasks", 0.0) + spans.get("merge", 0.0)
            s.gpu_wait_s += max(0.0, spans.get("window", 0.0) - spans.get("gpu_tasks", 0.0))
            if self.zero_copy:  # follow the zero-copy rate seen this step, per layer that had GPU tasks
                nbytes, calls = s.zero_copy_bytes - self._zc_seen[0], self.executor.zc_calls - self._zc_seen[1]
                if calls:
                    self.costs.observe_zero_copy(nbytes / calls, spans.get("gpu_tasks", 0.0) / calls)
                self._zc_seen = (s.zero_copy_bytes, self.executor.zc_calls)
        return out

    def _write_tokens(self, layer: int, st: DecodeStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token per row of st (k, v [B, Hkv, D]) into the device ring (and sink) slots and the device
        summaries."""
        kv_new = torch.stack([k, v], dim=1).to(self.dtype)  # [B, 2, Hkv, D]
        self.state.near[layer][st.slots_dev, :, :, st.ring_dev] = kv_new
        for b in st.sink_rows:  # early positions also live in the sink slots
            self.state.near[layer, int(st.slots[b]), :, :, int(st.n[b] - 1)] = kv_new[b]
        if self.summaries is not None:
            self.summaries.append_tokens(layer, st.slots_dev, st.pos_dev, int(st.slots.max()), int(st.n.max() - 1), k,
                                    v)

    def _queue_host_append(self, layer: int, st: DecodeStep, k: torch.Tensor, v: torch.Tensor) -> None:
        B = st.batch
        self.ensure_decode_buffers(B)
        self._kv_out[layer, 0, :B].copy_(k, non_blocking=True)  # [B, Hkv, D] each, contiguous
        self._kv_out[layer, 1, :B].copy_(v, non_blocking=True)
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.state.stats.pcie_bytes += 2 * k.numel() * 2
        self.state.pending[layer] = (st.slots.tolist(), B, ev)

    def flush_layer(self, layer: int) -> None:
        """Everything queued for the host store goes in (before anything reads it or appends to it)."""
        self.flush_eager_layer(layer)
        if self.device_capture is not None:  # the last device-graphed step's K/V (every layer)
            self.device_capture.flush_appends()

    def flush_eager_layer(self, layer: int) -> None:
        p = self.state.pending[layer]
        if p is None:
            return
        slots, B, ev = p
        if ev is not None:
            ev.synchronize()  # recorded a step ago: normally long complete
        self.store.append_batch(layer, slots, self._kv_out[layer, 0, :B], self._kv_out[layer, 1, :B])
        self.state.pending[layer] = None

    def _attend_decode(self, layer: int, q: torch.Tensor, st: DecodeStep, host_select: bool = False) -> torch.Tensor:
        """q: [B, Hq, D], one new token per sequence (already in the device buffers) -> out [B, Hq, D].
        host_select: with device selection, choose blocks with the native top-k over the host store's summaries and
        let the scheduler split the tasks between CPU and GPU (what CPU selection does) for this call."""
        B, hkv, r, d = st.batch, self.cfg.n_kv_heads, self.r, self.cfg.head_dim
        cuda = self.device.type == "cuda"
        on_host = self.summaries is None or host_select
        rp = self._row_plan(st)
        tasks, meta = self._layer_tasks(layer, st, rp)
        pinned = self.pins is not None and rp is None and len(tasks) > 0 and self.pins.any(layer)
        ev_q = None
        if len(tasks) and on_host and cuda:  # queued before the streaming part so it lands first
            self.ensure_decode_buffers(B)
            self._q_out[:B].copy_(q, non_blocking=True)
            ev_q = torch.cuda.Event()
            ev_q.record()
            self.state.stats.pcie_bytes += q.numel() * 4
        m0 = self.timer.mark()
        near = self.state.near[layer]
        kv = near[st.first_slot : st.first_slot + B] if st.first_slot is not None else near[st.slots_dev]
        keys, values = kv[:, 0], kv[:, 1]  # [B, Hkv, Ltot, D]
        qg = q.view(B, hkv, r, d)
        if rp is None:
            bias = st.bias[self.state.gidx_dev[layer]].transpose(0, 1)[:, :, None, :]  # [Hkv, B, Ltot] -> [B, Hkv, 1, Ltot]
        else:  # per-row plans: each (row, group) picks its own g's mask
            bias = st.bias[rp.gidx_dev[layer], torch.arange(B, device=self.device)[:, None]][:, :, None, :]  # [B, Hkv, 1, Ltot]
        out, lse_s = biased_attention(qg, keys, values, bias, self.scale)  # [B, Hkv, r, D], [B, Hkv, r]
        m1 = self.timer.mark()
        self.timer.span("stream", m0, m1)
        gi_read = self.state.gidx[layer][None, :] if rp is None else rp.gidx[layer]  # [1 or B, Hkv]
        self.state.read_tokens += float(st.stream_read[gi_read, np.arange(B)[:, None]].sum())
        self.state.context_tokens += float(st.n.sum()) * hkv
        parts = [(out, lse_s)]  # partial attentions (and the background term) merged by log-sum-exp
        ids = counts = None
        q_host = None
        bi, h, k_blocks, lo, hi = meta
        if len(tasks):
            view = self.store.view(layer)
            t0 = time.perf_counter()
            if on_host:
                if ev_q is not None:
                    ev_q.synchronize()
                q_host = self._q_out[:B] if cuda else q.float().contiguous()  # [B, Hq, D] fp32
                # pins take part of each task's k: the native top-k adds them to its selection
                pin_ids, pin_counts = self.pins.table(layer, tasks) if pinned else (None, None)
                ids, _, counts = native.group_topk(view, q_host, tasks, scoring=self.topk_scoring, pins=pin_ids,
                                                   pin_counts=pin_counts)
            else:
                ids, counts = self._select_on_device(layer, st, qg, bi, h, k_blocks, lo, hi, pinned)
            self.state.stats.cpu_topk_s += time.perf_counter() - t0
            o_r, lse_r = self.executor.run(view, q if q_host is None else q_host, qg.reshape(B * hkv, r, d), tasks,
                                           ids, counts, bi * hkv + h, B * hkv, self.scale,
                                           placement=None if self.summaries is None else "auto" if host_select else "gpu",
                                           layer=layer)
            self.state.read_tokens += float((counts.astype(np.float64) * tasks[:, 3]).sum())
            parts.append((o_r.view(B, hkv, r, d), lse_r.view(B, hkv, r)))
        if self.plan.background != "off":
            if q_host is None:  # device selection: its ids are not ascending, as native.background needs them
                q_host = q.float().cpu().contiguous()
                if ids is not None and counts is not None:  # pad entries sort last and stay past counts
                    pad = np.arange(ids.shape[1])[None, :] >= counts[:, None]
                    ids = np.sort(np.where(pad, np.iinfo(np.int32).max, ids), axis=1).astype(np.int32)
            bg = self._background(layer, st, q_host, tasks, ids, counts, bi * hkv + h, gi_read)
            if bg is not None:
                parts.append(bg)
        m2 = self.timer.mark()
        if len(parts) > 1:
            out = lse_merge_parts(parts)
        self.timer.span("window", m1, m2)
        self.timer.span("merge", m2, self.timer.mark())
        return out.view(B, hkv * r, d).to(q.dtype)

    def _background(self, layer: int, st: DecodeStep, q_host: torch.Tensor, tasks: np.ndarray,
                    ids: np.ndarray | None, counts: np.ndarray | None, task_rows: np.ndarray, gi: np.ndarray
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """background_rows as device tensors for the eager merge: (o [B, Hkv, r, D], lse [B, Hkv, r]) with lse -inf
        for groups without a term, or None when no group has one."""
        got = self.background_rows(layer, st, q_host, tasks, ids, counts, task_rows, gi)
        if got is None:
            return None
        rows, o_b, lse_b = got
        B, hkv, r, d = st.batch, self.cfg.n_kv_heads, self.r, self.cfg.head_dim
        o = torch.zeros(B * hkv, r, d)
        lse = torch.full((B * hkv, r), float("-inf"))
        o[rows], lse[rows] = torch.from_numpy(o_b), torch.from_numpy(lse_b)
        return o.view(B, hkv, r, d).to(self.device), lse.view(B, hkv, r).to(self.device)

    def background_rows(self, layer: int, st: DecodeStep, q_host: torch.Tensor, tasks: np.ndarray,
                        ids: np.ndarray | None, counts: np.ndarray | None, task_rows: np.ndarray, gi: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The unread-background term of one layer (plan.background) on the host: for the retrieval tasks (their
        selections ids / counts, result rows task_rows = sequence row * Hkv + group) over what they left unread,
        and with "all" for every other group over the gap between its sink and window (gi: the layer's rows of the
        step's per-g arrays, [1 or B, Hkv]); ids ascending per row, as the native top-k gives them. q_host: fp32
        [B, Hq, D] on the CPU. Returns the result rows (int64 [T]), out fp32 [T, r, D] and lse fp32 [T, r], or None
        when no group has a term."""
        k_cap = ids.shape[1] if ids is not None and len(tasks) else 1
        parts = []  # (tasks, ids, counts, result rows)
        if len(tasks):
            assert ids is not None and counts is not None
            parts.append((tasks, ids, counts, task_rows))
        if self.plan.background == "all":  # the other groups over their gap between sink and window, no selection
            more, more_rows = background_tasks(st, gi, task_rows)
            if len(more):
                parts.append((more, np.zeros((len(more), k_cap), np.int32), np.zeros(len(more), np.int32),
                              more_rows))
        if not parts:
            return None
        all_tasks, ids, counts, rows = (np.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts))
        t0 = time.perf_counter()
        o_b, lse_b = native.background(self.store.view(layer), q_host, all_tasks, ids, counts, self.scale)
        self.state.stats.cpu_background_s += time.perf_counter() - t0
        return rows, o_b, lse_b

    def _row_plan(self, st: DecodeStep) -> RowPlan | None:
        """The step's per-row plan arrays when some sequence has a per-request plan, else None (static plan)."""
        if self.planner is None:
            return None
        return self.planner.rows(st, [sid for sid, _ in st.key], self.device)

    def _layer_tasks(self, layer: int, st: DecodeStep, rp: RowPlan | None = None
                     ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Retrieval tasks of this layer, built with array ops: a retrieval group whose gap between sink and window
        holds at least one block. Returns the native task table and (seq row, group, k, lo, hi) per task."""
        if rp is None:  # the static plan: [1, 1, Hkv], broadcast over rows
            gi, g, ret, bud = (a[layer][None, None, :] for a in (self.state.gidx, self.state.g, self.state.retrieval, self.state.budget))
            long_only = None if self.state.long_only is None else self.state.long_only[layer][None, None, :]
        else:  # per-request plans: [1, B, Hkv]
            gi, g, ret, bud = (a[layer][None] for a in (rp.gidx, rp.g, rp.retrieval, rp.budget))
            long_only = None if rp.long_only is None else rp.long_only[layer][None]
        n_groups = st.batch * ret.shape[-1]
        self.state.stream_groups += float(n_groups - active_retrieval(st, ret, long_only).sum())
        self.state.all_groups += float(n_groups)
        tasks, _, bi, h, k_blocks, lo, hi = retrieval_tasks(st, gi, g, ret, bud, long_only)
        return tasks, (bi, h, k_blocks, lo, hi)

    def _select_on_device(self, layer: int, st: DecodeStep, qg: torch.Tensor, bi: np.ndarray, h: np.ndarray,
                          k_blocks: np.ndarray, lo: np.ndarray, hi: np.ndarray, pinned: bool = False
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k on the device over mirrored summaries (pins first, if the layer has any); only the chosen block
        ids come back to the host."""
        assert self.summaries is not None
        B, hkv, g = st.batch, self.cfg.n_kv_heads, self.summaries.g
        lo_blk, hi_blk = -(-lo // g), hi // g  # eligible blocks lie wholly inside [lo, hi)
        bounds = np.zeros((2, B, hkv), np.int64)  # non-task groups: empty range
        bounds[0, bi, h], bounds[1, bi, h] = lo_blk, hi_blk
        b_dev = torch.from_numpy(bounds).to(self.device, non_blocking=True)
        k_max = max(1, int(k_blocks.max()))
        n_blocks = int(-(-st.n.max() // g))
        mask = None
        if pinned:
            assert self.pins is not None
            mask = torch.from_numpy(self.pins.mask(st.slots, n_blocks, layer)).to(self.device)
        ids = self.summaries.select(layer, qg, st.slots_dev, b_dev[0], b_dev[1], n_blocks, k_max, mask).cpu().numpy()
        self.state.stats.pcie_bytes += ids.nbytes
        ids_t = np.ascontiguousarray(ids[bi, h])  # [T, k]
        counts = np.minimum(k_blocks, np.maximum(hi_blk - lo_blk, 0)).astype(np.int32)
        if ids_t.shape[1] < k_max:  # fewer blocks exist than k_max: pad (never read beyond counts)
            ids_t = np.pad(ids_t, ((0, 0), (0, k_max - ids_t.shape[1])))
        return ids_t, np.minimum(counts, ids_t.shape[1]).astype(np.int32)
