"""research/cpu_crossover.py on smollm2-135m at two short contexts: both modes timed, the ratio column right."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_modes_are_timed(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    run = subprocess.run([sys.executable, str(ROOT / "research" / "cpu_crossover.py"), "--models", "smollm2-135m",
                          "--contexts", "64", "128", "--decode", "5", "--threads", "1", "--out", str(out)],
                         check=True, cwd=ROOT, capture_output=True, text=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [64, 128] and all(r["full_ms"] > 0 and r["fluxion_ms"] > 0 for r in rows)
    assert abs(rows[1]["dense_kv_over_weights"] - 2 * rows[0]["dense_kv_over_weights"]) < 1e-9
    assert "fluxion first faster at" in run.stdout
