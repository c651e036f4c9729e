/*
 * test_positions: flashc_params.positions (0.6) as context parallelism uses it, on the CPU backend.
 *
 *   ring     one causal + ALiBi + window attention over N rows, cut into query chunks x key chunks: each pair run
 *            with positions (the chunks' first rows), the forward's partial results merged by lse (flashc_merge),
 *            the backward run on every pair with the whole attention's out and lse, dq summed over key chunks and
 *            dk, dv over query chunks. Everything must equal the one call on the whole sequence (fp32: relative
 *            error 1e-5; lse to 1e-5, +inf exactly where a row sees no key; pairs the band leaves empty included).
 *            Again with dropout (same seed and offset everywhere): the pairs drop the whole attention's elements.
 *   windows  window sides on either side of where they stop hiding keys (Nq - 1 + diag on the left, Nk - 1 - diag
 *            on the right, diag = q_position - k_position), past the keys both ways: the library (which makes the
 *            sides that hide nothing unbounded) against the oracle run on the raw sides, as the caller gave them.
 *   dropout  flashc_dropout_mask with positions is the block of the whole mask at those rows and keys; the quick
 *            table's positions rows with dropout: those dropout takes run against the oracle, the others (a
 *            k_position that is not a multiple of 4) are refused and reported skipped by the case runner.
 *
 * Fresh inputs every run (the seed is printed; FLASHC_SEED=<n> replays).
 */
#include "ref/testkit.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_checks, g_failed;

static void check(const char *what, int cond) {
    g_checks++;
    g_failed += !cond;
    if (!cond) printf("FAIL %s\n", what);
}

static float *normal_floats(size_t n, uint64_t *rng) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    if (!x) exit(2);
    for (size_t i = 0; i < n; i++) x[i] = (float)flashc_rand_normal(rng);
    return x;
}

/* ||a - b|| / ||b|| over n floats (b all zero: ||a - b||). */
static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ---- ring ------------------------------------------------------------------------------------------------------ */

enum { RB = 2, RN = 300, RH = 4, RHKV = 2, RD = 32 };

/* Rows [r0, r0 + n) of a contiguous (RB, RN, heads, RD) tensor, as a view. */
static flashc_tensor rows_view(float *base, int64_t heads, int64_t r0, int64_t n) {
    flashc_tensor t = flashc_tensor_contiguous(base, FLASHC_DTYPE_F32, RB, RN, heads, RD);
    t.data = base + r0 * heads * RD;
    t.shape[1] = n;
    return t;
}

static void test_ring(uint64_t seed, float dropout_p) {
    uint64_t rng = seed;
    const size_t nq_el = (size_t)RB * RN * RH * RD, nk_el = (size_t)RB * RN * RHKV * RD, nl = (size_t)RB * RH * RN;
    float *q = normal_floats(nq_el, &rng), *k = normal_floats(nk_el, &rng), *v = normal_floats(nk_el, &rng);
    float *dout = normal_floats(nq_el, &rng);
    for (size_t i = 0; i < nq_el; i += 7 * RD) q[i] *= 6.0f; /* some large logits */
    float slopes[RH];
    for (int h = 0; h < RH; h++) slopes[h] = 0.05f + 0.1f * (float)h;
    float *out = calloc(nq_el, 4), *lse = calloc(nl, 4), *dq = calloc(nq_el, 4), *dk = calloc(nk_el, 4),
          *dv = calloc(nk_el, 4);
    float *r_out = calloc(nq_el, 4), *r_lse = calloc(nl, 4), *r_dq = calloc(nq_el, 4), *r_dk = calloc(nk_el, 4),
          *r_dv = calloc(nk_el, 4);
    /* r_*: the pairs' results put together (r_lse: a pair's lse before its merge); c_*: one pair's out, gradients
     * and the whole attention's lse rows of its query chunk; m_lse: the merged lse of a query chunk */
    float *c_out = calloc(nq_el, 4), *c_lse = calloc(nl, 4), *c_dq = calloc(nq_el, 4), *c_dk = calloc(nk_el, 4),
          *c_dv = calloc(nk_el, 4), *m_lse = calloc(nl, 4);
    flashc_context_t ctx;
    if (!out || !lse || !dq || !dk || !dv || !r_out || !r_lse || !r_dq || !r_dk || !r_dv || !c_out || !c_lse ||
        !c_dq || !c_dk || !c_dv || !m_lse || flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK)
        exit(2);
    flashc_params prm = flashc_params_default();
    prm.causal = 1;
    prm.window_left = 90;
    prm.alibi_slopes = slopes;
    prm.dropout_p = dropout_p;
    prm.dropout_seed = flashc_rand_u64(&rng);
    prm.dropout_offset = flashc_rand_u64(&rng);

    /* the whole attention */
    const flashc_tensor tq = rows_view(q, RH, 0, RN), tk = rows_view(k, RHKV, 0, RN), tv = rows_view(v, RHKV, 0, RN);
    const flashc_tensor to = rows_view(out, RH, 0, RN), tdo = rows_view(dout, RH, 0, RN);
    const flashc_tensor tdq = rows_view(dq, RH, 0, RN), tdk = rows_view(dk, RHKV, 0, RN),
                        tdv = rows_view(dv, RHKV, 0, RN);
    check("ring: the whole forward", flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0) == FLASHC_STATUS_OK);
    check("ring: the whole backward", flashc_backward(ctx, &tq, &tk, &tv, &to, &tdo, lse, &prm, &tdq, &tdk, &tdv,
                                                      NULL, 0) == FLASHC_STATUS_OK);

    /* chunks of unequal lengths, so that no pair is square and some pairs see nothing (keys after the queries); key
     * chunks start at multiples of 4, as dropout with positions needs */
    static const int64_t cuts[] = {0, 72, 180, 232, RN};
    const int nc = (int)(sizeof cuts / sizeof cuts[0]) - 1;
    int empty_pairs = 0;
    for (int a = 0; a < nc; a++) {
        const int64_t q0 = cuts[a], nq = cuts[a + 1] - cuts[a];
        const flashc_tensor cq = rows_view(q, RH, q0, nq), cdo = rows_view(dout, RH, q0, nq);
        const flashc_tensor go = rows_view(out, RH, q0, nq); /* the whole attention's out rows */
        /* this query chunk's rows of the whole lse, contiguous (B, H, nq), for the backward */
        for (int64_t b = 0; b < RB; b++)
            for (int64_t h = 0; h < RH; h++)
                memcpy(c_lse + (b * RH + h) * nq, lse + (b * RH + h) * RN + q0, (size_t)nq * 4);
        flashc_tensor mo = flashc_tensor_contiguous(r_out, FLASHC_DTYPE_F32, RB, nq, RH, RD); /* merged so far */
        for (int c = 0; c < nc; c++) {
            const int64_t k0 = cuts[c], nk = cuts[c + 1] - cuts[c];
            const flashc_tensor ck = rows_view(k, RHKV, k0, nk), cv = rows_view(v, RHKV, k0, nk);
            flashc_params pp = prm;
            pp.positions = 1;
            pp.q_position = q0;
            pp.k_position = k0;
            flashc_tensor po = flashc_tensor_contiguous(c == 0 ? r_out : c_out, FLASHC_DTYPE_F32, RB, nq, RH, RD);
            float *plse = c == 0 ? m_lse : r_lse;
            check("ring: a pair's forward",
                  flashc_forward(ctx, &cq, &ck, &cv, &pp, &po, plse, NULL, 0) == FLASHC_STATUS_OK);
            int seen = 0;
            for (int64_t i = 0; i < RB * RH * nq; i++) seen |= !isinf(plse[i]);
            empty_pairs += !seen;
            if (c > 0)
                check("ring: merge", flashc_merge(ctx, &mo, m_lse, &po, plse, &mo, m_lse) == FLASHC_STATUS_OK);
            /* the backward of the pair, with the whole attention's out and lse */
            const flashc_tensor gq = flashc_tensor_contiguous(c_dq, FLASHC_DTYPE_F32, RB, nq, RH, RD);
            const flashc_tensor gk = flashc_tensor_contiguous(c_dk, FLASHC_DTYPE_F32, RB, nk, RHKV, RD);
            const flashc_tensor gv = flashc_tensor_contiguous(c_dv, FLASHC_DTYPE_F32, RB, nk, RHKV, RD);
            check("ring: a pair's backward", flashc_backward(ctx, &cq, &ck, &cv, &go, &cdo, c_lse, &pp, &gq, &gk, &gv,
                                                             NULL, 0) == FLASHC_STATUS_OK);
            for (int64_t b = 0; b < RB; b++) {
                for (int64_t i = 0; i < nq * RH * RD; i++)
                    r_dq[(b * RN + q0) * RH * RD + i] += c_dq[b * nq * RH * RD + i];
                for (int64_t i = 0; i < nk * RHKV * RD; i++) {
                    r_dk[(b * RN + k0) * RHKV * RD + i] += c_dk[b * nk * RHKV * RD + i];
                    r_dv[(b * RN + k0) * RHKV * RD + i] += c_dv[b * nk * RHKV * RD + i];
                }
            }
        }
        /* the merged chunk against the whole attention's rows */
        double num = 0, den = 0;
        int lse_ok = 1;
        for (int64_t b = 0; b < RB; b++) {
            for (int64_t i = 0; i < nq * RH * RD; i++) {
                const double w = out[(b * RN + q0) * RH * RD + i], g = r_out[b * nq * RH * RD + i];
                num += (g - w) * (g - w);
                den += w * w;
            }
            for (int64_t h = 0; h < RH; h++)
                for (int64_t i = 0; i < nq; i++) {
                    const float w = lse[(b * RH + h) * RN + q0 + i], g = m_lse[(b * RH + h) * nq + i];
                    lse_ok &= isinf(w) ? g == w : fabsf(g - w) <= 1e-5f * (1.0f + fabsf(w));
                }
        }
        char what[96];
        snprintf(what, sizeof what, "ring (dropout %g): query chunk %d merged over %d key chunks: out (rel %.2g)",
                 (double)dropout_p, a, nc, sqrt(num / den));
        check(what, sqrt(num / den) <= 1e-5);
        snprintf(what, sizeof what, "ring: query chunk %d: lse", a);
        check(what, lse_ok);
    }
    check("ring: some pairs see no key (keys after the queries)", empty_pairs > 0);
    const double edq = rel_err(r_dq, dq, nq_el), edk = rel_err(r_dk, dk, nk_el), edv = rel_err(r_dv, dv, nk_el);
    char what[128];
    snprintf(what, sizeof what, "ring: dq, dk, dv summed over the pairs (rel %.2g, %.2g, %.2g)", edq, edk, edv);
    check(what, edq <= 1e-4 && edk <= 1e-4 && edv <= 1e-4);
    printf("ring (dropout %g): %d x %d chunk pairs (%d empty) against one call: out, lse, dq %.2g, dk %.2g, dv %.2g\n",
           (double)dropout_p, nc, nc, empty_pairs, edq, edk, edv);
    flashc_context_destroy(ctx);
    float *all[] = {q, k, v, dout, out, lse, dq, dk, dv, r_out, r_lse, r_dq, r_dk, r_dv, c_out, c_lse, c_dq, c_dk,
                    c_dv, m_lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* ---- windows at their limits ----------------------------------------------------------------------------------- */

enum { WB = 2, WNQ = 20, WNK = 31, WH = 2, WD = 16 };

static void test_windows(uint64_t seed) {
    uint64_t rng = seed;
    const size_t nq_el = (size_t)WB * WNQ * WH * WD, nk_el = (size_t)WB * WNK * WH * WD, nl = (size_t)WB * WH * WNQ;
    float *q = normal_floats(nq_el, &rng), *k = normal_floats(nk_el, &rng), *v = normal_floats(nk_el, &rng);
    float *out = malloc(nq_el * 4), *lse = malloc(nl * 4), *want = malloc(nq_el * 4);
    double *ref = malloc(nq_el * sizeof(double)), *ref_lse = malloc(nl * sizeof(double));
    float slopes[WH] = {0.3f, 0.05f};
    flashc_context_t ctx;
    if (!out || !lse || !want || !ref || !ref_lse || flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != 0) exit(2);
    const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, WB, WNQ, WH, WD);
    const flashc_tensor tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_F32, WB, WNK, WH, WD);
    const flashc_tensor tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_F32, WB, WNK, WH, WD);
    const flashc_tensor to = flashc_tensor_contiguous(out, FLASHC_DTYPE_F32, WB, WNQ, WH, WD);
    static const int64_t diags[] = {-60, -31, -12, 0, 5, 11, 30, 51, 90};
    int cases = 0, bad = 0;
    for (size_t di = 0; di < sizeof diags / sizeof diags[0]; di++) {
        const int64_t diag = diags[di];
        /* each side around where it stops hiding keys, and far past it */
        const int64_t lstop = WNQ - 1 + diag, rstop = WNK - 1 - diag;
        const int64_t lefts[] = {-1, 0, 3, lstop - 1, lstop, lstop + 1, lstop + 2, 1000};
        const int64_t rights[] = {-1, 0, 4, rstop - 1, rstop, rstop + 1, rstop + 2, 1000};
        for (int li = 0; li < 8; li++)
            for (int ri = 0; ri < 8; ri++)
                for (int alibi = 0; alibi < 2; alibi++) {
                    const int64_t left = lefts[li], right = rights[ri];
                    if (left < -1 || right < -1) continue;
                    flashc_params prm = flashc_params_default();
                    prm.window_left = left;
                    prm.window_right = right;
                    prm.alibi_slopes = alibi ? slopes : NULL;
                    prm.positions = 1;
                    prm.q_position = 1000 + diag;
                    prm.k_position = 1000;
                    cases++;
                    flashc_problem p;
                    if (flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0) != FLASHC_STATUS_OK ||
                        flashc_problem_build(NULL, FLASHC_OP_FORWARD, &tq, &tk, &tv, &prm, &to, lse, NULL, NULL,
                                             NULL, NULL, &p) != FLASHC_STATUS_OK) {
                        bad++;
                        printf("FAIL windows diag %lld (%lld, %lld): refused: %s\n", (long long)diag,
                               (long long)left, (long long)right, flashc_context_last_error(ctx));
                        continue;
                    }
                    /* the sides and positions as given, not as the front simplified them (sides that hide no key
                     * unbounded, and then positions that change nothing dropped) */
                    p.win_left = left;
                    p.win_right = right;
                    p.positions = 1;
                    p.q_position = prm.q_position;
                    p.k_position = prm.k_position;
                    if (flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref, ref_lse)) exit(2);
                    for (size_t i = 0; i < nq_el; i++) want[i] = (float)ref[i];
                    int ok = rel_err(out, want, nq_el) <= 1e-5;
                    for (size_t i = 0; i < nl; i++)
                        ok &= isinf(ref_lse[i]) ? isinf(lse[i]) && lse[i] > 0
                                                : fabs(lse[i] - ref_lse[i]) <= 1e-5 * (1 + fabs(ref_lse[i]));
                    if (!ok) {
                        bad++;
                        if (bad <= 10)
                            printf("FAIL windows diag %lld, window (%lld, %lld), alibi %d: out rel %.3g\n",
                                   (long long)diag, (long long)left, (long long)right, alibi,
                                   rel_err(out, want, nq_el));
                    }
                }
    }
    char what[96];
    snprintf(what, sizeof what, "windows: %d of %d (diag, left, right, alibi) against the raw sides", cases - bad,
             cases);
    check(what, bad == 0);
    printf("%s\n", what);
    flashc_context_destroy(ctx);
    free(q), free(k), free(v), free(out), free(lse), free(want), free(ref), free(ref_lse);
}

/* flashc_dropout_mask at positions (a, c) is rows a.., keys c.. of the mask at (0, 0); and the quick table's positions
 * rows with dropout (as the dropout runs of the table set it): run against the oracle where dropout takes their
 * positions, else refused with NOT_SUPPORTED, which the case runner reports as skipped (not passed silently). */
static void test_dropout(uint64_t seed) {
    enum { MB = 2, MH = 3, MN = 70, SQ = 21, SK = 30, A = 13, C = 36 };
    static uint8_t whole[MB * MH * MN * MN], part[MB * MH * SQ * SK];
    flashc_params prm = flashc_params_default();
    prm.dropout_p = 0.3f;
    prm.dropout_seed = seed;
    prm.dropout_offset = seed >> 7;
    int ok = flashc_dropout_mask(&prm, MB, MH, MN, MN, whole) == FLASHC_STATUS_OK;
    prm.positions = 1;
    prm.q_position = A;
    prm.k_position = C;
    ok &= flashc_dropout_mask(&prm, MB, MH, SQ, SK, part) == FLASHC_STATUS_OK;
    for (int64_t bh = 0; bh < MB * MH && ok; bh++)
        for (int64_t i = 0; i < SQ; i++)
            ok &= !memcmp(part + (bh * SQ + i) * SK, whole + (bh * MN + A + i) * MN + C, SK);
    check("dropout: flashc_dropout_mask at positions (13, 36) is that block of the whole mask", ok);

    size_t n = 0;
    const flashc_case *table = flashc_case_table(0, &n);
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) exit(2);
    int ran = 0, skipped = 0;
    for (size_t i = 0; i < n; i++) {
        if (!table[i].positions) continue;
        flashc_case c = table[i];
        c.dropout = 0.1f;
        flashc_case_result r;
        memset(&r, 0, sizeof r);
        const int takes = c.q_position >= 0 && c.k_position >= 0 && c.k_position % 4 == 0;
        const int rc = flashc_case_run(ctx, &c, seed + i, &r);
        char what[400];
        snprintf(what, sizeof what, "dropout: %s at (%lld, %lld) %s: %s", c.name, (long long)c.q_position,
                 (long long)c.k_position, takes ? "runs against the oracle" : "is refused and reported skipped",
                 r.message);
        check(what, rc == 0 && r.pass &&
                        (takes ? !r.skipped : r.skipped && r.status == FLASHC_STATUS_NOT_SUPPORTED &&
                                                  strstr(r.message, "multiple of 4") != NULL));
        ran += takes, skipped += !takes;
    }
    check("dropout: the quick table has positions rows of both kinds", ran > 0 && skipped > 0);
    printf("dropout: the mask at positions; %d positions rows with dropout against the oracle, %d refused\n", ran,
           skipped);
    flashc_context_destroy(ctx);
}

/* Positions that change nothing are dropped by the front (the plain problem, which every kernel takes however far
 * apart the positions are); with a band side, ALiBi or dropout they stay. */
static void test_dropped(void) {
    static float buf[4 * 8 * 2 * 16], out[4 * 8 * 2 * 16], lse[64], slopes[2] = {0.5f, 0.25f};
    const flashc_tensor t = flashc_tensor_contiguous(buf, FLASHC_DTYPE_F32, 1, 8, 2, 16);
    const flashc_tensor to = flashc_tensor_contiguous(out, FLASHC_DTYPE_F32, 1, 8, 2, 16);
    for (int v = 0; v < 5; v++) {
        flashc_params prm = flashc_params_default();
        prm.positions = 1;
        prm.q_position = (int64_t)1 << 35; /* past what the CUDA kernels' int32 rows take */
        prm.k_position = 0;
        if (v == 1) prm.window_left = ((int64_t)1 << 35) + 8; /* hides no key: unbounded, then dropped */
        if (v == 2) prm.alibi_slopes = slopes;
        if (v == 3) prm.dropout_p = 0.1f;
        if (v == 4) prm.window_left = 100;
        flashc_problem p;
        const flashc_status st =
            flashc_problem_build(NULL, FLASHC_OP_FORWARD, &t, &t, &t, &prm, &to, lse, NULL, NULL, NULL, NULL, &p);
        char what[96];
        snprintf(what, sizeof what, "positions (2^35, 0), variant %d: %s", v,
                 v < 2 ? "dropped" : v == 3 ? "kept (dropout refuses them)" : "kept");
        if (v == 3)
            check(what, st == FLASHC_STATUS_NOT_SUPPORTED); /* dropout: q_position + Nq past 2^32 */
        else
            check(what, st == FLASHC_STATUS_OK && p.positions == (v >= 2) &&
                            (v >= 2 || (p.q_position == 0 && p.k_position == 0)));
    }
}

int main(void) {
    const char *env = getenv("FLASHC_SEED");
    const uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    printf("test_positions: FLASHC_SEED=%" PRIu64 "\n", seed);
    test_ring(seed, 0.0f);
    test_ring(seed, 0.2f);
    test_windows(seed + 1);
    test_dropout(seed + 2);
    test_dropped();
    printf("test_positions: %d checks, %d failed\n", g_checks, g_failed);
    return g_failed != 0;
}
