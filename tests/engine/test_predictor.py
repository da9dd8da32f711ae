"""Head-property predictor: features, training, selector, the per-request plan hook, and the shipped weights."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.plan.space import all_configs
from fluxion_lite.plan.calibration import capture_prompt
from fluxion_lite.model.gguf_loader import load_gguf
from fluxion_lite.plan.head_features import FEATURE_NAMES, FEATURE_QUERIES, N_FEATURES, layer_features
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.plan.selector import select_plan
from fluxion_lite.plan.predictor import (N_INPUTS, Predictor, config_costs, loo_prior, param_count, select_groups,
                                    split_prompts, train)
from fluxion_lite.plan.request_plan import RequestPlanner
from fluxion_lite.sparse.cost_model import Costs
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import SparsePlan
from gguf_fixtures import TinySpec, write_tiny_model

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
CATALOG = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
C = len(all_configs())
F = N_FEATURES
SPEC = TinySpec("llama", n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48, vocab=64, n_layers=2, context_length=1024)


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features whose first column decides the streaming label and scales every config's error (a learnable rule);
    the prior is the rule's average (what a static calibration would know), so the features must do the work."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, F)).astype(np.float32)
    scale = np.exp(x[:, :1] - 2.0)  # streaming error e^(x0 - 2): <= 0.1 iff x0 <= ~-0.3
    decay = np.linspace(1.0, 0.05, C)[None, :]
    prior = np.broadcast_to(np.exp(-2.0 + 0.5) * decay, (n, C)).astype(np.float32)
    return x, (scale * decay).astype(np.float32), prior


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    path = tmp_path_factory.mktemp("pred") / "tiny.gguf"
    write_tiny_model(path, SPEC, seed=3)
    return Transformer(load_gguf(path, torch.float32), "cpu", torch.float32)


def test_parameter_count_is_exact_and_about_a_tenth_of_a_million() -> None:
    assert N_INPUTS == F + C == 40
    assert param_count() == (N_INPUTS * 288 + 288) + (288 * 288 + 288) + (288 * (1 + C) + 1 + C) == 101_398
    pred = train(*synthetic(64, 0), epsilon=0.1, epochs=2)
    assert pred.n_params == 101_398
    assert pred.weights["w1"].shape == (N_INPUTS, 288) and pred.weights["w3"].shape == (288, 1 + C)


def test_training_is_deterministic_for_a_seed_and_learns_the_rule() -> None:
    data = synthetic(600, 0)
    a = train(*data, epsilon=0.1, seed=5, epochs=150)
    b = train(*data, epsilon=0.1, seed=5, epochs=150)
    c = train(*data, epsilon=0.1, seed=6, epochs=150)
    for k in a.weights:
        assert np.array_equal(a.weights[k], b.weights[k]), k
    assert not np.array_equal(a.weights["w1"], c.weights["w1"])
    xt, et, pt = synthetic(300, 1)  # held out
    p, err = a.forward(xt, pt)
    assert ((p >= 0.5) == (et[:, 0] <= 0.1)).mean() > 0.9
    assert np.abs(np.log10(err + 1e-4) - np.log10(et + 1e-4)).mean() < 0.25


def test_save_load_round_trip_without_pickles(tmp_path: Path) -> None:
    x, e, pr = synthetic(64, 0)
    pred = train(x, e, pr, epsilon=0.07, epochs=3, prior_table=np.full((2, 2, C), 0.03), meta={"model": "t"})
    pred.save(tmp_path / "p.npz")
    back = Predictor.load(tmp_path / "p.npz")  # np.load(allow_pickle=False) inside
    assert back.epsilon == 0.07 and back.meta["model"] == "t"
    np.testing.assert_array_equal(back.forward(x, pr)[1], pred.forward(x, pr)[1])
    np.testing.assert_array_equal(back.predict_layer(x[:2], 1)[1], pred.forward(x[:2], np.full((2, C), 0.03))[1])


def test_leave_one_out_prior_excludes_the_prompt_itself() -> None:
    errors = np.arange(12, dtype=np.float64).reshape(3, 2, 2)  # [P, ...]
    prior = loo_prior(errors)
    np.testing.assert_allclose(prior[0], (errors[1] + errors[2]) / 2)
    np.testing.assert_allclose(prior[2], (errors[0] + errors[1]) / 2)


def test_split_is_by_prompt_and_holds_out_one_of_each_kind() -> None:
    tr, te = split_prompts(25, 5)
    assert list(te) == [20, 21, 22, 23, 24] and set(tr).isdisjoint(te) and len(tr) == 20


def test_features_on_a_tiny_random_model(tiny_model: Transformer) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SPEC.vocab, 300).tolist()
    cap = capture_prompt(tiny_model, tokens, FEATURE_QUERIES)
    for layer in range(SPEC.n_layers):
        q = torch.cat(cap.q[layer]).view(FEATURE_QUERIES, 2, 2, 16)
        keys, values = cap.kv[layer]
        f = layer_features(q, keys, values, tiny_model.layers[layer].wo, layer, SPEC.n_layers, 16, 64)
        assert f.shape == (2, F) and torch.isfinite(f).all()
        col = {n: f[:, i] for i, n in enumerate(FEATURE_NAMES)}
        assert ((col["mass_sink"] >= 0) & (col["mass_sink"] + col["mass_window"] <= 1 + 1e-5)).all()
        assert torch.allclose(col["contribution"].sum(), torch.tensor(1.0), atol=1e-5)  # shares over the groups
        for n in FEATURE_NAMES:
            if n.startswith("recall"):
                assert ((col[n] >= 0) & (col[n] <= 1)).all()
        assert torch.allclose(col["layer_frac"], torch.tensor(float(layer)))
        assert math.isclose(float(col["log_context"][0]), math.log(300) / math.log(32768), rel_tol=1e-6)


def test_features_see_a_sink_head_and_a_retrieval_head() -> None:
    """Group 0 attends to token 0 (a sink: streaming suffices); group 1 to one mid-context token (needs retrieval)."""
    n, d = 512, 16
    gen = torch.Generator().manual_seed(0)
    keys = 0.1 * torch.randn(2, n, d, generator=gen)
    values = torch.randn(2, n, d, generator=gen)
    keys[0, 0] = keys[1, 300] = torch.full((d,), 3.0)
    q = torch.full((FEATURE_QUERIES, 2, 1, d), 3.0)
    wo = torch.eye(2 * d)
    f = layer_features(q, keys, values, wo, 0, 4, 16, 64)
    col = {name: f[:, i] for i, name in enumerate(FEATURE_NAMES)}
    assert col["mass_sink"][0] > 0.99 and col["mass_sink"][1] < 0.01
    assert col["log_dev_stream"][0] < math.log(0.01) < math.log(0.5) < col["log_dev_stream"][1]
    assert col["recall_g16_b0.02"][1] > 0.99  # the Quest bound finds the block holding token 300


def test_selector_picks_the_cheapest_feasible_config() -> None:
    n, sink, window, hd, eps = 4096, 16, 64, 64, 0.1
    costs = config_costs(n, sink, window, hd)
    rng = np.random.default_rng(0)
    err = rng.uniform(0.0, 0.3, (40, C))
    err[3] = 0.5  # nothing feasible: lowest error wins
    err[3, 7] = 0.2
    p = (err[:, 0] <= eps).astype(float)  # a classifier that agrees with the stream error
    s, g, b = select_groups(p, err, costs, eps)
    configs = all_configs()
    for i in range(40):
        if p[i] >= 0.5:
            assert s[i]
            continue
        feas = [j for j in range(1, C) if err[i, j] <= eps]
        j = min(feas, key=lambda j: (costs[j], err[i, j])) if feas else min(range(1, C), key=lambda j: err[i, j])
        assert (s[i], g[i], b[i]) == (False, configs[j].g, configs[j].budget)
    assert (g[3], b[3]) == (configs[7].g, configs[7].budget)
    # the same decisions as the static selector makes from labels equal to the predictions
    labels = {(0, i, c.key): (float(err[i, j]), 0.0) for i in range(40) for j, c in enumerate(configs)}
    plan = select_plan(labels, 1, 40, eps, n, sink, window, hd)
    assert [(gp.streaming, gp.g if not gp.streaming else 16, gp.budget) for gp in plan.groups[0]] == \
        [(bool(s[i]), int(g[i]), float(b[i])) for i in range(40)]


def _planner_backend(model: Transformer, pred: Predictor) -> SparseAttention:
    cfg = model.cfg
    static = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.05, sink=16, window=64)
    attn = SparseAttention(cfg, static, torch.float32, torch.device("cpu"), max_seqs=4,
                           costs=Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None))
    attn.planner = RequestPlanner(pred, static, cfg, [lw.wo for lw in model.layers])
    return attn


def _run(model: Transformer, attn: SparseAttention, tokens: list[int], n_decode: int) -> torch.Tensor:
    attn.allocate(0)
    n_prefix = len(tokens) - n_decode
    for s in range(0, n_prefix, 128):
        n = min(128, n_prefix - s)
        model.forward(torch.tensor(tokens[s : s + n]), torch.arange(s, s + n), [SeqChunk(0, s, n)], attn)
    rows = [model.forward(torch.tensor([tokens[p]]), torch.tensor([p]), [SeqChunk(0, p, 1)], attn)[0]
            for p in range(n_prefix, len(tokens))]
    return torch.stack(rows)


def test_per_request_plan_matches_offline_features_and_is_deterministic(tiny_model: Transformer) -> None:
    cfg = tiny_model.cfg
    x, e, pr = synthetic(400, 2)
    pred = train(x, e, pr, epsilon=0.1, epochs=30, prior_table=np.full((2, 2, C), 0.05), meta={"sink": 16, "window": 64})
    tokens = np.random.default_rng(1).integers(0, SPEC.vocab, 404).tolist()
    plans, logits = [], []
    for _ in range(2):
        attn = _planner_backend(tiny_model, pred)
        logits.append(_run(tiny_model, attn, tokens, 4))
        assert attn.planner is not None and attn.planner.layer_calls == cfg.n_layers  # once per layer, at prefill end
        plan = attn.planner.plan_of(0)
        assert plan is not None
        plans.append(plan.groups)
        attn.free(0)
        assert attn.planner.plan_of(0) is None  # forgotten with the sequence
    assert plans[0] == plans[1] and torch.equal(logits[0], logits[1])
    # offline: the same features from a dense capture of the 400-token prompt give the same plan
    cap = capture_prompt(tiny_model, tokens[:400], FEATURE_QUERIES)
    costs = config_costs(400, 16, 64, cfg.head_dim)
    for layer in range(cfg.n_layers):
        keys, values = cap.kv[layer]
        q = torch.cat(cap.q[layer]).view(FEATURE_QUERIES, cfg.n_kv_heads, 2, cfg.head_dim)
        f = layer_features(q, keys, values, tiny_model.layers[layer].wo, layer, cfg.n_layers, 16, 64).numpy()
        s, g, b = select_groups(*pred.predict_layer(f, layer), costs, pred.epsilon)
        got = plans[0][layer]
        assert [gp.streaming for gp in got] == s.tolist()
        assert [gp.g for gp in got] == [16 if s[h] else int(g[h]) for h in range(cfg.n_kv_heads)]


def test_per_request_plan_changes_what_decode_reads(tiny_model: Transformer) -> None:
    """A predictor that calls every group streaming must make decode read only sink + window."""
    pred = train(*synthetic(200, 3), epsilon=0.1, epochs=2, prior_table=np.full((2, 2, C), 0.05))
    pred.weights["w3"][:, 0] = 0.0
    pred.weights["b3"][0] = 50.0  # P(streaming) = 1 everywhere
    attn = _planner_backend(tiny_model, pred)
    _run(tiny_model, attn, np.random.default_rng(2).integers(0, SPEC.vocab, 404).tolist(), 4)
    assert attn.planner is not None and attn.planner.plan_of(0).streaming_fraction == 1.0  # type: ignore[union-attr]
    assert attn.stats()["streaming_fraction"] == 1.0  # what decode did, not the static plan's share
    # the static plan would have read 5% blocks on top: streaming-only reads sink + window (+ the new tokens)
    assert attn.stats()["kv_read_fraction"] < (16 + 64 + 1) / 400 + 1e-3


@pytest.mark.parametrize("model", CATALOG)
def test_shipped_predictor_and_card(model: str) -> None:
    path = MODELS_DIR / f"{model}.predictor.npz"
    assert path.stat().st_size < 1_000_000
    pred = Predictor.load(path)
    assert pred.n_params == param_count()
    assert pred.weights["prior"].shape == (pred.meta["n_layers"], pred.meta["n_groups"], C)
    ho = pred.meta["heldout"]
    assert isinstance(ho, dict) and 0.0 <= ho["accuracy"] <= 1.0 and ho["heldout_groups"] > 0
    card = (MODELS_DIR / f"{model}.predictor.md").read_text()
    assert f"{pred.n_params:,} parameters" in card and "Held-out" in card


@pytest.mark.slow
def test_calibrate_train_command_writes_predictor_and_card(tmp_path: Path) -> None:
    from fluxion_lite.cli import main

    argv = ["calibrate", "smollm2-135m", "--train", "--samples", "2", "--context", "400", "--positions", "8",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    pred = Predictor.load(tmp_path / "smollm2-135m.predictor.npz")
    assert pred.meta["n_layers"] == 30 and pred.meta["train_prompts"] == 1
    assert "Held-out" in (tmp_path / "smollm2-135m.predictor.md").read_text()
    assert main(argv + ["--from-labels"]) == 0  # retrain from the saved data
    assert np.array_equal(Predictor.load(tmp_path / "smollm2-135m.predictor.npz").weights["w1"], pred.weights["w1"])


@pytest.mark.slow
def test_engine_uses_the_shipped_predictor_per_request() -> None:
    from fluxion_lite.engine.engine import Engine
    from fluxion_lite.offline.eval_text import essay_text
    from fluxion_lite.engine.sampling import SamplingParams

    engine = Engine("smollm2-135m", attention="fluxion", max_context=2048, prefix_cache_entries=0, predictor=True)
    assert "per-request plans: predictor" in engine.explain()
    attn = engine.attn
    assert isinstance(attn, SparseAttention) and attn.planner is not None
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(essay_text()[:6000])[:700]
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert attn.planner.layer_calls == engine.config.n_layers  # one prediction per layer, after the prefill
    assert "sparse plan (predictor, sequence" in engine.explain()  # the last request's own plan is shown
