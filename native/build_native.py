"""cffi API-mode build of the native sparse-attention library (module fluxion_lite._native)."""
from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef("int fx_version(void);")
ffibuilder.set_source(
    "fluxion_lite._native",
    '#include "fluxion.h"',
    # Relative paths: setuptools refuses absolute ones; the build runs from the project root.
    sources=["native/fluxion.c"],
    include_dirs=["native"],
    extra_compile_args=["-O3"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
