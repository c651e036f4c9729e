/*
 * AVX512-BF16 microkernels for bf16 attention, forward and backward (built with -mavx512bf16 -mavx512bw on top of the
 * AVX-512 flags, chosen at run time only on a CPU with both; backend.c adds them to the AVX-512 table as the
 * "avx512bf16" set).
 * gemm: the AVX-512 kernel's 12x32 register tile (24 zmm accumulators, 2 for the B pair row, 1 for the A broadcast)
 * with vdpbf16ps in place of the FMA: each instruction takes a pair of the reduction index, 32 bf16 products into 16
 * f32 lanes, so a k step of the loop covers two of the fp32 kernel's. A's pair is one 32-bit broadcast; B is in pair
 * rows (cpu.h, flashc_cpu_gemm_bf16_fn). pairs: two rows of a tile interleaved into one pair row, fp32 rounded to
 * bf16 by vcvtne2ps2bf16 (to nearest even, as flash-attn rounds P and dS on the GPU) and zipped by vpermw (AVX512BW,
 * which every CPU with AVX512-BF16 has); to_bf16: the same rounding in place of layout.
 */
#include "cpu.h"

#if defined(FLASHC_CPU_X86) && defined(FLASHC_CPU_AVX512BF16)
#include <immintrin.h>
#include <string.h>

#define AI __attribute__((always_inline)) static inline

AI __mmask16 first(int n) { return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* A pair (two bf16) as one 32-bit lane value, from any alignment. */
AI int pair_at(const uint16_t *ptr) {
    int x;
    memcpy(&x, ptr, sizeof x);
    return x;
}

/*
 * C[0..MR)[0..nr) (+)= alpha A B for one 12x32 register tile, k pair steps; A addressed from four row bases as in the
 * fp32 kernel (kernels_avx512.c says why).
 */
AI void ukr_bf16_12x32(const int MR, int nr, int k, const uint16_t *a, int64_t rs_a, int64_t cs_a, const uint16_t *b,
                       int64_t ldb, float *c, int64_t ldc, float alpha, int accumulate) {
    __m512 c0[12], c1[12];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    const __mmask16 m0 = first(nr), m1 = first(nr - 16);
    const uint16_t *a0 = a, *a3 = a + 3 * rs_a, *a6 = a + 6 * rs_a, *a9 = a + 9 * rs_a, *bp = b;
    const int64_t r1 = rs_a, r2 = 2 * rs_a;
/* C row i += A pair (i, p) . (b0, b1), where ptr points at the pair. */
#define ROW(i, ptr)                                                                                                   \
    if (i < MR) {                                                                                                     \
        const __m512bh ai = (__m512bh)_mm512_set1_epi32(pair_at(ptr));                                                \
        c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);                                                                      \
        c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);                                                                      \
    }
#define K_STEP                                                                                                        \
    ROW(0, a0) ROW(1, a0 + r1) ROW(2, a0 + r2) ROW(3, a3) ROW(4, a3 + r1) ROW(5, a3 + r2)                             \
    ROW(6, a6) ROW(7, a6 + r1) ROW(8, a6 + r2) ROW(9, a9) ROW(10, a9 + r1) ROW(11, a9 + r2)                           \
    a0 += cs_a, a3 += cs_a, a6 += cs_a, a9 += cs_a, bp += ldb;
    if (nr == 32) {
        for (int p = 0; p < k; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 32);
            K_STEP
        }
    } else {
        for (int p = 0; p < k; p++) {
            const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, bp);
            const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, bp + 32);
            K_STEP
        }
    }
#undef K_STEP
#undef ROW
    const __m512 s = _mm512_set1_ps(alpha);
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        float *ci = c + (size_t)i * ldc;
        c0[i] = _mm512_mul_ps(c0[i], s);
        c1[i] = _mm512_mul_ps(c1[i], s);
        if (accumulate) {
            c0[i] = _mm512_add_ps(c0[i], _mm512_maskz_loadu_ps(m0, ci));
            c1[i] = _mm512_add_ps(c1[i], _mm512_maskz_loadu_ps(m1, ci + 16));
        }
        _mm512_mask_storeu_ps(ci, m0, c0[i]);
        _mm512_mask_storeu_ps(ci + 16, m1, c1[i]);
    }
}

static void gemm_bf16_avx512(int m, int n, int k, const uint16_t *a, int64_t rs_a, int64_t cs_a, const uint16_t *b,
                             int64_t ldb, float *c, int64_t ldc, float alpha, int accumulate) {
    for (int j0 = 0; j0 < n; j0 += 32) {
        const int nr = n - j0 < 32 ? n - j0 : 32;
        const uint16_t *bj = b + 2 * (int64_t)j0;
        float *cj = c + j0;
        int i0 = 0;
        for (; i0 + 12 <= m; i0 += 12)
            ukr_bf16_12x32(12, nr, k, a + (int64_t)i0 * rs_a, rs_a, cs_a, bj, ldb, cj + (size_t)i0 * ldc, ldc, alpha,
                           accumulate);
        const uint16_t *ai = a + (int64_t)i0 * rs_a;
        float *ci = cj + (size_t)i0 * ldc;
#define TAIL(r)                                                                                                       \
    case r: ukr_bf16_12x32(r, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, alpha, accumulate); break;
        switch (m - i0) {
            TAIL(11) TAIL(10) TAIL(9) TAIL(8) TAIL(7) TAIL(6) TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
        default: break;
        }
#undef TAIL
    }
}

/* 16 pairs (x0[j], x1[j]) as 32-bit lanes, x0 in the low half. */
AI __m512i interleave(__m256i x0, __m256i x1) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(x0), _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16));
}

/* Row r of the pair rows' source, NULL for the zero rows (before the first, after the last). */
AI const float *row_f32(const float *src, int64_t lds, int rows, int r) {
    return r >= 0 && r < rows ? src + (int64_t)r * lds : NULL;
}

AI __m512 load_or_zero(const float *x, __mmask16 m) { return x ? _mm512_maskz_loadu_ps(m, x) : _mm512_setzero_ps(); }

/*
 * vcvtne2ps2bf16 rounds both rows into one register (x0 in the low 16 words, x1 in the high), and vpermw puts each
 * x1 word beside its x0 word: two instructions per 16 pairs, where widening each half to 32 bits and merging took six
 * (P's pair rows are a pass over every score tile).
 */
static void pairs_f32_avx512(int rows, int lead, int n, const float *src, int64_t lds, uint16_t *dst, int64_t ldd) {
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; 2 * p < rows + lead; p++) {
        const float *x0 = row_f32(src, lds, rows, 2 * p - lead), *x1 = row_f32(src, lds, rows, 2 * p + 1 - lead);
        uint16_t *d = dst + (int64_t)p * ldd;
        for (int j = 0; j < n; j += 16) {
            const __mmask16 m = first(n - j);
            const __m512bh both = _mm512_cvtne2ps_pbh(load_or_zero(x1 ? x1 + j : NULL, m),
                                                      load_or_zero(x0 ? x0 + j : NULL, m));
            _mm512_mask_storeu_epi32(d + 2 * j, m, _mm512_permutexvar_epi16(zip, (__m512i)both));
        }
    }
}

static void pairs_bf16_avx512(int rows, int n, const uint16_t *src, int64_t lds, uint16_t *dst, int64_t ldd) {
    const __m256i zero = _mm256_setzero_si256();
    for (int p = 0; 2 * p < rows; p++) {
        const uint16_t *x0 = src + (int64_t)2 * p * lds, *x1 = 2 * p + 1 < rows ? x0 + lds : NULL;
        uint16_t *d = dst + (int64_t)p * ldd;
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(x0 + j));
            const __m256i hi = x1 ? _mm256_loadu_si256((const __m256i *)(x1 + j)) : zero;
            _mm512_storeu_si512(d + 2 * j, interleave(lo, hi));
        }
        for (; j < n; j++) d[2 * j] = x0[j], d[2 * j + 1] = x1 ? x1[j] : 0;
    }
}

static void to_bf16_avx512(int n, const float *src, uint16_t *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = flashc_f32_to_bf16(src[i]);
}

const flashc_cpu_bf16_kernels flashc_cpu_bf16_kernels_avx512 = {
    .gemm = gemm_bf16_avx512,
    .pairs_f32 = pairs_f32_avx512,
    .pairs_bf16 = pairs_bf16_avx512,
    .to_bf16 = to_bf16_avx512,
};
#endif
