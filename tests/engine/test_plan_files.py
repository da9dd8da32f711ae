"""Plans are user data: calibrate writes into the user cache, and the engine prefers a plan there to the shipped one."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fluxion_lite.cli import main
from fluxion_lite.engine.engine import Engine
from fluxion_lite.hub.catalog import cache_dir, get_model, local_path
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.plan.auto_plan import stamp_matches
from fluxion_lite.plan import files as plan_files
from fluxion_lite.plan.sparse_plan import SparsePlan

MODEL = "smollm2-135m"


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh user cache holding the (already pulled) model file and its verification stamp, as links."""
    model = get_model(MODEL)
    src = local_path(model)
    monkeypatch.setenv("FLUXION_CACHE_DIR", str(tmp_path))
    for f in (src, src.with_name(src.name + ".verified")):
        os.symlink(f, tmp_path / f.name)
    assert cache_dir() == tmp_path
    return tmp_path


def test_calibrate_writes_into_the_user_cache_not_the_package(user_cache: Path) -> None:
    shipped = plan_files.shipped_dir() / f"{MODEL}.plan.json"
    before = shipped.read_bytes()
    # --from-labels re-selects from the shipped labels (no model run), and writes where no --out-dir is given
    assert main(["calibrate", MODEL, "--from-labels", "--epsilon", "1.0"]) == 0
    written = user_cache / f"{MODEL}.plan.json"
    assert written.is_file()
    assert shipped.read_bytes() == before  # the installed package is untouched
    assert SparsePlan.load(written).streaming_fraction == 1.0
    assert plan_files.find(MODEL, ".plan.json") == written
    # stamped for the model file, so the engine uses it for this file only (plan/auto_plan.py)
    stamp = json.loads((user_cache / f"{MODEL}.plan.stamp.json").read_text())
    assert stamp_matches(stamp, resolve_model(MODEL, pull_missing=False))


def test_engine_prefers_the_user_plan_to_the_shipped_one(user_cache: Path) -> None:
    mine = SparsePlan.uniform(30, 3, g=32, budget=0.07, sink=16, window=64)  # smollm2-135m: 30 layers, 3 groups
    mine = SparsePlan(mine.sink, mine.window, mine.groups, source="the user's own plan")
    mine.save(user_cache / f"{MODEL}.plan.json")
    engine = Engine(MODEL, attention="fluxion", load_tokenizer=False)
    assert "the user's own plan" in engine.explain()
    (user_cache / f"{MODEL}.plan.json").unlink()
    engine.set_attention("fluxion")  # falls back to the shipped plan
    assert "the user's own plan" not in engine.explain()
    assert plan_files.find(MODEL, ".plan.json") == plan_files.shipped_dir() / f"{MODEL}.plan.json"
