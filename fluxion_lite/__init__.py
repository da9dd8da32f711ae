"""fluxion-lite: LLM inference with hybrid CPU-GPU sparse attention over host-memory KV caches.

The public surface: `LLM` (generate / chat in a few lines), `SamplingParams`, `Engine` (requests, steps, streaming:
what the server drives) and `Settings` (every knob, parsed once). Everything else is internal.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Engine", "Settings", "__version__"]

if TYPE_CHECKING:
    from fluxion_lite.engine.engine import Engine
    from fluxion_lite.engine.llm import LLM
    from fluxion_lite.engine.sampling import SamplingParams
    from fluxion_lite.settings import Settings


def __getattr__(name: str) -> Any:
    # lazy: `import fluxion_lite` (the CLI's --help, the version) stays free of torch until an engine is wanted
    if name == "Engine":
        from fluxion_lite.engine.engine import Engine
        return Engine
    if name == "LLM":
        from fluxion_lite.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from fluxion_lite.engine.sampling import SamplingParams
        return SamplingParams
    if name == "Settings":
        from fluxion_lite.settings import Settings
        return Settings
    raise AttributeError(f"module 'fluxion_lite' has no attribute {name!r}")
