/*
 * cpu.h - the CPU backend's pieces: the microkernel table (BLIS's split: a portable framework in C and small
 * per-ISA kernels chosen at run time), tile loads/stores, and the forward/backward drivers.
 */
#ifndef FLASHC_CPU_H
#define FLASHC_CPU_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Tile products on fp32 row-major tiles. Every product of the forward and backward is one of these two:
 *   gemm_nn: C[m][n] (+)= A[m][k] . B[k][n]      S = Q.K^T (K stored transposed), O += P.V, dQ += dS.K
 *   gemm_tn: C[m][n] (+)= A[k][m]^T . B[k][n]    dV += P^T.dO, dK += dS^T.Q
 * accumulate = 0 overwrites C.
 */
typedef void (*flashc_cpu_gemm_fn)(int m, int n, int k, const float *a, int lda, const float *b, int ldb,
                                   float *c, int ldc, int accumulate);

typedef struct flashc_cpu_kernels {
    const char *name;
    flashc_cpu_gemm_fn gemm_nn;
    flashc_cpu_gemm_fn gemm_tn;
} flashc_cpu_kernels;

extern const flashc_cpu_kernels flashc_cpu_kernels_generic;
const flashc_cpu_kernels *flashc_cpu_select_kernels(void);

/* Tile sizes: query rows resident per task, key rows streamed per step. */
typedef struct flashc_cpu_tiles {
    int br, bc;
} flashc_cpu_tiles;
flashc_cpu_tiles flashc_cpu_choose_tiles(int64_t D);

int flashc_cpu_thread_count(const struct flashc_context *ctx);

/* Element offset of (batch b, row n, head h, dim 0) in a view. */
static inline int64_t flashc_cpu_offset(const flashc_tensor *t, int64_t b, int64_t n, int64_t h) {
    return b * t->stride[0] + n * t->stride[1] + h * t->stride[2];
}

/* Loads rows [row0, row0 + rows) of head h into dst[r][0..D) (fp32, leading dim ld), zero-filling up to ld
 * columns and rows up to pad_rows; scale multiplies every value. */
void flashc_cpu_load_rows(float *dst, int ld, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                          int pad_rows, int64_t h, int64_t D, float scale);
/* Loads rows transposed: dst[d][r] for d < D, r < rows (leading dim ld >= pad_rows), zero-filled. */
void flashc_cpu_load_rows_t(float *dst, int ld, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                            int pad_rows, int64_t h, int64_t D);
/* Stores src[r][0..D) into rows [row0, row0 + rows) of head h, converting to the view's dtype. */
void flashc_cpu_store_rows(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                           const float *src, int ld);

/* Batch index of sequence b inside the tensors (0 with varlen, which packs along N). */
static inline int64_t flashc_cpu_tensor_batch(const flashc_problem *p, int64_t b) { return p->varlen ? 0 : b; }
/* Offset of lse(b, h, row 0) in the (B, H, Nq) / varlen (H, total_q) array. */
static inline int64_t flashc_cpu_lse_offset(const flashc_problem *p, int64_t b, int64_t h, int64_t q0) {
    return p->varlen ? h * p->total_q + q0 : (b * p->H + h) * p->Nq;
}

/*
 * Fills S[r][c] (log2 units) for query rows i0 + r, keys j0 + c of one tile: applies softcap, ALiBi, the
 * causal/window range and the block mask. S holds scale * q.k on entry; masked entries become -inf.
 * With softcap, tanh_out (if not NULL) receives tanh(s / softcap) for the backward's derivative.
 */
void flashc_cpu_score_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                               int64_t i0, int rows, int64_t j0, int cols, float *s, int lds, float *tanh_out);

/* 1 when some mask block overlapping the tile [i0, i0+rows) x [j0, j0+cols) is non-zero (or no mask). */
int flashc_cpu_tile_visible(const flashc_problem *p, int64_t b, int64_t h, int64_t i0, int rows, int64_t j0,
                            int cols);

/* Checks cu_seqlens (host memory) against the problem; sets the error on ctx. */
flashc_status flashc_cpu_check_varlen(struct flashc_context *ctx, const flashc_problem *p);

size_t flashc_cpu_forward_workspace(const struct flashc_context *ctx, const flashc_problem *p);
size_t flashc_cpu_backward_workspace(const struct flashc_context *ctx, const flashc_problem *p);
flashc_status flashc_cpu_forward(struct flashc_context *ctx, const flashc_problem *p, void *workspace);
flashc_status flashc_cpu_backward(struct flashc_context *ctx, const flashc_problem *p, void *workspace);

#define FLASHC_LOG2E 1.4426950408889634f
#define FLASHC_LN2 0.6931471805599453f

#ifdef __cplusplus
}
#endif

#endif
