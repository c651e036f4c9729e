/*
 * bwd_sm90.h - the Hopper backward (bwd_sm90.cu: wgmma, TMA, mbarriers, warp specialization) as the backward's
 * host side (bwd.cu) sees it: its tile table, whether it runs on this GPU, whether it takes a problem, and
 * its launch. It computes dK and dV (and, given a->dq_acc, the fp32 dQ sums) from the same flashc_bwd_args as
 * the Ampere-class dK/dV kernel, after the same preprocess kernel (D_i, zeroed dQ sums) and before the same dQ
 * conversion or deterministic dQ kernel. C++ (nvcc) only; not installed.
 */
#ifndef FLASHC_CUDA_BWD_SM90_H
#define FLASHC_CUDA_BWD_SM90_H

#include "bwd_sm80.h"

#include <cuda_runtime.h>

/*
 * Tile sizes per head dim, the one table. bn: keys per block, split between two consumer warpgroups of 64 keys
 * (the M of wgmma), each holding its keys' dK and dV accumulators (d / 2 + d / 2 floats per thread: 128 of 232
 * registers at d 128); at d 256 both consumers take the same bn = 64 keys and split the work by role instead (one
 * S^T, P^T and dV, the other dP^T, dS^T and dK: each holds one accumulator of 64 keys x 256 columns); bm: query rows
 * per step (the N of S^T = K Q^T and dP^T = V dO^T, the K of dV += P^T dO and dK += dS^T Q; 128 only at d 64,
 * where S^T and dP^T of 128 rows take 128 registers beside dK and dV's 64); st: stages of the (Q, dO) ring.
 * Shared memory: K and V bn x d, st stages of Q and dO bm x d, two dS^T tiles bn x bm, all 16-bit, the rows'
 * lse and D_i, and two dQ staging tiles 64 x 64 fp32: 195 KB at d 64, 194 KB at d 128; 210 KB at d 256 (no staging
 * tiles: dQ is staged over the step's Q / dO ring slot). d 64 with 64-row steps had 4 stages (163 KB); 128-row
 * steps took 7-19% off its main kernel on the H200 (lab/LOG.md, twenty-first session).
 */
typedef struct fc90_btile {
    int d, bn, bm, st;
} fc90_btile;

#ifndef FC90_BTILE_64
#define FC90_BTILE_64 fc90_btile{64, 128, 128, 2}
#endif
#ifndef FC90_BTILE_128
#define FC90_BTILE_128 fc90_btile{128, 128, 64, 2}
#endif
#ifndef FC90_BTILE_256
#define FC90_BTILE_256 fc90_btile{256, 64, 64, 2}
#endif

__host__ __device__ constexpr fc90_btile fc90_btile_for(int d) {
    return d <= 64 ? FC90_BTILE_64 : d <= 128 ? FC90_BTILE_128 : FC90_BTILE_256;
}

/* 1 when `device` is compute capability 9.0 and runs the sm_90a binary of these kernels. */
int flashc_bwd_sm90_available(int device);

/* 1 when the Hopper backward takes a: head dim exactly 64, 128 or 256, 16-bit inputs with 16-byte aligned rows
 * (TMA) (varlen, seqused_k, causal, windows, softcap, ALiBi, block masks and GQA are taken). Pointers that are NULL
 * (a supported() query) are taken as aligned. */
int flashc_bwd_sm90_supports(const flashc_bwd_args *a);

/* Workspace bytes the launch needs in a->bm_tiles (16-byte aligned): a block mask's per-key-tile bitmaps
 * (bm_tiles.h), 0 without a block mask. */
size_t flashc_bwd_sm90_workspace(const flashc_bwd_args *a);

/* Queues the dK/dV kernel (and dQ, added to the fp32 sums a->dq_acc by TMA reductions, when it is set) on stream, for a
 * problem flashc_bwd_sm90_supports accepted on a device where flashc_bwd_sm90_available holds. Builds the tensor
 * maps on the host, so it fails without launching when the driver refuses one. l2_bytes: the GPU's L2 cache, which
 * sizes the block order's groups (0 when unknown). */
cudaError_t flashc_bwd_sm90_launch(const flashc_bwd_args *a, long long l2_bytes, cudaStream_t stream);

#endif /* FLASHC_CUDA_BWD_SM90_H */
