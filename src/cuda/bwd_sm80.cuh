/*
 * bwd_sm80.cuh - the attention backward on tensor cores with mma.sync (sm_80 and later; built for sm_80 and
 * sm_90a). Included once per head dim by the translation units that sources.cmake generates.
 *
 * Algorithm: FlashAttention-2 backward (Dao 2023, Algorithm 2). P is recomputed from q, k and the forward's lse,
 * never stored; D_i = rowsum(dO o O) comes from bwd.cu's preprocess kernel.
 *   fc_bwd_kv_kernel: one block per (key tile, kv head, sequence) keeps K_j, V_j in shared memory and dK_j, dV_j
 *     in registers while it walks the query tiles (of every query head of its GQA group) that the band and the
 *     block mask let see its keys. Its warps own key rows, so the products are taken transposed:
 *     S^T = K Q^T, dP^T = V dO^T, P^T = 2^(S^T - lse), dS^T = P^T o (dP^T - D), dV += P^T dO, dK += dS^T Q;
 *     the S^T / dP^T accumulators are, packed, exactly the A operand of the next product (as P is in the
 *     forward's O += P V), so neither P nor dS leaves registers for dK and dV. With a->dq_acc set, dS^T also goes
 *     to shared memory and the block adds dS K into the fp32 dQ sums with atomics (bwd.cu converts them).
 *   fc_bwd_q_kernel (deterministic mode): one block per (query tile, head, sequence) walks its visible key tiles
 *     and accumulates dQ += dS K in registers: S and dP are recomputed once more (7 tile products instead of 5)
 *     so that every dq element has one writer and a fixed order.
 * dK and dV always have one writer (the block of their key tile, summing a GQA group's heads in order), so they
 * are bitwise reproducible in both modes.
 *
 * Scores are formed as in the forward (fwd_sm80.cuh): base 2, scale folded into score_mul, softcap as
 * softcap2 tanh(s score_mul), ALiBi subtracted, the band and block mask applied per element only on tiles they
 * cut. Precision: Q, K, V, dO, P and dS enter the tensor cores as f16 / bf16 (fp32 inputs as bf16, like the
 * forward), every sum is fp32.
 */
#ifndef FLASHC_CUDA_BWD_SM80_CUH
#define FLASHC_CUDA_BWD_SM80_CUH

#include "bwd_sm80.h"
#include "fwd_sm80.cuh" /* the mma.sync / ldmatrix / cp.async helpers and fc_load_tile */
#include "score.cuh"     /* fc_bwd_elem, fc_mask_vote, FC_LOG2E */

/* cp.async.ca.shared.global, 4 bytes; zero-filled when src_bytes is 0. */
static __device__ __forceinline__ void fc_cp_async4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

/* dst[0] += x, dst[1] += y in global memory, unordered (fp32 atomics; one vector reduction on sm_90). */
static __device__ __forceinline__ void fc_red_add2(float *dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
#endif
}

/* Rows [i0, i0 + R) of a (lse-shaped) per-row fp32 vector into shared memory, zero past nrows. */
template <int R, int NT>
static __device__ __forceinline__ void fc_load_rowvec(float *s, const float *g, int nrows, int tid) {
    for (int r = tid; r < R; r += NT) fc_cp_async4(fc_smem_addr(s + r), r < nrows ? g + r : g, r < nrows ? 4 : 0);
}

/* s = A1 B1^T and dp = A2 B2^T over the head dim (KD k16 steps): A rows (MT m16 tiles, this warp's) and B rows
 * (2 KN n8 tiles) are both row-major in shared memory; a1/a2 carry the lane's a_off, b1/b2 its b_off. */
template <int BF, int MT, int KN, int KD>
static __device__ __forceinline__ void fc_bwd_scores(float (*s)[2 * KN][4], float (*dp)[2 * KN][4], uint32_t a1,
                                                     uint32_t a2, uint32_t b1, uint32_t b2, int rowb) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 2 * KN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
        uint32_t x1[MT][4], x2[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            fc_ldsm_x4(x1[mt], a1 + mt * 16 * rowb + kk * 32);
            fc_ldsm_x4(x2[mt], a2 + mt * 16 * rowb + kk * 32);
        }
#pragma unroll
        for (int n2 = 0; n2 < KN; ++n2) {
            uint32_t y1[4], y2[4];
            fc_ldsm_x4(y1, b1 + n2 * 16 * rowb + kk * 32);
            fc_ldsm_x4(y2, b2 + n2 * 16 * rowb + kk * 32);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                fc_mma<BF>(s[mt][2 * n2], x1[mt], y1[0], y1[1]);
                fc_mma<BF>(s[mt][2 * n2 + 1], x1[mt], y1[2], y1[3]);
                fc_mma<BF>(dp[mt][2 * n2], x2[mt], y2[0], y2[1]);
                fc_mma<BF>(dp[mt][2 * n2 + 1], x2[mt], y2[2], y2[3]);
            }
        }
    }
}

/* The sequence's row offsets and lengths (varlen) or the batch's. */
struct fc_bseq {
    int64_t q0, k0;
    int nq, nk, bb;
};
static __device__ __forceinline__ fc_bseq fc_bwd_seq(const flashc_bwd_args &a, int b) {
    fc_bseq s;
    if (a.varlen) {
        s.q0 = a.cu_q[b];
        s.nq = a.cu_q[b + 1] - a.cu_q[b];
        s.k0 = a.cu_k[b];
        s.nk = a.cu_k[b + 1] - a.cu_k[b];
        s.bb = 0;
    } else {
        s.q0 = s.k0 = 0;
        s.nq = a.Nq;
        s.nk = a.Nk;
        s.bb = b;
    }
    s.nk = fc_used_keys(a, b, s.nk);
    return s;
}

/* Index of row 0 of (sequence b, head h) in lse / D_i. */
static __device__ __forceinline__ int64_t fc_bwd_lse_row0(const flashc_bwd_args &a, const fc_bseq &s, int b, int h) {
    return a.varlen ? (int64_t)h * a.total_q + s.q0 : ((int64_t)b * a.H + h) * a.Nq;
}

/* Stores one pair of output elements (column col, col + 1 when has1) in the output dtype. */
static __device__ __forceinline__ void fc_bwd_store2(void *base, int64_t off, int64_t sd, int dtype, float v0,
                                                     float v1, bool has1) {
    if (dtype == FLASHC_DTYPE_F32) {
        float *p = (float *)base + off;
        p[0] = v0;
        if (has1) p[sd] = v1;
    } else {
        uint16_t *p = (uint16_t *)base + off;
        const int bf = dtype == FLASHC_DTYPE_BF16;
        p[0] = bf ? fc_round16<1>(v0) : fc_round16<0>(v0);
        if (has1) p[sd] = bf ? fc_round16<1>(v1) : fc_round16<0>(v1);
    }
}

/*
 * dK, dV (and atomic dQ). Grid: (key tile, kv head, sequence) flattened, key tile fastest: with causal masks the
 * first key tiles have the most queries, so the longest blocks start first. Block: nw warps; warp w owns keys
 * [16 mt (w / ds), 16 mt (w / ds + 1)) of the tile and columns [d/ds (w % ds), d/ds (w % ds + 1)) of dK, dV.
 */
template <int D, int BF, bool DROP>
__global__ void __launch_bounds__(fc_btile_for(D).nw * 32, fc_btile_for(D).minb) fc_bwd_kv_kernel(const __grid_constant__ flashc_bwd_args a) {
    constexpr fc_btile TL = fc_btile_for(D);
    constexpr int BK = TL.bk, BQ = TL.bq, NW = TL.nw, DS = TL.ds, NT = NW * 32;
    constexpr int NG = NW / DS, MT = BK / (16 * NG);
    constexpr int ROW = fc_smem_row(D), ROWB = ROW * 2;
    constexpr int KD = D / 16, KQ = BQ / 16, DW = D / DS, DSROW = BQ + 8;
    constexpr int RG = BQ / 16, CG = NW / RG, NCH = (KD + CG - 1) / CG; /* dQ product: warps as RG x CG */
    static_assert(TL.d == D && D % 16 == 0 && DW % 16 == 0 && MT >= 1 && BK == MT * 16 * NG, "tile table");
    static_assert(NW % RG == 0 && BQ % 16 == 0, "tile table");

    extern __shared__ __align__(16) uint16_t fc_smem[];
    uint16_t *sK = fc_smem, *sV = sK + BK * ROW, *sQ = sV + BK * ROW, *sG = sQ + 2 * BQ * ROW;
    float *sL = (float *)(sG + 2 * BQ * ROW), *sDv = sL + 2 * BQ;
    uint16_t *sDS = (uint16_t *)(sDv + 2 * BQ);
    __shared__ int s_item[2], s_part[2];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    int64_t bid = blockIdx.x;
    const int kt = (int)(bid % a.n_kblk);
    bid /= a.n_kblk;
    const int hk = (int)(bid % a.Hkv), b = (int)(bid / a.Hkv);
    const fc_bseq sq = fc_bwd_seq(a, b);
    const int nq = sq.nq, nk = sq.nk, diag = fc_diag(a, nq, nk);
    const int j0 = kt * BK;
    if (j0 >= nk) return; /* varlen: this sequence has fewer keys than max_seqlen_k */
    const int jlast = min(j0 + BK, nk) - 1;
    const int group = a.H / a.Hkv;

    /* Query tiles whose rows can see these keys under the band. */
    int ilo, ihi;
    fc_query_rows(a, j0, jlast, diag, nq, &ilo, &ihi);
    const int qtb = ilo / BQ, nqt = ilo <= ihi ? ihi / BQ - qtb + 1 : 0;
    const int items = nqt * group; /* (head of the group, query tile), the tile fastest */

    const int esz = a.in_mode == FC_IN_F32 ? 4 : 2;
    {
        const int64_t kr = sq.k0 + j0;
        const char *gk = (const char *)a.k + ((int64_t)sq.bb * a.k_sb + kr * a.k_sn + (int64_t)hk * a.k_sh) * esz;
        const char *gv = (const char *)a.v + ((int64_t)sq.bb * a.v_sb + kr * a.v_sn + (int64_t)hk * a.v_sh) * esz;
        fc_load_tile<BK, D, NT, BF>(sK, gk, a.k_sn, nk - j0, a.D, a.in_mode, tid);
        fc_load_tile<BK, D, NT, BF>(sV, gv, a.v_sn, nk - j0, a.D, a.in_mode, tid);
    }

    int cand = 0;
    auto issue_next = [&](int slot) {
        int part = 0, c = cand;
        for (; c < items; ++c) {
            if (!a.bm) break;
            const int h = hk * group + c / nqt, i0 = (qtb + c % nqt) * BQ;
            if (fc_mask_vote<NT>(a, fc_bm_base(a, b, h), i0, min(i0 + BQ, nq) - 1, j0, jlast, tid, &part)) break;
        }
        if (tid == 0) {
            s_item[slot] = c < items ? c : -1;
            s_part[slot] = part;
        }
        if (c < items) {
            const int h = hk * group + c / nqt, i0 = (qtb + c % nqt) * BQ;
            const int64_t qr = sq.q0 + i0;
            const char *gq = (const char *)a.q + ((int64_t)sq.bb * a.q_sb + qr * a.q_sn + (int64_t)h * a.q_sh) * esz;
            const char *gg = (const char *)a.dout + ((int64_t)sq.bb * a.g_sb + qr * a.g_sn + (int64_t)h * a.g_sh) * esz;
            fc_load_tile<BQ, D, NT, BF>(sQ + slot * BQ * ROW, gq, a.q_sn, nq - i0, a.D, a.in_mode, tid);
            fc_load_tile<BQ, D, NT, BF>(sG + slot * BQ * ROW, gg, a.g_sn, nq - i0, a.D, a.in_mode, tid);
            const int64_t r0 = fc_bwd_lse_row0(a, sq, b, h) + i0;
            fc_load_rowvec<BQ, NT>(sL + slot * BQ, a.lse + r0, nq - i0, tid);
            fc_load_rowvec<BQ, NT>(sDv + slot * BQ, a.dvec + r0, nq - i0, tid);
            cand = c + 1;
        } else {
            cand = items;
        }
        fc_cp_async_commit();
    };
    issue_next(0); /* joins the K/V group */

    const int kg = warp / DS, dpart = warp % DS, wk0 = kg * 16 * MT, dcol0 = dpart * DW;
    const uint32_t a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;
    const uint32_t b_off = ((lane & 7) + (lane >> 4) * 8) * ROWB + ((lane >> 3) & 1) * 16;
    const uint32_t sKa = fc_smem_addr(sK) + wk0 * ROWB + a_off, sVa = fc_smem_addr(sV) + wk0 * ROWB + a_off;
    const uint32_t sQb = fc_smem_addr(sQ) + b_off, sGb = fc_smem_addr(sG) + b_off;
    const uint32_t sQt = fc_smem_addr(sQ) + a_off + dcol0 * 2, sGt = fc_smem_addr(sG) + a_off + dcol0 * 2;

    float dk[MT][DW / 8][4], dv[MT][DW / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < DW / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[mt][n][e] = dv[mt][n][e] = 0.f;

    for (int it = 0;; ++it) {
        fc_cp_async_wait<0>();
        __syncthreads();
        const int slot = it & 1;
        const int c = s_item[slot];
        if (c < 0) break;
        const int part = s_part[slot];
        issue_next(slot ^ 1);
        const int h = hk * group + c / nqt, i0 = (qtb + c % nqt) * BQ;

        float s[MT][BQ / 8][4], dp[MT][BQ / 8][4];
        fc_bwd_scores<BF, MT, KQ, KD>(s, dp, sKa, sVa, sQb + slot * BQ * ROWB, sGb + slot * BQ * ROWB, ROWB);

        /* Dropout (Z = keep / (1 - p), the forward's bits): dP^T becomes Z o dP^T before dS^T = P^T o (dP^T - D), and
         * P^T becomes Z o P^T after, for dV. D_i = rowsum(dO o O) needs nothing: O is the dropped output. */
        uint32_t keep[DROP ? MT : 1][(BQ / 8 + 7) / 8];
        if (DROP) {
            const fc_drop_stream drop = fc_drop_begin(a, b, h);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                fc_drop_bits_cols<BQ / 8>(drop, j0 + wk0 + mt * 16, i0, lane, keep[DROP ? mt : 0]);
                fc_drop_apply(dp[mt], keep[DROP ? mt : 0], a.drop_scale);
            }
        }

        /* P^T and dS^T: rows are keys j, columns queries i. */
        const bool need_mask = part || i0 + BQ > nq || fc_band_cuts(a, i0, i0 + BQ - 1, j0, j0 + BK - 1, diag, nk);
        const uint8_t *bmrow = part ? fc_bm_base(a, b, h) : NULL;
        const float slope2 = fc_alibi_slope2(a, b, h);
        const float *lrow = sL + slot * BQ, *drow = sDv + slot * BQ;
        if (!need_mask && fc_score_plain(a)) {
            /* Inside the band, no softcap or ALiBi: P = 2^(s c - lse2) by one FFMA and the exponent. */
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt) {
                const float2 l2 = *(const float2 *)(lrow + nt * 8 + tig * 2);
                const float2 d2 = *(const float2 *)(drow + nt * 8 + tig * 2);
                const float nl[2] = {-l2.x * FC_LOG2E, -l2.y * FC_LOG2E}, dd[2] = {d2.x, d2.y};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const float p = fc_exp2(fmaf(s[mt][nt][x], a.score_mul, nl[x & 1]));
                        s[mt][nt][x] = p;
                        dp[mt][nt][x] = p * (dp[mt][nt][x] - dd[x & 1]);
                    }
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int ci = nt * 8 + tig * 2 + e, i = i0 + ci;
                    const float lse2 = lrow[ci] * FC_LOG2E, dvec = drow[ci];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const int j = j0 + wk0 + mt * 16 + g + hf * 8;
                            bool vis = true;
                            if (need_mask) {
                                vis = i < nq && fc_keeps(a, i, j, diag, nk);
                                if (part && vis) vis = fc_bm_keeps(a, fc_bm_row(a, bmrow, i), j);
                            }
                            const float al = a.alibi ? fc_alibi(slope2, i + diag - j) : 0.f;
                            fc_bwd_elem<fc_fast_math>(a, s[mt][nt][2 * hf + e], dp[mt][nt][2 * hf + e], lse2, dvec,
                                                      al, vis);
                        }
                }
        }

        if (DROP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) fc_drop_apply(s[mt], keep[DROP ? mt : 0], a.drop_scale);
        }

        /* dV += P^T dO, dK += dS^T Q over the tile's queries, this warp's columns. */
        fc_acc_product<BF, MT, KQ, DW / 16>(dv, s, sGt + slot * BQ * ROWB, ROWB);
        fc_acc_product<BF, MT, KQ, DW / 16>(dk, dp, sQt + slot * BQ * ROWB, ROWB);

        if (a.dq_acc) {
            /* dQ += dS K: dS^T to shared memory (one warp of each key group writes), then the warps split the
             * (queries x head dim) tile as RG row groups x CG column groups and add their part with atomics. */
            if (dpart == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                        for (int nt = 0; nt < BQ / 8; ++nt)
                            *(uint32_t *)(sDS + (wk0 + mt * 16 + g + hf * 8) * DSROW + nt * 8 + tig * 2) =
                                fc_pack2<BF>(dp[mt][nt][2 * hf], dp[mt][nt][2 * hf + 1]);
            }
            __syncthreads();
            const int rg = warp % RG, cg = warp / RG;
            float acc[NCH][2][4];
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[ch][n][e] = 0.f;
            const uint32_t dsa = fc_smem_addr(sDS) + ((lane & 7) + (lane >> 4) * 8) * (DSROW * 2) +
                                 (rg * 16 + ((lane >> 3) & 1) * 8) * 2;
            const uint32_t kb = fc_smem_addr(sK) + a_off;
#pragma unroll
            for (int kc = 0; kc < BK / 16; ++kc) {
                uint32_t af[4];
                fc_ldsm_x4_t(af, dsa + kc * 16 * DSROW * 2);
#pragma unroll
                for (int ch = 0; ch < NCH; ++ch) {
                    const int c16 = cg + ch * CG;
                    if (KD % CG == 0 || c16 < KD) {
                        uint32_t bf[4];
                        fc_ldsm_x4_t(bf, kb + kc * 16 * ROWB + c16 * 32);
                        fc_mma<BF>(acc[ch][0], af, bf[0], bf[1]);
                        fc_mma<BF>(acc[ch][1], af, bf[2], bf[3]);
                    }
                }
            }
            const int64_t qrow0 = a.varlen ? sq.q0 : (int64_t)b * a.Nq;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = i0 + rg * 16 + g + hf * 8;
                if (i >= nq) continue;
                float *dst = a.dq_acc + ((qrow0 + i) * a.H + h) * a.D;
#pragma unroll
                for (int ch = 0; ch < NCH; ++ch) {
                    const int c16 = cg + ch * CG;
                    if (KD % CG != 0 && c16 >= KD) continue;
#pragma unroll
                    for (int n = 0; n < 2; ++n) {
                        const int col = c16 * 16 + n * 8 + tig * 2;
                        if (col + 1 < a.D && a.D % 2 == 0) /* 8-byte aligned pair */
                            fc_red_add2(dst + col, acc[ch][n][2 * hf], acc[ch][n][2 * hf + 1]);
                        else {
                            if (col < a.D) atomicAdd(dst + col, acc[ch][n][2 * hf]);
                            if (col + 1 < a.D) atomicAdd(dst + col + 1, acc[ch][n][2 * hf + 1]);
                        }
                    }
                }
            }
        }
    }
    fc_cp_async_wait<0>();

    /* dk = scale dS^T Q (the score's scale, applied once here), dv as summed. */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int j = j0 + wk0 + mt * 16 + g + hf * 8;
            if (j >= nk) continue;
            const int64_t kr = sq.k0 + j;
            const int64_t ok = (int64_t)sq.bb * a.dk_sb + kr * a.dk_sn + (int64_t)hk * a.dk_sh;
            const int64_t ov = (int64_t)sq.bb * a.dv_sb + kr * a.dv_sn + (int64_t)hk * a.dv_sh;
#pragma unroll
            for (int n = 0; n < DW / 8; ++n) {
                const int col = dcol0 + n * 8 + tig * 2;
                if (col >= a.D) continue;
                const bool has1 = col + 1 < a.D;
                fc_bwd_store2(a.dk, ok + col * a.dk_sd, a.dk_sd, a.out_dtype, a.scale * dk[mt][n][2 * hf],
                              a.scale * dk[mt][n][2 * hf + 1], has1);
                fc_bwd_store2(a.dv, ov + col * a.dv_sd, a.dv_sd, a.out_dtype, dv[mt][n][2 * hf], dv[mt][n][2 * hf + 1],
                              has1);
            }
        }
}

/*
 * dQ, deterministic mode. Grid: (query tile, head, sequence), query tile fastest and in reverse (causal: longest
 * rows first). Block: qnw warps, warp w owns query rows [16 w, 16 w + 16) and all of dQ's columns for them.
 */
template <int D, int BF, bool DROP>
__global__ void __launch_bounds__(fc_btile_for(D).qnw * 32, fc_btile_for(D).qminb) fc_bwd_q_kernel(const __grid_constant__ flashc_bwd_args a) {
    constexpr fc_btile TL = fc_btile_for(D);
    constexpr int BR = TL.qbr, BC = TL.qbc, NW = TL.qnw, NT = NW * 32, MT = BR / (16 * NW);
    constexpr int ROW = fc_smem_row(D), ROWB = ROW * 2, KD = D / 16, KC = BC / 16;
    static_assert(BR == MT * 16 * NW && BC % 16 == 0, "tile table");

    extern __shared__ __align__(16) uint16_t fc_smem[];
    uint16_t *sQ = fc_smem, *sG = sQ + BR * ROW, *sK = sG + BR * ROW, *sV = sK + 2 * BC * ROW;
    __shared__ int s_tile[2], s_part[2];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    int64_t bid = blockIdx.x;
    const int mblk = a.n_qblk - 1 - (int)(bid % a.n_qblk);
    bid /= a.n_qblk;
    const int h = (int)(bid % a.H), b = (int)(bid / a.H);
    const fc_bseq sq = fc_bwd_seq(a, b);
    const int nq = sq.nq, nk = sq.nk, diag = fc_diag(a, nq, nk);
    const int i0 = mblk * BR;
    if (i0 >= nq) return;
    const int ilast = min(i0 + BR, nq) - 1;
    const int hk = h / (a.H / a.Hkv);

    int tb, te;
    fc_key_tiles(a, i0, ilast, diag, nk, BC, &tb, &te);
    const uint8_t *bmrow = a.bm ? fc_bm_base(a, b, h) : NULL;

    const int esz = a.in_mode == FC_IN_F32 ? 4 : 2;
    {
        const int64_t qr = sq.q0 + i0;
        const char *gq = (const char *)a.q + ((int64_t)sq.bb * a.q_sb + qr * a.q_sn + (int64_t)h * a.q_sh) * esz;
        const char *gg = (const char *)a.dout + ((int64_t)sq.bb * a.g_sb + qr * a.g_sn + (int64_t)h * a.g_sh) * esz;
        fc_load_tile<BR, D, NT, BF>(sQ, gq, a.q_sn, nq - i0, a.D, a.in_mode, tid);
        fc_load_tile<BR, D, NT, BF>(sG, gg, a.g_sn, nq - i0, a.D, a.in_mode, tid);
    }
    int cand = tb;
    auto issue_next = [&](int slot) {
        int part = 0, t = cand;
        for (; t < te; ++t)
            if (!bmrow || fc_mask_vote<NT>(a, bmrow, i0, ilast, t * BC, min(t * BC + BC, nk) - 1, tid, &part))
                break;
        if (tid == 0) {
            s_tile[slot] = t < te ? t : -1;
            s_part[slot] = part;
        }
        if (t < te) {
            const int64_t kr = sq.k0 + t * BC;
            const char *gk = (const char *)a.k + ((int64_t)sq.bb * a.k_sb + kr * a.k_sn + (int64_t)hk * a.k_sh) * esz;
            const char *gv = (const char *)a.v + ((int64_t)sq.bb * a.v_sb + kr * a.v_sn + (int64_t)hk * a.v_sh) * esz;
            fc_load_tile<BC, D, NT, BF>(sK + slot * BC * ROW, gk, a.k_sn, nk - t * BC, a.D, a.in_mode, tid);
            fc_load_tile<BC, D, NT, BF>(sV + slot * BC * ROW, gv, a.v_sn, nk - t * BC, a.D, a.in_mode, tid);
            cand = t + 1;
        } else {
            cand = te;
        }
        fc_cp_async_commit();
    };
    issue_next(0);

    const int wr0 = warp * 16 * MT;
    const uint32_t a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;
    const uint32_t b_off = ((lane & 7) + (lane >> 4) * 8) * ROWB + ((lane >> 3) & 1) * 16;
    const uint32_t sQa = fc_smem_addr(sQ) + wr0 * ROWB + a_off, sGa = fc_smem_addr(sG) + wr0 * ROWB + a_off;
    const uint32_t sKb = fc_smem_addr(sK) + b_off, sVb = fc_smem_addr(sV) + b_off, sKt = fc_smem_addr(sK) + a_off;

    /* This lane's rows' lse (base 2) and D_i; rows past the end see nothing (+inf). */
    float lse2[MT][2], dvr[MT][2];
    const int64_t r0 = fc_bwd_lse_row0(a, sq, b, h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = i0 + wr0 + mt * 16 + g + hf * 8;
            lse2[mt][hf] = i < nq ? a.lse[r0 + i] * FC_LOG2E : INFINITY;
            dvr[mt][hf] = i < nq ? a.dvec[r0 + i] : 0.f;
        }
    const float slope2 = fc_alibi_slope2(a, b, h);
    const fc_drop_stream drop = DROP ? fc_drop_begin(a, b, h) : fc_drop_stream{};

    float dq[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[mt][n][e] = 0.f;

    for (int it = 0;; ++it) {
        fc_cp_async_wait<0>();
        __syncthreads();
        const int slot = it & 1;
        const int t = s_tile[slot];
        if (t < 0) break;
        const int part = s_part[slot];
        issue_next(slot ^ 1);
        const int j0 = t * BC;

        float s[MT][BC / 8][4], dp[MT][BC / 8][4];
        fc_bwd_scores<BF, MT, KC, KD>(s, dp, sQa, sGa, sKb + slot * BC * ROWB, sVb + slot * BC * ROWB, ROWB);
        if (DROP) { /* dP becomes Z o dP (the dK/dV kernel's comment); P itself is not used here */
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                uint32_t keep[(BC / 8 + 7) / 8];
                fc_drop_bits_rows<BC / 8>(drop, i0 + wr0 + mt * 16, j0, lane, keep);
                fc_drop_apply(dp[mt], keep, a.drop_scale);
            }
        }

        const bool need_mask = part || fc_band_cuts(a, i0, ilast, j0, j0 + BC - 1, diag, nk);
        if (!need_mask && fc_score_plain(a)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        const float p = fc_exp2(fmaf(s[mt][nt][x], a.score_mul, -lse2[mt][x >> 1]));
                        s[mt][nt][x] = p;
                        dp[mt][nt][x] = p * (dp[mt][nt][x] - dvr[mt][x >> 1]);
                    }
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int i = i0 + wr0 + mt * 16 + g + hf * 8;
#pragma unroll
                    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int j = j0 + nt * 8 + tig * 2 + e;
                            bool vis = true;
                            if (need_mask) {
                                vis = fc_keeps(a, i, j, diag, nk);
                                if (part && vis && i < nq) vis = fc_bm_keeps(a, fc_bm_row(a, bmrow, i), j);
                            }
                            const float al = a.alibi ? fc_alibi(slope2, i + diag - j) : 0.f;
                            fc_bwd_elem<fc_fast_math>(a, s[mt][nt][2 * hf + e], dp[mt][nt][2 * hf + e], lse2[mt][hf],
                                                      dvr[mt][hf], al, vis);
                        }
                }
        }
        /* dQ += dS K over the tile's keys. */
        fc_acc_product<BF, MT, KC, D / 16>(dq, dp, sKt + slot * BC * ROWB, ROWB);
    }
    fc_cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = i0 + wr0 + mt * 16 + g + hf * 8;
            if (i >= nq) continue;
            const int64_t off = (int64_t)sq.bb * a.dq_sb + (sq.q0 + i) * a.dq_sn + (int64_t)h * a.dq_sh;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                const int col = n * 8 + tig * 2;
                if (col >= a.D) continue;
                fc_bwd_store2(a.dq, off + col * a.dq_sd, a.dq_sd, a.out_dtype, a.scale * dq[mt][n][2 * hf],
                              a.scale * dq[mt][n][2 * hf + 1], col + 1 < a.D);
            }
        }
}

template <int D, int BF, bool DROP>
static cudaError_t fc_bwd_run_as(const flashc_bwd_args *a, cudaStream_t stream, int what, size_t *smem) {
    constexpr fc_btile t = fc_btile_for(D);
    const size_t kv = fc_bwd_kv_smem(t), qs = fc_bwd_q_smem(t);
    if (what == 2) {
        *smem = kv > qs ? kv : qs;
        cudaError_t e = fc_smem_optin<fc_bwd_kv_kernel<D, BF, DROP>>((int)kv);
        if (e == cudaSuccess) e = fc_smem_optin<fc_bwd_q_kernel<D, BF, DROP>>((int)qs);
        return e;
    }
    if (what == 0) {
        const int64_t blocks = (int64_t)a->n_kblk * a->Hkv * a->B;
        fc_bwd_kv_kernel<D, BF, DROP><<<(unsigned)blocks, t.nw * 32, kv, stream>>>(*a);
    } else {
        const int64_t blocks = (int64_t)a->n_qblk * a->H * a->B;
        fc_bwd_q_kernel<D, BF, DROP><<<(unsigned)blocks, t.qnw * 32, qs, stream>>>(*a);
    }
    return cudaGetLastError();
}

template <int D, int BF>
static cudaError_t fc_bwd_run(const flashc_bwd_args *a, cudaStream_t stream, int what, size_t *smem) {
    if (what == 2) { /* both variants' shared memory opt-in; the tile (and so the size) is the same */
        const cudaError_t e = fc_bwd_run_as<D, BF, true>(a, stream, what, smem);
        return e != cudaSuccess ? e : fc_bwd_run_as<D, BF, false>(a, stream, what, smem);
    }
    return a->dropout ? fc_bwd_run_as<D, BF, true>(a, stream, what, smem)
                      : fc_bwd_run_as<D, BF, false>(a, stream, what, smem);
}

#define FLASHC_BWD_INSTANTIATE(D)                                                                            \
    FC_BWD_ENTRY(D) {                                                                                        \
        return a->bf16 ? fc_bwd_run<D, 1>(a, stream, what, smem) : fc_bwd_run<D, 0>(a, stream, what, smem); \
    }

#endif /* FLASHC_CUDA_BWD_SM80_CUH */
