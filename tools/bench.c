/*
 * bench.c - `flashc bench`: flash attention against standard attention over a sweep of sequence lengths.
 *
 * Standard attention here is the textbook one the FlashAttention paper measures against: S = scale * Q K^T
 * materialized for every (batch, head) in fp32, a row softmax over it in place (P), then O = P V. Its two
 * products run on OpenBLAS's sgemm when the command was built with OpenBLAS (FLASHC_BENCH_OPENBLAS: CMake found
 * it), so the baseline runs at the machine's matrix-multiply rate; otherwise on plain C loops laid out so the
 * compiler vectorizes the inner ones (an AVX2 copy is picked at run time on x86), with OpenMP over rows. It runs
 * only while its B*H*N*N buffer fits the memory cap, and only on the CPU.
 * Both sides are timed as repeated runs after one warm-up (median, min, max); a time budget per measurement stops
 * the repetitions early on long runs so the default sweep stays around a minute on two cores.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* clock_gettime, sysconf, isatty */
#endif

#include "cli.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef FLASHC_BENCH_OPENBLAS
#include <cblas.h> /* OpenBLAS's: cblas_sgemm, openblas_set_num_threads, openblas_get_config */
#endif

static const char bench_usage[] =
    "usage: flashc bench [options]\n"
    "\n"
    "Sweeps N = 256, 512, 1024, ... up to --nmax (Nq = Nk = N) and prints per N: the flash attention time (median,\n"
    "min and max of --reps runs after a warm-up), its rate at the median (4*B*H*N*N*D FLOPs, halved when causal;\n"
    "GFLOP/s on the CPU, TFLOP/s on CUDA) and its extra memory (the workspace the library asks for); then the same\n"
    "for standard attention (S = QK^T materialized in fp32 for all heads, softmax, O = PV; CPU only; its products\n"
    "on OpenBLAS when the command was built with it, else on C loops: the header line says which) while its\n"
    "B*H*N*N buffer fits the cap, the speedup, and the largest difference between the two outputs. Progress goes\n"
    "to stderr.\n"
    "\n"
    "options:\n"
    "  --backend auto|cpu|cuda   default auto\n"
    "  --device N                GPU index (default 0)\n"
    "  --dtype f32|f16|bf16      default f32 on the CPU, bf16 on CUDA\n"
    "  --causal                  causal attention\n"
    "  --dim D                   head dimension (default 64 on the CPU, 128 on CUDA)\n"
    "  --heads H                 default 8 on the CPU, 2048/D on CUDA\n"
    "  --batch B                 default 1 on the CPU, 16384/N on CUDA\n"
    "  --nmin N, --nmax N        sweep range (default 256..4096 on the CPU, 512..16384 on CUDA)\n"
    "  --threads T               CPU threads for both implementations (default: OpenMP's)\n"
    "  --reps R                  timed runs per measurement (default 10 on the CPU, 30 on CUDA)\n"
    "  --budget S                stop repeating a measurement after S seconds (default 2)\n"
    "  --std-cap GIB             largest standard-attention buffer to allocate (default 4, at most 1/4 of RAM)\n"
    "  --no-std                  skip standard attention\n"
    "  --json FILE               also write the results as JSON (the settings, then one object per N: times in\n"
    "                            ms, rates in GFLOP/s, null where not measured)\n"
    "  --csv FILE                also write them as CSV (a header line, then one line per N; empty where not\n"
    "                            measured)\n"
    "Output files are written whole at the end of a successful sweep, or not at all.\n";

/* ---- standard attention ----------------------------------------------------------------------------------- */

typedef struct std_problem {
    const float *q, *k, *v; /* (B, N, H, D), (B, N, Hkv, D) contiguous fp32 */
    float *o;               /* (B, N, H, D) */
    float *s;               /* (B, H, N, N): S, then P in place */
    float *kt;              /* (B, Hkv, D, N): K transposed so S's rows are built with unit-stride loops */
    int64_t B, N, H, Hkv, D;
    float scale;
    int causal;
} std_problem;

/* A task is STD_RB query rows of one (b, h). Inside it, STD_MR x STD_NR register blocks (4 rows by two 8-wide
 * vectors) of S and O accumulate over D and over keys; O = P V walks the keys in STD_JC blocks so that a V
 * block is read once per task rather than once per row. */
#define STD_RB 16
#define STD_MR 4
#define STD_NR 16
#define STD_JC 64

/* Eight floats: GCC/Clang vector extensions make the register blocks explicit (one AVX register, or two SSE
 * ones in the generic build); other compilers get a struct and scalar loops. Passed by pointer: vector-typed
 * arguments would change the ABI between the generic and the AVX2 copies. */
#if defined(__GNUC__)
typedef float std_v8 __attribute__((vector_size(32)));
#define STD_V8_FMA(acc, a, v) (*(acc) += (a) * *(v))
#else
typedef struct std_v8 {
    float x[8];
} std_v8;
#define STD_V8_FMA(acc, a, v)                                                                                \
    do {                                                                                                     \
        for (int e_ = 0; e_ < 8; e_++) (acc)->x[e_] += (a) * (v)->x[e_];                                     \
    } while (0)
#endif
#define STD_V8_LOAD(dst, src) memcpy((dst), (src), sizeof(std_v8))
#define STD_V8_STORE(dst, src) memcpy((dst), (src), sizeof(std_v8))

/* exp(x) for x <= 0 (scores minus their row max, -inf for masked ones): 2^-n * e^r with |r| <= ln2/2 and a
 * degree-6 Taylor polynomial of e^r, relative error below 3e-7; exactly 0 below -87 where fp32 runs out.
 * Only integer selects and no calls, so the loops around it vectorize (glibc's expf does not, and a float
 * select followed by arithmetic is not if-converted under the default -ftrapping-math). */
static inline float std_exp(float x) {
    /* ln2 split in two (Cody and Waite) so that n * ln2_hi is exact and r keeps its low bits */
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const uint32_t lim = 0x42ae0000u; /* 87.0f */
    uint32_t ux;
    memcpy(&ux, &x, sizeof ux);
    ux &= 0x7fffffffu;                /* |x|, and -inf becomes the largest */
    const uint32_t keep = (uint32_t)-(int32_t)(ux < lim);
    ux = ux < lim ? ux : lim;
    float ax;
    memcpy(&ax, &ux, sizeof ax);
    const int32_t n = (int32_t)(ax * log2e + 0.5f);            /* exp(x) = 2^-n * e^r */
    const float r = ((float)n * ln2_hi - ax) + (float)n * ln2_lo; /* n ln2 - |x|, in about [-ln2/2, ln2/2] */
    const float p =
        1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    const uint32_t bits = ((uint32_t)(127 - n) << 23) & keep; /* 2^-n, or 0 */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Rows i0 .. i0+nr-1 of one (b, h)'s S (row r at srow + r * N, Nq == Nk == N) become P = softmax(S) in place,
 * the keys after the diagonal dropped when causal; partial max/sum arrays keep the reductions vectorizable. */
static inline
#if defined(__GNUC__)
    __attribute__((always_inline))
#endif
    void
    std_softmax_body(float *srow, int64_t N, int64_t i0, int nr, int causal) {
    for (int r = 0; r < nr; r++) {
        float *sr = srow + r * N;
        const int64_t i = i0 + r;
        if (causal)
            for (int64_t j = i + 1; j < N; j++) sr[j] = -INFINITY;
        float part[STD_NR];
        for (int jj = 0; jj < STD_NR; jj++) part[jj] = -INFINITY;
        int64_t j = 0;
        for (; j + STD_NR <= N; j += STD_NR)
            for (int jj = 0; jj < STD_NR; jj++) part[jj] = sr[j + jj] > part[jj] ? sr[j + jj] : part[jj];
        float m = -INFINITY;
        for (int jj = 0; jj < STD_NR; jj++) m = part[jj] > m ? part[jj] : m;
        for (; j < N; j++) m = sr[j] > m ? sr[j] : m;
        for (j = 0; j < N; j++) sr[j] = std_exp(sr[j] - m);
        for (int jj = 0; jj < STD_NR; jj++) part[jj] = 0.0f;
        for (j = 0; j + STD_NR <= N; j += STD_NR)
            for (int jj = 0; jj < STD_NR; jj++) part[jj] += sr[j + jj];
        float sum = 0.0f;
        for (int jj = 0; jj < STD_NR; jj++) sum += part[jj];
        for (; j < N; j++) sum += sr[j];
        const float inv = 1.0f / sum;
        for (j = 0; j < N; j++) sr[j] *= inv;
    }
}

/* Rows i0 .. i0+nr-1 (nr <= STD_RB) of one (b, h): S rows, softmax, O rows. scratch holds 2 * STD_RB * D
 * floats. */
static inline
#if defined(__GNUC__)
    __attribute__((always_inline))
#endif
    void
    std_rows_body(const std_problem *p, int64_t b, int64_t h, int64_t i0, int nr, float *scratch) {
    const int64_t N = p->N, D = p->D, H = p->H, Hkv = p->Hkv, hk = h / (H / Hkv);
    const float *kt = p->kt + (b * Hkv + hk) * D * N;
    const float *vh = p->v + (b * N * Hkv + hk) * D; /* row j at vh + j * Hkv * D */
    float *a = scratch, *oacc = scratch + STD_RB * D;
    float *srow = p->s + ((b * H + h) * N + i0) * N; /* row r at srow + r * N */

    for (int r = 0; r < nr; r++)
        for (int64_t d = 0; d < D; d++) a[r * D + d] = p->scale * p->q[((b * N + i0 + r) * H + h) * D + d];

    /* S = (scale Q) K^T */
    for (int64_t j0 = 0; j0 < N; j0 += STD_NR) {
        const int64_t nj = N - j0 < STD_NR ? N - j0 : STD_NR;
        for (int r0 = 0; r0 < nr; r0 += STD_MR) {
            const int mr = nr - r0 < STD_MR ? nr - r0 : STD_MR;
            if (mr == STD_MR && nj == STD_NR) {
                std_v8 acc[STD_MR][2], k0, k1;
                memset(acc, 0, sizeof acc);
                for (int64_t d = 0; d < D; d++) {
                    STD_V8_LOAD(&k0, kt + d * N + j0);
                    STD_V8_LOAD(&k1, kt + d * N + j0 + 8);
                    for (int r = 0; r < STD_MR; r++) {
                        const float ar = a[(r0 + r) * D + d];
                        STD_V8_FMA(&acc[r][0], ar, &k0);
                        STD_V8_FMA(&acc[r][1], ar, &k1);
                    }
                }
                for (int r = 0; r < STD_MR; r++) {
                    STD_V8_STORE(srow + (r0 + r) * N + j0, &acc[r][0]);
                    STD_V8_STORE(srow + (r0 + r) * N + j0 + 8, &acc[r][1]);
                }
            } else {
                for (int r = 0; r < mr; r++)
                    for (int64_t jj = 0; jj < nj; jj++) {
                        float acc = 0.0f;
                        for (int64_t d = 0; d < D; d++) acc += a[(r0 + r) * D + d] * kt[d * N + j0 + jj];
                        srow[(r0 + r) * N + j0 + jj] = acc;
                    }
            }
        }
    }

    /* P = softmax(S) row by row, in place */
    std_softmax_body(srow, N, i0, nr, p->causal);

    /* O = P V */
    memset(oacc, 0, (size_t)(nr * D) * sizeof(float));
    for (int64_t j0 = 0; j0 < N; j0 += STD_JC) {
        const int64_t j1 = N - j0 < STD_JC ? N : j0 + STD_JC;
        for (int r0 = 0; r0 < nr; r0 += STD_MR) {
            const int mr = nr - r0 < STD_MR ? nr - r0 : STD_MR;
            for (int64_t d0 = 0; d0 < D; d0 += STD_NR) {
                const int64_t nd = D - d0 < STD_NR ? D - d0 : STD_NR;
                if (mr == STD_MR && nd == STD_NR) {
                    std_v8 acc[STD_MR][2], v0, v1;
                    for (int r = 0; r < STD_MR; r++) {
                        STD_V8_LOAD(&acc[r][0], oacc + (r0 + r) * D + d0);
                        STD_V8_LOAD(&acc[r][1], oacc + (r0 + r) * D + d0 + 8);
                    }
                    for (int64_t j = j0; j < j1; j++) {
                        const float *vj = vh + j * Hkv * D + d0;
                        STD_V8_LOAD(&v0, vj);
                        STD_V8_LOAD(&v1, vj + 8);
                        for (int r = 0; r < STD_MR; r++) {
                            const float pr = srow[(r0 + r) * N + j];
                            STD_V8_FMA(&acc[r][0], pr, &v0);
                            STD_V8_FMA(&acc[r][1], pr, &v1);
                        }
                    }
                    for (int r = 0; r < STD_MR; r++) {
                        STD_V8_STORE(oacc + (r0 + r) * D + d0, &acc[r][0]);
                        STD_V8_STORE(oacc + (r0 + r) * D + d0 + 8, &acc[r][1]);
                    }
                } else {
                    for (int r = 0; r < mr; r++)
                        for (int64_t j = j0; j < j1; j++) {
                            const float pr = srow[(r0 + r) * N + j];
                            const float *vj = vh + j * Hkv * D + d0;
                            for (int64_t dd = 0; dd < nd; dd++) oacc[(r0 + r) * D + d0 + dd] += pr * vj[dd];
                        }
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) memcpy(p->o + ((b * N + i0 + r) * H + h) * D, oacc + r * D, (size_t)D * sizeof(float));
}

static void std_rows_generic(const std_problem *p, int64_t b, int64_t h, int64_t i0, int nr, float *scratch) {
    std_rows_body(p, b, h, i0, nr, scratch);
}
static void std_softmax_generic(float *srow, int64_t N, int64_t i0, int nr, int causal) {
    std_softmax_body(srow, N, i0, nr, causal);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define STD_HAVE_AVX2 1
__attribute__((target("avx2,fma"))) static void std_rows_avx2(const std_problem *p, int64_t b, int64_t h,
                                                              int64_t i0, int nr, float *scratch) {
    std_rows_body(p, b, h, i0, nr, scratch);
}
__attribute__((target("avx2,fma"))) static void std_softmax_avx2(float *srow, int64_t N, int64_t i0, int nr,
                                                                 int causal) {
    std_softmax_body(srow, N, i0, nr, causal);
}
#endif

typedef void (*std_rows_fn)(const std_problem *, int64_t, int64_t, int64_t, int, float *);
typedef void (*std_softmax_fn)(float *, int64_t, int64_t, int, int);

/* The copies this CPU runs, and what to call them ("avx2", "generic"). */
typedef struct std_kernels {
    std_rows_fn rows;
    std_softmax_fn softmax;
    const char *isa;
} std_kernels;

static std_kernels std_pick(void) {
    std_kernels k = {std_rows_generic, std_softmax_generic, "generic"};
#ifdef STD_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        k.rows = std_rows_avx2;
        k.softmax = std_softmax_avx2;
        k.isa = "avx2";
    }
#endif
    return k;
}

#ifdef FLASHC_BENCH_OPENBLAS
/* The same standard attention with its two products on OpenBLAS's sgemm, per (b, h): S = scale Q K^T straight
 * from the (B, N, H, D) rows (leading dimension H*D), the softmax above, O = P V into the output rows. The heads
 * are spread over up to `threads` OpenMP threads, each calling a single-threaded sgemm; when there are fewer
 * heads than threads, OpenBLAS gets the remaining threads inside each call. (Two thread pools spinning side by
 * side on the same cores would slow both, so the split is one or the other per call.) */
static void std_attention_blas(const std_problem *p, std_softmax_fn softmax, int threads) {
    const int64_t N = p->N, D = p->D, H = p->H, Hkv = p->Hkv, BH = p->B * p->H;
    const int outer = threads < BH ? threads : (int)BH, inner = threads / (outer > 0 ? outer : 1);
    openblas_set_num_threads(inner > 0 ? inner : 1);
#ifdef _OPENMP
#pragma omp parallel for num_threads(outer) schedule(dynamic, 1)
#endif
    for (int64_t bh = 0; bh < BH; bh++) {
        const int64_t b = bh / H, h = bh % H, hk = h / (H / Hkv);
        const float *q = p->q + (b * N * H + h) * D, *k = p->k + (b * N * Hkv + hk) * D;
        const float *v = p->v + (b * N * Hkv + hk) * D;
        float *s = p->s + bh * N * N, *o = p->o + (b * N * H + h) * D;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)N, (blasint)N, (blasint)D, p->scale, q,
                    (blasint)(H * D), k, (blasint)(Hkv * D), 0.0f, s, (blasint)N);
        softmax(s, N, 0, (int)N, p->causal);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)N, (blasint)D, (blasint)N, 1.0f, s,
                    (blasint)N, v, (blasint)(Hkv * D), 0.0f, o, (blasint)(H * D));
    }
    (void)outer;
}
#endif

/* Returns 0, or -1 when a thread's scratch could not be allocated. */
static int std_attention(const std_problem *p, std_rows_fn rows, int threads) {
    const int64_t N = p->N, D = p->D;
    const int64_t nkv = p->B * p->Hkv;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t bh = 0; bh < nkv; bh++) {
        const int64_t b = bh / p->Hkv, hk = bh % p->Hkv;
        float *kt = p->kt + bh * D * N;
        for (int64_t j = 0; j < N; j++) {
            const float *kj = p->k + ((b * N + j) * p->Hkv + hk) * D;
            for (int64_t d = 0; d < D; d++) kt[d * N + j] = kj[d];
        }
    }
    const int64_t nblk = (N + STD_RB - 1) / STD_RB, tasks = p->B * p->H * nblk;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
#endif
    {
        float *scratch = (float *)malloc((size_t)(2 * STD_RB * D) * sizeof(float));
        if (!scratch) failed = 1;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < tasks; t++) {
            if (!scratch) continue;
            const int64_t bh = t / nblk, i0 = (t % nblk) * STD_RB, left = N - i0;
            rows(p, bh / p->H, bh % p->H, i0, (int)(left < STD_RB ? left : STD_RB), scratch);
        }
        free(scratch);
    }
    (void)threads;
    return failed ? -1 : 0;
}

/* ---- the sweep ---------------------------------------------------------------------------------------------- */

typedef struct bench_opts {
    flashc_backend backend;
    int device;
    flashc_dtype dtype;
    int causal;
    int64_t D, H, B; /* B 0: per N */
    int64_t nmin, nmax;
    int threads;
    int reps;
    double budget;
    double std_cap;
    int std_on;
    const char *json_path, *csv_path; /* NULL: not written */
} bench_opts;

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Standard normal values, stored in dtype; f32 (when not NULL) receives the stored values widened. */
static void fill_normal(void *dst, float *f32, flashc_dtype dtype, size_t n, uint64_t *state) {
    const double two_pi = 6.283185307179586;
    for (size_t i = 0; i < n; i += 2) {
        double u1 = ((double)(rng_next(state) >> 11) + 1.0) * 0x1.0p-53;
        double u2 = (double)(rng_next(state) >> 11) * 0x1.0p-53;
        double r = sqrt(-2.0 * log(u1));
        float x[2] = {(float)(r * cos(two_pi * u2)), (float)(r * sin(two_pi * u2))};
        for (size_t j = 0; j < 2 && i + j < n; j++) {
            cli_store(dst, dtype, i + j, x[j]);
            if (f32) f32[i + j] = cli_load(dst, dtype, i + j);
        }
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double phys_memory_bytes(void) {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && size > 0) return (double)pages * (double)size;
#endif
    return 0.0;
}

static int progress_tty = -1;

static void progress(const char *fmt, int64_t n, int idx, int total) {
    if (progress_tty < 0) progress_tty = isatty(fileno(stderr));
    if (progress_tty) fprintf(stderr, "\r\033[K");
    fprintf(stderr, fmt, (long long)n, idx, total);
    fputc(progress_tty ? ' ' : '\n', stderr);
    fflush(stderr);
}

static void progress_clear(void) {
    if (progress_tty > 0) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
}

/* Seconds per run of one measurement: the median and the spread of the timed runs. */
typedef struct bench_stats {
    double median, min, max;
    int runs; /* 0: not measured */
} bench_stats;

/* Runs fn once as a warm-up, then up to reps times within the budget; returns 0 with the times in st, or -1 on
 * failure. */
typedef int (*bench_fn)(void *arg);

static int time_runs(flashc_backend b, bench_fn fn, void *arg, int reps, double budget, bench_stats *st) {
    cli_timer *timer = cli_timer_create(b);
    double *t = (double *)malloc((size_t)reps * sizeof *t);
    int rc = -1;
    memset(st, 0, sizeof *st);
    if (!timer || !t) goto out;
    cli_timer_start(timer);
    if (fn(arg) != 0) goto out;
    double warm = cli_timer_stop(timer);
    if (warm < 0) goto out;
    int n = 0;
    double spent = 0.0;
    while (n < reps && (n == 0 || spent < budget)) {
        cli_timer_start(timer);
        if (fn(arg) != 0) goto out;
        t[n] = cli_timer_stop(timer);
        if (t[n] < 0) goto out;
        spent += t[n++];
    }
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    st->median = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    st->min = t[0];
    st->max = t[n - 1];
    st->runs = n;
    rc = 0;
out:
    free(t);
    cli_timer_destroy(timer);
    return rc;
}

typedef struct flash_call {
    flashc_context_t ctx;
    flashc_tensor q, k, v, o;
    flashc_params prm;
    void *ws;
    size_t ws_bytes;
} flash_call;

static int flash_run(void *arg) {
    flash_call *c = (flash_call *)arg;
    return flashc_forward(c->ctx, &c->q, &c->k, &c->v, &c->prm, &c->o, NULL, c->ws, c->ws_bytes) ==
                   FLASHC_STATUS_OK
               ? 0
               : -1;
}

typedef struct std_call {
    std_problem p;
    std_kernels kern;
    int blas;
    int threads;
} std_call;

static int std_run(void *arg) {
    std_call *c = (std_call *)arg;
#ifdef FLASHC_BENCH_OPENBLAS
    if (c->blas) {
        std_attention_blas(&c->p, c->kern.softmax, c->threads);
        return 0;
    }
#endif
    return std_attention(&c->p, c->kern.rows, c->threads);
}

/* One N of the sweep, as printed and as written to --json / --csv. */
typedef struct bench_row {
    int64_t N, B;
    double flops;
    bench_stats flash;
    size_t ws_bytes;
    bench_stats std; /* runs 0: not measured (see std_state) */
    int std_state;   /* 0 not asked for (GPU, --no-std), 1 run, 2 over the cap */
    double std_bytes;
    double maxdiff; /* < 0: none */
} bench_row;

/* The JSON text of a string (quotes and escapes included). */
static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        const unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

/* A number, or null where there is none (JSON has no NaN or infinity). */
static void json_number(FILE *f, double x, int have) {
    if (have && isfinite(x))
        fprintf(f, "%.6g", x);
    else
        fputs("null", f);
}

static void json_stats(FILE *f, const bench_stats *st, double flops) {
    fputs("{\"ms_median\": ", f);
    json_number(f, 1e3 * st->median, 1);
    fputs(", \"ms_min\": ", f);
    json_number(f, 1e3 * st->min, 1);
    fputs(", \"ms_max\": ", f);
    json_number(f, 1e3 * st->max, 1);
    fprintf(f, ", \"runs\": %d, \"gflops\": ", st->runs);
    json_number(f, flops / st->median * 1e-9, st->median > 0);
}

static void write_json(FILE *f, const bench_opts *o, const char *device, const char *std_name, const char *std_detail,
                       int threads, const bench_row *rows, int nrows) {
    fprintf(f, "{\n  \"flashc\": ");
    json_string(f, flashc_version());
    fprintf(f, ",\n  \"backend\": \"%s\",\n  \"device\": ", flashc_backend_name(o->backend));
    json_string(f, device);
    fprintf(f, ",\n  \"dtype\": \"%s\",\n  \"causal\": %s,\n  \"heads\": %lld,\n  \"dim\": %lld,\n  \"threads\": ",
            flashc_dtype_name(o->dtype), o->causal ? "true" : "false", (long long)o->H, (long long)o->D);
    if (o->backend == FLASHC_BACKEND_CPU)
        fprintf(f, "%d", threads);
    else
        fputs("null", f);
    fprintf(f, ",\n  \"reps\": %d,\n  \"budget_s\": %.6g,\n  \"standard\": ", o->reps, o->budget);
    if (std_name) {
        json_string(f, std_name);
        fputs(",\n  \"standard_detail\": ", f);
        json_string(f, std_detail);
    } else {
        fputs("null,\n  \"standard_detail\": null", f);
    }
    fputs(",\n  \"rows\": [", f);
    for (int i = 0; i < nrows; i++) {
        const bench_row *r = &rows[i];
        fprintf(f, "%s\n    {\"N\": %lld, \"B\": %lld, \"flops\": %.0f,\n     \"flash\": ", i ? "," : "",
                (long long)r->N, (long long)r->B, r->flops);
        json_stats(f, &r->flash, r->flops);
        fprintf(f, ", \"workspace_bytes\": %zu},\n     \"standard\": ", r->ws_bytes);
        if (r->std_state == 1) {
            json_stats(f, &r->std, r->flops);
            fprintf(f, ", \"bytes\": %.0f}", r->std_bytes);
        } else {
            fputs("null", f);
        }
        fprintf(f, ", \"standard_skipped\": %s,\n     \"speedup\": ",
                r->std_state == 2 ? "\"over --std-cap\"" : "null");
        json_number(f, r->std.median / r->flash.median, r->std_state == 1);
        fputs(", \"max_abs_diff\": ", f);
        json_number(f, r->maxdiff, r->maxdiff >= 0);
        fputc('}', f);
    }
    fputs("\n  ]\n}\n", f);
}

static void csv_number(FILE *f, double x, int have) {
    fputc(',', f);
    if (have && isfinite(x)) fprintf(f, "%.6g", x);
}

static void write_csv(FILE *f, const bench_opts *o, const char *std_name, const bench_row *rows, int nrows) {
    fputs("backend,dtype,causal,H,D,N,B,flash_ms_median,flash_ms_min,flash_ms_max,flash_runs,flash_gflops,"
          "flash_workspace_bytes,standard,std_ms_median,std_ms_min,std_ms_max,std_runs,std_gflops,std_bytes,"
          "speedup,max_abs_diff\n",
          f);
    for (int i = 0; i < nrows; i++) {
        const bench_row *r = &rows[i];
        const int sr = r->std_state == 1;
        fprintf(f, "%s,%s,%d,%lld,%lld,%lld,%lld", flashc_backend_name(o->backend), flashc_dtype_name(o->dtype),
                o->causal, (long long)o->H, (long long)o->D, (long long)r->N, (long long)r->B);
        csv_number(f, 1e3 * r->flash.median, 1);
        csv_number(f, 1e3 * r->flash.min, 1);
        csv_number(f, 1e3 * r->flash.max, 1);
        fprintf(f, ",%d", r->flash.runs);
        csv_number(f, r->flops / r->flash.median * 1e-9, 1);
        fprintf(f, ",%zu,%s", r->ws_bytes, sr ? std_name : r->std_state == 2 ? "over-cap" : "");
        csv_number(f, 1e3 * r->std.median, sr);
        csv_number(f, 1e3 * r->std.min, sr);
        csv_number(f, 1e3 * r->std.max, sr);
        fputc(',', f);
        if (sr) fprintf(f, "%d", r->std.runs);
        csv_number(f, r->flops / r->std.median * 1e-9, sr);
        fputc(',', f);
        if (r->std_state != 0) fprintf(f, "%.0f", r->std_bytes);
        csv_number(f, r->std.median / r->flash.median, sr);
        csv_number(f, r->maxdiff, r->maxdiff >= 0);
        fputc('\n', f);
    }
}

static int bench_sweep(const bench_opts *o) {
    int rc = 1;
    char name[256], b1[32], b2[32], err[512];
    flashc_context_t ctx = NULL;
    bench_row *rows = NULL;
    int nrows = 0;
    /* The output files are checked and opened first (as temporaries beside them, renamed into place at the end),
     * so a bad name fails before the sweep, and a failed sweep leaves the disk as it was. */
    npy_out outs[2];
    memset(outs, 0, sizeof outs);
    const char *paths[2] = {o->json_path, o->csv_path};
    for (int i = 0; i < 2; i++)
        if (paths[i] && npy_out_open(&outs[i], paths[i], err, sizeof err) != 0) {
            cli_fail("bench", "%s", err);
            goto out;
        }
    if (flashc_context_create(&ctx, o->backend, o->device) != FLASHC_STATUS_OK) {
        cli_fail("bench", "cannot create a %s context: %s", flashc_backend_name(o->backend),
                 flashc_context_last_error(NULL));
        goto out;
    }
    if (o->threads > 0 && flashc_context_set_threads(ctx, o->threads) != FLASHC_STATUS_OK) {
        cli_fail("bench", "%s", flashc_context_last_error(ctx));
        goto out;
    }
    if (flashc_device_name(o->backend, o->device, name, sizeof name) != FLASHC_STATUS_OK) snprintf(name, sizeof name, "?");
    const int cpu = o->backend == FLASHC_BACKEND_CPU;
    const int threads = o->threads > 0 ? o->threads : cli_omp_max_threads();
    const std_kernels kern = std_pick();
    double cap = o->std_cap * 1073741824.0, phys = phys_memory_bytes();
    if (phys > 0 && cap > phys / 4) cap = phys / 4;

    /* Which standard attention runs: OpenBLAS's sgemm where the command was built with it, else the C loops. */
    char std_detail[256];
#ifdef FLASHC_BENCH_OPENBLAS
    const int blas = 1;
    const char *std_name = "openblas";
    snprintf(std_detail, sizeof std_detail, "OpenBLAS sgemm (%s), softmax in C (%s)", openblas_get_config(),
             kern.isa);
#else
    const int blas = 0;
    const char *std_name = "c-loops";
    snprintf(std_detail, sizeof std_detail, "C loops (%s); no BLAS found when the command was built", kern.isa);
#endif
    if (!cpu || !o->std_on) std_name = NULL;

    int total = 0;
    for (int64_t n = o->nmin; n <= o->nmax; n *= 2) total++;
    if (!(rows = (bench_row *)calloc((size_t)total, sizeof *rows))) {
        cli_fail("bench", "out of memory");
        goto out;
    }

    printf("flashc bench: %s, %s, H=%lld D=%lld, %s", flashc_backend_name(o->backend), flashc_dtype_name(o->dtype),
           (long long)o->H, (long long)o->D, o->causal ? "causal" : "non-causal");
    if (cpu) printf(", %d thread%s", threads, threads == 1 ? "" : "s");
    printf("; median, min and max of <= %d runs after a warm-up (%.0f s budget)\n", o->reps, o->budget);
    printf("device: %s\n", name);
    if (std_name)
        printf("standard: S = QK^T materialized in fp32 for all heads, softmax, O = PV; %s; cap %s\n", std_detail,
               cli_bytes(cap, b1, sizeof b1));
    else if (!cpu)
        printf("standard: not measured on %s (CPU only)\n", flashc_backend_name(o->backend));
    /* GPU rates read better in TFLOP/s */
    const double rate_unit = cpu ? 1e-9 : 1e-12;
    const char *rate_name = cpu ? "GFLOP/s" : "TFLOP/s";
    printf("%7s %5s %10s %10s %10s %9s %10s %10s %10s %10s %9s %10s %8s %10s\n", "N", "B", "flash ms", "min", "max",
           rate_name, "flash mem", "std ms", "min", "max", rate_name, "std mem", "speedup", "max|diff|");
    fflush(stdout); /* before the progress lines on stderr */

    int idx = 0, skipped = 0;
    for (int64_t N = o->nmin; N <= o->nmax; N *= 2) {
        idx++;
        progress("bench: N=%lld (%d/%d)...", N, idx, total);
        const int64_t B = o->B > 0 ? o->B : (cpu ? 1 : (16384 / N > 0 ? 16384 / N : 1));
        const int64_t H = o->H, D = o->D;
        if ((double)B * N * H * D * sizeof(float) > 0x1p62) {
            progress_clear();
            cli_fail("bench", "N=%lld: the tensors are too large", (long long)N);
            goto out;
        }
        const size_t n = (size_t)(B * N * H * D), esize = cli_dtype_size(o->dtype), bytes = n * esize;
        bench_row *row = &rows[nrows];
        memset(row, 0, sizeof *row);
        row->N = N;
        row->B = B;
        row->maxdiff = -1.0;
        row->flops = 4.0 * (double)B * (double)H * (double)N * (double)N * (double)D * (o->causal ? 0.5 : 1.0);
        /* S for every head; the C loops also keep K transposed */
        row->std_bytes = (double)B * H * N * N * sizeof(float) + (blas ? 0.0 : (double)B * H * D * N * sizeof(float));
        const int std_run_now = std_name && row->std_bytes <= cap;
        row->std_state = !std_name ? 0 : std_run_now ? 1 : 2;

        void *host[4] = {NULL, NULL, NULL, NULL}, *dev[4] = {NULL, NULL, NULL, NULL};
        float *f32[4] = {NULL, NULL, NULL, NULL}, *s = NULL, *kt = NULL;
        flash_call fc;
        memset(&fc, 0, sizeof fc);
        int ok = 1;
        for (int t = 0; t < 4 && ok; t++) {
            ok = (host[t] = malloc(bytes)) != NULL;
            if (ok && std_run_now) ok = (f32[t] = (float *)malloc(n * sizeof(float))) != NULL;
        }
        if (!ok) {
            progress_clear();
            cli_fail("bench", "out of memory at N=%lld", (long long)N);
            goto row_done;
        }
        uint64_t state = 0x5eed0000ull + (uint64_t)N;
        for (int t = 0; t < 3; t++) fill_normal(host[t], f32[t], o->dtype, n, &state);

        for (int t = 0; t < 4; t++) {
            if (cpu) {
                dev[t] = host[t];
            } else if (!(dev[t] = cli_mem_alloc(o->backend, bytes)) ||
                       (t < 3 && cli_mem_to_backend(o->backend, dev[t], host[t], bytes) != 0)) {
                progress_clear();
                cli_fail("bench", "cannot place N=%lld on the GPU", (long long)N);
                ok = 0;
                goto row_done;
            }
        }
        fc.ctx = ctx;
        fc.prm = flashc_params_default();
        fc.prm.causal = o->causal;
        fc.q = flashc_tensor_contiguous(dev[0], o->dtype, B, N, H, D);
        fc.k = flashc_tensor_contiguous(dev[1], o->dtype, B, N, H, D);
        fc.v = flashc_tensor_contiguous(dev[2], o->dtype, B, N, H, D);
        fc.o = flashc_tensor_contiguous(dev[3], o->dtype, B, N, H, D);
        if (flashc_forward_workspace_size(ctx, &fc.q, &fc.k, &fc.v, &fc.prm, &fc.ws_bytes) != FLASHC_STATUS_OK) {
            progress_clear();
            cli_fail("bench", "%s", flashc_context_last_error(ctx));
            ok = 0;
            goto row_done;
        }
        if (fc.ws_bytes && !(fc.ws = cli_mem_alloc(o->backend, fc.ws_bytes))) {
            progress_clear();
            cli_fail("bench", "cannot allocate the %zu-byte workspace", fc.ws_bytes);
            ok = 0;
            goto row_done;
        }
        row->ws_bytes = fc.ws_bytes;
        if (time_runs(o->backend, flash_run, &fc, o->reps, o->budget, &row->flash) != 0) {
            progress_clear();
            cli_fail("bench", "N=%lld: %s", (long long)N, flashc_context_last_error(ctx));
            ok = 0;
            goto row_done;
        }
        if (!cpu && cli_mem_to_host(o->backend, host[3], dev[3], bytes) != 0) {
            ok = 0;
            goto row_done;
        }

        if (std_run_now) {
            s = (float *)malloc((size_t)(B * H * N * N) * sizeof(float));
            if (!blas) kt = (float *)malloc((size_t)(B * H * D * N) * sizeof(float));
            if (s && (blas || kt)) {
                progress("bench: N=%lld (%d/%d) standard...", N, idx, total);
                std_call sc = {{f32[0], f32[1], f32[2], f32[3], s, kt, B, N, H, H, D, 1.0f / sqrtf((float)D),
                                o->causal},
                               kern, blas, threads};
                if (time_runs(FLASHC_BACKEND_CPU, std_run, &sc, o->reps, o->budget, &row->std) == 0) {
                    row->maxdiff = 0.0;
                    for (size_t i = 0; i < n; i++) {
                        double d = fabs((double)cli_load(host[3], o->dtype, i) - (double)f32[3][i]);
                        if (!(d <= row->maxdiff)) row->maxdiff = d; /* NaN sticks */
                    }
                }
            }
            if (row->std.runs == 0) row->std_state = 0; /* no memory for S, or it failed: shown as not run */
        }

    row_done:
        progress_clear();
        if (ok) {
            char ts[3][32] = {"-", "-", "-"}, gs[32] = "-", sp[32] = "-", md[32] = "-", sm[32] = "-";
            if (row->std.runs > 0) {
                snprintf(ts[0], sizeof ts[0], "%.3f", 1e3 * row->std.median);
                snprintf(ts[1], sizeof ts[1], "%.3f", 1e3 * row->std.min);
                snprintf(ts[2], sizeof ts[2], "%.3f", 1e3 * row->std.max);
                snprintf(gs, sizeof gs, "%.1f", row->flops / row->std.median * rate_unit);
                snprintf(sp, sizeof sp, "%.2fx", row->std.median / row->flash.median);
            }
            if (row->maxdiff >= 0 || row->maxdiff != row->maxdiff) snprintf(md, sizeof md, "%.2e", row->maxdiff);
            if (std_name) {
                cli_bytes(row->std_bytes, sm, sizeof sm);
                if (!std_run_now) {
                    strncat(sm, "*", sizeof sm - strlen(sm) - 1);
                    skipped = 1;
                }
            }
            printf("%7lld %5lld %10.3f %10.3f %10.3f %9.1f %10s %10s %10s %10s %9s %10s %8s %10s\n", (long long)N,
                   (long long)B, 1e3 * row->flash.median, 1e3 * row->flash.min, 1e3 * row->flash.max,
                   row->flops / row->flash.median * rate_unit, cli_bytes((double)fc.ws_bytes, b2, sizeof b2), ts[0],
                   ts[1], ts[2], gs, sm, sp, md);
            fflush(stdout);
            nrows++;
        }
        free(s);
        free(kt);
        cli_mem_free(o->backend, fc.ws);
        for (int t = 0; t < 4; t++) {
            if (!cpu) cli_mem_free(o->backend, dev[t]);
            free(host[t]);
            free(f32[t]);
        }
        if (!ok) goto out;
    }
    if (skipped) printf("* over the cap (--std-cap): standard attention not run\n");

    /* Both files written and closed before either replaces its name. */
    for (int i = 0; i < 2; i++) {
        if (!paths[i]) continue;
        if (i == 0)
            write_json(outs[i].f, o, name, std_name, std_detail, threads, rows, nrows);
        else
            write_csv(outs[i].f, o, std_name, rows, nrows);
        if (npy_out_close(&outs[i], err, sizeof err) != 0) {
            cli_fail("bench", "%s", err);
            goto out;
        }
    }
    for (int i = 0; i < 2; i++)
        if (paths[i] && npy_out_commit(&outs[i], err, sizeof err) != 0) {
            cli_fail("bench", "%s", err);
            goto out;
        }
    rc = 0;
out:
    for (int i = 0; i < 2; i++) npy_out_discard(&outs[i]);
    free(rows);
    flashc_context_destroy(ctx);
    return rc;
}

int cli_bench(int argc, char **argv) {
    flashc_backend requested = FLASHC_BACKEND_AUTO;
    int have_dtype = 0;
    flashc_dtype dtype = FLASHC_DTYPE_F32;
    int64_t D = 0, H = 0, B = 0, nmin = 0, nmax = 0, threads = 0, reps = 0, device = 0;
    float budget = 2.0f, std_cap = 4.0f;
    int causal = 0, std_on = 1;
    const char *json_path = NULL, *csv_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL, *a = argv[i];
        int m;
        if (cli_is_help(a)) {
            fputs(bench_usage, stdout);
            return 0;
        }
        if (cli_flag(a, "causal")) {
            causal = 1;
        } else if (cli_flag(a, "no-std")) {
            std_on = 0;
        } else if ((m = cli_opt(argc, argv, &i, "backend", &v)) != 0) {
            if (m < 0 || cli_parse_backend("bench", v, &requested) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "device", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "device", v, 0, 1024, &device) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "dtype", &v)) != 0) {
            if (m < 0 || cli_parse_dtype("bench", v, &dtype) != 0) return 2;
            have_dtype = 1;
        } else if ((m = cli_opt(argc, argv, &i, "dim", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "dim", v, 1, 1 << 16, &D) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "heads", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "heads", v, 1, 1 << 16, &H) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "batch", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "batch", v, 1, 1 << 20, &B) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "nmin", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "nmin", v, 1, INT64_C(1) << 24, &nmin) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "nmax", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "nmax", v, 1, INT64_C(1) << 24, &nmax) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "threads", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "threads", v, 0, 4096, &threads) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "reps", &v)) != 0) {
            if (m < 0 || cli_parse_i64("bench", "reps", v, 1, 100000, &reps) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "budget", &v)) != 0) {
            if (m < 0 || cli_parse_f32("bench", "budget", v, &budget) != 0) return 2;
            if (budget < 0) return cli_usage_error("bench", "--budget must not be negative");
        } else if ((m = cli_opt(argc, argv, &i, "std-cap", &v)) != 0) {
            if (m < 0 || cli_parse_f32("bench", "std-cap", v, &std_cap) != 0) return 2;
            if (std_cap < 0) return cli_usage_error("bench", "--std-cap must not be negative");
        } else if ((m = cli_opt(argc, argv, &i, "json", &v)) != 0) {
            if (m < 0) return 2;
            if (json_path) return cli_usage_error("bench", "--json given twice");
            if (!v[0]) return cli_usage_error("bench", "--json: the file name is empty");
            json_path = v;
        } else if ((m = cli_opt(argc, argv, &i, "csv", &v)) != 0) {
            if (m < 0) return 2;
            if (csv_path) return cli_usage_error("bench", "--csv given twice");
            if (!v[0]) return cli_usage_error("bench", "--csv: the file name is empty");
            csv_path = v;
        } else {
            return cli_usage_error("bench", "unknown argument '%s'", a);
        }
    }
    if (json_path && csv_path && cli_same_file(json_path, csv_path))
        return cli_usage_error("bench", "--json and --csv name the same file '%s'", csv_path);

    bench_opts o;
    memset(&o, 0, sizeof o);
    o.backend = cli_resolve_backend(requested);
    o.device = (int)device;
    if (cli_backend_usable("bench", o.backend, o.device) != 0) return 1;
    if (cli_set_device(o.backend, o.device) != 0) return 1;
    const int cpu = o.backend == FLASHC_BACKEND_CPU;
    o.dtype = have_dtype ? dtype : (cpu ? FLASHC_DTYPE_F32 : FLASHC_DTYPE_BF16);
    o.causal = causal;
    o.D = D ? D : (cpu ? 64 : 128);
    o.H = H ? H : (cpu ? 8 : (2048 / o.D > 0 ? 2048 / o.D : 1));
    o.B = B;
    o.nmin = nmin ? nmin : (cpu ? 256 : 512);
    o.nmax = nmax ? nmax : (cpu ? 4096 : 16384);
    if (o.nmax < o.nmin) return cli_usage_error("bench", "--nmax %lld is below --nmin %lld", (long long)o.nmax,
                                                (long long)o.nmin);
    o.threads = (int)threads;
    o.reps = reps ? (int)reps : (cpu ? 10 : 30);
    o.budget = budget;
    o.std_cap = std_cap;
    o.std_on = std_on;
    o.json_path = json_path;
    o.csv_path = csv_path;
    return bench_sweep(&o);
}
