/*
 * score.h - the constants of the base-2 scores, the key tiles a query tile visits under the causal / sliding-window
 * band, and the block-mask bytes of a row. Plain C++ with no CUDA types, so that host code (launch.h) and the CPU
 * emulation of the CUDA-core backward (tests/emu_bwd_simt.cc) can include it; the per-element score and mask
 * step is score.cuh. Not installed.
 *
 * Every kernel forms its scores in base 2 (s log2 e, exponentials by exp2) and returns the lse in natural log:
 * the one place these two constants are spelled out.
 */
#ifndef FLASHC_CUDA_SCORE_H
#define FLASHC_CUDA_SCORE_H

#define FC_LOG2E 1.4426950408889634f /* log2(e): natural-log scores to base 2 */
#define FC_LN2 0.6931471805599453f   /* ln(2): a base-2 lse back to natural log */

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
 * Key tiles [*tb, *te) of bc keys that query rows [i0, i1] of a sequence of nk keys visit under the band of a
 * (win_left, win_right; -1: unbounded side): row i keeps keys [i + diag - win_left, i + diag + win_right], diag =
 * nk - nq of the sequence. Those intervals move by one key per row, so the rows' union is [i0 + diag - win_left,
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

#endif /* FLASHC_CUDA_SCORE_H */
