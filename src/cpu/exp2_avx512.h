/*
 * exp2_avx512.h - the AVX-512 vector 2^x that kernels_avx512.c (softmax, exp2_sub) and kernels_avx512bf16.c (the
 * bf16 backward's fused P and dS step) share, so that both give P bit for bit (include it only from a file built with
 * -mavx512f -mfma). Degree-6 polynomial of 2^f (cpu.h, FLASHC_EXP2_C*), scaled by 2^n with vscalefps.
 */
#ifndef FLASHC_CPU_EXP2_AVX512_H
#define FLASHC_CPU_EXP2_AVX512_H

#include "cpu.h"

#include <immintrin.h>

/* Clamped to [-126, 128]: vscalefps turns n = 128 into +inf, and +inf inputs never reach inf - inf = NaN. */
__attribute__((always_inline)) static inline __m512 flashc_exp2_avx512(__m512 x) {
    /* NaN stays NaN: max/min return their second operand when either is NaN, so x goes second, and the flush to
     * 0 below -126 is "not less than", true for NaN. */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(128.0f), _mm512_max_ps(_mm512_set1_ps(-126.0f), x));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(FLASHC_EXP2_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

#endif
