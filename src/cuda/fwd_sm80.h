/*
 * fwd_sm80.h - what the CUDA host side (cuda.cu) and the forward kernels (fwd_sm80.cuh) share: the kernel
 * arguments, the one table of tile sizes per head dim, and the per-head-dim entry points.
 * C++ (nvcc) only; not installed.
 */
#ifndef FLASHC_CUDA_FWD_SM80_H
#define FLASHC_CUDA_FWD_SM80_H

#include "score.h" /* FC_SCORE_FIELDS */

#include <cuda_runtime.h>
#include <stdint.h>

/* How the kernel reads q, k, v. */
enum {
    FC_IN_ASYNC16 = 0, /* f16/bf16, 16-byte aligned rows: cp.async with zero fill */
    FC_IN_ELEM16 = 1,  /* f16/bf16, any alignment: element loads */
    FC_IN_F32 = 2      /* f32 rounded to bf16 on load */
};

/* Kernel arguments (passed by value). Shapes follow flashc.h; with varlen B is the number of sequences, Nq/Nk
 * the max lengths, and rows come from cu_q/cu_k (the tensors' batch stride is then unused). */
typedef struct flashc_fwd_args {
    const void *q, *k, *v;
    void *out;
    float *lse;    /* NULL: not wanted */
    float *ws_o;   /* split-KV partial outputs, (nsplit, H, total_q, D) fp32 */
    float *ws_lse; /* split-KV partial lse, (nsplit, H, total_q), natural log, -inf when empty */
    int64_t q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, o_sb, o_sn, o_sh;
    int B, H, Hkv, Nq, Nk, D; /* D: the caller's head dim (the kernel's may be larger: zero padding) */
    int64_t total_q;           /* rows of q: B * Nq, or the packed length with varlen */
    int varlen;
    const int32_t *cu_q, *cu_k;
    FC_SCORE_FIELDS; /* score_mul, softcap2, the band, ALiBi, the block mask (score.h) */
    int in_mode;  /* FC_IN_* */
    int out_f32;  /* output dtype is f32 */
    int out_vec;  /* 16-bit output with 16-byte aligned rows: staged, vectorized stores */
    int bf16;     /* tensor-core operand type: bf16 (also for f32 inputs) or f16 */
    int nsplit;   /* > 1: write partials to ws_*, fc_fwd_combine finishes */
    int n_mblk;   /* query tiles per (sequence, head) */
    int64_t total_k; /* rows of k and v: B * Nk, or the packed length with varlen (last: the fields before keep
                      * their offsets in the kernels' parameter space) */
    const int32_t *seqused_k; /* keys each sequence uses (score.h's fc_used_keys); NULL: all */
    const float *sinks;       /* attention sinks per head (score.h's fc_sink_fold); NULL: none */
    const uint32_t *bm_tiles; /* the block mask by the kernel's tiles (score.h's fc_bm_tile_bits); NULL: none */
    int bm_tiles_w;           /* words per half of a bitmap row (fc_bm_tile_words) */
    /* Paged K/V (flashc_kv_offset's rule): k, v are page pools (num_pages, page_size, Hkv, D) with the page stride
     * in k_sb / v_sb; key j of sequence b is row j % page_size of page block_table[b * bt_stride + j / page_size].
     * NULL: not paged. A page outside [0, num_pages) is never read: its rows load as zeros and the rows of every
     * query tile that met it come out NaN (out and lse), since a kernel cannot return an error. */
    const int32_t *block_table;
    int64_t bt_stride;
    int page_size, num_pages;
    int kv_chunks; /* Hopper forward: the K and V maps are 5-dimensional (sm90.cuh's fc90_map with chunks) */
    int kv_groups; /* Hopper forward, paged: one load per page, 8-row groups of every chunk (fc90_map_pages) */
    FC_DROP_FIELDS; /* dropout (score.h); the Hopper kernels take none yet */
} flashc_fwd_args;

/*
 * Tile sizes per head dim, the one table, with a column for Hopper (sm_90 and later: 227 KB of shared memory per
 * block) and one for Ampere (sm_80..89: 163 KB on A100, 99 KB on sm_86/89). br: query rows per block, bc: keys
 * per K/V tile, nw: warps (each owns br / nw rows, i.e. br / (16 nw) m16 tiles), st: cp.async stages of the K/V
 * ring, qreg: Q fragments kept in registers (else re-read from shared memory with ldmatrix each tile), minb:
 * blocks per SM the register allocation must allow. A kernel takes the column of the architecture it is
 * compiled for; the host reads that architecture back from the kernel (cudaFuncGetAttributes().ptxVersion).
 */
typedef struct fc_tile {
    int d, br, bc, nw, st, qreg, minb;
} fc_tile;

/* Measured on H200 (bench/RESULTS.md, lab/tiles/). A lab build may try others: -DFLASHC_CUDA_TILES_FILE=path
 * (CMake) includes a header defining some FC_TILE_<d> / FC_TILE_<d>_SM90 before the defaults below. */
#ifdef FLASHC_CUDA_TILES_FILE
#include FLASHC_CUDA_TILES_FILE
#endif
#ifndef FC_TILE_32
#define FC_TILE_32 fc_tile{32, 128, 64, 4, 2, 1, 2}
#endif
#ifndef FC_TILE_64
#define FC_TILE_64 fc_tile{64, 128, 64, 4, 2, 1, 2}
#endif
#ifndef FC_TILE_96
#define FC_TILE_96 fc_tile{96, 128, 64, 4, 2, 0, 2}
#endif
#ifndef FC_TILE_128
#define FC_TILE_128 fc_tile{128, 128, 32, 4, 2, 0, 2}
#endif
#ifndef FC_TILE_160
#define FC_TILE_160 fc_tile{160, 128, 64, 8, 2, 1, 1}
#endif
#ifndef FC_TILE_192
#define FC_TILE_192 fc_tile{192, 128, 64, 8, 2, 0, 1}
#endif
#ifndef FC_TILE_256
#define FC_TILE_256 fc_tile{256, 128, 32, 8, 2, 0, 1}
#endif
#ifndef FC_TILE_32_SM90
#define FC_TILE_32_SM90 FC_TILE_32
#endif
#ifndef FC_TILE_64_SM90
#define FC_TILE_64_SM90 fc_tile{64, 128, 64, 4, 3, 1, 2}
#endif
#ifndef FC_TILE_96_SM90
#define FC_TILE_96_SM90 FC_TILE_96
#endif
#ifndef FC_TILE_128_SM90
#define FC_TILE_128_SM90 fc_tile{128, 128, 64, 4, 2, 0, 2}
#endif
#ifndef FC_TILE_160_SM90
#define FC_TILE_160_SM90 FC_TILE_160
#endif
#ifndef FC_TILE_192_SM90
#define FC_TILE_192_SM90 FC_TILE_192
#endif
#ifndef FC_TILE_256_SM90
#define FC_TILE_256_SM90 fc_tile{256, 128, 64, 8, 2, 0, 1}
#endif

__host__ __device__ constexpr fc_tile fc_tile_for(int d, int sm90) {
    return sm90 ? (d <= 32 ? FC_TILE_32_SM90 : d <= 64 ? FC_TILE_64_SM90 : d <= 96 ? FC_TILE_96_SM90
                   : d <= 128 ? FC_TILE_128_SM90 : d <= 160 ? FC_TILE_160_SM90 : d <= 192 ? FC_TILE_192_SM90
                   : FC_TILE_256_SM90)
                : (d <= 32 ? FC_TILE_32 : d <= 64 ? FC_TILE_64 : d <= 96 ? FC_TILE_96 : d <= 128 ? FC_TILE_128
                   : d <= 160 ? FC_TILE_160 : d <= 192 ? FC_TILE_192 : FC_TILE_256);
}

/* The decode tile (a lab build may define FC_TILE_DEC(d) in its tiles file), for forwards of at most 16 query rows (decode, and GQA heads as rows): one warp of 16 rows, so
 * that the tensor cores compute no more rows than one m16 tile (the main tile's 128 would be 8 times the work and
 * more); keys 64 per tile up to d 128 (Q in registers), 32 above; 2 stages. About 74 KB of shared memory at d 128:
 * three blocks per SM, whose loads in flight keep the memory busy. */
#ifndef FC_TILE_DEC
#define FC_TILE_DEC(d) fc_tile{d, 16, d <= 128 ? 64 : 32, 1, 2, d <= 128 ? 1 : 0, 1}
#endif
__host__ __device__ constexpr fc_tile fc_tile_dec(int d) { return FC_TILE_DEC(d); }
#define FC_DEC_ROWS 16 /* fc_tile_dec(d).br */

/* The column this compilation pass uses (device passes only; the host asks the kernel instead). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FC_SM90 1
#else
#define FC_SM90 0
#endif

/* Shared memory of one block: Q tile + st stages of (K tile, V tile), rows padded by 16 bytes so that the
 * eight rows one ldmatrix phase reads fall in distinct bank groups ((d + 8) / 8 is odd for every d % 16 == 0). */
#ifndef FC_SMEM_PAD
#define FC_SMEM_PAD 8 /* elements of padding per row (a lab build may set another in its tiles file) */
#endif
__host__ __device__ constexpr int fc_smem_row(int d) { return d + FC_SMEM_PAD; }
__host__ __device__ constexpr size_t fc_fwd_smem_bytes(fc_tile t) {
    return (size_t)2 * fc_smem_row(t.d) * (t.br + 2 * t.st * t.bc);
}

/* Per-head-dim entry point (one translation unit each, generated by sources.cmake). what == 0 launches the
 * forward on stream; what == 1 only stores the kernel's tile in *tile and its resident blocks per SM in
 * *occupancy (a->bf16 picks the operand type); what == 2 and 3 the same for the decode tile's kernel. */
#define FC_FWD_ENTRY(D)                                                                                      \
    cudaError_t flashc_fwd_sm80_d##D(const flashc_fwd_args *a, cudaStream_t stream, int what, fc_tile *tile,  \
                                     int *occupancy)
typedef cudaError_t (*fc_fwd_entry)(const flashc_fwd_args *a, cudaStream_t stream, int what, fc_tile *tile,
                                    int *occupancy);
FC_FWD_ENTRY(32);
FC_FWD_ENTRY(64);
FC_FWD_ENTRY(96);
FC_FWD_ENTRY(128);
FC_FWD_ENTRY(160);
FC_FWD_ENTRY(192);
FC_FWD_ENTRY(256);

/*
 * Split-KV pieces, one rule for every forward kernel (cuda.cu's fwd_splits, fwd_sm90.cu's flashc_fwd_sm90_splits):
 * split the keys only when the (query tile, head, sequence) blocks fill less than 4/5 of a wave, into as many
 * splits as fit in one wave (rounded down: one more split than fits starts a second, mostly idle wave), keeping at
 * least 4 key tiles per split (the combine's traffic and the partials' rescaling must stay small next to the work
 * saved), at most 128. Rounding down instead of up took decode (H200,
 * bench/decode.py, B 16, Nq 1, H 32 / Hkv 8, D 128) from 103 to 82 us at Nk 4096 and 726 to 525 us at 32768 (3
 * splits of 128 pairs in a wave of 396 decode blocks, not 4).
 */
static inline int fc_split_count(int64_t blocks, int64_t wave, int64_t key_tiles) {
    if (blocks <= 0 || blocks * 5 >= wave * 4) return 1;
    int64_t n = wave / blocks;
    if (n > key_tiles / 4) n = key_tiles / 4;
    if (n > 128) n = 128;
    return n < 2 ? 1 : (int)n;
}

/* Split-KV combine (fwd_combine.cu): merges a->nsplit partials into out and lse. */
cudaError_t flashc_fwd_sm80_combine(const flashc_fwd_args *a, cudaStream_t stream);

#endif /* FLASHC_CUDA_FWD_SM80_H */
