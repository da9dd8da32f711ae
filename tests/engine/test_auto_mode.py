"""Attention mode auto (sparse/auto_mode.py): each request dense or fluxion by its prompt length, in one batch."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.errors import RequestError
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.model.attention import DenseAttention
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.plan.calibration_text import essay_text
from fluxion_lite.plan.sparse_plan import SparsePlan
from fluxion_lite.settings import Settings
from fluxion_lite.sparse.auto_mode import DENSE_TOKENS, AutoAttention, dense_tokens_for
from fluxion_lite.sparse.backend import SparseAttention

MODEL = "smollm2-135m"
DENSE = 200  # the crossover these tests set (FLUXION_AUTO_DENSE_TOKENS), so that short prompts stay cheap


def _engine(**kw: object) -> Engine:
    kw.setdefault("settings", Settings.load(auto_dense_tokens=DENSE))
    return Engine(MODEL, max_context=2048, dtype="float32", **kw)  # type: ignore[arg-type]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    rids = [engine.add_request(list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[r] for r in rids]


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    engine = _engine()
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(essay_text(), add_special=True)
    return ids[:150], ids[:700]  # one under the crossover, one over


def test_auto_is_the_default_and_routes_by_prompt_length(prompts: tuple[list[int], list[int]]) -> None:
    engine = _engine()
    assert engine.attention_mode == "auto" and engine.auto_dense_tokens == DENSE
    attn = engine.attn
    assert isinstance(attn, AutoAttention) and isinstance(attn.sparse, SparseAttention)  # smollm2 ships a plan
    short, long_ = prompts
    engine.add_request(short, SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request(long_, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    assert attn.sides() == (1, 1)
    assert engine.stats().sparse["dense_sequences"] == 1.0
    text = engine.explain()
    assert f"up to {DENSE} tokens run dense" in text and "sparse plan" in text


def test_a_mixed_batch_equals_each_mode_alone(prompts: tuple[list[int], list[int]]) -> None:
    """Short and long prompts in one batch: the short one's tokens are `full` mode's, the long one's `fluxion`'s."""
    short, long_ = prompts
    both = _run(_engine(), [short, long_])
    full = _run(Engine(MODEL, max_context=2048, dtype="float32", attention="full"), [short])
    fluxion = _run(Engine(MODEL, max_context=2048, dtype="float32", attention="fluxion"), [long_])
    assert both == [full[0], fluxion[0]]


def test_dense_sequences_keep_the_prefix_cache(prompts: tuple[list[int], list[int]]) -> None:
    short, long_ = prompts
    engine = _engine()
    first = engine.tokenizer.encode("The capital of France is", add_special=True)  # type: ignore[union-attr]
    _run(engine, [first], max_tokens=3)
    rid = engine.add_request(first + [13], SamplingParams(max_tokens=2, temperature=0.0))
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                cached = o.cached_tokens
    assert cached == len(first)  # the next turn adopted the dense KV
    _run(engine, [long_], max_tokens=2)  # a fluxion sequence is freed when it ends (the host store cannot truncate)
    assert engine.attn.sides()[1] == 0  # type: ignore[attr-defined]
    # a long prompt never adopts a dense sequence's KV, even when it extends it
    rid = engine.add_request(first + long_, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                assert o.cached_tokens == 0


def test_no_fluxion_side_when_no_prompt_can_reach_it() -> None:
    engine = Engine(MODEL, max_context=256, dtype="float32", settings=Settings.load(auto_dense_tokens=512))
    assert isinstance(engine.attn, AutoAttention) and engine.attn.sparse is None
    assert "calibrated at the first prompt" in engine.explain()


def test_the_fluxion_side_is_built_at_the_first_long_prompt() -> None:
    """A model without a plan must not calibrate before a prompt needs fluxion (plan/auto_plan.py calibrates)."""
    cfg = ModelConfig(arch="llama", n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=32, context_length=4096, rms_eps=1e-6, rope_theta=10000.0, rope_dim=16,
                      rope_style="interleaved")
    built: list[SparseAttention] = []

    def make() -> SparseAttention:
        plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.5, sink=16, window=64)
        built.append(SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4))
        return built[-1]

    auto = AutoAttention(DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32,
                                        torch.device("cpu")), make, dense_tokens=100)
    auto.allocate(0, prompt_tokens=100)
    assert not built and auto.sparse is None
    auto.allocate(1, prompt_tokens=101)
    assert len(built) == 1 and auto.sparse is built[0]
    auto.allocate(2, prompt_tokens=5000)
    assert len(built) == 1 and auto.sides() == (1, 2)
    assert auto.can_reuse(0, 50) and not auto.can_reuse(0, 101) and not auto.can_reuse(1, 50)
    with pytest.raises(ValueError, match="already has a KV cache"):
        auto.allocate(0, 10)
    for seq in range(3):
        auto.free(seq)
    assert auto.sides() == (0, 0)


def test_the_crossover_comes_from_the_setting_else_the_device_kind() -> None:
    assert dense_tokens_for(torch.device("cpu"), None) == DENSE_TOKENS["cpu"]
    assert dense_tokens_for(torch.device("cpu"), 0) == 0
    assert dense_tokens_for(torch.device("cuda"), None) == DENSE_TOKENS["cuda"]


def test_a_first_long_prompt_that_cannot_build_fluxion_is_that_requests_error(tmp_path: Path) -> None:
    """A model with no plan, loaded without its tokenizer: the first long prompt needs a calibration, which needs the
    tokenizer. add_request says so (no request is left half-admitted inside step), and short prompts still run."""
    path = tmp_path / "no-plan-model.gguf"
    shutil.copyfile(resolve_model(MODEL, pull_missing=False), path)
    settings = Settings.load({"FLUXION_CACHE_DIR": str(tmp_path / "cache")}, auto_dense_tokens=DENSE)
    engine = Engine(str(path), max_context=2048, dtype="float32", load_tokenizer=False, settings=settings)
    assert isinstance(engine.attn, AutoAttention) and engine.attn.sparse is None
    with pytest.raises(RequestError, match="needs the tokenizer"):
        engine.add_request(list(range(100, 100 + DENSE + 1)), SamplingParams(max_tokens=2, temperature=0.0))
    assert not engine.has_unfinished()
    assert len(_run(engine, [list(range(100, 150))], max_tokens=2)[0]) == 2
