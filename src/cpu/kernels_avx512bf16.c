/*
 * AVX512-BF16 microkernels for bf16 attention, forward and backward (built with -mavx512bf16 -mavx512bw on top of the
 * AVX-512 flags, chosen at run time only on a CPU with both; backend.c adds them to the AVX-512 table as the
 * "avx512bf16" set).
 * gemm: the AVX-512 kernel's 12x32 register tile (24 zmm accumulators, 2 for the B pair row, 1 for the A broadcast)
 * with vdpbf16ps in place of the FMA: each instruction takes a pair of the reduction index, 32 bf16 products into 16
 * f32 lanes, so a k step of the loop covers two of the fp32 kernel's. A's pair is one 32-bit broadcast; B is in pair
 * rows (cpu.h, flashc_cpu_gemm_bf16_fn). pairs: two rows of a tile interleaved into one pair row, fp32 rounded to
 * bf16 by vcvtne2ps2bf16 (to nearest even, as flash-attn rounds P and dS on the GPU) and zipped by vpermw (AVX512BW,
 * which every CPU with AVX512-BF16 has); to_bf16: the same rounding in place of layout. ds: the backward's P, dS and
 * their bf16 forms in one pass over the tile (P's 2^x as softmax_pairs's: P and dS go only to bf16); pairs_t: Q's
 * and dO's pair rows by 16x16 transposes of pair words; softmax_pairs: the forward's online-softmax step writing P's
 * pair rows (no fp32 P) and rescaling O; both take dropout's keep bits as masks (keep: philox_avx512.h's sixteen rows
 * a vector, written as 16-bit masks that the two steps apply with zero-masking moves); their P's 2^x to bf16's need
 * (exp2_avx512.h, flashc_exp2_p16_avx512: 6 operations, 3e-6 relative, where the fp32 softmax's and exp2_sub's take
 * 13).
 * decode (decode.c), when K / V rows are bf16 (fp32 rows go to the AVX-512 set's kernels): dots_kv, 4x4, 2x8 or
 * 1x16 blocks of (query row, key) with vdpbf16ps along D and one 16-way reduction per block, or for D <= 32 sixteen
 * keys in the lanes after a 16x16 transpose of their pairs; pv, O = alpha O + P V on 4x64 tiles of O, two V rows
 * zipped into pair layout by vpermt2w and P rounded to bf16 as the gemm's pairs do; softmax_rows_p16, the AVX-512
 * softmax_rows with that P's 2^x as softmax_pairs's (decode.c takes it with bf16 V rows).
 */
#include "cpu.h"

#if defined(FLASHC_CPU_X86) && defined(FLASHC_CPU_AVX512BF16)
#include <immintrin.h>
#include <string.h>

#include "exp2_avx512.h"
#include "philox_avx512.h"
#include "transpose_avx512.h"

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

/*
 * Row blocks of 12, except that a remainder of 13 to 17 rows is cut in two halves: a 4-row tail (64 = 5 x 12 + 4, the
 * forward's P V; 16-row edge strips) keeps only 8 accumulators in flight, too few to cover vdpbf16ps's latency, where
 * two blocks of 8 keep 16. Each element's sum runs over k in the same order whatever block holds its row: the same
 * bits.
 */
static void gemm_bf16_avx512(int m, int n, int k, const uint16_t *a, int64_t rs_a, int64_t cs_a, const uint16_t *b,
                             int64_t ldb, float *c, int64_t ldc, float alpha, int accumulate) {
    for (int j0 = 0; j0 < n; j0 += 32) {
        const int nr = n - j0 < 32 ? n - j0 : 32;
        const uint16_t *bj = b + 2 * (int64_t)j0;
        float *cj = c + j0;
        for (int i0 = 0; i0 < m;) {
            const int rem = m - i0, mr = rem >= 18 || rem == 12 ? 12 : rem > 12 ? (rem + 1) / 2 : rem;
            const uint16_t *ai = a + (int64_t)i0 * rs_a;
            float *ci = cj + (size_t)i0 * ldc;
#define BLOCK(r)                                                                                                      \
    case r: ukr_bf16_12x32(r, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, alpha, accumulate); break;
            switch (mr) {
                BLOCK(12) BLOCK(11) BLOCK(10) BLOCK(9) BLOCK(8) BLOCK(7) BLOCK(6) BLOCK(5) BLOCK(4) BLOCK(3) BLOCK(2)
                BLOCK(1)
            default: break;
            }
#undef BLOCK
            i0 += mr;
        }
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

/* flashc_f32_to_bf16 on sixteen lanes in integer arithmetic: u + 0x7fff + (bit 16 of u), NaN quieted instead. */
static void out_bf16_avx512(int n, const float *src, float scale, uint16_t *dst) {
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), abs = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000), quiet = _mm512_set1_epi32(0x40);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), s));
        const __m512i hi = _mm512_srli_epi32(u, 16);
        const __m512i near =
            _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(hi, one)), 16);
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
        _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, _mm512_mask_mov_epi32(near, nan, _mm512_or_si512(hi, quiet)));
    }
}

static void to_bf16_avx512(int n, const float *src, uint16_t *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = flashc_f32_to_bf16(src[i]);
}

/*
 * Two keys (columns c, c + 1 of the tile) at a time, so that one vcvtne2ps2bf16 rounds both columns' 16 rows into one
 * register: its halves are the two p16 / ds16 rows, and vpermw zips them into dS's pair row. One pass over st and dpt
 * where exp2_sub, the dS loop, two to_bf16 and pairs_f32 made five over the tile (seven with dropout's factor tile,
 * which keep's masks replace). DROP: with keep.
 */
AI void ds_tile(const int DROP, int cols, int rows, const float *st, const float *dpt, int64_t ld, const float *lse2,
                const float *di, const uint16_t *keep, int64_t ldk, float kept, uint16_t *p16, uint16_t *ds16,
                uint16_t *ds2) {
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 kv = _mm512_set1_ps(kept);
    for (int c = 0; c < cols; c += 2) {
        const int two = c + 1 < cols;
        const float *s0 = st + (int64_t)c * ld, *d0 = dpt + (int64_t)c * ld;
        uint16_t *pr = p16 + (int64_t)c * ld, *dr = ds16 + (int64_t)c * ld, *pair = ds2 + (int64_t)c * ld;
        for (int r = 0; r < rows; r += 16) {
            const __m512 lse = _mm512_loadu_ps(lse2 + r), dv = _mm512_loadu_ps(di + r);
            __m512 p0 = flashc_exp2_p16_avx512(_mm512_sub_ps(_mm512_loadu_ps(s0 + r), lse)), g0,
                   p1 = _mm512_setzero_ps(), g1 = p1;
            if (DROP) { /* dS = P (Z dP - D), then P Z, Z = kept or 0 */
                const __m512 z = _mm512_maskz_mov_ps(keep[r / 16 * ldk + c], kv);
                g0 = _mm512_mul_ps(p0, _mm512_sub_ps(_mm512_mul_ps(z, _mm512_loadu_ps(d0 + r)), dv));
                p0 = _mm512_mul_ps(p0, z);
            } else {
                g0 = _mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(d0 + r), dv));
            }
            if (two) {
                p1 = flashc_exp2_p16_avx512(_mm512_sub_ps(_mm512_loadu_ps(s0 + ld + r), lse));
                if (DROP) {
                    const __m512 z = _mm512_maskz_mov_ps(keep[r / 16 * ldk + c + 1], kv);
                    g1 = _mm512_mul_ps(p1, _mm512_sub_ps(_mm512_mul_ps(z, _mm512_loadu_ps(d0 + ld + r)), dv));
                    p1 = _mm512_mul_ps(p1, z);
                } else {
                    g1 = _mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(d0 + ld + r), dv));
                }
            }
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0), gb = (__m512i)_mm512_cvtne2ps_pbh(g1, g0);
            _mm256_storeu_si256((__m256i *)(pr + r), _mm512_castsi512_si256(pb));
            _mm256_storeu_si256((__m256i *)(dr + r), _mm512_castsi512_si256(gb));
            if (two) {
                _mm256_storeu_si256((__m256i *)(pr + ld + r), _mm512_extracti64x4_epi64(pb, 1));
                _mm256_storeu_si256((__m256i *)(dr + ld + r), _mm512_extracti64x4_epi64(gb, 1));
            }
            _mm512_storeu_si512(pair + 2 * r, _mm512_permutexvar_epi16(zip, gb));
        }
    }
}

static void ds_avx512(int cols, int rows, const float *st, const float *dpt, int64_t ld, const float *lse2,
                      const float *di, const uint16_t *keep, int64_t ldk, float kept, uint16_t *p16, uint16_t *ds16,
                      uint16_t *ds2) {
    if (keep) ds_tile(1, cols, rows, st, dpt, ld, lse2, di, keep, ldk, kept, p16, ds16, ds2);
    else ds_tile(0, cols, rows, st, dpt, ld, lse2, di, NULL, 0, 1.0f, p16, ds16, ds2);
}

static void keep_avx512(int cols, int rows, uint16_t *keep, int64_t ldk, const flashc_cpu_dropout *d, int64_t i0,
                        int64_t j0) {
    if (cols > 0 && rows > 0) flashc_dropout_tile_avx512(cols, rows, d, i0, j0, NULL, 0, keep, ldk);
}

/* ---- decode (decode.c): dots_kv and pv on vdpbf16ps when K / V are bf16; fp32 rows take the AVX-512 set's ------- */

AI __mmask32 first32(int n) { return n <= 0 ? 0 : n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u); }

enum { DEC_CHUNKS = 8 }; /* 32-value chunks of D at most (FLASHC_MAX_HEAD_DIM 256) */

/*
 * R query rows against KC = 16 / R keys: sixteen accumulators, one per (row, key), each K chunk loaded once for the R
 * rows, and one reduce16 for the sixteen scores (lane r * KC + c, so row r's scores are 128 / R contiguous bits).
 * A query row enters as T bf16 rows: hi = bf16(q) alone when q is bf16 already (decode passes bf16 queries unscaled),
 * else hi and lo = bf16(q - hi) against the same K chunk, so the scores carry q's fp32 precision to about 2^-17 (the
 * products of bf16 are exact in fp32, the sums fp32). Keys past n repeat key n - 1 and are not stored.
 */
AI void dots_bf16_block(const int R, const int T, int nd, __mmask32 tail, const __m512i qh[][DEC_CHUNKS],
                        const __m512i ql[][DEC_CHUNKS], const uint16_t *const kp[16], float *s, int64_t lds, int n) {
    const int KC = 16 / R;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < nd; d++) {
        const __mmask32 m = d + 1 < nd ? (__mmask32)0xffffffffu : tail;
#pragma GCC unroll 16
        for (int c = 0; c < KC; c++) {
            const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, kp[c] + 32 * d);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r * KC + c] = _mm512_dpbf16_ps(acc[r * KC + c], (__m512bh)qh[r][d], kv);
                if (T == 2) acc[r * KC + c] = _mm512_dpbf16_ps(acc[r * KC + c], (__m512bh)ql[r][d], kv);
            }
        }
    }
    const __m512 sc = flashc_cpu_reduce16(acc);
    const __mmask16 mn = first(n < KC ? n : KC);
    flashc_cpu_store_scores(s, lds, sc, mn, R);
}

/* Rows [r0, r0 + R) of q as hi / lo bf16 chunks, zero past D; whether some lo is not 0 (q not bf16 already). */
AI int split_q(int R, int rows_left, int D, int nd, const float *q, int64_t ldq, __m512i qh[][DEC_CHUNKS],
               __m512i ql[][DEC_CHUNKS]) {
    __m512i any = _mm512_setzero_si512();
    for (int r = 0; r < R; r++)
        for (int d = 0; d < nd; d++) {
            __m512 x0 = _mm512_setzero_ps(), x1 = x0;
            if (r < rows_left) {
                x0 = _mm512_maskz_loadu_ps(first(D - 32 * d), q + r * ldq + 32 * d);
                x1 = _mm512_maskz_loadu_ps(first(D - 32 * d - 16), q + r * ldq + 32 * d + 16);
            }
            const __m512bh h = _mm512_cvtne2ps_pbh(x1, x0);
            /* hi back in fp32: the upper halves of the words */
            const __m512i hw = (__m512i)h;
            const __m512 h0 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw)), 16);
            const __m512 h1 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1)), 16);
            qh[r][d] = hw;
            ql[r][d] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
            any = _mm512_or_si512(any, ql[r][d]);
        }
    return _mm512_test_epi32_mask(any, any) != 0;
}


/*
 * D <= 32, R query rows against sixteen keys in the lanes: t[p] holds pair p of the sixteen K rows (transposed), so
 * each row's scores come from sixteen vdpbf16ps with its pair p broadcast, with no reduction across lanes (two
 * accumulators per row for the latency). qw / qlw: the rows' hi / lo words (pairs).
 */
AI void dots_bf16_short(const int R, const int T, const __m512i t[16], const uint32_t qw[][16],
                        const uint32_t qlw[][16], float *s, int64_t lds, __mmask16 mn) {
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int p = 0; p < 16; p++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r][p & 1] = _mm512_dpbf16_ps(acc[r][p & 1], (__m512bh)_mm512_set1_epi32((int)qw[r][p]), (__m512bh)t[p]);
            if (T == 2)
                acc[r][p & 1] =
                    _mm512_dpbf16_ps(acc[r][p & 1], (__m512bh)_mm512_set1_epi32((int)qlw[r][p]), (__m512bh)t[p]);
        }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(s + r * lds, mn, _mm512_add_ps(acc[r][0], acc[r][1]));
}

/* dots_kv for D <= 32: sixteen query rows at a time as bf16 words, then per sixteen keys one transpose shared by
 * the rows, blocks of four rows against it. */
static void dots_kv_short(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, float *s,
                          int64_t lds, flashc_cpu_pf_cursor *cur) {
    const __mmask32 tail = first32(D);
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? rows - r0 : 16;
        _Alignas(64) uint32_t qw[16][16], qlw[16][16];
        int two = 0;
        for (int b = 0; b < nr; b += 4) {
            __m512i qh[4][DEC_CHUNKS], ql[4][DEC_CHUNKS];
            two |= split_q(4, nr - b, D, 1, q + (int64_t)(r0 + b) * ldq, ldq, qh, ql);
            for (int i = 0; i < 4; i++) {
                _mm512_store_si512(qw[b + i], qh[i][0]);
                _mm512_store_si512(qlw[b + i], ql[i][0]);
            }
        }
        for (int c0 = 0; c0 < cols; c0 += 16) {
            const int n = cols - c0 < 16 ? cols - c0 : 16;
            __m512i t[16];
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++)
                t[c] = _mm512_maskz_loadu_epi16(tail, k[c0 + (c < n ? c : n - 1)]);
            flashc_cpu_transpose16(t);
            flashc_cpu_pf_issue(cur);
            const __mmask16 mn = first(n);
            for (int b = 0; b < nr; b += 4) {
                float *sb = s + (int64_t)(r0 + b) * lds + c0;
#define SHORT(R_) (two ? dots_bf16_short(R_, 2, t, qw + b, qlw + b, sb, lds, mn) \
                       : dots_bf16_short(R_, 1, t, qw + b, qlw + b, sb, lds, mn))
                switch (nr - b) {
                case 1: SHORT(1); break;
                case 2: SHORT(2); break;
                case 3: SHORT(3); break;
                default: SHORT(4); break;
                }
#undef SHORT
            }
        }
    }
}

void flashc_cpu_dots_kv_avx512bf16(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k,
                                   int kt, float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    if (kt != FLASHC_CPU_KV_BF16 || D > 32 * DEC_CHUNKS) {
        flashc_cpu_kernels_avx512.dots_kv(rows, cols, D, q, ldq, k, kt, s, lds, pf);
        return;
    }
    const int nd = (D + 31) / 32;
    const __mmask32 tail = first32(D - 32 * (nd - 1));
    flashc_cpu_pf_cursor cur; /* an issue per block (per sixteen keys when D <= 32) */
    /* the loop's issues: row blocks of 4 (keys four at a time), then a pair (eight), then one (sixteen) */
    const int rem = rows % 4;
    const int blocks = nd == 1 ? (cols + 15) / 16
                               : rows / 4 * ((cols + 3) / 4) + (rem >= 2 ? (cols + 7) / 8 : 0) +
                                     (rem % 2 ? (cols + 15) / 16 : 0);
    flashc_cpu_pf_begin(&cur, pf, blocks);
    if (nd == 1) {
        dots_kv_short(rows, cols, D, q, ldq, k, s, lds, &cur);
        return;
    }
    __m512i qh[4][DEC_CHUNKS], ql[4][DEC_CHUNKS];
    for (int r0 = 0; r0 < rows;) {
        /* rows four at a time, then a pair, then one: each K chunk feeds R rows */
        const int R = rows - r0 >= 4 ? 4 : rows - r0 >= 2 ? 2 : 1, KC = 16 / R;
        const int two = split_q(R, rows - r0, D, nd, q + r0 * ldq, ldq, qh, ql);
        for (int c0 = 0; c0 < cols; c0 += KC) {
            const int n = cols - c0 < KC ? cols - c0 : KC;
            const uint16_t *kp[16];
            for (int c = 0; c < KC; c++) kp[c] = k[c0 + (c < n ? c : n - 1)];
            flashc_cpu_pf_issue(&cur);
            float *sb = s + r0 * lds + c0;
#define BLOCK(R_, T_) dots_bf16_block(R_, T_, nd, tail, qh, ql, kp, sb, lds, n)
            if (R == 4) two ? BLOCK(4, 2) : BLOCK(4, 1);
            else if (R == 2) two ? BLOCK(2, 2) : BLOCK(2, 1);
            else two ? BLOCK(1, 2) : BLOCK(1, 1);
#undef BLOCK
        }
        r0 += R;
    }
}

enum { PV_KEYS = 64 }; /* keys of P rounded to bf16 at a time */

/*
 * O[r][j0, j0 + 32 NC) (+)= sum over the pairs of keys (c, c + 1) of P(r, c) V[c] + P(r, c + 1) V[c + 1], for MR rows
 * and NC chunks of 32 columns: per chunk two V rows zipped by vpermt2w into the pair layout (two registers of 16
 * columns), then per row one 32-bit broadcast of its P pair for all NC chunks and 2 NC vdpbf16ps. P enters rounded to
 * bf16 (as flash-attn rounds P before P V on the GPU, and as the bf16 gemm's pairs_f32 does here); the sums are fp32,
 * each column's in key order whatever NC, so the same bits at any NC. Two chunks a pass (64 columns, 16 accumulators
 * at 4 rows) halve the P broadcasts and the loop's overhead per key against one.
 */
AI void pv_bf16_block(const int MR, const int NC, int keys, int nr, const uint16_t *pb, int ldpb, const float *alpha,
                      int first_chunk, const void *const *v, int j0, float *o, int64_t ldo) {
    const __m512i z0 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i z1 = _mm512_add_epi16(z0, _mm512_set1_epi16(16));
    __mmask32 mv[2];
    __m512 acc[4][2][2];
#pragma GCC unroll 2
    for (int h = 0; h < NC; h++) mv[h] = first32(nr - 32 * h);
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 2
        for (int h = 0; h < NC; h++) acc[i][h][0] = acc[i][h][1] = _mm512_setzero_ps();
    for (int c = 0; c < keys; c += 2) {
        __m512bh b[2][2];
#pragma GCC unroll 2
        for (int h = 0; h < NC; h++) {
            const __m512i x = _mm512_maskz_loadu_epi16(mv[h], (const uint16_t *)v[c] + j0 + 32 * h);
            const __m512i y = c + 1 < keys ? _mm512_maskz_loadu_epi16(mv[h], (const uint16_t *)v[c + 1] + j0 + 32 * h)
                                           : _mm512_setzero_si512();
            b[h][0] = (__m512bh)_mm512_permutex2var_epi16(x, z0, y);
            b[h][1] = (__m512bh)_mm512_permutex2var_epi16(x, z1, y);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m512bh pi = (__m512bh)_mm512_set1_epi32(pair_at(pb + i * ldpb + c));
#pragma GCC unroll 2
            for (int h = 0; h < NC; h++) {
                acc[i][h][0] = _mm512_dpbf16_ps(acc[i][h][0], pi, b[h][0]);
                acc[i][h][1] = _mm512_dpbf16_ps(acc[i][h][1], pi, b[h][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        const __m512 a = _mm512_set1_ps(first_chunk ? alpha[i] : 1.0f);
#pragma GCC unroll 2
        for (int h = 0; h < NC; h++) {
            float *oi = o + (int64_t)i * ldo + j0 + 32 * h;
            const __mmask16 m0 = first(nr - 32 * h), m1 = first(nr - 32 * h - 16);
            _mm512_mask_storeu_ps(oi, m0, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m0, oi), acc[i][h][0]));
            _mm512_mask_storeu_ps(oi + 16, m1, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m1, oi + 16), acc[i][h][1]));
        }
    }
}

/* The O rows' columns 64 at a time (the last 32 or fewer as one chunk). */
AI void pv_bf16_rows(const int MR, int keys, int D, const uint16_t *pb, int ldpb, const float *alpha, int first_chunk,
                     const void *const *v, float *o, int64_t ldo) {
    for (int j0 = 0; j0 < D; j0 += 64) {
        const int nr = D - j0 < 64 ? D - j0 : 64;
        if (nr > 32) pv_bf16_block(MR, 2, keys, nr, pb, ldpb, alpha, first_chunk, v, j0, o, ldo);
        else pv_bf16_block(MR, 1, keys, nr, pb, ldpb, alpha, first_chunk, v, j0, o, ldo);
    }
}

void flashc_cpu_pv_avx512bf16(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                              const void *const *v, int vt, float *o, int64_t ldo) {
    if (vt != FLASHC_CPU_KV_BF16) {
        flashc_cpu_pv_avx2(rows, cols, D, p, ldp, alpha, v, vt, o, ldo);
        return;
    }
    enum { LDPB = PV_KEYS + 2 };
    _Alignas(64) uint16_t pb[4 * LDPB];
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int mr = rows - r0 < 4 ? rows - r0 : 4;
        for (int c0 = 0; c0 < cols || c0 == 0; c0 += PV_KEYS) {
            const int keys = cols - c0 < PV_KEYS ? cols - c0 : PV_KEYS;
            /* P rows rounded to bf16, a zero after an odd count (the pair's second key) */
            for (int i = 0; i < mr; i++) {
                const float *pr = p + (int64_t)(r0 + i) * ldp + c0;
                uint16_t *d = pb + i * LDPB;
                int c = 0;
                for (; c + 16 <= keys; c += 16)
                    _mm256_storeu_si256((__m256i *)(d + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pr + c)));
                if (c < keys)
                    _mm256_storeu_si256((__m256i *)(d + c),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first(keys - c), pr + c)));
                d[keys] = 0;
            }
            const void *const *vc = v + c0;
            float *orow = o + (int64_t)r0 * ldo;
            const int fc = c0 == 0;
            switch (mr) {
            case 4: pv_bf16_rows(4, keys, D, pb, LDPB, alpha + r0, fc, vc, orow, ldo); break;
            case 3: pv_bf16_rows(3, keys, D, pb, LDPB, alpha + r0, fc, vc, orow, ldo); break;
            case 2: pv_bf16_rows(2, keys, D, pb, LDPB, alpha + r0, fc, vc, orow, ldo); break;
            default: pv_bf16_rows(1, keys, D, pb, LDPB, alpha + r0, fc, vc, orow, ldo); break;
            }
            if (cols == 0) break;
        }
    }
}

/* Blocks of 16 rows x 16 pair words transposed: 16 loads and 16 whole-line stores per block, where a word at
 * a time wrote each to another line. */
static void pairs_t_avx512(int rows, int pad_rows, int pairs, const uint16_t *src, int64_t lds, uint16_t *dst,
                           int64_t ldd) {
    for (int r0 = 0; r0 < pad_rows; r0 += 16) {
        const __mmask16 mr = first(pad_rows - r0);
        for (int q0 = 0; q0 < pairs; q0 += 16) {
            const int nq = pairs - q0 < 16 ? pairs - q0 : 16;
            const __mmask16 mq = first(nq);
            __m512i x[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                x[i] = r0 + i < rows ? _mm512_maskz_loadu_epi32(mq, src + (int64_t)(r0 + i) * lds + 2 * q0)
                                     : _mm512_setzero_si512();
            flashc_cpu_transpose16(x);
            for (int j = 0; j < nq; j++) _mm512_mask_storeu_epi32(dst + (int64_t)(q0 + j) * ldd + 2 * r0, mr, x[j]);
        }
    }
}

/* Sixteen scores of softmax_pairs: st's, times qs where SCALED (one rounding, the product the gemm's alpha gave). */
AI __m512 score16(const int SCALED, const float *x, __m512 qs) {
    const __m512 s = _mm512_loadu_ps(x);
    return SCALED ? _mm512_mul_ps(s, qs) : s;
}

/* flashc_softmax_sub_avx512 (the new max, alpha and the value to subtract) on the scores score16 reads. */
AI __m512 softmax_sub(const int SCALED, int cols, const float *st, int64_t ld, __m512 qs, __m512 m_old, __m512 *m_new,
                      __m512 *alpha) {
    if (!SCALED) return flashc_softmax_sub_avx512(cols, st, ld, m_old, m_new, alpha);
    __m512 mx = m_old;
    for (int c = 0; c < cols; c++) mx = _mm512_max_ps(score16(1, st + (size_t)c * ld, qs), mx);
    return flashc_softmax_sub_of_max(mx, m_old, m_new, alpha);
}

/* P's pair word (keys 2p - lead, 2p + 1 - lead; 16 rows from r) of softmax_pairs: exp2 of the scores less sub, summed
 * into sum in column order, rounded to bf16 by one vcvtne2ps2bf16 and zipped by vpermw as pairs_f32 does; with DROP
 * the pair's two keep masks (one 32-bit word) zero the dropped bf16 lanes before the zip (bf16(0) = 0, so the bits of
 * zeroing P first). */
AI __m512i softmax_pair(const int DROP, const int SCALED, int p, int cols, int lead, const float *st, int64_t ld,
                        __m512 qs, int r, __m512 sub, __m512 *sum, const uint16_t *keep, int64_t ldk, __m512i zip) {
    const int c0 = 2 * p - lead, c1 = c0 + 1;
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
    if (c0 >= 0) {
        e0 = flashc_exp2_p16_avx512(_mm512_sub_ps(score16(SCALED, st + (size_t)c0 * ld + r, qs), sub));
        *sum = _mm512_add_ps(*sum, e0);
    }
    if (c1 < cols) {
        e1 = flashc_exp2_p16_avx512(_mm512_sub_ps(score16(SCALED, st + (size_t)c1 * ld + r, qs), sub));
        *sum = _mm512_add_ps(*sum, e1);
    }
    __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
    if (DROP) {
        const uint16_t *kr = keep + r / 16 * ldk;
        uint32_t bits;
        if (c0 >= 0 && c1 < cols) memcpy(&bits, kr + c0, 4); /* little-endian: key c0's mask low */
        else bits = c0 >= 0 ? kr[c0] : (uint32_t)kr[c1] << 16;
        pb = _mm512_maskz_mov_epi16((__mmask32)bits, pb);
    }
    return _mm512_permutexvar_epi16(zip, pb);
}

/* softmax_avx512's steps (max, alpha, exp2 and sum in column order) per 16 rows, the exp2 pass two columns (a pair)
 * at a time (softmax_pair), with no fp32 P stored. DROP: with keep. SCALED: the scores are qs st (S^T's Q scale
 * applied as the scores are read, where the AMX gemm's separate pass over the stored tile would store and reload
 * them). ROWS: P's pair words written query-major,
 * p2[r * ldp + 2 p + e] (rows of key pairs, the layout of an AMX A tile), sixteen pairs at a time transposed in
 * registers (16 x 16 words), where the pair rows (ROWS 0: p2[p * ldp + 2 r + e]) are a pair word per row and key pair
 * that the AMX gemm transposed again per call; the same words either way. */
AI void softmax_pairs_tile(const int DROP, const int SCALED, const int ROWS, int cols, int rows, const float *st,
                           int64_t ld, float qscale, float *m, float *l, float *alpha, const uint16_t *keep,
                           int64_t ldk, int lead, uint16_t *p2, int64_t ldp, float *o, int64_t ldo, int D) {
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int np = (cols + lead + 1) / 2; /* pairs */
    const __m512 qs = _mm512_set1_ps(qscale);
    for (int r = 0; r < rows; r += 16) {
        __m512 mx, a;
        const __m512 sub = softmax_sub(SCALED, cols, st + r, ld, qs, _mm512_loadu_ps(m + r), &mx, &a);
        __m512 sum = _mm512_setzero_ps();
        if (!ROWS) {
            for (int p = 0; p < np; p++)
                _mm512_storeu_si512(p2 + (int64_t)p * ldp + 2 * r,
                                    softmax_pair(DROP, SCALED, p, cols, lead, st, ld, qs, r, sub, &sum, keep, ldk,
                                                 zip));
        } else {
            for (int p0 = 0; p0 < np; p0 += 16) {
                __m512i x[16];
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    x[j] = p0 + j < np ? softmax_pair(DROP, SCALED, p0 + j, cols, lead, st, ld, qs, r, sub, &sum, keep,
                                                      ldk, zip)
                                       : _mm512_setzero_si512();
                flashc_cpu_transpose16(x);
                const __mmask16 mp = first(np - p0);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) _mm512_mask_storeu_epi32(p2 + (int64_t)(r + i) * ldp + 2 * p0, mp, x[i]);
            }
        }
        _mm512_storeu_ps(alpha + r, a);
        _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), a, sum));
        _mm512_storeu_ps(m + r, mx);
        for (int i = 0; i < 16; i++) { /* O rows r .. r + 15 scaled by their alpha */
            const __m512 ai = _mm512_set1_ps(alpha[r + i]);
            float *orow = o + (int64_t)(r + i) * ldo;
            for (int d = 0; d < D; d += 16) {
                const __mmask16 md = first(D - d);
                _mm512_mask_storeu_ps(orow + d, md, _mm512_mul_ps(_mm512_maskz_loadu_ps(md, orow + d), ai));
            }
        }
    }
}

/* Decode's softmax_rows where pv rounds P to bf16 (bf16 V rows): P by flashc_exp2_p16_avx512 (exp2_avx512.h). */
void flashc_cpu_softmax_rows_p16_avx512bf16(int rows, int cols, float *s, int64_t lds, float *m, float *l,
                                            float *alpha) {
    flashc_softmax_rows_avx512(1, rows, cols, s, lds, m, l, alpha);
}

/* The forms of softmax_pairs_tile by keep and qs (the avx512bf16 set's gemm scales S^T in its registers, so attn.c
 * passes softmax_pairs qs 1; the AMX gemm leaves the scale to softmax_prows). */
#define SOFTMAX_PAIRS_FORMS(ROWS, p2)                                                                              \
    do {                                                                                                           \
        if (qs == 1.0f && !keep)                                                                                   \
            softmax_pairs_tile(0, 0, ROWS, cols, rows, st, ld, qs, m, l, alpha, NULL, 0, lead, p2, ldp, o, ldo, D); \
        else if (qs == 1.0f)                                                                                       \
            softmax_pairs_tile(1, 0, ROWS, cols, rows, st, ld, qs, m, l, alpha, keep, ldk, lead, p2, ldp, o, ldo, D); \
        else if (!keep)                                                                                            \
            softmax_pairs_tile(0, 1, ROWS, cols, rows, st, ld, qs, m, l, alpha, NULL, 0, lead, p2, ldp, o, ldo, D); \
        else                                                                                                       \
            softmax_pairs_tile(1, 1, ROWS, cols, rows, st, ld, qs, m, l, alpha, keep, ldk, lead, p2, ldp, o, ldo, D); \
    } while (0)

static void softmax_pairs_avx512(int cols, int rows, const float *st, int64_t ld, float qs, float *m, float *l,
                                 float *alpha, const uint16_t *keep, int64_t ldk, int lead, uint16_t *p2, int64_t ldp,
                                 float *o, int64_t ldo, int D) {
    SOFTMAX_PAIRS_FORMS(0, p2);
}

void flashc_cpu_softmax_prows_avx512bf16(int cols, int rows, const float *st, int64_t ld, float qs, float *m,
                                         float *l, float *alpha, const uint16_t *keep, int64_t ldk, int lead,
                                         uint16_t *p, int64_t ldp, float *o, int64_t ldo, int D) {
    SOFTMAX_PAIRS_FORMS(1, p);
}
#undef SOFTMAX_PAIRS_FORMS

const flashc_cpu_bf16_kernels flashc_cpu_bf16_kernels_avx512 = {
    .gemm = gemm_bf16_avx512,
    .pairs_f32 = pairs_f32_avx512,
    .pairs_bf16 = pairs_bf16_avx512,
    .to_bf16 = to_bf16_avx512,
    .ds = ds_avx512,
    .pairs_t = pairs_t_avx512,
    .softmax_pairs = softmax_pairs_avx512,
    .keep = keep_avx512,
    .out_bf16 = out_bf16_avx512,
};
#endif
