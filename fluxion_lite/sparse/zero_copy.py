"""Zero-copy GPU feeder: the GPU reads the selected KV blocks itself from the pinned host store, over PCIe.

With unified virtual addressing (every 64-bit CUDA platform), pinned host memory is mapped into the device's address
space at the same address, so a CUDA kernel can load from it directly. The host store's slabs (host_kv.py) are such
memory. Here:
  - `raw_view` makes a torch tensor over a raw address range: on CUDA an alias through `__cuda_array_interface__`
    (torch.as_tensor; cupy + DLPack as a second way), on a CPU device a numpy view of the same host bytes.
  - `check` proves the alias works before anything relies on it: bytes written on the host, read back by a kernel
    through the alias, compared; also across two separate allocations (the span trick below).
  - `probe` times an alias read in the decode access pattern (4 KiB chunks in random order) and the device
    attention over what was read: the scheduler's zero-copy GPU side (scheduler.Costs.pcie_read_gbs/gpu_attn_gbs).
  - `ZeroCopyFeeder` turns a layer's GPU tasks (selected block ids) into chunk indices with torch ops on the device,
    reads K and V of all tasks with one index_select through the alias, and runs the batched block attention.

The span trick: one alias covers [lowest slab, end of highest slab] as int64 rows of one 16-token chunk of one head
(16 x D x 2 bytes). Slabs are separate allocations, so the span also covers unmapped gaps between them; nothing ever
reads there, because every index is computed from a page's real address and clamped into a real page (an unused
page-table entry maps to chunk 0, the first page of the lowest slab). torch only inspects the base address (a pointer
attribute query) when it creates the alias, and index_select checks indices against the span's row count only.
This saves one kernel per slab per layer (a store holds hundreds of slabs) and the Python bookkeeping of grouping
chunks by slab.

On a CPU device the "alias" is the host memory itself and the same code runs with torch CPU ops (tests/test_hybrid.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from fluxion_lite.hostkv.store import CHUNK_TOKENS, HostKVStore

LOG = logging.getLogger("fluxion_lite.sparse.zero_copy")


class _DeviceArray:
    """A `__cuda_array_interface__` (v2: no stream semantics) over a raw device-visible address; holds its owner."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "strides": None,
                                         "version": 2}


class _HostArray:
    """The numpy `__array_interface__` equivalent for a host address (the CPU-device "alias")."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: object):
        self.owner = owner
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "strides": None,
                                    "version": 3}


_TYPESTR = {torch.uint8: "|u1", torch.int64: "<i8"}


def raw_view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: object) -> torch.Tensor:
    """A tensor of `shape` (contiguous) at address ptr on `device`, alive as long as the tensor: the tensor keeps
    `owner` (whatever owns the memory) referenced. CUDA: ptr must be pinned host memory (or device memory)."""
    typestr = _TYPESTR[dtype]
    if device.type != "cuda":
        arr = np.asarray(_HostArray(ptr, shape, typestr, owner))  # arr.base keeps the owner
        return torch.from_numpy(arr)
    errors = []
    try:
        t = torch.as_tensor(_DeviceArray(ptr, shape, typestr, owner))
        if t.device.type == "cuda" and t.data_ptr() == ptr:
            return t if t.device == device or device.index is None else t.to(device)
        errors.append(f"torch.as_tensor gave {t.device} at {t.data_ptr():#x}")
    except Exception as e:  # noqa: BLE001 - any failure means: try the next way
        errors.append(f"torch.as_tensor: {e}")
    try:
        import cupy  # type: ignore[import-not-found]

        nbytes = int(np.prod(shape)) * (8 if dtype == torch.int64 else 1)
        index = device.index if device.index is not None else torch.cuda.current_device()
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=index)
        arr = cupy.ndarray(shape, dtype=cupy.int64 if dtype == torch.int64 else cupy.uint8,
                           memptr=cupy.cuda.MemoryPointer(mem, 0))
        t = torch.from_dlpack(arr)
        if t.device.type == "cuda" and t.data_ptr() == ptr:
            return t
        errors.append(f"cupy/dlpack gave {t.device} at {t.data_ptr():#x}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"cupy: {e}")
    raise RuntimeError("no CUDA alias of host memory: " + "; ".join(errors))


def _device_pointer_matches(ptr: int) -> str | None:
    """With cupy: the device address of a pinned host pointer must be the pointer itself (UVA). A query, so a
    mismatch is found without a kernel touching a bad address. None when fine or when cupy is missing."""
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        a = cupy.cuda.runtime.pointerGetAttributes(ptr)
    except Exception as e:  # noqa: BLE001
        return f"pointerGetAttributes failed: {e}"
    if int(a.devicePointer) != ptr or int(a.hostPointer) != ptr:
        return f"host {ptr:#x} maps to device {int(a.devicePointer):#x} (no unified addressing for it)"
    return None


_checked: dict[str, tuple[bool, str]] = {}


def check(device: torch.device, enabled: bool = True) -> tuple[bool, str]:
    """(usable, why): can kernels on `device` read the store's pinned host memory through an alias? Cached per device.
    enabled=False (the setting FLUXION_ZERO_COPY=0, settings.zero_copy is False) turns it off. On a CPU device it is
    always usable (the alias is the memory itself)."""
    if device.type != "cuda":
        return True, "CPU device: the alias is the host memory itself"
    if not enabled:
        return False, "disabled by FLUXION_ZERO_COPY=0"
    key = str(device)
    if key not in _checked:
        try:
            _checked[key] = _round_trip(device)
        except Exception as e:  # noqa: BLE001 - any failure: fall back to staging
            _checked[key] = (False, f"{type(e).__name__}: {e}")
    return _checked[key]


def _round_trip(device: torch.device) -> tuple[bool, str]:
    n = 1 << 20
    gen = torch.Generator().manual_seed(1234)
    # two allocations from the store's allocator: the alias must work inside one and across both (the span trick)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory()
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory()
    for t in (a, b):
        bad = _device_pointer_matches(t.data_ptr())
        if bad:
            return False, bad
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    span_rows = (hi.data_ptr() + n - lo.data_ptr()) // 8
    if lo.data_ptr() % 8 or hi.data_ptr() % 8:
        return False, "pinned allocations are not 8-byte aligned"
    span = raw_view(lo.data_ptr(), (span_rows,), torch.int64, device, (lo, hi))
    rows_lo = torch.arange(0, n // 8, device=device)
    rows_hi = (hi.data_ptr() - lo.data_ptr()) // 8 + rows_lo
    perm = torch.randperm(2 * (n // 8), generator=gen).to(device)
    rows = torch.cat([rows_lo, rows_hi])[perm]
    got = span.index_select(0, rows).cpu()  # a kernel reads host memory through the alias
    want = torch.cat([lo.view(torch.int64), hi.view(torch.int64)])[perm.cpu()]
    if not torch.equal(got, want):
        return False, f"alias read mismatch ({int((got != want).sum())} of {got.numel()} words differ)"
    lo.view(torch.int64)[:16] = 0x5A5A  # host writes after the alias exists are seen by the next kernel
    torch.cuda.synchronize(device)
    # read by a kernel again (index_select, as the feeder does; a memcpy may take another route)
    if not torch.equal(span.index_select(0, rows_lo[:16]).cpu(), lo.view(torch.int64)[:16]):
        return False, "alias does not see host writes"
    return True, f"alias round trip ok (2 x {n >> 20} MiB pinned, read by index_select on {device})"


_probed: dict[str, tuple[float, float, float]] = {}


def probe(device: torch.device, mib: int = 128, head_dim: int = 128) -> tuple[float, float, float]:
    """(pcie_read_gbs, gpu_attn_gbs, fixed_s) of the zero-copy GPU side, measured: an alias read of `mib` MiB of
    pinned host memory as 16-token chunks in random order (the decode access pattern), attention of 4 query heads
    over what was read (from device memory), and the time of a one-chunk read + attention (launches, sync).
    Cached per device. Only meaningful on CUDA (on a CPU device: a copy within host memory)."""
    key = f"{device}:{mib}:{head_dim}"
    if key in _probed:
        return _probed[key]
    from fluxion_lite.sparse.attend import masked_attention

    chunk = CHUNK_TOKENS * head_dim * 2
    n = (mib << 20) // chunk
    host = torch.zeros(n * chunk, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.view(torch.bfloat16).normal_()  # finite values; every OS page touched before timing
    span = raw_view(host.data_ptr(), (n, chunk // 8), torch.int64, device, host)
    idx = torch.randperm(n).to(device)
    out = torch.empty(n, chunk // 8, dtype=torch.int64, device=device)
    t_tasks, per_task = 64, n // 64  # attention shape: 64 tasks of r = 4 over n/64 chunks each
    q = torch.randn(t_tasks, 4, head_dim, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    kv = out.view(torch.bfloat16)[: t_tasks * per_task].view(t_tasks, per_task * CHUNK_TOKENS, head_dim)
    valid = torch.ones(t_tasks, per_task * CHUNK_TOKENS, dtype=torch.bool, device=device)

    def timed(fn: Any, repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return best

    read = lambda: torch.index_select(span, 0, idx, out=out)  # noqa: E731
    attend = lambda: masked_attention(q, kv, kv, valid, 0.1)  # noqa: E731
    read()
    attend()  # warm-up: mappings, kernels, cuBLAS
    read_s, attn_s = timed(read, 3), timed(attend, 3)
    one = idx[:1]

    def tiny() -> None:
        torch.index_select(span, 0, one, out=out[:1])
        masked_attention(q[:1], kv[:1, :CHUNK_TOKENS], kv[:1, :CHUNK_TOKENS], valid[:1, :CHUNK_TOKENS], 0.1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    tiny()
    fixed = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        tiny()
        fixed = min(fixed, time.perf_counter() - t0)
    nbytes = n * chunk
    result = (nbytes / read_s / 1e9, nbytes / attn_s / 1e9, fixed)
    del span, out, kv
    _probed[key] = result
    return result


class ZeroCopyFeeder:
    """GPU-side gather + attention over a HostKVStore through one alias of its slabs (see the module docstring)."""

    def __init__(self, store: HostKVStore, device: torch.device):
        self.store, self.device = store, device
        self.h, self.p, self.d = store.n_kv_heads, store.page_tokens, store.head_dim
        self.chunks_per_head = self.p // CHUNK_TOKENS  # chunks of one head in one page (K or V)
        self.span: torch.Tensor | None = None  # int64 [span_chunks, chunk_bytes / 8]
        self._span_version = -1
        self._base = 0
        # per layer: device table [S, max_pages] of each page's first chunk in the span (0 where no page)
        self._tables: list[torch.Tensor | None] = [None] * store.n_layers
        self._table_key: list[tuple[int, int, int]] = [(-1, -1, -1)] * store.n_layers

    def refresh(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The alias over every slab (span, int64 rows of one chunk) and the layer's chunk table, rebuilt only when
        the store's slabs or the layer's pages changed; the device step reads both at fixed addresses."""
        st = self.store
        if self._span_version != st.slab_version:
            starts = st.page_addresses()
            base = min(a for a, _ in starts)
            end = max(a + n * st.page_stride for a, n in starts)
            # owner: the store's slab list, so no slab can go while an alias of it lives
            self.span = raw_view(base, ((end - base) // st.chunk_bytes, st.chunk_bytes // 8), torch.int64,
                                 self.device, st.slabs)
            self._base, self._span_version = base, st.slab_version
        key = (st.slab_version, int(st.layer_version[layer]), st.page_table(layer).shape[1])
        if self._table_key[layer] != key:
            addr = st.page_table(layer).astype(np.int64)  # [S, max_pages]; addresses fit int64 (user space)
            table = np.where(addr != 0, (addr - self._base) // st.chunk_bytes, 0)
            self._tables[layer] = torch.from_numpy(table).to(self.device)
            self._table_key[layer] = key
        assert self.span is not None and self._tables[layer] is not None
        return self.span, self._tables[layer]  # type: ignore[return-value]

    def attend(self, layer: int, n_tokens: np.ndarray, qg: torch.Tensor, tasks: np.ndarray, ids: np.ndarray,
               counts: np.ndarray, bh: np.ndarray, scale: float, meta_host: torch.Tensor, meta_dev: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The layer's GPU tasks: tasks int32 [T, 9], ids int32 [T, k_cap] (block ids, any order), counts int32 [T],
        bh int64 [T] (rows of qg); n_tokens int64 [slots] of this layer; qg [n_bh, r, D] on the device.
        meta_host / meta_dev: int32 buffers of >= meta_size(...) elements (pinned host / device; the same tensor on a
        CPU device), free to overwrite. Returns out fp32 [T, r, D], lse fp32 [T, r], bh on the device [T], and the
        K+V bytes read from host memory.

        Only the selected chunks cross PCIe: they are read packed (task after task), then placed into a padded
        [T, C * 16, D] layout in device memory for the batched attention (C: chunks of the largest task)."""
        span, table = self.refresh(layer)
        T, dev = len(tasks), self.device
        kc = self.ids_width(counts)
        n_live = counts.astype(np.int64) * tasks[:, 3] // CHUNK_TOKENS  # [T] chunks per task
        n_read = int(n_live.sum())  # N: chunks read over PCIe (known here, so no device->host sync)
        n_chunks = max(1, int(n_live.max()) if T else 1)  # C
        offs = np.zeros(T, np.int64)
        offs[1:] = np.cumsum(n_live)[:-1]
        # one int32 upload: fields [7, T] (slot, head, g, count, tokens of the slot, bh, first packed chunk),
        # then ids [T, kc]
        n_meta = self.meta_size(T, counts)
        fields = meta_host[: 7 * T].view(7, T)
        for i, col in enumerate((tasks[:, 0], tasks[:, 2], tasks[:, 3], counts, n_tokens[tasks[:, 0]], bh, offs)):
            fields[i] = torch.from_numpy(np.ascontiguousarray(col, dtype=np.int32))
        meta_host[7 * T : n_meta].view(T, kc).copy_(torch.from_numpy(np.ascontiguousarray(ids[:, :kc], np.int32)))
        m = meta_dev[:n_meta]
        if dev.type == "cuda":
            m.copy_(meta_host[:n_meta], non_blocking=True)
        slot, head, g, cnt, ntok, bh_dev, first = m[: 7 * T].view(7, T).long().unbind(0)  # each [T]
        sel = m[7 * T :].view(T, kc).long()  # [T, kc]
        cpb = g // CHUNK_TOKENS  # [T] chunks per block
        # packed chunk f belongs to task t(f), chunk jj(f) of that task
        t_of = torch.repeat_interleave(torch.arange(T, device=dev), cnt * cpb, output_size=n_read)  # [N]
        jj = torch.arange(n_read, device=dev) - first[t_of]  # [N]
        cpb_f = cpb[t_of]
        blk = sel[t_of, torch.div(jj, cpb_f, rounding_mode="floor")].clamp_(min=0)  # [N] block id
        t0 = blk * g[t_of] + (jj % cpb_f) * CHUNK_TOKENS  # [N] first token of the chunk
        page = torch.div(t0, self.p, rounding_mode="floor").clamp_(max=table.shape[1] - 1)
        # every index lands in a real page: page clamped into the table, an unused entry -> chunk 0 (a real page)
        k_idx = table[slot[t_of], page] + head[t_of] * self.chunks_per_head + (t0 % self.p) // CHUNK_TOKENS
        v_idx = k_idx + self.h * self.chunks_per_head
        rows = span.index_select(0, torch.cat([k_idx, v_idx]))  # [2N, 16 * D * 2 / 8] int64: the PCIe read
        dest = t_of * n_chunks + jj  # [N] row in the padded layout
        padded = torch.zeros(2, T * n_chunks, rows.shape[1], dtype=torch.int64, device=dev)
        padded.index_copy_(1, dest, rows.view(2, n_read, -1))
        kv = padded.view(torch.bfloat16).view(2, T, n_chunks * CHUNK_TOKENS, self.d)  # [2, T, C * 16, D]
        valid = torch.zeros(T * n_chunks, CHUNK_TOKENS, dtype=torch.uint8, device=dev)  # uint8: any index_copy_
        valid.index_copy_(0, dest, (t0[:, None] + torch.arange(CHUNK_TOKENS, device=dev) < ntok[t_of, None]).to(torch.uint8))
        from fluxion_lite.sparse.attend import masked_attention

        out, lse = masked_attention(qg[bh_dev], kv[0], kv[1], valid.view(T, -1).bool(), scale)  # [T, r, D], [T, r]
        return out, lse, bh_dev, 2 * n_read * self.store.chunk_bytes

    @staticmethod
    def ids_width(counts: np.ndarray) -> int:
        return max(1, int(counts.max()) if len(counts) else 1)

    @classmethod
    def meta_size(cls, n_tasks: int, counts: np.ndarray) -> int:
        """int32 elements of attend's upload for n_tasks tasks."""
        return n_tasks * (7 + cls.ids_width(counts))


def log_fallback(reason: str) -> None:
    LOG.warning("zero-copy GPU feeder unavailable (%s): the GPU side uses the staging path (CPU gather + H2D)", reason)
