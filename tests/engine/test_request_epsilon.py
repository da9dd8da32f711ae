"""A request's own epsilon (SamplingParams.epsilon): the selector's plan at that epsilon from the model's calibration
labels runs for that sequence alone, beside sequences on the model's plan, and the output reports it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.errors import RequestError
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.plan.calibration_text import essay_text
from fluxion_lite.plan.sparse_plan import SparsePlan
from fluxion_lite.settings import Settings

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(MODEL, max_context=2048, attention="fluxion", dtype="float32")


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(essay_text(), add_special=True)[:1200]


def _run(engine: Engine, prompt: list[int], epsilons: list[float | None]) -> list[tuple[list[int], object]]:
    rids = [engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, epsilon=e)) for e in epsilons]
    toks: dict[str, list[int]] = {r: [] for r in rids}
    last: dict[str, object] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    return [(toks[r], last[r]) for r in rids]


def test_a_smaller_epsilon_reads_more_and_is_reported(engine: Engine, prompt: list[int]) -> None:
    reads = []
    for eps in (0.01, 0.1, 1.0):
        (_, out), = _run(engine, prompt, [eps])
        assert out.attention == "fluxion" and out.epsilon == eps  # type: ignore[attr-defined]
        reads.append(out.kv_read_fraction)  # type: ignore[attr-defined]
    assert 0 < reads[2] < reads[1] < reads[0] <= 1
    (_, out), = _run(engine, prompt, [None])
    assert out.epsilon is None and 0 < out.kv_read_fraction < 1  # type: ignore[attr-defined]


def test_a_requests_plan_equals_that_plan_run_for_everyone(engine: Engine, prompt: list[int]) -> None:
    """The per-row plan path gives the tokens of an engine whose static plan is the epsilon plan; a request without
    epsilon in the same batch keeps the model's plan (its tokens as when it runs alone in a batch of two)."""
    eps = 0.03
    (own, _), = _run(engine, prompt, [eps])
    plan = engine._epsilon_plans[eps]
    static = Engine(MODEL, max_context=2048, attention="fluxion", dtype="float32")
    static.set_attention("fluxion", plan)
    (same, _), = _run(static, prompt, [None])
    assert own == same
    assert isinstance(plan, SparsePlan) and plan.source.startswith(f"epsilon={eps:g}")
    mixed = _run(engine, prompt, [eps, None])
    plain = _run(engine, prompt, [None, None])
    assert mixed[1][0] == plain[1][0] and mixed[1][1].epsilon is None  # type: ignore[attr-defined]


def test_epsilon_errors_say_why(tmp_path: Path) -> None:
    full = Engine(MODEL, max_context=512, attention="full", load_tokenizer=False)
    with pytest.raises(RequestError, match="mode 'full' is exact"):
        full.add_request([1, 2, 3], SamplingParams(epsilon=0.1))
    with pytest.raises(RequestError, match="epsilon"):
        full.add_request([1, 2, 3], SamplingParams(epsilon=0.0))
    # a model whose plan is the user's own, with no calibration labels to choose from
    path = tmp_path / "handmade.gguf"
    shutil.copyfile(resolve_model(MODEL, pull_missing=False), path)
    cache = tmp_path / "cache"
    settings = Settings.load({"FLUXION_CACHE_DIR": str(cache)})
    from fluxion_lite.plan import files as plan_files

    user = plan_files.user_dir(settings)
    user.mkdir(parents=True, exist_ok=True)
    SparsePlan.load(plan_files.shipped_dir() / f"{MODEL}.plan.json").save(user / "handmade.plan.json")
    own = Engine(str(path), max_context=512, attention="fluxion", load_tokenizer=False, settings=settings)
    assert own.plan_origin is not None and own.plan_origin.startswith("your plan")
    with pytest.raises(RequestError, match="no calibration labels"):
        own.add_request([1, 2, 3], SamplingParams(epsilon=0.1))
