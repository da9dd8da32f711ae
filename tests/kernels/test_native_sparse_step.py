"""The one-call sparse decode step (native/fluxion.h, "SPARSE DECODE STEP"): bit for bit the calls it composes
(fx_layer_qkv, the append, fx_select_attend_pinned, fx_attend_spans, fx_layer_out_mlp) made one by one from Python,
with and without pins, for several rows and weight mixes, on every SIMD path with 1 and N threads; against float64
where every block is selected (then the step is dense attention over the store's 16-bit keys and values); then the
errors, which are reported before anything is written.

Tolerance of the float64 test: F32 weights (no activation quantization), fp32 products and a softmax over a few
hundred keys against float64 with the K/V rounded to the store's dtype as the step rounds them: <= 1e-4 of the
largest |x| (the decode step's own float64 test allows the same)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.layer import LayerSpec, NativeDecoder, SparseDecodeStep
from fluxion_lite.hostkv.native import ffi, lib
from fluxion_lite.hostkv.store import HostKVStore
from native_layers import QUANT_MIXES, layer_ref, make_layer, rope_rows

SPEC = LayerSpec(256, 8, 2, 32, 32, True, 512, 1e-6)
F32 = dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), 0)


class Case:
    """A store holding random contexts for m rows (slots in scrambled order), layers, a step's tasks and pins: per
    layer, row and KV group a retrieval task (g 16 / 32 / 64, k_blocks blocks) or, every third one with streaming,
    a streaming task (k = 0: its sink and window only)."""

    def __init__(self, seed: int, spec: LayerSpec, types: dict[str, int], n_layers: int, lengths: list[int],
                 dtype: torch.dtype = torch.bfloat16, k_blocks: int = 3, pinned: bool = True,
                 streaming: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self.spec, self.n_layers, self.m = spec, n_layers, len(lengths)
        made = [make_layer(rng, spec, types, bias=True) for _ in range(n_layers)]
        self.layers, self.f64s = [m[0] for m in made], [m[1] for m in made]
        self.decoder = NativeDecoder(self.layers)
        hkv, d = spec.n_kv_heads, spec.head_dim
        self.stores = []
        for _ in range(2):  # one for the step, one for the per-layer calls
            store = HostKVStore(n_layers, hkv, d, dtype=dtype, max_seqs=self.m + 2, page_tokens=256)
            store.allocate()  # slot 0 stays empty: the rows' slots are not their row numbers
            slots = [store.allocate() for _ in range(self.m)][::-1]
            self.stores.append(store)
        self.slots = np.array(slots, np.int32)
        ctx = np.random.default_rng(seed + 1)
        for layer in range(n_layers):
            for slot, n in zip(self.slots, lengths):
                k = torch.from_numpy(ctx.standard_normal((n, hkv, d))).to(dtype)
                v = torch.from_numpy(ctx.standard_normal((n, hkv, d))).to(dtype)
                for store in self.stores:
                    store.append(layer, int(slot), k, v)
        for store in self.stores:
            store.reserve_decode(self.slots.astype(np.int64))  # the step's pages: its views stay valid
        # tasks: per layer, row and KV group a retrieval task (g 16 / 32 / 64, k blocks) or a streaming one (k = 0)
        self.x = torch.from_numpy(rng.standard_normal((self.m, spec.d))).float()
        self.rope = rope_rows(rng, self.m, spec.rope_dim)
        rows, tables, pins, pin_counts = [], [], [], []
        for layer in range(n_layers):
            for i, n in enumerate(lengths):
                total = n + 1  # after the step's append
                for h in range(hkv):
                    g = int(rng.choice([16, 32, 64]))
                    k = 0 if streaming and (layer + i + h) % 3 == 2 else k_blocks
                    # the streaming part g-aligned, as the backend makes it (sink rounded up, window start down)
                    sink = 64
                    win_lo = max((total - 48) // g * g, sink)
                    tables.append(native.make_tasks(int(self.slots[i]), i, h, g if k else 16, k,
                                                    exclude=[(0, sink), (win_lo, total)]))
                    rows.append(i * hkv + h)
                    lo, hi = sink // g, win_lo // g  # eligible blocks
                    count = min(1, k, max(hi - lo, 0)) if pinned else 0
                    pin = np.full(2, np.iinfo(np.int32).max, np.int32)
                    pin[:count] = rng.integers(lo, hi, count) if count else []
                    pins.append(pin)
                    pin_counts.append(count)
        self.tasks = np.concatenate(tables).astype(np.int32)
        per_layer = self.m * hkv
        self.ends = [layer * per_layer for layer in range(n_layers + 1)]
        self.rows = np.array(rows, np.int64)
        self.pins = np.stack(pins) if pinned else None
        self.pin_counts = np.array(pin_counts, np.int32) if pinned else None
        self.k_cap = max(1, int(self.tasks[:, 4].max()))
        self.scale = spec.head_dim ** -0.5

    def step(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, tuple[int, int]]:
        """The one call over store 0: (x, ids, counts, (selected, span tokens))."""
        T = len(self.tasks)
        ids, scores, counts = (np.zeros((T, self.k_cap), np.int32), np.zeros((T, self.k_cap), np.float32),
                               np.zeros(T, np.int32))
        s = SparseDecodeStep(self.decoder, self.slots, self.tasks, self.ends, self.rows, ids, scores, counts, 0,
                             self.scale)
        s.set_pins(self.pins, self.pin_counts)
        x = self.x.clone()
        store = self.stores[0]
        sel, spans, _, _ = s.run(x, self.rope, 2 * self.spec.rope_dim, [store.view(i) for i in range(self.n_layers)])
        return x, ids, counts, (sel, spans)

    def per_layer(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, tuple[int, int]]:
        """The same calls one by one over store 1, as the sparse backend's HostDecode makes them."""
        spec, store, m = self.spec, self.stores[1], self.m
        hq, hkv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
        x = self.x.clone()
        q = np.zeros((m, spec.n_heads, spec.head_dim), np.float32)
        out = np.zeros((m * spec.n_kv_heads, spec.n_heads // spec.n_kv_heads, spec.head_dim), np.float32)
        lse = np.zeros(out.shape[:2], np.float32)
        prep = native.PreparedSelection(store.view(0), q, self.tasks, self.scale, rows=self.rows, out=out, lse=lse)
        sel = spans = 0
        for layer, nl in enumerate(self.layers):
            qkv = nl.qkv(x, self.rope)  # [m, width]
            q[:] = qkv[:, :hq].reshape(q.shape).numpy()
            k16 = qkv[:, hq : hq + hkv].reshape(m, spec.n_kv_heads, spec.head_dim).to(store.dtype)
            v16 = qkv[:, hq + hkv :].reshape(m, spec.n_kv_heads, spec.head_dim).to(store.dtype)
            store.append_batch(layer, [int(s) for s in self.slots], k16, v16, counts=[1] * m)
            lo, hi = self.ends[layer], self.ends[layer + 1]
            pins = None if self.pins is None else self.pins[lo:hi]
            pin_counts = None if self.pin_counts is None else self.pin_counts[lo:hi]
            got, _, _ = prep.select_attend(store.view(layer), lo, hi, pins=pins, pin_counts=pin_counts)
            sel += got
            spans += prep.attend_spans(store.view(layer), lo, hi)
            nl.out_mlp(x, torch.from_numpy(out).reshape(m, hq))
        return x, prep.ids, prep.counts, (sel, spans)


@pytest.mark.parametrize("pinned", [True, False], ids=["pins", "no-pins"])
@pytest.mark.parametrize("mix", list(QUANT_MIXES))
def test_step_equals_the_per_layer_calls(path: str, mix: str, pinned: bool) -> None:
    case = Case(len(mix) + pinned, SPEC, QUANT_MIXES[mix], 3, [700, 301, 1000], pinned=pinned)
    x, ids, counts, tokens = case.step()
    x2, ids2, counts2, tokens2 = case.per_layer()
    assert torch.equal(x, x2) and tokens == tokens2
    np.testing.assert_array_equal(counts, counts2)
    for i, c in enumerate(counts):
        np.testing.assert_array_equal(ids[i, :c], ids2[i, :c])
    assert tokens[0] > 0 and tokens[1] > 0
    for layer in range(case.n_layers):  # the appended tokens and everything before them
        for slot in case.slots:
            a, b = case.stores[0].read(layer, int(slot)), case.stores[1].read(layer, int(slot))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_lone_row_and_fp16_store_equal_the_per_layer_calls() -> None:
    case = Case(5, SPEC, QUANT_MIXES["k-mix"], 2, [513], dtype=torch.float16)
    x, ids, counts, tokens = case.step()
    x2, _, counts2, tokens2 = case.per_layer()
    assert torch.equal(x, x2) and tokens == tokens2
    np.testing.assert_array_equal(counts, counts2)


def dense_ref(case: Case) -> np.ndarray:
    """float64: every layer's q/k/v, its k and v rounded to the store's dtype and appended, attention over all of
    each row's stored tokens, output products and MLP (the step's answer when every block is selected)."""
    spec, store = case.spec, case.stores[1]
    hq, hkv, D, r = (spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.head_dim,
                     spec.n_heads // spec.n_kv_heads)
    x = case.x.double().numpy()
    cs = case.rope.double().numpy()
    for layer, f64 in enumerate(case.f64s):
        qkv, _ = layer_ref(spec, f64, x, cs, np.zeros((case.m, hq)))
        o = np.zeros((case.m, hq))
        for i, slot in enumerate(case.slots):
            k_old, v_old = (t.double().numpy() for t in store.read(layer, int(slot)))  # [n, Hkv, D]
            k_new = torch.from_numpy(qkv[i, hq : hq + hkv]).to(store.dtype).double().numpy().reshape(1, -1, D)
            v_new = torch.from_numpy(qkv[i, hq + hkv :]).to(store.dtype).double().numpy().reshape(1, -1, D)
            keys, values = np.concatenate([k_old, k_new]), np.concatenate([v_old, v_new])
            for j in range(spec.n_heads):
                s = keys[:, j // r] @ qkv[i, j * D : (j + 1) * D] * case.scale
                p = np.exp(s - s.max())
                o[i, j * D : (j + 1) * D] = (p / p.sum()) @ values[:, j // r]
        _, x = layer_ref(spec, f64, x, cs, o)
    return x


@pytest.mark.parametrize("lengths", [[200], [333, 90]], ids=["one-row", "two-rows"])
def test_step_with_every_block_selected_matches_float64(path: str, lengths: list[int]) -> None:
    case = Case(11, SPEC, F32, 2, lengths, k_blocks=64, pinned=False, streaming=False)
    want = dense_ref(case)
    x, _, _, _ = case.step()
    assert np.abs(x.double().numpy() - want).max() <= 1e-4 * np.abs(want).max()


def test_errors_are_reported_before_any_write() -> None:
    case = Case(3, SPEC, QUANT_MIXES["q5-q8"], 2, [300, 200])
    dec, store = case.decoder, case.stores[0]
    T = len(case.tasks)
    ids, scores, counts = np.zeros((T, case.k_cap), np.int32), np.zeros((T, case.k_cap), np.float32), np.zeros(T, np.int32)
    before = [store.n_tokens(layer, int(s)) for layer in range(2) for s in case.slots]

    def run(slots=None, ends=None, scoring=0, n_views=2, rope_stride=64):
        step = SparseDecodeStep(dec, case.slots if slots is None else slots, case.tasks,
                                case.ends if ends is None else ends, case.rows, ids, scores, counts, scoring, case.scale)
        x = case.x.clone()
        views = [store.view(i) for i in range(n_views)]
        try:
            step.run(x, case.rope, rope_stride, views + views[:2 - n_views] if n_views < 2 else views)
        finally:
            assert torch.equal(x, case.x)  # nothing written
    with pytest.raises(ValueError, match="slot out of range"):
        run(slots=np.array([case.slots[0], case.slots[0]], np.int32))  # a slot twice
    with pytest.raises(ValueError, match="slot out of range"):
        run(slots=np.array([case.slots[0], 99], np.int32))
    with pytest.raises(ValueError, match="bad shapes"):
        run(ends=[0, 6, 4])  # decreasing
    with pytest.raises(ValueError, match="task_ends has 2 entries"):
        run(ends=[0, 4])
    with pytest.raises(ValueError, match="unknown block-scoring mode"):
        run(scoring=7)
    assert [store.n_tokens(layer, int(s)) for layer in range(2) for s in case.slots] == before
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    assert lib.fx_sparse_decode_workspace(dec.c_layers, 2, 0) == -lib.FX_E_QSHAPE
    assert lib.fx_sparse_decode_workspace(dec.c_layers, 2, 65) == -lib.FX_E_QSHAPE
    assert lib.fx_sparse_decode_workspace(dec.c_layers, 0, 1) == -lib.FX_E_QSHAPE
    step = SparseDecodeStep(dec, case.slots, case.tasks, case.ends, case.rows, ids, scores, counts, 0, case.scale)
    views = ffi.new("fx_kv_view *[]", [store.view(0).struct, store.view(1).struct])  # kept: the struct only points
    step.struct.views = views
    need = lib.fx_sparse_decode_workspace(dec.c_layers, 2, 2)
    floats = lib.fx_sparse_decode_select_floats(dec.c_layers, 2, 2, step.struct)
    assert need > 0 and floats > 0
    work, ws = np.empty(need, np.uint8), np.empty(floats, np.float32)
    out = ffi.new("int64_t[2]"), ffi.new("double[2]"), ffi.new("int32_t[1]"), ffi.new("int64_t[1]")
    x = case.x.clone()
    args = (dec.c_layers, 2, fp(x), 2, fp(case.rope), 64, step.struct)
    assert lib.fx_sparse_decode_layers(*args, ffi.from_buffer("float[]", ws), floats, ffi.from_buffer("uint8_t[]", work),
                                       need - 1, *out) == lib.FX_E_OUTPUT
    assert lib.fx_sparse_decode_layers(*args, ffi.from_buffer("float[]", ws), floats - 1,
                                       ffi.from_buffer("uint8_t[]", work), need, *out) == lib.FX_E_OUTPUT
    assert lib.fx_sparse_decode_layers(dec.c_layers, 2, fp(x), 2, ffi.NULL, 64, step.struct, ffi.from_buffer("float[]", ws),
                                       floats, ffi.from_buffer("uint8_t[]", work), need, *out) == lib.FX_E_QSHAPE
    assert torch.equal(x, case.x)
    assert [store.n_tokens(layer, int(s)) for layer in range(2) for s in case.slots] == before
    assert lib.fx_sparse_decode_layers(*args, ffi.from_buffer("float[]", ws), floats, ffi.from_buffer("uint8_t[]", work),
                                       need, *out) == lib.FX_OK
    assert not torch.equal(x, case.x)
