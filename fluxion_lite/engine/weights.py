"""Where a model runs and in what form its weights are kept, from the user's `device` and `dtype` (both "auto" by
default, so that nobody has to choose).

device "auto": CUDA when torch sees a GPU, else the CPU.
dtype:
  "gguf"   the matrices stay in the file's 4-8 bit blocks: native integer kernels on the CPU (fp32 activations),
           Triton kernels on CUDA (bf16 activations; model/quantized_gpu.py). What llama.cpp does.
  "auto"   the CPU: "gguf". CUDA: bfloat16 weights when they fit the GPU, else "gguf". Why not "gguf" always on
           CUDA: the quantized GPU kernels are level with bf16 at one row a step but 5-15x slower at 8-16 rows (H100,
           Q4_K, bench/results/qgemv_h100.log), so a server's batched decode would pay; where bf16 does not fit, the
           blocks are the only way the model runs at all.
  "float32" / "bfloat16" / "float16"  every weight dequantized to that dtype (on the GPU for CUDA: the blocks go
           there as the file stores them, so host RAM holds no dequantized copy).
"""
from __future__ import annotations

import torch

from fluxion_lite.errors import RequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
GGUF = "gguf"
# the share of free GPU memory that bf16 weights may take under dtype "auto" (the rest: the KV cache, activations)
FIT_SHARE = 0.75


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where torch sees a GPU, else "cpu"; other values as given ("cuda:1" included)."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
        raise RequestError(f"device={device!r}: use auto, cpu or cuda[:index]")
    return device


def resolve_dtype(dtype: str, device: str, n_weights: int | None = None) -> tuple[torch.dtype, bool]:
    """(compute dtype, whether the matrices stay in their blocks) for a dtype argument on a resolved device.
    n_weights: the model's weight count, for "auto" on CUDA (None: assume bf16 fits)."""
    cuda = device.startswith("cuda")
    if dtype == GGUF:
        return (torch.bfloat16 if cuda else torch.float32), True
    if dtype == AUTO:
        if not cuda:
            return torch.float32, True
        return torch.bfloat16, n_weights is not None and not bf16_fits(n_weights, device)
    if dtype not in DTYPES:
        raise RequestError(f"dtype={dtype!r}: supported are {', '.join((AUTO, GGUF, *DTYPES))}")
    return DTYPES[dtype], False


def bf16_fits(n_weights: int, device: str) -> bool:
    """Whether n_weights dequantized to bf16 (2 bytes each) fit within FIT_SHARE of the GPU's free memory. Host RAM
    is not asked: the blocks are dequantized on the GPU (Transformer, quant_kernels "none")."""
    free_gpu, _ = torch.cuda.mem_get_info(torch.device(device))
    return 2 * n_weights <= FIT_SHARE * free_gpu
