"""cffi API-mode build of the native sparse-attention library (module fluxion_lite._native).

Used three ways:
  * `pip install .` / `pip install -e .`: setup.py names `native/build_native.py:ffibuilder` in cffi_modules.
  * `python3 native/build_native.py`: in-place build into fluxion_lite/ (no pip needed, e.g. on a bare host).
  * native/asan_check.py: `make_builder(sanitize=True)` compiled into a scratch folder.

SIMD paths: every source compiles with the same flags; fx_simd_avx2.c / fx_simd_avx512.c / fx_simd_avx512bf16.c and
fx_quant_avx2.c / fx_quant_avx512.c / fx_quant_avx512vnni.c enable their instruction sets with a `#pragma GCC target`
of their own, and fluxion.c / fx_quant.c pick one at run time (__builtin_cpu_supports; CPUID + XGETBV for
AVX512-BF16).
That keeps per-file flags out of setuptools (cffi's set_source takes one flag list for all sources).

Environment: FLUXION_NATIVE_ARCH=1 adds -march=native (opt-in; the default build runs on any x86-64).
"""
from __future__ import annotations

import os
import re
import sys

from cffi import FFI

NATIVE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(NATIVE_DIR)
SOURCES = ["fluxion.c", "fx_background.c", "fx_pool.c", "fx_simd_portable.c", "fx_simd_avx2.c", "fx_simd_avx512.c",
           "fx_simd_avx512bf16.c", "fx_quant.c", "fx_quant_portable.c", "fx_quant_avx2.c", "fx_quant_avx512.c",
           "fx_quant_avx512vnni.c", "fx_layer.c", "fx_spans.c", "fx_sparse_step.c"]

HEADER = os.path.join(NATIVE_DIR, "fluxion.h")
_CONSTANT = re.compile(r"#define\s+FX_\w+\s+\d+\s*$")


def header_cdef(path: str = HEADER) -> str:
    """The declarations of fluxion.h as cffi's cdef wants them: comments dropped, and of the preprocessor lines only
    the integer constants kept (the include guard and #include go). The header is the one statement of the API, so
    the binding cannot drift from it; the API-mode compile still checks every declaration against the C code."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#") or _CONSTANT.match(ln.strip())]
    return "\n".join(lines)




def compile_flags(sanitize: bool = False) -> tuple[list[str], list[str]]:
    """(compile args, link args) for the current environment."""
    args = ["-O3", "-std=gnu11", "-pthread", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"]
    link = ["-pthread", "-lm"]
    if os.environ.get("FLUXION_NATIVE_ARCH") == "1":
        args.append("-march=native")
    if sanitize:
        args = [a for a in args if a != "-O3"] + ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
        link.append("-fsanitize=address")
    return args, link


def make_builder(sanitize: bool = False, absolute_paths: bool = False) -> FFI:
    # setuptools refuses absolute source paths, so the pip build uses paths relative to the project root (its cwd);
    # a build in a scratch folder (cffi's compile(tmpdir=...)) needs absolute ones.
    base = NATIVE_DIR if absolute_paths else "native"
    args, link = compile_flags(sanitize)
    ffi = FFI()
    ffi.cdef(header_cdef())
    ffi.set_source(
        "fluxion_lite._native",
        '#include "fluxion.h"',
        sources=[os.path.join(base, s) for s in SOURCES],
        include_dirs=[base],
        depends=[os.path.join(base, h) for h in ("fluxion.h", "fx_internal.h", "fx_layout.h", "fx_simd_avx512.h",
                                                 "fx_quant.h", "fx_quant_avx512.h", "fx_quant_ymm.h",
                                                 "fx_attn32_ymm.h")],
        extra_compile_args=args,
        extra_link_args=link,
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    # In-place build: writes fluxion_lite/_native.<abi tag>.so under the project root.
    os.chdir(ROOT)
    out = make_builder(absolute_paths=True).compile(tmpdir=".", verbose="-v" in sys.argv)
    print(out)
