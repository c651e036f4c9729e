/*
 * philox_avx512.h - dropout's keep bits (src/dropout.h) in sixteen 32-bit lanes, one query row a lane, that
 * kernels_avx512.c (dropout applied to an fp32 tile) and kernels_avx512bf16.c (the keep masks that the fused bf16
 * steps read) share. AVX-512F only: include it from a file built with -mavx512f.
 *
 * Philox4x32-10 as kernels_avx2.c's philox8 computes it (the first three rounds partly in scalar registers, since
 * the lanes differ only in the counter word c1 = i), on zmm registers: a 32 x 32 -> 64-bit product is two vpmuludq
 * (even lanes, and odd lanes moved down by a vpshufd) whose high and low halves are put back in place by one masked
 * vpshufd each (where philox8 needs two shifts and two blends), and each round's three-way xor is one vpternlogd.
 * 12 operations per round for 16 rows x 4 keys where philox8 takes 18 for 8 x 4; NV independent vectors of rows are
 * interleaved so that the products' latency overlaps. The keep test x >= t is one unsigned compare into a mask
 * register, which the fp32 kernel applies with a zero-masking multiply and the bf16 steps read as 16-bit words.
 * On the 2-vCPU Zen 4 VM, one thread, a 128 x 64 tile: 0.46 ns per element (philox8) -> 0.30 (NV 2; NV 1 0.36, NV 4
 * 0.34), about two zmm operations a cycle, so the operation count sets the time: the low words by vpmulld or the rounds
 * on 64-bit lanes (low word in place, high word one shift away, twice the xors) came out the same (lab/LOG.md).
 */
#ifndef FLASHC_CPU_PHILOX_AVX512_H
#define FLASHC_CPU_PHILOX_AVX512_H

#include "cpu.h"

#include <immintrin.h>

/* rows per Philox batch: NV vectors of 16 */
#define FLASHC_PHILOX16_NV 2

/* The keys of the ten rounds, (k0 + r W0, k1 + r W1), once per call. */
typedef struct flashc_philox16_keys {
    uint32_t k0[10], k1[10];
} flashc_philox16_keys;

__attribute__((always_inline)) static inline flashc_philox16_keys flashc_philox16_keys_of(uint64_t seed) {
    flashc_philox16_keys k;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        k.k0[r] = k0, k.k1[r] = k1;
        k0 += FLASHC_PHILOX_W0, k1 += FLASHC_PHILOX_W1;
    }
    return k;
}

/* hi and lo halves of the 32 x 32 -> 64-bit products a * m in sixteen lanes (m the same in every lane). */
__attribute__((always_inline)) static inline void flashc_mulhilo16(__m512i a, __m512i m, __m512i *hi, __m512i *lo) {
    const __m512i even = _mm512_mul_epu32(a, m), odd = _mm512_mul_epu32(_mm512_shuffle_epi32(a, _MM_PERM_DDBB), m);
    *hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_DDBB); /* even lanes: the high word of even's */
    *lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CCAA); /* odd lanes: the low word of odd's */
}

__attribute__((always_inline)) static inline __m512i flashc_xor3_16(__m512i a, __m512i b, uint32_t c) {
    return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32((int)c), 0x96);
}

/* out[v][k] = Philox4x32-10((c0, c1[v], c2, c3), keys)[k] for NV vectors of sixteen counters that differ only in c1
 * (kernels_avx2.c's philox8 says how the first three rounds use the shared words). */
__attribute__((always_inline)) static inline void flashc_philox16(const int NV, __m512i out[][4], uint32_t c0,
                                                                  const __m512i c1[], uint32_t c2, uint32_t c3,
                                                                  const flashc_philox16_keys *k) {
    const __m512i m0 = _mm512_set1_epi32((int)FLASHC_PHILOX_M0), m1 = _mm512_set1_epi32((int)FLASHC_PHILOX_M1);
    uint64_t p0 = (uint64_t)FLASHC_PHILOX_M0 * c0, p1 = (uint64_t)FLASHC_PHILOX_M1 * c2;
    /* round 1: (v, s, s, s) out, v differing between lanes, s shared */
    __m512i a0[FLASHC_PHILOX16_NV];
    for (int n = 0; n < NV; n++) a0[n] = _mm512_xor_si512(c1[n], _mm512_set1_epi32((int)((uint32_t)(p1 >> 32) ^ k->k0[0])));
    const uint32_t a1 = (uint32_t)p1, a2 = (uint32_t)(p0 >> 32) ^ c3 ^ k->k1[0], a3 = (uint32_t)p0;
    /* round 2: (s, s, v, v) */
    p1 = (uint64_t)FLASHC_PHILOX_M1 * a2;
    const uint32_t b0 = (uint32_t)(p1 >> 32) ^ a1 ^ k->k0[1], b1 = (uint32_t)p1;
    __m512i b2[FLASHC_PHILOX16_NV], b3[FLASHC_PHILOX16_NV];
    for (int n = 0; n < NV; n++) {
        __m512i hi;
        flashc_mulhilo16(a0[n], m0, &hi, &b3[n]);
        b2[n] = _mm512_xor_si512(hi, _mm512_set1_epi32((int)(a3 ^ k->k1[1])));
    }
    /* round 3: (v, v, v, s) */
    p0 = (uint64_t)FLASHC_PHILOX_M0 * b0;
    __m512i x0[FLASHC_PHILOX16_NV], x1[FLASHC_PHILOX16_NV], x2[FLASHC_PHILOX16_NV], x3[FLASHC_PHILOX16_NV];
    for (int n = 0; n < NV; n++) {
        __m512i hi;
        flashc_mulhilo16(b2[n], m1, &hi, &x1[n]);
        x0[n] = _mm512_xor_si512(hi, _mm512_set1_epi32((int)(b1 ^ k->k0[2])));
        x2[n] = _mm512_xor_si512(b3[n], _mm512_set1_epi32((int)((uint32_t)(p0 >> 32) ^ k->k1[2])));
        x3[n] = _mm512_set1_epi32((int)(uint32_t)p0);
    }
    /* rounds 4-10 */
    for (int round = 3; round < 10; round++)
        for (int n = 0; n < NV; n++) {
            __m512i h0, l0, h1, l1;
            flashc_mulhilo16(x0[n], m0, &h0, &l0);
            flashc_mulhilo16(x2[n], m1, &h1, &l1);
            x0[n] = flashc_xor3_16(h1, x1[n], k->k0[round]);
            x1[n] = l1;
            x2[n] = flashc_xor3_16(h0, x3[n], k->k1[round]);
            x3[n] = l0;
        }
    for (int n = 0; n < NV; n++) {
        out[n][0] = x0[n];
        out[n][1] = x1[n];
        out[n][2] = x2[n];
        out[n][3] = x3[n];
    }
}

/*
 * The keep bits of a key-major tile (keys j0 + c, c < cols; query rows i0 + r, r < rows; both moved by d->row0,
 * d->col0 as cpu.h's flashc_cpu_dropout says): with st, each element st[c * ld + r] becomes st * kept where kept, else
 * 0 (the dropout kernel); else keep[r / 16 * ldk + c] gets the kept bits of rows r .. r + 15 of key c (bit b: row
 * r + b), rows rounded up to 16 (the fused bf16 steps' masks). Rows go NV vectors of 16 at a time, the last ones one
 * vector at a time (masked past rows when st is given).
 */
__attribute__((always_inline)) static inline void flashc_dropout_tile_avx512(int cols, int rows,
                                                                             const flashc_cpu_dropout *d, int64_t i0,
                                                                             int64_t j0, float *st, int64_t ld,
                                                                             uint16_t *keep, int64_t ldk) {
    enum { NV = FLASHC_PHILOX16_NV, R = 16 * NV };
    i0 += d->row0, j0 += d->col0; /* dropout's (i, j) from here on; columns c = j - j0 */
    const flashc_philox16_keys k = flashc_philox16_keys_of(d->seed);
    const uint32_t s0 = (uint32_t)d->stream, s1 = (uint32_t)(d->stream >> 32);
    const __m512i tv = _mm512_set1_epi32((int)d->threshold);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 kept = _mm512_set1_ps(d->kept);
    const int rv = rows / R * R;
    const int64_t g0 = j0 >> 2, g1 = (j0 + cols - 1) >> 2;
    for (int64_t g = g0; g <= g1; g++) {
        const int klo = g == g0 ? (int)(j0 - 4 * g) : 0, khi = g == g1 ? (int)(j0 + cols - 1 - 4 * g) : 3;
        const int64_t c4 = 4 * g - j0; /* column of the group's first key */
        int r = 0;
        for (; r < rv; r += R) {
            __m512i c1[NV], x[NV][4];
            for (int n = 0; n < NV; n++)
                c1[n] = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(i0 + r + 16 * n)), lane);
            flashc_philox16(NV, x, (uint32_t)g, c1, s0, s1, &k);
            for (int kk = klo; kk <= khi; kk++)
                for (int n = 0; n < NV; n++) {
                    const __mmask16 kb = _mm512_cmpge_epu32_mask(x[n][kk], tv);
                    if (st) {
                        float *e = st + (c4 + kk) * ld + r + 16 * n;
                        _mm512_storeu_ps(e, _mm512_maskz_mul_ps(kb, _mm512_loadu_ps(e), kept));
                    } else {
                        keep[(r / 16 + n) * ldk + c4 + kk] = (uint16_t)kb;
                    }
                }
        }
        for (; r < rows; r += 16) {
            const __mmask16 in = rows - r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (rows - r)) - 1u);
            __m512i c1[1], x[1][4];
            c1[0] = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(i0 + r)), lane);
            flashc_philox16(1, x, (uint32_t)g, c1, s0, s1, &k);
            for (int kk = klo; kk <= khi; kk++) {
                const __mmask16 kb = _mm512_cmpge_epu32_mask(x[0][kk], tv);
                if (st) {
                    float *e = st + (c4 + kk) * ld + r;
                    _mm512_mask_storeu_ps(e, in, _mm512_maskz_mul_ps(kb, _mm512_maskz_loadu_ps(in, e), kept));
                } else {
                    keep[r / 16 * ldk + c4 + kk] = (uint16_t)kb;
                }
            }
        }
    }
}

#endif
