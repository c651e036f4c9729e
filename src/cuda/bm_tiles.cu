/*
 * bm_tiles.cu - the block mask by a kernel's tiles: for each (mask sequence, mask head, query tile of br rows) the
 * key tiles of bc keys that the mask keeps for some row (visited) and those it also drops somewhere (cut), as the
 * bitmaps of score.h's fc_bm_tile_bits. The kernels then skip dropped tiles without reading the mask, and test
 * elements only on cut tiles. Every mask byte is read about once: a block per bitmap row, a warp per key tile.
 */
#include "bm_tiles.h"
#include "score.h"

#define FC_BMT_THREADS 256

/* Tiles per bitmap row (the bits) and bitmap rows per (mask sequence, mask head). */
static __host__ __device__ int fc_bmt_outer(const fc_bm_tiles_args &a) {
    return a.by_keys ? (a.nk + a.bc - 1) / a.bc : (a.nq + a.br - 1) / a.br;
}
static __host__ __device__ int fc_bmt_words(const fc_bm_tiles_args &a) {
    return a.by_keys ? fc_bm_tile_words(a.nq, a.br) : fc_bm_tile_words(a.nk, a.bc);
}

size_t fc_bm_tiles_bytes(const fc_bm_tiles_args *a) {
    const size_t rows = (size_t)a->bm_batch * (size_t)a->bm_heads * (size_t)fc_bmt_outer(*a);
    return rows * 2 * (size_t)fc_bmt_words(*a) * sizeof(uint32_t);
}

__global__ void __launch_bounds__(FC_BMT_THREADS) fc_bm_tiles_kernel(const fc_bm_tiles_args a, uint32_t *out) {
    extern __shared__ uint32_t fc_bmt_row[]; /* 2 w words: visited, then cut */
    const int nqt = (a.nq + a.br - 1) / a.br, nkt = (a.nk + a.bc - 1) / a.bc, w = fc_bmt_words(a);
    const int nouter = a.by_keys ? nkt : nqt, ninner = a.by_keys ? nqt : nkt;
    const int64_t row = blockIdx.x; /* (mask sequence, mask head) major, row tile minor */
    const int outer = (int)(row % nouter);
    const int64_t map = row / nouter;
    const uint8_t *base = a.bm + map * a.bm_nqb * a.bm_nkb;
    for (int i = threadIdx.x; i < 2 * w; i += FC_BMT_THREADS) fc_bmt_row[i] = 0;
    __syncthreads();
    const int lane = threadIdx.x % 32;
    for (int in = threadIdx.x / 32; in < ninner; in += FC_BMT_THREADS / 32) {
        const int qt = a.by_keys ? in : outer, kt = a.by_keys ? outer : in;
        const int i0 = qt * a.br, i1 = min(i0 + a.br, a.nq) - 1;
        int on = 0, off = 0;
        fc_bm_scan(a, base, i0, i1, kt * a.bc, min(kt * a.bc + a.bc, a.nk) - 1, lane, 32, &on, &off);
        on = __any_sync(0xffffffffu, on);
        off = __any_sync(0xffffffffu, off);
        if (lane == 0 && on) {
            atomicOr(&fc_bmt_row[in >> 5], 1u << (in & 31));
            if (off) atomicOr(&fc_bmt_row[w + (in >> 5)], 1u << (in & 31));
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * w; i += FC_BMT_THREADS) out[row * 2 * w + i] = fc_bmt_row[i];
}

cudaError_t fc_bm_tiles_build(const fc_bm_tiles_args *a, uint32_t *out, cudaStream_t stream) {
    const int64_t rows = (int64_t)a->bm_batch * a->bm_heads * fc_bmt_outer(*a);
    const size_t smem = 2 * (size_t)fc_bmt_words(*a) * sizeof(uint32_t);
    if (rows == 0) return cudaSuccess;
    if (rows > INT32_MAX || smem > 48 * 1024) return cudaErrorInvalidConfiguration;
    fc_bm_tiles_kernel<<<(unsigned)rows, FC_BMT_THREADS, smem, stream>>>(*a, out);
    return cudaGetLastError();
}
