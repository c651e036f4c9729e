/*
 * bm_tiles.h - the block mask by a kernel's tiles (bm_tiles.cu): the bitmaps of score.h's fc_bm_tile_bits, built
 * on the GPU once per call before a kernel that walks them. C++ (nvcc) only; not installed.
 */
#ifndef FLASHC_CUDA_BM_TILES_H
#define FLASHC_CUDA_BM_TILES_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

/* The mask (score.h's bm fields, block sizes clamped to the lengths as launch.h does), the lengths it covers
 * (max lengths with varlen) and the kernel's tile: br query rows x bc keys. by_keys: a row per key tile, a bit
 * per query tile (the backward's walk) instead of a row per query tile, a bit per key tile (the forward's). */
typedef struct fc_bm_tiles_args {
    const uint8_t *bm;
    int bm_q, bm_k, bm_batch, bm_heads, bm_nqb, bm_nkb;
    int nq, nk, br, bc;
    int by_keys;
} fc_bm_tiles_args;

/* Bytes of the bitmaps: bm_batch x bm_heads x ceil(nq / br) rows of 2 fc_bm_tile_words(nk, bc) words (by_keys:
 * ceil(nk / bc) rows of 2 fc_bm_tile_words(nq, br)). */
size_t fc_bm_tiles_bytes(const fc_bm_tiles_args *a);

/* Builds them into out (fc_bm_tiles_bytes, device memory) on stream: one block per bitmap row, a warp per tile
 * of the row scanning its bytes. */
cudaError_t fc_bm_tiles_build(const fc_bm_tiles_args *a, uint32_t *out, cudaStream_t stream);

#endif /* FLASHC_CUDA_BM_TILES_H */
