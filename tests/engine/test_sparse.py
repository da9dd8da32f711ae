"""Sparse decode backend, calibration and selector on the real smollm2-135m model (short contexts, so it stays quick)."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.plan.space import Config, all_configs
from fluxion_lite.plan.calibration import group_outputs
from fluxion_lite.engine.engine import Engine, make_attention
from fluxion_lite.errors import CapacityError
from fluxion_lite.plan.cost import bytes_per_step
from fluxion_lite.plan.selector import select_plan
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from real_model import MODEL, decode_logits, engine, essay_tokens  # noqa: F401  (fixtures)


def test_full_budget_sparse_decode_equals_dense(engine: Engine, essay_tokens: list[int]) -> None:
    cfg = engine.config
    dense = decode_logits(engine, engine.attn, essay_tokens, 6)
    for g in (16, 128):  # sink/window alignment differs per g; coverage must stay exact
        plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=g, budget=1.0, sink=20, window=70)
        attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
        sparse = decode_logits(engine, attn, essay_tokens, 6)
        assert attn.stats()["kv_read_fraction"] == pytest.approx(1.0)
        kl = (dense.log_softmax(-1).exp() * (dense.log_softmax(-1) - sparse.log_softmax(-1))).sum(-1)
        assert float(kl.max()) < 1e-3  # only the bf16 rounding of the host store differs
        assert torch.equal(dense.argmax(-1), sparse.argmax(-1))


def test_streaming_plan_reads_only_sink_and_window(engine: Engine, essay_tokens: list[int]) -> None:
    cfg = engine.config
    plan = SparsePlan(16, 64, [[GroupPlan(True)] * cfg.n_kv_heads for _ in range(cfg.n_layers)], "all streaming")
    attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
    logits = decode_logits(engine, attn, essay_tokens, 4)
    assert torch.isfinite(logits).all()
    expected = 80 * 4 / sum(range(697, 701))  # tokens read over context tokens, summed over the decode steps
    assert attn.stats()["kv_read_fraction"] == pytest.approx(expected, rel=1e-9)
    assert attn.stats()["streaming_fraction"] == 1.0


def test_fixed_mode_generates_and_abort_returns_host_memory() -> None:
    eng = Engine(MODEL, attention="fixed", max_context=2048)
    base = eng.stats()
    rid = eng.add_request("Tell me a long story about a lighthouse keeper.", SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    text = ""
    for _ in range(6):
        text += "".join(o.new_text for o in eng.step())
    assert text.strip()
    assert eng.stats().kv_bytes_host > base.kv_bytes_host
    assert eng.stats().sparse["kv_read_fraction"] > 0
    eng.abort(rid)
    assert eng.stats().kv_bytes_host == base.kv_bytes_host
    assert [o.finish_reason for o in eng.step()] == ["abort"]


def test_request_larger_than_kv_budget_is_refused() -> None:
    eng = Engine(MODEL, attention="fixed", max_context=2048, kv_budget_bytes=4 * 2**20)
    with pytest.raises(CapacityError, match="KV budget"):
        eng.add_request("word " * 300, SamplingParams(max_tokens=64))


def test_selector_picks_cheapest_feasible_configuration() -> None:
    configs = all_configs()
    n, sink, window, d = 4096, 16, 64, 64
    # group 0: streaming is good enough; group 1: only g=128 b=0.05 and larger budgets are; group 2: nothing is
    labels = {}
    for c in configs:
        labels[(0, 0, c.key)] = (0.001, 0.0)
        ok_1 = not c.streaming and c.g == 128 and c.budget >= 0.05
        labels[(0, 1, c.key)] = (0.01 if ok_1 else 0.5, 0.0)
        labels[(0, 2, c.key)] = (0.3 - (0.0 if c.streaming else c.budget), 0.0)
    plan = select_plan(labels, 1, 3, 0.02, n, sink, window, d)
    assert plan.groups[0][0] == GroupPlan(True)
    assert plan.groups[0][1] == GroupPlan(False, 128, 0.05)
    assert plan.groups[0][2].budget == 0.2  # lowest error when nothing is feasible
    assert select_plan(labels, 1, 3, 0.02, n, sink, window, d).groups == plan.groups  # deterministic
    # cost model: smaller blocks scan more summaries, larger budgets read more KV
    assert bytes_per_step(Config(False, 16, 0.05), n, sink, window, d) > bytes_per_step(Config(False, 64, 0.05), n, sink, window, d)
    assert bytes_per_step(Config(True), n, sink, window, d) < bytes_per_step(Config(False, 128, 0.01), n, sink, window, d)


def test_summary_weight_trades_summary_scans_for_kv_reads() -> None:
    """With summaries counted in full, a 1% budget in 64- or 128-token blocks (a whole block at 4K) beats 1% in
    16-token blocks (48 tokens, but 4-8x the summaries); with summaries free, the selector takes the finer blocks
    that read the least K/V."""
    n, sink, window, d = 4096, 16, 64, 64
    labels = {(0, 0, c.key): (0.01 if (not c.streaming and c.budget == 0.01) else 0.5, 0.0) for c in all_configs()}
    coarse = select_plan(labels, 1, 1, 0.02, n, sink, window, d)
    fine = select_plan(labels, 1, 1, 0.02, n, sink, window, d, summary_weight=0.0)
    assert coarse.groups[0][0].g > 16 and coarse.groups[0][0].budget == 0.01
    assert fine.groups[0][0] == GroupPlan(False, 16, 0.01)


def test_calibration_outputs_match_dense_at_full_budget() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 64, generator=gen)
    keys, values = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen)
    positions = torch.arange(295, 300)
    outs = group_outputs(q, keys, values, positions, [Config(False, 32, 1.0), Config(True)], 16, 64, 0.125)
    full, _ = outs["full"]
    ref = torch.softmax((q @ keys.T * 0.125).masked_fill(torch.arange(300)[None, None, :] > positions[:, None, None], float("-inf")), -1) @ values
    assert torch.allclose(full, ref, atol=1e-5)
    assert torch.allclose(outs["g32_b1"][0], full, atol=1e-5)
    stream, frac = outs["stream"]
    assert not torch.allclose(stream, full, atol=1e-3)
    assert torch.allclose(frac, 80 / (positions + 1).double())


def test_calibration_labels_on_a_real_prompt(engine: Engine, essay_tokens: list[int]) -> None:
    from fluxion_lite.plan.calibration import calibrate_prompt

    configs = [Config(True), Config(False, 16, 0.05), Config(False, 64, 1.0)]
    labels = calibrate_prompt(engine.model, essay_tokens[:400], 8, 16, 64, configs)
    cfg = engine.config
    assert len(labels) == cfg.n_layers * cfg.n_kv_heads * len(configs)
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_kv_heads):
            full_err, full_read = labels[(layer, h, "g64_b1")]
            assert full_err < 1e-5 and full_read == pytest.approx(1.0)  # every block selected = dense
            assert labels[(layer, h, "stream")][1] < 0.25  # sink + window only
    assert max(labels[(layer, h, "stream")][0] for layer in range(cfg.n_layers) for h in range(cfg.n_kv_heads)) > 0.01


def test_calibrate_command_writes_labels_and_a_loadable_plan(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from fluxion_lite.cli import main

    out = Path(str(tmp_path))
    argv = ["calibrate", MODEL, "--samples", "1", "--context", "300", "--positions", "4", "--out-dir", str(out)]
    assert main(argv) == 0
    plan = SparsePlan.load(out / f"{MODEL}.plan.json")
    plan.validate(30, 3)  # smollm2-135m: 30 layers, 3 KV groups
    assert "layer 29" in capsys.readouterr().out
    assert main(argv[:2] + ["--from-labels", "--epsilon", "1.0", "--out-dir", str(out)]) == 0
    assert SparsePlan.load(out / f"{MODEL}.plan.json").streaming_fraction == 1.0  # everything is within a loose bound
    assert main(["calibrate", MODEL, "--context", "100", "--positions", "200"]) == 2
