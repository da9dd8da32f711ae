"""research/prefill_attention.py runs end to end at small sizes and its error columns say what the benchmark claims."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_writes_rows_and_the_shipped_paths_sit_at_the_rounding_floor(tmp_path: Path) -> None:
    out = tmp_path / "pa.json"
    proc = subprocess.run([sys.executable, str(ROOT / "research" / "prefill_attention.py"), "--threads", "1",
                           "--lengths", "96", "160", "--chunk", "64", "--error-rows", "16", "--batch", "3",
                           "--slots", "70", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, env=repo_env(ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    # 2 shapes x (2 lengths x 3 prefill ways + 2 decode ways)
    assert len(rows) == 2 * (2 * 3 + 2)
    for r in rows:
        assert r["ms"] > 0 and 0 < r["bf16_floor"] < 1e-2
        if r["impl"] in ("flash", "masked_sdpa"):  # fp32 scores: near the floor of a bf16 output
            assert r["rel_error"] < 3 * r["bf16_floor"]
        if r["kind"] == "decode_stream":
            assert r["lse_max_error"] < (2e-3 if r["impl"] == "flash" else 1.0)


def test_bad_arguments_get_a_message_not_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "research" / "prefill_attention.py"), "--lengths", "96",
                           "--chunk", "64", "--error-rows", "65", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, env=repo_env(ROOT), timeout=120)
    assert proc.returncode == 2 and "--error-rows" in proc.stderr and "Traceback" not in proc.stderr
