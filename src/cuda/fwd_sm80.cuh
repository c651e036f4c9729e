/*
 * fwd_sm80.cuh - the attention forward on tensor cores with mma.sync (sm_80 and later; built for sm_80 and
 * sm_90a). Included once per head dim by the translation units that sources.cmake generates.
 *
 * Algorithm: FlashAttention-2 forward (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
 * and Work Partitioning", Algorithm 1 with the section 3.2 partitioning). One thread block owns a tile of br
 * query rows of one (sequence, head); its warps split those rows (br / nw rows each, so no warp ever needs
 * another warp's softmax statistics). The Q tile goes to registers once (or stays in shared memory for large
 * head dims), K/V tiles of bc keys stream through a cp.async ring of st stages, S = Q K^T and O += P V run on
 * mma.sync.m16n8k16 with fp32 accumulators, and the online softmax runs in base 2 on the S accumulators in
 * registers: the running max m and sum l stay per row, O is rescaled by 2^(m_old - m_new), and O / l and
 * lse = ln 2 * m + ln l are written once at the end. Nothing of size Nq x Nk touches global memory.
 * Tile sizes (fc_tile_for in fwd_sm80.h, one column per architecture): br = 128 query rows for every head dim;
 * bc = 64 keys, except 32 at d 128 (64 spills) and at d 256 on Ampere (64 needs 203 KB of shared memory,
 * Hopper only); 4 warps of 2 m16 tiles up to d 128, 8 warps of 1 m16 tile above; 2 stages, 3 at d 64 and
 * d 128 on Hopper.
 *
 * Masks: key tiles outside the causal / sliding-window band of the whole query tile are never visited; tiles
 * whose every block-mask byte is 0 are never loaded; tiles cut by a band edge, the end of the keys, or a
 * partly-zero block mask are masked element by element. Split-KV (flash-decoding) gives each split a range of
 * key tiles and writes fp32 partials that fc_fwd_combine (fwd_combine.cu) merges.
 *
 * Precision: fp32 accumulation everywhere; Q, K, V and P enter the tensor cores as f16 or bf16. fp32 inputs are
 * rounded to bf16 on load (bf16 keeps fp32's range, so no input overflows) and the output is written in fp32:
 * accuracy is that of bf16 operands, about 3 significant digits (relative error ~1e-3..1e-2 against fp64, the
 * same rule as bf16 inputs), not fp32's 1e-5. Callers who need fp32 accuracy use the CPU backend.
 */
#ifndef FLASHC_CUDA_FWD_SM80_CUH
#define FLASHC_CUDA_FWD_SM80_CUH

#include "common.cuh"
#include "fwd_sm80.h"
#include "score.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

/* cp.async.cg.shared.global, 16 bytes global -> shared (L1 bypassed); bytes past src_bytes are zero-filled. */
static __device__ __forceinline__ void fc_cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
/* cp.async.commit_group: closes the group of this thread's cp.async issued since the last commit. */
static __device__ __forceinline__ void fc_cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::);
}
/* cp.async.wait_group N: waits until at most N of this thread's groups are still in flight. */
template <int N>
static __device__ __forceinline__ void fc_cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ldmatrix.m8n8.x4.b16: lanes 8j..8j+7 give the 8 row addresses of matrix j; register j gets matrix j's
 * elements (row lane/4, cols 2(lane%4), 2(lane%4)+1). */
static __device__ __forceinline__ void fc_ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/* ldmatrix.m8n8.x4.trans.b16: same addressing; register j gets matrix j transposed (rows 2(lane%4), +1 of
 * column lane/4 of the stored matrix). */
static __device__ __forceinline__ void fc_ldsm_x4_t(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C. A 16x16 row-major, 4 regs of 2 elements:
 * a0 (rows 0-7, k 0-7), a1 (rows 8-15, k 0-7), a2 (rows 0-7, k 8-15), a3 (rows 8-15, k 8-15), each thread
 * holding row lane/4, k 2(lane%4)+{0,1}; B 16x8 "col": b0 k 0-7, b1 k 8-15, thread holds k 2(lane%4)+{0,1} of
 * column lane/4; C/D fp32: c0,c1 row lane/4, c2,c3 row lane/4+8, columns 2(lane%4)+{0,1}. */
template <int BF>
static __device__ __forceinline__ void fc_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if (BF) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/* acc (MT x 2 NC n8 tiles) += A B, where A is the MT m16 x K fragment set packed from the fp32 accumulators x
 * (the accumulators of n8 tiles 2kc, 2kc+1 are exactly the A fragment of k16 step kc) and B (K x 16 NC) is read
 * transposed from shared-memory rows of rowb bytes starting at byte address b (already offset by the lane's
 * a_off pattern): the forward's O += P V, the backward's dV += P^T dO, dK += dS^T Q and dQ += dS K. */
template <int BF, int MT, int KC, int NC>
static __device__ __forceinline__ void fc_acc_product(float (*acc)[2 * NC][4], float (*x)[2 * KC][4], uint32_t b,
                                                          int rowb) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = fc_pack2<BF>(x[mt][2 * kc][0], x[mt][2 * kc][1]);
            pa[mt][1] = fc_pack2<BF>(x[mt][2 * kc][2], x[mt][2 * kc][3]);
            pa[mt][2] = fc_pack2<BF>(x[mt][2 * kc + 1][0], x[mt][2 * kc + 1][1]);
            pa[mt][3] = fc_pack2<BF>(x[mt][2 * kc + 1][2], x[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t bf[4];
            fc_ldsm_x4_t(bf, b + kc * 16 * rowb + c * 32);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                fc_mma<BF>(acc[mt][2 * c], pa[mt], bf[0], bf[1]);
                fc_mma<BF>(acc[mt][2 * c + 1], pa[mt], bf[2], bf[3]);
            }
        }
    }
}

/*
 * Tile load, rows (R) x cols (D) into shared memory rows of fc_smem_row(D) elements. Row r of the tile starts
 * at byte g + r * sn * element size. Rows >= nrows and columns >= dact read as zero, so padded head dims and
 * ragged tile ends contribute nothing to S and O (and no stale shared memory can inject NaN through P = 0).
 */
template <int R, int D, int NT, int BF>
static __device__ __forceinline__ void fc_load_tile(uint16_t *s, const char *g, int64_t sn, int nrows, int dact,
                                                    int mode, int tid) {
    constexpr int CH = D / 8, TOT = R * CH, ITER = (TOT + NT - 1) / NT, ROW = fc_smem_row(D);
    if (mode == FC_IN_ASYNC16 && NT % CH == 0) {
        /* Each thread copies one column chunk of every (NT / CH)-th row: one pointer, stepped. */
        constexpr int RSTEP = NT / CH;
        const int r0 = tid / CH, ch = tid % CH;
        const char *p = g + (r0 * sn + ch * 8) * 2;
        const int64_t step = RSTEP * sn * 2;
        const uint32_t d0 = fc_smem_addr(s + r0 * ROW + ch * 8);
        const bool colok = ch * 8 < dact;
#pragma unroll
        for (int it = 0; it < (R + RSTEP - 1) / RSTEP; ++it) {
            const int r = r0 + it * RSTEP;
            if (R % RSTEP == 0 || r < R) {
                const bool ok = colok && r < nrows;
                fc_cp_async16(d0 + it * RSTEP * ROW * 2, ok ? p : g, ok ? 16 : 0);
            }
            p += step;
        }
    } else if (mode == FC_IN_ASYNC16) {
        /* Not unrolled: unrolled, the per-chunk offsets are loop-invariant and get hoisted out of the main
         * loop into registers that the accumulators need. */
#pragma unroll 1
        for (int it = 0; it < ITER; ++it) {
            const int c = tid + it * NT;
            if (TOT % NT == 0 || c < TOT) {
                const int r = c / CH, ch = c % CH;
                const bool ok = r < nrows && ch * 8 < dact;
                const char *src = ok ? g + (r * sn + ch * 8) * 2 : g;
                fc_cp_async16(fc_smem_addr(s + r * ROW + ch * 8), src, ok ? 16 : 0);
            }
        }
    } else {
        /* Unaligned rows or f32 inputs: plain loads, rounded to the operand type (f32 -> bf16) on the way. */
        const int esz = mode == FC_IN_F32 ? 4 : 2;
#pragma unroll 1
        for (int it = 0; it < ITER; ++it) {
            const int c = tid + it * NT;
            if (TOT % NT == 0 || c < TOT) {
                const int r = c / CH, ch = c % CH;
                uint32_t w[4];
#pragma unroll
                for (int e = 0; e < 8; e += 2) {
                    uint32_t lo = 0, hi = 0;
                    const int col = ch * 8 + e;
                    if (r < nrows) {
                        const char *p = g + (r * sn + col) * esz;
                        if (mode == FC_IN_F32) {
                            if (col < dact) lo = fc_round16<BF>(__ldg((const float *)p));
                            if (col + 1 < dact) hi = fc_round16<BF>(__ldg((const float *)p + 1));
                        } else {
                            if (col < dact) lo = __ldg((const unsigned short *)p);
                            if (col + 1 < dact) hi = __ldg((const unsigned short *)p + 1);
                        }
                    }
                    w[e / 2] = lo | (hi << 16);
                }
                *(uint4 *)(s + r * ROW + ch * 8) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

/*
 * A K tile and its V tile from page pools (paged K/V, flashc_kv_offset's rule): row r of the tiles is key kr0 + r of
 * its sequence, row (kr0 + r) % ps of page bt[(kr0 + r) / ps]; gk / gv are the pools plus the head's offset, ksb / vsb
 * their page strides and ksn / vsn their row strides (elements). A tile of R <= 64 rows lies on at most 64 pages
 * (R at page size 1, at most R / 2 + 1 above), so each warp reads the tile's table entries once, lane l holding
 * entries l and 32 + l, and every row takes its page from them by a shuffle: one round trip to memory per tile
 * instead of one per row before its loads can be issued. A page outside [0, np) is not read: its rows load as zeros
 * and bad is set. Rows >= nrows and columns >= dact read as zero, as in fc_load_tile. Every lane of the warp runs
 * the whole loop (the shuffles need them all).
 */
template <int R, int D, int NT, int BF>
static __device__ __forceinline__ void fc_load_kv_paged(uint16_t *sk, uint16_t *sv, const char *gk, const char *gv,
                                                        int64_t ksb, int64_t ksn, int64_t vsb, int64_t vsn,
                                                        const int32_t *bt, int ps, int np, int kr0, int nrows,
                                                        int dact, int mode, int tid, int &bad) {
    constexpr int CH = D / 8, TOT = R * CH, ITER = (TOT + NT - 1) / NT, ROW = fc_smem_row(D);
    static_assert(R <= 64 && NT % 32 == 0, "two table words per lane cover a tile's pages");
    const int esz = mode == FC_IN_F32 ? 4 : 2, lane = tid & 31;
    const int pg0 = kr0 / ps, q0 = kr0 - pg0 * ps; /* row r: entry (q0 + r) / ps, row (q0 + r) % ps of its page */
    const int64_t kend = (int64_t)kr0 + nrows; /* keys past it are not read, nor their table entries */
    const int e0 = (int64_t)(pg0 + lane) * ps < kend ? __ldg(bt + pg0 + lane) : -1;
    const int e1 = (int64_t)(pg0 + 32 + lane) * ps < kend ? __ldg(bt + pg0 + 32 + lane) : -1;
    if (mode == FC_IN_ASYNC16 && NT % CH == 0) {
        /* As fc_load_tile's fast path: each thread one column chunk of every RSTEP-th row, unrolled; the entry and
         * the row in its page advance by RSTEP rows a step (one division per tile, not one per row). */
        constexpr int RSTEP = NT / CH;
        const int r0 = tid / CH, ch = tid % CH;
        int idx = (q0 + r0) / ps, prow = q0 + r0 - idx * ps;
        const bool colok = ch * 8 < dact;
        const uint32_t dk0 = fc_smem_addr(sk + r0 * ROW + ch * 8), dv0 = fc_smem_addr(sv + r0 * ROW + ch * 8);
#pragma unroll
        for (int it = 0; it < (R + RSTEP - 1) / RSTEP; ++it) {
            const int r = r0 + it * RSTEP;
            const int p0 = __shfl_sync(0xffffffffu, e0, idx & 31), p1 = __shfl_sync(0xffffffffu, e1, idx & 31);
            if (R % RSTEP == 0 || r < R) {
                const int page = idx < 32 ? p0 : p1;
                const bool valid = (unsigned)page < (unsigned)np;
                if (r < nrows && !valid) bad = 1;
                const bool ok = colok && r < nrows && valid;
                const int64_t kof = ((int64_t)page * ksb + prow * ksn + ch * 8) * 2;
                const int64_t vof = ((int64_t)page * vsb + prow * vsn + ch * 8) * 2;
                fc_cp_async16(dk0 + it * RSTEP * ROW * 2, ok ? gk + kof : gk, ok ? 16 : 0);
                fc_cp_async16(dv0 + it * RSTEP * ROW * 2, ok ? gv + vof : gv, ok ? 16 : 0);
            }
            prow += RSTEP;
            while (prow >= ps) prow -= ps, ++idx;
        }
        return;
    }
#pragma unroll 1
    for (int it = 0; it < ITER; ++it) {
        const int c = tid + it * NT;
        const int r = c / CH, ch = c % CH, key = kr0 + r;
        const int idx = key / ps - pg0; /* in [0, 64) for rows of this tile */
        const int p0 = __shfl_sync(0xffffffffu, e0, idx & 31), p1 = __shfl_sync(0xffffffffu, e1, idx & 31);
        if (!(TOT % NT == 0 || c < TOT)) continue;
        const char *krow = NULL, *vrow = NULL;
        if (r < nrows) {
            const int page = idx < 32 ? p0 : p1;
            const int64_t prow = key - (int64_t)(pg0 + idx) * ps;
            if ((unsigned)page < (unsigned)np) {
                krow = gk + ((int64_t)page * ksb + prow * ksn) * esz;
                vrow = gv + ((int64_t)page * vsb + prow * vsn) * esz;
            } else {
                bad = 1;
            }
        }
        const uint32_t dst = r * ROW + ch * 8;
        if (mode == FC_IN_ASYNC16) {
            const bool ok = krow && ch * 8 < dact;
            fc_cp_async16(fc_smem_addr(sk + dst), ok ? krow + ch * 16 : gk, ok ? 16 : 0);
            fc_cp_async16(fc_smem_addr(sv + dst), ok ? vrow + ch * 16 : gv, ok ? 16 : 0);
            continue;
        }
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
            const char *row = kv ? vrow : krow;
            uint32_t w[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                uint32_t lo = 0, hi = 0;
                const int col = ch * 8 + e;
                if (row) {
                    const char *p = row + col * esz;
                    if (mode == FC_IN_F32) {
                        if (col < dact) lo = fc_round16<BF>(__ldg((const float *)p));
                        if (col + 1 < dact) hi = fc_round16<BF>(__ldg((const float *)p + 1));
                    } else {
                        if (col < dact) lo = __ldg((const unsigned short *)p);
                        if (col + 1 < dact) hi = __ldg((const unsigned short *)p + 1);
                    }
                }
                w[e / 2] = lo | (hi << 16);
            }
            *(uint4 *)((kv ? sv : sk) + dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

/*
 * Grid: one block per (query tile, split, head, sequence), flattened into x with the query tile fastest (the
 * blocks of one head run together and share K/V in L2) and in reverse order (with causal masks the longest rows
 * start first). Block: nw warps; warp w owns query rows [w * 16 mt, (w + 1) * 16 mt) of the tile.
 */
template <int D, int BF, bool DEC, bool DROP>
__global__ void __launch_bounds__((DEC ? fc_tile_dec(D) : fc_tile_for(D, FC_SM90)).nw * 32,
                                  (DEC ? fc_tile_dec(D) : fc_tile_for(D, FC_SM90)).minb)
    fc_fwd_kernel(const __grid_constant__ flashc_fwd_args a) {
    constexpr fc_tile TL = DEC ? fc_tile_dec(D) : fc_tile_for(D, FC_SM90);
    constexpr int BR = TL.br, BC = TL.bc, NW = TL.nw, ST = TL.st, NT = NW * 32;
    constexpr int MT = BR / (16 * NW);  /* m16 tiles per warp */
    constexpr int ROW = fc_smem_row(D), ROWB = ROW * 2;
    constexpr int NKT = BC / 8, NDT = D / 8, KD = D / 16, KC = BC / 16;
    constexpr bool QREG = TL.qreg != 0;
    static_assert(TL.d == D && D % 16 == 0 && BC % 16 == 0, "tile table");
    static_assert(MT >= 1 && BR == MT * 16 * NW && ST >= 2, "tile table");

    extern __shared__ __align__(16) uint16_t fc_smem[];
    uint16_t *sQ = fc_smem, *sK = sQ + BR * ROW, *sV = sK + ST * BC * ROW;
    __shared__ int s_tile[ST], s_part[ST];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;

    int64_t bid = blockIdx.x;
    const int mblk = a.n_mblk - 1 - (int)(bid % a.n_mblk);
    bid /= a.n_mblk;
    const int split = (int)(bid % a.nsplit);
    bid /= a.nsplit;
    const int h = (int)(bid % a.H), b = (int)(bid / a.H);

    int64_t q0 = 0, k0 = 0;
    int nq = a.Nq, nk = a.Nk;
    if (a.varlen) {
        q0 = a.cu_q[b];
        nq = a.cu_q[b + 1] - a.cu_q[b];
        k0 = a.cu_k[b];
        nk = a.cu_k[b + 1] - a.cu_k[b];
    }
    nk = fc_used_keys(a, b, nk);
    const int m0 = mblk * BR;
    if (m0 >= nq) return; /* varlen: this sequence is shorter than max_seqlen_q */
    const int mlast = min(m0 + BR, nq) - 1;
    const int hk = h / (a.H / a.Hkv);
    const int bb = a.varlen ? 0 : b;
    const int diag = fc_diag(a, nq, nk); /* query row i's diagonal key is i + diag (score.h) */

    /* Key tiles any row of this tile may see under the causal / window band; then this split's share of them. */
    int tb, te;
    fc_key_tiles(a, m0, mlast, diag, nk, BC, &tb, &te);
    if (a.nsplit > 1) {
        const int per = (te - tb + a.nsplit - 1) / a.nsplit;
        tb = min(tb + split * per, te);
        te = min(tb + per, te);
    }

    const int esz = a.in_mode == FC_IN_F32 ? 4 : 2;
    const char *gq = (const char *)a.q + ((int64_t)bb * a.q_sb + (q0 + m0) * a.q_sn + (int64_t)h * a.q_sh) * esz;
    const int k0i = a.block_table ? 0 : (int)k0; /* cu_seqlens are int32; paged: cu_k gives lengths only */
    const uint8_t *bmrow = a.bm ? fc_bm_base(a, b, h) : NULL;

    /* Paged K/V: tile t of this sequence from its pages, row by row (each row's page looked up). A tile inside
     * one page loaded as one strided block would need fewer instructions, but that second path made the d 128
     * kernel spill 64 bytes on sm_90a (8 without it, as before paging). */
    int bad = 0; /* a page outside the pool was named: this tile's rows come out NaN */
    auto load_paged = [&](int slot, int t) {
        fc_load_kv_paged<BC, D, NT, BF>(sK + slot * BC * ROW, sV + slot * BC * ROW,
                                        (const char *)a.k + (int64_t)hk * a.k_sh * esz,
                                        (const char *)a.v + (int64_t)hk * a.v_sh * esz, a.k_sb, a.k_sn, a.v_sb,
                                        a.v_sn, a.block_table + (int64_t)b * a.bt_stride, a.page_size, a.num_pages,
                                        t * BC, nk - t * BC, a.D, a.in_mode, tid, bad);
    };

    /* K/V ring: slot s holds tile s_tile[s] (-1: none left); written by thread 0 when the load is issued and
     * read by everyone after the barrier that also publishes the data. */
    int cand = tb;
    auto issue_next = [&](int slot) {
        int part;
        const int t = fc_next_key_tile<BC, NT>(a, bmrow, cand, te, m0, mlast, nk, tid, &part);
        if (tid == 0) {
            s_tile[slot] = t < te ? t : -1;
            s_part[slot] = part;
        }
        if (t < te && a.block_table) {
            load_paged(slot, t);
            cand = t + 1;
        } else if (t < te) {
            /* Tile addresses are rebuilt per tile: two 64-bit pointers kept live would cost registers that the
             * accumulators need (d 128 with 64-key tiles spills with them). */
            const int64_t kr = (int64_t)k0i + t * BC;
            const char *gk = (const char *)a.k + ((int64_t)bb * a.k_sb + kr * a.k_sn + (int64_t)hk * a.k_sh) * esz;
            const char *gv = (const char *)a.v + ((int64_t)bb * a.v_sb + kr * a.v_sn + (int64_t)hk * a.v_sh) * esz;
            fc_load_tile<BC, D, NT, BF>(sK + slot * BC * ROW, gk, a.k_sn,
                                        nk - t * BC, a.D, a.in_mode, tid);
            fc_load_tile<BC, D, NT, BF>(sV + slot * BC * ROW, gv, a.v_sn,
                                        nk - t * BC, a.D, a.in_mode, tid);
            cand = t + 1;
        } else {
            cand = te;
        }
        fc_cp_async_commit();
    };

    /* Q joins the first K/V group. */
    fc_load_tile<BR, D, NT, BF>(sQ, gq, a.q_sn, mlast - m0 + 1, a.D, a.in_mode, tid);
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) issue_next(s);

    const int wr0 = warp * 16 * MT; /* this warp's first row in the tile */
    /* Per-lane ldmatrix byte offsets: A operand (Q) and V (transposed B) read matrices (rows 0-7 | 8-15) x
     * (cols 0-7 | 8-15) in the order a0..a3 / b0,b1 of two n8 tiles; K (B operand) reads keys 0-7 then 8-15. */
    const uint32_t a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;
    const uint32_t b_off = ((lane & 7) + (lane >> 4) * 8) * ROWB + ((lane >> 3) & 1) * 16;
    const uint32_t sQa = fc_smem_addr(sQ) + wr0 * ROWB + a_off;
    const uint32_t sKa = fc_smem_addr(sK) + b_off, sVa = fc_smem_addr(sV) + a_off;

    float o[MT][NDT][4];
    float row_m[MT][2], row_l[MT][2];
    uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
        row_m[mt][0] = row_m[mt][1] = -INFINITY;
        row_l[mt][0] = row_l[mt][1] = 0.f;
    }
    const bool score_plain = fc_score_plain(a) && a.score_mul > 0.f;
    const float slope2 = fc_alibi_slope2(a, b, h);
    const fc_drop_stream drop = DROP ? fc_drop_begin(a, b, h) : fc_drop_stream{};

    for (int it = 0;; ++it) {
        fc_cp_async_wait<ST - 2>();
        __syncthreads();
        const int slot = it % ST;
        const int t = s_tile[slot];
        if (t < 0) break;
        const int part = s_part[slot];
        if (QREG && it == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < KD; ++kk) fc_ldsm_x4(qf[mt][kk], sQa + mt * 16 * ROWB + kk * 32);
        }
        issue_next((it + ST - 1) % ST);

        /* Dropout's keep bits of this tile (fc_drop_bits_rows), before S exists: the Philox work then has the
         * registers that S and the softmax need later, and only a few words of bits stay live across them. */
        uint32_t keep[DROP ? MT : 1][(NKT + 7) / 8];
        if (DROP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fc_drop_bits_rows<NKT>(drop, m0 + wr0 + mt * 16, t * BC, lane, keep[DROP ? mt : 0]);
        }

        /* S = Q K^T for this warp's rows: MT x NKT accumulators of m16n8. */
        float s[MT][NKT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NKT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
        const uint32_t kbase = sKa + slot * BC * ROWB, vbase = sVa + slot * BC * ROWB;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (QREG) {
                    af[mt][0] = qf[QREG ? mt : 0][QREG ? kk : 0][0];
                    af[mt][1] = qf[QREG ? mt : 0][QREG ? kk : 0][1];
                    af[mt][2] = qf[QREG ? mt : 0][QREG ? kk : 0][2];
                    af[mt][3] = qf[QREG ? mt : 0][QREG ? kk : 0][3];
                } else {
                    fc_ldsm_x4(af[mt], sQa + mt * 16 * ROWB + kk * 32);
                }
            }
#pragma unroll
            for (int nt2 = 0; nt2 < KC; ++nt2) {
                uint32_t bf[4];
                fc_ldsm_x4(bf, kbase + nt2 * 16 * ROWB + kk * 32);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    fc_mma<BF>(s[mt][2 * nt2], af[mt], bf[0], bf[1]);
                    fc_mma<BF>(s[mt][2 * nt2 + 1], af[mt], bf[2], bf[3]);
                }
            }
        }

        /* Scores in base 2: scale (or softcap), ALiBi, masks. */
        const int n0 = t * BC;
        const bool need_mask = part || fc_band_cuts(a, m0, mlast, n0, n0 + BC - 1, diag, nk);
        /* Without softcap, ALiBi or a cutting block mask the raw scores stay: the scale folds into the exponent's
         * FFMA (max(c s) = c max(s), c > 0), and the band only needs each row's kept column range. */
        const bool raw = score_plain && !part;
        float smul = raw ? a.score_mul : 1.f; /* or fc_score_row's factor */
        if (raw && need_mask) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    int jlo, jhi;
                    fc_row_keys(a, m0 + wr0 + mt * 16 + g + hf * 8, diag, nk, jlo, jhi);
                    fc_mask_row<true>(s[mt], hf, jlo, jhi, n0, tig);
                }
        } else if (!raw) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    /* Row i keeps keys of the band; the block mask, when it cuts the tile, per key. */
                    const int i = m0 + wr0 + mt * 16 + g + hf * 8;
                    smul = fc_score_row(a, s[mt], hf, i, n0, tig, diag, nq, nk, slope2, need_mask, part, bmrow);
                }
        }

        /* Online softmax (fc_softmax_row); the four lanes of a quad share a row. */
        float alpha[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                alpha[mt][hf] = fc_softmax_row<true>(s[mt], hf, row_m[mt][hf], row_l[mt][hf], smul);
        /* Once the row maxima settle (most tiles of a long row), no row of the warp moves: skip the rescale. */
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < NDT; ++dt) {
                    o[mt][dt][0] *= alpha[mt][0];
                    o[mt][dt][1] *= alpha[mt][0];
                    o[mt][dt][2] *= alpha[mt][1];
                    o[mt][dt][3] *= alpha[mt][1];
                }
        }

        /* Dropout: the dropped entries of P leave the product (the row sums above keep them: lse and the
         * normalization are the undropped softmax's); the kept ones are scaled by 1 / (1 - p) with 1 / l. */
        if (DROP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) fc_drop_apply(s[mt], keep[DROP ? mt : 0], 1.f);
        }

        /* O += P V: P is the S accumulators, packed. */
        fc_acc_product<BF, MT, KC, KD>(o, s, vbase, ROWB);
    }
    fc_cp_async_wait<0>();
    if (a.block_table) bad = __syncthreads_or(bad); /* uniform: every thread of the block is here */

    /* Epilogue: O / l, lse = ln 2 * m + ln l; a row that saw no key gets O = 0 and lse = +inf (a split's
     * partial gets -inf, the neutral element of the combine). */
    const int64_t grow0 = a.varlen ? q0 : (int64_t)b * a.Nq; /* row 0 of this sequence in (H, total_q) */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = row_l[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = l > 0.f ? 1.f / l : 0.f;
            float lse = l > 0.f ? row_m[mt][hf] * FC_LN2 + logf(l) : (a.nsplit > 1 ? -INFINITY : INFINITY);
            if (a.sinks && a.nsplit == 1) inv = fc_sink_fold(a.sinks[h], row_m[mt][hf], l, lse); /* split: combine's */
            if (DROP) inv *= a.drop_scale;
            if (bad) inv = lse = __int_as_float(0x7fffffff); /* a page outside the pool: NaN, never a quiet result */
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt) {
                o[mt][dt][2 * hf] *= inv;
                o[mt][dt][2 * hf + 1] *= inv;
            }
            const int i = m0 + wr0 + mt * 16 + g + hf * 8;
            if (tig == 0 && i < nq) {
                if (a.nsplit > 1)
                    a.ws_lse[((int64_t)split * a.H + h) * a.total_q + grow0 + i] = lse;
                else if (a.lse)
                    a.lse[(a.varlen ? (int64_t)h * a.total_q + q0 : ((int64_t)b * a.H + h) * a.Nq) + i] = lse;
            }
        }

    if (a.nsplit == 1 && a.out_vec) {
        /* Stage this warp's own rows of sQ (no other warp reads them), then store 16 bytes per lane. */
        uint16_t *sO = sQ + wr0 * ROW;
        __syncwarp(); /* the warp's last ldmatrix of these rows is behind every lane before they are overwritten */
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    *(uint32_t *)(sO + (mt * 16 + g + hf * 8) * ROW + dt * 8 + tig * 2) =
                        fc_pack2<BF>(o[mt][dt][2 * hf], o[mt][dt][2 * hf + 1]);
        __syncwarp();
        char *go = (char *)a.out + ((int64_t)bb * a.o_sb + (q0 + m0 + wr0) * a.o_sn + (int64_t)h * a.o_sh) * 2;
#pragma unroll
        for (int c = lane; c < 16 * MT * NDT; c += 32) {
            const int r = c / NDT, ch = c % NDT;
            if (m0 + wr0 + r < nq && ch * 8 < a.D)
                *(uint4 *)(go + (r * a.o_sn + ch * 8) * 2) = *(const uint4 *)(sO + r * ROW + ch * 8);
        }
    } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = m0 + wr0 + mt * 16 + g + hf * 8;
                if (i >= nq) continue;
                const int64_t orow = (int64_t)bb * a.o_sb + (q0 + i) * a.o_sn + (int64_t)h * a.o_sh;
                float *wrow = a.nsplit > 1 ? a.ws_o + (((int64_t)split * a.H + h) * a.total_q + grow0 + i) * a.D
                                           : NULL;
#pragma unroll
                for (int dt = 0; dt < NDT; ++dt) {
                    const int col = dt * 8 + tig * 2;
                    if (col >= a.D) continue;
                    const float v0 = o[mt][dt][2 * hf], v1 = o[mt][dt][2 * hf + 1];
                    const bool has1 = col + 1 < a.D;
                    if (wrow) {
                        wrow[col] = v0;
                        if (has1) wrow[col + 1] = v1;
                    } else if (a.out_f32) {
                        float *p = (float *)a.out + orow + col;
                        p[0] = v0;
                        if (has1) p[1] = v1;
                    } else {
                        uint16_t *p = (uint16_t *)a.out + orow + col;
                        p[0] = fc_round16<BF>(v0);
                        if (has1) p[1] = fc_round16<BF>(v1);
                    }
                }
            }
    }
}

template <int D, int BF, bool DEC, bool DROP = false>
static cudaError_t fc_fwd_run_as(const flashc_fwd_args *a, cudaStream_t stream, int what, fc_tile *tile,
                                 int *occupancy) {
    /* The tile column is the one the loaded kernel was compiled for (sm_90a binary, or sm_80 code/PTX); the
     * decode tile has one. */
    cudaFuncAttributes fa;
    cudaError_t e = cudaFuncGetAttributes(&fa, fc_fwd_kernel<D, BF, DEC, DROP>);
    if (e != cudaSuccess) return e;
    const fc_tile t = DEC ? fc_tile_dec(D) : fc_tile_for(D, fa.ptxVersion >= 90);
    const int smem = (int)fc_fwd_smem_bytes(t);
    e = fc_smem_optin<fc_fwd_kernel<D, BF, DEC, DROP>>(smem);
    if (what == 1) {
        /* A GPU without enough shared memory for this tile reports occupancy 0 (the host refuses the problem). */
        *tile = t;
        *occupancy = 0;
        if (e != cudaSuccess) {
            cudaGetLastError();
            return cudaSuccess;
        }
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(occupancy, fc_fwd_kernel<D, BF, DEC, DROP>, t.nw * 32, smem);
    }
    if (e != cudaSuccess) return e;
    const int64_t blocks = (int64_t)a->n_mblk * a->nsplit * a->H * a->B;
    fc_fwd_kernel<D, BF, DEC, DROP><<<(unsigned)blocks, t.nw * 32, smem, stream>>>(*a);
    return cudaGetLastError();
}
template <int D, int BF>
static cudaError_t fc_fwd_run(const flashc_fwd_args *a, cudaStream_t stream, int what, fc_tile *tile,
                              int *occupancy) {
    /* Dropout runs the main tile only (the host never picks the decode tile for it). */
    if (what == 0 && a->dropout) return fc_fwd_run_as<D, BF, false, true>(a, stream, 0, tile, occupancy);
    return what >= 2 ? fc_fwd_run_as<D, BF, true>(a, stream, what - 2, tile, occupancy)
                     : fc_fwd_run_as<D, BF, false>(a, stream, what, tile, occupancy);
}

#define FLASHC_FWD_INSTANTIATE(D)                                                                            \
    FC_FWD_ENTRY(D) {                                                                                        \
        return a->bf16 ? fc_fwd_run<D, 1>(a, stream, what, tile, occupancy)                                  \
                       : fc_fwd_run<D, 0>(a, stream, what, tile, occupancy);                                 \
    }

#endif /* FLASHC_CUDA_FWD_SM80_CUH */
