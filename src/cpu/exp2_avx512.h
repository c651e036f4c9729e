/*
 * exp2_avx512.h - the AVX-512 vector 2^x and the online softmax's max step that kernels_avx512.c (softmax, exp2_sub)
 * and kernels_avx512bf16.c (the bf16 backward's fused P and dS step, the forward's softmax into P's pair rows) share,
 * so that both give P bit for bit (include it only from a file built with -mavx512f -mfma). Degree-6 polynomial of
 * 2^f (cpu.h, FLASHC_EXP2_C*), scaled by 2^n with vscalefps.
 */
#ifndef FLASHC_CPU_EXP2_AVX512_H
#define FLASHC_CPU_EXP2_AVX512_H

#include "cpu.h"

#include <immintrin.h>

/* 2^x for an x already bounded by its caller: the polynomial of 2^f at f = x - round(x), scaled by 2^round(x). */
__attribute__((always_inline)) static inline __m512 flashc_exp2_poly_avx512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(FLASHC_EXP2_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Clamped to [-126, 128]: vscalefps turns n = 128 into +inf, and +inf inputs never reach inf - inf = NaN. */
__attribute__((always_inline)) static inline __m512 flashc_exp2_avx512(__m512 x) {
    /* NaN stays NaN: max/min return their second operand when either is NaN, so x goes second, and the flush to
     * 0 below -126 is "not less than", true for NaN. */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(128.0f), _mm512_max_ps(_mm512_set1_ps(-126.0f), x));
    return _mm512_maskz_mov_ps(keep, flashc_exp2_poly_avx512(x));
}

/* flashc_softmax_sub_avx512's end from the new row maxima mx (m_old among them), however they were found: what the
 * scores subtract, alpha and *m_new. */
__attribute__((always_inline)) static inline __m512 flashc_softmax_sub_of_max(__m512 mx, __m512 m_old, __m512 *m_new,
                                                                              __m512 *alpha) {
    const __mmask16 empty = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    const __m512 sub = _mm512_mask_mov_ps(mx, empty, _mm512_setzero_ps());
    *alpha = _mm512_mask_mov_ps(flashc_exp2_avx512(_mm512_sub_ps(m_old, sub)), empty, _mm512_set1_ps(1.0f));
    *m_new = mx;
    return sub;
}

/*
 * The online softmax's first steps for 16 rows whose scores lie in columns (st + c ld, c < cols): the new row max
 * from m_old (NaN scores skipped: max returns its second operand, mx, when the score is NaN, as fmaxf does in the
 * portable kernel; a NaN score still makes its row NaN through exp2 and the sum) into *m_new; returned: what the
 * scores subtract (the max, or 0 for a row that has seen no key), and in *alpha 2^(m_old - that) (1 for such a row).
 */
__attribute__((always_inline)) static inline __m512 flashc_softmax_sub_avx512(int cols, const float *st, int64_t ld,
                                                                               __m512 m_old, __m512 *m_new,
                                                                               __m512 *alpha) {
    __m512 mx = m_old;
    for (int c = 0; c < cols; c++) mx = _mm512_max_ps(_mm512_loadu_ps(st + (size_t)c * ld), mx);
    return flashc_softmax_sub_of_max(mx, m_old, m_new, alpha);
}

#endif
