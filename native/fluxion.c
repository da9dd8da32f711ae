/* fluxion.c -- validation, work splitting and the shared parts of the kernels; see fluxion.h for the contract. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include "fx_internal.h"
#include "fx_layout.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

int fx_version(void) { return 12; } /* 12: fx_dequantize_bf16 and the one-call sparse decode step, 11: the dense decode attention appends its token, the one-call decode step, 10: streaming spans (fx_spans.c), 9: decoder layer and dense decode attention (fx_layer.c), 8: quantized-weight products (fx_quant.c), 7: value sums + unread background, 6: midrange scoring, 5: pinned blocks (4: block summaries in the KV dtype, 3: per-head scoring) */

/* ------------------------------------------------------------------------------------------------ settings -- */

static const fx_kernels *g_kern = NULL;
static int g_simd = -1;
static int g_checks = 1;

#if defined(__x86_64__) || defined(__i386__)
/* AVX512-BF16 by hand (CPUID leaf 7 subleaf 1, EAX bit 5), not __builtin_cpu_supports: older compilers do not
 * know the name.  The bit only says the CPU has the instructions; the OS must also save the ZMM and opmask state
 * (XCR0 bits 1, 2, 5, 6, 7), which is checked here too rather than left to the AVX-512 check's library. */
static int cpu_has_avx512_bf16(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return 0;
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0xE6) != 0xE6) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1;
}
#endif

int fx_simd_supported(int path) {
    switch (path) {
        case FX_SIMD_PORTABLE: return 1;
#if defined(__x86_64__) || defined(__i386__)
        case FX_SIMD_AVX2:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case FX_SIMD_AVX512:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   fx_simd_supported(FX_SIMD_AVX2);
        case FX_SIMD_AVX512_BF16: return fx_simd_supported(FX_SIMD_AVX512) && cpu_has_avx512_bf16();
#endif
        default: return 0;
    }
}

static const fx_kernels *kernels_of(int path) {
    switch (path) {
        case FX_SIMD_AVX512_BF16: return &fx_kernels_avx512_bf16;
        case FX_SIMD_AVX512: return &fx_kernels_avx512;
        case FX_SIMD_AVX2: return &fx_kernels_avx2;
        default: return &fx_kernels_portable;
    }
}

int fx_set_simd(int path) {
    if (path == FX_SIMD_AUTO) {
        path = fx_simd_supported(FX_SIMD_AVX512_BF16) ? FX_SIMD_AVX512_BF16
               : fx_simd_supported(FX_SIMD_AVX512)    ? FX_SIMD_AVX512
               : fx_simd_supported(FX_SIMD_AVX2)      ? FX_SIMD_AVX2
                                                      : FX_SIMD_PORTABLE;
    }
    if (!fx_simd_supported(path)) return -FX_E_SIMD;
    g_kern = kernels_of(path);
    g_simd = path;
    return path;
}

int fx_get_simd(void) {
    if (!g_kern) fx_set_simd(FX_SIMD_AUTO);
    return g_simd;
}

const fx_kernels *fx_kern(void) {
    if (!g_kern) fx_set_simd(FX_SIMD_AUTO);
    return g_kern;
}

int fx_set_threads(int n) { return fx_pool_set_threads(n); }
int fx_get_threads(void) { return fx_pool_threads(); }
int64_t fx_set_spin_ns(int64_t ns) { return fx_pool_set_spin_ns(ns); }
void fx_wake_threads(void) { fx_pool_wake(); }
void fx_set_checks(int on) { g_checks = on != 0; }

/* ---------------------------------------------------------------------------------------------- page layout -- */

int64_t fx_page_bytes(int32_t n_kv_heads, int32_t head_dim, int32_t page_tokens, int32_t gran_mask) {
    int64_t bytes = 2 * (int64_t)n_kv_heads * page_tokens * head_dim * 2;
    for (int i = 0; i < 4; i++)
        if (gran_mask & (1 << i)) bytes += (int64_t)n_kv_heads * (page_tokens / (16 << i)) * 2 * head_dim * 2;
    if (gran_mask & FX_KEEP_VALUE_SUMS) bytes += (int64_t)n_kv_heads * (page_tokens / FX_MAX_BLOCK) * head_dim * 4;
    return bytes;
}

/* ------------------------------------------------------------------------------------------------ validation -- */

int fx_check_view(const fx_kv_view *kv) {
    if (!kv || !kv->pages || !kv->n_tokens) return FX_E_VIEW;
    if (kv->n_slots <= 0 || kv->max_pages <= 0 || kv->n_kv_heads <= 0) return FX_E_VIEW;
    if (kv->head_dim <= 0 || kv->head_dim % 16 || kv->head_dim > FX_MAX_DIM) return FX_E_VIEW;
    if (kv->page_tokens <= 0 || kv->page_tokens % FX_MAX_BLOCK) return FX_E_VIEW;
    if (kv->dtype != FX_F16 && kv->dtype != FX_BF16) return FX_E_VIEW;
    if (kv->gran_mask < 0 || kv->gran_mask > (15 | FX_KEEP_VALUE_SUMS)) return FX_E_VIEW;
    return FX_OK;
}

/* n_tokens of a slot within the table's capacity, and every page holding its tokens present. */
static int check_slot_pages(const fx_kv_view *kv, int slot, int64_t n_tok) {
    if (n_tok < 0 || n_tok > (int64_t)kv->max_pages * kv->page_tokens) return FX_E_PAGE;
    int64_t n_pages = (n_tok + kv->page_tokens - 1) / kv->page_tokens;
    for (int64_t p = 0; p < n_pages; p++)
        if (!kv->pages[(int64_t)slot * kv->max_pages + p]) return FX_E_PAGE;
    return FX_OK;
}

int fx_check_group(const fx_kv_view *kv, int32_t n_q_heads) {
    if (n_q_heads <= 0 || n_q_heads % kv->n_kv_heads) return FX_E_GROUP;
    if (n_q_heads / kv->n_kv_heads > FX_MAX_GROUP) return FX_E_GROUP;
    return FX_OK;
}

/* Common task fields; need_kept: the granularity's summaries must be in the pages. */
int fx_check_task(const fx_kv_view *kv, const int32_t *t, int64_t q_rows, int need_kept) {
    if (t[0] < 0 || t[0] >= kv->n_slots) return FX_E_SLOT;
    if (q_rows >= 0 && (t[1] < 0 || t[1] >= q_rows)) return FX_E_QROW;
    if (t[2] < 0 || t[2] >= kv->n_kv_heads) return FX_E_HEAD;
    int gi = gran_index(t[3]);
    if (gi < 0 || (need_kept && !(kv->gran_mask & (1 << gi)))) return FX_E_GRAN;
    return check_slot_pages(kv, t[0], kv->n_tokens[t[0]]);
}

static int check_selection(const fx_kv_view *kv, const int32_t *t, const int32_t *ids, int32_t count, int32_t k_cap) {
    if (count < 0 || count > k_cap) return FX_E_K;
    int64_t n_blocks = (kv->n_tokens[t[0]] + t[3] - 1) / t[3];
    for (int32_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n_blocks) return FX_E_BLOCK;
    return FX_OK;
}

/* One task of a call over selected blocks (sparse attention, gather, block-read probe): its fields, its count
 * within k_cap, and (with checks on) its block ids. */
static int check_selected_task(const fx_kv_view *kv, const int32_t *t, int64_t q_rows, const int32_t *ids,
                               int32_t count, int32_t k_cap) {
    int rc = fx_check_task(kv, t, q_rows, 0);
    if (!rc) rc = count < 0 || count > k_cap ? FX_E_K : FX_OK;
    if (!rc && g_checks) rc = check_selection(kv, t, ids, count, k_cap);
    return rc;
}

/* -------------------------------------------------------------------------------------- work-item cursors -- */

/* Participants claim item numbers from a shared counter in increasing order and walk a cursor forward to find
 * (task, chunk) for each claim: amortised O(items) per participant, no index buffer needed. */
typedef struct {
    int64_t task, chunk, item; /* item = global number of (task, chunk) */
} cursor;

static inline int64_t chunks_of(int32_t count, int32_t cb) { return (count + cb - 1) / cb; }

/* The blocks [*b0, *b1) of its task that item c covers: cb of them from chunk * cb, fewer at the task's end. */
static inline void item_span(const cursor *c, const int32_t *counts, int32_t cb, int32_t *b0, int32_t *b1) {
    *b0 = (int32_t)(c->chunk * cb);
    *b1 = *b0 + cb < counts[c->task] ? *b0 + cb : counts[c->task];
}

static int cursor_seek(cursor *c, int64_t target, const int32_t *counts, int64_t n_tasks, int32_t cb) {
    while (c->task < n_tasks) {
        int64_t nc = chunks_of(counts[c->task], cb);
        if (target < c->item - c->chunk + nc) {
            c->chunk += target - c->item;
            c->item = target;
            return 1;
        }
        c->item += nc - c->chunk;
        c->chunk = 0;
        c->task++;
    }
    return 0;
}

/* Blocks per work item: about FX_ITEMS_PER_THREAD items per participant, at least 2 blocks each.  Dynamic claiming
 * balances the load to within one item, so smaller items shorten the tail where some threads already idle: at 16
 * threads and a 10% budget of 32K tokens an item is 2 blocks (64 KiB of K+V, ~10 us), so the tail is a few us.
 * Claims are one atomic add each (a few hundred per call), and attention merges one partial per item. */
#define FX_ITEMS_PER_THREAD 16
static int32_t chunk_blocks(const int32_t *counts, int64_t n_tasks) {
    int64_t total = 0;
    for (int64_t i = 0; i < n_tasks; i++) total += counts[i];
    int64_t target = FX_ITEMS_PER_THREAD * (int64_t)fx_pool_threads();
    int64_t cb = (total + target - 1) / target;
    if (cb < 2) cb = 2;
    if (cb > (1 << 30)) cb = 1 << 30;
    return (int32_t)cb;
}

/* ------------------------------------------------------------------------------------------ append/summary -- */

typedef struct {
    const fx_kv_view *kv;
    const int32_t *slots;
    const int64_t *lo, *hi;      /* token range [lo, hi) per item (hi: new length) */
    const int64_t *row_start;    /* NULL: summaries only */
    const uint16_t *src_k, *src_v;
    int64_t n_items;
    _Atomic int64_t next;
    const fx_kernels *kern;
} append_job;

/* Fold the values of tokens [lo, hi) (one page, head h) into their 128-token blocks' fp32 sums, token by token in
 * order; a block whose first token is in the range starts from zero. */
static void add_value_sums(const fx_kv_view *kv, int slot, int h, int64_t lo, int64_t hi) {
    int64_t D = kv->head_dim, voff = v_offset(kv);
    int bf16 = kv->dtype == FX_BF16;
    for (int64_t b = lo / FX_MAX_BLOCK; b * FX_MAX_BLOCK < hi; b++) {
        int64_t t0 = b * FX_MAX_BLOCK > lo ? b * FX_MAX_BLOCK : lo;
        int64_t t1 = (b + 1) * FX_MAX_BLOCK < hi ? (b + 1) * FX_MAX_BLOCK : hi;
        float *vs = value_sums(kv, slot, h, b);
        if (t0 == b * FX_MAX_BLOCK) memset(vs, 0, sizeof(float) * (size_t)D);
        for (int64_t t = t0; t < t1; t++) {
            const uint16_t *v = k_row(kv, slot, h, t) + voff;
            for (int64_t e = 0; e < D; e++) vs[e] += bf16 ? fx_bf16_to_f32(v[e]) : fx_f16_to_f32(v[e]);
        }
    }
}

/* Units: (item, page touched, head). */
static void append_unit(append_job *J, int64_t i, int64_t page, int h) {
    const fx_kv_view *kv = J->kv;
    int64_t P = kv->page_tokens, D = kv->head_dim, H = kv->n_kv_heads;
    int slot = J->slots[i];
    int64_t lo = J->lo[i] > page * P ? J->lo[i] : page * P;
    int64_t hi = J->hi[i] < (page + 1) * P ? J->hi[i] : (page + 1) * P;
    if (lo >= hi) return;
    int bf16 = kv->dtype == FX_BF16;
    if (J->row_start) {
        for (int64_t t = lo; t < hi; t++) {
            int64_t src = ((J->row_start[i] + t - J->lo[i]) * H + h) * D;
            uint16_t *dk = k_row(kv, slot, h, t);
            memcpy(dk, J->src_k + src, (size_t)D * 2);
            memcpy(dk + v_offset(kv), J->src_v + src, (size_t)D * 2);
        }
    }
    for (int gi = 0; gi < 4; gi++) {
        if (!(kv->gran_mask & (1 << gi))) continue;
        int64_t g = 16 << gi;
        for (int64_t b = lo / g; b * g < hi; b++) {
            int64_t t0 = b * g > lo ? b * g : lo;
            int64_t t1 = (b + 1) * g < hi ? (b + 1) * g : hi;
            uint16_t *s = summary(kv, slot, h, gi, b);
            J->kern->minmax(k_row(kv, slot, h, t0), (int)(t1 - t0), (int)D, bf16, s, s + D, t0 == b * g);
        }
    }
    if (kv->gran_mask & FX_KEEP_VALUE_SUMS) add_value_sums(kv, slot, h, lo, hi);
}

static void append_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    append_job *J = ctx;
    const fx_kv_view *kv = J->kv;
    int64_t P = kv->page_tokens, H = kv->n_kv_heads;
    /* cursor over (item, page, head) units */
    int64_t item = 0, unit_base = 0;
    for (;;) {
        int64_t u = atomic_fetch_add(&J->next, 1);
        for (;;) {
            if (item >= J->n_items) return;
            int64_t first = J->lo[item] / P, last = J->hi[item] > J->lo[item] ? (J->hi[item] - 1) / P : first - 1;
            int64_t n_units = (last - first + 1) * H;
            if (u < unit_base + n_units) {
                int64_t k = u - unit_base;
                append_unit(J, item, first + k / H, (int)(k % H));
                break;
            }
            unit_base += n_units;
            item++;
        }
    }
}

/* Appends of at most this many (item, page, head) units run on the caller alone: a decode step's one token per
 * sequence is a few hundred bytes per unit, and waking the pool for it cost more than the copies (on the 2-core VM:
 * ~10 us for one token x 8 heads on the caller, 30 us and more with the second thread). */
enum { FX_APPEND_INLINE_UNITS = 64 };

static int run_append(const fx_kv_view *kv, const int32_t *slots, const int64_t *lo, const int64_t *hi,
                      const int64_t *row_start, int64_t n_items, const void *src_k, const void *src_v) {
    append_job J = {kv, slots, lo, hi, row_start, src_k, src_v, n_items, 0, fx_kern()};
    int64_t units = 0, P = kv->page_tokens;
    for (int64_t i = 0; i < n_items && units <= FX_APPEND_INLINE_UNITS; i++)
        if (hi[i] > lo[i]) units += ((hi[i] - 1) / P - lo[i] / P + 1) * kv->n_kv_heads;
    if (units <= FX_APPEND_INLINE_UNITS)
        append_worker(&J, 0, 1); /* correct with any subset of participants, the caller alone included */
    else
        fx_pool_run(append_worker, &J);
    return FX_OK;
}

/* Token ranges are staged on the stack in chunks, so any number of items works without allocating. */
enum { FX_RANGE_CHUNK = 512 };

int fx_append(const fx_kv_view *kv, const int32_t *slots, const int64_t *row_start, const int64_t *row_count,
              int64_t n_items, const void *src_k, const void *src_v, int64_t n_rows, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (rc) return rc;
    int64_t los[FX_RANGE_CHUNK], his[FX_RANGE_CHUNK];
    for (int64_t base = 0; base < n_items; base += FX_RANGE_CHUNK) {
        int64_t n = n_items - base < FX_RANGE_CHUNK ? n_items - base : FX_RANGE_CHUNK;
        for (int64_t i = 0; i < n; i++) {
            int64_t ii = base + i;
            *err_index = ii;
            int slot = slots[ii];
            if (slot < 0 || slot >= kv->n_slots) return FX_E_SLOT;
            if (row_count[ii] < 0 || row_start[ii] < 0 || row_start[ii] + row_count[ii] > n_rows) return FX_E_APPEND;
            int64_t n_old = kv->n_tokens[slot];
            if (n_old < 0 || n_old + row_count[ii] > (int64_t)kv->max_pages * kv->page_tokens) return FX_E_APPEND;
            rc = check_slot_pages(kv, slot, n_old + row_count[ii]);
            if (rc) return rc;
            los[i] = n_old;
            his[i] = n_old + row_count[ii];
        }
        *err_index = -1;
        run_append(kv, slots + base, los, his, row_start + base, n, src_k, src_v);
        for (int64_t i = 0; i < n; i++) kv->n_tokens[slots[base + i]] = his[i];
    }
    return FX_OK;
}

int fx_summaries_update(const fx_kv_view *kv, const int32_t *slots, const int64_t *from_token, int64_t n_items,
                        int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (rc) return rc;
    int64_t los[FX_RANGE_CHUNK], his[FX_RANGE_CHUNK];
    for (int64_t base = 0; base < n_items; base += FX_RANGE_CHUNK) {
        int64_t n = n_items - base < FX_RANGE_CHUNK ? n_items - base : FX_RANGE_CHUNK;
        for (int64_t i = 0; i < n; i++) {
            int64_t ii = base + i;
            *err_index = ii;
            int slot = slots[ii];
            if (slot < 0 || slot >= kv->n_slots) return FX_E_SLOT;
            int64_t n_tok = kv->n_tokens[slot];
            rc = check_slot_pages(kv, slot, n_tok);
            if (rc) return rc;
            if (from_token[ii] < 0 || from_token[ii] > n_tok) return FX_E_APPEND;
            /* Rebuild from the enclosing 128-token boundary, a block start for every granularity, so no block
             * keeps a stale partial summary. */
            los[i] = from_token[ii] / FX_MAX_BLOCK * FX_MAX_BLOCK;
            his[i] = n_tok;
        }
        *err_index = -1;
        run_append(kv, slots + base, los, his, NULL, n, NULL, NULL);
    }
    return FX_OK;
}

/* ----------------------------------------------------------------------------------------------- group top-k -- */

typedef struct {
    const fx_kv_view *kv;
    const float *q;
    int32_t n_q_heads, k_cap;
    const int32_t *tasks;
    int64_t n_tasks;
    int32_t *ids;
    float *scores;
    int32_t *counts;
    float *ws;            /* see fx_topk_workspace_floats */
    int64_t max_blocks;
    int32_t *nb;          /* blocks to score per task */
    _Atomic int32_t *done;
    int32_t cb;           /* blocks per work item */
    _Atomic int64_t next;
    const fx_kernels *kern;
    int32_t scoring;      /* FX_SCORE_* */
    float *heads;         /* per-head scoring: every head's bounds [n_tasks][r][max_blocks] */
    const int32_t *pins;        /* [n_tasks][pin_stride] pinned ids (ascending, checked), or NULL */
    const int32_t *pin_counts;  /* [n_tasks], or NULL: no pins */
    int32_t pin_stride;
} topk_job;

/* Selection by radix select on the scores' bit patterns.  The order is: higher score first, equal scores ->
 * lower block id first (a strict total order, so the result does not depend on the visiting order).  A
 * comparison-based quickselect plus a sort by id cost ~30-40 us per task of 2048 blocks (every comparison on
 * random scores is a mispredicted branch), and the last task's selection sat alone in the tail of a multi-thread
 * call.  Here: three histogram passes find the k-th best key, one in-order pass emits the winners; since the
 * candidates are scanned in ascending block id, the output is already sorted by id and equal keys are taken
 * lowest id first.  Short tasks (few candidates, or k near 1 or near n) find the same k-th key by a direct
 * selection instead (kth_key_direct): the histogram passes cost ~2 us per task whatever n, which dominated decode
 * calls of many short tasks.  Either way the k-th key and the count of its ties to take are exact, so the emitting
 * pass (and with it every result) is the same on both paths. */

/* Monotone map of a float to uint32 (larger float -> larger key).  +0.0 is added first so -0.0 and +0.0 (equal
 * as floats) get the same key; scores are finite. */
static inline uint32_t score_key(float f) {
    union { float f; uint32_t u; } c;
    c.f = f + 0.0f;
    uint32_t m = (uint32_t)(-(int32_t)(c.u >> 31)) | 0x80000000u;
    return c.u ^ m;
}

/* The k-th largest key among s[0..n) (1 <= k <= n) and, in *need_equal, how many elements equal to it belong to
 * the k best (those with larger keys all do). */
static uint32_t kth_key(const float *s, int64_t n, int64_t k, int64_t *need_equal) {
    static const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    uint32_t hist[1 << 11];
    uint32_t prefix = 0, mask = 0;
    int64_t need = k; /* still to take among the elements matching prefix under mask */
    for (int p = 0; p < 3; p++) {
        int sh = shifts[p];
        uint32_t nb = 1u << widths[p], bm = nb - 1;
        memset(hist, 0, sizeof(uint32_t) * nb);
        for (int64_t i = 0; i < n; i++) {
            uint32_t key = score_key(s[i]);
            if ((key & mask) == prefix) hist[(key >> sh) & bm]++;
        }
        int64_t above = 0;
        uint32_t b = bm;
        for (;; b--) { /* the bucket holding the need-th largest; it exists because need <= matching count */
            if (above + hist[b] >= need || b == 0) break;
            above += hist[b];
        }
        need -= above;
        prefix |= b << sh;
        mask |= bm << sh;
    }
    *need_equal = need;
    return prefix;
}

/* Direct selection for short tasks: the same result as kth_key, for any bit patterns.  The k-th largest key is the
 * m-th largest key when m = k, or the m-th smallest when m = n-k+1 (the m-th largest of the complemented keys),
 * whichever m is smaller; a descending buffer of the m largest (complemented) keys seen so far finds it in one
 * pass.  A key enters only when it beats the buffer's last entry, so scores in random order cost ~1 ns per
 * candidate, but a key sequence that keeps rising along the scan enters every time (~0.5 ns per shifted entry).
 * Two things keep trends cheap: the scan runs from the highest block id down (scores rising with the block id,
 * recent blocks scoring higher, then mostly fail the first comparison), and for m >= TOPK_DIRECT_FLOOR_M a first
 * pass takes the maxima of the m classes of candidates by index mod m: every class holds a key >= the smallest
 * of those maxima, so at least m keys are >= it and no key below it can be among the m largest; keys below that
 * floor are skipped (a monotone run of scores then costs n, not n*m).  The scan order and the floor do not change
 * the result, only which keys are looked at twice. */
#define TOPK_DIRECT_MAX_M 32      /* largest m (buffer entries, on the stack) */
#define TOPK_DIRECT_MAX_WORK 8192 /* largest n*m: bounds the worst case (every key entering, ~0.5 ns*n*m, an
                                   * order the floor does not catch) to ~1-2x the histogram passes */
#define TOPK_DIRECT_FLOOR_M 8     /* below this m the floor pass costs more than it saves */

static inline int topk_use_direct(int64_t n, int64_t k) {
    int64_t m = k <= n - k + 1 ? k : n - k + 1;
    return m <= TOPK_DIRECT_MAX_M && n * m <= TOPK_DIRECT_MAX_WORK;
}

/* 1 <= k < n, topk_use_direct(n, k) */
static uint32_t kth_key_direct(const float *s, int64_t n, int64_t k, int64_t *need_equal) {
    uint32_t buf[TOPK_DIRECT_MAX_M], floor_key = 0;
    int flip_side = k > n - k + 1;
    uint32_t flip = flip_side ? ~0u : 0u;
    int64_t m = flip_side ? n - k + 1 : k; /* 1 <= m < n */
    if (m >= TOPK_DIRECT_FLOOR_M) {
        uint32_t cmax[TOPK_DIRECT_MAX_M];
        int64_t base = 0;
        for (int64_t j = 0; j < m; j++) cmax[j] = 0;
        for (; base + m <= n; base += m) /* whole rows of m: the inner loop vectorises */
            for (int64_t j = 0; j < m; j++) {
                uint32_t key = score_key(s[base + j]) ^ flip;
                cmax[j] = key > cmax[j] ? key : cmax[j];
            }
        for (int64_t j = 0; base + j < n; j++) {
            uint32_t key = score_key(s[base + j]) ^ flip;
            cmax[j] = key > cmax[j] ? key : cmax[j];
        }
        floor_key = cmax[0];
        for (int64_t j = 1; j < m; j++) floor_key = cmax[j] < floor_key ? cmax[j] : floor_key;
    }
    buf[m - 1] = 0; /* read only once the buffer is full; set to keep the compiler's uninitialised check quiet */
    for (int64_t i = n - 1, c = 0; i >= 0; i--) {
        uint32_t key = score_key(s[i]) ^ flip;
        int64_t j;
        if (key < floor_key) continue;
        if (c < m) j = c++;
        else if (key > buf[m - 1]) j = m - 1;
        else continue;
        for (; j > 0 && buf[j - 1] < key; j--) buf[j] = buf[j - 1];
        buf[j] = key;
    }
    uint32_t kth = buf[m - 1] ^ flip;
    /* the k best are every key above kth and then need_equal keys equal to it */
    int64_t above = 0;
    if (!flip_side) {
        for (int64_t j = 0; j < m; j++) above += buf[j] != buf[m - 1]; /* buf holds exactly the k largest keys */
    } else {
        for (int64_t i = 0; i < n; i++) above += score_key(s[i]) > kth;
    }
    *need_equal = k - above;
    return kth;
}

/* Task t's pinned ids (fluxion.h, PINNED BLOCKS): 0 <= count <= min(k, stride), strictly ascending, blocks of the
 * slot outside the excluded ranges.  t passed fx_check_task. */
static int check_pins(const fx_kv_view *kv, const int32_t *t, const int32_t *pin, int32_t count, int32_t stride) {
    if (count < 0 || count > stride || count > t[4]) return FX_E_PIN;
    if (count > 0 && !pin) return FX_E_PIN;
    int64_t n_tok = kv->n_tokens[t[0]], nb = (n_tok + t[3] - 1) / t[3], ex_lo[2], ex_hi[2];
    excluded_blocks(t, n_tok, ex_lo, ex_hi);
    for (int32_t i = 0; i < count; i++) {
        int64_t b = pin[i];
        if (b < 0 || b >= nb || (i > 0 && b <= pin[i - 1]) || block_excluded(b, ex_lo, ex_hi)) return FX_E_PIN;
    }
    return FX_OK;
}

/* Per-head scoring, once all of a task's blocks have their r bounds: each head's best bound over the eligible
 * blocks (at most three runs of block ids around the two excluded ranges), then score(b) = max_j (bound_j(b) -
 * best_j) for the eligible blocks.  Excluded blocks keep whatever their score slot held; the compaction drops them. */
static void per_head_scores(topk_job *J, int64_t ti, int64_t nb, const int64_t ex_lo[2], const int64_t ex_hi[2]) {
    int r = J->n_q_heads / J->kv->n_kv_heads;
    const float *heads = J->heads + ti * r * J->max_blocks;
    float *all_s = J->ws + ti * J->max_blocks;
    int64_t run_lo[3], run_hi[3], start = 0;
    int n_runs = 0;
    int first = ex_lo[1] < ex_lo[0] ? 1 : 0; /* the excluded ranges by start (an empty one is [0, 0)) */
    for (int x = 0; x < 2; x++) {
        int64_t lo = ex_lo[first ^ x], hi = ex_hi[first ^ x];
        if (lo >= hi) continue;
        if (lo > start) {
            run_lo[n_runs] = start;
            run_hi[n_runs++] = lo;
        }
        start = hi > start ? hi : start;
    }
    if (start < nb) {
        run_lo[n_runs] = start;
        run_hi[n_runs++] = nb;
    }
    if (n_runs == 0) return; /* nothing eligible */
    float best[FX_MAX_GROUP];
    for (int j = 0; j < r; j++) {
        const float *row = heads + j * J->max_blocks;
        float m = -INFINITY;
        for (int i = 0; i < n_runs; i++) {
            float v = J->kern->row_max(row + run_lo[i], (int)(run_hi[i] - run_lo[i]));
            m = v > m ? v : m;
        }
        best[j] = m;
    }
    for (int i = 0; i < n_runs; i++)
        J->kern->gap_max(heads + run_lo[i], J->max_blocks, best, r, (int)(run_hi[i] - run_lo[i]),
                         all_s + run_lo[i]);
}

/* Work items are (task, chunk of blocks) so a few long sequences still use every thread.  Each item writes the
 * scores of its blocks at their block index in the task's workspace row (per-head scoring: every head's bounds
 * in the task's rows of J->heads); whoever finishes a task's last chunk drops the excluded blocks, selects the k
 * best and writes them in ascending id order. */
static void topk_select(topk_job *J, int64_t ti) {
    const int32_t *t = J->tasks + ti * FX_TASK_FIELDS;
    int k = t[4];
    int64_t n_tok = J->kv->n_tokens[t[0]], nb = J->nb[ti];
    float *all_s = J->ws + ti * J->max_blocks;
    int32_t *all_id = (int32_t *)(J->ws + J->n_tasks * J->max_blocks) + ti * J->max_blocks;
    int64_t ex_lo[2], ex_hi[2];
    excluded_blocks(t, n_tok, ex_lo, ex_hi);
    if (J->scoring == FX_SCORE_PER_HEAD) per_head_scores(J, ti, nb, ex_lo, ex_hi);
    /* Pinned blocks leave the candidates: the task's id row of the workspace holds the pins' scores in [0, P)
     * (floats, never read as ids) and the candidates' ids after them, two disjoint parts (P + candidates <= nb);
     * the compaction writes all_s only at or below the block it reads, so no unread score is overwritten. */
    int64_t n_pin = J->pin_counts ? J->pin_counts[ti] : 0;
    const int32_t *pin = n_pin ? J->pins + ti * J->pin_stride : NULL;
    float *pin_s = J->ws + J->n_tasks * J->max_blocks + ti * J->max_blocks;
    int32_t *cand_id = all_id + n_pin;
    int64_t n = 0, p = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (block_excluded(b, ex_lo, ex_hi)) continue;
        if (p < n_pin && pin[p] == b) { /* pins are checked ascending and outside the excluded ranges */
            pin_s[p++] = all_s[b];
            continue;
        }
        all_s[n] = all_s[b]; /* compact in place (n <= b), ids ascending */
        cand_id[n] = (int32_t)b;
        n++;
    }
    int32_t *ids = J->ids + ti * J->k_cap;
    float *sc = J->scores + ti * J->k_cap;
    int64_t want = k - n_pin, m = 0; /* want >= 0: checked */
    if (n <= want) {
        memcpy(ids, cand_id, sizeof(int32_t) * (size_t)n);
        memcpy(sc, all_s, sizeof(float) * (size_t)n);
        m = n;
    } else if (want > 0) {
        int64_t need_equal;
        uint32_t kth = topk_use_direct(n, want) ? kth_key_direct(all_s, n, want, &need_equal)
                                                : kth_key(all_s, n, want, &need_equal);
        for (int64_t i = 0; i < n; i++) {
            uint32_t key = score_key(all_s[i]);
            if (key > kth || (key == kth && need_equal-- > 0)) {
                ids[m] = cand_id[i];
                sc[m] = all_s[i];
                m++;
            }
        }
    }
    /* the selection (ascending, at the front) and the pins (ascending) merged from the back, in place: the write
     * position i + j - 1 is never below the selection's next unread entry j - 1 */
    for (int64_t i = n_pin, j = m; i > 0;) {
        int64_t o = i + j - 1;
        if (j > 0 && ids[j - 1] > pin[i - 1]) {
            ids[o] = ids[j - 1];
            sc[o] = sc[j - 1];
            j--;
        } else {
            ids[o] = pin[i - 1];
            sc[o] = pin_s[i - 1];
            i--;
        }
    }
    J->counts[ti] = (int32_t)(m + n_pin); /* == min(k, eligible blocks) */
}

/* pos[e] = max(x[e], 0) and neg[e] = min(x[e], 0) (+0.0 for the other part) by the sign bit.  A branch on random
 * signs mispredicts half the time: with queries changing per call (decode), 32 tasks of 5 blocks took 91 us per
 * call with it and 15 us without (1 thread, the VM; a repeated query hides it, the predictor learns its signs).
 * GCC does not if-convert the float compare here; these integer masks vectorise. */
static void split_signs(const float *x, int n, float *pos, float *neg) {
    for (int e = 0; e < n; e++) {
        uint32_t u, m, a, b;
        memcpy(&u, x + e, 4);
        m = (uint32_t)((int32_t)u >> 31); /* all ones where the sign bit is set */
        a = u & ~m;
        b = u & m;
        memcpy(pos + e, &a, 4);
        memcpy(neg + e, &b, 4);
    }
}

static void topk_score_chunk(topk_job *J, int64_t ti, int64_t b0, int64_t b1) {
    const fx_kv_view *kv = J->kv;
    const int32_t *t = J->tasks + ti * FX_TASK_FIELDS;
    int slot = t[0], h = t[2], g = t[3];
    int D = kv->head_dim, r = J->n_q_heads / kv->n_kv_heads, gi = gran_index(g);
    int64_t per_page = kv->page_tokens / g;
    float *all_s = J->ws + ti * J->max_blocks;
    const float *q = J->q + ((int64_t)t[1] * J->n_q_heads + (int64_t)h * r) * D;
    if (J->scoring == FX_SCORE_PER_HEAD) {
        float *heads = J->heads + ti * r * J->max_blocks;
        for (int64_t b = b0, run = 0; b < b1; b += run) {
            run = per_page - b % per_page;
            if (run > b1 - b) run = b1 - b;
            J->kern->bound_heads(q, r, summary(kv, slot, h, gi, b), (int)run, D, kv->dtype == FX_BF16, heads + b,
                                 J->max_blocks);
        }
        return;
    }

    /* The group's bound collapses to two vectors: sum_j max(q_j,0) and sum_j min(q_j,0).  The midrange score is the
     * same kernel with both set to (sum_j q_j) / 2: max . s/2 + min . s/2 = s . (min + max) / 2. */
    float qpos[FX_MAX_DIM], qneg[FX_MAX_DIM];
    if (J->scoring == FX_SCORE_MIDRANGE) {
        for (int e = 0; e < D; e++) qpos[e] = q[e];
        for (int j = 1; j < r; j++)
            for (int e = 0; e < D; e++) qpos[e] += q[(int64_t)j * D + e];
        for (int e = 0; e < D; e++) qneg[e] = qpos[e] = 0.5f * qpos[e];
    } else {
        split_signs(q, D, qpos, qneg);
        for (int j = 1; j < r; j++) {
            float p[FX_MAX_DIM], n[FX_MAX_DIM];
            split_signs(q + (int64_t)j * D, D, p, n);
            for (int e = 0; e < D; e++) {
                qpos[e] += p[e];
                qneg[e] += n[e];
            }
        }
    }
    /* a run of blocks inside one page is contiguous in S_g */
    for (int64_t b = b0, run = 0; b < b1; b += run) {
        run = per_page - b % per_page;
        if (run > b1 - b) run = b1 - b;
        J->kern->bound(qpos, qneg, summary(kv, slot, h, gi, b), (int)run, D, kv->dtype == FX_BF16, all_s + b);
    }
}

static void topk_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    topk_job *J = ctx;
    cursor c = {0, 0, 0};
    for (;;) {
        int64_t item = atomic_fetch_add(&J->next, 1);
        if (!cursor_seek(&c, item, J->nb, J->n_tasks, J->cb)) return;
        int32_t b0, b1;
        item_span(&c, J->nb, J->cb, &b0, &b1);
        topk_score_chunk(J, c.task, b0, b1);
        if (atomic_fetch_add(&J->done[c.task], 1) == chunks_of(J->nb[c.task], J->cb) - 1) topk_select(J, c.task);
    }
}

/* scores [n_tasks][max_blocks], ids [n_tasks][max_blocks], blocks per task [n_tasks], counters [n_tasks], then
 * for per-head scoring every head's bounds [n_tasks][group][max_blocks] */
int64_t fx_topk_workspace_floats(int64_t n_tasks, int64_t max_blocks) { return n_tasks * (2 * max_blocks + 2); }

int64_t fx_topk_scoring_workspace_floats(int64_t n_tasks, int64_t max_blocks, int32_t group, int32_t scoring) {
    int64_t heads = scoring == FX_SCORE_PER_HEAD ? n_tasks * (int64_t)group * max_blocks : 0;
    return fx_topk_workspace_floats(n_tasks, max_blocks) + heads;
}

int fx_group_topk(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                  int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                  float *workspace, int64_t workspace_floats, int64_t *err_index) {
    return fx_group_topk_scoring(kv, q, q_rows, n_q_heads, tasks, n_tasks, k_cap, FX_SCORE_GROUP, out_ids,
                                 out_scores, out_counts, workspace, workspace_floats, err_index);
}

int fx_group_topk_scoring(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                          const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, int32_t *out_ids,
                          float *out_scores, int32_t *out_counts, float *workspace, int64_t workspace_floats,
                          int64_t *err_index) {
    return fx_group_topk_pinned(kv, q, q_rows, n_q_heads, tasks, n_tasks, k_cap, scoring, NULL, NULL, 0, out_ids,
                                out_scores, out_counts, workspace, workspace_floats, err_index);
}

int fx_group_topk_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                         const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, const int32_t *pins,
                         const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids, float *out_scores,
                         int32_t *out_counts, float *workspace, int64_t workspace_floats, int64_t *err_index) {
    *err_index = -1;
    if (scoring != FX_SCORE_GROUP && scoring != FX_SCORE_PER_HEAD && scoring != FX_SCORE_MIDRANGE) return FX_E_SCORING;
    int rc = fx_check_view(kv);
    if (!rc) rc = fx_check_group(kv, n_q_heads);
    if (rc) return rc;
    if (k_cap < 0) return FX_E_K;
    if (pin_counts && pin_stride < 0) return FX_E_PIN;
    int64_t max_blocks = 1, total = 0;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = fx_check_task(kv, t, q_rows, 1); /* O(tasks + pages): always on */
        if (rc) return rc;
        if (t[4] < 0 || t[4] > k_cap) return FX_E_K;
        if (pin_counts) { /* always checked: a bad pin would break the selection's invariants, not just a read */
            rc = check_pins(kv, t, pins ? pins + i * (int64_t)pin_stride : NULL, pin_counts[i], pin_stride);
            if (rc) return rc;
        }
        int64_t nb = (kv->n_tokens[t[0]] + t[3] - 1) / t[3];
        max_blocks = nb > max_blocks ? nb : max_blocks;
        total += nb;
    }
    *err_index = -1;
    int32_t r = n_q_heads / kv->n_kv_heads;
    if (fx_topk_scoring_workspace_floats(n_tasks, max_blocks, r, scoring) > workspace_floats) return FX_E_OUTPUT;
    int32_t *nb = (int32_t *)(workspace + 2 * n_tasks * max_blocks);
    _Atomic int32_t *done = (_Atomic int32_t *)(nb + n_tasks);
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        nb[i] = t[4] > 0 ? (int32_t)((kv->n_tokens[t[0]] + t[3] - 1) / t[3]) : 0; /* k = 0: nothing to score */
        atomic_init(&done[i], 0);
        if (nb[i] == 0) out_counts[i] = 0;
    }
    int64_t target = FX_ITEMS_PER_THREAD * (int64_t)fx_pool_threads(), cb = (total + target - 1) / target;
    if (cb < 32) cb = 32;
    topk_job J = {kv, q, n_q_heads, k_cap, tasks, n_tasks, out_ids, out_scores, out_counts, workspace, max_blocks,
                  nb, done, (int32_t)cb, 0, fx_kern(), scoring,
                  workspace + fx_topk_workspace_floats(n_tasks, max_blocks), pins, pin_counts, pin_stride};
    fx_pool_run(topk_worker, &J);
    return FX_OK;
}

/* ------------------------------------------------------------------------------------------ sparse attention -- */

/* Per work item the workspace holds acc [r][D] (normalised output of that chunk) then lse [r]; after all items,
 * one int32 completion counter per task. */
int64_t fx_attention_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim) {
    int64_t items = n_tasks + FX_ITEMS_PER_THREAD * (int64_t)fx_pool_threads(); /* bound from chunk_blocks */
    return items * (int64_t)group * (head_dim + 1) + n_tasks; /* + per-task completion counters */
}

typedef struct {
    const fx_kv_view *kv;
    const float *q;
    int32_t n_q_heads, k_cap, cb;
    const int32_t *tasks, *ids, *counts;
    int64_t n_tasks;
    float scale;
    float *out, *lse, *ws;
    const int64_t *rows;     /* NULL: task i's results at row i of out/lse; else at row rows[i] */
    _Atomic int32_t *done;   /* per task: chunks finished (the last finisher merges) */
    _Atomic int64_t next;
    const fx_kernels *kern;
} attn_job;

/* Attend the group's r heads over selected blocks ids[b0..b1) of one task; write normalised acc and lse. */
static void attend_chunk(attn_job *J, const int32_t *t, const int32_t *ids, int32_t b0, int32_t b1, float *acc,
                         float *lse, const uint16_t *after, int64_t after_lines) {
    const fx_kv_view *kv = J->kv;
    const fx_kernels *K = J->kern;
    int slot = t[0], h = t[2], g = t[3];
    int D = kv->head_dim, r = J->n_q_heads / kv->n_kv_heads, bf16 = kv->dtype == FX_BF16;
    int64_t n_tok = kv->n_tokens[slot], voff = v_offset(kv);
    const float *q = J->q + ((int64_t)t[1] * J->n_q_heads + (int64_t)h * r) * D;
    float s[FX_MAX_GROUP * FX_MAX_BLOCK];
    float m[FX_MAX_GROUP], l[FX_MAX_GROUP];
    /* bf16 dot products for q.k (FX_SIMD_AVX512_BF16) only where they give exact products: bf16 K and a q whose
     * elements are all bf16 values (a bf16 model's q is; an fp32 model's is not, and keeps the fp32 qk).  Checked
     * once per work item, not per block. */
    uint16_t qb[FX_MAX_GROUP * FX_MAX_DIM] __attribute__((aligned(64)));
    int dot_bf16 = bf16 && K->qk_bf16 && K->q_to_bf16(q, r * D, qb);
    for (int j = 0; j < r; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)r * D);
    for (int32_t bi = b0; bi < b1; bi++) {
        int64_t t0 = (int64_t)ids[bi] * g;
        int len = (int)(n_tok - t0 < g ? n_tok - t0 : g);
        const uint16_t *kb = k_row(kv, slot, h, t0);
        /* next block (or the first block of this thread's next work item): prefetched while this one computes */
        const uint16_t *kn = after;
        int64_t pf_lines = after_lines;
        if (bi + 1 < b1) {
            int64_t tn = (int64_t)ids[bi + 1] * g;
            kn = k_row(kv, slot, h, tn);
            pf_lines = ((n_tok - tn < g ? n_tok - tn : g) * D * 2 + 63) / 64;
        }
        if (dot_bf16) K->qk_bf16(qb, r, kb, len, D, J->scale, s, len, kn, pf_lines);
        else K->qk(q, r, kb, len, D, bf16, J->scale, s, len, kn, pf_lines);
        fx_softmax_block(K, s, len, r, D, m, l, acc);
        K->pv(s, r, len, kb + voff, len, D, bf16, acc, kn ? kn + voff : NULL, pf_lines);
    }
    fx_finish_partial(acc, lse, m, l, r, D);
}

/* Merge one task's chunk results (items first .. first+nc-1 of the workspace) by log-sum-exp into out/lse. */
static void merge_task(attn_job *J, int64_t ti, int64_t first, int64_t nc) {
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t stride = (int64_t)r * (D + 1), row = J->rows ? J->rows[ti] : ti;
    fx_merge_partials(J->ws + first * stride, nc, r, D, J->out + row * r * D, J->lse + row * r);
}

void fx_finish_partial(float *acc, float *lse, const float *m, const float *l, int r, int D) {
    for (int j = 0; j < r; j++) {
        if (l[j] > 0.0f) {
            float inv = 1.0f / l[j];
            for (int e = 0; e < D; e++) acc[(int64_t)j * D + e] *= inv;
            lse[j] = m[j] + logf(l[j]);
        } else {
            lse[j] = -INFINITY;
        }
    }
}

void fx_merge_partials(const float *parts, int64_t nc, int r, int D, float *out, float *lse) {
    int64_t stride = (int64_t)r * (D + 1);
    for (int j = 0; j < r; j++) {
        float mx = -INFINITY;
        for (int64_t c = 0; c < nc; c++) {
            float v = parts[c * stride + (int64_t)r * D + j];
            mx = v > mx ? v : mx;
        }
        float *o = out + (int64_t)j * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        if (mx == -INFINITY) {
            lse[j] = -INFINITY;
            continue;
        }
        float wsum = 0.0f;
        for (int64_t c = 0; c < nc; c++) {
            const float *part = parts + c * stride;
            float w = expf(part[(int64_t)r * D + j] - mx);
            wsum += w;
            for (int e = 0; e < D; e++) o[e] += w * part[(int64_t)j * D + e];
        }
        float inv = 1.0f / wsum;
        for (int e = 0; e < D; e++) o[e] *= inv;
        lse[j] = mx + logf(wsum);
    }
}

static inline int64_t block_len(const fx_kv_view *kv, int slot, int g, int32_t id) {
    int64_t rest = kv->n_tokens[slot] - (int64_t)id * g;
    return rest < g ? rest : g;
}

/* The block to prefetch while block b of an item's blocks [.., b1) is read (attention, gather, block-read probe): block
 * b + 1 of the same item, else the next item's first block (next: its cursor, NULL when there is none), else none.
 * Returns its K row (NULL for none) and sets *lines to its cache lines (0 for none). */
static const uint16_t *block_after(const fx_kv_view *kv, const int32_t *tasks, const int32_t *all_ids, int32_t k_cap,
                                   int32_t cb, const int32_t *t, const int32_t *ids, int32_t b, int32_t b1,
                                   const cursor *next, int64_t *lines) {
    int64_t D = kv->head_dim;
    if (b + 1 < b1) {
        *lines = (block_len(kv, t[0], t[3], ids[b + 1]) * D * 2 + 63) / 64;
        return k_row(kv, t[0], t[2], (int64_t)ids[b + 1] * t[3]);
    }
    if (next == NULL) {
        *lines = 0;
        return NULL;
    }
    const int32_t *nt = tasks + next->task * FX_TASK_FIELDS;
    int32_t nid = all_ids[next->task * k_cap + next->chunk * cb];
    *lines = (block_len(kv, nt[0], nt[3], nid) * D * 2 + 63) / 64;
    return k_row(kv, nt[0], nt[2], (int64_t)nid * nt[3]);
}

/* K row of a work item's first block and its cache-line count (to prefetch across items). */
static const uint16_t *item_first_block(attn_job *J, const cursor *c, int64_t *lines) {
    return block_after(J->kv, J->tasks, J->ids, J->k_cap, J->cb, NULL, NULL, 0, 0, c, lines);
}

/* Each participant claims its next item before working on the current one, so the current item's last block can
 * prefetch the next item's first block; whoever finishes a task's last chunk merges that task. */
static void attn_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    attn_job *J = ctx;
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t stride = (int64_t)r * (D + 1);
    cursor c = {0, 0, 0};
    int64_t item = atomic_fetch_add(&J->next, 1);
    if (!cursor_seek(&c, item, J->counts, J->n_tasks, J->cb)) return;
    for (;;) {
        cursor nc = c;
        int64_t next_item = atomic_fetch_add(&J->next, 1);
        int has_next = cursor_seek(&nc, next_item, J->counts, J->n_tasks, J->cb);
        int64_t after_lines = 0;
        const uint16_t *after = has_next ? item_first_block(J, &nc, &after_lines) : NULL;

        const int32_t *t = J->tasks + c.task * FX_TASK_FIELDS;
        const int32_t *ids = J->ids + c.task * J->k_cap;
        int32_t b0, b1;
        item_span(&c, J->counts, J->cb, &b0, &b1);
        float *part = J->ws + item * stride;
        attend_chunk(J, t, ids, b0, b1, part, part + (int64_t)r * D, after, after_lines);
        int64_t n_chunks = chunks_of(J->counts[c.task], J->cb);
        if (atomic_fetch_add(&J->done[c.task], 1) == n_chunks - 1) merge_task(J, c.task, item - c.chunk, n_chunks);

        if (!has_next) return;
        c = nc;
        item = next_item;
    }
}

/* fx_sparse_attention with task i's results at row rows[i] of out/lse (rows NULL: row i). */
static int attention_run(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                         const int32_t *tasks, int64_t n_tasks, const int32_t *ids, const int32_t *counts,
                         int32_t k_cap, float scale, float *out, float *lse, const int64_t *rows, float *workspace,
                         int64_t workspace_floats, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (!rc) rc = fx_check_group(kv, n_q_heads);
    if (rc) return rc;
    if (k_cap < 0) return FX_E_K;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = check_selected_task(kv, t, q_rows, ids + i * k_cap, counts[i], k_cap);
        if (rc) return rc;
    }
    *err_index = -1;
    int32_t r = n_q_heads / kv->n_kv_heads;
    int32_t cb = chunk_blocks(counts, n_tasks);
    int64_t items = 0;
    for (int64_t i = 0; i < n_tasks; i++) items += chunks_of(counts[i], cb);
    int64_t stride = (int64_t)r * (kv->head_dim + 1);
    if (items * stride + n_tasks > workspace_floats) return FX_E_OUTPUT;
    _Atomic int32_t *done = (_Atomic int32_t *)(workspace + items * stride);
    for (int64_t i = 0; i < n_tasks; i++) {
        atomic_init(&done[i], 0);
        if (counts[i] == 0) { /* no work item will merge an empty task */
            int64_t row = rows ? rows[i] : i;
            memset(out + row * r * kv->head_dim, 0, sizeof(float) * (size_t)r * kv->head_dim);
            for (int j = 0; j < r; j++) lse[row * r + j] = -INFINITY;
        }
    }
    attn_job J = {kv, q, n_q_heads, k_cap, cb, tasks, ids, counts, n_tasks, scale, out, lse, workspace, rows, done,
                  0, fx_kern()};
    fx_pool_run(attn_worker, &J);
    return FX_OK;
}

int fx_sparse_attention(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                        const int32_t *tasks, int64_t n_tasks, const int32_t *ids, const int32_t *counts,
                        int32_t k_cap, float scale, float *out, float *lse, float *workspace,
                        int64_t workspace_floats, int64_t *err_index) {
    return attention_run(kv, q, q_rows, n_q_heads, tasks, n_tasks, ids, counts, k_cap, scale, out, lse, NULL,
                         workspace, workspace_floats, err_index);
}

/* ---------------------------------------------------------------------------------------- select + attend -- */

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int fx_select_attend(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                     int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                     float scale, const int64_t *rows, int64_t n_rows, float *out, float *lse, float *workspace,
                     int64_t workspace_floats, int64_t *selected_tokens, double *seconds, int64_t *err_index) {
    return fx_select_attend_pinned(kv, q, q_rows, n_q_heads, tasks, n_tasks, k_cap, FX_SCORE_GROUP, NULL, NULL, 0,
                                   out_ids, out_scores, out_counts, scale, rows, n_rows, out, lse, workspace,
                                   workspace_floats, selected_tokens, seconds, err_index);
}

int fx_select_attend_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                            const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring,
                            const int32_t *pins, const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids,
                            float *out_scores, int32_t *out_counts, float scale, const int64_t *rows, int64_t n_rows,
                            float *out, float *lse, float *workspace, int64_t workspace_floats,
                            int64_t *selected_tokens, double *seconds, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (!rc) rc = fx_check_group(kv, n_q_heads);
    if (rc) return rc;
    int32_t r = n_q_heads / kv->n_kv_heads;
    for (int64_t i = 0; i < n_tasks; i++) { /* strictly ascending rows inside [0, n_rows): no two tasks share one */
        if (rows[i] < 0 || rows[i] >= n_rows || (i > 0 && rows[i] <= rows[i - 1])) {
            *err_index = i;
            return FX_E_OUTPUT;
        }
    }
    /* the attention's share first, so that a short workspace is reported before any work (top-k checks its own) */
    if (fx_attention_workspace_floats(n_tasks, r, kv->head_dim) > workspace_floats) return FX_E_OUTPUT;
    double t0 = now_seconds();
    rc = fx_group_topk_pinned(kv, q, q_rows, n_q_heads, tasks, n_tasks, k_cap, scoring, pins, pin_counts, pin_stride,
                              out_ids, out_scores, out_counts, workspace, workspace_floats, err_index);
    if (rc) return rc;
    double t1 = now_seconds();
    int64_t tokens = 0;
    for (int64_t i = 0; i < n_tasks; i++) tokens += (int64_t)out_counts[i] * tasks[i * FX_TASK_FIELDS + 3];
    for (int64_t i = 0; i < n_rows * r; i++) lse[i] = -INFINITY; /* rows without a task; the others are written */
    rc = attention_run(kv, q, q_rows, n_q_heads, tasks, n_tasks, out_ids, out_counts, k_cap, scale, out, lse, rows,
                       workspace, workspace_floats, err_index);
    if (rc) return rc;
    *selected_tokens = tokens;
    seconds[0] = t1 - t0;
    seconds[1] = now_seconds() - t1;
    return FX_OK;
}

/* --------------------------------------------------------------------------------------------------- gather -- */

typedef struct {
    const fx_kv_view *kv;
    const int32_t *tasks, *ids, *counts;
    int64_t n_tasks;
    int32_t k_cap, cb;
    const int64_t *out_offset;
    uint16_t *k_out, *v_out;
    _Atomic int64_t next;
    const fx_kernels *kern;
} gather_job;

/* Plain stores keep the staging buffer in the last-level cache (good when it fits and the GPU's DMA reads from
 * there); non-temporal stores skip the cache (good when it does not). fx_set_stream_stores picks. */
static int g_stream_stores = 1;
void fx_set_stream_stores(int on) { g_stream_stores = on != 0; }

static void plain_copy(void *dst, const void *src, int64_t n, const void *pf, int64_t pf_lines) {
    enum { PARTS = 4 };
    for (int p = 0; p < PARTS; p++) {
        int64_t lo = n * p / PARTS / 64 * 64, hi = p == PARTS - 1 ? n : n * (p + 1) / PARTS / 64 * 64;
        fx_prefetch_share(pf, pf_lines, p, PARTS);
        memcpy((char *)dst + lo, (const char *)src + lo, (size_t)(hi - lo));
    }
}

static void gather_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    gather_job *J = ctx;
    const fx_kv_view *kv = J->kv;
    int64_t D = kv->head_dim, voff = v_offset(kv);
    void (*copy)(void *, const void *, int64_t, const void *, int64_t) =
        g_stream_stores ? J->kern->stage_copy : plain_copy;
    cursor c = {0, 0, 0};
    int64_t item = atomic_fetch_add(&J->next, 1);
    if (!cursor_seek(&c, item, J->counts, J->n_tasks, J->cb)) return;
    for (;;) {
        /* claim the next item first so the last block here can prefetch its first block */
        cursor nc = c;
        int has_next = cursor_seek(&nc, atomic_fetch_add(&J->next, 1), J->counts, J->n_tasks, J->cb);
        const int32_t *t = J->tasks + c.task * FX_TASK_FIELDS;
        const int32_t *ids = J->ids + c.task * J->k_cap;
        int slot = t[0], h = t[2], g = t[3];
        int32_t b0, b1;
        item_span(&c, J->counts, J->cb, &b0, &b1);
        int64_t row = J->out_offset[c.task];
        for (int32_t b = 0; b < b0; b++) row += block_len(kv, slot, g, ids[b]);
        for (int32_t b = b0; b < b1; b++) {
            int64_t len = block_len(kv, slot, g, ids[b]);
            const uint16_t *src = k_row(kv, slot, h, (int64_t)ids[b] * g);
            int64_t next_lines;
            const uint16_t *next = block_after(kv, J->tasks, J->ids, J->k_cap, J->cb, t, ids, b, b1,
                                               has_next ? &nc : NULL, &next_lines);
            copy(J->k_out + row * D, src, len * D * 2, next, next_lines);
            copy(J->v_out + row * D, src + voff, len * D * 2, next ? next + voff : NULL, next_lines);
            row += len;
        }
        if (!has_next) break;
        c = nc;
    }
    J->kern->fence();
}

int fx_gather(const fx_kv_view *kv, const int32_t *tasks, int64_t n_tasks, const int32_t *ids,
              const int32_t *counts, int32_t k_cap, const int64_t *out_offset, int64_t cap_tokens, void *k_out,
              void *v_out, int32_t *out_tokens, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (rc) return rc;
    if (k_cap < 0) return FX_E_K;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = check_selected_task(kv, t, -1, ids + i * k_cap, counts[i], k_cap);
        if (rc) return rc;
        int64_t rows = 0;
        for (int32_t b = 0; b < counts[i]; b++) rows += block_len(kv, t[0], t[3], ids[i * k_cap + b]);
        /* output bounds are always checked: a wrong offset would write past the staging buffer */
        if (out_offset[i] < 0 || out_offset[i] + rows > cap_tokens) return FX_E_OUTPUT;
        out_tokens[i] = (int32_t)rows;
    }
    *err_index = -1;
    gather_job J = {kv, tasks, ids, counts, n_tasks, k_cap, chunk_blocks(counts, n_tasks), out_offset, k_out, v_out, 0,
                    fx_kern()};
    fx_pool_run(gather_worker, &J);
    return FX_OK;
}

/* ----------------------------------------------------------------------------------------- bandwidth probe -- */

typedef struct {
    const uint8_t *buf;
    int64_t n;
    int32_t repeats;
    _Atomic int64_t next;
    _Atomic uint64_t sum;
} probe_job;

#define FX_PROBE_CHUNK (1 << 20)

static void probe_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    probe_job *J = ctx;
    int64_t chunks = (J->n + FX_PROBE_CHUNK - 1) / FX_PROBE_CHUNK;
    uint64_t a[8] = {0};
    for (;;) {
        int64_t c = atomic_fetch_add(&J->next, 1);
        if (c >= chunks * J->repeats) break;
        int64_t lo = (c % chunks) * FX_PROBE_CHUNK;
        int64_t hi = lo + FX_PROBE_CHUNK < J->n ? lo + FX_PROBE_CHUNK : J->n;
        const uint64_t *p = (const uint64_t *)(J->buf + lo);
        int64_t words = (hi - lo) / 8;
        for (int64_t i = 0; i + 8 <= words; i += 8)
            for (int k = 0; k < 8; k++) a[k] += p[i + k];
    }
    uint64_t s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    atomic_fetch_add(&J->sum, s);
}

double fx_read_bandwidth_probe(const void *buf, int64_t n_bytes, int32_t repeats) {
    probe_job J = {buf, n_bytes, repeats, 0, 0};
    fx_pool_run(probe_worker, &J);
    return (double)atomic_load(&J.sum);
}

/* ---------------------------------------------------------------------------------------- block read probe -- */

typedef struct {
    const fx_kv_view *kv;
    const int32_t *tasks, *ids, *counts;
    int64_t n_tasks;
    int32_t k_cap, cb;
    _Atomic int64_t next;
    _Atomic uint64_t sum;
} blocks_probe_job;

/* Wrapping sum of the n bytes at src (n a multiple of 8, as every block's bytes are: D is a multiple of 16), one
 * 64-byte line per step with the next block's prefetch spread over the steps, as the attention kernels spread it. */
static uint64_t read_sum(const void *src, int64_t n, const void *pf, int64_t pf_lines) {
    const uint64_t *p = src;
    int64_t words = n / 8, lines = (n + 63) / 64;
    uint64_t a[8] = {0};
    pf_cursor pc = pfc_init(pf, pf_lines, lines);
    int64_t i = 0;
    for (int64_t l = 0; l < lines; l++) {
        pfc_step(&pc);
        if (i + 8 <= words) {
            for (int k = 0; k < 8; k++) a[k] += p[i + k];
            i += 8;
        } else {
            for (; i < words; i++) a[0] += p[i];
        }
    }
    uint64_t s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    return s;
}

/* attn_worker's loop with read_sum in place of the kernels: claim the next item first, prefetch the next block (or
 * the next item's first block) while reading this one, K then V. */
static void blocks_probe_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    blocks_probe_job *J = ctx;
    const fx_kv_view *kv = J->kv;
    int64_t D = kv->head_dim, voff = v_offset(kv);
    uint64_t sum = 0;
    cursor c = {0, 0, 0};
    if (!cursor_seek(&c, atomic_fetch_add(&J->next, 1), J->counts, J->n_tasks, J->cb)) return;
    for (;;) {
        cursor nc = c;
        int has_next = cursor_seek(&nc, atomic_fetch_add(&J->next, 1), J->counts, J->n_tasks, J->cb);
        const int32_t *t = J->tasks + c.task * FX_TASK_FIELDS;
        const int32_t *ids = J->ids + c.task * J->k_cap;
        int slot = t[0], h = t[2], g = t[3];
        int32_t b0, b1;
        item_span(&c, J->counts, J->cb, &b0, &b1);
        for (int32_t b = b0; b < b1; b++) {
            int64_t len = block_len(kv, slot, g, ids[b]);
            const uint16_t *src = k_row(kv, slot, h, (int64_t)ids[b] * g);
            int64_t next_lines;
            const uint16_t *next = block_after(kv, J->tasks, J->ids, J->k_cap, J->cb, t, ids, b, b1,
                                               has_next ? &nc : NULL, &next_lines);
            sum += read_sum(src, len * D * 2, next, next_lines);
            sum += read_sum(src + voff, len * D * 2, next ? next + voff : NULL, next_lines);
        }
        if (!has_next) break;
        c = nc;
    }
    atomic_fetch_add(&J->sum, sum);
}

int fx_read_blocks_probe(const fx_kv_view *kv, const int32_t *tasks, int64_t n_tasks, const int32_t *ids,
                         const int32_t *counts, int32_t k_cap, uint64_t *checksum, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (rc) return rc;
    if (k_cap < 0) return FX_E_K;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = check_selected_task(kv, t, -1, ids + i * k_cap, counts[i], k_cap);
        if (rc) return rc;
    }
    *err_index = -1;
    blocks_probe_job J = {kv, tasks, ids, counts, n_tasks, k_cap, chunk_blocks(counts, n_tasks), 0, 0};
    fx_pool_run(blocks_probe_worker, &J);
    *checksum = atomic_load(&J.sum);
    return FX_OK;
}
