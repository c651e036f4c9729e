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

/* One warp per (head, row): lanes split the splits for the lse, then the head dim for O. */
__global__ void __launch_bounds__(FC_COMBINE_WARPS * 32) fc_fwd_combine_kernel(const __grid_constant__ flashc_fwd_args a) {
    const int lane = threadIdx.x & 31;
    const int64_t pair = (int64_t)blockIdx.x * FC_COMBINE_WARPS + (threadIdx.x >> 5);
    if (pair >= a.H * a.total_q) return;
    const int h = (int)(pair / a.total_q);
    const int64_t grow = pair % a.total_q;
    const int64_t stride_s = (int64_t)a.H * a.total_q; /* between splits, in rows */
    const float *ls = a.ws_lse + (int64_t)h * a.total_q + grow;

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
    const float *po = a.ws_o + ((int64_t)h * a.total_q + grow) * a.D;
    for (int d = lane; d < a.D; d += 32) {
        float acc = 0.f;
        if (mx != -INFINITY)
            for (int s = 0; s < a.nsplit; ++s) {
                const float l = ls[s * stride_s];
                if (l != -INFINITY) acc += expf(l - lse) * po[s * stride_s * a.D + d];
            }
        if (a.out_f32)
            ((float *)a.out)[orow + d] = acc;
        else if (a.bf16)
            ((__nv_bfloat16 *)a.out)[orow + d] = __float2bfloat16_rn(acc);
        else
            ((__half *)a.out)[orow + d] = __float2half_rn(acc);
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
