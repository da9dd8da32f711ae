"""The sparse decode step with selection on the device, captured whole: no host round trip inside a step.

sparse_graph.py keeps top-k and (usually) attention on the CPU, so every layer's device work waits for a D2H of q, the
native calls and an H2D of the results: at batch 1 on the H200 host that round trip, not bandwidth, sets the step
time (bench/tpot.py: ~60% of the step is the GPU waiting). Here the retrieval part runs on the device too:

  prologue(layer)  write the new K/V into the device sink/ring slab and into the step's staging rows for the host
                   store; update the device block summaries (device_select.DeviceSummaries) with the new key;
                   streaming attention over sink + window; Quest scores of every block from the summaries, pinned
                   blocks first, one top-k for all groups of the layer; the selected 16-token chunks of every group
                   read with one gather straight from the pinned host store through the zero-copy alias
                   (zero_copy.py), and one ragged attention over them (softmax per group by segment reductions)
  epilogue(layer)  LSE merge of streaming and retrieval parts -> o [B, Hq, D]
  after_replay()   (eager) one non-blocking D2H of every layer's new K/V
  end()            while the device runs: the previous step's K/V into the host store, the likely next step
                   planned (its inputs, counters and host pages, so begin() only copies); then one sync (the
                   logits are read next anyway)

Pin cache (kernel path; on unless FLUXION_PIN_CACHE=0; pin_pool.py): the pinned blocks, which top-k takes at every
step, are copied to device memory once per sequence and read from there; PCIe then carries the dynamic blocks only.
It is KV on the GPU beyond sink + window (the pinned share of each budget, ~3% of the context with the shipped
plan), so it is counted in SparseAttention.bytes_used and left out when it would take more than PIN_CACHE_SHARE of
the free device memory.

Early block choice (batch-1 steps; on unless FLUXION_EARLY_SELECT=0): layer l's scores, top-k and PCIe reads run
on a side stream during layer l - 1's MLP, from layer l's query predicted off the stream after l - 1's attention
(early()).

All layers are one graph (decode_graphs' whole_step), replayed once per step (FLUXION_DEVICE_GRAPHS=layer: one graph
per layer, launched back to back with nothing in between). The newest tokens are in the device
window, which top-k never selects, so the host store may lag by a step.

Static shapes for capture: each retrieval group's block count k_cap comes from the longest sequence's length rounded
up to BUCKET_TOKENS, so the graph is captured again only when that bucket (or a buffer address) changes; each (row,
group) then uses the first k of its k_cap ranked blocks, k from its own length as the eager path computes it (the
extra <= k_cap - k blocks are masked: device_kernels skips their reads, the torch ops path reads them over PCIe and
counts them in the PCIe bytes; neither counts them in the KV read fraction).
A layer's kernels do not depend on how many groups or budgets it has: groups differ only in how many entries of
the flat block list they own. Supports the static plan with one block size for all retrieval groups (what
DeviceSummaries mirrors); anything else runs eagerly.

The unread-background term (plan.background; device_background.py) needs that block size to be 16: the device
summaries then keep per-128-token value sums too, each (layer, row, group)'s background candidates come in ds.ints
(background_bounds), and after the selection the term is computed from the summaries alone and folded into the
streaming part (the torch path: into the retrieval part), so combine / the epilogue merge it with the rest.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from fluxion_lite.sparse.device import kernels as device_kernels

from fluxion_lite.sparse.device import topk as device_topk
from fluxion_lite.sparse.device.background import background_term, merge_into_partial, merge_normalised, selected_blocks
from fluxion_lite.model.attention import CapturedDecode, SeqChunk
from fluxion_lite.sparse.attend import lse_merge
from fluxion_lite.sparse.device.pin_cache import DevicePinPool, span_kv_rows
from fluxion_lite.sparse.device.reuse_cache import DeviceReuseCache
from fluxion_lite.sparse.host_capture import stream_layer
from fluxion_lite.sparse.device.step_buffers import DeviceStep
from fluxion_lite.sparse.device.topk import ReuseViews
from fluxion_lite.sparse.step import BACKGROUND_G, DecodeStep, GVALS

if TYPE_CHECKING:
    from fluxion_lite.sparse.backend import SparseAttention

BUCKET_TOKENS = 1024  # k_cap follows the longest sequence in steps of this many tokens (a capture per bucket)
# The early block choice (unless FLUXION_EARLY_SELECT=0) runs for steps of at most this many rows: at batch 4 its extra
# query projection and side-stream kernels slowed the step (H200, 8B shape, 32K: 9.65 vs 9.27 ms), at batch 1 they
# shortened it (6.38-6.44 vs 6.60-6.68 ms; docs/hybrid.md)
EARLY_MAX_BATCH = 1
PIN_CACHE_SHARE = 0.5  # the pin cache may take at most this share of the free device memory when it (re)grows
# a step's integer inputs on the host (pinned on CUDA), its k_row [L, B, Hkv] (a view of them) and its counters
StepInputs = tuple[torch.Tensor, np.ndarray, tuple[float, float, float, float]]


def bucket_tokens(n_max: int) -> int:
    return -(-n_max // BUCKET_TOKENS) * BUCKET_TOKENS


def background_bounds(a: SparseAttention, st: DecodeStep, layer_of: np.ndarray, rows: np.ndarray,
                      heads: np.ndarray) -> np.ndarray:
    """Each (layer, row, group)'s unread-background candidates as 16-token blocks [lo, hi), int64 [2, L, B, Hkv]:
    the whole 16-token blocks of its gap between sink and window (its row of st.sink_hi / win_lo), as the native
    term's tasks exclude them (SparseAttention.background_rows, sparse_step.background_tasks); empty for a group
    without a term (with background "retrieval": one without a retrieval task this step). layer_of, rows, heads:
    the step's retrieval tasks (plan_tasks)."""
    gi = a.state.gidx[:, None, :]  # [L, 1, Hkv]
    b = np.arange(st.batch)[None, :, None]  # [1, B, 1]
    lo, hi = -(-st.sink_hi[gi, b] // BACKGROUND_G), st.win_lo[gi, b] // BACKGROUND_G  # [L, B, Hkv]
    if a.plan.background != "all":
        has_task = np.zeros(lo.shape, bool)
        has_task[layer_of, rows, heads] = True
        lo, hi = np.where(has_task, lo, 0), np.where(has_task, hi, 0)
    return np.stack([lo, np.maximum(hi, lo)])


class DeviceGraphedDecode(CapturedDecode):
    """CapturedDecode (model/attention.py) for SparseAttention with selection='gpu' and zero-copy reads."""

    def __init__(self, owner: SparseAttention):
        # No host work between layers, so decode_graphs may capture the step as one graph (measured: one ~7.7 ms
        # cudaGraphLaunch per step on the H200 host). FLUXION_DEVICE_GRAPHS=layer keeps one graph per layer instead,
        # so launching layer i + 1 overlaps running layer i (host(i) does nothing); not measured yet.
        self.whole_step = owner.settings.experimental.device_graphs != "layer"
        self.fused = device_kernels.enabled(owner.device, owner.settings)  # a few Triton kernels, not ~100 torch ops
        # the fused step's block choice: device_topk's select (default) or torch.topk (FLUXION_DEVICE_TOPK=torch:
        # the A/B in bench/results/tpot_llama3.1-8b_32k_topk_h200_*)
        self.torch_topk = owner.settings.experimental.device_topk == "torch"
        # Pinned blocks are chosen once, at the end of a prompt, and top-k takes them at every step: the pin cache
        # copies them to device memory once and reads them from there, so the PCIe bytes per step are the dynamic
        # share of the budget only (H200, 8B shape, 32K: 12.1 -> 9.2 ms at b1, 41.3 -> 20.4 ms at b8). It is KV on
        # the GPU beyond sink + window: FLUXION_PIN_CACHE=0 leaves it out (what issue 5's 13.6 ms target assumes).
        self.a = weakref.proxy(owner)  # graph sets hold this object: they must not keep a dropped backend alive
        self.serial = owner.serial
        assert owner.summaries is not None and owner.executor.feeder is not None
        self.dsum, self.feeder = owner.summaries, owner.executor.feeder
        self.g = self.dsum.g
        # the unread-background term (device_background.py): from the g = 16 summaries and the device value sums
        self.background = owner.plan.background != "off"
        assert not self.background or (self.g == BACKGROUND_G and self.dsum.value_sums)
        self.pool = (DevicePinPool(self.g, owner.cfg.n_kv_heads, owner.cfg.head_dim, owner.store.page_tokens,
                                   owner.store.dtype, owner.device, PIN_CACHE_SHARE)
                     if self.fused and owner.settings.pin_cache else None)
        # blocks read over PCIe kept in device memory for the next steps (reuse_cache.py; FLUXION_REUSE_CACHE=0: off;
        # FLUXION_PIN_CACHE=0 too: it promises no KV on the GPU beyond sink + window)
        keep_kv = owner.settings.pin_cache and owner.settings.reuse_cache
        self.reuse = (DeviceReuseCache(owner.cfg.n_layers, owner.cfg.n_kv_heads, self.g, owner.cfg.head_dim,
                                       owner.store.dtype, owner.device, owner.settings.experimental.reuse_share)
                      if self.fused and not self.torch_topk and keep_kv else None)
        self._reuse_now: DeviceReuseCache | None = None  # self.reuse when it holds the current step structure
        self.static: dict[tuple[object, ...], DeviceStep] = {}
        # per length bucket (prepare): k_cap [L, Hkv], page_cap, k_cap's bytes (in the structure's key), widths
        self._buckets: dict[int, tuple[np.ndarray, int, bytes, tuple[int, ...]]] = {}
        self.ds: DeviceStep | None = None
        self.st: DecodeStep | None = None
        self.chunks: list[SeqChunk] = []
        self._shape: tuple[object, ...] = ()
        self._t0 = 0.0
        # Host work overlapped with the device step (FLUXION_STEP_OVERLAP=0: off, for A/B). At batch 1 on the H200
        # host a step's host work took ~1.3 ms of a ~9.5 ms step with the GPU idle (a cProfile of bench/tpot.py): the
        # next step's plan (~0.7 ms) and the store appends (~0.3 ms). With overlap, end() appends the previous
        # step's K/V and plans the likely next step (the same rows, one token on) while the device runs; the host
        # store then lags the device by one more token, which top-k never reads (the newest tokens are in the window).
        self.overlap = owner.settings.step_overlap
        # (step structure, row set, the step's end event on CUDA) appended at the next end()
        self._queued: tuple[DeviceStep, int, torch.cuda.Event | None] | None = None
        self._last_end = 0.0  # perf_counter at the last deferred end() (0: the last end() synchronised)
        # the next step as end() planned it: ((DecodeStep key, DeviceStep serial), its inputs), its host pages reserved
        self._ahead: tuple[tuple[object, int], StepInputs] | None = None
        self.planned_ahead = 0  # steps that found their plan made by the previous end()
        # The streaming part of a retrieval layer does not wait for the retrieval chain (scores -> top-k -> block
        # attention): on CUDA it runs on a side stream, forked after append_token and joined before combine, so the
        # two run side by side (at batch 1 each fills a few SMs; captured graphs keep the fork as parallel branches).
        # FLUXION_STREAM_BRANCH=0 keeps one stream (for A/B).
        self._side = (torch.cuda.Stream(owner.device)
                      if self.fused and owner.device.type == "cuda"
                      and owner.settings.stream_branch else None)
        # Early block choice (on by default since RULER at batch 1 showed no loss: 4K and 32K, 156 samples each, 9
        # better and 9 worse over both, docs/history.md; FLUXION_EARLY_SELECT=0 for A/B): layer l's
        # blocks are chosen with a query predicted from the stream after layer l-1's attention (Transformer.
        # query_ahead), on a second side stream while layer l-1's MLP runs, and with the reuse cache the chosen
        # blocks' PCIe reads run there too (block_attention stage 1). Layer l's own chain then keeps block attention
        # over device memory only (stage 2). Measured (H200, 8B shape, 32K b1): the retrieval chain 1506 -> 1017 us
        # per step, the step ~0.2 ms shorter (the extra q GEMV and side kernels slow the MLP's GEMMs by ~6 us per
        # layer). The predicted query's choice held 97-99% of the real choice's attention mass on real models
        # (research/speculative_select.py, docs/history.md).
        self.early_on = (self.fused and not self.torch_topk
                         and owner.settings.early_select)
        # high priority: its kernels take SMs as the MLP's GEMM blocks retire, instead of queueing behind them
        self._early_stream = (torch.cuda.Stream(owner.device, priority=owner.settings.experimental.early_priority)
                              if self.early_on and owner.device.type == "cuda" else None)
        self._early_layers: set[int] = set()  # layers whose blocks early() chose in the current pass
        # per layer: the pass's stream snapshot and predicted query, kept so that no buffer a side stream reads is
        # handed to another tensor while it runs (inside a capture they become the graph's own buffers)
        self._early_refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.early_choices = 0  # layers whose blocks were chosen early (tests check the path ran)

    # ---- the step's structure (captured_decode calls prepare before key) -------------------------------------------
    def prepare(self, chunks: list[SeqChunk]) -> None:
        """Sizes of this step's static tensors; grows the device summaries first, so nothing the graphs address
        moves during the step (begin() reserves the host pages, whose tables are copied into fixed tensors)."""
        a = self.a
        n_max = max(c.start for c in chunks) + 1
        nb = bucket_tokens(n_max)
        self.dsum.reserve(a.cfg.n_layers, max(a.state.slot[c.seq_id] for c in chunks), nb // self.g)
        bucket = self._buckets.get(nb)
        if bucket is None:  # once per length bucket, not per step
            # an upper bound of every row's k in this bucket: the budget factor's largest value over the bucket's
            # lengths (a budget curve may rise with n), a long-only group's factor only rises (0 below
            # short_tokens: no blocks, as a streaming group)
            factor = np.full(a.state.budget.shape, a.plan.max_budget_factor(max(nb - BUCKET_TOKENS + 1, 1), nb))
            if a.state.long_only is not None:
                factor[a.state.long_only] = float(a.plan.long_factor(nb))
            k_cap = np.where(a.state.retrieval, np.ceil(a.state.budget * nb * factor / self.g), 0).astype(np.int64)  # [L, Hkv]
            widths = tuple(int(w) for w in np.minimum(k_cap, nb // self.g).max(axis=1))  # per layer
            bucket = self._buckets[nb] = (k_cap, -(-nb // a.store.page_tokens), k_cap.tobytes(), widths)
        k_cap, page_cap, caps_key, widths = bucket
        self._shape = (len(chunks), nb, page_cap, caps_key)
        if self._shape not in self.static:
            if len(self.static) >= 4:  # an old bucket's buffers go with its graphs
                self.static.pop(next(iter(self.static)))
            self.static[self._shape] = DeviceStep(a, len(chunks), k_cap, nb // self.g, page_cap, self.fused)
        if self.reuse is not None:  # may reallocate: before the graphs' key is taken
            self._reuse_now = self.reuse if self.reuse.ensure(len(chunks), nb // self.g, widths) else None
        if self.pool is not None and a.pins is not None:  # may grow the pool: before the graphs' key is taken
            self.pool.reserve(a.pins, np.array([a.state.slot[c.seq_id] for c in chunks]))

    @property
    def pin_cache(self) -> bool:
        """Whether pinned blocks are read from the device pool (on, fitting in device memory, kernel path)."""
        return self.pool is not None and self.pool.enabled

    def pin_cache_bytes(self) -> int:
        """Device memory the pin cache holds."""
        return 0 if self.pool is None else self.pool.nbytes()

    @property
    def reuse_on(self) -> bool:
        """Whether the current step structure reads and keeps blocks in the reuse cache."""
        return self._reuse_now is not None

    def reuse_cache_bytes(self) -> int:
        """Device memory the reuse cache holds."""
        return 0 if self.reuse is None else self.reuse.nbytes()

    def owner_id(self) -> int:
        return self.serial

    def key(self, batch: int) -> tuple[object, ...]:
        """Changes whenever a buffer the captured graphs address was reallocated, or the step's structure changed."""
        a = self.a
        self.feeder.refresh(0)  # the span alias follows the store's slabs
        ds = self.static[self._shape]
        return ("device", a.serial, self._shape, a.state.near.data_ptr(), self.dsum.version, a.store.slab_version,
                ds.serial, 0 if self.pool is None else self.pool.serial, 0 if self.reuse is None else self.reuse.serial,
                self.reuse_on)

    # ---- per step -------------------------------------------------------------------------------------------------
    def begin(self, chunks: list[SeqChunk]) -> None:
        a = self.a
        self.chunks = chunks
        eager = any(p is not None for p in a.state.pending)
        if eager:  # K/V queued by an eager step go in first
            for layer in range(a.cfg.n_layers):
                a.flush_eager_layer(layer)
        self.st = st = a.state.step_for(chunks)  # planned by the last end() when these are its rows one token on
        self.ds = ds = self.static[self._shape]
        ahead, self._ahead = self._ahead, None
        planned: StepInputs | None = None
        if ahead is not None and ahead[0] == (st.key, ds.serial):
            self.planned_ahead += 1
            planned = ahead[1]
        if planned is None or eager:  # pages for this step's appends (and the queued step's), before the tables
            # are copied (the eager K/V moved the store lengths that end()'s reservation counted from)
            a.store.reserve_decode(st.slots, 2 if self.overlap else 1)
        ds.bias.copy_(st.bias)  # device to device: build_step sent it when it planned the step
        ds.slots32[ds.buf][:] = st.slots
        self._load_tables(ds)
        self._load_pins(ds, st)
        self._load_tasks(ds, st, planned)
        if self._reuse_now is not None:
            self._reuse_now.start_step(tuple(c.seq_id for c in chunks))
        self._t0 = time.perf_counter()

    def _load_tables(self, ds: DeviceStep) -> None:
        """Each layer's page table into ds.tables when the store's slabs or that layer's table changed."""
        store = self.a.store
        if ds.table_slabs == store.slab_version and ds.table_versions.tobytes() == store.layer_version.tobytes():
            return  # the usual step: one comparison (of raw bytes: the cheapest in numpy) instead of one per layer
        stale = (range(self.a.cfg.n_layers) if ds.table_slabs != store.slab_version
                 else np.flatnonzero(ds.table_versions != store.layer_version).tolist())
        for layer in stale:
            _, table = self.feeder.refresh(layer)  # [S, max_pages] chunk index of each page in the span
            w = min(table.shape[1], ds.tables.shape[2])
            ds.tables[layer].zero_()
            ds.tables[layer, : table.shape[0], :w] = table[:, :w]
        ds.table_slabs = store.slab_version
        ds.table_versions[:] = store.layer_version

    def _load_tasks(self, ds: DeviceStep, st: DecodeStep, planned: StepInputs | None) -> None:
        """The step's integer inputs (ds.ints: slots, positions, ring slots, eligible blocks, and each (layer, row,
        group)'s k as the host paths compute it: SparseState.plan_tasks) in one copy, made by the previous end()
        when it planned these rows (`planned`; else now); the counters (SparseState.step_counts' streaming and context,
        planned with them; the bytes fetched over PCIe)."""
        a = self.a
        ints, k_row, counts = planned if planned is not None else self._step_ints(ds, st)
        ds.ints.copy_(ints, non_blocking=True)  # pinned on CUDA: asynchronous, after the previous step's reads
        a.state.add_counts(counts)
        # the kernels skip masked ranks; the torch path reads every rank up to k_cap and masks afterwards
        fetched = int(k_row.sum()) if self.fused else ds.fetched_blocks
        if self.pin_cache:  # pinned blocks rank first and come from the device cache
            fetched -= int(np.minimum(k_row, ds.pin_count).sum())
        self._count_pcie(fetched)

    def _step_ints(self, ds: DeviceStep, st: DecodeStep) -> StepInputs:
        """ds.ints' contents for step st, on the host (pinned on CUDA), with k_row int64 [L, B, Hkv] (each (layer,
        row, group)'s k: SparseState.plan_tasks capped at the structure's k_cap) and the step's counters
        (SparseState.step_counts with the tokens the step selects added to the tokens read)."""
        a, B = self.a, st.batch
        tasks, _, ends, selected = a.state.plan_tasks(st)  # tasks: int32 [T, 9] (slot, row, group, g, k, ...)
        layer_of = np.repeat(np.arange(len(ends) - 1), np.diff(ends))  # [T]
        heads = tasks[:, 2].astype(np.int64)
        host = torch.empty(ds.ints.shape[0], dtype=torch.long, pin_memory=a.device.type == "cuda")
        ints = host.numpy()
        gi = GVALS.index(self.g)
        ints[: 3 * B] = st.idx.reshape(-1)  # slots, positions, ring slots, as build_step made them
        ints[3 * B: 4 * B] = st.sink_hi[gi] // self.g  # eligible blocks [lo, hi), as the eager path's
        ints[4 * B: 5 * B] = st.win_lo[gi] // self.g
        k_row = ints[5 * B: 5 * B + ds.k_row.numel()].reshape(ds.k_row.shape)  # [L, B, Hkv]
        k_row[:] = 0
        k_row[layer_of, tasks[:, 1].astype(np.int64), heads] = np.minimum(tasks[:, 4], ds.k_cap[layer_of, heads])
        if ds.bg_bounds is not None:
            bg = ints[5 * B + k_row.size:].reshape(ds.bg_bounds.shape)
            bg[:] = background_bounds(a, st, layer_of, tasks[:, 1].astype(np.int64), heads)
        read, context, streaming, groups = a.state.step_counts(st)
        return host, k_row, (read + float(selected.sum()), context, streaming, groups)

    def _plan_next(self) -> None:
        """The likely next step (these rows, one token on) planned while the device runs this one: its DecodeStep
        (SparseAttention._step_for keeps it) and its integer inputs (_step_ints, for the same step structure);
        begin() uses them when the rows and the structure are as expected."""
        nxt = [SeqChunk(c.seq_id, c.start + c.length, 1) for c in self.chunks]
        st = self.a.state.step_for(nxt)
        ds = self.ds
        assert ds is not None
        # its pages too: the store holds what begin() would count from (the queued step just went in), and the
        # running step reads the device copies of the page tables, which the next begin() refreshes
        self.a.store.reserve_decode(st.slots, 2)
        self._ahead = ((st.key, ds.serial), self._step_ints(ds, st))

    def flush_appends(self) -> None:
        """The queued step's K/V into the host store (SparseAttention._flush calls it before anything reads the
        store: a free, an eager step, an import)."""
        if self._queued is not None:
            ds, buf, done = self._queued
            self._queued = None
            if done is not None:
                done.synchronize()  # its D2H into ds.kv_host[buf] has landed
                if self._reuse_now is not None:  # and its reuse hits' snapshot: a deferred step's are counted here
                    self._count_pcie(-self._reuse_now.take_hits())
            for layer, appender in enumerate(ds.appenders[buf]):
                appender.run(self.a.store.view(layer))

    def _count_pcie(self, blocks: int) -> None:
        """Blocks read from the host store over PCIe (K and V, 16-bit), in the backend's byte counters."""
        a = self.a
        nbytes = float(blocks * self.g * a.cfg.head_dim * 2 * 2)
        a.state.stats.gpu_bytes += nbytes
        a.state.stats.zero_copy_bytes += nbytes

    def _load_pins(self, ds: DeviceStep, st: DecodeStep) -> None:
        """The rows' pinned blocks as a mask [L, B, Hkv, NB] (rebuilt only when the rows or their pins changed);
        with the pin cache, the new sequences' pinned blocks copied to the pool and the step's index into it."""
        a, pins = self.a, self.a.pins
        key = (tuple(st.slots.tolist()), None if pins is None else pins.version)
        if key != ds.pins_key:
            mask = np.zeros(ds.pinned.shape, bool) if pins is None else pins.mask(st.slots, ds.n_blocks)
            ds.pinned.copy_(torch.from_numpy(mask))
            ds.pin_count[:] = mask.sum(-1)
            ds.pins_key = key
        if self.pool is not None and self.pin_cache:
            span = self.feeder.span
            assert span is not None
            copied = self.pool.blocks_copied
            self.pool.fill(span.view(a.store.dtype), ds.tables)  # after _load_tables: the step's page tables
            self._count_pcie(self.pool.blocks_copied - copied)
            ds.pin_index_key = self.pool.index(ds.pin_slot, st.slots, ds.pin_index_key)

    def end(self, defer_sync: bool = False) -> None:
        """After the step's replay and D2H were queued. defer_sync (CUDA, with overlap): wait for the previous step
        instead of this one, so the caller can queue the next step (its input token chosen on the device) before
        this one finishes; the host then trails the device by a step (Engine's async decode, bench/tpot.py
        --async-decode). The previous step's reuse hits are counted then; flush_appends waits for its own step."""
        a, ds = self.a, self.ds
        assert ds is not None
        if not self.whole_step:  # per-layer graphs: after_replay() was not called
            self.after_replay()
        cuda = a.device.type == "cuda"
        deferred = defer_sync and cuda and self.overlap
        if self._reuse_now is not None:  # the hit counter as it stands after this step, read once it is done
            self._reuse_now.snapshot_hits()
        done = None
        if cuda:  # this step's end on the device (its logits, its D2H of the new K/V and of the reuse hits)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(a.device))
        if self.overlap:  # host work while the device runs the step (see __init__)
            self.flush_appends()  # the previous step's K/V (waits for that step: deferred, it may still run)
            self._plan_next()
        if cuda and not deferred:
            done.synchronize()  # type: ignore[union-attr]  # the step's end (the logits are read next)
        if self._reuse_now is not None:  # blocks read from the reuse cache did not cross PCIe
            self._count_pcie(-self._reuse_now.take_hits())  # up to the last step that is done
        self._queued = (ds, ds.buf, done)
        ds.buf ^= 1  # the next step's D2H goes to the other rows
        if not self.overlap:
            self.flush_appends()
        for c in self.chunks:
            a.state.length[c.seq_id] = c.start + c.length
        a.state.stats.steps += 1
        now = time.perf_counter()
        # deferred: the time since the previous end, the step's share of a run of steps (its own span ends later)
        step = now - (self._last_end if deferred and self._last_end > 0 else self._t0)
        self._last_end = now if deferred else 0.0
        a.state.stats.step_s += step
        a.state.stats.gpu_compute_s += step  # nothing inside the step waits for the host

    # ---- captured pieces -----------------------------------------------------------------------------------------
    def prologue(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, D], k, v [B, Hkv, D] (graph buffers)."""
        a, ds = self.a, self.ds
        assert ds is not None
        flat = ds.flat[layer]
        if self.fused:  # device_kernels: append, streaming part, scores, top-k, block attention, combine
            qg = q.view(ds.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim)
            device_kernels.append_token(k, v, a.state.near[layer], ds.stage[layer], self.dsum.layer(layer), ds.slots,
                                        ds.pos, ds.ring, self.g)  # summary capacity reserved in prepare()
            if self.background:
                self.dsum.append_values(layer, ds.slots, ds.pos, v)
            side = self._side if flat is not None else None
            if side is None:
                self._stream_part(layer, qg, ds)
                if flat is not None:
                    self._retrieve_fused(layer, qg, ds, flat)
            else:
                assert flat is not None
                main = torch.cuda.current_stream(a.device)
                side.wait_stream(main)  # fork: after append_token wrote the newest K/V into the window
                with torch.cuda.stream(side):
                    self._stream_part(layer, qg, ds)
                self._retrieve_fused(layer, qg, ds, flat)
                main.wait_stream(side)  # join: combine reads both parts
            if self.background:  # after the join: the term goes into the streaming partials' last split
                selected = None
                if flat is not None:
                    ids, vals, _ = self._chosen(layer, ds, flat[0])
                    ranks = torch.arange(flat[0], device=ids.device)
                    selected = selected_blocks(ids, (vals > float("-inf")) & (ranks < ds.k_row[layer][..., None]),
                                               ds.n_blocks)
                o_bg, lse_bg = self._background(layer, qg, ds, selected)
                merge_into_partial(ds.stream_o[:, :, -1], ds.stream_m[:, :, -1], ds.stream_l[:, :, -1], o_bg, lse_bg)
            device_kernels.combine(ds.part_o, ds.part_m, ds.part_l, ds.starts[layer], ds.caps[layer], ds.stream_o,
                                   ds.stream_m, ds.stream_l, ds.out[layer], flat[0] if flat is not None else 0,
                                   pdl=a.settings.experimental.pdl)
            return
        qg, ds.out_s[layer], ds.lse_s[layer] = stream_layer(a, layer, ds.slots, ds.ring, ds.bias, q, k, v)
        ds.stage[layer, :, 0] = k  # [B, Hkv, D] each, for the host store
        ds.stage[layer, :, 1] = v
        self.dsum.append_tokens(layer, ds.slots, ds.pos, 0, 0, k, v)  # capacity reserved in prepare()
        selected = self._retrieve(layer, qg, ds, *flat) if flat is not None else None
        if self.background:  # folded into the retrieval part, which the epilogue merges with the streaming one
            merge_normalised(ds.o_ret, ds.lse_ret, *self._background(layer, qg, ds, selected))

    def _background(self, layer: int, qg: torch.Tensor, ds: DeviceStep, selected: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's unread-background term (device_background.py) for query qg [B, Hkv, r, D], given the blocks
        the step reads (selected bool [B, Hkv, NB], None: none) -> o fp32 [B, Hkv, r, D], lse fp32 [B, Hkv, r]."""
        assert ds.bg_bounds is not None
        return background_term(qg, self.dsum.layer(layer), self.dsum.layer_values(layer), ds.slots, ds.pos + 1,
                               ds.bg_bounds[:, layer], selected, ds.n_blocks, self.a.scale)

    def _stream_part(self, layer: int, qg: torch.Tensor, ds: DeviceStep) -> None:
        """Attention over the device sink + window of every group -> the partials ds.stream_o/m/l."""
        a = self.a
        device_kernels.stream_attention(qg, a.state.near[layer], ds.bias, a.state.gidx_dev[layer], ds.slots, ds.stream_o,
                                        ds.stream_m, ds.stream_l, a.scale)

    def _retrieve_fused(self, layer: int, qg: torch.Tensor, ds: DeviceStep,
                        flat: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        """_retrieve in device_kernels' kernels -> the partials ds.part_o/m/l that combine merges."""
        width = flat[0]
        if layer in self._early_layers:  # chosen (and fetched) during the previous layer's MLP: wait for it
            self._early_layers.discard(layer)
            if self._early_stream is not None:
                torch.cuda.current_stream(qg.device).wait_stream(self._early_stream)
            ids, vals, reuse = self._chosen(layer, ds, width)
            self._attend(layer, qg, ds, flat, ids, vals, reuse, 0 if reuse is None else 2)
            return
        self._attend(layer, qg, ds, flat, *self._choose(layer, qg, ds, width), 0)

    def _chosen(self, layer: int, ds: DeviceStep, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, ReuseViews | None]:
        """The layer's chosen blocks: ids, vals [B, Hkv, width] (views of ds.top_*), and its reuse cache views."""
        n = ds.batch * self.a.cfg.n_kv_heads * width
        reuse = self._reuse_now.views(layer, width) if self._reuse_now is not None and not self.torch_topk else None
        return ds.top_ids[:n].view(ds.batch, -1, width), ds.top_vals[:n].view(ds.batch, -1, width), reuse

    def _choose(self, layer: int, qg: torch.Tensor, ds: DeviceStep, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, ReuseViews | None]:
        """Block scores of query qg [B, Hkv, r, D] and the top-k into ds.top_ids / top_vals (with the reuse cache:
        its hits and entries); returns _chosen's views of them."""
        scores = device_kernels.block_scores(qg, self.dsum.layer(layer), ds.slots, ds.bounds, ds.n_blocks,
                                             ds.pinned[layer], ds.scores, self.dsum.midrange)
        ids, vals, reuse = self._chosen(layer, ds, width)
        if self.torch_topk:
            top = scores.topk(width, dim=-1)  # [B, Hkv, width] best first
            vals.copy_(top.values)
            ids.copy_(top.indices)
        else:  # the same blocks, unordered, without a sort (device_topk's docstring says why)
            device_topk.select_top(scores, ds.k_row[layer], ids, vals, reuse)
        return ids, vals, reuse

    def _attend(self, layer: int, qg: torch.Tensor, ds: DeviceStep, flat: tuple[int, torch.Tensor, torch.Tensor],
                ids: torch.Tensor, vals: torch.Tensor, reuse: ReuseViews | None, stage: int) -> None:
        """device_kernels.block_attention over the chosen blocks (stage: see there) -> ds.part_o/m/l."""
        _, flat_h, flat_j = flat
        span = self.feeder.span
        assert span is not None
        pin = self.pool is not None and self.pool.kv is not None
        cache = self._reuse_now
        ab = self.a.settings.experimental  # block_attention's A/B knobs (FLUXION_BA_*)
        device_kernels.block_attention(qg, ids, vals, flat_h, flat_j, ds.k_row[layer], ds.slots, ds.tables[layer],
                                       span.view(self.a.store.dtype), self.a.store.page_tokens, self.g,
                                       self.a.scale, ds.part_o, ds.part_m, ds.part_l,
                                       ds.pin_slot[layer] if pin else None, self.pool.kv if pin else None,
                                       *((reuse.entry, reuse.hit, cache.kv(layer))
                                         if reuse is not None and cache is not None else ()), stage=stage,
                                       warps=ab.ba_warps, entries=ab.ba_entries, always_dot=ab.ba_dot)

    def early(self, layer: int, x: torch.Tensor, query: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Called inside layer - 1's post_attention (decode_graphs) with the stream x [B, d] after its attention:
        unless FLUXION_EARLY_SELECT=0, choose layer's blocks from query(x) [B, Hq, D] on the early stream, and
        fetch the chosen misses into the reuse cache there (see __init__); _retrieve_fused then waits for it."""
        ds = self.ds
        if not self.early_on or ds is None or ds.flat[layer] is None or ds.batch > EARLY_MAX_BATCH:
            return
        a = self.a
        snap = x.clone()  # [B, d]: the MLP's residual add changes x in place while the early stream reads it
        es = self._early_stream
        if es is not None:
            es.wait_stream(torch.cuda.current_stream(x.device))  # fork: after the attention's residual add
        with torch.cuda.stream(es) if es is not None else contextlib.nullcontext():
            q = query(snap)  # [B, Hq, D]
            qg = q.view(ds.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim)
            flat = ds.flat[layer]
            assert flat is not None
            ids, vals, reuse = self._choose(layer, qg, ds, flat[0])
            if reuse is not None:  # the PCIe reads now; the real query attends over device memory later
                self._attend(layer, qg, ds, flat, ids, vals, reuse, 1)
        self._early_refs[layer] = (snap, q)
        self._early_layers.add(layer)
        self.early_choices += 1

    def _retrieve(self, layer: int, qg: torch.Tensor, ds: DeviceStep, width: int, flat_h: torch.Tensor,
                  flat_j: torch.Tensor) -> torch.Tensor | None:
        """Top-k over the device summaries and attention over the chosen chunks, read through the alias, for all
        retrieval groups of the layer at once -> ds.o_ret [B, Hkv, r, D], ds.lse_ret [B, Hkv, r]. Returns, with the
        unread-background term, which blocks were read (bool [B, Hkv, NB]), else None."""
        a = self.a
        B, hkv, r, d, g = ds.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim, self.g
        dev = qg.device
        scores = self.dsum.scores(layer, qg, ds.slots, ds.bounds[0], ds.bounds[1], ds.n_blocks, ds.pinned[layer])
        vals, ids = scores.topk(width, dim=-1)  # [B, Hkv, width] best first
        ids, vals = ids[:, flat_h, flat_j], vals[:, flat_h, flat_j]  # [B, N]: each group's first k_cap
        valid = (vals > float("-inf")) & (flat_j < ds.k_row[layer][:, flat_h])  # [B, N]
        span = self.feeder.span
        assert span is not None
        n = flat_h.shape[0]
        rows = span.index_select(0, span_kv_rows(ds.tables[layer], ds.slots[:, None].expand(B, n),
                                                 flat_h[None, :].expand(B, n), ids, g, a.store.page_tokens,
                                                 hkv))  # the PCIe read
        kv = rows.view(a.store.dtype).view(2, B, n, g, d).float()  # [2, B, N, g, D]
        q = qg.float()[:, flat_h]  # [B, N, r, D]: each block with its group's queries
        logits = torch.einsum("bnrd,bntd->bnrt", q, kv[0]) * a.scale  # [B, N, r, g]
        logits = logits.masked_fill(~valid[:, :, None, None], float("-inf"))
        values = kv[1].masked_fill(~valid[:, :, None, None], 0.0)  # masked blocks may hold any bits: 0 x NaN = NaN
        idx = flat_h[None, :, None].expand(B, n, r)
        m = torch.full((B, hkv, r), float("-inf"), device=dev).scatter_reduce(1, idx, logits.amax(-1), "amax")
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # [B, Hkv, r]; 0 for a group with nothing
        p = torch.exp(logits - m[:, flat_h][..., None])  # [B, N, r, g]
        s = torch.zeros(B, hkv, r, device=dev).index_add_(1, flat_h, p.sum(-1))
        o = torch.zeros(B, hkv, r, d, device=dev).index_add_(1, flat_h, torch.einsum("bnrt,bntd->bnrd", p, values))
        ds.o_ret.copy_(o / s.clamp_min(1e-30)[..., None])
        ds.lse_ret.copy_(m + torch.log(s))  # -inf for a group with nothing selected
        if not self.background:
            return None
        hits = torch.zeros(B, hkv * ds.n_blocks, device=dev)  # [B, Hkv * NB]: scatter_add, as ids may repeat
        return hits.scatter_add_(1, flat_h[None, :] * ds.n_blocks + ids, valid.float()).view(B, hkv, -1) > 0

    def epilogue(self, layer: int) -> torch.Tensor:
        """Merge the streaming and retrieval parts by LSE -> o [B, Hq, D] in the model dtype."""
        a, ds = self.a, self.ds
        assert ds is not None
        B, hkv, r, d = ds.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim
        if self.fused:  # merged by device_kernels.combine in the prologue
            return ds.out[layer].view(B, hkv * r, d)
        out_s, lse_s = ds.out_s[layer], ds.lse_s[layer]
        assert out_s is not None and lse_s is not None
        out = lse_merge(out_s, lse_s, ds.o_ret, ds.lse_ret)  # lse_s is finite: the streaming part always has tokens
        ds.lse_ret.fill_(float("-inf"))  # groups without a task in the next layer contribute nothing
        return out.view(B, hkv * r, d).to(a.dtype)

    def host(self, layer: int) -> None:
        """Between per-layer replays (FLUXION_DEVICE_GRAPHS=layer): nothing; the new K/V leave after the step."""

    def after_replay(self) -> None:
        ds = self.ds
        assert ds is not None
        ds.kv_host[ds.buf].copy_(ds.stage, non_blocking=True)  # every layer's new K/V, queued after the replay
