/*
 * transpose_avx512.h - sixteen rows of sixteen 32-bit words transposed in AVX-512 registers, shared by the
 * avx512bf16 and amx kernel sets (each file is built with its own ISA flags; the function is inlined into each).
 */
#ifndef FLASHC_CPU_TRANSPOSE_AVX512_H
#define FLASHC_CPU_TRANSPOSE_AVX512_H

#include <immintrin.h>

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

#endif /* FLASHC_CPU_TRANSPOSE_AVX512_H */
