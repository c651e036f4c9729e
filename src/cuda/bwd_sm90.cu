/*
 * bwd_sm90.cu - the attention backward's dK/dV kernel on Hopper (sm_90a): wgmma products, TMA loads completing
 * on mbarriers, a producer warpgroup and two consumer warpgroups. The preprocess kernel (D_i, cleared dQ sums),
 * the dQ conversion and the deterministic dQ kernel are the Ampere-class path's (bwd.cu); this kernel takes
 * the place of its dK/dV kernel for the problems flashc_bwd_sm90_supports accepts.
 *
 * Algorithm: FlashAttention-2's backward (Dao 2023, Algorithm 2) per key tile, with the Hopper structure of
 * FlashAttention-3 (Shah et al. 2024): a block owns bn = 128 keys, K and V stay in shared memory, and it walks the
 * query tiles (bm = 128 rows at d 64, 64 at d 128 / 256) of every query head that shares its K/V head. Consumer
 * warpgroup c owns keys [64 c, 64 c + 64) of the tile and, per query tile, computes in the transposed
 * orientation, so that the M of every wgmma is its 64 keys and P^T, dS^T leave the accumulators as the A operands
 * of the next products:
 *   S^T = K_c Q^T, dP^T = V_c dO^T           (wgmma m64n{bm}k16, both operands in shared memory, K-major)
 *   P^T = 2^(S^T score_mul - lse2), dS^T = P^T o (dP^T - D)    (lse2, D of the tile's rows from shared memory)
 *   dV_c += P^T dO, dK_c += dS^T Q            (wgmma m64n{d}k16, A from registers, dO and Q read MN-major)
 * and, unless the dQ kernel does it (deterministic mode), dS^T goes to shared memory (keys x queries), the two
 * warpgroups meet at a named barrier, and dQ = dS K for the tile's 128 keys is one more product (A = dS read
 * MN-major, B = K read MN-major) whose fp32 result is staged in shared memory and added to the dQ sums in
 * global memory by a TMA reduction (cp.reduce.async.bulk.tensor .add, issued by one thread per warpgroup, so the
 * consumers only wait for it to have read the staging a step later): at d 128 each warpgroup computes 64 of the
 * columns; at d 64 each warpgroup computes all columns for its half of the step's 128 rows (the tile table's
 * 64-row steps at d 64, a lab option, take the steps in turn). The products' order: dV and dK are issued once dS^T
 * is packed, then come the barrier and dQ; at d 128 dQ is issued before dK (FC90B_DQ_FIRST), so that dQ's staging
 * and reduction run under dK's product. dK is scaled by the softmax scale at the end; dQ's scale is applied by the
 * conversion kernel.
 *
 * d 256 (bn = 64: dK and dV of 64 keys x 256 columns take 128 registers each) gives the consumers roles instead
 * (fc90b_roles_run): consumer 0 computes S^T, P^T and dV += P^T dO over all d, consumer 1 dP^T, dS^T (reading P^T
 * from shared memory) and dK += dS^T Q, and each computes half of dQ's columns. Every product then has N = 64 or
 * N = d; halves of the queries and of d (before v14, lab/LOG.md) took N = 32, read K and V twice, and were 12-30%
 * slower.
 *
 * Shared memory (bytes from a 1024-aligned base; every tile in the 128-byte swizzle of sm90.cuh): K, V (bn x d),
 * st stages of Q and of dO (bm x d), two dS^T buffers (bn x bm, by step parity; 128 query columns as two chunks
 * of 64), st stages of the rows' lse2 and D (2 x bm floats), each consumer's dQ staging (64 x 64 fp32,
 * FC90B_DQ_ROWS, two 128-byte-swizzled boxes of 32 columns), then the mbarriers.
 *
 * Code: the kernel computes the block's work (fc90b_block: its query tiles from score.h's fc_query_tiles) and the
 * shared-memory addresses, then the producer warpgroup runs fc90b_produce, and each consumer warpgroup takes its
 * fixed part (fc90b_consumer_at) and runs the step loop: per step fc90b_probs (S^T, dP^T, then P^T and dS^T; the
 * band through fc_band_cuts_in / fc_keeps_in) and fc90b_grads, then the epilogue fc90b_store_acc; at d 256 each
 * consumer runs fc90b_roles_run (its role's loop and the same epilogue).
 *
 * Barrier protocol (phases as in fwd_sm90.cu):
 *   kv_full    1 arrival (expect_tx) + the K and V bytes; consumers wait for parity 0 once. With FC90B_KFIRST
 *              (the fixed-length d 128 kernels) K's bytes only, and v_full takes V's, loaded after the first
 *              step's Q and dO; the consumers wait for it between the first step's S^T and dP^T products.
 *   full[s]    1 arrival (expect_tx) + the Q and dO bytes of the step in slot s, and 32 arrivals of the
 *              producer's second warp once it has written the rows' lse2 and D. Step it uses slot it % st in
 *              its (it / st)-th round; consumers wait for parity (it / st) & 1.
 *   empty[s]   256 arrivals, one per consumer thread once its products reading slot s are complete; the producer
 *              waits for parity ((it / st) & 1) ^ 1 before refilling it.
 *   named barrier 1 (256 threads): both consumers' dS^T halves are in shared memory (after a proxy fence, as
 *              wgmma reads them through the async proxy). A dS^T buffer is rewritten two steps later, by which
 *              time both warpgroups have waited for the dQ product that read it (each waits before its next
 *              step's barrier).
 *
 * Masks and scores: query tiles that no key of the block can see under the band (its right edge for the first
 * key, its left edge for the last) are skipped; keys past the end and elements outside a row's band get P = 0
 * (so dS = 0) on the tiles an edge or the end cuts. Softcap and ALiBi take the element formula of the mma.sync
 * kernel (fc_bwd_elem), so that P is the forward's. Rows past the end of the queries (zero-filled by TMA) get
 * lse2 = +inf and D = 0, so P = dS = 0 there. Block masks (kernels of their own, BMASK, among the VARLEN ones):
 * the steps are the query tiles of each head's bitmap row of this key tile (bm_tiles.h, built before the launch),
 * and the steps the mask cuts take the element test with the mask's bytes.
 *
 * Varlen (kernels of their own, VARLEN, so that the fixed-length ones keep their machine code): the tensor maps
 * span the packed rows, a block's sequence comes from cu_seqlens and its loads, dQ reductions and dK/dV rows start
 * at the sequence's first rows; key tiles past a shorter sequence have no work. A tile at the end of a sequence
 * reads the next one's rows: its lse2 and masks make P and dS 0 there, and the consumers clear those rows of K, V,
 * Q and dO (fc90_clear_rows) so that no value of another sequence reaches a gradient (0 x NaN); the dQ rows the
 * last query tile adds past its sequence receive zeros.
 */
#include "bm_tiles.h"    /* the block mask as per-tile bitmaps */
#include "bwd_sm80.cuh" /* fc_bwd_store2; fc_bwd_elem, fc_exp2, fc_pack2 of score.cuh / common.cuh */
#include "bwd_sm90.h"
#include "sm90.cuh"

#include <stdint.h>

#define FC90B_THREADS 384   /* producer + two consumer warpgroups */
#define FC90B_CONS_REGS 232 /* setmaxnreg of the consumers: what the producer gives back (168 -> 32) */
#define FC90B_BAR_DS 1      /* named barrier: both dS^T halves stored */
#define FC90B_BAR_DQ 2      /* named barriers 2, 3: one consumer's dQ staging (free, then written) */
#define FC90B_BAR_CLEAR 4   /* named barriers 4, 5: one consumer's varlen tails cleared (fc90_clear_rows) */
#define FC90B_BAR_P 6       /* d 256: consumer 0's P^T stored (arrive), consumer 1 reads it (sync) */
/* How dQ reaches the fp32 sums (the kernel's DQ parameter): not at all (the deterministic mode's dQ kernel computes
 * it), or staged in shared memory and added by the TMA (at d 256 the staging is the step's Q / dO ring slot). The
 * vector reductions from registers it replaced, at d 64 / 128 and then at d 256, are in lab/bwd90/. */
enum { FC90B_DQ_NONE = 0, FC90B_DQ_TMA = 1 };
/* d 128 with the dQ product: 1 issues dV, then (after the dS^T barrier) dQ, then dK, so that dQ's staging and
 * reduction run under dK's product; 0 issues dV and dK before the barrier and dQ after them, as d 64 does (H100,
 * lab/LOG.md v9: d 128's main kernel 2-6% faster, d 64's 0-2% slower). Lab builds compare the two. */
#ifndef FC90B_DQ_FIRST
#define FC90B_DQ_FIRST 1
#endif
/* Lab (lab/LOG.md, twenty-second session): 1 issues dV's product as soon as P^T is packed, before dS^T's elements,
 * which then read P^T back from the packed operand (its bf16 / fp16 rounding, the naive algorithm's), so that the
 * fp32 P^T is not live beside the product in flight (d 64 / 128 without dropout; the generic element step keeps
 * fp32 P^T and issues dV after it). 1: d 128; 2: d 64 and d 128; 0 (default): dV after dS^T. */
#ifndef FC90B_EARLY_DV
#define FC90B_EARLY_DV 0
#endif
/* How fc90b_grads stores dS^T: by stmatrix, four 8 x 8 matrices per instruction, or by 4-byte stores, one pair per
 * instruction. 1 (default): stmatrix at d 128; 2: at d 64 too; 0: nowhere (before). H200, lab/LOG.md v11: the main
 * kernel 2-3% faster at d 128, 2-4% slower at d 64. (d 256's fc90b_roles_run always takes stmatrix and ldmatrix.) */
#ifndef FC90B_STSM
#define FC90B_STSM 1
#endif
/* How a block's first loads are ordered: K, then the first step's Q and dO, then V (its own mbarrier, v_full), so
 * that the first step's S^T runs while V lands (every block of a wave loads at once); or K and V first under one
 * mbarrier. 1 (default): the first order at d 128; 2: at d 64 too; 0: nowhere (before). H200, lab/LOG.md
 * (twenty-sixth session): d 128's main kernel 1-2% faster, d 64's 1.7-4.7% slower. Fixed-length kernels only
 * (the VARLEN ones clear V's rows past the end before the first step). */
#ifndef FC90B_KFIRST
#define FC90B_KFIRST 1
#endif
template <int D, bool VARLEN> __host__ __device__ constexpr bool fc90b_kfirst() {
    return (FC90B_KFIRST == 2 ? D <= 128 : FC90B_KFIRST == 1 && D == 128) && !VARLEN;
}

__host__ __device__ constexpr uint32_t fc90b_kv_bytes(fc90_btile t) { return (uint32_t)t.bn * t.d * 2; }
__host__ __device__ constexpr uint32_t fc90b_q_bytes(fc90_btile t) { return (uint32_t)t.bm * t.d * 2; }
__host__ __device__ constexpr uint32_t fc90b_ds_bytes(fc90_btile t) { return (uint32_t)t.bn * t.bm * 2; }
__host__ __device__ constexpr uint32_t fc90b_off_v(fc90_btile t) { return fc90b_kv_bytes(t); }
__host__ __device__ constexpr uint32_t fc90b_off_q(fc90_btile t) { return 2 * fc90b_kv_bytes(t); }
__host__ __device__ constexpr uint32_t fc90b_off_g(fc90_btile t) { return fc90b_off_q(t) + t.st * fc90b_q_bytes(t); }
__host__ __device__ constexpr uint32_t fc90b_off_ds(fc90_btile t) { return fc90b_off_g(t) + t.st * fc90b_q_bytes(t); }
/* The d 256 tile, whose consumers have roles (fc90b_roles_run): P^T joins dS^T in shared memory (two of each, by
 * step parity), and dQ is staged over the step's Q / dO ring slot: a staging of its own would not fit. */
__host__ __device__ constexpr bool fc90b_roles(fc90_btile t) { return t.d > 128; }
/* dV early (FC90B_EARLY_DV) in this kernel */
template <int D, bool DROP> __host__ __device__ constexpr bool fc90b_early_dv() {
    return (FC90B_EARLY_DV == 2 ? D <= 128 : FC90B_EARLY_DV == 1 && D == 128) && !DROP;
}
/* dS^T stored by stmatrix (FC90B_STSM) in this kernel (d 64 / 128) */
template <int D> __host__ __device__ constexpr bool fc90b_stsm() { return FC90B_STSM == 2 || (FC90B_STSM == 1 && D > 64); }
__host__ __device__ constexpr uint32_t fc90b_off_ld(fc90_btile t) {
    return fc90b_off_ds(t) + (fc90b_roles(t) ? 4 : 2) * fc90b_ds_bytes(t);
}
/* dQ staging for the TMA reduction: per consumer FC90B_DQ_ROWS rows (the M of its dQ product: the step's rows, or
 * its half of a 128-row step) x 64 fp32 columns, as boxes of 32 columns (128 bytes). */
#define FC90B_DQ_ROWS 64
__host__ __device__ constexpr uint32_t fc90b_dq_bytes(fc90_btile) { return (uint32_t)FC90B_DQ_ROWS * 64 * 4; }
__host__ __device__ constexpr uint32_t fc90b_off_dq(fc90_btile t) {
    return (fc90b_off_ld(t) + t.st * 2 * t.bm * 4 + 1023u) & ~1023u;
}
__host__ __device__ constexpr uint32_t fc90b_off_bar(fc90_btile t) {
    return fc90b_off_dq(t) + (fc90b_roles(t) ? 0 : 2 * fc90b_dq_bytes(t));
}
/* kv_full, full[st], empty[st], v_full (FC90B_KFIRST); + 1024 to round the dynamic shared memory base up. */
__host__ __device__ constexpr uint32_t fc90b_smem_bytes(fc90_btile t) { return fc90b_off_bar(t) + 8 * (2 + 2 * t.st) + 1024; }
static_assert(fc90b_smem_bytes(fc90_btile_for(64)) <= 227 * 1024 && fc90b_smem_bytes(fc90_btile_for(128)) <= 227 * 1024 &&
                  fc90b_smem_bytes(fc90_btile_for(256)) <= 227 * 1024,
              "shared memory per block");

#if FC90_DEVICE

/* cp.reduce.async.bulk.tensor (add): the box of tensor map `map` at (c0, .., c3) += the tile at src in shared
 * memory (laid out as the map's box and swizzle say), asynchronously, in the issuing thread's bulk group. */
static __device__ __forceinline__ void fc90_tma_reduce_add(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2,
                                                           int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                     (uint64_t)map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
static __device__ __forceinline__ void fc90_bulk_commit(void) { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* Returns once this thread's bulk groups have all read their shared-memory sources (the staging may be reused). */
static __device__ __forceinline__ void fc90_bulk_wait_read(void) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* Issues acc = A B^T over d (d / 16 k-steps) with A = 64 rows of a bn-row tile and B the bm-row tile, both
 * K-major in 64-column chunks: S^T = K_c Q^T and dP^T = V_c dO^T. One commit group. */
template <int D, int N, int BF>
static __device__ __forceinline__ void fc90b_scores_issue(float (&acc)[N / 2], uint64_t da, uint64_t db) {
    constexpr fc90_btile TL = fc90_btile_for(D);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t aoff = (kk / 4) * TL.bn * FC90_SW_ROW + (kk % 4) * 32,
                       boff = (kk / 4) * TL.bm * FC90_SW_ROW + (kk % 4) * 32;
        fc90_mma_ss<N, BF>(acc, da + (aoff >> 4), db + (boff >> 4), kk > 0);
    }
    fc90_wgmma_commit();
}

/* Issues acc += A B with A (64 keys x bm queries) in registers and B (bm queries x N columns of d) read MN-major:
 * dV += P^T dO, dK += dS^T Q. No commit. */
template <int N, int BM, int BF>
static __device__ __forceinline__ void fc90b_grad_issue(float (&acc)[N / 2], const uint32_t (&pa)[BM / 16][4],
                                                        uint64_t db) {
#pragma unroll
    for (int c = 0; c < BM / 16; ++c) fc90_mma_rs<N, BF>(acc, pa[c], db + ((uint32_t)(c * 2048) >> 4));
}

/* dV early (fc90b_early_dv): P^T packed into pa, then dV += P^T dO issued (dgn: dO's MN-major descriptor). One
 * commit group; pa stays live until it completes. */
template <int D, int BF>
static __device__ __forceinline__ void fc90b_dv_issue(float (&dv)[D / 2], uint32_t (&pa)[fc90_btile_for(D).bm / 16][4],
                                                      const float (&s)[fc90_btile_for(D).bm / 2], uint64_t dgn) {
    constexpr int BM = fc90_btile_for(D).bm;
    fc90_pack_p<BM, BF>(pa, s);
    fc90_pin(dv);
    fc90_pin(pa);
    fc90_wgmma_fence();
    fc90b_grad_issue<D, BM, BF>(dv, pa, dgn);
    fc90_wgmma_commit();
}

#endif /* FC90_DEVICE */

/*
 * Grid: one block per (key tile, K/V head, sequence), in a.kv_groups groups of (K/V head, sequence) pairs whose Q
 * and dO fit in half the L2 together (fc90b_kv_groups; sizes differ by at most one), each group's blocks key tile
 * by key tile, the group's pairs fastest: with causal masks the first key tiles see the most query rows, so the
 * longest blocks start first within the group, and the group's blocks share its Q and dO in L2. (Before: key tile
 * fastest within each pair, so the last pair's longest block started when nearly all work was out and ran alone
 * at the end: a 6% tail at N 1k-4k causal in a simulation of the hardware's in-order block dispatch.)
 * Tensor maps: q, dout over (d, Nq, H, B) with boxes of 64 columns x bm rows; k, v over (d, Nk, Hkv, B) with boxes
 * of 64 x bn. DQ: the dQ product and its reductions are on (a.dq_acc is set).
 */
/*
 * Step it of a block (key tile kt of sequence b, kv head hk): head gi of the group and query tile mt. Without a
 * block mask the steps are the band's query tiles [mb_lo, mb_hi] of each head in turn (per_head of them); with one
 * (BMASK) the set bits in that range of each head's bitmap row, walked in order: (gi, mt) moves from the step
 * before (start: gi 0, mt mb_lo - 1), and the caller counted the steps.
 */
template <bool BMASK>
static __device__ __forceinline__ void fc90b_step(const flashc_bwd_args &a, int b, int hk, int kt, int group,
                                                  int mb_lo, int mb_hi, int per_head, int it, int &gi, int &mt) {
    if constexpr (!BMASK) {
        gi = it / per_head, mt = mb_lo + it % per_head;
    } else {
        for (;;) {
            mt = fc_bits_find(fc_bm_tile_bits(a, b, hk * group + gi, kt, a.n_kblk), mt + 1, mb_hi + 1);
            if (mt <= mb_hi) return;
            ++gi, mt = mb_lo - 1;
        }
    }
}

/* A block's work: key tile kt (first key n0) of kv head hk of sequence b (its first rows sq0, sk0 in the packed
 * tensors, batch coordinate qb in the tensor maps, lengths nq, nk), and its steps: items (head of the group, query
 * tile) pairs over the query tiles [mb_lo, mb_hi], per_head of them per head without a block mask (fc90b_step). */
struct fc90b_block {
    int kt, hk, b;
    bool packed;
    int sq0, sk0, qb, nq, nk, diag, n0, group, mb_lo, mb_hi, per_head, items;
};

#if FC90_DEVICE /* the kernel's pieces; the kernel is empty where the device is not sm_90a */
/* The producer warpgroup: warp 0's thread 0 loads K and V once (FC90B_KFIRST: V after the first step's Q and dO),
 * then Q and dO of each step into the ring; warp 1 writes each step's rows' lse2 and D_i. */
template <int D, bool VARLEN, bool BMASK, typename Ring>
static __device__ __forceinline__ void fc90b_produce(const flashc_bwd_args &a, const fc90b_block &blk,
                                                     const CUtensorMap &tm_q, const CUtensorMap &tm_k,
                                                     const CUtensorMap &tm_v, const CUtensorMap &tm_g,
                                                     const Ring &ring, uint32_t bar_kv, uint32_t bar_v, uint32_t sK,
                                                     uint32_t sV, uint32_t sQ, uint32_t sG, float *sLD) {
    const int b = blk.b, hk = blk.hk, kt = blk.kt, group = blk.group, mb_lo = blk.mb_lo, mb_hi = blk.mb_hi,
              per_head = blk.per_head, items = blk.items, sq0 = blk.sq0, sk0 = blk.sk0, qb = blk.qb, nq = blk.nq,
              n0 = blk.n0;
    const bool packed = blk.packed;
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BN = TL.bn, BM = TL.bm, NCH = D / 64;
    constexpr uint32_t KVB = fc90b_kv_bytes(TL), QB = fc90b_q_bytes(TL);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0 && items > 0) {
        /* Warp 0, one thread: K and V once (KF: V after the first step's Q and dO), then Q and dO of each step. */
        fc90_tma_prefetch(&tm_q);
        fc90_tma_prefetch(&tm_g);
        constexpr bool KF = fc90b_kfirst<D, VARLEN>();
        fc90_bar_expect(bar_kv, (KF ? 1 : 2) * KVB);
        /* (The fixed-length kernels keep their own expressions: their machine code stays as it was.) */
        if constexpr (VARLEN) {
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sK + c * BN * FC90_SW_ROW, &tm_k, bar_kv, c * FC90_SW_COLS, sk0 + n0, hk, qb);
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sV + c * BN * FC90_SW_ROW, &tm_v, bar_kv, c * FC90_SW_COLS, sk0 + n0, hk, qb);
        } else {
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sK + c * BN * FC90_SW_ROW, &tm_k, bar_kv, c * FC90_SW_COLS, n0, hk, b);
            if constexpr (!KF)
                for (int c = 0; c < NCH; ++c)
                    fc90_tma_load(sV + c * BN * FC90_SW_ROW, &tm_v, bar_kv, c * FC90_SW_COLS, n0, hk, b);
        }
        int gi = 0, mt = mb_lo - 1;
        for (int it = 0; it < items; ++it) {
            fc90b_step<BMASK>(a, b, hk, kt, group, mb_lo, mb_hi, per_head, it, gi, mt);
            const int s = ring.slot(it), h = hk * group + gi, m0 = mt * BM;
            ring.wait_empty(it);
            ring.expect(it, 2 * QB);
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sQ + s * QB + c * BM * FC90_SW_ROW, &tm_q, ring.full_bar(it), c * FC90_SW_COLS,
                              sq0 + m0, h, qb);
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sG + s * QB + c * BM * FC90_SW_ROW, &tm_g, ring.full_bar(it), c * FC90_SW_COLS,
                              sq0 + m0, h, qb);
            if (KF && it == 0) { /* V after the first step's Q and dO */
                fc90_bar_expect(bar_v, KVB);
                for (int c = 0; c < NCH; ++c)
                    fc90_tma_load(sV + c * BN * FC90_SW_ROW, &tm_v, bar_v, c * FC90_SW_COLS, n0, hk, b);
            }
        }
    } else if (warp == 1) {
        /* Warp 1: the rows' lse in base 2 (+inf past the end: P = 0 there) and D_i (0 past the end). */
        int gi = 0, mt = mb_lo - 1;
        for (int it = 0; it < items; ++it) {
            fc90b_step<BMASK>(a, b, hk, kt, group, mb_lo, mb_hi, per_head, it, gi, mt);
            const int s = ring.slot(it), h = hk * group + gi, m0 = mt * BM;
            ring.wait_empty(it);
            /* lse and D_i: (B, H, Nq), or (H, total_q) with varlen */
            const int64_t r0 = packed ? (int64_t)h * a.total_q + sq0 : ((int64_t)b * a.H + h) * nq;
            float *ld = sLD + s * 2 * BM;
            for (int r = lane; r < BM; r += 32) {
                const int i = m0 + r;
                ld[r] = i < nq ? a.lse[r0 + i] * FC_LOG2E : INFINITY;
                ld[BM + r] = i < nq ? a.dvec[r0 + i] : 0.f;
            }
            ring.arrive_full(it);
        }
    }
}

/* The epilogue of a consumer warpgroup: its accumulators of this thread's two key rows (key0, key0 + 8), all DW
 * columns, into global memory (dK scaled by the softmax scale), over the ring's shared memory when rows
 * allow 16-byte stores. TWO: acc0 is dK and acc1 dV; otherwise acc0 alone is dK (which0 0) or dV (which0 1). */
template <int D, int BF, int DW, bool TWO>
static __device__ __forceinline__ void fc90b_store_acc(const flashc_bwd_args &a, const float (&acc0)[DW / 2],
                                                       const float (&acc1)[DW / 2], int which0, const fc90b_block &blk,
                                                       uint8_t *gbase, int cw, int t, int warp, int g, int tig,
                                                       int krow, int key0) {
    const int n0 = blk.n0, nk = blk.nk, sk0 = blk.sk0, qb = blk.qb, hk = blk.hk;
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int ST = TL.st, NP = TWO ? 2 : 1;
    constexpr uint32_t QB = fc90b_q_bytes(TL), DSB = fc90b_ds_bytes(TL);
    /* part p: its tensor (0 dK, 1 dV) and factor */
    auto tensor = [&](int p) { return TWO ? p : which0; };
    auto mul = [&](int p) { return tensor(p) ? 1.f : a.scale; };
    const bool vec_out = a.out_dtype != FLASHC_DTYPE_F32 && a.dk_sd == 1 && a.dv_sd == 1 &&
                         (((uintptr_t)a.dk | (uintptr_t)a.dv) & 15) == 0 &&
                         ((a.dk_sb | a.dk_sn | a.dk_sh | a.dv_sb | a.dv_sn | a.dv_sh) & 7) == 0;
    if (vec_out) {
        /* Staged through shared memory (over the Q, dO ring and the dS^T tiles, which nothing reads once both
         * consumers are past their last step; rows padded by 16 bytes against bank conflicts), then written as
         * 16-byte pieces, consecutive threads on consecutive pieces of a row. */
        constexpr int OROW = DW + 8;
        static_assert(2 * NP * 64 * OROW * 2 <= 2 * ST * QB + 2 * DSB, "epilogue staging within the ring and dS^T");
        fc90_nbar_sync(FC90B_BAR_DS, 256);
        uint16_t *st = (uint16_t *)(gbase + fc90b_off_q(TL)) + cw * NP * 64 * OROW;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = 16 * warp + g + 8 * hf;
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const float(&acc)[DW / 2] = p ? acc1 : acc0;
                const float m = mul(p);
#pragma unroll
                for (int j = 0; j < DW / 8; ++j)
                    *(uint32_t *)(st + (64 * p + r) * OROW + 8 * j + 2 * tig) =
                        fc_pack2<BF>(m * acc[4 * j + 2 * hf], m * acc[4 * j + 2 * hf + 1]);
            }
        }
        fc90_nbar_sync(FC90B_BAR_DQ + cw, FC90_WG_THREADS);
        for (int c = t; c < NP * 64 * (DW / 8); c += FC90_WG_THREADS) {
            const int r = c / (DW / 8), piece = c % (DW / 8), which = tensor(r / 64), key = n0 + krow + r % 64;
            if (key >= nk) continue;
            const int64_t off = which ? (int64_t)qb * a.dv_sb + (int64_t)(sk0 + key) * a.dv_sn + (int64_t)hk * a.dv_sh
                                      : (int64_t)qb * a.dk_sb + (int64_t)(sk0 + key) * a.dk_sn + (int64_t)hk * a.dk_sh;
            *(uint4 *)((uint16_t *)(which ? a.dv : a.dk) + off + 8 * piece) =
                *(const uint4 *)(st + r * OROW + 8 * piece);
        }
    } else {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int key = key0 + 8 * hf;
            if (key >= nk) continue;
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const float(&acc)[DW / 2] = p ? acc1 : acc0;
                const float m = mul(p);
                const bool dv = tensor(p);
                const int64_t o = dv ? (int64_t)qb * a.dv_sb + (int64_t)(sk0 + key) * a.dv_sn + (int64_t)hk * a.dv_sh
                                     : (int64_t)qb * a.dk_sb + (int64_t)(sk0 + key) * a.dk_sn + (int64_t)hk * a.dk_sh;
                const int64_t sd = dv ? a.dv_sd : a.dk_sd;
#pragma unroll
                for (int j = 0; j < DW / 8; ++j) {
                    const int col = 8 * j + 2 * tig;
                    fc_bwd_store2(dv ? a.dv : a.dk, o + col * sd, sd, a.out_dtype, m * acc[4 * j + 2 * hf],
                                  m * acc[4 * j + 2 * hf + 1], true);
                }
            }
        }
    }
}
/* A consumer warpgroup's fixed part: its thread's place (cw, the thread t in the warpgroup, warp, g, tig), its
 * keys (krow, key0), the shared memory it reads, and the wgmma descriptors of its products.
 * fc90b_consumer_at fills it once, before the step loop. */
struct fc90b_consumer {
    int cw, t, warp, g, tig;
    int krow, key0; /* first key row in the tile, the thread's first key (second: key0 + 8) */
    int dq_chunk;   /* the first 64-column chunk of K that dQ's product reads */
    int wg_last_key;      /* the last key of this warpgroup's rows: where the band or the end cuts a step */
    uint32_t base, sQ, sG, sDS;
    uint8_t *gbase, *sdq; /* the block's shared memory; this warpgroup's dQ staging (d 64 / 128) */
    const float *sLD;
    uint64_t dKa, dVa, dQk, dGk, dQn, dGn, dKn, dSn;
};

template <int D>
static __device__ __forceinline__ fc90b_consumer fc90b_consumer_at(int wg, int n0, uint32_t base, uint8_t *gbase,
                                                                   uint32_t sK, uint32_t sV, uint32_t sQ, uint32_t sG,
                                                                   uint32_t sDS, const float *sLD) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BN = TL.bn, BM = TL.bm, NCH = D / 64;
    constexpr bool ROLES = fc90b_roles(TL);
    fc90b_consumer c;
    c.cw = wg - 1, c.t = threadIdx.x % FC90_WG_THREADS, c.warp = c.t / 32, c.g = (c.t % 32) / 4, c.tig = c.t % 4;
    c.krow = ROLES ? 0 : 64 * c.cw;
    c.key0 = n0 + c.krow + 16 * c.warp + c.g;
    c.base = base, c.sQ = sQ, c.sG = sG, c.sDS = sDS, c.gbase = gbase, c.sLD = sLD;
    /* Descriptors (fc90_desc in sm90.cuh): this warpgroup's 64 rows of K and V as A (K-major); Q and dO as the B
     * of the scores (K-major) and of the gradients (MN-major: LBO the 64-column chunk step); dS^T as the A of dQ
     * and K as its B, both MN-major (8-key groups 1024 bytes apart, a k16 step 2048 bytes). */
    c.dKa = fc90_desc(sK + c.krow * FC90_SW_ROW, 16, 1024), c.dVa = fc90_desc(sV + c.krow * FC90_SW_ROW, 16, 1024);
    c.dQk = fc90_desc(sQ, 16, 1024), c.dGk = fc90_desc(sG, 16, 1024);
    c.dQn = fc90_desc(sQ, BM * FC90_SW_ROW, 1024), c.dGn = fc90_desc(sG, BM * FC90_SW_ROW, 1024);
    /* dQ's columns: at d 128 this warpgroup's 64-column chunk of K; at d 64 all of them (its half of the rows, or
     * every other step with 64-row steps); at d 256 its half, d / 2 columns (two chunks, LBO apart), every step. */
    c.dq_chunk = ROLES ? c.cw * NCH / 2 : NCH > 1 ? c.cw : 0;
    c.dKn = fc90_desc(sK + c.dq_chunk * BN * FC90_SW_ROW, BN * FC90_SW_ROW, 1024);
    c.dSn = fc90_desc(sDS, BM * FC90_SW_ROW, 1024);
    c.sdq = gbase + fc90b_off_dq(TL) + c.cw * fc90b_dq_bytes(TL);
    c.wg_last_key = n0 + c.krow + 63;
    return c;
}

/* A consumer's start: K and V in shared memory (FC90B_KFIRST: K; fc90b_probs waits for V at the first step), and
 * (VARLEN) the rows of a tile past the end of the keys cleared. */
template <int D, bool VARLEN>
static __device__ __forceinline__ void fc90b_kv_ready(const fc90b_block &blk, const fc90b_consumer &c, uint32_t bar_kv,
                                                      uint32_t sK, uint32_t sV) {
    constexpr int BN = fc90_btile_for(D).bn;
    if (blk.items > 0) fc90_bar_wait(bar_kv, 0);
    if constexpr (VARLEN) {
        if (blk.items > 0 && blk.n0 + BN > blk.nk) {
            fc90_clear_rows<D>(sK, BN, blk.nk - blk.n0, FC90B_BAR_CLEAR + c.cw, c.t);
            fc90_clear_rows<D>(sV, BN, blk.nk - blk.n0, FC90B_BAR_CLEAR + c.cw, c.t);
        }
    }
}

/* VARLEN: a step's Q and dO rows (ring slot `slot`, first row m0) past the end of the queries cleared. */
template <int D, bool VARLEN>
static __device__ __forceinline__ void fc90b_clear_step(const fc90b_consumer &c, int slot, int m0, int nq) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BM = TL.bm;
    constexpr uint32_t QB = fc90b_q_bytes(TL);
    if constexpr (VARLEN) {
        if (m0 + BM > nq) {
            fc90_clear_rows<D>(c.sQ + slot * QB, BM, nq - m0, FC90B_BAR_CLEAR + c.cw, c.t);
            fc90_clear_rows<D>(c.sG + slot * QB, BM, nq - m0, FC90B_BAR_CLEAR + c.cw, c.t);
        }
    }
}

/*
 * fc90b_probs' element step on a tile that neither the band, the end of the keys nor the block mask cuts, under a
 * score modifier: fc_bwd_elem on every element with the softcap fixed at compile time (CAP, fc_score_view) and
 * ALiBi's distance i + diag - key stepped in float from dist0 (the thread's first element's), so that no element
 * issues a tanh, a band test or an int-to-float conversion it does not use (tested per element they were
 * predicated, not skipped).
 */
template <int CAP, bool ALIBI, int N>
static __device__ __forceinline__ void fc90b_elems_open(const flashc_bwd_args &a, float (&s)[N], float (&dp)[N],
                                                        const float *lse2, const float *dvec, float slope2,
                                                        float dist0, int tig) {
    const fc_score_view<CAP> sv(a);
#pragma unroll
    for (int j = 0; j < N / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float l = lse2[8 * j + 2 * tig + e], dd = dvec[8 * j + 2 * tig + e];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float al = ALIBI ? fc_alibi(slope2, dist0 + (float)(8 * j + e - 8 * hf)) : 0.f;
                fc_bwd_elem<fc_fast_math>(sv, s[4 * j + 2 * hf + e], dp[4 * j + 2 * hf + e], l, dd, al, true);
            }
        }
}

/* The raw element step of P^T on a tile nothing cuts: s (keys x queries, accumulator layout: columns 8 j + 2 tig + e)
 * becomes 2^(s score_mul - lse2[column]), lse2 the step's rows' lse in base 2. */
template <int N>
static __device__ __forceinline__ void fc90b_exp_raw(float (&s)[N], const float *lse2, float score_mul, int tig) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
        const float2 l = *(const float2 *)(lse2 + 8 * j + 2 * tig);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            s[4 * j + 2 * hf] = fc_exp2(fmaf(s[4 * j + 2 * hf], score_mul, -l.x));
            s[4 * j + 2 * hf + 1] = fc_exp2(fmaf(s[4 * j + 2 * hf + 1], score_mul, -l.y));
        }
    }
}

/* A step (head h of the group, query tile mt, first row m0, in ring slot `slot`, qoff its offset in
 * descriptor units), the part every consumer shares: S^T and dP^T issued, then P^T into s and dS^T into dp
 * (times the keep bits' 1 / (1 - p) under dropout). Tiles that the band, the end of the keys or the block mask
 * cut, and problems with a score modifier (generic), take the element step of score.h (fc_keeps_lr,
 * fc_bwd_elem); the others the raw exponent (d 64 and 128; d 256 has fc90b_roles_run). */
template <int D, int BF, int DQ, bool BMASK, bool DROP, typename Ring>
static __device__ __forceinline__ void fc90b_probs(const flashc_bwd_args &a, const fc90b_block &blk,
                                                   const fc90b_consumer &c, const Ring &ring, int slot, int h, int mt,
                                                   int m0, uint32_t qoff, bool generic, uint32_t v_wait,
                                                   float (&s)[fc90_btile_for(D).bm / 2],
                                                   float (&dp)[fc90_btile_for(D).bm / 2], float (&dv)[D / 2],
                                                   uint32_t (&pa)[fc90_btile_for(D).bm / 16][4]) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BM = TL.bm;
    constexpr bool EARLY = fc90b_early_dv<D, DROP>();
    static_assert(!fc90b_roles(TL), "the d 64 / 128 tiles");
    const int b = blk.b, kt = blk.kt, nq = blk.nq, nk = blk.nk, diag = blk.diag, wl = a.win_left, wr = a.win_right;
    const int warp = c.warp, lane = c.t % 32, tig = c.tig, key0 = c.key0;

    fc90_pin(s);
    fc90_pin(dp);
    fc90_wgmma_fence();
    fc90b_scores_issue<D, BM, BF>(s, c.dKa, c.dQk + qoff);
    if (v_wait) fc90_bar_wait(v_wait, 0); /* FC90B_KFIRST: the first step waits for V under S^T */
    fc90b_scores_issue<D, BM, BF>(dp, c.dVa, c.dGk + qoff);
    /* Dropout (DROP): the step's keep bits (keys as rows: fc_drop_bits_cols) while both products run; Z =
     * keep / (1 - p) multiplies dP^T before dS^T = P^T o (dP^T - D), and P^T after, for dV. */
    uint32_t keep[(BM / 8 + 7) / 8];
    if (DROP) {
        fc_drop_bits_cols<BM / 8>(fc_drop_begin(a, b, h), blk.n0 + c.krow + 16 * warp, m0, lane, keep);
        fc90_block_end_bits(keep); /* under the products, not after their wait */
    }
    const float *lse2 = c.sLD + slot * 2 * BM, *dvec = lse2 + BM;

    /* P^T: columns are query rows m0 + 8 j + 2 tig + e, rows keys key0 + 8 hf. The band edges or the end of
     * the keys cut this warpgroup's part of the tile (keys [wg_last_key - 63, wg_last_key], rows [m0, m0 + bm)). */
    const bool cut = fc_band_cuts_lr(a, wl, wr, m0, m0 + BM - 1, c.wg_last_key - 63, c.wg_last_key, diag, nk);
    /* BMASK: the block mask cuts the step's tile (its bitmap's second half), so its bytes are tested too */
    const bool part = BMASK && fc_bit(fc_bm_tile_bits(a, b, h, kt, a.n_kblk) + a.bm_tiles_w, mt);
    if (!generic && !cut && !part) {
        fc90_wgmma_wait<1>();
        fc90_pin(s);
        fc90b_exp_raw(s, lse2, a.score_mul, tig);
        if constexpr (!EARLY) { /* EARLY: dS^T after dV's issue, below */
            fc90_wgmma_wait<0>();
            fc90_pin(dp);
            if (DROP) fc_drop_apply(dp, keep, a.drop_scale);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 dd = *(const float2 *)(dvec + 8 * j + 2 * tig);
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    dp[4 * j + 2 * hf] = s[4 * j + 2 * hf] * (dp[4 * j + 2 * hf] - dd.x);
                    dp[4 * j + 2 * hf + 1] = s[4 * j + 2 * hf + 1] * (dp[4 * j + 2 * hf + 1] - dd.y);
                }
            }
        }
    } else {
        fc90_wgmma_wait<0>();
        fc90_pin(s);
        fc90_pin(dp);
        if (DROP) fc_drop_apply(dp, keep, a.drop_scale);
        const float slope2 = fc_alibi_slope2(a, b, h);
        if (!DROP && !cut && !part && a.softcap2 == 0.f) /* ALiBi alone on a tile no mask cuts */
            fc90b_elems_open<0, true>(a, s, dp, lse2, dvec, slope2, (float)(m0 + 2 * tig + diag - key0), tig);
        else if (!DROP && !cut && !part && !a.alibi) /* softcap alone */
            fc90b_elems_open<1, false>(a, s, dp, lse2, dvec, slope2, 0.f, tig);
        else
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = m0 + 8 * j + 2 * tig + e;
                const float l = lse2[8 * j + 2 * tig + e], dd = dvec[8 * j + 2 * tig + e];
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int key = key0 + 8 * hf;
                    bool vis = fc_keeps_lr(a, wl, wr, i, key, diag, nk);
                    if (BMASK && part)
                        vis = vis && fc_bm_keeps(a, fc_bm_row(a, fc_bm_base(a, b, h), min(i, nq - 1)), key);
                    const float al = a.alibi ? slope2 * fabsf((float)(i + diag - key)) : 0.f;
                    fc_bwd_elem<fc_fast_math>(a, s[4 * j + 2 * hf + e], dp[4 * j + 2 * hf + e], l, dd, al, vis);
                }
            }
    }
    if constexpr (EARLY) {
        /* dV's product under dS^T's elements: issued where both paths meet (a wgmma in one branch only had ptxas
         * serialize them all, C7512); on the fast path dS^T follows, reading P^T back from its packed pairs */
        fc90b_dv_issue<D, BF>(dv, pa, s, c.dGn + qoff);
        if (!generic && !cut && !part) {
            fc90_wgmma_wait<1>();
            fc90_pin(dp);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 dd = *(const float2 *)(dvec + 8 * j + 2 * tig);
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) { /* element 4 j + 2 hf is pair 2 (j % 2) + hf of k16 step j / 2 */
                    const float2 p = fc_unpack2<BF>(pa[j / 2][2 * (j % 2) + hf]);
                    dp[4 * j + 2 * hf] = p.x * (dp[4 * j + 2 * hf] - dd.x);
                    dp[4 * j + 2 * hf + 1] = p.y * (dp[4 * j + 2 * hf + 1] - dd.y);
                }
            }
        }
    }
    if (DROP) fc_drop_apply(s, keep, a.drop_scale);
}

/* d 64 / 128: dV += P^T dO and dK += dS^T Q with P^T, dS^T as register A operands; with DQ, dS^T also goes to the
 * step's buffer (keys x queries) for dQ = dS K over the tile's 128 keys (at d 128 each warpgroup its 64-column
 * chunk, at d 64 each its half of a 128-row step, or in turn by 64-row step), staged in this warpgroup's dQ boxes
 * and added by the TMA. */
template <int D, int BF, int DQ, bool VARLEN, bool EARLY, typename Ring>
static __device__ __forceinline__ void fc90b_grads(const flashc_bwd_args &a, const fc90b_block &blk,
                                                   const fc90b_consumer &c, const Ring &ring, const CUtensorMap &tm_dq,
                                                   int it, int slot, int h, int m0, uint32_t qoff,
                                                   float (&s)[fc90_btile_for(D).bm / 2],
                                                   float (&dp)[fc90_btile_for(D).bm / 2], float (&dk)[D / 2],
                                                   float (&dv)[D / 2],
                                                   uint32_t (&pa_early)[fc90_btile_for(D).bm / 16][4]) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BN = TL.bn, BM = TL.bm, NCH = D / 64, DQN = 64;
    constexpr uint32_t DSB = fc90b_ds_bytes(TL);
    static_assert(!fc90b_roles(TL), "the d 64 / 128 tiles");
    const int cw = c.cw, t = c.t, warp = c.warp, g = c.g, tig = c.tig, key0 = c.key0;
    uint32_t pa_here[BM / 16][4], da[BM / 16][4];
    uint32_t(&pa)[BM / 16][4] = EARLY ? pa_early : pa_here; /* EARLY: packed, and dV issued, in fc90b_probs */
    if (!EARLY) fc90_pack_p<BM, BF>(pa, s);
    fc90_pack_p<BM, BF>(da, dp);

    const int buf = it & 1;
    if (DQ) {
        /* dS^T into buffer buf, keys x queries, swizzled: fragment (cc, r) holds n8 blocks 2 cc + r / 2 (query
         * columns) of key row key0 - n0 + 8 (r % 2). */
        uint8_t *ds = c.gbase + fc90b_off_ds(TL) + buf * DSB;
        if (fc90b_stsm<D>()) {
            /* fragment cc as four 8 x 8 matrices (register r: rows + 8 (r % 2), n8 block 2 cc + r / 2); lane l gives
             * row l % 8 of matrix l / 8 */
            const int mi = (t % 32) / 8, row = key0 - g - blk.n0 + 8 * (mi & 1) + (t % 8);
#pragma unroll
            for (int cc = 0; cc < BM / 16; ++cc) {
                const int j = 2 * cc + (mi >> 1);
                fc90_stmatrix_x4(c.sDS + buf * DSB + (j / 8) * (BN * 128) + row * 128 + (((j % 8) ^ (row & 7)) * 16),
                                 da[cc][0], da[cc][1], da[cc][2], da[cc][3]);
            }
        } else {
#pragma unroll
            for (int cc = 0; cc < BM / 16; ++cc)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int row = key0 - blk.n0 + 8 * (r & 1), j = 2 * cc + (r >> 1); /* row in the tile */
                    *(uint32_t *)(ds + (j / 8) * (BN * 128) + row * 128 + (((j % 8) ^ (row & 7)) * 16) + 4 * tig) =
                        da[cc][r];
                }
        }
    }

    fc90_pin(dv);
    fc90_pin(dk);
    fc90_pin(pa);
    fc90_pin(da);
    constexpr bool DQ_FIRST = DQ && FC90B_DQ_FIRST && D == 128; /* dK after dQ */
    fc90_wgmma_fence();
    if (!EARLY) fc90b_grad_issue<D, BM, BF>(dv, pa, c.dGn + qoff);
    if (!DQ_FIRST) fc90b_grad_issue<D, BM, BF>(dk, da, c.dQn + qoff);
    if (!EARLY || !DQ_FIRST) fc90_wgmma_commit();

    if (DQ) {
        fc90_fence_proxy_async();
        fc90_nbar_sync(FC90B_BAR_DS, 256);
        /* d 128: each warpgroup its column chunk of every step; d 64: all 64 columns, every other step with 64-row
         * steps, or the warpgroup's half of the rows (qh) of every 128-row step */
        const bool mine = NCH > 1 || BM == 128 || (it & 1) == cw;
        const int qh = BM == 128 ? cw : 0;
        float dq[DQN / 2];
        if (mine) {
#pragma unroll
            for (int i = 0; i < DQN / 2; ++i) dq[i] = 0.f;
            fc90_pin(dq);
            fc90_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                fc90_mma_ss<DQN, BF, 1>(dq, c.dSn + ((buf * DSB + qh * BN * 128 + kk * 2048) >> 4),
                                        c.dKn + ((kk * 2048) >> 4), kk > 0);
            fc90_wgmma_commit();
        }
        if (DQ_FIRST) { /* dV and dQ done, dK under dQ's staging */
            fc90_wgmma_fence();
            fc90b_grad_issue<D, BM, BF>(dk, da, c.dQn + qoff);
            fc90_wgmma_commit();
            fc90_wgmma_wait<1>();
            fc90_pin(dv);
            fc90_pin(pa);
        } else {
            fc90_wgmma_wait<0>();
            fc90_pin(dv);
            fc90_pin(dk);
            fc90_pin(pa);
            fc90_pin(da);
            ring.release_slot(slot);
        }
        if (mine) {
            /* Stage in two swizzled boxes of 32 columns (fragment j of the accumulator is box j / 4), then one
             * thread adds them to the fp32 sums with the TMA. The staging is free again once the previous step's
             * reduction has read it. */
            fc90_pin(dq);
            if (t == 0) fc90_bulk_wait_read();
            fc90_nbar_sync(FC90B_BAR_DQ + cw, FC90_WG_THREADS);
            const int r0 = 16 * warp + g;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = r0 + 8 * hf;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const uint32_t chunk = (uint32_t)(2 * (j % 4) + tig / 2) ^ (uint32_t)(row & 7);
                    *(float2 *)(c.sdq + (j / 4) * (FC90B_DQ_ROWS * 128) + row * 128 + chunk * 16 + 8 * (tig & 1)) =
                        make_float2(dq[4 * j + 2 * hf], dq[4 * j + 2 * hf + 1]);
                }
            }
            fc90_fence_proxy_async();
            fc90_nbar_sync(FC90B_BAR_DQ + cw, FC90_WG_THREADS);
            if (t == 0) {
                const uint32_t src = c.base + fc90b_off_dq(TL) + cw * fc90b_dq_bytes(TL);
                static_assert(DQN == 64, "two staging boxes of 32 columns");
                constexpr uint32_t BOX = FC90B_DQ_ROWS * FC90_SW_ROW;
                const int r0 = m0 + FC90B_DQ_ROWS * qh;
                if constexpr (VARLEN) {
                    fc90_tma_reduce_add(&tm_dq, src, c.dq_chunk * 64, h, blk.sq0 + r0, blk.qb);
                    fc90_tma_reduce_add(&tm_dq, src + BOX, c.dq_chunk * 64 + 32, h, blk.sq0 + r0, blk.qb);
                } else {
                    fc90_tma_reduce_add(&tm_dq, src, c.dq_chunk * 64, h, r0, blk.b);
                    fc90_tma_reduce_add(&tm_dq, src + BOX, c.dq_chunk * 64 + 32, h, r0, blk.b);
                }
                fc90_bulk_commit();
            }
        }
        if (DQ_FIRST) {
            fc90_wgmma_wait<0>();
            fc90_pin(dk);
            fc90_pin(da);
            ring.release_slot(slot);
        }
    } else {
        fc90_wgmma_wait<0>();
        fc90_pin(dv);
        fc90_pin(dk);
        fc90_pin(pa);
        fc90_pin(da);
        ring.release_slot(slot);
    }
}


/*
 * d 256 with roles (fc90b_roles): consumer R's step loop and epilogue. Per step, both products of the first stage
 * run at once (S^T on consumer 0, dP^T on 1), then:
 *   R 0: P^T (the element step of score.h where a mask cuts the tile or a score modifier is on), stored as fp16
 *        pairs of P^T dcap (the softcap's derivative; dropout's keep bits are applied to dP^T by consumer 1) into
 *        the step's P^T buffer by stmatrix, named barrier FC90B_BAR_P arrived at; dV += P^T dO (Z P^T under
 *        dropout) issued from registers.
 *   R 1: waits at FC90B_BAR_P, reads P^T dcap back by ldmatrix (the same addresses and registers), dS^T =
 *        P^T dcap o (Z dP^T - D), stored by stmatrix (with DQ) and fenced for the async proxy; dK += dS^T Q issued.
 * Both meet at FC90B_BAR_DS (sync on both sides, so that neither runs a step ahead of the other: that also
 * keeps the P^T and dS^T buffers and the two barriers' phases apart), then each computes dQ = dS K for its half
 * of d, stages it over the step's dO (R 0, whose dV was its last reader) or Q (R 1, after its dK) ring slot and
 * has the TMA add it to the sums; thread 0 gives the slot back once the reduction has read it (staged_slot, next
 * step). Consumer 0's next S^T can start while consumer 1's dK runs.
 */
template <int R, int D, int BF, int DQ, bool VARLEN, bool BMASK, bool DROP, typename Ring>
static __device__ __forceinline__ void fc90b_roles_run(const flashc_bwd_args &a, const fc90b_block &blk,
                                                       const fc90b_consumer &c, const Ring &ring,
                                                       const CUtensorMap &tm_dq, uint32_t bar_kv, uint32_t sK,
                                                       uint32_t sV, bool generic) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BN = TL.bn, BM = TL.bm, DQN = D / 2;
    constexpr uint32_t QB = fc90b_q_bytes(TL), DSB = fc90b_ds_bytes(TL);
    static_assert(fc90b_roles(TL) && BN == 64 && BM == 64, "the d 256 tile");
    const int b = blk.b, hk = blk.hk, kt = blk.kt, group = blk.group, mb_lo = blk.mb_lo, mb_hi = blk.mb_hi,
              per_head = blk.per_head, items = blk.items, n0 = blk.n0, nq = blk.nq, nk = blk.nk, diag = blk.diag;
    const int cw = c.cw, t = c.t, warp = c.warp, lane = t % 32, tig = c.tig, key0 = c.key0;
    const int wl = a.win_left, wr = a.win_right;
    float acc[D / 2]; /* R 0: dV, R 1: dK, all d */
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    int staged_slot = -1;
    fc90b_kv_ready<D, VARLEN>(blk, c, bar_kv, sK, sV);
    /* stmatrix / ldmatrix of the 64 x 64 P^T and dS^T tiles: n8 blocks (j, j + 1) x rows (+0, +8) as four 8 x 8
     * matrices; lane l gives row l % 8 of matrix l / 8 (the layout of fc90b_grads' dS^T: keys x queries, swizzled) */
    const int mi = lane / 8, mrow = 16 * warp + 8 * (mi & 1) + (t % 8);
    int step_gi = 0, step_mt = mb_lo - 1;
    for (int it = 0; it < items; ++it) {
        fc90b_step<BMASK>(a, b, hk, kt, group, mb_lo, mb_hi, per_head, it, step_gi, step_mt);
        const int slot = ring.slot(it), h = hk * group + step_gi, mt = step_mt, m0 = mt * BM, buf = it & 1;
        const uint32_t qoff = (slot * QB) >> 4, sPt = c.sDS + (2 + buf) * DSB, sDSt = c.sDS + buf * DSB;
        ring.wait_full(it);
        fc90b_clear_step<D, VARLEN>(c, slot, m0, nq);
        float x[BM / 2]; /* R 0: S^T, then P^T; R 1: dP^T, then dS^T */
        fc90_pin(x);
        fc90_wgmma_fence();
        if (R == 0) fc90b_scores_issue<D, BM, BF>(x, c.dKa, c.dQk + qoff);
        else fc90b_scores_issue<D, BM, BF>(x, c.dVa, c.dGk + qoff);
        uint32_t keep[(BM / 8 + 7) / 8];
        if (DROP) {
            fc_drop_bits_cols<BM / 8>(fc_drop_begin(a, b, h), n0 + 16 * warp, m0, lane, keep);
            fc90_block_end_bits(keep);
        }
        if (DQ == FC90B_DQ_TMA && staged_slot >= 0) { /* thread 0 only */
            fc90_bulk_wait_read();
            ring.release_slot(staged_slot);
            staged_slot = -1;
        }
        const float *lse2 = c.sLD + slot * 2 * BM, *dvec = lse2 + BM;
        uint32_t op[BM / 16][4]; /* the A operand of dV (R 0) or dK (R 1) */
        fc90_wgmma_wait<0>();
        fc90_pin(x);
        if (R == 0) {
            const bool cut = fc_band_cuts_lr(a, wl, wr, m0, m0 + BM - 1, n0, n0 + BN - 1, diag, nk);
            const bool part = BMASK && fc_bit(fc_bm_tile_bits(a, b, h, kt, a.n_kblk) + a.bm_tiles_w, mt);
            uint32_t e[BM / 16][4]; /* P^T dcap as fp16 pairs, op's layout */
            if (!generic && !cut && !part) {
                fc90b_exp_raw(x, lse2, a.score_mul, tig);
                fc90_pack_p<BM, 0>(e, x);
            } else {
                const float slope2 = fc_alibi_slope2(a, b, h);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        float pd[2];
#pragma unroll
                        for (int ee = 0; ee < 2; ++ee) {
                            const int i = m0 + 8 * j + 2 * tig + ee, key = key0 + 8 * hf;
                            bool vis = fc_keeps_lr(a, wl, wr, i, key, diag, nk);
                            if (BMASK && part)
                                vis = vis && fc_bm_keeps(a, fc_bm_row(a, fc_bm_base(a, b, h), min(i, nq - 1)), key);
                            const float al = a.alibi ? slope2 * fabsf((float)(i + diag - key)) : 0.f;
                            float dcap;
                            float &v = x[4 * j + 2 * hf + ee];
                            v = fc_bwd_prob<fc_fast_math>(a, v, lse2[8 * j + 2 * tig + ee], al, vis, dcap);
                            pd[ee] = v * dcap;
                        }
                        e[j / 2][2 * (j % 2) + hf] = fc_pack2<0>(pd[0], pd[1]);
                    }
            }
#pragma unroll
            for (int cc = 0; cc < BM / 16; ++cc) {
                const int piece = 2 * cc + (mi >> 1);
                fc90_stmatrix_x4(sPt + mrow * FC90_SW_ROW + ((piece ^ (mrow & 7)) * 16), e[cc][0], e[cc][1],
                                 e[cc][2], e[cc][3]);
            }
            fc90_nbar_arrive(FC90B_BAR_P);
            if (DROP) fc_drop_apply(x, keep, a.drop_scale);
            fc90_pack_p<BM, BF>(op, x);
        } else {
            if (DROP) fc_drop_apply(x, keep, a.drop_scale);
            fc90_nbar_sync(FC90B_BAR_P, 256);
            uint32_t e[BM / 16][4];
#pragma unroll
            for (int cc = 0; cc < BM / 16; ++cc) {
                const int piece = 2 * cc + (mi >> 1);
                fc90_ldmatrix_x4(sPt + mrow * FC90_SW_ROW + ((piece ^ (mrow & 7)) * 16), e[cc]);
            }
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
                const float2 dd = *(const float2 *)(dvec + 8 * j + 2 * tig);
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float2 p = fc_unpack2<0>(e[j / 2][2 * (j % 2) + hf]);
                    x[4 * j + 2 * hf] = p.x * (x[4 * j + 2 * hf] - dd.x);
                    x[4 * j + 2 * hf + 1] = p.y * (x[4 * j + 2 * hf + 1] - dd.y);
                }
            }
            fc90_pack_p<BM, BF>(op, x);
            if (DQ) {
#pragma unroll
                for (int cc = 0; cc < BM / 16; ++cc) {
                    const int piece = 2 * cc + (mi >> 1);
                    fc90_stmatrix_x4(sDSt + mrow * FC90_SW_ROW + ((piece ^ (mrow & 7)) * 16), op[cc][0], op[cc][1],
                                     op[cc][2], op[cc][3]);
                }
                fc90_fence_proxy_async();
            }
        }
        fc90_pin(acc);
        fc90_pin(op);
        fc90_wgmma_fence();
        fc90b_grad_issue<D, BM, BF>(acc, op, (R == 0 ? c.dGn : c.dQn) + qoff);
        fc90_wgmma_commit();
        fc90_nbar_sync(FC90B_BAR_DS, 256);
        if (DQ == FC90B_DQ_TMA) {
            /* dV or dK complete first: its accumulator, operand and dQ's would not fit in registers together
             * (ptxas serializes every wgmma, C7512) */
            fc90_wgmma_wait<0>();
            fc90_pin(acc);
            fc90_pin(op);
            float dq[DQN / 2];
#pragma unroll
            for (int i = 0; i < DQN / 2; ++i) dq[i] = 0.f;
            fc90_pin(dq);
            fc90_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                fc90_mma_ss<DQN, BF, 1>(dq, c.dSn + ((buf * DSB + kk * 2048) >> 4), c.dKn + ((kk * 2048) >> 4), kk > 0);
            fc90_wgmma_commit();
            fc90_wgmma_wait<0>();
            fc90_pin(dq);
            /* fp32, DQN / 32 swizzled boxes of 32 columns (fragment j in box j / 4), over dO (R 0) or Q (R 1) */
            uint8_t *const stg = c.gbase + (R == 0 ? fc90b_off_g(TL) : fc90b_off_q(TL)) + slot * QB;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = 16 * warp + c.g + 8 * hf;
#pragma unroll
                for (int j = 0; j < DQN / 8; ++j) {
                    const uint32_t chunk = (uint32_t)(2 * (j % 4) + tig / 2) ^ (uint32_t)(row & 7);
                    *(float2 *)(stg + (j / 4) * (BM * 128) + row * 128 + chunk * 16 + 8 * (tig & 1)) =
                        make_float2(dq[4 * j + 2 * hf], dq[4 * j + 2 * hf + 1]);
                }
            }
            fc90_fence_proxy_async();
            fc90_nbar_sync(FC90B_BAR_DQ + cw, FC90_WG_THREADS);
            if (t == 0) {
                const uint32_t src = (R == 0 ? c.sG : c.sQ) + slot * QB;
#pragma unroll
                for (int bx = 0; bx < DQN / 32; ++bx)
                    fc90_tma_reduce_add(&tm_dq, src + bx * (BM * FC90_SW_ROW), cw * DQN + 32 * bx, h, blk.sq0 + m0,
                                        blk.qb);
                fc90_bulk_commit();
                staged_slot = slot;
            } else {
                ring.release_slot(slot);
            }
        } else {
            fc90_wgmma_wait<0>();
            fc90_pin(acc);
            fc90_pin(op);
            ring.release_slot(slot);
        }
    }
    if (DQ == FC90B_DQ_TMA && t == 0) fc90_bulk_wait_read();
    fc90b_store_acc<D, BF, D, false>(a, acc, acc, R == 0 /* dV */, blk, c.gbase, cw, t, warp, c.g, tig, 0, key0);
}

#endif /* FC90_DEVICE */

template <int D, int BF, int DQ, bool VARLEN, bool BMASK = false, bool DROP = false>
__global__ void __launch_bounds__(FC90B_THREADS, 1)
    fc90_bwd_kernel(const __grid_constant__ flashc_bwd_args a, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_g, const __grid_constant__ CUtensorMap tm_dq) {
#if FC90_DEVICE
    constexpr fc90_btile TL = fc90_btile_for(D);
    constexpr int BN = TL.bn, BM = TL.bm, ST = TL.st;
    /* ROLES (d 256): both consumers take all bn = 64 keys of the tile, one S^T, P^T and dV, the other dP^T, dS^T
     * and dK (fc90b_roles_run; dK and dV of 64 keys x 256 columns are 128 registers each). */
    constexpr bool ROLES = fc90b_roles(TL);
    constexpr uint32_t QB = fc90b_q_bytes(TL);
    static_assert(TL.d == D && D % 64 == 0 && BN == (ROLES ? 64 : 128) && (BM == 64 || (BM == 128 && D == 64)) &&
                      ST >= 2,
                  "tile table");
    static_assert(FC90_WG_THREADS * (168 - 32) >= 2 * FC90_WG_THREADS * (FC90B_CONS_REGS - 168),
                  "the consumers grow by what the producer frees");

    extern __shared__ uint8_t fc90_smem[];
    const uint32_t base = (fc_smem_addr(fc90_smem) + 1023u) & ~1023u;
    uint8_t *const gbase = fc90_smem + (base - fc_smem_addr(fc90_smem));
    const uint32_t sK = base, sV = base + fc90b_off_v(TL), sQ = base + fc90b_off_q(TL), sG = base + fc90b_off_g(TL),
                   sDS = base + fc90b_off_ds(TL);
    float *const sLD = (float *)(gbase + fc90b_off_ld(TL)); /* slot s: lse2 [bm], then D [bm] */
    const uint32_t bar_kv = base + fc90b_off_bar(TL);
    const fc90_ring<ST> ring = {bar_kv + 8, bar_kv + 8 + 8 * ST}; /* full[st], empty[st] */
    const uint32_t bar_v = bar_kv + 8 + 16 * ST;                   /* FC90B_KFIRST */

    /* Block -> (key tile, pair) in the group order above (the launch keeps blocks below 2^31) */
    uint32_t pair;
    const int kt = (int)fc90_group_order(blockIdx.x, a.n_kblk, (uint32_t)a.Hkv * a.B, a.kv_groups, &pair);
    const int hk = (int)(pair % a.Hkv), b = (int)(pair / a.Hkv);
    /* The sequence: its first query and key rows sq0, sk0 in the packed tensors (varlen), its lengths, and its batch
     * coordinate in the tensor maps (0 with varlen: one packed batch). */
    const bool packed = VARLEN && a.varlen; /* VARLEN kernels also run fixed-length problems with seqused_k */
    const int sq0 = packed ? a.cu_q[b] : 0, sk0 = packed ? a.cu_k[b] : 0, qb = packed ? 0 : b;
    const int nq = packed ? a.cu_q[b + 1] - sq0 : a.Nq,
              nk = VARLEN ? fc_used_keys(a, b, packed ? a.cu_k[b + 1] - sk0 : a.Nk) : a.Nk, diag = fc_diag(a, nq, nk),
              group = a.H / a.Hkv;
    const int n0 = kt * BN;
    /* The query tiles that this block's keys reach under the band */
    int mb_lo, mb_hi;
    const int per_head =
        fc_query_tiles(a, a.win_left, a.win_right, n0, min(n0 + BN, nk) - 1, diag, nq, BM, &mb_lo, &mb_hi);
    /* (head of the group, query tile), the tile fastest; none for a key tile past a shorter sequence (varlen) */
    int items = VARLEN && (n0 >= nk || nq <= 0) ? 0 : per_head * group;
    if constexpr (BMASK) /* the band's tiles that each head's bitmap row keeps */
        if (items > 0) {
            items = 0;
            for (int gi = 0; gi < group; ++gi)
                items += fc_bits_count(fc_bm_tile_bits(a, b, hk * group + gi, kt, a.n_kblk), mb_lo, mb_hi + 1);
        }

    const fc90b_block blk = {kt, hk, b, packed, sq0, sk0, qb, nq, nk, diag, n0, group, mb_lo, mb_hi, per_head, items};

    if (threadIdx.x == 0) {
        fc90_bar_init(bar_kv, 1);
        if constexpr (fc90b_kfirst<D, VARLEN>()) fc90_bar_init(bar_v, 1);
        ring.init(1 + 32, 2 * FC90_WG_THREADS); /* full: expect_tx + producer warp 1; empty: every consumer thread */
        fc90_bar_init_fence();
    }
    __syncthreads();

    const int wg = threadIdx.x / FC90_WG_THREADS;
    if (wg == 0) {
        fc90_regs_dec<32>();
        fc90b_produce<D, VARLEN, BMASK>(a, blk, tm_q, tm_k, tm_v, tm_g, ring, bar_kv, bar_v, sK, sV, sQ, sG, sLD);
        return;
    }

    fc90_regs_inc<FC90B_CONS_REGS>();
    const fc90b_consumer c = fc90b_consumer_at<D>(wg, n0, base, gbase, sK, sV, sQ, sG, sDS, sLD);
    if constexpr (ROLES) {
        if (c.cw == 0)
            fc90b_roles_run<0, D, BF, DQ, VARLEN, BMASK, DROP>(a, blk, c, ring, tm_dq, bar_kv, sK, sV,
                                                               !fc_score_plain(a));
        else
            fc90b_roles_run<1, D, BF, DQ, VARLEN, BMASK, DROP>(a, blk, c, ring, tm_dq, bar_kv, sK, sV,
                                                               !fc_score_plain(a));
    } else {
        float dk[D / 2], dv[D / 2], s_keep[BM / 2], dp_keep[BM / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) s_keep[i] = dp_keep[i] = 0.f;
        /* A score modifier changes every element's formula (fc_bwd_elem, as in the mma.sync kernel). */
        const bool generic = !fc_score_plain(a);

        fc90b_kv_ready<D, VARLEN>(blk, c, bar_kv, sK, sV);
        int step_gi = 0, step_mt = mb_lo - 1;
        for (int it = 0; it < items; ++it) {
            fc90b_step<BMASK>(a, b, hk, kt, group, mb_lo, mb_hi, per_head, it, step_gi, step_mt);
            /* S^T and dP^T: with 128-row steps fresh registers each step (the first product of each overwrites them),
             * so that their 128 registers are not live across the step's gradient products as a loop-carried value
             * would be; 64-row steps keep the arrays above (their machine code as it was). */
            float s_step[BM / 2], dp_step[BM / 2];
            constexpr bool EARLY = fc90b_early_dv<D, DROP>();
            float(&s)[BM / 2] = BM == 128 || EARLY ? s_step : s_keep;
            float(&dp)[BM / 2] = BM == 128 || EARLY ? dp_step : dp_keep;
            uint32_t pa[BM / 16][4]; /* P^T packed: dV's A operand (d 64 / 128) */
            const int slot = ring.slot(it), h = hk * group + step_gi, m0 = step_mt * BM;
            const uint32_t qoff = (slot * QB) >> 4;
            ring.wait_full(it);
            fc90b_clear_step<D, VARLEN>(c, slot, m0, nq);
            fc90b_probs<D, BF, DQ, BMASK, DROP>(a, blk, c, ring, slot, h, step_mt, m0, qoff, generic,
                                                fc90b_kfirst<D, VARLEN>() && it == 0 ? bar_v : 0u, s, dp, dv, pa);
            fc90b_grads<D, BF, DQ, VARLEN, EARLY>(a, blk, c, ring, tm_dq, it, slot, h, m0, qoff, s, dp, dk, dv, pa);
        }

        /* The last reduction must have read the staging before the epilogue reuses the ring or the block's shared
         * memory goes away. */
        if (DQ == FC90B_DQ_TMA && c.t == 0) fc90_bulk_wait_read();

        fc90b_store_acc<D, BF, D, true>(a, dk, dv, 0, blk, gbase, c.cw, c.t, c.warp, c.g, c.tig, c.krow, c.key0);
    }
#endif /* FC90_DEVICE */
}

/* ---- host ------------------------------------------------------------------------------------------------ */

template <int D, int BF, int DQ, bool VARLEN, bool BMASK = false, bool DROP = false>
static cudaError_t fc90b_launch_as(const flashc_bwd_args *a, const CUtensorMap *tm, int64_t blocks, cudaStream_t stream) {
    const int smem = (int)fc90b_smem_bytes(fc90_btile_for(D));
    cudaError_t e = fc_smem_optin<fc90_bwd_kernel<D, BF, DQ, VARLEN, BMASK, DROP>>(smem);
    if (e != cudaSuccess) return e;
    fc90_bwd_kernel<D, BF, DQ, VARLEN, BMASK, DROP>
        <<<(unsigned)blocks, FC90B_THREADS, smem, stream>>>(*a, tm[0], tm[1], tm[2], tm[3], tm[4]);
    return cudaGetLastError();
}
/* Varlen takes kernels of its own (VARLEN), so that the fixed-length ones keep their machine code; so does a
 * fixed-length problem whose sequences use fewer keys (seqused_k), which needs their tail clearing; and block
 * masks, BMASK kernels among the VARLEN ones; and dropout, VARLEN kernels of its own (DROP; no block mask). */
template <int D, int BF, int DQ>
static cudaError_t fc90b_launch(const flashc_bwd_args *a, const CUtensorMap *tm, int64_t blocks, cudaStream_t stream) {
    if (a->dropout) return fc90b_launch_as<D, BF, DQ, true, false, true>(a, tm, blocks, stream); /* no block mask */
    if (a->bm) return fc90b_launch_as<D, BF, DQ, true, true>(a, tm, blocks, stream);
    return a->varlen || a->seqused_k ? fc90b_launch_as<D, BF, DQ, true>(a, tm, blocks, stream)
                     : fc90b_launch_as<D, BF, DQ, false>(a, tm, blocks, stream);
}

/* The fp32 dQ sums (rows, H, D) as a (D, H, Nq, B) tensor for the TMA reduction: boxes of 32 columns x 1 head x
 * box_rows (FC90B_DQ_ROWS) rows, 128-byte swizzle; the Nq dimension clips a tile's rows past the end of its
 * sequence. */
static cudaError_t fc90b_dq_map(CUtensorMap *map, float *dq_acc, int D, int H, int Nq, int B, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 enc = fc90_encoder();
    if (!enc) return cudaErrorNotSupported;
    const cuuint64_t dim[4] = {(cuuint64_t)D, (cuuint64_t)H, (cuuint64_t)Nq, (cuuint64_t)B};
    const cuuint64_t str[3] = {(cuuint64_t)D * 4, (cuuint64_t)H * D * 4, (cuuint64_t)Nq * H * D * 4};
    const cuuint32_t box[4] = {32, 1, (cuuint32_t)box_rows, 1}, estr[4] = {1, 1, 1, 1};
    const CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dq_acc, dim, str, box, estr,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}


/* The block mask by this kernel's tiles, a bitmap row per key tile (bm_tiles.h), over the max lengths. */
static fc_bm_tiles_args fc90b_bm_tiles_args(const flashc_bwd_args *a) {
    const fc90_btile tl = fc90_btile_for(a->D);
    return fc_bm_tiles_args{a->bm, a->bm_q, a->bm_k, a->bm_batch, a->bm_heads, a->bm_nqb, a->bm_nkb, a->Nq, a->Nk,
                            tl.bm, tl.bn, 1};
}

/* Groups of the block order: none holds more (K/V head, sequence) pairs than have their Q and dO (4 Nq D bytes per
 * query head) in half the L2 together. Lab (lab/LOG.md, twenty-sixth session; not yet measured): FC90B_PAIR_BYTES
 * is the bytes per query row and column a pair counts: 4 (default) its Q and dO; 8 adds the fp32 dQ sums the blocks
 * reduce into, which share the L2 with them; a huge value makes every pair its own group (key tile fastest). */
#ifndef FC90B_PAIR_BYTES
#define FC90B_PAIR_BYTES 4.0
#endif
static int fc90b_kv_groups(const flashc_bwd_args *a, long long l2_bytes) {
    const double per_pair =
        (double)(FC90B_PAIR_BYTES) * (a->varlen ? (double)a->total_q / a->B : a->Nq) * a->D * (a->H / a->Hkv);
    return fc90_group_count((int64_t)a->Hkv * a->B, per_pair, l2_bytes);
}

template <int D, int BF>
static cudaError_t fc90b_run(const flashc_bwd_args *a, long long l2_bytes, cudaStream_t stream) {
    constexpr fc90_btile TL = fc90_btile_for(D);
    flashc_bwd_args k = *a;
    k.n_kblk = (a->Nk + TL.bn - 1) / TL.bn;
    const int64_t blocks = (int64_t)k.n_kblk * a->Hkv * a->B;
    if (blocks == 0) return cudaSuccess;
    if (blocks >= INT32_MAX) return cudaErrorInvalidValue; /* the block order's 32-bit arithmetic */
    k.kv_groups = fc90b_kv_groups(a, l2_bytes);
    CUtensorMap tm[5];
    /* Varlen: one batch of the packed rows (the tensors' batch strides unused). */
    const int64_t qr = a->varlen ? a->total_q : a->Nq, kr = a->varlen ? a->total_k : a->Nk, nb = a->varlen ? 1 : a->B;
    cudaError_t e = fc90_map(&tm[0], a->q, BF, D, qr, a->H, nb, a->q_sn, a->q_sh, a->q_sb, TL.bm);
    if (e == cudaSuccess) e = fc90_map(&tm[1], a->k, BF, D, kr, a->Hkv, nb, a->k_sn, a->k_sh, a->k_sb, TL.bn);
    if (e == cudaSuccess) e = fc90_map(&tm[2], a->v, BF, D, kr, a->Hkv, nb, a->v_sn, a->v_sh, a->v_sb, TL.bn);
    if (e == cudaSuccess) e = fc90_map(&tm[3], a->dout, BF, D, qr, a->H, nb, a->g_sn, a->g_sh, a->g_sb, TL.bm);
    if (e == cudaSuccess && a->dq_acc) e = fc90b_dq_map(&tm[4], a->dq_acc, D, a->H, (int)qr, (int)nb, FC90B_DQ_ROWS);
    else tm[4] = tm[0]; /* unused without dQ */
    if (e != cudaSuccess) return e;
    if (a->bm) { /* the bitmaps first, into the workspace (flashc_bwd_sm90_workspace) */
        if (!a->bm_tiles) return cudaErrorInvalidValue;
        const fc_bm_tiles_args bt = fc90b_bm_tiles_args(a);
        k.bm_tiles_w = fc_bm_tile_words(a->Nq, TL.bm);
        e = fc_bm_tiles_build(&bt, (uint32_t *)a->bm_tiles, stream);
        if (e != cudaSuccess) return e;
    }
    if (a->dq_acc) return fc90b_launch<D, BF, FC90B_DQ_TMA>(&k, tm, blocks, stream);
    return fc90b_launch<D, BF, FC90B_DQ_NONE>(&k, tm, blocks, stream);
}

int flashc_bwd_sm90_available(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (major != 9 || minor != 0) return 0;
    const void *kernels[2] = {(const void *)fc90_bwd_kernel<64, 1, FC90B_DQ_TMA, false>,
                              (const void *)fc90_bwd_kernel<128, 0, FC90B_DQ_NONE, false>};
    for (int i = 0; i < 2; i++) {
        cudaFuncAttributes fa;
        if (cudaFuncGetAttributes(&fa, kernels[i]) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        if (fa.binaryVersion != 90) return 0;
    }
    return fc90_encoder() != NULL;
}

/* A NULL pointer (a supported() query passes no tensors) stands for an aligned one. */
static int fc90b_tma_ok(const void *p, const int64_t e[3], const int64_t s[3]) {
    static const uint4 aligned_stand_in = {0, 0, 0, 0};
    return fc90_tma_ok(p ? p : &aligned_stand_in, e, s);
}

int flashc_bwd_sm90_supports(const flashc_bwd_args *a) {
    if (a->D != 64 && a->D != 128 && a->D != 256) return 0;
    if (a->dropout && a->bm) return 0; /* dropout: VARLEN kernels of its own, without block masks (mma.sync has both) */
    if (a->in_mode != FC_IN_ASYNC16) return 0;
    /* Block masks: a bitmap row in a builder block's 48 KB of shared memory (bm_tiles.cu) */
    if (a->bm && 2 * (size_t)fc_bm_tile_words(a->Nq, fc90_btile_for(a->D).bm) * 4 > 48 * 1024) return 0;
    if (!(a->score_mul > 0.f)) return 0;
    if (a->B < 1 || a->H < 1 || a->Hkv < 1 || a->H % a->Hkv || a->Nq < 1 || a->Nk < 1) return 0;
    const int64_t nb = a->varlen ? 1 : a->B;
    const int64_t eq[3] = {a->varlen ? a->total_q : a->Nq, a->H, nb}, ek[3] = {a->varlen ? a->total_k : a->Nk, a->Hkv, nb};
    const int64_t sq[3] = {a->q_sn, a->q_sh, a->q_sb}, sk[3] = {a->k_sn, a->k_sh, a->k_sb},
                  sv[3] = {a->v_sn, a->v_sh, a->v_sb}, sg[3] = {a->g_sn, a->g_sh, a->g_sb};
    return fc90b_tma_ok(a->q, eq, sq) && fc90b_tma_ok(a->k, ek, sk) && fc90b_tma_ok(a->v, ek, sv) &&
           fc90b_tma_ok(a->dout, eq, sg);
}

cudaError_t flashc_bwd_sm90_launch(const flashc_bwd_args *a, long long l2_bytes, cudaStream_t stream) {
    if (!flashc_bwd_sm90_supports(a) || !a->q || !a->k || !a->v || !a->dout) return cudaErrorInvalidValue;
    if (a->D == 64) return a->bf16 ? fc90b_run<64, 1>(a, l2_bytes, stream) : fc90b_run<64, 0>(a, l2_bytes, stream);
    if (a->D == 128) return a->bf16 ? fc90b_run<128, 1>(a, l2_bytes, stream) : fc90b_run<128, 0>(a, l2_bytes, stream);
    return a->bf16 ? fc90b_run<256, 1>(a, l2_bytes, stream) : fc90b_run<256, 0>(a, l2_bytes, stream);
}

size_t flashc_bwd_sm90_workspace(const flashc_bwd_args *a) {
    if (!a->bm) return 0;
    const fc_bm_tiles_args bt = fc90b_bm_tiles_args(a);
    return fc_bm_tiles_bytes(&bt);
}
