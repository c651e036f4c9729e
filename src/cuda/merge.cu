/*
 * merge.cu - flashc_merge on the GPU: two partial attention results over disjoint key sets into one (the combine of
 * cascade attention, split-KV and ring / context parallelism), row by row:
 *   lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b,
 * with the empty-part rule of flashc_merge_weights (src/internal.h), the one the CPU backend runs too.
 *
 * Memory-bound: every element of out_a and out_b is read once and out written once. A row of D elements is taken by
 * TPR lanes (the smallest power of two, at most 32, whose 16-byte pieces cover it), so a warp merges 32 / TPR rows
 * at once and short rows do not leave lanes idle. Views whose rows are 16-byte aligned with unit stride along D
 * move 16 bytes per access; any other strides go one element at a time. The lane that leads a row reads its two lse
 * values, passes them to the row's other lanes by shuffle and writes the merged lse itself: a row's lse is read
 * before it is written by the same thread, so lse may be lse_a or lse_b (in place), as out may be out_a or out_b
 * (each element is read and written by one thread).
 */
#include "merge.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#define FC_MERGE_THREADS 256
#define FC_MERGE_MAX_BLOCKS (1 << 20) /* the rows loop strides over the grid past that */

typedef struct fc_merge_args {
    const void *a, *b;
    void *o;
    int64_t sa[4], sb[4], so[4]; /* element strides of out_a, out_b, out */
    const float *lse_a, *lse_b;
    float *lse; /* NULL: not written */
    int64_t N, H, D, rows;
    int tpr; /* lanes per row, a power of two <= 32 */
} fc_merge_args;

/* Element conversions of a dtype, and its elements inside a 16-byte word. */
template <int DT> struct fc_merge_type;
template <> struct fc_merge_type<FLASHC_DTYPE_F32> {
    enum { VEC = 4 };
    static __device__ float load(const void *p, int64_t i) { return ((const float *)p)[i]; }
    static __device__ void store(void *p, int64_t i, float x) { ((float *)p)[i] = x; }
    static __device__ float get(const uint32_t *w, int k) { return __uint_as_float(w[k]); }
    static __device__ void put(uint32_t *w, int k, float x) { w[k] = __float_as_uint(x); }
};
template <int DT> struct fc_merge_type16 { /* f16 and bf16: two elements per 32-bit word, low half first */
    enum { VEC = 8 };
    static __device__ float cvt(unsigned short u) {
        return DT == FLASHC_DTYPE_F16 ? __half2float(__ushort_as_half(u)) : __bfloat162float(__ushort_as_bfloat16(u));
    }
    static __device__ unsigned short rnd(float x) {
        return DT == FLASHC_DTYPE_F16 ? __half_as_ushort(__float2half_rn(x))
                                      : __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    static __device__ float load(const void *p, int64_t i) { return cvt(((const unsigned short *)p)[i]); }
    static __device__ void store(void *p, int64_t i, float x) { ((unsigned short *)p)[i] = rnd(x); }
    static __device__ float get(const uint32_t *w, int k) { return cvt((unsigned short)(w[k >> 1] >> (16 * (k & 1)))); }
    static __device__ void put(uint32_t *w, int k, float x) { w[k >> 1] |= (uint32_t)rnd(x) << (16 * (k & 1)); }
};
template <> struct fc_merge_type<FLASHC_DTYPE_F16> : fc_merge_type16<FLASHC_DTYPE_F16> {};
template <> struct fc_merge_type<FLASHC_DTYPE_BF16> : fc_merge_type16<FLASHC_DTYPE_BF16> {};

union fc_word16 {
    uint4 v;
    uint32_t w[4];
};

/* VEC: elements per access, fc_merge_type<DT>::VEC (16 bytes, unit stride along D) or 1 (any strides). */
template <int DT, int VEC>
__global__ void __launch_bounds__(FC_MERGE_THREADS) fc_merge_kernel(const __grid_constant__ fc_merge_args a) {
    typedef fc_merge_type<DT> E;
    const int lane = threadIdx.x & 31, lead = lane & ~(a.tpr - 1), sub = lane - lead;
    const int64_t per_warp = 32 / a.tpr, warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5,
                  warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r0 = warp * per_warp; r0 < a.rows; r0 += warps * per_warp) { /* uniform across the warp */
        const int64_t r = r0 + lane / a.tpr; /* (b * N + i) * H + h: out's rows in memory order */
        const bool live = r < a.rows;
        const int64_t h = r % a.H, i = r / a.H % a.N, b = r / (a.H * a.N), l = (b * a.H + h) * a.N + i;
        float la = 0.f, lb = 0.f;
        if (live && sub == 0) la = a.lse_a[l], lb = a.lse_b[l];
        la = __shfl_sync(0xffffffffu, la, lead);
        lb = __shfl_sync(0xffffffffu, lb, lead);
        if (!live) continue;
        float wa, wb;
        const float lse = flashc_merge_weights(la, lb, &wa, &wb);
        const int64_t oa = b * a.sa[0] + i * a.sa[1] + h * a.sa[2], ob = b * a.sb[0] + i * a.sb[1] + h * a.sb[2],
                      oo = b * a.so[0] + i * a.so[1] + h * a.so[2];
        for (int64_t d = (int64_t)sub * VEC; d < a.D; d += (int64_t)a.tpr * VEC) {
            if (VEC > 1) {
                fc_word16 x, y, z;
                z.v = make_uint4(0u, 0u, 0u, 0u); /* put() ors the 16-bit elements in */
                x.v = *(const uint4 *)((const char *)a.a + (oa + d) * (16 / VEC));
                y.v = *(const uint4 *)((const char *)a.b + (ob + d) * (16 / VEC));
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    E::put(z.w, k, flashc_merge_value(wa, E::get(x.w, k), wb, E::get(y.w, k)));
                *(uint4 *)((char *)a.o + (oo + d) * (16 / VEC)) = z.v;
            } else {
                E::store(a.o, oo + d * a.so[3],
                         flashc_merge_value(wa, E::load(a.a, oa + d * a.sa[3]), wb, E::load(a.b, ob + d * a.sb[3])));
            }
        }
        if (sub == 0 && a.lse) a.lse[l] = lse;
    }
}

/* 16-byte aligned base, unit stride along D and the other strides multiples of vec elements (dims of extent 1
 * never move): every row piece of vec elements is one aligned 16-byte word. */
static int rows_vectorizable(const flashc_tensor *t, int64_t vec) {
    if ((uintptr_t)t->data % 16 || t->stride[3] != 1) return 0;
    for (int d = 0; d < 3; d++)
        if (t->shape[d] > 1 && t->stride[d] % vec) return 0;
    return 1;
}

template <int DT>
static void launch(const fc_merge_args &a, int vec, int64_t blocks, cudaStream_t stream) {
    if (vec > 1)
        fc_merge_kernel<DT, fc_merge_type<DT>::VEC><<<(unsigned)blocks, FC_MERGE_THREADS, 0, stream>>>(a);
    else
        fc_merge_kernel<DT, 1><<<(unsigned)blocks, FC_MERGE_THREADS, 0, stream>>>(a);
}

flashc_status flashc_cuda_merge(struct flashc_context *ctx, const flashc_tensor *out_a, const float *lse_a,
                                const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out, float *lse) {
    cudaError_t e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "cudaSetDevice(%d): %s (%s)", ctx->device,
                          cudaGetErrorString(e), cudaGetErrorName(e));
    }
    fc_merge_args a;
    a.a = out_a->data, a.b = out_b->data, a.o = out->data;
    for (int d = 0; d < 4; d++) a.sa[d] = out_a->stride[d], a.sb[d] = out_b->stride[d], a.so[d] = out->stride[d];
    a.lse_a = lse_a, a.lse_b = lse_b, a.lse = lse;
    a.N = out->shape[1], a.H = out->shape[2], a.D = out->shape[3];
    a.rows = out->shape[0] * a.N * a.H;
    const int64_t vec = 16 / (int64_t)flashc_dtype_size(out->dtype);
    const int vectorized = a.D % vec == 0 && rows_vectorizable(out_a, vec) && rows_vectorizable(out_b, vec) &&
                           rows_vectorizable(out, vec);
    const int64_t pieces = vectorized ? a.D / vec : a.D;
    a.tpr = 1;
    while (a.tpr < 32 && a.tpr < pieces) a.tpr *= 2;
    const int64_t rows_per_block = (FC_MERGE_THREADS / 32) * (32 / a.tpr);
    int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
    if (blocks > FC_MERGE_MAX_BLOCKS) blocks = FC_MERGE_MAX_BLOCKS;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    const int v = vectorized ? (int)vec : 1;
    switch (out->dtype) {
    case FLASHC_DTYPE_F16: launch<FLASHC_DTYPE_F16>(a, v, blocks, stream); break;
    case FLASHC_DTYPE_BF16: launch<FLASHC_DTYPE_BF16>(a, v, blocks, stream); break;
    default: launch<FLASHC_DTYPE_F32>(a, v, blocks, stream); break;
    }
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "merge kernel launch: %s (%s)", cudaGetErrorString(e),
                          cudaGetErrorName(e));
    return FLASHC_STATUS_OK;
}
