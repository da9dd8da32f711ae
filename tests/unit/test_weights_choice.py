"""engine/weights.py: device and weight form from the user's arguments, "auto" by default."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.engine import weights
from fluxion_lite.errors import RequestError


def test_device_auto_is_the_gpu_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert weights.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert weights.resolve_device("auto") == "cuda"
    assert weights.resolve_device("cuda:1") == "cuda:1" and weights.resolve_device("cpu") == "cpu"
    with pytest.raises(RequestError, match="device='tpu'"):
        weights.resolve_device("tpu")


def test_dtype_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert weights.resolve_dtype("auto", "cpu", 10**9) == (torch.float32, True)
    assert weights.resolve_dtype("gguf", "cpu") == (torch.float32, True)
    assert weights.resolve_dtype("gguf", "cuda") == (torch.bfloat16, True)
    assert weights.resolve_dtype("bfloat16", "cuda") == (torch.bfloat16, False)
    assert weights.resolve_dtype("float32", "cpu") == (torch.float32, False)
    # auto on CUDA: bf16 where 2 bytes a weight fit 75% of the free GPU memory, else the blocks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 << 30, 80 << 30))
    assert weights.resolve_dtype("auto", "cuda", 6 << 30) == (torch.bfloat16, False)  # 12 GiB
    assert weights.resolve_dtype("auto", "cuda", 7 << 30) == (torch.bfloat16, True)  # 14 GiB > 0.75 x 16 GiB
    with pytest.raises(RequestError, match="dtype='int3'.*gguf"):
        weights.resolve_dtype("int3", "cpu")
