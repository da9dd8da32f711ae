"""Python wrappers over the native CPU sparse-attention library (native/fluxion.h states the memory layout).

Every kernel call is batch-oriented: one call per layer covers all (sequence, KV group) tasks, runs on the
library's own thread pool and releases the GIL (cffi API mode drops the GIL around every C call).  Arguments are
checked here and mistakes raise ValueError naming the argument; the C side validates indices again.

Arrays may be numpy arrays or CPU torch tensors; nothing is copied (pointers go straight to C).

Settings: set_threads(n) / env FLUXION_THREADS (default: physical cores), set_simd(path) / env FLUXION_SIMD
(portable | avx2 | avx512 | auto), set_checks(on), set_stream_stores(on) / env FLUXION_STREAM_STORES (0 | 1).
Env FLUXION_NATIVE_SO loads another build of the extension (the AddressSanitizer build of native/asan_check.py).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import threading
from typing import Any, Sequence

import numpy as np

try:
    import torch
except ImportError:  # the kernels work on numpy arrays alone
    torch = None  # type: ignore[assignment]


def _load_extension() -> Any:
    path = os.environ.get("FLUXION_NATIVE_SO")
    if not path:
        from fluxion_lite import _native

        return _native
    loader = importlib.machinery.ExtensionFileLoader("fluxion_lite._native", path)
    spec = importlib.util.spec_from_file_location("fluxion_lite._native", path, loader=loader)
    if spec is None:
        raise ImportError(f"FLUXION_NATIVE_SO={path!r} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_ext = _load_extension()
ffi, lib = _ext.ffi, _ext.lib

TASK_FIELDS = 9  # slot, q_row, kv_head, g, k, ex0_lo, ex0_hi, ex1_lo, ex1_hi
GRANULARITIES = (16, 32, 64, 128)
MAX_GROUP, MAX_DIM, MAX_BLOCK = 16, 256, 128
SIMD_PATHS = ("portable", "avx2", "avx512")
DTYPES = ("float16", "bfloat16")

_ERRORS = {
    1: "invalid KV view",
    2: "slot out of range",
    3: "q_row out of range",
    4: "kv_head out of range",
    5: "granularity not kept in this KV store",
    6: "k / count negative or above k_cap",
    7: "selected block id outside the sequence's blocks",
    8: "a page holding the sequence's tokens is missing",
    9: "output buffer too small",
    10: "query heads not a multiple of KV heads, or group too large",
    11: "SIMD path not supported on this CPU",
    12: "append past the page table's capacity",
}


def _raise_for(rc: int, err_index: Any, what: str) -> None:
    if rc == 0:
        return
    idx = int(err_index[0])
    where = f" (task/item {idx})" if idx >= 0 else ""
    raise ValueError(f"{what}: {_ERRORS.get(rc, f'native error {rc}')}{where}")


# ---------------------------------------------------------------------------------------------------- settings --


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on; os.cpu_count() if unknown."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def set_threads(n: int) -> int:
    """Size the native thread pool (the calling thread counts as one). Returns the size in effect."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"threads must be a positive int, got {n!r}")
    return int(lib.fx_set_threads(n))


def get_threads() -> int:
    return int(lib.fx_get_threads())


def simd_supported() -> list[str]:
    return [name for i, name in enumerate(SIMD_PATHS) if lib.fx_simd_supported(i)]


def set_simd(path: str | None = "auto") -> str:
    """Force a kernel path ('portable', 'avx2', 'avx512') or pick the best ('auto' / None)."""
    if path in (None, "auto"):
        code = lib.fx_set_simd(-1)
    elif path in SIMD_PATHS:
        code = lib.fx_set_simd(SIMD_PATHS.index(path))
        if code < 0:
            raise ValueError(f"simd path {path!r} is not supported on this CPU (supported: {simd_supported()})")
    else:
        raise ValueError(f"simd must be one of {SIMD_PATHS} or 'auto', got {path!r}")
    return SIMD_PATHS[code]


def get_simd() -> str:
    return SIMD_PATHS[lib.fx_get_simd()]


def set_checks(on: bool) -> None:
    """Per-block-id validation in C (on by default). Slot/head/page/output checks stay on regardless."""
    lib.fx_set_checks(1 if on else 0)


def set_stream_stores(on: bool) -> None:
    """gather: non-temporal stores into the staging buffer (default) or plain cached stores."""
    lib.fx_set_stream_stores(1 if on else 0)


def gran_mask(granularities: Sequence[int]) -> int:
    mask = 0
    for g in granularities:
        if g not in GRANULARITIES:
            raise ValueError(f"granularities: {g!r} is not one of {GRANULARITIES}")
        mask |= 1 << GRANULARITIES.index(g)
    return mask


def page_bytes(n_kv_heads: int, head_dim: int, page_tokens: int, granularities: Sequence[int]) -> int:
    """Bytes of one page: K and V [Hkv, P, D] 16-bit, then per kept g the summaries [Hkv, P/g, 2, D] fp32."""
    return int(lib.fx_page_bytes(n_kv_heads, head_dim, page_tokens, gran_mask(granularities)))


def _init_from_env() -> None:
    threads = os.environ.get("FLUXION_THREADS")
    if threads:
        try:
            n = int(threads)
        except ValueError:
            raise ValueError(f"FLUXION_THREADS must be a positive integer, got {threads!r}") from None
        set_threads(n)
    else:
        set_threads(physical_cores())
    set_simd(os.environ.get("FLUXION_SIMD") or "auto")
    stream = os.environ.get("FLUXION_STREAM_STORES")
    if stream is not None:
        if stream not in ("0", "1"):
            raise ValueError(f"FLUXION_STREAM_STORES must be 0 or 1, got {stream!r}")
        set_stream_stores(stream == "1")


_init_from_env()

# ------------------------------------------------------------------------------------------------ array helpers --


def _is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def _np_view(x: Any, name: str) -> np.ndarray:
    """A numpy view sharing memory with x (16-bit floats viewed as uint16)."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
        if x.dtype in (torch.float16, torch.bfloat16, torch.int16):
            return x.view(torch.int16).numpy().view(np.uint16)
        try:
            return x.numpy()
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"{name} has unsupported dtype {x.dtype}") from e
    if isinstance(x, np.ndarray):
        if x.dtype in (np.float16, np.int16):
            return x.view(np.uint16)
        return x
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def _arr(x: Any, name: str, dtype: type, ndim: int | None = None, shape: tuple[int | None, ...] | None = None,
         writable: bool = False) -> np.ndarray:
    a = _np_view(x, name)
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype.name}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and a.shape[axis] != want:
                raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want} on axis {axis}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return a


_ARRAY_TYPE = {"float *": "float[]", "int32_t *": "int32_t[]", "int64_t *": "int64_t[]", "void *": "char[]",
               "uint8_t **": "uint8_t *[]"}


def _ptr(a: np.ndarray, ctype: str) -> Any:
    """A C pointer into a contiguous numpy array's memory (no copy; the array must outlive the call)."""
    return ffi.from_buffer(_ARRAY_TYPE[ctype], a)


def _dtype_code(dtype: Any) -> int:
    if torch is not None and isinstance(dtype, torch.dtype):
        dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    return DTYPES.index(dtype)


# --------------------------------------------------------------------------------------------------------- view --


class KVView:
    """One layer of a host KV store as the C code sees it (the fx_kv_view struct).

    pages: uint64 [n_slots, max_pages] page base addresses (0 = not allocated); n_tokens: int64 [n_slots].
    Both arrays are read (and n_tokens written by append) in place, so keep them alive and pass the same arrays.
    """

    def __init__(self, pages: np.ndarray, n_tokens: np.ndarray, *, n_kv_heads: int, head_dim: int,
                 page_tokens: int, dtype: Any, granularities: Sequence[int]) -> None:
        pages = _arr(pages, "pages", np.uint64, ndim=2)
        n_tokens = _arr(n_tokens, "n_tokens", np.int64, ndim=1, shape=(pages.shape[0],), writable=True)
        if n_kv_heads < 1:
            raise ValueError(f"n_kv_heads must be >= 1, got {n_kv_heads}")
        if head_dim < 16 or head_dim % 16 or head_dim > MAX_DIM:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, {MAX_DIM}], got {head_dim}")
        if page_tokens < MAX_BLOCK or page_tokens % MAX_BLOCK:
            raise ValueError(f"page_tokens must be a positive multiple of {MAX_BLOCK}, got {page_tokens}")
        self.pages, self.n_tokens = pages, n_tokens
        self.n_kv_heads, self.head_dim, self.page_tokens = n_kv_heads, head_dim, page_tokens
        self.dtype = DTYPES[_dtype_code(dtype)]
        self.granularities = tuple(sorted(set(granularities)))
        self.struct = ffi.new("fx_kv_view *")
        s = self.struct
        s.n_slots, s.max_pages = pages.shape
        s.n_kv_heads, s.head_dim, s.page_tokens = n_kv_heads, head_dim, page_tokens
        s.dtype, s.gran_mask = _dtype_code(dtype), gran_mask(self.granularities)
        s.n_tokens = _ptr(n_tokens, "int64_t *")
        s.pages = _ptr(pages, "uint8_t **")

    @property
    def n_slots(self) -> int:
        return int(self.pages.shape[0])

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.n_kv_heads, self.head_dim, self.page_tokens, self.granularities)


# -------------------------------------------------------------------------------------------------------- tasks --


def make_tasks(slots: Any, q_rows: Any, kv_heads: Any, g: Any, k: Any = 0,
               exclude: Sequence[tuple[Any, Any]] = ()) -> np.ndarray:
    """Build the int32 [n_tasks, TASK_FIELDS] task table; every argument broadcasts (scalars or 1-D arrays).

    exclude: up to two (lo, hi) token ranges per task (e.g. sink (0, S) and window (n - W, n)), used by group_topk.
    """
    if len(exclude) > 2:
        raise ValueError(f"exclude: at most 2 ranges, got {len(exclude)}")
    cols = [slots, q_rows, kv_heads, g, k]
    for lo, hi in list(exclude) + [(0, 0)] * (2 - len(exclude)):
        cols += [lo, hi]
    parts = np.broadcast_arrays(*[np.asarray(c, dtype=np.int64) for c in cols])
    table = np.stack([p.reshape(-1) for p in parts], axis=1)
    if table.size and (table.max() > np.iinfo(np.int32).max or table.min() < np.iinfo(np.int32).min):
        raise ValueError("tasks: a field does not fit in int32")
    return np.ascontiguousarray(table.astype(np.int32))


_FIELD_NAMES = ("slot", "q_row", "kv_head", "g")


def _tasks_array(tasks: Any) -> np.ndarray:
    return _arr(tasks, "tasks", np.int32, ndim=2, shape=(None, TASK_FIELDS))


def _check_q(view: KVView, q: Any) -> tuple[np.ndarray, int]:
    a = _arr(q, "q", np.float32, ndim=3)
    n_q_heads, d = a.shape[1], a.shape[2]
    if d != view.head_dim:
        raise ValueError(f"q has head_dim {d}, the KV store has {view.head_dim}")
    if n_q_heads % view.n_kv_heads:
        raise ValueError(f"q has {n_q_heads} heads, not a multiple of n_kv_heads={view.n_kv_heads}")
    r = n_q_heads // view.n_kv_heads
    if r > MAX_GROUP:
        raise ValueError(f"q: group of {r} query heads per KV head exceeds {MAX_GROUP}")
    return a, r


def _selection_arrays(t: np.ndarray, ids: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    ids_a = _arr(ids, "ids", np.int32, ndim=2, shape=(len(t), None))
    counts_a = _arr(counts, "counts", np.int32, ndim=1, shape=(len(t),))
    return ids_a, counts_a


def _native_error(rc: int, err_index: Any, what: str, view: KVView, t: np.ndarray, *, q_rows: int | None = None,
                  k_cap: int | None = None, ids: np.ndarray | None = None, counts: np.ndarray | None = None,
                  kept_only: bool = False) -> ValueError:
    """Turn the C library's (code, task index) into a message naming the offending argument and value.

    Range checks run in C (one pass, no Python per task); this only runs once something was rejected."""
    i = int(err_index[0])
    if i < 0 or rc not in (2, 3, 4, 5, 6, 7, 8, 9):
        return ValueError(f"{what}: {_ERRORS.get(rc, f'native error {rc}')}")
    limits = {2: view.n_slots, 3: q_rows, 4: view.n_kv_heads}
    if rc in limits:
        col = rc - 2
        return ValueError(f"{what}: tasks[{i}].{_FIELD_NAMES[col]}={int(t[i, col])} out of range [0, {limits[rc]})")
    if rc == 5:
        allowed = view.granularities if kept_only else GRANULARITIES
        return ValueError(f"{what}: tasks[{i}].g={int(t[i, 3])} is not one of {allowed}")
    if rc == 6:
        if counts is None:
            return ValueError(f"{what}: tasks[{i}].k={int(t[i, 4])} out of range [0, {k_cap}]")
        return ValueError(f"{what}: counts[{i}]={int(counts[i])} out of range [0, {k_cap}]")
    slot, g = int(t[i, 0]), int(t[i, 3])
    n_tok = int(view.n_tokens[slot])
    if rc == 7 and ids is not None and counts is not None:
        n_blocks = -(-n_tok // g)
        row = ids[i, :counts[i]]
        j = int(np.flatnonzero((row < 0) | (row >= n_blocks))[0])
        return ValueError(f"{what}: ids[{i}, {j}]={int(row[j])} out of range [0, {n_blocks}) (slot {slot}, g={g})")
    if rc == 8:
        return ValueError(f"{what}: tasks[{i}]: slot {slot} holds {n_tok} tokens but a page holding them is missing")
    return ValueError(f"{what}: {_ERRORS[rc]} (task {i})")


# ------------------------------------------------------------------------------------------------------ kernels --


def append(view: KVView, slots: Any, row_start: Any, row_count: Any, k: Any, v: Any) -> None:
    """Append rows of k, v [n_rows, Hkv, D] (16-bit, the store's dtype) to slots; updates summaries and n_tokens.

    Slot slots[i] gets rows row_start[i] .. row_start[i]+row_count[i]-1.  Pages must already be allocated.
    """
    if _is_torch(k) and k.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"k must be float16 or bfloat16, got {k.dtype}")
    if _is_torch(k) and DTYPES[_dtype_code(k.dtype)] != view.dtype:
        raise ValueError(f"k has dtype {k.dtype}, the KV store holds {view.dtype}")
    ka = _arr(k, "k", np.uint16, ndim=3, shape=(None, view.n_kv_heads, view.head_dim))
    va = _arr(v, "v", np.uint16, ndim=3, shape=ka.shape)
    s = np.ascontiguousarray(np.asarray(slots, dtype=np.int32).reshape(-1))
    rs = np.ascontiguousarray(np.broadcast_to(np.asarray(row_start, dtype=np.int64), s.shape))
    rc_ = np.ascontiguousarray(np.broadcast_to(np.asarray(row_count, dtype=np.int64), s.shape))
    if len(np.unique(s)) != len(s):
        raise ValueError("slots: each slot may appear once per append call")
    if s.size and ((s < 0).any() or (s >= view.n_slots).any()):
        raise ValueError(f"slots: values must be in [0, {view.n_slots})")
    if s.size and ((rs < 0).any() or (rc_ < 0).any() or (rs + rc_ > ka.shape[0]).any()):
        raise ValueError(f"row_start/row_count: rows must lie within k's {ka.shape[0]} rows")
    err = ffi.new("int64_t[1]")
    rc = lib.fx_append(view.struct, _ptr(s, "int32_t *"), _ptr(rs, "int64_t *"), _ptr(rc_, "int64_t *"), len(s),
                       _ptr(ka, "void *"), _ptr(va, "void *"), ka.shape[0], err)
    _raise_for(rc, err, "append")


def summaries_update(view: KVView, slots: Any, from_token: Any) -> None:
    """Rebuild summaries of tokens [from_token, n_tokens) (K written into pages by other means)."""
    s = np.ascontiguousarray(np.asarray(slots, dtype=np.int32).reshape(-1))
    f = np.ascontiguousarray(np.broadcast_to(np.asarray(from_token, dtype=np.int64), s.shape))
    err = ffi.new("int64_t[1]")
    rc = lib.fx_summaries_update(view.struct, _ptr(s, "int32_t *"), _ptr(f, "int64_t *"), len(s), err)
    _raise_for(rc, err, "summaries_update")


# Scratch for the C kernels, one per Python thread (concurrent calls must not share it); grown, never shrunk.
_workspace = threading.local()


def _workspace_for(n_floats: int) -> np.ndarray:
    ws = getattr(_workspace, "buf", None)
    if ws is None or ws.size < n_floats:
        ws = np.empty(max(n_floats, 1 << 16), np.float32)
        _workspace.buf = ws
    return ws


def group_topk(view: KVView, q: Any, tasks: Any, k_cap: int | None = None,
               out: tuple[Any, Any, Any] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per task, the k highest-scoring eligible blocks (Quest bound summed over the group's query heads).

    q: fp32 [q_rows, Hq, D]; tasks: int32 [T, TASK_FIELDS] (make_tasks).  Returns ids int32 [T, k_cap] (ascending
    block ids), scores fp32 [T, k_cap], counts int32 [T]; only ids[i, :counts[i]] are meaningful.
    out: optional preallocated (ids, scores, counts).
    """
    qa, _ = _check_q(view, q)
    t = _tasks_array(tasks)
    if k_cap is None:
        k_cap = max(0, int(t[:, 4].max())) if len(t) else 0
    if out is None:
        ids = np.empty((len(t), k_cap), np.int32)
        scores = np.empty((len(t), k_cap), np.float32)
        counts = np.empty(len(t), np.int32)
    else:
        ids = _arr(out[0], "out[0] (ids)", np.int32, ndim=2, shape=(len(t), k_cap), writable=True)
        scores = _arr(out[1], "out[1] (scores)", np.float32, ndim=2, shape=(len(t), k_cap), writable=True)
        counts = _arr(out[2], "out[2] (counts)", np.int32, ndim=1, shape=(len(t),), writable=True)
    # Workspace rows are sized for the longest slot at the finest granularity (an upper bound of every task's
    # block count; C checks the exact need).  Cheaper than per-task numpy work, which cost ~25 us per call.
    max_blocks = -(-int(view.n_tokens.max()) // GRANULARITIES[0]) if view.n_slots else 1
    ws = _workspace_for(int(lib.fx_topk_workspace_floats(len(t), max(1, max_blocks))))
    err = ffi.new("int64_t[1]")
    rc = lib.fx_group_topk(view.struct, _ptr(qa, "float *"), qa.shape[0], qa.shape[1], _ptr(t, "int32_t *"), len(t),
                           k_cap, _ptr(ids, "int32_t *"), _ptr(scores, "float *"), _ptr(counts, "int32_t *"),
                           _ptr(ws, "float *"), ws.size, err)
    if rc:
        raise _native_error(rc, err, "group_topk", view, t, q_rows=qa.shape[0], k_cap=k_cap, kept_only=True)
    return ids, scores, counts


def sparse_attention(view: KVView, q: Any, tasks: Any, ids: Any, counts: Any, scale: float,
                     out: Any | None = None, lse: Any | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each task's query heads attend over its selected blocks; returns out fp32 [T, r, D], lse fp32 [T, r].

    Empty selections give out = 0 and lse = -inf.  lse is the natural log of sum(exp(scale * q.k)), ready to be
    merged with another partial attention.
    """
    qa, r = _check_q(view, q)
    t = _tasks_array(tasks)
    ids_a, counts_a = _selection_arrays(t, ids, counts)
    if not (0.0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    d = view.head_dim
    out_a = np.empty((len(t), r, d), np.float32) if out is None else _arr(out, "out", np.float32, ndim=3,
                                                                          shape=(len(t), r, d), writable=True)
    lse_a = np.empty((len(t), r), np.float32) if lse is None else _arr(lse, "lse", np.float32, ndim=2,
                                                                       shape=(len(t), r), writable=True)
    ws = _workspace_for(int(lib.fx_attention_workspace_floats(len(t), r, d)))
    err = ffi.new("int64_t[1]")
    rc = lib.fx_sparse_attention(view.struct, _ptr(qa, "float *"), qa.shape[0], qa.shape[1], _ptr(t, "int32_t *"),
                                 len(t), _ptr(ids_a, "int32_t *"), _ptr(counts_a, "int32_t *"), ids_a.shape[1],
                                 float(scale), _ptr(out_a, "float *"), _ptr(lse_a, "float *"), _ptr(ws, "float *"),
                                 ws.size, err)
    if rc:
        raise _native_error(rc, err, "sparse_attention", view, t, q_rows=qa.shape[0], k_cap=ids_a.shape[1],
                            ids=ids_a, counts=counts_a)
    return out_a, lse_a


def gather(view: KVView, tasks: Any, ids: Any, counts: Any, k_out: Any, v_out: Any,
           out_offset: Any | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Copy each task's selected blocks (valid tokens, in the given order) into staging k_out/v_out [cap, D].

    out_offset: int64 [T] first row per task; default packs tasks back to back (assuming full blocks).
    Returns (out_offset, out_tokens int32 [T]).
    """
    t = _tasks_array(tasks)
    ids_a, counts_a = _selection_arrays(t, ids, counts)
    ko_ptr, cap = _staging_ptr(k_out, "k_out", view.head_dim, None)
    vo_ptr, _ = _staging_ptr(v_out, "v_out", view.head_dim, cap)
    if out_offset is None:
        sizes = counts_a.astype(np.int64) * t[:, 3]
        offs = np.zeros(len(t), np.int64)
        if len(t):
            offs[1:] = np.cumsum(sizes)[:-1]
    else:
        offs = _arr(out_offset, "out_offset", np.int64, ndim=1, shape=(len(t),))
    tokens = np.empty(len(t), np.int32)
    err = ffi.new("int64_t[1]")
    rc = lib.fx_gather(view.struct, _ptr(t, "int32_t *"), len(t), _ptr(ids_a, "int32_t *"),
                       _ptr(counts_a, "int32_t *"), ids_a.shape[1], _ptr(offs, "int64_t *"), cap,
                       ko_ptr, vo_ptr, _ptr(tokens, "int32_t *"), err)
    if rc == 9:
        i = int(err[0])
        raise ValueError(f"gather: task {i} does not fit: out_offset={int(offs[i])} plus its tokens exceeds the "
                         f"k_out/v_out capacity of {cap} rows")
    if rc:
        raise _native_error(rc, err, "gather", view, t, k_cap=ids_a.shape[1], ids=ids_a, counts=counts_a)
    return offs, tokens


def _staging_ptr(x: Any, name: str, head_dim: int, rows: int | None) -> tuple[Any, int]:
    """(C pointer, rows) of a 16-bit [rows, head_dim] staging buffer.

    A contiguous CPU torch tensor (the usual pinned staging buffer) goes straight through data_ptr(): the generic
    path (a numpy view of the tensor) costs ~5 us per buffer, a visible share of a ~100 us call.  Anything else,
    and every error message, takes the generic path."""
    if (_is_torch(x) and x.dtype in (torch.float16, torch.bfloat16, torch.int16) and x.dim() == 2
            and x.shape[1] == head_dim and (rows is None or x.shape[0] == rows) and x.device.type == "cpu"
            and x.is_contiguous()):
        return ffi.cast("void *", x.data_ptr()), int(x.shape[0])
    a = _arr(x, name, np.uint16, ndim=2, shape=(rows, head_dim), writable=True)
    return _ptr(a, "void *"), int(a.shape[0])


def read_bandwidth_probe(buf: Any, repeats: int = 1) -> float:
    """Read every byte of buf `repeats` times on the pool (a STREAM-like read); returns a checksum."""
    a = _np_view(buf, "buf")
    if not a.flags.c_contiguous:
        raise ValueError("buf must be C-contiguous")
    return float(lib.fx_read_bandwidth_probe(_ptr(a, "void *"), a.nbytes, int(repeats)))


__all__ = [
    "TASK_FIELDS", "GRANULARITIES", "SIMD_PATHS", "KVView", "make_tasks", "append", "summaries_update",
    "group_topk", "sparse_attention", "gather", "read_bandwidth_probe", "set_threads", "get_threads",
    "set_simd", "get_simd", "simd_supported", "set_checks", "set_stream_stores", "physical_cores", "page_bytes",
    "gran_mask",
]
