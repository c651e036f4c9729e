/*
 * cpu_bwd_ab: the CPU backward of two (or more) builds of libflashc in one process, timed in turns on the same
 * inputs, and their gradients compared bit for bit. Each library is dlopen'ed with RTLD_LOCAL, so two builds of the
 * same symbols live side by side; the first computes the forward (out, lse) that every backward then reads.
 *
 *   cc -O2 -std=c11 -Iinclude bench/cpu_bwd_ab.c -o cpu_bwd_ab -ldl -lm
 *   OMP_WAIT_POLICY=passive ./cpu_bwd_ab [--cpu-time] [--ns 512,1024] [--dims 64,128] [--dtypes f32,bf16]
 *       [--causal 0,1] [--heads 8] [--threads 2] [--reps 5] [--nq NQ] [--no-warmup] base/libflashc.so new/libflashc.so
 *
 * Prints per shape the median GFLOP/s of each library (backward FLOPs: 2.5 x 4 B H N^2 D, halved when causal), the
 * ratio of each to the first, and how many gradient elements differ from the first library's (bits). --nq: NQ query
 * rows against N keys (the backward streams its query side once per pass over the keys, so a long NQ against a short N
 * shows the long-sequence behaviour at a fraction of the time; FLOPs then count NQ x N). --no-warmup: no untimed
 * round first (for runs of a minute each). --cpu-time:
 * process CPU time / threads instead of the wall clock (what a run would take with its cores to itself, on a
 * machine shared with other jobs; with OMP_WAIT_POLICY=passive threads waiting at a barrier do not count).
 */
#define _POSIX_C_SOURCE 200809L
#include "flashc.h"
#include "benchkit.h"
#include "benchlib.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LIBS 4
#define MAX_REPS 15

int main(int argc, char **argv) {
    int ns[16] = {512, 1024, 2048}, nns = 3, dims[4] = {64, 128}, ndims = 2, causals[2] = {0, 1}, ncausal = 2;
    int heads = 8, reps = 5, dt_f32 = 1, dt_bf16 = 1, nlibs = 0, nq_fixed = 0, warmup = 1;
    lib libs[MAX_LIBS];
    memset(libs, 0, sizeof libs);
    nthreads = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cpu-time")) cpu_clock = 1;
        else if (!strcmp(argv[i], "--ns") && i + 1 < argc) nns = parse_list(argv[++i], ns, 16);
        else if (!strcmp(argv[i], "--dims") && i + 1 < argc) ndims = parse_list(argv[++i], dims, 4);
        else if (!strcmp(argv[i], "--causal") && i + 1 < argc) ncausal = parse_list(argv[++i], causals, 2);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc) heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) nthreads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--nq") && i + 1 < argc) nq_fixed = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-warmup")) warmup = 0;
        else if (!strcmp(argv[i], "--dtypes") && i + 1 < argc) {
            dt_f32 = strstr(argv[i + 1], "f32") != NULL;
            dt_bf16 = strstr(argv[i + 1], "bf16") != NULL;
            i++;
        } else if (argv[i][0] != '-' && nlibs < MAX_LIBS) libs[nlibs++].path = argv[i];
        else {
            fprintf(stderr, "usage: %s [--cpu-time] [--ns N,..] [--dims D,..] [--dtypes f32,bf16] [--causal 0,1] "
                            "[--heads H] [--threads T] [--reps R] [--nq NQ] [--no-warmup] lib1.so lib2.so ...\n", argv[0]);
            return 2;
        }
    }
    if (nlibs < 1 || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "cpu_bwd_ab: one to %d libraries and 1..%d reps\n", MAX_LIBS, MAX_REPS);
        return 2;
    }
    for (int li = 0; li < nlibs; li++)
        if (lib_open(&libs[li], nthreads, "cpu_bwd_ab")) return 1;
    printf("backward GFLOP/s, B 1, H %d, %d threads, median of %d runs in turns (%s)\n", heads, nthreads, reps,
           cpu_clock ? "CPU time per thread" : "wall clock");
    for (int li = 0; li < nlibs; li++) printf("  lib %d: %s\n", li, libs[li].path);
    if (nq_fixed > 0) printf("%d query rows against N keys\n", nq_fixed);
    printf("%-5s %4s %6s %6s |", "dtype", "D", "causal", "N");
    for (int li = 0; li < nlibs; li++) printf(" %8s%d", "GFLOP/s", li);
    for (int li = 1; li < nlibs; li++) printf(" %6s%d %9s%d", "ratio", li, "diffbits", li);
    printf("\n");
    const lib *a = &libs[0];
    for (int di = 0; di < 2; di++) {
        const flashc_dtype dt = di == 0 ? FLASHC_DTYPE_F32 : FLASHC_DTYPE_BF16;
        if ((di == 0 && !dt_f32) || (di == 1 && !dt_bf16)) continue;
        const size_t esz = dt == FLASHC_DTYPE_F32 ? 4 : 2;
        for (int d = 0; d < ndims; d++)
            for (int ci = 0; ci < ncausal; ci++)
                for (int ni = 0; ni < nns; ni++) {
                    const int64_t N = ns[ni], D = dims[d], H = heads, NQ = nq_fixed > 0 ? nq_fixed : N;
                    const int64_t nqe = NQ * H * D, nke = N * H * D; /* elements of q-like and k-like tensors */
                    const int64_t n = nqe > nke ? nqe : nke;
                    void *in[4], *out[4 * MAX_LIBS];
                    for (int t = 0; t < 4; t++) { /* q, k, v, dout */
                        in[t] = malloc((size_t)n * esz);
                        for (int64_t i = 0; i < n; i++) {
                            const float x = frand();
                            if (esz == 4) ((float *)in[t])[i] = x;
                            else ((uint16_t *)in[t])[i] = to_bf16(x);
                        }
                    }
                    for (int t = 0; t < 4 * nlibs; t++) out[t] = calloc((size_t)n, esz); /* o, dq, dk, dv per lib */
                    flashc_tensor q = a->tensor_contiguous(in[0], dt, 1, NQ, H, D);
                    flashc_tensor k = a->tensor_contiguous(in[1], dt, 1, N, H, D);
                    flashc_tensor v = a->tensor_contiguous(in[2], dt, 1, N, H, D);
                    flashc_tensor dout = a->tensor_contiguous(in[3], dt, 1, NQ, H, D);
                    flashc_tensor o = a->tensor_contiguous(out[0], dt, 1, NQ, H, D);
                    flashc_params prm = a->params_default();
                    prm.causal = causals[ci];
                    float *lse = malloc(sizeof(float) * (size_t)(H * NQ));
                    size_t wsb = 0, w;
                    a->fwd_ws(a->ctx, &q, &k, &v, &prm, &wsb);
                    for (int li = 0; li < nlibs; li++) {
                        libs[li].bwd_ws(libs[li].ctx, &q, &k, &v, &prm, &w);
                        if (w > wsb) wsb = w;
                    }
                    void *ws = malloc(wsb);
                    if (a->forward(a->ctx, &q, &k, &v, &prm, &o, lse, ws, wsb) != FLASHC_STATUS_OK) {
                        fprintf(stderr, "forward: %s\n", a->last_error(a->ctx));
                        return 1;
                    }
                    double t[MAX_LIBS][MAX_REPS];
                    for (int r = -warmup; r < reps; r++) /* a warm-up round, then reps rounds in turns */
                        for (int li = 0; li < nlibs; li++) {
                            const lib *l = &libs[li];
                            flashc_tensor dq = a->tensor_contiguous(out[4 * li + 1], dt, 1, NQ, H, D);
                            flashc_tensor dk = a->tensor_contiguous(out[4 * li + 2], dt, 1, N, H, D);
                            flashc_tensor dv = a->tensor_contiguous(out[4 * li + 3], dt, 1, N, H, D);
                            const double t0 = now();
                            if (l->backward(l->ctx, &q, &k, &v, &o, &dout, lse, &prm, &dq, &dk, &dv, ws, wsb) !=
                                FLASHC_STATUS_OK) {
                                fprintf(stderr, "%s backward: %s\n", l->path, l->last_error(l->ctx));
                                return 1;
                            }
                            if (r >= 0) t[li][r] = now() - t0;
                        }
                    const double flops = 2.5 * 4.0 * H * (double)NQ * N * D * (causals[ci] ? 0.5 : 1.0);
                    printf("%-5s %4d %6d %6d |", dt == FLASHC_DTYPE_F32 ? "f32" : "bf16", (int)D, causals[ci],
                           (int)N);
                    double rate[MAX_LIBS];
                    for (int li = 0; li < nlibs; li++) {
                        qsort(t[li], (size_t)reps, sizeof(double), cmp_double);
                        rate[li] = flops / t[li][reps / 2] * 1e-9;
                        printf(" %9.1f", rate[li]);
                    }
                    for (int li = 1; li < nlibs; li++) {
                        size_t diff = 0;
                        for (int g = 1; g < 4; g++)
                            for (int64_t i = 0; i < (g == 1 ? nqe : nke); i++)
                                diff += memcmp((char *)out[4 * li + g] + i * esz, (char *)out[g] + i * esz, esz) != 0;
                        printf(" %7.3f %10zu", rate[li] / rate[0], diff);
                    }
                    printf("\n");
                    fflush(stdout);
                    for (int i = 0; i < 4; i++) free(in[i]);
                    for (int i = 0; i < 4 * nlibs; i++) free(out[i]);
                    free(lse);
                    free(ws);
                }
    }
    for (int li = 0; li < nlibs; li++) libs[li].context_destroy(libs[li].ctx);
    return 0;
}
