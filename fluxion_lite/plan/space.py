"""The configurations a KV group can take: streaming, or retrieval at block size g with a budget (a fraction of
the context). Calibration labels each; the selector and the predictor choose among them."""
from __future__ import annotations

import math
from dataclasses import dataclass

GRANULARITIES = (16, 32, 64, 128)  # retrieval block sizes, in tokens
BUDGETS = (0.01, 0.02, 0.05, 0.10, 0.20)


@dataclass(frozen=True)
class Config:
    streaming: bool
    g: int = 1
    budget: float = 0.0

    @property
    def key(self) -> str:
        return "stream" if self.streaming else f"g{self.g}_b{self.budget:g}"


def all_configs() -> list[Config]:
    return [Config(True)] + [Config(False, g, b) for g in GRANULARITIES for b in BUDGETS]


def budget_tokens(budget: float, n: int, g: int) -> int:
    return math.ceil(budget * n / g) * g
