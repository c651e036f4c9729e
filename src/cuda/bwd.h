/*
 * bwd.h - the CUDA backward as the host side (cuda.cu) sees it: bwd_sm80.cu picks the tensor-core kernels
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

/* NULL when the kernels run this problem, otherwise why not (a static string). Reads shapes only. */
const char *flashc_cuda_bwd_unsupported(const flashc_problem *p);

/* Bytes of device workspace the backward needs: D_i = rowsum(dO o O) in fp32, one per (head, query row), and
 * unless p->deterministic the fp32 dQ sums, (query rows, H, D). Reads shapes and flags only (works on a
 * supported()/workspace query problem). */
size_t flashc_cuda_bwd_workspace(const flashc_problem *p);

/* Queues the backward on stream: dq, dk, dv from q, k, v, out, dout and lse. workspace: device memory of at least
 * flashc_cuda_bwd_workspace(p) bytes, 4-byte aligned (NULL when that is 0); nothing else is allocated. sm90: the
 * Hopper dK/dV kernel (bwd_sm90.h) may run here (the caller has checked flashc_bwd_sm90_available). Returns
 * the first launch error (cudaErrorInvalidValue for a problem flashc_cuda_bwd_unsupported refuses or a missing
 * workspace). dk and dv are always bitwise reproducible (one writer per element, fixed order); dq is too with
 * p->deterministic, otherwise it is summed with fp32 atomics. */
cudaError_t flashc_cuda_bwd_launch(const flashc_problem *p, void *workspace, cudaStream_t stream, int sm90);

/* The path flashc_cuda_bwd_launch takes for p (a static string): "sm90 (wgmma, TMA, warp-specialized)" (plus
 * which dQ), "tensor cores (mma.sync)" or "CUDA cores". FLASHC_CUDA_BWD=simt in the environment forces the
 * CUDA-core baseline; FLASHC_CUDA_BWD=sm80 keeps the mma.sync kernels (read by cuda.cu, which passes sm90). */
const char *flashc_cuda_bwd_path_name(const flashc_problem *p, int sm90);

/* The CUDA-core baseline (bwd_simt.cu): any strides, every feature, fp32 throughout; deterministic. dvec: rows x
 * H floats of workspace for D_i. */
const char *flashc_cuda_bwd_simt_unsupported(const flashc_problem *p);
cudaError_t flashc_cuda_bwd_simt_launch(const flashc_problem *p, float *dvec, cudaStream_t stream);

#endif /* FLASHC_CUDA_BWD_H */
