"""research/mixed_step.py on the real smollm2-135m (CPU): every timed step is the mixed step it claims to measure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from subprocess_env import repo_env

ROOT = Path(__file__).resolve().parents[2]


def test_mixed_step_bench_times_mixed_steps_and_labels_their_parts(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, str(ROOT / "research" / "mixed_step.py"), "--gguf", "smollm2-135m", "--device", "cpu",
           "--dtype", "float32", "--context", "384", "--batch", "3", "--prefill-chunk", "96", "--warmup", "1",
           "--steps", "3", "--profile-steps", "1", "--top", "3", "--variants", "cpu", "cpu+blocking-append", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(ROOT),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == ["cpu", "cpu+blocking-append"]
    for res in results:
        assert res["steps"] == 3 and res["mixed_steps"] == 3  # two rows decoding beside a prompt chunk, every step
        assert len(res["walls_ms"]) == 3 and all(w > 0 for w in res["walls_ms"])
        labels = {lab["label"]: lab for lab in res["profile"]["labels"]}
        layers = 30  # smollm2-135m: each labelled part once per layer of the profiled step
        for part in ("fluxion::mixed_host_append", "fluxion::mixed_chunk", "fluxion::mixed_decode_rows"):
            assert labels[part]["calls"] == layers and labels[part]["cpu_ms"] > 0
    env = repo_env(ROOT)
    for bad, flag in ((["--batch", "1"], "--batch"), (["--variants", "gpu+sync"], "--variants")):
        refused = subprocess.run([*cmd[:-2], *bad], capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode != 0 and flag in refused.stderr
