"""Fixtures of the native kernel tests."""
from __future__ import annotations

import pytest

from fluxion_lite.hostkv import native
from native_cases import N_THREADS, PATHS


@pytest.fixture(params=[(p, t) for p in PATHS for t in (1, N_THREADS)],
                ids=lambda v: f"{v[0]}-t{v[1]}")
def path(request):
    """Every SIMD path this CPU supports with 1 and N pool threads; the native defaults again afterwards."""
    simd, threads = request.param
    native.set_simd(simd)
    native.set_threads(threads)
    yield simd
    native.set_simd("auto")
    native.set_threads(native.physical_cores())
