/* The 32-block kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on 256-bit vectors, one block per vector, shared by
 * fx_quant_avx2.c and the AVX-512 files (fx_quant_avx512.h): included after the file's target pragma, with
 * FXQ_YMM_VNNI 1 for vpdpbusd on ymm (AVX512-VNNI + VL), 0 for vpmaddubsw + vpmaddwd.  256-bit, not 512-bit, on the
 * AVX-512 paths too: a 32-block fills a 256-bit vector exactly, and a first version with two blocks per 512-bit
 * vector (per-block scales) was no faster than AVX2 on the Sapphire Rapids Xeon measured; this one is 1.2-1.9x
 * faster than it per core at m = 1 (bench/qmatmul.py).
 *
 * Blocks go 8 at a time: their 8 fp16 scales are converted and multiplied by the 8 activation scales in one vector
 * operation each (stored to the stack, then broadcast per block by a load), and the per-block offset terms are one
 * FMA per 8 blocks: Q4_0 / Q5_0 take their unsigned part n (0..15, 0..31) into the integer dot product and add
 * -8 d (-16 d) * (dx sum(qx)); Q4_1 / Q5_1 add m * (dx sum(qx)).  Q8_0 is signed: |qs| with the sign moved onto x
 * (vpsignb), the sums exactly sum(qs qx).  Per block and row of x that leaves the dot product, a conversion and an
 * FMA.  No int16 pair saturates (weight bytes <= 128, |qx| <= 127: at most 32512), so both dot products give the
 * same int32 lanes. */

FXQ_INLINE_Y float hsum8_y(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 lanes, lane l = sum of the products of bytes 4l .. 4l + 3 (u unsigned, s signed) */
FXQ_INLINE_Y __m256i dot_y(__m256i u, __m256i s) {
#if FXQ_YMM_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The 32 nibbles of 16 bytes in element order: low nibbles (elements 0..15), then high nibbles (16..31). */
FXQ_INLINE_Y __m256i nibbles_y(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
}

/* Byte e = 16 if bit e of the little-endian uint32 at qh is set, else 0 (Q5_0 / Q5_1's fifth bits). */
FXQ_INLINE_Y __m256i fifth_bits_y(const uint8_t *qh) {
    __m256i v = _mm256_set1_epi32((int)fxq_u32(qh));
    v = _mm256_shuffle_epi8(v, _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(16));
}

/* The integer part that goes into the dot product: n for Q4_0/Q4_1/Q5_0/Q5_1 (unsigned), qs for Q8_0 (signed). */
FXQ_INLINE_Y __m256i ints_y(int t, const uint8_t *p) {
    switch (t) {
        case FX_QT_Q4_0: return nibbles_y(p + 2);
        case FX_QT_Q4_1: return nibbles_y(p + 4);
        case FX_QT_Q5_0: return _mm256_or_si256(nibbles_y(p + 6), fifth_bits_y(p + 2));
        case FX_QT_Q5_1: return _mm256_or_si256(nibbles_y(p + 8), fifth_bits_y(p + 4));
        default: return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
}

/* The fp16 field at byte offset off of 8 consecutive blocks, as fp32 */
FXQ_INLINE_Y __m256 f16x8_y(const uint8_t *p, int bytes, int off) {
    __m128i h = _mm_setr_epi16((short)fxq_u16(p + off), (short)fxq_u16(p + bytes + off),
                               (short)fxq_u16(p + 2 * bytes + off), (short)fxq_u16(p + 3 * bytes + off),
                               (short)fxq_u16(p + 4 * bytes + off), (short)fxq_u16(p + 5 * bytes + off),
                               (short)fxq_u16(p + 6 * bytes + off), (short)fxq_u16(p + 7 * bytes + off));
    return _mm256_cvtph_ps(h);
}

/* dot of block p with x block xb of one row, integer part as ints_y gave it (signed: Q8_0) */
FXQ_INLINE_Y __m256i block_dot_y(int signed_w, __m256i w, const int8_t *xb) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)xb);
    return signed_w ? dot_y(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)) : dot_y(w, xv);
}

FXQ_INLINE_Y void q32_tile_y(int t, int bytes, const uint8_t *row, const fxq_act *a, int i0, const int MT, float *y,
                             int64_t ldy) {
    const int64_t k = a->k, nb = k / 32;
    const int signed_w = t == FX_QT_Q8_0, has_min = t == FX_QT_Q4_1 || t == FX_QT_Q5_1;
    const float off = t == FX_QT_Q4_0 ? -8.0f : t == FX_QT_Q5_0 ? -16.0f : 0.0f; /* the offset, times d */
    const int8_t *xq = a->q32 + i0 * k;
    const float *xd = a->d32 + i0 * nb, *xs = a->s32 + i0 * nb;
    __m256 acc[FXQ_YMM_MT], cacc[FXQ_YMM_MT];
    float scale[FXQ_YMM_MT][8] __attribute__((aligned(32)));
    for (int i = 0; i < MT; i++) acc[i] = cacc[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *p = row + b * bytes;
        fxq_prefetch(p, 8 * bytes);
        const __m256 d8 = f16x8_y(p, bytes, 0);
        const __m256 c8 = has_min ? f16x8_y(p, bytes, 2) : _mm256_mul_ps(d8, _mm256_set1_ps(off));
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            _mm256_store_ps(scale[i], _mm256_mul_ps(d8, _mm256_loadu_ps(xd + i * nb + b)));
            if (!signed_w) cacc[i] = _mm256_fmadd_ps(c8, _mm256_loadu_ps(xs + i * nb + b), cacc[i]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i w = ints_y(t, p + j * bytes);
#pragma GCC unroll 8
            for (int i = 0; i < MT; i++) {
                __m256i dot = block_dot_y(signed_w, w, xq + i * k + 32 * (b + j));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[i][j]), acc[i]);
            }
        }
    }
    float corr[FXQ_YMM_MT];
    for (int i = 0; i < MT; i++) corr[i] = 0.0f;
    for (; b < nb; b++) { /* the last nb % 8 blocks one by one */
        const uint8_t *p = row + b * bytes;
        const float d = _cvtsh_ss(fxq_u16(p)), c = has_min ? _cvtsh_ss(fxq_u16(p + 2)) : d * off;
        const __m256i w = ints_y(t, p);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            __m256i dot = block_dot_y(signed_w, w, xq + i * k + 32 * b);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[i * nb + b]), acc[i]);
            if (!signed_w) corr[i] += c * xs[i * nb + b];
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum8_y(_mm256_add_ps(acc[i], cacc[i])) + corr[i];
}
