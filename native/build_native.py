"""cffi API-mode build of the native sparse-attention library (module fluxion_lite._native).

Used three ways:
  * `pip install .` / `pip install -e .`: setup.py names `native/build_native.py:ffibuilder` in cffi_modules.
  * `python3 native/build_native.py`: in-place build into fluxion_lite/ (no pip needed, e.g. on a bare host).
  * native/asan_check.py: `make_builder(sanitize=True)` compiled into a scratch folder.

SIMD paths: every source compiles with the same flags; fx_simd_avx2.c / fx_simd_avx512.c enable their instruction
sets with a `#pragma GCC target` of their own, and fluxion.c picks one at run time with __builtin_cpu_supports.
That keeps per-file flags out of setuptools (cffi's set_source takes one flag list for all sources).

Environment: FLUXION_NATIVE_ARCH=1 adds -march=native (opt-in; the default build runs on any x86-64).
"""
from __future__ import annotations

import os
import sys

from cffi import FFI

NATIVE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(NATIVE_DIR)
SOURCES = ["fluxion.c", "fx_pool.c", "fx_simd_portable.c", "fx_simd_avx2.c", "fx_simd_avx512.c"]

# Must match fluxion.h (the API-mode compile checks every declaration against the header).
CDEF = """
#define FX_TASK_FIELDS 9
#define FX_MAX_GROUP 16
#define FX_MAX_DIM 256
#define FX_MAX_BLOCK 128
typedef struct fx_kv_view {
    int32_t n_slots; int32_t max_pages; int32_t n_kv_heads; int32_t head_dim; int32_t page_tokens;
    int32_t dtype; int32_t gran_mask; int64_t *n_tokens; uint8_t **pages;
} fx_kv_view;
int fx_version(void);
int fx_set_threads(int n);
int fx_get_threads(void);
int64_t fx_set_spin_ns(int64_t ns);
void fx_wake_threads(void);
int fx_set_simd(int path);
int fx_get_simd(void);
int fx_simd_supported(int path);
void fx_set_checks(int on);
void fx_set_stream_stores(int on);
int64_t fx_page_bytes(int32_t n_kv_heads, int32_t head_dim, int32_t page_tokens, int32_t gran_mask);
int fx_append(const fx_kv_view *kv, const int32_t *slots, const int64_t *row_start, const int64_t *row_count,
              int64_t n_items, const void *src_k, const void *src_v, int64_t n_rows, int64_t *err_index);
int fx_summaries_update(const fx_kv_view *kv, const int32_t *slots, const int64_t *from_token, int64_t n_items,
                        int64_t *err_index);
int64_t fx_topk_workspace_floats(int64_t n_tasks, int64_t max_blocks);
int64_t fx_topk_scoring_workspace_floats(int64_t n_tasks, int64_t max_blocks, int32_t group, int32_t scoring);
int fx_group_topk(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                  int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                  float *workspace, int64_t workspace_floats, int64_t *err_index);
int fx_group_topk_scoring(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                          const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, int32_t *out_ids,
                          float *out_scores, int32_t *out_counts, float *workspace, int64_t workspace_floats,
                          int64_t *err_index);
int fx_group_topk_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                         const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, const int32_t *pins,
                         const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids, float *out_scores,
                         int32_t *out_counts, float *workspace, int64_t workspace_floats, int64_t *err_index);
int64_t fx_attention_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim);
int fx_sparse_attention(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                        const int32_t *tasks, int64_t n_tasks, const int32_t *ids, const int32_t *counts,
                        int32_t k_cap, float scale, float *out, float *lse, float *workspace,
                        int64_t workspace_floats, int64_t *err_index);
int fx_select_attend(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                     int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                     float scale, const int64_t *rows, int64_t n_rows, float *out, float *lse, float *workspace,
                     int64_t workspace_floats, int64_t *selected_tokens, double *seconds, int64_t *err_index);
int fx_select_attend_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                            const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring,
                            const int32_t *pins, const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids,
                            float *out_scores, int32_t *out_counts, float scale, const int64_t *rows, int64_t n_rows,
                            float *out, float *lse, float *workspace, int64_t workspace_floats,
                            int64_t *selected_tokens, double *seconds, int64_t *err_index);
int fx_gather(const fx_kv_view *kv, const int32_t *tasks, int64_t n_tasks, const int32_t *ids,
              const int32_t *counts, int32_t k_cap, const int64_t *out_offset, int64_t cap_tokens, void *k_out,
              void *v_out, int32_t *out_tokens, int64_t *err_index);
double fx_read_bandwidth_probe(const void *buf, int64_t n_bytes, int32_t repeats);
"""


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
    ffi.cdef(CDEF)
    ffi.set_source(
        "fluxion_lite._native",
        '#include "fluxion.h"',
        sources=[os.path.join(base, s) for s in SOURCES],
        include_dirs=[base],
        depends=[os.path.join(base, h) for h in ("fluxion.h", "fx_internal.h")],
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
