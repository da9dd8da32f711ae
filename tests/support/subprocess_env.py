"""The environment for a test's subprocess that runs a repository script."""
from __future__ import annotations

import os
from pathlib import Path


def repo_env(root: Path) -> dict[str, str]:
    """os.environ with the repository first on PYTHONPATH, the rest kept: on the GPU host the carried wheels
    (cffi and friends, device README) live on PYTHONPATH, and a child that lost them could not import the package."""
    rest = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(root) + (os.pathsep + rest if rest else "")}
