/*
 * Portable microkernels: plain C written so that the compiler vectorizes the inner loop over n (unit stride in
 * B and C). The per-ISA kernels of the CPU speed work plug into the same table.
 */
#include "cpu.h"

static void gemm_nn_generic(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float *c,
                            int ldc, int accumulate) {
    for (int i = 0; i < m; i++) {
        float *restrict ci = c + (size_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < n; j++) ci[j] = 0.0f;
        const float *ai = a + (size_t)i * lda;
        for (int p = 0; p < k; p++) {
            const float aip = ai[p];
            if (aip == 0.0f) continue; /* masked probabilities are exact zeros */
            const float *restrict bp = b + (size_t)p * ldb;
            for (int j = 0; j < n; j++) ci[j] += aip * bp[j];
        }
    }
}

static void gemm_tn_generic(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float *c,
                            int ldc, int accumulate) {
    if (!accumulate)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) c[(size_t)i * ldc + j] = 0.0f;
    for (int p = 0; p < k; p++) {
        const float *ap = a + (size_t)p * lda;
        const float *restrict bp = b + (size_t)p * ldb;
        for (int i = 0; i < m; i++) {
            const float api = ap[i];
            if (api == 0.0f) continue;
            float *restrict ci = c + (size_t)i * ldc;
            for (int j = 0; j < n; j++) ci[j] += api * bp[j];
        }
    }
}

const flashc_cpu_kernels flashc_cpu_kernels_generic = {"generic", gemm_nn_generic, gemm_tn_generic};
