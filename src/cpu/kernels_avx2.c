/*
 * AVX2 + FMA + F16C microkernels (built with -mavx2 -mfma -mf16c, chosen at run time).
 * gemm: a 6x16 register tile (12 ymm accumulators, 2 for the B row, 1 for the A broadcast: 15 of 16 ymm), the
 * shape of BLIS's haswell sgemm kernel, with masked loads/stores for the last columns.
 * exp2: 2^x = 2^n * 2^f, n = round(x), f in [-1/2, 1/2], 2^f by a degree-6 polynomial in f (FLASHC_EXP2_C*, cpu.h);
 * inputs below -126 (and -inf, NaN) give 0.
 * decode (decode.c): dots_kv (query rows against eight keys per hsum8, K read in place as fp32 or bf16) and pv
 * (O = alpha O + P V on a 4x16 tile of O, V read in place), both widening bf16 in registers.
 */
#include "cpu.h"

#if defined(FLASHC_CPU_X86)
#include <immintrin.h>
#include <string.h>

#define AI __attribute__((always_inline)) static inline

static const int32_t mask_table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* First n (0..8) lanes set. */
AI __m256i lanes(int n) {
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_loadu_si256((const __m256i *)(mask_table + 8 - n));
}

/*
 * C[0..MR)[0..nr) (+)= A B for one 6x16 register tile, k steps. A(i, p) = a[i * rs_a + p * cs_a] is addressed from
 * two row bases (rows 0 and 3) plus one and two row strides, which keeps the loop free of spilled pointers whichever
 * way A is laid out (the AVX-512 kernel explains why that matters).
 */
AI void ukr_6x16(const int MR, int nr, int k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int accumulate) {
    __m256 c0[6], c1[6];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    if (accumulate) /* the C tile is read only after the k loop: start its lines on their way now */
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) _mm_prefetch((const char *)(c + (size_t)i * ldc), _MM_HINT_T0);
    const float *a0 = a, *a3 = a + 3 * rs_a, *bp = b;
    const int64_t r1 = rs_a, r2 = 2 * rs_a;
/* C row i += A(i, p) * (b0, b1), where ptr points at A(i, p). */
#define ROW(i, ptr)                                                                                                   \
    if (i < MR) {                                                                                                     \
        const __m256 ai = _mm256_broadcast_ss(ptr);                                                                   \
        c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);                                                                       \
        c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);                                                                       \
    }
#define K_STEP                                                                                                        \
    ROW(0, a0) ROW(1, a0 + r1) ROW(2, a0 + r2) ROW(3, a3) ROW(4, a3 + r1) ROW(5, a3 + r2)                             \
    a0 += cs_a, a3 += cs_a, bp += ldb;
    if (nr == 16) {
        for (int p = 0; p < k; p++) {
            const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
            K_STEP
        }
    } else {
        const __m256i m0 = lanes(nr), m1 = lanes(nr - 8);
        for (int p = 0; p < k; p++) {
            const __m256 b0 = _mm256_maskload_ps(bp, m0), b1 = _mm256_maskload_ps(bp + 8, m1);
            K_STEP
        }
    }
#undef K_STEP
#undef ROW
    const __m256i m0 = lanes(nr), m1 = lanes(nr - 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        float *ci = c + (size_t)i * ldc;
        if (nr == 16) {
            if (accumulate) {
                c0[i] = _mm256_add_ps(c0[i], _mm256_loadu_ps(ci));
                c1[i] = _mm256_add_ps(c1[i], _mm256_loadu_ps(ci + 8));
            }
            _mm256_storeu_ps(ci, c0[i]);
            _mm256_storeu_ps(ci + 8, c1[i]);
        } else {
            if (accumulate) {
                c0[i] = _mm256_add_ps(c0[i], _mm256_maskload_ps(ci, m0));
                c1[i] = _mm256_add_ps(c1[i], _mm256_maskload_ps(ci + 8, m1));
            }
            _mm256_maskstore_ps(ci, m0, c0[i]);
            _mm256_maskstore_ps(ci + 8, m1, c1[i]);
        }
    }
}

static void gemm_avx2(int m, int n, int k, const float *a, int64_t rs_a, int64_t cs_a, const float *b, int64_t ldb,
                      float *c, int64_t ldc, int accumulate) {
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int nr = n - j0 < 16 ? n - j0 : 16;
        const float *bj = b + j0;
        float *cj = c + j0;
        int i0 = 0;
        for (; i0 + 6 <= m; i0 += 6)
            ukr_6x16(6, nr, k, a + (int64_t)i0 * rs_a, rs_a, cs_a, bj, ldb, cj + (size_t)i0 * ldc, ldc, accumulate);
        const float *ai = a + (int64_t)i0 * rs_a;
        float *ci = cj + (size_t)i0 * ldc;
        switch (m - i0) {
        case 5: ukr_6x16(5, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 4: ukr_6x16(4, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 3: ukr_6x16(3, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 2: ukr_6x16(2, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 1: ukr_6x16(1, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        default: break;
        }
    }
}

AI __m256 exp2_ps(__m256 x) {
    /* NaN stays NaN: max/min return their second operand when either is NaN, so x goes second, and the flush to
     * 0 below -126 is "not less than", true for NaN. */
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-126.0f), x));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(FLASHC_EXP2_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(FLASHC_EXP2_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(FLASHC_EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(FLASHC_EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(FLASHC_EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(FLASHC_EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

static void softmax_avx2(int cols, int rows, float *st, int64_t ld, float *m, float *l, float *alpha) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    for (int r = 0; r < rows; r += 8) {
        const __m256 m_old = _mm256_loadu_ps(m + r);
        __m256 mx = m_old;
        /* The row max skips NaN scores (max returns its second operand, mx, when the score is NaN), as fmaxf does
         * in the portable kernel; a NaN score still makes its row NaN through exp2 and the sum. */
        for (int c = 0; c < cols; c++) mx = _mm256_max_ps(_mm256_loadu_ps(st + (size_t)c * ld + r), mx);
        const __m256 empty = _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ);
        const __m256 sub = _mm256_blendv_ps(mx, zero, empty);
        const __m256 a = _mm256_blendv_ps(exp2_ps(_mm256_sub_ps(m_old, sub)), one, empty);
        __m256 sum = zero;
        for (int c = 0; c < cols; c++) {
            float *x = st + (size_t)c * ld + r;
            const __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(x), sub));
            _mm256_storeu_ps(x, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(alpha + r, a);
        _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
        _mm256_storeu_ps(m + r, mx);
    }
}

static void exp2_sub_avx2(int cols, int rows, float *st, int64_t ld, const float *sub) {
    for (int c = 0; c < cols; c++) {
        float *col = st + (size_t)c * ld;
        for (int r = 0; r < rows; r += 8)
            _mm256_storeu_ps(col + r, exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(col + r), _mm256_loadu_ps(sub + r))));
    }
}

static void exp2_avx2(int n, const float *src, float *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, exp2_ps(_mm256_loadu_ps(src + i)));
    if (i < n) {
        const __m256i m = lanes(n - i);
        _mm256_maskstore_ps(dst + i, m, exp2_ps(_mm256_maskload_ps(src + i, m)));
    }
}

static void f16_avx2(int n, const uint16_t *src, float *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = flashc_f16_to_f32(src[i]);
}

static void bf16_avx2(int n, const uint16_t *src, float *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++) dst[i] = flashc_bf16_to_f32(src[i]);
}

/* [sum a0, sum a1, ..., sum a7]: the eight horizontal sums in one vector, in a fixed order. */
AI __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    /* u0 = [a0 a1 a2 a3 | a0 a1 a2 a3] over lanes 0-3 and 4-7 of each, u1 the same for a4-a7 */
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight bf16 values at p widened to fp32 (bf16 is fp32's upper half). */
AI __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* The first n (0..8) of eight bf16 values at p, the rest 0, reading only those n. */
AI __m256 bf16x8_first(const uint16_t *p, int n) {
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, sizeof(uint16_t) * (size_t)n);
    return bf16x8(tmp);
}

/* Eight values of K row kp at d as fp32: loaded, or widened from bf16. */
AI __m256 k_at(const void *kp, int kt, int d) {
    return kt == FLASHC_CPU_KV_BF16 ? bf16x8((const uint16_t *)kp + d) : _mm256_loadu_ps((const float *)kp + d);
}
/* The same for the D tail: its first `tail` lanes, the rest 0. */
AI __m256 k_tail(const void *kp, int kt, int d, int n, __m256i tail) {
    return kt == FLASHC_CPU_KV_BF16 ? bf16x8_first((const uint16_t *)kp + d, n)
                                    : _mm256_maskload_ps((const float *)kp + d, tail);
}

/*
 * R query rows (1, 2 or 4) against 8 / R keys: eight accumulators, one per (row, key), so that each K vector loaded
 * (and widened, when bf16) feeds R FMAs and one hsum8 gives all eight scores, row i's 8 / R in lanes
 * [i * 8 / R, (i + 1) * 8 / R). Keys past n (a ragged last group) repeat key n - 1 and are not stored.
 */
AI void dots_block(const int R, const int kt, int D, const float *q, int64_t ldq, const void *const kp[8], float *s,
                   int64_t lds, int n) {
    const int KPR = 8 / R;
    const int dv = D & ~7;
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
#define D_STEP(d, LOADK)                                                                                              \
    {                                                                                                                 \
        __m256 x[4];                                                                                                  \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) x[i] = _mm256_loadu_ps(q + i * ldq + (d));                \
        _Pragma("GCC unroll 8") for (int j = 0; j < KPR; j++) {                                                       \
            const __m256 kv = LOADK;                                                                                  \
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) acc[i * KPR + j] =                                    \
                _mm256_fmadd_ps(x[i], kv, acc[i * KPR + j]);                                                          \
        }                                                                                                             \
    }
#pragma GCC unroll 1
    for (int d = 0; d < dv; d += 8) D_STEP(d, k_at(kp[j], kt, d))
    if (dv < D) {
        const __m256i tail = lanes(D - dv);
        D_STEP(dv, k_tail(kp[j], kt, dv, D - dv, tail))
    }
#undef D_STEP
    const __m256 sc = hsum8(acc);
    if (R == 1) {
        if (n >= 8) _mm256_storeu_ps(s, sc);
        else _mm256_maskstore_ps(s, lanes(n), sc);
    } else {
        const __m128 lo = _mm256_castps256_ps128(sc), hi = _mm256_extractf128_ps(sc, 1);
        if (R == 2) {
            if (n >= 4) _mm_storeu_ps(s, lo), _mm_storeu_ps(s + lds, hi);
            else {
                const __m128i m = _mm256_castsi256_si128(lanes(n));
                _mm_maskstore_ps(s, m, lo), _mm_maskstore_ps(s + lds, m, hi);
            }
        } else if (n >= 2) {
            _mm_storel_pi((__m64 *)s, lo), _mm_storeh_pi((__m64 *)(s + lds), lo);
            _mm_storel_pi((__m64 *)(s + 2 * lds), hi), _mm_storeh_pi((__m64 *)(s + 3 * lds), hi);
        } else {
            _mm_store_ss(s, lo), _mm_store_ss(s + lds, _mm_movehl_ps(lo, lo));
            _mm_store_ss(s + 2 * lds, hi), _mm_store_ss(s + 3 * lds, _mm_movehl_ps(hi, hi));
        }
    }
}

/*
 * Scores for each group of eight keys: rows four at a time (two keys per pass), then a pair (four keys), then one
 * (eight keys), so each K vector is loaded (and widened, when bf16) once per four rows and every hsum8 reduces eight
 * useful accumulators. The D tail is masked, since the K rows are read in place. With pf, its rows are spread evenly
 * over the passes, a few before each. K rows from the table kr (decode's), or without one at k + c * ldk (dots).
 */
AI void dots_kv_t(const int kt, int rows, int cols, int D, const float *q, int64_t ldq, const void *const *kr,
                  const float *k, int64_t ldk, float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    flashc_cpu_pf_cursor cur; /* a block of R rows takes R passes per eight keys */
    flashc_cpu_pf_begin(&cur, pf, (cols + 7) / 8 * rows);
    for (int c8 = 0; c8 < cols; c8 += 8) {
        const int n8 = cols - c8 < 8 ? cols - c8 : 8;
        const void *kp[8];
        for (int j = 0; j < 8; j++) {
            const int c = c8 + (j < n8 ? j : n8 - 1);
            kp[j] = kr ? kr[c] : (const void *)(k + (int64_t)c * ldk);
        }
        int r = 0;
        /* Rows in blocks of four, then two, so that each K vector loaded (and widened, when bf16) feeds that many
         * FMAs. For fp32 K, one row against eight keys had measured faster on the earlier AVX2 VM (EPYC family 25
         * model 1; the kernel alone, D 32, K in L2: 5.1-5.6 against 6.1 ns per key and kv head); with the prefetches
         * into L2, blocks measured faster on Zen 4 (1 thread, decode_ab in turns: cold 1.03-1.13x, hot 1.07-1.20x at
         * 8/2/32 and 32/8/128), where the eight K rows of one row's pass lie 4 KiB apart at 32/8/128 and share L1
         * sets between the passes. */
        for (; r + 4 <= rows; r += 4)
            for (int c = 0; c < n8; c += 2) {
                flashc_cpu_pf_issue(&cur);
                dots_block(4, kt, D, q + r * ldq, ldq, kp + c, s + r * lds + c8 + c, lds, n8 - c);
            }
        for (; r + 2 <= rows; r += 2)
            for (int c = 0; c < n8; c += 4) {
                flashc_cpu_pf_issue(&cur);
                dots_block(2, kt, D, q + r * ldq, ldq, kp + c, s + r * lds + c8 + c, lds, n8 - c);
            }
        for (; r < rows; r++) {
            flashc_cpu_pf_issue(&cur);
            dots_block(1, kt, D, q + r * ldq, ldq, kp, s + r * lds + c8, lds, n8);
        }
    }
}

void flashc_cpu_dots_kv_avx2(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, int kt,
                             float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    if (kt == FLASHC_CPU_KV_BF16) dots_kv_t(FLASHC_CPU_KV_BF16, rows, cols, D, q, ldq, k, NULL, 0, s, lds, pf);
    else dots_kv_t(FLASHC_CPU_KV_F32, rows, cols, D, q, ldq, k, NULL, 0, s, lds, pf);
}

void flashc_cpu_dots_avx2(int rows, int cols, int D, const float *q, int64_t ldq, const float *k, int64_t ldk,
                          float *s, int64_t lds) {
    dots_kv_t(FLASHC_CPU_KV_F32, rows, cols, D, q, ldq, NULL, k, ldk, s, lds, NULL);
}

/*
 * O[r][0..D) = alpha[r] O[r] + sum_c P[r][c] V[c] for MR rows (1..4), 16 columns at a time: the product in eight
 * accumulators from zero, per key two V loads (widened when bf16), MR broadcasts of P and 2 MR FMAs, then one FMA
 * per vector adds alpha O. The O lines are prefetched before the keys and read only after them, so their latency
 * (O may have left L1 while the step's K and V rows passed through it) stays off the FMAs' path, as the gemm
 * microkernel does with its C tile; loading and scaling O first measured the same within noise (32/8/128 fp32,
 * cold). Columns past D are neither read from V nor written to O.
 */
AI void pv_rows(const int MR, int cols, int D, const float *p, int64_t ldp, const float *alpha, const void *const *v,
                int vt, float *o, int64_t ldo) {
    for (int j0 = 0; j0 < D; j0 += 16) {
        const int nr = D - j0 < 16 ? D - j0 : 16;
        const __m256i m0 = lanes(nr), m1 = lanes(nr - 8);
        __m256 c0[4], c1[4];
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            _mm_prefetch((const char *)(o + (int64_t)i * ldo + j0), _MM_HINT_T0);
            c0[i] = c1[i] = _mm256_setzero_ps();
        }
#define KEY(b0, b1)                                                                                                   \
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                                                            \
        const __m256 pi = _mm256_broadcast_ss(p + (int64_t)i * ldp + c);                                              \
        c0[i] = _mm256_fmadd_ps(pi, b0, c0[i]);                                                                       \
        c1[i] = _mm256_fmadd_ps(pi, b1, c1[i]);                                                                       \
    }
        if (vt == FLASHC_CPU_KV_BF16) {
            if (nr == 16)
                for (int c = 0; c < cols; c++) {
                    const uint16_t *vc = (const uint16_t *)v[c] + j0;
                    const __m256 b0 = bf16x8(vc), b1 = bf16x8(vc + 8);
                    KEY(b0, b1)
                }
            else
                for (int c = 0; c < cols; c++) {
                    const uint16_t *vc = (const uint16_t *)v[c] + j0;
                    const __m256 b0 = bf16x8_first(vc, nr < 8 ? nr : 8), b1 = nr > 8 ? bf16x8_first(vc + 8, nr - 8)
                                                                                       : _mm256_setzero_ps();
                    KEY(b0, b1)
                }
        } else {
            if (nr == 16)
                for (int c = 0; c < cols; c++) {
                    const float *vc = (const float *)v[c] + j0;
                    const __m256 b0 = _mm256_loadu_ps(vc), b1 = _mm256_loadu_ps(vc + 8);
                    KEY(b0, b1)
                }
            else
                for (int c = 0; c < cols; c++) {
                    const float *vc = (const float *)v[c] + j0;
                    const __m256 b0 = _mm256_maskload_ps(vc, m0), b1 = _mm256_maskload_ps(vc + 8, m1);
                    KEY(b0, b1)
                }
        }
#undef KEY
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            float *oi = o + (int64_t)i * ldo + j0;
            const __m256 a = _mm256_broadcast_ss(alpha + i);
            if (nr == 16) {
                _mm256_storeu_ps(oi, _mm256_fmadd_ps(a, _mm256_loadu_ps(oi), c0[i]));
                _mm256_storeu_ps(oi + 8, _mm256_fmadd_ps(a, _mm256_loadu_ps(oi + 8), c1[i]));
            } else {
                _mm256_maskstore_ps(oi, m0, _mm256_fmadd_ps(a, _mm256_maskload_ps(oi, m0), c0[i]));
                _mm256_maskstore_ps(oi + 8, m1, _mm256_fmadd_ps(a, _mm256_maskload_ps(oi + 8, m1), c1[i]));
            }
        }
    }
}

void flashc_cpu_pv_avx2(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                        const void *const *v, int vt, float *o, int64_t ldo) {
    int r = 0;
    for (; r + 4 <= rows; r += 4)
        pv_rows(4, cols, D, p + (int64_t)r * ldp, ldp, alpha + r, v, vt, o + (int64_t)r * ldo, ldo);
    const float *pr = p + (int64_t)r * ldp, *ar = alpha + r;
    float *orow = o + (int64_t)r * ldo;
    switch (rows - r) {
    case 3: pv_rows(3, cols, D, pr, ldp, ar, v, vt, orow, ldo); break;
    case 2: pv_rows(2, cols, D, pr, ldp, ar, v, vt, orow, ldo); break;
    case 1: pv_rows(1, cols, D, pr, ldp, ar, v, vt, orow, ldo); break;
    default: break;
    }
}

/* Horizontal max of one vector. */
AI float hmax(__m256 x) {
    x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_cvtss_f32(x);
}

/*
 * Rows in groups of eight: each row's max and exponentials along its columns, then one hsum8 for the group's eight
 * sums and one vector exp2 for its eight alphas (a row at a time, those were two more horizontal reductions and a
 * whole vector exp2 per row).
 */
void flashc_cpu_softmax_rows_avx2(int rows, int cols, float *s, int64_t lds, float *m, float *l, float *alpha) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        const int g = rows - r0 < 8 ? rows - r0 : 8;
        __m256 sums[8];
        _Alignas(32) float mn[8] = {0};
        for (int i = 0; i < g; i++) {
            const int r = r0 + i;
            float *x = s + (int64_t)r * lds;
            /* NaN scores are skipped by the max (its second operand, mx, wins) and reach the sum through exp2. */
            __m256 mx = _mm256_set1_ps(m[r]);
            for (int c = 0; c < cols; c += 8) mx = _mm256_max_ps(_mm256_loadu_ps(x + c), mx);
            const float m_new = hmax(mx);
            const __m256 vsub = _mm256_set1_ps(m_new == -INFINITY ? 0.0f : m_new);
            __m256 sum = zero;
            for (int c = 0; c < cols; c += 8) {
                const __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), vsub));
                _mm256_storeu_ps(x + c, e);
                sum = _mm256_add_ps(sum, e);
            }
            sums[i] = sum;
            mn[i] = m_new;
        }
        for (int i = g; i < 8; i++) sums[i] = zero;
        const __m256i mask = lanes(g);
        const __m256 m_old = _mm256_maskload_ps(m + r0, mask), m_new = _mm256_load_ps(mn);
        const __m256 empty = _mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ);
        const __m256 a = _mm256_blendv_ps(exp2_ps(_mm256_sub_ps(m_old, _mm256_blendv_ps(m_new, zero, empty))), one,
                                          empty);
        _mm256_maskstore_ps(alpha + r0, mask, a);
        _mm256_maskstore_ps(l + r0, mask, _mm256_fmadd_ps(_mm256_maskload_ps(l + r0, mask), a, hsum8(sums)));
        _mm256_maskstore_ps(m + r0, mask, m_new);
    }
}

/* ---- dropout: Philox4x32-10 (dropout.h) in eight lanes, one query row each ---------------------------------- */

/* hi and lo halves of the 32 x 32 -> 64-bit products a * m in eight lanes (m the same in every lane). */
AI void mulhilo8(__m256i a, __m256i m, __m256i *hi, __m256i *lo) {
    const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

AI __m256i xor_u32(__m256i a, uint32_t b) { return _mm256_xor_si256(a, _mm256_set1_epi32((int)b)); }

/*
 * out[v][k] = Philox4x32-10((c0, c1[v], c2, c3), (k0, k1))[k] for NV vectors of eight counters that differ only in
 * c1. The first three rounds are partly the same in every lane, so they run partly in scalar registers: round 1
 * multiplies c0 and c2 (both shared), round 2 one shared and one lane word, round 3 likewise; from round 4 on every
 * word differs (16 vector products of 20). A round's products take several cycles, so NV independent vectors are
 * interleaved to keep the multiplier busy (two measured 0.76 -> 0.5 ns per element on a Zen 2 EPYC).
 */
#define PHILOX_NV 2
AI void philox8(__m256i out[PHILOX_NV][4], uint32_t c0, const __m256i c1[PHILOX_NV], uint32_t c2, uint32_t c3,
                uint32_t k0, uint32_t k1) {
    const __m256i m0 = _mm256_set1_epi32((int)FLASHC_PHILOX_M0), m1 = _mm256_set1_epi32((int)FLASHC_PHILOX_M1);
    uint64_t p0 = (uint64_t)FLASHC_PHILOX_M0 * c0, p1 = (uint64_t)FLASHC_PHILOX_M1 * c2;
    /* round 1: (v, s, s, s) out, v differing between lanes, s shared */
    __m256i a0[PHILOX_NV];
    for (int n = 0; n < PHILOX_NV; n++) a0[n] = xor_u32(c1[n], (uint32_t)(p1 >> 32) ^ k0);
    const uint32_t a1 = (uint32_t)p1, a2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, a3 = (uint32_t)p0;
    k0 += FLASHC_PHILOX_W0, k1 += FLASHC_PHILOX_W1;
    /* round 2: (s, s, v, v) */
    p1 = (uint64_t)FLASHC_PHILOX_M1 * a2;
    const uint32_t b0 = (uint32_t)(p1 >> 32) ^ a1 ^ k0, b1 = (uint32_t)p1;
    __m256i b2[PHILOX_NV], b3[PHILOX_NV];
    for (int n = 0; n < PHILOX_NV; n++) {
        __m256i hi;
        mulhilo8(a0[n], m0, &hi, &b3[n]);
        b2[n] = xor_u32(hi, a3 ^ k1);
    }
    k0 += FLASHC_PHILOX_W0, k1 += FLASHC_PHILOX_W1;
    /* round 3: (v, v, v, s) */
    p0 = (uint64_t)FLASHC_PHILOX_M0 * b0;
    __m256i x0[PHILOX_NV], x1[PHILOX_NV], x2[PHILOX_NV], x3[PHILOX_NV];
    for (int n = 0; n < PHILOX_NV; n++) {
        __m256i hi;
        mulhilo8(b2[n], m1, &hi, &x1[n]);
        x0[n] = xor_u32(hi, b1 ^ k0);
        x2[n] = xor_u32(b3[n], (uint32_t)(p0 >> 32) ^ k1);
        x3[n] = _mm256_set1_epi32((int)(uint32_t)p0);
    }
    k0 += FLASHC_PHILOX_W0, k1 += FLASHC_PHILOX_W1;
    /* rounds 4-10 */
    for (int round = 3; round < 10; round++) {
        for (int n = 0; n < PHILOX_NV; n++) {
            __m256i h0, l0, h1, l1;
            mulhilo8(x0[n], m0, &h0, &l0);
            mulhilo8(x2[n], m1, &h1, &l1);
            x0[n] = xor_u32(_mm256_xor_si256(h1, x1[n]), k0);
            x1[n] = l1;
            x2[n] = xor_u32(_mm256_xor_si256(h0, x3[n]), k1);
            x3[n] = l0;
        }
        k0 += FLASHC_PHILOX_W0, k1 += FLASHC_PHILOX_W1;
    }
    for (int n = 0; n < PHILOX_NV; n++) {
        out[n][0] = x0[n];
        out[n][1] = x1[n];
        out[n][2] = x2[n];
        out[n][3] = x3[n];
    }
}

static void dropout_avx2(int cols, int rows, float *st, int64_t ld, const flashc_cpu_dropout *d, int64_t i0,
                         int64_t j0) {
    if (cols <= 0 || rows <= 0) return;
    const int64_t ri0 = i0, rj0 = j0; /* the tile's own coordinates, for the generic tail (which shifts them too) */
    i0 += d->row0, j0 += d->col0;     /* dropout's (i, j) from here on; columns c = j - j0 as before */
    enum { R = 8 * PHILOX_NV }; /* rows per Philox batch */
    const int rv = rows / R * R;
    const uint32_t k0 = (uint32_t)d->seed, k1 = (uint32_t)(d->seed >> 32);
    const uint32_t s0 = (uint32_t)d->stream, s1 = (uint32_t)(d->stream >> 32);
    /* unsigned x >= t as signed compares with the sign bits flipped: dropped where t' > x' */
    const __m256i sign = _mm256_set1_epi32(INT32_MIN), tv = _mm256_set1_epi32((int)(d->threshold ^ 0x80000000u));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 kept = _mm256_set1_ps(d->kept);
    const int64_t g0 = j0 >> 2, g1 = (j0 + cols - 1) >> 2;
    for (int64_t g = g0; g <= g1; g++) {
        const int klo = g == g0 ? (int)(j0 - 4 * g) : 0, khi = g == g1 ? (int)(j0 + cols - 1 - 4 * g) : 3;
        float *col = st + (4 * g - j0) * ld;
        for (int r = 0; r < rv; r += R) {
            __m256i c1[PHILOX_NV], x[PHILOX_NV][4];
            for (int n = 0; n < PHILOX_NV; n++)
                c1[n] = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(i0 + r + 8 * n)), lane);
            philox8(x, (uint32_t)g, c1, s0, s1, k0, k1);
            for (int k = klo; k <= khi; k++)
                for (int n = 0; n < PHILOX_NV; n++) {
                    float *e = col + k * ld + r + 8 * n;
                    const __m256 drop = _mm256_castsi256_ps(_mm256_cmpgt_epi32(tv, _mm256_xor_si256(x[n][k], sign)));
                    _mm256_storeu_ps(e, _mm256_andnot_ps(drop, _mm256_mul_ps(_mm256_loadu_ps(e), kept)));
                }
        }
    }
    if (rv < rows) flashc_cpu_dropout_generic(cols, rows - rv, st + rv, ld, d, ri0 + rv, rj0);
}

const flashc_cpu_kernels flashc_cpu_kernels_avx2 = {
    .name = "avx2_6x16",
    .mr = 6,
    .nr = 16,
    .gemm = gemm_avx2,
    .softmax = softmax_avx2,
    .exp2_sub = exp2_sub_avx2,
    .exp2 = exp2_avx2,
    .f16_to_f32 = f16_avx2,
    .bf16_to_f32 = bf16_avx2,
    .dots = flashc_cpu_dots_avx2,
    .softmax_rows = flashc_cpu_softmax_rows_avx2,
    .dropout = dropout_avx2,
    .dots_kv = flashc_cpu_dots_kv_avx2,
    .pv = flashc_cpu_pv_avx2,
};
#endif
