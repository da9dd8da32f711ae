"""A one-line progress bar on stderr for long work: calibration (on first use too), predictor data."""
from __future__ import annotations

import sys
import time


def progress(i: int, n: int, t0: float, what: str) -> None:
    done = i / n
    bar = "#" * int(30 * done)
    eta = (time.time() - t0) / max(i, 1) * (n - i)
    sys.stderr.write(f"\r{what} [{bar:<30}] {i}/{n} eta {eta:5.0f}s")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()
