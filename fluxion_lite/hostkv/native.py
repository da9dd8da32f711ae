"""Python wrappers over the native CPU sparse-attention library (native/fluxion.h states the memory layout).

Every kernel call is batch-oriented: one call per layer covers all (sequence, KV group) tasks, runs on the
library's own thread pool and releases the GIL (cffi API mode drops the GIL around every C call).  Arguments are
checked here and mistakes raise ValueError naming the argument; the C side validates indices again.

Arrays may be numpy arrays or CPU torch tensors; nothing is copied (pointers go straight to C).

Settings: set_threads(n) / FLUXION_THREADS (default: physical cores), set_simd(path) / FLUXION_SIMD
(portable | avx2 | avx512 | avx512bf16 | auto; avx512bf16 = avx512 plus q.k by bf16 dot products when q is exactly
bf16, see fluxion.h), set_checks(on), set_stream_stores(on) / FLUXION_STREAM_STORES (0 | 1). The variables are read
through fluxion_lite.settings when this module is imported, and configure(settings) applies an engine's settings.
FLUXION_NATIVE_SO loads another build of the extension (the AddressSanitizer build of native/asan_check.py).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import threading
from typing import Any, Sequence

import numpy as np

from fluxion_lite.settings import Settings

try:
    import torch
except ImportError:  # the kernels work on numpy arrays alone
    torch = None  # type: ignore[assignment]


_SETTINGS = Settings.load()  # the environment's settings when the module is first imported


def _load_extension(path: str | None) -> Any:
    if not path:
        return importlib.import_module("fluxion_lite._native")  # the cffi extension built by native/build_native.py
    loader = importlib.machinery.ExtensionFileLoader("fluxion_lite._native", path)
    spec = importlib.util.spec_from_file_location("fluxion_lite._native", path, loader=loader)
    if spec is None:
        raise ImportError(f"FLUXION_NATIVE_SO={path!r} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_ext = _load_extension(_SETTINGS.native_so)
ffi, lib = _ext.ffi, _ext.lib

# the header's constants (build_native.py binds fluxion.h itself, so these cannot drift from the C side)
TASK_FIELDS = int(lib.FX_TASK_FIELDS)  # slot, q_row, kv_head, g, k, ex0_lo, ex0_hi, ex1_lo, ex1_hi
GRANULARITIES = (16, 32, 64, 128)
MAX_GROUP, MAX_DIM, MAX_BLOCK = int(lib.FX_MAX_GROUP), int(lib.FX_MAX_DIM), int(lib.FX_MAX_BLOCK)
SIMD_PATHS = ("portable", "avx2", "avx512", "avx512bf16")  # fluxion.h FX_SIMD_* codes, in order
DTYPES = ("float16", "bfloat16")
SCORINGS = ("group", "per-head", "midrange")  # group_topk's block scoring, in the order of fluxion.h's FX_SCORE_* codes

_ERRORS = {
    lib.FX_E_VIEW: "invalid KV view",
    lib.FX_E_SLOT: "slot out of range",
    lib.FX_E_QROW: "q_row out of range",
    lib.FX_E_HEAD: "kv_head out of range",
    lib.FX_E_GRAN: "granularity not kept in this KV store",
    lib.FX_E_K: "k / count negative or above k_cap",
    lib.FX_E_BLOCK: "selected block id outside the sequence's blocks",
    lib.FX_E_PAGE: "a page holding the sequence's tokens is missing",
    lib.FX_E_OUTPUT: "output buffer too small",
    lib.FX_E_GROUP: "query heads not a multiple of KV heads, or group too large",
    lib.FX_E_SIMD: "SIMD path not supported on this CPU",
    lib.FX_E_APPEND: "append past the page table's capacity",
    lib.FX_E_SCORING: "unknown block-scoring mode",
    lib.FX_E_PIN: "bad pinned blocks",
    lib.FX_E_SPAN: "a task's two token ranges overlap",
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


DEFAULT_SPIN_US = 200.0  # fx_pool.c's FX_SPIN_NS


def set_spin_us(us: float | None) -> float:
    """How long idle pool workers spin before sleeping (None: the default, 200 us). A GPU decode step raises it for
    its duration: its host calls come a device layer apart (0.2-1 ms), and a call that finds the workers asleep runs
    mostly on its caller. Returns the value in effect."""
    if us is not None and (isinstance(us, bool) or not isinstance(us, (int, float)) or not us >= 0):
        raise ValueError(f"spin must be None or a non-negative number of microseconds, got {us!r}")
    return float(lib.fx_set_spin_ns(-1 if us is None else int(us * 1000))) / 1000


def wake_threads() -> None:
    """Sleeping pool workers wake and spin, so that a call a few microseconds later finds them running."""
    lib.fx_wake_threads()


def simd_supported() -> list[str]:
    return [name for i, name in enumerate(SIMD_PATHS) if lib.fx_simd_supported(i)]


def set_simd(path: str | None = "auto") -> str:
    """Force a kernel path ('portable', 'avx2', 'avx512', 'avx512bf16') or pick the best ('auto' / None)."""
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


def gran_mask(granularities: Sequence[int], value_sums: bool = False) -> int:
    """The view's layout mask: one bit per kept granularity, and FX_KEEP_VALUE_SUMS if the pages hold value sums."""
    mask = lib.FX_KEEP_VALUE_SUMS if value_sums else 0
    for g in granularities:
        if g not in GRANULARITIES:
            raise ValueError(f"granularities: {g!r} is not one of {GRANULARITIES}")
        mask |= 1 << GRANULARITIES.index(g)
    return mask


def page_bytes(n_kv_heads: int, head_dim: int, page_tokens: int, granularities: Sequence[int],
               value_sums: bool = False) -> int:
    """Bytes of one page: K and V [Hkv, P, D] 16-bit, then per kept g the summaries [Hkv, P/g, 2, D] 16-bit, then
    (value_sums) the per-128-token value sums [Hkv, P/128, D] fp32."""
    return int(lib.fx_page_bytes(n_kv_heads, head_dim, page_tokens, gran_mask(granularities, value_sums)))


_configured: tuple[int | None, str, bool] | None = None  # what configure() applied last


def configure(settings: Settings) -> None:
    """The pool size, SIMD path and gather stores of `settings` (threads, simd, experimental.stream_stores) into
    the library, unless they are what configure() applied last (so set_threads / set_simd calls in between stand
    until the settings change). Runs at import with the environment's settings; the engine calls it with its own."""
    global _configured
    wanted = (settings.threads, settings.simd, settings.experimental.stream_stores)
    if wanted == _configured:
        return
    set_threads(settings.threads or physical_cores())
    set_simd(settings.simd)
    set_stream_stores(settings.experimental.stream_stores)
    _configured = wanted


configure(_SETTINGS)

# ------------------------------------------------------------------------------------------------ array helpers --
#
# A decode step calls every kernel once per layer, so the wrappers' fixed cost adds up: the checks below take a
# fast path for the usual arguments (a numpy array or a contiguous CPU torch tensor already of the right dtype and
# shape) and fall back to the generic path, which also words every error message, for anything else.

_F32, _I32, _I64, _U16, _U64 = (np.dtype(t) for t in (np.float32, np.int32, np.int64, np.uint16, np.uint64))

# cffi array types per numpy dtype, built once (ffi.from_buffer with a type object skips parsing a C type string)
_C_ARRAY = {dt: ffi.typeof(f"{name}[]") for dt, name in
            ((_F32, "float"), (_I32, "int32_t"), (_I64, "int64_t"), (_U16, "uint16_t"), (_U64, "uint64_t"))}
_C_POINTER = {dt: ffi.typeof(f"{name}*") for dt, name in
              ((_F32, "float"), (_I32, "int32_t"), (_I64, "int64_t"), (_U16, "uint16_t"))}
# torch dtypes whose memory a numpy dtype stands for (16-bit floats travel as raw uint16)
_TORCH_DTYPES: dict[np.dtype, tuple[Any, ...]] = {} if torch is None else {
    _F32: (torch.float32,), _I32: (torch.int32,), _I64: (torch.int64,),
    _U16: (torch.float16, torch.bfloat16, torch.int16),
}


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


def _shape_fits(have: Sequence[int], want: tuple[int | None, ...] | None) -> bool:
    """have matches want on every axis where want is not None (the ranks are checked by the caller)."""
    if want is None or have == want:  # a whole-tuple compare settles the usual case without a Python loop
        return True
    for h, w in zip(have, want):
        if w is not None and h != w:
            return False
    return True


def _arr(x: Any, name: str, dtype: Any, ndim: int | None = None, shape: tuple[int | None, ...] | None = None,
         writable: bool = False) -> np.ndarray:
    """x as a C-contiguous numpy array of dtype (a view, never a copy); ValueError naming `name` otherwise."""
    # Fast path: a numpy array exactly as required (builtin dtypes are singletons, so `is` compares them; an equal
    # but distinct dtype object only takes the slow path).
    if type(x) is np.ndarray:
        shp = x.shape
        if (x.dtype is dtype and (ndim is None or len(shp) == ndim) and x.flags.c_contiguous
                and (not writable or x.flags.writeable) and (shape is None or shp == shape or _shape_fits(shp, shape))):
            return x
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


def _buf(x: Any, name: str, dtype: np.dtype, ndim: int, shape: tuple[int | None, ...] | None = None,
         writable: bool = False) -> tuple[Any, tuple[int, ...]]:
    """(C pointer, shape) of an array argument that C only reads or fills (no numpy view needed afterwards).

    A contiguous CPU torch tensor (queries, outputs, k/v, pinned staging buffers) goes straight through
    data_ptr(): a numpy view of a tensor costs 1-2 us, a visible share of a call.  Empty tensors (data_ptr 0)
    and anything unusual take the generic path, which also raises the error messages."""
    if type(x) is np.ndarray:  # _arr's fast path, inlined: one call level less on every numpy argument
        shp = x.shape
        if (x.dtype is dtype and len(shp) == ndim and x.flags.c_contiguous and (not writable or x.flags.writeable)
                and (shape is None or shp == shape or _shape_fits(shp, shape))):
            return ffi.from_buffer(_C_ARRAY[dtype], x), shp
    elif torch is not None and isinstance(x, torch.Tensor):
        shp = x.shape  # a new torch.Size (a tuple) per access: read it once
        if (len(shp) == ndim and x.dtype in _TORCH_DTYPES[dtype] and x.is_cpu and x.is_contiguous()
                and (shape is None or shp == shape or _shape_fits(shp, shape))):
            addr = x.data_ptr()
            if addr:
                return ffi.cast(_C_POINTER[dtype], addr), shp
    a = _arr(x, name, dtype, ndim, shape, writable)
    return ffi.from_buffer(_C_ARRAY[dtype], a), a.shape


def _cptr(a: np.ndarray) -> Any:
    """A C pointer into a contiguous numpy array of one of the kernels' dtypes (no copy; a keeps the memory)."""
    return ffi.from_buffer(_C_ARRAY[a.dtype], a)


_ARRAY_TYPE = {"float *": ffi.typeof("float[]"), "int32_t *": ffi.typeof("int32_t[]"),
               "int64_t *": ffi.typeof("int64_t[]"), "void *": ffi.typeof("char[]"),
               "uint8_t **": ffi.typeof("uint8_t *[]")}


def _ptr(a: np.ndarray, ctype: str) -> Any:
    """A C pointer into a contiguous numpy array's memory (no copy; the array must outlive the call)."""
    return ffi.from_buffer(_ARRAY_TYPE[ctype], a)


def _int_vector(x: Any, n: int, dtype: np.dtype = _I64) -> np.ndarray:
    """x (a scalar or n values) as a contiguous 1-D array of n values; an array already so is passed through."""
    a = np.asarray(x, dtype=dtype)
    if a.shape != (n,):
        a = np.broadcast_to(a, (n,))  # scalars (and length-1 arrays); anything else raises numpy's ValueError
    return np.ascontiguousarray(a)


def _dtype_code(dtype: Any) -> int:
    if torch is not None and isinstance(dtype, torch.dtype):
        dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    return DTYPES.index(dtype)


class _Scratch(threading.local):
    """Per Python thread (concurrent calls must not share them): the kernels' workspace, grown and never shrunk,
    with its C pointer made once, and the error-index cell every C call writes."""

    def __init__(self) -> None:
        self.err = ffi.new("int64_t[1]")
        self.ws_floats = 0
        self.grow(1 << 16)

    def grow(self, n_floats: int) -> None:
        """Make the workspace (ws_ptr, ws_floats) at least n_floats long.

        By 1.5x at least: the need grows with the longest sequence during decode, and each growth costs the
        calling wrapper a rejected C call first (see group_topk)."""
        if self.ws_floats < n_floats:
            n_floats = max(n_floats, self.ws_floats * 3 // 2)
            self.ws = np.empty(n_floats, np.float32)  # ws_ptr keeps it alive too; the old one is freed
            self.ws_ptr, self.ws_floats = _cptr(self.ws), n_floats


_scratch = _Scratch()


# --------------------------------------------------------------------------------------------------------- view --


class KVView:
    """One layer of a host KV store as the C code sees it (the fx_kv_view struct).

    pages: uint64 [n_slots, max_pages] page base addresses (0 = not allocated); n_tokens: int64 [n_slots].
    Both arrays are read (and n_tokens written by append) in place, so keep them alive and pass the same arrays.
    The struct holding their C pointers is built once here; every call passes it as is.
    """

    def __init__(self, pages: np.ndarray, n_tokens: np.ndarray, *, n_kv_heads: int, head_dim: int,
                 page_tokens: int, dtype: Any, granularities: Sequence[int], value_sums: bool = False) -> None:
        pages = _arr(pages, "pages", _U64, ndim=2)
        n_tokens = _arr(n_tokens, "n_tokens", _I64, ndim=1, shape=(pages.shape[0],), writable=True)
        if n_kv_heads < 1:
            raise ValueError(f"n_kv_heads must be >= 1, got {n_kv_heads}")
        if head_dim < 16 or head_dim % 16 or head_dim > MAX_DIM:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, {MAX_DIM}], got {head_dim}")
        if page_tokens < MAX_BLOCK or page_tokens % MAX_BLOCK:
            raise ValueError(f"page_tokens must be a positive multiple of {MAX_BLOCK}, got {page_tokens}")
        self.pages, self.n_tokens = pages, n_tokens
        self.n_kv_heads, self.head_dim, self.page_tokens = n_kv_heads, head_dim, page_tokens
        self.dtype = DTYPES[_dtype_code(dtype)]
        # the torch dtype append() accepts for k/v (None without torch)
        self.torch_dtype = None if torch is None else getattr(torch, self.dtype)
        self.granularities = tuple(sorted(set(granularities)))
        self.value_sums = value_sums  # the pages hold per-128-token value sums (what background() reads)
        self._n_slots = int(pages.shape[0])
        self.struct = ffi.new("fx_kv_view *")
        s = self.struct
        s.n_slots, s.max_pages = pages.shape
        s.n_kv_heads, s.head_dim, s.page_tokens = n_kv_heads, head_dim, page_tokens
        s.dtype, s.gran_mask = _dtype_code(dtype), gran_mask(self.granularities, value_sums)
        s.n_tokens = _ptr(n_tokens, "int64_t *")
        s.pages = _ptr(pages, "uint8_t **")

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.n_kv_heads, self.head_dim, self.page_tokens, self.granularities, self.value_sums)


# -------------------------------------------------------------------------------------------------------- tasks --

_INT32_SPAN = 1 << 32


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
    # Fill one int64 table column by column (numpy broadcasts each column on assignment): no per-column
    # conversion, broadcast copy and stack, which cost ~30 us per call.
    table = np.empty(np.broadcast(*cols).shape + (TASK_FIELDS,), np.int64)
    for j, col in enumerate(cols):
        table[..., j] = col
    # Every field fits in int32 iff x + 2**31 lies in [0, 2**32) for all of them: one reduction over the table
    # (values that wrap past int64 land far above 2**32 as uint64, so they are caught too).
    if table.size and int((table + (_INT32_SPAN >> 1)).view(np.uint64).max()) >= _INT32_SPAN:
        raise ValueError("tasks: a field does not fit in int32")
    return table.reshape(-1, TASK_FIELDS).astype(np.int32)


_FIELD_NAMES = ("slot", "q_row", "kv_head", "g")


def _tasks_array(tasks: Any) -> np.ndarray:
    # every kernel call checks its tasks: the usual table (make_tasks' output) is recognised without _arr's loop
    if (type(tasks) is np.ndarray and tasks.dtype is _I32 and tasks.ndim == 2 and tasks.shape[1] == TASK_FIELDS
            and tasks.flags.c_contiguous):
        return tasks
    return _arr(tasks, "tasks", _I32, ndim=2, shape=(None, TASK_FIELDS))


def _check_q(view: KVView, q: Any) -> tuple[Any, int, int, int]:
    """(pointer, q_rows, n_q_heads, r) of the fp32 queries q [q_rows, Hq, D]."""
    q_ptr, (q_rows, n_q_heads, d) = _buf(q, "q", _F32, 3)
    if d != view.head_dim:
        raise ValueError(f"q has head_dim {d}, the KV store has {view.head_dim}")
    if n_q_heads % view.n_kv_heads:
        raise ValueError(f"q has {n_q_heads} heads, not a multiple of n_kv_heads={view.n_kv_heads}")
    r = n_q_heads // view.n_kv_heads
    if r > MAX_GROUP:
        raise ValueError(f"q: group of {r} query heads per KV head exceeds {MAX_GROUP}")
    return q_ptr, q_rows, n_q_heads, r


def _selection_arrays(t: np.ndarray, ids: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """ids int32 [T, k_cap] and counts int32 [T] for the tasks t (group_topk's output is recognised inline)."""
    n = len(t)
    if (type(ids) is np.ndarray and type(counts) is np.ndarray and ids.dtype is _I32 and counts.dtype is _I32
            and ids.ndim == 2 and ids.shape[0] == n and counts.shape == (n,) and ids.flags.c_contiguous
            and counts.flags.c_contiguous):
        return ids, counts
    return (_arr(ids, "ids", _I32, ndim=2, shape=(n, None)),
            _arr(counts, "counts", _I32, ndim=1, shape=(n,)))


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

_E_OUTPUT, _E_PIN = lib.FX_E_OUTPUT, lib.FX_E_PIN
_INF = float("inf")


def _kv_rows(view: KVView, x: Any, name: str, rows: int | None) -> tuple[Any, tuple[int, ...]]:
    """(pointer, shape) of append's k or v: [rows, Hkv, D] 16-bit; a torch tensor must have the store's dtype."""
    if _is_torch(x) and x.dtype is not view.torch_dtype:
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        raise ValueError(f"{name} has dtype {x.dtype}, the KV store holds {view.dtype}")
    return _buf(x, name, _U16, 3, (rows, view.n_kv_heads, view.head_dim))


def append(view: KVView, slots: Any, row_start: Any, row_count: Any, k: Any, v: Any) -> None:
    """Append rows of k, v [n_rows, Hkv, D] (16-bit, the store's dtype) to slots; updates summaries and n_tokens.

    Slot slots[i] gets rows row_start[i] .. row_start[i]+row_count[i]-1.  Pages must already be allocated.
    All items are checked before anything is written, so a rejected call changes nothing.
    """
    k_ptr, k_shape = _kv_rows(view, k, "k", None)
    n_rows = k_shape[0]
    v_ptr, _ = _kv_rows(view, v, "v", n_rows)
    s = np.ascontiguousarray(np.asarray(slots, dtype=np.int32).reshape(-1))
    rs, rc_ = _int_vector(row_start, len(s)), _int_vector(row_count, len(s))
    # The checks run on Python ints with builtin min/max/set: about 0.1 us per item against a numpy call's
    # ~1 us each, and an item's copy in C costs several times that, so this never dominates a call.
    sl, rsl, rcl = s.tolist(), rs.tolist(), rc_.tolist()
    if len(set(sl)) != len(sl):
        raise ValueError("slots: each slot may appear once per append call")
    if sl and (min(sl) < 0 or max(sl) >= view.n_slots):
        raise ValueError(f"slots: values must be in [0, {view.n_slots})")
    if sl and (min(rsl) < 0 or min(rcl) < 0 or max(a + b for a, b in zip(rsl, rcl)) > n_rows):
        raise ValueError(f"row_start/row_count: rows must lie within k's {n_rows} rows")
    err = _scratch.err
    rc = lib.fx_append(view.struct, _cptr(s), _cptr(rs), _cptr(rc_), len(s), k_ptr, v_ptr, n_rows, err)
    _raise_for(rc, err, "append")


def summaries_update(view: KVView, slots: Any, from_token: Any) -> None:
    """Rebuild summaries of tokens [from_token, n_tokens) (K written into pages by other means)."""
    s = np.ascontiguousarray(np.asarray(slots, dtype=np.int32).reshape(-1))
    f = _int_vector(from_token, len(s))
    err = _scratch.err
    rc = lib.fx_summaries_update(view.struct, _cptr(s), _cptr(f), len(s), err)
    _raise_for(rc, err, "summaries_update")


def _scoring_code(scoring: str) -> int:
    if scoring == "group":  # compared by value first: the usual argument costs no list search
        return 0
    if scoring in SCORINGS:
        return SCORINGS.index(scoring)
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def scoring_code(scoring: str) -> int:
    """The native code (FX_SCORE_*) of a block scoring name: "group", "per_head" or "midrange"."""
    return _scoring_code(scoring)


_NO_PINS = (ffi.NULL, ffi.NULL, 0)


def _pin_args(n: int, pins: Any, pin_counts: Any) -> tuple[Any, Any, int]:
    """(pins pointer, pin_counts pointer, pin_stride) for n tasks: pins int32 [n, W] and pin_counts int32 [n], both
    or neither (then NULLs: no pins). The values (counts, ascending ids, ranges) are checked in C on every call."""
    if pins is None and pin_counts is None:
        return _NO_PINS
    if pins is None or pin_counts is None:
        raise ValueError("pins and pin_counts go together (both or neither)")
    ids_ptr, (_, width) = _buf(pins, "pins", _I32, 2, (n, None))
    counts_ptr, _ = _buf(pin_counts, "pin_counts", _I32, 1, (n,))
    return ids_ptr, counts_ptr, width


def _pin_error(what: str, view: KVView, t: np.ndarray, i: int, pins: Any, pin_counts: Any) -> ValueError:
    """Which pinned-blocks rule task i broke (fluxion.h, PINNED BLOCKS), worded; only runs after C rejected it."""
    if i < 0:
        return ValueError(f"{what}: pins: negative row stride")
    p_ids, p_counts = _np_view(pins, "pins"), _np_view(pin_counts, "pin_counts")
    count, width, k = int(p_counts[i]), p_ids.shape[1], int(t[i, 4])
    if not 0 <= count <= width:
        return ValueError(f"{what}: pin_counts[{i}]={count} out of range [0, {width}] (pins has {width} columns)")
    if count > k:
        return ValueError(f"{what}: pin_counts[{i}]={count} exceeds the task's k={k} (pins take part of k)")
    slot, g = int(t[i, 0]), int(t[i, 3])
    n_tok = int(view.n_tokens[slot])
    n_blocks = -(-n_tok // g)
    row = p_ids[i, :count].astype(np.int64)
    for j, b in enumerate(row.tolist()):
        if not 0 <= b < n_blocks:
            return ValueError(f"{what}: pins[{i}, {j}]={b} out of range [0, {n_blocks}) (slot {slot}, g={g})")
        if j and b <= row[j - 1]:
            return ValueError(f"{what}: pins[{i}]: ids must be strictly ascending, got {row[j - 1]} then {b}")
        for x in range(2):
            lo, hi = int(t[i, 5 + 2 * x]), int(t[i, 6 + 2 * x])
            if max(lo, b * g) < min(hi, (b + 1) * g, n_tok):
                return ValueError(f"{what}: pins[{i}, {j}]={b} (tokens [{b * g}, {(b + 1) * g})) intersects the "
                                  f"task's excluded range [{lo}, {hi})")
    return ValueError(f"{what}: {_ERRORS[_E_PIN]} (task {i})")


def group_topk(view: KVView, q: Any, tasks: Any, k_cap: int | None = None,
               out: tuple[Any, Any, Any] | None = None, scoring: str = "group", pins: Any | None = None,
               pin_counts: Any | None = None) -> tuple[Any, Any, Any]:
    """Per task, the k highest-scoring eligible blocks by the Quest bound of the group's query heads.

    q: fp32 [q_rows, Hq, D]; tasks: int32 [T, TASK_FIELDS] (make_tasks).  Returns ids int32 [T, k_cap] (ascending
    block ids), scores fp32 [T, k_cap], counts int32 [T]; only ids[i, :counts[i]] are meaningful.
    out: optional preallocated (ids, scores, counts), numpy arrays or CPU tensors, filled and returned as given.
    scoring: "group" scores a block by the bound of the summed query heads; "per-head" by max over the heads j of
    bound_j(block) - max over eligible blocks of bound_j (each head's gap to its own best block; scores <= 0);
    "midrange" by the summed query heads . (block min + block max) / 2 (an estimate, not a bound).
    pins int32 [T, W], pin_counts int32 [T] (both or neither): task i's P = pin_counts[i] pinned block ids,
    ascending, in pins[i, :P]; the selection is those P blocks plus the k - P best eligible blocks that are not
    pinned, ids ascending (fluxion.h, PINNED BLOCKS). P <= k, and pins must be blocks of the slot outside the
    task's excluded ranges: else ValueError naming the entry.
    """
    code = _scoring_code(scoring)
    q_ptr, q_rows, n_q_heads, r = _check_q(view, q)
    t = _tasks_array(tasks)
    n = len(t)
    pin_ptr, pin_counts_ptr, pin_stride = _pin_args(n, pins, pin_counts)
    if k_cap is None:
        k_cap = max(0, int(np.maximum.reduce(t[:, 4]))) if n else 0  # the ufunc itself: .max() adds a wrapper
    if out is None:
        ids, scores, counts = np.empty((n, k_cap), _I32), np.empty((n, k_cap), _F32), np.empty(n, _I32)
        ids_ptr, scores_ptr, counts_ptr = _cptr(ids), _cptr(scores), _cptr(counts)
    else:
        ids, scores, counts = out
        ids_ptr, _ = _buf(ids, "out[0] (ids)", _I32, 2, (n, k_cap), writable=True)
        scores_ptr, _ = _buf(scores, "out[1] (scores)", _F32, 2, (n, k_cap), writable=True)
        counts_ptr, _ = _buf(counts, "out[2] (counts)", _I32, 1, (n,), writable=True)
    t_ptr, scratch = _cptr(t), _scratch
    err = scratch.err

    def call() -> int:
        return lib.fx_group_topk_pinned(view.struct, q_ptr, q_rows, n_q_heads, t_ptr, n, k_cap, code, pin_ptr,
                                        pin_counts_ptr, pin_stride, ids_ptr, scores_ptr, counts_ptr, scratch.ws_ptr,
                                        scratch.ws_floats, err)

    # Try the thread's workspace as it is: C computes the exact need (from every task's block count) and returns
    # FX_E_OUTPUT before touching any memory when it is short.  Only then size it, for the longest slot at the
    # finest granularity (an upper bound of every task's block count), and call again; the workspace is kept, so
    # this happens once per new sequence-length record, not per call.
    rc = call()
    if rc == _E_OUTPUT:
        max_blocks = -(-int(view.n_tokens.max()) // GRANULARITIES[0])
        scratch.grow(int(lib.fx_topk_scoring_workspace_floats(n, max(1, max_blocks), r, code)))
        rc = call()
    if rc == _E_PIN:
        raise _pin_error("group_topk", view, t, int(err[0]), pins, pin_counts)
    if rc:
        raise _native_error(rc, err, "group_topk", view, t, q_rows=q_rows, k_cap=k_cap, kept_only=True)
    return ids, scores, counts


class _SelectedCall:
    """The checked arguments of a call over tasks with selections that writes out fp32 [T, r, D] and lse fp32 [T, r]
    (sparse_attention, background): q, the task table, ids / counts, a positive finite scale, and the output
    buffers (made here when not given)."""

    def __init__(self, view: KVView, q: Any, tasks: Any, ids: Any, counts: Any, scale: float, out: Any | None,
                 lse: Any | None) -> None:
        self.q_ptr, self.q_rows, self.n_q_heads, self.r = _check_q(view, q)
        self.t = _tasks_array(tasks)
        n, r, d = len(self.t), self.r, view.head_dim
        self.n = n
        self.ids, self.counts = _selection_arrays(self.t, ids, counts)
        if not (0.0 < scale < _INF):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        self.out = np.empty((n, r, d), _F32) if out is None else out
        self.out_ptr, _ = _buf(self.out, "out", _F32, 3, (n, r, d), writable=True)
        self.lse = np.empty((n, r), _F32) if lse is None else lse
        self.lse_ptr, _ = _buf(self.lse, "lse", _F32, 2, (n, r), writable=True)


def sparse_attention(view: KVView, q: Any, tasks: Any, ids: Any, counts: Any, scale: float,
                     out: Any | None = None, lse: Any | None = None) -> tuple[Any, Any]:
    """Each task's query heads attend over its selected blocks; returns out fp32 [T, r, D], lse fp32 [T, r].

    Empty selections give out = 0 and lse = -inf.  lse is the natural log of sum(exp(scale * q.k)), ready to be
    merged with another partial attention.  out/lse: optional preallocated buffers (numpy arrays or CPU tensors),
    filled and returned as given.
    """
    a = _SelectedCall(view, q, tasks, ids, counts, scale, out, lse)
    t, n, ids_a, counts_a, r, d = a.t, a.n, a.ids, a.counts, a.r, view.head_dim
    t_ptr, ids_ptr, counts_ptr, k_cap, scratch = _cptr(t), _cptr(ids_a), _cptr(counts_a), ids_a.shape[1], _scratch
    err = scratch.err

    def call() -> int:
        return lib.fx_sparse_attention(view.struct, a.q_ptr, a.q_rows, a.n_q_heads, t_ptr, n, ids_ptr, counts_ptr,
                                       k_cap, float(scale), a.out_ptr, a.lse_ptr, scratch.ws_ptr, scratch.ws_floats,
                                       err)

    # As in group_topk: the thread's workspace as it is first; sized by the C formula only when C says it is short.
    rc = call()
    if rc == _E_OUTPUT:
        scratch.grow(int(lib.fx_attention_workspace_floats(n, r, d)))
        rc = call()
    if rc:
        raise _native_error(rc, err, "sparse_attention", view, t, q_rows=a.q_rows, k_cap=ids_a.shape[1],
                            ids=ids_a, counts=counts_a)
    return a.out, a.lse


def background(view: KVView, q: Any, tasks: Any, ids: Any, counts: Any, scale: float,
               out: Any | None = None, lse: Any | None = None) -> tuple[Any, Any]:
    """The unread-background term of each task (fluxion.h, "unread background"): out fp32 [T, r, D], lse fp32 [T, r].

    For the tokens a task's selection (ids int32 [T, k_cap] strictly ascending per row, counts int32 [T], at the
    task's g) leaves unread between its excluded ranges: one softmax term per 128-token block, its mass from the
    16-token blocks' midrange keys, its value the block's mean value; merge (out, lse) with the read part by
    log-sum-exp.  No unread block: out 0, lse -inf.  Needs a view with the g = 16 summaries and value sums
    (HostKVStore(value_sums=True)).  out/lse: optional preallocated buffers, filled and returned as given.
    """
    if not view.value_sums or GRANULARITIES[0] not in view.granularities:
        raise ValueError("background: the KV store keeps no value sums or no g=16 summaries "
                         "(HostKVStore(value_sums=True, granularities including 16))")
    a = _SelectedCall(view, q, tasks, ids, counts, scale, out, lse)
    t, n, ids_a, counts_a, r, d = a.t, a.n, a.ids, a.counts, a.r, view.head_dim
    t_ptr, ids_ptr, counts_ptr, k_cap, scratch = _cptr(t), _cptr(ids_a), _cptr(counts_a), ids_a.shape[1], _scratch
    err = scratch.err

    def call() -> int:
        return lib.fx_background(view.struct, a.q_ptr, a.q_rows, a.n_q_heads, t_ptr, n, ids_ptr, counts_ptr, k_cap,
                                 float(scale), a.out_ptr, a.lse_ptr, scratch.ws_ptr, scratch.ws_floats, err)

    rc = call()
    if rc == _E_OUTPUT:
        scratch.grow(int(lib.fx_background_workspace_floats(n, r, d)))
        rc = call()
    if rc == lib.FX_E_BLOCK:
        i = int(err[0])
        row = ids_a[i, :counts_a[i]].tolist()
        raise ValueError(f"background: ids[{i}, :{int(counts_a[i])}]={row} must be strictly ascending block "
                         f"ids in [0, {-(-int(view.n_tokens[int(t[i, 0])]) // int(t[i, 3]))}) (slot {int(t[i, 0])}, "
                         f"g={int(t[i, 3])})")
    if rc:
        raise _native_error(rc, err, "background", view, t, q_rows=a.q_rows, k_cap=k_cap, ids=ids_a, counts=counts_a)
    return a.out, a.lse


def _spans_call(view: KVView, what: str, t: np.ndarray, q_ptr: Any, q_rows: int, n_q_heads: int, r: int,
                scale: float, rows_ptr: Any, n_rows: int, out_ptr: Any, lse_ptr: Any, rows: np.ndarray,
                tokens: Any) -> int:
    """fx_attend_spans of the tasks t with checked pointers; the thread's workspace grown when C says it is short.
    Returns the tokens attended."""
    scratch = _scratch
    err = scratch.err
    n = len(t)
    args = (view.struct, q_ptr, q_rows, n_q_heads, _cptr(t), n, float(scale), rows_ptr, n_rows, out_ptr, lse_ptr)
    rc = lib.fx_attend_spans(*args, scratch.ws_ptr, scratch.ws_floats, tokens, err)
    if rc == _E_OUTPUT and int(err[0]) < 0:
        scratch.grow(int(lib.fx_spans_workspace_floats(n, r, view.head_dim)))
        rc = lib.fx_attend_spans(*args, scratch.ws_ptr, scratch.ws_floats, tokens, err)
    if rc == _E_OUTPUT:
        i = int(err[0])
        raise ValueError(f"{what}: rows[{i}]={int(rows[i])}: rows must be strictly ascending in [0, {n_rows})")
    if rc == lib.FX_E_SPAN:
        i = int(err[0])
        raise ValueError(f"{what}: tasks[{i}]: the ranges [{int(t[i, 5])}, {int(t[i, 6])}) and "
                         f"[{int(t[i, 7])}, {int(t[i, 8])}) overlap")
    if rc:
        raise _native_error(rc, err, what, view, t, q_rows=q_rows)
    return int(tokens[0])


def attend_spans(view: KVView, q: Any, tasks: Any, scale: float, rows: Any, out: Any, lse: Any) -> int:
    """Each task's query heads attend over its two token ranges (the excluded ranges of make_tasks: a streaming
    part's sink and window), merged by log-sum-exp into row rows[i] of out fp32 [n_rows, r, D] / lse fp32
    [n_rows, r] (lse -inf there: nothing yet), in place (fluxion.h, "the streaming spans of a decode layer").
    rows int64 [T] strictly ascending. Returns the tokens attended."""
    q_ptr, q_rows, n_q_heads, r = _check_q(view, q)
    t = _tasks_array(tasks)
    if not (0.0 < scale < _INF):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    rows_a = _arr(rows, "rows", _I64, ndim=1, shape=(len(t),))
    out_ptr, (n_rows, _, _) = _buf(out, "out", _F32, 3, (None, r, view.head_dim), writable=True)
    lse_ptr, _ = _buf(lse, "lse", _F32, 2, (n_rows, r), writable=True)
    return _spans_call(view, "attend_spans", t, q_ptr, q_rows, n_q_heads, r, scale, _cptr(rows_a), n_rows, out_ptr,
                       lse_ptr, rows_a, ffi.new("int64_t[1]"))


def gather(view: KVView, tasks: Any, ids: Any, counts: Any, k_out: Any, v_out: Any,
           out_offset: Any | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Copy each task's selected blocks (valid tokens, in the given order) into staging k_out/v_out [cap, D].

    out_offset: int64 [T] first row per task; default packs tasks back to back (assuming full blocks).
    Returns (out_offset, out_tokens int32 [T]).
    """
    t = _tasks_array(tasks)
    n = len(t)
    ids_a, counts_a = _selection_arrays(t, ids, counts)
    ko_ptr, (cap, _) = _buf(k_out, "k_out", _U16, 2, (None, view.head_dim), writable=True)
    vo_ptr, _ = _buf(v_out, "v_out", _U16, 2, (cap, view.head_dim), writable=True)
    if out_offset is None:
        # task i starts after the full blocks of tasks 0 .. i-1: offs[i] = sum over j < i of counts[j] * g[j]
        offs = np.zeros(n, np.int64)
        if n > 1:
            np.add.accumulate(np.multiply(counts_a[:-1], t[:-1, 3], dtype=np.int64), out=offs[1:])
    else:
        offs = _arr(out_offset, "out_offset", _I64, ndim=1, shape=(n,))
    tokens = np.empty(n, _I32)
    err = _scratch.err
    rc = lib.fx_gather(view.struct, _cptr(t), n, _cptr(ids_a), _cptr(counts_a), ids_a.shape[1], _cptr(offs), cap,
                       ko_ptr, vo_ptr, _cptr(tokens), err)
    if rc == _E_OUTPUT:
        i = int(err[0])
        raise ValueError(f"gather: task {i} does not fit: out_offset={int(offs[i])} plus its tokens exceeds the "
                         f"k_out/v_out capacity of {cap} rows")
    if rc:
        raise _native_error(rc, err, "gather", view, t, k_cap=ids_a.shape[1], ids=ids_a, counts=counts_a)
    return offs, tokens


# ----------------------------------------------------------------------------------------------- prepared calls --
#
# The graphed decode step (sparse_graph.py) calls append, group_topk and sparse_attention once per layer on the
# critical path (the GPU waits for the host at small batches). The checked wrappers above cost 10-20 us per call
# in Python; these objects check their arguments once (per step or per buffer) and then make one C call per layer.
# The C side still validates every slot, head, page and block id on each call.


class PreparedAppend:
    """append() of one token per slot from fixed buffers: k, v [n_rows, Hkv, D] (16-bit, the store's dtype), slot
    slots[i] taking row row_start[i]. slots is an int32 [n] array the caller may refill in place between calls
    (distinct values); run(view) appends into any layer's view of the same store."""

    def __init__(self, view: KVView, slots: np.ndarray, row_start: Any, k: Any, v: Any) -> None:
        self._k_ptr, k_shape = _kv_rows(view, k, "k", None)
        self._v_ptr, _ = _kv_rows(view, v, "v", k_shape[0])
        self.slots = _arr(slots, "slots", _I32, ndim=1, writable=True)
        n = len(self.slots)
        rs = _int_vector(row_start, n)
        if n and (int(rs.min()) < 0 or int(rs.max()) >= k_shape[0]):
            raise ValueError(f"row_start: rows must lie within k's {k_shape[0]} rows")
        self._keep = (k, v, rs, np.ones(n, np.int64))  # the memory the pointers below point into
        self._args = (_cptr(self.slots), _cptr(rs), _cptr(self._keep[3]), n, self._k_ptr, self._v_ptr, k_shape[0])

    def run(self, view: KVView) -> None:
        err = _scratch.err
        s, rs, rc_, n, k, v, n_rows = self._args
        rc = lib.fx_append(view.struct, s, rs, rc_, n, k, v, n_rows, err)
        _raise_for(rc, err, "append")


class PreparedSelection:
    """group_topk then sparse_attention over the task rows [lo, hi) of one table, per layer, with the arguments
    checked once: q fp32 [q_rows, Hq, D] (read at every call: refill it in place), tasks int32 [T, 9] (every
    layer's tasks, layer-major). ids int32 [T, k_cap] / scores / counts int32 [T] belong to this object (k_cap:
    the largest k of all rows, so every layer's rows keep the k_cap their own call would use or more; columns
    past counts[i] are never read)."""

    def __init__(self, view: KVView, q: Any, tasks: Any, scale: float, rows: Any | None = None,
                 out: Any | None = None, lse: Any | None = None) -> None:
        """rows, out, lse: for select_attend (see there); rows int64 [T], out fp32 [n_rows, r, D], lse [n_rows, r]."""
        self._q_ptr, self.q_rows, self.n_q_heads, self.r = _check_q(view, q)
        self.tasks = t = _tasks_array(tasks)
        if not (0.0 < scale < _INF):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        self.scale = float(scale)
        n = len(t)
        self.k_cap = k_cap = max(0, int(np.maximum.reduce(t[:, 4]))) if n else 0
        self.ids, self.scores, self.counts = np.empty((n, k_cap), _I32), np.empty((n, k_cap), _F32), np.empty(n, _I32)
        self._q = q
        self._t, self._ids = _cptr(t), _cptr(self.ids)
        self._scores, self._counts = _cptr(self.scores), _cptr(self.counts)
        self.head_dim, self.n_kv_heads = view.head_dim, view.n_kv_heads
        self.rows: np.ndarray | None = None
        if rows is not None or out is not None or lse is not None:
            if rows is None or out is None or lse is None:
                raise ValueError("rows, out and lse go together (select_attend's destination)")
            self.rows = _arr(rows, "rows", _I64, ndim=1, shape=(n,))
            self._out_ptr, (self.n_rows, _, _) = _buf(out, "out", _F32, 3, (None, self.r, self.head_dim),
                                                      writable=True)
            self._lse_ptr, _ = _buf(lse, "lse", _F32, 2, (self.n_rows, self.r), writable=True)
            self._rows_ptr, self._dest = _cptr(self.rows), (out, lse)
            self._tokens, self._seconds = ffi.new("int64_t[1]"), ffi.new("double[2]")

    def _check(self, view: KVView, lo: int, hi: int) -> None:
        """The call's view and row range (pointers are offset by lo: a range past the table would read past it)."""
        if view.head_dim != self.head_dim or view.n_kv_heads != self.n_kv_heads:
            raise ValueError("view: another store's shape than the one the call was prepared for")
        if not 0 <= lo <= hi <= len(self.tasks):
            raise ValueError(f"rows [{lo}, {hi}) outside the task table's {len(self.tasks)} rows")

    def _topk_floats(self, view: KVView, n: int, code: int) -> int:
        """Top-k workspace for n tasks of this view (the longest slot at the finest granularity bounds every task's
        block count)."""
        max_blocks = -(-int(view.n_tokens.max()) // GRANULARITIES[0])
        return int(lib.fx_topk_scoring_workspace_floats(n, max(1, max_blocks), self.r, code))

    def topk(self, view: KVView, lo: int, hi: int, scoring: str = "group", pins: Any | None = None,
             pin_counts: Any | None = None) -> None:
        """group_topk of rows [lo, hi) into ids/scores/counts rows [lo, hi); scoring, pins [hi - lo, W] and
        pin_counts [hi - lo] as for group_topk (the pins of these rows only)."""
        self._check(view, lo, hi)
        code = _scoring_code(scoring)
        pin_args = _pin_args(hi - lo, pins, pin_counts)
        scratch, k_cap = _scratch, self.k_cap
        err = scratch.err
        args = (view.struct, self._q_ptr, self.q_rows, self.n_q_heads, self._t + lo * TASK_FIELDS, hi - lo, k_cap,
                code, *pin_args, self._ids + lo * k_cap, self._scores + lo * k_cap, self._counts + lo)
        rc = lib.fx_group_topk_pinned(*args, scratch.ws_ptr, scratch.ws_floats, err)
        if rc == _E_OUTPUT:  # as in group_topk: size the workspace only when C says it is short
            scratch.grow(self._topk_floats(view, hi - lo, code))
            rc = lib.fx_group_topk_pinned(*args, scratch.ws_ptr, scratch.ws_floats, err)
        if rc == _E_PIN:
            raise _pin_error("group_topk", view, self.tasks[lo:hi], int(err[0]), pins, pin_counts)
        if rc:
            raise _native_error(rc, err, "group_topk", view, self.tasks[lo:hi], q_rows=self.q_rows, k_cap=k_cap,
                                kept_only=True)

    def select_attend(self, view: KVView, lo: int, hi: int, scoring: str = "group", pins: Any | None = None,
                      pin_counts: Any | None = None) -> tuple[int, float, float]:
        """topk then attention of rows [lo, hi) in one C call, the results going straight to rows[lo:hi] of out/lse
        (given to the constructor; rows strictly ascending within [lo, hi)); every other row's lse becomes -inf.
        scoring, pins, pin_counts as for topk. Returns (selected tokens: sum of counts * g, seconds selecting,
        seconds attending)."""
        if self.rows is None:
            raise ValueError("select_attend needs rows, out and lse given to the constructor")
        self._check(view, lo, hi)
        code = _scoring_code(scoring)
        n, scratch, k_cap = hi - lo, _scratch, self.k_cap
        pin_args = _pin_args(n, pins, pin_counts)
        err = scratch.err
        args = (view.struct, self._q_ptr, self.q_rows, self.n_q_heads, self._t + lo * TASK_FIELDS, n, k_cap, code,
                *pin_args, self._ids + lo * k_cap, self._scores + lo * k_cap, self._counts + lo, self.scale,
                self._rows_ptr + lo, self.n_rows, self._out_ptr, self._lse_ptr)
        rc = lib.fx_select_attend_pinned(*args, scratch.ws_ptr, scratch.ws_floats, self._tokens, self._seconds, err)
        if rc == _E_OUTPUT and int(err[0]) < 0:  # the workspace, for both kernels
            scratch.grow(max(self._topk_floats(view, n, code),
                             int(lib.fx_attention_workspace_floats(n, self.r, self.head_dim))))
            rc = lib.fx_select_attend_pinned(*args, scratch.ws_ptr, scratch.ws_floats, self._tokens, self._seconds,
                                             err)
        if rc == _E_PIN:
            raise _pin_error("select_attend", view, self.tasks[lo:hi], int(err[0]), pins, pin_counts)
        if rc == _E_OUTPUT:
            i = int(err[0])
            if i < 0:
                raise ValueError("select_attend: the workspace is still short after growing it")
            raise ValueError(f"select_attend: rows[{lo + i}]={int(self.rows[lo + i])}: rows must be strictly "
                             f"ascending in [0, {self.n_rows})")
        if rc:
            raise _native_error(rc, err, "select_attend", view, self.tasks[lo:hi], q_rows=self.q_rows, k_cap=k_cap,
                                kept_only=True)
        return int(self._tokens[0]), float(self._seconds[0]), float(self._seconds[1])

    def attend_spans(self, view: KVView, lo: int, hi: int) -> int:
        """attend_spans of rows [lo, hi): each task's two ranges merged into its row of out/lse (given to the
        constructor), after select_attend over the same rows. Returns the tokens attended."""
        if self.rows is None:
            raise ValueError("attend_spans needs rows, out and lse given to the constructor")
        self._check(view, lo, hi)
        t = self.tasks[lo:hi]
        return _spans_call(view, "attend_spans", t, self._q_ptr, self.q_rows, self.n_q_heads, self.r, self.scale,
                           self._rows_ptr + lo, self.n_rows, self._out_ptr, self._lse_ptr, self.rows[lo:hi],
                           self._tokens)

    def attention(self, view: KVView, lo: int, hi: int, out: Any, lse: Any) -> None:
        """sparse_attention of rows [lo, hi) over their selections into out fp32 [hi - lo, r, D] and lse fp32
        [hi - lo, r] (numpy arrays or CPU tensors; checked here: a few us)."""
        self._check(view, lo, hi)
        n, r, d = hi - lo, self.r, self.head_dim
        out_ptr, _ = _buf(out, "out", _F32, 3, (n, r, d), writable=True)
        lse_ptr, _ = _buf(lse, "lse", _F32, 2, (n, r), writable=True)
        scratch, k_cap = _scratch, self.k_cap
        err = scratch.err
        args = (view.struct, self._q_ptr, self.q_rows, self.n_q_heads, self._t + lo * TASK_FIELDS, n,
                self._ids + lo * k_cap, self._counts + lo, k_cap, self.scale, out_ptr, lse_ptr)
        rc = lib.fx_sparse_attention(*args, scratch.ws_ptr, scratch.ws_floats, err)
        if rc == _E_OUTPUT:
            scratch.grow(int(lib.fx_attention_workspace_floats(n, r, d)))
            rc = lib.fx_sparse_attention(*args, scratch.ws_ptr, scratch.ws_floats, err)
        if rc:
            raise _native_error(rc, err, "sparse_attention", view, self.tasks[lo:hi], q_rows=self.q_rows,
                                k_cap=k_cap, ids=self.ids[lo:hi], counts=self.counts[lo:hi])


def read_bandwidth_probe(buf: Any, repeats: int = 1) -> float:
    """Read every byte of buf `repeats` times on the pool (a STREAM-like read); returns a checksum."""
    a = _np_view(buf, "buf")
    if not a.flags.c_contiguous:
        raise ValueError("buf must be C-contiguous")
    return float(lib.fx_read_bandwidth_probe(_ptr(a, "void *"), a.nbytes, int(repeats)))


def read_blocks_probe(view: KVView, tasks: Any, ids: Any, counts: Any) -> int:
    """Read the K and V of the selected blocks as sparse_attention does (same work split, order and prefetch) without
    computing: the ceiling of that access pattern. Returns the wrapping sum of the 64-bit words read."""
    t = _tasks_array(tasks)
    ids_a, counts_a = _selection_arrays(t, ids, counts)
    checksum = ffi.new("uint64_t *")
    err = _scratch.err
    rc = lib.fx_read_blocks_probe(view.struct, _cptr(t), len(t), _cptr(ids_a), _cptr(counts_a), ids_a.shape[1],
                                  checksum, err)
    if rc:
        raise _native_error(rc, err, "read_blocks_probe", view, t, k_cap=ids_a.shape[1], ids=ids_a, counts=counts_a)
    return int(checksum[0])


__all__ = [
    "TASK_FIELDS", "GRANULARITIES", "SIMD_PATHS", "SCORINGS", "KVView", "make_tasks", "append", "summaries_update",
    "group_topk", "sparse_attention", "gather", "read_bandwidth_probe", "read_blocks_probe", "set_threads", "get_threads",
    "set_simd", "get_simd", "simd_supported", "set_checks", "set_stream_stores", "physical_cores", "page_bytes",
    "gran_mask", "PreparedAppend", "PreparedSelection", "background",
]
