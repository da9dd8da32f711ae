"""Shared pytest set-up.

Without a GPU, Triton kernels (fluxion_lite/device_kernels.py) can only run in Triton's interpreter, which must be
chosen before triton is first imported: its own library functions (tl.sum, ...) are built at that moment."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
