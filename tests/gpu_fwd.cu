/*
 * gpu_fwd.cu - the CUDA forward against the fp64 oracle (ctest label gpu).
 *
 *   gpu_fwd            the full shared case table (forward only), then: split-KV decode shapes, bitwise-identical
 *                      output over 100 reruns, N = 64k on one head, and a problem of more than 2^31 elements
 *   gpu_fwd --quick    the reduced table only (for compute-sanitizer memcheck / racecheck)
 *   gpu_fwd --paged    the paged K/V checks alone (paged_vs_contiguous), for the sanitizers too
 *
 * Every check uses the CONVENTIONS.md rule: max|ours - ref64| <= 2 max|naive_lowp - ref64| + 1e-5 (f32 runs on
 * bf16 tensor-core operands, so the case runner holds it to the bf16 rule on CUDA). The long
 * shapes are checked on blocks of rows (first and last, where causal masks and the largest offsets are) against
 * the oracle run on exactly those rows. Exits non-zero on any failure.
 */
#include "flashc.h"
#include "ref/testkit.h"
#include "gpu_common.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

/* ---- the shared table ------------------------------------------------------------------------------- */

/* The cases of the table with each score modifier or mask on 16-bit inputs, all of which the Hopper kernel takes,
 * and how many of them ran on it. */
enum {
    FEAT_WINDOW, FEAT_SOFTCAP, FEAT_ALIBI, FEAT_VARLEN, FEAT_USED, FEAT_SINKS, FEAT_BLOCK, FEAT_POSITIONS, FEAT_N
};
static const char *const feat_name[FEAT_N] = {"window", "softcap", "alibi", "varlen", "seqused_k", "sinks",
                                              "block-mask", "positions"};
typedef struct feature_tally {
    int cases[FEAT_N], sm90[FEAT_N];
} feature_tally;

static void feature_add(feature_tally *ft, const flashc_case *c, const char *kernel) {
    /* (padded layouts pitch heads by d + 3 elements: rows that are not 16-byte aligned, which TMA cannot load) */
    if (!ft || c->dtype == FLASHC_DTYPE_F32 || c->layout == FLASHC_LAYOUT_PADDED) return;
    if (c->D != 64 && c->D != 96 && c->D != 128 && c->D != 192 && c->D != 256) return; /* the Hopper kernel's dims */
    /* block masks with few tiles: the keys split on mma.sync (the Hopper kernel's split-KV takes no block mask) */
    if (c->block_q > 0 && kernel && strstr(kernel, "sm80") && strstr(kernel, "split-KV")) return;
    if (c->page_size > 0) return; /* paged K/V: some page sizes on the Hopper kernel (paged_tests checks those) */
    const int has[FEAT_N] = {!c->causal && (c->window_left >= 0 || c->window_right >= 0), c->softcap > 0.f,
                             c->alibi != 0, c->varlen != 0, c->seqused != 0, c->sinks != 0, c->block_q > 0,
                             c->positions != 0};
    for (int f = 0; f < FEAT_N; f++)
        if (has[f]) {
            ft->cases[f]++;
            if (kernel && strncmp(kernel, "sm90", 4) == 0) ft->sm90[f]++;
        }
}

/* Whether a case keeps a right band (causal: right 0) after the front made the sides that hide no key unbounded: with
 * positions a right side below Nk - (q_position - k_position); bottom-right aligned, never for one query row (its
 * diagonal is the last key). Such a band keeps the CUDA forward off the GQA-rows path. */
static int right_band_cuts(const flashc_case *c) {
    const int64_t right = c->causal ? 0 : c->window_right;
    return c->positions && right >= 0 && right < c->Nk - (c->q_position - c->k_position);
}
/* Decode rows the CUDA forward runs with the GQA heads of a kv head as its query rows (cuda.cu's fwd_gqa_rows):
 * one query, grouped heads, and nothing that depends on a row's position or head. */
static int gqa_rows_expected(const flashc_case *c) {
    return c->Nq == 1 && c->H > c->Hkv && !c->varlen && c->window_left < 0 && !c->alibi && !c->sinks && !c->block_q &&
           !right_band_cuts(c);
}
static int gqa_rows_cases = 0;
/* Rows that run the decode tile (cuda.cu's fwd_dec) where the Hopper kernel does not take them (kernel: the one that
 * ran): at most 16 query rows, after GQA heads become rows, and at least 64 (sequence, head) pairs. */
static int dec_tile_expected(const flashc_case *c, const char *kernel) {
    const int g = gqa_rows_expected(c);
    return (g ? c->H / c->Hkv : c->Nq) <= 16 && c->B * (g ? c->Hkv : c->H) >= 64 &&
           !(kernel && !strncmp(kernel, "sm90", 4));
}
static int dec_tile_row(const flashc_case *c) { return dec_tile_expected(c, NULL); }
static int dec_tile_cases = 0;

/* Whether the kernel that ran (name kernel) carries the variant named what exactly when the case expects it; counts
 * the cases that ran it in *cases. */
static int variant_ok(const flashc_case *c, const char *kernel, const char *what, int expected, int *cases) {
    const int ran = kernel && strstr(kernel, what) != NULL;
    *cases += ran;
    if (ran == expected) return 1;
    printf("FAIL %-26s %s %s (kernel: %s)\n", c->name, ran ? "ran with" : "did not run with", what,
           kernel ? kernel : "?");
    return 0;
}

/* The case table (full or quick) on ctx; only: the rows to run (NULL: all). */
static void run_table(flashc_context_t ctx, int full, uint64_t seed, kernel_tally *kernels, feature_tally *ft,
                      int (*only)(const flashc_case *) = NULL) {
    size_t n = 0;
    const flashc_case *table = flashc_case_table(full, &n);
    int passed = 0, skipped = 0;
    size_t rows = 0;
    for (size_t i = 0; i < n; i++) {
        flashc_case c = table[i];
        if (only && !only(&c)) continue;
        rows++;
        c.backward = 0; /* the CUDA backend is forward-only for now */
        flashc_case_result r;
        memset(&r, 0, sizeof r);
        if (flashc_case_run(ctx, &c, seed + i, &r) != 0) {
            printf("FAIL %-26s could not be set up\n", c.name);
            failures++;
            continue;
        }
        if (r.skipped) { /* paged K/V, which the CUDA backend refuses for now: said, not counted either way */
            printf("skip %-26s %s\n", c.name, r.message);
            skipped++;
            continue;
        }
        int ok = r.pass;
        ok &= variant_ok(&c, r.kernel_fwd, "GQA heads as rows", gqa_rows_expected(&c), &gqa_rows_cases);
        ok &= variant_ok(&c, r.kernel_fwd, "16-row decode tile", dec_tile_expected(&c, r.kernel_fwd), &dec_tile_cases);
        if (kernels) tally_add(kernels, r.kernel_fwd);
        feature_add(ft, &c, r.kernel_fwd);
        printf("%s %-26s %-4s out %.3g (tol %.3g) lse %.3g (tol %.3g) on %s%s%s\n", ok ? "ok  " : "FAIL", c.name,
               flashc_dtype_name(c.dtype), r.err_out, r.tol_out, r.err_lse, r.tol_lse,
               r.kernel_fwd ? r.kernel_fwd : "?", r.message[0] ? " -- " : "", r.message);
        if (ok) passed++;
        else failures++;
    }
    printf("table (%s%s): %d / %zu passed, %d skipped (paged K/V)\n", full ? "full" : "quick", only ? ", some rows" : "",
           passed, rows - skipped,
           skipped);
}

/* ---- long shapes, checked on row blocks ------------------------------------------------------------------ */

/* bf16 pseudo-normal inputs written on the GPU (gpu_common.h). */
static void fill(uint16_t *x, int64_t n, uint64_t seed, float scale) {
    fill_normal<<<4096, 256>>>(x, FLASHC_DTYPE_BF16, n, seed, scale);
    CHECK_CUDA(cudaGetLastError());
}

typedef struct shape {
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
} shape;

/*
 * Copies rows [r0, r0 + nr) of (b, h) and the keys they see to the host, runs the oracle (fp64 and naive bf16)
 * on just those rows, and compares out and lse. Tensors are contiguous (B, N, H, D) bf16 on the device.
 */
static int check_rows(const char *what, const shape *s, const uint16_t *dq, const uint16_t *dk, const uint16_t *dv,
                      const uint16_t *dout, const float *dlse, int64_t b, int64_t h, int64_t r0, int64_t nr) {
    const int64_t hk = h / (s->H / s->Hkv), D = s->D;
    /* bottom-right causal: row r0 + r sees keys < r0 + r + 1 + Nk - Nq, so the sub-problem keeps its alignment */
    const int64_t kend = s->causal ? r0 + nr + s->Nk - s->Nq : s->Nk;
    const size_t e = 2, row = (size_t)D * e;
    uint16_t *q = (uint16_t *)malloc(nr * row), *k = (uint16_t *)malloc(kend * row), *v = (uint16_t *)malloc(kend * row);
    uint16_t *o = (uint16_t *)malloc(nr * row);
    float *lse = (float *)malloc(nr * sizeof(float));
    double *ref = (double *)malloc(nr * D * sizeof(double)), *low = (double *)malloc(nr * D * sizeof(double));
    double *rlse = (double *)malloc(nr * sizeof(double)), *llse = (double *)malloc(nr * sizeof(double));
    if (!q || !k || !v || !o || !lse || !ref || !low || !rlse || !llse) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    const size_t qpitch = (size_t)(s->H * D) * e, kpitch = (size_t)(s->Hkv * D) * e;
    CHECK_CUDA(cudaMemcpy2D(q, row, dq + ((b * s->Nq + r0) * s->H + h) * D, qpitch, row, nr, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy2D(o, row, dout + ((b * s->Nq + r0) * s->H + h) * D, qpitch, row, nr, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy2D(k, row, dk + (b * s->Nk * s->Hkv + hk) * D, kpitch, row, kend, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy2D(v, row, dv + (b * s->Nk * s->Hkv + hk) * D, kpitch, row, kend, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse, dlse + (b * s->H + h) * s->Nq + r0, nr * sizeof(float), cudaMemcpyDeviceToHost));

    flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_BF16, 1, nr, 1, D);
    flashc_tensor tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_BF16, 1, kend, 1, D);
    flashc_tensor tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_BF16, 1, kend, 1, D);
    flashc_tensor to = flashc_tensor_contiguous(o, FLASHC_DTYPE_BF16, 1, nr, 1, D);
    flashc_params prm = flashc_params_default();
    prm.causal = s->causal;
    flashc_problem p;
    CHECK_FC(NULL, flashc_problem_build(NULL, FLASHC_OP_FORWARD, &tq, &tk, &tv, &prm, &to, lse, NULL, NULL, NULL,
                                        NULL, &p));
    if (flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref, rlse) || flashc_ref_forward(&p, FLASHC_DTYPE_BF16, low, llse)) {
        fprintf(stderr, "oracle out of memory\n");
        exit(2);
    }
    double err = 0, lerr = 0, el = 0, lel = 0;
    int bad = 0;
    for (int64_t i = 0; i < nr * D; i++) {
        const double x = flashc_bf16_to_f32(o[i]);
        if (!isfinite(x)) bad++;
        err = fmax(err, fabs(x - ref[i]));
        lerr = fmax(lerr, fabs(low[i] - ref[i]));
    }
    for (int64_t i = 0; i < nr; i++) {
        if (isinf(rlse[i])) {
            if (!(isinf(lse[i]) && lse[i] > 0)) bad++;
            continue;
        }
        if (!isfinite(lse[i])) bad++;
        el = fmax(el, fabs(lse[i] - rlse[i]));
        lel = fmax(lel, fabs(llse[i] - rlse[i]));
    }
    const double tol = 2 * lerr + 1e-5, ltol = 2 * lel + 1e-5;
    const int ok = !bad && err <= tol && el <= ltol;
    printf("%s %-26s b %lld h %lld rows %lld..%lld: out %.3g (tol %.3g) lse %.3g (tol %.3g)%s\n", ok ? "ok  " : "FAIL",
           what, (long long)b, (long long)h, (long long)r0, (long long)(r0 + nr - 1), err, tol, el, ltol,
           bad ? " non-finite or wrong +inf" : "");
    if (!ok) failures++;
    free(q), free(k), free(v), free(o), free(lse), free(ref), free(low), free(rlse), free(llse);
    return ok;
}

typedef struct problem_buf {
    shape s;
    uint16_t *q, *k, *v, *o;
    float *lse;
    flashc_tensor tq, tk, tv, to;
    flashc_params prm;
} problem_buf;

static int make_problem(problem_buf *pb, shape s, uint64_t seed) {
    memset(pb, 0, sizeof *pb);
    pb->s = s;
    const int64_t nq = s.B * s.Nq * s.H * s.D, nk = s.B * s.Nk * s.Hkv * s.D;
    size_t freeb = 0, total = 0;
    CHECK_CUDA(cudaMemGetInfo(&freeb, &total));
    const double need = 2.0 * (2 * nq + 2 * nk) + 4.0 * s.B * s.H * s.Nq;
    if (need > 0.9 * (double)freeb) {
        printf("skip: needs %.1f GB, the GPU has %.1f GB free\n", need / 1e9, freeb / 1e9);
        return -1;
    }
    CHECK_CUDA(cudaMalloc(&pb->q, nq * 2));
    CHECK_CUDA(cudaMalloc(&pb->o, nq * 2));
    CHECK_CUDA(cudaMalloc(&pb->k, nk * 2));
    CHECK_CUDA(cudaMalloc(&pb->v, nk * 2));
    CHECK_CUDA(cudaMalloc(&pb->lse, s.B * s.H * s.Nq * sizeof(float)));
    fill(pb->q, nq, seed, 1.5f);
    fill(pb->k, nk, seed + 1, 1.f);
    fill(pb->v, nk, seed + 2, 1.f);
    CHECK_CUDA(cudaMemset(pb->o, 0xff, nq * 2));
    CHECK_CUDA(cudaMemset(pb->lse, 0xff, s.B * s.H * s.Nq * sizeof(float)));
    pb->tq = flashc_tensor_contiguous(pb->q, FLASHC_DTYPE_BF16, s.B, s.Nq, s.H, s.D);
    pb->tk = flashc_tensor_contiguous(pb->k, FLASHC_DTYPE_BF16, s.B, s.Nk, s.Hkv, s.D);
    pb->tv = flashc_tensor_contiguous(pb->v, FLASHC_DTYPE_BF16, s.B, s.Nk, s.Hkv, s.D);
    pb->to = flashc_tensor_contiguous(pb->o, FLASHC_DTYPE_BF16, s.B, s.Nq, s.H, s.D);
    pb->prm = flashc_params_default();
    pb->prm.causal = s.causal;
    return 0;
}

static void free_problem(problem_buf *pb) {
    cudaFree(pb->q), cudaFree(pb->k), cudaFree(pb->v), cudaFree(pb->o), cudaFree(pb->lse);
}

static void run_problem(flashc_context_t ctx, problem_buf *pb) {
    CHECK_FC(ctx, flashc_forward(ctx, &pb->tq, &pb->tk, &pb->tv, &pb->prm, &pb->to, pb->lse, NULL, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
}

/*
 * Varlen on the Hopper kernel: the last key tile of a sequence reaches into the next one's rows (TMA zero-fills
 * only past the packed tensor). With the next sequence's values all NaN, the first sequence's output and lse must
 * be finite and bitwise what they are with finite values there (its P is 0 on those keys, and 0 x NaN is NaN
 * unless the kernel clears them). Sequences of 100 and 300 rows (tiles of 128 keys), H 2, D 64 / 128 / 256.
 */
static void varlen_nan_neighbour(flashc_context_t ctx, const char *want) {
    const int H = VL_H, L0 = VL_L0, T = VL_T;
    int32_t *dcu = varlen_pair_cu();
    for (int D = 64; D <= 256; D *= 2) {
        const int64_t n = (int64_t)T * H * D, first = (int64_t)L0 * H * D;
        uint16_t *q, *k, *v, *o;
        float *lse;
        CHECK_CUDA(cudaMalloc(&q, n * 2));
        CHECK_CUDA(cudaMalloc(&k, n * 2));
        CHECK_CUDA(cudaMalloc(&v, n * 2));
        CHECK_CUDA(cudaMalloc(&o, n * 2));
        CHECK_CUDA(cudaMalloc(&lse, (size_t)H * T * sizeof(float)));
        fill(q, n, 51 + D, 1.5f);
        fill(k, n, 52 + D, 1.f);
        fill(v, n, 53 + D, 1.f);
        flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_BF16, 1, T, H, D);
        flashc_tensor tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_BF16, 1, T, H, D);
        flashc_tensor tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_BF16, 1, T, H, D);
        flashc_tensor to = flashc_tensor_contiguous(o, FLASHC_DTYPE_BF16, 1, T, H, D);
        const flashc_params prm = varlen_pair_params(dcu);
        const char *kn = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &tq, &tk, &tv, &prm);
        const int kernel_ok = kn && strncmp(kn, want, strlen(want)) == 0;
        uint16_t *ref = (uint16_t *)malloc(first * 2), *got = (uint16_t *)malloc(first * 2);
        float *lref = (float *)malloc(2 * sizeof(float) * H * T), *lgot = lref + H * T;
        CHECK_FC(ctx, flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0));
        CHECK_CUDA(cudaMemcpy(ref, o, first * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(lref, lse, sizeof(float) * H * T, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemset(v + first, 0xff, (n - first) * 2)); /* 0xffff: a NaN in bf16 */
        CHECK_CUDA(cudaMemset(o, 0, n * 2));
        CHECK_FC(ctx, flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0));
        CHECK_CUDA(cudaMemcpy(got, o, first * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(lgot, lse, sizeof(float) * H * T, cudaMemcpyDeviceToHost));
        int same = memcmp(ref, got, first * 2) == 0;
        for (int h = 0; h < H; h++) same = same && memcmp(lref + h * T, lgot + h * T, L0 * sizeof(float)) == 0;
        const int ok = same && kernel_ok;
        printf("%s varlen_nan_neighbour d%-3d on %s: first sequence %s\n", ok ? "ok  " : "FAIL", D, kn ? kn : "?",
               same ? "bitwise unchanged" : "CHANGED by the next sequence's NaN values");
        if (!ok) failures++;
        free(ref), free(got), free(lref);
        cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse);
    }
    cudaFree(dcu);
}

/*
 * Paged K/V against the same keys laid out contiguously. The pool holds each sequence's keys on pages of ps rows
 * in a shuffled order, with three spare pages and every row no key maps to NaN; sequence b uses its first
 * Nk - 7 b keys (seqused_k, both runs). The forward over the block table must run the kernel the contiguous forward
 * runs and give its out and lse bit for bit (same tiles, same arithmetic). Then the first page of sequence 1 is
 * named past the pool: that sequence's out and lse must come out all NaN (nothing read out of bounds: memcheck),
 * and every other sequence's must stay bitwise as it was.
 */
static void paged_vs_contiguous(flashc_context_t ctx, const char *what, shape s, int64_t ps, uint64_t seed) {
    problem_buf pb;
    if (make_problem(&pb, s, seed)) return;
    const int64_t B = s.B, maxp = (s.Nk + ps - 1) / ps, np = B * maxp + 3, row = s.Hkv * s.D;
    const int64_t nkv = B * s.Nk * row, npool = np * ps * row, nout = B * s.Nq * s.H * s.D, nlse = B * s.H * s.Nq;
    int32_t *bt = (int32_t *)malloc(B * maxp * sizeof(int32_t)), used[64];
    uint16_t *hk = (uint16_t *)malloc(nkv * 2), *hv = (uint16_t *)malloc(nkv * 2);
    uint16_t *pk = (uint16_t *)malloc(npool * 2), *pv = (uint16_t *)malloc(npool * 2);
    unsigned char *ref = (unsigned char *)malloc((nout * 2 + nlse * 4) * 2), *got = ref + nout * 2 + nlse * 4;
    if (!bt || !hk || !hv || !pk || !pv || !ref || B > 64) exit(2);
    for (int64_t i = 0; i < B * maxp; i++) bt[i] = (int32_t)i;
    uint64_t x = seed * 2654435761u + 1;
    for (int64_t i = B * maxp - 1; i > 0; i--) { /* Fisher-Yates with a 64-bit LCG */
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t j = (int64_t)((x >> 33) % (uint64_t)(i + 1));
        const int32_t t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    for (int64_t b = 0; b < B; b++) used[b] = (int32_t)(s.Nk - 7 * b);
    CHECK_CUDA(cudaMemcpy(hk, pb.k, nkv * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hv, pb.v, nkv * 2, cudaMemcpyDeviceToHost));
    memset(pk, 0xff, npool * 2), memset(pv, 0xff, npool * 2); /* 0xffff: NaN in bf16 */
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < s.Nk; n++) {
            const int64_t dst = ((int64_t)bt[b * maxp + n / ps] * ps + n % ps) * row, src = (b * s.Nk + n) * row;
            memcpy(pk + dst, hk + src, row * 2), memcpy(pv + dst, hv + src, row * 2);
        }
    uint16_t *dpk, *dpv;
    int32_t *dbt, *dused;
    CHECK_CUDA(cudaMalloc(&dpk, npool * 2));
    CHECK_CUDA(cudaMalloc(&dpv, npool * 2));
    CHECK_CUDA(cudaMalloc(&dbt, B * maxp * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&dused, B * sizeof(int32_t)));
    CHECK_CUDA(cudaMemcpy(dpk, pk, npool * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dpv, pv, npool * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dbt, bt, B * maxp * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dused, used, B * sizeof(int32_t), cudaMemcpyHostToDevice));
    pb.prm.seqused_k = dused;
    flashc_params pprm = pb.prm;
    pprm.block_table = dbt, pprm.block_table_max_pages = maxp, pprm.page_size = ps;
    const flashc_tensor tpk = flashc_tensor_contiguous(dpk, FLASHC_DTYPE_BF16, np, ps, s.Hkv, s.D);
    const flashc_tensor tpv = flashc_tensor_contiguous(dpv, FLASHC_DTYPE_BF16, np, ps, s.Hkv, s.D);
    const char *kc = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &pb.tq, &pb.tk, &pb.tv, &pb.prm);
    const char *kp = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &pb.tq, &tpk, &tpv, &pprm);
    /* the contiguous run, then the paged one, each from poisoned outputs */
    unsigned char *bufs[2] = {ref, got};
    for (int run = 0; run < 3; run++) {
        if (run == 2) { /* sequence 1's first page past the pool */
            const int32_t bad = (int32_t)np + 5;
            CHECK_CUDA(cudaMemcpy(dbt + maxp, &bad, sizeof bad, cudaMemcpyHostToDevice));
        }
        CHECK_CUDA(cudaMemset(pb.o, 0x7f, nout * 2));
        CHECK_CUDA(cudaMemset(pb.lse, 0x7f, nlse * 4));
        if (run == 0) CHECK_FC(ctx, flashc_forward(ctx, &pb.tq, &pb.tk, &pb.tv, &pb.prm, &pb.to, pb.lse, NULL, 0));
        else CHECK_FC(ctx, flashc_forward(ctx, &pb.tq, &tpk, &tpv, &pprm, &pb.to, pb.lse, NULL, 0));
        unsigned char *dst = bufs[run ? 1 : 0];
        CHECK_CUDA(cudaMemcpy(dst, pb.o, nout * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(dst + nout * 2, pb.lse, nlse * 4, cudaMemcpyDeviceToHost));
        if (run == 1) {
            const int same = memcmp(ref, got, nout * 2 + nlse * 4) == 0;
            const int kern = kc && kp && !strcmp(kc, kp);
            printf("%s %-26s page %lld, B %lld Nq %lld Nk %lld H %lld Hkv %lld D %lld: %s, on %s%s\n",
                   same && kern ? "ok  " : "FAIL", what, (long long)ps, (long long)B, (long long)s.Nq,
                   (long long)s.Nk, (long long)s.H, (long long)s.Hkv, (long long)s.D,
                   same ? "bitwise the contiguous result" : "DIFFERS from the contiguous result", kp ? kp : "?",
                   kern ? "" : " (contiguous ran another kernel)");
            if (!(same && kern)) failures++;
        }
    }
    /* the time of each (not a test: a hint of what the table costs; bench/decode.py measures it properly) */
    CHECK_CUDA(cudaMemcpy(dbt + maxp, bt + maxp, sizeof(int32_t), cudaMemcpyHostToDevice));
    float ms[2] = {0, 0};
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (int rep = 0; rep < 2; rep++)
        for (int paged = 0; paged < 2; paged++) {
            CHECK_CUDA(cudaEventRecord(e0));
            for (int i = 0; i < 10; i++)
                CHECK_FC(ctx, flashc_forward(ctx, &pb.tq, paged ? &tpk : &pb.tk, paged ? &tpv : &pb.tv,
                                             paged ? &pprm : &pb.prm, &pb.to, pb.lse, NULL, 0));
            CHECK_CUDA(cudaEventRecord(e1));
            CHECK_CUDA(cudaEventSynchronize(e1));
            CHECK_CUDA(cudaEventElapsedTime(&ms[paged], e0, e1));
        }
    printf("     %-26s contiguous %.1f us, paged %.1f us (%.2fx)\n", what, ms[0] * 100, ms[1] * 100, ms[1] / ms[0]);
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    /* run 2: sequence 1 all NaN, the others unchanged */
    const int64_t per_o = s.Nq * s.H * s.D;
    int nan_ok = 1, others_ok = 1;
    const uint16_t *o16 = (const uint16_t *)got, *r16 = (const uint16_t *)ref;
    const float *l32 = (const float *)(got + nout * 2), *r32 = (const float *)(ref + nout * 2);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < per_o; i++) {
            const uint16_t v = o16[b * per_o + i];
            if (b == 1) nan_ok &= (v & 0x7f80) == 0x7f80 && (v & 0x7f) != 0;
            else others_ok &= v == r16[b * per_o + i];
        }
        for (int64_t i = 0; i < s.H * s.Nq; i++) {
            const float l = l32[b * s.H * s.Nq + i];
            if (b == 1) nan_ok &= l != l;
            else others_ok &= memcmp(&l, &r32[b * s.H * s.Nq + i], 4) == 0;
        }
    }
    printf("%s %-26s a page past the pool: sequence 1 %s, the others %s\n", nan_ok && others_ok ? "ok  " : "FAIL",
           what, nan_ok ? "all NaN" : "NOT all NaN", others_ok ? "bitwise unchanged" : "CHANGED");
    if (!(nan_ok && others_ok)) failures++;
    free(bt), free(hk), free(hv), free(pk), free(pv), free(ref);
    cudaFree(dpk), cudaFree(dpv), cudaFree(dbt), cudaFree(dused);
    free_problem(&pb);
}

/* Checks that the problem runs on the kernel whose name starts with want (NULL: anything). */
static void expect_kernel(flashc_context_t ctx, const char *what, problem_buf *pb, const char *want) {
    const char *k = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &pb->tq, &pb->tk, &pb->tv, &pb->prm);
    const int ok = k && (!want || !strncmp(k, want, strlen(want)));
    printf("%s %-26s runs on %s%s%s\n", ok ? "ok  " : "FAIL", what, k ? k : flashc_context_last_error(ctx),
           ok || !want ? "" : ", wanted ", ok || !want ? "" : want);
    if (!ok) failures++;
}

/* Runs a shape once and checks its first and last row blocks of the first and last (b, h); want: the kernel it
 * must run on (a name prefix), NULL for any. */
static void long_shape(flashc_context_t ctx, const char *what, shape s, int64_t rows, uint64_t seed,
                       const char *want = NULL) {
    problem_buf pb;
    if (make_problem(&pb, s, seed)) return;
    expect_kernel(ctx, what, &pb, want);
    cudaEvent_t t0, t1;
    CHECK_CUDA(cudaEventCreate(&t0));
    CHECK_CUDA(cudaEventCreate(&t1));
    CHECK_CUDA(cudaEventRecord(t0));
    run_problem(ctx, &pb);
    CHECK_CUDA(cudaEventRecord(t1));
    CHECK_CUDA(cudaEventSynchronize(t1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
    printf("     %-26s B %lld Nq %lld Nk %lld H %lld Hkv %lld D %lld causal %d: %.1f ms (%.3g elements in q)\n", what,
           (long long)s.B, (long long)s.Nq, (long long)s.Nk, (long long)s.H, (long long)s.Hkv, (long long)s.D, s.causal,
           ms, (double)(s.B * s.Nq * s.H * s.D));
    if (rows > s.Nq) rows = s.Nq;
    check_rows(what, &s, pb.q, pb.k, pb.v, pb.o, pb.lse, 0, 0, 0, rows);
    check_rows(what, &s, pb.q, pb.k, pb.v, pb.o, pb.lse, s.B - 1, s.H - 1, s.Nq - rows, rows);
    CHECK_CUDA(cudaEventDestroy(t0));
    CHECK_CUDA(cudaEventDestroy(t1));
    free_problem(&pb);
}

/* 100 reruns must reproduce the first output bit for bit (outputs re-poisoned before each). */
static void determinism(flashc_context_t ctx, const char *what, shape s, int reruns, const char *want = NULL) {
    problem_buf pb;
    if (make_problem(&pb, s, 77)) return;
    expect_kernel(ctx, what, &pb, want);
    const size_t ob = (size_t)(s.B * s.Nq * s.H * s.D) * 2, lb = (size_t)(s.B * s.H * s.Nq) * 4;
    unsigned char *first = (unsigned char *)malloc(ob + lb), *again = (unsigned char *)malloc(ob + lb);
    if (!first || !again) exit(2);
    run_problem(ctx, &pb);
    CHECK_CUDA(cudaMemcpy(first, pb.o, ob, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(first + ob, pb.lse, lb, cudaMemcpyDeviceToHost));
    int differ = 0;
    for (int r = 0; r < reruns && !differ; r++) {
        CHECK_CUDA(cudaMemset(pb.o, 0xff, ob));
        CHECK_CUDA(cudaMemset(pb.lse, 0xff, lb));
        run_problem(ctx, &pb);
        CHECK_CUDA(cudaMemcpy(again, pb.o, ob, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(again + ob, pb.lse, lb, cudaMemcpyDeviceToHost));
        if (memcmp(first, again, ob + lb)) differ = r + 1;
    }
    printf("%s %-26s %d reruns%s\n", differ ? "FAIL" : "ok  ", what, reruns,
           differ ? ": output differs from the first run" : " bitwise identical");
    if (differ) failures++;
    else check_rows(what, &s, pb.q, pb.k, pb.v, pb.o, pb.lse, s.B - 1, s.H - 1, s.Nq - (s.Nq < 64 ? s.Nq : 64),
                    s.Nq < 64 ? s.Nq : 64);
    free(first), free(again);
    free_problem(&pb);
}

/* paged K/V (paged_vs_contiguous): on the mma.sync kernels (FLASHC_CUDA_FWD=sm80, so that the contiguous runs take
 * them too), decode with GQA heads as rows on the decode tile, the decode tile at page size 1, split keys at page
 * 256, prefill (pages of 48 and 24 rows: not a power of two, tiles straddle pages) and pages of 200 rows (larger than
 * the key tile, not a multiple of it) with split keys; then on the default context, which
 * on a Hopper GPU runs the Hopper kernel's page boxes (fwd_sm90.cu's fc90_tile_pages) for both: 8, 4 and 2 pages of
 * a 128-key tile, a tile inside a page of 256 with split keys, a page per key tile (128), and 5 pages of d 256's
 * 80-key tile, causal prefill among them: one load per page (kv_groups) at pages of 16 and 32 but for d 96, one
 * kv head among them; one per page and column chunk at the others. */
static void paged_tests(flashc_context_t ctx) {
    paged_vs_contiguous(ctx, "paged_pg16_decode_gqa", (shape){16, 1, 4096, 32, 8, 128, 0}, 16, 26);
    paged_vs_contiguous(ctx, "paged_pg256_split", (shape){2, 1, 20480, 8, 2, 128, 0}, 256, 27);
    paged_vs_contiguous(ctx, "paged_pg128_prefill_causal", (shape){3, 300, 1024, 4, 2, 128, 1}, 128, 28);
    paged_vs_contiguous(ctx, "paged_pg32_d96", (shape){2, 64, 992, 4, 4, 96, 0}, 32, 29);
    paged_vs_contiguous(ctx, "paged_pg16_d256_causal", (shape){2, 200, 480, 4, 2, 256, 1}, 16, 30);
    paged_vs_contiguous(ctx, "paged_pg32_hkv1", (shape){4, 1, 3000, 8, 1, 128, 0}, 32, 34);
    paged_vs_contiguous(ctx, "paged_pg64_decode", (shape){8, 1, 8192, 32, 8, 128, 0}, 64, 35);
    flashc_context_t c80 = gpu_context_with("FLASHC_CUDA_FWD", "sm80");
    paged_vs_contiguous(c80, "paged_decode_gqa_rows", (shape){16, 1, 4096, 32, 8, 128, 0}, 16, 21);
    paged_vs_contiguous(c80, "paged_decode_tile_pg1", (shape){16, 4, 700, 8, 8, 64, 1}, 1, 22);
    paged_vs_contiguous(c80, "paged_splitkv_pg256", (shape){2, 1, 20000, 8, 2, 128, 0}, 256, 23);
    paged_vs_contiguous(c80, "paged_prefill_pg48_causal", (shape){3, 300, 1000, 4, 2, 96, 1}, 48, 24);
    paged_vs_contiguous(c80, "paged_prefill_pg64_d256", (shape){2, 200, 500, 4, 4, 256, 0}, 64, 25);
    paged_vs_contiguous(c80, "paged_pg200_split", (shape){2, 1, 20000, 8, 2, 128, 0}, 200, 33);
    paged_vs_contiguous(c80, "paged_pg24_prefill_causal", (shape){3, 300, 1000, 4, 2, 128, 1}, 24, 32);
    flashc_context_destroy(c80);
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    flashc_context_t ctx = gpu_test_context();
    if (argc > 1 && strcmp(argv[1], "--paged") == 0) { /* the paged tests alone (for compute-sanitizer) */
        paged_tests(ctx);
        flashc_context_destroy(ctx);
        printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
        return failures ? 1 : 0;
    }
    const int hopper = gpu_is_hopper();
    const char *sm90 = hopper ? "sm90" : "sm80"; /* where the Hopper kernel must take a shape */

    kernel_tally kernels = {};
    feature_tally feats = {};
    run_table(ctx, !quick, 1000, &kernels, &feats);
    tally_print("table", &kernels);
    /* The table covers both generations on a Hopper GPU: 16-bit rows at its head dims on the Hopper kernel (every
     * mask and score modifier, split keys too), f32 and other head dims on mma.sync. */
    const int n_sm80 = tally_count(&kernels, "sm80"), n_sm90 = tally_count(&kernels, "sm90");
    /* (The reduced table of --quick, for the sanitizers, is too small to promise both.) */
    const int cover = n_sm80 + n_sm90 == tally_total(&kernels) && (quick || (n_sm80 > 0 && (!hopper || n_sm90 > 0)));
    printf("%s table kernels: %d sm80, %d sm90 of %d cases\n", cover ? "ok  " : "FAIL", n_sm80, n_sm90,
           tally_total(&kernels));
    if (!cover) failures++;
    /* The decode rows with grouped heads ran with them as query rows (each checked in run_table). */
    printf("%s decode cases with GQA heads as rows: %d\n", quick || gqa_rows_cases > 0 ? "ok  " : "FAIL", gqa_rows_cases);
    if (!quick && gqa_rows_cases == 0) failures++;
    if (hopper && !quick)
        for (int f = 0; f < FEAT_N; f++) {
            /* Every 16-bit case of a feature the Hopper kernel takes ran on it (the table's layouts are all
             * TMA-aligned for these cases), and there was at least one. */
            const int ok = feats.cases[f] > 0 && feats.sm90[f] == feats.cases[f];
            printf("%s %s cases on sm90: %d of %d\n", ok ? "ok  " : "FAIL", feat_name[f], feats.sm90[f],
                   feats.cases[f]);
            if (!ok) failures++;
        }
    if (!quick) {
        /* The mma.sync forward on its own (FLASHC_CUDA_FWD=sm80), which the Hopper kernel otherwise replaces. */
        flashc_context_t sm80 = gpu_context_with("FLASHC_CUDA_FWD", "sm80");
        kernel_tally k80 = {};
        run_table(sm80, 0, 3000, &k80, NULL);
        tally_print("FLASHC_CUDA_FWD=sm80", &k80);
        const int only80 = tally_count(&k80, "sm80") == tally_total(&k80) && tally_total(&k80) > 0;
        printf("%s FLASHC_CUDA_FWD=sm80 runs only sm80 kernels\n", only80 ? "ok  " : "FAIL");
        if (!only80) failures++;
        /* The decode tile's rows of the full table on the mma.sync kernels (on a Hopper GPU the Hopper kernel takes
         * them in the table above): each must run on it (run_table's check), and there must be some. */
        dec_tile_cases = 0;
        run_table(sm80, 1, 4000, NULL, NULL, dec_tile_row);
        printf("%s cases on the 16-row decode tile: %d\n", dec_tile_cases > 0 ? "ok  " : "FAIL", dec_tile_cases);
        if (dec_tile_cases == 0) failures++;
        flashc_context_destroy(sm80);

        /* decode: B * H * query tiles far below one wave, so the keys are split (flash-decoding), on the Hopper
         * kernel where the GPU has it */
        const char *split = hopper ? "sm90 (wgmma, TMA, warp-specialized) + split-KV" : "sm80 (mma.sync) + split-KV";
        long_shape(ctx, "splitkv_decode_gqa", (shape){2, 1, 8192, 8, 2, 128, 0}, 1, 11, split);
        long_shape(ctx, "splitkv_q16_causal", (shape){1, 16, 20000, 4, 4, 64, 1}, 16, 12, split);
        determinism(ctx, "determinism_causal", (shape){2, 1000, 1000, 4, 4, 128, 1}, 100); /* split-KV or not */
        determinism(ctx, "determinism_splitkv", (shape){1, 3, 9000, 8, 1, 64, 0}, 100, split);
        /* d 256 on Hopper: a key tile (80) that does not divide the lengths, many turns of the ring, and the
         * output stored unstaged from the accumulators, on the persistent grid (more tiles than SMs: no split-KV) */
        long_shape(ctx, "d256_long_causal_gqa", (shape){2, 1500, 1700, 8, 2, 256, 1}, 128, 15, sm90);
        determinism(ctx, "determinism_d256", (shape){2, 1000, 1000, 8, 8, 256, 0}, 100, sm90);
        /* Hopper: d 96 and 192 on the d 128 / d 256 kernels (TMA's zero fill past d); more tiles than SMs (and
         * enough blocks that the keys are not split), so the persistent grid takes d 64, 96, 128 and 192
         * (FLASHC_CUDA_LOG=1 names the grid), with tiles that see no key (Nq > Nk, causal: rows above the first
         * key's diagonal) among them */
        long_shape(ctx, "d96_causal_gqa", (shape){4, 1500, 1700, 16, 4, 96, 1}, 128, 16, sm90);
        long_shape(ctx, "d192_causal_gqa", (shape){2, 1500, 1700, 8, 2, 192, 1}, 128, 17, sm90);
        long_shape(ctx, "persistent_d64_causal", (shape){8, 2000, 2000, 8, 4, 64, 1}, 200, 18, sm90);
        long_shape(ctx, "persistent_nq_gt_nk_causal", (shape){4, 3000, 700, 8, 8, 128, 1}, 2400, 19, sm90);
        /* d 64, causal, Nq <= 1024: the two-consumer 128-row tile (fwd_sm90.h's FC90_NARROW_NQ), here also with
         * fewer keys than queries (rows above the first key's diagonal see none) and with long rows; so does any
         * Nq that 192-row tiles would pad by half (FC90_NARROW_PAD: Nq <= 128, 193-256); at Nq 1025 causal and Nq
         * 1000 without the causal mask the 192-row one */
        const char *narrow = hopper ? "sm90 (wgmma, TMA, warp-specialized), 128-row tile" : "sm80";
        long_shape(ctx, "narrow_d64_causal", (shape){16, 1000, 1000, 8, 8, 64, 1}, 1000, 20, narrow);
        long_shape(ctx, "narrow_d64_causal_nq_gt_nk", (shape){4, 1024, 700, 8, 2, 64, 1}, 1024, 21, narrow);
        long_shape(ctx, "narrow_d64_causal_long_rows", (shape){16, 256, 8192, 8, 8, 64, 1}, 256, 25, narrow);
        long_shape(ctx, "narrow_d64_nq200", (shape){64, 200, 3000, 8, 8, 64, 0}, 200, 26, narrow);
        long_shape(ctx, "narrow_d64_nq100_gqa", (shape){32, 100, 2000, 8, 2, 64, 0}, 100, 27, narrow);
        if (hopper) {
            const shape wide[2] = {{16, 1025, 1025, 8, 8, 64, 1}, {16, 1000, 1000, 8, 8, 64, 0}};
            const char *const wide_what[2] = {"causal_1025", "noncausal"};
            for (int i = 0; i < 2; i++) {
                problem_buf pb;
                if (make_problem(&pb, wide[i], 22 + i)) continue;
                const char *k = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &pb.tq, &pb.tk, &pb.tv, &pb.prm);
                const int ok = k && !strcmp(k, "sm90 (wgmma, TMA, warp-specialized)");
                printf("%s wide_d64_%-17s runs on %s\n", ok ? "ok  " : "FAIL", wide_what[i],
                       k ? k : flashc_context_last_error(ctx));
                if (!ok) failures++;
                free_problem(&pb);
            }
        }
        determinism(ctx, "determinism_persistent", (shape){4, 2048, 2048, 16, 4, 128, 1}, 100, sm90);
        determinism(ctx, "determinism_d192", (shape){2, 1000, 1000, 8, 8, 192, 0}, 100, sm90);
        varlen_nan_neighbour(ctx, sm90);
        paged_tests(ctx);
        long_shape(ctx, "n64k_one_head_causal", (shape){1, 65536, 65536, 1, 1, 128, 1}, 64, 13);
        /* 2 * 65600 * 128 * 128 = 2.15e9 elements per tensor: offsets past 2^31 elements (2^32 bytes) */
        long_shape(ctx, "over_2e31_elements", (shape){2, 65600, 65600, 128, 128, 128, 1}, 64, 14);
    }
    flashc_context_destroy(ctx);
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
