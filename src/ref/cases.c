/*
 * cases.c - the shared case table and the runner that checks one case against the oracle.
 *
 * A case is run on fresh random inputs drawn from its seed: q, k, v, dout are normal, and one query row in
 * eight is multiplied by 4..8 so that some rows have large logits (softmax close to one-hot, where a missing
 * max-subtraction or a lost rescale shows). Every output is filled with 0xFF bytes (a NaN in every dtype)
 * before the call; an element still holding that pattern afterwards was never written, and with padded
 * layouts an element outside the view that lost it was written where it must not be.
 */
#include "testkit.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random numbers -------------------------------------------------------------------------------------- */

uint64_t flashc_rand_u64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rand_uniform(uint64_t *state) { /* (0, 1) */
    return ((double)(flashc_rand_u64(state) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

double flashc_rand_normal(uint64_t *state) {
    const double two_pi = 6.283185307179586;
    double u1 = rand_uniform(state), u2 = rand_uniform(state);
    return sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}

static int64_t rand_below(uint64_t *state, int64_t n) { return n <= 1 ? 0 : (int64_t)(flashc_rand_u64(state) % (uint64_t)n); }

/* ---- the case table -------------------------------------------------------------------------------------- */

#define F32 FLASHC_DTYPE_F32
#define F16 FLASHC_DTYPE_F16
#define BF16 FLASHC_DTYPE_BF16
#define BNHD FLASHC_LAYOUT_BNHD
#define BHND FLASHC_LAYOUT_BHND
#define PAD FLASHC_LAYOUT_PADDED

/* name, dtype, B, Nq, Nk, H, Hkv, D, causal, window (left, right), softcap, alibi, block (q, k), varlen, layout,
 * backward */
#define CASE(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd) \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, 0, 0, 0, 0, 0, 0, 0}
/* ... and the two later columns: seqused_k, sinks */
#define CASE2(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks) \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks, 0, 0, 0, 0, \
     0}
/* ... and the page size of a paged K/V cache */
#define CASE3(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks, \
              page) \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks, page, 0, 0, \
     0, 0}

/* ... and positions (flashc_params 0.6): query row i of every sequence at qpos + i, key j at kpos + j */
#define CASEP(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks, \
              page, qpos, kpos) \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, bwd, used, sinks, page, 0, 1, \
     qpos, kpos}

/* Sizes are kept so that the whole table, naive fp64 oracle included, runs in about a minute on two cores:
 * the oracle costs O(Nq * Nk * D) per head, so long sequences and wide heads get small B and H. */
static const flashc_case full_table[] = {
    /* head dims: each in fp32 and a 16-bit type, Nq != Nk both ways */
    CASE("d8", F32, 2, 17, 128, 4, 4, 8, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d8_bf16_causal", BF16, 2, 128, 17, 4, 1, 8, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d32", F32, 2, 113, 128, 4, 2, 32, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d32_f16", F16, 1, 255, 113, 4, 4, 32, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d59_mqa", F32, 1, 113, 255, 4, 1, 59, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d59_bf16_causal", BF16, 2, 128, 113, 2, 2, 59, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d64", F32, 2, 255, 255, 4, 4, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d64_f16_causal_gqa", F16, 2, 128, 255, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d64_bf16", BF16, 2, 255, 128, 4, 4, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d80", F32, 1, 128, 255, 2, 2, 80, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d80_bf16_causal", BF16, 1, 255, 255, 2, 1, 80, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d96", F32, 1, 255, 113, 2, 2, 96, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d96_f16", F16, 1, 113, 255, 4, 2, 96, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d111", F32, 1, 128, 113, 2, 2, 111, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d111_bf16_causal", BF16, 1, 113, 255, 2, 2, 111, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d128", F32, 1, 255, 255, 2, 2, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d128_f16_causal", F16, 1, 255, 128, 2, 1, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d128_bf16", BF16, 1, 128, 255, 2, 2, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d160", F32, 1, 113, 255, 2, 2, 160, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d160_bf16", BF16, 1, 255, 113, 2, 1, 160, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d192", F32, 1, 128, 113, 2, 2, 192, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d192_f16_causal", F16, 1, 255, 255, 2, 2, 192, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d256", F32, 1, 255, 128, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d256_bf16_causal", BF16, 1, 128, 255, 2, 1, 256, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d256_f16", F16, 1, 113, 113, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),

    /* the third dtype of each head dim, with a feature on top */
    CASE("d8_f16_window", F16, 4, 113, 128, 2, 1, 8, 0, 9, 4, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d32_bf16_softcap", BF16, 2, 128, 113, 4, 2, 32, 0, -1, -1, 15.0f, 0, 0, 0, 0, BNHD, 1),
    CASE("d59_f16_alibi", F16, 2, 113, 128, 2, 2, 59, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 1),
    CASE("d80_f16_bhnd", F16, 1, 255, 128, 2, 2, 80, 0, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    CASE("d96_bf16_padded", BF16, 1, 128, 255, 2, 1, 96, 1, -1, -1, 0, 0, 0, 0, 0, PAD, 1),
    CASE("d111_f16_mask", F16, 1, 255, 113, 2, 2, 111, 0, -1, -1, 0, 0, 24, 9, 0, BNHD, 1),
    CASE("d160_f16_causal", F16, 1, 128, 128, 2, 2, 160, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("d192_bf16_varlen", BF16, 3, 128, 113, 2, 1, 192, 0, -1, -1, 0, 0, 0, 0, 1, BNHD, 1),

    /* lengths: 1, 17, 512, 1023, both ways round */
    CASE("n1x1", F32, 2, 1, 1, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1x1023", F32, 1, 1, 1023, 4, 1, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1x1023_bf16_causal", BF16, 2, 1, 1023, 4, 4, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1023x1_bf16", BF16, 1, 1023, 1, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1023x1_f16_causal", F16, 1, 1023, 1, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n17x512_f16", F16, 2, 17, 512, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n512x17_causal", F32, 2, 512, 17, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1023_causal", F32, 1, 1023, 1023, 1, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1023_bf16", BF16, 1, 1023, 1023, 1, 1, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0),
    CASE("n1023x255_f16_causal", F16, 1, 1023, 255, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n255x1023_causal", F32, 1, 255, 1023, 2, 2, 32, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n113x1023_bf16", BF16, 1, 113, 1023, 2, 1, 96, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n512x255", F32, 1, 512, 255, 2, 1, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n255x512_f16", F16, 1, 255, 512, 2, 2, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0),

    /* grouped and multi-query attention */
    CASE("gqa_h8_kv2", F32, 2, 128, 113, 8, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("gqa_h8_kv2_bf16_causal", BF16, 2, 113, 128, 8, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("mqa_h8_f16", F16, 1, 128, 255, 8, 1, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("mqa_h8_causal", F32, 1, 255, 128, 8, 1, 32, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),

    /* sliding windows */
    CASE("win_16_0", F32, 2, 255, 255, 2, 2, 64, 0, 16, 0, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("win_32_8_bf16", BF16, 2, 128, 255, 2, 1, 64, 0, 32, 8, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("win_0_0", F32, 1, 255, 128, 2, 2, 64, 0, 0, 0, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("win_inf_5_f16", F16, 1, 255, 255, 2, 2, 64, 0, -1, 5, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("win_7_inf", F32, 1, 113, 512, 2, 1, 64, 0, 7, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("win_100_100_bf16", BF16, 1, 1023, 1023, 1, 1, 32, 0, 100, 100, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("causal_win_64", F32, 1, 512, 512, 2, 1, 64, 1, 64, -1, 0, 0, 0, 0, 0, BNHD, 1),

    /* softcap */
    CASE("softcap30", F32, 2, 128, 255, 2, 2, 64, 0, -1, -1, 30.0f, 0, 0, 0, 0, BNHD, 1),
    CASE("softcap5_bf16_causal", BF16, 2, 255, 128, 2, 2, 64, 1, -1, -1, 5.0f, 0, 0, 0, 0, BNHD, 1),
    CASE("softcap2_f16_gqa", F16, 1, 128, 128, 8, 2, 128, 0, -1, -1, 2.0f, 0, 0, 0, 0, BNHD, 1),
    CASE("softcap3_alibi", F32, 1, 113, 255, 4, 2, 64, 0, -1, -1, 3.0f, 1, 0, 0, 0, BNHD, 1),

    /* ALiBi, one slope per head or per (batch, head) */
    CASE("alibi_head", F32, 2, 255, 128, 4, 4, 64, 0, -1, -1, 0, 1, 0, 0, 0, BNHD, 1),
    CASE("alibi_batch_bf16_causal", BF16, 2, 128, 255, 4, 2, 64, 1, -1, -1, 0, 2, 0, 0, 0, BNHD, 1),
    CASE("alibi_head_f16_window", F16, 2, 255, 255, 4, 1, 64, 0, 40, 10, 0, 1, 0, 0, 0, BNHD, 1),
    CASE("alibi_batch_n1023", F32, 2, 17, 1023, 2, 2, 64, 0, -1, -1, 0, 2, 0, 0, 0, BNHD, 1),

    /* block-sparse masks, block sizes that do not divide the lengths */
    CASE("bs_16x16", F32, 2, 113, 113, 2, 2, 64, 0, -1, -1, 0, 0, 16, 16, 0, BNHD, 1),
    CASE("bs_7x13_bf16", BF16, 2, 128, 255, 2, 1, 64, 0, -1, -1, 0, 0, 7, 13, 0, BNHD, 1),
    CASE("bs_64x33_f16_causal", F16, 1, 255, 1023, 2, 2, 64, 1, -1, -1, 0, 0, 64, 33, 0, BNHD, 1),
    CASE("bs_100x200", F32, 1, 512, 255, 2, 2, 64, 0, -1, -1, 0, 0, 100, 200, 0, BNHD, 1),
    CASE("bs_1x1", F32, 2, 17, 17, 2, 2, 32, 0, -1, -1, 0, 0, 1, 1, 0, BNHD, 1),
    CASE("bs_33x47_bf16_all", BF16, 2, 255, 255, 4, 2, 64, 1, 100, -1, 0, 1, 33, 47, 0, BNHD, 1),
    /* at the Hopper kernels' other head dims: blocks that align with their tiles (no tile cut) and that do not;
     * under 512 keys, so that the GPU does not split the keys of these few tiles */
    CASE("bs_128x128_bf16_d128", BF16, 2, 512, 384, 4, 2, 128, 0, -1, -1, 0, 0, 128, 128, 0, BNHD, 1),
    CASE("bs_64x64_f16_d128_causal", F16, 1, 384, 384, 2, 2, 128, 1, -1, -1, 0, 0, 64, 64, 0, BNHD, 1),
    CASE("bs_129x127_bf16_d256_window", BF16, 2, 300, 440, 2, 1, 256, 0, 200, 50, 0, 0, 129, 127, 0, BNHD, 1),
    CASE("bs_48x80_bf16_d128_softcap", BF16, 1, 255, 447, 4, 4, 128, 0, -1, -1, 30, 0, 48, 80, 0, BNHD, 1),
    CASE2("bs_32x64_f16_d96_used_sinks", F16, 3, 200, 400, 4, 2, 96, 0, -1, -1, 0, 0, 32, 64, 0, BNHD, 1, 1, 1),
    CASE("bs_varlen_f16_d128_causal", F16, 3, 300, 400, 2, 2, 128, 1, -1, -1, 0, 0, 64, 128, 1, BNHD, 1),
    CASE("bs_192x128_bf16_d192_gqa", BF16, 2, 400, 400, 6, 2, 192, 0, -1, -1, 0, 0, 192, 128, 0, BNHD, 1),

    /* varlen: packed sequences of random lengths, one of them empty */
    CASE("varlen", F32, 4, 255, 255, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 1, BNHD, 1),
    CASE("varlen_bf16_causal", BF16, 5, 128, 255, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1),
    CASE("varlen_f16_window_gqa", F16, 3, 255, 128, 4, 1, 64, 0, 20, 3, 0, 0, 0, 0, 1, BNHD, 1),
    CASE("varlen_alibi_batch", F32, 4, 113, 255, 2, 2, 96, 0, -1, -1, 0, 2, 0, 0, 1, BNHD, 1),
    CASE("varlen_blockmask_bf16", BF16, 3, 255, 255, 2, 2, 64, 0, -1, -1, 0, 0, 17, 24, 1, BNHD, 1),
    CASE("varlen_bhnd_causal", F32, 4, 128, 128, 2, 1, 128, 1, -1, -1, 0, 0, 0, 0, 1, BHND, 1),
    CASE("varlen_padded_f16", F16, 4, 113, 255, 2, 2, 59, 0, -1, -1, 0, 0, 0, 0, 1, PAD, 1),

    /* strided views */
    CASE("bhnd", F32, 2, 255, 128, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    CASE("bhnd_bf16_causal", BF16, 2, 128, 255, 4, 4, 128, 1, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    CASE("padded", F32, 2, 113, 255, 4, 1, 80, 0, -1, -1, 0, 0, 0, 0, 0, PAD, 1),
    CASE("padded_f16_causal", F16, 2, 255, 113, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, PAD, 1),
    CASE("padded_bf16_d256", BF16, 1, 128, 128, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, PAD, 1),

    /* more batches and heads, mixed features */
    CASE("b8_h2_n17", F32, 8, 17, 33, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("h16_kv4_bf16", BF16, 1, 64, 96, 16, 4, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("bs_24x9_window", F32, 2, 128, 255, 2, 1, 64, 0, 50, 30, 0, 0, 24, 9, 0, BNHD, 1),
    CASE("bs_9x24_f16_gqa", F16, 2, 255, 128, 4, 2, 64, 0, -1, -1, 0, 0, 9, 24, 0, BHND, 1),
    CASE("softcap_varlen_bf16_gqa", BF16, 4, 255, 255, 4, 2, 64, 0, -1, -1, 20.0f, 0, 0, 0, 1, BNHD, 1),
    CASE("alibi_softcap_f16_causal", F16, 2, 255, 255, 2, 2, 64, 1, -1, -1, 12.0f, 2, 0, 0, 0, BNHD, 1),
    CASE("mqa_varlen_bhnd_f16", F16, 3, 128, 255, 4, 1, 128, 1, -1, -1, 0, 0, 0, 0, 1, BHND, 1),
    CASE("n1023_f16_causal_d128", F16, 1, 1023, 1023, 1, 1, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("n1023x512_alibi_window", F32, 1, 1023, 512, 2, 1, 64, 0, 128, 64, 0, 1, 0, 0, 0, PAD, 1),
    CASE("n17x17_all_f32", F32, 2, 17, 17, 2, 1, 8, 1, 5, -1, 3.0f, 2, 3, 5, 0, BHND, 1),

    /* larger problems: many tiles per thread, long rows through the online softmax */
    CASE("large_causal_gqa", F32, 2, 1023, 1023, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("large_bf16_mqa_d128", BF16, 1, 1023, 1023, 4, 1, 128, 0, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    CASE("large_f16_varlen_all", F16, 4, 1023, 1023, 2, 2, 64, 1, 256, -1, 30.0f, 2, 64, 128, 1, BNHD, 1),

    /* used keys per sequence (a static KV cache) and attention sinks */
    CASE2("used_k", F32, 3, 64, 200, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0),
    CASE2("used_k_bf16_causal_gqa", BF16, 4, 17, 255, 4, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0),
    CASE2("used_k_f16_n1_window", F16, 4, 1, 300, 4, 1, 64, 0, 100, 0, 0, 0, 0, 0, 0, BNHD, 1, 1, 0),
    CASE2("used_k_varlen_bf16", BF16, 4, 128, 255, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 1, 0),
    CASE2("used_k_d256_f16", F16, 3, 100, 255, 2, 1, 256, 0, -1, -1, 0, 1, 0, 0, 0, BHND, 1, 1, 0),
    CASE2("sinks", F32, 2, 113, 128, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 1),
    CASE2("sinks_bf16_causal", BF16, 2, 255, 255, 4, 4, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 1),
    CASE2("sinks_f16_window_gqa", F16, 2, 255, 255, 8, 2, 64, 0, 64, 0, 0, 0, 0, 0, 0, BNHD, 1, 0, 1),
    CASE2("sinks_varlen_bf16", BF16, 4, 128, 255, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 1),
    CASE2("sinks_n1x1023_bf16", BF16, 2, 1, 1023, 8, 2, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 1),
    CASE2("sinks_d256_softcap_f16", F16, 1, 128, 200, 2, 2, 256, 0, -1, -1, 10.0f, 0, 0, 0, 0, BNHD, 1, 0, 1),
    CASE2("used_sinks_bf16_mask", BF16, 3, 100, 255, 4, 2, 64, 1, 80, -1, 0, 0, 32, 48, 0, BNHD, 1, 1, 1),

    /* decode and chunked prefill (Nq 1-16) against long caches: the CPU's decode path packs a GQA group's rows and
     * splits the keys into pieces merged by lse (tests/test_cases.c checks that these rows ran on it) */
    CASE("dec_n1_gqa4", F32, 1, 1, 4100, 8, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE2("dec_n1_bf16_used_sinks", BF16, 3, 1, 2000, 8, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 1, 1),
    CASE("dec_n4_f16_causal_g8", F16, 2, 4, 1500, 16, 2, 96, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE2("dec_n16_window_g8_used", F32, 2, 16, 3000, 8, 1, 64, 0, 300, 0, 0, 0, 0, 0, 0, BNHD, 0, 1, 0),
    CASE("dec_n7_bf16_softcap_alibi", BF16, 2, 7, 1000, 4, 2, 59, 1, -1, -1, 20.0f, 2, 0, 0, 0, BNHD, 1),
    CASE2("dec_n3_varlen_bf16_sinks", BF16, 4, 3, 1200, 8, 4, 128, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 1),
    CASE("dec_n1_mqa_bhnd", F32, 2, 1, 5000, 16, 1, 32, 0, -1, -1, 0, 0, 0, 0, 0, BHND, 0),
    CASE("dec_n2_f16_mask_padded", F16, 2, 2, 777, 4, 2, 80, 0, -1, -1, 0, 1, 1, 50, 0, PAD, 1),
    CASE("dec_n1_d256_win", F32, 2, 1, 1100, 4, 1, 256, 0, 500, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("dec_n8_d256_f16_g8_kv3", F16, 1, 8, 700, 24, 3, 256, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0),
    CASE("dec_n1_mha20_bhnd", F32, 2, 1, 900, 20, 20, 32, 0, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    /* grouped heads the CUDA forward takes as query rows (one query, nothing per position or head) */
    CASE2("dec_n1_bf16_gqa8_used_causal", BF16, 3, 1, 3000, 16, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0),
    CASE("dec_n1_f16_mqa_d64_softcap", F16, 2, 1, 2500, 8, 1, 64, 0, -1, 5, 10.0f, 0, 0, 0, 0, BNHD, 1),
    /* enough (sequence, head) pairs (>= 64) for the CUDA forward's 16-row decode tile */
    CASE("dec_n4_bf16_b8_causal_tile16", BF16, 8, 4, 600, 16, 4, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("dec_n1_f16_b16_gqa4_tile16", F16, 16, 1, 500, 32, 8, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),

    /* paged K/V (block_table) at page sizes 1, 16, 64, 256: pages in a shuffled order, unused pages and rows NaN. The
     * decode rows (dec_*) run the CPU's decode path, the others its tiles; the CUDA backend runs their forwards (on
     * mma.sync) and refuses their backwards for now (reported as skipped; none is a row gpu_fwd expects to run with
     * GQA heads as rows or on the decode tile) */
    CASE3("dec_pg1_n1_gqa4_used_sinks", F32, 3, 1, 300, 8, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 1, 1, 1),
    CASE3("dec_pg16_n4_bf16_causal_used", BF16, 2, 4, 1000, 8, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 16),
    CASE3("dec_pg64_n16_f16_window_used", F16, 2, 16, 2000, 4, 1, 64, 0, 200, 0, 0, 0, 0, 0, 0, BNHD, 0, 1, 0, 64),
    CASE3("dec_pg256_n1_varlen_bf16", BF16, 4, 1, 1500, 8, 2, 96, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 0, 0, 0, 256),
    CASE3("dec_pg16_n1_mha_bhnd_alibi", F32, 2, 1, 700, 4, 4, 32, 0, -1, -1, 0, 1, 0, 0, 0, BHND, 1, 0, 0, 16),
    CASE3("dec_pg64_n7_padded_softcap", F32, 2, 7, 400, 6, 2, 48, 1, -1, -1, 10.0f, 0, 0, 0, 0, PAD, 0, 1, 0, 64),
    CASE3("pg16_prefill_causal_gqa_used", F32, 2, 200, 300, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 16),
    CASE3("pg64_prefill_bf16_softcap_pad", BF16, 2, 100, 250, 4, 2, 80, 0, -1, -1, 20.0f, 0, 0, 0, 0, PAD, 1, 0, 0, 64),
    CASE3("pg1_varlen_f16_causal", F16, 3, 40, 60, 2, 1, 32, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 1),
    CASE3("pg256_prefill_mask_sinks", F32, 2, 64, 600, 2, 2, 64, 0, -1, -1, 0, 0, 32, 100, 0, BNHD, 1, 0, 1, 256),

    /* positions (context / ring parallelism: a chunk pair of a longer sequence): the band and ALiBi measured between
     * q_position + i and k_position + j. Keys after the queries and before them, causal with Nq != Nk (rows that see
     * no key where the keys start later), windows, varlen, seqused_k (which no longer moves the alignment), sinks,
     * GQA, block masks, paged K/V, negative positions, and decode rows (dec_*: the CPU's decode path; on CUDA a right
     * band that cuts keeps Nq 1 off the GQA-rows path) */
    CASEP("pos_alibi_keys_after", F32, 2, 200, 150, 4, 2, 64, 0, -1, -1, 0, 1, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 300),
    CASEP("pos_alibi_keys_before_bf16", BF16, 2, 150, 255, 4, 4, 128, 0, -1, -1, 20.0f, 2, 0, 0, 0, BNHD, 1, 0, 0, 0,
          1000, 700),
    CASEP("pos_causal_f16_gqa", F16, 2, 255, 128, 4, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 300, 200),
    CASEP("pos_causal_keys_later_bf16", BF16, 2, 128, 255, 2, 2, 96, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 64),
    CASEP("pos_window_alibi", F32, 1, 255, 300, 2, 1, 32, 0, 40, 10, 0, 1, 0, 0, 0, PAD, 1, 0, 0, 0, 500, 450),
    CASEP("pos_window_bf16_d256", BF16, 1, 113, 200, 2, 2, 256, 1, 64, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 150, 0),
    CASEP("pos_window_f16_right", F16, 2, 200, 200, 4, 2, 128, 0, -1, 30, 0, 0, 0, 0, 0, BHND, 1, 0, 0, 0, -50, 20),
    CASEP("pos_varlen_f16_causal_alibi", F16, 4, 128, 255, 2, 2, 64, 1, -1, -1, 0, 2, 0, 0, 1, BNHD, 1, 0, 0, 0, 200,
          100),
    CASEP("pos_varlen_window_gqa", F32, 3, 255, 128, 8, 2, 64, 0, 30, 30, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 0, 50, 100),
    CASEP("pos_used_k_bf16_causal_alibi", BF16, 3, 64, 200, 2, 2, 128, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 1, 1, 0, 0, 150,
          0),
    CASEP("pos_used_sinks_f16_window", F16, 3, 100, 255, 4, 2, 64, 0, 100, 20, 0, 0, 0, 0, 0, BNHD, 1, 1, 1, 0, 80, 0),
    CASEP("pos_mask_bf16_causal", BF16, 2, 255, 255, 2, 2, 64, 1, -1, -1, 0, 0, 32, 48, 0, BNHD, 1, 0, 0, 0, 100, 0),
    CASEP("pos_ring_causal_gqa_window", F32, 1, 1023, 512, 4, 1, 64, 1, 300, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 512, 0),
    /* positions 2^29 apart, the most the CUDA kernels' int32 rows take, with a band side just past 2^29 that still
     * cuts keys (no ALiBi: its fp32 distances are not resolved that far out) */
    CASEP("pos_far_left_bf16", BF16, 1, 64, 128, 2, 2, 64, 0, (1LL << 29) + 50, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0,
          1LL << 29, 0),
    CASEP("pos_far_right_f16_softcap", F16, 1, 64, 100, 4, 1, 64, 0, -1, (1LL << 29) + 30, 15.0f, 0, 0, 0, 0, BNHD, 1,
          0, 0, 0, 0, 1LL << 29),
    CASEP("pos_pg16_causal_used", F32, 2, 64, 300, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 16, 236, 0),
    CASEP("dec_pos_n1_causal_gqa", F32, 2, 1, 2000, 8, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 1000, 0),
    CASEP("dec_pos_n4_bf16_alibi_window", BF16, 2, 4, 1500, 8, 2, 128, 0, 300, 0, 0, 2, 0, 0, 0, BNHD, 1, 0, 0, 0, 900,
          -100),
    CASEP("dec_pos_n1_f16_b16_tile16", F16, 16, 1, 500, 32, 8, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 250, 0),
    CASEP("dec_pos_n1_gqa_rows_all_keys", BF16, 3, 1, 600, 16, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 5000,
          0),

    /* everything at once */
    CASE("all_bf16", BF16, 3, 255, 255, 4, 2, 64, 1, 90, -1, 8.0f, 2, 19, 29, 1, PAD, 1),
    CASE("all_f32", F32, 3, 128, 255, 4, 1, 96, 0, 60, 20, 8.0f, 2, 29, 19, 1, BHND, 1),
    CASE("all_f16", F16, 2, 255, 113, 8, 2, 32, 1, -1, -1, 10.0f, 1, 37, 11, 0, PAD, 1),
};

/* Each feature once, on small shapes: for sanitizer and racecheck runs. */
static const flashc_case quick_table[] = {
    CASE("q_d64", F32, 2, 33, 47, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_d8_bf16_causal", BF16, 2, 47, 33, 2, 2, 8, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_d59_f16", F16, 1, 40, 40, 2, 1, 59, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_d256", F32, 1, 17, 70, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_n1", BF16, 2, 1, 65, 2, 2, 32, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_mqa", F32, 1, 65, 31, 4, 1, 32, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_window", F16, 1, 70, 70, 2, 2, 64, 0, 9, 3, 0, 0, 0, 0, 0, BNHD, 1),
    CASE("q_softcap", F32, 1, 40, 50, 2, 2, 64, 0, -1, -1, 4.0f, 0, 0, 0, 0, BNHD, 1),
    CASE("q_alibi_head", BF16, 1, 50, 40, 2, 1, 64, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 1),
    CASE("q_alibi_batch", F32, 2, 30, 60, 2, 2, 32, 0, -1, -1, 0, 2, 0, 0, 0, BNHD, 1),
    CASE("q_blockmask", F32, 2, 45, 67, 2, 2, 32, 0, -1, -1, 0, 0, 13, 9, 0, BNHD, 1),
    CASE("q_varlen", BF16, 4, 40, 50, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1),
    CASE("q_bhnd", F32, 2, 35, 35, 2, 2, 96, 1, -1, -1, 0, 0, 0, 0, 0, BHND, 1),
    CASE("q_padded", F16, 2, 37, 29, 2, 1, 80, 0, -1, -1, 0, 0, 0, 0, 0, PAD, 1),
    CASE("q_all", F32, 3, 45, 61, 4, 2, 48, 1, 20, -1, 5.0f, 2, 11, 7, 1, PAD, 1),
    CASE2("q_used_sinks", BF16, 3, 33, 70, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 1),
    CASE2("q_dec_n2_gqa", F32, 2, 2, 600, 8, 2, 48, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 1),
    CASE3("q_paged16", F32, 2, 3, 100, 4, 2, 32, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 16),
    CASEP("q_positions", F32, 2, 40, 50, 4, 2, 32, 1, 20, -1, 0, 1, 0, 0, 0, BNHD, 1, 0, 0, 0, 30, 10),
    CASEP("q_pos_varlen_keys_after", BF16, 3, 33, 45, 2, 1, 64, 0, -1, 3, 0, 2, 0, 0, 1, BNHD, 1, 0, 0, 0, 0, 8),
};

const flashc_case *flashc_case_table(int full, size_t *count) {
    if (full) {
        if (count) *count = sizeof full_table / sizeof full_table[0];
        return full_table;
    }
    if (count) *count = sizeof quick_table / sizeof quick_table[0];
    return quick_table;
}

/* ---- memory ---------------------------------------------------------------------------------------------- */

static flashc_case_memory g_mem;
static int g_mem_set;

static int g_reruns; /* flashc_case_set_reruns */

void flashc_case_set_reruns(int reruns) { g_reruns = reruns > 0 ? reruns : 0; }

void flashc_case_set_memory(const flashc_case_memory *mem) {
    if (mem) {
        g_mem = *mem;
        g_mem_set = 1;
    } else {
        memset(&g_mem, 0, sizeof g_mem);
        g_mem_set = 0;
    }
}

/* A host buffer and, with memory hooks, its device twin; without hooks dev == host. */
typedef struct buffer {
    void *host, *dev;
    size_t bytes;
} buffer;

static int buf_alloc(buffer *b, size_t bytes) {
    b->bytes = bytes;
    b->host = malloc(bytes ? bytes : 1);
    b->dev = NULL;
    if (!b->host) return -1;
    if (!g_mem_set) {
        b->dev = b->host;
        return 0;
    }
    b->dev = g_mem.alloc(bytes ? bytes : 1);
    return b->dev ? 0 : -1;
}

static void buf_free(buffer *b) {
    if (g_mem_set && b->dev) g_mem.free(b->dev);
    free(b->host);
    b->host = b->dev = NULL;
}

static int buf_upload(buffer *b) { return g_mem_set && b->bytes ? g_mem.to_device(b->dev, b->host, b->bytes) : 0; }
static int buf_download(buffer *b) { return g_mem_set && b->bytes ? g_mem.to_host(b->host, b->dev, b->bytes) : 0; }

/* Runs call() reruns more times, each on outputs poisoned first, and compares the n buffers bitwise with what the
 * first run left in them (their host copies): the index of the first rerun that differs, 0 when all agree, -1 when a
 * call or a copy failed (status in *st). */
typedef flashc_status (*rerun_fn)(void *arg);
static int rerun_compare(buffer *const *bufs, int n, rerun_fn call, void *arg, flashc_status *st) {
    void *first[5] = {0};
    int differ = 0;
    for (int i = 0; i < n; i++) {
        first[i] = malloc(bufs[i]->bytes ? bufs[i]->bytes : 1);
        if (!first[i]) differ = -1;
        else memcpy(first[i], bufs[i]->host, bufs[i]->bytes);
    }
    for (int r = 1; r <= g_reruns && differ == 0; r++) {
        for (int i = 0; i < n && differ == 0; i++) {
            memset(bufs[i]->host, 0xff, bufs[i]->bytes);
            if (buf_upload(bufs[i])) differ = -1;
        }
        if (differ) break;
        *st = call(arg);
        if (*st != FLASHC_STATUS_OK) {
            differ = -1;
            break;
        }
        for (int i = 0; i < n && differ == 0; i++) {
            if (buf_download(bufs[i])) differ = -1;
            else if (memcmp(first[i], bufs[i]->host, bufs[i]->bytes) != 0) differ = r;
        }
    }
    for (int i = 0; i < n; i++) free(first[i]);
    return differ;
}


/* One library call, as the reruns repeat it. */
typedef struct fwd_call {
    flashc_context_t ctx;
    const flashc_tensor *q, *k, *v, *out;
    const flashc_params *prm;
    float *lse;
    void *ws;
    size_t ws_bytes;
} fwd_call;
static flashc_status fwd_call_run(void *p) {
    const fwd_call *a = p;
    return flashc_forward(a->ctx, a->q, a->k, a->v, a->prm, a->out, a->lse, a->ws, a->ws_bytes);
}
typedef struct bwd_call {
    flashc_context_t ctx;
    const flashc_tensor *q, *k, *v, *out, *dout, *dq, *dk, *dv;
    const flashc_params *prm;
    const float *lse;
    void *ws;
    size_t ws_bytes;
} bwd_call;
static flashc_status bwd_call_run(void *p) {
    const bwd_call *a = p;
    return flashc_backward(a->ctx, a->q, a->k, a->v, a->out, a->dout, a->lse, a->prm, a->dq, a->dk, a->dv, a->ws,
                           a->ws_bytes);
}

/* ---- tensors --------------------------------------------------------------------------------------------- */

/* A (nb, rows, heads, D) view in the case's layout over a buffer of *elems elements. */
static flashc_tensor make_view(flashc_case_layout layout, flashc_dtype dt, int64_t nb, int64_t rows, int64_t heads,
                               int64_t D, int64_t *elems) {
    flashc_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dt;
    t.shape[0] = nb;
    t.shape[1] = rows;
    t.shape[2] = heads;
    t.shape[3] = D;
    switch (layout) {
    case FLASHC_LAYOUT_BHND:
        t.stride[3] = 1;
        t.stride[1] = D;
        t.stride[2] = rows * D;
        t.stride[0] = heads * rows * D;
        *elems = nb * heads * rows * D;
        break;
    case FLASHC_LAYOUT_PADDED: {
        /* gaps after each head vector, after the heads of a row, and between batches */
        int64_t head_pitch = D + 3, row_pitch = (heads + 1) * head_pitch, batch_pitch = rows * row_pitch + 5;
        t.stride[3] = 1;
        t.stride[2] = head_pitch;
        t.stride[1] = row_pitch;
        t.stride[0] = batch_pitch;
        *elems = nb * batch_pitch;
        break;
    }
    default:
        t.stride[3] = 1;
        t.stride[2] = D;
        t.stride[1] = heads * D;
        t.stride[0] = rows * heads * D;
        *elems = nb * rows * heads * D;
        break;
    }
    return t;
}

static int64_t view_offset(const flashc_tensor *t, int64_t b, int64_t n, int64_t h, int64_t d) {
    return b * t->stride[0] + n * t->stride[1] + h * t->stride[2] + d * t->stride[3];
}

static double get_elem(const void *data, flashc_dtype dt, int64_t off) {
    switch (dt) {
    case FLASHC_DTYPE_F32: return ((const float *)data)[off];
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)data)[off]);
    default: return flashc_bf16_to_f32(((const uint16_t *)data)[off]);
    }
}

static void set_elem(void *data, flashc_dtype dt, int64_t off, double x) {
    switch (dt) {
    case FLASHC_DTYPE_F32: ((float *)data)[off] = (float)x; break;
    case FLASHC_DTYPE_F16: ((uint16_t *)data)[off] = flashc_f32_to_f16((float)x); break;
    default: ((uint16_t *)data)[off] = flashc_f32_to_bf16((float)x); break;
    }
}

static int is_poison(const void *data, flashc_dtype dt, int64_t off) {
    if (dt == FLASHC_DTYPE_F32) return ((const uint32_t *)data)[off] == 0xffffffffu;
    return ((const uint16_t *)data)[off] == 0xffffu;
}

/* Fills the view with normal values, one query row in eight (row_boost) scaled by 4..8; what lies outside
 * the view is left as poison so that a read outside it turns the result into NaN. */
static void fill_view(buffer *buf, const flashc_tensor *t, uint64_t *rng, int row_boost) {
    memset(buf->host, 0xff, buf->bytes);
    for (int64_t b = 0; b < t->shape[0]; b++)
        for (int64_t n = 0; n < t->shape[1]; n++) {
            double f = 1.0;
            if (row_boost && rand_below(rng, 8) == 0) f = 4.0 + 4.0 * rand_uniform(rng);
            for (int64_t h = 0; h < t->shape[2]; h++)
                for (int64_t d = 0; d < t->shape[3]; d++)
                    set_elem(buf->host, t->dtype, view_offset(t, b, n, h, d), f * flashc_rand_normal(rng));
        }
}

/* ---- comparison ------------------------------------------------------------------------------------------ */

typedef struct check {
    double err, tol;
    int64_t unwritten, nonfinite, outside;
} check;

/*
 * Compares an output view (host copy) with the reference (contiguous, in the view's logical order).
 * fp32: relative Frobenius error, bound rel_tol (an identically zero reference is held to rel_tol absolute);
 * low precision: max abs error, bound mult * max|lowp - ref| + 1e-5.
 */
static check compare_view(const buffer *buf, const flashc_tensor *t, const double *ref, const double *lowp,
                          double rel_tol, double mult) {
    check c = {0, 0, 0, 0, 0};
    const int64_t n0 = t->shape[0], n1 = t->shape[1], n2 = t->shape[2], n3 = t->shape[3];
    const int64_t elems = (int64_t)(buf->bytes / flashc_dtype_size(t->dtype));
    unsigned char *inview = calloc((size_t)elems, 1);
    double num = 0, den = 0, maxabs = 0, lowp_err = 0;
    int64_t i = 0;
    for (int64_t b = 0; b < n0; b++)
        for (int64_t n = 0; n < n1; n++)
            for (int64_t h = 0; h < n2; h++)
                for (int64_t d = 0; d < n3; d++, i++) {
                    int64_t off = view_offset(t, b, n, h, d);
                    if (inview) inview[off] = 1;
                    if (is_poison(buf->host, t->dtype, off)) {
                        c.unwritten++;
                        continue;
                    }
                    double x = get_elem(buf->host, t->dtype, off);
                    if (!isfinite(x)) {
                        c.nonfinite++;
                        continue;
                    }
                    double e = fabs(x - ref[i]);
                    num += e * e;
                    den += ref[i] * ref[i];
                    if (e > maxabs) maxabs = e;
                    if (lowp && fabs(lowp[i] - ref[i]) > lowp_err) lowp_err = fabs(lowp[i] - ref[i]);
                }
    if (inview)
        for (int64_t k = 0; k < elems; k++)
            if (!inview[k] && !is_poison(buf->host, t->dtype, k)) c.outside++;
    free(inview);
    if (lowp) {
        c.err = maxabs;
        c.tol = mult * lowp_err + 1e-5;
    } else {
        c.err = den > 0 ? sqrt(num / den) : maxabs;
        c.tol = rel_tol;
    }
    return c;
}

/* lse: +inf exactly where the reference row sees no key; elsewhere the rule of compare_view. */
static check compare_lse(const float *lse, const double *ref, const double *lowp, int64_t n, double rel_tol) {
    check c = {0, 0, 0, 0, 0};
    double num = 0, den = 0, maxabs = 0, lowp_err = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &lse[i], sizeof bits);
        if (bits == 0xffffffffu) {
            c.unwritten++;
            continue;
        }
        double x = lse[i];
        if (isinf(ref[i])) {
            if (!(isinf(x) && x > 0)) c.nonfinite++;
            continue;
        }
        if (!isfinite(x)) {
            c.nonfinite++;
            continue;
        }
        double e = fabs(x - ref[i]);
        num += e * e;
        den += ref[i] * ref[i];
        if (e > maxabs) maxabs = e;
        if (lowp && fabs(lowp[i] - ref[i]) > lowp_err) lowp_err = fabs(lowp[i] - ref[i]);
    }
    if (lowp) {
        c.err = maxabs;
        c.tol = 2.0 * lowp_err + 1e-5;
    } else {
        c.err = den > 0 ? sqrt(num / den) : maxabs;
        c.tol = rel_tol;
    }
    return c;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void append(flashc_case_result *res, const char *fmt, ...) {
    size_t used = strlen(res->message);
    if (used + 3 >= sizeof res->message) return;
    if (used) {
        memcpy(res->message + used, "; ", 3);
        used += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(res->message + used, sizeof res->message - used, fmt, ap);
    va_end(ap);
}

/* Folds one tensor's check into the result; returns 1 when it passed. */
static int judge(flashc_case_result *res, const char *name, const check *c) {
    int ok = 1;
    res->unwritten += (int)c->unwritten;
    res->nonfinite += (int)c->nonfinite;
    if (c->unwritten) {
        append(res, "%s: %lld elements not written", name, (long long)c->unwritten);
        ok = 0;
    }
    if (c->nonfinite) {
        append(res, "%s: %lld wrong non-finite values", name, (long long)c->nonfinite);
        ok = 0;
    }
    if (c->outside) {
        append(res, "%s: %lld elements written outside the view", name, (long long)c->outside);
        ok = 0;
    }
    if (!(c->err <= c->tol)) {
        append(res, "%s: error %.3g > bound %.3g", name, c->err, c->tol);
        ok = 0;
    }
    return ok;
}

/* ---- the runner ------------------------------------------------------------------------------------------ */

enum { BQ, BK, BV, BOUT, BLSE, BDOUT, BDQ, BDK, BDV, BSLOPES, BMASK, BCUQ, BCUK, BWS, BUSED, BSINK, BDSINK, BTABLE,
       NBUF };

static void set_status(flashc_case_result *res, flashc_status st, const char *what, flashc_context_t ctx) {
    res->status = st;
    res->pass = 0;
    snprintf(res->message, sizeof res->message, "%s: %s: %s", what, flashc_status_string(st),
             flashc_context_last_error(ctx));
}

int flashc_case_run(flashc_context_t ctx, const flashc_case *c, uint64_t seed, flashc_case_result *res) {
    memset(res, 0, sizeof *res);
    uint64_t rng = seed;
    buffer buf[NBUF];
    memset(buf, 0, sizeof buf);
    double *ref[5] = {0}, *lowp[5] = {0}; /* out, lse, dq, dk, dv */
    void *first[3] = {0};                 /* dq, dk, dv of the first deterministic backward */
    int nondet = 0;
    int rc = -1;
    /* The CUDA backend computes fp32 inputs through bf16 tensor-core operands: hold it to the bf16 rule. */
    const flashc_dtype rule = c->dtype == FLASHC_DTYPE_F32 && flashc_context_backend(ctx) == FLASHC_BACKEND_CUDA
                                  ? FLASHC_DTYPE_BF16
                                  : c->dtype;
    const int lp = rule != FLASHC_DTYPE_F32;
    const size_t esz = flashc_dtype_size(c->dtype);
    int64_t prm_bt_stride = 0; /* paged: the block table's row stride */

    /* sequence lengths */
    int64_t B = c->B, nb = c->varlen ? 1 : B, rows_q = c->Nq, rows_k = c->Nk;
    int32_t *cu_q = NULL, *cu_k = NULL;
    if (c->varlen) {
        if (buf_alloc(&buf[BCUQ], (size_t)(B + 1) * sizeof(int32_t)) ||
            buf_alloc(&buf[BCUK], (size_t)(B + 1) * sizeof(int32_t)))
            goto done;
        cu_q = buf[BCUQ].host;
        cu_k = buf[BCUK].host;
        /* one sequence without queries, one at the maximum lengths, and (B >= 3) one without keys */
        int64_t empty = rand_below(&rng, B), full = (empty + 1) % B, nokeys = B >= 3 ? (empty + 2) % B : -1;
        cu_q[0] = cu_k[0] = 0;
        for (int64_t b = 0; b < B; b++) {
            int64_t lq = 1 + rand_below(&rng, c->Nq), lk = 1 + rand_below(&rng, c->Nk);
            if (b == empty) lq = 0;
            if (b == full) lq = c->Nq, lk = c->Nk;
            if (b == nokeys) lk = 0;
            cu_q[b + 1] = (int32_t)(cu_q[b] + lq);
            cu_k[b + 1] = (int32_t)(cu_k[b] + lk);
        }
        rows_q = cu_q[B];
        rows_k = cu_k[B];
    }

    /* paged: each sequence has max_pages pages of page_size rows (its logical keys nk_log = max_pages * page_size,
     * varlen: its cu_seqlens_k length), taken from a pool of num_pages in a shuffled order; the pool has a few pages
     * more than the table names, which hold NaN */
    const int64_t ps = c->page_size, max_pages = ps > 0 ? (c->Nk + ps - 1) / ps : 0;
    const int64_t nk_log = ps > 0 ? (c->varlen ? c->Nk : max_pages * ps) : c->Nk;
    const int64_t num_pages = ps > 0 ? B * max_pages + 2 + B : 0;
    int32_t *table = NULL;
    if (ps > 0) {
        const int64_t stride = max_pages + (int64_t)rand_below(&rng, 3); /* a padded row stride, now and then */
        if (buf_alloc(&buf[BTABLE], (size_t)(B * stride) * sizeof(int32_t))) goto done;
        table = buf[BTABLE].host;
        int32_t *perm = malloc((size_t)num_pages * sizeof(int32_t));
        if (!perm) goto done;
        for (int64_t i = 0; i < num_pages; i++) perm[i] = (int32_t)i;
        for (int64_t i = num_pages - 1; i > 0; i--) { /* Fisher-Yates */
            const int64_t j = rand_below(&rng, i + 1);
            const int32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int64_t i = 0; i < B * stride; i++) table[i] = -7; /* the padding of each row: never read */
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < max_pages; i++) table[b * stride + i] = perm[b * max_pages + i];
        free(perm);
        prm_bt_stride = stride;
    }

    /* tensors */
    int64_t eq, ek;
    flashc_tensor tq = make_view(c->layout, c->dtype, nb, rows_q, c->H, c->D, &eq);
    flashc_tensor tk = ps > 0 ? make_view(c->layout, c->dtype, num_pages, ps, c->Hkv, c->D, &ek)
                              : make_view(c->layout, c->dtype, nb, rows_k, c->Hkv, c->D, &ek);
    flashc_tensor tv = tk, tout = tq, tdout = tq, tdq = tq, tdk = tk, tdv = tk;
    const int64_t lse_n = nb * c->H * rows_q;
    if (buf_alloc(&buf[BQ], (size_t)eq * esz) || buf_alloc(&buf[BK], (size_t)ek * esz) ||
        buf_alloc(&buf[BV], (size_t)ek * esz) || buf_alloc(&buf[BOUT], (size_t)eq * esz) ||
        buf_alloc(&buf[BLSE], (size_t)lse_n * sizeof(float)))
        goto done;
    if (c->backward && (buf_alloc(&buf[BDOUT], (size_t)eq * esz) || buf_alloc(&buf[BDQ], (size_t)eq * esz) ||
                        buf_alloc(&buf[BDK], (size_t)ek * esz) || buf_alloc(&buf[BDV], (size_t)ek * esz)))
        goto done;
    fill_view(&buf[BQ], &tq, &rng, 1);
    fill_view(&buf[BK], &tk, &rng, 0);
    fill_view(&buf[BV], &tv, &rng, 0);
    if (c->backward) fill_view(&buf[BDOUT], &tdout, &rng, 0);
    if (c->seqused) {
        /* keys each sequence uses: one none, one all, the others at random; the unused rows of k and v hold NaN,
         * which must reach no result */
        if (buf_alloc(&buf[BUSED], (size_t)B * sizeof(int32_t))) goto done;
        int32_t *used = buf[BUSED].host;
        const int64_t none = rand_below(&rng, B), all = (none + 1) % B;
        for (int64_t b = 0; b < B; b++) {
            const int64_t k0 = cu_k && !table ? cu_k[b] : 0, rows = cu_k ? cu_k[b + 1] - cu_k[b] : nk_log;
            used[b] = (int32_t)(b == none ? 0 : b == all ? rows : rand_below(&rng, rows + 1));
            for (int64_t j = used[b]; j < rows; j++)
                for (int64_t h = 0; h < c->Hkv; h++)
                    for (int64_t d = 0; d < c->D; d++) {
                        const int64_t tb = table ? table[b * prm_bt_stride + j / ps] : cu_k ? 0 : b;
                        const int64_t row = table ? j % ps : k0 + j;
                        set_elem(buf[BK].host, c->dtype, view_offset(&tk, tb, row, h, d), NAN);
                        set_elem(buf[BV].host, c->dtype, view_offset(&tv, tb, row, h, d), NAN);
                    }
            /* the table's entries past the pages a sequence uses are not read: some hold -1 */
            if (table && b % 2)
                for (int64_t i = (used[b] + ps - 1) / ps; i < max_pages; i++) table[b * prm_bt_stride + i] = -1;
        }
    }
    if (table) { /* every row of a page no needed table entry names holds NaN (what reading a wrong page shows) */
        unsigned char *named = calloc((size_t)num_pages, 1);
        if (!named) goto done;
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < max_pages; i++)
                if (table[b * prm_bt_stride + i] >= 0) named[table[b * prm_bt_stride + i]] = 1;
        for (int64_t pg = 0; pg < num_pages; pg++)
            if (!named[pg])
                for (int64_t r = 0; r < ps; r++)
                    for (int64_t h = 0; h < c->Hkv; h++)
                        for (int64_t d = 0; d < c->D; d++) {
                            set_elem(buf[BK].host, c->dtype, view_offset(&tk, pg, r, h, d), NAN);
                            set_elem(buf[BV].host, c->dtype, view_offset(&tv, pg, r, h, d), NAN);
                        }
        free(named);
    }
    if (c->sinks) { /* one logit per head, some of them large enough to take most of a row's mass */
        if (buf_alloc(&buf[BSINK], (size_t)c->H * sizeof(float))) goto done;
        float *sk = buf[BSINK].host;
        for (int64_t h = 0; h < c->H; h++) sk[h] = (float)(h % 3 == 2 ? 6.0 : 1.5 * flashc_rand_normal(&rng));
        if (c->backward && buf_alloc(&buf[BDSINK], (size_t)c->H * sizeof(float))) goto done;
    }

    /* parameters */
    flashc_params prm = flashc_params_default();
    if (rand_below(&rng, 2)) prm.softmax_scale = (float)((0.5 + rand_uniform(&rng)) / sqrt((double)c->D));
    prm.causal = c->causal;
    prm.window_left = c->window_left;
    prm.window_right = c->window_right;
    prm.softcap = c->softcap;
    prm.deterministic = (int)rand_below(&rng, 2);
    if (c->alibi) {
        int64_t n = c->alibi == 2 ? B * c->H : c->H;
        if (buf_alloc(&buf[BSLOPES], (size_t)n * sizeof(float))) goto done;
        float *s = buf[BSLOPES].host;
        for (int64_t i = 0; i < n; i++) s[i] = (float)(0.02 + 0.98 * rand_uniform(&rng));
        prm.alibi_batch_stride = c->alibi == 2 ? c->H : 0;
    }
    if (c->block_q > 0) {
        /* broadcast over batch / heads or not, varied from case to case through the block sizes' parity */
        int64_t mb = (c->block_q % 2 && B > 1) ? B : 1, mh = (c->block_k % 2 && c->H > 1) ? c->H : 1;
        int64_t nqb = (c->Nq + c->block_q - 1) / c->block_q, nkb = (nk_log + c->block_k - 1) / c->block_k;
        size_t n = (size_t)(mb * mh * nqb * nkb);
        if (buf_alloc(&buf[BMASK], n)) goto done;
        uint8_t *m = buf[BMASK].host;
        for (size_t i = 0; i < n; i++) m[i] = rand_below(&rng, 10) < 3 ? 0 : (uint8_t)(1 + rand_below(&rng, 255));
        /* a query block that sees nothing: its rows must come out as 0 with lse +inf */
        memset(m + rand_below(&rng, nqb) * nkb, 0, (size_t)nkb);
        prm.block_mask_q = c->block_q;
        prm.block_mask_k = c->block_k;
        prm.block_mask_batch = mb;
        prm.block_mask_heads = mh;
    }
    if (c->dropout > 0) {
        prm.dropout_p = c->dropout;
        prm.dropout_seed = flashc_rand_u64(&rng);
        prm.dropout_offset = flashc_rand_u64(&rng) >> (rand_below(&rng, 2) ? 0 : 40); /* large (streams wrap), small */
    }
    if (c->positions) {
        prm.positions = 1;
        prm.q_position = c->q_position;
        prm.k_position = c->k_position;
    }
    if (c->varlen) {
        prm.num_seqs = B;
        prm.max_seqlen_q = c->Nq;
        prm.max_seqlen_k = c->Nk;
    }
    /* the library gets device pointers, the oracle host ones */
    flashc_params hprm = prm;
    hprm.alibi_slopes = buf[BSLOPES].host;
    hprm.block_mask = buf[BMASK].host;
    hprm.cu_seqlens_q = buf[BCUQ].host;
    hprm.cu_seqlens_k = buf[BCUK].host;
    prm.alibi_slopes = buf[BSLOPES].dev;
    prm.block_mask = buf[BMASK].dev;
    prm.cu_seqlens_q = buf[BCUQ].dev;
    prm.cu_seqlens_k = buf[BCUK].dev;
    hprm.seqused_k = buf[BUSED].host;
    hprm.sinks = buf[BSINK].host;
    hprm.dsinks = buf[BDSINK].host;
    prm.seqused_k = buf[BUSED].dev;
    prm.sinks = buf[BSINK].dev;
    prm.dsinks = buf[BDSINK].dev;
    if (table) {
        hprm.block_table = buf[BTABLE].host;
        prm.block_table = buf[BTABLE].dev;
        prm.block_table_max_pages = hprm.block_table_max_pages = max_pages;
        prm.block_table_stride = hprm.block_table_stride = prm_bt_stride;
        prm.page_size = hprm.page_size = rand_below(&rng, 2) ? ps : 0; /* 0: k's shape[1] */
    }
    for (int i = 0; i < NBUF; i++)
        if (i != BOUT && i != BLSE && i != BDQ && i != BDK && i != BDV && i != BDSINK && buf[i].host &&
            buf_upload(&buf[i]))
            goto done;

    flashc_tensor dq_ = tq, dk_ = tk, dv_ = tv, dout_ = tdout, out_ = tout; /* device views */
    flashc_tensor q_ = tq, k_ = tk, v_ = tv;
    q_.data = buf[BQ].dev;
    k_.data = buf[BK].dev;
    v_.data = buf[BV].dev;
    out_.data = buf[BOUT].dev;
    dout_.data = buf[BDOUT].dev;
    dq_.data = buf[BDQ].dev;
    dk_.data = buf[BDK].dev;
    dv_.data = buf[BDV].dev;
    tq.data = buf[BQ].host;
    tk.data = buf[BK].host;
    tv.data = buf[BV].host;
    tout.data = buf[BOUT].host;
    tdout.data = buf[BDOUT].host;
    tdq.data = buf[BDQ].host;
    tdk.data = buf[BDK].host;
    tdv.data = buf[BDV].host;

    flashc_status st = flashc_supported(ctx, c->backward ? FLASHC_OP_BACKWARD : FLASHC_OP_FORWARD, &q_, &k_, &v_, &prm);
    /* dropout's (i, j) are the positions: both >= 0 and k_position a multiple of 4, or the call is refused */
    const int drop_positions_out = c->positions && c->dropout > 0 &&
                                   (c->q_position < 0 || c->k_position < 0 || c->k_position % 4 != 0);
    if (st == FLASHC_STATUS_NOT_SUPPORTED &&
        ((table && flashc_context_backend(ctx) == FLASHC_BACKEND_CUDA) || drop_positions_out)) {
        /* the paged backward is not on the CUDA backend yet, and dropout takes no positions below 0 or keys that
         * split Philox's groups of four (the dropout runs of the table set dropout on every row): said so, not
         * counted as a failure */
        set_status(res, st, "skipped (not supported)", ctx);
        res->pass = 1;
        res->skipped = 1;
        rc = 0;
        goto done;
    }
    if (st != FLASHC_STATUS_OK) {
        set_status(res, st, "supported", ctx);
        rc = 0;
        goto done;
    }

    /* what runs, so that a test can assert the kernel it meant to exercise */
    res->kernel_fwd = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &q_, &k_, &v_, &prm);
    if (c->backward) res->kernel_bwd = flashc_kernel_name(ctx, FLASHC_OP_BACKWARD, &q_, &k_, &v_, &prm);

    /* half of the runs bring their own workspace, the others let the library allocate */
    int own_ws = (int)rand_below(&rng, 2);
    size_t ws_bytes = 0;
    if (own_ws) {
        size_t fb = 0, bb = 0;
        st = flashc_forward_workspace_size(ctx, &q_, &k_, &v_, &prm, &fb);
        if (st == FLASHC_STATUS_OK && c->backward) st = flashc_backward_workspace_size(ctx, &q_, &k_, &v_, &prm, &bb);
        if (st != FLASHC_STATUS_OK) {
            set_status(res, st, "workspace_size", ctx);
            rc = 0;
            goto done;
        }
        ws_bytes = fb > bb ? fb : bb;
        if (ws_bytes && buf_alloc(&buf[BWS], ws_bytes)) goto done;
    }
    void *ws = ws_bytes ? buf[BWS].dev : NULL;

    /* forward */
    memset(buf[BOUT].host, 0xff, buf[BOUT].bytes);
    memset(buf[BLSE].host, 0xff, buf[BLSE].bytes);
    if (buf_upload(&buf[BOUT]) || buf_upload(&buf[BLSE])) goto done;
    st = flashc_forward(ctx, &q_, &k_, &v_, &prm, &out_, buf[BLSE].dev, ws, ws_bytes);
    if (st != FLASHC_STATUS_OK) {
        set_status(res, st, "forward", ctx);
        rc = 0;
        goto done;
    }
    if (buf_download(&buf[BOUT]) || buf_download(&buf[BLSE])) goto done;
    int fwd_differ = 0, bwd_differ = 0;
    if (g_reruns) { /* the same forward again: out and lse bit for bit */
        fwd_call fa = {ctx, &q_, &k_, &v_, &out_, &prm, (float *)buf[BLSE].dev, ws, ws_bytes};
        buffer *const outs[2] = {&buf[BOUT], &buf[BLSE]};
        fwd_differ = rerun_compare(outs, 2, fwd_call_run, &fa, &st);
        if (fwd_differ < 0) {
            set_status(res, st, "forward rerun", ctx);
            rc = st == FLASHC_STATUS_OK ? -1 : 0;
            goto done;
        }
    }
    if (c->backward) {
        for (int i = BDQ; i <= BDV; i++) {
            memset(buf[i].host, 0xff, buf[i].bytes);
            if (buf_upload(&buf[i])) goto done;
        }
        st = flashc_backward(ctx, &q_, &k_, &v_, &out_, &dout_, buf[BLSE].dev, &prm, &dq_, &dk_, &dv_, ws, ws_bytes);
        if (st != FLASHC_STATUS_OK) {
            set_status(res, st, "backward", ctx);
            rc = 0;
            goto done;
        }
        for (int i = BDQ; i <= BDV; i++)
            if (buf_download(&buf[i])) goto done;
        if (buf[BDSINK].host && buf_download(&buf[BDSINK])) goto done;
        if (g_reruns) { /* dK and dV have one writer each: bit for bit in both modes (and dQ when deterministic) */
            bwd_call ba = {ctx, &q_, &k_, &v_, &out_, &dout_, &dq_, &dk_, &dv_, &prm, (const float *)buf[BLSE].dev, ws,
                           ws_bytes};
            buffer *const grads[3] = {&buf[BDK], &buf[BDV], &buf[BDQ]};
            bwd_differ = rerun_compare(grads, prm.deterministic ? 3 : 2, bwd_call_run, &ba, &st);
            if (bwd_differ < 0) {
                set_status(res, st, "backward rerun", ctx);
                rc = st == FLASHC_STATUS_OK ? -1 : 0;
                goto done;
            }
        }
        if (prm.deterministic) { /* a second run must reproduce every bit */
            for (int i = 0; i < 3; i++) {
                first[i] = malloc(buf[BDQ + i].bytes ? buf[BDQ + i].bytes : 1);
                if (!first[i]) goto done;
                memcpy(first[i], buf[BDQ + i].host, buf[BDQ + i].bytes);
                memset(buf[BDQ + i].host, 0xff, buf[BDQ + i].bytes);
                if (buf_upload(&buf[BDQ + i])) goto done;
            }
            st = flashc_backward(ctx, &q_, &k_, &v_, &out_, &dout_, buf[BLSE].dev, &prm, &dq_, &dk_, &dv_, ws,
                                 ws_bytes);
            if (st != FLASHC_STATUS_OK) {
                set_status(res, st, "second deterministic backward", ctx);
                rc = 0;
                goto done;
            }
            for (int i = 0; i < 3; i++) {
                if (buf_download(&buf[BDQ + i])) goto done;
                if (memcmp(first[i], buf[BDQ + i].host, buf[BDQ + i].bytes) != 0) nondet = 1;
            }
        }
    }

    /* the oracle, on the host copies */
    flashc_problem p;
    st = flashc_problem_build(NULL, c->backward ? FLASHC_OP_BACKWARD : FLASHC_OP_FORWARD, &tq, &tk, &tv, &hprm,
                              &tout, buf[BLSE].host, c->backward ? &tdout : NULL, c->backward ? &tdq : NULL,
                              c->backward ? &tdk : NULL, c->backward ? &tdv : NULL, &p);
    if (st != FLASHC_STATUS_OK) {
        set_status(res, st, "oracle problem", NULL);
        rc = 0;
        goto done;
    }
    /* The oracle measures the case's own window sides and positions, not the front's simplification of them (a side
     * that hides no key made unbounded, positions that change nothing dropped): a wrong simplification then fails. */
    p.win_left = hprm.window_left;
    p.win_right = hprm.causal ? 0 : hprm.window_right;
    p.positions = hprm.positions != 0;
    p.q_position = p.positions ? hprm.q_position : 0;
    p.k_position = p.positions ? hprm.k_position : 0;
    const size_t nq_el = (size_t)(nb * rows_q * c->H * c->D),
                 nk_el = (size_t)(table ? num_pages * ps * c->Hkv * c->D : nb * rows_k * c->Hkv * c->D);
    const size_t sizes[5] = {nq_el, (size_t)lse_n, nq_el, nk_el, nk_el};
    for (int i = 0; i < (c->backward ? 5 : 2); i++) {
        ref[i] = malloc((sizes[i] ? sizes[i] : 1) * sizeof(double));
        if (lp) lowp[i] = malloc((sizes[i] ? sizes[i] : 1) * sizeof(double));
        if (!ref[i] || (lp && !lowp[i])) goto done;
    }
    if (flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref[0], ref[1])) goto done;
    if (lp && flashc_ref_forward(&p, rule, lowp[0], lowp[1])) goto done;
    if (c->backward) {
        if (flashc_ref_backward(&p, FLASHC_DTYPE_F32, ref[2], ref[3], ref[4])) goto done;
        if (lp && flashc_ref_backward(&p, rule, lowp[2], lowp[3], lowp[4])) goto done;
    }

    /* verdict */
    res->status = FLASHC_STATUS_OK;
    int ok = 1;
    check co = compare_view(&buf[BOUT], &tout, ref[0], lowp[0], 1e-5, 2.0);
    ok &= judge(res, "out", &co);
    res->err_out = co.err;
    res->tol_out = co.tol;
    check cl = compare_lse(buf[BLSE].host, ref[1], lowp[1], lse_n, 1e-5);
    ok &= judge(res, "lse", &cl);
    res->err_lse = cl.err;
    res->tol_lse = cl.tol;
    if (c->backward) {
        static const char *names[3] = {"dq", "dk", "dv"};
        const flashc_tensor *views[3] = {&tdq, &tdk, &tdv};
        double worst = -1;
        for (int i = 0; i < 3; i++) {
            check cg = compare_view(&buf[BDQ + i], views[i], ref[2 + i], lowp[2 + i], 1e-4, 3.0);
            ok &= judge(res, names[i], &cg);
            double ratio = cg.err / cg.tol;
            if (!(ratio <= worst)) { /* NaN counts as worst */
                worst = ratio;
                res->err_grad = cg.err;
                res->tol_grad = cg.tol;
            }
        }
    }
    if (c->backward && c->sinks) { /* the sinks' gradient against the oracle's, relative to its terms' scale */
        double *dref = malloc((size_t)c->H * 2 * sizeof(double));
        if (!dref || flashc_ref_sinks_grad(&p, dref, dref + c->H)) {
            free(dref);
            goto done;
        }
        const float *got = buf[BDSINK].host;
        for (int64_t h = 0; h < c->H; h++) {
            const double tol = (lp ? 2e-2 : 1e-4) * dref[c->H + h] + 1e-5;
            if (!(fabs(got[h] - dref[h]) <= tol)) {
                append(res, "dsinks[%lld]: %.6g, expected %.6g (bound %.2g)", (long long)h, (double)got[h], dref[h],
                       tol);
                ok = 0;
                break;
            }
        }
        free(dref);
    }
    if (nondet) {
        append(res, "deterministic backward: two runs differ");
        ok = 0;
    }
    if (fwd_differ > 0) {
        append(res, "forward rerun %d differs from the first run", fwd_differ);
        ok = 0;
    }
    if (bwd_differ > 0) {
        append(res, "backward rerun %d: dK / dV%s differ from the first run", bwd_differ, prm.deterministic ? " / dQ" : "");
        ok = 0;
    }
    res->pass = ok;
    rc = 0;

done:
    if (rc != 0 && !res->message[0]) snprintf(res->message, sizeof res->message, "could not set the case up (memory)");
    for (int i = 0; i < 5; i++) {
        free(ref[i]);
        free(lowp[i]);
    }
    for (int i = 0; i < 3; i++) free(first[i]);
    for (int i = 0; i < NBUF; i++) buf_free(&buf[i]);
    return rc;
}
