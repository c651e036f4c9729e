/*
 * merge.c - flashc_merge on the CPU: two partial attention results over disjoint key sets into one, row by row
 * (the combine step of split-KV / flash-decoding, and of cascade and ring attention):
 *   lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b,
 * with the empty-part rule of flashc_merge_weights (internal.h), which the CUDA backend shares. Each row is read
 * and written by one thread, its lse read before it is written, so an output may be its input's very view (in
 * place). Memory-bound: rows are spread over the threads when there are enough of them to pay for the start.
 */
#include "cpu.h"

/* Below this many elements one thread does it all: an OpenMP region costs more than the copy. */
#define MERGE_MIN_PARALLEL (1 << 16)

/* One row of D elements at element offsets oa, ob, o (strides sa, sb, so along D). */
static void merge_row(const flashc_tensor *out_a, int64_t oa, const flashc_tensor *out_b, int64_t ob,
                      const flashc_tensor *out, int64_t o, int64_t D, float wa, float wb) {
    const flashc_dtype t = out->dtype;
    const int64_t sa = out_a->stride[3], sb = out_b->stride[3], so = out->stride[3];
    if (t == FLASHC_DTYPE_F32 && sa == 1 && sb == 1 && so == 1) { /* the common case, vectorized by the compiler */
        const float *a = (const float *)out_a->data + oa, *b = (const float *)out_b->data + ob;
        float *y = (float *)out->data + o;
        for (int64_t d = 0; d < D; d++) y[d] = flashc_merge_value(wa, a[d], wb, b[d]);
        return;
    }
    for (int64_t d = 0; d < D; d++)
        flashc_cpu_store_elem(out->data, t, o + d * so,
                              flashc_merge_value(wa, flashc_cpu_load_elem(out_a->data, t, oa + d * sa), wb,
                                                 flashc_cpu_load_elem(out_b->data, t, ob + d * sb)));
}

/* What the merge's team shares. */
typedef struct merge_job {
    const flashc_tensor *out_a, *out_b, *out;
    const float *lse_a, *lse_b;
    float *lse;
} merge_job;

static void merge_body(void *arg, int tid) {
    const merge_job *J = arg;
    const flashc_tensor *out_a = J->out_a, *out_b = J->out_b, *out = J->out;
    const int64_t N = out->shape[1], H = out->shape[2], D = out->shape[3], rows = out->shape[0] * N * H;
    (void)tid;
#ifdef _OPENMP
#  pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < rows; r++) { /* r = (b * N + i) * H + h: out's rows in memory order */
        const int64_t h = r % H, i = r / H % N, b = r / (H * N), l = (b * H + h) * N + i;
        float wa, wb;
        const float m = flashc_merge_weights(J->lse_a[l], J->lse_b[l], &wa, &wb);
#define OFFSET(t) (b * (t)->stride[0] + i * (t)->stride[1] + h * (t)->stride[2])
        merge_row(out_a, OFFSET(out_a), out_b, OFFSET(out_b), out, OFFSET(out), D, wa, wb);
#undef OFFSET
        if (J->lse) J->lse[l] = m;
    }
}

void flashc_cpu_merge(const flashc_tensor *out_a, const float *lse_a, const flashc_tensor *out_b,
                      const float *lse_b, const flashc_tensor *out, float *lse, int threads) {
    const int64_t rows = out->shape[0] * out->shape[1] * out->shape[2];
    merge_job J = {.out_a = out_a, .out_b = out_b, .out = out, .lse_a = lse_a, .lse_b = lse_b, .lse = lse};
    flashc_cpu_team(rows * out->shape[3] >= MERGE_MIN_PARALLEL ? threads : 1, rows, merge_body, &J);
}
