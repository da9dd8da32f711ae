"""The captured device-selection step (device_graph.DeviceGraphedDecode) against the eager device-selection path:
same logits step by step, same KV read counters, pins honoured, and the graphs captured again only per length
bucket. On a CPU-only machine the "device" is torch on the CPU and the zero-copy alias is the host memory itself,
so the code that runs is the one the H200 captures (decode_graphs' segments run eagerly); with CUDA the cases with
device_kernels' Triton kernels run on the GPU, captured into real graphs (side streams included)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.sparse.device import capture as device_graph
from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.model.cuda_graphs import DecodeGraphs
from fluxion_lite.sparse.device.capture import DeviceGraphedDecode
from fluxion_lite.sparse.device.summaries import PINNED_SCORE
from fluxion_lite.model.gguf_loader import GGUFModel
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.sparse.cost_model import Costs
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from decode_compare import decode_and_compare, prefill
from tiny_model import make_cfg, random_weights

CPU = torch.device("cpu")
COSTS = Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None, zero_copy=True, pcie_read_gbs=10.0)


def _models(seed: int, no_mlp: bool = False, device: torch.device = CPU) -> tuple[Transformer, Transformer]:
    """no_mlp: every layer's MLP adds nothing (zero down projections), so a layer's query predicted from the stream
    after the previous layer's attention (Transformer.query_ahead) is its real query."""
    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    w = random_weights(cfg, seed=seed)
    if no_mlp:
        for name in w:
            if name.endswith("ffn_down.weight"):
                w[name] = torch.zeros_like(w[name])
    eager = Transformer(GGUFModel(Path("x"), cfg, {}, w), device=device, dtype=torch.float32, cuda_graphs=False)
    runner = Transformer(GGUFModel(Path("x"), cfg, {}, w), device=device, dtype=torch.float32)
    runner.graphs = DecodeGraphs(runner, capture=device.type == "cuda")  # real captures on a GPU
    return eager, runner


def _backends(plan: SparsePlan, cfg: object, device: torch.device = CPU, selection: str = "gpu"
              ) -> list[SparseAttention]:
    return [SparseAttention(cfg, plan, torch.float32, device, max_seqs=4, host_decode=False, placement="gpu",  # type: ignore[arg-type]
                            selection=selection, costs=COSTS, zero_copy=True) for _ in range(2)]


@pytest.mark.parametrize("pin_fraction,short_scale,graphs,fused,pin_cache,reuse,overlap,early", [
    (0.0, 1.0, "step", False, False, False, True, False), (0.5, 1.0, "step", False, False, False, True, False),
    (0.5, 1.0, "step", False, False, False, False, False), (0.5, 1.6, "step", False, False, False, True, False),
    (0.5, 1.0, "layer", False, False, False, True, False), (0.5, 1.6, "step", True, False, False, True, False),
    (0.5, 1.6, "step", True, True, True, True, False), (0.0, 1.0, "step", True, True, True, True, False),
    # the early block choice (FLUXION_EARLY_SELECT=1) on a model whose predicted queries are the real ones: with the
    # reuse cache (fetch during the previous layer, attend from device memory) and without (choice only)
    (0.5, 1.6, "step", True, True, True, True, True), (0.5, 1.6, "layer", True, False, False, True, True),
    # a budget curve that rises with the context (SparsePlan.budget_curve): a bucket's k_cap is its largest factor
    (0.5, ((200, 1.0), (800, 2.5)), "step", False, False, False, True, False),
    (0.0, ((200, 1.0), (800, 2.5)), "step", True, False, False, True, False)])
def test_captured_device_step_matches_the_eager_device_path(monkeypatch: pytest.MonkeyPatch, pin_fraction: float,
                                                           short_scale: float | tuple[tuple[int, float], ...],
                                                           graphs: str, fused: bool,
                                                           pin_cache: bool, reuse: bool, overlap: bool,
                                                           early: bool) -> None:
    device = CPU
    if fused:  # device_kernels' Triton kernels (the interpreter's, without CUDA) instead of the torch ops
        pytest.importorskip("triton")
        if torch.cuda.is_available():  # compiled kernels in captured graphs on the GPU
            device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv("FLUXION_TRITON", "1" if fused else "0")
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)  # k_cap above the rows' own k: the masking is exercised
    monkeypatch.setenv("FLUXION_DEVICE_GRAPHS", graphs)  # one graph per step, or one per layer
    monkeypatch.setenv("FLUXION_PIN_CACHE", "1" if pin_cache else "0")  # pinned blocks read from device memory
    monkeypatch.setenv("FLUXION_STEP_OVERLAP", "1" if overlap else "0")  # host work while the device runs
    # earlier steps' blocks read from device memory; without the pin cache (FLUXION_PIN_CACHE=0) not even by default
    if reuse or pin_cache:
        monkeypatch.setenv("FLUXION_REUSE_CACHE", "1" if reuse else "0")
    else:
        monkeypatch.delenv("FLUXION_REUSE_CACHE", raising=False)
    monkeypatch.setenv("FLUXION_EARLY_SELECT", "1" if early else "0")
    monkeypatch.setattr(device_graph, "EARLY_MAX_BATCH", 3)  # this test's three rows
    eager, runner = _models(seed=7, no_mlp=early, device=device)
    cfg = eager.cfg
    # one block size (what the device summaries mirror), budgets that differ inside a layer, a streaming group
    groups = [[GroupPlan(False, 16, 0.07), GroupPlan(False, 16, 0.2), GroupPlan(True)],
              [GroupPlan(False, 16, 0.02), GroupPlan(False, 16, 0.07), GroupPlan(False, 16, 0.5)]]
    # short_tokens 300: the rows sit below, across and above the short-context scale's ramp
    curve = short_scale if isinstance(short_scale, tuple) else ()
    plan = SparsePlan(sink=20, window=33, groups=groups, source="test", pin_fraction=pin_fraction, obs_window=8,
                      pin_span=2, short_scale=1.0 if curve else float(short_scale), short_tokens=300,
                      budget_curve=curve)
    backends = _backends(plan, cfg, device)
    g = torch.Generator().manual_seed(3)
    lengths = [250, 700, 180]  # the first crosses a 256-token page boundary while decoding, rows differ in k
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts)
    decode_and_compare(eager, runner, backends, lengths, 1, g, cfg.vocab_size)  # the first decode step: eager
    if pin_fraction:  # pinned there, by the prompts' last queries
        assert backends[1].pins is not None and backends[1].pins.any(0) and backends[1].pins.any(1)
    for a in backends:
        a.reset_stats()
    decode_and_compare(eager, runner, backends, [n + 1 for n in lengths], 8, g, cfg.vocab_size)
    hooked = backends[1].device_capture
    assert isinstance(hooked, DeviceGraphedDecode) and hooked.ds is not None
    assert hooked.whole_step == (graphs == "step") and hooked.fused == fused
    assert hooked.early_on == early and (hooked.early_choices > 0) == early
    assert hooked.ds.k_cap.max() > hooked.ds.k_row.max().item()  # padded top-k, masked to each row's k
    assert bool(hooked.ds.pinned.any()) == bool(pin_fraction)  # the pins reached the device mask
    if pin_cache and pin_fraction:  # every pinned block has a place in the device cache holding its K/V
        ds = hooked.ds
        kv = hooked.pool.kv if hooked.pool is not None else None
        assert hooked.pin_cache and kv is not None
        assert torch.equal(ds.pin_slot >= 0, ds.pinned) and int(ds.pin_count.sum()) == int(ds.pinned.sum())
        g = hooked.g
        for layer, b, h, blk in torch.nonzero(ds.pinned).tolist():  # each in its own entry of the layer's pool
            k, v = backends[1].store.read(layer, int(ds.slots[b]))  # [n, Hkv, D] each
            c = int(ds.pin_slot[layer, b, h, blk])
            assert torch.equal(kv[c, 0].cpu(), k[blk * g:(blk + 1) * g, h].to(kv.dtype))
            assert torch.equal(kv[c, 1].cpu(), v[blk * g:(blk + 1) * g, h].to(kv.dtype))
        used = ds.pin_slot[ds.pin_slot >= 0]
        assert used.unique().numel() == used.numel()  # no two blocks share an entry
    if reuse:  # blocks of earlier steps were read from the reuse cache, whose entries hold the store's K/V
        cache, ds = hooked.reuse, hooked.ds
        assert cache is not None and hooked.reuse_on and cache.hits_read > 0
        held = cache._tensors["held"]  # [L, B, Hkv, NB]
        assert int((held >= 0).sum()) > 0
        for layer, b, h, blk in torch.nonzero(held >= 0).tolist():
            k, v = backends[1].store.read(layer, int(ds.slots[b]))
            e = int(held[layer, b, h, blk])
            assert int(cache.owner(layer)[b, h, e]) == blk
            kv = cache.kv(layer)[b, h, e].cpu()  # [2, g, D]
            assert torch.equal(kv[0], k[blk * hooked.g:(blk + 1) * hooked.g, h].to(kv.dtype))
            assert torch.equal(kv[1], v[blk * hooked.g:(blk + 1) * hooked.g, h].to(kv.dtype))
    elif fused:
        assert hooked.reuse is None and hooked.reuse_cache_bytes() == 0
    s_eager, s_hooked = backends[0].stats(), backends[1].stats()
    assert s_hooked["kv_read_fraction"] == pytest.approx(s_eager["kv_read_fraction"])
    assert s_hooked["cpu_topk_ms"] == 0.0 and s_hooked["cpu_attn_ms"] == 0.0  # nothing ran on the host
    # with overlap, every step but the first hooked one (after an eager step) found its plan made ahead, and the
    # last step's K/V wait for a flush (as the eager path's do); without, they are in the store at the step's end
    assert hooked.overlap == overlap and hooked.planned_ahead == (7 if overlap else 0)
    lag = 1 if overlap else 0
    for layer in range(cfg.n_layers):
        for slot in range(len(lengths)):
            n = lengths[slot] + 1 + 8
            assert backends[1].store.n_tokens(layer, slot) == n - lag
            assert backends[0].store.n_tokens(layer, slot) == n - 1
    for a in backends:
        a.flush()
    for layer in range(cfg.n_layers):  # the host store got every decoded token's K/V, as the eager path's
        for slot in range(len(lengths)):
            assert backends[1].store.n_tokens(layer, slot) == backends[0].store.n_tokens(layer, slot)
            torch.testing.assert_close(backends[1].store.read(layer, slot)[0], backends[0].store.read(layer, slot)[0])
    for a in backends:
        a.executor.close()


@pytest.mark.parametrize("fused", [False, True])
def test_captured_midrange_step_matches_the_eager_device_path(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """FLUXION_TOPK=midrange (a plan's scoring "midrange"): both device paths score blocks by the midrange, the
    torch one (eager) and the captured step (block_scores kernel when fused), and they agree as with the bound."""
    from fluxion_lite.sparse.device.summaries import DeviceSummaries

    seen: set[bool] = set()
    real = DeviceSummaries.scores

    def spy(self: DeviceSummaries, *args: object, **kwargs: object) -> torch.Tensor:
        seen.add(self.midrange)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DeviceSummaries, "scores", spy)
    monkeypatch.setenv("FLUXION_TOPK", "midrange")
    test_captured_device_step_matches_the_eager_device_path(monkeypatch, 0.5, 1.6, "step", fused, fused, fused,
                                                            True, False)
    assert seen == {True}


@pytest.mark.parametrize("background,fused", [("all", False), ("retrieval", False), ("all", True)])
def test_captured_step_with_the_background_term_matches_the_eager_device_path(monkeypatch: pytest.MonkeyPatch,
                                                                            background: str, fused: bool) -> None:
    """The unread-background term in the captured step (device_background.py, from the device summaries and value
    sums) gives the logits of the eager device path, which computes it natively over the host store after selecting
    on the device; the hooked step spends no host time on it; and the term changes the logits (a run without it
    differs). fused: device_kernels' Triton kernels (the interpreter's on a CPU), the term folded into the
    streaming partials before combine."""
    from fluxion_lite.sparse.device import summaries as device_select

    if fused:
        pytest.importorskip("triton")
    monkeypatch.setenv("FLUXION_TRITON", "1" if fused else "0")
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    monkeypatch.delenv("FLUXION_BACKGROUND", raising=False)
    # fp32 keys (this CPU model): the device summaries round them to bf16 outward, the host store to nearest, so
    # midranges would differ by a bf16 step; rounded to nearest here, both hold the same bounds (on the GPU the
    # keys are bf16 already and the two are equal anyway)
    nearest = lambda x: x.to(torch.bfloat16)  # noqa: E731
    monkeypatch.setattr(device_select, "round_down_bf16", nearest)
    monkeypatch.setattr(device_select, "round_up_bf16", nearest)
    eager, runner = _models(seed=11)
    cfg = eager.cfg
    groups = [[GroupPlan(False, 16, 0.07), GroupPlan(False, 16, 0.2), GroupPlan(True)],
              [GroupPlan(False, 16, 0.02), GroupPlan(True), GroupPlan(False, 16, 0.5)]]
    # window 150: no 128-token block with background in it holds a token the host store may still lack (the
    # device sums include the newest token, the store trails it by up to two), so both terms see the same means
    plan = SparsePlan(sink=20, window=150, groups=groups, source="test", pin_fraction=0.5, obs_window=8, pin_span=2,
                      background=background)
    backends = _backends(plan, cfg) + _backends(dataclasses.replace(plan, background="off"), cfg)[:1]
    gen = torch.Generator().manual_seed(4)
    lengths = [450, 700, 380]  # rows cross 128- and 256-token boundaries while decoding
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    prefill((eager, runner), backends[:2], prompts)
    prefill((eager,), backends[2:], prompts)
    models = (eager, runner, eager)
    pos = list(lengths)
    for step in range(9):  # the first step runs eagerly in both (a sequence's first decode step)
        toks = torch.randint(0, cfg.vocab_size, (len(pos),), generator=gen)
        chunks = [SeqChunk(s, pos[s], 1) for s in range(len(pos))]
        want, got, off = (m.forward(toks, torch.tensor(pos), chunks, a) for m, a in zip(models, backends))
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        assert float((off - want).abs().max()) > 1e-2  # the term is there in both
        if step == 0:
            for a in backends:
                a.reset_stats()
        pos = [p + 1 for p in pos]
    hooked = backends[1].device_capture
    assert isinstance(hooked, DeviceGraphedDecode) and hooked.background and hooked.ds is not None
    assert hooked.fused == fused
    assert hooked.ds.bg_bounds is not None and bool((hooked.ds.bg_bounds[1] > hooked.ds.bg_bounds[0]).any())
    s_eager, s_hooked = backends[0].stats(), backends[1].stats()
    assert s_eager["cpu_background_ms"] > 0 and s_hooked["cpu_background_ms"] == 0.0  # on the device
    assert s_hooked["cpu_topk_ms"] == 0.0 and s_hooked["cpu_attn_ms"] == 0.0
    assert s_hooked["kv_read_fraction"] == pytest.approx(s_eager["kv_read_fraction"])
    for a in backends:
        a.executor.close()


def test_structure_changes_only_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    eager, runner = _models(seed=9)
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    backends = _backends(plan, eager.cfg)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, eager.cfg.vocab_size, (250,), generator=g)]
    prefill((eager, runner), backends, prompts)
    decode_and_compare(eager, runner, backends, [250], 10, g, eager.cfg.vocab_size)  # positions 250 .. 259
    hooked = backends[1].device_capture
    assert hooked is not None
    # the first step ran eagerly; positions 251-255 share the 256-token bucket, 256-259 the next one
    assert sorted(shape[1] for shape in hooked.static) == [256, 512]
    for a in backends:
        a.executor.close()


def test_queued_appends_reach_the_store_before_an_eager_step_and_a_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap (the default) a device step's K/V wait in pinned rows until the next step's end; a mixed step
    (a new prompt next to decode rows, the eager path) and a free must append them first, in order."""
    monkeypatch.setenv("FLUXION_TRITON", "0")
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    eager, runner = _models(seed=11)
    cfg = eager.cfg
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    backends = _backends(plan, cfg)
    g = torch.Generator().manual_seed(6)
    lengths = [200, 300]
    prefill((eager, runner), backends, [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths])
    decode_and_compare(eager, runner, backends, lengths, 4, g, cfg.vocab_size)  # eager first step, 3 device steps
    hooked = backends[1].device_capture
    assert hooked is not None and hooked.overlap and hooked._queued is not None
    # a mixed step: sequence 2's prompt next to one decode token of each running sequence
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    pos = [n + 4 for n in lengths]
    toks = torch.cat([torch.randint(0, cfg.vocab_size, (2,), generator=g), prompt])
    positions = torch.cat([torch.tensor(pos), torch.arange(40)])
    chunks = [SeqChunk(0, pos[0], 1), SeqChunk(1, pos[1], 1), SeqChunk(2, 0, 40)]
    outs = []
    for m, a in zip((eager, runner), backends):
        a.allocate(2)
        outs.append(m.forward(toks, positions, chunks, a))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-4, atol=2e-4)
    assert hooked._queued is None  # the eager step appended the queued K/V before its own
    decode_and_compare(eager, runner, backends, [p + 1 for p in pos] + [40], 3, g, cfg.vocab_size)
    for a in backends:
        a.free(1)  # appends what is queued, then releases the slot
    assert hooked._queued is None
    for layer in range(cfg.n_layers):
        for slot in (0, 2):
            assert backends[1].store.n_tokens(layer, slot) >= backends[0].store.n_tokens(layer, slot) - 1
    for a in backends:
        a.flush()
    for layer in range(cfg.n_layers):
        for slot in (0, 2):
            assert backends[1].store.n_tokens(layer, slot) == backends[0].store.n_tokens(layer, slot)
            torch.testing.assert_close(backends[1].store.read(layer, slot)[0], backends[0].store.read(layer, slot)[0])
            torch.testing.assert_close(backends[1].store.read(layer, slot)[1], backends[0].store.read(layer, slot)[1])
    for a in backends:
        a.executor.close()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("selection", ["gpu", "cpu"])
def test_decode_rows_of_a_mixed_step_equal_a_decode_step(monkeypatch: pytest.MonkeyPatch, selection: str,
                                                          overlap: bool) -> None:
    """A step holding a prompt chunk writes its one-token rows together, as a decode step does (ring and sink slots,
    device summaries): those rows' logits equal the same rows decoded alone, the prompt's equal its own prefill,
    and the state left behind (device slab, summaries, host store) decodes alike afterwards; with the host append
    after the chunk's device work (overlap, the default) or before it."""
    monkeypatch.setenv("FLUXION_TRITON", "0")
    eager, _ = _models(seed=13)
    cfg = eager.cfg
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    backends = _backends(plan, cfg, selection=selection)
    backends[0].overlap_chunk_append = overlap  # the backend that runs the mixed step
    g = torch.Generator().manual_seed(8)
    lengths = [200, 13]  # the second sequence's next tokens still land in the sink
    prefill((eager, eager), backends, [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths])
    decode_and_compare(eager, eager, backends, lengths, 2, g, cfg.vocab_size, tol=0.0)
    pos = [n + 2 for n in lengths]
    toks = torch.randint(0, cfg.vocab_size, (2,), generator=g)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    rows = [SeqChunk(0, pos[0], 1), SeqChunk(1, pos[1], 1)]
    for a in backends:
        a.allocate(2)
    mixed = eager.forward(torch.cat([toks, prompt]), torch.cat([torch.tensor(pos), torch.arange(40)]),
                          rows + [SeqChunk(2, 0, 40)], backends[0])  # [3, V]: each chunk's last token
    alone = eager.forward(toks, torch.tensor(pos), rows, backends[1])
    first = eager.forward(prompt, torch.arange(40), [SeqChunk(2, 0, 40)], backends[1])
    torch.testing.assert_close(mixed[:2], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[2:], first, rtol=1e-5, atol=1e-5)
    # (the new K/V come out of a 42-row and a 2-row GEMM: equal up to float rounding)
    torch.testing.assert_close(backends[0].state.near, backends[1].state.near, rtol=1e-5, atol=1e-5)
    decode_and_compare(eager, eager, backends, [p + 1 for p in pos] + [40], 3, g, cfg.vocab_size, tol=1e-5)
    for a in backends:
        a.executor.close()


@pytest.mark.parametrize("mixed_select", ["host", "device"])
def test_mixed_step_decode_rows_select_where_configured(monkeypatch: pytest.MonkeyPatch, mixed_select: str) -> None:
    """With device selection, a mixed step's decode rows choose blocks with the native top-k over the host store
    (FLUXION_MIXED_SELECT=host, the default): the same logits as a CPU-selection backend, and no device top-k
    call; FLUXION_MIXED_SELECT=device keeps the device top-k there."""
    monkeypatch.setenv("FLUXION_TRITON", "0")
    monkeypatch.setenv("FLUXION_MIXED_SELECT", mixed_select)
    eager, _ = _models(seed=17)
    cfg = eager.cfg
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    backends = [SparseAttention(cfg, plan, torch.float32, CPU, max_seqs=4, host_decode=False, placement="gpu", selection=sel,
                                costs=COSTS, zero_copy=True) for sel in ("gpu", "cpu")]
    assert backends[0].mixed_host_select == (mixed_select == "host") and not backends[1].mixed_host_select
    g = torch.Generator().manual_seed(9)
    lengths = [260, 190]
    prefill((eager, eager), backends, [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths])
    device_calls = []
    dsum = backends[0].summaries
    assert dsum is not None
    real_select = dsum.select
    monkeypatch.setattr(dsum, "select", lambda *a, **k: device_calls.append(1) or real_select(*a, **k))
    toks = torch.randint(0, cfg.vocab_size, (2,), generator=g)
    prompt = torch.randint(0, cfg.vocab_size, (30,), generator=g)
    chunks = [SeqChunk(0, lengths[0], 1), SeqChunk(1, lengths[1], 1), SeqChunk(2, 0, 30)]
    outs = []
    for a in backends:
        a.allocate(2)
        outs.append(eager.forward(torch.cat([toks, prompt]), torch.cat([torch.tensor(lengths), torch.arange(30)]),
                                  chunks, a))
    assert len(device_calls) == (0 if mixed_select == "host" else cfg.n_layers)
    if mixed_select == "host":  # the same blocks from the same host summaries: the CPU-selection backend's logits
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a in backends:
        a.executor.close()


def test_mixed_select_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUXION_MIXED_SELECT", "gpu")
    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    with pytest.raises(ValueError, match="FLUXION_MIXED_SELECT='gpu': use host or device"):
        SparseAttention(cfg, plan, torch.float32, CPU, max_seqs=2, host_decode=False, placement="gpu", selection="gpu", costs=COSTS,
                        zero_copy=True)


def test_pinned_blocks_score_first_but_stay_inside_the_eligible_range() -> None:
    from fluxion_lite.sparse.device.summaries import DeviceSummaries, round_down_bf16, round_up_bf16

    ds = DeviceSummaries(1, 2, 8, 16, torch.device("cpu"))
    k = torch.randn(160, 2, 8, generator=torch.Generator().manual_seed(2))
    ds.append_chunk(0, 0, 0, k)  # 10 blocks
    qg = torch.randn(1, 2, 3, 8)
    pinned = torch.zeros(1, 2, 10, dtype=torch.bool)
    pinned[0, 0, [1, 4]] = True  # block 1 is below the eligible range: it must stay out
    lo, hi = torch.tensor([2]), torch.tensor([9])
    s = ds.scores(0, qg, torch.tensor([0]), lo, hi, 10, pinned)
    assert s[0, 0, 4] == PINNED_SCORE and torch.isneginf(s[0, 0, [0, 1, 9]]).all()
    top = ds.select(0, qg, torch.tensor([0]), lo, hi, 10, 3, pinned)
    assert top[0, 0, 0] == 4
    # the bound itself: sum over heads of sum_d max(q_d min_d, q_d max_d), checked in float64 over the stored bf16
    # summaries: min rounded down, max up (tests/kernels/test_device_summaries.py checks that rounding and the bound)
    blocks = k.view(10, 16, 2, 8)
    mn, mx = round_down_bf16(blocks.amin(1)).double(), round_up_bf16(blocks.amax(1)).double()  # [10, Hkv, D]
    q64 = qg.double()[0]  # [Hkv, r, D]
    want = torch.maximum(q64[:, :, None, :] * mn.transpose(0, 1)[:, None], q64[:, :, None, :] * mx.transpose(0, 1)[:, None])
    want = want.sum(-1).sum(1)  # [Hkv, 10]
    free = ~pinned[0] & (torch.arange(10) >= 2) & (torch.arange(10) < 9)
    torch.testing.assert_close(s[0][free].double(), want[free], rtol=1e-5, atol=1e-5)
    assert np.isfinite(PINNED_SCORE)


def test_fluxion_selects_on_the_device_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from fluxion_lite.engine.engine import make_attention

    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    plan = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1)] * 3] * cfg.n_layers, source="test")
    for env, want in (("gpu", "gpu"), ("cpu", "cpu"), ("auto", "cpu")):  # auto: the GPU path needs CUDA
        monkeypatch.setenv("FLUXION_SELECTION", env)
        a = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, "test", plan=plan)
        assert isinstance(a, SparseAttention) and a.selection == want
        a.executor.close()


def test_auto_selection_keeps_the_cpu_where_the_device_step_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from fluxion_lite.engine import engine
    from fluxion_lite.sparse import zero_copy
    from fluxion_lite.errors import RequestError

    one_g = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1), GroupPlan(True)] * 2] * 2, source="t")
    two_g = SparsePlan(sink=16, window=32, groups=[[GroupPlan(False, 16, 0.1), GroupPlan(False, 64, 0.1)]] * 2,
                       source="t")
    cuda = torch.device("cuda")
    monkeypatch.delenv("FLUXION_SELECTION", raising=False)
    monkeypatch.setattr(zero_copy, "check", lambda device: (True, "test: pretend the alias works"))
    assert engine.fluxion_selection(cuda, one_g, per_request_plans=False) == "gpu"
    assert engine.fluxion_selection(cuda, two_g, per_request_plans=False) == "cpu"  # summaries mirror one g
    assert engine.fluxion_selection(cuda, one_g, per_request_plans=True) == "cpu"  # predictor plans: eager path
    per_head = SparsePlan(sink=16, window=32, groups=one_g.groups, source="t", scoring="per-head")
    assert engine.fluxion_selection(cuda, per_head, per_request_plans=False) == "cpu"  # native scoring only
    midrange = SparsePlan(sink=16, window=32, groups=one_g.groups, source="t", scoring="midrange")
    assert engine.fluxion_selection(cuda, midrange, per_request_plans=False) == "gpu"  # the device scores it too
    monkeypatch.setenv("FLUXION_TOPK", "per-head")
    assert engine.fluxion_selection(cuda, one_g, per_request_plans=False) == "cpu"
    monkeypatch.delenv("FLUXION_TOPK")
    background = SparsePlan(sink=16, window=32, groups=one_g.groups, source="t", background="all")
    assert engine.fluxion_selection(cuda, background, per_request_plans=False) == "cpu"  # only the CPU step has it
    monkeypatch.setenv("FLUXION_BACKGROUND", "off")  # the override decides, as in the backend
    assert engine.fluxion_selection(cuda, background, per_request_plans=False) == "gpu"
    monkeypatch.setenv("FLUXION_BACKGROUND", "retrieval")
    assert engine.fluxion_selection(cuda, one_g, per_request_plans=False) == "cpu"
    monkeypatch.delenv("FLUXION_BACKGROUND")
    assert engine.fluxion_selection(torch.device("cpu"), one_g, per_request_plans=False) == "cpu"
    monkeypatch.setattr(zero_copy, "check", lambda device: (False, "test: no alias"))
    assert engine.fluxion_selection(cuda, one_g, per_request_plans=False) == "cpu"  # staging would sync per layer
    monkeypatch.setenv("FLUXION_SELECTION", "fast")
    with pytest.raises(RequestError, match="FLUXION_SELECTION"):
        engine.fluxion_selection(cuda, one_g, per_request_plans=False)


@pytest.mark.parametrize("room", [True, False])
def test_pin_cache_follows_the_batch_as_sequences_end_and_arrive(monkeypatch: pytest.MonkeyPatch, room: bool) -> None:
    """With the pin cache the captured step keeps the eager path's logits while the batch changes: a sequence
    ends (its slot leaves the rows), a new one is prefilled (new pins: the cache is refilled, and grown if needed).
    Without room for it (room=False: no share of device memory allowed) the backend reads every block over PCIe,
    with the same logits."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this test's device is the CPU: compiled Triton kernels need CUDA tensors")
    monkeypatch.setenv("FLUXION_TRITON", "1")
    monkeypatch.delenv("FLUXION_PIN_CACHE", raising=False)  # the default: on
    if not room:
        monkeypatch.setattr(device_graph, "PIN_CACHE_SHARE", 0.0)
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    eager, runner = _models(seed=11)
    cfg = eager.cfg
    groups = [[GroupPlan(False, 16, 0.1), GroupPlan(False, 16, 0.2), GroupPlan(True)],
              [GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.1), GroupPlan(False, 16, 0.3)]]
    plan = SparsePlan(sink=20, window=33, groups=groups, source="test", pin_fraction=0.6, obs_window=8, pin_span=2)
    backends = _backends(plan, cfg)
    g = torch.Generator().manual_seed(5)
    prompts = {sid: torch.randint(0, cfg.vocab_size, (n,), generator=g) for sid, n in [(0, 400), (1, 300), (2, 520)]}
    prefill((eager, runner), backends, list(prompts.values()))
    pos = {sid: len(p) for sid, p in prompts.items()}

    def step(sids: list[int]) -> None:
        toks = torch.randint(0, cfg.vocab_size, (len(sids),), generator=g)
        chunks = [SeqChunk(s, pos[s], 1) for s in sids]
        positions = torch.tensor([pos[s] for s in sids])
        want = eager.forward(toks, positions, chunks, backends[0])
        got = runner.forward(toks, positions, chunks, backends[1])
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        for s in sids:
            pos[s] += 1

    def copied() -> int:  # blocks the pin cache has read over PCIe so far
        hooked = backends[1].device_capture
        return 0 if hooked is None or hooked.pool is None else hooked.pool.blocks_copied

    for _ in range(3):
        step([0, 1, 2])
    before = copied()
    for a in backends:  # sequence 1 ends
        a.free(1)
    for _ in range(3):
        step([0, 2])
    assert copied() == before  # the others keep their entries: nothing is read again
    longer = torch.randint(0, cfg.vocab_size, (700,), generator=g)  # sequence 3 arrives with more blocks to pin
    for m, a in zip((eager, runner), backends):
        a.allocate(3)
        m.forward(longer, torch.arange(len(longer)), [SeqChunk(3, 0, len(longer))], a)
    pos[3] = len(longer)
    step([0, 2, 3])  # its first decode step (eager) pins its blocks
    before = copied()
    for _ in range(3):
        step([0, 2, 3])
    pins = backends[1].pins
    assert pins is not None
    new_pins = len(pins.slot_blocks(backends[1].state.slot[3])[0])
    assert new_pins > 0 and copied() - before == (new_pins if room else 0)  # only the new sequence's pins
    hooked = backends[1].device_capture
    assert isinstance(hooked, DeviceGraphedDecode) and hooked.pin_cache == room
    ds = hooked.ds
    assert ds is not None and bool(ds.pinned.any())
    assert hooked.pool is not None
    if room:
        assert hooked.pool.kv is not None and torch.equal(ds.pin_slot >= 0, ds.pinned)
        assert hooked.pin_cache_bytes() > 0
    else:  # nothing held
        assert hooked.pool.kv is None and hooked.pin_cache_bytes() == 0
    for a in backends:
        a.executor.close()


def test_released_graph_sets_let_a_retired_backend_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph set captured with a backend's hooks holds that backend's host store (through the zero-copy span):
    DecodeGraphs.release_backends() drops it, so retiring a backend frees its host KV before the next allocates."""
    import gc
    import weakref

    monkeypatch.setenv("FLUXION_TRITON", "0")
    eager, runner = _models(seed=13)
    cfg = eager.cfg
    plan = SparsePlan(sink=20, window=33, groups=[[GroupPlan(False, 16, 0.1)] * 3] * 2, source="test")
    backend = _backends(plan, cfg)[1]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=g)
    backend.allocate(0)
    runner.forward(prompt, torch.arange(300), [SeqChunk(0, 0, 300)], backend)
    for pos in (300, 301, 302):  # the first decode step runs eagerly, the next ones through the graph runner
        runner.forward(torch.randint(0, cfg.vocab_size, (1,), generator=g), torch.tensor([pos]),
                       [SeqChunk(0, pos, 1)], backend)
    assert runner.graphs is not None and any(gs.hooks is not None for gs in runner.graphs.sets.values())
    slabs = weakref.ref(backend.store.slabs[0])
    backend.free(0)
    backend.executor.close()
    del backend
    gc.collect()
    assert slabs() is not None  # still held by the captured set's hooks
    runner.graphs.release_backends()
    gc.collect()
    assert slabs() is None and not any(gs.hooks is not None for gs in runner.graphs.sets.values())


def test_deferred_steps_match_synchronised_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine-style chained decode (async_decode.py): each step's input tokens are the previous step's argmax, still
    on the device, and the step returns before it is done (defer_sync). Same logits as waiting for every step, the
    host store complete after a flush, and the reuse hits (read from snapshots a step late) all counted. On CUDA
    with the compiled kernels in real graphs; without CUDA the host path of the same calls."""
    device = CPU
    fused = torch.cuda.is_available()
    if fused:
        pytest.importorskip("triton")
        device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv("FLUXION_TRITON", "1" if fused else "0")
    monkeypatch.setattr(device_graph, "BUCKET_TOKENS", 256)
    for name, value in (("FLUXION_DEVICE_GRAPHS", "step"), ("FLUXION_PIN_CACHE", "1"), ("FLUXION_REUSE_CACHE", "1"),
                        ("FLUXION_STEP_OVERLAP", "1"), ("FLUXION_EARLY_SELECT", "0")):
        monkeypatch.setenv(name, value)
    eager, runner = _models(seed=11, device=device)
    cfg = eager.cfg
    groups = [[GroupPlan(False, 16, 0.1), GroupPlan(False, 16, 0.3), GroupPlan(True)],
              [GroupPlan(False, 16, 0.05), GroupPlan(False, 16, 0.2), GroupPlan(False, 16, 0.5)]]
    plan = SparsePlan(sink=20, window=33, groups=groups, source="test", pin_fraction=0.5, obs_window=8, pin_span=2)
    eager.graphs = DecodeGraphs(eager, capture=device.type == "cuda")  # both hooked: one waits, one defers
    backends = _backends(plan, cfg, device)
    g = torch.Generator().manual_seed(5)
    lengths = [300, 520]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts)
    def chunks_at(step: int) -> list[SeqChunk]:
        return [SeqChunk(s, lengths[s] + step, 1) for s in range(2)]

    toks = torch.randint(0, cfg.vocab_size, (2,), generator=g).to(device)
    inputs, outs = [], []
    for step in range(10):  # the chain first, nothing read back on the way (the other runner would wait for it)
        inputs.append(toks)
        outs.append(runner.forward(toks, torch.tensor([c.start for c in chunks_at(step)]), chunks_at(step),
                                   backends[1], defer_sync=True))
        toks = outs[-1].argmax(-1)  # stays on the device
    for step in range(10):
        want = eager.forward(inputs[step].cpu(), torch.tensor([c.start for c in chunks_at(step)]), chunks_at(step),
                             backends[0])
        torch.testing.assert_close(outs[step], want, rtol=2e-4, atol=2e-4)
    hooked = [a.device_capture for a in backends]
    assert all(isinstance(h, DeviceGraphedDecode) for h in hooked)
    for a in backends:
        a.flush()  # the last step's K/V (flush_appends waits for its step)
    for layer in range(cfg.n_layers):
        for slot in range(2):
            assert backends[1].store.n_tokens(layer, slot) == lengths[slot] + 10
            torch.testing.assert_close(backends[1].store.read(layer, slot)[0], backends[0].store.read(layer, slot)[0])
    if fused:  # the deferred steps' hits are counted from snapshots (the last by the flush): as many as waiting
        assert hooked[1].reuse is not None and hooked[0].reuse is not None
        assert hooked[1].reuse.hits_read == hooked[0].reuse.hits_read > 0
        assert backends[1].stats()["pcie_mb"] == pytest.approx(backends[0].stats()["pcie_mb"])
    for a in backends:
        a.executor.close()
