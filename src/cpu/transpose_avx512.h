/*
 * transpose_avx512.h - sixteen rows of sixteen 32-bit words transposed in AVX-512 registers, and sixteen vectors'
 * lane sums gathered into one (a transposing reduction: decode's dots_kv), shared by the avx512, avx512bf16 and amx
 * kernel sets (each file is built with its own ISA flags; the functions are inlined into each; AVX-512F only).
 */
#ifndef FLASHC_CPU_TRANSPOSE_AVX512_H
#define FLASHC_CPU_TRANSPOSE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* In place: x[c] word g = the old x[g] word c. Words paired within 128-bit blocks, then pairs of words, then blocks
 * across rows in two steps; 64 shuffles. */
__attribute__((always_inline)) static inline void flashc_cpu_transpose16(__m512i x[16]) {
    __m512i a[16], b[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    /* b[4g + j], block L: words 4L + j of rows 4g .. 4g + 3 */
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i u0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xee);
        const __m512i v0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xee);
        x[j] = _mm512_shuffle_i32x4(u0, v0, 0x88);
        x[4 + j] = _mm512_shuffle_i32x4(u0, v0, 0xdd);
        x[8 + j] = _mm512_shuffle_i32x4(u1, v1, 0x88);
        x[12 + j] = _mm512_shuffle_i32x4(u1, v1, 0xdd);
    }
}

/*
 * The sums of sixteen vectors' lanes in one vector, lane i the sum of a[i]: 45 instructions, halving the count of
 * vectors at each of four levels (whole 256-bit halves, 128-bit blocks, then pairs and single lanes within blocks).
 * A level's shuffles send its inputs to blocks and lanes in an order of their own; `in` undoes it.
 */
__attribute__((always_inline)) static inline __m512 flashc_cpu_reduce16(const __m512 a[16]) {
    __m512 in[16], u[8], w[4], x[2];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) in[(int[]){0, 2, 1, 3}[i % 4] + (int[]){0, 8, 4, 12}[i / 4]] = a[i];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[i], in[i + 8], 0x44),
                             _mm512_shuffle_f32x4(in[i], in[i + 8], 0xee));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[i], u[i + 4], 0x88), _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44), _mm512_shuffle_ps(w[i], w[i + 2], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xdd));
}

/*
 * A dots kernel's block of R rows (1, 2 or 4) x 16 / R keys, reduced into one vector (flashc_cpu_reduce16: row r's
 * keys in lanes r 16 / R ..), stored as the first lanes of each row's scores: row r's lanes moved to the front
 * (whole 128-bit blocks, or the upper half when R is 2), mn the keys to store.
 */
__attribute__((always_inline)) static inline void flashc_cpu_store_scores(float *s, int64_t lds, __m512 sc,
                                                                          __mmask16 mn, int R) {
    _mm512_mask_storeu_ps(s, mn, sc);
    if (R == 2) _mm512_mask_storeu_ps(s + lds, mn, _mm512_shuffle_f32x4(sc, sc, 0xee));
    if (R == 4) {
        _mm512_mask_storeu_ps(s + lds, mn, _mm512_shuffle_f32x4(sc, sc, 0x01));
        _mm512_mask_storeu_ps(s + 2 * lds, mn, _mm512_shuffle_f32x4(sc, sc, 0x02));
        _mm512_mask_storeu_ps(s + 3 * lds, mn, _mm512_shuffle_f32x4(sc, sc, 0x03));
    }
}

#endif /* FLASHC_CPU_TRANSPOSE_AVX512_H */
