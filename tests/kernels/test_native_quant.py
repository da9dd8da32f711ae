"""Quantized-weight products (native/fluxion.h, "QUANTIZED WEIGHTS") against float64 references written from the
stated block layouts (native_quant_reference.py), with gguf-py's dequantizer as an independent reading of the same
bytes; every weight type, every SIMD path this CPU supports (the AVX-512 paths with and without VNNI), 1 and N
threads, odd shapes; then the errors.

Tolerances, and why:
  * dequantize: bit for bit.  Every product in the layouts' formulas is exact in fp32, so each element is its exact
    value rounded once; the reference computes the exact value in float64 (exact for the fields random_blocks draws)
    and rounds it to fp32.
  * qmatmul against the float64 product with the SAME quantized x (dx * qx; quantize_x reproduces the C quantizer
    bit for bit): |y - ref| <= (nb + 4) u S, u = 2^-24, nb the blocks per row (k for F32/F16/BF16), S = the sum over
    the row of |each part of w| * |dx qx| -- recursive summation of nb fp32 block terms, each rounded a few times.
    The errors seen are about 0.5 u S, i.e. ~1e-7 relative to S.
  * qmatmul against the unquantized x: |y - W @ x| <= sum_e |w_e| dx_e / 2 (1 + 1e-5) + the bound above -- the 8-bit
    quantization moves each x element by at most half its block's step dx.
"""
from __future__ import annotations

import threading

import gguf
import numpy as np
import pytest
import torch

import native_quant_reference as ref
from fluxion_lite.hostkv import native, quant

N_THREADS = max(2, native.physical_cores())
VNNI = quant.set_vnni(True)  # the CPU has AVX512-VNNI (and AVX-512)
# (SIMD path, VNNI on): every path; the AVX-512 kernels once more with AVX-512BW integer dot products
VARIANTS = [(p, True) for p in native.simd_supported()] + ([("avx512", False)] if VNNI else [])
QUANT_TYPES = [t for t in ref.TYPES if ref.TYPES[t][1] > 1]
ALL_TYPES = list(ref.TYPES)


def _vid(v: tuple[str, bool]) -> str:
    return v[0] if v[1] or not v[0].startswith("avx512") else f"{v[0]}-bw"


def _tid(t: int) -> str:
    return ref.TYPES[t][0]


@pytest.fixture()
def variant(request):
    """Select a (SIMD path, VNNI) variant; the native defaults again afterwards."""
    simd, vnni = request.param
    native.set_simd(simd)
    quant.set_vnni(vnni)
    yield simd, vnni
    native.set_simd("auto")
    native.set_threads(native.physical_cores())
    quant.set_vnni(True)


def _ks(tid: int) -> list[int]:
    """Row lengths to try: one block, several (odd counts too: AVX-512 takes 32-blocks in pairs)."""
    block = ref.TYPES[tid][1]
    if block == 1:
        return [1, 7, 33, 100, 16, 300, 64, 31]
    if block == 32:
        return [32 * n for n in (1, 3, 7, 2, 5, 4, 1, 9)]
    return [256 * n for n in (1, 2, 3, 1, 2, 3, 1, 2)]


# (n_out, m): every n_out with every m somewhere; m = 40 takes three tiles of x rows
SHAPES = [(1, 1), (3, 2), (17, 5), (257, 16), (17, 40), (1, 16), (3, 1), (257, 2)]


def _bounds(tid: int, w: np.ndarray, k: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(y with the quantized x, tolerance, y with x as given, tolerance), float64 [m, n_out]."""
    v, mag = ref.dequantize(tid, w, k)
    xh = ref.dequantized_x(x, tid)
    block = ref.activation_block(tid)
    nb = k // block if block else k
    tol_q = (nb + 4) * ref.U * (np.abs(xh) @ mag.T) + 1e-30
    step = np.zeros_like(xh)
    if block:
        _, dx = ref.quantize_x(x, block)
        step = np.repeat(dx.astype(np.float64), block, axis=1) / 2 * (1 + 1e-5)
    return xh @ v.T, tol_q, x.astype(np.float64) @ v.T, tol_q + step @ np.abs(v).T


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
@pytest.mark.parametrize("tid", ALL_TYPES, ids=_tid)
def test_qmatmul_matches_float64_reference(tid: int, variant) -> None:
    rng = np.random.default_rng(tid * 1000 + len(variant[0]) + variant[1])
    for si, ((n_out, m), k) in enumerate(zip(SHAPES, _ks(tid))):
        native.set_threads(1 if si % 2 == 0 else N_THREADS)
        w = ref.random_matrix(tid, n_out, k, rng)
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        y = quant.qmatmul(tid, w, n_out, k, torch.from_numpy(x))
        assert isinstance(y, torch.Tensor) and y.shape == (m, n_out) and y.dtype == torch.float32
        y = y.numpy().astype(np.float64)
        want_q, tol_q, want, tol = _bounds(tid, w, k, x)
        where = f"{_tid(tid)} n_out={n_out} m={m} k={k}"
        assert np.all(np.abs(y - want_q) <= tol_q), f"{where}: off the quantized-x product by " \
            f"{(np.abs(y - want_q) / tol_q).max():.3g} x the bound"
        assert np.all(np.abs(y - want) <= tol), f"{where}: off the exact product by " \
            f"{(np.abs(y - want) / tol).max():.3g} x the bound"


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
@pytest.mark.parametrize("tid", ALL_TYPES, ids=_tid)
def test_dequantize_is_exact(tid: int, variant) -> None:
    rng = np.random.default_rng(tid + 7)
    block = ref.TYPES[tid][1]
    for threads, n_out, k in ((1, 5, 3 * max(block, 32)), (N_THREADS, 67, max(block, 32)), (N_THREADS, 3, 37 if
                                                                                                 block == 1 else 2 * block)):
        native.set_threads(threads)
        w = ref.random_matrix(tid, n_out, k, rng)
        want = ref.dequantize(tid, w, k)[0].astype(np.float32)
        np.testing.assert_array_equal(quant.dequantize(tid, w, k), want)
        row0, n_rows = n_out // 3, n_out - n_out // 3 - 1
        np.testing.assert_array_equal(quant.dequantize(tid, w, k, row0, n_rows), want[row0:row0 + n_rows])
        got = quant.dequantize(tid, torch.from_numpy(w), k, n_rows=1)  # a tensor in, a tensor out
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), want[:1])


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
@pytest.mark.parametrize("tid", ALL_TYPES, ids=_tid)
def test_dequantize_bf16_rounds_the_exact_values_to_nearest_even(tid: int, variant) -> None:
    """fx_dequantize_bf16: the float64 reference's values (exact in fp32) rounded by torch's fp32 -> bf16
    conversion, bit for bit; rows longer than the 4,096-element chunk it converts at a time, 1 and N threads."""
    rng = np.random.default_rng(tid + 11)
    block = ref.TYPES[tid][1]
    long_k = 4096 + 3 * max(block, 32) if block > 1 else 4099
    for threads, n_out, k in ((1, 5, 3 * max(block, 32)), (N_THREADS, 67, max(block, 32)), (N_THREADS, 3, long_k),
                              (1, 2, 2 * long_k)):
        native.set_threads(threads)
        w = ref.random_matrix(tid, n_out, k, rng)
        want = torch.from_numpy(ref.dequantize(tid, w, k)[0].astype(np.float32)).to(torch.bfloat16)  # [n_out, k]
        qw = quant.QuantWeight(tid, torch.from_numpy(w), n_out, k)
        assert torch.equal(qw.dequantize_bf16().view(torch.int16), want.view(torch.int16))
        row0, n_rows = n_out // 3, n_out - n_out // 3 - 1
        out = torch.full((n_rows, k), 7.0, dtype=torch.bfloat16)
        assert qw.dequantize_bf16(row0, n_rows, out=out) is out
        assert torch.equal(out.view(torch.int16), want[row0:row0 + n_rows].view(torch.int16))


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
def test_dequantize_bf16_ties_and_non_finite_values(variant) -> None:
    """F32 weights that sit on bf16 ties (to even: down from an even neighbour, up to one), the largest finite fp32
    (rounds to inf, as torch's conversion does), infinities, NaNs of both signs (-> 0x7fc0), zeros and subnormals."""
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8), 3.4028234663852886e38]
    specials = [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-45, -1e-40, 65504.0, 1.0000001]
    x = np.array(ties + specials + list(np.random.default_rng(3).standard_normal(45)), np.float32)  # [60]
    x[x.size // 2] = np.float32(np.frombuffer(np.uint32(0xFFC00001).tobytes(), np.float32)[0])  # a negative NaN
    got = quant.QuantWeight(0, torch.from_numpy(x.copy()).view(torch.uint8), 1, x.size).dequantize_bf16()[0]
    want = torch.from_numpy(x).to(torch.bfloat16)
    nan = torch.from_numpy(np.isnan(x))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert (got[nan].view(torch.int16) == 0x7FC0).all()  # torch's own NaN bits differ between its code paths
    assert int(got[0].view(torch.int16)) == 0x3F80 and int(got[1].view(torch.int16)) == 0x3F82  # 1+2^-8 down, 1+3*2^-8 up


@pytest.mark.parametrize("tid", ALL_TYPES, ids=_tid)
def test_layout_agrees_with_gguf(tid: int) -> None:
    """gguf-py reads the same bytes to the same values (an independent reading of the layouts), its block sizes are
    the header's, and for the types gguf-py can quantize, its blocks of realistic data read back the same."""
    rng = np.random.default_rng(tid + 99)
    qtype = gguf.GGMLQuantizationType(tid)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert (quant.block_size(tid), quant.block_bytes(tid)) == (block, nbytes) == ref.TYPES[tid][1:]
    assert quant.TYPE_NAMES[tid] == qtype.name
    k = 2 * max(block, 32)
    w = ref.random_matrix(tid, 9, k, rng)
    theirs = gguf.quants.dequantize(w, qtype).reshape(9, k).astype(np.float32)
    np.testing.assert_array_equal(quant.dequantize(tid, w, k), theirs)
    try:
        real = gguf.quants.quantize(rng.standard_normal((9, k)).astype(np.float32) * 0.05, qtype)
    except NotImplementedError:
        return  # gguf-py dequantizes the K types only
    real = np.ascontiguousarray(real).view(np.uint8).reshape(9, -1)
    np.testing.assert_array_equal(quant.dequantize(tid, real, k),
                                  gguf.quants.dequantize(real, qtype).reshape(9, k).astype(np.float32))
    np.testing.assert_array_equal(quant.dequantize(tid, real, k), ref.dequantize(tid, real, k)[0].astype(np.float32))


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
def test_qmatmul_many_equals_separate_calls(variant) -> None:
    """One dispatch for several weights of mixed types on one x: each output bit for bit qmatmul's (same kernels on
    the same quantized x), also with MAX_MANY weights and with fewer rows than threads."""
    rng = np.random.default_rng(5)
    k = 512
    types = [2, 8, 12, 14, 1, 30, 7, 13, 0, 3, 6, 2, 8, 12, 14, 1]
    n_outs = [17, 3, 33, 1, 5, 2, 64, 16, 7, 1, 9, 257, 2, 3, 4, 5]
    ws = [ref.random_matrix(t, n, k, rng) for t, n in zip(types, n_outs)]
    for threads, m, count in ((1, 1, 3), (N_THREADS, 5, 7), (N_THREADS, 19, quant.MAX_MANY), (1, 16, 2)):
        native.set_threads(threads)
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = quant.qmatmul_many(types[:count], ws[:count], n_outs[:count], k, x)
        for t, w, n, y in zip(types, ws, n_outs, ys):
            assert isinstance(y, np.ndarray) and y.shape == (m, n)
            np.testing.assert_array_equal(y, quant.qmatmul(t, w, n, k, x), err_msg=f"{_tid(t)} m={m}")
    qws = [quant.QuantWeight(t, w, n, k) for t, w, n in zip(types[:3], ws[:3], n_outs[:3])]
    outs = [torch.empty(4, n) for n in n_outs[:3]]
    x = torch.randn(4, k)
    got = quant.matmul_many(qws, x, outs)
    assert all(a is b for a, b in zip(got, outs))
    for qw, y in zip(qws, got):
        np.testing.assert_array_equal(y.numpy(), qw.matmul(x).numpy())
    group = quant.QuantGroup(qws)  # the prepared form: the same results, call after call, x 1-D too
    for xx in (x, x[1]):
        for qw, y in zip(qws, group.matmul(xx)):
            np.testing.assert_array_equal(y.numpy(), qw.matmul(xx).numpy())
    assert quant.QuantGroup([]).matmul(x) == []


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid, indirect=True)
def test_nonfinite_and_zero_activations(variant) -> None:
    """A NaN or an infinity in a row of x makes that row's outputs NaN (its block scale is NaN) and no other row's;
    an all-zero block contributes exactly 0."""
    rng = np.random.default_rng(11)
    k = 512
    for tid in (2, 3, 8, 12, 14):
        w = ref.random_matrix(tid, 19, k, rng)
        x = rng.standard_normal((4, k)).astype(np.float32)
        clean = quant.qmatmul(tid, w, 19, k, x)
        x[1, 300] = np.nan
        x[2, 5] = np.inf
        x[3, :256] = 0.0
        y = quant.qmatmul(tid, w, 19, k, x)
        assert np.isnan(y[1]).all() and np.isnan(y[2]).all(), _tid(tid)
        np.testing.assert_array_equal(y[0], clean[0])
        want_q, tol_q, _, _ = _bounds(tid, w, k, x[3:])
        assert np.all(np.abs(y[3] - want_q[0]) <= tol_q[0]), _tid(tid)
    x = np.zeros((2, 64), np.float32)
    assert not quant.qmatmul(2, ref.random_matrix(2, 3, 64, rng), 3, 64, x).any()


def test_concurrent_calls_from_two_threads() -> None:
    """Two Python threads at once (the second finds the pool busy and runs on its own thread, with its own
    workspace): both get the results of a call alone."""
    rng = np.random.default_rng(3)
    k, n_out = 1024, 300
    w = ref.random_matrix(12, n_out, k, rng)
    xs = [rng.standard_normal((3, k)).astype(np.float32) for _ in range(2)]
    want = [quant.qmatmul(12, w, n_out, k, x) for x in xs]
    got: list[list[np.ndarray]] = [[], []]

    def run(i: int) -> None:
        for _ in range(20):
            got[i].append(quant.qmatmul(12, w, n_out, k, xs[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for y in got[i]:
            np.testing.assert_array_equal(y, want[i])


def test_python_shapes_and_kinds() -> None:
    rng = np.random.default_rng(8)
    w = ref.random_matrix(8, 6, 64, rng)
    x = rng.standard_normal(64).astype(np.float32)
    y1 = quant.qmatmul("q8_0", w, 6, 64, x)  # a 1-D x: a 1-D y; names are case-insensitive
    assert y1.shape == (6,)
    np.testing.assert_array_equal(y1, quant.qmatmul(gguf.GGMLQuantizationType.Q8_0, w, 6, 64, x[None])[0])
    out = np.full((1, 6), 7.0, np.float32)
    assert quant.qmatmul(8, torch.from_numpy(w), 6, 64, x[None], out=out) is out
    np.testing.assert_array_equal(out[0], y1)
    assert quant.qmatmul(8, w, 6, 64, np.zeros((0, 64), np.float32)).shape == (0, 6)
    assert quant.qmatmul(8, w[:0], 0, 64, x).shape == (0,)
    f16 = rng.standard_normal((5, 10)).astype(np.float16)  # float weights as their own dtype
    np.testing.assert_allclose(quant.qmatmul("F16", f16, 5, 10, np.ones(10, np.float32)),
                               f16.astype(np.float32).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert quant.row_bytes("Q4_K", 512) == 288 and quant.type_id("bf16") == 30
    assert repr(quant.QuantWeight(8, w, 6, 64)) == "QuantWeight(Q8_0, n_out=6, k=64)"


def test_workspace_sizes() -> None:
    lib = quant.lib
    assert lib.fx_version() >= 8  # 8: the quantized-weight products
    for tid in ALL_TYPES:
        block = ref.TYPES[tid][1]
        k = 256 * 3
        need = lib.fx_qmatmul_workspace(tid, 5, k)
        assert (need == 0) == (block == 1)
        assert lib.fx_qmatmul_workspace(lib.FX_QT_ANY, 5, k) >= need
        assert lib.fx_qmatmul_workspace(tid, 0, k) == 0
    any_ = lib.fx_qmatmul_workspace(lib.FX_QT_ANY, 5, 512)
    assert any_ == lib.fx_qmatmul_workspace(2, 5, 512) + lib.fx_qmatmul_workspace(12, 5, 512) - 64
    assert lib.fx_qmatmul_workspace(lib.FX_QT_ANY, 5, 96) == lib.fx_qmatmul_workspace(8, 5, 96)  # K types can't
    assert lib.fx_qmatmul_workspace(2, 5, 48) == -lib.FX_E_QSHAPE
    assert lib.fx_qmatmul_workspace(2, -1, 64) == -lib.FX_E_QSHAPE
    assert lib.fx_qmatmul_workspace(5, 1, 64) == -lib.FX_E_QTYPE
    assert lib.fx_qblock_size(4) == 0 and lib.fx_qrow_bytes(99, 32) == -lib.FX_E_QTYPE
    assert lib.fx_qrow_bytes(12, 128) == -lib.FX_E_QSHAPE and lib.fx_qrow_bytes(0, 0) == -lib.FX_E_QSHAPE


class _Call:
    """fx_qmatmul / fx_qmatmul_many / fx_dequantize on raw buffers, y and out filled with a sentinel so that a
    rejected call is seen to have written nothing."""

    def __init__(self, tid: int = 2, n_out: int = 5, k: int = 64, m: int = 3) -> None:
        self.tid, self.n_out, self.k, self.m = tid, n_out, k, m
        rng = np.random.default_rng(1)
        self.w = ref.random_matrix(tid, n_out, k, rng)
        self.x = rng.standard_normal((m, k)).astype(np.float32)
        self.y = np.full((m, n_out), 123.0, np.float32)
        self.need = quant.lib.fx_qmatmul_workspace(tid, m, k)
        self.work = np.zeros(max(self.need, 1), np.uint8)
        self.ffi = quant.ffi

    def ptr(self, a: np.ndarray, ctype: str = "char[]"):
        return self.ffi.from_buffer(ctype, a)

    def qmatmul(self, tid=None, w="w", n_out=None, k=None, x="x", m=None, y="y", work="work", work_bytes=None):
        f = self.ffi
        args = (self.tid if tid is None else tid, f.NULL if w is None else self.ptr(self.w),
                self.n_out if n_out is None else n_out, self.k if k is None else k,
                f.NULL if x is None else self.ptr(self.x, "float[]"), self.m if m is None else m,
                f.NULL if y is None else self.ptr(self.y, "float[]"), f.NULL if work is None else self.ptr(self.work),
                self.need if work_bytes is None else work_bytes)
        return quant.lib.fx_qmatmul(*args)

    def untouched(self) -> bool:
        return bool((self.y == 123.0).all())


def test_native_errors_before_any_write() -> None:
    lib = quant.lib
    c = _Call()
    assert c.qmatmul(tid=5) == lib.FX_E_QTYPE and c.qmatmul(tid=-1) == lib.FX_E_QTYPE
    assert c.qmatmul(k=48) == lib.FX_E_QSHAPE and c.qmatmul(k=0) == lib.FX_E_QSHAPE
    assert c.qmatmul(n_out=-1) == lib.FX_E_QSHAPE and c.qmatmul(m=-1) == lib.FX_E_QSHAPE
    assert c.qmatmul(w=None) == lib.FX_E_QSHAPE and c.qmatmul(x=None) == lib.FX_E_QSHAPE
    assert c.qmatmul(y=None) == lib.FX_E_QSHAPE and c.qmatmul(work=None) == lib.FX_E_QSHAPE
    assert c.qmatmul(work_bytes=c.need - 1) == lib.FX_E_OUTPUT
    assert c.untouched()
    assert c.qmatmul(m=0, x=None, y=None, work=None, work_bytes=0) == lib.FX_OK  # nothing to do, nothing needed
    assert c.qmatmul(n_out=0, w=None, y=None) == lib.FX_OK and c.untouched()
    assert c.qmatmul() == lib.FX_OK and not c.untouched()
    f = _Call(tid=1, k=10)
    assert f.need == 0 and f.qmatmul(work=None, work_bytes=0) == lib.FX_OK  # float weights: no workspace

    # qmatmul_many: every weight checked before any work; a mix of formats needs both formats' workspace
    ffi = quant.ffi
    k, m = 512, 2
    rng = np.random.default_rng(2)
    types = [2, 12, 30]
    ws = [ref.random_matrix(t, 4, k, rng) for t in types]
    x = rng.standard_normal((m, k)).astype(np.float32)
    ys = [np.full((m, 4), 123.0, np.float32) for _ in types]
    keep = [ffi.from_buffer("char[]", w) for w in ws] + [ffi.from_buffer("float[]", y) for y in ys]

    def many(tt, work_bytes, n=None, n_outs=(4, 4, 4)):
        n = len(tt) if n is None else n
        work = np.zeros(max(work_bytes, 1), np.uint8)
        return lib.fx_qmatmul_many(n, ffi.new("int32_t[]", list(tt) or [0]), ffi.new("void *[]", keep[:3]),
                                   ffi.new("int64_t[]", list(n_outs)), k, ffi.from_buffer("float[]", x), m,
                                   ffi.new("float *[]", keep[3:]), ffi.from_buffer("char[]", work), work_bytes)

    full = lib.fx_qmatmul_workspace(lib.FX_QT_ANY, m, k)
    assert many(types, lib.fx_qmatmul_workspace(2, m, k)) == lib.FX_E_OUTPUT  # the K type's format is missing
    assert many([2, 12, 4], full) == lib.FX_E_QTYPE
    assert many(types, full, n_outs=(4, -4, 4)) == lib.FX_E_QSHAPE
    assert many(types, full, n=quant.MAX_MANY + 1) == lib.FX_E_QSHAPE and many(types, full, n=-1) == lib.FX_E_QSHAPE
    assert all((y == 123.0).all() for y in ys)
    assert many([], 0) == lib.FX_OK
    assert many(types, full) == lib.FX_OK and not any((y == 123.0).all() for y in ys)

    out = np.full((2, 64), 5.0, np.float32)
    w = ref.random_matrix(8, 3, 64, rng)
    args = (ffi.from_buffer("char[]", w), ffi.from_buffer("float[]", out))
    assert lib.fx_dequantize(8, args[0], -1, 2, 64, args[1]) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize(8, args[0], 0, -2, 64, args[1]) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize(8, args[0], 0, 2, 60, args[1]) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize(9, args[0], 0, 2, 64, args[1]) == lib.FX_E_QTYPE
    assert lib.fx_dequantize(8, ffi.NULL, 0, 2, 64, args[1]) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize(8, args[0], 0, 2, 64, ffi.NULL) == lib.FX_E_QSHAPE
    assert (out == 5.0).all()
    assert lib.fx_dequantize(8, args[0], 1, 2, 64, args[1]) == lib.FX_OK and not (out == 5.0).any()
    out16 = np.full((2, 64), 0x1234, np.uint16)
    p16 = ffi.from_buffer("uint16_t[]", out16)
    assert lib.fx_dequantize_bf16(8, args[0], -1, 2, 64, p16) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize_bf16(8, args[0], 0, 2, 60, p16) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize_bf16(9, args[0], 0, 2, 64, p16) == lib.FX_E_QTYPE
    assert lib.fx_dequantize_bf16(8, ffi.NULL, 0, 2, 64, p16) == lib.FX_E_QSHAPE
    assert lib.fx_dequantize_bf16(8, args[0], 0, 2, 64, ffi.NULL) == lib.FX_E_QSHAPE
    assert (out16 == 0x1234).all()
    assert lib.fx_dequantize_bf16(8, args[0], 1, 2, 64, p16) == lib.FX_OK and not (out16 == 0x1234).any()


def test_python_errors_name_the_argument() -> None:
    rng = np.random.default_rng(4)
    w = ref.random_matrix(2, 4, 64, rng)
    x = np.ones((2, 64), np.float32)
    cases = [
        (lambda: quant.qmatmul("Q9_9", w, 4, 64, x), "wtype: 'Q9_9'"),
        (lambda: quant.qmatmul(5, w, 4, 64, x), "wtype: 5"),
        (lambda: quant.qmatmul(2, w, 4, 48, x), "k=48 is not a positive multiple of Q4_0's block of 32"),
        (lambda: quant.qmatmul(2, w, 5, 64, x), "w holds 144 bytes, expected 180"),
        (lambda: quant.qmatmul(2, w, -1, 64, x), "n_out must be >= 0"),
        (lambda: quant.qmatmul(2, w, 4, 64, x.astype(np.float64)), "x must be a C-contiguous float32 array"),
        (lambda: quant.qmatmul(2, w, 4, 64, np.ones((2, 32), np.float32)), r"x has shape \(2, 32\)"),
        (lambda: quant.qmatmul(2, w, 4, 64, np.ones((64, 2), np.float32).T), "not contiguous"),
        (lambda: quant.qmatmul(2, w, 4, 64, x, out=np.empty((2, 5), np.float32)), "out must be"),
        (lambda: quant.qmatmul(2, w[:, ::2], 4, 64, x), "w must be C-contiguous"),
        (lambda: quant.qmatmul(2, [1, 2], 4, 64, x), "w must be a numpy array or a torch tensor"),
        (lambda: quant.qmatmul_many([2, 2], [w], [4, 4], 64, x), "differ in length"),
        (lambda: quant.qmatmul_many([2] * 17, [w] * 17, [4] * 17, 64, x), "at most 16 weights"),
        (lambda: quant.matmul_many([quant.QuantWeight(2, w, 4, 64), quant.QuantWeight(2, w, 2, 128)], x),
         "weights\\[1\\] has k=128"),
        (lambda: quant.dequantize(2, w, 64, 3, 2), r"rows \[3, 5\) outside the matrix's 4 rows"),
        (lambda: quant.QuantWeight(2, w, 4, 64).dequantize_bf16(out=torch.empty(4, 64)),
         "out must be a contiguous CPU bfloat16 tensor of shape \\(4, 64\\)"),
        (lambda: quant.QuantWeight(2, w, 4, 64).dequantize_bf16(3, 2), r"rows \[3, 5\) outside the matrix's 4 rows"),
        (lambda: quant.dequantize(2, w[:, :17], 64), "w holds 68 bytes, not a whole number of 36-byte rows"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
