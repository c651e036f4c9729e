/*
 * rotary.h - the CUDA backend's flashc_rotary (rotary.cu), for its table in cuda.cu. Host C++ only; not installed.
 */
#ifndef FLASHC_CUDA_ROTARY_H
#define FLASHC_CUDA_ROTARY_H

#include "../internal.h"

/* flashc_rotary on views the front validated (src/internal.h, flashc_backend_ops.rotary), queued on ctx's stream. */
flashc_status flashc_cuda_rotary(struct flashc_context *ctx, const flashc_tensor *x, const flashc_tensor *cos,
                                 const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                                 const flashc_tensor *out);

#endif /* FLASHC_CUDA_ROTARY_H */
