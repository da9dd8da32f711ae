"""Matrix products with quantized (GGUF) weights on the native library (native/fluxion.h, "QUANTIZED WEIGHTS", states
the block layouts byte by byte and the arithmetic).

A weight matrix W [n_out, k] is the bytes of a GGUF tensor as stored in the file (row-major, each row k / block
blocks): a numpy array of any dtype (uint8 from gguf's reader, float16 / float32 for the float types) or a CPU torch
tensor, C-contiguous, exactly n_out * row_bytes(wtype, k) bytes; nothing is copied.  Weight types are the GGUF/ggml
type ids (TYPE_NAMES), given as the id, the name ("Q4_K") or a gguf.GGMLQuantizationType.

    y = qmatmul(wtype, w, n_out, k, x)              # x fp32 [m, k] (or [k]) -> y fp32 [m, n_out] (or [n_out])
    ys = qmatmul_many(wtypes, ws, n_outs, k, x)     # several weights on one x (q/k/v, gate/up): one native call
    rows = dequantize(wtype, w, k, row0, n_rows)    # fp32 [n_rows, k]
    qw = QuantWeight(wtype, w, n_out, k); qw.matmul(x)   # the checks done once (the decode loop's form)
    group = QuantGroup([wq, wk, wv]); q, k, v = group.matmul(x)   # likewise for qmatmul_many

x (and y) are torch tensors or numpy arrays (y follows x).  The activations are quantized to 8 bits per block inside
(fluxion.h), into a workspace kept per Python thread and grown as needed, never allocated per call.  The calls run on
the library's thread pool (native.set_threads) and SIMD path (native.set_simd), and release the GIL.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from fluxion_lite.hostkv.native import ffi, lib, torch

TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
              14: "Q6_K", 30: "BF16"}
TYPE_IDS = {name: tid for tid, name in TYPE_NAMES.items()}
MAX_MANY = int(lib.FX_QMM_MAX_MANY)

_ERRORS = {
    lib.FX_E_QTYPE: "unknown weight type",
    lib.FX_E_QSHAPE: "bad matrix arguments",
    lib.FX_E_OUTPUT: "workspace too small",
}
_E_OUTPUT = int(lib.FX_E_OUTPUT)
_F32 = np.dtype(np.float32)
_FLOAT_PTR = ffi.typeof("float *")
_FLOAT_ARRAY = ffi.typeof("float[]")
_BYTES = ffi.typeof("uint8_t[]")
_VOID_PTR = ffi.typeof("void *")
_U16_PTR = ffi.typeof("uint16_t *")


def type_id(wtype: Any) -> int:
    """The GGUF type id of wtype: an id, a name of TYPE_NAMES or a gguf.GGMLQuantizationType (an int enum)."""
    if isinstance(wtype, str):
        tid = TYPE_IDS.get(wtype.upper())
        if tid is None:
            raise ValueError(f"wtype: {wtype!r} is not one of {sorted(TYPE_IDS)}")
        return tid
    if isinstance(wtype, (int, np.integer)) and not isinstance(wtype, bool) and int(wtype) in TYPE_NAMES:
        return int(wtype)
    raise ValueError(f"wtype: {wtype!r} is not a supported weight type ({TYPE_NAMES})")


def block_size(wtype: Any) -> int:
    """Elements per block (1 for F32/F16/BF16, 32 for Q4_0..Q8_0, 256 for the K types)."""
    return int(lib.fx_qblock_size(type_id(wtype)))


def block_bytes(wtype: Any) -> int:
    """Bytes per block (fluxion.h's table)."""
    t = type_id(wtype)
    return int(lib.fx_qrow_bytes(t, lib.fx_qblock_size(t)))


def row_bytes(wtype: Any, k: int) -> int:
    """Bytes of one row of k elements; ValueError unless k is a positive multiple of the block size."""
    t = type_id(wtype)
    n = int(lib.fx_qrow_bytes(t, _int(k, "k")))
    if n < 0:
        raise ValueError(f"k={k} is not a positive multiple of {TYPE_NAMES[t]}'s block of {block_size(t)}")
    return n


def set_vnni(on: bool) -> bool:
    """AVX-512 paths: AVX512-VNNI integer dot products (on, the default) or AVX-512BW ones (same results, bit for
    bit). Returns True when VNNI is in use from now on (on, and the CPU has it)."""
    return bool(lib.fx_set_vnni(1 if on else 0))


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {v!r}")
    return int(v)


def _raise(rc: int, what: str) -> None:
    raise ValueError(f"{what}: {_ERRORS.get(rc, f'native error {rc}')}")


def _weight_ptr(w: Any, nbytes: int, name: str) -> tuple[Any, Any]:
    """(C pointer, the object keeping the memory) of a weight's bytes; exactly nbytes, C-contiguous, on the CPU."""
    if torch is not None and isinstance(w, torch.Tensor):
        if w.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {w.device}")
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        have = w.numel() * w.element_size()
        if have != nbytes:
            raise ValueError(f"{name} holds {have} bytes, expected {nbytes}")
        return ffi.cast(_VOID_PTR, w.data_ptr()), w
    if isinstance(w, np.ndarray):
        if not w.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if w.nbytes != nbytes:
            raise ValueError(f"{name} holds {w.nbytes} bytes, expected {nbytes}")
        if nbytes == 0:
            return ffi.NULL, w
        return ffi.from_buffer(_BYTES, w.reshape(-1).view(np.uint8)), w
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(w).__name__}")


def _x_ptr(x: Any, k: int) -> tuple[Any, int, bool]:
    """(pointer, m, was 1-D) of x fp32 [m, k] or [k], C-contiguous on the CPU."""
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous CPU float32 tensor, got {x.dtype} on {x.device}"
                             f"{'' if x.is_contiguous() else ' (not contiguous)'}")
        shape = tuple(x.shape)
        ptr = ffi.cast(_FLOAT_PTR, x.data_ptr()) if x.numel() else ffi.NULL
    elif isinstance(x, np.ndarray):
        if x.dtype != _F32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be a C-contiguous float32 array, got {x.dtype}"
                             f"{'' if x.flags.c_contiguous else ' (not contiguous)'}")
        shape = x.shape
        ptr = ffi.from_buffer(_FLOAT_ARRAY, x) if x.size else ffi.NULL
    else:
        raise ValueError(f"x must be a numpy array or a torch tensor, got {type(x).__name__}")
    if len(shape) not in (1, 2) or shape[-1] != k:
        raise ValueError(f"x has shape {shape}, expected [m, {k}] or [{k}]")
    return ptr, (shape[0] if len(shape) == 2 else 1), len(shape) == 1


def _out(x: Any, out: Any | None, m: int, n_out: int, flat: bool, name: str) -> tuple[Any, Any]:
    """(y, pointer): out checked, or a new fp32 array of x's kind, shape [m, n_out] ([n_out] for a 1-D x)."""
    shape = (n_out,) if flat else (m, n_out)
    if out is None:
        if torch is not None and isinstance(x, torch.Tensor):
            out = torch.empty(shape, dtype=torch.float32)
        else:
            out = np.empty(shape, np.float32)
    if torch is not None and isinstance(out, torch.Tensor):
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() \
                or tuple(out.shape) != shape:
            raise ValueError(f"{name} must be a contiguous CPU float32 tensor of shape {shape}")
        return out, (ffi.cast(_FLOAT_PTR, out.data_ptr()) if out.numel() else ffi.NULL)
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.flags.c_contiguous
            and out.flags.writeable and out.shape == shape):
        raise ValueError(f"{name} must be a writable C-contiguous float32 array of shape {shape}")
    return out, (ffi.from_buffer(_FLOAT_ARRAY, out) if out.size else ffi.NULL)


class _Workspace(threading.local):
    """Per Python thread (concurrent calls must not share it): the quantized activations' buffer, grown (by 1.5x at
    least) when the C call reports it short, never shrunk; its C pointer made once per growth."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.ptr = ffi.NULL
        self.grow(1 << 16)

    def grow(self, nbytes: int) -> None:
        if self.nbytes < nbytes:
            nbytes = max(nbytes, self.nbytes * 3 // 2)
            self.buf = np.empty(nbytes, np.uint8)
            self.ptr, self.nbytes = ffi.from_buffer(_BYTES, self.buf), nbytes


_work = _Workspace()


class QuantWeight:
    """One weight matrix, checked once: wtype, w (the file's bytes, kept referenced), n_out, k.  matmul(x) is
    qmatmul without the per-call checks of the weight."""

    __slots__ = ("wtype", "name", "n_out", "k", "row_bytes", "w", "ptr")

    def __init__(self, wtype: Any, w: Any, n_out: int, k: int) -> None:
        self.wtype = type_id(wtype)
        self.name = TYPE_NAMES[self.wtype]
        self.n_out, self.k = _int(n_out, "n_out"), _int(k, "k")
        if self.n_out < 0:
            raise ValueError(f"n_out must be >= 0, got {n_out}")
        self.row_bytes = row_bytes(self.wtype, self.k)
        self.ptr, self.w = _weight_ptr(w, self.n_out * self.row_bytes, "w")

    def __repr__(self) -> str:
        return f"QuantWeight({self.name}, n_out={self.n_out}, k={self.k})"

    def matmul(self, x: Any, out: Any | None = None) -> Any:
        """y = x @ W^T: x fp32 [m, k] or [k] -> y fp32 [m, n_out] (or [n_out]); out: an optional destination."""
        xp, m, flat = _x_ptr(x, self.k)
        y, yp = _out(x, out, m, self.n_out, flat, "out")
        work = _work
        rc = lib.fx_qmatmul(self.wtype, self.ptr, self.n_out, self.k, xp, m, yp, work.ptr, work.nbytes)
        if rc == _E_OUTPUT:
            work.grow(int(lib.fx_qmatmul_workspace(self.wtype, m, self.k)))
            rc = lib.fx_qmatmul(self.wtype, self.ptr, self.n_out, self.k, xp, m, yp, work.ptr, work.nbytes)
        if rc:
            _raise(rc, f"qmatmul({self.name}, n_out={self.n_out}, k={self.k}, m={m})")
        return y

    def dequantize(self, row0: int = 0, n_rows: int | None = None, out: Any | None = None) -> Any:
        """Rows row0 .. row0 + n_rows - 1 (default: to the end) as fp32 [n_rows, k] (a torch tensor if w is one)."""
        return _dequantize(self, row0, n_rows, out)

    def dequantize_bf16(self, row0: int = 0, n_rows: int | None = None, out: Any | None = None) -> Any:
        """The same rows as bf16 [n_rows, k] (a torch tensor: numpy has no bf16), each the fp32 value rounded to
        nearest even, in one pass with no fp32 copy: the weights of a bf16 prefill GEMM."""
        return _dequantize_bf16(self, row0, n_rows, out)


def qmatmul(wtype: Any, w: Any, n_out: int, k: int, x: Any, out: Any | None = None) -> Any:
    """y = x @ W^T with W [n_out, k] of type wtype (the file's bytes): x fp32 [m, k] or [k] (torch or numpy) -> y fp32
    [m, n_out] or [n_out], of x's kind (or out, filled and returned)."""
    return QuantWeight(wtype, w, n_out, k).matmul(x, out)


class QuantGroup:
    """Weights of one k that share their input (q/k/v; gate/up), at most MAX_MANY, with the C argument arrays made
    once: matmul(x) is [x @ W^T for W in weights] in one native call (one pool dispatch, x quantized once)."""

    __slots__ = ("weights", "k", "_types", "_ptrs", "_n_outs")

    def __init__(self, weights: Sequence[QuantWeight]) -> None:
        weights = list(weights)
        if len(weights) > MAX_MANY:
            raise ValueError(f"at most {MAX_MANY} weights per call, got {len(weights)}")
        for j, qw in enumerate(weights):
            if not isinstance(qw, QuantWeight):
                raise ValueError(f"weights[{j}] must be a QuantWeight, got {type(qw).__name__}")
            if qw.k != weights[0].k:
                raise ValueError(f"weights[{j}] has k={qw.k}, weights[0] k={weights[0].k}: one x needs one k")
        self.weights = weights
        self.k = weights[0].k if weights else 0
        self._types = ffi.new("int32_t[]", [qw.wtype for qw in weights] or [0])
        self._ptrs = ffi.new("void *[]", [qw.ptr for qw in weights] or [ffi.NULL])
        self._n_outs = ffi.new("int64_t[]", [qw.n_out for qw in weights] or [0])

    def matmul(self, x: Any, outs: Sequence[Any] | None = None) -> list[Any]:
        """[x @ W^T for W in weights]: x fp32 [m, k] or [k]; outs: optional destinations, one per weight."""
        n = len(self.weights)
        if outs is not None and len(outs) != n:
            raise ValueError(f"outs: {len(outs)} destinations for {n} weights")
        if n == 0:
            return []
        xp, m, flat = _x_ptr(x, self.k)
        ys, yps = [], []
        for j, qw in enumerate(self.weights):
            y, yp = _out(x, None if outs is None else outs[j], m, qw.n_out, flat, f"outs[{j}]")
            ys.append(y)
            yps.append(yp)
        y_ptrs = ffi.new("float *[]", yps)
        work = _work
        args = (n, self._types, self._ptrs, self._n_outs, self.k, xp, m, y_ptrs)
        rc = lib.fx_qmatmul_many(*args, work.ptr, work.nbytes)
        if rc == _E_OUTPUT:
            work.grow(int(lib.fx_qmatmul_workspace(lib.FX_QT_ANY, m, self.k)))
            rc = lib.fx_qmatmul_many(*args, work.ptr, work.nbytes)
        if rc:
            _raise(rc, f"qmatmul_many({[qw.name for qw in self.weights]}, k={self.k}, m={m})")
        return ys


def matmul_many(weights: Sequence[QuantWeight], x: Any, outs: Sequence[Any] | None = None) -> list[Any]:
    """[x @ W^T for W in weights] in one native call (one pool dispatch, x quantized once): weights of one k, at most
    MAX_MANY of them; outs: optional destinations, one per weight.  (QuantGroup(weights).matmul, the group made once
    when called repeatedly.)"""
    return QuantGroup(weights).matmul(x, outs)


def qmatmul_many(wtypes: Sequence[Any], ws: Sequence[Any], n_outs: Sequence[int], k: int, x: Any,
                 outs: Sequence[Any] | None = None) -> list[Any]:
    """[qmatmul(wtypes[j], ws[j], n_outs[j], k, x) for each j] in one native call (x quantized once)."""
    if not len(wtypes) == len(ws) == len(n_outs):
        raise ValueError(f"wtypes, ws, n_outs differ in length ({len(wtypes)}, {len(ws)}, {len(n_outs)})")
    return matmul_many([QuantWeight(t, w, n, k) for t, w, n in zip(wtypes, ws, n_outs)], x, outs)


def _row_range(qw: QuantWeight, row0: int, n_rows: int | None) -> tuple[int, int]:
    row0 = _int(row0, "row0")
    n_rows = qw.n_out - row0 if n_rows is None else _int(n_rows, "n_rows")
    if row0 < 0 or n_rows < 0 or row0 + n_rows > qw.n_out:
        raise ValueError(f"rows [{row0}, {row0 + n_rows}) outside the matrix's {qw.n_out} rows")
    return row0, n_rows


def _dequantize(qw: QuantWeight, row0: int, n_rows: int | None, out: Any | None) -> Any:
    row0, n_rows = _row_range(qw, row0, n_rows)
    like = qw.w if torch is not None and isinstance(qw.w, torch.Tensor) else None
    y, yp = _out(like, out, n_rows, qw.k, False, "out")
    rc = lib.fx_dequantize(qw.wtype, qw.ptr, row0, n_rows, qw.k, yp)
    if rc:
        _raise(rc, f"dequantize({qw.name}, rows [{row0}, {row0 + n_rows}), k={qw.k})")
    return y


def _dequantize_bf16(qw: QuantWeight, row0: int, n_rows: int | None, out: Any | None) -> Any:
    if torch is None:
        raise ValueError("dequantize_bf16 needs torch (numpy has no bf16)")
    row0, n_rows = _row_range(qw, row0, n_rows)
    shape = (n_rows, qw.k)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16)
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device.type == "cpu"
            and out.is_contiguous() and tuple(out.shape) == shape):
        raise ValueError(f"out must be a contiguous CPU bfloat16 tensor of shape {shape}")
    yp = ffi.cast(_U16_PTR, out.data_ptr()) if out.numel() else ffi.NULL
    rc = lib.fx_dequantize_bf16(qw.wtype, qw.ptr, row0, n_rows, qw.k, yp)
    if rc:
        _raise(rc, f"dequantize_bf16({qw.name}, rows [{row0}, {row0 + n_rows}), k={qw.k})")
    return out


def dequantize(wtype: Any, w: Any, k: int, row0: int = 0, n_rows: int | None = None, out: Any | None = None,
               n_out: int | None = None) -> Any:
    """Rows row0 .. row0 + n_rows - 1 of W (type wtype, k columns; w the whole matrix's bytes, n_out rows: by default
    w's size / row_bytes) as fp32 [n_rows, k]: numpy, or torch if w is a tensor (or out, filled and returned)."""
    rb = row_bytes(wtype, k)
    if n_out is None:
        nbytes = (w.numel() * w.element_size()) if torch is not None and isinstance(w, torch.Tensor) else \
            getattr(w, "nbytes", None)
        if nbytes is None:
            raise ValueError(f"w must be a numpy array or a torch tensor, got {type(w).__name__}")
        if nbytes % rb:
            raise ValueError(f"w holds {nbytes} bytes, not a whole number of {rb}-byte rows")
        n_out = nbytes // rb
    return _dequantize(QuantWeight(wtype, w, n_out, k), row0, n_rows, out)


__all__ = ["TYPE_NAMES", "TYPE_IDS", "MAX_MANY", "QuantWeight", "QuantGroup", "type_id", "block_size", "block_bytes", "row_bytes",
           "set_vnni", "qmatmul", "qmatmul_many", "matmul_many", "dequantize"]
