/*
 * bwd.h - the CUDA backward as the host side (cuda.cu) sees it: bwd.cu picks the tensor-core kernels
 * (bwd_sm80.cuh) or the CUDA-core baseline (bwd_simt.cu). C++ (nvcc) only; not installed.
 *
 * Shapes follow flashc.h. The problem must be a validated backward problem (flashc_problem_build) whose
 * pointers are device memory.
 */
#ifndef FLASHC_CUDA_BWD_H
#define FLASHC_CUDA_BWD_H

#include "../internal.h"

#include <cuda_runtime.h>
#include <stddef.h>

/* The backward's paths, in the order of their names (flashc_plan.path). */
enum { FC_BWD_SIMT, FC_BWD_SM80, FC_BWD_SM90, FC_BWD_SM90_DET };

/*
 * The backward's one decision for p: its path (the Hopper dK/dV kernel when sm90 and it takes p; the mma.sync
 * kernels; or the CUDA-core baseline, always when simt_only), kernel entry, name and workspace (D_i = rowsum(dO o
 * O) in fp32, one per (head, query row), and unless p->deterministic the fp32 dQ sums, (query rows, H, D)). NULL
 * with *plan filled, or why the backward cannot run p (a static string). Reads shapes, strides and flags only, so
 * it answers supported()/workspace queries too.
 */
const char *flashc_cuda_bwd_plan(const flashc_problem *p, int sm90, int simt_only, flashc_plan *plan);

/* Queues the backward as planned on stream: dq, dk, dv from q, k, v, out, dout and lse. workspace: device memory
 * of plan->workspace bytes, 4-byte aligned (NULL when that is 0); nothing else is allocated. Returns the first
 * launch error (cudaErrorInvalidValue for a missing workspace). dk and dv are always bitwise reproducible (one
 * writer per element, fixed order); dq is too with p->deterministic, otherwise it is summed with fp32 atomics.
 * l2_bytes: the GPU's L2 cache (the Hopper kernel's block order; 0 when unknown). */
cudaError_t flashc_cuda_bwd_launch(const flashc_problem *p, const flashc_plan *plan, void *workspace,
                                   long long l2_bytes, cudaStream_t stream);

/* The CUDA-core baseline (bwd_simt.cu): any strides, every feature, fp32 throughout; deterministic. dvec: rows x
 * H floats of workspace for D_i. */
const char *flashc_cuda_bwd_simt_unsupported(const flashc_problem *p);
cudaError_t flashc_cuda_bwd_simt_launch(const flashc_problem *p, float *dvec, cudaStream_t stream);
/* What runs after every path (bwd_simt.cu): dk = dv = 0 on key rows past seqused_k, and the sinks' gradient from
 * lse and D_i (dvec) into p->dsinks. Nothing to do without those. */
cudaError_t flashc_cuda_bwd_post_launch(const flashc_problem *p, float *dvec, cudaStream_t stream);

#endif /* FLASHC_CUDA_BWD_H */
