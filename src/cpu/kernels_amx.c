/*
 * AMX-BF16 tile kernels for the bf16 products (Intel AMX: TDPBF16PS on 16-row x 64-byte tiles), the "amx" kernel set:
 * backend.c puts this file's gemm on the avx512bf16 table, whose other kernels (softmax_pairs, which rounds P to
 * bf16 to nearest even into pair rows, ds, the decode kernels, everything fp32 and fp16) it keeps, and adds that
 * table's softmax_prows: the forward's P written as rows of key pairs, the A tile's layout, so that O += P V loads
 * it in place instead of transposing P's pair rows here once per call and 16-row panel. Every bf16 product
 * goes through gemm, so the forward's S^T = K Q^T and O += P V run on tiles, and so do the backward's five products
 * (attn.c calls one gemm for all of them).
 *
 * gemm: C (+)= alpha A B over k pairs (cpu.h, flashc_cpu_gemm_bf16_fn) in 32 x 32 blocks of C: four C tiles (0-3,
 * 16 x 16 fp32 each), two A tiles (4, 5: 16 rows x 16 pairs) and two B tiles (6, 7: 16 pair rows x 16 columns, the
 * VNNI layout that B's pair rows already have), four TDPBF16PS per 16 pairs of k. B is read in place (tile loads at
 * its row stride) except at ragged edges, which are copied into a zero-padded tile. A is read in place where its
 * pairs are contiguous (cs_a = 2: K's bf16 rows for S^T, the forward's P from softmax_prows, the backward's key-major
 * P and dS); otherwise (dS's pair rows, cs_a = 2 ld) each 16-row panel of A is transposed once per call into rows of
 * pairs (16 x 16 word transposes) and reused for every column block. C: accumulated in the tiles when alpha is 1 (C
 * loaded into them),
 * else summed from zero, stored and scaled (S^T's Q scale) - the order kernels_avx512bf16.c's gemm sums in. The
 * forward passes its S^T alpha 1 where it can and leaves the scale to softmax_prows, which multiplies each score as it
 * reads it (attn.c, scale_in_softmax): the same products without this pass's reload and second store of the tile; the
 * backward's S^T and the forward with softcap or ALiBi still scale here. Edge blocks go through a 32 x 32 buffer,
 * but for those summed from zero with alpha 1 whose tiles in use are whole (the forward's 16-key edge strips of S^T,
 * attn.c's edge_scores), which are written from the tiles as whole blocks are: the same sums, no copy.
 * The tiles are configured at every call (LDTILECFG): each OpenMP thread must configure its own before its first tile
 * instruction, and another library in the process (oneDNN under torch) may have configured them differently since.
 *
 * With FLASHC_CPU_AMX_EMULATE the tile operations are C (kernels_amx_tile.h), so the set runs, slowly, on any CPU with
 * AVX512-BF16 (FLASHC_CPU_KERNELS=amx); the packing and the epilogue are AVX-512 in both builds.
 */
#include "cpu.h"

#if defined(FLASHC_CPU_X86) && defined(FLASHC_CPU_AMX)
#include <immintrin.h>
#include <string.h>

#include "kernels_amx_tile.h"
#include "transpose_avx512.h"

#define AI __attribute__((always_inline)) static inline

enum {
    TR = 16,   /* rows of a tile */
    TP = 16,   /* pairs in a row of an A tile, pair rows of a B tile (64 bytes) */
    KMAX = 128 /* pairs of k that the A panels hold (attn.c's products: D / 2 <= 128, keys or query rows / 2 <= 64) */
};

AI int imin(int a, int b) { return a < b ? a : b; }
AI __mmask16 first(int n) { return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* Every tile 16 rows x 64 bytes (palette 1). */
static void configure_tiles(void) {
    _Alignas(64) flashc_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = TR, cfg.colsb[t] = 64;
    FLASHC_AMX_CONFIG(&cfg);
}

/*
 * A's rows [i0, i0 + rows) (rows <= 16) as one tile panel: dst[r * ldd + 2p + e] = A(i0 + r, p) element e for p < k,
 * zero for p up to kp (a multiple of 16) and for rows .. 16.
 */
static void pack_a(int rows, int k, int kp, const uint16_t *a, int64_t rs_a, int64_t cs_a, uint16_t *dst,
                   int64_t ldd) {
    if (rs_a == 2) { /* pair rows: sixteen pairs of k (rows of the source) at a time, transposed */
        const __mmask16 mr = first(rows);
        for (int p0 = 0; p0 < kp; p0 += TP) {
            __m512i x[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                x[j] = p0 + j < k ? _mm512_maskz_loadu_epi32(mr, a + (int64_t)(p0 + j) * cs_a) : _mm512_setzero_si512();
            flashc_cpu_transpose16(x);
#pragma GCC unroll 16
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + r * ldd + 2 * p0, x[r]);
        }
        return;
    }
    for (int r = 0; r < TR; r++) {
        uint16_t *d = dst + r * ldd;
        if (r >= rows) {
            memset(d, 0, sizeof(uint16_t) * 2 * (size_t)kp);
            continue;
        }
        const uint16_t *s = a + (int64_t)r * rs_a;
        if (cs_a == 2) {
            for (int p0 = 0; p0 < kp; p0 += TP)
                _mm512_storeu_si512(d + 2 * p0, _mm512_maskz_loadu_epi32(first(k - p0), s + 2 * p0));
        } else {
            for (int p = 0; p < kp; p++) {
                uint32_t w = 0;
                if (p < k) memcpy(&w, s + (int64_t)p * cs_a, sizeof w);
                memcpy(d + 2 * p, &w, sizeof w);
            }
        }
    }
}

/* B's pair rows [0, rows) and columns [0, cols) from b into a zero-padded 16 x 16-pair tile (64-byte rows). */
static void pack_b(int rows, int cols, const uint16_t *b, int64_t ldb, uint16_t *dst) {
    const __mmask16 mc = first(cols);
    for (int p = 0; p < TP; p++)
        _mm512_store_si512(dst + 32 * p,
                           p < rows ? _mm512_maskz_loadu_epi32(mc, b + (int64_t)p * ldb) : _mm512_setzero_si512());
}

/* c[i][j] = alpha x[i][j] (+ c[i][j]) for i < rows, j < cols (<= 32), x rows 32 floats apart. */
static void epilogue(int rows, int cols, const float *x, float *c, int64_t ldc, float alpha, int accumulate) {
    const __mmask16 m0 = first(cols), m1 = first(cols - 16);
    const __m512 s = _mm512_set1_ps(alpha);
    for (int i = 0; i < rows; i++) {
        float *ci = c + (int64_t)i * ldc;
        __m512 c0 = _mm512_mul_ps(_mm512_load_ps(x + 32 * i), s);
        __m512 c1 = _mm512_mul_ps(_mm512_load_ps(x + 32 * i + 16), s);
        if (accumulate) {
            c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(m0, ci));
            c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(m1, ci + 16));
        }
        _mm512_mask_storeu_ps(ci, m0, c0);
        _mm512_mask_storeu_ps(ci + 16, m1, c1);
    }
}

static void gemm_bf16_amx(int m, int n, int k, const uint16_t *a, int64_t rs_a, int64_t cs_a, const uint16_t *b,
                          int64_t ldb, float *c, int64_t ldc, float alpha, int accumulate) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0 || k > KMAX) { /* nothing to sum, or more than the panels hold: the vdpbf16ps kernel */
        flashc_cpu_bf16_kernels_avx512.gemm(m, n, k, a, rs_a, cs_a, b, ldb, c, ldc, alpha, accumulate);
        return;
    }
    configure_tiles();
    const int ks = (k + TP - 1) / TP; /* 16-pair steps */
    const int64_t lda = 2 * (int64_t)ks * TP; /* a packed panel's row, bf16 */
    const int a_direct = cs_a == 2 && k % TP == 0;
    _Alignas(64) uint16_t apanel[2][TR * 2 * KMAX];
    _Alignas(64) uint16_t btile[2][TP * 32];
    _Alignas(64) float cbuf[32 * 32];
    for (int i0 = 0; i0 < m; i0 += 2 * TR) {
        const int mr[2] = {imin(TR, m - i0), imin(TR, m - i0 - TR)};
        const uint16_t *at[2] = {NULL, NULL};
        int64_t as[2] = {0, 0}; /* bytes */
        for (int t = 0; t < 2; t++) {
            if (mr[t] <= 0) continue;
            const uint16_t *src = a + (int64_t)(i0 + TR * t) * rs_a;
            if (a_direct && mr[t] == TR) {
                at[t] = src, as[t] = 2 * rs_a;
            } else {
                pack_a(mr[t], k, ks * TP, src, rs_a, cs_a, apanel[t], lda);
                at[t] = apanel[t], as[t] = 2 * lda;
            }
        }
        const int two_m = mr[1] > 0;
        for (int j0 = 0; j0 < n; j0 += 32) {
            const int nc[2] = {imin(16, n - j0), imin(16, n - j0 - 16)}, two_n = nc[1] > 0;
            const int full = mr[0] == TR && mr[1] == TR && nc[0] == 16 && nc[1] == 16;
            /* every tile used whole: one row of tiles or one column (attn.c's 16-key edge strips of S^T) */
            const int whole = mr[0] == TR && (mr[1] <= 0 || mr[1] == TR) && nc[0] == 16 && (nc[1] <= 0 || nc[1] == 16);
            float *cij = c + (int64_t)i0 * ldc + j0;
            const int64_t cs = 4 * ldc;
            const int in_place = full && accumulate && alpha == 1.0f;
            if (in_place) { /* O += P V: C accumulates in the tiles */
                FLASHC_AMX_LOAD(0, cij, cs);
                FLASHC_AMX_LOAD(1, cij + 16, cs);
                FLASHC_AMX_LOAD(2, cij + TR * ldc, cs);
                FLASHC_AMX_LOAD(3, cij + TR * ldc + 16, cs);
            } else {
                FLASHC_AMX_ZERO(0);
                FLASHC_AMX_ZERO(1);
                FLASHC_AMX_ZERO(2);
                FLASHC_AMX_ZERO(3);
            }
            for (int s = 0; s < ks; s++) {
                const int kr = imin(TP, k - s * TP);
                const uint16_t *bs = b + (int64_t)s * TP * ldb + 2 * (int64_t)j0;
                FLASHC_AMX_LOAD(4, at[0] + 2 * TP * s, as[0]);
                if (nc[0] == 16 && kr == TP) {
                    FLASHC_AMX_LOAD(6, bs, 2 * ldb);
                } else {
                    pack_b(kr, nc[0], bs, ldb, btile[0]);
                    FLASHC_AMX_LOAD(6, btile[0], 64);
                }
                FLASHC_AMX_DPBF16PS(0, 4, 6);
                if (two_n) {
                    if (nc[1] == 16 && kr == TP) {
                        FLASHC_AMX_LOAD(7, bs + 32, 2 * ldb);
                    } else {
                        pack_b(kr, nc[1], bs + 32, ldb, btile[1]);
                        FLASHC_AMX_LOAD(7, btile[1], 64);
                    }
                    FLASHC_AMX_DPBF16PS(1, 4, 7);
                }
                if (two_m) {
                    FLASHC_AMX_LOAD(5, at[1] + 2 * TP * s, as[1]);
                    FLASHC_AMX_DPBF16PS(2, 5, 6);
                    if (two_n) {
                        FLASHC_AMX_DPBF16PS(3, 5, 7);
                    }
                }
            }
            if (in_place || (!accumulate && (full || (whole && alpha == 1.0f)))) { /* C written from the tiles */
                FLASHC_AMX_STORE(0, cij, cs);
                if (two_n) FLASHC_AMX_STORE(1, cij + 16, cs);
                if (two_m) FLASHC_AMX_STORE(2, cij + TR * ldc, cs);
                if (two_m && two_n) FLASHC_AMX_STORE(3, cij + TR * ldc + 16, cs);
                if (!in_place && alpha != 1.0f) /* S^T's Q scale on the fp32 sums (the backward's; see above) */
                    for (int i = 0; i < 2 * TR; i++) {
                        float *ci = cij + (int64_t)i * ldc;
                        const __m512 sc = _mm512_set1_ps(alpha);
                        _mm512_storeu_ps(ci, _mm512_mul_ps(_mm512_loadu_ps(ci), sc));
                        _mm512_storeu_ps(ci + 16, _mm512_mul_ps(_mm512_loadu_ps(ci + 16), sc));
                    }
            } else {
                FLASHC_AMX_STORE(0, cbuf, 128);
                FLASHC_AMX_STORE(1, cbuf + 16, 128);
                FLASHC_AMX_STORE(2, cbuf + 32 * TR, 128);
                FLASHC_AMX_STORE(3, cbuf + 32 * TR + 16, 128);
                epilogue(imin(2 * TR, m - i0), imin(32, n - j0), cbuf, cij, ldc, alpha, accumulate);
            }
        }
    }
}

/* The avx512bf16 set's bf16 kernels with gemm on tiles. */
void flashc_cpu_bf16_kernels_amx_fill(flashc_cpu_bf16_kernels *k) {
    *k = flashc_cpu_bf16_kernels_avx512;
    k->gemm = gemm_bf16_amx;
    k->softmax_prows = flashc_cpu_softmax_prows_avx512bf16;
}
#endif
