/* fx_spans.c -- the streaming spans of a decode layer (fluxion.h, "the streaming spans of a decode layer"): each
 * task's sink and recent window attended straight from the host pages and merged by log-sum-exp into the row that
 * the selected blocks' attention left, so a CPU decode layer needs no second copy of the sink and window. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "fx_internal.h"
#include "fx_layout.h"

enum {
    ITEMS_PER_THREAD = 8,  /* work items per pool participant: a window of 1K tokens is ~10 us of one thread */
    MIN_ITEM_TOKENS = 128, /* tokens per item at least: below that the partial's merge costs more than it saves */
    PIECE = FX_MAX_BLOCK,  /* tokens per kernel call: the score buffer's width; pages hold whole pieces */
};

/* Workspace: int64 item offsets [n_tasks + 1] (the first item of each task), int32 done counters [n_tasks], then
 * per item its partial [r][D] out and [r] lse.  Items: sum over tasks of ceil(tokens / chunk) <= n_tasks + the
 * target, because chunk >= ceil(all tokens / target). */
static int64_t max_items(int64_t n_tasks) { return n_tasks + ITEMS_PER_THREAD * (int64_t)fx_pool_threads(); }

int64_t fx_spans_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim) {
    return 2 * (n_tasks + 1) + n_tasks + max_items(n_tasks) * (int64_t)group * (head_dim + 1);
}

typedef struct {
    const fx_kv_view *kv;
    const float *q;
    int32_t n_q_heads;
    const int32_t *tasks;
    int64_t n_tasks, chunk;    /* chunk: tokens per work item */
    float scale;
    float *out, *lse, *parts;
    const int64_t *rows;
    const int64_t *first_item; /* [n_tasks + 1] */
    _Atomic int32_t *done;     /* per task: items finished (the last finisher merges) */
    _Atomic int64_t next;
    const fx_kernels *kern;
} span_job;

/* Task t's two ranges clipped to [0, n_tok) as lo[x], len[x] (len 0: empty). */
static void task_ranges(const int32_t *t, int64_t n_tok, int64_t lo[2], int64_t len[2]) {
    for (int x = 0; x < 2; x++) len[x] = excluded_range(t, x, n_tok, &lo[x]);
}

/* One online-softmax pass over tokens [t, e) of (slot, head h), pieces of at most PIECE tokens that never cross a
 * page; m, l, acc carry the running maxima, sums and weighted values of the r heads. */
static void attend_tokens(span_job *J, const float *q, const uint16_t *qb, int dot_bf16, int slot, int h, int64_t t,
                          int64_t e, float *m, float *l, float *acc) {
    const fx_kv_view *kv = J->kv;
    const fx_kernels *K = J->kern;
    int D = kv->head_dim, r = J->n_q_heads / kv->n_kv_heads, bf16 = kv->dtype == FX_BF16;
    int64_t P = kv->page_tokens, voff = v_offset(kv);
    float s[FX_MAX_GROUP * PIECE];
    while (t < e) {
        int64_t room = P - t % P, len = e - t < PIECE ? e - t : PIECE;
        if (len > room) len = room;
        const uint16_t *kb = k_row(kv, slot, h, t);
        int64_t tn = t + len, next_len = 0;
        const uint16_t *kn = NULL;
        if (tn < e) { /* the next piece, prefetched while this one computes */
            next_len = e - tn < PIECE ? e - tn : PIECE;
            if (next_len > P - tn % P) next_len = P - tn % P;
            kn = k_row(kv, slot, h, tn);
        }
        int64_t pf_lines = (next_len * D * 2 + 63) / 64;
        int n = (int)len;
        if (dot_bf16) K->qk_bf16(qb, r, kb, n, D, J->scale, s, n, kn, pf_lines);
        else K->qk(q, r, kb, n, D, bf16, J->scale, s, n, kn, pf_lines);
        fx_softmax_block(K, s, n, r, D, m, l, acc);
        K->pv(s, r, n, kb + voff, n, D, bf16, acc, kn ? kn + voff : NULL, pf_lines);
        t = tn;
    }
}

/* Tokens [o0, o1) of task ti's ranges laid end to end (the first range, then the second) -> partial acc [r][D],
 * lse [r]. */
static void span_item(span_job *J, int64_t ti, int64_t o0, int64_t o1, float *acc, float *lse) {
    const fx_kv_view *kv = J->kv;
    const int32_t *t = J->tasks + ti * FX_TASK_FIELDS;
    int slot = t[0], h = t[2];
    int D = kv->head_dim, r = J->n_q_heads / kv->n_kv_heads;
    const float *q = J->q + ((int64_t)t[1] * J->n_q_heads + (int64_t)h * r) * D;
    /* bf16 products only where exact, as in the selected blocks' attention (fluxion.c, attend_chunk) */
    uint16_t qb[FX_MAX_GROUP * FX_MAX_DIM] __attribute__((aligned(64)));
    int dot_bf16 = kv->dtype == FX_BF16 && J->kern->qk_bf16 && J->kern->q_to_bf16(q, r * D, qb);
    float m[FX_MAX_GROUP], l[FX_MAX_GROUP];
    for (int j = 0; j < r; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)r * D);
    int64_t lo[2], len[2];
    task_ranges(t, kv->n_tokens[slot], lo, len);
    for (int x = 0; x < 2; x++) {
        int64_t start = x == 0 ? 0 : len[0]; /* the range's offset in the concatenation */
        int64_t a = o0 > start ? o0 : start, b = o1 < start + len[x] ? o1 : start + len[x];
        if (a < b) attend_tokens(J, q, qb, dot_bf16, slot, h, lo[x] + a - start, lo[x] + b - start, m, l, acc);
    }
    fx_finish_partial(acc, lse, m, l, r, D);
}

/* Task ti's partials parts [n][r*(D+1)] merged with what its row already holds, into the row. */
static void merge_into_row(span_job *J, int64_t ti, const float *parts, int64_t n) {
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t stride = (int64_t)r * (D + 1), row = J->rows[ti];
    for (int j = 0; j < r; j++) {
        float *o = J->out + (row * r + j) * D, *lj = J->lse + row * r + j;
        float mx = *lj;
        for (int64_t c = 0; c < n; c++) {
            float v = parts[c * stride + (int64_t)r * D + j];
            mx = v > mx ? v : mx;
        }
        if (mx == -INFINITY) { /* nothing anywhere: an empty attention */
            memset(o, 0, sizeof(float) * (size_t)D);
            continue;
        }
        float w0 = *lj == -INFINITY ? 0.0f : expf(*lj - mx), wsum = w0;
        for (int c = 0; c < D; c++) o[c] = w0 == 0.0f ? 0.0f : o[c] * w0; /* the row's out is unset when lse -inf */
        for (int64_t p = 0; p < n; p++) {
            const float *part = parts + p * stride;
            float lp = part[(int64_t)r * D + j];
            if (lp == -INFINITY) continue;
            float w = expf(lp - mx);
            wsum += w;
            for (int c = 0; c < D; c++) o[c] += w * part[(int64_t)j * D + c];
        }
        float inv = 1.0f / wsum;
        for (int c = 0; c < D; c++) o[c] *= inv;
        *lj = mx + logf(wsum);
    }
}

/* One work item: offsets [k chunk, (k + 1) chunk) of task ti's ranges, as a partial at its place in the workspace. */
static void span_chunk(void *ctx, int64_t ti, int64_t k, int64_t item) {
    span_job *J = ctx;
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    const int32_t *t = J->tasks + ti * FX_TASK_FIELDS;
    int64_t lo[2], len[2];
    task_ranges(t, J->kv->n_tokens[t[0]], lo, len);
    int64_t o0 = k * J->chunk, o1 = o0 + J->chunk < len[0] + len[1] ? o0 + J->chunk : len[0] + len[1];
    float *part = J->parts + item * (int64_t)r * (D + 1);
    span_item(J, ti, o0, o1, part, part + (int64_t)r * D);
}

/* A task's items all done: its partials merged with its row. */
static void span_merge(void *ctx, int64_t ti) {
    span_job *J = ctx;
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t first = J->first_item[ti];
    merge_into_row(J, ti, J->parts + first * (int64_t)r * (D + 1), J->first_item[ti + 1] - first);
}

static void span_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    span_job *J = ctx;
    fx_run_task_items(J, &J->next, J->first_item, J->n_tasks, J->done, span_chunk, span_merge);
}

int fx_attend_spans(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                    int64_t n_tasks, float scale, const int64_t *rows, int64_t n_rows, float *out, float *lse,
                    float *workspace, int64_t workspace_floats, int64_t *span_tokens, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (!rc) rc = fx_check_group(kv, n_q_heads);
    if (rc) return rc;
    int64_t total = 0;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = fx_check_task(kv, t, q_rows, 0);
        if (rc) return rc;
        if (rows[i] < 0 || rows[i] >= n_rows || (i > 0 && rows[i] <= rows[i - 1])) return FX_E_OUTPUT;
        int64_t lo[2], len[2];
        task_ranges(t, kv->n_tokens[t[0]], lo, len);
        if (len[0] && len[1] && lo[0] < lo[1] + len[1] && lo[1] < lo[0] + len[0]) return FX_E_SPAN;
        total += len[0] + len[1];
    }
    *err_index = -1;
    int32_t r = n_q_heads / kv->n_kv_heads, D = kv->head_dim;
    if (fx_spans_workspace_floats(n_tasks, r, D) > workspace_floats) return FX_E_OUTPUT;
    int64_t target = ITEMS_PER_THREAD * (int64_t)fx_pool_threads();
    int64_t chunk = (total + target - 1) / target;
    if (chunk < MIN_ITEM_TOKENS) chunk = MIN_ITEM_TOKENS;
    int64_t *first_item = (int64_t *)workspace; /* 8-byte aligned: the workspace starts 64-byte aligned */
    _Atomic int32_t *done = (_Atomic int32_t *)(workspace + 2 * (n_tasks + 1));
    float *parts = workspace + 2 * (n_tasks + 1) + n_tasks;
    first_item[0] = 0;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        int64_t lo[2], len[2];
        task_ranges(t, kv->n_tokens[t[0]], lo, len);
        first_item[i + 1] = first_item[i] + (len[0] + len[1] + chunk - 1) / chunk; /* no items: the row stays */
        atomic_init(&done[i], 0);
    }
    span_job J = {kv, q, n_q_heads, tasks, n_tasks, chunk, scale, out, lse, parts, rows, first_item, done, 0,
                  fx_kern()};
    fx_pool_run(span_worker, &J);
    *span_tokens = total;
    return FX_OK;
}
