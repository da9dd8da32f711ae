"""`fluxion-lite calibrate`'s model run: a fresh dense fp32 engine for the labels' reference, calibrated by
plan/calibration.py (which the engine also runs on its own model when a file has no plan, plan/auto_plan.py)."""
from __future__ import annotations

from fluxion_lite.plan.calibration import calibrate_loaded


def run_calibration(model_name: str, *, samples: int = 4, context: int = 2048, positions: int = 32, sink: int = 16,
                    window: int = 64, seed: int = 0) -> tuple[dict[tuple[int, int, str], tuple[float, float]], dict[str, object]]:
    """Calibrate a catalog model (or .gguf path) on planted-fact essay prompts; deterministic for a given seed."""
    from fluxion_lite.engine.engine import Engine

    engine = Engine(model_name, attention="full", dtype="float32", prefix_cache_entries=0)  # dense fp32: the labels' reference
    return calibrate_loaded(engine.model, engine.tokenizer, model_name, samples=samples, context=context,
                            positions=positions, sink=sink, window=window, seed=seed)


