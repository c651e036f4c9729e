/*
 * fwd_sm90.cu - the attention forward on Hopper (sm_90a): wgmma tensor-core products, TMA loads completing on
 * mbarriers, and warp specialization. The Ampere-class kernel (fwd_sm80.cuh) stays the fallback for everything
 * this one does not take (fwd_sm90.h lists it) and for every other GPU.
 *
 * Algorithm: FlashAttention-3 forward (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao 2024, "FlashAttention-3:
 * Fast and Accurate Attention with Asynchrony and Low-precision"): section 3.1's producer-consumer warp
 * specialization with a circular buffer of K/V tiles and its ping-pong between consumer warpgroups, and
 * section 3.2's intra-warpgroup overlap of the softmax with the GEMMs. The online softmax is FlashAttention-2's,
 * in base 2, exactly as in fwd_sm80.cuh. The serial, ping-pong-only and overlap-only schedules it was measured
 * against are in lab/fwd90/.
 *
 * Block: 1 + br / 64 warpgroups working on tiles (query tile of br rows, head, sequence), one after another on
 * the persistent grid (see fc90_fwd_kernel's grid comment): 384 threads at br 128, 512 at br 192 (d 64, but
 * on the narrow tile of block masks, short causal problems and short Nq: fc90_tile_for).
 * Warpgroup 0 is the producer: it gives registers back (setmaxnreg.dec, fc90_producer_regs) and one thread takes
 * the tiles and issues the TMA loads: per tile Q once, then K and V tiles of bc keys into a ring of 2 stages
 * that runs on across tiles. The others are consumers (setmaxnreg.inc, fc90_consumer_regs), each owning 64 query
 * rows: per key tile, S = Q K^T by wgmma m64n{bc}k16 with Q and K in shared memory, masks and
 * the online softmax on the S accumulators, P rounded to 16 bits straight into wgmma's A-register fragment,
 * and O += P V by wgmma m64n{d}k16 with V in shared memory read N-major (transpose bit), since V is stored
 * keys x d. Tile sizes (bc 128 at d 64 and 128, 80 at d 256): fc90_tile_for in fwd_sm90.h.
 *
 * The consumers' schedule: turn j issues S_j = Q K_j^T and O += P_(j-1) V_(j-1) back to back (O is rescaled by
 * softmax j - 1's factor just before, since that P V is only added now), then runs softmax j on S_j, so S_j and
 * the packed P_(j-1) live in registers together. Ping-pong: the consumers take turns at issuing, round robin
 * (named barriers 1 .. consumers), so the tensor cores run one warpgroup's products while the others do their
 * softmax. Intra-warpgroup overlap: softmax j starts once S_j is done, while P_(j-1) V_(j-1) is still in flight.
 *
 * Shared memory holds every operand in the 128-byte swizzled layout, written by TMA (CU_TENSOR_MAP_SWIZZLE_128B)
 * and read by wgmma through descriptors with the same swizzle: a tile of R rows and d columns is d / 64 column
 * chunks, each R rows x 128 bytes (64 elements), the 16-byte pieces of row r XORed with r % 8. Every chunk
 * starts on a 1024-byte boundary, where the swizzle pattern repeats, so descriptors need no base offset.
 *
 * Barrier protocol (the rings of sm90.cuh's fc90_ring, which number the uses and keep the phase arithmetic:
 * a fresh mbarrier is in phase 0, and waiting for the parity of the phase before it returns at once):
 *   q_full       1 arrival (the producer's expect_tx) + the Q bytes; consumers wait for parity 0 once.
 *   k_full[s]    1 arrival (expect_tx) + the K bytes of the tile in slot s. Tile it uses slot it % 2 in its
 *                (it / 2)-th round; consumers wait for parity (it / 2) & 1.
 *   v_full[s]    the same for V.
 *   k_empty[s]   128 x consumers arrivals, one per consumer thread once its S = Q K^T of the tile in slot
 *                s is complete. Before refilling slot s for tile it the producer waits for parity
 *                ((it / 2) & 1) ^ 1: at once in round 0, then for the consumers' release of the round before.
 *   v_empty[s]   the same for V, released once P V is complete. V is read one turn after K, so a 2-stage
 *                ring per operand keeps a load a whole turn ahead of its use.
 * Turns: named barrier 1 + c is consumer c's turn, round robin; see fc90_turn_begin. Otherwise the warpgroups
 * synchronize only through the mbarriers; each consumer warp stages its own output rows.
 *
 * Scores and masks (score.cuh's shared step): key tiles outside the band of every row of the query tile (causal
 * or sliding window, fc_key_tiles) are never loaded; tiles cut by the band or by the end of the keys are masked
 * per element to -inf before the softmax (TMA zero-fills rows past the end of the keys and of the queries; rows
 * past Nq are computed and not written). Plain scores stay raw, the scale folded into the exponent; softcap and
 * ALiBi take every element through fc_score_row, under the P V product in flight like the rest of the softmax
 * (in kernels of their own, GENERIC, so that the plain kernels keep their registers).
 *
 * Varlen (kernels of their own, VARLEN): the tensor maps span the packed rows (one batch), a tile's sequence comes
 * from cu_seqlens, and its loads start at the sequence's first row; query tiles past a sequence's end
 * (max_seqlen_q is the grid's) have no work. A tile at the end of a sequence reads the next one's rows: its keys
 * are masked like keys past the end, and its V rows are cleared before P V (sm90.cuh's fc90_clear_rows), so that
 * no value of another sequence reaches the output. The same kernels run a per-sequence used key length
 * (seqused_k, fc_used_keys), varlen or not: keys past it are masked and their V rows cleared alike.
 *
 * Block masks (BMASK kernels, among the VARLEN ones): the mask comes as per-tile bitmaps built before the launch
 * (bm_tiles.cu; score.h's fc_bm_tile_bits): the producer and the consumers walk the set bits of the query tile's
 * row within the band's range, so tiles the mask drops are never loaded, and tiles it cuts (the row's second
 * half) are masked per block (fc_bm_mask_row) or, with a score modifier, per element (fc_score_row).
 *
 * Attention sinks: a row's sink joins the denominator in the epilogue (fc_sink_fold; VARLEN kernels, which also
 * run fixed-length problems), the lse includes it.
 *
 * Split-KV (VARLEN kernels, when the tiles fill less than a wave: decode, short query sides): a tile's key range in
 * nsplit pieces run as tiles of their own, each writing a normalized partial O and its lse (fc90_fwd_partials) for
 * fwd_combine.cu's combine. Paged K/V (VARLEN kernels at d 96-256): the tensor maps span the page pools and a key
 * tile loads as boxes of whole pages or one box inside a page (fc90_tile_pages); at four pages or more per tile one
 * load per page brings every column chunk (kv_groups, fc90_map_pages), with the slots laid out in 8-row groups.
 */
#include "bm_tiles.h" /* the block mask as per-tile bitmaps */
#include "common.cuh"
#include "fwd_sm90.h"
#include "score.cuh" /* the score / mask step and tile ranges every kernel shares */
#include "sm90.cuh"  /* mbarriers, TMA, setmaxnreg, wgmma */

#include <stdint.h>

/* Warpgroup 0 is the producer; 1 .. br / 64 are consumers (2, or 3 at d 64). */
__host__ __device__ constexpr int fc90_consumers(fc90_tile t) { return t.br / 64; }
__host__ __device__ constexpr int fc90_threads(fc90_tile t) { return FC90_WG_THREADS * (1 + fc90_consumers(t)); }
#define FC90_BAR_TURN 1     /* named barriers 1 .. consumers: the consumers' turns (0 is __syncthreads') */
#define FC90_BAR_VCLEAR 5   /* 5 .. 4 + consumers: one consumer's V tail cleared (varlen, fc90_clear_rows) */
#define FC90_PAGED_BOXES 8  /* paged K/V: at most this many pages per key tile (128 keys at pages of 16) */

/* Shared memory layout (bytes from a 1024-aligned base): Q, K stages, V stages, output staging (unless it
 * overlays Q and K), mbarriers. */
#define FC90_SMEM_MAX (227 * 1024) /* per block on sm_90 */
__host__ __device__ constexpr uint32_t fc90_q_bytes(fc90_tile t) { return (uint32_t)t.br * t.d * 2; }
__host__ __device__ constexpr uint32_t fc90_kv_bytes(fc90_tile t) { return (uint32_t)t.bc * t.d * 2; }
__host__ __device__ constexpr uint32_t fc90_off_k(fc90_tile t) { return fc90_q_bytes(t); }
__host__ __device__ constexpr uint32_t fc90_off_v(fc90_tile t) { return fc90_off_k(t) + t.st * fc90_kv_bytes(t); }
__host__ __device__ constexpr uint32_t fc90_end_v(fc90_tile t) { return fc90_off_v(t) + t.st * fc90_kv_bytes(t); }
__host__ __device__ constexpr uint32_t fc90_o_row(fc90_tile t) { return t.d + 8; } /* elements; odd 16-byte count */
__host__ __device__ constexpr uint32_t fc90_o_bytes(fc90_tile t) { return t.br * fc90_o_row(t) * 2; }
/* Barriers: q_full, q_empty, then k_full, v_full, k_empty, v_empty of st slots each, then the 8-byte slot where
 * the producer posts the block's next tile; + 1024: the dynamic shared memory base is only guaranteed 16-byte
 * aligned, and the kernel rounds it up. */
__host__ __device__ constexpr uint32_t fc90_tail_bytes(fc90_tile t) { return 8 * (2 + 4 * t.st) + 8 + 1024; }
/* The output staging has a place of its own after the V ring where it fits (d 64, 128); where it does not (d 256),
 * each thread stores its output pairs straight from the accumulators (fc90_fwd_epilogue), so that Q and the rings
 * stay free for the next tile's loads under the epilogue. Every tile runs on the persistent grid. */
__host__ __device__ constexpr bool fc90_o_staged(fc90_tile t) {
#ifdef FC90_O_UNSTAGED /* a lab build (FLASHC_CUDA_TILES_FILE) may store every tile's output unstaged */
    return false;
#else
    return fc90_end_v(t) + fc90_o_bytes(t) + fc90_tail_bytes(t) <= FC90_SMEM_MAX;
#endif
}

/* Registers per thread after setmaxnreg (multiples of 8). The block starts with 65536 / threads (launch bounds
 * with 1 block per SM): 168 with 2 consumers, 128 with 3; the consumers can only grow by what the producer gives
 * back. The producer keeps its tile loop's state in 40 (less spills it), with 3 consumers in 32, as they need 160
 * (S 64 + O 32 + P 32 and addresses); at d 256 in 24, so that the consumers have 240 (O 128, S 40, P 20 and the
 * rest; at 232 the plain kernel spilled, at 240 it does not, and the producers of the block-mask, dropout and
 * generic kernels spill a few words). */
__host__ __device__ constexpr int fc90_producer_regs(fc90_tile t) {
    return fc90_consumers(t) == 3 ? 32 : t.d > 128 ? 24 : 40;
}
__host__ __device__ constexpr int fc90_consumer_regs(fc90_tile t) {
    return fc90_consumers(t) == 3 ? 160 : t.d > 128 ? 240 : 232;
}
__host__ __device__ constexpr bool fc90_regs_fit(fc90_tile t) {
    /* setmaxnreg.inc only gets what setmaxnreg.dec gave back of the block's launch allocation (65536 / threads,
     * rounded down to 8, per thread): asking for more waits forever. */
    return FC90_WG_THREADS * ((65536 / fc90_threads(t)) / 8 * 8 - fc90_producer_regs(t)) >=
               FC90_WG_THREADS * fc90_consumers(t) * (fc90_consumer_regs(t) - (65536 / fc90_threads(t)) / 8 * 8) &&
           fc90_consumers(t) >= 2 && fc90_consumers(t) <= 3 && t.br % 64 == 0;
}
__host__ __device__ constexpr uint32_t fc90_off_o(fc90_tile t) { return fc90_end_v(t); } /* where fc90_o_staged */
__host__ __device__ constexpr uint32_t fc90_off_bar(fc90_tile t) {
    return fc90_end_v(t) + (fc90_o_staged(t) ? fc90_o_bytes(t) : 0);
}
__host__ __device__ constexpr uint32_t fc90_smem_bytes(fc90_tile t) { return fc90_off_bar(t) + fc90_tail_bytes(t); }
static_assert(fc90_smem_bytes(fc90_tile_for(64)) <= FC90_SMEM_MAX && fc90_smem_bytes(fc90_tile_for(128)) <= FC90_SMEM_MAX &&
                  fc90_smem_bytes(fc90_tile_for(256)) <= FC90_SMEM_MAX &&
                  fc90_smem_bytes(fc90_tile_for(64, true)) <= FC90_SMEM_MAX,
              "shared memory per block");

/* The kernels that take paged K/V (fc90_tile_pages): the VARLEN ones but for block masks and dropout, and not at d 64,
 * whose producer has 32 registers beside three consumers (the page loop made those kernels spill 60 bytes, not 12). */
__host__ __device__ constexpr bool fc90_paged_tile(fc90_tile t) { return fc90_consumers(t) == 2; }
template <int D, bool VARLEN, bool BMASK, bool DROP>
__host__ __device__ constexpr bool fc90_paged_kernel() {
    return VARLEN && !BMASK && !DROP && fc90_paged_tile(fc90_tile_for(D));
}

/* The K and V slots' layout: column chunk after column chunk, each the tile's bc rows of 128 bytes (8-row groups
 * 1024 bytes apart), or with kv_groups (paged kernels, sm90.cuh's fc90_map_pages: one load per page and operand)
 * 8-row group after group, each the group's d / 64 chunks of 1024 bytes. The descriptors take either: S = Q K^T
 * steps K's chunks by the chunk stride and its 8-row groups by the group stride; P V steps V's chunks (N) by the
 * chunk stride and 16 keys by two group strides. */
template <int D, bool VARLEN, bool BMASK, bool DROP>
static __device__ __forceinline__ bool fc90_kv_groups(const flashc_fwd_args &a) {
    return fc90_paged_kernel<D, VARLEN, BMASK, DROP>() && a.kv_groups;
}
template <int D>
__host__ __device__ constexpr uint32_t fc90_group_step(bool groups) {
    return groups ? (D / FC90_SW_COLS) * 1024u : 1024u;
}
/* The layout a main loop is compiled for: chunk after chunk, 8-row groups (kv_groups), or either as the kernel's
 * argument says (the d 256 kernels: with a main loop per layout their consumers spilled 92-116 bytes). */
enum { FC90_KV_CHUNKS = 0, FC90_KV_GROUPS = 1, FC90_KV_EITHER = 2 };
template <int L>
struct fc90_layout {
    static constexpr int value = L;
};

/* Whether a problem's scores take the generic element step (GENERIC kernels: a score modifier, softcap or ALiBi,
 * or a scale that the softmax's exponent cannot fold); the raw kernels keep their registers for the plain path
 * (with the generic step compiled in, the d 64 kernel spilled 96 bytes). */
static __host__ __device__ __forceinline__ bool fc90_generic(const flashc_fwd_args *a) {
    return !(fc_score_plain(*a) && a->score_mul > 0.f);
}

#if FC90_DEVICE

/* ---- the consumer's tile operations ------------------------------------------------------------------------ */

/* Issues s = Q K^T for this warpgroup's 64 rows and the bc keys of one ring slot (d / 16 k-steps) as one commit
 * group; the caller fences before and waits after. kcs: K's column-chunk step in 16-byte units (bc rows of 128
 * bytes, or one 1024-byte group with kv_groups). */
template <int D, int BF, bool NARROW>
static __device__ __forceinline__ void fc90_qk_issue(float (&s)[fc90_tile_for(D, NARROW).bc / 2], uint64_t dq,
                                                     uint64_t dk, uint32_t kcs) {
    constexpr fc90_tile TL = fc90_tile_for(D, NARROW);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        /* k16 step kk: chunk kk / 4, 32 bytes per step within its rows */
        const uint32_t qoff = (kk / 4) * TL.br * FC90_SW_ROW + (kk % 4) * 32;
        fc90_mma_ss<TL.bc, BF>(s, dq + (qoff >> 4), dk + (kk / 4) * kcs + (kk % 4) * 2, kk > 0);
    }
    fc90_wgmma_commit();
}

/* Keys past the end or outside row i's band to -inf (fc_row_keys, fc_mask_row); i0 is the thread's first row (the
 * second is i0 + 8), n0 the tile's first key. */
template <int BC>
static __device__ __forceinline__ void fc90_mask(const flashc_fwd_args &a, float (&s)[BC / 2], int i0, int n0, int nk,
                                                 int diag, int tig) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        int jlo, jhi;
        fc_row_keys(a, i0 + 8 * hf, diag, nk, jlo, jhi);
        fc_mask_row<true>(s, hf, jlo, jhi, n0, tig);
    }
}

/*
 * Online softmax step (fc_softmax_row) on raw scores s, the scale folded into the exponent's FFMA (smul =
 * score_mul): s becomes P, the row sums are rescaled by alpha. O is left alone: it must be scaled by alpha before
 * the next P V adds to it, which the consumers do only once the P V product in flight has completed.
 */
template <int BC, bool GENERIC>
static __device__ __forceinline__ void fc90_online_p(float (&s)[BC / 2], float (&row_m)[2], float (&row_l)[2],
                                                     float (&alpha)[2], float smul, const float (&shift)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
        alpha[hf] = GENERIC ? fc_softmax_row<false>(s, hf, row_m[hf], row_l[hf], smul, shift[hf])
                            : fc_softmax_row<false>(s, hf, row_m[hf], row_l[hf], smul);
}

/* o *= alpha, row by row (alpha[0] for the thread's first row, alpha[1] for the row 8 below). */
template <int D>
static __device__ __forceinline__ void fc90_rescale(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            o[4 * j + 2 * hf] *= alpha[hf];
            o[4 * j + 2 * hf + 1] *= alpha[hf];
        }
}

/* Issues o += P V, V from one ring slot, as one commit group; the caller fences before and waits after. vks: the
 * step of 16 keys in 16-byte units (two 8-row groups). */
template <int D, int BF, bool NARROW>
static __device__ __forceinline__ void fc90_pv_issue(float (&o)[D / 2],
                                                     const uint32_t (&pa)[fc90_tile_for(D, NARROW).bc / 16][4],
                                                     uint64_t dv, uint32_t vks) {
#pragma unroll
    for (int c = 0; c < fc90_tile_for(D, NARROW).bc / 16; ++c) fc90_mma_rs<D, BF>(o, pa[c], dv + c * vks);
    fc90_wgmma_commit();
}

/*
 * Keeps the softmax above the wgmma.wait_group that follows it, where it runs under the P V product in flight.
 * The pin orders it in the PTX, but ptxas schedules within a basic block and hoists the wait above independent
 * arithmetic (seen in the SASS: all exponentials after the wait). A branch ptxas cannot remove ends the block:
 * its condition (a NaN row sum, only from NaN or infinite inputs) is known only at run time, and what it
 * guards (a fence) changes nothing when taken.
 */
template <int N>
static __device__ __forceinline__ void fc90_block_end(float (&s)[N], float row_sum) {
    fc90_pin(s);
    if (row_sum != row_sum) asm volatile("membar.cta;\n" ::: "memory");
}

/*
 * The score and mask step on this warpgroup's part of the tile of keys from n0 (rows [w0, w0 + 63]; i0 is the
 * thread's first row). Plain scores (generic false) stay raw, the scale folded into the softmax's exponent, and
 * only the elements outside the band or past the end of the keys go to -inf, when either cuts the tile. With a
 * score modifier (softcap, ALiBi: generic) every element takes score.cuh's fc_score_row, and the softmax takes
 * the scores with the factor it returns. Returns the softmax's factor for the tile: smul (the raw path's scale),
 * or fc_score_row's; shift: the constants fc_score_row leaves to the softmax for the thread's two rows (generic).
 * BMASK: where the block mask cuts the tile (part; bmbase: fc_bm_base of the tile's sequence and head) the blocks
 * it drops go to -inf too (fc_bm_mask_row, or fc_score_row's element test).
 */
template <int BC, bool BMASK>
static __device__ __forceinline__ float fc90_scores(const flashc_fwd_args &a, float (&s)[BC / 2], int w0, int i0,
                                                    int n0, int nq, int nk, int diag, int tig, bool generic,
                                                    float slope2, bool part, const uint8_t *bmbase, float smul,
                                                    float (&shift)[2]) {
    const bool cut = fc_band_cuts(a, w0, w0 + 63, n0, n0 + BC - 1, diag, nk);
    part = BMASK && part;
    if (generic) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            smul = fc_score_row(a, s, hf, i0 + 8 * hf, n0, tig, diag, nq, nk, slope2, cut || part, part, bmbase,
                                &shift[hf]);
    } else {
        if (cut) fc90_mask<BC>(a, s, i0, n0, nk, diag, tig);
        if (part)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) fc_bm_mask_row(a, s, hf, bmbase, i0 + 8 * hf, n0, nq, nk, tig);
    }
    return smul;
}

/* The ping-pong's turn (FA3 section 3.1), a round robin over the NC consumers: consumer cw waits for its turn
 * before issuing its products and, once they are issued (not completed), hands the turn to the next, so that
 * the tensor cores take the warpgroups' products in turn and the others' softmax runs under them (with 3
 * consumers, two softmaxes under one's products). Consumer 0 takes the first turn (the last consumer arrives
 * once ahead); the last does not hand over after its last turn, so every arrival on a barrier meets a sync
 * and none is left pending at exit (every consumer of a block takes the same number of turns). */
static __device__ __forceinline__ void fc90_turn_begin(int cw) { fc90_nbar_sync(FC90_BAR_TURN + cw); }
template <int NC>
static __device__ __forceinline__ void fc90_turn_end(int cw, bool last) {
    if (!(last && cw == NC - 1)) fc90_nbar_arrive(FC90_BAR_TURN + (cw + 1) % NC);
}

/*
 * The tile order. A tile is (query tile, head, sequence); the heads (head-major within each sequence) go in ng
 * groups whose K and V fit in half the L2 together (fc90_head_groups), of sizes that differ by at most one, and
 * within a group the query tiles run from the last to the first (with causal masks the longest first), the group's
 * heads fastest. Both grids take the tiles in this order: BLOCKS as block indices, which the hardware starts in
 * order and hands to SMs as they free up; PERSISTENT from a counter, the same greedy longest-first schedule without
 * a block launch per tile. Equal groups give the launch's last group as many tiles as the others (or n_mblk
 * fewer): a remainder group of one head (d 128, N 16k: 128 causal tiles on 132 SMs) left its longest tile running
 * alone at the end.
 */
static __device__ __forceinline__ void fc90_tile_of(uint32_t t, uint32_t n_mblk, uint32_t H, uint32_t B, uint32_t ng,
                                                    int &mblk, int &h, int &b) {
    uint32_t hb;
    mblk = (int)(n_mblk - 1 - fc90_group_order(t, n_mblk, H * B, ng, &hb));
    h = (int)(hb % H);
    b = (int)(hb / H);
}

/* Sequence b's rows: its first query and key rows in the (packed, with varlen) tensors, q0 and k0, and its
 * lengths nq and nk; qb is its batch coordinate in the tensor maps (0 with varlen: one packed batch). */
struct fc90_seq {
    int q0, k0, nq, nk, qb;
};
template <bool VARLEN>
static __device__ __forceinline__ fc90_seq fc90_seq_of(const flashc_fwd_args &a, int b) {
    if constexpr (!VARLEN) return {0, 0, a.Nq, a.Nk, b};
    if (!a.varlen) return {0, 0, a.Nq, fc_used_keys(a, b, a.Nk), b}; /* fixed length, keys used per sequence */
    const int q0 = a.cu_q[b], k0 = a.cu_k[b];
    return {q0, k0, a.cu_q[b + 1] - q0, fc_used_keys(a, b, a.cu_k[b + 1] - k0), 0};
}

/* Key tiles [*tb, *te) that some row of query tile mblk sees under the band (fc_key_tiles); none for a tile past
 * the end of its sequence's queries (varlen: a shorter sequence than max_seqlen_q). With split-KV, split's share. */
template <int BR, int BC, bool VARLEN>
static __device__ __forceinline__ void fc90_key_tiles(const flashc_fwd_args &a, const fc90_seq &sq, int mblk, int split,
                                                      int *tb, int *te) {
    *tb = *te = 0;
    if (VARLEN && mblk * BR >= sq.nq) return;
    const int mlast = min(mblk * BR + BR, sq.nq) - 1;
    fc_key_tiles(a, mblk * BR, mlast, fc_diag(a, sq.nq, sq.nk), sq.nk, BC, tb, te);
    if (VARLEN && a.nsplit > 1) { /* split-KV: this split's share of them (as the mma.sync kernel cuts them) */
        const int per = (*te - *tb + a.nsplit - 1) / a.nsplit;
        *tb = min(*tb + split * per, *te);
        *te = min(*tb + per, *te);
    }
}

/* Split-KV (VARLEN kernels only, when the (query tile, head, sequence) tiles fill less than a wave): tile t of
 * the launch is split t % nsplit of the key range of tile t / nsplit, so that a tile's splits run side by side. */
template <bool VARLEN>
static __device__ __forceinline__ uint32_t fc90_split_of(const flashc_fwd_args &a, uint32_t t, int &split) {
    if (!VARLEN || a.nsplit <= 1) {
        split = 0;
        return t;
    }
    split = (int)(t % (uint32_t)a.nsplit);
    return t / (uint32_t)a.nsplit;
}


/*
 * Paged K/V (VARLEN kernels; flashc_fwd_sm90_supports: page sizes from 16 that divide the key tile or that it
 * divides). The tensor maps span the pools as (d, page_size, Hkv, num_pages), boxes of min(bc, page_size) rows, so
 * that a box never leaves its page: a tile of bc keys is bc / page_size boxes of whole pages, each at its row offset
 * in the tile (a multiple of 16 rows: the 128-byte swizzle's 1024-byte pattern stays aligned), or one box of a page
 * at (ktile bc) % page_size. Only the boxes that hold keys below nk (the sequence's used keys) are loaded, so no
 * table entry past them is read; the tile's rows past nk keep what the slot held, which the consumers mask (K) and
 * clear (V) as for any sequence end. A page outside [0, num_pages) is loaded from page 0 instead (never read out of
 * the pool); the consumers find it in the table themselves (fc90_bad_pages) and write NaN.
 */

/* The boxes of key tile ktile of sequence b (their count) and the page of box i (page 0 for one outside the pool,
 * or for i past the count, whose entry is not read): each lane of the producer warp reads the entry of its box. */
template <int BC>
static __device__ __forceinline__ int fc90_tile_pages(const flashc_fwd_args &a, int b, int ktile, int nk, int i,
                                                      int *page) {
    const int ps = a.page_size, box = min(BC, ps), key0 = ktile * BC;
    const int nbox = (min(BC, nk - key0) + box - 1) / box;
    const int e = i < nbox ? __ldg(a.block_table + (int64_t)b * a.bt_stride + key0 / ps + i) : 0;
    *page = (unsigned)e < (unsigned)a.num_pages ? e : 0;
    return nbox;
}

/* Whether the table names a page outside the pool for some key of [tb bc, min(te bc, nk)) of sequence b (the keys
 * this tile's split loaded): the warp's lanes read the entries in turn. Every lane of the warp calls it. */
template <int BC>
static __device__ __forceinline__ bool fc90_bad_pages(const flashc_fwd_args &a, int b, int tb, int te, int nk,
                                                      int lane) {
    const int ps = a.page_size, p1 = (min(te * BC, nk) + ps - 1) / ps;
    const int32_t *bt = a.block_table + (int64_t)b * a.bt_stride;
    bool bad = false;
    for (int p = tb * BC / ps + lane; p < p1; p += 32) bad |= (unsigned)__ldg(bt + p) >= (unsigned)a.num_pages;
    return __any_sync(0xffffffffu, bad);
}

/* The block's shared memory: the operand tiles (shared-memory addresses), the rings of Q (one slot per tile), K
 * and V, the output staging and the slot where the producer posts the block's next tile. */
template <int ST>
struct fc90_fwd_smem {
    uint32_t q, k, v;       /* Q tile, K and V rings of ST slots */
    uint16_t *o;            /* output staging (generic address) */
    fc90_ring<1> qr;        /* q_full / q_empty: one use per tile */
    fc90_ring<ST> kr, vr;   /* K and V: one use per key tile, counted over the block's run */
    volatile int *tile_slot;
};

/*
 * Producer (warp 0 of warpgroup 0 in the kernels that take paged K/V, else its first thread; lane 0 leads): takes
 * the tiles and issues the loads. Lane 0 does every barrier arrival, counter step and load but the paged K and V
 * boxes, which the lanes issue one box and 64-column chunk each (at pages of 16, 16 boxes of 2 KB per operand and
 * d 128 tile: from one thread they took 1.4x the contiguous time). Per tile Q once (q_full; a tile
 * without keys arrives without bytes, since its rows still get O = 0 and lse = +inf), then the K and V tiles of
 * its key range into the rings. The next tile comes from the counter once the current one's loads are out, and
 * is posted in the tile slot with the next Q, once the consumers have released the last one's (q_empty); -1 when
 * none is left. The last block to finish sets the counters back to zero for the next launch.
 */
template <int D, int BF, bool VARLEN, bool BMASK, bool DROP, bool NARROW>
static __device__ __forceinline__ void fc90_fwd_producer(const flashc_fwd_args &a, const CUtensorMap &tm_q,
                                                         const CUtensorMap &tm_k, const CUtensorMap &tm_v,
                                                         unsigned *ctr, int ng,
                                                         const fc90_fwd_smem<fc90_tile_for(D, NARROW).st> &sm,
                                                         int lane) {
    constexpr fc90_tile TL = fc90_tile_for(D, NARROW);
    constexpr int BR = TL.br, BC = TL.bc, NCH = D / FC90_SW_COLS;
    constexpr uint32_t KV_BYTES = fc90_kv_bytes(TL);
    constexpr bool PAGED = fc90_paged_kernel<D, VARLEN, BMASK, DROP>();
    static_assert(!PAGED || FC90_PAGED_BOXES * NCH <= 32, "a lane per paged box and chunk");
    const unsigned warp = PAGED ? 0xffffffffu : 1u; /* the lanes in the producer */
    const bool lead = lane == 0;
    const uint32_t tiles = (uint32_t)a.n_mblk * a.H * a.B * (VARLEN ? a.nsplit : 1); /* below 2^31 (fc90_run) */
    if (lead) {
        fc90_tma_prefetch(&tm_q);
        fc90_tma_prefetch(&tm_k);
        fc90_tma_prefetch(&tm_v);
    }
    uint32_t kv_it = 0; /* K/V tiles loaded so far: the rings' use count */
    uint32_t tile = blockIdx.x;
    for (uint32_t nt = 0;; ++nt) {
        sm.qr.wait_empty(nt); /* the consumers are done with the last tile's Q */
        if (tile >= tiles) {
            if (lead) {
                *sm.tile_slot = -1; /* no more tiles */
                sm.qr.arrive_full(nt);
            }
            break;
        }
        if (lead) *sm.tile_slot = (int)tile;
        int mblk, h, b, split;
        fc90_tile_of(fc90_split_of<VARLEN>(a, tile, split), a.n_mblk, a.H, a.B, ng, mblk, h, b);
        const fc90_seq sq = fc90_seq_of<VARLEN>(a, b);
        int tb, te;
        fc90_key_tiles<BR, BC, VARLEN>(a, sq, mblk, split, &tb, &te);
        /* BMASK: the band's key tiles that the block mask keeps for the tile (its bitmap row, fc_bm_tile_bits) */
        const uint32_t *keep = BMASK ? fc_bm_tile_bits(a, b, h, mblk, a.n_mblk) : NULL;
        const int hk = h / (a.H / a.Hkv), ntiles = BMASK && te > tb ? fc_bits_count(keep, tb, te) : te - tb;
        if (lead && ntiles > 0) {
            sm.qr.expect(nt, fc90_q_bytes(TL));
            for (int c = 0; c < NCH; ++c)
                fc90_tma_load(sm.q + c * BR * FC90_SW_ROW, &tm_q, sm.qr.full_bar(nt), c * FC90_SW_COLS,
                              sq.q0 + mblk * BR, h, sq.qb);
        } else if (lead) {
            sm.qr.arrive_full(nt);
        }
        /* Paged: with kv_groups lane i loads box i, every chunk (fc90_map_pages: box i's 8-row groups follow box
         * i - 1's); else lane i NCH + c loads chunk c of box i. */
        const bool groups = PAGED && a.kv_groups;
        const int bi = groups ? lane : lane / NCH, bch = groups ? 0 : lane % NCH; /* box, chunk */
        int ktile = tb - 1; /* the key tile of turn it */
        for (int it = 0; it < ntiles; ++it, ++kv_it) {
            ktile = BMASK ? fc_bits_next(keep, ktile + 1) : tb + it;
            /* The consumers read V one turn after K, so each has its own ring. */
            const uint32_t off = sm.kr.slot(kv_it) * KV_BYTES;
            if (PAGED && a.block_table) {
                int page;
                const int nbox = fc90_tile_pages<BC>(a, b, ktile, sq.nk, bi, &page);
                const uint32_t box = (uint32_t)min(BC, a.page_size), bytes = (uint32_t)nbox * box * D * 2;
                const int prow = (ktile * BC) % a.page_size; /* the first box's row in its page (the others: 0) */
                const int group = page * (a.page_size / 8) + prow / 8; /* kv_groups: the box's first 8-row group */
                const uint32_t dst = groups ? bi * box * D * 2 : (bch * BC + bi * box) * FC90_SW_ROW;
                /* One operand: its ring, map and slot. */
                auto load = [&](const auto &ring, const CUtensorMap &tm, uint32_t slot) {
                    ring.wait_empty(kv_it);
                    if (lead) ring.expect(kv_it, bytes);
                    __syncwarp(); /* the bytes expected before any box lands */
                    if (bi < nbox && groups)
                        fc90_tma_load5(slot + dst, &tm, ring.full_bar(kv_it), 0, 0, 0, group, hk);
                    else if (bi < nbox)
                        fc90_tma_load(slot + dst, &tm, ring.full_bar(kv_it), bch * FC90_SW_COLS, prow, hk, page);
                };
                load(sm.kr, tm_k, sm.k + off);
                load(sm.vr, tm_v, sm.v + off);
                continue;
            }
            /* Every lane waits with the lead, so that the warp stays converged (lanes that ran ahead to the next
             * tile's wait took issue slots from the lead's loads: contiguous decode 4% slower). */
            /* With 5-dimensional maps (kv_chunks) one load brings every column chunk of the tile's rows. */
            auto load = [&](const auto &ring, const CUtensorMap &tm, uint32_t slot) {
                ring.wait_empty(kv_it);
                if (!lead) return;
                ring.expect(kv_it, KV_BYTES);
                if (a.kv_chunks)
                    fc90_tma_load5(slot, &tm, ring.full_bar(kv_it), 0, sq.k0 + ktile * BC, 0, hk, sq.qb);
                else
                    for (int c = 0; c < NCH; ++c)
                        fc90_tma_load(slot + c * BC * FC90_SW_ROW, &tm, ring.full_bar(kv_it), c * FC90_SW_COLS,
                                      sq.k0 + ktile * BC, hk, sq.qb);
            };
            load(sm.kr, tm_k, sm.k + off);
            load(sm.vr, tm_v, sm.v + off);
        }
        /* The next tile is claimed once the last loads of this one are out, about two key tiles before its end:
         * the blocks then take the tiles in the order they come free, as the greedy longest-first schedule wants.
         * (Claimed with the tile's Q load instead, every block took its second tile at the start: causal d 256 at
         * N 16k ran 10% slower than a block per tile, long tiles paired with long ones.) */
        uint32_t next = tiles;
        if (ctr) {
            if (lead) next = gridDim.x + atomicAdd(ctr, 1u);
            next = __shfl_sync(warp, next, 0);
        }
        tile = next;
    }
    if (ctr && lead) {
        /* Every block's last counter increment precedes its arrival here; the last one resets both. */
        __threadfence();
        if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
            atomicExch(ctr, 0u);
            atomicExch(ctr + 1, 0u);
        }
    }
}

/*
 * One consumer warpgroup's products and softmax over the ntiles key tiles from key tile tb of a query tile (rings'
 * uses kv_it .. kv_it + ntiles - 1; slope2: the head's ALiBi slope in base 2; nq, nk: its sequence's lengths):
 * O (unnormalized), the row maxima and (thread-partial) sums. Turn it issues S_it = Q K_it^T
 * and O += P_(it-1) V_(it-1) together (O first rescaled by the alpha of softmax it - 1, whose P V is only now
 * added), then runs softmax it on S_it; the softmax starts once S_it is done, while P V still runs (so it must
 * leave O and the P fragments alone). Registers: S (bc / 2 floats) and the packed P of the tile before (bc / 4)
 * live together. Q is released after the tile's last S.
 */
template <int D, int BF, bool GENERIC, bool VARLEN, bool BMASK, bool DROP, bool NARROW, int LAYOUT>
static __device__ __forceinline__ void fc90_fwd_mainloop(const flashc_fwd_args &a, const fc_drop_stream &drop,
                                                         const fc90_fwd_smem<fc90_tile_for(D, NARROW).st> &sm,
                                                         uint32_t nt, uint32_t kv_it, int tb, int ntiles, const uint32_t *bits,
                                                         const uint8_t *bmbase, float slope2, int nq, int nk,
                                                         int m0, int cw, int row0, int tig,
                                                         uint64_t dq, uint64_t dk, uint64_t dv, float (&o)[D / 2],
                                                         float (&s)[fc90_tile_for(D, NARROW).bc / 2], float (&row_m)[2],
                                                         float (&row_l)[2]) {
    constexpr fc90_tile TL = fc90_tile_for(D, NARROW);
    constexpr int BC = TL.bc, NC = fc90_consumers(TL);
    constexpr uint32_t KV_BYTES = fc90_kv_bytes(TL);
    const int diag = fc_diag(a, nq, nk), w0 = m0 + 64 * cw; /* w0: this warpgroup's first row */
    const int t = threadIdx.x % FC90_WG_THREADS;
    /* The slots' layout (LAYOUT, fc90_kv_groups): K's column-chunk step and V's 16-key step, in 16-byte units;
     * constants where the kernel has a main loop per layout (with the layout read from the arguments, the d 128
     * contiguous decode measured 0.5-1% slower). */
    const bool groups = LAYOUT == FC90_KV_EITHER ? fc90_kv_groups<D, VARLEN, BMASK, DROP>(a) : LAYOUT == FC90_KV_GROUPS;
    const uint32_t kcs = (groups ? 1024u : BC * FC90_SW_ROW) >> 4, vks = 2 * fc90_group_step<D>(groups) >> 4;
    /* Varlen: before the P V of the key tile from key n0, clear V's rows past the sequence's end. */
    auto clear_v = [&](int n0, uint32_t use) {
        if (VARLEN && n0 + BC > nk)
            fc90_clear_rows<D>(sm.v + sm.vr.slot(use) * KV_BYTES, BC, nk - n0, FC90_BAR_VCLEAR + cw, t, groups);
    };
    /* The key tile of each turn: tb + it, or with a block mask (BMASK) the it-th set bit of the tile's bitmap
     * from tb, cut where the second half's bit is set, as the producer walks it. */
    int ktile = BMASK ? fc_bits_next(bits, tb) : tb;
    auto part_of = [&](int k) { return BMASK && fc_bit(bits + a.bm_tiles_w, k); };
    const float smul = GENERIC ? 1.f : a.score_mul;
    uint32_t pa[BC / 16][4];
    float alpha[2], shift[2] = {0.f, 0.f};
    /* Dropout (DROP): the keep bits of a tile (fc_drop_bits_rows, this warp's 16 rows), taken after the tile before
     * it is packed: S's registers are free there (under the other consumer's products), so more Philox chains run
     * at once than while S is in flight (lab/LOG.md); applied to P after the softmax (the row sums keep the dropped
     * entries), the factor 1 / (1 - p) in the epilogue. The next tile is tile + 1: no block mask with DROP. */
    static_assert(!(DROP && BMASK), "dropout's bits follow consecutive key tiles");
    uint32_t keep[(BC / 8 + 7) / 8];
    const int wrow0 = m0 + row0 - (threadIdx.x % 32) / 4; /* the warp's first row: fc_drop_bits_rows adds g */
    if (DROP) fc_drop_bits_rows<BC / 8>(drop, wrow0, tb * BC, threadIdx.x % 32, keep);
    if (cw == NC - 1) fc90_nbar_arrive(FC90_BAR_TURN + 0);

    sm.kr.wait_full(kv_it);
    fc90_turn_begin(cw);
    fc90_pin(s);
    fc90_wgmma_fence();
    fc90_qk_issue<D, BF, NARROW>(s, dq, dk + ((sm.kr.slot(kv_it) * KV_BYTES) >> 4), kcs);
    fc90_turn_end<NC>(cw, false);
    fc90_wgmma_wait<0>();
    fc90_pin(s);
    sm.kr.release(kv_it);
    if (ntiles == 1) sm.qr.release(nt);
    {
        const float sm = fc90_scores<BC, BMASK>(a, s, w0, m0 + row0, ktile * BC, nq, nk, diag, tig, GENERIC, slope2,
                                                part_of(ktile), bmbase, smul, shift);
        fc90_online_p<BC, GENERIC>(s, row_m, row_l, alpha, sm, shift);
    }
    if (DROP) fc_drop_apply(s, keep, 1.f);
    fc90_pack_p<BC, BF>(pa, s);
    if (DROP && ntiles > 1) fc_drop_bits_rows<BC / 8>(drop, wrow0, (tb + 1) * BC, threadIdx.x % 32, keep);

    for (int it = 1; it < ntiles; ++it) {
        const uint32_t kt = kv_it + it; /* K of this turn; V of the one before */
        const int kprev = ktile;
        ktile = BMASK ? fc_bits_next(bits, ktile + 1) : tb + it;
        sm.kr.wait_full(kt);
        sm.vr.wait_full(kt - 1);
        clear_v(kprev * BC, kt - 1);
        fc90_turn_begin(cw);
        fc90_rescale<D>(o, alpha);
        fc90_pin(s);
        fc90_pin(o);
        fc90_pin(pa);
        fc90_wgmma_fence();
        fc90_qk_issue<D, BF, NARROW>(s, dq, dk + ((sm.kr.slot(kt) * KV_BYTES) >> 4), kcs);
        fc90_pv_issue<D, BF, NARROW>(o, pa, dv + ((sm.vr.slot(kt - 1) * KV_BYTES) >> 4), vks);
        fc90_turn_end<NC>(cw, false);
        fc90_wgmma_wait<1>();
        fc90_pin(s);
        sm.kr.release(kt);
        if (it == ntiles - 1) sm.qr.release(nt);
        {
            const float sm = fc90_scores<BC, BMASK>(a, s, w0, m0 + row0, ktile * BC, nq, nk, diag, tig, GENERIC,
                                                    slope2, part_of(ktile), bmbase, smul, shift);
            fc90_online_p<BC, GENERIC>(s, row_m, row_l, alpha, sm, shift);
        }
        if (DROP) fc_drop_apply(s, keep, 1.f);
        fc90_block_end(s, row_l[0]);
        fc90_wgmma_wait<0>();
        fc90_pin(o);
        fc90_pin(pa);
        fc90_pack_p<BC, BF>(pa, s);
        sm.vr.release(kt - 1);
        if (DROP && it + 1 < ntiles) fc_drop_bits_rows<BC / 8>(drop, wrow0, (ktile + 1) * BC, threadIdx.x % 32, keep);
    }

    const uint32_t kt = kv_it + ntiles - 1;
    sm.vr.wait_full(kt);
    clear_v(ktile * BC, kt);
    fc90_turn_begin(cw);
    fc90_rescale<D>(o, alpha);
    fc90_pin(o);
    fc90_pin(pa);
    fc90_wgmma_fence();
    fc90_pv_issue<D, BF, NARROW>(o, pa, dv + ((sm.vr.slot(kt) * KV_BYTES) >> 4), vks);
    fc90_turn_end<NC>(cw, true);
    fc90_wgmma_wait<0>();
    fc90_pin(o);
    sm.vr.release(kt);
}

/* A quad's 4 x 4 transpose: lane tig of the quad holds v[k] = the k-th of 4 consecutive 8-column chunks' pair tig
 * (the accumulator layout) and gets chunk tig's 4 pairs (16 contiguous bytes of the row): two rounds of exchanges,
 * across lanes 2 apart (the chunks' high bit), then 1 apart. */
static __device__ __forceinline__ void fc_quad_transpose(uint32_t (&v)[4], int tig) {
    const bool hi = tig & 2, lo = tig & 1;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? v[s] : v[2 + s], 2);
        if (hi) v[s] = got;
        else v[2 + s] = got;
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, lo ? v[2 * m] : v[2 * m + 1], 1);
        if (lo) v[2 * m] = got;
        else v[2 * m + 1] = got;
    }
}

/*
 * One consumer warpgroup's epilogue of a query tile: O / l and lse = ln 2 * m + ln l (a row that saw no key gets
 * O = 0 and lse = +inf), written in the output type. With 16-byte aligned rows and a staging tile (fc90_o_staged)
 * each warp stages its own 16 rows (no other warp touches them) and stores 16 bytes per lane; without one (d 256)
 * each lane stores 16 bytes of its row once the quad's pairs are transposed (fc_quad_transpose); with rows not
 * so aligned, 2 bytes at a time. Columns from a.D on (a kernel of a larger head dim) are the zero fill's: never
 * written.
 * bad (paged, fc90_bad_pages): the rows come out NaN, out and lse.
 */
template <int D, int BF, bool VARLEN, bool BMASK, bool DROP, bool NARROW>
static __device__ __forceinline__ void fc90_fwd_epilogue(const flashc_fwd_args &a,
                                                         const fc90_fwd_smem<fc90_tile_for(D, NARROW).st> &sm,
                                                         float (&o)[D / 2],
                                                         const float (&row_m)[2], const float (&row_l)[2],
                                                         const fc90_seq &sq, int m0, int h, int b, int cw, int warp,
                                                         int lane, bool bad) {
    constexpr fc90_tile TL = fc90_tile_for(D, NARROW);
    constexpr int OROW = fc90_o_row(TL);
    constexpr bool STAGED = fc90_o_staged(TL);
    const int nq = sq.nq, g = lane / 4, tig = lane % 4, row0 = 64 * cw + 16 * warp + g;
    /* The sequence's rows in the output and the lse: (B, Nq, H, D) and (B, H, Nq), or with varlen the packed
     * (total_q, H, D) from row q0 and (H, total_q). */
    const bool packed = VARLEN && a.varlen; /* VARLEN kernels also run fixed-length problems with seqused_k */
    const int64_t ob = packed ? 0 : (int64_t)b * a.o_sb;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = row_l[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float inv = l > 0.f ? 1.f / l : 0.f, sink_lse = 0.f;
        if constexpr (VARLEN) /* sinks take the VARLEN kernels, so that the fixed-length ones keep their code */
            if (a.sinks) inv = fc_sink_fold(a.sinks[h], row_m[hf], l, sink_lse);
        if (DROP) inv *= a.drop_scale; /* kept entries of P times 1 / (1 - p) */
        if (VARLEN && bad) inv = sink_lse = __int_as_float(0x7fffffff); /* paged: a page outside the pool */
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[4 * j + 2 * hf] *= inv;
            o[4 * j + 2 * hf + 1] *= inv;
        }
        const int i = m0 + row0 + 8 * hf;
        if (tig == 0 && i < nq && a.lse)
            a.lse[(packed ? (int64_t)h * a.total_q + sq.q0 : ((int64_t)b * a.H + h) * nq) + i] =
                VARLEN && (a.sinks || bad) ? sink_lse : l > 0.f ? row_m[hf] * FC_LN2 + logf(l) : INFINITY;
    }

    const int wrow = 64 * cw + 16 * warp; /* this warp's first tile row */
    if (STAGED && a.out_vec) {
        uint16_t *sO = sm.o + wrow * OROW;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                *(uint32_t *)(sO + (g + 8 * hf) * OROW + 8 * j + 2 * tig) =
                    fc_pack2<BF>(o[4 * j + 2 * hf], o[4 * j + 2 * hf + 1]);
        __syncwarp();
        char *go = (char *)a.out + (ob + (int64_t)(sq.q0 + m0 + wrow) * a.o_sn + (int64_t)h * a.o_sh) * 2;
#pragma unroll
        for (int c = lane; c < 16 * (D / 8); c += 32) {
            const int r = c / (D / 8), ch = c % (D / 8);
            if (m0 + wrow + r < nq && ch * 8 < a.D)
                *(uint4 *)(go + (r * a.o_sn + ch * 8) * 2) = *(const uint4 *)(sO + r * OROW + ch * 8);
        }
        __syncwarp(); /* the staging rows are rewritten by the next tile's epilogue */
    } else if (a.out_vec) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + row0 + 8 * hf;
            uint16_t *orow = (uint16_t *)a.out + ob + (int64_t)(sq.q0 + i) * a.o_sn + (int64_t)h * a.o_sh;
#pragma unroll
            for (int j0 = 0; j0 < D / 8; j0 += 4) {
                uint32_t v[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) v[k] = fc_pack2<BF>(o[4 * (j0 + k) + 2 * hf], o[4 * (j0 + k) + 2 * hf + 1]);
                fc_quad_transpose(v, tig);
                if (i < nq && 8 * (j0 + tig) < a.D)
                    *(uint4 *)(orow + 8 * (j0 + tig)) = make_uint4(v[0], v[1], v[2], v[3]);
            }
        }
    } else {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + row0 + 8 * hf;
            if (i >= nq) continue;
            uint16_t *orow = (uint16_t *)a.out + ob + (int64_t)(sq.q0 + i) * a.o_sn + (int64_t)h * a.o_sh;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                if (8 * j < a.D) { /* rows not 16-byte aligned: 2-byte stores */
                    orow[8 * j + 2 * tig] = fc_round16<BF>(o[4 * j + 2 * hf]);
                    orow[8 * j + 2 * tig + 1] = fc_round16<BF>(o[4 * j + 2 * hf + 1]);
                }
        }
    }
}

/*
 * Split-KV's epilogue (VARLEN kernels): this split's normalized partial O and its lse (natural log, -inf when the
 * split saw no key of the row), fp32, into the workspace in the layout the combine reads (fwd_combine.cu: (nsplit,
 * H, total_q, D) and (nsplit, H, total_q)); sinks are the combine's; bad (paged, fc90_bad_pages): NaN for both. Rows
 * past the sequence's end are not written.
 */
template <int D>
static __device__ __forceinline__ void fc90_fwd_partials(const flashc_fwd_args &a, const float (&o)[D / 2],
                                                         const float (&row_m)[2], const float (&row_l)[2],
                                                         const fc90_seq &sq, int m0, int h, int b, int split, int cw,
                                                         int warp, int lane, bool bad) {
    const int g = lane / 4, tig = lane % 4, row0 = 64 * cw + 16 * warp + g;
    const int64_t grow0 = a.varlen ? sq.q0 : (int64_t)b * a.Nq; /* the sequence's first row in (H, total_q) */
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = row_l[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int i = m0 + row0 + 8 * hf;
        if (i >= sq.nq) continue;
        const float nan = __int_as_float(0x7fffffff), inv = bad ? nan : l > 0.f ? 1.f / l : 0.f;
        const int64_t r = ((int64_t)split * a.H + h) * a.total_q + grow0 + i;
        if (tig == 0) a.ws_lse[r] = bad ? nan : l > 0.f ? row_m[hf] * FC_LN2 + logf(l) : -INFINITY;
        float *wrow = a.ws_o + r * a.D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            if (8 * j + 2 * tig < a.D) /* a.D % 8 == 0 (TMA rows): the pair is whole */
                *(float2 *)(wrow + 8 * j + 2 * tig) = make_float2(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
    }
}

#endif /* FC90_DEVICE */

/*
 * Grid: BLOCKS, one block per tile (ctr NULL, gridDim.x = tiles), or PERSISTENT, one block per SM (ctr: two
 * counters in device memory, zero at launch): block x takes tile x first, then tile gridDim.x + the counter's
 * next value until none is left (fc90_fwd_producer). The consumers release Q and the tile slot (q_empty) after
 * their last S = Q K^T of a tile, so the next tile's Q and first K/V tiles load under the last P V and the
 * epilogue.
 * Tensor maps: q over (d, Nq, H, B), k and v over (d, Nk, Hkv, B) with d the caller's head dim (a kernel of a
 * larger D reads the columns past it as TMA's zero fill), boxes of 64 columns x (br or bc) rows.
 */
template <int D, int BF, bool GENERIC, bool VARLEN, bool BMASK, bool DROP, bool NARROW>
__global__ void __launch_bounds__(fc90_threads(fc90_tile_for(D, NARROW)), 1)
    fc90_fwd_kernel(const __grid_constant__ flashc_fwd_args a, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                    unsigned *ctr, int ng) {
#if FC90_DEVICE
    constexpr fc90_tile TL = fc90_tile_for(D, NARROW);
    constexpr int BR = TL.br, BC = TL.bc, ST = TL.st, NC = fc90_consumers(TL);
    static_assert(TL.d == D && D % 64 == 0 && fc90_regs_fit(TL) && BC % 16 == 0 && BC <= 256 && ST >= 2, "tile table");

    extern __shared__ uint8_t fc90_smem[];
    const uint32_t raw = fc_smem_addr(fc90_smem);
    const uint32_t base = (raw + 1023u) & ~1023u;
    const uint32_t bars = base + fc90_off_bar(TL); /* q_full, q_empty, k_full[st], v_full[st], k_empty[st], v_empty[st] */
    fc90_fwd_smem<ST> sm;
    sm.q = base, sm.k = base + fc90_off_k(TL), sm.v = base + fc90_off_v(TL);
    sm.o = (uint16_t *)(fc90_smem + (base - raw) + fc90_off_o(TL));
    sm.qr = {bars, bars + 8};
    sm.kr = {bars + 16, bars + 16 + 16 * ST};
    sm.vr = {bars + 16 + 8 * ST, bars + 16 + 24 * ST};
    sm.tile_slot = (volatile int *)(fc90_smem + (base - raw) + fc90_off_bar(TL) + 8 * (2 + 4 * ST));

    if (threadIdx.x == 0) {
        sm.qr.init(1, FC90_WG_THREADS * NC);
        sm.kr.init(1, FC90_WG_THREADS * NC); /* full: the producer's expect_tx; empty: every consumer thread */
        sm.vr.init(1, FC90_WG_THREADS * NC);
        fc90_bar_init_fence();
    }
    __syncthreads();

    const int wg = threadIdx.x / FC90_WG_THREADS;
    if (wg == 0) {
        /* The producer's warpgroup gives its registers back; its first warp (paged kernels) or thread issues the
         * loads. */
        fc90_regs_dec<fc90_producer_regs(TL)>();
        if (fc90_paged_kernel<D, VARLEN, BMASK, DROP>() ? threadIdx.x < 32 : threadIdx.x == 0)
            fc90_fwd_producer<D, BF, VARLEN, BMASK, DROP, NARROW>(a, tm_q, tm_k, tm_v, ctr, ng, sm, threadIdx.x);
        return;
    }

    /* Consumer warpgroup cw owns tile rows [64 cw, 64 cw + 64); this thread rows row0 and row0 + 8. */
    fc90_regs_inc<fc90_consumer_regs(TL)>();
    const int cw = wg - 1, t = threadIdx.x % FC90_WG_THREADS, warp = t / 32, lane = t % 32, g = lane / 4, tig = lane % 4;
    const int row0 = 64 * cw + 16 * warp + g;
    const uint64_t dq = fc90_desc(sm.q + 64 * cw * FC90_SW_ROW, 16, 1024);
    /* K: 8-row groups SBO apart; V: column chunks LBO apart, 8-key groups SBO apart (fc90_kv_groups' layouts) */
    const bool groups = fc90_kv_groups<D, VARLEN, BMASK, DROP>(a);
    const uint64_t dk = fc90_desc(sm.k, 16, fc90_group_step<D>(groups));
    const uint64_t dv = fc90_desc(sm.v, groups ? 1024 : BC * FC90_SW_ROW, fc90_group_step<D>(groups));
    uint32_t kv_it = 0; /* as the producer's */

    for (uint32_t nt = 0;; ++nt) {
        sm.qr.wait_full(nt);
        const int tile = *sm.tile_slot;
        if (tile < 0) break;
        int mblk, h, b, split;
        fc90_tile_of(fc90_split_of<VARLEN>(a, (uint32_t)tile, split), a.n_mblk, a.H, a.B, ng, mblk, h, b);
        const fc90_seq sq = fc90_seq_of<VARLEN>(a, b);
        int tb, te;
        fc90_key_tiles<BR, BC, VARLEN>(a, sq, mblk, split, &tb, &te);
        const uint32_t *bits = BMASK ? fc_bm_tile_bits(a, b, h, mblk, a.n_mblk) : NULL; /* as the producer's */
        const int m0 = mblk * BR, ntiles = BMASK && te > tb ? fc_bits_count(bits, tb, te) : te - tb;

        float o[D / 2], s[BC / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
        for (int i = 0; i < BC / 2; ++i) s[i] = 0.f;
        float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
        if (ntiles == 0) sm.qr.release(nt);
        /* the main loop for the slots' layout (fc90_layout) */
        auto mainloop = [&](auto layout) {
            fc90_fwd_mainloop<D, BF, GENERIC, VARLEN, BMASK, DROP, NARROW, decltype(layout)::value>(
                a, DROP ? fc_drop_begin(a, b, h) : fc_drop_stream{}, sm, nt, kv_it, tb, ntiles, bits,
                BMASK ? fc_bm_base(a, b, h) : (const uint8_t *)NULL, fc_alibi_slope2(a, b, h), sq.nq, sq.nk, m0, cw,
                row0, tig, dq, dk, dv, o, s, row_m, row_l);
        };
        constexpr bool PAGED = fc90_paged_kernel<D, VARLEN, BMASK, DROP>();
        if (ntiles > 0 && PAGED && D > 128)
            mainloop(fc90_layout<FC90_KV_EITHER>{});
        else if (ntiles > 0 && groups)
            mainloop(fc90_layout<PAGED ? FC90_KV_GROUPS : FC90_KV_CHUNKS>{});
        else if (ntiles > 0)
            mainloop(fc90_layout<FC90_KV_CHUNKS>{});
        kv_it += ntiles;
        /* paged: a page outside the pool among the keys this tile loaded makes its rows NaN (fc90_tile_pages) */
        const bool bad = fc90_paged_kernel<D, VARLEN, BMASK, DROP>() && a.block_table && ntiles > 0 &&
                         fc90_bad_pages<BC>(a, b, tb, te, sq.nk, lane);
        if (VARLEN && a.nsplit > 1)
            fc90_fwd_partials<D>(a, o, row_m, row_l, sq, m0, h, b, split, cw, warp, lane, bad);
        else
            fc90_fwd_epilogue<D, BF, VARLEN, BMASK, DROP, NARROW>(a, sm, o, row_m, row_l, sq, m0, h, b, cw, warp, lane,
                                                                  bad);
    }
#endif /* FC90_DEVICE */
}

template <int D, int BF, bool GENERIC, bool VARLEN, bool BMASK = false, bool DROP = false, bool NARROW = BMASK>
static cudaError_t fc90_launch_as(const flashc_fwd_args *k, const CUtensorMap *tq, const CUtensorMap *tk,
                                  const CUtensorMap *tv, int64_t blocks, unsigned *ctr, int ng, cudaStream_t stream) {
    const int smem = (int)fc90_smem_bytes(fc90_tile_for(D, NARROW));
    cudaError_t e = fc_smem_optin<fc90_fwd_kernel<D, BF, GENERIC, VARLEN, BMASK, DROP, NARROW>>(smem);
    if (e != cudaSuccess) return e;
    fc90_fwd_kernel<D, BF, GENERIC, VARLEN, BMASK, DROP, NARROW>
        <<<(unsigned)blocks, fc90_threads(fc90_tile_for(D, NARROW)), smem, stream>>>(*k, *tq, *tk, *tv, ctr, ng);
    return cudaGetLastError();
}
/* Kernels per (score step, varlen): the plain fixed-length kernels keep their registers and their code. The
 * VARLEN kernels also take fixed-length problems whose sequences use fewer keys (seqused_k): the tail clear of V
 * is what those need too (the unused keys' rows are the caller's memory, NaN included); and attention sinks,
 * whose fold in the epilogue the fixed-length kernels leave out; split-KV (fc90_split_of, fc90_fwd_partials); and
 * paged K/V (fc90_tile_pages).
 * Block masks take VARLEN kernels of their own (BMASK: the key tiles from the bitmaps, the element test on the
 * tiles the mask cuts). NARROW: the narrow d 64 tile (fwd_sm90.h), which the BMASK kernels take and, of the others,
 * the fixed-length kernels of short causal problems and of Nq that 192-row tiles would pad by half
 * (flashc_fwd_sm90_narrow). */
static bool fc90_varlen_kernel(const flashc_fwd_args *a) {
    return a->varlen || a->seqused_k || a->sinks || a->nsplit > 1 || a->block_table;
}

int flashc_fwd_sm90_narrow(const flashc_fwd_args *a) {
    if (fc90_kernel_d(a->D) != 64 || a->bm || a->dropout || fc90_varlen_kernel(a)) return 0;
    if (a->win_left < 0 && a->win_right == 0 && a->Nq <= FC90_NARROW_NQ) return 1; /* short causal */
    /* any mask: where the wide tiles compute FC90_NARROW_PAD times the narrow ones' rows or more */
    const int64_t wide = fc90_tile_for(64).br, narrow = fc90_tile_for(64, true).br;
    const int64_t wide_rows = (a->Nq + wide - 1) / wide * wide, narrow_rows = (a->Nq + narrow - 1) / narrow * narrow;
    return (double)wide_rows >= FC90_NARROW_PAD * (double)narrow_rows;
}

/* The tile of the kernel that fc90_launch picks for a. */
static fc90_tile fc90_tile_of_launch(const flashc_fwd_args *a) {
    return fc90_tile_for(fc90_kernel_d(a->D), a->bm || flashc_fwd_sm90_narrow(a));
}

template <int D, int BF>
static cudaError_t fc90_launch(const flashc_fwd_args *k, const CUtensorMap *tq, const CUtensorMap *tk,
                               const CUtensorMap *tv, int64_t blocks, unsigned *ctr, int ng, cudaStream_t stream) {
    const bool generic = fc90_generic(k);
    /* Dropout: a VARLEN kernel of its own (fixed-length problems too), plain scores only (supports() says) */
    if (k->dropout) return fc90_launch_as<D, BF, false, true, false, true>(k, tq, tk, tv, blocks, ctr, ng, stream);
    if (k->bm)
        return generic ? fc90_launch_as<D, BF, true, true, true>(k, tq, tk, tv, blocks, ctr, ng, stream)
                       : fc90_launch_as<D, BF, false, true, true>(k, tq, tk, tv, blocks, ctr, ng, stream);
    if (fc90_varlen_kernel(k))
        return generic ? fc90_launch_as<D, BF, true, true>(k, tq, tk, tv, blocks, ctr, ng, stream)
                       : fc90_launch_as<D, BF, false, true>(k, tq, tk, tv, blocks, ctr, ng, stream);
    if constexpr (D == 64) /* short causal problems and short Nq on the narrow tile */
        if (flashc_fwd_sm90_narrow(k)) {
            if (generic)
                return fc90_launch_as<D, BF, true, false, false, false, true>(k, tq, tk, tv, blocks, ctr, ng, stream);
            return fc90_launch_as<D, BF, false, false, false, false, true>(k, tq, tk, tv, blocks, ctr, ng, stream);
        }
    return generic ? fc90_launch_as<D, BF, true, false>(k, tq, tk, tv, blocks, ctr, ng, stream)
                   : fc90_launch_as<D, BF, false, false>(k, tq, tk, tv, blocks, ctr, ng, stream);
}

/* Groups of the tile order (fc90_tile_of): none holds more heads than have their K and V (16-bit, shared by the
 * query heads of a GQA group) in half the L2 together. */
static int fc90_head_groups(const flashc_fwd_args *a, long long l2_bytes) {
    return fc90_group_count((int64_t)a->H * a->B, 4.0 * a->Nk * a->D / (a->H / a->Hkv), l2_bytes);
}

/* Tiles of the launch, and whether its grid is persistent: with counters, and when there are more tiles than
 * SMs. */
static int64_t fc90_tiles(const flashc_fwd_args *a, fc90_tile tl) {
    return (int64_t)((a->Nq + tl.br - 1) / tl.br) * a->H * a->B * (a->nsplit > 1 ? a->nsplit : 1);
}
static int fc90_grid_persistent(const flashc_fwd_args *a, const fc90_grid *grid) {
    const fc90_tile tl = fc90_tile_of_launch(a);
    return grid->ctr && grid->sms > 0 && fc90_tiles(a, tl) > grid->sms;
}

/* The block mask by this kernel's tiles (bm_tiles.h), over the max lengths. */
static fc_bm_tiles_args fc90_bm_tiles_args(const flashc_fwd_args *a) {
    const fc90_tile tl = fc90_tile_of_launch(a);
    return fc_bm_tiles_args{a->bm, a->bm_q, a->bm_k, a->bm_batch, a->bm_heads, a->bm_nqb, a->bm_nkb, a->Nq, a->Nk,
                            tl.br, tl.bc, 0};
}

template <int D, int BF>
static cudaError_t fc90_run(const flashc_fwd_args *a, const fc90_grid *grid, cudaStream_t stream) {
    const fc90_tile TL = fc90_tile_of_launch(a);
    flashc_fwd_args k = *a;
    k.n_mblk = (a->Nq + TL.br - 1) / TL.br;
    const int64_t tiles = fc90_tiles(a, TL);
    if (tiles == 0) return cudaSuccess;
    if (tiles >= INT32_MAX) return cudaErrorInvalidConfiguration; /* more than a grid holds */
    const int persistent = fc90_grid_persistent(a, grid);
    const int64_t blocks = persistent ? grid->sms : tiles;
    unsigned *ctr = persistent ? grid->ctr : NULL;
    const int ng = fc90_head_groups(a, grid->l2_bytes);
    CUtensorMap tq, tk, tv;
    /* Varlen: one batch of the packed rows (the tensor's batch stride unused). */
    const int64_t qrows = a->varlen ? a->total_q : a->Nq, krows = a->varlen ? a->total_k : a->Nk;
    const int64_t nb = a->varlen ? 1 : a->B;
    /* Paged: K and V are pools (d, page_size, Hkv, num_pages) with boxes that stay inside a page (fc90_tile_pages). */
    const int64_t kr = a->block_table ? a->page_size : krows, kb = a->block_table ? a->num_pages : nb;
    const int kbox = a->block_table && a->page_size < TL.bc ? a->page_size : TL.bc;
    /* One query tile per (sequence, head): decode, each K/V row read once, so the L2 promotes only the 128 bytes
     * asked for. 256 bytes there made the L2 handle 1.25x the sectors the SMs asked for, the extra across the
     * partitions' fabric (B 16, Nk 32768, D 128, H200: DRAM at 89.5% of peak -> 90.8%; decode 0-4% faster).
     * Prefill keeps 256: 128 measured 4-8% slower there in one round with cold inputs (bench/compare_torch.py),
     * within that harness's spread, so not settled. */
    const bool l2_128 = k.n_mblk == 1;
    /* Decode from a contiguous cache with several 64-column chunks (D 128, 256): one load per tile and operand
     * (kv_chunks) instead of one per chunk. The TMA unit's cost is per load: boxes of 64, 32, 16 rows instead of
     * 128 made decode 1.5%, 7%, 17% slower (the paged path's 16-row boxes at pages of 16 lose the same), and the
     * 5-dimensional loads gained 0.4-0.8% (B x Nk 16 x 32768, 8 x 16384, 1 x 131072, H200; prefill not measured,
     * so it keeps the per-chunk loads). */
    bool chunks = l2_128 && !a->block_table && a->D == D && D > 64;
    /* Paged at four pages or more per key tile, with the pages one after another in rows (page stride = page_size
     * rows, as flashc_kv_offset's pools are laid out) and every column the kernel's: one load per page and operand
     * (fc90_map_pages, the slots in 8-row groups: kv_groups) instead of one per page and 64-column chunk. Decode
     * (H200, B x Nk 16 x 4096, 16 x 32768, 1 x 131072, d 128): paged / contiguous time 1.24-1.28 -> 1.15-1.19 at
     * pages of 16, 1.15-1.17 -> 1.09-1.13 at 32; d 256 at 16 (five pages per tile) 1.16 -> 1.07. At 64 it was level
     * (1.08-1.12 against 1.09-1.12), and at 256 (a tile inside a page: one load against two) 0-2% slower in most of
     * four rounds, so larger pages keep the boxes per chunk. */
    bool groups = a->block_table && a->D == D && D % 64 == 0 && fc90_paged_tile(TL) && 4 * a->page_size <= TL.bc &&
                  (a->num_pages == 1 || (a->k_sb == a->page_size * a->k_sn && a->v_sb == a->page_size * a->v_sn));
    if (groups) {
        cudaError_t g = fc90_map_pages(&tk, a->k, BF, a->D, a->page_size, a->Hkv, a->num_pages, a->k_sn, a->k_sh,
                                       kbox, l2_128);
        if (g == cudaSuccess)
            g = fc90_map_pages(&tv, a->v, BF, a->D, a->page_size, a->Hkv, a->num_pages, a->v_sn, a->v_sh, kbox, l2_128);
        groups = g == cudaSuccess; /* else the 4-dimensional page boxes */
    }
    cudaError_t e = fc90_map(&tq, a->q, BF, a->D, qrows, a->H, nb, a->q_sn, a->q_sh, a->q_sb, TL.br);
    if (e == cudaSuccess && !groups) {
        e = fc90_map(&tk, a->k, BF, a->D, kr, a->Hkv, kb, a->k_sn, a->k_sh, a->k_sb, kbox, l2_128, chunks);
        if (e == cudaSuccess)
            e = fc90_map(&tv, a->v, BF, a->D, kr, a->Hkv, kb, a->v_sn, a->v_sh, a->v_sb, kbox, l2_128, chunks);
        if (e != cudaSuccess && chunks) { /* a map the driver refuses in 5 dimensions: the 4-dimensional loads */
            chunks = false;
            e = fc90_map(&tk, a->k, BF, a->D, kr, a->Hkv, kb, a->k_sn, a->k_sh, a->k_sb, kbox, l2_128);
            if (e == cudaSuccess)
                e = fc90_map(&tv, a->v, BF, a->D, kr, a->Hkv, kb, a->v_sn, a->v_sh, a->v_sb, kbox, l2_128);
        }
    }
    if (e != cudaSuccess) return e;
    k.kv_chunks = chunks;
    k.kv_groups = groups;
    if (a->bm) { /* the bitmaps first, into the workspace (flashc_fwd_sm90_workspace) */
        if (!a->bm_tiles) return cudaErrorInvalidValue;
        const fc_bm_tiles_args bt = fc90_bm_tiles_args(a);
        k.bm_tiles_w = fc_bm_tile_words(a->Nk, TL.bc);
        e = fc_bm_tiles_build(&bt, (uint32_t *)a->bm_tiles, stream);
        if (e != cudaSuccess) return e;
    }
    return fc90_launch<D, BF>(&k, &tq, &tk, &tv, blocks, ctr, ng, stream);
}

int flashc_fwd_sm90_available(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (major != 9 || minor != 0) return 0;
    /* The sm_90a binary, not the sm_80 PTX (whose kernel body is empty), must be what this GPU runs. */
    const void *kernels[4] = {(const void *)fc90_fwd_kernel<64, 0, false, false, false, false, false>,
                              (const void *)fc90_fwd_kernel<64, 1, false, false, false, false, false>,
                              (const void *)fc90_fwd_kernel<128, 0, false, false, false, false, false>,
                              (const void *)fc90_fwd_kernel<128, 1, false, false, false, false, false>};
    for (int i = 0; i < 4; i++) {
        cudaFuncAttributes fa;
        if (cudaFuncGetAttributes(&fa, kernels[i]) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        if (fa.binaryVersion != 90) return 0;
    }
    return fc90_encoder() != NULL;
}

int flashc_fwd_sm90_supports(const flashc_fwd_args *a, int head_dim_compiled) {
    if (fc90_kernel_d(head_dim_compiled) == 0 || a->D != head_dim_compiled) return 0;
    if (a->in_mode != FC_IN_ASYNC16 || a->out_f32 || a->nsplit < 1) return 0;
    if (a->nsplit > 1 && (a->dropout || a->bm)) return 0; /* split-KV: the VARLEN kernels without a block mask */
    /* Paged K/V (fc90_tile_pages): boxes of whole pages from 16 rows that tile the key tile, or a key tile inside a
     * page; not with dropout or a block mask, nor at d 64 (the mma.sync kernel's per-row page loads take the rest). */
    if (a->block_table) {
        const fc90_tile tl = fc90_tile_for(fc90_kernel_d(head_dim_compiled));
        const int bc = tl.bc, ps = a->page_size;
        if (a->dropout || a->bm || !fc90_paged_tile(tl) || ps < 16 || ps % 16 || (bc % ps && ps % bc) ||
            (bc > ps && bc / ps > FC90_PAGED_BOXES))
            return 0;
    }
    /* Dropout: plain scores (no softcap, ALiBi or block mask) in kernels of their own; the rest on mma.sync. */
    if (a->dropout && (fc90_generic(a) || a->bm)) return 0;
    /* Block masks: a bitmap row in a builder block's 48 KB of shared memory (bm_tiles.cu), Nk below 25M keys. */
    if (a->bm && 2 * (size_t)fc_bm_tile_words(a->Nk, fc90_tile_for(fc90_kernel_d(a->D), true).bc) * 4 > 48 * 1024)
        return 0;
    if (a->B < 1 || a->H < 1 || a->Hkv < 1 || a->H % a->Hkv || a->Nq < 1 || a->Nk < 1) return 0;
    const int64_t nb = a->varlen ? 1 : a->B;
    const int64_t eq[3] = {a->varlen ? a->total_q : a->Nq, a->H, nb},
                  ek[3] = {a->block_table ? a->page_size : a->varlen ? a->total_k : a->Nk, a->Hkv,
                           a->block_table ? a->num_pages : nb};
    const int64_t sq[3] = {a->q_sn, a->q_sh, a->q_sb}, sk[3] = {a->k_sn, a->k_sh, a->k_sb},
                  sv[3] = {a->v_sn, a->v_sh, a->v_sb};
    return fc90_tma_ok(a->q, eq, sq) && fc90_tma_ok(a->k, ek, sk) && fc90_tma_ok(a->v, ek, sv);
}

int flashc_fwd_sm90_splits(const flashc_fwd_args *a, int sms) {
    if (fc90_kernel_d(a->D) == 0) return 1;
    const fc90_tile tl = fc90_tile_for(fc90_kernel_d(a->D));
    flashc_fwd_args one = *a;
    one.nsplit = 1;
    return fc_split_count(fc90_tiles(&one, tl), sms, (a->Nk + tl.bc - 1) / tl.bc);
}

cudaError_t flashc_fwd_sm90_launch(const flashc_fwd_args *a, const fc90_grid *grid, cudaStream_t stream) {
    switch (fc90_kernel_d(a->D)) {
    case 64: return a->bf16 ? fc90_run<64, 1>(a, grid, stream) : fc90_run<64, 0>(a, grid, stream);
    case 128: return a->bf16 ? fc90_run<128, 1>(a, grid, stream) : fc90_run<128, 0>(a, grid, stream);
    case 256: return a->bf16 ? fc90_run<256, 1>(a, grid, stream) : fc90_run<256, 0>(a, grid, stream);
    }
    return cudaErrorInvalidValue;
}

const char *flashc_fwd_sm90_grid_name(const flashc_fwd_args *a, const fc90_grid *grid) {
    return fc90_grid_persistent(a, grid) ? "persistent grid" : "a block per tile";
}

size_t flashc_fwd_sm90_workspace(const flashc_fwd_args *a) {
    if (!a->bm) return 0;
    const fc_bm_tiles_args bt = fc90_bm_tiles_args(a);
    return fc_bm_tiles_bytes(&bt);
}
