/*
 * decode_ab: CPU decode (B 1, Nq 1 against a KV cache, GQA) of two or more builds of libflashc in one process, timed
 * in turns, beside the machine's copy bandwidth timed in the same turns. Each library is dlopen'ed with RTLD_LOCAL,
 * so builds of the same symbols live side by side.
 *
 *   cc -O2 -std=c11 -fopenmp -Iinclude bench/decode_ab.c -o decode_ab -ldl -lm
 *   ./decode_ab [--shapes 32/8/128,8/2/32] [--nk 1024,8192,32768] [--dtypes f32,bf16] [--threads 1]
 *       [--runs 9] [--cold-mb 128] [--copy-mb 128] [--min-calls 8] [--hot] [--cpu-time]
 *       base/libflashc.so new/libflashc.so
 *
 * Each call is flashc_forward with seqused_k = Nk and causal (as flash_attn_with_kvcache calls it). Caches are cold:
 * every call reads the next of enough copies of K and V that together they span --cold-mb MiB (--hot: one copy,
 * reused, which shows the kernels' own rate with the cache in L2 / L3). A round times one pass over the copies per
 * library (at least --min-calls calls, cycling through the copies), then a copy of a --copy-mb buffer (read + write
 * bytes over time, memcpy of a chunk per OpenMP thread); the table gives the median and the min over rounds of the
 * per-call time, the K+V bandwidth, its share of the copy's (median over median), and the largest |difference| of
 * each library's output from the first's. OMP_WAIT_POLICY=active is advised (threads that sleep between calls wake
 * late on a shared VM). --cpu-time: process CPU time / threads instead of the wall clock, which leaves out the time
 * other jobs held the cores (with OMP_WAIT_POLICY=passive, so that waiting threads do not count; cache sharing with
 * those jobs still does).
 */
#define _POSIX_C_SOURCE 200809L
#include "flashc.h"
#include "benchkit.h"
#include "benchlib.h"

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* dst = src over n floats, memcpy of one contiguous chunk per thread on `threads` threads (libc's large copies use
 * streaming stores, which a plain loop's write-allocate would not): the machine's copy bandwidth. */
static void copy_floats(float *restrict dst, const float *restrict src, int64_t n, int threads) {
#ifdef _OPENMP
#  pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int t = 0; t < threads; t++) {
        const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
        memcpy(dst + lo, src + lo, sizeof(float) * (size_t)(hi - lo));
    }
}

#define MAX_LIBS 4
#define MAX_RUNS 31

int main(int argc, char **argv) {
    int nks[8] = {1024, 8192, 32768}, nnk = 3, runs = 9, cold_mb = 128, copy_mb = 128, hot = 0, nlibs = 0;
    int min_calls = 8;
    int dt_f32 = 1, dt_bf16 = 1, shapes[8][3] = {{32, 8, 128}, {8, 2, 32}}, nshapes = 2;
    lib libs[MAX_LIBS];
    memset(libs, 0, sizeof libs);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nk") && i + 1 < argc) nnk = parse_list(argv[++i], nks, 8);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) nthreads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cpu-time")) cpu_clock = 1;
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cold-mb") && i + 1 < argc) cold_mb = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--copy-mb") && i + 1 < argc) copy_mb = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--min-calls") && i + 1 < argc) min_calls = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hot")) hot = 1;
        else if (!strcmp(argv[i], "--shapes") && i + 1 < argc) {
            const char *s = argv[++i];
            nshapes = 0;
            while (*s && nshapes < 8) {
                if (sscanf(s, "%d/%d/%d", &shapes[nshapes][0], &shapes[nshapes][1], &shapes[nshapes][2]) != 3) break;
                nshapes++;
                const char *c = strchr(s, ',');
                if (!c) break;
                s = c + 1;
            }
        } else if (!strcmp(argv[i], "--dtypes") && i + 1 < argc) {
            dt_f32 = strstr(argv[i + 1], "f32") != NULL;
            dt_bf16 = strstr(argv[i + 1], "bf16") != NULL;
            i++;
        } else if (argv[i][0] != '-' && nlibs < MAX_LIBS) libs[nlibs++].path = argv[i];
        else {
            fprintf(stderr, "usage: %s [--shapes H/Hkv/D,..] [--nk N,..] [--dtypes f32,bf16] [--threads T] [--runs R] "
                            "[--cold-mb M] [--copy-mb M] [--min-calls C] [--hot] [--cpu-time] lib1.so [lib2.so ..]\n",
                    argv[0]);
            return 2;
        }
    }
    if (nlibs < 1 || runs < 1 || runs > MAX_RUNS || cold_mb < 1 || copy_mb < 1 || min_calls < 1) {
        fprintf(stderr, "decode_ab: one to %d libraries, 1..%d runs\n", MAX_LIBS, MAX_RUNS);
        return 2;
    }
    const int threads = nthreads;
    for (int li = 0; li < nlibs; li++)
        if (lib_open(&libs[li], threads, "decode_ab")) return 1;
    const int64_t copy_n = (int64_t)copy_mb << 18; /* floats */
    float *csrc = malloc(sizeof(float) * (size_t)copy_n), *cdst = malloc(sizeof(float) * (size_t)copy_n);
    for (int64_t i = 0; i < copy_n; i++) csrc[i] = (float)(i & 1023), cdst[i] = 0.0f;
    printf("decode B 1, Nq 1, seqused_k = Nk, causal; %d thread(s); %s caches; median / min of %d rounds in turns; "
           "%s\n",
           threads, hot ? "hot (one copy reused)" : "cold", runs, cpu_clock ? "CPU time / threads" : "wall clock");
    for (int li = 0; li < nlibs; li++) printf("  lib %d: %s\n", li, libs[li].path);
    printf("%-9s %-4s %6s |", "H/Hkv/D", "type", "Nk");
    for (int li = 0; li < nlibs; li++) printf(" %9s%d %8s%d %6s%d", "us_med", li, "us_min", li, "GB/s", li);
    printf(" | %9s %9s |", "copy_med", "copy_min");
    for (int li = 0; li < nlibs; li++) printf(" %5s%d", "%cpy", li);
    for (int li = 1; li < nlibs; li++) printf(" %6s%d %8s%d", "ratio", li, "maxdiff", li);
    printf("\n");
    fflush(stdout);
    const lib *a = &libs[0];
    for (int si = 0; si < nshapes; si++)
        for (int di = 0; di < 2; di++) {
            const flashc_dtype dt = di == 0 ? FLASHC_DTYPE_F32 : FLASHC_DTYPE_BF16;
            if ((di == 0 && !dt_f32) || (di == 1 && !dt_bf16)) continue;
            const size_t esz = dt == FLASHC_DTYPE_F32 ? 4 : 2;
            const int64_t H = shapes[si][0], Hkv = shapes[si][1], D = shapes[si][2];
            for (int ni = 0; ni < nnk; ni++) {
                const int64_t Nk = nks[ni], kv_elems = Nk * Hkv * D;
                const size_t kv_bytes = (size_t)kv_elems * esz * 2;
                int copies = hot ? 1 : (int)(((size_t)cold_mb << 20) / kv_bytes + 1);
                if (copies < 2 && !hot) copies = 2;
                const int calls = copies > min_calls ? copies : min_calls; /* per pass, cycling through the copies */
                void *q = malloc((size_t)(H * D) * esz);
                void **k = malloc(sizeof(void *) * (size_t)copies), **v = malloc(sizeof(void *) * (size_t)copies);
                for (int64_t i = 0; i < H * D; i++) {
                    const float x = 2.0f * frand();
                    if (esz == 4) ((float *)q)[i] = x;
                    else ((uint16_t *)q)[i] = to_bf16(x);
                }
                for (int c = 0; c < copies; c++) {
                    k[c] = malloc((size_t)kv_elems * esz);
                    v[c] = malloc((size_t)kv_elems * esz);
                    for (int64_t i = 0; i < kv_elems; i++) {
                        const float x = frand(), y = frand();
                        if (esz == 4) ((float *)k[c])[i] = x, ((float *)v[c])[i] = y;
                        else ((uint16_t *)k[c])[i] = to_bf16(x), ((uint16_t *)v[c])[i] = to_bf16(y);
                    }
                }
                void *out[MAX_LIBS];
                for (int li = 0; li < nlibs; li++) out[li] = calloc((size_t)(H * D), esz);
                const int32_t used = (int32_t)Nk;
                flashc_params prm = a->params_default();
                prm.causal = 1;
                prm.seqused_k = &used;
                flashc_tensor tq = a->tensor_contiguous(q, dt, 1, 1, H, D);
                size_t wsb = 0;
                for (int li = 0; li < nlibs; li++) {
                    flashc_tensor tk = a->tensor_contiguous(k[0], dt, 1, Nk, Hkv, D), tv = tk;
                    tv.data = v[0];
                    size_t w = 0;
                    libs[li].fwd_ws(libs[li].ctx, &tq, &tk, &tv, &prm, &w);
                    if (w > wsb) wsb = w;
                }
                void *ws = malloc(wsb + 64);
                double t[MAX_LIBS][MAX_RUNS], tc[MAX_RUNS];
                for (int r = -1; r < runs; r++) { /* one untimed round, then runs rounds in turns */
                    for (int li = 0; li < nlibs; li++) {
                        const lib *l = &libs[li];
                        flashc_tensor to = a->tensor_contiguous(out[li], dt, 1, 1, H, D);
                        const double t0 = now();
                        for (int i = 0; i < calls; i++) {
                            const int c = i % copies;
                            flashc_tensor tk = a->tensor_contiguous(k[c], dt, 1, Nk, Hkv, D);
                            flashc_tensor tv = a->tensor_contiguous(v[c], dt, 1, Nk, Hkv, D);
                            if (l->forward(l->ctx, &tq, &tk, &tv, &prm, &to, NULL, ws, wsb) != FLASHC_STATUS_OK) {
                                fprintf(stderr, "%s forward: %s\n", l->path, l->last_error(l->ctx));
                                return 1;
                            }
                        }
                        if (r >= 0) t[li][r] = (now() - t0) / calls;
                    }
                    const double t0 = now();
                    copy_floats(cdst, csrc, copy_n, threads);
                    if (r >= 0) tc[r] = now() - t0;
                }
                printf("%3d/%d/%-4d %-4s %6d |", (int)H, (int)Hkv, (int)D, di == 0 ? "f32" : "bf16", (int)Nk);
                double med[MAX_LIBS];
                for (int li = 0; li < nlibs; li++) {
                    qsort(t[li], (size_t)runs, sizeof(double), cmp_double);
                    med[li] = t[li][runs / 2];
                    printf(" %10.1f %9.1f %7.2f", med[li] * 1e6, t[li][0] * 1e6, kv_bytes / med[li] * 1e-9);
                }
                qsort(tc, (size_t)runs, sizeof(double), cmp_double);
                const double copy_med = 8.0 * copy_n / tc[runs / 2] * 1e-9, copy_max = 8.0 * copy_n / tc[0] * 1e-9;
                printf(" | %9.2f %9.2f |", copy_med, copy_max);
                for (int li = 0; li < nlibs; li++) printf(" %5.0f%%", 100.0 * kv_bytes / med[li] * 1e-9 / copy_med);
                for (int li = 1; li < nlibs; li++) {
                    double md = 0.0;
                    for (int64_t i = 0; i < H * D; i++) {
                        float x, y;
                        if (esz == 4) x = ((float *)out[li])[i], y = ((float *)out[0])[i];
                        else {
                            uint32_t ux = (uint32_t)((uint16_t *)out[li])[i] << 16,
                                     uy = (uint32_t)((uint16_t *)out[0])[i] << 16;
                            memcpy(&x, &ux, 4), memcpy(&y, &uy, 4);
                        }
                        const double d = fabs((double)x - (double)y);
                        if (!(d <= md)) md = d;
                    }
                    printf(" %7.3f %9.2e", med[0] / med[li], md);
                }
                printf("\n");
                fflush(stdout);
                for (int c = 0; c < copies; c++) free(k[c]), free(v[c]);
                free(k), free(v), free(q), free(ws);
                for (int li = 0; li < nlibs; li++) free(out[li]);
            }
        }
    free(csrc), free(cdst);
    return 0;
}
