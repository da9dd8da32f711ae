"""A model argument (catalog name or .gguf path) -> a GGUF file on disk, pulling a catalog model on first use."""
from __future__ import annotations

import os
from pathlib import Path

from fluxion_lite.errors import UnknownModelError
from fluxion_lite.hub.catalog import catalog, get_model, is_present, local_path
from fluxion_lite.hub.pull import pull
from fluxion_lite.settings import Settings


def _looks_like_path(name_or_path: str) -> bool:
    return (
        os.sep in name_or_path
        or (os.altsep is not None and os.altsep in name_or_path)
        or name_or_path.lower().endswith(".gguf")
        or name_or_path.startswith(("~", "."))
    )


def _existing_file(path: Path) -> Path:
    if path.is_dir():
        raise UnknownModelError(f"model path {str(path)!r} is a directory, not a .gguf file")
    if not path.is_file():
        raise UnknownModelError(f"model file {str(path)!r} does not exist")
    return path


def resolve_model(name_or_path: str | os.PathLike[str], *, pull_missing: bool = True, progress: bool = True,
                  settings: Settings | None = None) -> Path:
    """A catalog name or a .gguf path -> the path of a GGUF file on disk.

    A catalog model that is not in the cache yet is pulled (with a progress bar on stderr unless progress=False).
    A path is returned as given if the file exists; whether it really is a GGUF is the loader's job. settings:
    whose cache_dir (None: Settings.load()).
    """
    text = os.fspath(name_or_path)
    if not text.strip():
        raise UnknownModelError(f"empty model name; known models: {', '.join(catalog())}")
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text):
        return _existing_file(Path(text).expanduser())
    if text not in catalog() and Path(text).is_file():  # a bare file name in the working directory
        return Path(text)
    model = get_model(text)
    if is_present(model, settings):
        return local_path(model, settings)
    if not pull_missing:
        raise UnknownModelError(f"model {model.name!r} is not downloaded yet; run `fluxion-lite pull {model.name}`")
    return pull(model, show_progress=progress, settings=settings)
