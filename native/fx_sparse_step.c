/* fx_sparse_step.c -- a decode step over the host KV store in one call: per layer the decoder layer's two calls
 * around the append, the selection with its attention and the streaming spans (fluxion.h, SPARSE DECODE STEP).
 * Nothing here computes anything of its own: the arithmetic is that of the calls it makes, in the order a caller
 * would make them, so the step equals the per-layer path bit for bit. */
#include <string.h>
#include <time.h>
#include "fx_internal.h"

static int64_t a64(int64_t n) { return (n + 63) & ~(int64_t)63; }

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The step's own buffers, laid out from base (64-byte aligned, each rounded up to 64 bytes); the layer calls'
 * workspace follows them.  With base NULL only the size comes out (the pointers are then NULL). */
typedef struct {
    float *qkv, *q, *out, *lse;  /* [m][width], [m][Hq D], [m][Hq D], [m][Hq] */
    uint16_t *k16, *v16;         /* [m][Hkv D] in the store's dtype */
    int64_t *row_start, *row_count;  /* [m] */
} step_bufs;

static void *carve(char *base, int64_t *offset, int64_t bytes) {
    void *at = base ? base + *offset : NULL;
    *offset += a64(bytes);
    return at;
}

static int64_t layout(const fx_qlayer *L0, int64_t m, char *base, step_bufs *B) {
    int64_t D = L0->head_dim, hq = (int64_t)L0->n_heads * D, hkv = (int64_t)L0->n_kv_heads * D;
    int64_t n = 0;
    B->qkv = carve(base, &n, m * (hq + 2 * hkv) * 4);
    B->q = carve(base, &n, m * hq * 4);
    B->out = carve(base, &n, m * hq * 4);
    B->lse = carve(base, &n, m * L0->n_heads * 4);
    B->k16 = carve(base, &n, m * hkv * 2);
    B->v16 = carve(base, &n, m * hkv * 2);
    B->row_start = carve(base, &n, m * 8);
    B->row_count = carve(base, &n, m * 8);
    return n;
}

int64_t fx_sparse_decode_workspace(const fx_qlayer *const *layers, int32_t n_layers, int64_t m) {
    if (!layers || n_layers < 1 || m < 1 || m > FX_LAYER_MAX_ROWS || !layers[0]) return -FX_E_QSHAPE;
    const fx_qlayer *L0 = layers[0];
    int64_t layer_bytes = 0;
    for (int32_t l = 0; l < n_layers; l++) {
        const fx_qlayer *L = layers[l];
        if (!L) return -FX_E_QSHAPE;
        int64_t b = fx_layer_workspace(L, m);
        if (b < 0) return b;
        if (L->d != L0->d || L->n_heads != L0->n_heads || L->n_kv_heads != L0->n_kv_heads ||
            L->head_dim != L0->head_dim)
            return -FX_E_QSHAPE;
        layer_bytes = b > layer_bytes ? b : layer_bytes;
    }
    step_bufs B;
    return 64 + layout(L0, m, NULL, &B) + layer_bytes;
}

/* The step's arguments that do not depend on a layer's tasks: the views against the layers' shape, the slots,
 * the task table's bounds.  (The tasks themselves are checked by the calls that read them.) */
static int check_step(const fx_qlayer *L0, int32_t n_layers, int64_t m, const fx_sparse_step *S) {
    if (!S || !S->views || !S->slots || !S->task_ends || (S->task_ends[n_layers] > 0 && (!S->tasks || !S->rows ||
        !S->ids || !S->scores || !S->counts)))
        return FX_E_QSHAPE;
    if (S->task_ends[0] != 0) return FX_E_QSHAPE;
    if (S->scoring != FX_SCORE_GROUP && S->scoring != FX_SCORE_PER_HEAD && S->scoring != FX_SCORE_MIDRANGE)
        return FX_E_SCORING;
    for (int32_t l = 0; l < n_layers; l++) {
        const fx_kv_view *kv = S->views[l];
        if (!kv || S->task_ends[l + 1] < S->task_ends[l]) return FX_E_QSHAPE;
        int rc = fx_check_view(kv);
        if (rc) return rc;
        if (kv->n_kv_heads != L0->n_kv_heads || kv->head_dim != L0->head_dim ||
            kv->dtype != S->views[0]->dtype || kv->n_slots != S->views[0]->n_slots)
            return FX_E_QSHAPE;
    }
    for (int64_t i = 0; i < m; i++) {
        if (S->slots[i] < 0 || S->slots[i] >= S->views[0]->n_slots) return FX_E_SLOT;
        for (int64_t j = 0; j < i; j++)
            if (S->slots[j] == S->slots[i]) return FX_E_SLOT;
    }
    return FX_OK;
}

/* Floats of select_ws the step's largest layer needs: its top-k over the longest slot after this step's append
 * (blocks of 16 tokens, the finest granularity, bound every task's count), its attention and its spans. */
static int64_t select_floats(const fx_qlayer *L0, int32_t n_layers, int64_t m, const fx_sparse_step *S) {
    int32_t r = L0->n_heads / L0->n_kv_heads, D = L0->head_dim;
    int64_t max_tokens = 0;
    for (int32_t l = 0; l < n_layers; l++)
        for (int64_t i = 0; i < m; i++) {
            int64_t n = S->views[l]->n_tokens[S->slots[i]] + 1;
            max_tokens = n > max_tokens ? n : max_tokens;
        }
    int64_t max_blocks = (max_tokens + 15) / 16, need = 0;
    for (int32_t l = 0; l < n_layers; l++) {
        int64_t n = S->task_ends[l + 1] - S->task_ends[l];
        int64_t sizes[3] = {fx_topk_scoring_workspace_floats(n, max_blocks, r, S->scoring),
                            fx_attention_workspace_floats(n, r, D), fx_spans_workspace_floats(n, r, D)};
        for (int j = 0; j < 3; j++) {
            if (sizes[j] < 0) return sizes[j];
            need = sizes[j] > need ? sizes[j] : need;
        }
    }
    return need;
}

int64_t fx_sparse_decode_select_floats(const fx_qlayer *const *layers, int32_t n_layers, int64_t m,
                                       const fx_sparse_step *step) {
    int64_t need = fx_sparse_decode_workspace(layers, n_layers, m);
    if (need < 0) return need;
    int rc = check_step(layers[0], n_layers, m, step);
    if (rc) return -rc;
    return select_floats(layers[0], n_layers, m, step);
}

int fx_sparse_decode_layers(const fx_qlayer *const *layers, int32_t n_layers, float *x, int64_t m, const float *rope,
                            int64_t rope_stride, const fx_sparse_step *S, float *select_ws,
                            int64_t select_ws_floats, void *work, int64_t work_bytes, int64_t *read_tokens,
                            double *seconds, int32_t *err_layer, int64_t *err_index) {
    if (!err_layer || !err_index || !read_tokens || !seconds) return FX_E_QSHAPE;
    *err_layer = -1;
    *err_index = -1;
    int64_t need = fx_sparse_decode_workspace(layers, n_layers, m);
    if (need < 0) return (int)-need;
    const fx_qlayer *L0 = layers[0];
    if (!x || !work || (L0->rope_dim > 0 && !rope)) return FX_E_QSHAPE;
    int rc = check_step(L0, n_layers, m, S);
    if (rc) return rc;
    int64_t select_need = select_floats(L0, n_layers, m, S);
    if (select_need < 0) return (int)-select_need;
    if (work_bytes < need || select_ws_floats < select_need || !select_ws) return FX_E_OUTPUT;

    int64_t D = L0->head_dim, Hq = L0->n_heads, Hkv = L0->n_kv_heads;
    int64_t hq = Hq * D, hkv = Hkv * D, width = hq + 2 * hkv;
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    step_bufs B;
    p += layout(L0, m, p, &B);
    float *qkv = B.qkv, *q = B.q, *out = B.out, *lse = B.lse;
    uint16_t *k16 = B.k16, *v16 = B.v16;
    int64_t *row_start = B.row_start, *row_count = B.row_count;
    int64_t layer_bytes = work_bytes - (p - (char *)work);
    for (int64_t i = 0; i < m; i++) row_start[i] = i, row_count[i] = 1;
    int bf16 = S->views[0]->dtype == FX_BF16;

    read_tokens[0] = read_tokens[1] = 0;
    seconds[0] = seconds[1] = 0.0;
    for (int32_t l = 0; l < n_layers; l++) {
        const fx_qlayer *L = layers[l];
        const fx_kv_view *kv = S->views[l];
        int64_t lo = S->task_ends[l], n = S->task_ends[l + 1] - lo;
        *err_layer = l;
        rc = fx_layer_qkv(L, x, m, rope, rope_stride, qkv, p, layer_bytes);
        if (rc) return rc;
        for (int64_t i = 0; i < m; i++) { /* q rows side by side for the attention; k, v in the store's dtype */
            const float *row = qkv + i * width;
            memcpy(q + i * hq, row, (size_t)hq * 4);
            for (int64_t e = 0; e < hkv; e++) {
                k16[i * hkv + e] = bf16 ? fx_f32_to_bf16(row[hq + e]) : fx_f32_to_f16(row[hq + e]);
                v16[i * hkv + e] = bf16 ? fx_f32_to_bf16(row[hq + hkv + e]) : fx_f32_to_f16(row[hq + hkv + e]);
            }
        }
        rc = fx_append(kv, S->slots, row_start, row_count, m, k16, v16, m, err_index);
        if (rc) return rc;
        const int32_t *tasks = S->tasks + lo * FX_TASK_FIELDS;
        int64_t selected = 0, spans = 0;
        double sec[2] = {0.0, 0.0};
        rc = fx_select_attend_pinned(kv, q, m, (int32_t)Hq, tasks, n, S->k_cap, S->scoring,
                                     S->pin_counts ? S->pins + lo * S->pin_stride : NULL,
                                     S->pin_counts ? S->pin_counts + lo : NULL, S->pin_stride,
                                     S->ids + lo * S->k_cap, S->scores + lo * S->k_cap, S->counts + lo, S->scale,
                                     S->rows + lo, m * Hkv, out, lse, select_ws, select_ws_floats, &selected, sec,
                                     err_index);
        if (rc) return rc;
        double t0 = now_seconds();
        rc = fx_attend_spans(kv, q, m, (int32_t)Hq, tasks, n, S->scale, S->rows + lo, m * Hkv, out, lse, select_ws,
                             select_ws_floats, &spans, err_index);
        if (rc) return rc;
        seconds[0] += sec[0];
        seconds[1] += sec[1] + (now_seconds() - t0);
        read_tokens[0] += selected;
        read_tokens[1] += spans;
        rc = fx_layer_out_mlp(L, x, out, m, p, layer_bytes);
        if (rc) return rc;
    }
    *err_layer = -1;
    return FX_OK;
}
