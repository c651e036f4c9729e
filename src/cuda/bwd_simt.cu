/*
 * bwd_simt.cu - the attention backward on CUDA cores in fp32: the correctness baseline of the CUDA backward,
 * which the tensor-core version must reproduce.
 *
 * Algorithm: FlashAttention-2 backward (Dao 2023, "FlashAttention-2", Algorithm 2). P is recomputed from q, k
 * and the forward's lse, never stored:
 *   1. fc_bwd_dvec: D_i = rowsum(dO o O) in fp32 into the workspace (laid out like lse).
 *   2. fc_bwd_dkdv: one block per (key tile, kv head, sequence) keeps dK_j, dV_j in registers and walks the
 *      query tiles of every query head of its group that the band (causal / window) and the block mask let see
 *      its keys: S = q k^T, P = 2^(x - lse log2 e) with x the forward's base-2 score (scale, softcap, ALiBi),
 *      dP = dO v^T, dS = P o (dP - D_i) (times 1 - tanh^2 under softcap), dV += P^T dO, dK += dS^T Q. Writes
 *      dk = scale dK and dv once; with GQA the group's heads are summed in the same registers.
 *   3. fc_bwd_dq: one block per (query tile, head, sequence) walks its visible key tiles, recomputes P and dS
 *      the same way and accumulates dQ += dS K; writes dq = scale dQ once.
 * No block adds into another's output, so there are no atomics: each element of dq, dk, dv is the sum of one
 * thread in a fixed order and is bitwise identical from run to run. The deterministic flag costs nothing here.
 *
 * Tiles: BR = 32 query rows x BC = 32 keys, 256 threads (8 per query row or key). The head dim passes through
 * shared memory in chunks of DC = 64 columns (41,984 bytes of static shared memory for any D <= 256); each thread
 * keeps NDC = 1, 2 or 4 chunks (D <= 64, 128, 256) of 8 accumulator columns. Inputs are read element by element
 * with any strides (the head dim's too) and converted to fp32; everything is computed in fp32 with the accurate
 * exp2f / tanhf. fp32 q, k, v are read rounded to bf16, the operands the forward used (see fc_bwd_make_args).
 *
 * Scores and masks: score.h's shared step, as every CUDA kernel forms them (a score modifier or a mask is added
 * there, not here): the fields FC_SCORE_FIELDS filled by fc_set_scores_and_masks (launch.h), the element
 * fc_bwd_elem with fc_exact_math, the band fc_keeps, the block mask fc_bm_row / fc_bm_keeps, and the tiles a block
 * visits from fc_key_tiles, fc_query_rows and fc_bm_scan. In base 2, as the forward: x = s scale log2 e (softcap
 * and ALiBi in base 2 too) against lse2 = lse log2 e, so that P = 2^(x - lse2) = e^(s scale - lse); the two
 * factors add a rounding or two of the score's size, fp32's accuracy as before (this kernel used natural units
 * and expf before it shared the step).
 *
 * The kernel bodies are plain C++ (CUDA only through fc_sync / fc_sync_or) so that tests/emu_bwd_simt.cc runs
 * them on the CPU, one host thread per CUDA thread, against the case table.
 */
#include "bwd.h"
#include "launch.h" /* fc_set_scores_and_masks; score.h */

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FC_BWD_FN static __device__ __forceinline__
#define FC_UNROLL _Pragma("unroll")
static __device__ __forceinline__ void fc_sync(void) { __syncthreads(); }
static __device__ __forceinline__ int fc_sync_or(int x) { return __syncthreads_or(x); }
#else
/* Host emulation: the including program provides the block barriers. */
#define FC_BWD_FN static inline
#define FC_UNROLL
void fc_sync(void);
int fc_sync_or(int x);
#endif

enum {
    FC_BWD_BR = 32,  /* query rows per tile */
    FC_BWD_BC = 32,  /* keys per tile */
    FC_BWD_DC = 64,  /* head-dim columns per shared-memory chunk */
    FC_BWD_NT = 256, /* threads per block */
    FC_BWD_TPR = FC_BWD_NT / FC_BWD_BR,  /* threads per query row (S, dQ) and per key (dK, dV): 8 */
    FC_BWD_KPT = FC_BWD_BC / FC_BWD_TPR, /* keys per thread in S, dP: 4 */
    FC_BWD_CPT = FC_BWD_DC / FC_BWD_TPR  /* accumulator columns per thread per chunk: 8 */
};
static_assert(FC_BWD_NT == FC_BWD_BC * FC_BWD_TPR, "one key per TPR threads in dK, dV");

/* A strided (B, N, heads, D) view; element (b, n, h, d) is at b sb + n sn + h sh + d sd. */
typedef struct fc_bwd_tensor {
    void *data;
    int64_t sb, sn, sh, sd;
} fc_bwd_tensor;

/* Kernel arguments (by value). As in flashc_problem: with varlen B is the number of sequences, Nq/Nk the max
 * lengths, rows come from cu_q/cu_k and the tensors' batch index is 0. */
typedef struct fc_bwd_args {
    fc_bwd_tensor q, k, v, o, dout, dq, dk, dv;
    const float *lse; /* (B, H, Nq) or (H, total_q) */
    float *dvec;      /* D_i, laid out like lse */
    int64_t B, H, Hkv, Nq, Nk, D, total_q;
    int varlen;
    const int32_t *cu_q, *cu_k;
    float scale;     /* the natural scale: dk = scale dK, dq = scale dQ */
    FC_SCORE_FIELDS; /* score_mul, softcap2, the band, ALiBi, the block mask (score.h), as the forward's */
    int64_t n_qt, n_kt; /* query / key tiles per sequence of the max lengths */
    int qkv_bf16;       /* read q, k, v rounded to bf16 (fp32 inputs: the forward's operands) */
    const int32_t *seqused_k; /* keys each sequence uses (score.h's fc_used_keys); NULL: all */
    const float *sinks;       /* attention sinks per head; NULL: none */
    float *dsinks;            /* their gradient (H); NULL: not asked for */
    FC_DROP_FIELDS;           /* dropout (score.h) */
} fc_bwd_args;

/* Shared memory of a block: the chunks of the current tile pair, its P and dS, and its rows' lse and D_i. The +1
 * padding puts the rows a warp reads at once (4 or 8 rows, same column) into distinct banks. */
typedef struct fc_bwd_smem {
    float q[FC_BWD_BR][FC_BWD_DC + 1];
    float dout[FC_BWD_BR][FC_BWD_DC + 1];
    float k[FC_BWD_BC][FC_BWD_DC + 1];
    float v[FC_BWD_BC][FC_BWD_DC + 1];
    float p[FC_BWD_BR][FC_BWD_BC + 1];
    float ds[FC_BWD_BR][FC_BWD_BC + 1];
    float lse[FC_BWD_BR];
    float di[FC_BWD_BR];
} fc_bwd_smem;

FC_BWD_FN int64_t fc_min64(int64_t x, int64_t y) { return x < y ? x : y; }

FC_BWD_FN float fc_to_f32(float x) { return x; }
FC_BWD_FN float fc_to_f32(__half x) { return __half2float(x); }
FC_BWD_FN float fc_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
FC_BWD_FN void fc_store(float *p, float x) { *p = x; }
FC_BWD_FN void fc_store(__half *p, float x) { *p = __float2half_rn(x); }
FC_BWD_FN void fc_store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16_rn(x); }

/* Sequence b: first packed row and length of its queries and keys, and the tensors' batch index. */
typedef struct fc_seq {
    int64_t q0, nq, k0, nk, bb;
} fc_seq;

FC_BWD_FN fc_seq fc_seq_of(const fc_bwd_args &a, int64_t b) {
    fc_seq s;
    if (a.varlen) {
        s.q0 = a.cu_q[b];
        s.nq = (int64_t)a.cu_q[b + 1] - a.cu_q[b];
        s.k0 = a.cu_k[b];
        s.nk = (int64_t)a.cu_k[b + 1] - a.cu_k[b];
        s.bb = 0;
    } else {
        s.q0 = 0;
        s.nq = a.Nq;
        s.k0 = 0;
        s.nk = a.Nk;
        s.bb = b;
    }
    s.nk = fc_used_keys(a, b, s.nk);
    return s;
}

/* Index of query row i of (sequence b, head h) in lse and D_i. */
FC_BWD_FN int64_t fc_lse_index(const fc_bwd_args &a, const fc_seq &s, int64_t b, int64_t h, int64_t i) {
    return a.varlen ? h * a.total_q + s.q0 + i : (b * a.H + h) * a.Nq + i;
}

/* Whether some block-mask byte over rows [i0, i1] x keys [j0, j1] is non-zero (true without a block mask):
 * score.h's fc_bm_scan, this thread's share, reduced over the block. Every thread of the block must call it (it
 * ends in a barrier); the answer is the same for all. */
FC_BWD_FN bool fc_bm_meets(const fc_bwd_args &a, const uint8_t *mask, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                           int tid) {
    if (!mask) return true;
    int on = 0, off = 0;
    fc_bm_scan(a, mask, i0, i1, j0, j1, tid, FC_BWD_NT, &on, &off);
    return fc_sync_or(on) != 0;
}

/* Columns [c0, c0 + DC) of rows row0 .. row0 + R - 1 (packed) of head h into dst, rounded through bf16 when
 * bf16 is set; rows >= nrows and columns >= D read as 0, so ragged tiles and head dims add nothing. Consecutive
 * threads read consecutive columns. */
template <typename T, int R>
FC_BWD_FN void fc_load_chunk(float (*dst)[FC_BWD_DC + 1], const fc_bwd_tensor &t, int64_t bb, int64_t row0,
                             int64_t h, int64_t nrows, int64_t c0, int64_t D, int bf16, int tid) {
    const T *base = (const T *)t.data + bb * t.sb + row0 * t.sn + h * t.sh;
    for (int e = tid; e < R * FC_BWD_DC; e += FC_BWD_NT) {
        const int r = e / FC_BWD_DC, c = e % FC_BWD_DC;
        float x = 0.f;
        if (r < nrows && c0 + c < D) x = fc_to_f32(base[r * t.sn + (c0 + c) * t.sd]);
        dst[r][c] = bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
    }
}

/*
 * P and dS of query rows i0 .. i0 + BR - 1 of head h against keys j0 .. j0 + BC - 1 of sequence s (batch b)
 * into sm.p and sm.ds, 0 where masked or past the ends. Thread tid computes row tid / TPR against keys
 * tid % TPR + TPR u, u < KPT: S and dP accumulate over the head dim chunk by chunk. Starts with a barrier (the
 * caller's last reads of sm are done); the caller needs one before reading sm.p / sm.ds.
 */
template <typename T>
FC_BWD_FN void fc_bwd_tile(const fc_bwd_args &a, fc_bwd_smem &sm, const fc_seq &s, const uint8_t *mask, int64_t b,
                           int64_t h, int64_t i0, int64_t j0, int tid) {
    const int64_t hk = h / (a.H / a.Hkv);
    const int64_t nrows = fc_min64(FC_BWD_BR, s.nq - i0), ncols = fc_min64(FC_BWD_BC, s.nk - j0);
    const int r = tid / FC_BWD_TPR, cu = tid % FC_BWD_TPR;
    float sacc[FC_BWD_KPT], dpacc[FC_BWD_KPT];
    FC_UNROLL
    for (int u = 0; u < FC_BWD_KPT; ++u) sacc[u] = dpacc[u] = 0.f;

    fc_sync();
    if (tid < FC_BWD_BR) {
        const bool in = tid < nrows;
        const int64_t idx = fc_lse_index(a, s, b, h, i0 + tid);
        sm.lse[tid] = in ? a.lse[idx] : INFINITY;
        sm.di[tid] = in ? a.dvec[idx] : 0.f;
    }
    for (int64_t c0 = 0; c0 < a.D; c0 += FC_BWD_DC) {
        if (c0 > 0) fc_sync();
        fc_load_chunk<T, FC_BWD_BR>(sm.q, a.q, s.bb, s.q0 + i0, h, nrows, c0, a.D, a.qkv_bf16, tid);
        fc_load_chunk<T, FC_BWD_BR>(sm.dout, a.dout, s.bb, s.q0 + i0, h, nrows, c0, a.D, 0, tid);
        fc_load_chunk<T, FC_BWD_BC>(sm.k, a.k, s.bb, s.k0 + j0, hk, ncols, c0, a.D, a.qkv_bf16, tid);
        fc_load_chunk<T, FC_BWD_BC>(sm.v, a.v, s.bb, s.k0 + j0, hk, ncols, c0, a.D, a.qkv_bf16, tid);
        fc_sync();
        for (int d = 0; d < FC_BWD_DC; ++d) {
            const float qv = sm.q[r][d], gv = sm.dout[r][d];
            FC_UNROLL
            for (int u = 0; u < FC_BWD_KPT; ++u) {
                sacc[u] += qv * sm.k[cu + FC_BWD_TPR * u][d];
                dpacc[u] += gv * sm.v[cu + FC_BWD_TPR * u][d];
            }
        }
    }

    /* score.h's element in base 2 with exact exp2f / tanhf: x - lse2 is formed before the exponent, so P keeps
     * fp32's relative accuracy. A row that saw no key in the forward has lse = +inf and gets P = 0. Visible: the
     * row is in the tile, the band keeps key j (fc_keeps, which also ends at the sequence's keys) and so does the
     * block mask. */
    const int64_t i = i0 + r, diag = fc_diag(a, s.nq, s.nk);
    const float lse2 = sm.lse[r] * FC_LOG2E, di = sm.di[r];
    const float slope2 = fc_alibi_slope2(a, b, h);
    const uint8_t *bmrow = mask && r < nrows ? fc_bm_row(a, mask, i) : NULL;
    uint64_t seed = a.drop_seed, stream = 0;
    if (a.dropout) {
        if (a.drop_rng) seed = a.drop_rng[0];
        stream = flashc_dropout_stream(a.drop_rng ? a.drop_rng[1] : a.drop_offset, b, a.H, h);
    }
    FC_UNROLL
    for (int u = 0; u < FC_BWD_KPT; ++u) {
        const int c = cu + FC_BWD_TPR * u;
        const int64_t j = j0 + c;
        const bool vis = r < nrows && fc_keeps(a, i, j, diag, s.nk) && (!mask || fc_bm_keeps(a, bmrow, j));
        float p = sacc[u], ds = dpacc[u];
        /* Dropout: Z = keep / (1 - p) times dP before the element step, times P after (for dV); one Philox call per
         * element here (the tensor-core kernels share each call between four). */
        const float z = a.dropout ? (flashc_dropout_keep(seed, stream, a.drop_row0 + i, 4 * (int64_t)a.drop_col4 + j,
                                                         a.drop_t)
                                         ? a.drop_scale
                                         : 0.f)
                                  : 1.f;
        ds *= z;
        fc_bwd_elem<fc_exact_math>(a, p, ds, lse2, di, a.alibi ? fc_alibi(slope2, i + diag - j) : 0.f, vis);
        p *= z;
        sm.p[r][c] = p;
        sm.ds[r][c] = ds;
    }
}

/*
 * After every backward path (bwd.cu runs these last, whatever kernels ran before):
 * fc_bwd_unused_body: dk = dv = 0 on the key rows a sequence holds but does not use (seqused_k), which no kernel
 *   writes; one thread per (sequence, key row of the max length, kv head), x = (b Nk + j) Hkv + hk.
 * fc_bwd_sinks_body: the sinks' gradient, one block per head h. The lse includes the sink, so P_sink,i = e^(sink -
 *   lse_i), and dL/dsink = -sum_i P_sink,i D_i over every query row of the head (D_i = sum_j P_ij dP_ij). Each
 *   thread sums its rows (stride NT) in order, then thread 0 the threads' sums in order: reproducible bitwise.
 *   part: NT doubles of the block's shared memory.
 */
template <typename T>
FC_BWD_FN void fc_bwd_unused_body(const fc_bwd_args &a, int64_t x) {
    if (x >= a.B * a.Nk * a.Hkv) return;
    const int64_t hk = x % a.Hkv, j = (x / a.Hkv) % a.Nk, b = x / (a.Hkv * a.Nk);
    const fc_seq s = fc_seq_of(a, b); /* s.nk: the keys it uses */
    const int64_t rows = a.varlen ? (int64_t)a.cu_k[b + 1] - a.cu_k[b] : a.Nk;
    if (j < s.nk || j >= rows) return;
    T *dk = (T *)a.dk.data + s.bb * a.dk.sb + (s.k0 + j) * a.dk.sn + hk * a.dk.sh;
    T *dv = (T *)a.dv.data + s.bb * a.dv.sb + (s.k0 + j) * a.dv.sn + hk * a.dv.sh;
    for (int64_t d = 0; d < a.D; ++d) {
        fc_store(dk + d * a.dk.sd, 0.f);
        fc_store(dv + d * a.dv.sd, 0.f);
    }
}

FC_BWD_FN void fc_bwd_sinks_body(const fc_bwd_args &a, double *part, int64_t h, int tid) {
    const int64_t rows = a.varlen ? (int64_t)a.cu_q[a.B] : a.B * a.Nq; /* varlen: the sequences' rows only */
    const float sink = a.sinks[h];
    double acc = 0.0;
    for (int64_t r = tid; r < rows; r += FC_BWD_NT) {
        const int64_t idx = a.varlen ? h * a.total_q + r : ((r / a.Nq) * a.H + h) * a.Nq + r % a.Nq;
        acc -= (double)expf(sink - a.lse[idx]) * (double)a.dvec[idx];
    }
    part[tid] = acc;
    fc_sync();
    if (tid == 0) {
        double sum = 0.0;
        for (int t = 0; t < FC_BWD_NT; ++t) sum += part[t];
        a.dsinks[h] = (float)sum;
    }
}

/* dvec[(b, h, i)] = sum_d dO o O, one thread per (query row, head): x = row * H + h over all packed rows. */
template <typename T>
FC_BWD_FN void fc_bwd_dvec_body(const fc_bwd_args &a, int64_t x) {
    const int64_t rows = a.varlen ? a.total_q : a.B * a.Nq;
    if (x >= rows * a.H) return;
    const int64_t h = x % a.H, row = x / a.H;
    int64_t b = 0, n = row, idx = h * a.total_q + row;
    if (!a.varlen) {
        b = row / a.Nq;
        n = row % a.Nq;
        idx = (b * a.H + h) * a.Nq + n;
    }
    const T *o = (const T *)a.o.data + b * a.o.sb + n * a.o.sn + h * a.o.sh;
    const T *g = (const T *)a.dout.data + b * a.dout.sb + n * a.dout.sn + h * a.dout.sh;
    float acc = 0.f;
    for (int64_t d = 0; d < a.D; ++d) acc += fc_to_f32(o[d * a.o.sd]) * fc_to_f32(g[d * a.dout.sd]);
    a.dvec[idx] = acc;
}

/* Block bid = (key tile, kv head, sequence), key tile fastest. Thread tid owns key tid / TPR of the tile and
 * columns ch DC + tid % TPR + TPR u of dK, dV. */
template <typename T, int NDC>
FC_BWD_FN void fc_bwd_dkdv_body(const fc_bwd_args &a, fc_bwd_smem &sm, int64_t bid, int tid) {
    const int64_t jt = bid % a.n_kt, hk = bid / a.n_kt % a.Hkv, b = bid / a.n_kt / a.Hkv;
    const fc_seq s = fc_seq_of(a, b);
    const int64_t j0 = jt * FC_BWD_BC;
    if (j0 >= s.nk) return; /* varlen: this sequence has fewer keys than max_seqlen_k */
    const int64_t j1 = fc_min64(j0 + FC_BWD_BC, s.nk) - 1;
    const int c = tid / FC_BWD_TPR, cu = tid % FC_BWD_TPR;
    float dk[NDC][FC_BWD_CPT], dv[NDC][FC_BWD_CPT];
    FC_UNROLL
    for (int ch = 0; ch < NDC; ++ch) {
        FC_UNROLL
        for (int u = 0; u < FC_BWD_CPT; ++u) dk[ch][u] = dv[ch][u] = 0.f;
    }

    /* Query rows [qlo, qhi] the band lets see some key of the tile (none: qlo > qhi); their tiles, from the one
     * that holds qlo. */
    int64_t qlo, qhi;
    fc_query_rows(a, j0, j1, fc_diag(a, s.nq, s.nk), s.nq, &qlo, &qhi);
    const int64_t qt0 = qlo <= qhi ? qlo / FC_BWD_BR : 0, qt1 = qlo <= qhi ? qhi / FC_BWD_BR + 1 : 0;
    const int64_t group = a.H / a.Hkv;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const uint8_t *mask = a.bm ? fc_bm_base(a, b, h) : NULL;
        for (int64_t i0 = qt0 * FC_BWD_BR; i0 < qt1 * FC_BWD_BR; i0 += FC_BWD_BR) {
            const int64_t i1 = fc_min64(i0 + FC_BWD_BR, s.nq) - 1;
            if (!fc_bm_meets(a, mask, i0, i1, j0, j1, tid)) continue;
            fc_bwd_tile<T>(a, sm, s, mask, b, h, i0, j0, tid);
            /* dV += P^T dO, dK += dS^T Q over the tile's rows, chunk by chunk of the head dim. */
            FC_UNROLL
            for (int ch = 0; ch < NDC; ++ch) {
                if (ch * FC_BWD_DC >= a.D) continue;
                fc_sync();
                const int64_t nrows = i1 - i0 + 1, c0 = ch * FC_BWD_DC;
                fc_load_chunk<T, FC_BWD_BR>(sm.q, a.q, s.bb, s.q0 + i0, h, nrows, c0, a.D, a.qkv_bf16, tid);
                fc_load_chunk<T, FC_BWD_BR>(sm.dout, a.dout, s.bb, s.q0 + i0, h, nrows, c0, a.D, 0, tid);
                fc_sync();
                for (int r = 0; r < FC_BWD_BR; ++r) {
                    const float p = sm.p[r][c], ds = sm.ds[r][c];
                    FC_UNROLL
                    for (int u = 0; u < FC_BWD_CPT; ++u) {
                        dv[ch][u] += p * sm.dout[r][cu + FC_BWD_TPR * u];
                        dk[ch][u] += ds * sm.q[r][cu + FC_BWD_TPR * u];
                    }
                }
            }
        }
    }

    if (j0 + c > j1) return;
    const int64_t row = s.k0 + j0 + c;
    T *gk = (T *)a.dk.data + s.bb * a.dk.sb + row * a.dk.sn + hk * a.dk.sh;
    T *gv = (T *)a.dv.data + s.bb * a.dv.sb + row * a.dv.sn + hk * a.dv.sh;
    FC_UNROLL
    for (int ch = 0; ch < NDC; ++ch) {
        FC_UNROLL
        for (int u = 0; u < FC_BWD_CPT; ++u) {
            const int64_t d = ch * FC_BWD_DC + cu + FC_BWD_TPR * u;
            if (d < a.D) {
                fc_store(gk + d * a.dk.sd, a.scale * dk[ch][u]);
                fc_store(gv + d * a.dv.sd, dv[ch][u]);
            }
        }
    }
}

/* Block bid = (query tile, head, sequence), query tile fastest. Thread tid owns row tid / TPR of the tile and
 * columns ch DC + tid % TPR + TPR u of dQ. */
template <typename T, int NDC>
FC_BWD_FN void fc_bwd_dq_body(const fc_bwd_args &a, fc_bwd_smem &sm, int64_t bid, int tid) {
    const int64_t it = bid % a.n_qt, h = bid / a.n_qt % a.H, b = bid / a.n_qt / a.H;
    const fc_seq s = fc_seq_of(a, b);
    const int64_t i0 = it * FC_BWD_BR;
    if (i0 >= s.nq) return; /* varlen: this sequence has fewer queries than max_seqlen_q */
    const int64_t i1 = fc_min64(i0 + FC_BWD_BR, s.nq) - 1, hk = h / (a.H / a.Hkv);
    const int r = tid / FC_BWD_TPR, cu = tid % FC_BWD_TPR;
    const uint8_t *mask = a.bm ? fc_bm_base(a, b, h) : NULL;
    float dq[NDC][FC_BWD_CPT];
    FC_UNROLL
    for (int ch = 0; ch < NDC; ++ch) {
        FC_UNROLL
        for (int u = 0; u < FC_BWD_CPT; ++u) dq[ch][u] = 0.f;
    }

    /* Key tiles [tb, te) the band lets rows i0 .. i1 see (none, e.g. a sequence without keys: tb == te). */
    int64_t tb, te;
    fc_key_tiles(a, i0, i1, fc_diag(a, s.nq, s.nk), s.nk, (int64_t)FC_BWD_BC, &tb, &te);
    for (int64_t j0 = tb * FC_BWD_BC; j0 < te * FC_BWD_BC; j0 += FC_BWD_BC) {
        const int64_t j1 = fc_min64(j0 + FC_BWD_BC, s.nk) - 1;
        if (!fc_bm_meets(a, mask, i0, i1, j0, j1, tid)) continue;
        fc_bwd_tile<T>(a, sm, s, mask, b, h, i0, j0, tid);
        /* dQ += dS K over the tile's keys, chunk by chunk of the head dim. */
        FC_UNROLL
        for (int ch = 0; ch < NDC; ++ch) {
            if (ch * FC_BWD_DC >= a.D) continue;
            fc_sync();
            fc_load_chunk<T, FC_BWD_BC>(sm.k, a.k, s.bb, s.k0 + j0, hk, j1 - j0 + 1, ch * FC_BWD_DC, a.D, a.qkv_bf16,
                                        tid);
            fc_sync();
            for (int cc = 0; cc < FC_BWD_BC; ++cc) {
                const float ds = sm.ds[r][cc];
                FC_UNROLL
                for (int u = 0; u < FC_BWD_CPT; ++u) dq[ch][u] += ds * sm.k[cc][cu + FC_BWD_TPR * u];
            }
        }
    }

    if (i0 + r > i1) return;
    T *g = (T *)a.dq.data + s.bb * a.dq.sb + (s.q0 + i0 + r) * a.dq.sn + h * a.dq.sh;
    FC_UNROLL
    for (int ch = 0; ch < NDC; ++ch) {
        FC_UNROLL
        for (int u = 0; u < FC_BWD_CPT; ++u) {
            const int64_t d = ch * FC_BWD_DC + cu + FC_BWD_TPR * u;
            if (d < a.D) fc_store(g + d * a.dq.sd, a.scale * dq[ch][u]);
        }
    }
}

/* ---- host side ----------------------------------------------------------------------------------------- */

static int64_t fc_bwd_rows(const flashc_problem *p) { return p->varlen ? p->total_q : p->B * p->Nq; }

/* Accumulator chunks per thread: the fewest of 1, 2, 4 that cover the head dim. */
static int fc_bwd_ndc(int64_t D) { return D <= FC_BWD_DC ? 1 : D <= 2 * FC_BWD_DC ? 2 : 4; }

/* Grid sizes of the three kernels. */
static void fc_bwd_grids(const flashc_problem *p, int64_t *dvec_blocks, int64_t *dkdv_blocks, int64_t *dq_blocks) {
    *dvec_blocks = (fc_bwd_rows(p) * p->H + FC_BWD_NT - 1) / FC_BWD_NT;
    *dkdv_blocks = (p->Nk + FC_BWD_BC - 1) / FC_BWD_BC * p->Hkv * p->B;
    *dq_blocks = (p->Nq + FC_BWD_BR - 1) / FC_BWD_BR * p->H * p->B;
}

const char *flashc_cuda_bwd_simt_unsupported(const flashc_problem *p) {
    int64_t g0, g1, g2;
    fc_bwd_grids(p, &g0, &g1, &g2);
    if (g0 > INT_MAX || g1 > INT_MAX || g2 > INT_MAX) return "problem too large for one CUDA backward launch";
    return NULL;
}

/* The grids of the steps after every backward path: the unused keys' zeros (0 without seqused_k) and the
 * sinks' gradient (0 without dsinks). */
static void fc_bwd_post_grids(const flashc_problem *p, int64_t *unused_blocks, int64_t *sink_blocks) {
    *unused_blocks = p->seqused_k ? (p->B * p->Nk * p->Hkv + FC_BWD_NT - 1) / FC_BWD_NT : 0;
    *sink_blocks = p->dsinks ? p->H : 0;
}

static fc_bwd_tensor fc_bwd_view(const flashc_tensor *t) {
    fc_bwd_tensor v;
    v.data = t->data;
    v.sb = t->stride[0], v.sn = t->stride[1], v.sh = t->stride[2], v.sd = t->stride[3];
    return v;
}

static fc_bwd_args fc_bwd_make_args(const flashc_problem *p, void *workspace) {
    fc_bwd_args a;
    memset(&a, 0, sizeof a);
    a.q = fc_bwd_view(&p->q), a.k = fc_bwd_view(&p->k), a.v = fc_bwd_view(&p->v), a.o = fc_bwd_view(&p->out);
    a.dout = fc_bwd_view(&p->dout), a.dq = fc_bwd_view(&p->dq), a.dk = fc_bwd_view(&p->dk);
    a.dv = fc_bwd_view(&p->dv);
    a.lse = p->lse;
    a.dvec = (float *)workspace;
    a.B = p->B, a.H = p->H, a.Hkv = p->Hkv, a.Nq = p->Nq, a.Nk = p->Nk, a.D = p->D;
    a.total_q = p->varlen ? p->total_q : p->B * p->Nq;
    a.varlen = p->varlen;
    a.cu_q = p->cu_q, a.cu_k = p->cu_k;
    a.seqused_k = p->seqused_k;
    a.sinks = p->sinks, a.dsinks = p->dsinks;
    a.scale = p->scale;
    fc_set_scores_and_masks(p, &a);
    fc_set_dropout(p, &a);
    a.n_qt = (p->Nq + FC_BWD_BR - 1) / FC_BWD_BR;
    a.n_kt = (p->Nk + FC_BWD_BC - 1) / FC_BWD_BC;
    /* The CUDA forward runs fp32 inputs on bf16 operands (fwd_sm80.cuh): its lse and O belong to the bf16-rounded
     * q, k, v. Recomputing S from unrounded q, k would give a P that does not sum to one against that lse (a
     * one-hot row whose top score moved by d gets P = e^-d), an error of the bf16 rounding's size, undamped and
     * measured (tests/emu_bwd_simt.cc --gpu-numerics) just over the bf16 rule's bound. So the backward takes the
     * gradient of the function the forward computed: the same rounded q, k, v; dO, D_i and all sums stay fp32. */
    a.qkv_bf16 = p->dtype == FLASHC_DTYPE_F32;
    return a;
}

#ifdef __CUDACC__

template <typename T>
__global__ void __launch_bounds__(FC_BWD_NT) fc_bwd_dvec(const __grid_constant__ fc_bwd_args a) {
    fc_bwd_dvec_body<T>(a, (int64_t)blockIdx.x * FC_BWD_NT + threadIdx.x);
}

template <typename T, int NDC>
__global__ void __launch_bounds__(FC_BWD_NT) fc_bwd_dkdv(const __grid_constant__ fc_bwd_args a) {
    __shared__ fc_bwd_smem sm;
    fc_bwd_dkdv_body<T, NDC>(a, sm, blockIdx.x, threadIdx.x);
}

template <typename T, int NDC>
__global__ void __launch_bounds__(FC_BWD_NT) fc_bwd_dq(const __grid_constant__ fc_bwd_args a) {
    __shared__ fc_bwd_smem sm;
    fc_bwd_dq_body<T, NDC>(a, sm, blockIdx.x, threadIdx.x);
}

template <typename T, int NDC>
static cudaError_t fc_bwd_run(const flashc_problem *p, const fc_bwd_args &a, cudaStream_t stream) {
    int64_t g0, g1, g2;
    fc_bwd_grids(p, &g0, &g1, &g2);
    cudaError_t e;
    if (g0 > 0) {
        fc_bwd_dvec<T><<<(unsigned)g0, FC_BWD_NT, 0, stream>>>(a);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (g1 > 0) {
        fc_bwd_dkdv<T, NDC><<<(unsigned)g1, FC_BWD_NT, 0, stream>>>(a);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (g2 > 0) {
        fc_bwd_dq<T, NDC><<<(unsigned)g2, FC_BWD_NT, 0, stream>>>(a);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

template <typename T>
static cudaError_t fc_bwd_run_dtype(const flashc_problem *p, const fc_bwd_args &a, cudaStream_t stream) {
    switch (fc_bwd_ndc(p->D)) {
    case 1: return fc_bwd_run<T, 1>(p, a, stream);
    case 2: return fc_bwd_run<T, 2>(p, a, stream);
    default: return fc_bwd_run<T, 4>(p, a, stream);
    }
}

template <typename T>
__global__ void __launch_bounds__(FC_BWD_NT) fc_bwd_unused(const __grid_constant__ fc_bwd_args a) {
    fc_bwd_unused_body<T>(a, (int64_t)blockIdx.x * FC_BWD_NT + threadIdx.x);
}

__global__ void __launch_bounds__(FC_BWD_NT) fc_bwd_sinks(const __grid_constant__ fc_bwd_args a) {
    __shared__ double part[FC_BWD_NT];
    fc_bwd_sinks_body(a, part, blockIdx.x, threadIdx.x);
}

cudaError_t flashc_cuda_bwd_post_launch(const flashc_problem *p, float *dvec, cudaStream_t stream) {
    int64_t gu, gs;
    fc_bwd_post_grids(p, &gu, &gs);
    if (gu > INT_MAX) return cudaErrorInvalidConfiguration;
    const fc_bwd_args a = fc_bwd_make_args(p, dvec);
    cudaError_t e;
    if (gu > 0) {
        switch (p->dtype) {
        case FLASHC_DTYPE_F32: fc_bwd_unused<float><<<(unsigned)gu, FC_BWD_NT, 0, stream>>>(a); break;
        case FLASHC_DTYPE_F16: fc_bwd_unused<__half><<<(unsigned)gu, FC_BWD_NT, 0, stream>>>(a); break;
        case FLASHC_DTYPE_BF16: fc_bwd_unused<__nv_bfloat16><<<(unsigned)gu, FC_BWD_NT, 0, stream>>>(a); break;
        }
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (gs > 0) {
        fc_bwd_sinks<<<(unsigned)gs, FC_BWD_NT, 0, stream>>>(a);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t flashc_cuda_bwd_simt_launch(const flashc_problem *p, float *dvec, cudaStream_t stream) {
    if (flashc_cuda_bwd_simt_unsupported(p)) return cudaErrorInvalidValue;
    const fc_bwd_args a = fc_bwd_make_args(p, dvec);
    switch (p->dtype) {
    case FLASHC_DTYPE_F32: return fc_bwd_run_dtype<float>(p, a, stream);
    case FLASHC_DTYPE_F16: return fc_bwd_run_dtype<__half>(p, a, stream);
    case FLASHC_DTYPE_BF16: return fc_bwd_run_dtype<__nv_bfloat16>(p, a, stream);
    }
    return cudaErrorInvalidValue;
}

#endif /* __CUDACC__ */
