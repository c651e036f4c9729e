/*
 * rotary.c - flashc_rotary on the CPU: rotary position embedding (RoPE, Su et al. 2021, "RoFormer", section 3.4.2),
 * flash-attn's apply_rotary_emb, row by row. Row i of batch b sits at position seq_start[b] + i; each pair of its
 * first R dims, (j, j + R/2) or interleaved (2j, 2j + 1), turns by the angle whose cosine and sine are the tables'
 * entries at that position, through flashc_rotary_pair (internal.h), the rule the CUDA kernel runs too, so that both
 * backends give the same bits. The front checked the views; cpu_rotary (backend.c) checked every position. Each row is
 * read and written by one thread, each pair read before it is written, so out may be x's very view (in place).
 * Memory-bound: rows are spread over the threads when there are enough of them to pay for the start.
 */
#include "cpu.h"

/* Below this many elements one thread does it all: an OpenMP region costs more than the pass. */
#define ROTARY_MIN_PARALLEL (1 << 16)

/* What the team shares. */
typedef struct rotary_job {
    const flashc_tensor *x, *cos, *sin, *out;
    const int32_t *seq_start; /* NULL: 0 */
    int interleaved;
    int in_place; /* out is x's view: the dims past R stay as they are */
} rotary_job;

static void rotary_body(void *arg, int tid) {
    const rotary_job *J = arg;
    const flashc_tensor *x = J->x, *out = J->out;
    const flashc_dtype t = x->dtype, tt = J->cos->dtype;
    const int64_t N = x->shape[1], H = x->shape[2], D = x->shape[3], half = J->cos->shape[3];
    const int64_t rows = x->shape[0] * N * H;
    const int64_t sx = x->stride[3], so = out->stride[3], sc = J->cos->stride[3], ss = J->sin->stride[3];
    /* pair j: dims (j step, j step + other) */
    const int64_t step = J->interleaved ? 2 : 1, other = J->interleaved ? 1 : half;
    (void)tid;
#ifdef _OPENMP
#  pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < rows; r++) { /* r = (b * N + i) * H + h: x's rows in memory order */
        const int64_t h = r % H, i = r / H % N, b = r / (H * N);
        const int64_t p = (J->seq_start ? (int64_t)J->seq_start[b] : 0) + i; /* in [0, P): cpu_rotary checked */
        const int64_t ox = b * x->stride[0] + i * x->stride[1] + h * x->stride[2],
                      oo = b * out->stride[0] + i * out->stride[1] + h * out->stride[2];
        const int64_t oc = p * J->cos->stride[1], os = p * J->sin->stride[1];
        for (int64_t j = 0; j < half; j++) {
            const int64_t a = j * step, e = a + other;
            float ya, ye;
            flashc_rotary_pair(flashc_cpu_load_elem(x->data, t, ox + a * sx),
                               flashc_cpu_load_elem(x->data, t, ox + e * sx),
                               flashc_cpu_load_elem(J->cos->data, tt, oc + j * sc),
                               flashc_cpu_load_elem(J->sin->data, tt, os + j * ss), &ya, &ye);
            flashc_cpu_store_elem(out->data, t, oo + a * so, ya);
            flashc_cpu_store_elem(out->data, t, oo + e * so, ye);
        }
        if (!J->in_place)
            for (int64_t d = 2 * half; d < D; d++)
                flashc_cpu_store_elem(out->data, t, oo + d * so, flashc_cpu_load_elem(x->data, t, ox + d * sx));
    }
}

void flashc_cpu_rotary(const flashc_tensor *x, const flashc_tensor *cos, const flashc_tensor *sin,
                       const int32_t *seq_start, int interleaved, const flashc_tensor *out, int in_place, int threads) {
    const int64_t rows = x->shape[0] * x->shape[1] * x->shape[2];
    rotary_job J = {.x = x, .cos = cos, .sin = sin, .out = out, .seq_start = seq_start, .interleaved = interleaved,
                    .in_place = in_place};
    flashc_cpu_team(rows * x->shape[3] >= ROTARY_MIN_PARALLEL ? threads : 1, rows, rotary_body, &J);
}
