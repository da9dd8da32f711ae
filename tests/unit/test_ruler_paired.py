"""bench/ruler_paired.py: paired differences of two scored RULER runs, their bootstrap interval and sign test,
checked against hand computations and float64 references."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ruler_paired  # noqa: E402


def _binomial_two_sided(better: int, worse: int) -> float:
    """Reference: twice the lower tail of Binomial(n, 1/2) at min(better, worse), in float64 term by term."""
    n, k = better + worse, min(better, worse)
    tail = 0.0
    for i in range(k + 1):
        tail += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2.0))
    return min(1.0, 2.0 * tail)


@pytest.mark.parametrize("better,worse", [(10, 25), (25, 10), (0, 7), (3, 3), (1, 0), (40, 55), (11, 32)])
def test_sign_test_matches_the_binomial_tail(better: int, worse: int) -> None:
    assert ruler_paired.sign_test(better, worse) == pytest.approx(_binomial_two_sided(better, worse), rel=1e-9)


def test_sign_test_without_differences_is_one() -> None:
    assert ruler_paired.sign_test(0, 0) == 1.0


def test_difference_weighs_tasks_equally_not_samples() -> None:
    diffs = {"a": np.array([1.0, 1.0, 1.0, 1.0]), "b": np.array([0.0, -1.0])}
    # task means 1.0 and -0.5 -> 0.25; pooled over the 6 samples it would be 3/6 = 0.5
    assert ruler_paired.task_mean_difference(diffs) == pytest.approx(0.25)


def test_bootstrap_interval_of_a_constant_shift_is_that_shift() -> None:
    diffs = {"a": np.full(20, 0.5), "b": np.full(13, 0.5)}
    lo, hi = ruler_paired.bootstrap_interval(diffs, resamples=500, seed=3)
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_more_samples() -> None:
    rng = np.random.default_rng(7)
    small = {t: rng.choice([-1.0, 0.0, 0.0, 1.0, 0.5], size=20) for t in "abcde"}
    large = {t: rng.choice([-1.0, 0.0, 0.0, 1.0, 0.5], size=400) for t in "abcde"}
    for diffs in (small, large):
        lo, hi = ruler_paired.bootstrap_interval(diffs, resamples=4000, seed=1)
        assert lo < ruler_paired.task_mean_difference(diffs) < hi
    width_small = np.subtract(*reversed(ruler_paired.bootstrap_interval(small, 4000, 1)))
    width_large = np.subtract(*reversed(ruler_paired.bootstrap_interval(large, 4000, 1)))
    assert width_large < width_small / 2  # ~1/sqrt(20) of it in expectation
    # the same seed gives the same interval
    assert ruler_paired.bootstrap_interval(small, 4000, 1) == ruler_paired.bootstrap_interval(small, 4000, 1)


def test_paired_by_task_uses_only_samples_both_runs_scored() -> None:
    ref = {("a", 0): 1.0, ("a", 1): 0.0, ("b", 0): 0.5, ("b", 9): 1.0}
    cand = {("a", 0): 0.0, ("a", 1): 1.0, ("b", 0): 1.0, ("c", 0): 1.0}
    diffs = ruler_paired.paired_by_task(ref, cand)
    assert sorted(diffs) == ["a", "b"]
    np.testing.assert_array_equal(diffs["a"], [-1.0, 1.0])
    np.testing.assert_array_equal(diffs["b"], [0.5])


def _scored(path: Path, mode: str, scores: dict[tuple[str, int], float], length: int = 4096) -> str:
    records = [{"task": t, "index": i, "score": s} for (t, i), s in scores.items()]
    path.write_text(json.dumps({"length": length, "modes": {mode: {"mean_accuracy": 0.0, "records": records}}}))
    return f"{path}:{mode}"


def test_cli_writes_the_paired_summary(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    keys = [(t, i) for t in ("niah_single_1", "vt", "cwe") for i in range(20)]
    ref = {k: float(rng.integers(0, 2)) for k in keys}
    cand = {k: float(rng.choice([0.0, 0.5, 1.0])) for k in keys}
    out = tmp_path / "paired.json"
    cmd = [sys.executable, str(ROOT / "bench" / "ruler_paired.py"), "--reference", _scored(tmp_path / "r.json", "full", ref),
           "--candidate", _scored(tmp_path / "c.json", "fluxion", cand), "--resamples", "2000", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    by_task = {t: [cand[k] - ref[k] for k in keys if k[0] == t] for t in ("niah_single_1", "vt", "cwe")}
    assert got["difference"] == pytest.approx(np.mean([np.mean(d) for d in by_task.values()]))
    all_d = [d for ds in by_task.values() for d in ds]
    assert (got["better"], got["worse"]) == (sum(d > 0 for d in all_d), sum(d < 0 for d in all_d))
    assert got["interval95"][0] <= got["difference"] <= got["interval95"][1]
    assert got["sign_test_p"] == pytest.approx(_binomial_two_sided(got["better"], got["worse"]))
    assert "95% interval" in done.stdout


def test_cli_pools_runs_of_disjoint_samples(tmp_path: Path) -> None:
    """Indices 0-19 and 20-39 of each side from separate files give what one file of all 40 gives."""
    rng = np.random.default_rng(5)
    keys = [(t, i) for t in ("vt", "cwe", "qa_2") for i in range(40)]
    ref = {k: float(rng.integers(0, 2)) for k in keys}
    cand = {k: float(rng.choice([0.0, 0.5, 1.0])) for k in keys}
    ref_a, cand_a = ({k: v for k, v in d.items() if k[1] < 20} for d in (ref, cand))
    ref_b, cand_b = ({k: v for k, v in d.items() if k[1] >= 20} for d in (ref, cand))
    script = str(ROOT / "bench" / "ruler_paired.py")

    def run(refs: list[str], cands: list[str], out: Path) -> dict:
        cmd = [sys.executable, script, "--reference", *refs, "--candidate", *cands, "--resamples", "1000", "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(out.read_text())

    whole = run([_scored(tmp_path / "r.json", "full", ref)], [_scored(tmp_path / "c.json", "fluxion", cand)],
                tmp_path / "whole.json")
    pooled = run([_scored(tmp_path / "r0.json", "full", ref_a), _scored(tmp_path / "r1.json", "full", ref_b)],
                 [_scored(tmp_path / "c0.json", "fluxion", cand_a), _scored(tmp_path / "c1.json", "fluxion", cand_b)],
                 tmp_path / "pooled.json")
    assert pooled["samples"] == whole["samples"] == 120
    for field in ("difference", "interval95", "better", "worse", "tasks"):
        assert pooled[field] == whole[field]
    assert " + " in pooled["reference"] and pooled["unpaired"] == 0


@pytest.mark.parametrize("case,message", [
    ("overlap", "is in both"),
    ("pooled_other_length", "pool runs of one length"),
    ("missing_mode", "has no mode 'fixed'"),
    ("no_records", "no per-sample records"),
    ("other_length", "different lengths"),
    ("not_json", "not a scored RULER file"),
    ("modes_not_a_table", "not a scored RULER file"),
])
def test_cli_bad_input_gets_a_clear_error(tmp_path: Path, case: str, message: str) -> None:
    ref = _scored(tmp_path / "r.json", "full", {("vt", 0): 1.0})
    cand = _scored(tmp_path / "c.json", "fluxion", {("vt", 0): 0.0})
    if case == "missing_mode":
        cand = cand.rsplit(":", 1)[0] + ":fixed"
    elif case == "no_records":
        (tmp_path / "c.json").write_text(json.dumps({"length": 4096, "modes": {"fluxion": {"mean_accuracy": 0.5}}}))
    elif case == "other_length":
        cand = _scored(tmp_path / "c.json", "fluxion", {("vt", 0): 0.0}, length=8192)
    elif case in ("overlap", "pooled_other_length"):
        extra = _scored(tmp_path / "c2.json", "fluxion", {("vt", 0 if case == "overlap" else 1): 1.0},
                        length=4096 if case == "overlap" else 8192)
        cmd = [sys.executable, str(ROOT / "bench" / "ruler_paired.py"), "--reference", ref, "--candidate", cand, extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
        return
    elif case == "modes_not_a_table":
        (tmp_path / "c.json").write_text(json.dumps({"length": 4096, "modes": ["fluxion"]}))
    else:
        (tmp_path / "c.json").write_text("{not json")
    cmd = [sys.executable, str(ROOT / "bench" / "ruler_paired.py"), "--reference", ref, "--candidate", cand]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
