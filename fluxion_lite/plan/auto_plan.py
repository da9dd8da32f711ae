"""A fluxion plan for any model file: the user's calibration, else the shipped plan, else a calibration made now.

A model without a plan used to be refused ("run `fluxion-lite calibrate`"). Now the engine calibrates it on first
use (3 planted-fact prompts of up to 4,096 tokens through the loaded model, a progress bar on stderr; `calibrate`
of qwen2.5-coder-0.5b, the same measurement, takes 45 s on the 2-core VM), selects the plan as `calibrate` does and
keeps it in the user cache next to the models, with a stamp naming the file it was made for (size, modification time,
sha256). A plan whose stamp no longer
matches the file is made again, never reused: size and time equal -> trusted without reading the file; otherwise
the file's sha256 decides (a file rewritten in place with the same size and time would slip through; nothing else).
`calibrate` stamps the plans it writes the same way; a user plan without a stamp (written by hand, or by `calibrate
--from-labels` without the model file at hand) is the user's choice and is used as it is.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fluxion_lite.hub.catalog import file_record, file_sha256, read_record, record_is_current, write_record
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.plan import files as plan_files
from fluxion_lite.plan.recipe import first_use_recipe, request_recipe
from fluxion_lite.plan.selector import DEFAULT_EPSILON, Labels, load_labels, save_labels, select_plan
from fluxion_lite.plan.sparse_plan import SparsePlan
from fluxion_lite.settings import Settings

AUTO_SAMPLES = 3  # prompts: what `calibrate` takes by default
AUTO_CONTEXT = 4096  # tokens per prompt, at most (and at most half the model's context)
AUTO_POSITIONS = 32  # query positions measured per prompt
AUTO_SINK, AUTO_WINDOW = 16, 64
STAMP_SUFFIX = ".plan.stamp.json"

Calibrate = Callable[[int, int, int, int, int], tuple[Labels, dict[str, object]]]  # samples, context, positions,
# sink, window -> labels and metadata (plan/calibration.calibrate_loaded on the engine's model)


@dataclass
class PlanChoice:
    plan: SparsePlan
    origin: str  # where it came from, in words (Engine.explain and /props show it)


def plan_key(model_name: str) -> str:
    """The name a model's plan files carry: a file's name without .gguf (as `calibrate` names them)."""
    return model_name.removesuffix(".gguf")


def make_stamp(path: Path) -> dict[str, object]:
    """The stamp of a model file as it is now (hub/catalog.py's record: sha256, size, modification time)."""
    return file_record(path, file_sha256(path))


def stamp_matches(stamp: dict[str, object], path: Path) -> bool:
    """The stamp was made for this file: same size and modification time, or else the same size and sha256."""
    if record_is_current(stamp, path):
        return True
    return stamp.get("size") == path.stat().st_size and stamp.get("sha256") == file_sha256(path)


def write_stamp(folder: Path, key: str, model_path: Path) -> None:
    """Mark the plan <key>.plan.json in folder as made for model_path (choose_plan checks it before use)."""
    write_record(folder / f"{key}{STAMP_SUFFIX}", make_stamp(model_path))


def write_plan(folder: Path, key: str, plan: SparsePlan, model_path: Path, labels: Labels | None = None,
               meta: dict[str, object] | None = None) -> Path:
    """The plan, its stamp for model_path and (if given) its labels into folder; returns the plan's path. Each file
    lands whole (written aside, then renamed), the plan before its stamp: a run stopped between the two leaves a new
    plan under the old file's stamp, which the next run finds mismatched and calibrates again, never an old plan
    under a new stamp."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / f"{key}.plan.json"
    tmp = plan_path.with_name(plan_path.name + ".tmp")
    plan.save(tmp)
    os.replace(tmp, plan_path)
    write_stamp(folder, key, model_path)
    if labels is not None and meta is not None:
        save_labels(folder / f"{key}.calib.json", labels, meta)
    return plan_path


def find_plan(model_name: str, model_path: Path, cfg: ModelConfig, settings: Settings | None = None
              ) -> tuple[PlanChoice | None, str]:
    """The plan that fits this model file without calibrating (the user's, else the shipped one), or None and why
    there is none."""
    key = plan_key(model_name)
    user = plan_files.user_dir(settings)
    user_plan, stamp_path = user / f"{key}.plan.json", user / f"{key}{STAMP_SUFFIX}"
    if user_plan.is_file():
        if not stamp_path.is_file():
            return PlanChoice(_load(user_plan, cfg), f"your plan {user_plan}"), ""
        stamp = read_record(stamp_path) or {}
        if stamp_matches(stamp, model_path):
            return PlanChoice(_load(user_plan, cfg), f"calibrated for this file (sha256 {str(stamp['sha256'])[:12]}), "
                                                     f"{user_plan}"), ""
        return None, f"{model_path.name} is not the file the plan {user_plan} was calibrated for"
    shipped = plan_files.shipped_dir() / f"{key}.plan.json"
    if shipped.is_file():
        return PlanChoice(_load(shipped, cfg), f"shipped with fluxion-lite, {shipped}"), ""
    return None, f"no plan for {key}"


def find_labels(model_name: str, model_path: Path, settings: Settings | None = None
                ) -> tuple[Labels, dict[str, object]] | None:
    """The calibration labels behind this model file's plan (the user's when their stamp fits the file, else the
    shipped ones), from which the selector makes a plan at any epsilon; None when there are none."""
    key = plan_key(model_name)
    user = plan_files.user_dir(settings)
    stamp_path = user / f"{key}{STAMP_SUFFIX}"
    user_labels = user / f"{key}.calib.json"
    if user_labels.is_file() and (not stamp_path.is_file() or stamp_matches(read_record(stamp_path) or {}, model_path)):
        return load_labels(user_labels)
    shipped = plan_files.shipped_dir() / f"{key}.calib.json"
    return load_labels(shipped) if shipped.is_file() else None


def epsilon_plan(labels: Labels, meta: dict[str, object], cfg: ModelConfig, epsilon: float, sink: int,
                 window: int) -> SparsePlan:
    """A request's own plan: the selector's plan at this epsilon with the running plan's sink and window, shaped by
    the recipe's first step (plan/recipe.py)."""
    context = int(meta.get("context", AUTO_CONTEXT))  # type: ignore[call-overload]
    selected = select_plan(labels, cfg.n_layers, cfg.n_kv_heads, epsilon, context, sink, window, cfg.head_dim,
                           source=f"epsilon={epsilon:g}, for one request")
    return request_recipe(selected, context)


def choose_plan(model_name: str, model_path: Path, cfg: ModelConfig, calibrate: Calibrate,
                settings: Settings | None = None, log: Callable[[str], None] | None = None) -> PlanChoice:
    """The plan `fluxion` runs for this model file (module docstring), calibrating now where none fits."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    found, why = find_plan(model_name, model_path, cfg, settings)
    if found is not None:
        return found
    key, user = plan_key(model_name), plan_files.user_dir(settings)
    context = min(AUTO_CONTEXT, cfg.context_length // 2)
    if context <= AUTO_POSITIONS + AUTO_SINK + AUTO_WINDOW:
        raise ValueError(f"{model_path.name}: a context of {cfg.context_length} tokens is too short to calibrate a "
                         f"fluxion plan; use attention='full'")
    log(f"fluxion: {why}: calibrating one on {AUTO_SAMPLES} prompts of {context} tokens (once; kept in {user})")
    labels, meta = calibrate(AUTO_SAMPLES, context, AUTO_POSITIONS, AUTO_SINK, AUTO_WINDOW)
    selected = select_plan(labels, cfg.n_layers, cfg.n_kv_heads, DEFAULT_EPSILON, context, AUTO_SINK, AUTO_WINDOW,
                           cfg.head_dim, source=f"calibrated on first use, {AUTO_SAMPLES} x {context} tokens, "
                                                f"epsilon={DEFAULT_EPSILON:g}")
    plan = first_use_recipe(selected, context)  # shaped as the shipped 0.5b plan was (plan/recipe.py)
    path = write_plan(user, key, plan, model_path, labels, meta)
    plan.validate(cfg.n_layers, cfg.n_kv_heads)
    return PlanChoice(plan, f"calibrated now for this file, {path}")


def _load(path: Path, cfg: ModelConfig) -> SparsePlan:
    plan = SparsePlan.load(path)
    plan.validate(cfg.n_layers, cfg.n_kv_heads)
    return plan
