"""Shared pytest set-up for every area of the suite (unit/, kernels/, engine/, server/).

The helpers the areas share (reference implementations, tiny GGUF writers, the real-model fixtures, ...) live in
tests/support/; it goes first on sys.path here, so a test imports them by module name (`from decode_compare import
...`). research/tests/conftest.py puts the same folder on its path.

Without a GPU, Triton kernels (fluxion_lite/sparse/device/kernels.py) can only run in Triton's interpreter, which must be
chosen before triton is first imported: its own library functions (tl.sum, ...) are built at that moment."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture()
def settings():
    """For tests that pick a SIMD path or a thread count: the native defaults again afterwards."""
    from fluxion_lite.hostkv import native

    yield
    native.set_simd("auto")
    native.set_threads(native.physical_cores())
