/* AVX-512 kernels of the quantized-weight products with AVX-512BW integer dot products (vpmaddubsw + vpmaddwd):
 * FX_SIMD_AVX512 / FX_SIMD_AVX512_BF16 on CPUs without AVX512-VNNI, or with fx_set_vnni(0).  The kernels are
 * fx_quant_avx512.h's; the target pragma enables the instruction sets for this file only and fx_quant.c calls in
 * here only when the CPU has them. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")
#endif

#define FXQ_VNNI 0
#define FXQ_TABLE fx_qkernels_avx512
#include "fx_quant_avx512.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
