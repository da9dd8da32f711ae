/* fx_background.c -- the unread background term (fluxion.h, "unread background"): one softmax term per 128-token
 * block for the tokens a task's selection leaves unread, its mass from the 16-token blocks' midrange keys and its
 * value the block's mean value, computed from summaries alone. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "fx_internal.h"
#include "fx_layout.h"

static const float LOG_16 = 2.77258872223978123767f; /* log(16): a whole sub-block's token count */

enum {
    SUBS = FX_MAX_BLOCK / 16,  /* 16-token blocks per 128-token block */
    ITEMS_PER_THREAD = 4,      /* work items per pool participant: each item is a few us of summaries */
    MIN_ITEM_BLOCKS = 8,       /* 128-token blocks per item at least (1024 tokens) */
    STRIP_BLOCKS = 16,         /* blocks whose logits an item holds at once: r x 256 floats (16 KiB at r = 16) */
    STRIP_SUBS = STRIP_BLOCKS * SUBS,
    LD = 2 * STRIP_SUBS,       /* row stride of the strip's products: a min and a max row per sub-block */
};

/* Workspace: int64 item offsets [n_tasks + 1] (the first item of each task), int32 done counters [n_tasks], then
 * per item its partial [r][D] out and [r] lse. */
static int64_t max_items(int64_t n_tasks) { return n_tasks + ITEMS_PER_THREAD * (int64_t)fx_pool_threads(); }

int64_t fx_background_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim) {
    return 2 * (n_tasks + 1) + n_tasks + max_items(n_tasks) * (int64_t)group * (head_dim + 1);
}

typedef struct {
    const fx_kv_view *kv;
    const float *q;
    int32_t n_q_heads, k_cap, cb; /* cb: 128-token blocks per work item */
    const int32_t *tasks, *ids, *counts;
    int64_t n_tasks;
    float scale;
    float *out, *lse, *parts;
    const int64_t *first_item;   /* [n_tasks + 1] */
    _Atomic int32_t *done;       /* per task: items finished (the last finisher merges) */
    _Atomic int64_t next;
    const fx_kernels *kern;
} bg_job;

/* The first index p of ids[0 .. n) (ascending) with ids[p] >= x. */
static int32_t lower_bound(const int32_t *ids, int32_t n, int64_t x) {
    int32_t lo = 0, hi = n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Task ti's 128-token blocks [b0, b1): the background term over them as a normalised partial (acc [r][D], then lse
 * [r]).  In strips of STRIP_BLOCKS blocks: every 16-token block's midrange logit for every head, one vectorised exp
 * against the heads' running maxima, then each block's mass is the sum of its sub-blocks' and weighs its mean value
 * (one rescale per strip, not one log-sum-exp per block). */
static void background_item(bg_job *J, int64_t ti, int64_t b0, int64_t b1, float *acc, float *lse) {
    const fx_kv_view *kv = J->kv;
    const fx_kernels *K = J->kern;
    const int32_t *t = J->tasks + ti * FX_TASK_FIELDS;
    int slot = t[0], h = t[2], g = t[3];
    int D = kv->head_dim, r = J->n_q_heads / kv->n_kv_heads, bf16 = kv->dtype == FX_BF16;
    int64_t n_tok = kv->n_tokens[slot], n_subs = (n_tok + 15) / 16, subs_per_page = kv->page_tokens / 16;
    int64_t ex_lo[2], ex_hi[2];
    excluded_blocks(t, n_tok, ex_lo, ex_hi);
    const int32_t *ids = J->ids + ti * J->k_cap;
    int32_t count = J->counts[ti];
    int32_t p = lower_bound(ids, count, b0 * FX_MAX_BLOCK / g); /* the first selected block this item can meet */
    /* scale q_j . (min + max) / 2 = scale (q_j / 2) . min + scale (q_j / 2) . max: the attention's qk kernel over a
     * run of summaries read as rows (each 16-token block's [2][D] is a min row and a max row), all heads at once */
    const float *q = J->q + ((int64_t)t[1] * J->n_q_heads + (int64_t)h * r) * D;
    float half[FX_MAX_GROUP * FX_MAX_DIM];
    for (int64_t e = 0; e < (int64_t)r * D; e++) half[e] = 0.5f * q[e];
    float m[FX_MAX_GROUP], l[FX_MAX_GROUP], vbar[FX_MAX_DIM];
    /* [r][2 STRIP_SUBS]: the qk products of the strip's min / max rows, then in place each sub-block's logit and
     * weight in the row's first STRIP_SUBS entries */
    float x[FX_MAX_GROUP * 2 * STRIP_SUBS];
    float log_n[STRIP_SUBS];            /* log of a sub-block's valid tokens; -inf: read, not background */
    for (int j = 0; j < r; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)r * D);
    for (int64_t sb = b0; sb < b1; sb += STRIP_BLOCKS) {
        int64_t se = sb + STRIP_BLOCKS < b1 ? sb + STRIP_BLOCKS : b1;
        int64_t s0 = sb * SUBS, s1 = se * SUBS < n_subs ? se * SUBS : n_subs;
        int ns = (int)(s1 - s0), any = 0;
        for (int s = 0; s < ns; s++) {
            int64_t parent = (s0 + s) * 16 / g;
            while (p < count && ids[p] < parent) p++;
            int read = block_excluded(parent, ex_lo, ex_hi) || (p < count && ids[p] == parent);
            int64_t n_s = n_tok - (s0 + s) * 16 < 16 ? n_tok - (s0 + s) * 16 : 16;
            log_n[s] = read ? -INFINITY : n_s == 16 ? LOG_16 : logf((float)n_s);
            any |= !read;
        }
        if (!any) continue;
        /* the products, per run of sub-blocks inside one page (their summaries are contiguous) */
        for (int64_t a = s0; a < s1;) {
            int64_t e = (a / subs_per_page + 1) * subs_per_page < s1 ? (a / subs_per_page + 1) * subs_per_page : s1;
            K->qk(half, r, summary(kv, slot, h, 0, a), (int)(2 * (e - a)), D, bf16, J->scale, x + 2 * (a - s0), LD,
                  NULL, 0);
            a = e;
        }
        for (int j = 0; j < r; j++) {
            float *xj = x + j * LD, mx = -INFINITY;
            for (int s = 0; s < ns; s++) { /* in place: entry s is read from 2s and 2s + 1 >= s */
                xj[s] = log_n[s] == -INFINITY ? -INFINITY : xj[2 * s] + xj[2 * s + 1] + log_n[s];
                mx = xj[s] > mx ? xj[s] : mx;
            }
            if (mx > m[j]) { /* rescale what is accumulated to the new running max */
                float corr = m[j] == -INFINITY ? 0.0f : expf(m[j] - mx);
                l[j] *= corr;
                for (int e = 0; e < D; e++) acc[(int64_t)j * D + e] *= corr;
                m[j] = mx;
            }
            K->exp_sum(xj, ns, m[j]); /* xj[s] = exp(xj[s] - m_j); -inf gives 0 */
        }
        for (int64_t b = sb; b < se; b++) {
            int64_t first = (b - sb) * SUBS, valid = n_tok - b * FX_MAX_BLOCK;
            if (valid > FX_MAX_BLOCK) valid = FX_MAX_BLOCK;
            int nsub = (int)((valid + 15) / 16), bg = 0;
            for (int s = 0; s < nsub; s++) bg |= log_n[first + s] != -INFINITY;
            if (!bg) continue;
            const float *vs = value_sums(kv, slot, h, b);
            float inv = 1.0f / (float)valid;
            for (int e = 0; e < D; e++) vbar[e] = vs[e] * inv;
            for (int j = 0; j < r; j++) {
                float mass = 0.0f;
                for (int s = 0; s < nsub; s++) mass += x[j * LD + first + s];
                l[j] += mass;
                float *aj = acc + (int64_t)j * D;
                for (int e = 0; e < D; e++) aj[e] += mass * vbar[e];
            }
        }
    }
    fx_finish_partial(acc, lse, m, l, r, D);
}

/* One work item: 128-token blocks [k cb, (k + 1) cb) of task ti, as a partial at its place in the workspace. */
static void background_chunk(void *ctx, int64_t ti, int64_t k, int64_t item) {
    bg_job *J = ctx;
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t nb = (J->kv->n_tokens[J->tasks[ti * FX_TASK_FIELDS]] + FX_MAX_BLOCK - 1) / FX_MAX_BLOCK;
    int64_t b0 = k * J->cb, b1 = b0 + J->cb < nb ? b0 + J->cb : nb;
    float *part = J->parts + item * (int64_t)r * (D + 1);
    background_item(J, ti, b0, b1, part, part + (int64_t)r * D);
}

/* A task's items all done: its partials merged into its row of out/lse. */
static void background_merge(void *ctx, int64_t ti) {
    bg_job *J = ctx;
    int r = J->n_q_heads / J->kv->n_kv_heads, D = J->kv->head_dim;
    int64_t first = J->first_item[ti];
    fx_merge_partials(J->parts + first * (int64_t)r * (D + 1), J->first_item[ti + 1] - first, r, D,
                      J->out + ti * r * D, J->lse + ti * r);
}

static void background_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    bg_job *J = ctx;
    fx_run_task_items(J, &J->next, J->first_item, J->n_tasks, J->done, background_chunk, background_merge);
}

/* Counts within k_cap, ids blocks of the slot at g and strictly ascending (the walk relies on the order). */
static int check_background_task(const fx_kv_view *kv, const int32_t *t, int64_t q_rows, const int32_t *ids,
                                 int32_t count, int32_t k_cap) {
    int rc = fx_check_task(kv, t, q_rows, 0);
    if (rc) return rc;
    if (count < 0 || count > k_cap) return FX_E_K;
    int64_t n_blocks = (kv->n_tokens[t[0]] + t[3] - 1) / t[3];
    for (int32_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n_blocks || (i > 0 && ids[i] <= ids[i - 1])) return FX_E_BLOCK;
    return FX_OK;
}

int fx_background(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                  int64_t n_tasks, const int32_t *ids, const int32_t *counts, int32_t k_cap, float scale, float *out,
                  float *lse, float *workspace, int64_t workspace_floats, int64_t *err_index) {
    *err_index = -1;
    int rc = fx_check_view(kv);
    if (!rc) rc = fx_check_group(kv, n_q_heads);
    if (rc) return rc;
    if (!(kv->gran_mask & 1) || !(kv->gran_mask & FX_KEEP_VALUE_SUMS)) return FX_E_GRAN;
    if (k_cap < 0 || n_tasks < 0) return FX_E_K;
    int64_t total_blocks = 0;
    for (int64_t i = 0; i < n_tasks; i++) {
        const int32_t *t = tasks + i * FX_TASK_FIELDS;
        *err_index = i;
        rc = check_background_task(kv, t, q_rows, ids + i * k_cap, counts[i], k_cap);
        if (rc) return rc;
        total_blocks += (kv->n_tokens[t[0]] + FX_MAX_BLOCK - 1) / FX_MAX_BLOCK;
    }
    *err_index = -1;
    int32_t r = n_q_heads / kv->n_kv_heads, D = kv->head_dim;
    if (fx_background_workspace_floats(n_tasks, r, D) > workspace_floats) return FX_E_OUTPUT;
    int64_t target = ITEMS_PER_THREAD * (int64_t)fx_pool_threads();
    int64_t cb = (total_blocks + target - 1) / target;
    if (cb < MIN_ITEM_BLOCKS) cb = MIN_ITEM_BLOCKS;
    int64_t *first_item = (int64_t *)workspace; /* 8-byte aligned: the workspace starts 64-byte aligned */
    _Atomic int32_t *done = (_Atomic int32_t *)(workspace + 2 * (n_tasks + 1));
    float *parts = workspace + 2 * (n_tasks + 1) + n_tasks;
    first_item[0] = 0;
    for (int64_t i = 0; i < n_tasks; i++) {
        int64_t nb = (kv->n_tokens[tasks[i * FX_TASK_FIELDS]] + FX_MAX_BLOCK - 1) / FX_MAX_BLOCK;
        first_item[i + 1] = first_item[i] + (nb + cb - 1) / cb;
        atomic_init(&done[i], 0);
        if (nb == 0) { /* no item will merge an empty task */
            memset(out + i * r * D, 0, sizeof(float) * (size_t)r * D);
            for (int j = 0; j < r; j++) lse[i * r + j] = -INFINITY;
        }
    }
    bg_job J = {kv, q, n_q_heads, k_cap, (int32_t)cb, tasks, ids, counts, n_tasks, scale, out, lse, parts,
                first_item, done, 0, fx_kern()};
    fx_pool_run(background_worker, &J);
    return FX_OK;
}
