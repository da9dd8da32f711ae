"""pytest set-up for the research scripts' tests (`make test-research`; not part of `make test`).

The research scripts (research/) import each other and the product benchmarks (bench/) by module name, and the tests
share helpers with the product suite (tests/support/): all three folders go on sys.path. As in tests/conftest.py,
Triton runs in its interpreter where there is no GPU (chosen before triton is first imported)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "bench", ROOT / "tests" / "support", ROOT / "research"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
