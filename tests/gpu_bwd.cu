/*
 * gpu_bwd.cu - the CUDA backward against the fp64 oracle (ctest label gpu).
 *
 *   gpu_bwd            the rows of the full shared case table that have a backward (forward, then backward from
 *                      the library's own out and lse; gradients within 3x the naive low-precision error, f32
 *                      through the bf16 rule: forward and backward both take fp32 q, k, v as bf16 operands), then
 *                      the reduced table again on the CUDA-core baseline (FLASHC_CUDA_BWD=simt), then
 *                      deterministic mode: the same inputs through 50 backward runs must give bitwise-identical
 *                      dq, dk, dv (the table itself draws the deterministic flag per case, so both dQ modes of
 *                      the tensor-core path run it)
 *   gpu_bwd --quick    the reduced table only (for compute-sanitizer racecheck / memcheck)
 *
 * Outputs are poisoned (0xFF bytes, NaN in every dtype) before every call, so an element a kernel forgets
 * fails. Prints one line per case and exits non-zero on any failure; without a GPU it says so and exits 0.
 */
#include "flashc.h"
#include "ref/testkit.h"
#include "gpu_common.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

/* ---- the shared table ------------------------------------------------------------------------------- */

static void run_table(flashc_context_t ctx, int full, uint64_t seed, kernel_tally *kernels) {
    size_t n = 0;
    const flashc_case *table = flashc_case_table(full, &n);
    int ran = 0, passed = 0;
    printf("%-4s %-26s %-4s %10s %10s %10s %10s\n", "", "case", "type", "grad err", "grad tol", "out err", "out tol");
    for (size_t i = 0; i < n; i++) {
        const flashc_case *c = &table[i];
        if (!c->backward) continue; /* forward-only rows belong to gpu_fwd */
        ran++;
        flashc_case_result r;
        memset(&r, 0, sizeof r);
        if (flashc_case_run(ctx, c, seed + i, &r) != 0) {
            printf("FAIL %-26s could not be set up\n", c->name);
            failures++;
            continue;
        }
        tally_add(kernels, r.kernel_bwd);
        printf("%s %-26s %-4s %10.3g %10.3g %10.3g %10.3g on %s%s%s\n", r.pass ? "ok  " : "FAIL", c->name,
               flashc_dtype_name(c->dtype), r.err_grad, r.tol_grad, r.err_out, r.tol_out,
               r.kernel_bwd ? r.kernel_bwd : "?", r.message[0] ? " -- " : "", r.message);
        fflush(stdout);
        if (r.pass) passed++;
        else failures++;
    }
    printf("backward table (%s): %d / %d passed\n", full ? "full" : "quick", passed, ran);
}

/* ---- deterministic mode ---------------------------------------------------------------------------------- */

static void fill(void *x, flashc_dtype dt, int64_t n, uint64_t seed, float scale) {
    fill_normal<<<1024, 256>>>(x, dt, n, seed, scale);
    CHECK_CUDA(cudaGetLastError());
}

typedef struct det_case {
    const char *name;
    flashc_dtype dtype;
    int64_t B, N, H, Hkv, D;
    int causal;
    int64_t window_left;
    float softcap;
} det_case;

/* Non-finite values in a downloaded gradient (the poison left by an unwritten element, or a NaN). */
static int64_t count_nonfinite(const void *x, flashc_dtype dt, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float v;
        if (dt == FLASHC_DTYPE_F32) v = ((const float *)x)[i];
        else if (dt == FLASHC_DTYPE_F16) v = flashc_f16_to_f32(((const uint16_t *)x)[i]);
        else v = flashc_bf16_to_f32(((const uint16_t *)x)[i]);
        bad += !isfinite(v);
    }
    return bad;
}

/* The same inputs through `reruns` backward runs with params.deterministic = 1: dq, dk, dv must repeat the first
 * run bit for bit. Runs alternate between the caller's workspace and the library's own. */
static void determinism(flashc_context_t ctx, const det_case *d, int reruns, uint64_t seed) {
    const flashc_dtype dt = d->dtype;
    const size_t esz = dt == FLASHC_DTYPE_F32 ? 4 : 2;
    const int64_t nq = d->B * d->N * d->H * d->D, nk = d->B * d->N * d->Hkv * d->D;
    void *q, *k, *v, *o, *dout, *g[3];
    float *lse;
    CHECK_CUDA(cudaMalloc(&q, nq * esz));
    CHECK_CUDA(cudaMalloc(&o, nq * esz));
    CHECK_CUDA(cudaMalloc(&dout, nq * esz));
    CHECK_CUDA(cudaMalloc(&k, nk * esz));
    CHECK_CUDA(cudaMalloc(&v, nk * esz));
    CHECK_CUDA(cudaMalloc(&g[0], nq * esz));
    CHECK_CUDA(cudaMalloc(&g[1], nk * esz));
    CHECK_CUDA(cudaMalloc(&g[2], nk * esz));
    CHECK_CUDA(cudaMalloc(&lse, d->B * d->H * d->N * sizeof(float)));
    fill(q, dt, nq, seed, 2.f);
    fill(k, dt, nk, seed + 1, 1.f);
    fill(v, dt, nk, seed + 2, 1.f);
    fill(dout, dt, nq, seed + 3, 1.f);
    const flashc_tensor tq = flashc_tensor_contiguous(q, dt, d->B, d->N, d->H, d->D);
    const flashc_tensor tk = flashc_tensor_contiguous(k, dt, d->B, d->N, d->Hkv, d->D);
    const flashc_tensor tv = flashc_tensor_contiguous(v, dt, d->B, d->N, d->Hkv, d->D);
    const flashc_tensor to = flashc_tensor_contiguous(o, dt, d->B, d->N, d->H, d->D);
    const flashc_tensor tdo = flashc_tensor_contiguous(dout, dt, d->B, d->N, d->H, d->D);
    const flashc_tensor tdq = flashc_tensor_contiguous(g[0], dt, d->B, d->N, d->H, d->D);
    const flashc_tensor tdk = flashc_tensor_contiguous(g[1], dt, d->B, d->N, d->Hkv, d->D);
    const flashc_tensor tdv = flashc_tensor_contiguous(g[2], dt, d->B, d->N, d->Hkv, d->D);
    flashc_params prm = flashc_params_default();
    prm.causal = d->causal;
    prm.window_left = d->window_left;
    prm.softcap = d->softcap;
    prm.deterministic = 1;
    CHECK_FC(ctx, flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0));
    size_t ws_bytes = 0;
    CHECK_FC(ctx, flashc_backward_workspace_size(ctx, &tq, &tk, &tv, &prm, &ws_bytes));
    void *ws = NULL;
    if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));

    const size_t bytes[3] = {(size_t)nq * esz, (size_t)nk * esz, (size_t)nk * esz};
    const size_t total = bytes[0] + bytes[1] + bytes[2];
    unsigned char *first = (unsigned char *)malloc(total), *again = (unsigned char *)malloc(total);
    if (!first || !again) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    int differ = 0;
    int64_t bad = 0;
    for (int r = 0; r <= reruns && !differ; r++) {
        for (int i = 0; i < 3; i++) CHECK_CUDA(cudaMemset(g[i], 0xff, bytes[i]));
        const int own = r % 2;
        CHECK_FC(ctx, flashc_backward(ctx, &tq, &tk, &tv, &to, &tdo, lse, &prm, &tdq, &tdk, &tdv, own ? ws : NULL,
                                      own ? ws_bytes : 0));
        unsigned char *dst = r == 0 ? first : again;
        for (size_t i = 0, at = 0; i < 3; at += bytes[i], i++)
            CHECK_CUDA(cudaMemcpy(dst + at, g[i], bytes[i], cudaMemcpyDeviceToHost));
        if (r == 0) {
            bad = count_nonfinite(first, dt, nq) + count_nonfinite(first + bytes[0], dt, nk) +
                  count_nonfinite(first + bytes[0] + bytes[1], dt, nk);
            if (bad) break;
        } else if (memcmp(first, again, total) != 0) {
            differ = r;
        }
    }
    const int ok = !bad && !differ;
    printf("%s %-30s %s B %lld N %lld H %lld Hkv %lld D %lld: %d runs %s\n", ok ? "ok  " : "FAIL", d->name,
           flashc_dtype_name(dt), (long long)d->B, (long long)d->N, (long long)d->H, (long long)d->Hkv,
           (long long)d->D, reruns + 1,
           bad ? "non-finite or unwritten gradients" : differ ? "differ from the first run" : "bitwise identical");
    if (!ok) failures++;
    free(first), free(again);
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(dout), cudaFree(lse), cudaFree(ws);
    for (int i = 0; i < 3; i++) cudaFree(g[i]);
}

int main(int argc, char **argv) {
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("no GPU: gpu_bwd skipped\n");
        return 0;
    }
    flashc_context_t ctx = gpu_test_context();
    /* gpu_bwd_sm80 runs this program with FLASHC_CUDA_BWD=sm80: then no Hopper kernel may run. */
    const char *forced = getenv("FLASHC_CUDA_BWD");
    const int hopper = gpu_is_hopper() && !forced, no90 = forced && !strcmp(forced, "sm80");

    kernel_tally kernels = {};
    run_table(ctx, !quick, 5000, &kernels);
    tally_print("table", &kernels);
    /* On a Hopper GPU the table reaches the Hopper dK/dV kernel (with atomic and deterministic dQ) and the mma.sync
     * kernels (varlen, block masks); the CUDA-core baseline is run on its own below. */
    const int n_sm90 = tally_count(&kernels, "sm90 (wgmma, TMA, warp-specialized)"),
              n_det = tally_count(&kernels, "sm90 (wgmma, TMA, warp-specialized) dK/dV"),
              n_mma = tally_count(&kernels, "tensor cores (mma.sync)"), n_simt = tally_count(&kernels, "CUDA cores");
    /* (The reduced table of --quick, for the sanitizers, is too small to promise every path.) */
    const int cover = (quick || (n_mma > 0 && (!hopper || (n_sm90 > n_det && n_det > 0)))) && (!no90 || n_sm90 == 0);
    printf("%s table kernels: %d sm90 (%d deterministic), %d mma.sync, %d CUDA cores\n", cover ? "ok  " : "FAIL",
           n_sm90, n_det, n_mma, n_simt);
    if (!cover) failures++;
    if (!quick) {
        /* The CUDA-core baseline still runs what the tensor-core kernels do not take (strided head dims); keep it
         * checked on the reduced table, in a context that sends it everything (FLASHC_CUDA_BWD=simt). */
        flashc_context_t simt = gpu_context_with("FLASHC_CUDA_BWD", "simt");
        kernel_tally ks = {};
        run_table(simt, 0, 7000, &ks);
        tally_print("FLASHC_CUDA_BWD=simt", &ks);
        const int only = tally_count(&ks, "CUDA cores") == tally_total(&ks) && tally_total(&ks) > 0;
        printf("%s FLASHC_CUDA_BWD=simt runs only the CUDA-core backward\n", only ? "ok  " : "FAIL");
        if (!only) failures++;
        flashc_context_destroy(simt);
    }
    if (!quick) {
        /* GQA sums over the group and long causal rows; a window with softcap; fp32 at the widest head dim. */
        static const det_case dets[] = {
            {"det_bf16_causal_gqa_d128", FLASHC_DTYPE_BF16, 2, 1000, 8, 2, 128, 1, -1, 0.f},
            {"det_f16_window_softcap_mqa", FLASHC_DTYPE_F16, 1, 2048, 4, 1, 64, 0, 256, 20.f},
            {"det_f32_d256", FLASHC_DTYPE_F32, 1, 700, 2, 2, 256, 0, -1, 0.f},
        };
        for (size_t i = 0; i < sizeof dets / sizeof dets[0]; i++) determinism(ctx, &dets[i], 49, 900 + 10 * i);
    }
    flashc_context_destroy(ctx);
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
