"""The test matrix shared by the native kernel tests: SIMD paths the machine has, GQA ratios, thread counts, and one
case of the matrix (printed as the pytest id)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from fluxion_lite import native

PATHS = native.simd_supported()
RATIOS = (1, 3, 4, 7, 8)
N_THREADS = max(2, native.physical_cores())


@dataclass(frozen=True)
class Case:
    simd: str
    ratio: int
    head_dim: int
    g: int
    dtype: torch.dtype
    threads: int

    def __str__(self) -> str:
        dt = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        return f"{self.simd}-r{self.ratio}-d{self.head_dim}-g{self.g}-{dt}-t{self.threads}"


def rotated_cases() -> list[Case]:
    """Every SIMD path with every GQA ratio, head_dim / g / dtype / threads rotating across them (so each path also
    sees most of those); a test adds its own fixed cases for what it must cover on every path."""
    rot = itertools.cycle(itertools.product((64, 128), (16, 32, 64, 128), (torch.float16, torch.bfloat16),
                                            (1, N_THREADS)))
    return [Case(simd, ratio, *next(rot)) for simd in PATHS for ratio in RATIOS]
