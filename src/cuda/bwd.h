/*
 * bwd.h - the CUDA backward (bwd_simt.cu) as the host side (cuda.cu) sees it. C++ (nvcc) only; not installed.
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

/* Bytes of device workspace the backward needs: D_i = rowsum(dO o O) in fp32, one per (head, query row).
 * Reads shapes only (works on a supported()/workspace query problem). */
size_t flashc_cuda_bwd_workspace(const flashc_problem *p);

/* Queues the backward on stream: dq, dk, dv from q, k, v, out, dout and lse. workspace: device memory of at least
 * flashc_cuda_bwd_workspace(p) bytes, 4-byte aligned (NULL when that is 0); nothing else is allocated. Returns
 * the first launch error (cudaErrorInvalidValue for a problem flashc_cuda_bwd_unsupported refuses or a missing
 * workspace). dq, dk, dv are bitwise reproducible: every element has one writer and a fixed summation order. */
cudaError_t flashc_cuda_bwd_launch(const flashc_problem *p, void *workspace, cudaStream_t stream);

#endif /* FLASHC_CUDA_BWD_H */
