/*
 * merge.h - the CUDA backend's flashc_merge (merge.cu), for its table in cuda.cu. Host C++ only; not installed.
 */
#ifndef FLASHC_CUDA_MERGE_H
#define FLASHC_CUDA_MERGE_H

#include "../internal.h"

/* flashc_merge on views the front validated (src/internal.h, flashc_backend_ops.merge), queued on ctx's stream. */
flashc_status flashc_cuda_merge(struct flashc_context *ctx, const flashc_tensor *out_a, const float *lse_a,
                                const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out, float *lse);

#endif /* FLASHC_CUDA_MERGE_H */
