"""research/ruler_length.py: answers cut to their first N words and re-scored with the task's metric, checked by
hand."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

import ruler_length  # noqa: E402


def test_first_words_keeps_the_text_up_to_the_nth_word() -> None:
    text = " apple, pear, 12, plum-tree. fig"
    assert ruler_length.first_words(text, 1) == " apple"
    assert ruler_length.first_words(text, 3) == " apple, pear, 12, plum"  # numbers are not words
    assert ruler_length.first_words(text, 4) == " apple, pear, 12, plum-tree"
    assert ruler_length.first_words(text, 9) == text
    assert ruler_length.word_count(text) == 5


def test_cut_score_uses_the_tasks_metric() -> None:
    cwe = {"task": "cwe", "output": " a, b, gold, silver", "answers": ["gold", "silver"], "score": 1.0}
    assert ruler_length.cut_score(cwe, None) == 1.0  # as answered: the stored score
    assert ruler_length.cut_score(cwe, 2) == 0.0
    assert ruler_length.cut_score(cwe, 3) == 0.5  # "all": the fraction of references found
    assert ruler_length.cut_score(cwe, 4) == 1.0
    qa = {"task": "qa_1", "output": " Paris or Lyon", "answers": ["Lyon", "Paris"], "score": 1.0}
    assert ruler_length.cut_score(qa, 1) == 1.0  # "any": one reference is enough


def _write(path: Path, mode: str, outputs: dict[tuple[str, int], str], answers: list[str]) -> str:
    records = [{"task": t, "index": i, "output": o, "answers": answers,
                "score": ruler_length.cut_score({"task": t, "output": o, "answers": answers, "score": 0.0}, 10**6)}
               for (t, i), o in outputs.items()]
    path.write_text(json.dumps({"length": 4096, "modes": {mode: {"records": records}}}))
    return f"{path}:{mode}"


def test_cli_separates_length_from_choice(tmp_path: Path) -> None:
    """Both sides list the same first words; the reference keeps listing and finds more references, the candidate
    stops: as answered the candidate loses, cut to the shorter length they tie."""
    answers = ["gold", "silver", "copper", "tin"]
    ref = {("cwe", i): " gold, iron, silver, lead, copper, zinc, tin" for i in range(6)}
    cand = {("cwe", i): " gold, iron, silver." for i in range(6)}
    other = {("vt", i): " x" for i in range(6)}
    out = tmp_path / "len.json"
    cmd = [sys.executable, str(ROOT / "research" / "ruler_length.py"),
           "--reference", _write(tmp_path / "r.json", "full", ref | other, answers),
           "--candidate", _write(tmp_path / "c.json", "fluxion", cand | other, answers),
           "--words", "3", "7", "--resamples", "500", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    cuts = got["per_task"]["cwe"]["cuts"]
    assert cuts["as answered"]["difference"] == pytest.approx(0.5 - 1.0)
    assert cuts["first 3 words"]["reference"] == pytest.approx(0.5) and cuts["first 3 words"]["difference"] == 0.0
    assert cuts["first 7 words"]["difference"] == pytest.approx(-0.5) and cuts["first 7 words"]["worse"] == 6
    assert got["per_task"]["cwe"]["reference_words"] == 7 and got["per_task"]["cwe"]["candidate_words"] == 3
    assert got["per_task"]["cwe"]["candidate_shorter_than_7"] == 1.0
    # two tasks weighted equally; vt is never cut and ties
    assert got["overall"]["as answered"]["difference"] == pytest.approx(np.mean([-0.5, 0.0]))
    assert got["overall"]["first 3 words"]["difference"] == 0.0
    assert "first 3 words" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--cut-tasks", "nope"], "unknown task"),
    (["--words", "0"], "at least 1 word"),
    (["--cut-tasks", "fwe"], "no sample of it in both runs"),
])
def test_cli_bad_input_gets_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    ref = _write(tmp_path / "r.json", "full", {("cwe", 0): " gold"}, ["gold"])
    cand = _write(tmp_path / "c.json", "fluxion", {("cwe", 0): " gold"}, ["gold"])
    cmd = [sys.executable, str(ROOT / "research" / "ruler_length.py"), "--reference", ref, "--candidate", cand, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


def test_cli_rejects_a_sample_in_two_runs_of_one_side(tmp_path: Path) -> None:
    ref = _write(tmp_path / "r.json", "full", {("cwe", 0): " gold"}, ["gold"])
    cand = _write(tmp_path / "c.json", "fluxion", {("cwe", 0): " gold"}, ["gold"])
    cmd = [sys.executable, str(ROOT / "research" / "ruler_length.py"), "--reference", ref, ref, "--candidate", cand]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "is in both" in done.stderr and "Traceback" not in done.stderr
