"""`fluxion` on a GGUF file that has no plan (plan/auto_plan.py): the real smollm2-135m under a name no catalog or
shipped plan knows, in a fresh user cache. The first engine calibrates on the loaded model and keeps the plan with a
stamp of the file; the next one reuses it without calibrating; a touched but unchanged file is recognised by its
sha256; a changed file is calibrated again, never reused; and the error paths say why."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.errors import RequestError
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.plan import auto_plan
from fluxion_lite.plan.auto_plan import choose_plan, plan_key, stamp_matches
from fluxion_lite.settings import Settings
from tiny_model import make_cfg


@pytest.fixture()
def own_model(tmp_path: Path) -> tuple[Path, Settings]:
    """A copy of smollm2-135m named like a user's own file, and settings whose user cache is empty."""
    src = resolve_model("smollm2-135m", pull_missing=False)
    path = tmp_path / "my-own-model.gguf"
    shutil.copyfile(src, path)
    cache = tmp_path / "cache"
    cache.mkdir()
    return path, Settings.load({"FLUXION_CACHE_DIR": str(cache)})


def _engine(path: Path, settings: Settings) -> Engine:
    return Engine(str(path), attention="fluxion", max_context=4096, settings=settings)


def _greedy(engine: Engine) -> list[int]:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=6))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


@pytest.mark.slow
def test_a_model_without_a_plan_is_calibrated_once_and_reused_for_the_same_file(own_model, capsys) -> None:  # type: ignore[no-untyped-def]
    path, settings = own_model
    cache = Path(settings.cache_dir)
    first = _engine(path, settings)
    assert first.plan_origin is not None and first.plan_origin.startswith("calibrated now"), first.plan_origin
    err = capsys.readouterr().err
    assert "fluxion: no plan for my-own-model: calibrating one on 3 prompts" in err and "3/3" in err
    stamp = json.loads((cache / "my-own-model.plan.stamp.json").read_text())
    assert stamp["size"] == path.stat().st_size and len(stamp["sha256"]) == 64
    assert (cache / "my-own-model.plan.json").is_file() and (cache / "my-own-model.calib.json").is_file()
    assert "plan: calibrated now for this file" in first.explain()
    tokens = _greedy(first)
    assert len(tokens) == 6
    read = first.attn.stats()["kv_read_fraction"]  # type: ignore[attr-defined]
    assert 0.0 < read < 1.0
    del first

    again = _engine(path, settings)  # the same file: the plan is reused, nothing is calibrated
    assert again.plan_origin is not None and again.plan_origin.startswith("calibrated for this file")
    assert "calibrating" not in capsys.readouterr().err
    assert _greedy(again) == tokens
    del again

    os.utime(path)  # touched, same bytes: the sha256 says it is the same file
    touched = _engine(path, settings)
    assert touched.plan_origin is not None and touched.plan_origin.startswith("calibrated for this file")
    assert "calibrating" not in capsys.readouterr().err
    del touched

    with open(path, "r+b") as f:  # one byte of tensor data changed: another file
        f.seek(path.stat().st_size - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    changed = _engine(path, settings)
    assert changed.plan_origin is not None and changed.plan_origin.startswith("calibrated now")
    assert "is not the file the plan" in capsys.readouterr().err
    new_stamp = json.loads((cache / "my-own-model.plan.stamp.json").read_text())
    assert new_stamp["sha256"] != stamp["sha256"]


def test_plan_keys_and_stamps(tmp_path: Path) -> None:
    assert plan_key("my-model.gguf") == plan_key("my-model") == "my-model"
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc" * 1000)
    stamp = auto_plan.make_stamp(f)
    assert stamp_matches(stamp, f)
    os.utime(f, ns=(1, 1))
    assert stamp_matches(stamp, f)  # another time, same bytes: the sha256 decides
    f.write_bytes(b"abd" * 1000)
    assert not stamp_matches(stamp, f)
    f.write_bytes(b"abc" * 1001)
    assert not stamp_matches(stamp, f)  # another size: no need to read it


def test_a_context_too_short_to_calibrate_is_a_clear_error(tmp_path: Path) -> None:
    cfg = replace(make_cfg("llama"), context_length=128)
    f = tmp_path / "short.gguf"
    f.write_bytes(b"x" * 100)

    def never(*_: int) -> tuple[dict, dict]:
        raise AssertionError("must not calibrate")

    settings = Settings.load({"FLUXION_CACHE_DIR": str(tmp_path / "cache")})
    with pytest.raises(ValueError, match="short.gguf: a context of 128 tokens is too short to calibrate"):
        choose_plan("short.gguf", f, cfg, never, settings, log=lambda _: None)


def test_an_engine_without_its_tokenizer_says_why_it_cannot_calibrate(own_model) -> None:  # type: ignore[no-untyped-def]
    path, settings = own_model
    with pytest.raises(RequestError, match="no fluxion plan, and calibrating one needs the tokenizer"):
        Engine(str(path), attention="fluxion", load_tokenizer=False, settings=settings)
