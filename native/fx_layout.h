/* fx_layout.h -- where things live in a host KV page (fluxion.h, HOST KV LAYOUT), as inline helpers shared by the
 * library's C files.  None of them validates: callers check the view, slot and pages first. */
#ifndef FX_LAYOUT_H
#define FX_LAYOUT_H

#include <stdint.h>
#include "fluxion.h"

static inline int gran_index(int g) {
    switch (g) {
        case 16: return 0;
        case 32: return 1;
        case 64: return 2;
        case 128: return 3;
        default: return -1;
    }
}

static inline uint8_t *page_of(const fx_kv_view *kv, int slot, int64_t tok) {
    return kv->pages[(int64_t)slot * kv->max_pages + tok / kv->page_tokens];
}

/* K row of token `tok` (head h); V is the same offset plus Hkv*P*D elements. */
static inline uint16_t *k_row(const fx_kv_view *kv, int slot, int h, int64_t tok) {
    int64_t P = kv->page_tokens;
    return (uint16_t *)page_of(kv, slot, tok) + ((int64_t)h * P + tok % P) * kv->head_dim;
}

static inline int64_t v_offset(const fx_kv_view *kv) {
    return (int64_t)kv->n_kv_heads * kv->page_tokens * kv->head_dim;
}

/* Bytes of the min/max summaries of the kept granularities with index < below in one page (they follow K and V):
 * below = gi is granularity gi's offset among them, below = 4 all of them. */
static inline int64_t summaries_bytes(const fx_kv_view *kv, int below) {
    int64_t P = kv->page_tokens, D = kv->head_dim, H = kv->n_kv_heads, bytes = 0;
    for (int i = 0; i < below; i++)
        if (kv->gran_mask & (1 << i)) bytes += H * (P / (16 << i)) * 2 * D * 2;
    return bytes;
}

/* Summary [2][D] (16-bit, the KV dtype) of block b (granularity index gi) of head h. */
static inline uint16_t *summary(const fx_kv_view *kv, int slot, int h, int gi, int64_t b) {
    int64_t P = kv->page_tokens, D = kv->head_dim, H = kv->n_kv_heads, g = 16 << gi;
    uint8_t *sums = page_of(kv, slot, b * g) + 2 * H * P * D * 2 + summaries_bytes(kv, gi);
    return (uint16_t *)sums + ((int64_t)h * (P / g) + (b * g % P) / g) * 2 * D;
}

/* A task's excluded token range x (0 or 1) clipped to [0, n_tok): its first token in *lo, its length returned (0:
 * empty). */
static inline int64_t excluded_range(const int32_t *t, int x, int64_t n_tok, int64_t *lo) {
    int64_t a = t[5 + 2 * x], b = t[6 + 2 * x];
    if (a < 0) a = 0;
    if (b > n_tok) b = n_tok;
    *lo = a;
    return b > a ? b - a : 0;
}

/* A task's excluded token ranges as block ranges [ex_lo[x], ex_hi[x]) (a block is excluded when it intersects a
 * range; an empty range becomes [0, 0)). */
static inline void excluded_blocks(const int32_t *t, int64_t n_tok, int64_t ex_lo[2], int64_t ex_hi[2]) {
    int g = t[3];
    for (int x = 0; x < 2; x++) {
        int64_t lo, len = excluded_range(t, x, n_tok, &lo);
        ex_lo[x] = len ? lo / g : 0;
        ex_hi[x] = len ? (lo + len - 1) / g + 1 : 0;
    }
}

static inline int block_excluded(int64_t b, const int64_t ex_lo[2], const int64_t ex_hi[2]) {
    return (b >= ex_lo[0] && b < ex_hi[0]) || (b >= ex_lo[1] && b < ex_hi[1]);
}

/* Value sums [D] fp32 of 128-token block b of head h (only where the view keeps them: FX_KEEP_VALUE_SUMS). */
static inline float *value_sums(const fx_kv_view *kv, int slot, int h, int64_t b) {
    int64_t P = kv->page_tokens, D = kv->head_dim, H = kv->n_kv_heads;
    uint8_t *page = page_of(kv, slot, b * FX_MAX_BLOCK);
    float *vs = (float *)(page + 2 * H * P * D * 2 + summaries_bytes(kv, 4));
    return vs + ((int64_t)h * (P / FX_MAX_BLOCK) + (b * FX_MAX_BLOCK % P) / FX_MAX_BLOCK) * D;
}

#endif
