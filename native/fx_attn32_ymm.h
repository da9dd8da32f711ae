/* fp32 keys and values (the dense CPU KV cache) on 256-bit vectors: fx_kernels' qk32 / pv32, shared by
 * fx_simd_avx2.c and fx_simd_avx512.c (included after the file's target pragma, which gives AVX2 + FMA).  One
 * 256-bit path for both: a head_dim of 64 is eight ymm loads per token, and these loops are bound by the reads of K
 * and V, not by the vector width.
 *
 * qk32: eight tokens at a time per query row, eight accumulators (one per token) over the head dimension, reduced
 * together by a tree of horizontal adds into one vector of the eight scores (7 shuffles for 8 dot products rather
 * than ~5 per product).  pv32: the accumulators of one query row over a 64-float strip of the head dimension stay
 * in registers while a tile of 64 tokens streams through (the tile stays in L1 for the next rows). */

#define A32_INLINE static inline __attribute__((always_inline))

/* Software prefetch distance of the K / V streams: one core alone does not keep enough reads in flight on its
 * hardware prefetcher (measured on the VM: 7 GB/s per core without, the quantized products reach 15 with it). */
#define A32_PF_BYTES 4096

A32_INLINE void a32_prefetch(const float *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + A32_PF_BYTES + o, 0, 2);
}

/* [sum a0, sum a1, ..., sum a7] */
A32_INLINE __m256 a32_reduce8(const __m256 a[8]) {
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3])); /* a0..a3 by 128-bit half */
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

A32_INLINE float a32_dot(const float *a, const float *b, int d) {
    __m256 acc = _mm256_setzero_ps();
    int e = 0;
    for (; e + 8 <= d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; e < d; e++) sum += a[e] * b[e];
    return sum;
}

static void a32_qk(const float *q, int r, const float *k, int len, int d, float scale, float *s, int ld) {
    const __m256 vs = _mm256_set1_ps(scale);
    int t = 0;
    if (d % 8 == 0) {
        for (; t + 8 <= len; t += 8) {
            const float *kt = k + (int64_t)t * d;
            a32_prefetch(kt, (int64_t)8 * d * 4);
            for (int j = 0; j < r; j++) {
                const float *qj = q + (int64_t)j * d;
                __m256 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
                for (int e = 0; e < d; e += 8) {
                    __m256 qv = _mm256_loadu_ps(qj + e);
                    for (int u = 0; u < 8; u++)
                        acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + (int64_t)u * d + e), acc[u]);
                }
                _mm256_storeu_ps(s + (int64_t)j * ld + t, _mm256_mul_ps(a32_reduce8(acc), vs));
            }
        }
    }
    for (; t < len; t++)
        for (int j = 0; j < r; j++) s[(int64_t)j * ld + t] = a32_dot(q + (int64_t)j * d, k + (int64_t)t * d, d) * scale;
}

#define A32_PV_TILE 64 /* tokens per tile: 64 x head_dim 64 x 4 bytes = 16 KB of V, in L1 for every query row */

static void a32_pv(const float *p, int r, int ld, const float *v, int len, int d, float *acc) {
    for (int t0 = 0; t0 < len; t0 += A32_PV_TILE) {
        int t1 = t0 + A32_PV_TILE < len ? t0 + A32_PV_TILE : len;
        /* the next tile, while this one is read r times from L1 (the first row's pass is the memory read) */
        for (int64_t o = 0; o < (int64_t)(t1 - t0) * d * 4; o += 64)
            __builtin_prefetch((const char *)(v + (int64_t)t1 * d) + o, 0, 2);
        for (int j = 0; j < r; j++) {
            const float *pj = p + (int64_t)j * ld;
            float *aj = acc + (int64_t)j * d;
            int e0 = 0;
            for (; e0 + 64 <= d; e0 += 64) { /* a strip of 64 floats: eight accumulators */
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_loadu_ps(aj + e0 + 8 * u);
                for (int t = t0; t < t1; t++) {
                    __m256 pt = _mm256_set1_ps(pj[t]);
                    const float *vt = v + (int64_t)t * d + e0;
                    for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * u), a[u]);
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(aj + e0 + 8 * u, a[u]);
            }
            for (; e0 + 8 <= d; e0 += 8) {
                __m256 a = _mm256_loadu_ps(aj + e0);
                for (int t = t0; t < t1; t++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pj[t]), _mm256_loadu_ps(v + (int64_t)t * d + e0), a);
                _mm256_storeu_ps(aj + e0, a);
            }
            for (; e0 < d; e0++) {
                float a = aj[e0];
                for (int t = t0; t < t1; t++) a += pj[t] * v[(int64_t)t * d + e0];
                aj[e0] = a;
            }
        }
    }
}
