/*
 * rotary.cu - flashc_rotary on the GPU: rotary position embedding (RoPE, Su et al. 2021, "RoFormer", section 3.4.2),
 * flash-attn's apply_rotary_emb. Row i of batch b sits at position seq_start[b] + i; each pair of its first R dims,
 * (j, j + R/2) or interleaved (2j, 2j + 1), turns by the tables' cosine and sine at that position, through
 * flashc_rotary_pair (src/internal.h), the rule the CPU backend runs too: both give the same bits.
 *
 * Elementwise and memory-bound. A row's work items are its R/2 pairs and, when out is not x, its D - R elements past R
 * to copy; TPR lanes take a row (the smallest power of two, at most 32, that covers its items), consecutive lanes
 * consecutive pairs, so a warp reads and writes whole rows in order and short rows do not leave lanes idle. A row's
 * indices are split once per row, in 32 bits where they fit. Any strides. A thread reads its pair before it writes
 * it, so out may be x's very view (in place; the dims past R are then not touched). The kernel cannot report a
 * position outside the tables (seq_start lives in device memory, read only here): that row's first R elements come out
 * NaN and the tables are not read.
 */
#include "rotary.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#define FC_ROTARY_THREADS 256
#define FC_ROTARY_MAX_BLOCKS (1 << 20) /* the loop strides over the grid past that */

typedef struct fc_rotary_args {
    const void *x, *cos, *sin;
    void *o;
    int64_t sx[4], so[4];         /* element strides of x and out */
    int64_t cos_row, cos_col;     /* of the cos table (1, P, 1, R/2): along P and along R/2 */
    int64_t sin_row, sin_col;
    const int32_t *seq_start;     /* NULL: 0 */
    int64_t N, H, half, P, rows;  /* rows = B * N * H */
    int64_t units;                /* work items per row: half pairs, then D - R copies (none in place) */
    int tpr;                      /* lanes per row, a power of two <= 32 */
    int narrow;                   /* rows < 2^32: row indices split in 32 bits */
    int table_dtype;
    int interleaved;
} fc_rotary_args;

/* An element of x or out (DT) or of the tables (any dtype, known at run time: one branch the warp takes together). */
template <int DT> static __device__ float fc_rot_load(const void *p, int64_t i) {
    if (DT == FLASHC_DTYPE_F16) return __half2float(((const __half *)p)[i]);
    if (DT == FLASHC_DTYPE_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return ((const float *)p)[i];
}
template <int DT> static __device__ void fc_rot_store(void *p, int64_t i, float v) {
    if (DT == FLASHC_DTYPE_F16) ((__half *)p)[i] = __float2half_rn(v);
    else if (DT == FLASHC_DTYPE_BF16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else ((float *)p)[i] = v;
}
static __device__ float fc_rot_table(const void *p, int dt, int64_t i) {
    return dt == FLASHC_DTYPE_F16    ? fc_rot_load<FLASHC_DTYPE_F16>(p, i)
           : dt == FLASHC_DTYPE_BF16 ? fc_rot_load<FLASHC_DTYPE_BF16>(p, i)
                                     : fc_rot_load<FLASHC_DTYPE_F32>(p, i);
}

template <int DT>
__global__ void __launch_bounds__(FC_ROTARY_THREADS) fc_rotary_kernel(const __grid_constant__ fc_rotary_args a) {
    const int lane = threadIdx.x & 31, sub = lane & (a.tpr - 1);
    const int64_t per_warp = 32 / a.tpr, warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5,
                  warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r0 = warp * per_warp; r0 < a.rows; r0 += warps * per_warp) {
        const int64_t r = r0 + lane / a.tpr; /* (b * N + i) * H + h: x's rows in memory order */
        if (r >= a.rows) continue;
        int64_t b, i, h; /* 32-bit divisions where the sizes allow (64-bit ones are long instruction sequences) */
        if (a.narrow) {
            const uint32_t r32 = (uint32_t)r, H32 = (uint32_t)a.H, q = r32 / H32;
            h = r32 - q * H32, i = q % (uint32_t)a.N, b = q / (uint32_t)a.N;
        } else {
            h = r % a.H, i = r / a.H % a.N, b = r / (a.H * a.N);
        }
        const int64_t ox = b * a.sx[0] + i * a.sx[1] + h * a.sx[2], oo = b * a.so[0] + i * a.so[1] + h * a.so[2];
        const int64_t p = (a.seq_start ? (int64_t)a.seq_start[b] : 0) + i;
        const bool inside = p >= 0 && p < a.P;
        for (int64_t k = sub; k < a.units; k += a.tpr) {
            if (k >= a.half) { /* a dim past R: copied */
                const int64_t d = a.half + k;
                fc_rot_store<DT>(a.o, oo + d * a.so[3], fc_rot_load<DT>(a.x, ox + d * a.sx[3]));
                continue;
            }
            const int64_t du = a.interleaved ? 2 * k : k, dw = a.interleaved ? du + 1 : du + a.half;
            float yu = NAN, yw = NAN;
            if (inside)
                flashc_rotary_pair(fc_rot_load<DT>(a.x, ox + du * a.sx[3]), fc_rot_load<DT>(a.x, ox + dw * a.sx[3]),
                                   fc_rot_table(a.cos, a.table_dtype, p * a.cos_row + k * a.cos_col),
                                   fc_rot_table(a.sin, a.table_dtype, p * a.sin_row + k * a.sin_col), &yu, &yw);
            fc_rot_store<DT>(a.o, oo + du * a.so[3], yu);
            fc_rot_store<DT>(a.o, oo + dw * a.so[3], yw);
        }
    }
}

flashc_status flashc_cuda_rotary(struct flashc_context *ctx, const flashc_tensor *x, const flashc_tensor *cos,
                                 const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                                 const flashc_tensor *out) {
    cudaError_t e = cudaSetDevice(ctx->device);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "cudaSetDevice(%d): %s (%s)", ctx->device,
                          cudaGetErrorString(e), cudaGetErrorName(e));
    }
    fc_rotary_args a;
    a.x = x->data, a.o = out->data, a.cos = cos->data, a.sin = sin->data;
    for (int d = 0; d < 4; d++) a.sx[d] = x->stride[d], a.so[d] = out->stride[d];
    a.cos_row = cos->stride[1], a.cos_col = cos->stride[3], a.sin_row = sin->stride[1], a.sin_col = sin->stride[3];
    a.seq_start = seq_start;
    a.N = x->shape[1], a.H = x->shape[2], a.half = cos->shape[3], a.P = cos->shape[1];
    a.rows = x->shape[0] * a.N * a.H;
    const int in_place = out->data == x->data; /* the front let out meet x only as x's very view */
    a.units = a.half + (in_place ? 0 : x->shape[3] - 2 * a.half);
    a.table_dtype = (int)cos->dtype;
    a.interleaved = interleaved;
    a.tpr = 1;
    while (a.tpr < 32 && a.tpr < a.units) a.tpr *= 2;
    a.narrow = a.rows <= (int64_t)UINT32_MAX;
    const int64_t rows_per_block = (FC_ROTARY_THREADS / 32) * (32 / a.tpr);
    int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
    if (blocks > FC_ROTARY_MAX_BLOCKS) blocks = FC_ROTARY_MAX_BLOCKS;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    const unsigned grid = (unsigned)blocks;
    switch (x->dtype) {
    case FLASHC_DTYPE_F16: fc_rotary_kernel<FLASHC_DTYPE_F16><<<grid, FC_ROTARY_THREADS, 0, stream>>>(a); break;
    case FLASHC_DTYPE_BF16: fc_rotary_kernel<FLASHC_DTYPE_BF16><<<grid, FC_ROTARY_THREADS, 0, stream>>>(a); break;
    default: fc_rotary_kernel<FLASHC_DTYPE_F32><<<grid, FC_ROTARY_THREADS, 0, stream>>>(a); break;
    }
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "rotary kernel launch: %s (%s)", cudaGetErrorString(e),
                          cudaGetErrorName(e));
    return FLASHC_STATUS_OK;
}
