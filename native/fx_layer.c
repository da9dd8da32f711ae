/* fx_layer.c -- a decoder layer's work around its attention for the rows of a decode step (fx_layer_qkv,
 * fx_layer_out_mlp) and the dense decode attention over an fp32 KV cache (fx_decode_attention).  fluxion.h
 * ("DECODER LAYER", "DENSE DECODE ATTENTION") is the contract.
 *
 * The products go through fx_quant.c (one pool dispatch each); what lies between them (norms, bias, RoPE, silu,
 * residual adds) is O(d + F) per row and runs on the calling thread: at d = 896 that is about a microsecond, less
 * than waking the pool for it would cost. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "fx_quant.h"

/* ------------------------------------------------------------------------------------------------ checks -- */

static int64_t qw_row_bytes(const fx_qweight *w, int64_t k) { return fx_qrow_bytes(w->wtype, k); }

/* FX_OK, or the first problem of L (weights checked against their role's shape) */
static int check_layer(const fx_qlayer *L) {
    if (!L) return FX_E_QSHAPE;
    if (L->d <= 0 || L->n_heads <= 0 || L->n_kv_heads <= 0 || L->head_dim <= 0 || L->ffn <= 0) return FX_E_QSHAPE;
    if (L->n_heads % L->n_kv_heads) return FX_E_QSHAPE;
    if (L->head_dim > FX_LAYER_MAX_HEAD_DIM || L->rope_dim < 0 || L->rope_dim % 2 || L->rope_dim > L->head_dim)
        return FX_E_QSHAPE;
    if (!L->attn_norm || !L->ffn_norm || !(L->eps >= 0.0f)) return FX_E_QSHAPE;
    int64_t d = L->d, hq = (int64_t)L->n_heads * L->head_dim, hkv = (int64_t)L->n_kv_heads * L->head_dim;
    const struct {
        const fx_qweight *w;
        int64_t n_out, k;
    } roles[] = {{&L->q, hq, d},  {&L->k, hkv, d},    {&L->v, hkv, d},    {&L->o, d, hq},
                 {&L->gate, L->ffn, d}, {&L->up, L->ffn, d}, {&L->down, d, L->ffn}};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++) {
        if (!roles[i].w->w || roles[i].w->n_out != roles[i].n_out) return FX_E_QSHAPE;
        int64_t rb = qw_row_bytes(roles[i].w, roles[i].k);
        if (rb < 0) return (int)-rb;
    }
    return FX_OK;
}

/* ------------------------------------------------------------------------------------------- workspace -- */

static int64_t a64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* The workspace's parts, in floats: h [m][d], t [m][d], g [m][F], u [m][F]; then the products' quantization space. */
typedef struct {
    float *h, *t, *g, *u;
    void *qwork;
    int64_t qbytes;
} layer_ws;

static int64_t quant_bytes(const fx_qlayer *L, int64_t m) {
    int64_t hq = (int64_t)L->n_heads * L->head_dim, most = 0;
    const int64_t widths[] = {L->d, hq, L->ffn};
    for (int i = 0; i < 3; i++) {
        int64_t b = fx_qmatmul_workspace(FX_QT_ANY, m, widths[i]);
        if (b < 0) return b;
        most = b > most ? b : most;
    }
    return most;
}

int64_t fx_layer_workspace(const fx_qlayer *L, int64_t m) {
    int rc = check_layer(L);
    if (rc != FX_OK) return -rc;
    if (m < 0 || m > FX_LAYER_MAX_ROWS) return -FX_E_QSHAPE;
    int64_t q = quant_bytes(L, m > 0 ? m : 1);
    if (q < 0) return q;
    return 64 + 2 * a64(m * (int64_t)L->d * 4) + 2 * a64(m * (int64_t)L->ffn * 4) + q;
}

static layer_ws carve(const fx_qlayer *L, int64_t m, void *work, int64_t work_bytes) {
    layer_ws W;
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    W.h = (float *)p, p += a64(m * (int64_t)L->d * 4);
    W.t = (float *)p, p += a64(m * (int64_t)L->d * 4);
    W.g = (float *)p, p += a64(m * (int64_t)L->ffn * 4);
    W.u = (float *)p, p += a64(m * (int64_t)L->ffn * 4);
    W.qwork = p;
    W.qbytes = work_bytes - (p - (char *)work);
    return W;
}

/* FX_OK when the call's arguments hold (workspace included) */
static int check_call(const fx_qlayer *L, int64_t m, const void *a, const void *b, const void *work, int64_t work_bytes) {
    int rc = check_layer(L);
    if (rc != FX_OK) return rc;
    if (m < 0 || m > FX_LAYER_MAX_ROWS) return FX_E_QSHAPE;
    if (m == 0) return FX_OK;
    if (!a || !b || !work) return FX_E_QSHAPE;
    int64_t need = fx_layer_workspace(L, m);
    if (need < 0) return (int)-need;
    return work_bytes < need ? FX_E_OUTPUT : FX_OK;
}

/* ------------------------------------------------------------------------------------------ row helpers -- */

/* out [d] = x / sqrt(mean(x^2) + eps) * w */
static void rms_norm_row(const float *x, const float *w, int64_t d, float eps, float *out) {
    double ss = 0.0;
    for (int64_t e = 0; e < d; e++) ss += (double)x[e] * x[e];
    float inv = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    for (int64_t e = 0; e < d; e++) out[e] = x[e] * inv * w[e];
}

/* RoPE on n_heads heads of head_dim at x (fluxion.h's formula); cs: cos [R] then sin_signed [R] */
static void rope_heads(float *x, int n_heads, int head_dim, int R, int neox, const float *cs) {
    const float *cs_cos = cs, *cs_sin = cs + R;
    float tmp[FX_LAYER_MAX_HEAD_DIM];
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (int64_t)h * head_dim;
        memcpy(tmp, xh, sizeof(float) * (size_t)R);
        for (int i = 0; i < R; i++) {
            int pair = neox ? (i + R / 2) % R : i ^ 1;
            xh[i] = tmp[i] * cs_cos[i] + tmp[pair] * cs_sin[i];
        }
    }
}

/* ------------------------------------------------------------------------------------------------ layer -- */

int fx_layer_qkv(const fx_qlayer *L, const float *x, int64_t m, const float *rope, int64_t rope_stride, float *qkv,
                 void *work, int64_t work_bytes) {
    int rc = check_call(L, m, x, qkv, work, work_bytes);
    if (rc != FX_OK || m == 0) return rc;
    if (L->rope_dim > 0 && (!rope || rope_stride < 2 * (int64_t)L->rope_dim)) return FX_E_QSHAPE;
    int64_t d = L->d, D = L->head_dim, hq = (int64_t)L->n_heads * D, hkv = (int64_t)L->n_kv_heads * D;
    int64_t width = hq + 2 * hkv;
    layer_ws W = carve(L, m, work, work_bytes);
    for (int64_t i = 0; i < m; i++) rms_norm_row(x + i * d, L->attn_norm, d, L->eps, W.h + i * d);
    const int32_t types[3] = {L->q.wtype, L->k.wtype, L->v.wtype};
    const void *ws[3] = {L->q.w, L->k.w, L->v.w};
    const int64_t n_outs[3] = {hq, hkv, hkv}, ldys[3] = {width, width, width};
    float *ys[3] = {qkv, qkv + hq, qkv + hq + hkv};
    rc = fxq_matmul_ld(3, types, ws, n_outs, ldys, d, W.h, m, ys, W.qwork, W.qbytes);
    if (rc != FX_OK) return rc;
    for (int64_t i = 0; i < m; i++) {
        float *row = qkv + i * width;
        if (L->qkv_bias)
            for (int64_t e = 0; e < width; e++) row[e] += L->qkv_bias[e];
        if (L->rope_dim > 0)
            rope_heads(row, L->n_heads + L->n_kv_heads, (int)D, L->rope_dim, L->rope_neox, rope + i * rope_stride);
    }
    return FX_OK;
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

int fx_layer_out_mlp(const fx_qlayer *L, float *x, const float *o, int64_t m, void *work, int64_t work_bytes) {
    int rc = check_call(L, m, x, o, work, work_bytes);
    if (rc != FX_OK || m == 0) return rc;
    int64_t d = L->d, F = L->ffn, hq = (int64_t)L->n_heads * L->head_dim;
    layer_ws W = carve(L, m, work, work_bytes);
    rc = fxq_matmul_ld(1, &L->o.wtype, &L->o.w, &L->o.n_out, NULL, hq, o, m, &W.t, W.qwork, W.qbytes);
    if (rc != FX_OK) return rc;
    for (int64_t i = 0; i < m * d; i++) x[i] += W.t[i];
    for (int64_t i = 0; i < m; i++) rms_norm_row(x + i * d, L->ffn_norm, d, L->eps, W.h + i * d);
    const int32_t types[2] = {L->gate.wtype, L->up.wtype};
    const void *ws[2] = {L->gate.w, L->up.w};
    const int64_t n_outs[2] = {F, F};
    float *ys[2] = {W.g, W.u};
    rc = fxq_matmul_ld(2, types, ws, n_outs, NULL, d, W.h, m, ys, W.qwork, W.qbytes);
    if (rc != FX_OK) return rc;
    for (int64_t i = 0; i < m * F; i++) W.g[i] = silu(W.g[i]) * W.u[i];
    rc = fxq_matmul_ld(1, &L->down.wtype, &L->down.w, &L->down.n_out, NULL, F, W.g, m, &W.t, W.qwork, W.qbytes);
    if (rc != FX_OK) return rc;
    for (int64_t i = 0; i < m * d; i++) x[i] += W.t[i];
    return FX_OK;
}

/* ----------------------------------------------------------------------------------- decode attention -- */

typedef struct {
    const fx_kernels *K;
    const float *q, *k, *v;
    int64_t head_stride, len, chunk, n_chunks, items;
    int r, D;
    float scale;
    float *parts; /* [items][r * D + r]: normalised out, then lse */
    _Atomic int64_t next;
} dattn_job;

static void dattn_worker(void *ctx, int tid, int nthreads) {
    (void)tid;
    (void)nthreads;
    dattn_job *J = ctx;
    int r = J->r, D = J->D;
    float s[FX_MAX_GROUP * FX_DECODE_CHUNK], m[FX_MAX_GROUP], l[FX_MAX_GROUP];
    for (;;) {
        int64_t it = atomic_fetch_add_explicit(&J->next, 1, memory_order_relaxed);
        if (it >= J->items) return;
        int64_t h = it / J->n_chunks, c = it % J->n_chunks;
        int64_t t0 = c * J->chunk;
        int len = (int)(J->len - t0 < J->chunk ? J->len - t0 : J->chunk);
        const float *kh = J->k + h * J->head_stride + t0 * D, *vh = J->v + h * J->head_stride + t0 * D;
        const float *q = J->q + h * r * D;
        float *acc = J->parts + it * ((int64_t)r * D + r), *lse = acc + (int64_t)r * D;
        memset(acc, 0, sizeof(float) * (size_t)r * (size_t)D);
        J->K->qk32(q, r, kh, len, D, J->scale, s, len);
        for (int j = 0; j < r; j++) {
            m[j] = J->K->row_max(s + j * len, len);
            l[j] = J->K->exp_sum(s + j * len, len, m[j]);
        }
        J->K->pv32(s, r, len, vh, len, D, acc);
        fx_finish_partial(acc, lse, m, l, r, D);
    }
}

/* Keys per item: FX_DECODE_CHUNK, or shorter (a multiple of 16, at least FX_DECODE_MIN_CHUNK) until every thread of
 * the pool has two items. */
static int64_t dattn_chunk(int64_t len, int32_t n_kv_heads) {
    int64_t per_head = (2 * (int64_t)fx_pool_threads() + n_kv_heads - 1) / n_kv_heads;
    int64_t chunk = (len + per_head - 1) / per_head;
    chunk = (chunk + 15) & ~(int64_t)15;
    if (chunk < FX_DECODE_MIN_CHUNK) chunk = FX_DECODE_MIN_CHUNK;
    return chunk < FX_DECODE_CHUNK ? chunk : FX_DECODE_CHUNK;
}

int64_t fx_decode_attention_workspace(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int64_t len) {
    if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || len <= 0) return -FX_E_QSHAPE;
    if (n_heads % n_kv_heads || n_heads / n_kv_heads > FX_MAX_GROUP) return -FX_E_GROUP;
    int64_t r = n_heads / n_kv_heads, chunk = dattn_chunk(len, n_kv_heads), chunks = (len + chunk - 1) / chunk;
    return (int64_t)n_kv_heads * chunks * (r * head_dim + r);
}

int fx_decode_attention(const float *q, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float *k, float *v,
                        int64_t head_stride, int64_t len, const float *k_new, const float *v_new, float scale,
                        float *out, float *work, int64_t work_floats) {
    int64_t need = fx_decode_attention_workspace(n_heads, n_kv_heads, head_dim, len);
    if (need < 0) return (int)-need;
    if (!q || !k || !v || !out || !work || head_stride < len * head_dim || (!k_new) != (!v_new)) return FX_E_QSHAPE;
    if (work_floats < need) return FX_E_OUTPUT;
    if (k_new) /* the step's append: row len - 1 of every head */
        for (int64_t h = 0; h < n_kv_heads; h++) {
            memcpy(k + h * head_stride + (len - 1) * head_dim, k_new + h * head_dim, sizeof(float) * (size_t)head_dim);
            memcpy(v + h * head_stride + (len - 1) * head_dim, v_new + h * head_dim, sizeof(float) * (size_t)head_dim);
        }
    dattn_job J;
    memset(&J, 0, sizeof J);
    J.K = fx_kern();
    J.q = q, J.k = k, J.v = v;
    J.head_stride = head_stride, J.len = len;
    J.r = n_heads / n_kv_heads, J.D = head_dim;
    J.scale = scale;
    J.chunk = dattn_chunk(len, n_kv_heads);
    J.n_chunks = (len + J.chunk - 1) / J.chunk;
    J.items = (int64_t)n_kv_heads * J.n_chunks;
    J.parts = work;
    atomic_store(&J.next, 0);
    if (J.items == 1) dattn_worker(&J, 0, 1);
    else fx_pool_run(dattn_worker, &J);
    int64_t stride = (int64_t)J.r * (head_dim + 1);
    float lse[FX_MAX_GROUP];
    for (int64_t h = 0; h < n_kv_heads; h++)
        fx_merge_partials(work + h * J.n_chunks * stride, J.n_chunks, J.r, head_dim,
                          out + h * J.r * (int64_t)head_dim, lse);
    return FX_OK;
}

/* ------------------------------------------------------------------------------------------- decode step -- */

/* Bytes of the step's workspace for these layers (all checked), or a negative error: qkv [width], the attention's
 * output [Hq D] and work, then one layer call's workspace, each 64-byte aligned. */
static int64_t decode_step_bytes(const fx_qlayer *const *layers, int32_t n_layers, int64_t pos, int64_t *attn_floats) {
    if (!layers || n_layers < 1 || pos < 0 || !layers[0]) return -FX_E_QSHAPE;
    const fx_qlayer *L0 = layers[0];
    int64_t layer_bytes = 0;
    for (int32_t l = 0; l < n_layers; l++) {
        const fx_qlayer *L = layers[l];
        if (!L) return -FX_E_QSHAPE;
        int64_t b = fx_layer_workspace(L, 1);
        if (b < 0) return b;
        if (L->d != L0->d || L->n_heads != L0->n_heads || L->n_kv_heads != L0->n_kv_heads ||
            L->head_dim != L0->head_dim)
            return -FX_E_QSHAPE;
        layer_bytes = b > layer_bytes ? b : layer_bytes;
    }
    int64_t attn = fx_decode_attention_workspace(L0->n_heads, L0->n_kv_heads, L0->head_dim, pos + 1);
    if (attn < 0) return attn;
    *attn_floats = attn;
    int64_t hq = (int64_t)L0->n_heads * L0->head_dim, width = hq + 2 * (int64_t)L0->n_kv_heads * L0->head_dim;
    return 64 + a64(width * 4) + a64(hq * 4) + a64(attn * 4) + layer_bytes;
}

int64_t fx_decode_layers_workspace(const fx_qlayer *const *layers, int32_t n_layers, int64_t pos) {
    int64_t attn;
    return decode_step_bytes(layers, n_layers, pos, &attn);
}

int fx_decode_layers(const fx_qlayer *const *layers, int32_t n_layers, float *x, const float *rope, float *k,
                     float *v, int64_t layer_stride, int64_t head_stride, int64_t pos, float scale, void *work,
                     int64_t work_bytes) {
    int64_t attn_floats = 0, need = decode_step_bytes(layers, n_layers, pos, &attn_floats);
    if (need < 0) return (int)-need;
    const fx_qlayer *L0 = layers[0];
    int64_t D = L0->head_dim, hq = (int64_t)L0->n_heads * D, hkv = (int64_t)L0->n_kv_heads * D;
    if (!x || !k || !v || !work || head_stride < (pos + 1) * D || layer_stride < L0->n_kv_heads * head_stride)
        return FX_E_QSHAPE;
    if (L0->rope_dim > 0 && !rope) return FX_E_QSHAPE;
    if (work_bytes < need) return FX_E_OUTPUT;
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    float *qkv = (float *)p;
    p += a64((hq + 2 * hkv) * 4);
    float *o = (float *)p;
    p += a64(hq * 4);
    float *attn = (float *)p;
    p += a64(attn_floats * 4);
    int64_t layer_bytes = work_bytes - (p - (char *)work);
    for (int32_t l = 0; l < n_layers; l++) {
        const fx_qlayer *L = layers[l];
        int rc = fx_layer_qkv(L, x, 1, rope, 2 * (int64_t)L->rope_dim, qkv, p, layer_bytes);
        if (rc == FX_OK)
            rc = fx_decode_attention(qkv, L->n_heads, L->n_kv_heads, L->head_dim, k + l * layer_stride,
                                     v + l * layer_stride, head_stride, pos + 1, qkv + hq, qkv + hq + hkv, scale, o,
                                     attn, attn_floats);
        if (rc == FX_OK) rc = fx_layer_out_mlp(L, x, o, 1, p, layer_bytes);
        if (rc != FX_OK) return rc; /* not reached: every check above was made before the first layer */
    }
    return FX_OK;
}
