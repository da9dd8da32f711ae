"""Blocks pinned at prefill end by the prompt's own attention (fluxion_lite/plan/pins.py): the attention mass against a
float64 reference, the choice of blocks, the union with the per-step top-k, and decode through the sparse backend."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.engine.engine import Engine, make_attention
from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.pins import PinnedBlocks, attention_mass, group_pins, pick_pins
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from decode_compare import decode_and_compare, prefill
from real_model import MODEL, decode_logits, engine, essay_tokens  # noqa: F401  (fixtures)


def pin_plan(n_layers: int, n_kv_heads: int, obs_window: int) -> SparsePlan:
    """A plan that only sizes PinnedBlocks (the tests store pins directly)."""
    return SparsePlan(16, 64, [[GroupPlan(False, 16, 0.1)] * n_kv_heads for _ in range(n_layers)], "t",
                      pin_fraction=0.5, obs_window=obs_window)


def reference_mass(q: np.ndarray, keys: np.ndarray, first_pos: int, scale: float) -> np.ndarray:
    """float64: for each KV head, sum over its query heads and the rows of softmax(q k^T) over keys <= the row."""
    w, hq, _ = q.shape
    hkv, n, _ = keys.shape
    r = hq // hkv
    out = np.zeros((hkv, n))
    for h in range(hkv):
        for j in range(h * r, (h + 1) * r):
            for i in range(w):
                visible = first_pos + i + 1
                s = keys[h, :visible] @ q[i, j] * scale
                p = np.exp(s - s.max())
                out[h, :visible] += p / p.sum()
    return out


@pytest.mark.parametrize("w,hq,hkv,d,n", [(5, 6, 2, 16, 90), (32, 7, 1, 64, 300), (1, 8, 8, 32, 40)])
def test_attention_mass_matches_float64_reference(w: int, hq: int, hkv: int, d: int, n: int) -> None:
    g = torch.Generator().manual_seed(w * 100 + n)
    q = torch.randn(w, hq, d, generator=g)
    keys = torch.randn(hkv, n, d, generator=g)
    first = n - w
    got = attention_mass(q, keys, first, d**-0.5).numpy()
    want = reference_mass(q.double().numpy(), keys.double().numpy(), first, d**-0.5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got.sum() == pytest.approx(w * hq, rel=1e-5)  # every row's softmax sums to 1


@pytest.mark.parametrize("g,n,count", [(16, 700, 5), (128, 700, 2), (32, 300, 100), (64, 100, 3)])
def test_pick_pins_takes_the_heaviest_eligible_blocks(g: int, n: int, count: int) -> None:
    sink, window = 20, 70
    mass = np.random.default_rng(g + n).random(n - 1)  # the prompt: n - 1 tokens before the first decode token
    got = pick_pins(mass, g, n, sink, window, count)
    sink_hi = -(-sink // g) * g
    win_lo = max(((n - window) // g) * g, sink_hi)
    eligible = [b for b in range(n // g + 1) if b * g >= sink_hi and (b + 1) * g <= win_lo]
    per_block = {b: mass[b * g : (b + 1) * g].sum() for b in eligible}
    want = sorted(sorted(eligible, key=lambda b: (-per_block[b], b))[:count])
    assert got.tolist() == want
    assert got.dtype == np.int32


def test_table_gathers_each_tasks_pins_for_the_native_top_k() -> None:
    """table(): per task the pins of its (slot, KV head), counts alongside; slots never pinned (inside or past the
    stored rows) count 0; and the native top-k given that table selects the pins plus the best of the rest."""
    from fluxion_lite.hostkv import native
    from fluxion_lite.hostkv.store import HostKVStore

    pins = PinnedBlocks(pin_plan(n_layers=2, n_kv_heads=2, obs_window=4))
    pinned = {(0, 0): [3, 9, 20], (0, 1): [], (2, 0): [1], (2, 1): [5, 6, 7, 8]}
    for slot in (0, 2):
        pins._store(0, slot, [np.array(pinned[(slot, h)], np.int32) for h in range(2)])
    pins._store(1, 2, [np.array([11], np.int32), np.array([], np.int32)])  # layer 1: other pins, slot 2 only
    tasks = np.zeros((6, 9), np.int32)
    tasks[:, 0] = [0, 0, 2, 2, 1, 5]  # slot 1: a row without pins; slot 5: past the stored rows
    tasks[:, 2] = [0, 1, 0, 1, 0, 1]
    tasks[:, 3], tasks[:, 4] = 16, 6
    for first in (6, 5):  # with and without a slot past the stored rows
        ids, counts = pins.table(0, tasks[:first])
        assert ids.dtype == counts.dtype == np.int32 and ids.shape == (first, 4)
        for i in range(first):
            want = pinned.get((int(tasks[i, 0]), int(tasks[i, 2])), [])
            assert ids[i, : counts[i]].tolist() == want, i
        # a step's table: each row its own layer (layer-major rows of two layers)
        rows = [0, 1, 2, 2, 3, first - 1]  # layer 1's last row: slot 5 (past the stored rows) or slot 1
        step_ids, step_counts = pins.table(np.array([0, 0, 0, 1, 1, 1]), tasks[rows])
        assert step_counts.tolist() == [3, 0, 1, 1, 0, 0]
        assert step_ids[2, :1].tolist() == [1] and step_ids[3, :1].tolist() == [11]
    store = HostKVStore(1, 2, 32, dtype=torch.bfloat16, max_seqs=6)
    for _ in range(6):
        slot = store.allocate()
        k = torch.randn(30 * 16, 2, 32, generator=torch.Generator().manual_seed(slot)).bfloat16()
        store.append(0, slot, k, k)
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(9))
    ids, counts = pins.table(0, tasks)
    plain, _, plain_counts = native.group_topk(store.view(0), q, tasks)
    got, _, got_counts = native.group_topk(store.view(0), q, tasks, pins=ids, pin_counts=counts)
    all_blocks = tasks.copy()
    all_blocks[:, 4] = 30
    every, every_scores, every_counts = native.group_topk(store.view(0), q, all_blocks)  # each block, its score
    for i in range(len(tasks)):
        pin = pinned.get((int(tasks[i, 0]), int(tasks[i, 2])), [])
        order = sorted(range(every_counts[i]), key=lambda j: (-float(every_scores[i, j]), int(every[i, j])))
        best = [int(every[i, j]) for j in order if int(every[i, j]) not in pin][: 6 - len(pin)]
        assert got[i, : got_counts[i]].tolist() == sorted(best + pin), i
        if not pin:
            assert got[i, : got_counts[i]].tolist() == plain[i, : plain_counts[i]].tolist()
    pins.forget(seq_id=0, slot=2)
    assert not pins._counts[0][2].any() and pins.any(0)


def test_mask_marks_each_rows_pins_for_the_device_top_k() -> None:
    """mask(): True exactly at the stored pins of each row's slot below n_blocks, all layers or one; slots never
    pinned (inside or past the stored rows) all False."""
    pins = PinnedBlocks(pin_plan(n_layers=2, n_kv_heads=2, obs_window=4))
    pinned = {(0, 0, 0): [3, 9, 20], (0, 2, 0): [1], (0, 2, 1): [5, 6, 7, 8], (1, 2, 0): [11]}
    for layer, slot in ((0, 0), (0, 2), (1, 2)):
        pins._store(layer, slot, [np.array(pinned.get((layer, slot, h), []), np.int32) for h in range(2)])
    slots = np.array([2, 1, 0, 7])  # slot 1: no pins; slot 7: past the stored rows
    m = pins.mask(slots, n_blocks=16)
    assert m.shape == (2, 4, 2, 16) and m.dtype == bool
    want = np.zeros_like(m)
    for (layer, slot, h), blocks in pinned.items():
        for b in range(len(slots)):
            if slots[b] == slot:
                want[layer, b, h, [x for x in blocks if x < 16]] = True  # block 20 lies past n_blocks
    assert (m == want).all()
    assert (pins.mask(slots, 16, layer=1) == want[1]).all()


def test_observe_keeps_the_last_rows_across_a_short_last_chunk() -> None:
    pins = PinnedBlocks(pin_plan(n_layers=2, n_kv_heads=1, obs_window=8))
    q = torch.arange(20 * 2 * 4, dtype=torch.float32).view(20, 2, 4)
    pins.observe(1, seq_id=5, start=0, q=q[:17])
    pins.observe(1, seq_id=5, start=17, q=q[17:])
    first, rows = pins._q[5][1]  # type: ignore[misc]
    assert first == 12 and torch.equal(rows, q[12:])


def test_a_needle_block_the_summed_bound_misses_is_pinned() -> None:
    """The question (the observed rows) matches one block's keys exactly; other blocks have larger extremes."""
    hkv, hq, d, n, g = 1, 4, 32, 512, 16
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(hkv, n, d, generator=gen) * 0.3
    keys[0, 200:216] += 3.0 * torch.randn(d, generator=gen).sign()  # block 12 is far from the question...
    needle = torch.randn(d, generator=gen)
    keys[0, 300:316] = needle * 0.8  # ...block 18 holds the needle
    q = needle.repeat(4, hq, 1)  # [W, Hq, D]
    plan = SparsePlan(16, 64, [[GroupPlan(False, g, 0.1)]], "t", pin_fraction=0.5, obs_window=4)
    pins = PinnedBlocks(plan)
    pins.observe(0, seq_id=1, start=n - 4, q=q)
    pins.pin(0, seq_id=1, slot=0, keys_of=lambda i: keys, n=n + 1, scale=d**-0.5)
    assert 300 // g in pins._ids[0][0, 0, : pins._counts[0][0, 0]].tolist()


@pytest.mark.parametrize("g,pin_fraction", [(16, 0.1), (128, 0.5)])
def test_pins_plus_topk_at_full_budget_equal_dense(engine: Engine, essay_tokens: list[int], g: int,  # noqa: F811
                                                   pin_fraction: float) -> None:
    """At budget 1 the pins and the shrunk top-k together still cover every block, some of them twice: each block
    must be read once (a duplicate would count its tokens twice in the softmax)."""
    cfg = engine.config
    dense = decode_logits(engine, engine.attn, essay_tokens, 6)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=g, budget=1.0, sink=20, window=70)
    plan.pin_fraction = pin_fraction
    attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
    sparse = decode_logits(engine, attn, essay_tokens, 6)
    assert attn.pins is not None and not attn.pins.any(0)  # freed with the sequence
    assert attn.stats()["kv_read_fraction"] == pytest.approx(1.0)
    kl = (dense.log_softmax(-1).exp() * (dense.log_softmax(-1) - sparse.log_softmax(-1))).sum(-1)
    assert float(kl.max()) < 1e-3
    assert torch.equal(dense.argmax(-1), sparse.argmax(-1))


def test_pinned_plan_reads_the_same_blocks_per_step(engine: Engine, essay_tokens: list[int]) -> None:  # noqa: F811
    """Pins take part of the budget: a step reads as many blocks as the unpinned plan (block counts, not tokens:
    a pinned block can be a different, never partial, block, so the fractions agree to rounding only)."""
    cfg = engine.config
    reads = {}
    for frac in (0.0, 0.5):
        plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.2, sink=16, window=64)
        plan.pin_fraction = frac
        attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
        logits = decode_logits(engine, attn, essay_tokens, 4)
        assert torch.isfinite(logits).all()
        reads[frac] = attn.stats()["kv_read_fraction"]
    assert reads[0.5] == pytest.approx(reads[0.0], rel=1e-9)


def reference_span_pins(mass: np.ndarray, g: int, n: int, sink: int, window: int, count: int, span: int) -> list[int]:
    """float64, one block at a time: visit eligible blocks by mass (ties to the lower id) and add each with its
    span - 1 successors that are eligible and not yet taken, until count blocks."""
    sink_hi = -(-sink // g) * g
    win_lo = max(((n - window) // g) * g, sink_hi)
    eligible = [b for b in range(n // g + 1) if b * g >= sink_hi and (b + 1) * g <= win_lo]
    per_block = {b: float(np.sum(mass[b * g : (b + 1) * g], dtype=np.float64)) for b in eligible}
    taken: list[int] = []
    for anchor in sorted(eligible, key=lambda b: (-per_block[b], b)):
        for b in range(anchor, anchor + span):
            if len(taken) < count and b in per_block and b not in taken:
                taken.append(b)
    return sorted(taken)


def reference_decayed_pins(mass: np.ndarray, g: int, n: int, sink: int, window: int, count: int, span: int,
                           decay: float) -> list[int]:
    """float64: a block scores the largest of its mass and decay^j x its j-th eligible predecessor's (j < span)."""
    sink_hi = -(-sink // g) * g
    win_lo = max(((n - window) // g) * g, sink_hi)
    eligible = [b for b in range(n // g + 1) if b * g >= sink_hi and (b + 1) * g <= win_lo]
    per_block = {b: float(np.sum(mass[b * g : (b + 1) * g], dtype=np.float64)) for b in eligible}
    score = {b: max(decay**j * per_block[b - j] for j in range(span) if b - j in per_block) for b in eligible}
    return sorted(sorted(eligible, key=lambda b: (-score[b], b))[:count])


@pytest.mark.parametrize("g,n,count,span", [(16, 700, 5, 2), (16, 700, 9, 3), (128, 700, 2, 2), (32, 300, 100, 2),
                                            (64, 100, 3, 4), (16, 4000, 31, 2), (16, 200, 1, 3)])
def test_pick_pins_in_spans_takes_heavy_blocks_and_their_successors(g: int, n: int, count: int, span: int) -> None:
    sink, window = 20, 70
    mass = np.random.default_rng(g * n + span).random(n - 1) + 1e-3  # never zero: no ties broken by padding
    got = pick_pins(mass, g, n, sink, window, count, span)  # decay 1: whole spans, heaviest block first
    want = reference_span_pins(mass, g, n, sink, window, count, span)
    assert got.tolist() == want
    assert got.dtype == np.int32
    n_eligible = len(reference_span_pins(mass, g, n, sink, window, 10**6, 1))
    assert len(got) == min(count, n_eligible)  # the same pin count as span 1: a step reads as many blocks
    sink_hi, win_lo = -(-sink // g) * g, ((n - window) // g) * g
    assert all(b * g >= sink_hi and (b + 1) * g <= win_lo for b in got.tolist())  # the eligibility range is kept
    assert got.tolist() == sorted(set(got.tolist()))
    np.testing.assert_array_equal(pick_pins(mass, g, n, sink, window, count, 1), pick_pins(mass, g, n, sink, window,
                                                                                            count))
    for decay in (0.3, 0.5, 0.9):
        got = pick_pins(mass, g, n, sink, window, count, span, decay)
        assert got.tolist() == reference_decayed_pins(mass, g, n, sink, window, count, span, decay)
        assert len(got) == min(count, n_eligible)
        assert all(b * g >= sink_hi and (b + 1) * g <= win_lo for b in got.tolist())


def test_a_span_pins_the_block_after_the_heaviest_one() -> None:
    """The needle's key draws the mass; the value's block after it, light and look-alike, comes with it."""
    g, n, sink, window = 16, 1000, 16, 64
    mass = np.full(n - 1, 1e-3)
    mass[22 * g + 10 : 22 * g + 14] = 5.0  # the key, near the end of block 22
    mass[40 * g : 40 * g + 3] = 1.0  # a second, lighter peak
    assert pick_pins(mass, g, n, sink, window, 2, 1).tolist() == [22, 40]
    assert pick_pins(mass, g, n, sink, window, 2, 2).tolist() == [22, 23]
    assert pick_pins(mass, g, n, sink, window, 4, 2).tolist() == [22, 23, 40, 41]
    # decayed: the successor (20 x 0.5) still beats the lighter peak (3); at x0.1 (2) it does not
    assert pick_pins(mass, g, n, sink, window, 2, 2, 0.5).tolist() == [22, 23]
    assert pick_pins(mass, g, n, sink, window, 2, 2, 0.1).tolist() == [22, 40]
    # a heavy block right before the window: its successor is not eligible, the next span starts elsewhere
    last = (n - window) // g - 1
    mass[last * g] = 50.0
    assert pick_pins(mass, g, n, sink, window, 3, 2).tolist() == [22, 23, last]


def test_plan_file_round_trips_the_pin_settings(tmp_path: Path) -> None:
    plan = SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05), GroupPlan(True)]], "t", pin_fraction=0.5, obs_window=48,
                      scoring="per-head", pin_span=2, pin_decay=0.5)
    plan.save(tmp_path / "p.plan.json")
    back = SparsePlan.load(tmp_path / "p.plan.json")
    assert (back.pin_fraction, back.obs_window, back.scoring, back.groups) == (0.5, 48, "per-head", plan.groups)
    assert (back.pin_span, back.pin_decay) == (2, 0.5) and "spans of 2 blocks, successors x0.5" in back.explain()
    assert "50% of each retrieval budget pinned" in back.explain() and "per-head" in back.explain()
    plan.pin_span, plan.pin_decay = 1, 1.0  # the defaults are not written: older plan files load with span 1
    plan.save(tmp_path / "p1.plan.json")
    assert "pin_span" not in (tmp_path / "p1.plan.json").read_text()
    assert "pin_decay" not in (tmp_path / "p1.plan.json").read_text()
    assert (SparsePlan.load(tmp_path / "p1.plan.json").pin_span, SparsePlan.load(tmp_path / "p1.plan.json").pin_decay
            ) == (1, 1.0)
    for bad_span in (0, 9):
        with pytest.raises(ModelFileError, match="pin_span"):
            SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05)]], "t", pin_fraction=0.5, pin_span=bad_span).validate(1, 1)
    for bad_decay in (0.0, 1.5):
        with pytest.raises(ModelFileError, match="pin_decay"):
            SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05)]], "t", pin_fraction=0.5, pin_span=2,
                       pin_decay=bad_decay).validate(1, 1)
    (tmp_path / "f.plan.json").write_text((tmp_path / "p.plan.json").read_text().replace('"pin_span": 2',
                                                                                         '"pin_span": 2.5'))
    with pytest.raises(ModelFileError, match="pin_span"):
        SparsePlan.load(tmp_path / "f.plan.json")
    bad = SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05)]], "t", scoring="exact")
    with pytest.raises(ModelFileError, match="scoring"):
        bad.validate(1, 1)
    plan.pin_stride = 0.25  # written only when set, read back, shown, range-checked
    plan.save(tmp_path / "s.plan.json")
    assert SparsePlan.load(tmp_path / "s.plan.json").pin_stride == 0.25
    assert "25% of the pins spread evenly" in SparsePlan.load(tmp_path / "s.plan.json").explain()
    assert "pin_stride" not in (tmp_path / "p1.plan.json").read_text()
    with pytest.raises(ModelFileError, match="pin_stride"):
        SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05)]], "t", pin_fraction=0.5, pin_stride=1.5).validate(1, 1)
    plan.pin_stride, plan.pin_min_blocks = 0.0, 3
    plan.save(tmp_path / "m.plan.json")
    assert SparsePlan.load(tmp_path / "m.plan.json").pin_min_blocks == 3
    assert "fewer than 3 blocks pin none" in SparsePlan.load(tmp_path / "m.plan.json").explain()
    (tmp_path / "m2.plan.json").write_text((tmp_path / "m.plan.json").read_text().replace('"pin_min_blocks": 3',
                                                                                          '"pin_min_blocks": 3.5'))
    with pytest.raises(ModelFileError, match="pin_min_blocks"):
        SparsePlan.load(tmp_path / "m2.plan.json")
    with pytest.raises(ModelFileError, match="pin_min_blocks"):
        SparsePlan(16, 64, [[GroupPlan(False, 16, 0.05)]], "t", pin_fraction=0.5, pin_min_blocks=-1).validate(1, 1)
    # a field this version does not know is an error naming it, never ignored (it could change which blocks are read)
    (tmp_path / "u.plan.json").write_text((tmp_path / "p.plan.json").read_text().replace('"pin_span": 2',
                                                                                         '"pin_spam": 2'))
    with pytest.raises(ModelFileError, match="unknown field.*pin_spam"):
        SparsePlan.load(tmp_path / "u.plan.json")


def test_the_plan_names_the_block_scoring(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    cfg = engine.config
    monkeypatch.delenv("FLUXION_TOPK", raising=False)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=16, window=64)
    plan.scoring = "per-head"
    attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
    assert attn.topk_scoring == "per-head"


@pytest.mark.parametrize("one_call", [True, False], ids=["select_attend", "topk_then_scheduler"])
def test_graphed_step_with_pins_matches_eager(monkeypatch: pytest.MonkeyPatch, one_call: bool) -> None:
    """The graphed step's host() adds pins as the eager path does: same logits, same bytes read, pins in place; on
    the one-call path (all-CPU split: PreparedSelection.select_attend with the layer's pin table) and on the path of
    a GPU split (group_topk with pins, then the scheduler), forced here by reporting no all-CPU split."""
    from fluxion_lite.hostkv import native
    from fluxion_lite.sparse.host_capture import GraphedDecode

    hosted, pinned_calls = [], {"select_attend": 0, "group_topk": 0}
    real_host = GraphedDecode.host
    monkeypatch.setattr(GraphedDecode, "host", lambda self, layer: (hosted.append(layer), real_host(self, layer))[1])
    if not one_call:
        from fluxion_lite.sparse.hybrid import HybridExecutor

        monkeypatch.setattr(HybridExecutor, "all_cpu", lambda self, *args: False)
    real_select_attend, real_topk = native.PreparedSelection.select_attend, native.group_topk

    def select_attend(self: native.PreparedSelection, *args: object, **kw: object) -> object:
        pinned_calls["select_attend"] += args[4] is not None  # (view, lo, hi, scoring, pins, pin_counts)
        return real_select_attend(self, *args, **kw)  # type: ignore[arg-type]

    def group_topk(*args: object, **kw: object) -> object:
        pinned_calls["group_topk"] += kw.get("pins") is not None
        return real_topk(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native.PreparedSelection, "select_attend", select_attend)
    monkeypatch.setattr(native, "group_topk", group_topk)
    from fluxion_lite.model.cuda_graphs import DecodeGraphs
    from fluxion_lite.model.gguf_loader import GGUFModel
    from fluxion_lite.model.transformer import Transformer
    from fluxion_lite.sparse.cost_model import Costs
    from fluxion_lite.sparse.backend import SparseAttention
    from tiny_model import make_cfg, random_weights

    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    w = random_weights(cfg, seed=8)
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner.graphs = DecodeGraphs(runner, capture=False)
    groups = [[GroupPlan(False, 16, 0.2), GroupPlan(True), GroupPlan(False, 32, 0.3)] for _ in range(cfg.n_layers)]
    plan = SparsePlan(sink=16, window=32, groups=groups, source="test", pin_fraction=0.5, obs_window=8)
    costs = Costs(cpu_gbs=10.0, gather_gbs=1000.0, h2d_gbs=10.0)
    backends = [SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False, placement="cpu",
                                costs=costs, zero_copy=False) for _ in range(2)]
    g = torch.Generator().manual_seed(12)
    lengths = [400, 260]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts, chunk=128)  # chunked: the observation rows span two chunks
    decode_and_compare(eager, runner, backends, lengths, 6, g, cfg.vocab_size)
    hooked = backends[1]
    assert len(hosted) == 5 * cfg.n_layers  # every step after the first (eager: it ends the prefill) went through host()
    # every hosted layer has pins: on the path chosen, with the pin table (eager steps call group_topk with pins too)
    assert pinned_calls["select_attend"] == (5 * cfg.n_layers if one_call else 0)
    assert pinned_calls["group_topk"] >= (0 if one_call else 5 * cfg.n_layers)
    assert hooked.pins is not None and all(hooked.pins.any(layer) for layer in range(cfg.n_layers))
    for layer in range(cfg.n_layers):
        np.testing.assert_array_equal(hooked.pins._ids[layer], backends[0].pins._ids[layer])  # type: ignore[union-attr]
    assert hooked.stats()["kv_read_fraction"] == pytest.approx(backends[0].stats()["kv_read_fraction"])
    for a in backends:
        a.executor.close()


def test_pin_spans_in_tokens_cover_the_same_stretch_at_every_block_size(tmp_path: Path) -> None:
    """pin_span_tokens 80: a group of block size g pins ceil(80 / g) blocks per span (5 at g = 16, 1 at g = 128), so
    a 78-token needle after its heavy key is pinned whole at any g; the plan file keeps the field, older files load
    with it off, and bad values are refused."""
    groups = [[GroupPlan(False, 16, 0.1), GroupPlan(False, 32, 0.1), GroupPlan(False, 64, 0.2),
               GroupPlan(False, 128, 0.2)]]
    plan = SparsePlan(16, 64, groups, "t", pin_fraction=1.0, pin_span=3, pin_span_tokens=80)
    plan.validate(1, 4)
    assert [plan.span_for(g) for g in (16, 32, 64, 128)] == [5, 3, 2, 1]
    assert SparsePlan(16, 64, groups, "t", pin_span=3).span_for(16) == 3  # off: pin_span blocks at every g
    n = 4096
    mass = np.full((4, n - 1), 1e-4)
    mass[:, 1024 : 1024 + 4] = 5.0  # the key at the start of the needle; its value runs on for ~74 tokens
    pins = PinnedBlocks(plan)
    pins.pin_by_mass(0, 0, mass, n)
    _, heads, blocks = pins.slot_blocks(0)
    for h, g in enumerate((16, 32, 64, 128)):
        ids = blocks[heads == h].tolist()
        span = plan.span_for(g)
        key = 1024 // g
        assert set(range(key, key + span)) <= set(ids) and key + span not in ids, (g, ids)  # key block + successors
        assert (1024 // g + span) * g >= 1024 + 78  # the whole needle is inside the span
    plan.save(tmp_path / "t.plan.json")
    back = SparsePlan.load(tmp_path / "t.plan.json")
    assert back.pin_span_tokens == 80 and "spans of 80 tokens" in back.explain()
    plan.pin_span_tokens = 0
    plan.save(tmp_path / "off.plan.json")
    assert "pin_span_tokens" not in (tmp_path / "off.plan.json").read_text()
    assert SparsePlan.load(tmp_path / "off.plan.json").pin_span_tokens == 0
    for bad in (-16, 129):
        with pytest.raises(ModelFileError, match="pin_span_tokens"):
            SparsePlan(16, 64, groups, "t", pin_fraction=0.5, pin_span_tokens=bad).validate(1, 4)
    (tmp_path / "f.plan.json").write_text((tmp_path / "t.plan.json").read_text().replace(
        '"pin_span_tokens": 80', '"pin_span_tokens": "80"'))
    with pytest.raises(ModelFileError, match="pin_span_tokens"):
        SparsePlan.load(tmp_path / "f.plan.json")


@pytest.mark.parametrize("g,n,count,span,stride", [(16, 700, 8, 3, 0.25), (16, 4000, 40, 3, 0.33),
                                                   (64, 4000, 9, 1, 0.5), (32, 300, 100, 2, 0.34),
                                                   (16, 700, 6, 3, 1.0)])
def test_strided_pins_spread_part_of_the_count_evenly(g: int, n: int, count: int, span: int, stride: float) -> None:
    """round(stride x count) pins go evenly over the eligible blocks the mass pick left out; the rest are the mass
    pick of that smaller count; the count, the eligibility range and the order hold."""
    sink, window = 20, 70
    mass = np.random.default_rng(g * n + count).random(n - 1) + 1e-3
    got = pick_pins(mass, g, n, sink, window, count, span, 1.0, stride)
    eligible = reference_span_pins(mass, g, n, sink, window, 10**6, 1)
    spread = min(int(round(stride * count)), len(eligible))
    by_mass = reference_span_pins(mass, g, n, sink, window, min(count, len(eligible)) - spread, span)
    assert set(by_mass) <= set(got.tolist())
    assert len(got) == min(count, len(eligible)) and got.tolist() == sorted(set(got.tolist()))
    assert set(got.tolist()) <= set(eligible)
    rest = [b for b in eligible if b not in by_mass]
    want = sorted(by_mass + [rest[int((i + 0.5) * len(rest) / spread)] for i in range(spread)])
    assert got.tolist() == want
    if spread >= 2:  # evenly: the spread pins' gaps (in positions among the left-out blocks) differ by at most 1
        at = [rest.index(b) for b in sorted(set(got.tolist()) - set(by_mass))]
        assert max(np.diff(at)) - min(np.diff(at)) <= 1


def test_groups_below_pin_min_blocks_pin_nothing() -> None:
    """pin_min_blocks 4: a group whose budget is 1-3 blocks at this context chooses every block per step; the
    others pin their share as before."""
    groups = [[GroupPlan(False, 64, 0.03), GroupPlan(False, 16, 0.03), GroupPlan(True)]]  # 2 and 8 blocks at 4096
    plan = SparsePlan(16, 64, groups, "t", pin_fraction=0.75, pin_min_blocks=4)
    n = 4096
    assert [plan.block_count(gp, n) for gp in groups[0]] == [2, 8, 0]
    mass = np.random.default_rng(7).random((3, n - 1)) + 1e-3
    pins = PinnedBlocks(plan)
    pins.pin_by_mass(0, 0, mass, n)
    _, heads, blocks = pins.slot_blocks(0)
    assert (heads == 0).sum() == 0  # 2 blocks < 4: none pinned
    want = pick_pins(mass[1], 16, n, 16, 64, 6)  # int(0.75 x 8) by mass, as without the rule
    assert blocks[heads == 1].tolist() == want.tolist()
    plan.pin_min_blocks = 0
    pins.pin_by_mass(0, 0, mass, n)
    assert (pins.slot_blocks(0)[1] == 0).sum() == 1  # without the rule the 2-block group pins int(0.75 x 2) = 1


def test_consensus_pins_every_layer_at_the_first_call_from_the_blended_masses() -> None:
    """pin_consensus: the first pin() call of a sequence computes every layer's observed mass and pins all layers
    from pinned.consensus_masses (each group's normalised mass blended with all retrieval groups' mean; a float64
    reference here); later calls find nothing left; share 1 pins the same blocks in groups of equal g and count."""
    n, d, hq, hkv, w = 640, 16, 4, 2, 4
    gen = torch.Generator().manual_seed(5)
    keys = {i: torch.randn(hkv, n, d, generator=gen) for i in range(3)}
    qs = {i: torch.randn(w, hq, d, generator=gen) for i in range(3)}
    row = [GroupPlan(False, 16, 0.1), GroupPlan(False, 16, 0.1)]
    streaming_row = [GroupPlan(True), GroupPlan(False, 16, 0.1)]
    for share in (0.0, 0.4, 1.0):
        plan = SparsePlan(16, 64, [row, streaming_row, row], "t", pin_fraction=0.75, obs_window=w,
                          pin_consensus=share)
        pins = PinnedBlocks(plan)
        for i in range(3):
            pins.observe(i, seq_id=7, start=n - w, q=qs[i])
        calls: list[int] = []

        def keys_of(i: int) -> torch.Tensor:
            calls.append(i)
            return keys[i]

        for layer in range(3):
            pins.pin(layer, seq_id=7, slot=0, keys_of=keys_of, n=n + 1, scale=d**-0.5)
        assert calls == [0, 1, 2]  # each layer's keys read once, all at the first call with a consensus
        masses = {i: attention_mass(qs[i], keys[i], n - w, d**-0.5).double().numpy() for i in range(3)}
        lo, hi = 16, n + 1 - 64
        norm = {i: m / m[:, lo:hi].sum(1, keepdims=True) for i, m in masses.items()}
        mean = np.mean([norm[i][h] for i in range(3) for h in range(2) if not plan.groups[i][h].streaming], axis=0)
        for i in range(3):
            for h, gp in enumerate(plan.groups[i]):
                want = group_pins(plan, gp, masses[i][h] if share == 0 else (1 - share) * norm[i][h] + share * mean,
                                  n + 1)
                got = pins._ids[i, 0, h, : pins._counts[i, 0, h]]
                assert got.tolist() == want.tolist(), (share, i, h)
        if share == 1.0:
            retrieval = [pins._ids[i, 0, h, : pins._counts[i, 0, h]].tolist() for i in range(3) for h in range(2)
                         if not plan.groups[i][h].streaming]
            assert all(r == retrieval[0] for r in retrieval) and retrieval[0]


def test_the_plan_file_carries_the_pin_consensus(tmp_path: Path) -> None:
    """pin_consensus in the plan file and its check (research/tests/test_plan_variant.py: the same, then carried by
    research/plan_variant.py)."""
    path = tmp_path / "c.plan.json"
    SparsePlan(16, 64, [[GroupPlan(False, 16, 0.1)]], "t", pin_fraction=0.75, pin_consensus=0.5).save(path)
    back = SparsePlan.load(path)
    assert back.pin_consensus == 0.5 and "consensus" in back.explain()
    bad = SparsePlan(16, 64, [[GroupPlan(False, 16, 0.1)]], "t", pin_fraction=0.75, pin_consensus=1.5)
    with pytest.raises(ModelFileError, match="pin_consensus"):
        bad.validate(1, 1)


@pytest.mark.parametrize("consensus", [0.0, 0.5])
def test_pins_made_at_the_prompts_end_equal_those_of_the_first_decode_step(engine: Engine,  # noqa: F811
                                                                           essay_tokens: list[int],
                                                                           consensus: float) -> None:
    """Told the prompt's length, the backend pins as the last prefill chunk ends (the prompt attention's cost goes
    to prefill, not to the first decode step); not told, at the first decode step. Same pins, same logits."""
    cfg = engine.config
    n_prefix, n_decode = len(essay_tokens) - 3, 3
    results = {}
    for told in (False, True):
        plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.2, sink=16, window=64)
        plan.pin_fraction, plan.pin_consensus = 0.5, consensus
        attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
        attn.allocate(0, n_prefix if told else 0)
        for s in range(0, n_prefix, 256):
            n = min(256, n_prefix - s)
            engine.model.forward(torch.tensor(essay_tokens[s : s + n]), torch.arange(s, s + n), [SeqChunk(0, s, n)],
                                 attn)
        assert all(attn.pins.any(layer) for layer in range(cfg.n_layers)) == told
        rows = [engine.model.forward(torch.tensor([essay_tokens[p]]), torch.tensor([p]), [SeqChunk(0, p, 1)], attn)[0]
                for p in range(n_prefix, n_prefix + n_decode)]
        slot = attn.state.slot[0]
        results[told] = (torch.stack(rows), [attn.pins.slot_blocks(slot)[i].copy() for i in range(3)])
        attn.free(0)
    assert torch.equal(results[False][0], results[True][0])
    for a, b in zip(results[False][1], results[True][1]):
        np.testing.assert_array_equal(a, b)
