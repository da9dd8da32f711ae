"""Issue 5's peer rows: llama.cpp's batch-1 decode step on a random F16 GGUF of the Llama-3.1-8B shape, KV on the GPU
and KV in host RAM, measured on the machine that runs bench/tpot.py.

The llama.cpp is the one llama-cpp-python 0.3.36 vendors (its PyPI sdist), built as a library with CUDA for the local
GPU; bench/llamacpp_peer/peer_step.c times the steps (why not llama-bench: see that file). Steps:

  trim   (any machine)  sdist -> a tarball of what the library build needs (~5 MB: no other GPU backends, tools,
                        tests, docs), small enough to carry to a GPU host that cannot reach PyPI
  build  (GPU host)     cmake + nvcc: libllama and libggml* (CUDA, CMAKE_CUDA_ARCHITECTURES), then peer_step
  gguf   (GPU host)     a random-weight F16 GGUF of a bench/tpot.py shape (16 GB for llama3.1-8b), written in place
  run    (GPU host)     peer_step per depth; prints the table and writes JSON (medians, every step's time)

Usage:
  python bench/llamacpp_peer.py trim llama_cpp_python-0.3.36.tar.gz .peer/llama.cpp.tgz
  python bench/llamacpp_peer.py build .peer/llama.cpp.tgz /tmp/peer --cuda-arch 90
  python bench/llamacpp_peer.py gguf --shape llama3.1-8b /tmp/peer/llama3.1-8b-f16.gguf
  python bench/llamacpp_peer.py run --bin /tmp/peer/peer_step --model /tmp/peer/llama3.1-8b-f16.gguf \
      --depths 8192 32768 65536 --steps 16 --threads 16 --out bench/results/llamacpp_peer_h200.json
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# what the library build reads, relative to the sdist's vendor/llama.cpp
KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "licenses/", "ggml/CMakeLists.txt", "ggml/cmake/",
        "ggml/include/", "vendor/CMakeLists.txt", "vendor/hash/", "vendor/nlohmann/", "vendor/sheredom/")
GGML_SRC_DIRS = ("ggml-cpu/", "ggml-cuda/", "ggml-blas/")  # of ggml/src/'s backend folders, the ones kept
# the numbers issue 5 quotes (llama-cpp-python 0.3.36 on this H200 host, 16 threads), printed beside ours
ISSUE_KV_GPU_MS = {8192: 5.33, 32768: 6.81, 65536: 8.65}
ISSUE_KV_HOST_MS = {8192: 68.8, 32768: 230.0, 65536: 508.0}
ROW_KEYS = ("kv_gpu_fa_ms", "kv_gpu_ms", "kv_host_ms")  # peer_step's rows: see bench/llamacpp_peer/peer_step.c


def _kept(rel: str) -> bool:
    if rel.startswith("ggml/src/"):
        rest = rel[len("ggml/src/"):]
        return "/" not in rest or rest.startswith(GGML_SRC_DIRS)
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP)


def trim(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as src:
        root = next(m.name for m in src.getmembers() if m.name.endswith("/vendor/llama.cpp/CMakeLists.txt"))
        base = root[: -len("CMakeLists.txt")]
        out.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with tarfile.open(out, "w:gz") as dst:
            for m in src.getmembers():
                if not m.isfile() or not m.name.startswith(base) or not _kept(m.name[len(base):]):
                    continue
                rel = m.name[len(base):]
                data = src.extractfile(m).read()  # type: ignore[union-attr]
                if rel == "vendor/CMakeLists.txt":  # the vendored libraries that only tools and common use
                    data = b"\n".join(line for line in data.splitlines()
                                      if b"miniaudio" not in line and b"add_subdirectory(stb)" not in line) + b"\n"
                info = tarfile.TarInfo("llama.cpp/" + rel)
                info.size, info.mode, info.mtime = len(data), m.mode, m.mtime
                dst.addfile(info, io.BytesIO(data))
                n += 1
    print(f"wrote {out}: {n} files, {out.stat().st_size / 2**20:.1f} MiB")


def build(tgz: Path, work: Path, cuda_arch: str, jobs: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tgz) as t:
        t.extractall(work, filter="data")
    src, bld = work / "llama.cpp", work / "build"
    cfg = ["cmake", "-S", str(src), "-B", str(bld), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
           *(["-DGGML_CUDA=OFF"] if cuda_arch == "none" else ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]),
           "-DLLAMA_BUILD_COMMON=OFF",
           "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]
    t0 = time.time()
    subprocess.run(cfg, check=True)
    subprocess.run(["cmake", "--build", str(bld), "--target", "llama", "-j", str(jobs)], check=True)
    libdirs = sorted({str(p.parent) for p in bld.rglob("*.so")})
    cmd = ["cc", "-O2", "-Wall", "-o", str(work / "peer_step"), str(HERE / "llamacpp_peer" / "peer_step.c"),
           f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", *[f"-L{d}" for d in libdirs], "-lllama",
           *[f"-Wl,-rpath,{d}" for d in libdirs]]
    subprocess.run(cmd, check=True)
    print(f"built {work / 'peer_step'} in {time.time() - t0:.0f} s")


def write_gguf(shape_name: str, out: Path, seed: int) -> None:
    """A random F16 GGUF of the shape (bench/random_gguf.py)."""
    sys.path.insert(0, str(HERE))
    import random_gguf

    random_gguf.write(shape_name, out, "f16", seed)


def run(binary: Path, model: Path, depths: list[int], steps: int, threads: int, out: Path) -> None:
    """peer_step per depth, cheapest first; the JSON is rewritten after each depth, so a timeout keeps what ran."""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except FileNotFoundError:  # a CPU-only check of the program
        gpu = "none"
    rows: list[dict] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for depth in sorted(depths):
        t0 = time.time()
        proc = subprocess.run([str(binary), str(model), str(depth), str(steps), str(threads)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"peer_step failed at depth {depth} (exit {proc.returncode})")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        for key in ROW_KEYS:
            row[key + "_median"] = statistics.median(row[key])
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"depth {depth}: " + ", ".join(f"{k} {row[k + '_median']:.2f}" for k in ROW_KEYS)
              + f" (prefill {row['prefill_s']:.1f} s, {row['wall_s']} s)", flush=True)
        out.write_text(json.dumps({"machine": platform.node(), "gpu": gpu, "cpus": os.cpu_count(),
                                   "model": model.name, "threads": threads, "steps": steps,
                                   "llama_cpp": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp",
                                   "issue_rows_ms": {"kv_gpu": ISSUE_KV_GPU_MS, "kv_host": ISSUE_KV_HOST_MS},
                                   "rows": rows}, indent=1))
    print(f"\nllama.cpp (llama-cpp-python 0.3.36's vendored copy), {model.name}, batch 1, {threads} threads; "
          f"median of {steps} steps")
    print(f"{'depth':>7} {'KV on GPU, FA':>14} {'KV on GPU':>10} {'issue':>7} {'KV in host':>11} {'issue':>7}  (ms)")
    for r in rows:
        d = r["depth"]
        print(f"{d:>7} {r['kv_gpu_fa_ms_median']:>14.2f} {r['kv_gpu_ms_median']:>10.2f} "
              f"{ISSUE_KV_GPU_MS.get(d, float('nan')):>7.2f} {r['kv_host_ms_median']:>11.1f} "
              f"{ISSUE_KV_HOST_MS.get(d, float('nan')):>7.1f}")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim")
    t.add_argument("sdist", type=Path)
    t.add_argument("out", type=Path)
    b = sub.add_parser("build")
    b.add_argument("tgz", type=Path)
    b.add_argument("work", type=Path)
    b.add_argument("--cuda-arch", default="90", help="'none': a CPU-only build (to check the program off the GPU host)")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    g = sub.add_parser("gguf")
    g.add_argument("--shape", default="llama3.1-8b")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--bin", type=Path, required=True)
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--depths", type=int, nargs="+", default=[8192, 32768, 65536])
    r.add_argument("--steps", type=int, default=16)
    r.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "trim":
        trim(a.sdist, a.out)
    elif a.cmd == "build":
        build(a.tgz, a.work, a.cuda_arch, a.jobs)
    elif a.cmd == "gguf":
        write_gguf(a.shape, a.out, a.seed)
    else:
        run(a.bin, a.model, a.depths, a.steps, a.threads, a.out)


if __name__ == "__main__":
    main()
