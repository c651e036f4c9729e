/*
 * score.cuh - the score and mask step that every tensor-core kernel calls (fwd_sm80.cuh, bwd_sm80.cuh,
 * fwd_sm90.cu, bwd_sm90.cu), so that a mask or a score modifier is written once: the score of an element in base 2
 * (scale, softcap, ALiBi), which keys a row keeps (the causal / sliding-window band, the end of the sequence, the
 * block mask), the online-softmax row update of the forward, and which key tiles a query tile visits under the
 * block mask (the band's tile ranges are score.h's). The host side of the same step, filling score_mul, softcap2,
 * the window and the block mask fields, is fc_set_scores_and_masks in launch.h. C++ (nvcc) only.
 *
 * Accumulator layout: mma.sync m16n8 and wgmma m64nN give a thread the same fragment of each 8-column block:
 * rows g and g + 8 (hf = 0, 1) of its m16 slice, columns 2 tig and 2 tig + 1 (e = 0, 1), where g = lane / 4 and
 * tig = lane % 4. A fragment of nt n8 blocks is float[nt][4] (mma.sync) or float[4 nt] (wgmma); element e of
 * row hf of block j is fc_frag(x, j, 2 hf + e) in both.
 *
 * Args is flashc_fwd_args or flashc_bwd_args, which carry score.h's FC_SCORE_FIELDS (launch.h fills them). The
 * forwards' generic element step on a fragment row is fc_score_row below (both tensor-core forwards). The
 * scores (fc_score, fc_bwd_elem, fc_alibi, fc_score_plain), the band (fc_row_keys, fc_keeps, fc_band_cuts) and
 * the tile ranges (fc_key_tiles, fc_query_rows) are score.h's, shared with the host and the CUDA-core backward.
 * Every kernel forms its scores through fc_score / fc_bwd_elem and tests the band through score.h (fc_row_keys,
 * fc_keeps, fc_band_cuts; the wgmma backward through fc_keeps_lr, fc_band_cuts_lr and fc_query_tiles, with the
 * window sides in registers), so a new mask is written in score.h alone.
 */
#ifndef FLASHC_CUDA_SCORE_CUH
#define FLASHC_CUDA_SCORE_CUH

#include "../dropout.h" /* the keep bit: Philox4x32-10, one definition for every backend */
#include "common.cuh"    /* fc_exp2, fc_tanh */
#include "score.h"

#include <math.h>
#include <stdint.h>

/* ---- fragments --------------------------------------------------------------------------------------------- */

/* Element k (2 hf + e) of n8 block j of a thread's accumulator fragment, in either layout. */
template <int N>
static __device__ __forceinline__ float &fc_frag(float (&x)[N][4], int j, int k) {
    return x[j][k];
}
template <int N>
static __device__ __forceinline__ float &fc_frag(float (&x)[N], int j, int k) {
    return x[4 * j + k];
}
/* n8 blocks of a fragment type: fc_frag_n<Frag>::value. */
template <typename Frag>
struct fc_frag_n;
template <int N>
struct fc_frag_n<float[N][4]> {
    static constexpr int value = N;
};
template <int N>
struct fc_frag_n<float[N]> {
    static constexpr int value = N / 4;
};

/* ---- scores ------------------------------------------------------------------------------------------------ */

/* exp2 and tanh of the tensor-core kernels (score.h's fc_score / fc_bwd_elem take them as Math): ex2.approx
 * (~2 ulp) and fc_tanh (absolute error ~1e-7), the errors the kernels' tests bound. */
struct fc_fast_math {
    static __device__ __forceinline__ float exp2(float x) { return fc_exp2(x); }
    static __device__ __forceinline__ float tanh(float x) { return fc_tanh(x); }
};

/* ---- masks per element ------------------------------------------------------------------------------------- */

/* The raw fast paths' mask: row hf of fragment x (keys n0 + 8 j + 2 tig + e) outside [jlo, jhi] to -inf. LEFT
 * false: the kernel takes no left edge (jlo is 0 and n0 >= 0), only the right end is tested. */
template <bool LEFT, typename Frag>
static __device__ __forceinline__ void fc_mask_row(Frag &x, int hf, int jlo, int jhi, int n0, int tig) {
    const int clo = jlo - n0 - tig * 2, chi = jhi - n0 - tig * 2; /* in units of 8 j + e */
#pragma unroll
    for (int j = 0; j < fc_frag_n<Frag>::value; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if ((LEFT && j * 8 + e < clo) || j * 8 + e > chi) fc_frag(x, j, 2 * hf + e) = -INFINITY;
}

/*
 * The raw fast paths' block mask on a tile it cuts: row hf of fragment x (keys n0 + 8 j + 2 tig + e, of row i of
 * the sequence, nq and nk its lengths) to -inf over each block the mask (bmbase: fc_bm_base) drops. Per block, not
 * per element: two divisions per row and one masked range per dropped block of the tile. Rows past nq (never
 * written) read the last row's bytes; keys past nk are the band's (fc_mask_row).
 */
template <typename Args, typename Frag>
static __device__ __forceinline__ void fc_bm_mask_row(const Args &a, Frag &x, int hf, const uint8_t *bmbase, int i,
                                                      int n0, int nq, int nk, int tig) {
    const uint8_t *row = fc_bm_row(a, bmbase, min(i, nq - 1));
    constexpr int BC = 8 * fc_frag_n<Frag>::value;
    const int kb1 = (min(n0 + BC, nk) - 1) / a.bm_k;
    for (int kb = n0 / a.bm_k; kb <= kb1; ++kb) {
        if (row[kb]) continue;
        const int clo = kb * a.bm_k - n0 - tig * 2, chi = clo + a.bm_k - 1; /* in units of 8 j + e */
#pragma unroll
        for (int j = 0; j < fc_frag_n<Frag>::value; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (j * 8 + e >= clo && j * 8 + e <= chi) fc_frag(x, j, 2 * hf + e) = -INFINITY;
    }
}

/* The score fields fc_score reads, with the softcap known at compile time where CAP says so (0: off, 1: on,
 * 2: as a has it, 3: on with its factor left to the caller, fc_score then giving tanh(s score_mul); 4: off, with
 * the scale left to the caller, fc_score then giving s): fc_score's test then folds, and no tanh is issued,
 * predicated off, where it is not used. */
template <int CAP>
struct fc_score_view {
    float score_mul, softcap2;
    template <typename Args>
    __device__ __forceinline__ explicit fc_score_view(const Args &a)
        : score_mul(CAP == 4 ? 1.f : a.score_mul), softcap2(CAP == 0 || CAP == 4 ? 0.f : CAP == 3 ? 1.f : a.softcap2) {}
};

/*
 * fc_score_row's element step with what it applies fixed at compile time: MASK (the band, the keys and, where
 * part, the block mask), CAP (fc_score_view) and ALIBI (0: off, 1: on, 2: where a.alibi is set).
 */
template <bool MASK, int CAP, int ALIBI, typename Args, typename Frag>
static __device__ __forceinline__ void fc_score_row_as(const Args &a, Frag &x, int hf, int i, int n0, int tig,
                                                       int diag, int nq, int nk, float slope2, bool part,
                                                       const uint8_t *bmbase) {
    int jlo = 0, jhi = 0;
    if (MASK) fc_row_keys(a, i, diag, nk, jlo, jhi);
    const uint8_t *bmr = MASK && part && i < nq ? fc_bm_row(a, bmbase, i) : NULL;
    const fc_score_view<CAP> sv(a);
    const bool alibi = ALIBI == 1 || (ALIBI == 2 && a.alibi);
    /* i + diag - j at j = 0, e = 0, once per row in float: the element's distance is then that minus a constant
     * (8 nt + e), with no int-to-float conversion per element (conversions share the special-function units'
     * quarter rate with ex2 on sm_90; integers below 2^24 are exact either way). */
    const float jdf = (float)(i + diag - n0 - tig * 2);
#pragma unroll
    for (int nt = 0; nt < fc_frag_n<Frag>::value; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int j = n0 + nt * 8 + tig * 2 + e;
            float dcap;
            float v = fc_score<fc_fast_math>(sv, fc_frag(x, nt, 2 * hf + e), dcap);
            if (alibi) v -= fc_alibi(slope2, jdf - (float)(nt * 8 + e));
            if (MASK) {
                bool vis = j >= jlo && j <= jhi;
                if (part) vis = vis && bmr && fc_bm_keeps(a, bmr, j);
                if (!vis) v = -INFINITY;
            }
            fc_frag(x, nt, 2 * hf + e) = v;
        }
}

/*
 * The forward's element step on row hf of fragment x (keys n0 + 8 j + 2 tig + e) of query row i, for the kernels'
 * generic path (a score modifier, or a block mask that cuts the tile): the base-2 score (fc_score), minus ALiBi
 * (slope2: fc_alibi_slope2), and, where mask, -inf outside row i's band and the keys (fc_row_keys) or, where the
 * block mask cuts the tile (part), where the block mask (bmbase: fc_bm_base) drops the key. Returns the factor
 * the softmax takes the scores with (its smul): 1, or softcap2 where the softcap alone is left to it, or score_mul
 * where ALiBi alone leaves the scale to it. shift (optional): a constant of this thread's part of the row that the
 * softmax adds to its scores (fc_softmax_row), 0 unless ALiBi alone leaves one to it; without shift it never does.
 * A tile that no mask cuts (most of a row's tiles) branches once on the modifiers: tested per element, they were
 * predicated, and every element issued the tanh, the bias and the band test whether it used them or not (twice
 * the plain kernel's instructions under ALiBi alone, lab/LOG.md).
 */
template <typename Args, typename Frag>
static __device__ __forceinline__ float fc_score_row(const Args &a, Frag &x, int hf, int i, int n0, int tig, int diag,
                                                     int nq, int nk, float slope2, bool mask, bool part,
                                                     const uint8_t *bmbase, float *shift = NULL) {
    if (shift) *shift = 0.f;
    if (mask) {
        fc_score_row_as<true, 2, 2>(a, x, hf, i, n0, tig, diag, nq, nk, slope2, part, bmbase);
    } else if (a.softcap2 != 0.f && !a.alibi) {
        /* softcap alone: x = tanh(s score_mul), its factor softcap2 (> 0: the front refuses a negative softcap)
         * folded into the softmax's exponent like the raw path's scale (max(c x) = c max(x) for c > 0) */
        fc_score_row_as<false, 3, 0>(a, x, hf, i, n0, tig, diag, nq, nk, slope2, part, bmbase);
        return a.softcap2;
    } else if (a.softcap2 != 0.f) {
        fc_score_row_as<false, 1, 1>(a, x, hf, i, n0, tig, diag, nq, nk, slope2, part, bmbase);
    } else if (a.alibi && a.score_mul > 0.f) {
        /* ALiBi alone: x = s - k |distance| with k = slope2 / score_mul, the scale folded into the softmax's exponent
         * as on the raw path. Where every key of the thread's part of the row lies on one side of the row's diagonal
         * (d0 - c >= 0 for all, or <= 0; c = 8 nt + e, d0 the distance at c = 0), -k |d0 - c| = -+k d0 +- k c: x
         * takes +-k c (one FFMA with an immediate per element) and the thread's constant -+k d0 goes to *shift,
         * which the softmax adds once per row (fc_softmax_row). */
        const float k = __fdividef(slope2, a.score_mul);
        constexpr int CMAX = 8 * fc_frag_n<Frag>::value - 7; /* the largest c */
        const int d0 = i + diag - n0 - tig * 2;
        if (shift && (d0 >= CMAX || d0 <= 0)) {
            const float kc = d0 > 0 ? k : -k;
#pragma unroll
            for (int nt = 0; nt < fc_frag_n<Frag>::value; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    fc_frag(x, nt, 2 * hf + e) = fmaf(kc, (float)(nt * 8 + e), fc_frag(x, nt, 2 * hf + e));
            *shift = -kc * (float)d0;
        } else {
            fc_score_row_as<false, 4, 1>(a, x, hf, i, n0, tig, diag, nq, nk, k, part, bmbase);
        }
        return a.score_mul;
    } else if (a.alibi) {
        fc_score_row_as<false, 0, 1>(a, x, hf, i, n0, tig, diag, nq, nk, slope2, part, bmbase);
    } else {
        fc_score_row_as<false, 0, 0>(a, x, hf, i, n0, tig, diag, nq, nk, slope2, part, bmbase);
    }
    return 1.f;
}

/* ---- the forward's online softmax -------------------------------------------------------------------------- */

/*
 * One row (hf) of fragment x in base 2, FlashAttention-2's online softmax: the row max m moves (scores x smul:
 * smul is score_mul on the raw path, where max(c s) = c max(s) for c > 0, else 1), x becomes P = 2^(x smul - m),
 * the row sum l is rescaled by the returned alpha = 2^(m_old - m_new) and gains P's sum. The four lanes of a quad
 * share a row; l stays thread-partial until the end. A row that has seen no key keeps m = -inf and takes
 * exponents against 0, so that no inf - inf appears. PAIRS: P's sum taken in pairs of a block (mma.sync kernel)
 * or element by element (wgmma kernel) - the two orders each kernel was measured and tested with. shift: this
 * thread's scores are x + shift (fc_score_row's, finite), added to its max before the quad's and folded into the
 * exponent's constant.
 */
template <bool PAIRS, bool SHIFT, typename Frag>
static __device__ __forceinline__ float fc_softmax_row_as(Frag &x, int hf, float &row_m, float &row_l, float smul,
                                                          float shift) {
    constexpr int NB = fc_frag_n<Frag>::value;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NB; ++j) mx = fmaxf(mx, fmaxf(fc_frag(x, j, 2 * hf), fc_frag(x, j, 2 * hf + 1)));
    if (SHIFT) mx += shift;
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_m, mx * smul);
    const float mu = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = fc_exp2(row_m - mu);
    row_m = m_new;
    const float off = SHIFT ? fmaf(shift, smul, -mu) : -mu;
    float rs = 0.f;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        float &x0 = fc_frag(x, j, 2 * hf), &x1 = fc_frag(x, j, 2 * hf + 1);
        if (PAIRS) {
            x0 = fc_exp2(fmaf(x0, smul, off));
            x1 = fc_exp2(fmaf(x1, smul, off));
            rs += x0 + x1;
        } else {
            x0 = fc_exp2(fmaf(x0, smul, off));
            rs += x0;
            x1 = fc_exp2(fmaf(x1, smul, off));
            rs += x1;
        }
    }
    row_l = row_l * alpha + rs;
    return alpha;
}
template <bool PAIRS, typename Frag>
static __device__ __forceinline__ float fc_softmax_row(Frag &x, int hf, float &row_m, float &row_l, float smul) {
    return fc_softmax_row_as<PAIRS, false>(x, hf, row_m, row_l, smul, 0.f);
}
template <bool PAIRS, typename Frag>
static __device__ __forceinline__ float fc_softmax_row(Frag &x, int hf, float &row_m, float &row_l, float smul,
                                                       float shift) {
    return fc_softmax_row_as<PAIRS, true>(x, hf, row_m, row_l, smul, shift);
}

/* ---- dropout ------------------------------------------------------------------------------------------------ */

/*
 * The keep bits of src/dropout.h on accumulator fragments. One Philox call gives a row's four columns 4 j4 .. 4 j4 + 3
 * (a nibble, bit k for column 4 j4 + k), so each lane computes exactly one nibble per n8 block it holds and the lanes
 * that hold the other parts of those nibbles trade them by shuffles: no Philox output is computed twice or wasted.
 * The result is a bit set over the fragment: bit 4 (j % 8) + k of word j / 8 keeps element k (2 hf + e) of n8 block
 * j (fc_frag's numbering), 1 where the element is kept.
 */

/* A (sequence b, query head h) stream's Philox key and counter words, the threshold, and where the sequence's row 0
 * and key group 0 sit in dropout's (i, j / 4) (positions; else 0). Every lane of the block reads the same pair, so the
 * loads from drop_rng are uniform. Every word goes through a shuffle from lane 0 (the callers' warps are converged):
 * the compiler then knows it is the same in every lane and keeps the ten round keys in uniform registers; from a
 * load of drop_rng it kept them in vector registers and added each round's key increment again, about 1.3
 * instructions per round and chain (SASS of the Hopper forward's DROP kernel, d 128: VIADD 0.67 per Philox multiply). */
struct fc_drop_stream {
    uint32_t k0, k1, s0, s1, t, i0, j40;
};
template <typename Args>
static __device__ __forceinline__ fc_drop_stream fc_drop_begin(const Args &a, int b, int h) {
    uint64_t seed = a.drop_seed, offset = a.drop_offset;
    if (a.drop_rng) {
        seed = __ldg((const unsigned long long *)a.drop_rng);
        offset = __ldg((const unsigned long long *)a.drop_rng + 1);
    }
    const uint64_t st = flashc_dropout_stream(offset, b, a.H, h);
    const auto lane0 = [](uint32_t v) { return __shfl_sync(0xffffffffu, v, 0); };
    return {lane0((uint32_t)seed), lane0((uint32_t)(seed >> 32)), lane0((uint32_t)st), lane0((uint32_t)(st >> 32)),
            lane0(a.drop_t), lane0(a.drop_row0), lane0(a.drop_col4)};
}

/* The keep nibble of the sequence's row i, columns 4 j4 .. 4 j4 + 3 (dropout's row d.i0 + i, group d.j40 + j4). */
static __device__ __forceinline__ uint32_t fc_drop_nibble(const fc_drop_stream &d, uint32_t i, uint32_t j4) {
    const flashc_u32x4 x = flashc_philox4x32_10(d.j40 + j4, d.i0 + i, d.s0, d.s1, d.k0, d.k1);
    return (uint32_t)(x.x[0] >= d.t) | (uint32_t)(x.x[1] >= d.t) << 1 | (uint32_t)(x.x[2] >= d.t) << 2 |
           (uint32_t)(x.x[3] >= d.t) << 3;
}

/*
 * Rows are queries: NB n8 blocks whose rows are query rows i0 + g + 8 hf and columns keys n0 + 8 j + 2 tig + e
 * (n0 % 8 == 0): the forward's S and the dQ kernel's. Lanes tig and tig ^ 1 hold the same four columns of rows g and
 * g + 8: the even lane computes row g's nibble, the odd one row g + 8's, and they swap (one shuffle per 8 blocks).
 */
template <int NB>
static __device__ __forceinline__ void fc_drop_bits_rows(const fc_drop_stream &d, int i0, int n0, int lane,
                                                         uint32_t (&bits)[(NB + 7) / 8]) {
    const int g = lane >> 2, tig = lane & 3, odd = tig & 1;
    const uint32_t i = (uint32_t)(i0 + g + 8 * odd), j4 = (uint32_t)(n0 / 4 + (tig >> 1));
#pragma unroll
    for (int w = 0; w < (NB + 7) / 8; ++w) {
        uint32_t own = 0;
#pragma unroll
        for (int j = 8 * w; j < NB && j < 8 * w + 8; ++j) own |= fc_drop_nibble(d, i, j4 + 2 * j) << (4 * (j - 8 * w));
        const uint32_t other = __shfl_xor_sync(0xffffffffu, own, 1);
        /* this lane's two columns of each nibble, then row hf = odd from its own, the other row from the partner */
        const uint32_t mine = (own >> (2 * odd)) & 0x33333333u, theirs = (other >> (2 * odd)) & 0x33333333u;
        bits[w] = odd ? theirs | mine << 2 : mine | theirs << 2;
    }
}

/*
 * Rows are keys (the dK/dV kernel's S^T): NB n8 blocks whose rows are keys jb + g + 8 hf (jb % 16 == 0) and columns
 * query rows c0 + 8 j + 2 tig + e. A nibble (one query row, four keys) then spans the lanes g = 4 q .. 4 q + 3 of one
 * tig, which together hold 2 query rows x 2 key groups: lane r = g % 4 computes query row 2 tig + (r & 1) of key group
 * (r >> 1) and two butterfly shuffles give every lane all four nibbles (two blocks per 32-bit exchange).
 */
template <int NB>
static __device__ __forceinline__ void fc_drop_bits_cols(const fc_drop_stream &d, int jb, int c0, int lane,
                                                         uint32_t (&bits)[(NB + 7) / 8]) {
    const int g = lane >> 2, tig = lane & 3, r = g & 3;
    const uint32_t j4 = (uint32_t)((jb + (g & ~3) + 8 * (r >> 1)) / 4), i = (uint32_t)(c0 + 2 * tig + (r & 1));
#pragma unroll
    for (int w = 0; w < (NB + 7) / 8; ++w) bits[w] = 0;
#pragma unroll
    for (int j = 0; j < NB; j += 2) {
        uint32_t v = fc_drop_nibble(d, i + 8 * j, j4) << (4 * r);
        if (j + 1 < NB) v |= fc_drop_nibble(d, i + 8 * (j + 1), j4) << (16 + 4 * r);
        v |= __shfl_xor_sync(0xffffffffu, v, 4);
        v |= __shfl_xor_sync(0xffffffffu, v, 8);
#pragma unroll
        for (int half = 0; half < 2 && j + half < NB; ++half)
#pragma unroll
            for (int k = 0; k < 4; ++k) /* element k = 2 hf + e: lane (e + 2 hf)'s nibble, key offset r */
                bits[(j + half) / 8] |= ((v >> (16 * half + 4 * k + r)) & 1u) << (4 * ((j + half) % 8) + k);
    }
}

/* Element k of n8 block j of x: times z where the bit set keeps it, else 0. */
template <typename Frag, int NW>
static __device__ __forceinline__ void fc_drop_apply(Frag &x, const uint32_t (&bits)[NW], float z) {
#pragma unroll
    for (int j = 0; j < fc_frag_n<Frag>::value; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float &v = fc_frag(x, j, k);
            v = (bits[j / 8] >> (4 * (j % 8) + k)) & 1u ? v * z : 0.f;
        }
}

/* ---- tiles under the block mask ---------------------------------------------------------------------------- */

/*
 * Whether the block mask (base: fc_bm_base) lets any of rows [i0, i1] see any of keys [j0, j1], and *partial:
 * whether some of its bytes over that rectangle are 0 (then the tile is masked element by element). Every thread
 * of the block calls it (the votes are barriers); the answer is uniform.
 */
template <int NT, typename Args>
static __device__ int fc_mask_vote(const Args &a, const uint8_t *base, int i0, int i1, int j0, int j1, int tid,
                                   int *partial) {
    int on = 0, off = 0;
    fc_bm_scan(a, base, i0, i1, j0, j1, tid, NT, &on, &off);
    on = __syncthreads_or(on);
    *partial = __syncthreads_or(off);
    return on;
}

/*
 * The next key tile >= cand (and < te) of bc keys that the block mask bmrow does not rule out entirely for rows
 * [i0, i1], and whether the mask cuts it (*partial). Without a mask (bmrow NULL) every tile of the band's range
 * (fc_key_tiles) is visited. The whole block takes part (the votes are barriers), so the answer is uniform.
 */
template <int BC, int NT, typename Args>
static __device__ int fc_next_key_tile(const Args &a, const uint8_t *bmrow, int cand, int te, int i0, int i1, int nk,
                                       int tid, int *partial) {
    *partial = 0;
    if (!bmrow) return cand;
    for (; cand < te; ++cand) {
        int off;
        const int n0 = cand * BC, nlast = min(n0 + BC, nk) - 1;
        if (fc_mask_vote<NT>(a, bmrow, i0, i1, n0, nlast, tid, &off)) {
            *partial = off;
            return cand;
        }
    }
    return te;
}

#endif /* FLASHC_CUDA_SCORE_CUH */
