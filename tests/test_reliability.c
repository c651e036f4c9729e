/*
 * test_reliability: hostile inputs found by fuzzing the API, each of which once crashed, wrote out of bounds or
 * returned OK with a wrong result. Every check names the defect it guards:
 *   - size arithmetic: the backward workspace size wrapping size_t, block-mask block sizes near INT64_MAX,
 *     window sides near INT64_MAX (which mean "unbounded");
 *   - varlen max_seqlen far above the packed totals;
 *   - thread counts OpenMP cannot start;
 *   - NaN and overflow semantics, the same on every CPU kernel set (the test runs itself once per set this CPU
 *     has, with FLASHC_CPU_KERNELS, and checks which kernels ran);
 *   - non-finite ALiBi slopes;
 *   - outputs overlapping themselves, the small input arrays (cu_seqlens, slopes, block mask) or the workspace;
 *   - inputs read through negative strides (the microkernels' address arithmetic).
 */
#define _POSIX_C_SOURCE 200809L
#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures = 0, checks = 0;

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        checks++;                                                                                            \
        if (!(cond)) {                                                                                       \
            failures++;                                                                                      \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);                         \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fputc('\n', stderr);                                                                             \
        }                                                                                                    \
    } while (0)

static uint64_t rng_state;
static float randn(void) { /* sum of uniforms: roughly normal, enough for inputs */
    float s = 0;
    for (int i = 0; i < 4; i++) {
        rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
        s += (float)(rng_state >> 40) / (float)(1 << 24) - 0.5f;
    }
    return s * 1.7f;
}

/* A contiguous fp32 (B, N, H, D) problem with its own buffers. */
typedef struct prob {
    int64_t B, Nq, Nk, H, Hkv, D;
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    flashc_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv;
} prob;

static void prob_init(prob *p, int64_t B, int64_t Nq, int64_t Nk, int64_t H, int64_t Hkv, int64_t D) {
    memset(p, 0, sizeof *p);
    p->B = B, p->Nq = Nq, p->Nk = Nk, p->H = H, p->Hkv = Hkv, p->D = D;
    const size_t nq = (size_t)(B * Nq * H * D), nk = (size_t)(B * Nk * Hkv * D);
    p->q = malloc(nq * 4), p->out = malloc(nq * 4), p->dout = malloc(nq * 4), p->dq = malloc(nq * 4);
    p->k = malloc(nk * 4), p->v = malloc(nk * 4), p->dk = malloc(nk * 4), p->dv = malloc(nk * 4);
    p->lse = malloc((size_t)(B * H * Nq) * 4);
    for (size_t i = 0; i < nq; i++) p->q[i] = randn(), p->dout[i] = randn();
    for (size_t i = 0; i < nk; i++) p->k[i] = randn(), p->v[i] = randn();
    p->tq = flashc_tensor_contiguous(p->q, FLASHC_DTYPE_F32, B, Nq, H, D);
    p->to = flashc_tensor_contiguous(p->out, FLASHC_DTYPE_F32, B, Nq, H, D);
    p->tdo = flashc_tensor_contiguous(p->dout, FLASHC_DTYPE_F32, B, Nq, H, D);
    p->tdq = flashc_tensor_contiguous(p->dq, FLASHC_DTYPE_F32, B, Nq, H, D);
    p->tk = flashc_tensor_contiguous(p->k, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    p->tv = flashc_tensor_contiguous(p->v, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    p->tdk = flashc_tensor_contiguous(p->dk, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    p->tdv = flashc_tensor_contiguous(p->dv, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
}

static void prob_free(prob *p) {
    free(p->q), free(p->k), free(p->v), free(p->out), free(p->lse), free(p->dout), free(p->dq), free(p->dk);
    free(p->dv);
}

static flashc_status fwd(flashc_context_t ctx, prob *p, const flashc_params *prm) {
    return flashc_forward(ctx, &p->tq, &p->tk, &p->tv, prm, &p->to, p->lse, NULL, 0);
}

static flashc_status bwd(flashc_context_t ctx, prob *p, const flashc_params *prm) {
    return flashc_backward(ctx, &p->tq, &p->tk, &p->tv, &p->to, &p->tdo, p->lse, prm, &p->tdq, &p->tdk, &p->tdv,
                           NULL, 0);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* A refused call: the status, and a "file:line: message" that contains want. */
static void expect_refused(const char *what, flashc_status st, flashc_status want_st, flashc_context_t ctx,
                           const char *want) {
    const char *msg = flashc_context_last_error(ctx);
    CHECK(st == want_st, "%s: status %s, wanted %s (%s)", what, flashc_status_string(st),
          flashc_status_string(want_st), msg);
    CHECK(msg && strstr(msg, ".c:") && strstr(msg, want), "%s: message \"%s\" should mention \"%s\"", what,
          msg ? msg : "(null)", want);
}

/* ---- size arithmetic ------------------------------------------------------------------------------------- */

static void test_workspace_overflow(flashc_context_t ctx) {
    /* GQA with 2^20 query heads over 2^30 keys: the single-pass backward's per-head dK, dV buffers,
     * 2 * B * H * Nk * D * 4 bytes = 2^64, wrapped size_t to a few bytes and the query said OK. */
    flashc_params prm = flashc_params_default();
    flashc_tensor q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, 8, 1, (int64_t)1 << 20, 256);
    flashc_tensor k = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, 8, (int64_t)1 << 30, 1, 256);
    size_t bytes = 1;
    flashc_status st = flashc_backward_workspace_size(ctx, &q, &k, &k, &prm, &bytes);
    expect_refused("backward workspace 2^64 bytes", st, FLASHC_STATUS_NOT_SUPPORTED, ctx, "workspace");
    CHECK(bytes == 0, "a refused size query reports 0 bytes, not %zu", bytes);
    /* B * H * N beyond int64: refused before any size is formed. */
    q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, (int64_t)1 << 20, (int64_t)1 << 20, (int64_t)1 << 20, 1);
    k = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, (int64_t)1 << 20, 1, 1, 1);
    st = flashc_forward_workspace_size(ctx, &q, &k, &k, &prm, &bytes);
    expect_refused("B * H * N * 256 beyond int64", st, FLASHC_STATUS_NOT_SUPPORTED, ctx, "does not fit");
    /* flashc_tensor_contiguous with strides beyond int64 (signed overflow, UBSan) makes a view calls refuse. */
    q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, 40, (int64_t)1 << 40, (int64_t)1 << 40, 1024);
    CHECK(q.stride[0] == INT64_MIN && q.stride[1] == (int64_t)1 << 50, "overflowing contiguous strides (%lld, %lld)",
          (long long)q.stride[0], (long long)q.stride[1]);
    expect_refused("overflowing contiguous view", flashc_supported(ctx, FLASHC_OP_FORWARD, &q, &q, &q, &prm),
                   FLASHC_STATUS_INVALID_ARGUMENT, ctx, "out of range");
    /* Rows beyond 2^31 - 1024: tile counts rounded up would leave int32. */
    q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_F32, 1, INT32_MAX - 5, 1, 1);
    st = flashc_forward_workspace_size(ctx, &q, &q, &q, &prm, &bytes);
    expect_refused("2^31 - 6 rows", st, FLASHC_STATUS_NOT_SUPPORTED, ctx, "2^31 - 1024");
}

static void test_huge_block_and_window(flashc_context_t ctx) {
    prob p;
    prob_init(&p, 2, 37, 45, 2, 1, 32);
    const size_t no = (size_t)(p.B * p.Nq * p.H * p.D), nl = (size_t)(p.B * p.H * p.Nq);
    float *ref_o = malloc(no * 4), *ref_l = malloc(nl * 4);
    uint8_t mask[2 * 3] = {1, 0, 1, 1, 1, 0}; /* (batch 2, heads 1, 1 query block, 3 key blocks of 16) */

    /* A block-mask block size near INT64_MAX: one block row. ceil(N / block) overflowed to a negative count and
     * the mask was read before its start. Same answer as a block the length of the sequence. */
    flashc_params prm = flashc_params_default();
    prm.block_mask = mask, prm.block_mask_q = p.Nq, prm.block_mask_k = 16, prm.block_mask_batch = 2;
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "block mask, block_q = Nq: %s", flashc_context_last_error(ctx));
    memcpy(ref_o, p.out, no * 4), memcpy(ref_l, p.lse, nl * 4);
    prm.block_mask_q = INT64_MAX;
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "block_q INT64_MAX: %s", flashc_context_last_error(ctx));
    CHECK(same_bits(ref_o, p.out, no) && same_bits(ref_l, p.lse, nl), "block_q INT64_MAX differs from block_q Nq");
    prm.block_mask_q = INT64_MAX - 1, prm.block_mask_k = INT64_MAX;
    uint8_t one = 1;
    prm.block_mask = &one, prm.block_mask_batch = 1;
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "block (INT64_MAX - 1, INT64_MAX): %s",
          flashc_context_last_error(ctx));

    /* Window sides near INT64_MAX mean unbounded: i + Nk - Nq + right overflowed and every row came back
     * empty (out 0, lse +inf, status OK). */
    flashc_params plain = flashc_params_default();
    CHECK(fwd(ctx, &p, &plain) == FLASHC_STATUS_OK, "plain: %s", flashc_context_last_error(ctx));
    memcpy(ref_o, p.out, no * 4), memcpy(ref_l, p.lse, nl * 4);
    static const int64_t sides[][2] = {{-1, INT64_MAX}, {INT64_MAX, -1}, {INT64_MAX, INT64_MAX},
                                       {INT64_MAX - 1, INT64_MAX - 45}};
    for (int i = 0; i < 4; i++) {
        flashc_params w = flashc_params_default();
        w.window_left = sides[i][0], w.window_right = sides[i][1];
        CHECK(fwd(ctx, &p, &w) == FLASHC_STATUS_OK, "window (%lld, %lld): %s", (long long)sides[i][0],
              (long long)sides[i][1], flashc_context_last_error(ctx));
        CHECK(same_bits(ref_o, p.out, no) && same_bits(ref_l, p.lse, nl),
              "window (%lld, %lld) differs from no window", (long long)sides[i][0], (long long)sides[i][1]);
        CHECK(bwd(ctx, &p, &w) == FLASHC_STATUS_OK, "backward, window (%lld, %lld): %s", (long long)sides[i][0],
              (long long)sides[i][1], flashc_context_last_error(ctx));
    }
    flashc_params causal = flashc_params_default(), wide = flashc_params_default();
    causal.causal = 1;
    wide.window_left = INT64_MAX, wide.window_right = 0;
    CHECK(fwd(ctx, &p, &causal) == FLASHC_STATUS_OK, "causal: %s", flashc_context_last_error(ctx));
    memcpy(ref_o, p.out, no * 4), memcpy(ref_l, p.lse, nl * 4);
    CHECK(fwd(ctx, &p, &wide) == FLASHC_STATUS_OK, "window (INT64_MAX, 0): %s", flashc_context_last_error(ctx));
    CHECK(same_bits(ref_o, p.out, no) && same_bits(ref_l, p.lse, nl), "window (INT64_MAX, 0) differs from causal");
    free(ref_o), free(ref_l);
    prob_free(&p);
}

static void test_varlen_bounds(flashc_context_t ctx) {
    prob p;
    prob_init(&p, 1, 20, 24, 2, 2, 16);
    int32_t cu_q[3] = {0, 8, 20}, cu_k[3] = {0, 10, 24};
    flashc_params prm = flashc_params_default();
    prm.cu_seqlens_q = cu_q, prm.cu_seqlens_k = cu_k, prm.num_seqs = 2;
    prm.max_seqlen_q = 12, prm.max_seqlen_k = 14;
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "varlen: %s", flashc_context_last_error(ctx));
    /* 1e12 ran for minutes (a task per 64 rows that do not exist); INT64_MAX wrapped and returned OK without
     * writing the output. */
    const int64_t bad[] = {21, 1000000000000LL, INT64_MAX};
    for (int i = 0; i < 3; i++) {
        prm.max_seqlen_q = bad[i];
        prm.max_seqlen_k = 14;
        expect_refused("max_seqlen_q above total", fwd(ctx, &p, &prm), FLASHC_STATUS_INVALID_ARGUMENT, ctx,
                       "exceeds the packed totals");
        prm.max_seqlen_q = 12;
        prm.max_seqlen_k = bad[i] + (i == 0 ? 4 : 0);
        expect_refused("max_seqlen_k above total", fwd(ctx, &p, &prm), FLASHC_STATUS_INVALID_ARGUMENT, ctx,
                       "exceeds the packed totals");
    }
    prob_free(&p);
}

static void test_threads(void) {
    /* 40000 made libgomp call exit(1); 100000 crashed inside OpenMP. Capped at 4 per processor. */
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) return;
    prob p;
    prob_init(&p, 1, 9, 9, 1, 1, 8);
    flashc_params prm = flashc_params_default();
    const int asks[] = {40000, 100000, 2147483647};
    for (int i = 0; i < 3; i++) {
        CHECK(flashc_context_set_threads(ctx, asks[i]) == FLASHC_STATUS_OK, "set_threads(%d)", asks[i]);
        const int n = flashc_context_threads(ctx);
        CHECK(n >= 1 && n <= 4 * (int)sysconf(_SC_NPROCESSORS_ONLN) + 4 && n <= 1024,
              "set_threads(%d) runs %d threads", asks[i], n);
        CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "forward with threads(%d): %s", asks[i],
              flashc_context_last_error(ctx));
    }
    CHECK(flashc_context_set_threads(ctx, 1) == FLASHC_STATUS_OK && flashc_context_threads(ctx) == 1,
          "set_threads(1) runs %d", flashc_context_threads(ctx));
    prob_free(&p);
    flashc_context_destroy(ctx);
}

/* ---- NaN and overflow -------------------------------------------------------------------------------------- */

static int row_all_nan(const float *out, int64_t row_off, int64_t D) {
    for (int64_t d = 0; d < D; d++)
        if (!isnan(out[row_off + d])) return 0;
    return 1;
}

static int row_all_finite(const float *x, int64_t off, int64_t n) {
    for (int64_t d = 0; d < n; d++)
        if (!isfinite(x[off + d])) return 0;
    return 1;
}

/* NaN propagates as in torch and flash-attn: a NaN that a row sees makes its output and lse NaN; a score that
 * overflows to +inf gives NaN (inf - inf in the softmax); rows that do not see the NaN are untouched. The AVX2
 * and AVX-512 kernels used to read NaN as "masked": out 0 and lse +inf, like an empty row, or the key dropped. */
static void test_nan(flashc_context_t ctx, const char *kernels) {
    /* Nq = 80: two query blocks, and with causal the early rows do not see the late keys. */
    prob p;
    prob_init(&p, 1, 80, 80, 2, 2, 32);
    const int64_t H = p.H, D = p.D, rs = H * D; /* row stride */
    const size_t no = (size_t)(p.Nq * rs), nl = (size_t)(H * p.Nq);
    float *ref_o = malloc(no * 4), *ref_l = malloc(nl * 4), *ref_dq = malloc(no * 4);
    for (int causal = 0; causal < 2; causal++) {
        flashc_params prm = flashc_params_default();
        prm.causal = causal;
        CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK && bwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] baseline: %s",
              kernels, flashc_context_last_error(ctx));
        memcpy(ref_o, p.out, no * 4), memcpy(ref_l, p.lse, nl * 4), memcpy(ref_dq, p.dq, no * 4);

        /* NaN in q row 5 of head 1. */
        const float q_saved = p.q[5 * rs + 1 * D + 3];
        p.q[5 * rs + 1 * D + 3] = NAN;
        CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] NaN q: %s", kernels, flashc_context_last_error(ctx));
        CHECK(row_all_nan(p.out, 5 * rs + 1 * D, D) && isnan(p.lse[1 * p.Nq + 5]),
              "[%s causal %d] NaN in q row 5: out %g, lse %g (wanted NaN)", kernels, causal,
              (double)p.out[5 * rs + D], (double)p.lse[p.Nq + 5]);
        int others_same = 1;
        for (int64_t i = 0; i < p.Nq; i++)
            for (int64_t h = 0; h < H; h++)
                if (!(i == 5 && h == 1) && (!same_bits(ref_o + i * rs + h * D, p.out + i * rs + h * D, (size_t)D) ||
                                            !same_bits(ref_l + h * p.Nq + i, p.lse + h * p.Nq + i, 1)))
                    others_same = 0;
        CHECK(others_same, "[%s causal %d] NaN in q row 5 changed other rows", kernels, causal);
        CHECK(bwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] NaN q backward: %s", kernels,
              flashc_context_last_error(ctx));
        CHECK(row_all_nan(p.dq, 5 * rs + 1 * D, D), "[%s causal %d] NaN in q row 5: dq row not NaN", kernels, causal);
        int dq_others = 1;
        for (int64_t i = 0; i < p.Nq; i++)
            if (i != 5 && !row_all_finite(p.dq, i * rs + D, D)) dq_others = 0;
        CHECK(dq_others, "[%s causal %d] NaN in q row 5 reached other rows' dq", kernels, causal);
        p.q[5 * rs + 1 * D + 3] = q_saved;

        /* NaN in key 70 of head 0 (kv head 0): every row that sees key 70 is NaN; with causal, rows 0..69 do not
         * see it and stay exactly as they were. */
        const float k_saved = p.k[70 * rs + 7];
        p.k[70 * rs + 7] = NAN;
        CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] NaN k: %s", kernels, flashc_context_last_error(ctx));
        int seen_nan = 1, unseen_same = 1;
        for (int64_t i = 0; i < p.Nq; i++) {
            const int sees = !causal || i >= 70;
            if (sees && !(row_all_nan(p.out, i * rs, D) && isnan(p.lse[i]))) seen_nan = 0;
            if (!sees && !(same_bits(ref_o + i * rs, p.out + i * rs, (size_t)D) && same_bits(ref_l + i, p.lse + i, 1)))
                unseen_same = 0;
            if (!same_bits(ref_o + i * rs + D, p.out + i * rs + D, (size_t)D)) unseen_same = 0; /* head 1 */
        }
        CHECK(seen_nan, "[%s causal %d] NaN in key 70: a row that sees it is not NaN", kernels, causal);
        CHECK(unseen_same, "[%s causal %d] NaN in key 70 changed rows that do not see it", kernels, causal);
        p.k[70 * rs + 7] = k_saved;

        /* A score that overflows: q row 9 and key 0 of head 1 at 1e30 give +inf. */
        float qs[32], ks[32];
        memcpy(qs, p.q + 9 * rs + D, sizeof qs), memcpy(ks, p.k + D, sizeof ks);
        for (int d = 0; d < D; d++) p.q[9 * rs + D + d] = 1e30f, p.k[D + d] = 1e30f;
        CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] +inf score: %s", kernels, flashc_context_last_error(ctx));
        CHECK(row_all_nan(p.out, 9 * rs + D, D) && isnan(p.lse[p.Nq + 9]),
              "[%s causal %d] +inf score: out %g, lse %g (wanted NaN)", kernels, causal, (double)p.out[9 * rs + D],
              (double)p.lse[p.Nq + 9]);
        memcpy(p.q + 9 * rs + D, qs, sizeof qs), memcpy(p.k + D, ks, sizeof ks);
    }

    /* Split-KV (one query block, many keys, several threads): a piece whose scores are all NaN must not be skipped
     * as if it had seen no key. */
    prob d;
    prob_init(&d, 1, 1, 4096, 1, 1, 16);
    flashc_params prm = flashc_params_default();
    flashc_context_set_threads(ctx, 4);
    for (int64_t j = 0; j < d.Nk; j++) d.k[j * d.D] = j >= 2048 ? NAN : d.k[j * d.D];
    CHECK(fwd(ctx, &d, &prm) == FLASHC_STATUS_OK, "[%s] split-KV NaN: %s", kernels, flashc_context_last_error(ctx));
    CHECK(row_all_nan(d.out, 0, d.D) && isnan(d.lse[0]), "[%s] split-KV with NaN keys: out %g lse %g", kernels,
          (double)d.out[0], (double)d.lse[0]);
    flashc_context_set_threads(ctx, 0);
    prob_free(&d);

    /* Non-finite ALiBi slopes are refused, like a non-finite scale. */
    float slopes[2] = {0.5f, INFINITY};
    prm.alibi_slopes = slopes;
    expect_refused("inf slope", fwd(ctx, &p, &prm), FLASHC_STATUS_INVALID_ARGUMENT, ctx, "must be finite");
    slopes[1] = NAN;
    expect_refused("NaN slope", bwd(ctx, &p, &prm), FLASHC_STATUS_INVALID_ARGUMENT, ctx, "must be finite");
    free(ref_o), free(ref_l), free(ref_dq);
    prob_free(&p);
}

/* ---- aliasing ---------------------------------------------------------------------------------------------- */

static void test_aliasing(flashc_context_t ctx) {
    prob p;
    prob_init(&p, 2, 16, 16, 2, 2, 8);
    flashc_params prm = flashc_params_default();

    /* An output whose strides overlap itself: threads raced on it. */
    flashc_tensor bad = p.to;
    bad.stride[0] = 3, bad.stride[1] = 1, bad.stride[2] = 1, bad.stride[3] = 1;
    expect_refused("out strides (3,1,1,1)",
                   flashc_forward(ctx, &p.tq, &p.tk, &p.tv, &prm, &bad, p.lse, NULL, 0),
                   FLASHC_STATUS_INVALID_ARGUMENT, ctx, "overlap");
    flashc_tensor bad_dk = p.tdk;
    bad_dk.stride[1] = bad_dk.stride[2] = p.D / 2; /* rows and heads interleave */
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "forward: %s", flashc_context_last_error(ctx));
    expect_refused("dk rows overlapping",
                   flashc_backward(ctx, &p.tq, &p.tk, &p.tv, &p.to, &p.tdo, p.lse, &prm, &p.tdq, &bad_dk, &p.tdv,
                                   NULL, 0),
                   FLASHC_STATUS_INVALID_ARGUMENT, ctx, "overlap");
    /* Permuted (B, H, N, D) and padded views are not overlaps. */
    float *perm = malloc((size_t)(p.B * p.H * p.Nq * (p.D + 3)) * 4);
    flashc_tensor pv = p.to;
    pv.data = perm;
    pv.stride[3] = 1, pv.stride[1] = p.D + 3, pv.stride[2] = p.Nq * (p.D + 3), pv.stride[0] = p.H * p.Nq * (p.D + 3);
    CHECK(flashc_forward(ctx, &p.tq, &p.tk, &p.tv, &prm, &pv, p.lse, NULL, 0) == FLASHC_STATUS_OK,
          "permuted padded out refused: %s", flashc_context_last_error(ctx));
    free(perm);

    /* softmax_lse or out over the small input arrays: they were overwritten mid-call. */
    int32_t *shared = malloc(4096);
    float *lse_over = (float *)shared;
    prob vl;
    prob_init(&vl, 1, 10, 10, 2, 2, 8);
    int32_t cu[3] = {0, 4, 10};
    memcpy(shared, cu, sizeof cu);
    flashc_params v = flashc_params_default();
    v.cu_seqlens_q = shared, v.cu_seqlens_k = cu, v.num_seqs = 2, v.max_seqlen_q = 6, v.max_seqlen_k = 6;
    expect_refused("lse over cu_seqlens_q",
                   flashc_forward(ctx, &vl.tq, &vl.tk, &vl.tv, &v, &vl.to, lse_over, NULL, 0),
                   FLASHC_STATUS_INVALID_ARGUMENT, ctx, "overlaps cu_seqlens_q");
    CHECK(memcmp(shared, cu, sizeof cu) == 0, "cu_seqlens changed by a refused call");

    flashc_params a = flashc_params_default();
    a.alibi_slopes = (const float *)(p.out + 5); /* inside out */
    for (int i = 0; i < 2; i++) p.out[5 + i] = 0.25f;
    expect_refused("out over alibi slopes", fwd(ctx, &p, &a), FLASHC_STATUS_INVALID_ARGUMENT, ctx,
                   "overlaps alibi_slopes");

    flashc_params m = flashc_params_default();
    uint8_t *mask_in_lse = (uint8_t *)(p.lse + 3);
    memset(mask_in_lse, 1, 4);
    m.block_mask = mask_in_lse, m.block_mask_q = 8, m.block_mask_k = 8;
    expect_refused("lse over block mask", fwd(ctx, &p, &m), FLASHC_STATUS_INVALID_ARGUMENT, ctx,
                   "overlaps block_mask");

    /* A caller's workspace over an output or an input. */
    size_t need = 0;
    CHECK(flashc_backward_workspace_size(ctx, &p.tq, &p.tk, &p.tv, &prm, &need) == FLASHC_STATUS_OK && need > 0,
          "backward workspace size: %s", flashc_context_last_error(ctx));
    float *big = aligned_alloc(64, (need + 4096 + 63) / 64 * 64);
    flashc_tensor dq_in_ws = p.tdq;
    dq_in_ws.data = big + need / 4 / 2 / 16 * 16;
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "forward: %s", flashc_context_last_error(ctx));
    expect_refused("workspace over dq",
                   flashc_backward(ctx, &p.tq, &p.tk, &p.tv, &p.to, &p.tdo, p.lse, &prm, &dq_in_ws, &p.tdk, &p.tdv,
                                   big, need + 4096),
                   FLASHC_STATUS_INVALID_ARGUMENT, ctx, "workspace");
    free(big);
    free(shared);
    prob_free(&vl);
    prob_free(&p);
}

/* ---- negative strides ------------------------------------------------------------------------------------------ */

/* Inputs read in place through negative row strides: the microkernels formed A and B addresses with unsigned
 * products (size_t)i * stride, pointer overflow that clang's UBSan reported under libFuzzer (the results were
 * right only because the wrap-around cancels). Same numbers as the positive-stride run, to rounding. */
static void test_negative_strides(flashc_context_t ctx, const char *kernels) {
    prob p;
    prob_init(&p, 1, 70, 90, 2, 1, 32);
    const size_t nk = (size_t)(p.Nk * p.Hkv * p.D), rowk = (size_t)(p.Hkv * p.D);
    float *kr = malloc(nk * 4), *vr = malloc(nk * 4);
    for (int64_t j = 0; j < p.Nk; j++) { /* rows stored last to first */
        memcpy(kr + (size_t)(p.Nk - 1 - j) * rowk, p.k + (size_t)j * rowk, rowk * 4);
        memcpy(vr + (size_t)(p.Nk - 1 - j) * rowk, p.v + (size_t)j * rowk, rowk * 4);
    }
    flashc_params prm = flashc_params_default();
    CHECK(fwd(ctx, &p, &prm) == FLASHC_STATUS_OK && bwd(ctx, &p, &prm) == FLASHC_STATUS_OK, "[%s] baseline: %s",
          kernels, flashc_context_last_error(ctx));
    const size_t no = (size_t)(p.Nq * p.H * p.D);
    float *ref_o = malloc(no * 4), *ref_dk = malloc(nk * 4);
    memcpy(ref_o, p.out, no * 4), memcpy(ref_dk, p.dk, nk * 4);
    flashc_tensor tk = p.tk, tv = p.tv;
    tk.data = kr + (size_t)(p.Nk - 1) * rowk, tv.data = vr + (size_t)(p.Nk - 1) * rowk;
    tk.stride[1] = tv.stride[1] = -(int64_t)rowk;
    CHECK(flashc_forward(ctx, &p.tq, &tk, &tv, &prm, &p.to, p.lse, NULL, 0) == FLASHC_STATUS_OK, "[%s] forward: %s",
          kernels, flashc_context_last_error(ctx));
    CHECK(flashc_backward(ctx, &p.tq, &tk, &tv, &p.to, &p.tdo, p.lse, &prm, &p.tdq, &p.tdk, &p.tdv, NULL, 0) ==
              FLASHC_STATUS_OK,
          "[%s] backward: %s", kernels, flashc_context_last_error(ctx));
    double eo = 0, ro = 0, ek = 0, rk = 0;
    for (size_t i = 0; i < no; i++) eo += (p.out[i] - ref_o[i]) * (double)(p.out[i] - ref_o[i]), ro += ref_o[i] * (double)ref_o[i];
    for (size_t i = 0; i < nk; i++) ek += (p.dk[i] - ref_dk[i]) * (double)(p.dk[i] - ref_dk[i]), rk += ref_dk[i] * (double)ref_dk[i];
    CHECK(sqrt(eo / ro) < 1e-5 && sqrt(ek / rk) < 1e-5, "[%s] negative key strides: out %.3g, dk %.3g relative",
          kernels, sqrt(eo / ro), sqrt(ek / rk));
    free(kr), free(vr), free(ref_o), free(ref_dk);
    prob_free(&p);
}

/* ---- driver -------------------------------------------------------------------------------------------------- */

static int run_all(const char *kernels) {
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    const char *ran = flashc_cpu_select_kernels()->name;
    CHECK(strncmp(ran, kernels, strlen(kernels)) == 0, "FLASHC_CPU_KERNELS=%s ran %s", kernels, ran);
    test_nan(ctx, ran);
    test_negative_strides(ctx, ran);
    if (!strcmp(kernels, "generic")) { /* the front's checks: once is enough */
        test_workspace_overflow(ctx);
        test_huge_block_and_window(ctx);
        test_varlen_bounds(ctx);
        test_aliasing(ctx);
        test_threads();
    } else {
        test_huge_block_and_window(ctx);
    }
    flashc_context_destroy(ctx);
    printf("test_reliability [%s]: %d passed, %d failed\n", ran, checks - failures, failures);
    return failures != 0;
}

int main(int argc, char **argv) {
    rng_state = 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
    const char *forced = getenv("FLASHC_CPU_KERNELS");
    if (forced) return run_all(forced);
    /* Once per kernel set this CPU runs, each in its own process (the choice is made once per process). */
    static const char *sets[] = {"generic", "avx2", "avx512", "amx"};
    int bad = 0, ran = 0;
    for (int i = 0; i < (int)(sizeof sets / sizeof sets[0]); i++) {
        if (!flashc_cpu_kernels_by_name(sets[i])) {
            printf("test_reliability: %s kernels not on this CPU, skipped\n", sets[i]);
            continue;
        }
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            setenv("FLASHC_CPU_KERNELS", sets[i], 1);
            execv(argv[0], argv);
            _exit(127);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "test_reliability: the %s run failed (status %d)\n", sets[i], status);
            bad++;
        }
        ran++;
    }
    (void)argc;
    printf("%d passed, %d failed\n", ran - bad, bad);
    return bad != 0;
}
