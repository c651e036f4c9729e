/*
 * fwd_sm90.h - the Hopper forward (fwd_sm90.cu: wgmma, TMA, mbarriers, warp specialization) as the host side
 * (cuda.cu) sees it: its tile table, whether it runs on this GPU, whether it takes a configuration, and its
 * launch. It takes the same flashc_fwd_args as the Ampere-class kernel (fwd_sm80.h) with the same semantics;
 * whatever it does not take runs on that kernel. C++ (nvcc) only; not installed.
 */
#ifndef FLASHC_CUDA_FWD_SM90_H
#define FLASHC_CUDA_FWD_SM90_H

#include "fwd_sm80.h"

#include <cuda_runtime.h>

/*
 * Tile sizes per head dim, the one table. br: query rows per block, split between br / 64 consumer warpgroups
 * (2, or 3 at d 64) of 64 rows each (the M of wgmma); bc: keys per K/V tile (the N of the S = Q K^T wgmma, the K of O += P V);
 * st: stages of the K/V ring. A consumer thread holds bc / 2 S accumulators, d / 2 O accumulators and bc / 4
 * packed P registers: at d 128, bc 128 that is 160 of its 232 registers; at d 256, bc 80 it is 188, which is
 * why d 256 takes a narrower key tile (bc 128 would need 224 before any address or softmax register). At d 64
 * the products are short next to the softmax of a 128-key tile, so a third consumer (192 rows, 512 threads)
 * puts two softmaxes under each one's products; it has 160 registers (of which 128 for those arrays), as
 * 3 x 128 threads must share the register file with the producer.
 * Shared memory: Q br x d, st stages of K and V bc x d, an output staging tile br x (d + 8), all 16-bit:
 * 115 KB at d 64, 195 KB at d 128 (of 227). At d 256 Q and the ring alone take 224 KB, so the output goes from
 * the accumulators to memory unstaged (fc90_o_staged).
 */
typedef struct fc90_tile {
    int d, br, bc, st;
} fc90_tile;

/* A lab build may try others: FLASHC_CUDA_TILES_FILE (fwd_sm80.h) may define FC90_TILE_<d> (br: 128 or 192; bc of S: 64,
 * 80, 128 or 192, the N of a wgmma the kernel has). The two-consumer d 64 tile: fc90_tile{64, 128, 128, 2}. */
#ifndef FC90_TILE_64
#define FC90_TILE_64 fc90_tile{64, 192, 128, 2}
#endif
#ifndef FC90_TILE_128
#define FC90_TILE_128 fc90_tile{128, 128, 128, 2}
#endif
#ifndef FC90_TILE_256
#define FC90_TILE_256 fc90_tile{256, 128, 80, 2}
#endif
/* The narrow d 64 tile (NARROW kernels: two consumers, 128 rows), for
 * - block masks (BMASK kernels): mask blocks of 128 (or 64) query rows, the common sizes, would be straddled by
 *   192-row tiles, each of which visits the key tiles of two mask rows (the union) and masks the blocks one of them
 *   drops: on 128-row blocks a mask kept half the blocks and took 1.10x the dense time (0.67x on this tile);
 * - causal problems of Nq <= FC90_NARROW_NQ (flashc_fwd_sm90_narrow): with Nk as short, the diagonal's tiles are a
 *   large share of the work, and 192-row tiles leave more of them masked (and N 1024 a sixth tile of 64 rows); with
 *   long rows (Nk >> Nq) the 192-row tiles' padding (Nq 256: a second tile of 64 rows) costs about what two
 *   consumers lose on long rows. Causal d 64 on an H200 ran 1.13x at N 512 and 1024 on this tile, 1.01x at 768,
 *   0.96x at 1152 and 0.89-0.95x from N 1536; at Nq 256 / Nk 8192 about 1.2x, at Nq 512 and 1024 / Nk 4096 level;
 *   non-causal 0.84-0.95x at Nq = Nk (bench/RESULTS.md);
 * - whatever the mask, Nq whose 192-row tiles pad to FC90_NARROW_PAD times the rows of 128-row ones or more (Nq <=
 *   128 and 193-256: a third of the wide tiles' rows are padding): non-causal d 64 at Nk 8192 ran 1.24-1.33x on the
 *   narrow tile at Nq 64, 128 and 256; at Nq 640 (1.2 times the rows) 0.90-1.00x, as two consumers run long rows
 *   0.84-0.89x as fast as three. */
#ifndef FC90_TILE_64_NARROW
#define FC90_TILE_64_NARROW fc90_tile{64, 128, 128, 2}
#endif
#define FC90_NARROW_NQ 1024
#define FC90_NARROW_PAD 1.5

__host__ __device__ constexpr fc90_tile fc90_tile_for(int d, bool narrow = false) {
    return d <= 64 ? (narrow ? FC90_TILE_64_NARROW : FC90_TILE_64) : d <= 128 ? FC90_TILE_128 : FC90_TILE_256;
}

/* The kernel a head dim runs on: its own at 64, 128 and 256; d 96 on the d 128 kernel and d 192 on the d 256 one,
 * whose extra columns TMA fills with zeros (they add nothing to Q K^T, and P V computes them without writing them):
 * 25-33% of the products wasted, which the measured rates (lab/LOG.md, Hopper forward v7) still put well ahead of the
 * Ampere-class kernels at those head dims. 0: none (the Ampere-class kernel takes it). */
__host__ __device__ constexpr int fc90_kernel_d(int d) {
    return d == 64 ? 64 : d == 96 || d == 128 ? 128 : d == 192 || d == 256 ? 256 : 0;
}

/* 1 when `device` (the current device) is compute capability 9.0 and the sm_90a kernels are the code loaded for
 * it (a build without 90a-real, or a later GPU, runs the Ampere-class kernel instead). */
int flashc_fwd_sm90_available(int device);

/* 1 when the Hopper kernel takes this configuration: a->D == head_dim_compiled (the forward entry cuda.cu picked)
 * in {64, 96, 128, 192, 256}, 16-bit inputs with 16-byte aligned rows (TMA); varlen, seqused_k, sinks, any window
 * (causal included), softcap, ALiBi and block masks; split-KV (a->nsplit > 1) but with dropout or a block mask;
 * paged K/V at d 96-256 with pages of 16 rows or more that divide the key tile or that it divides (no dropout or
 * block mask there either). */
int flashc_fwd_sm90_supports(const flashc_fwd_args *a, int head_dim_compiled);

/* Split-KV pieces for the Hopper kernel (one block per SM, sms of them): 1 when its (query tile, head, sequence)
 * tiles fill at least 4/5 of a wave, else as many splits as fit in one wave, at least 4 key tiles each, at most
 * 128 (the Ampere-class kernel's rule, cuda.cu's fwd_splits, with this kernel's tile). Its partials go through
 * the same combine (flashc_fwd_sm80_combine). */
int flashc_fwd_sm90_splits(const flashc_fwd_args *a, int sms);

/* Workspace bytes the launch needs in a->bm_tiles: the block mask's per-tile bitmaps (bm_tiles.h), 0 without a
 * block mask. */
size_t flashc_fwd_sm90_workspace(const flashc_fwd_args *a);

/*
 * The grid. PERSISTENT (ctr set): one block per SM, each taking tiles from a counter until none is left, its
 * producer loading the next tile's Q and K/V under the current tile's last products and epilogue; BLOCKS (ctr
 * NULL, or no more tiles than SMs): one block per tile. Both take the tiles in the same order, longest first
 * within groups of heads whose K/V fit in half the L2 (fc90_tile_of in fwd_sm90.cu).
 */
typedef struct fc90_grid {
    unsigned *ctr;      /* 2 counters in device memory, zero before the launch and zero again after it */
    int sms;            /* blocks of the persistent grid: the GPU's SMs */
    long long l2_bytes; /* the GPU's L2 cache */
} fc90_grid;

/* Launches the forward on stream (a configuration flashc_fwd_sm90_supports accepted, on a device for which
 * flashc_fwd_sm90_available holds). Builds the Q, K, V tensor maps on the host, so it fails (without
 * launching) when the driver has no cuTensorMapEncodeTiled or refuses a map. The consumers' schedule is FA3's
 * ping-pong between warpgroups (section 3.1) with the intra-warpgroup overlap of softmax and products (3.2);
 * the schedules it beat are in lab/fwd90/. Launches sharing a grid->ctr must not run concurrently. */
cudaError_t flashc_fwd_sm90_launch(const flashc_fwd_args *a, const fc90_grid *grid, cudaStream_t stream);

/* 1 when a runs on the narrow d 64 tile though it has no block mask (fwd_sm90.h's FC90_TILE_64_NARROW): on the
 * fixed-length kernels (no varlen, seqused_k, sinks, split-KV, paged K/V or dropout), causal problems of
 * Nq <= FC90_NARROW_NQ and any whose wide tiles would pad Nq by FC90_NARROW_PAD. */
int flashc_fwd_sm90_narrow(const flashc_fwd_args *a);

/* "persistent grid" or "a block per tile": the grid that launch takes for a on grid (for the forward log). */
const char *flashc_fwd_sm90_grid_name(const flashc_fwd_args *a, const fc90_grid *grid);

#endif /* FLASHC_CUDA_FWD_SM90_H */
