/*
 * dropout.h - the dropout keep bit: one definition for every backend, the oracle and flashc_dropout_mask.
 *
 * Plain C11 that also compiles as CUDA: included from a .cu file every function is __host__ __device__ (FLASHC_HD).
 * No libc, no state, no tables; every function is a pure function of its arguments.
 *
 * Generator: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11),
 * counter-based: four 32-bit outputs from a 128-bit counter and a 64-bit key, ten rounds, the key bumped by the Weyl
 * constants between rounds. tests/test_dropout.c checks it against Random123's published known-answer vectors.
 *
 * The keep bit of element (b, h, i, j): sequence b (with varlen the sequence's index in cu_seqlens), query head h of H,
 * query row i and key column j, both counted from the start of the sequence (so varlen packing, seqused_k and paged
 * K/V change nothing) or, with flashc_params' positions, the positions q_position + i and k_position + j (so a chunk
 * pair of a longer attention gets that attention's bits), for a call with dropout_p = p, dropout_seed = seed,
 * dropout_offset = offset:
 *
 *   key      (k0, k1)          = (seed mod 2^32, seed >> 32)
 *   stream   s                 = offset + b * H + h                          (mod 2^64)
 *   counter  (c0, c1, c2, c3)  = (floor(j / 4), i, s mod 2^32, s >> 32)
 *   x        = Philox4x32-10(counter, key)[j mod 4]                          (uint32)
 *   t        = floor(p * 2^32 + 1/2)                                         (uint32; p * 2^32 is exact in double)
 *   dropped  iff  x < t          kept values are multiplied by 1 / (1 - p)   (rounded once to fp32)
 *
 * so an element is dropped with probability t / 2^32, within 2^-33 of p, for every p in [0, 1) (p = 0: t = 0, nothing
 * dropped; the largest float below 1 gives t = 2^32 - 256). The compare is on all 32 bits. flash-attn 2 instead
 * compares one byte of a Philox output with floor((1 - p) * 255) and keeps when it is not larger, i.e. keeps with
 * probability (floor(255 (1 - p)) + 1) / 256: 0.8984 for p = 0.1 (flashc: 0.9 to 2^-33), 0.8281 for p = 0.17, while
 * both scale kept values by 1 / (1 - p), so its expectation is off by up to 1/256 where flashc's is exact to 2^-33.
 *
 * One Philox call gives the bits of four neighbouring columns 4 * floor(j / 4) .. + 3 of one row: a GPU thread that
 * holds columns (c, c + 1) of rows r and r + 8 (an mma.sync accumulator) can compute the group of row r, its partner
 * lane the group of row r + 8, and exchange two values (one shuffle), so no output is wasted; a CPU computes eight or
 * sixteen rows at once in SIMD lanes (c1 is the only counter word that differs between them).
 *
 * Streams: a call uses streams offset .. offset + B * H - 1 (B = num_seqs with varlen). A caller that wants a fresh
 * mask for each call (torch's generator, as flash-attn uses it) advances offset by at least B * H between calls; and
 * sequence b of a batch gets the same bits as that sequence run alone with offset + b * H.
 */
#ifndef FLASHC_DROPOUT_H
#define FLASHC_DROPOUT_H

#include <stdint.h>

#ifndef FLASHC_HD
#  if defined(__CUDACC__)
#    define FLASHC_HD static inline __host__ __device__
#  else
#    define FLASHC_HD static inline
#  endif
#endif

/* Philox4x32 constants (the paper's Table 2 multipliers and the Weyl key increments: golden ratio and sqrt(3) - 1). */
#define FLASHC_PHILOX_M0 0xD2511F53u
#define FLASHC_PHILOX_M1 0xCD9E8D57u
#define FLASHC_PHILOX_W0 0x9E3779B9u
#define FLASHC_PHILOX_W1 0xBB67AE85u

typedef struct flashc_u32x4 {
    uint32_t x[4];
} flashc_u32x4;

/* One round on counter c with key (k0, k1): c = (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)). */
FLASHC_HD void flashc_philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
    const uint64_t p0 = (uint64_t)FLASHC_PHILOX_M0 * c[0], p1 = (uint64_t)FLASHC_PHILOX_M1 * c[2];
    const uint32_t y0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, y1 = (uint32_t)p1;
    const uint32_t y2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1, y3 = (uint32_t)p0;
    c[0] = y0;
    c[1] = y1;
    c[2] = y2;
    c[3] = y3;
}

/* Philox4x32-10 of counter (c0, c1, c2, c3) and key (k0, k1): round r (0..9) uses the key (k0 + r W0, k1 + r W1). */
FLASHC_HD flashc_u32x4 flashc_philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                            uint32_t k1) {
    flashc_u32x4 r;
    r.x[0] = c0;
    r.x[1] = c1;
    r.x[2] = c2;
    r.x[3] = c3;
    for (int round = 0; round < 10; round++) {
        flashc_philox_round(r.x, k0, k1);
        k0 += FLASHC_PHILOX_W0;
        k1 += FLASHC_PHILOX_W1;
    }
    return r;
}

/* The stream of sequence b, query head h of H: offset + b * H + h, modulo 2^64. */
FLASHC_HD uint64_t flashc_dropout_stream(uint64_t offset, int64_t b, int64_t H, int64_t h) {
    return offset + (uint64_t)b * (uint64_t)H + (uint64_t)h;
}

/* The four 32-bit values of columns 4 * j4 .. 4 * j4 + 3 of row i in a stream: value k belongs to column 4 * j4 + k. */
FLASHC_HD flashc_u32x4 flashc_dropout_bits4(uint64_t seed, uint64_t stream, int64_t i, int64_t j4) {
    return flashc_philox4x32_10((uint32_t)j4, (uint32_t)i, (uint32_t)stream, (uint32_t)(stream >> 32), (uint32_t)seed,
                                (uint32_t)(seed >> 32));
}

/* t = floor(p * 2^32 + 1/2): a value x is dropped iff x < t. p must lie in [0, 1) (the front checks it). p * 2^32 is
 * exact in double, and so is the sum wherever it could reach an integer, so the floor is exact; t < 2^32 - 255. */
FLASHC_HD uint32_t flashc_dropout_threshold(float p) {
    return (uint32_t)((double)p * 4294967296.0 + 0.5);
}

/* The factor of kept values, 1 / (1 - p) rounded once to fp32. */
FLASHC_HD float flashc_dropout_scale(float p) { return (float)(1.0 / (1.0 - (double)p)); }

/* 1 when element (i, j) of a stream is kept at threshold t, else 0. */
FLASHC_HD int flashc_dropout_keep(uint64_t seed, uint64_t stream, int64_t i, int64_t j, uint32_t t) {
    const flashc_u32x4 r = flashc_dropout_bits4(seed, stream, i, j >> 2);
    return r.x[j & 3] >= t;
}

#endif /* FLASHC_DROPOUT_H */
