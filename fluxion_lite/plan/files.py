"""Where a model's plan files live. They are user data: `fluxion-lite calibrate` writes them into the user cache,
next to the pulled models, and the runtime looks there first, then among the plans shipped in the package's
models/ folder. So a calibration never writes into the installed package, and a user's own plan wins over ours.

Files per model name: <name>.plan.json (the static plan), <name>.calib.json (calibration labels),
<name>.predictor.npz / .predictor-data.npz / .predictor.md (the head-property predictor, its data and card).
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fluxion_lite.hub.catalog import cache_dir
from fluxion_lite.settings import Settings


def user_dir(settings: Settings | None = None) -> Path:
    """Where calibrate writes: the model cache (FLUXION_CACHE_DIR, else ~/.cache/fluxion-lite/models; settings:
    whose cache_dir, None: Settings.load())."""
    return cache_dir(settings)


def shipped_dir() -> Path:
    """The plans that ship with the package (models/, read-only for the runtime)."""
    return Path(str(files("fluxion_lite.models")))


def find(model_name: str, suffix: str, settings: Settings | None = None) -> Path | None:
    """The first existing <model_name><suffix> in the user cache, then among the shipped files; None if neither."""
    for folder in (user_dir(settings), shipped_dir()):
        path = folder / f"{model_name}{suffix}"
        if path.is_file():
            return path
    return None
