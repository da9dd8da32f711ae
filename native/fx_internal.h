/* Internal interfaces of the native library: the per-SIMD-path kernel table and the thread pool. */
#ifndef FX_INTERNAL_H
#define FX_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "fluxion.h"

/* The inner loops that differ per instruction set.  Everything else (validation, task splitting, top-k
 * selection, softmax bookkeeping) is shared code in fluxion.c calling through this table once per block, so an
 * indirect call costs nothing next to the block's memory traffic. */
typedef struct fx_kernels {
    const char *name;
    /* s[j*ld + t] = scale * dot(q[j*D ..], K[t*D ..]) for j < r, t < len.  K is 16-bit (bf16 != 0: bf16).
     * pf/pf_lines: cache lines of the NEXT block to prefetch, spread over this block's tokens so the memory
     * system stays busy while this block computes (a burst of prefetches would stall on full miss buffers). */
    void (*qk)(const float *q, int r, const uint16_t *k, int len, int d, int bf16, float scale, float *s, int ld,
               const void *pf, int64_t pf_lines);
    /* acc[j*D + e] += sum_t p[j*ld + t] * V[t*D + e] for j < r.  pf/pf_lines as for qk. */
    void (*pv)(const float *p, int r, int ld, const uint16_t *v, int len, int d, int bf16, float *acc,
               const void *pf, int64_t pf_lines);
    /* x[i] = exp(x[i]) for x[i] <= 0; values below about -87 become 0 (no denormals, no NaN). */
    void (*exp_neg)(float *x, int n);
    /* max of x[0..n), n >= 1 */
    float (*row_max)(const float *x, int n);
    /* x[i] = exp(x[i] - m) (x[i] <= m), returns the sum */
    float (*exp_sum)(float *x, int n, float m);
    /* copy n bytes to a staging buffer that the CPU will not read back (non-temporal stores where possible);
     * the job that uses it calls fence() before finishing */
    void (*stage_copy)(void *dst, const void *src, int64_t n, const void *pf, int64_t pf_lines);
    void (*fence)(void);
    /* score[b] = sum_e qpos[e]*S[b][1][e] + qneg[e]*S[b][0][e] for b < n; S: [n][2][D] 16-bit like K (bf16 != 0:
     * bf16), widened exactly to fp32, so the scores equal those of fp32 summaries bit for bit.
     * (sum_j max(q_j*mn, q_j*mx) == (sum_j max(q_j,0))*mx + (sum_j min(q_j,0))*mn because mn <= mx.) */
    void (*bound)(const float *qpos, const float *qneg, const uint16_t *s, int n, int d, int bf16, float *score);
    /* Fold rows K[0..len) into per-dim min/max, 16-bit like K (init != 0: start from the first row, else from the
     * stored mn/mx).  Min and max of 16-bit values are 16-bit values, so the narrowing store is exact. */
    void (*minmax)(const uint16_t *k, int len, int d, int bf16, uint16_t *mn, uint16_t *mx, int init);
    /* One bound per query head (per-head scoring): out[j*ld + b] = sum_e q[j*d+e] * (q[j*d+e] > 0 ? S[b][1][e] :
     * S[b][0][e]) for j < r, b < n; q [r][d]; S 16-bit as for bound, widened exactly.  One multiply-add per element
     * and head (the min or the max, picked by the sign of q, instead of two products); each summary is read once
     * for all r heads. */
    void (*bound_heads)(const float *q, int r, const uint16_t *s, int n, int d, int bf16, float *out, int64_t ld);
    /* score[b] = max over j < r of (x[j*ld + b] - m[j]) for b < n (n >= 1). */
    void (*gap_max)(const float *x, int64_t ld, const float *m, int r, int n, float *score);
    /* Optional (NULL on paths without bf16 dot products): qk for bf16 K with q given as bf16 values qb [r][D]
     * that equal the fp32 q exactly (q_to_bf16 said so), so every product is exact and only the summation order
     * differs from qk's.  Otherwise qk's contract. */
    void (*qk_bf16)(const uint16_t *qb, int r, const uint16_t *k, int len, int d, float scale, float *s, int ld,
                    const void *pf, int64_t pf_lines);
    /* qb[i] = q[i] as bf16 for i < n (n a multiple of 16); returns 1 when every q[i] is a bf16 value and not a
     * denormal (which qk_bf16's instruction would read as 0), else 0: qb is then incomplete, run qk. */
    int (*q_to_bf16)(const float *q, int n, uint16_t *qb);
    /* qk and pv for fp32 K / V (the dense CPU KV cache, fx_decode_attention): s[j*ld + t] = scale * dot(q[j*D ..],
     * K[t*D ..]) for j < r, t < len; acc[j*D + e] += sum_t p[j*ld + t] * V[t*D + e].  No prefetch hints: the rows
     * are contiguous and the hardware prefetcher follows them. */
    void (*qk32)(const float *q, int r, const float *k, int len, int d, float scale, float *s, int ld);
    void (*pv32)(const float *p, int r, int ld, const float *v, int len, int d, float *acc);
} fx_kernels;

/* One block of an online softmax over r heads: s [r][len] holds the block's scores and leaves holding their weights
 * exp(s - m'), where m' is each head's running maximum after the block; l [r] (the running sums of weights) and
 * acc [r][D] (the weighted values so far) are rescaled to m'.  The caller then adds the block's values (pv). */
static inline void fx_softmax_block(const fx_kernels *K, float *s, int len, int r, int D, float *m, float *l,
                                    float *acc) {
    for (int j = 0; j < r; j++) {
        float *sj = s + j * len;
        float mb = K->row_max(sj, len);
        float mn = mb > m[j] ? mb : m[j];
        float corr = m[j] == -INFINITY ? 0.0f : expf(m[j] - mn);
        m[j] = mn;
        l[j] = l[j] * corr + K->exp_sum(sj, len, mn);
        if (corr != 1.0f) {
            float *aj = acc + (int64_t)j * D;
            for (int e = 0; e < D; e++) aj[e] *= corr;
        }
    }
}

extern const fx_kernels fx_kernels_portable;
extern const fx_kernels fx_kernels_avx2;
extern const fx_kernels fx_kernels_avx512;
extern const fx_kernels fx_kernels_avx512_bf16; /* fx_kernels_avx512 plus qk_bf16 / q_to_bf16 */

/* fx_simd_avx512bf16.c (AVX512-BF16): the qk_bf16 / q_to_bf16 of fx_kernels_avx512_bf16 */
void fx_qk_bf16_avx512bf16(const uint16_t *qb, int r, const uint16_t *k, int len, int d, float scale, float *s,
                           int ld, const void *pf, int64_t pf_lines);
int fx_q_to_bf16_avx512bf16(const float *q, int n, uint16_t *qb);

/* Thread pool.  fn(ctx, tid, nthreads) runs on the caller and on every worker that joins in time (a worker that
 * wakes after the caller has finished its own share does not join); participants share work through their own
 * atomic counters in ctx, so a job must be correct with any subset of participants (including the caller alone,
 * as when the pool is busy).  Participants that store with non-temporal stores fence before returning. */
typedef void (*fx_job_fn)(void *ctx, int tid, int nthreads);
void fx_pool_run(fx_job_fn fn, void *ctx);
int fx_pool_set_threads(int n);
int fx_pool_threads(void);
int64_t fx_pool_set_spin_ns(int64_t ns); /* idle spin before sleeping; < 0: the default; returns the value set */
int64_t fx_pool_spin_ns(void);
void fx_pool_wake(void);                 /* sleeping workers wake and spin: call ahead of a call after an idle gap */

/* A job's work items grouped by task, run from inside a pool job by every participant: items are numbered
 * 0 .. first[n_tasks), task t owning first[t] .. first[t + 1] - 1.  Each participant claims the next number from
 * *next (claims rise, so its task index only moves forward) and calls item(job, t, k, i) for the k-th item of task
 * t (global number i); whoever finishes a task's last item (counted in done[t], zeroed by the caller) calls
 * task_done(job, t), once per task with items.  Tasks without items get no call. */
typedef void (*fx_item_fn)(void *job, int64_t task, int64_t k, int64_t item);
typedef void (*fx_task_done_fn)(void *job, int64_t task);
void fx_run_task_items(void *job, _Atomic int64_t *next, const int64_t *first, int64_t n_tasks, _Atomic int32_t *done,
                       fx_item_fn item, fx_task_done_fn task_done);

/* Shared by fluxion.c and fx_background.c: the SIMD path in use, and the validation of a view, of a call's GQA
 * group and of one task's common fields (need_kept: the task's granularity must be kept in the pages).  Each
 * returns FX_OK or an FX_E* code. */
const fx_kernels *fx_kern(void);
int fx_check_view(const fx_kv_view *kv);
int fx_check_group(const fx_kv_view *kv, int32_t n_q_heads);
int fx_check_task(const fx_kv_view *kv, const int32_t *t, int64_t q_rows, int need_kept);
/* Merge nc partial attentions of one task by log-sum-exp: parts [nc][r*D + r] (each: normalised out [r][D], then
 * lse [r]; lse -inf = empty) -> out [r][D], lse [r] (out 0, lse -inf where every part is empty). */
void fx_merge_partials(const float *parts, int64_t nc, int r, int D, float *out, float *lse);
/* End of an online softmax over one task's chunk: acc [r][D] (sum of weight x value, weights exp(x - m[j])) divided
 * by l[j] (the weights' sum), lse[j] = m[j] + log l[j]; l[j] = 0 (nothing seen): lse -inf, acc left as is (0). */
void fx_finish_partial(float *acc, float *lse, const float *m, const float *l, int r, int D);

/* Scalar 16-bit -> fp32, shared by all paths for tails and the portable kernels. */
static inline float fx_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}
float fx_f16_to_f32(uint16_t h);

/* Scalar fp32 -> 16-bit, round to nearest even (exact for values that are 16-bit values, as summaries are). */
static inline uint16_t fx_f32_to_bf16(float f) {
    union { float f; uint32_t u; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
uint16_t fx_f32_to_f16(float f);

/* Prefetch (towards L2) part `part` of `parts` equal shares of `lines` cache lines starting at pf. */
static inline void fx_prefetch_share(const void *pf, int64_t lines, int64_t part, int64_t parts) {
    if (!pf) return;
    for (int64_t l = part * lines / parts, e = (part + 1) * lines / parts; l < e; l++)
        __builtin_prefetch((const char *)pf + l * 64, 0, 2);
}

/* Prefetch (towards L2) `lines` cache lines from pf in `parts` even steps: fx_prefetch_share's spread without its
 * two divisions per step (at one step per token and strip, the divisions cost pv ~40% in cache). */
typedef struct {
    const char *p;
    int64_t per, rem, parts, err;
} pf_cursor;

static inline __attribute__((always_inline)) pf_cursor pfc_init(const void *pf, int64_t lines, int64_t parts) {
    pf_cursor c = {(const char *)pf, 0, 0, parts, 0};
    if (pf && parts > 0 && lines > 0) {
        c.per = lines / parts;
        c.rem = lines % parts;
        /* one line of every further 4 KiB page of the range up front: with 4 KiB pages each starts a page walk,
         * which then overlaps the in-order prefetches (~+4% at 1 thread on 64-token blocks without huge pages) */
        for (uintptr_t a = ((uintptr_t)pf + 4095) & ~(uintptr_t)4095; a < (uintptr_t)pf + lines * 64; a += 4096)
            __builtin_prefetch((const void *)a, 0, 2);
    } else {
        c.p = NULL;
    }
    return c;
}

static inline __attribute__((always_inline)) void pfc_step(pf_cursor *c) {
    if (!c->p) return;
    int64_t n = c->per;
    c->err += c->rem;
    if (c->err >= c->parts) {
        c->err -= c->parts;
        n++;
    }
    for (; n > 0; n--, c->p += 64) __builtin_prefetch(c->p, 0, 2);
}

#endif
