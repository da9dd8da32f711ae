/* AVX-512 kernels of the quantized-weight products with AVX512-VNNI integer dot products (vpdpbusd, vpdpwssd):
 * FX_SIMD_AVX512 / FX_SIMD_AVX512_BF16 where the CPU has AVX512-VNNI (fx_set_vnni, on by default).  The kernels are
 * fx_quant_avx512.h's, bit for bit the results of fx_quant_avx512.c; the target pragma enables the instruction sets
 * for this file only and fx_quant.c calls in here only when the CPU has them. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")
#endif

#define FXQ_VNNI 1
#define FXQ_TABLE fx_qkernels_avx512vnni
#include "fx_quant_avx512.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
