"""A decoder layer's work around its attention in two native calls, and the dense decode attention over an fp32 KV
cache (native/fluxion.h, "DECODER LAYER" and "DENSE DECODE ATTENTION", states the arithmetic).

    layer = NativeLayer(LayerSpec(...), q=..., k=..., v=..., o=..., gate=..., up=..., down=...)  # QuantWeights
    qkv = layer.qkv(x, rope_rows)      # x fp32 [m, d] -> [m, (Hq + 2 Hkv) D]: norm, q/k/v products, bias, RoPE
    layer.out_mlp(x, o)                # x += o @ Wo^T, then x += MLP(norm(x)), in place
    NativeDecoder(layers).step(...)    # every layer of a dense decode step in one call
    SparseDecodeStep(decoder, ...).run(x, rope_rows, stride, views)   # every layer of a step over the host store
    out = decode_attention(q, k, v, n_tokens, scale)   # q [Hq, D]; k, v [Hkv, cap, D] -> [Hq, D]

A decode step with quantized weights spends as much time in torch's per-operation dispatch as in its products when
each layer is ~20 tensor operations; these calls replace them (model/quantized.py builds a NativeLayer per layer).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fluxion_lite.hostkv.native import _ERRORS as _STORE_ERRORS
from fluxion_lite.hostkv.native import ffi, lib
from fluxion_lite.hostkv.quant import QuantWeight

MAX_ROWS = int(lib.FX_LAYER_MAX_ROWS)
_E_OUTPUT = int(lib.FX_E_OUTPUT)
_FLOAT_PTR = ffi.typeof("float *")
_BYTES = ffi.typeof("uint8_t[]")
_ERRORS = {int(lib.FX_E_QTYPE): "unknown weight type", int(lib.FX_E_QSHAPE): "bad shapes or arguments",
           int(lib.FX_E_OUTPUT): "workspace too small", int(lib.FX_E_GROUP): "query heads not a multiple of KV heads"}


def _raise(rc: int, what: str) -> None:
    raise ValueError(f"{what}: {_ERRORS.get(rc) or _STORE_ERRORS.get(rc, f'native error {rc}')}")


def _fptr(t: torch.Tensor) -> Any:
    return ffi.cast(_FLOAT_PTR, t.data_ptr())


class _Bytes(threading.local):
    """A per-Python-thread workspace (concurrent steps must not share one), grown when a call reports it short."""

    def __init__(self) -> None:
        self.nbytes, self.ptr, self.buf = 0, ffi.NULL, None

    def take(self, nbytes: int) -> Any:
        if self.nbytes < nbytes:
            self.buf = np.empty(max(nbytes, self.nbytes * 3 // 2), np.uint8)
            self.nbytes = self.buf.nbytes
            self.ptr = ffi.from_buffer(_BYTES, self.buf)
        return self.ptr


_layer_work = _Bytes()
_attn_work = _Bytes()
_select_work = _Bytes()  # the sparse step's selection, attention and spans (grows with the context)


@dataclass(frozen=True)
class LayerSpec:
    d: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_neox: bool
    ffn: int
    eps: float


class NativeLayer:
    """One decoder layer's C description (fx_qlayer), made once; keeps every array it points at alive."""

    def __init__(self, spec: LayerSpec, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, qkv_bias: torch.Tensor | None,
                 q: QuantWeight, k: QuantWeight, v: QuantWeight, o: QuantWeight, gate: QuantWeight, up: QuantWeight,
                 down: QuantWeight) -> None:
        self.spec = spec
        self._keep = [t.float().contiguous() for t in (attn_norm, ffn_norm)]
        if qkv_bias is not None:
            self._keep.append(qkv_bias.float().contiguous())
        self._weights = (q, k, v, o, gate, up, down)
        c = ffi.new("fx_qlayer *")
        c.d, c.n_heads, c.n_kv_heads, c.head_dim = spec.d, spec.n_heads, spec.n_kv_heads, spec.head_dim
        c.rope_dim, c.rope_neox, c.ffn, c.eps = spec.rope_dim, int(spec.rope_neox), spec.ffn, spec.eps
        c.attn_norm, c.ffn_norm = _fptr(self._keep[0]), _fptr(self._keep[1])
        c.qkv_bias = _fptr(self._keep[2]) if qkv_bias is not None else ffi.NULL
        for name, w in zip(("q", "k", "v", "o", "gate", "up", "down"), self._weights):
            field = getattr(c, name)
            field.wtype, field.w, field.n_out = w.wtype, w.ptr, w.n_out
        self.c = c
        self.width = (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
        need = int(lib.fx_layer_workspace(c, 1))
        if need < 0:
            _raise(-need, f"decoder layer {spec}")
        self._need = {1: need}

    def _work(self, m: int) -> tuple[Any, int]:
        need = self._need.get(m)
        if need is None:
            need = self._need[m] = int(lib.fx_layer_workspace(self.c, m))
            if need < 0:
                _raise(-need, f"decoder layer workspace for {m} rows")
        return _layer_work.take(need), _layer_work.nbytes

    def qkv(self, x: torch.Tensor, rope_rows: torch.Tensor) -> torch.Tensor:
        """x fp32 [m, d] (contiguous, m <= MAX_ROWS); rope_rows: each row's RoPE table row, [m, 2, ..., rope_dim]
        (cos then sin_signed, contiguous per row) -> qkv fp32 [m, (Hq + 2 Hkv) D]."""
        m = x.shape[0]
        out = torch.empty(m, self.width)
        ptr, nbytes = self._work(m)
        rc = lib.fx_layer_qkv(self.c, _fptr(x), m, _fptr(rope_rows), rope_rows.stride(0), _fptr(out), ptr, nbytes)
        if rc:
            _raise(rc, f"layer q/k/v for x {tuple(x.shape)}")
        return out

    def out_mlp(self, x: torch.Tensor, o: torch.Tensor) -> None:
        """x fp32 [m, d] += o [m, Hq D] @ Wo^T, then x += MLP(rms_norm(x)); both contiguous."""
        ptr, nbytes = self._work(x.shape[0])
        rc = lib.fx_layer_out_mlp(self.c, _fptr(x), _fptr(o), x.shape[0], ptr, nbytes)
        if rc:
            _raise(rc, f"layer output and MLP for x {tuple(x.shape)}")


class NativeDecoder:
    """A stack of NativeLayers that decodes one token of one sequence over its dense fp32 KV cache in one native
    call (fx_decode_layers): the layers' q/k/v, attention with the token appended, output products and MLP, the
    arithmetic of the per-layer calls without their round trips from Python."""

    def __init__(self, layers: list[NativeLayer]) -> None:
        if not layers:
            raise ValueError("NativeDecoder needs at least one layer")
        self.layers = layers
        self.c_layers = ffi.new("fx_qlayer *[]", [layer.c for layer in layers])  # what the step calls take
        self.n_layers = len(layers)

    def step(self, x: torch.Tensor, rope_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
             scale: float) -> None:
        """x fp32 [1, d] (contiguous; updated in place) through every layer, for the token at position pos.
        rope_row: its RoPE table row (cos then sin_signed, contiguous, fp32). k, v fp32 [n_layers, Hkv, cap, D]
        (cap > pos; token pos is written here). The caller holds the shapes (DenseKVCache.decode_stack)."""
        need = int(lib.fx_decode_layers_workspace(self.c_layers, self.n_layers, pos))
        if need < 0:
            _raise(-need, f"decode step at position {pos}")
        ptr = _layer_work.take(need)
        rc = lib.fx_decode_layers(self.c_layers, self.n_layers, _fptr(x), _fptr(rope_row), _fptr(k), _fptr(v),
                                  k.stride(0), k.stride(1), pos, scale, ptr, _layer_work.nbytes)
        if rc:
            _raise(rc, f"decode step at position {pos} over k {tuple(k.shape)}")


class SparseDecodeStep:
    """One decode step of m sequences over a host KV store in one native call (fx_sparse_decode_layers): every
    layer's q/k/v, append, selection with attention, streaming spans and output/MLP, for the task table of a step's
    shape (the sparse backend's HostDecode makes it once per shape and runs it each step).

    tasks int32 [T, 9] layer-major with task_ends [L + 1]; rows int64 [T]; ids int32 / scores fp32 [T, k_cap] and
    counts int32 [T] the selection's outputs (kept referenced); slots int32 [m] the rows' store slots."""

    def __init__(self, decoder: NativeDecoder, slots: np.ndarray, tasks: np.ndarray, task_ends: list[int],
                 rows: np.ndarray, ids: np.ndarray, scores: np.ndarray, counts: np.ndarray, scoring: int,
                 scale: float) -> None:
        if len(task_ends) != decoder.n_layers + 1:
            raise ValueError(f"task_ends has {len(task_ends)} entries for {decoder.n_layers} layers")
        self.decoder, self.m = decoder, len(slots)
        self._ends = np.asarray(task_ends, np.int64)
        self._keep = [np.ascontiguousarray(slots, np.int32), np.ascontiguousarray(tasks, np.int32),
                      np.ascontiguousarray(rows, np.int64), ids, scores, counts, self._ends]
        s = self.struct = ffi.new("fx_sparse_step *")
        s.slots, s.tasks, s.rows = (ffi.from_buffer(t, a) for t, a in
                                    zip(("int32_t[]", "int32_t[]", "int64_t[]"), self._keep[:3]))
        s.ids, s.scores, s.counts = (ffi.from_buffer(t, a) for t, a in
                                     zip(("int32_t[]", "float[]", "int32_t[]"), (ids, scores, counts)))
        s.task_ends = ffi.from_buffer("int64_t[]", self._ends)
        s.k_cap, s.scoring, s.scale = ids.shape[1], scoring, scale
        s.pins = s.pin_counts = ffi.NULL
        self._views: Any = None
        self._pin_keep: tuple[np.ndarray, np.ndarray] | None = None
        self._tokens, self._seconds = ffi.new("int64_t[2]"), ffi.new("double[2]")
        self._err_layer, self._err_index = ffi.new("int32_t[1]"), ffi.new("int64_t[1]")

    def set_pins(self, pins: np.ndarray | None, pin_counts: np.ndarray | None) -> None:
        """Every task's pins (int32 [T, P] and [T], PinnedBlocks.table of all layers' tasks), or None: no pins."""
        s = self.struct
        if pins is None or pin_counts is None:
            s.pins = s.pin_counts = ffi.NULL
            self._pin_keep = None
            return
        keep = (np.ascontiguousarray(pins, np.int32), np.ascontiguousarray(pin_counts, np.int32))
        s.pins, s.pin_counts = ffi.from_buffer("int32_t[]", keep[0]), ffi.from_buffer("int32_t[]", keep[1])
        s.pin_stride = keep[0].shape[1]
        self._pin_keep = keep

    def run(self, x: torch.Tensor, rope_rows: torch.Tensor, rope_stride: int, views: list[Any]) -> tuple[int, int, float, float]:
        """x fp32 [m, d] (contiguous; updated in place) through every layer; rope_rows: row 0's RoPE table row (rows
        rope_stride floats apart); views: each layer's KVView now (a grown page table replaces a view). Returns
        (tokens selected, tokens in streaming spans, seconds selecting, seconds attending)."""
        dec, s = self.decoder, self.struct
        self._views = ffi.new("fx_kv_view *[]", [v.struct for v in views])
        s.views = self._views
        need = int(lib.fx_sparse_decode_workspace(dec.c_layers, dec.n_layers, self.m))
        if need < 0:
            _raise(-need, f"sparse decode step of {self.m} rows")
        floats = int(lib.fx_sparse_decode_select_floats(dec.c_layers, dec.n_layers, self.m, s))
        if floats < 0:
            _raise(-floats, f"sparse decode step of {self.m} rows")
        select = ffi.cast(_FLOAT_PTR, _select_work.take(4 * floats))
        ptr = _layer_work.take(need)
        rc = lib.fx_sparse_decode_layers(dec.c_layers, dec.n_layers, _fptr(x), self.m, _fptr(rope_rows), rope_stride,
                                         s, select, _select_work.nbytes // 4, ptr, _layer_work.nbytes, self._tokens,
                                         self._seconds, self._err_layer, self._err_index)
        if rc:
            layer, idx = int(self._err_layer[0]), int(self._err_index[0])
            where = f" in layer {layer}" + (f", task/item {idx}" if idx >= 0 else "") if layer >= 0 else ""
            _raise(rc, f"sparse decode step of {self.m} rows{where}")
        return int(self._tokens[0]), int(self._tokens[1]), float(self._seconds[0]), float(self._seconds[1])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_tokens: int, scale: float,
                     out: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None) -> torch.Tensor:
    """One query token over the first n_tokens keys: q fp32 [Hq, D] (contiguous); k, v fp32 [Hkv, cap, D] (each head
    contiguous, cap >= n_tokens, the same head stride) -> out fp32 [Hq, D]. k_new, v_new fp32 [Hkv, D]
    (contiguous), optional: written at token n_tokens - 1 of k and v first (a decode step's append)."""
    hq, d = q.shape
    hkv = k.shape[0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1 or t.shape[-1] != d:
            raise ValueError(f"decode attention: {name} must be CPU float32 with a contiguous last dim of {d}")
    if k.shape != v.shape or k.stride() != v.stride() or k.stride(1) != d or k.shape[1] < n_tokens or not q.is_contiguous():
        raise ValueError(f"decode attention: k {tuple(k.shape)} / v {tuple(v.shape)} must be [Hkv, cap >= {n_tokens}, "
                         f"{d}] with one layout, q {tuple(q.shape)} contiguous")
    if (k_new is None) != (v_new is None):
        raise ValueError("decode attention: give both k_new and v_new, or neither")
    if k_new is not None and v_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (hkv, d) or not t.is_contiguous():
                raise ValueError(f"decode attention: {name} must be CPU float32 [{hkv}, {d}], contiguous")
    return decode_attention_unchecked(q, k, v, n_tokens, scale, out if out is not None else torch.empty(hq, d),
                                      k_new, v_new)


def decode_attention_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_tokens: int, scale: float,
                               out: torch.Tensor, k_new: torch.Tensor | None = None,
                               v_new: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention for arguments already known to fit (the dense cache's own decode step, once per layer):
    the checks above cost as much as the call at short contexts. The C call still refuses a bad size or stride."""
    hq, d = q.shape
    hkv = k.shape[0]
    need = int(lib.fx_decode_attention_workspace(hq, hkv, d, n_tokens))
    if need < 0:
        _raise(-need, f"decode attention over {n_tokens} tokens, {hq} / {hkv} heads of {d}")
    work = _attn_work.take(4 * need)
    rc = lib.fx_decode_attention(_fptr(q), hq, hkv, d, _fptr(k), _fptr(v), k.stride(0), n_tokens,
                                 ffi.NULL if k_new is None else _fptr(k_new),
                                 ffi.NULL if v_new is None else _fptr(v_new), scale, _fptr(out),
                                 ffi.cast(_FLOAT_PTR, work), _attn_work.nbytes // 4)
    if rc:
        _raise(rc, f"decode attention over {n_tokens} tokens")
    return out


__all__ = ["LayerSpec", "NativeLayer", "NativeDecoder", "SparseDecodeStep", "MAX_ROWS", "decode_attention", "decode_attention_unchecked"]
