/*
 * AVX-512F microkernels (built with -mavx512f -mfma -mf16c, chosen at run time).
 * gemm: a 12x32 register tile (24 zmm accumulators, 2 for the B row, 1 for the A broadcast), masked for the
 * last columns, A read in place through either stride (no packing). exp2: as the AVX2 kernel (degree-6 polynomial
 * of 2^f), scaled by 2^n with vscalefps (exp2_avx512.h, whose cheaper 2^x the bf16 kernels use where P goes to bf16
 * only). dropout: Philox in sixteen lanes (philox_avx512.h, shared with the bf16 kernels' keep masks), applied with
 * zero-masking multiplies.
 */
#include "cpu.h"

#if defined(FLASHC_CPU_X86)
#include <immintrin.h>

#include "exp2_avx512.h"
#include "philox_avx512.h"
#include "transpose_avx512.h"

#define AI __attribute__((always_inline)) static inline

AI __mmask16 first(int n) { return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/*
 * C[0..MR)[0..nr) (+)= A B for one 12x32 register tile, k steps. A(i, p) = a[i * rs_a + p * cs_a] is addressed
 * from four row bases (rows 0, 3, 6, 9) plus one and two row strides, so the twelve broadcasts need six registers
 * whichever way A is laid out: with twelve row pointers the compiler spilled them and reloaded the masks inside the
 * loop, and those extra instructions compete with the FMAs for the vector ports (on Intel cores, ports 0 and 5).
 * Full-width tiles load B without masks for the same reason.
 */
AI void ukr_12x32(const int MR, int nr, int k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                  int64_t ldb, float *c, int64_t ldc, int accumulate) {
    __m512 c0[12], c1[12];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    if (accumulate) /* the C tile is read only after the k loop: start its lines on their way now */
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            _mm_prefetch((const char *)(c + (size_t)i * ldc), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + (size_t)i * ldc + 16), _MM_HINT_T0);
        }
    const __mmask16 m0 = first(nr), m1 = first(nr - 16);
    const float *a0 = a, *a3 = a + 3 * rs_a, *a6 = a + 6 * rs_a, *a9 = a + 9 * rs_a, *bp = b;
    const int64_t r1 = rs_a, r2 = 2 * rs_a;
/* C row i += A(i, p) * (b0, b1), where ptr points at A(i, p). */
#define ROW(i, ptr)                                                                                                   \
    if (i < MR) {                                                                                                     \
        const __m512 ai = _mm512_set1_ps(*(ptr));                                                                     \
        c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);                                                                       \
        c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);                                                                       \
    }
#define K_STEP                                                                                                        \
    ROW(0, a0) ROW(1, a0 + r1) ROW(2, a0 + r2) ROW(3, a3) ROW(4, a3 + r1) ROW(5, a3 + r2)                             \
    ROW(6, a6) ROW(7, a6 + r1) ROW(8, a6 + r2) ROW(9, a9) ROW(10, a9 + r1) ROW(11, a9 + r2)                           \
    a0 += cs_a, a3 += cs_a, a6 += cs_a, a9 += cs_a, bp += ldb;
    if (nr == 32) {
        for (int p = 0; p < k; p++) {
            const __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
            K_STEP
        }
    } else {
        for (int p = 0; p < k; p++) {
            const __m512 b0 = _mm512_maskz_loadu_ps(m0, bp), b1 = _mm512_maskz_loadu_ps(m1, bp + 16);
            K_STEP
        }
    }
#undef K_STEP
#undef ROW
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        float *ci = c + (size_t)i * ldc;
        if (accumulate) {
            c0[i] = _mm512_add_ps(c0[i], _mm512_maskz_loadu_ps(m0, ci));
            c1[i] = _mm512_add_ps(c1[i], _mm512_maskz_loadu_ps(m1, ci + 16));
        }
        _mm512_mask_storeu_ps(ci, m0, c0[i]);
        _mm512_mask_storeu_ps(ci + 16, m1, c1[i]);
    }
}

static void gemm_avx512(int m, int n, int k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                        int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int j0 = 0; j0 < n; j0 += 32) {
        const int nr = n - j0 < 32 ? n - j0 : 32;
        const float *bj = b + j0;
        float *cj = c + j0;
        int i0 = 0;
        for (; i0 + 12 <= m; i0 += 12)
            ukr_12x32(12, nr, k, a + (int64_t)i0 * rs_a, rs_a, cs_a, bj, ldb, cj + (size_t)i0 * ldc, ldc, accumulate);
        const float *ai = a + (int64_t)i0 * rs_a;
        float *ci = cj + (size_t)i0 * ldc;
        switch (m - i0) {
        case 11: ukr_12x32(11, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 10: ukr_12x32(10, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 9: ukr_12x32(9, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 8: ukr_12x32(8, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 7: ukr_12x32(7, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 6: ukr_12x32(6, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 5: ukr_12x32(5, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 4: ukr_12x32(4, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 3: ukr_12x32(3, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 2: ukr_12x32(2, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        case 1: ukr_12x32(1, nr, k, ai, rs_a, cs_a, bj, ldb, ci, ldc, accumulate); break;
        default: break;
        }
    }
}

static void softmax_avx512(int cols, int rows, float *st, int64_t ld, float *m, float *l, float *alpha) {
    const __m512 zero = _mm512_setzero_ps();
    for (int r = 0; r < rows; r += 16) {
        __m512 mx, a;
        const __m512 sub = flashc_softmax_sub_avx512(cols, st + r, ld, _mm512_loadu_ps(m + r), &mx, &a);
        __m512 sum = zero;
        for (int c = 0; c < cols; c++) {
            float *x = st + (size_t)c * ld + r;
            const __m512 e = flashc_exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(x), sub));
            _mm512_storeu_ps(x, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(alpha + r, a);
        _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), a, sum));
        _mm512_storeu_ps(m + r, mx);
    }
}

/* Decode's online softmax (exp2_avx512.h says how), P in fp32. */
static void softmax_rows_avx512(int rows, int cols, float *s, int64_t lds, float *m, float *l, float *alpha) {
    flashc_softmax_rows_avx512(0, rows, cols, s, lds, m, l, alpha);
}

/*
 * Decode's scores (cpu.h, flashc_cpu_dots_kv_fn) for fp32 K rows: R query rows (4, 2 or 1) against KC = 16 / R keys,
 * sixteen accumulators along D in chunks of 16 (the tail masked: K is read in place), each K chunk loaded once for
 * the R rows (a GQA group's heads), and one flashc_cpu_reduce16 for the block's sixteen scores (lane r * KC + c), as
 * the avx512bf16 set's dots_kv is built on vdpbf16ps. Against the AVX2 kernel (4 rows x 2 keys a block, 8 wide, one
 * hsum8 per eight scores): per key and 4 rows at D 128, half the K and q loads and FMA instructions, and the
 * reduction of 16 scores in 45 instructions where two hsum8 took 16. The sums run in an order of their own (16 lanes
 * along D, then reduce16's tree), so the scores differ from the AVX2 set's in the last bits; dots takes the same
 * kernel through a stride, so dots_kv and dots keep the same bits within the set. Keys past n repeat key n - 1 and
 * are not stored.
 */
AI void dots_f32_block(const int R, int D, const float *q, int64_t ldq, const float *const kp[16], float *s,
                       int64_t lds, int n) {
    const int KC = 16 / R, dv = D & ~15;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
#define D_STEP(d, LOAD)                                                                                               \
    {                                                                                                                 \
        __m512 x[4];                                                                                                  \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) x[r] = LOAD(q + r * ldq + (d));                          \
        _Pragma("GCC unroll 16") for (int c = 0; c < KC; c++) {                                                       \
            const __m512 kv = LOAD(kp[c] + (d));                                                                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r * KC + c] =                                     \
                _mm512_fmadd_ps(x[r], kv, acc[r * KC + c]);                                                           \
        }                                                                                                             \
    }
#define FULL(ptr) _mm512_loadu_ps(ptr)
#define TAIL(ptr) _mm512_maskz_loadu_ps(tail, ptr)
#pragma GCC unroll 1
    for (int d = 0; d < dv; d += 16) D_STEP(d, FULL)
    if (dv < D) {
        const __mmask16 tail = first(D - dv);
        D_STEP(dv, TAIL)
    }
#undef TAIL
#undef FULL
#undef D_STEP
    const __m512 sc = flashc_cpu_reduce16(acc);
    const __mmask16 mn = first(n < KC ? n : KC);
    flashc_cpu_store_scores(s, lds, sc, mn, R);
}

/* Rows four at a time, then a pair, then one, each against its keys in blocks of 16 / R; with pf, an issue of its
 * rows before each block. K rows from the table kr (decode's), or without one at k + c * ldk (dots).
 * Taken at D <= 32 only (dots_kv_f32 below). */
static void dots_f32_avx512(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *kr,
                            const float *k, int64_t ldk, float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    const int rem = rows % 4;
    const int blocks = rows / 4 * ((cols + 3) / 4) + (rem >= 2 ? (cols + 7) / 8 : 0) + (rem % 2 ? (cols + 15) / 16 : 0);
    flashc_cpu_pf_cursor cur;
    flashc_cpu_pf_begin(&cur, pf, blocks);
    for (int r0 = 0; r0 < rows;) {
        const int R = rows - r0 >= 4 ? 4 : rows - r0 >= 2 ? 2 : 1, KC = 16 / R;
        for (int c0 = 0; c0 < cols; c0 += KC) {
            const int n = cols - c0 < KC ? cols - c0 : KC;
            const float *kp[16];
            for (int c = 0; c < KC; c++) {
                const int cc = c0 + (c < n ? c : n - 1);
                kp[c] = kr ? (const float *)kr[cc] : k + (int64_t)cc * ldk;
            }
            flashc_cpu_pf_issue(&cur);
            const float *qr = q + (int64_t)r0 * ldq;
            float *sb = s + (int64_t)r0 * lds + c0;
            if (R == 4) dots_f32_block(4, D, qr, ldq, kp, sb, lds, n);
            else if (R == 2) dots_f32_block(2, D, qr, ldq, kp, sb, lds, n);
            else dots_f32_block(1, D, qr, ldq, kp, sb, lds, n);
        }
        r0 += R;
    }
}

/*
 * Which kernel takes fp32 K rows: the one above at D <= 32, the AVX2 one (kernels_avx2.c) beyond. Zen 4 VM, 1 thread,
 * decode_ab --cpu-time in both orders: with the cache hot (Nk 1024) the block kernel measured 1.15x at both 8/2/32 and
 * 32/8/128, but cold, where the K/V stream sets the time (the prefetch instructions stall for free fill buffers), it
 * measured 0.94-0.99x at 32/8/128 and 1.01-1.04x at 8/2/32. dots follows the same choice, so dots_kv and dots keep
 * the same bits.
 */
AI int dots_f32_blocks(int D) { return D <= 32; }

/* dots_kv: fp32 rows as chosen above, bf16 rows the AVX2 kernel's (the avx512bf16 set takes them on vdpbf16ps). */
void flashc_cpu_dots_kv_avx512(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, int kt,
                               float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    if (kt == FLASHC_CPU_KV_F32 && dots_f32_blocks(D)) dots_f32_avx512(rows, cols, D, q, ldq, k, NULL, 0, s, lds, pf);
    else flashc_cpu_dots_kv_avx2(rows, cols, D, q, ldq, k, kt, s, lds, pf);
}

static void dots_avx512(int rows, int cols, int D, const float *q, int64_t ldq, const float *k, int64_t ldk, float *s,
                        int64_t lds) {
    if (!dots_f32_blocks(D)) flashc_cpu_dots_avx2(rows, cols, D, q, ldq, k, ldk, s, lds);
    else dots_f32_avx512(rows, cols, D, q, ldq, NULL, k, ldk, s, lds, NULL);
}

/*
 * Decode's O = alpha O + P V (cpu.h, flashc_cpu_pv_fn) for fp32 V rows: MR query rows (1..4) by NV vectors of 16
 * columns (up to 64), the products in MR x NV accumulators from zero, per key NV V loads, MR broadcasts of P and
 * MR x NV FMAs, then one FMA per vector adds alpha O. The AVX2 kernel's order for every element (keys in order from
 * zero, then alpha O), so the same bits; with 64 columns a block, a V row of D 128 is two blocks instead of eight, a
 * quarter of the P broadcasts and half the loads and FMA instructions per key. bf16 rows take the AVX2 kernel.
 */
AI void pv_block(const int MR, const int NV, int cols, int nr, const float *p, int64_t ldp, const float *alpha,
                 const void *const *v, int j0, float *o, int64_t ldo) {
    __m512 acc[4][4];
    __mmask16 mk[4];
#pragma GCC unroll 4
    for (int q = 0; q < NV; q++) mk[q] = first(nr - 16 * q);
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
#pragma GCC unroll 4
        for (int q = 0; q < NV; q++) {
            _mm_prefetch((const char *)(o + (int64_t)i * ldo + j0 + 16 * q), _MM_HINT_T0);
            acc[i][q] = _mm512_setzero_ps();
        }
    }
    for (int c = 0; c < cols; c++) {
        const float *vc = (const float *)v[c] + j0;
        __m512 b[4];
#pragma GCC unroll 4
        for (int q = 0; q < NV; q++) b[q] = _mm512_maskz_loadu_ps(mk[q], vc + 16 * q);
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m512 pi = _mm512_set1_ps(p[(int64_t)i * ldp + c]);
#pragma GCC unroll 4
            for (int q = 0; q < NV; q++) acc[i][q] = _mm512_fmadd_ps(pi, b[q], acc[i][q]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        float *oi = o + (int64_t)i * ldo + j0;
        const __m512 a = _mm512_set1_ps(alpha[i]);
#pragma GCC unroll 4
        for (int q = 0; q < NV; q++)
            _mm512_mask_storeu_ps(oi + 16 * q, mk[q],
                                  _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(mk[q], oi + 16 * q), acc[i][q]));
    }
}

AI void pv_rows_avx512(const int MR, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                       const void *const *v, float *o, int64_t ldo) {
    for (int j0 = 0; j0 < D; j0 += 64) {
        const int nr = D - j0 < 64 ? D - j0 : 64;
        switch ((nr + 15) / 16) {
        case 4: pv_block(MR, 4, cols, nr, p, ldp, alpha, v, j0, o, ldo); break;
        case 3: pv_block(MR, 3, cols, nr, p, ldp, alpha, v, j0, o, ldo); break;
        case 2: pv_block(MR, 2, cols, nr, p, ldp, alpha, v, j0, o, ldo); break;
        default: pv_block(MR, 1, cols, nr, p, ldp, alpha, v, j0, o, ldo); break;
        }
    }
}

static void pv_avx512(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                      const void *const *v, int vt, float *o, int64_t ldo) {
    if (vt != FLASHC_CPU_KV_F32) {
        flashc_cpu_pv_avx2(rows, cols, D, p, ldp, alpha, v, vt, o, ldo);
        return;
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4)
        pv_rows_avx512(4, cols, D, p + (int64_t)r * ldp, ldp, alpha + r, v, o + (int64_t)r * ldo, ldo);
    const float *pr = p + (int64_t)r * ldp, *ar = alpha + r;
    float *orow = o + (int64_t)r * ldo;
    switch (rows - r) {
    case 3: pv_rows_avx512(3, cols, D, pr, ldp, ar, v, orow, ldo); break;
    case 2: pv_rows_avx512(2, cols, D, pr, ldp, ar, v, orow, ldo); break;
    case 1: pv_rows_avx512(1, cols, D, pr, ldp, ar, v, orow, ldo); break;
    default: break;
    }
}

static void exp2_sub_avx512(int cols, int rows, float *st, int64_t ld, const float *sub) {
    for (int c = 0; c < cols; c++) {
        float *col = st + (size_t)c * ld;
        for (int r = 0; r < rows; r += 16)
            _mm512_storeu_ps(col + r, flashc_exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(col + r), _mm512_loadu_ps(sub + r))));
    }
}

static void exp2_avx512(int n, const float *src, float *dst) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        _mm512_mask_storeu_ps(dst + i, m, flashc_exp2_avx512(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

static void f16_avx512(int n, const uint16_t *src, float *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    for (; i < n; i++) dst[i] = flashc_f16_to_f32(src[i]);
}

static void bf16_avx512(int n, const uint16_t *src, float *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
    for (; i < n; i++) dst[i] = flashc_bf16_to_f32(src[i]);
}

/* Dropout with sixteen rows a vector (philox_avx512.h); a single row (decode's row-major rows) takes the portable
 * kernel, where sixteen lanes of rows would compute fifteen for nothing. */
static void dropout_avx512(int cols, int rows, float *st, int64_t ld, const flashc_cpu_dropout *d, int64_t i0,
                           int64_t j0) {
    if (cols <= 0 || rows <= 0) return;
    if (rows == 1) flashc_cpu_dropout_generic(cols, rows, st, ld, d, i0, j0);
    else flashc_dropout_tile_avx512(cols, rows, d, i0, j0, st, ld, NULL, 0);
}

const flashc_cpu_kernels flashc_cpu_kernels_avx512 = {
    .name = "avx512_12x32",
    .mr = 12,
    .nr = 32,
    .gemm = gemm_avx512,
    .softmax = softmax_avx512,
    .exp2_sub = exp2_sub_avx512,
    .exp2 = exp2_avx512,
    .f16_to_f32 = f16_avx512,
    .bf16_to_f32 = bf16_avx512,
    .dots = dots_avx512,
    .softmax_rows = softmax_rows_avx512,
    .dots_kv = flashc_cpu_dots_kv_avx512,
    .pv = pv_avx512,
    .dropout = dropout_avx512,
};
#endif
