"""bench/tpot_plot.py --table: the merged grid of several bench/tpot.py files as one table, ratios from the rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[2]


def _row(mode: str, ctx: int, batch: int, ms: float, chained: float, wait: float, read: float) -> dict:
    return {"mode": mode, "context": ctx, "batch": batch, "tpot_ms": ms, "tpot_async_ms": chained,
            "gpu_wait_ratio": wait, "kv_read_fraction": read, "cuda_graphs": True}


def test_table_merges_files_and_divides_the_right_rows(tmp_path: Path) -> None:
    first = {"model": "llama3.1-8b", "machine": "test", "commit": "aaa", "mode_names": "reuse", "rows": [
        _row("fluxion-gpu-early", 32768, 1, 6.0, 5.5, 0.0, 0.044),
        _row("fixed", 32768, 1, 21.0, 22.0, 0.63, 0.053),
        _row("full-host", 32768, 1, 50.0, 49.0, 0.85, 1.0),
        _row("fluxion-gpu-early", 65536, 4, 12.5, 11.0, 0.0, 0.043),
    ]}
    second = {"model": "llama3.1-8b", "machine": "test", "commit": "bbb", "mode_names": "reuse", "rows": [
        _row("fixed", 32768, 1, 24.0, 23.1, 0.65, 0.053),  # replaces the first file's fixed row
    ]}
    files = []
    for i, data in enumerate((first, second)):
        files.append(tmp_path / f"t{i}.json")
        files[-1].write_text(json.dumps(data))
    table = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tpot_plot.py"), *map(str, files),
                           "--out", str(tmp_path / "p.png"), "--table", str(table)],
                          capture_output=True, text=True, env=repo_env(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(table.read_text())["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(32768, 1), (65536, 4)]
    r32 = rows[0]
    assert r32["fixed"]["tpot_ms"] == 24.0  # the later file won
    assert abs(r32["vs_fixed"] - 24.0 / 6.0) < 1e-12
    assert abs(r32["vs_fixed_chained"] - 23.1 / 5.5) < 1e-12
    assert abs(r32["vs_full_host"] - 50.0 / 6.0) < 1e-12
    assert rows[1]["vs_fixed"] is None and "fixed" not in rows[1]  # fixed did not run there: no ratio, "-"
    line32 = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| 32K | 1 |"))
    assert "6.00 / 5.50" in line32 and "4.00x / 4.20x" in line32 and "8.33x" in line32 and "0% / 65%" in line32
    line64 = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| 64K | 4 |"))
    assert "- / -" in line64 and "4.3%" in line64
