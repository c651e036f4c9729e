/*
 * bwd.cu - the CUDA backward's host side: which path runs a problem (the tensor-core kernels of
 * bwd_sm80.cuh, or the CUDA-core baseline of bwd_simt.cu for what they do not take), the workspace, and the
 * small kernels around the main ones: D_i = rowsum(dO o O) (which also clears the fp32 dQ sums) before, and the
 * conversion of those sums into dq after.
 *
 * Launch order on the stream: fc_bwd_pre, then fc_bwd_kv_kernel (dK, dV; and dQ by atomics unless
 * deterministic), then fc_bwd_dq_convert or, in deterministic mode, fc_bwd_q_kernel; last, on every path, the
 * zeros of unused keys' dk, dv (seqused_k) and the sinks' gradient (bwd_simt.cu's flashc_cuda_bwd_post_launch).
 */
#include "bwd.h"
#include "bwd_sm80.h"
#include "bwd_sm90.h"
#include "fwd_sm80.h"
#include "launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The backward kernels compiled into this build: the forward's head-dim list (sources.cmake). */
static const struct {
    int d;
    fc_bwd_entry fn;
} bwd_entries[] = {
#ifdef FLASHC_FWD_D32
    {32, flashc_bwd_sm80_d32},
#endif
#ifdef FLASHC_FWD_D64
    {64, flashc_bwd_sm80_d64},
#endif
#ifdef FLASHC_FWD_D96
    {96, flashc_bwd_sm80_d96},
#endif
#ifdef FLASHC_FWD_D128
    {128, flashc_bwd_sm80_d128},
#endif
#ifdef FLASHC_FWD_D160
    {160, flashc_bwd_sm80_d160},
#endif
#ifdef FLASHC_FWD_D192
    {192, flashc_bwd_sm80_d192},
#endif
#ifdef FLASHC_FWD_D256
    {256, flashc_bwd_sm80_d256},
#endif
    {0, NULL}};

/* Lengths the kernels index with 32-bit arithmetic (sums of two stay below 2^31). */
#define BWD_MAX_LEN (INT64_C(1) << 29)

static int64_t bwd_rows(const flashc_problem *p) { return p->varlen ? p->total_q : p->B * p->Nq; }

static int bwd_entry_index(int64_t D) {
    for (int i = 0; bwd_entries[i].fn; i++)
        if (D <= bwd_entries[i].d) return i;
    return -1;
}

/* D_i's share of the workspace, rounded up so that the dQ sums after it start 16-byte aligned. */
static size_t bwd_dvec_bytes(const flashc_problem *p) {
    return ((size_t)bwd_rows(p) * (size_t)p->H * sizeof(float) + 15) / 16 * 16;
}

static int head_dim_unit(const flashc_tensor *t, int64_t D) { return D <= 1 || t->stride[3] == 1; }

/* Whether the tensor-core kernels take p: a compiled head dim, the head dim contiguous in the inputs they load
 * as tiles, 32-bit lengths, grids within one launch, and shared memory this GPU can give. */
static int bwd_tensor_cores(const flashc_problem *p) {
    const int e = bwd_entry_index(p->D);
    if (e < 0) return 0;
    /* dout is absent from a supported()/workspace query (only q, k, v are passed): it is checked when present. */
    if (!head_dim_unit(&p->q, p->D) || !head_dim_unit(&p->k, p->D) || !head_dim_unit(&p->v, p->D) ||
        (p->dout.data && !head_dim_unit(&p->dout, p->D)))
        return 0;
    if (p->Nq > BWD_MAX_LEN || p->Nk > BWD_MAX_LEN || p->total_q > BWD_MAX_LEN * 8 || p->total_k > BWD_MAX_LEN * 8)
        return 0;
    const fc_btile t = fc_btile_for(bwd_entries[e].d);
    const int64_t rh = bwd_rows(p) * p->H;
    if ((p->Nk + t.bk - 1) / t.bk * p->Hkv * p->B > INT_MAX || (p->Nq + t.qbr - 1) / t.qbr * p->H * p->B > INT_MAX ||
        (rh + 7) / 8 > INT_MAX || (rh * p->D + 255) / 256 > INT_MAX)
        return 0;
    flashc_bwd_args a;
    memset(&a, 0, sizeof a);
    a.bf16 = p->dtype != FLASHC_DTYPE_F16;
    size_t smem = 0;
    if (bwd_entries[e].fn(&a, NULL, 2, &smem) != cudaSuccess) {
        cudaGetLastError(); /* a GPU with less shared memory than the tile needs: the baseline runs it */
        return 0;
    }
    return 1;
}

static void make_args(const flashc_problem *p, const fc_btile &t, float *dvec, float *dq_acc, flashc_bwd_args *a);

static size_t bwd_workspace(const flashc_problem *p) {
    size_t bytes = bwd_dvec_bytes(p); /* saturating: the front refuses SIZE_MAX */
    if (!p->deterministic)
        bytes = flashc_size_add(bytes, flashc_size_mul(flashc_size_mul(flashc_size_of_i64(bwd_rows(p)), (size_t)p->H),
                                                       (size_t)p->D * sizeof(float)));
    return bytes;
}

/* Where the Hopper kernel's block-mask bitmaps start in the workspace: after D_i and the dQ sums, 16-byte aligned. */
static size_t bwd_bm_tiles_offset(const flashc_problem *p) {
    const size_t w = bwd_workspace(p);
    return w > SIZE_MAX - 15 ? SIZE_MAX : (w + 15) / 16 * 16;
}

static const char *const bwd_path_names[] = {
    "CUDA cores", "tensor cores (mma.sync)", "sm90 (wgmma, TMA, warp-specialized)",
    "sm90 (wgmma, TMA, warp-specialized) dK/dV + mma.sync dQ (deterministic)"};

const char *flashc_cuda_bwd_plan(const flashc_problem *p, int sm90, int simt_only, flashc_plan *plan) {
    if (p->D > FLASHC_MAX_HEAD_DIM) return "the CUDA backward supports head dims up to 256";
    plan->workspace = bwd_workspace(p);
    plan->entry = -1;
    if (simt_only || !bwd_tensor_cores(p)) {
        const char *why = flashc_cuda_bwd_simt_unsupported(p);
        if (why) return why;
        plan->path = FC_BWD_SIMT;
    } else {
        plan->entry = bwd_entry_index(p->D);
        plan->path = FC_BWD_SM80;
        if (sm90) { /* the Hopper dK/dV kernel, where it runs and takes p */
            /* A query (flashc_supported, flashc_kernel_name) has no dout: it answers for dout laid out like q, as
             * frameworks give it. */
            flashc_problem like = *p;
            if (!p->dout.data) like.dout = p->q;
            flashc_bwd_args a;
            make_args(&like, fc_btile_for(bwd_entries[plan->entry].d), NULL, NULL, &a);
            if (flashc_bwd_sm90_supports(&a)) {
                plan->path = p->deterministic ? FC_BWD_SM90_DET : FC_BWD_SM90;
                /* a block mask's bitmaps after D_i and the dQ sums (bwd_bm_tiles_at) */
                const size_t bm = flashc_bwd_sm90_workspace(&a);
                if (bm) plan->workspace = flashc_size_add(bwd_bm_tiles_offset(p), bm);
            }
        }
    }
    plan->kernel = bwd_path_names[plan->path];
    return NULL;
}

/* ---- the kernels around the main ones ------------------------------------------------------------------ */

/* A strided (B, N, heads, D) view for the element-wise kernels. */
typedef struct bwd_view {
    void *data;
    int64_t sb, sn, sh, sd;
} bwd_view;

typedef struct bwd_pre_args {
    bwd_view o, g, dq;
    int64_t rows, total_q;
    int H, D, Nq, varlen, dtype;
    float scale;
    float *dvec, *dq_acc;
} bwd_pre_args;

static __device__ __forceinline__ float bwd_load(const void *p, int64_t i, int dtype) {
    if (dtype == FLASHC_DTYPE_F32) return ((const float *)p)[i];
    if (dtype == FLASHC_DTYPE_F16) return __half2float(((const __half *)p)[i]);
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

/* x / d and x % d for x >= 0, d > 0: in 32 bits when SMALL (the caller knows x < 2^31), where a 64-bit division
 * is a long instruction sequence per call. */
template <bool SMALL>
static __device__ __forceinline__ int64_t bwd_div(int64_t x, int d, int64_t &rem) {
    if (SMALL) {
        const uint32_t q = (uint32_t)x / (uint32_t)d;
        rem = (int64_t)((uint32_t)x - q * (uint32_t)d);
        return q;
    }
    const int64_t q = x / d;
    rem = x - q * d;
    return q;
}

/* Element (row r of the packed rows, head h) of a view: varlen rows are the tensor's N index, otherwise
 * r = b Nq + n. */
template <bool SMALL = false>
static __device__ __forceinline__ int64_t bwd_at(const bwd_view &v, const bwd_pre_args &a, int64_t r, int h) {
    if (a.varlen) return r * v.sn + (int64_t)h * v.sh;
    int64_t n;
    const int64_t b = bwd_div<SMALL>(r, a.Nq, n);
    return b * v.sb + n * v.sn + (int64_t)h * v.sh;
}

/* One warp per (row, head), x = row H + h: D_i = sum_d dO o O in fp32 (lanes over d, then a fixed-order shuffle
 * tree, so it is reproducible), and the row's dQ sums cleared when there are any. fp32 dO is rounded to bf16 first,
 * as the tensor-core kernels round it for dP = dO V^T: then D_i = sum_j P_ij dP_ij holds for the dP they compute, and
 * dS = P o (dP - D) has no term from dO's rounding alone (with one key, P = 1 and dS must be 0; unrounded, dK there
 * went past the bf16 rule at 4% of seeds, 3.1x the bound at worst: gpu_dropout --case n1x1, H200). */
__global__ void __launch_bounds__(256) fc_bwd_pre(const __grid_constant__ bwd_pre_args a) {
    const int64_t x = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (x >= a.rows * a.H) return;
    const int64_t r = x / a.H;
    const int h = (int)(x % a.H);
    const int64_t oo = bwd_at(a.o, a, r, h), og = bwd_at(a.g, a, r, h);
    float acc = 0.f;
    for (int d = lane; d < a.D; d += 32)
        acc += bwd_load(a.o.data, oo + d * a.o.sd, a.dtype) *
               (a.dtype == FLASHC_DTYPE_F32 ? __bfloat162float(__float2bfloat16_rn(((const float *)a.g.data)[og + d * a.g.sd]))
                                            : bwd_load(a.g.data, og + d * a.g.sd, a.dtype));
#pragma unroll
    for (int m = 16; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (lane == 0) {
        const int64_t idx = a.varlen ? (int64_t)h * a.total_q + r : ((r / a.Nq) * a.H + h) * a.Nq + r % a.Nq;
        a.dvec[idx] = acc;
    }
    if (a.dq_acc)
        for (int d = lane; d < a.D; d += 32) a.dq_acc[x * a.D + d] = 0.f;
}

/* The fast forms of both, for the usual layout (fast_pre / fast_convert below): 16-bit O and dO (or dq, 16-bit
 * or fp32) with the head dim contiguous, rows 16-byte aligned, D a power of two from 8 to 256. A row-head's D
 * elements are D / 8 lanes of 8 (one 16-byte access each), a warp holds 256 / D row-heads, and each thread does
 * its index arithmetic once per 8 elements. SMALL: rows x H x D below 2^31, so that every index divided fits in
 * 32 bits (in 64 bits the divisions took 7% of the preprocess: 53 against 49 us for 134 MB on an H200). */
template <int BF>
static __device__ __forceinline__ float2 bwd_unpack2(uint32_t w) {
    if (BF) return __bfloat1622float2(*(const __nv_bfloat162 *)&w);
    return __half22float2(*(const __half2 *)&w);
}
template <int BF>
static __device__ __forceinline__ uint32_t bwd_pack2(float lo, float hi) {
    uint32_t w;
    if (BF) *(__nv_bfloat162 *)&w = __floats2bfloat162_rn(lo, hi);
    else *(__half2 *)&w = __floats2half2_rn(lo, hi);
    return w;
}

template <int BF, bool SMALL>
__global__ void __launch_bounds__(256) fc_bwd_pre16(const __grid_constant__ bwd_pre_args a) {
    const int seg = a.D / 8, lane = threadIdx.x % 32, sub = lane % seg;
    const int64_t x = ((int64_t)blockIdx.x * 8 + threadIdx.x / 32) * (32 / seg) + lane / seg; /* row H + h */
    const bool valid = x < a.rows * a.H;
    float acc = 0.f;
    int64_t r = 0, hh = 0;
    if (valid) {
        r = bwd_div<SMALL>(x, a.H, hh);
        const int h = (int)hh;
        const uint4 o = *(const uint4 *)((const uint16_t *)a.o.data + bwd_at<SMALL>(a.o, a, r, h) + 8 * sub);
        const uint4 g = *(const uint4 *)((const uint16_t *)a.g.data + bwd_at<SMALL>(a.g, a, r, h) + 8 * sub);
        const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, gw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 of = bwd_unpack2<BF>(ow[i]), gf = bwd_unpack2<BF>(gw[i]);
            acc = fmaf(of.x, gf.x, acc);
            acc = fmaf(of.y, gf.y, acc);
        }
    }
    for (int m = seg / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (valid && sub == 0) {
        int64_t n = 0;
        const int64_t b = a.varlen ? 0 : bwd_div<SMALL>(r, a.Nq, n);
        a.dvec[a.varlen ? hh * a.total_q + r : (b * a.H + hh) * a.Nq + n] = acc;
    }
}

template <int OUT, bool SMALL>
__global__ void __launch_bounds__(256) fc_bwd_dq_convert8(const __grid_constant__ bwd_pre_args a) {
    const int seg = a.D / 8;
    const int64_t c = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (c >= a.rows * a.H * seg) return;
    int64_t piece, h;
    const int64_t rh = bwd_div<SMALL>(c, seg, piece), r = bwd_div<SMALL>(rh, a.H, h);
    const int d0 = (int)piece * 8;
    const float4 lo = *(const float4 *)(a.dq_acc + rh * a.D + d0), hi = *(const float4 *)(a.dq_acc + rh * a.D + d0 + 4);
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const int64_t off = bwd_at<SMALL>(a.dq, a, r, (int)h) + d0;
    if (OUT == FLASHC_DTYPE_F32) {
        float *d = (float *)a.dq.data + off;
        *(float4 *)d = make_float4(a.scale * v[0], a.scale * v[1], a.scale * v[2], a.scale * v[3]);
        *(float4 *)(d + 4) = make_float4(a.scale * v[4], a.scale * v[5], a.scale * v[6], a.scale * v[7]);
    } else {
        constexpr int BF = OUT == FLASHC_DTYPE_BF16;
        uint4 w;
        w.x = bwd_pack2<BF>(a.scale * v[0], a.scale * v[1]);
        w.y = bwd_pack2<BF>(a.scale * v[2], a.scale * v[3]);
        w.z = bwd_pack2<BF>(a.scale * v[4], a.scale * v[5]);
        w.w = bwd_pack2<BF>(a.scale * v[6], a.scale * v[7]);
        *(uint4 *)((uint16_t *)a.dq.data + off) = w;
    }
}

/* The fast kernels' launches with SMALL chosen at run time. */
template <int BF>
static void bwd_pre16_launch(bool small, unsigned blocks, const bwd_pre_args &pa, cudaStream_t stream) {
    if (small) fc_bwd_pre16<BF, true><<<blocks, 256, 0, stream>>>(pa);
    else fc_bwd_pre16<BF, false><<<blocks, 256, 0, stream>>>(pa);
}
template <int OUT>
static void bwd_convert8_launch(bool small, unsigned blocks, const bwd_pre_args &pa, cudaStream_t stream) {
    if (small) fc_bwd_dq_convert8<OUT, true><<<blocks, 256, 0, stream>>>(pa);
    else fc_bwd_dq_convert8<OUT, false><<<blocks, 256, 0, stream>>>(pa);
}

/* dq = scale x the fp32 sums, in dq's dtype and strides; one thread per element. */
__global__ void __launch_bounds__(256) fc_bwd_dq_convert(const __grid_constant__ bwd_pre_args a) {
    const int64_t x = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (x >= a.rows * a.H * a.D) return;
    const int d = (int)(x % a.D);
    const int64_t rh = x / a.D;
    const int64_t off = bwd_at(a.dq, a, rh / a.H, (int)(rh % a.H)) + d * a.dq.sd;
    const float v = a.scale * a.dq_acc[x];
    if (a.dtype == FLASHC_DTYPE_F32) ((float *)a.dq.data)[off] = v;
    else if (a.dtype == FLASHC_DTYPE_F16) ((__half *)a.dq.data)[off] = __float2half_rn(v);
    else ((__nv_bfloat16 *)a.dq.data)[off] = __float2bfloat16_rn(v);
}

/* ---- launch -------------------------------------------------------------------------------------------- */

static bwd_view view_of(const flashc_tensor *t) {
    bwd_view v;
    v.data = t->data;
    v.sb = t->stride[0], v.sn = t->stride[1], v.sh = t->stride[2], v.sd = t->stride[3];
    return v;
}

static void make_args(const flashc_problem *p, const fc_btile &t, float *dvec, float *dq_acc, flashc_bwd_args *a) {
    memset(a, 0, sizeof *a);
    a->q = p->q.data, a->k = p->k.data, a->v = p->v.data, a->dout = p->dout.data;
    a->dq = p->dq.data, a->dk = p->dk.data, a->dv = p->dv.data;
    a->lse = p->lse, a->dvec = dvec, a->dq_acc = dq_acc;
    a->q_sb = p->q.stride[0], a->q_sn = p->q.stride[1], a->q_sh = p->q.stride[2];
    a->k_sb = p->k.stride[0], a->k_sn = p->k.stride[1], a->k_sh = p->k.stride[2];
    a->v_sb = p->v.stride[0], a->v_sn = p->v.stride[1], a->v_sh = p->v.stride[2];
    a->g_sb = p->dout.stride[0], a->g_sn = p->dout.stride[1], a->g_sh = p->dout.stride[2];
    a->dq_sb = p->dq.stride[0], a->dq_sn = p->dq.stride[1], a->dq_sh = p->dq.stride[2], a->dq_sd = p->dq.stride[3];
    a->dk_sb = p->dk.stride[0], a->dk_sn = p->dk.stride[1], a->dk_sh = p->dk.stride[2], a->dk_sd = p->dk.stride[3];
    a->dv_sb = p->dv.stride[0], a->dv_sn = p->dv.stride[1], a->dv_sh = p->dv.stride[2], a->dv_sd = p->dv.stride[3];
    a->B = (int)p->B, a->H = (int)p->H, a->Hkv = (int)p->Hkv, a->Nq = (int)p->Nq, a->Nk = (int)p->Nk;
    a->D = (int)p->D;
    a->total_q = bwd_rows(p);
    a->total_k = p->varlen ? p->total_k : p->B * p->Nk;
    a->varlen = p->varlen;
    a->cu_q = p->cu_q, a->cu_k = p->cu_k;
    a->seqused_k = p->seqused_k;
    a->scale = p->scale;
    fc_set_scores_and_masks(p, a);
    fc_set_dropout(p, a);
    const int f32 = p->dtype == FLASHC_DTYPE_F32;
    a->bf16 = p->dtype != FLASHC_DTYPE_F16;
    a->out_dtype = p->dtype;
    if (f32)
        a->in_mode = FC_IN_F32;
    else if (p->D % 8 == 0 && fc_rows_aligned16(&p->q, p->varlen) && fc_rows_aligned16(&p->k, p->varlen) &&
             fc_rows_aligned16(&p->v, p->varlen) && fc_rows_aligned16(&p->dout, p->varlen))
        a->in_mode = FC_IN_ASYNC16;
    else
        a->in_mode = FC_IN_ELEM16;
    a->n_kblk = (int)((p->Nk + t.bk - 1) / t.bk);
    a->n_qblk = (int)((p->Nq + t.qbr - 1) / t.qbr);
}

static cudaError_t bwd_tensor_core_launch(const flashc_problem *p, const flashc_plan *plan, float *dvec,
                                          void *workspace, long long l2_bytes, cudaStream_t stream);

cudaError_t flashc_cuda_bwd_launch(const flashc_problem *p, const flashc_plan *plan, void *workspace,
                                   long long l2_bytes, cudaStream_t stream) {
    if (plan->workspace > 0 && (!workspace || (uintptr_t)workspace % sizeof(float))) return cudaErrorInvalidValue;
    float *dvec = (float *)workspace;
    cudaError_t err = plan->path == FC_BWD_SIMT ? flashc_cuda_bwd_simt_launch(p, dvec, stream)
                                                : bwd_tensor_core_launch(p, plan, dvec, workspace, l2_bytes, stream);
    if (err != cudaSuccess) return err;
    return flashc_cuda_bwd_post_launch(p, dvec, stream);
}

/* The tensor-core paths: D_i, the dK/dV (and atomic dQ) kernel, then dq. */
static cudaError_t bwd_tensor_core_launch(const flashc_problem *p, const flashc_plan *plan, float *dvec,
                                          void *workspace, long long l2_bytes, cudaStream_t stream) {

    const int e = plan->entry;
    const fc_btile t = fc_btile_for(bwd_entries[e].d);
    float *dq_acc = p->deterministic ? NULL : (float *)((char *)workspace + bwd_dvec_bytes(p));
    flashc_bwd_args a;
    make_args(p, t, dvec, dq_acc, &a);

    bwd_pre_args pa;
    memset(&pa, 0, sizeof pa);
    pa.o = view_of(&p->out), pa.g = view_of(&p->dout), pa.dq = view_of(&p->dq);
    pa.rows = bwd_rows(p), pa.total_q = a.total_q;
    pa.H = a.H, pa.D = a.D, pa.Nq = a.Nq, pa.varlen = a.varlen, pa.dtype = p->dtype;
    pa.scale = p->scale;
    pa.dvec = dvec, pa.dq_acc = dq_acc;

    cudaError_t err;
    const int pow2 = p->D >= 8 && p->D <= 256 && (p->D & (p->D - 1)) == 0;
    const int fast_pre = pow2 && p->dtype != FLASHC_DTYPE_F32 && p->out.stride[3] == 1 && p->dout.stride[3] == 1 &&
                         fc_rows_aligned16(&p->out, p->varlen) && fc_rows_aligned16(&p->dout, p->varlen);
    const int64_t rh = pa.rows * pa.H;
    const bool small = rh * p->D < ((int64_t)1 << 31); /* every index the fast kernels divide fits in 32 bits */
    if (rh > 0 && fast_pre) {
        /* The dQ sums are cleared by a memset (at the copy engine's rate) instead of by the kernel: clearing them in
         * this kernel instead measured no faster (bench/RESULTS.md, 2026-11-24). */
        pa.dq_acc = NULL;
        const int64_t blocks = (rh + 256 / p->D * 8 - 1) / (256 / p->D * 8);
        if (p->dtype == FLASHC_DTYPE_BF16) bwd_pre16_launch<1>(small, (unsigned)blocks, pa, stream);
        else bwd_pre16_launch<0>(small, (unsigned)blocks, pa, stream);
        if ((err = cudaGetLastError()) != cudaSuccess) return err;
        if (dq_acc && (err = cudaMemsetAsync(dq_acc, 0, (size_t)rh * p->D * sizeof(float), stream)) != cudaSuccess)
            return err;
        pa.dq_acc = dq_acc;
    } else if (rh > 0) {
        fc_bwd_pre<<<(unsigned)((rh + 7) / 8), 256, 0, stream>>>(pa);
        if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
    if ((int64_t)a.n_kblk * a.Hkv * a.B > 0) {
        size_t smem;
        if ((err = bwd_entries[e].fn(&a, stream, 2, &smem)) != cudaSuccess) return err;
        if (plan->path == FC_BWD_SM90 || plan->path == FC_BWD_SM90_DET) {
            if (a.bm) a.bm_tiles = (const uint32_t *)((char *)workspace + bwd_bm_tiles_offset(p));
            err = flashc_bwd_sm90_launch(&a, l2_bytes, stream);
        }
        else err = bwd_entries[e].fn(&a, stream, 0, NULL);
        if (err != cudaSuccess) return err;
    }
    if (p->deterministic) {
        if ((int64_t)a.n_qblk * a.H * a.B > 0 && (err = bwd_entries[e].fn(&a, stream, 1, NULL)) != cudaSuccess)
            return err;
    } else {
        const int64_t n = pa.rows * pa.H * pa.D;
        const int fast = pow2 && p->dq.stride[3] == 1 && fc_rows_aligned16(&p->dq, p->varlen);
        if (n > 0 && fast) {
            const unsigned blocks = (unsigned)((n / 8 + 255) / 256);
            if (p->dtype == FLASHC_DTYPE_F32) bwd_convert8_launch<FLASHC_DTYPE_F32>(small, blocks, pa, stream);
            else if (p->dtype == FLASHC_DTYPE_BF16) bwd_convert8_launch<FLASHC_DTYPE_BF16>(small, blocks, pa, stream);
            else bwd_convert8_launch<FLASHC_DTYPE_F16>(small, blocks, pa, stream);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        } else if (n > 0) {
            fc_bwd_dq_convert<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(pa);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
    }
    return cudaSuccess;
}
