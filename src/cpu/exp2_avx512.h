/*
 * exp2_avx512.h - the AVX-512 vector 2^x, the online softmax's max step and decode's row-major softmax that
 * kernels_avx512.c (softmax, exp2_sub, softmax_rows) and kernels_avx512bf16.c (the bf16 backward's fused P and dS
 * step, the forward's softmax into P's pair rows, decode's softmax_rows_p16) share (include it only from a file built
 * with -mavx512f -mfma). Degree-6 polynomial of 2^f (cpu.h, FLASHC_EXP2_C*), scaled by 2^n with vscalefps: the fp32
 * P (softmax, exp2_sub: the fp32 backward and the bf16 one with softcap) and the alphas. Where P is rounded to bf16
 * before its product and read nowhere else (the forward's softmax_pairs / softmax_prows and decode with bf16 V, before
 * P V; the bf16 backward's fused step, before dV += P^T dO, and its dS = P (dP - D), rounded to bf16 before dK and dQ)
 * it takes flashc_exp2_p16_avx512 instead, 3e-6 relative against bf16's 2^-9: that P is neither the fp32 softmax's
 * nor exp2_sub's bit for bit (nothing compares them; the backward recomputes its own P from the forward's lse).
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

/*
 * 2^x for a P that is rounded to bf16 next (the forward's P before P V with bf16 V; the bf16 backward's P before dV +=
 * P^T dO and dS = P (dP - D) before dK, dQ): x = s - m' <= 0 (s - lse2 in the backward, at most a rounding of the lse
 * above 0, where f = x and 2^0 scales), -inf (a masked score, or a padding row's lse2 +inf) or NaN (kept). vreduceps
 * gives f = x - floor(x) in [0, 1] in one instruction, a degree-4 polynomial with p(0) = 1 exactly (cpu.h,
 * FLASHC_EXP2_P16_C*: the row's largest P is 1) gives 2^f to 3e-6 relative, and vscalefps multiplies by 2^floor(x): 6
 * operations where flashc_exp2_avx512 takes 13 (and the degree-6 polynomial behind a clamp at -150 that softmax_pairs
 * took before, 10). At -inf f is 0 and the scale 2^-inf gives 0, so no clamp; below -126 denormals, as that clamped
 * form gave (vcvtne2ps2bf16 reads them as 0, and l, which the row's largest P, 1, joins, cannot hold them; the
 * backward's dS = P (dP - D) of such a P is at most |dP - D| 2^-126, where flashc_exp2_avx512's flush gave 0). 3e-6 is
 * a 650th of bf16's rounding of P (2^-9); l sums these same fp32 values, so P / l carries only their differences across
 * a row. Needs AVX512DQ (vreduceps): defined only in files built with it (kernels_avx512bf16.c; backend.c checks the
 * CPU for it).
 */
#if defined(__AVX512DQ__)
__attribute__((always_inline)) static inline __m512 flashc_exp2_p16_avx512(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(FLASHC_EXP2_P16_C4);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_P16_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_P16_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(FLASHC_EXP2_P16_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}
#endif

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

/* 2^x of a P: flashc_exp2_p16_avx512 where P16 (P rounded to bf16 next, in a file built with AVX512DQ), else
 * flashc_exp2_avx512. */
__attribute__((always_inline)) static inline __m512 flashc_exp2_of_p_avx512(const int P16, __m512 x) {
#if defined(__AVX512DQ__)
    if (P16) return flashc_exp2_p16_avx512(x);
#else
    (void)P16;
#endif
    return flashc_exp2_avx512(x);
}

/*
 * Decode's online softmax on a query-row-major tile (cpu.h, flashc_cpu_softmax_rows_fn): each row in 16-wide vectors,
 * its max and sum reduced once, then per group of up to 16 rows one vector exp2 for their alphas. Against the AVX2
 * kernel (8-wide, which the AVX-512 table used before): half the exp2 polynomials and loads per row; 2.5 -> 2.1 ns
 * per key and kv head at 4 rows x 32 keys (Zen 4 VM), decode with the cache hot 1.06-1.08x at 8/2/32, cold no
 * change beyond the spread. P16: P's 2^x by flashc_exp2_p16_avx512 (the avx512bf16 set's softmax_rows_p16, whose P
 * pv rounds to bf16); the alphas keep flashc_exp2_avx512 (they rescale O and l, whose lse the backward reads).
 */
__attribute__((always_inline)) static inline void flashc_softmax_rows_avx512(const int P16, int rows, int cols,
                                                                              float *s, int64_t lds, float *m,
                                                                              float *l, float *alpha) {
    const __m512 zero = _mm512_setzero_ps();
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int g = rows - r0 < 16 ? rows - r0 : 16;
        _Alignas(64) float mn[16] = {0}, sm[16] = {0};
        for (int i = 0; i < g; i++) {
            float *x = s + (int64_t)(r0 + i) * lds;
            /* NaN scores are skipped by the max (its second operand, mx, wins) and reach the sum through exp2. */
            __m512 mx = _mm512_set1_ps(m[r0 + i]);
            for (int c = 0; c < cols; c += 16) mx = _mm512_max_ps(_mm512_loadu_ps(x + c), mx);
            const float m_new = _mm512_reduce_max_ps(mx);
            const __m512 vsub = _mm512_set1_ps(m_new == -INFINITY ? 0.0f : m_new);
            __m512 sum = zero;
            for (int c = 0; c < cols; c += 16) {
                const __m512 e = flashc_exp2_of_p_avx512(P16, _mm512_sub_ps(_mm512_loadu_ps(x + c), vsub));
                _mm512_storeu_ps(x + c, e);
                sum = _mm512_add_ps(sum, e);
            }
            sm[i] = _mm512_reduce_add_ps(sum);
            mn[i] = m_new;
        }
        const __mmask16 mask = (__mmask16)((1u << g) - 1u);
        __m512 m_new, a;
        (void)flashc_softmax_sub_of_max(_mm512_load_ps(mn), _mm512_maskz_loadu_ps(mask, m + r0), &m_new, &a);
        _mm512_mask_storeu_ps(alpha + r0, mask, a);
        const __m512 l_new = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, l + r0), a, _mm512_load_ps(sm));
        _mm512_mask_storeu_ps(l + r0, mask, l_new);
        _mm512_mask_storeu_ps(m + r0, mask, m_new);
    }
}

#endif
