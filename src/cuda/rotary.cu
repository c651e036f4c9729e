/*
 * rotary.cu - flashc_rotary on the GPU: rotary position embedding (RoPE, Su et al. 2021, "RoFormer", section 3.4.2),
 * flash-attn's apply_rotary_emb. Row i of batch b sits at position seq_start[b] + i; each pair of its first R dims,
 * (j, j + R/2) or interleaved (2j, 2j + 1), turns by the tables' cosine and sine at that position, through
 * flashc_rotary_pair (src/internal.h), the rule the CPU backend runs too: both give the same bits.
 *
 * Elementwise and memory-bound. A row's work items are its R/2 pairs and, when out is not x, its D - R elements past R
 * to copy; where x and out have unit stride along D and 16-byte aligned rows (and the pair blocks are whole words),
 * an item is a 16-byte word instead (VEC = 4 f32 or 8 f16 / bf16 elements: VEC pairs from the two halves' words, or
 * VEC / 2 interleaved pairs of one word, or a word copied), so that each load has bytes enough in flight. TPR lanes
 * take a row (the smallest power of two, at most 32, that covers its items), consecutive lanes consecutive items, so a
 * warp reads and writes whole rows in order and short rows do not leave lanes idle. A row's indices are split once
 * per row, in 32 bits where they fit. Any other strides go element by element. A thread reads its pair before it writes
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
    int64_t rot_items;            /* work items per row that rotate: R/2 pairs, or words of pairs (16-byte path) */
    int64_t units;                /* work items per row: those, then the copies past R (none in place) */
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

/* Elements of a 16-byte word of dtype DT (VEC of them: 4 f32 or 8 f16 / bf16, low half of each 32-bit word first). */
union fc_rot_word {
    uint4 v;
    uint32_t w[4];
};
template <int DT> static __device__ float fc_rot_get(const fc_rot_word &x, int k) {
    if (DT == FLASHC_DTYPE_F32) return __uint_as_float(x.w[k]);
    const unsigned short u = (unsigned short)(x.w[k >> 1] >> (16 * (k & 1)));
    return DT == FLASHC_DTYPE_F16 ? __half2float(__ushort_as_half(u)) : __bfloat162float(__ushort_as_bfloat16(u));
}
template <int DT> static __device__ void fc_rot_put(fc_rot_word &x, int k, float v) {
    if (DT == FLASHC_DTYPE_F32) {
        x.w[k] = __float_as_uint(v);
        return;
    }
    const uint32_t u = DT == FLASHC_DTYPE_F16 ? __half_as_ushort(__float2half_rn(v))
                                              : __bfloat16_as_ushort(__float2bfloat16_rn(v));
    x.w[k >> 1] = (x.w[k >> 1] & (0xffff0000u >> (16 * (k & 1)))) | (u << (16 * (k & 1)));
}

/* Work item k of a row (x at element ox, out at oo, position p, inside: p in [0, P)). VEC 1: pair k, or the element
 * half + k past R to copy. VEC > 1 (unit stride along D, 16-byte words): a word of pairs, VEC of them in two words
 * (halves) or VEC / 2 in one (interleaved), or a word past R to copy. */
template <int DT, int VEC>
static __device__ void fc_rot_item(const fc_rotary_args &a, int64_t k, int64_t ox, int64_t oo, int64_t p, bool inside) {
    if (k >= a.rot_items) { /* past R: copied */
        const int64_t d = 2 * a.half + (k - a.rot_items) * VEC;
        const int64_t esz = 16 / VEC;
        if (VEC == 1) fc_rot_store<DT>(a.o, oo + d * a.so[3], fc_rot_load<DT>(a.x, ox + d * a.sx[3]));
        else *(uint4 *)((char *)a.o + (oo + d) * esz) = *(const uint4 *)((const char *)a.x + (ox + d) * esz);
        return;
    }
    if (VEC == 1) {
        const int64_t du = a.interleaved ? 2 * k : k, dw = a.interleaved ? du + 1 : du + a.half;
        float yu = NAN, yw = NAN;
        if (inside)
            flashc_rotary_pair(fc_rot_load<DT>(a.x, ox + du * a.sx[3]), fc_rot_load<DT>(a.x, ox + dw * a.sx[3]),
                               fc_rot_table(a.cos, a.table_dtype, p * a.cos_row + k * a.cos_col),
                               fc_rot_table(a.sin, a.table_dtype, p * a.sin_row + k * a.sin_col), &yu, &yw);
        fc_rot_store<DT>(a.o, oo + du * a.so[3], yu);
        fc_rot_store<DT>(a.o, oo + dw * a.so[3], yw);
        return;
    }
    const int64_t d0 = k * VEC; /* the item's first element: halves in both halves, interleaved its word */
    const char *xb = (const char *)a.x;
    char *ob = (char *)a.o;
    if (!a.interleaved) {
        fc_rot_word u, w;
        u.v = *(const uint4 *)(xb + (ox + d0) * (16 / VEC));
        w.v = *(const uint4 *)(xb + (ox + d0 + a.half) * (16 / VEC));
#pragma unroll
        for (int t = 0; t < VEC; t++) {
            float yu = NAN, yw = NAN;
            if (inside)
                flashc_rotary_pair(fc_rot_get<DT>(u, t), fc_rot_get<DT>(w, t),
                                   fc_rot_table(a.cos, a.table_dtype, p * a.cos_row + d0 + t),
                                   fc_rot_table(a.sin, a.table_dtype, p * a.sin_row + d0 + t), &yu, &yw);
            fc_rot_put<DT>(u, t, yu);
            fc_rot_put<DT>(w, t, yw);
        }
        *(uint4 *)(ob + (oo + d0) * (16 / VEC)) = u.v;
        *(uint4 *)(ob + (oo + d0 + a.half) * (16 / VEC)) = w.v;
    } else {
        fc_rot_word x;
        x.v = *(const uint4 *)(xb + (ox + d0) * (16 / VEC));
#pragma unroll
        for (int t = 0; t < VEC; t += 2) {
            float yu = NAN, yw = NAN;
            if (inside)
                flashc_rotary_pair(fc_rot_get<DT>(x, t), fc_rot_get<DT>(x, t + 1),
                                   fc_rot_table(a.cos, a.table_dtype, p * a.cos_row + (d0 + t) / 2),
                                   fc_rot_table(a.sin, a.table_dtype, p * a.sin_row + (d0 + t) / 2), &yu, &yw);
            fc_rot_put<DT>(x, t, yu);
            fc_rot_put<DT>(x, t + 1, yw);
        }
        *(uint4 *)(ob + (oo + d0) * (16 / VEC)) = x.v;
    }
}

template <int DT, int VEC>
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
        for (int64_t k = sub; k < a.units; k += a.tpr) fc_rot_item<DT, VEC>(a, k, ox, oo, p, inside);
    }
}

/* The 16-byte path: unit stride along D for x, out and the tables, x and out 16-byte aligned with every other stride
 * (of a dim longer than 1) a multiple of vec elements, and the pair blocks and the copied dims whole words. */
static int rotary_vectorizable(const flashc_tensor *x, const flashc_tensor *cos, const flashc_tensor *sin,
                               const flashc_tensor *out, int interleaved, int in_place, int64_t vec) {
    const int64_t half = cos->shape[3], D = x->shape[3];
    if (cos->stride[3] != 1 || sin->stride[3] != 1 || (interleaved ? 2 * half : half) % vec ||
        (!in_place && (D - 2 * half) % vec))
        return 0;
    const flashc_tensor *t[2] = {x, out};
    for (int v = 0; v < 2; v++) {
        if ((uintptr_t)t[v]->data % 16 || t[v]->stride[3] != 1) return 0;
        for (int d = 0; d < 3; d++)
            if (t[v]->shape[d] > 1 && t[v]->stride[d] % vec) return 0;
    }
    return 1;
}

template <int DT>
static void rotary_launch(const fc_rotary_args &a, int vec, unsigned grid, cudaStream_t stream) {
    if (vec > 1)
        fc_rotary_kernel<DT, 16 / (DT == FLASHC_DTYPE_F32 ? 4 : 2)><<<grid, FC_ROTARY_THREADS, 0, stream>>>(a);
    else
        fc_rotary_kernel<DT, 1><<<grid, FC_ROTARY_THREADS, 0, stream>>>(a);
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
    const int64_t vec = 16 / (int64_t)flashc_dtype_size(x->dtype);
    const int v = rotary_vectorizable(x, cos, sin, out, interleaved, in_place, vec) ? (int)vec : 1;
    a.rot_items = v == 1 ? a.half : (interleaved ? 2 * a.half : a.half) / v;
    a.units = a.rot_items + (in_place ? 0 : (x->shape[3] - 2 * a.half) / v);
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
    case FLASHC_DTYPE_F16: rotary_launch<FLASHC_DTYPE_F16>(a, v, grid, stream); break;
    case FLASHC_DTYPE_BF16: rotary_launch<FLASHC_DTYPE_BF16>(a, v, grid, stream); break;
    default: rotary_launch<FLASHC_DTYPE_F32>(a, v, grid, stream); break;
    }
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "rotary kernel launch: %s (%s)", cudaGetErrorString(e),
                          cudaGetErrorName(e));
    return FLASHC_STATUS_OK;
}
