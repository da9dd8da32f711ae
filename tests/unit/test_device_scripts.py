"""The GPU-host helper scripts (bench/device/): each parses as bash, and bench/device/README.md names each one, so
the procedure written there is the one the scripts implement."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[2] / "bench" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))


def test_there_are_scripts() -> None:
    assert {p.name for p in SCRIPTS} >= {"prepare.sh", "part.sh", "receive.sh", "setup.sh", "ruler.sh", "tpot.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_documented(script: Path) -> None:
    got = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert f"bench/device/{script.name}" in (DEVICE / "README.md").read_text()
