"""research/ruler_overlap.py: in how many of several candidate runs each RULER sample scored worse / better than a
reference, checked against counts done by hand and against a brute-force recount on random scores."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

import ruler_overlap  # noqa: E402


def test_overlap_counts_by_hand() -> None:
    ref = {("a", 0): 1.0, ("a", 1): 1.0, ("a", 2): 0.0, ("b", 0): 0.5, ("b", 1): 1.0}
    c1 = {("a", 0): 0.0, ("a", 1): 1.0, ("a", 2): 1.0, ("b", 0): 0.0, ("b", 1): 1.0}
    c2 = {("a", 0): 0.0, ("a", 1): 0.0, ("a", 2): 1.0, ("b", 0): 1.0, ("b", 1): 1.0, ("c", 0): 1.0}
    got = ruler_overlap.overlap(ref, [c1, c2])
    assert got["samples"] == 5  # ("c", 0) is not in the reference, so it is left out
    # worse by 0 / 1 / 2 candidates: (b,1) none; (a,1) and (b,0) one; (a,0) both; (a,2) none
    assert got["lost_by"] == [2, 2, 1]
    assert got["won_by"] == [3, 1, 1]  # (a,2) better in both, (b,0) in c2 only
    assert got["lost_by_all"] == [["a", 0]] and got["won_by_all"] == [["a", 2]]
    assert got["tasks"]["a"]["lost_by"] == [1, 1, 1] and got["tasks"]["b"]["lost_by"] == [1, 1, 0]


def test_overlap_matches_a_brute_force_recount() -> None:
    rng = np.random.default_rng(5)
    keys = [(t, i) for t in ("vt", "cwe", "qa_1") for i in range(20)]
    ref = {k: float(rng.choice([0.0, 0.5, 1.0])) for k in keys}
    cands = [{k: float(rng.choice([0.0, 0.5, 1.0])) for k in keys} for _ in range(4)]
    got = ruler_overlap.overlap(ref, cands)
    for k_worse in range(5):
        expect = sum(sum(c[k] < ref[k] for c in cands) == k_worse for k in keys)
        assert got["lost_by"][k_worse] == expect
    assert sum(got["lost_by"]) == sum(got["won_by"]) == len(keys)
    for task, t in got["tasks"].items():
        assert sum(t["lost_by"]) == t["samples"] == 20
    assert sum(t["lost_by"][4] for t in got["tasks"].values()) == len(got["lost_by_all"])


def _scored(path: Path, mode: str, scores: dict[tuple[str, int], float], length: int = 32768) -> str:
    records = [{"task": t, "index": i, "score": s} for (t, i), s in scores.items()]
    path.write_text(json.dumps({"length": length, "modes": {mode: {"mean_accuracy": 0.0, "records": records}}}))
    return f"{path}:{mode}"


def test_cli_writes_the_overlap(tmp_path: Path) -> None:
    ref = _scored(tmp_path / "r.json", "full", {("vt", 0): 1.0, ("vt", 1): 1.0, ("cwe", 0): 0.2})
    c1 = _scored(tmp_path / "c1.json", "fluxion", {("vt", 0): 0.0, ("vt", 1): 1.0, ("cwe", 0): 0.4})
    c2 = _scored(tmp_path / "c2.json", "fluxion@x.plan", {("vt", 0): 0.0, ("vt", 1): 0.0, ("cwe", 0): 0.4})
    out = tmp_path / "overlap.json"
    cmd = [sys.executable, str(ROOT / "research" / "ruler_overlap.py"), "--reference", ref, "--candidate", c1, c2,
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["lost_by_all"] == [["vt", 0]] and got["won_by_all"] == [["cwe", 0]] and got["length"] == 32768
    assert "worse in all 2: 1 samples (vt 1)" in done.stdout


def test_cli_rejects_runs_at_another_length(tmp_path: Path) -> None:
    ref = _scored(tmp_path / "r.json", "full", {("vt", 0): 1.0})
    cand = _scored(tmp_path / "c.json", "fluxion", {("vt", 0): 0.0}, length=16384)
    cmd = [sys.executable, str(ROOT / "research" / "ruler_overlap.py"), "--reference", ref, "--candidate", cand]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "length 16384" in done.stderr and "Traceback" not in done.stderr


def test_cli_without_common_samples_is_an_error(tmp_path: Path) -> None:
    ref = _scored(tmp_path / "r.json", "full", {("vt", 0): 1.0})
    cand = _scored(tmp_path / "c.json", "fluxion", {("vt", 1): 0.0})
    cmd = [sys.executable, str(ROOT / "research" / "ruler_overlap.py"), "--reference", ref, "--candidate", cand]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no (task, index) sample" in done.stderr
