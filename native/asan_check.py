"""Build the native library with AddressSanitizer and run the native tests against that build.

    python native/asan_check.py [extra pytest args]

The instrumented extension is compiled into a scratch folder (the installed one is untouched) and loaded through
FLUXION_NATIVE_SO; libasan is preloaded because the Python interpreter itself is not instrumented.  Leak detection
is off (CPython and torch keep allocations until exit by design).  Exit status is pytest's.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "native"))

from build_native import make_builder  # noqa: E402


def libasan_path() -> str:
    out = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    path = os.path.realpath(out.stdout.strip())
    if not os.path.exists(path):
        sys.exit(f"asan_check: libasan.so not found (gcc -print-file-name gave {out.stdout.strip()!r})")
    return path


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fluxion-asan-") as tmp:
        make_builder(sanitize=True, absolute_paths=True).compile(tmpdir=tmp, verbose=False)
        built = glob.glob(os.path.join(tmp, "fluxion_lite", "_native*.so"))
        if not built:
            sys.exit("asan_check: the instrumented build produced no extension")
        env = dict(os.environ)
        env.update({
            "FLUXION_NATIVE_SO": built[0],
            "LD_PRELOAD": libasan_path(),
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1",
        })
        tests = sorted(str(p) for p in (ROOT / "tests" / "kernels").glob("test_native_*.py"))
        if not tests:
            sys.exit("asan_check: no tests/kernels/test_native_*.py (pytest would run the whole suite instead)")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *sys.argv[1:]]
        print("asan_check:", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
