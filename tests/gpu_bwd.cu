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

/* 16-bit cases with per-sequence lengths (varlen, seqused_k) or sinks, without a block mask, at the Hopper backward's
 * head dims (64, 128, 256), and how many ran on it. */
static int varlen_cases, varlen_sm90, varlen_tally; /* counted while varlen_tally is set (the main context's table) */

static void run_table(flashc_context_t ctx, int full, uint64_t seed, kernel_tally *kernels) {
    size_t n = 0;
    const flashc_case *table = flashc_case_table(full, &n);
    int ran = 0, passed = 0, skipped = 0;
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
        if (r.skipped) { /* paged K/V, which the CUDA backend refuses for now: said, not counted either way */
            printf("skip %-26s %s\n", c->name, r.message);
            ran--, skipped++;
            continue;
        }
        tally_add(kernels, r.kernel_bwd);
        if (varlen_tally && (c->varlen || c->seqused || c->sinks) && c->dtype != FLASHC_DTYPE_F32 && !c->block_q &&
            (c->D == 64 || c->D == 128 || c->D == 256)) {
            const int on90 = r.kernel_bwd && strncmp(r.kernel_bwd, "sm90", 4) == 0;
            varlen_cases++;
            varlen_sm90 += on90;
            if (!on90)
                printf("     %s: a varlen / seqused_k / sinks case the Hopper kernel should take ran on %s\n", c->name,
                       r.kernel_bwd);
        }
        printf("%s %-26s %-4s %10.3g %10.3g %10.3g %10.3g on %s%s%s\n", r.pass ? "ok  " : "FAIL", c->name,
               flashc_dtype_name(c->dtype), r.err_grad, r.tol_grad, r.err_out, r.tol_out,
               r.kernel_bwd ? r.kernel_bwd : "?", r.message[0] ? " -- " : "", r.message);
        fflush(stdout);
        if (r.pass) passed++;
        else failures++;
    }
    printf("backward table (%s): %d / %d passed, %d skipped (paged K/V)\n", full ? "full" : "quick", passed, ran,
           skipped);
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

/*
 * Varlen on the Hopper kernel: a sequence's last query and key tiles reach into the next sequence's rows (TMA
 * zero-fills only past the packed tensor). With every input of the next sequence NaN (q, k, v, out, dout, lse),
 * the first sequence's dK and dV must be bitwise what they are with finite values there, and its dQ (summed by
 * atomics, in any order) finite and within rounding of it. Sequences of 100 and 300 rows, H 2, bf16.
 */
static void varlen_nan_neighbour(flashc_context_t ctx, int hopper) {
    const int H = VL_H, L0 = VL_L0, L1 = VL_L1, T = VL_T;
    int32_t *dcu = varlen_pair_cu();
    for (int D = 64; D <= 256; D *= 2) {
        const int64_t n = (int64_t)T * H * D, first = (int64_t)L0 * H * D;
        void *buf[8];
        for (int i = 0; i < 8; i++) CHECK_CUDA(cudaMalloc(&buf[i], n * 2));
        float *lse;
        CHECK_CUDA(cudaMalloc(&lse, (size_t)H * T * sizeof(float)));
        for (int i = 0; i < 3; i++) fill(buf[i], FLASHC_DTYPE_BF16, n, 71 + 3 * D + i, i ? 1.f : 1.5f);
        fill(buf[4], FLASHC_DTYPE_BF16, n, 75 + 3 * D, 1.f); /* dout */
        flashc_tensor t[8];
        for (int i = 0; i < 8; i++) t[i] = flashc_tensor_contiguous(buf[i], FLASHC_DTYPE_BF16, 1, T, H, D);
        /* 0 q, 1 k, 2 v, 3 out, 4 dout, 5 dq, 6 dk, 7 dv */
        const flashc_params prm = varlen_pair_params(dcu);
        CHECK_FC(ctx, flashc_forward(ctx, &t[0], &t[1], &t[2], &prm, &t[3], lse, NULL, 0));
        const char *kn = flashc_kernel_name(ctx, FLASHC_OP_BACKWARD, &t[0], &t[1], &t[2], &prm);
        const int kernel_ok = !hopper || (kn && strncmp(kn, "sm90", 4) == 0);
        uint16_t *ref = (uint16_t *)malloc(3 * first * 2), *got = (uint16_t *)malloc(3 * first * 2);
        for (int run = 0; run < 2; run++) {
            if (run) { /* every input of the second sequence NaN (0xffff in bf16) */
                for (int i = 0; i < 5; i++) CHECK_CUDA(cudaMemset((uint16_t *)buf[i] + first, 0xff, (n - first) * 2));
                for (int h = 0; h < H; h++) CHECK_CUDA(cudaMemset(lse + h * T + L0, 0xff, L1 * sizeof(float)));
            }
            for (int i = 5; i < 8; i++) CHECK_CUDA(cudaMemset(buf[i], 0, n * 2));
            CHECK_FC(ctx, flashc_backward(ctx, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &prm, &t[5], &t[6], &t[7],
                                          NULL, 0));
            for (int i = 0; i < 3; i++)
                CHECK_CUDA(cudaMemcpy((run ? got : ref) + i * first, buf[5 + i], first * 2, cudaMemcpyDeviceToHost));
        }
        int finite = 1, kv_same = memcmp(ref + first, got + first, 2 * first * 2) == 0;
        double dq_err = 0, dq_max = 0;
        for (int64_t i = 0; i < first; i++) {
            const double a = flashc_bf16_to_f32(ref[i]), b = flashc_bf16_to_f32(got[i]);
            finite = finite && isfinite(b);
            dq_err = fmax(dq_err, fabs(a - b));
            dq_max = fmax(dq_max, fabs(a));
        }
        for (int64_t i = first; i < 3 * first; i++) finite = finite && isfinite(flashc_bf16_to_f32(got[i]));
        const int ok = kernel_ok && finite && kv_same && dq_err <= 1e-2 * dq_max;
        printf("%s varlen_nan_neighbour d%-3d on %s: dK, dV %s, dQ %s (max diff %.3g of %.3g)\n", ok ? "ok  " : "FAIL", D,
               kn ? kn : "?", kv_same ? "bitwise unchanged" : "CHANGED", finite ? "finite" : "NOT FINITE", dq_err,
               dq_max);
        if (!ok) failures++;
        free(ref), free(got);
        for (int i = 0; i < 8; i++) cudaFree(buf[i]);
        cudaFree(lse);
    }
    cudaFree(dcu);
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
    varlen_tally = 1;
    run_table(ctx, !quick, 5000, &kernels);
    varlen_tally = 0;
    tally_print("table", &kernels);
    /* On a Hopper GPU the table reaches the Hopper dK/dV kernel (with atomic and deterministic dQ; varlen too) and
     * the mma.sync kernels (block masks, f32); the CUDA-core baseline is run on its own below. */
    const int n_sm90 = tally_count(&kernels, "sm90 (wgmma, TMA, warp-specialized)"),
              n_det = tally_count(&kernels, "sm90 (wgmma, TMA, warp-specialized) dK/dV"),
              n_mma = tally_count(&kernels, "tensor cores (mma.sync)"), n_simt = tally_count(&kernels, "CUDA cores");
    /* (The reduced table of --quick, for the sanitizers, is too small to promise every path.) */
    const int cover = (quick || (n_mma > 0 && (!hopper || (n_sm90 > n_det && n_det > 0)))) && (!no90 || n_sm90 == 0);
    printf("%s table kernels: %d sm90 (%d deterministic), %d mma.sync, %d CUDA cores\n", cover ? "ok  " : "FAIL",
           n_sm90, n_det, n_mma, n_simt);
    if (!cover) failures++;
    if (hopper && !quick) {
        const int ok = varlen_cases > 0 && varlen_sm90 == varlen_cases;
        printf("%s varlen, seqused_k and sinks cases on sm90: %d of %d\n", ok ? "ok  " : "FAIL", varlen_sm90,
               varlen_cases);
        if (!ok) failures++;
    }
    if (!quick) varlen_nan_neighbour(ctx, hopper);
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
