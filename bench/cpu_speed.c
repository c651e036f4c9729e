/*
 * cpu_speed: GFLOP/s of the CPU backend's forward and backward over N, D, causal, dtype and thread count, beside
 * the machine's sgemm rate (the ceiling) and standard attention (sgemm + softmax with the N x N matrix
 * materialized, one head at a time) as the baseline. Also the peak extra memory at a long N.
 *
 *   cpu_speed [--quick] [--nmax N] [--threads 1,2] [--dims 64,128] [--dtypes f32,bf16] [--no-bwd] [--memory]
 *             [--ns 8192,32768] [--nq NQ] [--causal 0|1] [--heads H] [--no-std] [--reps R]
 *                            --ns: these N instead of 512, 1024, ... nmax; --causal: one mask mode only; --no-std:
 *                            no standard attention (its N x N matrix is 4 GiB at N = 32768); --reps: timed runs;
 *                            --nq: NQ query rows against N keys (a long key length at a fraction of the time);
 *                            --cpu-time: time by CPU time per thread (see now())
 *   cpu_speed --dropout P [...] each shape without dropout and with dropout_p = P, timed in turns (one call of each
 *                            per round, so a load that comes and goes hits both): ms and the ratio of the speeds
 *                            (without / with time) of the forward and of forward + backward; no standard attention
 *   cpu_speed --kernels      one thread: GFLOP/s of each microkernel product at the forward's tile shapes, and the
 *                            share of a forward tile that the online softmax takes; with bf16 products, the bf16
 *                            forward tile's three phases (S^T, softmax step, P V) as attn.c calls them
 *                            (FLASHC_CPU_KERNELS picks the set)
 *
 * FLOPs: forward 4 * B * H * N^2 * D (halved when causal), backward 2.5x forward. Times are the median of
 * several runs after a warm-up, wall clock.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime: clang's -fopenmp does not turn it on as gcc's does */
#include "flashc.h"
#include "benchkit.h"
#include "cpu/cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#  include <omp.h>
#endif
#ifdef FLASHC_BENCH_CBLAS
#  include <cblas.h>
void openblas_set_num_threads(int) __attribute__((weak));
#endif

/* --cpu-time: the process's CPU time (all threads) divided by the thread count instead of the wall clock, what the
 * run would take with its cores to itself; on a machine shared with other jobs the wall clock mostly measures
 * them. Run it with OMP_WAIT_POLICY=passive so threads waiting at a barrier sleep rather than spin. */
static int cpu_clock, cpu_clock_threads = 1;
static double now(void) {
    struct timespec t;
    clock_gettime(cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return ((double)t.tv_sec + 1e-9 * (double)t.tv_nsec) / (cpu_clock ? cpu_clock_threads : 1);
}

#define MAX_REPS 9
typedef int (*bench_fn)(void *arg);

/* Median seconds of reps runs after one warm-up; negative when the function fails. */
static double time_median(bench_fn fn, void *arg, int reps) {
    double t[MAX_REPS];
    if (fn(arg) != 0) return -1.0;
    for (int i = 0; i < reps; i++) {
        double t0 = now();
        if (fn(arg) != 0) return -1.0;
        t[i] = now() - t0;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_double);
    return t[reps / 2];
}

/* Median seconds of two functions timed in turns, reps rounds after one warm-up of each; 0 when either fails. */
static int time_pair(bench_fn fa, void *a, bench_fn fb, void *b, int reps, double *ta, double *tb) {
    double x[MAX_REPS], y[MAX_REPS];
    if (fa(a) != 0 || fb(b) != 0) return 0;
    for (int i = 0; i < reps; i++) {
        double t0 = now();
        if (fa(a) != 0) return 0;
        double t1 = now();
        if (fb(b) != 0) return 0;
        x[i] = t1 - t0;
        y[i] = now() - t1;
    }
    qsort(x, (size_t)reps, sizeof(double), cmp_double);
    qsort(y, (size_t)reps, sizeof(double), cmp_double);
    *ta = x[reps / 2];
    *tb = y[reps / 2];
    return 1;
}

static int reps_forced; /* --reps */
static int reps_for(double flops) {
    if (reps_forced > 0) return reps_forced < MAX_REPS ? reps_forced : MAX_REPS;
    return flops > 2e11 ? 3 : flops > 2e10 ? 5 : MAX_REPS;
}

typedef struct attn_case {
    flashc_context_t ctx;
    flashc_tensor q, k, v, o, dout, dq, dk, dv;
    float *lse;
    flashc_params params;
    void *ws;
    size_t ws_bytes;
} attn_case;

static int run_fwd(void *arg) {
    attn_case *c = (attn_case *)arg;
    return flashc_forward(c->ctx, &c->q, &c->k, &c->v, &c->params, &c->o, c->lse, c->ws, c->ws_bytes) != 0;
}

static int run_bwd(void *arg) {
    attn_case *c = (attn_case *)arg;
    return flashc_backward(c->ctx, &c->q, &c->k, &c->v, &c->o, &c->dout, c->lse, &c->params, &c->dq, &c->dk, &c->dv,
                           c->ws, c->ws_bytes) != 0;
}

static int run_fwd_bwd(void *arg) { return run_fwd(arg) || run_bwd(arg); }

static void *alloc_tensor(flashc_tensor *t, flashc_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D, int fill) {
    size_t n = (size_t)(B * N * H * D), esz = dt == FLASHC_DTYPE_F32 ? 4 : 2;
    void *p = malloc(n * esz);
    if (!p) return NULL;
    if (fill)
        for (size_t i = 0; i < n; i++) {
            float x = frand();
            if (dt == FLASHC_DTYPE_F32) ((float *)p)[i] = x;
            else ((uint16_t *)p)[i] = to_bf16(x);
        }
    *t = flashc_tensor_contiguous(p, dt, B, N, H, D);
    return p;
}

#ifdef FLASHC_BENCH_CBLAS
typedef struct sgemm_case {
    int n;
    float *a, *b, *c;
} sgemm_case;

static int run_sgemm(void *arg) {
    sgemm_case *s = (sgemm_case *)arg;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->n, s->n, s->n, 1.0f, s->a, s->n, s->b, s->n, 0.0f, s->c,
                s->n);
    return 0;
}

/* Standard attention, f32, (B, N, H, D) inputs: per head S = scale Q K^T (N x N), row softmax, O = P V. */
typedef struct std_case {
    int N, H, D, causal;
    const float *q, *k, *v;
    float *o, *s;
} std_case;

static int run_standard(void *arg) {
    std_case *c = (std_case *)arg;
    const int N = c->N, H = c->H, D = c->D, ld = H * D;
    const float scale = 1.0f / sqrtf((float)D);
    for (int h = 0; h < H; h++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, D, scale, c->q + h * D, ld, c->k + h * D, ld, 0.0f,
                    c->s, N);
#  pragma omp parallel for schedule(static)
        for (int i = 0; i < N; i++) {
            float *row = c->s + (size_t)i * N;
            const int last = c->causal ? i : N - 1;
            float mx = -INFINITY, sum = 0.0f;
            for (int j = 0; j <= last; j++) mx = fmaxf(mx, row[j]);
            for (int j = 0; j <= last; j++) sum += (row[j] = expf(row[j] - mx));
            const float inv = 1.0f / sum;
            for (int j = 0; j <= last; j++) row[j] *= inv;
            for (int j = last + 1; j < N; j++) row[j] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, D, N, 1.0f, c->s, N, c->v + h * D, ld, 0.0f,
                    c->o + h * D, ld);
    }
    return 0;
}
#endif

static void set_threads(flashc_context_t ctx, int t) {
    flashc_context_set_threads(ctx, t);
#ifdef _OPENMP
    omp_set_num_threads(t);
#endif
#ifdef FLASHC_BENCH_CBLAS
    if (openblas_set_num_threads) openblas_set_num_threads(t);
#endif
}

typedef struct kernel_case {
    const flashc_cpu_kernels *k;
    int m, n, kk;
    const float *a, *b;
    int64_t rs_a, cs_a, ldb;
    float *c;
    int64_t ldc;
    int softmax;
    float *m_run, *l_run, *alpha;
    const uint16_t *a16, *b16; /* the bf16 products (kernels with bf16): k counts pairs */
} kernel_case;

static int run_kernel(void *arg) {
    kernel_case *c = (kernel_case *)arg;
    for (int it = 0; it < 50; it++) {
        if (c->softmax) {
            for (int r = 0; r < c->n; r++) c->m_run[r] = -INFINITY, c->l_run[r] = 0.0f;
            c->k->softmax(c->m, c->n, c->c, c->ldc, c->m_run, c->l_run, c->alpha);
        } else if (c->a16) {
            c->k->bf16->gemm(c->m, c->n, c->kk, c->a16, c->rs_a, c->cs_a, c->b16, c->ldb, c->c, c->ldc, 1.0f, 1);
        } else {
            c->k->gemm(c->m, c->n, c->kk, c->a, c->rs_a, c->cs_a, c->b, c->ldb, c->c, c->ldc, 1);
        }
    }
    return 0;
}

/*
 * The bf16 forward's tile in its three phases as attn.c calls them on a kernel set with bf16 products (bc keys x br
 * queries, head dim D, one thread): S^T = K Q^T with the Q scale, the online-softmax step writing P (softmax_prows
 * where the set has it, taking the Q scale in place of the gemm as attn.c does, else softmax_pairs) and rescaling O,
 * O += P V on that P; phase 3 runs the three in turn.
 */
typedef struct fwd_phases {
    const flashc_cpu_kernels *k;
    int D, br, bc, ld, phase;
    uint16_t *k16, *q2, *p, *v2;
    float *st, *o, *m, *l, *alpha;
} fwd_phases;

static void fwd_phase(fwd_phases *f, int phase) {
    const flashc_cpu_bf16_kernels *b = f->k->bf16;
    const int D = f->D, br = f->br, bc = f->bc, ld = f->ld, prows = b->softmax_prows != NULL;
    const int64_t prs = prows ? bc + 32 : 2, pcs = prows ? 2 : 2 * (int64_t)ld; /* attn.c's prows_ld */
    const float qs = 0.18f; /* the Q scale: in the gemm, or with softmax_prows in the softmax step (attn.c) */
    if (phase == 0) b->gemm(bc, br, D / 2, f->k16, D, 2, f->q2, 2 * (int64_t)ld, f->st, ld, prows ? 1.0f : qs, 0);
    if (phase == 1) {
        for (int r = 0; r < br; r++) f->m[r] = -INFINITY, f->l[r] = 0.0f;
        (prows ? b->softmax_prows : b->softmax_pairs)(bc, br, f->st, ld, prows ? qs : 1.0f, f->m, f->l, f->alpha, NULL,
                                                      0, 0, f->p, prows ? prs : pcs, f->o, D, D);
    }
    if (phase == 2) b->gemm(br, D, bc / 2, f->p, prs, pcs, f->v2, 2 * (int64_t)D, f->o, D, 1.0f, 1);
}

static int run_fwd_phase(void *arg) {
    fwd_phases *f = (fwd_phases *)arg;
    for (int it = 0; it < 50; it++) {
        if (f->phase < 3) fwd_phase(f, f->phase);
        else fwd_phase(f, 0), fwd_phase(f, 1), fwd_phase(f, 2);
    }
    return 0;
}

static void fwd_phase_report(const flashc_cpu_kernels *k, int D, int br, int bc, int ld) {
    fwd_phases f = {k, D, br, bc, ld, 0, calloc((size_t)bc * D, 2), calloc((size_t)D * ld, 2),
                    calloc((size_t)br * (bc + 32) + (size_t)(bc / 2 + 1) * 2 * ld, 2), calloc((size_t)bc * D, 2),
                    malloc(sizeof(float) * (size_t)bc * ld), malloc(sizeof(float) * (size_t)br * D),
                    malloc(sizeof(float) * (size_t)br), malloc(sizeof(float) * (size_t)br),
                    malloc(sizeof(float) * (size_t)br)};
    for (int i = 0; i < bc * D; i++) f.k16[i] = flashc_f32_to_bf16(frand()), f.v2[i] = flashc_f32_to_bf16(frand());
    for (int i = 0; i < D * ld; i++) f.q2[i] = flashc_f32_to_bf16(frand());
    for (int i = 0; i < br * D; i++) f.o[i] = frand();
    double t[4];
    for (int ph = 0; ph < 4; ph++) {
        f.phase = ph;
        fwd_phase(&f, 0); /* scores for the softmax */
        if (ph == 2) fwd_phase(&f, 1);
        t[ph] = time_median(run_fwd_phase, &f, 7) / 50;
    }
    const double sum = t[0] + t[1] + t[2], flops = 4.0 * bc * br * D;
    printf("  bf16 forward tile D=%d (%s): S^T %.2f us, softmax %.2f us, P V %.2f us (%.0f / %.0f / %.0f%%); "
           "the three in turn %.2f us, %.1f GFLOP/s\n",
           D, k->bf16->softmax_prows ? "P as rows of key pairs" : "P as pair rows", t[0] * 1e6, t[1] * 1e6,
           t[2] * 1e6, 100 * t[0] / sum, 100 * t[1] / sum, 100 * t[2] / sum, t[3] * 1e6, flops / t[3] * 1e-9);
    free(f.k16), free(f.q2), free(f.p), free(f.v2), free(f.st), free(f.o), free(f.m), free(f.l), free(f.alpha);
}

/* The forward's two products per tile, as the driver calls them (bc keys x br queries, head dim D, query-major
 * tiles with the driver's padded leading dim), one thread. */
static void kernel_report(void) {
    const flashc_cpu_kernels *k = flashc_cpu_select_kernels();
    printf("\nmicrokernel %s, one thread, forward tile shapes (50 calls per timing, median of 7):\n", k->name);
    printf("%-32s %5s %5s %5s %10s\n", "product", "m", "n", "k", "GFLOP/s");
    static const int dims[2] = {64, 128};
    for (int di = 0; di < 2; di++) {
        const int D = dims[di];
        flashc_cpu_tiles t = flashc_cpu_choose_tiles(D, 0);
        const int br = t.br, bc = t.bc, ld = br + FLASHC_CPU_LD_PAD;
        float *kt = malloc(sizeof(float) * (size_t)bc * D), *qt = malloc(sizeof(float) * (size_t)D * ld);
        float *st = malloc(sizeof(float) * (size_t)bc * ld), *v = malloc(sizeof(float) * (size_t)bc * D);
        float *o = malloc(sizeof(float) * (size_t)br * D), *m = malloc(sizeof(float) * (size_t)br);
        float *l = malloc(sizeof(float) * (size_t)br), *al = malloc(sizeof(float) * (size_t)br);
        for (int i = 0; i < bc * D; i++) kt[i] = frand(), v[i] = frand();
        for (int i = 0; i < D * ld; i++) qt[i] = frand();
        for (int i = 0; i < br * D; i++) o[i] = frand();
        for (int i = 0; i < bc * ld; i++) st[i] = frand();
        kernel_case s = {k, bc, br, D, kt, qt, D, 1, ld, st, ld, 0, NULL, NULL, NULL, NULL, NULL};
        kernel_case pv = {k, br, D, bc, st, v, 1, ld, D, o, D, 0, NULL, NULL, NULL, NULL, NULL};
        kernel_case sm = {k, bc, br, 0, NULL, NULL, 0, 0, 0, st, ld, 1, m, l, al, NULL, NULL};
        double ts = time_median(run_kernel, &s, 7) / 50, tp = time_median(run_kernel, &pv, 7) / 50;
        for (int i = 0; i < bc * ld; i++) st[i] = frand() * 8.0f;
        double tm = time_median(run_kernel, &sm, 7) / 50;
        const double f = 2.0 * bc * br * D;
        char name[64];
        snprintf(name, sizeof name, "S^T = K (scale Q)^T  D=%d", D);
        printf("%-32s %5d %5d %5d %10.1f\n", name, bc, br, D, f / ts * 1e-9);
        snprintf(name, sizeof name, "O += P V            D=%d", D);
        printf("%-32s %5d %5d %5d %10.1f\n", name, br, D, bc, f / tp * 1e-9);
        printf("  online softmax of the %dx%d tile: %.2f us, %.0f%% of the tile's time (products %.2f us)\n", bc, br,
               tm * 1e6, 100.0 * tm / (ts + tp + tm), (ts + tp) * 1e6);
        if (k->bf16) { /* the same products on bf16 pairs (operand layouts as attn.c passes them) */
            uint16_t *k16 = calloc((size_t)bc * D, 2), *q2 = calloc((size_t)D * ld, 2);
            uint16_t *p2 = calloc((size_t)bc * ld, 2), *v2 = calloc((size_t)bc * D, 2);
            for (int i = 0; i < bc * D; i++) k16[i] = flashc_f32_to_bf16(frand()), v2[i] = flashc_f32_to_bf16(frand());
            for (int i = 0; i < D * ld; i++) q2[i] = flashc_f32_to_bf16(frand());
            for (int i = 0; i < bc * ld; i++) p2[i] = flashc_f32_to_bf16(frand());
            kernel_case s16 = {k, bc, br, D / 2, NULL, NULL, D, 2, 2 * ld, st, ld, 0, NULL, NULL, NULL, k16, q2};
            kernel_case pv16 = {k, br, D, bc / 2, NULL, NULL, 2, 2 * ld, 2 * D, o, D, 0, NULL, NULL, NULL, p2, v2};
            const double ts16 = time_median(run_kernel, &s16, 7) / 50, tp16 = time_median(run_kernel, &pv16, 7) / 50;
            snprintf(name, sizeof name, "bf16 S^T = K Q^T    D=%d", D);
            printf("%-32s %5d %5d %5d %10.1f\n", name, bc, br, D, f / ts16 * 1e-9);
            snprintf(name, sizeof name, "bf16 O += P V       D=%d", D);
            printf("%-32s %5d %5d %5d %10.1f\n", name, br, D, bc, f / tp16 * 1e-9);
            free(k16), free(q2), free(p2), free(v2);
            fwd_phase_report(k, D, br, bc, ld);
        }
        free(kt), free(qt), free(st), free(v), free(o), free(m), free(l), free(al);
    }
}

static void memory_report(flashc_context_t ctx) {
    const int64_t N = 32768, H = 8, D = 128;
    flashc_tensor q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, 1, N, H, D);
    flashc_params p = flashc_params_default();
    size_t fwd = 0, bwd = 0;
    flashc_forward_workspace_size(ctx, &q, &q, &q, &p, &fwd);
    flashc_backward_workspace_size(ctx, &q, &q, &q, &p, &bwd);
    double lse = (double)(H * N) * 4, tensors = (double)(N * H * D) * 4;
    printf("\npeak extra memory, N = 32768, H = 8, D = 128, f32 (inputs/outputs %.0f MiB each):\n", tensors / 1048576);
    printf("  flashc forward : %8.2f MiB workspace + %.2f MiB lse\n", (double)fwd / 1048576, lse / 1048576);
    printf("  flashc backward: %8.2f MiB workspace (D_i, per-thread tiles, per-thread dQ of one sequence)\n", (double)bwd / 1048576);
    printf("  standard       : %8.0f MiB for S of one head, %.0f MiB for all 8 heads (plus P if kept for backward)\n",
           (double)N * N * 4 / 1048576, (double)N * N * 4 * H / 1048576);
}

int main(int argc, char **argv) {
    int nmax = 8192, dims[4] = {64, 128}, ndims = 2, threads[8], nthreads = 0, do_bwd = 1, memory = 0;
    int dt_f32 = 1, dt_bf16 = 1, kernels = 0, ns[16], nns = 0, causal_only = -1, heads = 8, no_std = 0, nq_fixed = 0;
    float dropout = 0.0f;
#ifdef _OPENMP
    const int all = omp_get_max_threads();
#else
    const int all = 1;
#endif
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) nmax = 2048;
        else if (!strcmp(argv[i], "--nmax") && i + 1 < argc) nmax = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) nthreads = parse_list(argv[++i], threads, 8);
        else if (!strcmp(argv[i], "--dims") && i + 1 < argc) ndims = parse_list(argv[++i], dims, 4);
        else if (!strcmp(argv[i], "--dtypes") && i + 1 < argc) {
            dt_f32 = strstr(argv[i + 1], "f32") != NULL;
            dt_bf16 = strstr(argv[i + 1], "bf16") != NULL;
            i++;
        } else if (!strcmp(argv[i], "--no-bwd")) do_bwd = 0;
        else if (!strcmp(argv[i], "--memory")) memory = 1;
        else if (!strcmp(argv[i], "--kernels")) kernels = 1;
        else if (!strcmp(argv[i], "--ns") && i + 1 < argc) nns = parse_list(argv[++i], ns, 16);
        else if (!strcmp(argv[i], "--causal") && i + 1 < argc) causal_only = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc) heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--nq") && i + 1 < argc) nq_fixed = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cpu-time")) cpu_clock = 1;
        else if (!strcmp(argv[i], "--no-std")) no_std = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps_forced = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dropout") && i + 1 < argc) dropout = (float)atof(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--quick] [--nmax N] [--threads 1,2] [--dims 64,128] [--dtypes f32,bf16] "
                            "[--no-bwd] [--memory] [--ns N1,N2] [--nq NQ] [--causal 0|1] [--heads H] [--no-std] "
                            "[--reps R] [--cpu-time] [--dropout P] | --kernels\n", argv[0]);
            return 2;
        }
    }
    if (kernels) {
        kernel_report();
        return 0;
    }
    if (nthreads == 0) {
        threads[nthreads++] = 1;
        if (all > 1) threads[nthreads++] = all;
    }
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "cpu_speed: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    printf("flashc %s cpu backend, features: %s\n", flashc_version(), flashc_cpu_features());
    double sgemm_rate[8] = {0};
#ifdef FLASHC_BENCH_CBLAS
    for (int ti = 0; ti < nthreads; ti++) {
        sgemm_case s = {2048, NULL, NULL, NULL};
        size_t n = (size_t)s.n * s.n;
        s.a = malloc(n * 4);
        s.b = malloc(n * 4);
        s.c = malloc(n * 4);
        for (size_t i = 0; i < n; i++) s.a[i] = frand(), s.b[i] = frand();
        set_threads(ctx, threads[ti]);
        cpu_clock_threads = threads[ti];
        double t = time_median(run_sgemm, &s, 5);
        sgemm_rate[ti] = 2.0 * s.n * (double)s.n * s.n / t * 1e-9;
        if (cpu_clock) { /* OpenBLAS's threads spin a while after a call: let them sleep before the CPU time counts */
            struct timespec pause = {1, 0};
            nanosleep(&pause, NULL);
        }
        printf("sgemm 2048^3 on %d thread(s): %.1f GFLOP/s\n", threads[ti], sgemm_rate[ti]);
        free(s.a), free(s.b), free(s.c);
    }
#else
    printf("sgemm: no CBLAS in this build\n");
#endif
    if (cpu_clock) printf("\ntimes are CPU time per thread (--cpu-time), not wall clock");
    if (nq_fixed > 0) printf("\n%d query rows against N keys", nq_fixed);
    if (dropout > 0.0f)
        printf("\ndropout_p %.2f: ratio = speed with dropout / speed without (time without / time with), in turns"
               "\n%-5s %4s %6s %3s %6s | %9s %9s %6s | %9s %9s %6s\n", dropout, "dtype", "D", "causal", "thr", "N",
               "fwd ms", "p ms", "ratio", "f+b ms", "p ms", "ratio");
    else
        printf("\n%-5s %4s %6s %3s %6s | %9s %8s %7s | %9s %8s %6s | %9s %8s\n", "dtype", "D", "causal", "thr", "N",
               "fwd ms", "GFLOP/s", "%sgemm", "std ms", "GFLOP/s", "ratio", "bwd ms", "GFLOP/s");
    if (nns == 0)
        for (int n = 512; n <= nmax && nns < 16; n *= 2) ns[nns++] = n;
    const int64_t B = 1, H = heads;
    for (int di = 0; di < 2; di++) {
        flashc_dtype dt = di == 0 ? FLASHC_DTYPE_F32 : FLASHC_DTYPE_BF16;
        if ((dt == FLASHC_DTYPE_F32 && !dt_f32) || (dt == FLASHC_DTYPE_BF16 && !dt_bf16)) continue;
        for (int d = 0; d < ndims; d++)
            for (int causal = 0; causal < 2; causal++)
                for (int ti = 0; ti < nthreads && (causal_only < 0 || causal == causal_only); ti++)
                    for (int ni = 0; ni < nns; ni++) {
                        const int64_t N = ns[ni], D = dims[d], NQ = nq_fixed > 0 ? nq_fixed : N;
                        set_threads(ctx, threads[ti]);
                        cpu_clock_threads = threads[ti];
                        fprintf(stderr, "cpu_speed: %s D=%lld causal=%d threads=%d N=%lld\r", flashc_dtype_name(dt),
                                (long long)D, causal, threads[ti], (long long)N);
                        attn_case c;
                        memset(&c, 0, sizeof c);
                        c.ctx = ctx;
                        c.params = flashc_params_default();
                        c.params.causal = causal;
                        void *bufs[8] = {alloc_tensor(&c.q, dt, B, NQ, H, D, 1), alloc_tensor(&c.k, dt, B, N, H, D, 1),
                                         alloc_tensor(&c.v, dt, B, N, H, D, 1), alloc_tensor(&c.o, dt, B, NQ, H, D, 0),
                                         alloc_tensor(&c.dout, dt, B, NQ, H, D, 1),
                                         alloc_tensor(&c.dq, dt, B, NQ, H, D, 0), alloc_tensor(&c.dk, dt, B, N, H, D, 0),
                                         alloc_tensor(&c.dv, dt, B, N, H, D, 0)};
                        c.lse = malloc(sizeof(float) * (size_t)(B * H * NQ));
                        size_t wf = 0, wb = 0;
                        flashc_params sized = c.params; /* with dropout the backward takes one more tile a thread */
                        sized.dropout_p = dropout;
                        flashc_forward_workspace_size(ctx, &c.q, &c.k, &c.v, &sized, &wf);
                        flashc_backward_workspace_size(ctx, &c.q, &c.k, &c.v, &sized, &wb);
                        c.ws_bytes = wf > wb ? wf : wb;
                        c.ws = malloc(c.ws_bytes);
                        /* (with NQ != N and causal, only roughly half the scores are visible) */
                        const double flops = 4.0 * B * H * (double)NQ * N * D * (causal ? 0.5 : 1.0);
                        if (dropout > 0.0f) {
                            attn_case cd = c; /* the same tensors and workspace, with dropout */
                            cd.params.dropout_p = dropout;
                            cd.params.dropout_seed = 0x5eed;
                            double f0 = -1.0, f1 = -1.0, b0 = -1.0, b1 = -1.0;
                            int ok = time_pair(run_fwd, &c, run_fwd, &cd, reps_for(flops), &f0, &f1);
                            if (ok && do_bwd)
                                ok = time_pair(run_fwd_bwd, &c, run_fwd_bwd, &cd, reps_for(3.5 * flops), &b0, &b1);
                            printf("%-5s %4lld %6d %3d %6lld | %9.2f %9.2f %6.3f |", flashc_dtype_name(dt),
                                   (long long)D, causal, threads[ti], (long long)N, f0 * 1e3, f1 * 1e3, f0 / f1);
                            if (ok && do_bwd) printf(" %9.2f %9.2f %6.3f\n", b0 * 1e3, b1 * 1e3, b0 / b1);
                            else printf(" %9s %9s %6s\n", "-", "-", ok ? "-" : "FAIL");
                            fflush(stdout);
                            for (int i = 0; i < 8; i++) free(bufs[i]);
                            free(c.lse);
                            free(c.ws);
                            continue;
                        }
                        const double tf = time_median(run_fwd, &c, reps_for(flops));
                        double tb = -1.0, ts = -1.0;
                        if (do_bwd) tb = time_median(run_bwd, &c, reps_for(2.5 * flops));
#ifdef FLASHC_BENCH_CBLAS
                        if (dt == FLASHC_DTYPE_F32 && !no_std && NQ == N) {
                            std_case sc = {(int)N, (int)H, (int)D, causal, c.q.data, c.k.data, c.v.data, c.o.data,
                                           malloc(sizeof(float) * (size_t)(N * N))};
                            if (sc.s) ts = time_median(run_standard, &sc, reps_for(flops));
                            free(sc.s);
                        }
#endif
                        printf("%-5s %4lld %6d %3d %6lld | %9.2f %8.1f %6.0f%% |", flashc_dtype_name(dt),
                               (long long)D, causal, threads[ti], (long long)N, tf * 1e3, flops / tf * 1e-9,
                               sgemm_rate[ti] > 0 ? 100.0 * flops / tf * 1e-9 / sgemm_rate[ti] : 0.0);
                        if (ts > 0) printf(" %9.2f %8.1f %5.2fx |", ts * 1e3, flops / ts * 1e-9, ts / tf);
                        else printf(" %9s %8s %6s |", "-", "-", "-");
                        if (tb > 0) printf(" %9.2f %8.1f\n", tb * 1e3, 2.5 * flops / tb * 1e-9);
                        else printf(" %9s %8s\n", "-", "-");
                        fflush(stdout);
                        for (int i = 0; i < 8; i++) free(bufs[i]);
                        free(c.lse);
                        free(c.ws);
                    }
    }
    fprintf(stderr, "%60s\r", "");
    if (memory) memory_report(ctx);
    flashc_context_destroy(ctx);
    return 0;
}
