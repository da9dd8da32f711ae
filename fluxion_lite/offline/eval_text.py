"""Real long text for evaluations: the Paul Graham essays that calibration also reads (plan/calibration_text.py)."""
from __future__ import annotations

from typing import Any

from fluxion_lite.plan.calibration_text import essay_text


def essay_tokens(tokenizer: Any, n: int, offset: int = 0) -> list[int]:
    """The first n token ids of the essays from character `offset`, BOS included (fewer if the text runs out: the
    caller checks). 8 characters a token is ample for English prose, so only that much text is encoded."""
    return tokenizer.encode(essay_text()[offset : offset + n * 8], add_special=True)[:n]
