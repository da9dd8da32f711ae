"""research/summary_append.py (CPU): it times the three summary-upkeep calls it names and counts their data ops, with
the block-aligned chunk read in place (fewer ops than a ragged chunk, which is padded first)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[2]


def test_summary_append_bench_counts_the_aligned_chunk_below_the_ragged_one(tmp_path: Path) -> None:
    out = tmp_path / "summary_append.json"
    cmd = [sys.executable, str(ROOT / "research" / "summary_append.py"), "--device", "cpu", "--chunk", "256", "--rows",
           "5", "--repeats", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(ROOT),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    aligned, ragged, decode = rows["chunk 256 at a block start"], rows["chunk 251 at start +5"], rows["5 decode keys"]
    for r in (aligned, ragged, decode):
        assert r["median_ms"] > 0 and r["launches"] == 0  # no kernel launches without CUDA
    # aligned: amin, amax, stack, the store's copy; ragged adds the padding cat and the first block's merge
    assert aligned["data_ops"] == 4 and ragged["data_ops"] > aligned["data_ops"] and decode["data_ops"] > 0
