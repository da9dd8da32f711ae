"""The piecewise decode runner (decode_graphs.py) against the eager forward. Without CUDA the runner cannot capture,
so it runs its segments eagerly through the same static buffers (DecodeGraphs(capture=False)): what is checked here
is the plumbing (layer order, static q/k/v and o buffers, RoPE rows, batch-size sets); the capture itself is checked on
a CUDA host by bench/tpot.py --check-graphs."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fluxion_lite.model import cuda_graphs as decode_graphs
from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.cuda_graphs import MAX_GRAPH_SETS, DecodeGraphs, graphs_wanted
from fluxion_lite.model.gguf_loader import GGUFModel
from fluxion_lite.model.transformer import Transformer
from decode_compare import decode_and_compare, prefill
from tiny_model import make_cfg, random_weights


def models(arch: str) -> tuple[Transformer, Transformer]:
    cfg = make_cfg(arch)
    w = random_weights(cfg, seed=3)
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float64)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float64)
    runner.graphs = DecodeGraphs(runner, capture=False)
    return eager, runner


def backend(m: Transformer) -> DenseAttention:
    return DenseAttention(m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim, torch.float64, torch.device("cpu"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_runner_matches_eager_forward_over_batch_changes(arch: str) -> None:
    eager, runner = models(arch)
    a_eager, a_runner = backend(eager), backend(runner)
    g = torch.Generator().manual_seed(5)
    lengths = [7, 12, 3]
    for sid, n in enumerate(lengths):
        toks = torch.randint(0, eager.cfg.vocab_size, (n,), generator=g)
        for m, a in ((eager, a_eager), (runner, a_runner)):
            a.allocate(sid)
            m.forward(toks, torch.arange(n), [SeqChunk(sid, 0, n)], a)
    pos = list(lengths)
    # batch sizes 3, 2, 3: a second set is captured, then the first is reused
    for live in ([0, 1, 2], [0, 2], [0, 1, 2], [1]):
        toks = torch.randint(0, eager.cfg.vocab_size, (len(live),), generator=g)
        chunks = [SeqChunk(s, pos[s], 1) for s in live]
        positions = torch.tensor([pos[s] for s in live])
        want = eager.forward(toks, positions, chunks, a_eager)
        got = runner.forward(toks, positions, chunks, a_runner)
        assert got.shape == want.shape == (len(live), eager.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for s in live:
            pos[s] += 1
    assert sorted(runner.graphs.sets) == [("plain", 1), ("plain", 2), ("plain", 3)]


def test_sets_are_bounded_and_prefill_stays_eager() -> None:
    eager, runner = models("llama")
    a = backend(runner)
    graphs = runner.graphs
    assert graphs is not None
    assert not graphs.handles([SeqChunk(0, 0, 5)])  # a prefill chunk
    assert not graphs.handles([SeqChunk(0, runner.cfg.context_length, 1)])  # past the RoPE table
    for b in range(1, MAX_GRAPH_SETS + 3):
        for s in range(b):
            if s not in a.cache._len:
                a.allocate(s)
                runner.forward(torch.tensor([1, 2]), torch.arange(2), [SeqChunk(s, 0, 2)], a)
        chunks = [SeqChunk(s, a.seq_len(s), 1) for s in range(b)]
        runner.forward(torch.ones(b, dtype=torch.long), torch.tensor([c.start for c in chunks]), chunks, a)
    assert len(graphs.sets) == MAX_GRAPH_SETS
    assert max(b for _, b in graphs.sets) == MAX_GRAPH_SETS + 2


def test_graphs_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not graphs_wanted(torch.device("cpu"), None)
    assert not graphs_wanted(torch.device("cpu"), True)
    assert graphs_wanted(torch.device("cuda"), None)
    monkeypatch.setenv("FLUXION_CUDA_GRAPHS", "0")
    assert not graphs_wanted(torch.device("cuda"), None)
    assert graphs_wanted(torch.device("cuda"), True)


@pytest.mark.parametrize("placement,zero_copy", [("cpu", False), ("gpu", True), ("auto", True)])
def test_sparse_hooks_match_the_eager_sparse_backend(placement: str, zero_copy: bool) -> None:
    """SparseAttention's captured form (sparse_graph.py: prologue / host / epilogue around the replays) gives the
    logits of its eager decode path, for CPU-only, GPU-only (zero-copy feeder) and split placements."""
    from fluxion_lite.sparse.cost_model import Costs
    from fluxion_lite.sparse.backend import SparseAttention
    from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan

    cfg = make_cfg("qwen2", hq=4, hkv=2, d=32)
    w = random_weights(cfg, seed=4)
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), dtype=torch.float32)
    runner.graphs = DecodeGraphs(runner, capture=False)
    groups = [[GroupPlan(layer == 0 and h == 0, (16, 64)[h], 0.1) for h in range(cfg.n_kv_heads)]
              for layer in range(cfg.n_layers)]
    plan = SparsePlan(sink=8, window=40, groups=groups, source="test")
    costs = Costs(cpu_gbs=10.0, gather_gbs=1000.0, h2d_gbs=10.0)
    g = torch.Generator().manual_seed(9)
    lengths = [300, 510]  # the second crosses a 256-token page boundary while decoding
    backends = []
    for m in (eager, runner):
        a = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False, placement=placement,
                            costs=costs, zero_copy=zero_copy)  # type: ignore[arg-type]
        backends.append(a)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts)
    decode_and_compare(eager, runner, backends, lengths, 5, g, cfg.vocab_size)
    assert any(k[0] == "hooked" for k in runner.graphs.sets)  # the first decode step ran eagerly, then hooked
    s_eager, s_hooked = backends[0].stats(), backends[1].stats()
    assert s_hooked["steps"] == 4 and s_hooked["kv_read_fraction"] == pytest.approx(s_eager["kv_read_fraction"])
    assert s_hooked["streaming_fraction"] == pytest.approx(s_eager["streaming_fraction"])
    if placement == "gpu":
        assert s_hooked["gpu_byte_fraction"] == 1.0
    for a in backends:
        a.executor.close()


def test_a_dropped_sparse_backend_is_not_kept_alive_by_the_graph_cache() -> None:
    """Graph sets of a hooked backend hold only a weak reference to it, and a new backend evicts the old one's sets:
    a benchmark that makes one backend per case must not pile up pinned host stores (it ran the H200 host out of RAM)."""
    import gc
    import weakref

    from fluxion_lite.sparse.cost_model import Costs
    from fluxion_lite.sparse.backend import SparseAttention
    from fluxion_lite.plan.sparse_plan import SparsePlan

    cfg = make_cfg("llama", hq=4, hkv=2, d=32)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, random_weights(cfg, seed=1)), dtype=torch.float32)
    runner.graphs = DecodeGraphs(runner, capture=False)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=8, window=40)
    refs = []
    for _ in range(2):
        a = SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=2, host_decode=False, placement="cpu",
                            costs=Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None))
        a.allocate(0)
        runner.forward(torch.arange(200) % cfg.vocab_size, torch.arange(200), [SeqChunk(0, 0, 200)], a)
        for p in (200, 201):
            runner.forward(torch.tensor([1]), torch.tensor([p]), [SeqChunk(0, p, 1)], a)
        hooked = [k for k in runner.graphs.sets if k[0] == "hooked"]
        assert len(hooked) == 1 and hooked[0][1][0] == a.serial
        a.free(0)
        a.executor.close()
        refs.append(weakref.ref(a))
        del a
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


class _FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


def test_capture_holds_the_garbage_collector_off(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    @contextmanager
    def fake_graph(g: object, pool: object = None) -> Iterator[None]:
        seen.append(gc.isenabled())
        yield

    @contextmanager
    def fake_stream(s: object) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "Stream", lambda dev=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    gs = decode_graphs._GraphSet.__new__(decode_graphs._GraphSet)
    gs.model, gs.pool, gs.hooks, gs.graphs = SimpleNamespace(device=torch.device("cpu")), (0, 1), None, []
    ran: list[int] = []
    gs.segments = [lambda i=i: ran.append(i) for i in range(3)]
    assert gc.isenabled()
    gs._capture()
    assert ran == [0, 1, 2, 0, 1, 2]  # the warm-up pass, then one capture per segment
    assert seen == [False, False, False] and gc.isenabled() and len(gs.graphs) == 3

    calls: list[int] = []

    def broken() -> None:  # runs in the warm-up, fails inside the capture
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("capture invalidated")

    gs.graphs, gs.segments = [], [broken]
    gc.disable()  # a caller that keeps the collector off gets it back off
    try:
        with pytest.raises(RuntimeError, match="invalidated"):
            gs._capture()
        assert len(calls) == 2 and not gc.isenabled()
    finally:
        gc.enable()
    gs.graphs, gs.segments = [], [lambda: None]
    seen.clear()
    gs._capture()
    assert seen == [False] and gc.isenabled()
