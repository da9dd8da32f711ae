"""Shared pytest set-up.

Without a GPU, Triton kernels (fluxion_lite/sparse/device/kernels.py) can only run in Triton's interpreter, which must be
chosen before triton is first imported: its own library functions (tl.sum, ...) are built at that moment."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture()
def settings():
    """For tests that pick a SIMD path or a thread count: the native defaults again afterwards."""
    from fluxion_lite.hostkv import native

    yield
    native.set_simd("auto")
    native.set_threads(native.physical_cores())
