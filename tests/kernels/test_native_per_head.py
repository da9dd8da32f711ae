"""Per-query-head block scoring of the native top-k (native.group_topk(..., scoring="per-head")): against a float64
reference across head_dim, GQA ratio, granularity, dtype, ragged lengths, excluded ranges, k from 1 to all, thread
counts and every SIMD path this CPU supports; deterministic ties; and the decode paths (eager and graphed) using it,
with the same selections as the numpy implementation it replaced (tests/support/per_head_numpy.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import Case, LENGTHS, N_THREADS, PATHS, rotated_cases, topk_setup
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore
from per_head_numpy import per_head_topk


def _cases() -> list[Case]:
    # the rotation, and a few fixed cases so each path also sees each head_dim, g, dtype and thread count, plus the
    # kernels' other head passes (12, 16 heads) and head_dims not a multiple of 32
    cases = rotated_cases()
    for simd in PATHS:
        for ratio, d, g, dt, th in ((7, 128, 16, torch.bfloat16, N_THREADS), (4, 64, 32, torch.float16, 1),
                                    (8, 64, 64, torch.bfloat16, 1), (3, 128, 128, torch.float16, N_THREADS),
                                    (12, 64, 16, torch.bfloat16, 1), (16, 128, 32, torch.float16, N_THREADS),
                                    (5, 48, 16, torch.bfloat16, 1), (2, 80, 64, torch.float16, 1)):
            cases.append(Case(simd, ratio, d, g, dt, th))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_per_head_topk_matches_float64_reference(case: Case, settings: None) -> None:
    # excluded: a block-aligned sink + window; an unaligned range (the 37-token sequence keeps 0 eligible blocks at
    # g = 128); two overlapping ranges (native_cases.excluded_ranges)
    t = topk_setup(case, str(case))
    keys, q, excludes, rows = t.keys, t.q, t.excludes, t.rows
    g, r, d = case.g, case.ratio, case.head_dim
    n_blocks = [-(-n // g) for n in LENGTHS]

    def run(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return native.group_topk(t.view, q, t.tasks(k), scoring="per-head")

    all_ids, all_scores, all_counts = run(max(n_blocks))  # every eligible block with its score
    for k in sorted({1, 3, max(n_blocks) // 2, max(n_blocks) + 5}):
        ids, scores, counts = run(k)
        for ti, (si, h) in enumerate(rows):
            mins, maxs = ref.block_summaries(keys[si][:, h], g)
            eligible = ref.eligible_blocks(LENGTHS[si], g, excludes[si])
            want = ref.per_head_scores(q[si, h * r:(h + 1) * r], mins, maxs, eligible)
            bounds = ref.head_bounds(q[si, h * r:(h + 1) * r], mins, maxs)
            tol = 1e-5 * np.abs(bounds).max() * np.sqrt(d)  # fp32 sums of d terms, then a difference
            chosen = ids[ti, :counts[ti]]
            assert counts[ti] == min(k, len(eligible))
            assert np.all(np.diff(chosen) > 0), "ids ascending and unique"
            assert np.isin(chosen, eligible).all()
            if counts[ti]:
                assert scores[ti, :counts[ti]].max() == 0.0, "some head's own best block scores exactly 0"
                assert (scores[ti, :counts[ti]] <= 0.0).all()
            np.testing.assert_allclose(scores[ti, :counts[ti]], want[chosen], rtol=0, atol=tol)
            rest = np.setdiff1d(eligible, chosen)
            if len(rest) and len(chosen):
                assert want[chosen].min() >= want[rest].max() - tol
            # exactly the (score desc, id asc) k best of the kernel's own scores: ties resolved the same every time
            e_ids, e_sc = all_ids[ti, :all_counts[ti]], all_scores[ti, :all_counts[ti]]
            want_ids, want_sc = ref.exact_topk(e_ids, e_sc, k)
            assert chosen.tolist() == want_ids.tolist()
            np.testing.assert_array_equal(scores[ti, :counts[ti]].view(np.int32), want_sc.view(np.int32))


@pytest.mark.parametrize("simd", PATHS)
def test_long_task_split_over_threads_is_bitwise_the_same(simd: str, settings: None) -> None:
    """A task long enough to be split into several work items (and several pages of summaries) gives the same ids
    and score bits on 1 and N threads, and its best-per-head maxima cover only eligible blocks."""
    native.set_simd(simd)
    rng = np.random.default_rng(17)
    r, d, n = 7, 128, 128 * 40 + 9
    store = HostKVStore(1, 1, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256)
    slot = store.allocate()
    k = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32) - 0.2).to(torch.bfloat16)
    store.append(0, slot, k, k)
    q = rng.standard_normal((1, r, d), dtype=np.float32)
    exclude = [(0, 64), (n - 100, n)]
    mins, maxs = ref.block_summaries(k.float().numpy()[:, 0].astype(np.float64), 16)
    eligible = ref.eligible_blocks(n, 16, exclude)
    want = ref.per_head_scores(q[0], mins, maxs, eligible)
    results = []
    for threads in (1, N_THREADS):
        native.set_threads(threads)
        for k_sel in (1, 37, len(eligible)):
            tasks = native.make_tasks(slot, 0, 0, 16, k_sel, exclude=exclude)
            ids, scores, counts = native.group_topk(store.view(0), q, tasks, scoring="per-head")
            chosen = ids[0, :counts[0]]
            assert counts[0] == min(k_sel, len(eligible)) and np.isin(chosen, eligible).all()
            rest = np.setdiff1d(eligible, chosen)
            if len(rest):
                assert want[chosen].min() >= want[rest].max() - 1e-3
            results.append((chosen.tolist(), scores[0, :counts[0]].view(np.int32).tolist()))
    assert results[:3] == results[3:]


def test_ties_prefer_lower_block_ids(settings: None) -> None:
    """Identical blocks score identically under every head: the lower ids must win, on every path."""
    store = HostKVStore(1, 1, 64, dtype=torch.bfloat16, max_seqs=1)
    slot = store.allocate()
    pattern = torch.randn(16, 1, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    store.append(0, slot, pattern.repeat(20, 1, 1), pattern.repeat(20, 1, 1))  # 20 identical 16-token blocks
    q = np.random.default_rng(1).standard_normal((1, 4, 64), dtype=np.float32)
    for simd in PATHS:
        native.set_simd(simd)
        for k, exclude, want in ((5, [(16, 48)], [0, 3, 4, 5, 6]), (1, [(0, 16)], [1]), (3, [], [0, 1, 2])):
            ids, scores, counts = native.group_topk(store.view(0), q, native.make_tasks(slot, 0, 0, 16, k,
                                                                                     exclude=exclude),
                                                    scoring="per-head")
            assert ids[0, :counts[0]].tolist() == want, (simd, k)
            assert (scores[0, :counts[0]] == 0.0).all()


def test_a_block_one_head_prefers_is_kept() -> None:
    """The reason for per-head scoring: one head's favourite block, ranked low by the summed query heads."""
    d, r = 16, 4
    store = HostKVStore(1, 1, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256)
    slot = store.allocate()
    k = torch.randn(256, 1, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    store.append(0, slot, k, k)
    s = store.summaries(0, slot, 16)[0].float().numpy()  # [16 blocks, 2, D]: min, max (bf16, exact)
    q = np.zeros((1, r, d), np.float32)
    q[0, 0] = np.where(s[5, 1] > 0, 1.0, 0.0)  # head 0 looks for block 5's largest dims
    other = np.zeros(d, np.float32)
    other[np.argsort(s[12, 1])[-4:]] = 3.0  # the other heads, together stronger, look for block 12's top dims
    q[0, 1:] = other
    head0_best = int(np.argmax(ref.head_bounds(q[0, :1], s[:, 0], s[:, 1])[0]))
    tasks = native.make_tasks(slot, 0, 0, 16, 2)
    ids_g, _, _ = native.group_topk(store.view(0), q, tasks)
    ids_p, _, counts_p = native.group_topk(store.view(0), q, tasks, scoring="per-head")
    assert head0_best not in ids_g[0, :2].tolist()  # the summed query ranks it low
    assert counts_p[0] == 2 and head0_best in ids_p[0, :2].tolist()


def test_one_head_per_group_selects_what_group_scoring_selects() -> None:
    """With r = 1 the gap is the bound minus a constant: the same blocks as the group scoring."""
    hkv, d, n = 2, 32, 700
    store = HostKVStore(1, hkv, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256)
    slot = store.allocate()
    k = torch.randn(n, hkv, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    store.append(0, slot, k, k)
    q = torch.randn(1, hkv, d, generator=torch.Generator().manual_seed(2))
    for g, kk in ((16, 5), (64, 3), (32, 40)):
        tasks = native.make_tasks(slot, 0, np.arange(hkv), g, kk, exclude=[(0, 32), (n - 64, n)])
        ids_g, _, counts_g = native.group_topk(store.view(0), q, tasks)
        ids_p, _, counts_p = native.group_topk(store.view(0), q, tasks, scoring="per-head")
        assert counts_p.tolist() == counts_g.tolist()
        for i in range(len(tasks)):
            assert ids_p[i, :counts_p[i]].tolist() == ids_g[i, :counts_g[i]].tolist()


def test_workspace_grows_for_the_heads_bounds() -> None:
    """Per-head scoring needs r floats per block more workspace than a group call just sized: the wrapper grows it."""
    hkv, r, d, n = 4, 8, 64, 8192
    store = HostKVStore(1, hkv, d, dtype=torch.float16, max_seqs=2, page_tokens=256)
    slots = [store.allocate() for _ in range(2)]
    for slot in slots:
        k = torch.randn(n, hkv, d).half()
        store.append(0, slot, k, k)
    q = torch.randn(2, hkv * r, d)
    tasks = native.make_tasks(np.repeat(slots, hkv), np.repeat([0, 1], hkv), np.tile(np.arange(hkv), 2), 16, 20)
    native.group_topk(store.view(0), q, tasks)
    ids, scores, counts = native.group_topk(store.view(0), q, tasks, scoring="per-head")
    assert (counts == 20).all() and (scores.max(axis=1) == 0.0).all()


def test_bad_scoring_is_rejected_naming_the_argument() -> None:
    store = HostKVStore(1, 1, 64, dtype=torch.float16, max_seqs=1)
    slot = store.allocate()
    store.append(0, slot, torch.randn(64, 1, 64).half(), torch.randn(64, 1, 64).half())
    q = np.ones((1, 2, 64), np.float32)
    tasks = native.make_tasks(slot, 0, 0, 16, 2)
    for bad in ("per_head", "", None, 1):
        with pytest.raises(ValueError, match="scoring"):
            native.group_topk(store.view(0), q, tasks, scoring=bad)  # type: ignore[arg-type]
    # the C entry point rejects an unknown code itself, before touching anything
    err = native.ffi.new("int64_t[1]")
    ids, sc, cnt = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32), np.full(1, -7, np.int32)
    ws = np.zeros(1 << 12, np.float32)
    rc = native.lib.fx_group_topk_scoring(store.view(0).struct, native.ffi.from_buffer("float[]", q), 1, 2,
                                          native.ffi.from_buffer("int32_t[]", tasks), 1, 2, 7,
                                          native.ffi.from_buffer("int32_t[]", ids),
                                          native.ffi.from_buffer("float[]", sc),
                                          native.ffi.from_buffer("int32_t[]", cnt),
                                          native.ffi.from_buffer("float[]", ws), len(ws), err)
    assert rc == 13 and cnt[0] == -7


# ------------------------------------------------------------------------------------------- decode paths --


def _decode_setup(topk_scoring: str | None, graphed: bool, host_decode: bool = False) -> tuple[Any, Any, Any]:
    """(config, model, SparseAttention backend): a 2-layer qwen2-style model with GQA 4, retrieval groups at
    g = 16 and 32 (one streaming group), the graphed runner's segments run eagerly when `graphed`; the hybrid
    step unless `host_decode` (the CPU device's own decode path, sparse/host_decode.py)."""
    from fluxion_lite.model.cuda_graphs import DecodeGraphs
    from fluxion_lite.model.gguf_loader import GGUFModel
    from fluxion_lite.model.transformer import Transformer
    from fluxion_lite.sparse.cost_model import Costs
    from fluxion_lite.sparse.backend import SparseAttention
    from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
    from tiny_model import make_cfg, random_weights

    cfg = make_cfg("qwen2", hq=8, hkv=2, d=32)  # GQA 4
    m = Transformer(GGUFModel(Path("x"), cfg, {}, random_weights(cfg, seed=4)), dtype=torch.float32)
    if graphed:
        m.graphs = DecodeGraphs(m, capture=False)
    groups = [[GroupPlan(layer == 0 and h == 0, (16, 32)[h], 0.08) for h in range(cfg.n_kv_heads)]
              for layer in range(cfg.n_layers)]
    plan = SparsePlan(sink=8, window=40, groups=groups, source="test")
    a = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, placement="cpu",
                        costs=Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None), topk_scoring=topk_scoring,
                        host_decode=host_decode)
    return cfg, m, a


def _decode(cfg: Any, m: Any, a: Any, steps: int = 4) -> list[torch.Tensor]:
    """Prefill two sequences (300 and 510 tokens), then `steps` decode steps; the logits of each step."""
    from fluxion_lite.model.attention import SeqChunk

    g = torch.Generator().manual_seed(9)
    lengths = [300, 510]
    for sid, n in enumerate(lengths):
        toks = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        a.allocate(sid)
        m.forward(toks, torch.arange(n), [SeqChunk(sid, 0, n)], a)
    pos, logits = list(lengths), []
    for _ in range(steps):
        toks = torch.randint(0, cfg.vocab_size, (2,), generator=g)
        logits.append(m.forward(toks, torch.tensor(pos), [SeqChunk(s, pos[s], 1) for s in range(2)], a))
        pos = [p + 1 for p in pos]
    return logits


def test_eager_decode_selects_what_the_numpy_per_head_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager decode path with per-head scoring: every top-k call picks the blocks the numpy implementation
    picks on the same store, queries and tasks, and they differ from the group scoring's somewhere."""
    cfg, m, a = _decode_setup("per-head", graphed=False)
    real = native.group_topk
    calls = {"n": 0, "differs_from_group": 0}

    def checked(view: native.KVView, q: Any, tasks: np.ndarray, k_cap: int | None = None, out: Any = None,
                scoring: str = "group", pins: Any = None, pin_counts: Any = None) -> tuple[Any, Any, Any]:
        assert pins is None  # the plan pins nothing
        ids, scores, counts = real(view, q, tasks, k_cap, out, scoring)
        assert scoring == "per-head"
        layer = next(lay for lay in range(cfg.n_layers) if a.store.view(lay) is view)
        want_ids, want_counts = per_head_topk(a.store, layer, torch.as_tensor(q), tasks, a.scale)
        assert counts.tolist() == want_counts.tolist()
        for i in range(len(tasks)):
            assert ids[i, :counts[i]].tolist() == want_ids[i, :want_counts[i]].tolist()
        g_ids, _, g_counts = real(view, q, tasks)
        calls["differs_from_group"] += any(g_ids[i, :g_counts[i]].tolist() != ids[i, :counts[i]].tolist()
                                           for i in range(len(tasks)))
        calls["n"] += 1
        return ids, scores, counts

    monkeypatch.setattr(native, "group_topk", checked)
    _decode(cfg, m, a)
    assert calls["n"] >= 4 and calls["differs_from_group"] > 0
    a.executor.close()


def scored_decode_runs(monkeypatch: pytest.MonkeyPatch, scoring: str) -> dict[str, list[torch.Tensor]]:
    """The logits of four decodes, "eager", "graphed" and "host" (the CPU device's decode path) with `scoring` and
    "graphed-group" with the group scoring, checking that every top-k call of each (the one-call select_attend of
    the graphed and host steps included) asks for its backend's scoring and that the graphed runs used the hooked
    step."""
    real, real_select_attend = native.group_topk, native.PreparedSelection.select_attend
    seen: list[str] = []

    def spy(view: native.KVView, q: Any, tasks: np.ndarray, k_cap: int | None = None, out: Any = None,
            scoring: str = "group", **pins: Any) -> tuple[Any, Any, Any]:
        seen.append(scoring)
        return real(view, q, tasks, k_cap, out, scoring, **pins)

    def spy_select_attend(self: native.PreparedSelection, view: native.KVView, lo: int, hi: int,
                          scoring: str = "group", *pins: Any, **pin_kw: Any) -> tuple[int, float, float]:
        seen.append(scoring)
        return real_select_attend(self, view, lo, hi, scoring, *pins, **pin_kw)

    monkeypatch.setattr(native, "group_topk", spy)
    monkeypatch.setattr(native.PreparedSelection, "select_attend", spy_select_attend)
    runs = {}
    for name, run_scoring, graphed in (("eager", scoring, False), ("graphed", scoring, True),
                                       ("graphed-group", "group", True), ("host", scoring, False)):
        cfg, m, a = _decode_setup(run_scoring, graphed, host_decode=name == "host")
        seen.clear()
        runs[name] = _decode(cfg, m, a)
        assert seen and set(seen) == {run_scoring}
        if graphed:
            assert any(k[0] == "hooked" for k in m.graphs.sets)
        a.executor.close()
    return runs


def test_graphed_decode_uses_the_backend_scoring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed step (sparse_graph.py host()) scores as the backend says: its logits equal the eager per-head
    decode's, every top-k call of both runs (the graphed step's one-call select_attend included) asks for per-head
    scoring, and the group scoring's logits differ."""
    runs = scored_decode_runs(monkeypatch, "per-head")
    for got, want in zip(runs["graphed"], runs["eager"]):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert any(not torch.allclose(x, y, rtol=2e-4, atol=2e-4) for x, y in zip(runs["graphed-group"], runs["graphed"]))


def test_scoring_setting_on_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """One place decides: the constructor argument, else FLUXION_TOPK, else "group"; settable later; bad values
    raise ValueError naming the setting."""
    from fluxion_lite.sparse.cost_model import Costs
    from fluxion_lite.sparse.backend import SparseAttention
    from fluxion_lite.plan.sparse_plan import SparsePlan
    from tiny_model import make_cfg

    cfg = make_cfg("llama", hq=4, hkv=2, d=32)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=8, window=40)
    costs = Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None)

    def make(**kw: Any) -> SparseAttention:
        return SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=1, placement="cpu",
                               costs=costs, **kw)

    monkeypatch.delenv("FLUXION_TOPK", raising=False)
    a = make()
    assert a.topk_scoring == "group"
    a.topk_scoring = "per-head"
    assert a.topk_scoring == "per-head"
    with pytest.raises(ValueError, match="topk_scoring"):
        a.topk_scoring = "max"
    monkeypatch.setenv("FLUXION_TOPK", "per-head")
    assert make().topk_scoring == "per-head"
    assert make(topk_scoring="group").topk_scoring == "group"
    monkeypatch.setenv("FLUXION_TOPK", "native")  # the group scoring's old name
    assert make().topk_scoring == "group"
    monkeypatch.setenv("FLUXION_TOPK", "perhead")
    with pytest.raises(ValueError, match="FLUXION_TOPK"):
        make()
    monkeypatch.delenv("FLUXION_TOPK")
    with pytest.raises(ValueError, match="selection='cpu'"):
        SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=1, placement="gpu", selection="gpu",
                        costs=costs, topk_scoring="per-head")
