/*
 * cuda.cu - the CUDA backend: device set-up, what the GPU kernels support, workspace, and the dispatch of a
 * validated problem to the forward kernel of the smallest compiled head dim that holds it (fwd_sm80.cuh), or on
 * an sm_90 GPU to the Hopper kernel (fwd_sm90.cu) when it takes the configuration.
 * Host code only, C style. Every CUDA call and every launch is checked; failures come back as
 * FLASHC_STATUS_DEVICE_ERROR (OUT_OF_MEMORY for allocations) with the CUDA error text, never an abort.
 */
#include "../internal.h"
#include "bwd.h"
#include "fwd_sm80.h"
#include "launch.h"
#include "bwd_sm90.h"
#include "fwd_sm90.h"
#include "merge.h"
#include "rotary.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cuda_state {
    int sm_count;
    size_t smem_optin;      /* shared memory a block may opt in to */
    int pools;              /* stream-ordered allocation (cudaMallocAsync) available */
    int fwd_sm90;           /* the Hopper forward runs here (and FLASHC_CUDA_FWD=sm80 did not turn it off) */
    int bwd_sm90;           /* the Hopper backward runs here (and FLASHC_CUDA_BWD=sm80 or simt did not turn it off) */
    int bwd_simt;           /* FLASHC_CUDA_BWD=simt: every backward on the CUDA-core baseline */
    int log_fwd;            /* FLASHC_CUDA_LOG=1: each forward names its kernel on stderr */
    /* The Hopper forward's persistent grid (fwd_sm90.h, fc90_grid): FC90_CTR_SLOTS pairs of tile counters in
     * device memory, one pair per launch in turn, so that launches on different streams (set_stream between
     * calls) do not share one unless 64 of them run at once. NULL: one block per tile (FLASHC_CUDA_SM90_GRID=
     * blocks, or the allocation failed). */
    unsigned *fc90_ctr;
    unsigned fc90_ctr_next;
    long long l2_bytes;
    /* per forward entry and operand type (f16, bf16), asked once at context creation (so that threads sharing the
     * context only read it): the kernel's tile and resident blocks per SM, or why they could not be had */
    cudaError_t info_err[8][2];
    fc_tile tile[8][2];
    int occupancy[8][2];
    /* the same for the decode tile's kernel (fc_tile_dec); 0 blocks: not used */
    fc_tile dec_tile[8][2];
    int dec_occupancy[8][2];
} cuda_state;

/* The forward kernels compiled into this build (sources.cmake defines FLASHC_FWD_D<d> for each). */
static const struct {
    int d;
    fc_fwd_entry fn;
} fwd_entries[] = {
#ifdef FLASHC_FWD_D32
    {32, flashc_fwd_sm80_d32},
#endif
#ifdef FLASHC_FWD_D64
    {64, flashc_fwd_sm80_d64},
#endif
#ifdef FLASHC_FWD_D96
    {96, flashc_fwd_sm80_d96},
#endif
#ifdef FLASHC_FWD_D128
    {128, flashc_fwd_sm80_d128},
#endif
#ifdef FLASHC_FWD_D160
    {160, flashc_fwd_sm80_d160},
#endif
#ifdef FLASHC_FWD_D192
    {192, flashc_fwd_sm80_d192},
#endif
#ifdef FLASHC_FWD_D256
    {256, flashc_fwd_sm80_d256},
#endif
    {0, NULL}};
#define FWD_ENTRIES ((int)(sizeof fwd_entries / sizeof fwd_entries[0]) - 1)
#define FC90_CTR_SLOTS 64

/* Largest query / key length the kernels index with 32-bit row arithmetic (sums of two stay below 2^31). */
#define CUDA_MAX_LEN (INT64_C(1) << 29)

static flashc_status cuda_fail(struct flashc_context *ctx, cudaError_t e, const char *file, int line,
                               const char *what) {
    cudaGetLastError(); /* clear a non-sticky error so that later calls start clean */
    flashc_status st = e == cudaErrorMemoryAllocation ? FLASHC_STATUS_OUT_OF_MEMORY : FLASHC_STATUS_DEVICE_ERROR;
    return flashc_set_error(ctx, st, file, line, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define CUDA_TRY(ctx, call)                                                                                  \
    do {                                                                                                     \
        cudaError_t cuda_try_e_ = (call);                                                                    \
        if (cuda_try_e_ != cudaSuccess) return cuda_fail((ctx), cuda_try_e_, __FILE__, __LINE__, #call);     \
    } while (0)

static cuda_state *state_of(struct flashc_context *ctx) { return (cuda_state *)ctx->backend_state; }

/* ---- devices ------------------------------------------------------------------------------------------- */

static int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0; /* no driver or no GPU: simply none */
    }
    return n;
}

static flashc_status cuda_device_name(int device, char *buf, size_t len) {
    if (!buf || len == 0) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "name buffer is empty");
    buf[0] = '\0';
    const int n = cuda_device_count();
    if (device < 0 || device >= n)
        return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "CUDA device %d does not exist (%d found)", device, n);
    cudaDeviceProp prop;
    CUDA_TRY(NULL, cudaGetDeviceProperties(&prop, device));
    snprintf(buf, len, "%s (sm_%d%d, %d SMs, %.0f GiB)", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return FLASHC_STATUS_OK;
}

/* ---- context ------------------------------------------------------------------------------------------- */

static void fwd_info(cuda_state *s, int e, int bf16);

static flashc_status cuda_init(struct flashc_context *ctx) {
    const int n = cuda_device_count();
    if (n == 0) return FLASHC_ERR(ctx, FLASHC_STATUS_DEVICE_ERROR, "no CUDA device found (or no driver)");
    if (ctx->device < 0 || ctx->device >= n)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "CUDA device %d does not exist (%d found)",
                          ctx->device, n);
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    cudaDeviceProp prop;
    CUDA_TRY(ctx, cudaGetDeviceProperties(&prop, ctx->device));
    if (prop.major < 8)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "%s has compute capability %d.%d; the CUDA kernels need 8.0 or later", prop.name,
                          prop.major, prop.minor);
    int pools = 0;
    CUDA_TRY(ctx, cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ctx->device));
    cuda_state *s = (cuda_state *)calloc(1, sizeof *s);
    if (!s) return FLASHC_ERR(ctx, FLASHC_STATUS_OUT_OF_MEMORY, "out of host memory for the CUDA state");
    s->sm_count = prop.multiProcessorCount;
    s->smem_optin = prop.sharedMemPerBlockOptin;
    s->pools = pools;
    /* FLASHC_CUDA_FWD=sm80 keeps every forward on the Ampere-class kernel, so that tests can compare the two. */
    const char *fwd = getenv("FLASHC_CUDA_FWD");
    s->fwd_sm90 = !(fwd && !strcmp(fwd, "sm80")) && flashc_fwd_sm90_available(ctx->device);
    /* FLASHC_CUDA_BWD=sm80 (or simt, see bwd.h) does the same for the backward. */
    const char *bwd = getenv("FLASHC_CUDA_BWD");
    s->bwd_sm90 = !(bwd && (!strcmp(bwd, "sm80") || !strcmp(bwd, "simt"))) && flashc_bwd_sm90_available(ctx->device);
    s->bwd_simt = bwd && !strcmp(bwd, "simt");
    /* FLASHC_CUDA_SM90_GRID=blocks launches the Hopper forward one block per tile instead of persistent. */
    const char *grid = getenv("FLASHC_CUDA_SM90_GRID");
    s->l2_bytes = prop.l2CacheSize;
    if (s->fwd_sm90 && !(grid && !strcmp(grid, "blocks"))) {
        void *ctr = NULL;
        if (cudaMalloc(&ctr, FC90_CTR_SLOTS * 2 * sizeof(unsigned)) == cudaSuccess &&
            cudaMemset(ctr, 0, FC90_CTR_SLOTS * 2 * sizeof(unsigned)) == cudaSuccess &&
            cudaStreamSynchronize(NULL) == cudaSuccess) /* zero before a launch on any stream reads them */
            s->fc90_ctr = (unsigned *)ctr;
        else if (ctr)
            cudaFree(ctr);
        cudaGetLastError(); /* without counters the forward still runs, one block per tile */
    }
    const char *log = getenv("FLASHC_CUDA_LOG");
    s->log_fwd = log && !strcmp(log, "1");
    for (int e = 0; e < FWD_ENTRIES; e++)
        for (int bf16 = 0; bf16 < 2; bf16++) fwd_info(s, e, bf16);
    ctx->backend_state = s;
    ctx->stream = NULL;
    return FLASHC_STATUS_OK;
}

static void cuda_fini(struct flashc_context *ctx) {
    cuda_state *s = state_of(ctx);
    if (s && s->fc90_ctr) {
        cudaFree(s->fc90_ctr); /* synchronizes; fails harmlessly when the process is already tearing CUDA down */
        cudaGetLastError();
    }
    free(ctx->backend_state);
    ctx->backend_state = NULL;
}

static flashc_status cuda_set_stream(struct flashc_context *ctx, void *stream) {
    ctx->stream = stream;
    return FLASHC_STATUS_OK;
}

/* ---- what the kernels run ------------------------------------------------------------------------------ */

static int fwd_entry_index(int64_t D) {
    for (int i = 0; i < FWD_ENTRIES; i++)
        if (fwd_entries[i].d >= D) return i;
    return -1;
}

/* The tile a forward kernel was built with (by the architecture of the code the GPU loads) and its resident
 * blocks per SM, asked once per context at its creation (the current device is the context's). */
static void fwd_info(cuda_state *s, int e, int bf16) {
    flashc_fwd_args a;
    memset(&a, 0, sizeof a);
    a.bf16 = bf16;
    int occ = 0;
    fc_tile t;
    memset(&t, 0, sizeof t);
    s->info_err[e][bf16] = fwd_entries[e].fn(&a, NULL, 1, &t, &occ);
    if (s->info_err[e][bf16] != cudaSuccess) cudaGetLastError();
    s->tile[e][bf16] = t;
    s->occupancy[e][bf16] = occ;
    occ = 0;
    if (fwd_entries[e].fn(&a, NULL, 3, &t, &occ) != cudaSuccess) {
        cudaGetLastError();
        occ = 0;
    }
    s->dec_tile[e][bf16] = t;
    s->dec_occupancy[e][bf16] = occ;
}

/*
 * Whether a forward of p runs the decode tile (fc_tile_dec): at most 16 query rows, where the kernel loads, and at
 * least 64 (sequence, head) pairs. Measured on an H100 (bench/RESULTS.md, decode with GQA heads as rows: B 16 x Hkv 8
 * = 128 pairs 152 -> 121 us at Nk 4096, 887 -> 859 at 32768); with 8 pairs (B 1, Nk 131072) the one-warp blocks of
 * the split keys ran slower than the 128-row tile's four warps (243 -> 287 us, 367 with twice the splits), so few
 * pairs keep the main tile. The crossover between 8 and 128 pairs is not measured; 64 is a guess.
 */
static int fwd_dec(struct flashc_context *ctx, const flashc_problem *p, int e) {
    return p->Nq <= FC_DEC_ROWS && p->B * p->H >= 64 && p->dropout_p == 0 && state_of(ctx)->dec_occupancy[e][p->dtype != FLASHC_DTYPE_F16] > 0;
}

/* Whether the forward kernels take p: its kernel entry, or NOT_SUPPORTED with the reason. */
static flashc_status fwd_check(struct flashc_context *ctx, const flashc_problem *p, int *entry) {
    const int e = fwd_entry_index(p->D);
    if (e < 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "head dim %lld: this build's CUDA kernels go up to %d (FLASHC_CUDA_HEAD_DIMS)",
                          (long long)p->D, FWD_ENTRIES ? fwd_entries[FWD_ENTRIES - 1].d : 0);
    const flashc_tensor *ts[4] = {&p->q, &p->k, &p->v, &p->out};
    static const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        if ((i < 3 || ts[i]->data) && p->D > 1 && ts[i]->stride[3] != 1)
            return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                              "%s: the CUDA backend needs the head dim contiguous (stride[3] == 1, got %lld)",
                              names[i], (long long)ts[i]->stride[3]);
    if (p->block_table && (p->num_pages > INT_MAX || p->page_size > INT_MAX))
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "paged KV: more than 2^31 pages or rows per page");
    if (p->Nq > CUDA_MAX_LEN || p->Nk > CUDA_MAX_LEN || p->total_q > CUDA_MAX_LEN * 8 ||
        p->total_k > CUDA_MAX_LEN * 8)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "sequence lengths beyond 2^29 are not supported on CUDA");
    const cuda_state *s = state_of(ctx);
    const int bf16 = p->dtype != FLASHC_DTYPE_F16;
    if (s->info_err[e][bf16] != cudaSuccess)
        return cuda_fail(ctx, s->info_err[e][bf16], __FILE__, __LINE__, "forward kernel attributes");
    const fc_tile t = s->tile[e][bf16];
    const size_t smem = fc_fwd_smem_bytes(t);
    if (smem > s->smem_optin || s->occupancy[e][bf16] < 1)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "head dim %lld needs %zu bytes of shared memory per block; this GPU allows %zu",
                          (long long)p->D, smem, s->smem_optin);
    const int64_t blocks = (p->Nq + t.br - 1) / t.br * p->H * p->B;
    if (blocks > INT_MAX || p->H * p->total_q > (int64_t)INT_MAX * 4)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "problem too large for one launch (%lld blocks)",
                          (long long)blocks);
    *entry = e;
    return FLASHC_STATUS_OK;
}

/* Split-KV pieces on the Ampere-class kernel (main or decode tile): fc_split_count's rule with its tile and
 * resident blocks. */
static int fwd_splits(struct flashc_context *ctx, const flashc_problem *p, int e, int dec) {
    const int bf16 = p->dtype != FLASHC_DTYPE_F16;
    const fc_tile t = dec ? state_of(ctx)->dec_tile[e][bf16] : state_of(ctx)->tile[e][bf16];
    const int64_t wave =
        (int64_t)state_of(ctx)->sm_count * (dec ? state_of(ctx)->dec_occupancy : state_of(ctx)->occupancy)[e][bf16];
    return fc_split_count((p->Nq + t.br - 1) / t.br * p->H * p->B, wave, (p->Nk + t.bc - 1) / t.bc);
}

/* The split-KV partials: nsplit x (H, rows) x (D + 1) floats (saturating: the front refuses SIZE_MAX). */
static size_t fwd_workspace(const flashc_problem *p, int nsplit) {
    if (nsplit < 2) return 0;
    const int64_t rows = p->varlen ? p->total_q : p->B * p->Nq; /* the partials' (H, rows) layout */
    return flashc_size_mul(flashc_size_mul(flashc_size_mul((size_t)nsplit, (size_t)p->H), flashc_size_of_i64(rows)),
                           ((size_t)p->D + 1) * sizeof(float));
}

static flashc_status cuda_workspace_alloc(struct flashc_context *ctx, size_t bytes, void **ptr) {
    *ptr = NULL;
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    /* Stream-ordered where possible: the front frees the buffer right after queueing the kernels. */
    if (state_of(ctx)->pools)
        CUDA_TRY(ctx, cudaMallocAsync(ptr, bytes, (cudaStream_t)ctx->stream));
    else
        CUDA_TRY(ctx, cudaMalloc(ptr, bytes));
    return FLASHC_STATUS_OK;
}

static void cuda_workspace_free(struct flashc_context *ctx, void *ptr) {
    if (!ptr) return;
    cudaError_t e = state_of(ctx)->pools ? cudaFreeAsync(ptr, (cudaStream_t)ctx->stream) : cudaFree(ptr);
    if (e != cudaSuccess) cudaGetLastError();
}

/* ---- forward ------------------------------------------------------------------------------------------- */

/* The kernel arguments of a problem fwd_check accepted, for kernel entry e and nsplit key pieces. With more than
 * one piece the partials go to workspace (NULL in a plan, which only needs the choice). */
static void fwd_args(struct flashc_context *ctx, const flashc_problem *p, int e, int nsplit, void *workspace,
                     flashc_fwd_args *out, int dec = 0) {
    const int bf16 = p->dtype != FLASHC_DTYPE_F16;
    const fc_tile t = dec ? state_of(ctx)->dec_tile[e][bf16] : state_of(ctx)->tile[e][bf16]; /* known since fwd_check */
    flashc_fwd_args a;
    memset(&a, 0, sizeof a);
    a.q = p->q.data;
    a.k = p->k.data;
    a.v = p->v.data;
    a.out = p->out.data;
    a.lse = p->lse;
    a.q_sb = p->q.stride[0], a.q_sn = p->q.stride[1], a.q_sh = p->q.stride[2];
    a.k_sb = p->k.stride[0], a.k_sn = p->k.stride[1], a.k_sh = p->k.stride[2];
    a.v_sb = p->v.stride[0], a.v_sn = p->v.stride[1], a.v_sh = p->v.stride[2];
    a.o_sb = p->out.stride[0], a.o_sn = p->out.stride[1], a.o_sh = p->out.stride[2];
    a.B = (int)p->B, a.H = (int)p->H, a.Hkv = (int)p->Hkv, a.Nq = (int)p->Nq, a.Nk = (int)p->Nk, a.D = (int)p->D;
    a.varlen = p->varlen;
    a.total_q = p->varlen ? p->total_q : p->B * p->Nq;
    a.total_k = p->varlen ? p->total_k : p->B * p->Nk;
    a.cu_q = p->cu_q, a.cu_k = p->cu_k;
    a.seqused_k = p->seqused_k, a.sinks = p->sinks;
    a.block_table = p->block_table, a.bt_stride = p->bt_stride;
    a.page_size = (int)p->page_size, a.num_pages = (int)p->num_pages;
    fc_set_scores_and_masks(p, &a);
    fc_set_dropout(p, &a);
    const int f32 = p->dtype == FLASHC_DTYPE_F32;
    a.bf16 = p->dtype != FLASHC_DTYPE_F16; /* f32 inputs run on bf16 operands: the f32 range, never inf */
    a.out_f32 = f32;
    if (f32)
        a.in_mode = FC_IN_F32;
    else if (p->D % 8 == 0 && fc_rows_aligned16(&p->q, p->varlen) && fc_rows_aligned16(&p->k, p->varlen) &&
             fc_rows_aligned16(&p->v, p->varlen))
        a.in_mode = FC_IN_ASYNC16;
    else
        a.in_mode = FC_IN_ELEM16;
    a.out_vec = !f32 && p->D % 8 == 0 && fc_rows_aligned16(&p->out, p->varlen);
    a.n_mblk = (int)((p->Nq + t.br - 1) / t.br);
    a.nsplit = nsplit;
    if (a.nsplit > 1 && workspace) {
        a.ws_o = (float *)workspace;
        a.ws_lse = a.ws_o + (int64_t)a.nsplit * a.H * a.total_q * a.D;
    }
    *out = a;
}

/* The forward kernels, in the order of fwd_path_names; FWD_ROWS_GQA added: on the problem fwd_gqa_rows made;
 * FWD_DEC added: the mma.sync kernel with the decode tile (fc_tile_dec). */
typedef enum { FWD_SM80, FWD_SM80_SPLIT, FWD_SM90, FWD_SM90_SPLIT, FWD_ROWS_GQA = 4, FWD_DEC = 8 } fwd_path;
static const char *const fwd_path_names[] = {
    "sm80 (mma.sync)", "sm80 (mma.sync) + split-KV combine", "sm90 (wgmma, TMA, warp-specialized)",
    "sm90 (wgmma, TMA, warp-specialized) + split-KV combine",
    "sm80 (mma.sync), GQA heads as rows", "sm80 (mma.sync) + split-KV combine, GQA heads as rows",
    "sm90 (wgmma, TMA, warp-specialized), GQA heads as rows",
    "sm90 (wgmma, TMA, warp-specialized) + split-KV combine, GQA heads as rows",
    "sm80 (mma.sync), 16-row decode tile", "sm80 (mma.sync) + split-KV combine, 16-row decode tile", "", "",
    "sm80 (mma.sync), GQA heads as rows, 16-row decode tile",
    "sm80 (mma.sync) + split-KV combine, GQA heads as rows, 16-row decode tile", "", ""};
/* FWD_SM90 (and with FWD_ROWS_GQA) on the narrow d 64 tile without a block mask (flashc_fwd_sm90_narrow) */
static const char *const fwd_sm90_narrow_names[] = {
    "sm90 (wgmma, TMA, warp-specialized), 128-row tile",
    "sm90 (wgmma, TMA, warp-specialized), GQA heads as rows, 128-row tile"};

/*
 * Decode with grouped heads (Nq 1, H = G Hkv, G > 1): the G query heads that share a kv head become G query rows
 * of one problem with Hkv heads, so that a tile reads each K/V row once for all of them instead of once per head
 * (and the grid has G times fewer blocks to split the keys over). q and out (B, 1, H, D) are the same memory seen
 * as (B, G, Hkv, D) (row stride: the head stride; head stride: G of them), and lse (B, H, 1) is (B, Hkv, G) as it
 * lies. Only where no score or mask depends on a row's position or head: the one row's causal or right window
 * keeps every key (so none is set), and no left window, ALiBi, sinks, block mask or varlen. With positions a right
 * window keeps every key only where the front made it unbounded (-1): one that is still set cuts the row's keys, and
 * would move by one key per packed row, so it stays off this path.
 */
static int fwd_gqa_rows(const flashc_problem *p, flashc_problem *out) {
    if (p->Nq != 1 || p->Hkv < 1 || p->H <= p->Hkv || p->H % p->Hkv || p->varlen || p->win_left >= 0 || p->alibi ||
        p->sinks || p->block_mask || p->dropout_p > 0 /* dropout's bits follow (head, row) */ ||
        (p->positions && p->win_right >= 0))
        return 0;
    const int64_t G = p->H / p->Hkv;
    *out = *p;
    out->Nq = G, out->H = p->Hkv, out->total_q = G;
    out->win_right = -1;
    out->positions = 0, out->q_position = out->k_position = 0; /* no band and no ALiBi left to align */
    flashc_tensor *const ts[2] = {&out->q, &out->out};
    for (int i = 0; i < 2; i++) {
        const int64_t sh = ts[i]->stride[2];
        ts[i]->shape[1] = G, ts[i]->shape[2] = p->Hkv;
        ts[i]->stride[1] = sh, ts[i]->stride[2] = G * sh;
    }
    return 1;
}

/*
 * The forward's one decision: kernel entry, split-KV pieces, path and workspace. The Hopper kernel takes what it
 * supports, with its own split-KV count (its tile, one block per SM); the rest runs on the Ampere-class kernel,
 * with the decode tile for short query sides (fwd_dec) and its split-KV. The Hopper kernel takes decode too (its
 * TMA loads against the decode tile's cp.async: bench/RESULTS.md); the decode tile stays for what the Hopper
 * kernel does not take (paged caches at d 64 or at pages that do not tile its key tile, fp32, rows not 16-byte
 * aligned) and for other GPUs.
 */
static flashc_status fwd_plan(struct flashc_context *ctx, const flashc_problem *p0, flashc_plan *plan) {
    flashc_problem rows;
    const int gqa = fwd_gqa_rows(p0, &rows);
    const flashc_problem *p = gqa ? &rows : p0;
    int e;
    FLASHC_TRY(fwd_check(ctx, p, &e));
    plan->entry = e;
    const int dec = fwd_dec(ctx, p, e);
    const int nsplit80 = fwd_splits(ctx, p, e, dec);
    if (state_of(ctx)->fwd_sm90) {
        flashc_fwd_args a;
        fwd_args(ctx, p, e, 1, NULL, &a);
        /* A query without data (flashc_kernel_name) answers for 16-byte aligned tensors, the kind frameworks
         * allocate; the base address is all the Hopper kernel's choice reads of the pointers. */
        static const uint4 aligned_stand_in = {0, 0, 0, 0};
        if (!a.q) a.q = &aligned_stand_in;
        if (!a.k) a.k = &aligned_stand_in;
        if (!a.v) a.v = &aligned_stand_in;
        /* Dropout and block masks have no Hopper split-KV: with keys to split they stay on mma.sync's. */
        a.nsplit = a.dropout || a.bm ? nsplit80 : flashc_fwd_sm90_splits(&a, state_of(ctx)->sm_count);
        if (flashc_fwd_sm90_supports(&a, fwd_entries[e].d)) {
            plan->nsplit = a.nsplit;
            /* the partials, or a block mask's per-tile bitmaps */
            plan->workspace = a.nsplit > 1 ? fwd_workspace(p, a.nsplit) : flashc_fwd_sm90_workspace(&a);
            plan->path = (a.nsplit > 1 ? FWD_SM90_SPLIT : FWD_SM90) + (gqa ? FWD_ROWS_GQA : 0);
            plan->kernel = flashc_fwd_sm90_narrow(&a) ? fwd_sm90_narrow_names[gqa] : fwd_path_names[plan->path];
            return FLASHC_STATUS_OK;
        }
    }
    plan->nsplit = nsplit80;
    plan->workspace = fwd_workspace(p, plan->nsplit);
    const fwd_path path = plan->nsplit > 1 ? FWD_SM80_SPLIT : FWD_SM80;
    plan->path = path + (gqa ? FWD_ROWS_GQA : 0) + (dec ? FWD_DEC : 0);
    plan->kernel = fwd_path_names[plan->path];
    return FLASHC_STATUS_OK;
}

static flashc_status cuda_plan(struct flashc_context *ctx, const flashc_problem *p, flashc_plan *plan) {
    /* Positions: every kernel takes diag = q_position - k_position in int32 (score.h's fc_diag). With |diag| and the
     * lengths up to 2^29, and the window sides the front left bounded (left < Nq + diag, right < Nk - diag; the
     * others are -1), every band and ALiBi sum of the kernels stays within int32. */
    if (flashc_pos_diag(p) > CUDA_MAX_LEN || -flashc_pos_diag(p) > CUDA_MAX_LEN)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "positions q_position %lld and k_position %lld lie more than 2^29 apart: the CUDA kernels "
                          "do not take that (the CPU backend does)",
                          (long long)p->q_position, (long long)p->k_position);
    /* Paged K/V: the forwards follow a block table (mma.sync: fc_load_kv_paged; Hopper: fc90_tile_pages); no backward
     * kernel does yet. */
    if (p->block_table && p->op != FLASHC_OP_FORWARD)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "the backward of paged KV (block_table) is not supported by the CUDA backend yet "
                          "(the forward is; the CPU backend runs both)");
    if (p->op == FLASHC_OP_FORWARD) return fwd_plan(ctx, p, plan);
    const cuda_state *s = state_of(ctx);
    const char *why = flashc_cuda_bwd_plan(p, s->bwd_sm90, s->bwd_simt, plan);
    return why ? FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "%s", why) : FLASHC_STATUS_OK;
}

static flashc_status cuda_forward(struct flashc_context *ctx, const flashc_problem *p0, const flashc_plan *plan,
                                  void *workspace) {
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    flashc_problem rows; /* the plan's problem: GQA heads as rows where it chose that */
    const int dec = plan->path >= FWD_DEC;
    const flashc_problem *p = plan->path % FWD_DEC >= FWD_ROWS_GQA && fwd_gqa_rows(p0, &rows) ? &rows : p0;
    flashc_fwd_args a;
    fwd_args(ctx, p, plan->entry, plan->nsplit, workspace, &a, dec);
    if (a.n_mblk == 0 || a.B == 0 || a.H == 0) return FLASHC_STATUS_OK;

    const fwd_path path = (fwd_path)(plan->path % FWD_DEC % FWD_ROWS_GQA);
    const int sm90 = path == FWD_SM90 || path == FWD_SM90_SPLIT;
    cuda_state *s = state_of(ctx);
    fc90_grid grid = {NULL, s->sm_count, s->l2_bytes};
    if (sm90 && s->fc90_ctr) /* atomic: threads may share the context */
        grid.ctr = s->fc90_ctr + 2 * (__atomic_fetch_add(&s->fc90_ctr_next, 1u, __ATOMIC_RELAXED) % FC90_CTR_SLOTS);
    if (s->log_fwd) {
        fprintf(stderr, "flashc: CUDA forward B %d Nq %d Nk %d H %d Hkv %d D %d on %s%s%s\n", a.B, a.Nq, a.Nk, a.H,
                a.Hkv, a.D, plan->kernel, sm90 ? ", ping-pong + intra-warpgroup overlap, " : "",
                sm90 ? flashc_fwd_sm90_grid_name(&a, &grid) : "");
    }
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    cudaError_t err;
    if (sm90) {
        if (a.bm) a.bm_tiles = (const uint32_t *)workspace; /* plan->workspace bytes, built by the launch */
        err = flashc_fwd_sm90_launch(&a, &grid, stream);
        if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "Hopper forward kernel launch");
    } else {
        err = fwd_entries[plan->entry].fn(&a, stream, dec ? 2 : 0, NULL, NULL);
        if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "forward kernel launch");
    }
    if (a.nsplit > 1) {
        err = flashc_fwd_sm80_combine(&a, stream);
        if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "split-KV combine launch");
    }
    return FLASHC_STATUS_OK;
}

static flashc_status cuda_backward(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                                   void *workspace) {
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    if (state_of(ctx)->log_fwd)
        fprintf(stderr, "flashc: CUDA backward B %lld Nq %lld Nk %lld H %lld Hkv %lld D %lld on %s\n", (long long)p->B,
                (long long)p->Nq, (long long)p->Nk, (long long)p->H, (long long)p->Hkv, (long long)p->D, plan->kernel);
    const cudaError_t err =
        flashc_cuda_bwd_launch(p, plan, workspace, state_of(ctx)->l2_bytes, (cudaStream_t)ctx->stream);
    if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "backward kernel launch");
    return FLASHC_STATUS_OK;
}

/* ---- KV cache ---------------------------------------------------------------------------------------------- */

/* One thread per element of the new rows, x over (b, i, h, d) in order: k_new, v_new[b, i, h, d] to the caches'
 * [b, cache_seqlens[b] + i, h, d]; rows outside the cache are skipped. T: a 2- or 4-byte word (bytes move as
 * they are). */
template <typename T>
__global__ void __launch_bounds__(256) fc_kv_append(const flashc_tensor kc, const flashc_tensor vc,
                                                     const flashc_tensor kn, const flashc_tensor vn,
                                                     const int32_t *seqlens) {
    const int64_t x = (int64_t)blockIdx.x * 256 + threadIdx.x;
    const int64_t D = kn.shape[3], H = kn.shape[2], N = kn.shape[1];
    if (x >= kn.shape[0] * N * H * D) return;
    const int64_t d = x % D, h = (x / D) % H, i = (x / (D * H)) % N, b = x / (D * H * N);
    const int64_t row = (int64_t)seqlens[b] + i;
    if (row < 0 || row >= kc.shape[1]) return;
    ((T *)kc.data)[b * kc.stride[0] + row * kc.stride[1] + h * kc.stride[2] + d * kc.stride[3]] =
        ((const T *)kn.data)[b * kn.stride[0] + i * kn.stride[1] + h * kn.stride[2] + d * kn.stride[3]];
    ((T *)vc.data)[b * vc.stride[0] + row * vc.stride[1] + h * vc.stride[2] + d * vc.stride[3]] =
        ((const T *)vn.data)[b * vn.stride[0] + i * vn.stride[1] + h * vn.stride[2] + d * vn.stride[3]];
}

static flashc_status cuda_kvcache_append(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                         const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                         const flashc_tensor *v_new, const int32_t *cache_seqlens) {
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    const int64_t n = k_new->shape[0] * k_new->shape[1] * k_new->shape[2] * k_new->shape[3], blocks = (n + 255) / 256;
    if (blocks > INT32_MAX) return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "too many new rows for one launch");
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    if (k_cache->dtype == FLASHC_DTYPE_F32)
        fc_kv_append<uint32_t><<<(unsigned)blocks, 256, 0, stream>>>(*k_cache, *v_cache, *k_new, *v_new, cache_seqlens);
    else
        fc_kv_append<uint16_t><<<(unsigned)blocks, 256, 0, stream>>>(*k_cache, *v_cache, *k_new, *v_new, cache_seqlens);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "KV-cache append launch");
    return FLASHC_STATUS_OK;
}

/* The same into page pools: row n of sequence b is row n % page_size of page block_table[b * stride + n / page_size]
 * (flashc_kv_offset's rule). Rows past the table and pages outside the pool are skipped: the kernel cannot report
 * them (the CPU backend refuses the call instead), and a row two sequences name gets one of the writes. */
template <typename T>
__global__ void __launch_bounds__(256) fc_kv_append_paged(const flashc_tensor kc, const flashc_tensor vc,
                                                           const flashc_tensor kn, const flashc_tensor vn,
                                                           const int32_t *seqlens, const int32_t *table,
                                                           int64_t max_pages, int64_t stride) {
    const int64_t x = (int64_t)blockIdx.x * 256 + threadIdx.x;
    const int64_t D = kn.shape[3], H = kn.shape[2], N = kn.shape[1], ps = kc.shape[1];
    if (x >= kn.shape[0] * N * H * D) return;
    const int64_t d = x % D, h = (x / D) % H, i = (x / (D * H)) % N, b = x / (D * H * N);
    const int64_t row = (int64_t)seqlens[b] + i;
    if (row < 0 || row >= max_pages * ps) return;
    const int64_t page = table[b * stride + row / ps];
    if (page < 0 || page >= kc.shape[0]) return;
    const int64_t r = row % ps;
    ((T *)kc.data)[page * kc.stride[0] + r * kc.stride[1] + h * kc.stride[2] + d * kc.stride[3]] =
        ((const T *)kn.data)[b * kn.stride[0] + i * kn.stride[1] + h * kn.stride[2] + d * kn.stride[3]];
    ((T *)vc.data)[page * vc.stride[0] + r * vc.stride[1] + h * vc.stride[2] + d * vc.stride[3]] =
        ((const T *)vn.data)[b * vn.stride[0] + i * vn.stride[1] + h * vn.stride[2] + d * vn.stride[3]];
}

static flashc_status cuda_kvcache_append_paged(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                               const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                               const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                               const int32_t *block_table, int64_t max_pages, int64_t stride) {
    CUDA_TRY(ctx, cudaSetDevice(ctx->device));
    const int64_t n = k_new->shape[0] * k_new->shape[1] * k_new->shape[2] * k_new->shape[3], blocks = (n + 255) / 256;
    if (blocks > INT32_MAX) return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "too many new rows for one launch");
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    const unsigned grid = (unsigned)blocks;
    if (k_cache->dtype == FLASHC_DTYPE_F32)
        fc_kv_append_paged<uint32_t><<<grid, 256, 0, stream>>>(*k_cache, *v_cache, *k_new, *v_new, cache_seqlens,
                                                               block_table, max_pages, stride);
    else
        fc_kv_append_paged<uint16_t><<<grid, 256, 0, stream>>>(*k_cache, *v_cache, *k_new, *v_new, cache_seqlens,
                                                               block_table, max_pages, stride);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail(ctx, err, __FILE__, __LINE__, "paged KV-cache append launch");
    return FLASHC_STATUS_OK;
}

/* The front reaches this backend only through this table (src/internal.h). */
extern "C" const flashc_backend_ops flashc_cuda_ops = {
    .kind = FLASHC_BACKEND_CUDA,
    .device_count = cuda_device_count,
    .device_name = cuda_device_name,
    .init = cuda_init,
    .fini = cuda_fini,
    .set_stream = cuda_set_stream,
    .threads = NULL, /* one host thread queues the kernels */
    .plan = cuda_plan,
    .workspace_alloc = cuda_workspace_alloc,
    .workspace_free = cuda_workspace_free,
    .forward = cuda_forward,
    .backward = cuda_backward,
    .kvcache_append = cuda_kvcache_append,
    .merge = flashc_cuda_merge,
    .kvcache_append_paged = cuda_kvcache_append_paged,
    .rotary = flashc_cuda_rotary,
};
