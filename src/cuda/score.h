/*
 * score.h - the score and mask step of every CUDA kernel, the part that host code can compile too: the score and
 * mask fields of the kernel arguments (one list), the score of an element (scale, softcap, ALiBi), which keys a
 * row keeps (the causal / sliding-window band, the end of the keys, the block mask), which key tiles a query tile
 * visits and which query rows a key tile meets, and whether the band cuts a tile. Plain C++ with no CUDA types:
 * the host (launch.h), the CUDA-core backward (bwd_simt.cu, also compiled for the CPU by tests/emu_bwd_simt.cc)
 * and the tensor-core kernels (through score.cuh, which adds the fragment layouts, fast exp2 / tanh, the online
 * softmax and the block-mask votes) include it. Not installed.
 *
 * Adding a score modifier or a mask: a field in FC_SCORE_FIELDS, its value in fc_set_scores_and_masks (launch.h),
 * the formula in fc_score (and fc_score_plain, so that the raw fast paths step aside) or the test in fc_row_keys,
 * fc_keeps / fc_keeps_lr and fc_band_cuts / fc_band_cuts_lr (and the tile ranges where it moves the band's reach);
 * every kernel calls these.
 *
 * Every kernel forms its scores in base 2 (s log2 e, exponentials by exp2) and returns the lse in natural log:
 * the one place these two constants are spelled out.
 */
#ifndef FLASHC_CUDA_SCORE_H
#define FLASHC_CUDA_SCORE_H

#define FC_LOG2E 1.4426950408889634f /* log2(e): natural-log scores to base 2 */
#define FC_LN2 0.6931471805599453f   /* ln(2): a base-2 lse back to natural log */

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define FC_HD static __host__ __device__ __forceinline__
#else
#define FC_HD static inline
#endif

/* max and min of two integers: CUDA's (one instruction, and what lets the compiler know a clamped value's sign)
 * in device code, plain comparisons on the host. */
template <typename I>
FC_HD I fc_imax(I x, I y) {
#ifdef __CUDA_ARCH__
    return max(x, y);
#else
    return x > y ? x : y;
#endif
}
template <typename I>
FC_HD I fc_imin(I x, I y) {
#ifdef __CUDA_ARCH__
    return min(x, y);
#else
    return x < y ? x : y;
#endif
}

/*
 * The score and mask fields of the kernel arguments (flashc_fwd_args, flashc_bwd_args, the CUDA-core backward's
 * fc_bwd_args), in this order; fc_set_scores_and_masks (launch.h) fills them from the problem:
 *   score_mul   the raw product's factor in base 2: scale log2(e), or scale / softcap before the tanh
 *   softcap2    softcap log2(e); 0: no softcap
 *   win_left, win_right   the band: row i keeps keys [i + diag - win_left, i + diag + win_right], -1: unbounded
 *               side (causal is win_right 0), diag of the sequence from fc_diag
 *   positions, pos_diag   positions (flashc_params 0.6) on: every sequence's diag is pos_diag (q_position -
 *               k_position, |pos_diag| <= 2^29: cuda.cu refuses more); 0: diag = nk - nq (bottom-right aligned)
 *   alibi, alibi_bs       ALiBi slopes (natural log) of (sequence, head), NULL: none
 *   bm ...      the block mask: bm_nqb x bm_nkb bytes per (sequence, head) of bm_q x bm_k blocks, NULL: none
 */
#define FC_SCORE_FIELDS                                                                                      \
    float score_mul;                                                                                         \
    float softcap2;                                                                                          \
    int win_left, win_right;                                                                                 \
    int positions, pos_diag;                                                                                 \
    const float *alibi;                                                                                      \
    int64_t alibi_bs;                                                                                        \
    const uint8_t *bm;                                                                                       \
    int bm_q, bm_k, bm_batch, bm_heads, bm_nqb, bm_nkb

/*
 * Dropout (src/dropout.h's keep bit), the fields every kernel argument struct appends last (so that the fields
 * before keep their offsets in the parameter space of the kernels that take no dropout): dropout 0 or 1, the 32-bit
 * threshold (dropped iff the Philox word < drop_t), the kept values' factor 1 / (1 - p), the (seed, offset) pair:
 * by value, or read from device memory by the kernel when drop_rng is set, and where a sequence's row 0 and key group
 * 0 sit in dropout's (i, j / 4): the positions q_position and k_position / 4 (flashc_params 0.6; the front keeps them
 * within 32 bits and k_position a multiple of 4), else 0. fc_set_dropout (launch.h) fills them; the tensor-core
 * kernels take their keep bits from score.cuh's fc_drop_* functions.
 */
#define FC_DROP_FIELDS                                                                                       \
    int dropout;                                                                                             \
    uint32_t drop_t;                                                                                         \
    float drop_scale;                                                                                        \
    uint64_t drop_seed, drop_offset;                                                                         \
    const uint64_t *drop_rng;                                                                                \
    uint32_t drop_row0, drop_col4

/* exp2 and tanh as a kernel wants them: fc_exact_math (exp2f, tanhf: fp32's own accuracy) in the CUDA-core
 * backward and on the host; score.cuh's fc_fast_math (ex2.approx and a short tanh) in the tensor-core kernels. */
struct fc_exact_math {
    FC_HD float exp2(float x) { return exp2f(x); }
    FC_HD float tanh(float x) { return tanhf(x); }
};

/* ---- scores ------------------------------------------------------------------------------------------------ */

/* Whether a problem's scores are the plain scaled dot products (no softcap, no ALiBi): the kernels' raw fast
 * paths then fold score_mul into the exponent's FFMA and only mask. A score modifier that needs the element
 * formula turns this off. */
template <typename Args>
FC_HD bool fc_score_plain(const Args &a) {
    return a.softcap2 == 0.f && !a.alibi;
}

/* The base-2 score of the raw product s (q k): s score_mul, or softcap2 tanh(s score_mul) under softcap, with
 * dcap the softcap's derivative d(c tanh(x / c)) / dx (1 without softcap) for the backward's dS. ALiBi is
 * subtracted by the caller (fc_alibi), which knows the row's distances. */
template <typename Math, typename Args>
FC_HD float fc_score(const Args &a, float s, float &dcap) {
    float x = s * a.score_mul;
    dcap = 1.f;
    if (a.softcap2 != 0.f) {
        const float cap = a.softcap2; /* read before the tanh, as the kernels did */
        const float th = Math::tanh(x);
        x = cap * th;
        dcap = 1.f - th * th;
    }
    return x;
}

/* ALiBi's slope of (sequence b, head h) in base 2 (0 without ALiBi), and its bias slope2 |dist| for the element
 * at distance dist = i + diag - j from row i's diagonal. */
template <typename Args, typename I>
FC_HD float fc_alibi_slope2(const Args &a, I b, I h) {
    return a.alibi ? a.alibi[(int64_t)b * a.alibi_bs + h] * FC_LOG2E : 0.f;
}
template <typename I>
FC_HD float fc_alibi(float slope2, I dist) {
    return slope2 * fabsf((float)dist);
}

/* The backward's probability of the raw product s (q k): P = 2^(x - alibi - lse2), x the forward's base-2 score
 * (fc_score), and dcap the softcap's derivative there. vis false: P = 0. */
template <typename Math, typename Args>
FC_HD float fc_bwd_prob(const Args &a, float s, float lse2, float alibi, bool vis, float &dcap) {
    const float x = fc_score<Math>(a, s, dcap);
    return vis ? Math::exp2(x - alibi - lse2) : 0.f;
}

/* The backward's element (in place): s (raw q k) becomes P (fc_bwd_prob), and dp becomes dS = P (dP - D_i) (times
 * the softcap's derivative). vis false: P = dS = 0. */
template <typename Math, typename Args>
FC_HD void fc_bwd_elem(const Args &a, float &s, float &dp, float lse2, float dvec, float alibi, bool vis) {
    float dcap;
    const float p = fc_bwd_prob<Math>(a, s, lse2, alibi, vis, dcap);
    s = p;
    dp = p * (dp - dvec) * dcap;
}

/* Attention sinks: the end of a row's softmax, m2 the max of its base-2 scores and l the sum of 2^(x - m2) (0: the
 * row saw no key), with the sink's logit (natural log) one more term of the denominator. Returns the factor the
 * row's unnormalized output takes (in place of 1 / l) and sets its natural-log lse (the sink when l is 0). The
 * kernels call it where a.sinks is set; internal.h's flashc_sink_fold is the CPU's twin. */
FC_HD float fc_sink_fold(float sink, float m2, float l, float &lse) {
    if (l == 0.f) {
        lse = sink;
        return 0.f;
    }
    const float s2 = sink * FC_LOG2E, mx = fmaxf(m2, s2);
    const float em = exp2f(m2 - mx), lt = l * em + exp2f(s2 - mx);
    lse = mx * FC_LN2 + logf(lt);
    return em / lt;
}

/* ---- masks ------------------------------------------------------------------------------------------------- */

/* The keys sequence b uses of its nk: the first seqused_k[b] (clamped to [0, nk]: the values are device memory,
 * which the host does not check) when the caller set them, else all. Every kernel takes its sequence's nk through
 * this, so that keys past it are masked like keys past the end (and never reach a result). Args: any kernel
 * argument struct with a seqused_k member. */
template <typename Args, typename I>
FC_HD I fc_used_keys(const Args &a, I b, I nk) {
    return a.seqused_k ? fc_imin(nk, fc_imax((I)a.seqused_k[b], (I)0)) : nk;
}

/* The alignment of a sequence of nq queries and nk keys (nk after fc_used_keys): row i's diagonal key is i + diag,
 * where the band is centred and from which ALiBi measures its distances. With positions a.pos_diag (q_position -
 * k_position, the same for every sequence, not moved by seqused_k), else nk - nq (bottom-right aligned). Every
 * kernel takes its diag from here. */
template <typename Args, typename I>
FC_HD I fc_diag(const Args &a, I nq, I nk) {
    return a.positions ? (I)a.pos_diag : nk - nq;
}

/*
 * The band's tests with the sides wl = a.win_left, wr = a.win_right (-1: unbounded) passed apart, for a kernel that
 * holds them in registers (the wgmma backward: read again from the arguments there, its code grows); the rest of a
 * mask's fields are read from a. fc_keeps and fc_band_cuts below are the same tests on the argument struct alone,
 * written out again because the kernels that call them compile to other code through these: keep each pair alike
 * (tests/test_score.cc checks both forms against the definition).
 *   fc_keeps_lr       whether row i keeps key j (and j < nk)
 *   fc_band_cuts_lr   whether the band or the end of the keys cuts the tile of rows [i0, i1] x keys [j0, j1]
 *   fc_query_tiles    query tiles [*lo, *hi] of bm rows (of nq) that the keys [j0, j1] of a key tile reach under the
 *                     band, and their number (0: none); the tile form of fc_query_rows, for kernels that walk
 *                     query tiles: it never misses a tile with a visible element, and may name one tile whose rows
 *                     see none (its elements then fail fc_keeps_lr, and fc_band_cuts_lr says the tile is cut)
 */
template <typename Args, typename I>
FC_HD bool fc_keeps_lr(const Args &a, int wl, int wr, I i, I j, I diag, I nk) {
    (void)a;
    return j < nk && (wl < 0 || j >= i + diag - wl) && (wr < 0 || j <= i + diag + wr);
}
template <bool LEFT = true, typename Args, typename I>
FC_HD bool fc_band_cuts_lr(const Args &a, int wl, int wr, I i0, I i1, I j0, I j1, I diag, I nk) {
    (void)a;
    return j1 >= nk || (LEFT && wl >= 0 && j0 < i1 + diag - wl) || (wr >= 0 && j1 > i0 + diag + wr);
}
template <typename Args>
FC_HD int fc_query_tiles(const Args &a, int wl, int wr, int j0, int j1, int diag, int nq, int bm, int *lo, int *hi) {
    (void)a;
    *lo = 0;
    if (wr >= 0) {
        const int first = j0 - diag - wr; /* the first row that sees key j0 */
        *lo = first > 0 ? first / bm : 0;
    }
    *hi = (nq - 1) / bm; /* up to the tile of the last row whose left edge reaches key j1 */
    if (wl >= 0) *hi = fc_imin(*hi, (j1 - diag + wl) / bm);
    return *hi >= *lo && (wl < 0 || j1 - diag + wl >= 0) ? *hi - *lo + 1 : 0;
}

/* Keys [jlo, jhi] that row i keeps among the sequence's nk: the band's, row i's diagonal key being i + diag
 * (fc_diag), each side -1 for unbounded. Computed once per row. LEFT false: the
 * kernel takes no left window. */
template <bool LEFT = true, typename Args, typename I>
FC_HD void fc_row_keys(const Args &a, I i, I diag, I nk, I &jlo, I &jhi) {
    jlo = 0, jhi = nk - 1;
    if (LEFT && a.win_left >= 0) jlo = fc_imax(jlo, i + diag - a.win_left);
    if (a.win_right >= 0) jhi = fc_imin(jhi, i + diag + a.win_right);
}

/* Whether row i keeps key j: the range of fc_row_keys (keep the two alike), written as comparisons for the kernels
 * that test element by element (through fc_row_keys the mma.sync backward spilled); the block mask, fc_bm_keeps,
 * is tested apart, on the tiles it cuts. */
template <typename Args, typename I>
FC_HD bool fc_keeps(const Args &a, I i, I j, I diag, I nk) {
    return j < nk && (a.win_left < 0 || j >= i + diag - a.win_left) && (a.win_right < 0 || j <= i + diag + a.win_right);
}

/* Whether the band or the end of the keys cuts the tile of rows [i0, i1] and keys [j0, j1] (the tile's own
 * extent; rows past the end of the queries are the caller's): then some of its elements are masked and the
 * kernel tests them one by one (fc_keeps); otherwise it keeps them all. LEFT false: the kernel takes no left
 * window. */
template <bool LEFT = true, typename Args, typename I>
FC_HD bool fc_band_cuts(const Args &a, I i0, I i1, I j0, I j1, I diag, I nk) {
    return j1 >= nk || (LEFT && a.win_left >= 0 && j0 < i1 + diag - a.win_left) ||
           (a.win_right >= 0 && j1 > i0 + diag + a.win_right);
}

/* Query rows [*lo, *hi] of nq that see some key of [j0, j1] under the band, the reverse of fc_key_tiles for the
 * backward's key tiles (none: *lo > *hi). */
template <typename Args, typename I>
FC_HD void fc_query_rows(const Args &a, I j0, I j1, I diag, I nq, I *lo, I *hi) {
    *lo = 0, *hi = nq - 1;
    if (a.win_right >= 0) *lo = fc_imax(*lo, j0 - diag - a.win_right);
    if (a.win_left >= 0) *hi = fc_imin(*hi, j1 - diag + a.win_left);
}

/*
 * Key tiles [*tb, *te) of bc keys that query rows [i0, i1] of a sequence of nk keys visit under the band of a
 * (win_left, win_right; -1: unbounded side): row i keeps keys [i + diag - win_left, i + diag + win_right], diag
 * of the sequence from fc_diag. Those intervals move by one key per row, so the rows' union is [i0 + diag - win_left,
 * i1 + diag + win_right]. No key (a band that misses the keys, or nk 0): tb == te == 0. I: int, or int64_t for
 * the CUDA-core kernel. LEFT false: a kernel that takes no left window does not test its edge.
 * The fields are read where they are used, as the kernels did before they shared this: the same code.
 */
template <bool LEFT = true, typename Args, typename I>
FC_HD void fc_key_tiles(const Args &a, I i0, I i1, I diag, I nk, I bc, I *tb, I *te) {
    I lo = 0, hi = nk;
    if (LEFT && a.win_left >= 0) lo = fc_imax(lo, i0 + diag - a.win_left);
    if (a.win_right >= 0) hi = fc_imin(hi, i1 + diag + a.win_right + 1);
    *tb = 0, *te = 0;
    if (lo < hi) {
        *tb = lo / bc;
        *te = (hi + bc - 1) / bc;
    }
}

/* The block-mask bytes of (sequence b, head h): bm_nqb rows of bm_nkb, one per bm_q x bm_k block. Args: any
 * kernel argument struct with the bm fields (flashc_fwd_args, flashc_bwd_args). */
template <typename Args, typename I>
FC_HD const uint8_t *fc_bm_base(const Args &a, I b, I h) {
    const I mb = a.bm_batch == 1 ? 0 : b, mh = a.bm_heads == 1 ? 0 : h;
    return a.bm + ((int64_t)mb * a.bm_heads + mh) * a.bm_nqb * a.bm_nkb;
}
/* Query row i's row of those bytes, and whether it keeps key j. */
template <typename Args, typename I>
FC_HD const uint8_t *fc_bm_row(const Args &a, const uint8_t *base, I i) {
    return base + (int64_t)(i / a.bm_q) * a.bm_nkb;
}
template <typename Args, typename I>
FC_HD bool fc_bm_keeps(const Args &a, const uint8_t *row, I j) {
    return row[j / a.bm_k] != 0;
}

/* This thread's share (elements tid, tid + nt, ...) of the block-mask bytes over rows [i0, i1] x keys [j0, j1]:
 * *on |= some byte is non-zero, *off |= some byte is zero. The kernel reduces the two over its block (score.cuh's
 * fc_mask_vote; the CUDA-core backward's own barrier). */
template <typename Args, typename I>
FC_HD void fc_bm_scan(const Args &a, const uint8_t *base, I i0, I i1, I j0, I j1, int tid, int nt, int *on,
                      int *off) {
    const I qb0 = i0 / a.bm_q, kb0 = j0 / a.bm_k;
    const I nqb = i1 / a.bm_q - qb0 + 1, nkb = j1 / a.bm_k - kb0 + 1;
    for (I e = tid; e < nqb * nkb; e += nt) {
        const uint8_t v = base[(int64_t)(qb0 + e / nkb) * a.bm_nkb + kb0 + e % nkb];
        *on |= v != 0;
        *off |= v == 0;
    }
}

/* ---- the block mask by tiles ------------------------------------------------------------------------------ */

/*
 * A kernel that walks the block mask by its own tiles (br query rows x bc keys) reads it as bitmaps built once per
 * call (bm_tiles.cu, before the kernel): per (mask sequence, mask head, query tile) a row of 2 w 32-bit words,
 * w = fc_bm_tile_words: bit kt of the first w says that the mask keeps some element of key tile kt for some row of
 * the query tile (the tile is visited), bit kt of the next w that it also drops some (the tile is cut: masked element
 * by element). Tiles the mask drops entirely are never loaded; the band's range (fc_key_tiles) still bounds the walk.
 */
FC_HD int fc_bm_tile_words(int nk, int bc) { return ((nk + bc - 1) / bc + 31) / 32; }

/* The bitmap row of query tile qt (of nqt per sequence and head) of (sequence b, head h). Args: a kernel argument
 * struct with the bm fields and bm_tiles, bm_tiles_w (flashc_fwd_args). */
template <typename Args, typename I>
FC_HD const uint32_t *fc_bm_tile_bits(const Args &a, I b, I h, I qt, I nqt) {
    const I mb = a.bm_batch == 1 ? 0 : b, mh = a.bm_heads == 1 ? 0 : h;
    return a.bm_tiles + (((int64_t)mb * a.bm_heads + mh) * nqt + qt) * 2 * a.bm_tiles_w;
}

FC_HD int fc_popc(uint32_t x) {
#ifdef __CUDA_ARCH__
    return __popc(x);
#else
    return __builtin_popcount(x);
#endif
}
/* Set bits of words in [lo, hi), and the first set bit at or after lo (one must exist: the caller counted). */
FC_HD int fc_bits_count(const uint32_t *words, int lo, int hi) {
    int n = 0;
    for (int w = lo >> 5; w << 5 < hi; ++w) {
        uint32_t x = words[w];
        if (w << 5 < lo) x &= ~0u << (lo & 31);
        if ((w << 5) + 32 > hi) x &= ~0u >> (32 - (hi & 31)); /* hi & 31 != 0 here */
        n += fc_popc(x);
    }
    return n;
}
FC_HD int fc_bits_next(const uint32_t *words, int lo) {
    int w = lo >> 5;
    uint32_t x = words[w] & (~0u << (lo & 31));
    while (!x) x = words[++w];
#ifdef __CUDA_ARCH__
    return (w << 5) + __ffs(x) - 1;
#else
    return (w << 5) + __builtin_ctz(x);
#endif
}
FC_HD bool fc_bit(const uint32_t *words, int i) { return (words[i >> 5] >> (i & 31)) & 1u; }
/* The first set bit in [lo, hi), or hi when there is none. */
FC_HD int fc_bits_find(const uint32_t *words, int lo, int hi) {
    for (int w = lo >> 5; w << 5 < hi; ++w) {
        uint32_t x = words[w];
        if (w << 5 < lo) x &= ~0u << (lo & 31);
        if (x) {
#ifdef __CUDA_ARCH__
            const int i = (w << 5) + __ffs(x) - 1;
#else
            const int i = (w << 5) + __builtin_ctz(x);
#endif
            return i < hi ? i : hi;
        }
    }
    return hi;
}

#endif /* FLASHC_CUDA_SCORE_H */
