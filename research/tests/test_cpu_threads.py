"""research/cpu_threads.py on smollm2-135m at one thread: a step's split adds up (its layers in the one-call step),
and the attention probe runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_split_and_probe(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(ROOT / "research" / "cpu_threads.py"), "--models", "smollm2-135m",
                    "--threads", "1", "--decode", "6", "--context", "64", "--no-peer", "--attention-probe",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    probe, row = json.loads(out.read_text())
    assert probe["probe"] == "decode_attention" and probe["us_per_call"] > 0
    split = row["split_ms"]
    parts = sum(v for k, v in split.items() if "." not in k and k != "rest")
    assert abs(parts + split["rest"] - row["tpot_ms"]) < 1e-6
    assert split["decode_layers"] > split["logits"] > 0  # a lone dense sequence: every layer in one call a step
    assert row["kernel_us"]["qkv"] > 0 and row["kernel_us"]["out_mlp"] > 0
