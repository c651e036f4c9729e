/*
 * fwd_combine.cu - the split-KV combine of the forward (flash-decoding). When B * H * query tiles cannot fill the
 * GPU, each (query tile, head, sequence) is split into nsplit ranges of key tiles; every split writes its
 * normalized partial O_s and lse_s (fp32, workspace), and this kernel merges them exactly:
 *   lse = ln sum_s exp(lse_s),  O = sum_s exp(lse_s - lse) O_s.
 * A split that saw no key has lse_s = -inf and weight 0; a row no split saw gets O = 0, lse = +inf. An attention
 * sink joins here (the splits' partials leave it out) as one more term with no output.
 */
#include "fwd_sm80.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define FC_COMBINE_WARPS 4
#define FC_COMBINE_CHUNK 128 /* splits whose weights a warp holds at once (both split counts stop at 128) */
#define FC_COMBINE_COLS 256  /* the widest head dim of the CUDA kernels (cuda.cu's fwd_check refuses more) */

/* Element at of the output (an index into it), in its type. */
static __device__ __forceinline__ void fc_combine_store(const flashc_fwd_args &a, int64_t at, float v) {
    if (a.out_f32)
        ((float *)a.out)[at] = v;
    else if (a.bf16)
        ((__nv_bfloat16 *)a.out)[at] = __float2bfloat16_rn(v);
    else
        ((__half *)a.out)[at] = __float2half_rn(v);
}

/*
 * One warp per (head, row): lanes split the splits for the lse and the weights exp(lse_s - lse) (kept in shared
 * memory), and each lane sums four adjacent columns of O over the splits, FC_COMBINE_AHEAD splits' loads in flight
 * at a time; the first group's loads are issued before the lse's, so that both wait on one round trip. The sum
 * runs over the splits in order for every column, so the result does not depend on the lane layout. (Earlier
 * versions: one column per lane and one split at a time, 30 us for 16 splits of 32 rows at D 128 on an H200; then
 * four splits in flight after the lse, 10 us under Nsight Compute, against 3.9 us for cuDNN's reduction.)
 */
#define FC_COMBINE_AHEAD 8

/* Columns 4 lane + 128 k .. + 3 of split s's partial row p (zeros past D or past the splits). */
static __device__ __forceinline__ void fc_combine_load(const float *p, int s, int nc, int d0, int D, bool vec, float (&v)[4]) {
    v[0] = v[1] = v[2] = v[3] = 0.f;
    if (s >= nc || d0 >= D) return;
    if (vec) {
        const float4 x = *(const float4 *)p;
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = d0 + e < D ? p[e] : 0.f;
    }
}

__global__ void __launch_bounds__(FC_COMBINE_WARPS * 32) fc_fwd_combine_kernel(const __grid_constant__ flashc_fwd_args a) {
    constexpr int K = FC_COMBINE_COLS / 128, G = FC_COMBINE_AHEAD;
    __shared__ float wsm[FC_COMBINE_WARPS][FC_COMBINE_CHUNK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t pair = (int64_t)blockIdx.x * FC_COMBINE_WARPS + warp;
    if (pair >= a.H * a.total_q) return; /* whole warps: the syncs below are per warp */
    const int h = (int)(pair / a.total_q);
    const int64_t grow = pair % a.total_q;
    const int64_t stride_s = (int64_t)a.H * a.total_q; /* between splits, in rows */
    const int64_t step = stride_s * a.D;                /* between splits, in floats */
    const float *ls = a.ws_lse + (int64_t)h * a.total_q + grow;
    const float *po = a.ws_o + ((int64_t)h * a.total_q + grow) * a.D;
    const bool vec = a.D % 4 == 0; /* rows of D floats: 16-byte aligned columns */

    /* The first group of partial rows, in flight while the lse is formed. */
    float v[G][K][4];
    const int nc0 = min(a.nsplit, FC_COMBINE_CHUNK);
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < K; ++k)
            fc_combine_load(po + g * step + 4 * lane + 128 * k, g, nc0, 4 * lane + 128 * k, a.D, vec, v[g][k]);

    /* An attention sink is one more partial, with lse = the sink and no output. */
    const float sink = a.sinks ? a.sinks[h] : -INFINITY;
    float mx = lane == 0 ? sink : -INFINITY;
    for (int s = lane; s < a.nsplit; s += 32) mx = fmaxf(mx, ls[s * stride_s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    if (mx != -INFINITY) {
        if (lane == 0 && a.sinks) sum = expf(sink - mx);
        for (int s = lane; s < a.nsplit; s += 32) sum += expf(ls[s * stride_s] - mx);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float lse = mx == -INFINITY ? INFINITY : mx + logf(sum);

    /* Output row: packed row grow (varlen) or (b, i) = divmod(grow, Nq). */
    int64_t b = 0, i = grow;
    if (!a.varlen) {
        b = grow / a.Nq;
        i = grow % a.Nq;
    }
    const int64_t orow = b * a.o_sb + i * a.o_sn + (int64_t)h * a.o_sh;
    float *w = wsm[warp];
    float acc[K][4] = {};
    for (int c0 = 0; c0 < a.nsplit && mx != -INFINITY; c0 += FC_COMBINE_CHUNK) {
        const int nc = min(a.nsplit - c0, FC_COMBINE_CHUNK);
        __syncwarp();
        for (int s = lane; s < nc; s += 32) { /* 0 for a split that saw no key (its partial O is 0 too) */
            const float l = ls[(c0 + s) * stride_s];
            w[s] = l != -INFINITY ? expf(l - lse) : 0.f;
        }
        __syncwarp();
        for (int s0 = 0; s0 < nc; s0 += G) {
            if (c0 > 0 || s0 > 0) /* the next group (the first is loaded above) */
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int k = 0; k < K; ++k)
                        fc_combine_load(po + (c0 + s0 + g) * step + 4 * lane + 128 * k, s0 + g, nc, 4 * lane + 128 * k,
                                        a.D, vec, v[g][k]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (s0 + g >= nc) break;
                const float ws = w[s0 + g];
#pragma unroll
                for (int k = 0; k < K; ++k)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[k][e] = ws != 0.f ? fmaf(ws, v[g][k][e], acc[k][e]) : acc[k][e];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = 4 * lane + 128 * k + e;
            if (d < a.D) fc_combine_store(a, orow + d, acc[k][e]);
        }
    if (lane == 0 && a.lse) a.lse[a.varlen ? (int64_t)h * a.total_q + grow : (b * a.H + h) * a.Nq + i] = lse;
}

cudaError_t flashc_fwd_sm80_combine(const flashc_fwd_args *a, cudaStream_t stream) {
    const int64_t pairs = (int64_t)a->H * a->total_q;
    if (pairs == 0) return cudaSuccess;
    const int64_t blocks = (pairs + FC_COMBINE_WARPS - 1) / FC_COMBINE_WARPS;
    fc_fwd_combine_kernel<<<(unsigned)blocks, FC_COMBINE_WARPS * 32, 0, stream>>>(*a);
    return cudaGetLastError();
}
