/*
 * Portable microkernels: plain C whose inner loops run over unit-stride j (B and C rows) so the compiler can
 * vectorize them for whatever the build targets. The per-ISA kernels implement the same table.
 */
#include "cpu.h"

#include <string.h>

static void gemm_generic(int m, int n, int k, const float *a, int64_t rs_a, int64_t cs_a, const float *b,
                         int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int i = 0; i < m; i++) {
        float *restrict ci = c + (size_t)i * ldc;
        if (!accumulate) memset(ci, 0, sizeof(float) * (size_t)n);
        const float *ai = a + (int64_t)i * rs_a;
        for (int p = 0; p < k; p++) {
            const float aip = ai[(int64_t)p * cs_a];
            const float *restrict bp = b + (int64_t)p * ldb;
            for (int j = 0; j < n; j++) ci[j] += aip * bp[j];
        }
    }
}

static void softmax_generic(int cols, int rows, float *st, int64_t ld, float *m, float *l, float *alpha) {
    float mx[16], sub[16], sum[16];
    for (int r0 = 0; r0 < rows; r0 += 16) {
        for (int r = 0; r < 16; r++) mx[r] = m[r0 + r];
        for (int c = 0; c < cols; c++)
            for (int r = 0; r < 16; r++) mx[r] = fmaxf(mx[r], st[(size_t)c * ld + r0 + r]);
        for (int r = 0; r < 16; r++) {
            sub[r] = mx[r] == -INFINITY ? 0.0f : mx[r];
            alpha[r0 + r] = mx[r] == -INFINITY ? 1.0f : exp2f(m[r0 + r] - sub[r]);
            sum[r] = 0.0f;
        }
        for (int c = 0; c < cols; c++) {
            float *col = st + (size_t)c * ld + r0;
            for (int r = 0; r < 16; r++) {
                col[r] = exp2f(col[r] - sub[r]);
                sum[r] += col[r];
            }
        }
        for (int r = 0; r < 16; r++) {
            l[r0 + r] = l[r0 + r] * alpha[r0 + r] + sum[r];
            m[r0 + r] = mx[r];
        }
    }
}

static void exp2_sub_generic(int cols, int rows, float *st, int64_t ld, const float *sub) {
    for (int c = 0; c < cols; c++) {
        float *col = st + (size_t)c * ld;
        for (int r = 0; r < rows; r++) col[r] = exp2f(col[r] - sub[r]);
    }
}

static void exp2_generic(int n, const float *src, float *dst) {
    for (int i = 0; i < n; i++) dst[i] = exp2f(src[i]);
}

static void f16_generic(int n, const uint16_t *src, float *dst) {
    for (int i = 0; i < n; i++) dst[i] = flashc_f16_to_f32(src[i]);
}

static void bf16_generic(int n, const uint16_t *src, float *dst) {
    for (int i = 0; i < n; i++) dst[i] = flashc_bf16_to_f32(src[i]);
}

static void dots_generic(int rows, int cols, int D, const float *q, int64_t ldq, const float *k, int64_t ldk,
                         float *s, int64_t lds) {
    for (int c = 0; c < cols; c++) {
        const float *kc = k + (int64_t)c * ldk;
        for (int r = 0; r < rows; r++) {
            const float *qr = q + (int64_t)r * ldq;
            float acc = 0.0f;
            for (int d = 0; d < D; d++) acc += qr[d] * kc[d];
            s[(int64_t)r * lds + c] = acc;
        }
    }
}

/* dots on K rows read in place as fp32 or bf16; no prefetching (pf is ignored). */
static void dots_kv_generic(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, int kt,
                            float *s, int64_t lds, const flashc_cpu_prefetch *pf) {
    float kc[FLASHC_MAX_HEAD_DIM];
    for (int c = 0; c < cols; c++) {
        if (kt == FLASHC_CPU_KV_F32) { /* dots' loop, one key */
            dots_generic(rows, 1, D, q, ldq, (const float *)k[c], 0, s + c, lds);
            continue;
        }
        const uint16_t *src = (const uint16_t *)k[c];
        for (int d = 0; d < D; d++) kc[d] = flashc_bf16_to_f32(src[d]);
        for (int r = 0; r < rows; r++) {
            const float *qr = q + (int64_t)r * ldq;
            float acc = 0.0f;
            for (int d = 0; d < D; d++) acc += qr[d] * kc[d];
            s[(int64_t)r * lds + c] = acc;
        }
    }
    (void)pf;
}

static void pv_generic(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                       const void *const *v, int vt, float *o, int64_t ldo) {
    for (int r = 0; r < rows; r++) {
        float *restrict orow = o + (int64_t)r * ldo;
        for (int d = 0; d < D; d++) orow[d] *= alpha[r];
        for (int c = 0; c < cols; c++) {
            const float prc = p[(int64_t)r * ldp + c];
            const void *vc = v[c];
            if (vt == FLASHC_CPU_KV_BF16)
                for (int d = 0; d < D; d++) orow[d] += prc * flashc_bf16_to_f32(((const uint16_t *)vc)[d]);
            else
                for (int d = 0; d < D; d++) orow[d] += prc * ((const float *)vc)[d];
        }
    }
}

static void softmax_rows_generic(int rows, int cols, float *s, int64_t lds, float *m, float *l, float *alpha) {
    for (int r = 0; r < rows; r++) {
        float *x = s + (int64_t)r * lds, mx = m[r], sum = 0.0f;
        for (int c = 0; c < cols; c++) mx = fmaxf(mx, x[c]);
        const float sub = mx == -INFINITY ? 0.0f : mx;
        alpha[r] = mx == -INFINITY ? 1.0f : exp2f(m[r] - sub);
        for (int c = 0; c < cols; c++) {
            x[c] = exp2f(x[c] - sub);
            sum += x[c];
        }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = mx;
    }
}

void flashc_cpu_dropout_generic(int cols, int rows, float *st, int64_t ld, const flashc_cpu_dropout *d, int64_t i0,
                                int64_t j0) {
    if (cols <= 0) return;
    i0 += d->row0, j0 += d->col0; /* dropout's (i, j) from here on; columns c = j - j0 as before */
    for (int r = 0; r < rows; r++)
        for (int64_t g = j0 >> 2; g <= (j0 + cols - 1) >> 2; g++) {
            const flashc_u32x4 x = flashc_dropout_bits4(d->seed, d->stream, i0 + r, g);
            for (int k = 0; k < 4; k++) {
                const int64_t c = 4 * g + k - j0;
                if (c < 0 || c >= cols) continue;
                float *e = st + c * ld + r;
                *e = x.x[k] >= d->threshold ? *e * d->kept : 0.0f;
            }
        }
}

const flashc_cpu_kernels flashc_cpu_kernels_generic = {
    .name = "generic",
    .mr = 1,
    .nr = 1,
    .gemm = gemm_generic,
    .softmax = softmax_generic,
    .exp2_sub = exp2_sub_generic,
    .exp2 = exp2_generic,
    .f16_to_f32 = f16_generic,
    .bf16_to_f32 = bf16_generic,
    .dots = dots_generic,
    .softmax_rows = softmax_rows_generic,
    .dropout = flashc_cpu_dropout_generic,
    .dots_kv = dots_kv_generic,
    .pv = pv_generic,
};
