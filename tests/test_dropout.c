/*
 * test_dropout: fused dropout (issue 19) on the CPU backend, and the keep-bit definition every backend shares.
 *
 *  1. Philox4x32-10 (src/dropout.h) against Random123's published known-answer vectors; the threshold at its edges.
 *  2. The CPU dropout kernels, every set this CPU runs, bit for bit against dropout.h on ragged tiles, their (i, j)
 *     moved by positions (up to the ends of Philox's 32-bit row and key-group counters); likewise the keep masks that
 *     the bf16 kernels' fused steps read (the avx512bf16 set).
 *  3. flashc_dropout_mask: the kept fraction within 5 sigma for p in {0.1, 0.17, 0.5}, overall and per column residue
 *     mod 4 and row parity (where a mix-up of Philox's four outputs would show); another offset or seed gives an
 *     independent mask (agreement q^2 + (1 - q)^2 within 5 sigma).
 *  4. The mask the library applies, read back from its outputs: with V = identity (D >= Nk) O_ij = P_ij Z_ij, with
 *     dO = identity dV_ji = P_ij Z_ij, so an entry is 0 exactly where it was dropped. At 1, 2 and 3 threads (split
 *     keys, both backward modes), on the tile and the decode path, GQA, a window, varlen packing, and each varlen
 *     sequence run alone at offset + b * H: always flashc_dropout_mask's bits.
 *  5. Forward and backward against the fp64 oracle given the same mask (flashc_case_run: CONVENTIONS.md's rule), f32,
 *     f16, bf16, with causal/window/softcap/ALiBi/block masks/GQA/varlen/seqused_k/sinks/paged K/V/decode rows.
 *  6. The oracle's backward against central differences of its forward in fp64 with dropout, and the library's fp32
 *     forward and backward against it.
 *  7. p = 0, and a p so small that nothing drops, bit for bit as no dropout; a bad p (NaN, < 0, >= 1) refused with a
 *     message and nothing written; the CUDA backend, where there is a GPU, takes dropout (supported).
 */
#include "cpu/cpu.h"
#include "dropout.h"
#include "ref/testkit.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures, checks;
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        checks++;                                                                                                  \
        if (!(cond)) {                                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                                          \
            printf("\n");                                                                                          \
            failures++;                                                                                            \
        }                                                                                                          \
    } while (0)

static float normal_f(uint64_t *rng, double s) { return (float)(s * flashc_rand_normal(rng)); }

/* ---- 1. Philox and the threshold ------------------------------------------------------------------------ */

static void test_philox(void) {
    /* Random123's kat_vectors, philox4x32 10: counter (4 words), key (2 words) -> output (4 words) */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
        {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0x408f276du, 0x41c83b0eu,
         0xa20bc7c6u, 0x6d5451fdu},
        {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0xd16cfe09u, 0x94fdccebu,
         0x5001e420u, 0x24126ea1u},
    };
    for (int t = 0; t < 3; t++) {
        const uint32_t *v = kat[t];
        const flashc_u32x4 r = flashc_philox4x32_10(v[0], v[1], v[2], v[3], v[4], v[5]);
        CHECK(r.x[0] == v[6] && r.x[1] == v[7] && r.x[2] == v[8] && r.x[3] == v[9],
              "philox4x32-10 kat %d: %08x %08x %08x %08x, expected %08x %08x %08x %08x", t, r.x[0], r.x[1], r.x[2],
              r.x[3], v[6], v[7], v[8], v[9]);
    }
    /* the counter layout: (j / 4, i, stream lo, stream hi), key (seed lo, seed hi) */
    const uint64_t seed = 0x299f31d0a4093822ull, stream = 0x0370734413198a2eull;
    const flashc_u32x4 r = flashc_dropout_bits4(seed, stream, 0x85a308d3, 0x243f6a88);
    CHECK(r.x[0] == 0xd16cfe09u && r.x[3] == 0x24126ea1u, "dropout bits: counter or key words out of place");
    CHECK(flashc_dropout_stream(5, 2, 7, 3) == 5 + 2 * 7 + 3, "stream = offset + b * H + h");
    CHECK(flashc_dropout_stream(UINT64_MAX, 0, 4, 1) == 0, "stream wraps modulo 2^64");

    /* t = floor(p * 2^32 + 1/2) */
    CHECK(flashc_dropout_threshold(0.0f) == 0, "threshold(0) = %u", flashc_dropout_threshold(0.0f));
    CHECK(flashc_dropout_threshold(0.5f) == 0x80000000u, "threshold(0.5) = %u", flashc_dropout_threshold(0.5f));
    CHECK(flashc_dropout_threshold(0.25f) == 0x40000000u, "threshold(0.25)");
    CHECK(flashc_dropout_threshold(nextafterf(1.0f, 0.0f)) == 0xffffff00u, "threshold(1 - 2^-24) = %x",
          flashc_dropout_threshold(nextafterf(1.0f, 0.0f)));
    CHECK(flashc_dropout_threshold(1e-12f) == 0, "threshold(1e-12): nothing drops");
    CHECK(flashc_dropout_threshold(ldexpf(1.0f, -33)) == 1, "threshold(2^-33): a tie rounds up");
    CHECK(flashc_dropout_threshold(ldexpf(3.0f, -34)) == 1, "threshold(3 * 2^-34) = 0.75 -> 1");
    const float p = 0.1f;
    const double want = floor((double)p * 4294967296.0 + 0.5);
    CHECK((double)flashc_dropout_threshold(p) == want, "threshold(0.1f) = %u, expected %.0f",
          flashc_dropout_threshold(p), want);
    CHECK(flashc_dropout_scale(0.5f) == 2.0f && flashc_dropout_scale(0.0f) == 1.0f, "scale 1 / (1 - p)");
}

/* ---- 2. the CPU kernels ------------------------------------------------------------------------------- */

static void test_kernels(void) {
    static const char *names[] = {"generic", "avx2", "avx512"};
    enum { COLS = 37, ROWS = 45, LD = 53 };
    static float src[COLS * LD], out[COLS * LD];
    uint64_t rng = 12345;
    for (int i = 0; i < COLS * LD; i++) src[i] = normal_f(&rng, 1.0);
    int ran = 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const flashc_cpu_kernels *kern = flashc_cpu_kernels_by_name(names[k]);
        if (!kern) continue;
        ran++;
        long bad = 0;
        const float ps[3] = {0.1f, 0.5f, 0.93f};
        const int64_t j0s[4] = {0, 1, 6, 4097}, i0s[3] = {0, 3, 100001};
        /* where the tile's row 0 and key 0 sit in dropout's (i, j) (positions): none, small, near the counters' end */
        const int64_t row0s[3] = {0, 7, 4294967296 - 200}, col0s[3] = {0, 12, 17179869184 - 5000};
        for (int a = 0; a < 3; a++)
            for (int jj = 0; jj < 4; jj++)
                for (int ii = 0; ii < 3; ii++)
                    for (int shape = 0; shape < 4; shape++) {
                        /* ragged: cols 1, 3, 37; rows 1, 8, 45; a row-major single row (ld 1) */
                        const int cols = shape == 0 ? COLS : shape == 1 ? 3 : shape == 2 ? 1 : 29;
                        const int rows = shape == 0 ? ROWS : shape == 1 ? 8 : shape == 2 ? 13 : 1;
                        const int64_t ld = shape == 3 ? 1 : LD;
                        const int pos = (a + jj + ii + shape) % 3;
                        flashc_cpu_dropout d = {flashc_rand_u64(&rng), flashc_rand_u64(&rng),
                                                flashc_dropout_threshold(ps[a]), a == 1 ? 1.0f : 1.7f, row0s[pos],
                                                col0s[pos]};
                        memcpy(out, src, sizeof out);
                        kern->dropout(cols, rows, out, ld, &d, i0s[ii], j0s[jj]);
                        for (int c = 0; c < COLS; c++)
                            for (int r = 0; r < LD; r++) {
                                const int64_t e = c * ld + r;
                                if (ld == 1 && (r > 0 || e >= COLS)) continue;
                                float want = src[e];
                                const int in = ld == 1 ? c < cols : (c < cols && r < rows);
                                if (in)
                                    want = flashc_dropout_keep(d.seed, d.stream, d.row0 + i0s[ii] + (ld == 1 ? 0 : r),
                                                               d.col0 + j0s[jj] + c, d.threshold)
                                               ? src[e] * d.kept
                                               : 0.0f;
                                if (memcmp(&want, &out[e], sizeof want)) bad++;
                            }
                    }
        CHECK(bad == 0, "dropout kernel %s: %ld elements differ from dropout.h", kern->name, bad);
    }
    CHECK(ran >= 1, "no kernel set ran");
    printf("kernels: %d kernel set(s) checked against dropout.h\n", ran);

    /* the keep masks: keep[r / 16 * ldk + c] bit b for row r + b, rows rounded up to 16; words past them untouched */
    const flashc_cpu_kernels *bf = flashc_cpu_kernels_by_name("avx512bf16");
    if (!bf || !bf->bf16 || !bf->bf16->keep) {
        printf("kernels: no avx512bf16 set here, keep masks not checked\n");
        return;
    }
    enum { LDK = 41, WORDS = LDK * 4 };
    static uint16_t keep[WORDS];
    long bad = 0, untouched = 0;
    const int64_t row0s[2] = {0, 4294967296 - 40}, col0s[2] = {0, 17179869184 - 30};
    for (int a = 0; a < 3; a++)
        for (int pos = 0; pos < 2; pos++)
            for (int shape = 0; shape < 4; shape++) {
                /* rows 45 (two vectors and a tail), 64 (one batch of 32 twice), 16, 1; cols 37, 40, 3, 1 */
                const int rows = shape == 0 ? 45 : shape == 1 ? 64 : shape == 2 ? 16 : 1;
                const int cols = shape == 0 ? 37 : shape == 1 ? 40 : shape == 2 ? 3 : 1;
                const int64_t i0 = shape * 1000 + a, j0 = shape == 3 ? 4097 : a + shape;
                const float ps[3] = {0.1f, 0.5f, 0.93f};
                flashc_cpu_dropout d = {flashc_rand_u64(&rng), flashc_rand_u64(&rng), flashc_dropout_threshold(ps[a]),
                                        1.0f, row0s[pos], col0s[pos]};
                memset(keep, 0xa5, sizeof keep);
                bf->bf16->keep(cols, rows, keep, LDK, &d, i0, j0);
                for (int w = 0; w < WORDS; w++) {
                    const int rb = w / LDK, c = w % LDK;
                    if (c >= cols || 16 * rb >= rows) {
                        untouched += keep[w] != 0xa5a5;
                        continue;
                    }
                    for (int bit = 0; bit < 16; bit++) {
                        const int want = flashc_dropout_keep(d.seed, d.stream, d.row0 + i0 + 16 * rb + bit,
                                                             d.col0 + j0 + c, d.threshold);
                        bad += ((keep[w] >> bit) & 1) != want;
                    }
                }
            }
    CHECK(bad == 0, "keep masks (%s): %ld bits differ from dropout.h", bf->name, bad);
    CHECK(untouched == 0, "keep masks (%s): %ld words written outside the tile", bf->name, untouched);
    printf("kernels: keep masks of %s checked against dropout.h\n", bf->name);
}

/* ---- 3. the mask's statistics -------------------------------------------------------------------------- */

/* |count - n q| within 5 sigma of a binomial(n, q). */
static int within(long count, long n, double q, double *z) {
    const double mean = n * q, sd = sqrt(n * q * (1 - q));
    *z = (count - mean) / sd;
    return fabs(*z) <= 5.0;
}

static void test_statistics(void) {
    const int64_t B = 2, H = 3, Nq = 301, Nk = 517; /* odd sizes: partial groups of four columns */
    const size_t n = (size_t)(B * H * Nq * Nk);
    uint8_t *m = malloc(n), *m2 = malloc(n);
    if (!m || !m2) {
        CHECK(0, "out of memory");
        return;
    }
    const float ps[3] = {0.1f, 0.17f, 0.5f};
    for (int a = 0; a < 3; a++) {
        flashc_params prm = flashc_params_default();
        prm.dropout_p = ps[a];
        prm.dropout_seed = 0x123456789abcdefull + (uint64_t)a;
        prm.dropout_offset = 1000;
        CHECK(flashc_dropout_mask(&prm, B, H, Nq, Nk, m) == FLASHC_STATUS_OK, "dropout_mask: %s",
              flashc_context_last_error(NULL));
        const double q = 1.0 - flashc_dropout_threshold(ps[a]) / 4294967296.0;
        long kept = 0, res[4] = {0}, resn[4] = {0}, par[2] = {0}, parn[2] = {0};
        for (int64_t e = 0; e < (int64_t)n; e++) {
            const int64_t j = e % Nk, i = e / Nk % Nq;
            kept += m[e];
            res[j % 4] += m[e], resn[j % 4]++;
            par[i % 2] += m[e], parn[i % 2]++;
        }
        double z;
        CHECK(within(kept, (long)n, q, &z), "p %g: kept %ld of %zu, z = %.2f", (double)ps[a], kept, n, z);
        printf("statistics: p %.2f kept %.5f (expected %.5f, z %+.2f) of %zu\n", (double)ps[a], (double)kept / n, q,
               z, n);
        for (int r = 0; r < 4; r++)
            CHECK(within(res[r], resn[r], q, &z), "p %g: columns j %% 4 == %d, z = %.2f", (double)ps[a], r, z);
        for (int r = 0; r < 2; r++)
            CHECK(within(par[r], parn[r], q, &z), "p %g: rows of parity %d, z = %.2f", (double)ps[a], r, z);
        /* the next call's offset (advanced by B * H), and another seed: independent masks */
        for (int other = 0; other < 2; other++) {
            flashc_params p2 = prm;
            if (other == 0) p2.dropout_offset += (uint64_t)(B * H);
            else p2.dropout_seed ^= 1;
            CHECK(flashc_dropout_mask(&p2, B, H, Nq, Nk, m2) == FLASHC_STATUS_OK, "dropout_mask");
            long agree = 0;
            for (size_t e = 0; e < n; e++) agree += m[e] == m2[e];
            CHECK(within(agree, (long)n, q * q + (1 - q) * (1 - q), &z), "p %g: %s agrees in %ld of %zu, z = %.2f",
                  (double)ps[a], other ? "another seed" : "the next offset", agree, n, z);
        }
        /* (b, h) are streams offset + b * H + h: batch 1 equals batch 0 at offset + H */
        flashc_params p3 = prm;
        p3.dropout_offset += (uint64_t)H;
        CHECK(flashc_dropout_mask(&p3, 1, H, Nq, Nk, m2) == FLASHC_STATUS_OK, "dropout_mask");
        CHECK(!memcmp(m2, m + (size_t)(H * Nq * Nk), (size_t)(H * Nq * Nk)), "sequence 1 != sequence 0 at offset + H");
    }
    free(m);
    free(m2);
}

/* ---- 4. the applied mask, read back ------------------------------------------------------------------ */

typedef struct rcfg {
    const char *name;
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
    int64_t wl, wr;
    const int32_t *lens; /* varlen: B (nq, nk) pairs; NULL: fixed lengths */
    int bwd;             /* also read the backward's dV (needs Hkv == H, D >= Nq) */
} rcfg;

/* Whether key j is visible to query i (sequence of nq queries, nk keys) through causal / window. */
static int visible(const rcfg *c, int64_t i, int64_t j, int64_t nq, int64_t nk) {
    const int64_t diag = i + nk - nq, wr = c->causal ? 0 : c->wr;
    if (c->wl >= 0 && j < diag - c->wl) return 0;
    if (wr >= 0 && j > diag + wr) return 0;
    return 1;
}

/*
 * Runs c with V = identity (and dO = identity for the backward) and compares the kept entries with mask
 * (mB, H, mNq, mNk), sequence b of this run being mask batch b0 + b. Returns the mismatches, -1 when a call failed;
 * *checked counts the compared entries.
 */
static long reveal(flashc_context_t ctx, const rcfg *c, float p, uint64_t seed, uint64_t offset, int64_t b0,
                   const uint8_t *mask, int64_t mNq, int64_t mNk, uint64_t *rng, long *checked) {
    const int64_t H = c->H, Hkv = c->Hkv, D = c->D;
    int32_t cu_q[16] = {0}, cu_k[16] = {0};
    int64_t nb = c->B, rq = c->Nq, rk = c->Nk;
    if (c->lens) {
        for (int64_t b = 0; b < c->B; b++) {
            cu_q[b + 1] = cu_q[b] + c->lens[2 * b];
            cu_k[b + 1] = cu_k[b] + c->lens[2 * b + 1];
        }
        nb = 1, rq = cu_q[c->B], rk = cu_k[c->B];
    }
    const size_t nqe = (size_t)(nb * rq * H * D), nke = (size_t)(nb * rk * Hkv * D);
    float *q = malloc(nqe * 4), *k = malloc(nke * 4), *v = malloc(nke * 4), *o = malloc(nqe * 4),
          *lse = malloc((size_t)(nb * H * rq) * 4), *dout = malloc(nqe * 4), *dq = malloc(nqe * 4),
          *dk = malloc(nke * 4), *dv = malloc(nke * 4);
    long bad = -1;
    if (!q || !k || !v || !o || !lse || !dout || !dq || !dk || !dv) goto out;
    for (size_t e = 0; e < nqe; e++) q[e] = normal_f(rng, 0.7);
    for (size_t e = 0; e < nke; e++) k[e] = normal_f(rng, 0.7);
    memset(v, 0, nke * 4);
    memset(dout, 0, nqe * 4);
    for (int64_t b = 0; b < c->B; b++) { /* row j of each sequence's V is e_j, row i of its dO e_i */
        const int64_t tb = c->lens ? 0 : b, q0 = c->lens ? cu_q[b] : 0, k0 = c->lens ? cu_k[b] : 0;
        const int64_t nq = c->lens ? c->lens[2 * b] : c->Nq, nk = c->lens ? c->lens[2 * b + 1] : c->Nk;
        for (int64_t j = 0; j < nk; j++)
            for (int64_t hk = 0; hk < Hkv; hk++) v[((tb * rk + k0 + j) * Hkv + hk) * D + j] = 1.0f;
        for (int64_t i = 0; i < nq; i++)
            for (int64_t h = 0; h < H; h++) dout[((tb * rq + q0 + i) * H + h) * D + i] = 1.0f;
    }
    flashc_params prm = flashc_params_default();
    prm.causal = c->causal;
    prm.window_left = c->wl;
    prm.window_right = c->wr;
    prm.dropout_p = p;
    prm.dropout_seed = seed;
    prm.dropout_offset = offset;
    if (c->lens) {
        prm.cu_seqlens_q = cu_q;
        prm.cu_seqlens_k = cu_k;
        prm.num_seqs = c->B;
        prm.max_seqlen_q = c->Nq;
        prm.max_seqlen_k = c->Nk;
    }
    const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, nb, rq, H, D),
                        tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_F32, nb, rk, Hkv, D),
                        tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_F32, nb, rk, Hkv, D),
                        to = flashc_tensor_contiguous(o, FLASHC_DTYPE_F32, nb, rq, H, D),
                        tdo = flashc_tensor_contiguous(dout, FLASHC_DTYPE_F32, nb, rq, H, D),
                        tdq = flashc_tensor_contiguous(dq, FLASHC_DTYPE_F32, nb, rq, H, D),
                        tdk = flashc_tensor_contiguous(dk, FLASHC_DTYPE_F32, nb, rk, Hkv, D),
                        tdv = flashc_tensor_contiguous(dv, FLASHC_DTYPE_F32, nb, rk, Hkv, D);
    flashc_status st = flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0);
    if (st == FLASHC_STATUS_OK && c->bwd)
        st = flashc_backward(ctx, &tq, &tk, &tv, &to, &tdo, lse, &prm, &tdq, &tdk, &tdv, NULL, 0);
    if (st != FLASHC_STATUS_OK) {
        printf("    %s: %s: %s\n", c->name, flashc_status_string(st), flashc_context_last_error(ctx));
        goto out;
    }
    bad = 0;
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t tb = c->lens ? 0 : b, q0 = c->lens ? cu_q[b] : 0, k0 = c->lens ? cu_k[b] : 0;
        const int64_t nq = c->lens ? c->lens[2 * b] : c->Nq, nk = c->lens ? c->lens[2 * b + 1] : c->Nk;
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < nq; i++)
                for (int64_t j = 0; j < nk; j++) {
                    if (!visible(c, i, j, nq, nk)) continue;
                    const int want = mask[(((b0 + b) * H + h) * mNq + i) * mNk + j];
                    const int fwd = o[((tb * rq + q0 + i) * H + h) * D + j] != 0.0f;
                    bad += fwd != want;
                    ++*checked;
                    if (c->bwd) {
                        bad += (dv[((tb * rk + k0 + j) * Hkv + h) * D + i] != 0.0f) != want;
                        ++*checked;
                    }
                }
    }
out:
    free(q), free(k), free(v), free(o), free(lse), free(dout), free(dq), free(dk), free(dv);
    return bad;
}

static void test_reveal(flashc_context_t ctx, uint64_t seed) {
    static const int32_t lens[] = {40, 60, 0, 30, 100, 256, 17, 1}; /* (nq, nk) per sequence */
    static const rcfg cfgs[] = {
        {"tiles_gqa", 2, 150, 200, 4, 2, 256, 0, -1, -1, NULL, 0},
        {"tiles_window_bwd", 1, 130, 230, 1, 1, 256, 0, 37, 5, NULL, 1},
        {"tiles_causal_bwd_h3", 2, 200, 190, 3, 3, 208, 1, -1, -1, NULL, 1},
        {"decode_gqa4_causal", 2, 5, 250, 8, 2, 256, 1, -1, -1, NULL, 0},
        {"decode_n1", 3, 1, 256, 4, 1, 256, 0, -1, -1, NULL, 0},
        {"varlen_bwd", 4, 100, 256, 2, 2, 256, 0, -1, -1, lens, 1},
    };
    const float ps[2] = {0.17f, 0.5f};
    uint64_t rng = seed;
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
        const rcfg *c = &cfgs[ci];
        for (int a = 0; a < 2; a++) {
            const uint64_t dseed = flashc_rand_u64(&rng), offset = flashc_rand_u64(&rng);
            flashc_params prm = flashc_params_default();
            prm.dropout_p = ps[a];
            prm.dropout_seed = dseed;
            prm.dropout_offset = offset;
            uint8_t *mask = malloc((size_t)(c->B * c->H * c->Nq * c->Nk));
            if (!mask || flashc_dropout_mask(&prm, c->B, c->H, c->Nq, c->Nk, mask) != FLASHC_STATUS_OK) {
                CHECK(0, "%s: dropout_mask", c->name);
                free(mask);
                continue;
            }
            for (int threads = 1; threads <= 3; threads++) {
                flashc_context_set_threads(ctx, threads);
                long checked = 0;
                const long bad = reveal(ctx, c, ps[a], dseed, offset, 0, mask, c->Nq, c->Nk, &rng, &checked);
                CHECK(bad == 0, "%s p %g threads %d: %ld of %ld entries not flashc_dropout_mask's", c->name,
                      (double)ps[a], threads, bad, checked);
                if (threads == 1 && a == 0)
                    printf("reveal: %-22s %8ld entries (%s) equal to flashc_dropout_mask at 1-3 threads?\n", c->name,
                           checked, c->bwd ? "out and dV" : "out");
            }
            if (c->lens) { /* each sequence alone, at offset + b * H: the packed run's bits */
                flashc_context_set_threads(ctx, 2);
                for (int64_t b = 0; b < c->B; b++) {
                    if (c->lens[2 * b] == 0 || c->lens[2 * b + 1] == 0) continue;
                    rcfg one = *c;
                    one.name = "varlen sequence alone";
                    one.B = 1, one.lens = NULL, one.Nq = c->lens[2 * b], one.Nk = c->lens[2 * b + 1];
                    long checked = 0;
                    const long bad = reveal(ctx, &one, ps[a], dseed, offset + (uint64_t)(b * c->H), b, mask, c->Nq,
                                            c->Nk, &rng, &checked);
                    CHECK(bad == 0, "varlen sequence %lld alone at offset + b * H: %ld of %ld entries differ",
                          (long long)b, bad, checked);
                }
            }
            free(mask);
        }
    }
    flashc_context_set_threads(ctx, 0);
}

/* ---- 5. against the oracle --------------------------------------------------------------------------------- */

#define DCASE(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, used, sinks, page, \
              p)                                                                                                   \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, 1, used, sinks, page, p, 0, 0, \
     0}
/* ... with positions */
#define DPCASE(name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, used, sinks, page,   \
               p, qpos, kpos)                                                                                      \
    {name, dt, B, Nq, Nk, H, Hkv, D, causal, wl, wr, cap, alibi, bq, bk, varlen, layout, 1, used, sinks, page, p, 1,     \
     qpos, kpos}
#define F32 FLASHC_DTYPE_F32
#define F16 FLASHC_DTYPE_F16
#define BF16 FLASHC_DTYPE_BF16
#define BNHD FLASHC_LAYOUT_BNHD
#define BHND FLASHC_LAYOUT_BHND
#define PAD FLASHC_LAYOUT_PADDED

static const flashc_case oracle_cases[] = {
    DCASE("p0.1_f32_gqa", F32, 2, 113, 128, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.1f),
    DCASE("p0.17_f16_causal", F16, 2, 128, 255, 4, 4, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.17f),
    DCASE("p0.5_bf16_mqa_d128", BF16, 1, 255, 128, 4, 1, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.5f),
    DCASE("p0.2_f32_win_softcap_alibi", F32, 2, 200, 180, 4, 2, 96, 0, 40, 7, 10.0f, 2, 0, 0, 0, BNHD, 0, 0, 0, 0.2f),
    DCASE("p0.1_bf16_varlen_causal", BF16, 4, 128, 200, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 0, 0, 0, 0.1f),
    DCASE("p0.3_f16_used_sinks", F16, 3, 100, 255, 4, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 0.3f),
    DCASE("p0.1_f32_blockmask_bhnd", F32, 2, 150, 170, 2, 2, 32, 0, -1, -1, 0, 0, 24, 9, 0, BHND, 0, 0, 0, 0.1f),
    DCASE("p0.1_f32_paged16_used", F32, 2, 64, 300, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 16, 0.1f),
    DCASE("p0.1_bf16_dec_n1_gqa8", BF16, 3, 1, 1500, 16, 2, 128, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.1f),
    DCASE("p0.25_f32_dec_n7_pg64_cap", F32, 2, 7, 700, 8, 2, 64, 1, -1, -1, 20.0f, 0, 0, 0, 0, BNHD, 0, 1, 64, 0.25f),
    DCASE("p0.1_f16_padded_d256", F16, 1, 128, 128, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, PAD, 0, 0, 0, 0.1f),
    DCASE("p0.5_f32_n1x1_d8", F32, 2, 1, 1, 4, 1, 8, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.5f),
    DCASE("p0.6_f32_d32_long", F32, 1, 512, 700, 2, 1, 32, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.6f),
    DCASE("p0.1_bf16_all", BF16, 3, 255, 255, 4, 2, 64, 1, 90, -1, 8.0f, 2, 19, 29, 1, PAD, 0, 1, 0, 0.1f),
    DCASE("p0.1_f32_all", F32, 3, 128, 255, 4, 1, 96, 0, 60, 20, 8.0f, 2, 29, 19, 1, BHND, 1, 1, 0, 0.1f),
    /* positions: dropout's (i, j) at (q_position + i, k_position + j), on the tiles, the decode path and varlen */
    DPCASE("p0.2_f32_pos_causal_alibi", F32, 2, 150, 200, 4, 2, 64, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 0, 0, 0, 0.2f, 300,
           212),
    DPCASE("p0.1_bf16_pos_varlen_window", BF16, 3, 128, 200, 4, 2, 64, 0, 50, 10, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 0.1f,
           1100, 1000),
    DPCASE("p0.3_f32_pos_dec_n3_gqa", F32, 2, 3, 900, 8, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.3f, 5000,
           4096),
    DPCASE("p0.1_f32_pos_near_counter_end", F32, 1, 100, 120, 2, 2, 32, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0.1f,
           4294967196, 17179868864),
};

static void test_oracle(flashc_context_t ctx, uint64_t seed) {
    const size_t n = sizeof oracle_cases / sizeof oracle_cases[0];
    printf("%-28s %5s %3s %10s %10s %10s %10s  %s\n", "oracle case", "dtype", "thr", "err_out", "tol_out", "err_grad",
           "tol_grad", "verdict");
    for (int threads = 1; threads <= 2; threads++) {
        flashc_context_set_threads(ctx, threads);
        for (size_t i = 0; i < n; i++) {
            const flashc_case *c = &oracle_cases[i];
            flashc_case_result r;
            const int rc = flashc_case_run(ctx, c, seed * 7919u + i + 1000u * (unsigned)threads, &r);
            CHECK(rc == 0 && r.pass, "oracle %s at %d thread(s): %s", c->name, threads,
                  rc ? "could not be set up" : r.message);
            printf("%-28s %5s %3d %10.3g %10.3g %10.3g %10.3g  %s\n", c->name, flashc_dtype_name(c->dtype), threads,
                   r.err_out, r.tol_out, r.err_grad, r.tol_grad, rc == 0 && r.pass ? "PASS" : "FAIL");
        }
    }
    flashc_context_set_threads(ctx, 0);
}

/* ---- 6. finite differences in fp64 ------------------------------------------------------------------------ */

typedef struct gcase {
    const char *name;
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
    int64_t wl, wr;
    float softcap;
    int alibi, sinks;
    const int32_t *lens; /* varlen (nq, nk) pairs */
    float p;
} gcase;

static float grid_normal(uint64_t *rng) { return (float)(nearbyint(flashc_rand_normal(rng) * 4096.0) / 4096.0); }

static double rel_max(const double *a, const double *b, int64_t n) {
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs(a[i] - b[i]);
        if (!(d <= e)) e = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return m > 0 ? e / m : e;
}

static double rel_norm_f(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void test_gradcheck(flashc_context_t ctx, uint64_t seed) {
    static const int32_t lens[] = {3, 5, 0, 4, 6, 2, 5, 7};
    static const gcase cases[] = {
        {"plain", 2, 5, 7, 2, 2, 4, 0, -1, -1, 0, 0, 0, NULL, 0.3f},
        {"causal_gqa", 1, 9, 6, 4, 2, 5, 1, -1, -1, 0, 0, 0, NULL, 0.5f},
        {"window_softcap_alibi", 2, 8, 8, 2, 1, 4, 0, 2, 1, 1.5f, 1, 0, NULL, 0.2f},
        {"varlen_sinks", 4, 6, 7, 2, 2, 4, 0, -1, -1, 0, 0, 1, lens, 0.4f},
        {"sinks_causal_p0.1", 2, 7, 5, 4, 2, 3, 1, -1, -1, 0, 0, 1, NULL, 0.1f},
    };
    const double fd_tol = 1e-5, out_tol = 1e-5, grad_tol = 1e-4;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const gcase *c = &cases[ci];
        uint64_t rng = seed * 1000003u + ci;
        int32_t cu_q[8] = {0}, cu_k[8] = {0};
        int64_t nb = c->B, rq = c->Nq, rk = c->Nk;
        if (c->lens) {
            for (int64_t b = 0; b < c->B; b++) {
                cu_q[b + 1] = cu_q[b] + c->lens[2 * b];
                cu_k[b + 1] = cu_k[b] + c->lens[2 * b + 1];
            }
            nb = 1, rq = cu_q[c->B], rk = cu_k[c->B];
        }
        const int64_t nqe = nb * rq * c->H * c->D, nke = nb * rk * c->Hkv * c->D, nl = nb * c->H * rq;
        float *q = malloc((size_t)nqe * 4), *k = malloc((size_t)nke * 4), *v = malloc((size_t)nke * 4),
              *o = malloc((size_t)nqe * 4), *dout = malloc((size_t)nqe * 4), *dq = malloc((size_t)nqe * 4),
              *dk = malloc((size_t)nke * 4), *dv = malloc((size_t)nke * 4), *lse = malloc((size_t)nl * 4);
        double *ref[3], *fd[3], *ref_out = malloc((size_t)nqe * 8), *tmp = malloc((size_t)nqe * 8);
        float slopes[8], sinks[8], dsinks[8];
        const int64_t nel[3] = {nqe, nke, nke};
        for (int t = 0; t < 3; t++) ref[t] = malloc((size_t)nel[t] * 8), fd[t] = malloc((size_t)nel[t] * 8);
        for (int64_t e = 0; e < nqe; e++) q[e] = grid_normal(&rng), dout[e] = grid_normal(&rng);
        for (int64_t e = 0; e < nke; e++) k[e] = grid_normal(&rng), v[e] = grid_normal(&rng);
        for (int h = 0; h < 8; h++) slopes[h] = 0.25f + 0.125f * h, sinks[h] = grid_normal(&rng);
        flashc_params prm = flashc_params_default();
        prm.causal = c->causal;
        prm.window_left = c->wl;
        prm.window_right = c->wr;
        prm.softcap = c->softcap;
        if (c->alibi) prm.alibi_slopes = slopes;
        if (c->sinks) prm.sinks = sinks, prm.dsinks = dsinks;
        prm.dropout_p = c->p;
        prm.dropout_seed = flashc_rand_u64(&rng);
        prm.dropout_offset = flashc_rand_u64(&rng);
        if (c->lens) {
            prm.cu_seqlens_q = cu_q, prm.cu_seqlens_k = cu_k, prm.num_seqs = c->B;
            prm.max_seqlen_q = c->Nq, prm.max_seqlen_k = c->Nk;
        }
        const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, nb, rq, c->H, c->D),
                            tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_F32, nb, rk, c->Hkv, c->D),
                            tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_F32, nb, rk, c->Hkv, c->D),
                            to = flashc_tensor_contiguous(o, FLASHC_DTYPE_F32, nb, rq, c->H, c->D),
                            tdo = flashc_tensor_contiguous(dout, FLASHC_DTYPE_F32, nb, rq, c->H, c->D),
                            tdq = flashc_tensor_contiguous(dq, FLASHC_DTYPE_F32, nb, rq, c->H, c->D),
                            tdk = flashc_tensor_contiguous(dk, FLASHC_DTYPE_F32, nb, rk, c->Hkv, c->D),
                            tdv = flashc_tensor_contiguous(dv, FLASHC_DTYPE_F32, nb, rk, c->Hkv, c->D);
        flashc_problem p;
        int ok = q && k && v && o && dout && dq && dk && dv && lse && ref_out && tmp;
        for (int t = 0; t < 3; t++) ok = ok && ref[t] && fd[t];
        ok = ok && flashc_problem_build(NULL, FLASHC_OP_BACKWARD, &tq, &tk, &tv, &prm, &to, lse, &tdo, &tdq, &tdk,
                                        &tdv, &p) == FLASHC_STATUS_OK;
        ok = ok && flashc_ref_backward(&p, FLASHC_DTYPE_F32, ref[0], ref[1], ref[2]) == 0 &&
             flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref_out, NULL) == 0;
        if (!ok) {
            CHECK(0, "gradcheck %s could not be set up: %s", c->name, flashc_context_last_error(NULL));
            goto next;
        }
        /* central differences of L = sum(out * dout), the oracle's forward, at exactly representable points */
        const float hstep = 1.0f / 1024.0f;
        float *in[3] = {q, k, v};
        double err_fd[3], err_sink_fd = 0, err_sink_lib = 0, dsink_ref[8];
        for (int t = 0; t < 3; t++) {
            for (int64_t e = 0; e < nel[t]; e++) {
                const float x = in[t][e];
                double l[2];
                for (int s = 0; s < 2; s++) {
                    in[t][e] = s ? x - hstep : x + hstep;
                    flashc_ref_forward(&p, FLASHC_DTYPE_F32, tmp, NULL);
                    l[s] = 0;
                    for (int64_t f = 0; f < nqe; f++) l[s] += tmp[f] * dout[f];
                }
                in[t][e] = x;
                fd[t][e] = (l[0] - l[1]) / (2.0 * hstep);
            }
            err_fd[t] = rel_max(fd[t], ref[t], nel[t]);
        }
        if (c->sinks) {
            double fds[8];
            flashc_ref_sinks_grad(&p, dsink_ref, NULL);
            for (int64_t h = 0; h < c->H; h++) {
                const float x = sinks[h];
                double l[2];
                for (int s = 0; s < 2; s++) {
                    sinks[h] = s ? x - hstep : x + hstep;
                    flashc_ref_forward(&p, FLASHC_DTYPE_F32, tmp, NULL);
                    l[s] = 0;
                    for (int64_t f = 0; f < nqe; f++) l[s] += tmp[f] * dout[f];
                }
                sinks[h] = x;
                fds[h] = (l[0] - l[1]) / (2.0 * hstep);
            }
            err_sink_fd = rel_max(fds, dsink_ref, c->H);
        }
        /* the library's fp32 forward and backward */
        double err_lib[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
        flashc_status st = flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0);
        if (st == FLASHC_STATUS_OK)
            st = flashc_backward(ctx, &tq, &tk, &tv, &to, &tdo, lse, &prm, &tdq, &tdk, &tdv, NULL, 0);
        if (st == FLASHC_STATUS_OK) {
            err_lib[0] = rel_norm_f(o, ref_out, nqe);
            err_lib[1] = rel_norm_f(dq, ref[0], nqe);
            err_lib[2] = rel_norm_f(dk, ref[1], nke);
            err_lib[3] = rel_norm_f(dv, ref[2], nke);
            if (c->sinks) err_sink_lib = rel_norm_f(dsinks, dsink_ref, c->H);
        }
        int pass = st == FLASHC_STATUS_OK && err_lib[0] <= out_tol && err_sink_fd <= fd_tol &&
                   err_sink_lib <= grad_tol;
        for (int t = 0; t < 3; t++) pass &= err_fd[t] <= fd_tol && err_lib[t + 1] <= grad_tol;
        CHECK(pass, "gradcheck %s: fd %.2e %.2e %.2e sinks %.2e, library %.2e %.2e %.2e %.2e sinks %.2e (%s)", c->name,
              err_fd[0], err_fd[1], err_fd[2], err_sink_fd, err_lib[0], err_lib[1], err_lib[2], err_lib[3],
              err_sink_lib, st == FLASHC_STATUS_OK ? "ok" : flashc_context_last_error(ctx));
        printf("gradcheck %-22s p %.2f  fd vs oracle %.1e %.1e %.1e  library out %.1e grads %.1e %.1e %.1e  %s\n",
               c->name, (double)c->p, err_fd[0], err_fd[1], err_fd[2], err_lib[0], err_lib[1], err_lib[2], err_lib[3],
               pass ? "PASS" : "FAIL");
    next:
        for (int t = 0; t < 3; t++) free(ref[t]), free(fd[t]);
        free(q), free(k), free(v), free(o), free(dout), free(dq), free(dk), free(dv), free(lse), free(ref_out),
            free(tmp);
    }
}

/* ---- 7. p = 0, bad p, CUDA ------------------------------------------------------------------------------- */

typedef struct fixture {
    int64_t B, Nq, Nk, H, Hkv, D;
    float *q, *k, *v, *o, *dout, *dq, *dk, *dv, *lse;
    flashc_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv;
    size_t nqe, nke, nl;
} fixture;

static int fixture_make(fixture *f, int64_t B, int64_t Nq, int64_t Nk, int64_t H, int64_t Hkv, int64_t D,
                        uint64_t *rng) {
    memset(f, 0, sizeof *f);
    f->B = B, f->Nq = Nq, f->Nk = Nk, f->H = H, f->Hkv = Hkv, f->D = D;
    f->nqe = (size_t)(B * Nq * H * D), f->nke = (size_t)(B * Nk * Hkv * D), f->nl = (size_t)(B * H * Nq);
    f->q = malloc(f->nqe * 4), f->dout = malloc(f->nqe * 4), f->o = malloc(f->nqe * 4), f->dq = malloc(f->nqe * 4);
    f->k = malloc(f->nke * 4), f->v = malloc(f->nke * 4), f->dk = malloc(f->nke * 4), f->dv = malloc(f->nke * 4);
    f->lse = malloc(f->nl * 4);
    if (!f->q || !f->dout || !f->o || !f->dq || !f->k || !f->v || !f->dk || !f->dv || !f->lse) return -1;
    for (size_t e = 0; e < f->nqe; e++) f->q[e] = normal_f(rng, 1.0), f->dout[e] = normal_f(rng, 1.0);
    for (size_t e = 0; e < f->nke; e++) f->k[e] = normal_f(rng, 1.0), f->v[e] = normal_f(rng, 1.0);
    f->tq = flashc_tensor_contiguous(f->q, FLASHC_DTYPE_F32, B, Nq, H, D);
    f->to = flashc_tensor_contiguous(f->o, FLASHC_DTYPE_F32, B, Nq, H, D);
    f->tdo = flashc_tensor_contiguous(f->dout, FLASHC_DTYPE_F32, B, Nq, H, D);
    f->tdq = flashc_tensor_contiguous(f->dq, FLASHC_DTYPE_F32, B, Nq, H, D);
    f->tk = flashc_tensor_contiguous(f->k, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    f->tv = flashc_tensor_contiguous(f->v, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    f->tdk = flashc_tensor_contiguous(f->dk, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    f->tdv = flashc_tensor_contiguous(f->dv, FLASHC_DTYPE_F32, B, Nk, Hkv, D);
    return 0;
}

static void fixture_free(fixture *f) {
    free(f->q), free(f->k), free(f->v), free(f->o), free(f->dout), free(f->dq), free(f->dk), free(f->dv), free(f->lse);
}

static void poison(fixture *f) {
    memset(f->o, 0xff, f->nqe * 4), memset(f->dq, 0xff, f->nqe * 4), memset(f->lse, 0xff, f->nl * 4);
    memset(f->dk, 0xff, f->nke * 4), memset(f->dv, 0xff, f->nke * 4);
}

static int all_poison(const void *x, size_t bytes) {
    const unsigned char *c = x;
    for (size_t i = 0; i < bytes; i++)
        if (c[i] != 0xff) return 0;
    return 1;
}

/* forward then backward; the outputs copied into snap (o, lse, dq, dk, dv back to back) */
static flashc_status run_both(flashc_context_t ctx, fixture *f, const flashc_params *prm, unsigned char *snap) {
    flashc_status st = flashc_forward(ctx, &f->tq, &f->tk, &f->tv, prm, &f->to, f->lse, NULL, 0);
    if (st == FLASHC_STATUS_OK)
        st = flashc_backward(ctx, &f->tq, &f->tk, &f->tv, &f->to, &f->tdo, f->lse, prm, &f->tdq, &f->tdk, &f->tdv,
                             NULL, 0);
    if (snap) {
        memcpy(snap, f->o, f->nqe * 4), snap += f->nqe * 4;
        memcpy(snap, f->lse, f->nl * 4), snap += f->nl * 4;
        memcpy(snap, f->dq, f->nqe * 4), snap += f->nqe * 4;
        memcpy(snap, f->dk, f->nke * 4), snap += f->nke * 4;
        memcpy(snap, f->dv, f->nke * 4);
    }
    return st;
}

static void test_edges(flashc_context_t ctx, uint64_t seed) {
    uint64_t rng = seed ^ 0x5eed;
    const int64_t shapes[2][6] = {{2, 70, 90, 4, 2, 64}, {2, 3, 500, 8, 2, 32}}; /* the tile path, the decode path */
    for (int s = 0; s < 2; s++) {
        fixture f;
        if (fixture_make(&f, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], shapes[s][4], shapes[s][5],
                         &rng)) {
            CHECK(0, "out of memory");
            fixture_free(&f);
            continue;
        }
        const size_t bytes = (2 * f.nqe + 2 * f.nke + f.nl) * 4;
        unsigned char *base = malloc(bytes), *other = malloc(bytes);
        flashc_params plain = flashc_params_default();
        plain.causal = 1;
        CHECK(base && other && run_both(ctx, &f, &plain, base) == FLASHC_STATUS_OK, "no-dropout run");
        /* p = 0 with a seed and offset; p = 1e-12, whose threshold is 0 (nothing dropped, scale 1/(1 - p) = 1) */
        const float ps[2] = {0.0f, 1e-12f};
        for (int a = 0; a < 2; a++) {
            flashc_params prm = plain;
            prm.dropout_p = ps[a];
            prm.dropout_seed = 99;
            prm.dropout_offset = 12345;
            poison(&f);
            const flashc_status st = run_both(ctx, &f, &prm, other);
            CHECK(st == FLASHC_STATUS_OK && base && other && !memcmp(base, other, bytes),
                  "shape %d: p = %g is not bit for bit no dropout", s, (double)ps[a]);
        }
        /* bad p: refused, a message naming it, nothing written */
        const float bad[5] = {NAN, -0.25f, 1.0f, 1.5f, INFINITY};
        for (int a = 0; a < 5; a++) {
            flashc_params prm = plain;
            prm.dropout_p = bad[a];
            poison(&f);
            flashc_status st = flashc_forward(ctx, &f.tq, &f.tk, &f.tv, &prm, &f.to, f.lse, NULL, 0);
            CHECK(st == FLASHC_STATUS_INVALID_ARGUMENT && strstr(flashc_context_last_error(ctx), "dropout_p"),
                  "forward with dropout_p %g: %s (%s)", (double)bad[a], flashc_status_string(st),
                  flashc_context_last_error(ctx));
            memcpy(f.lse, base + f.nqe * 4, f.nl * 4); /* a valid lse for the backward */
            st = flashc_backward(ctx, &f.tq, &f.tk, &f.tv, &f.to, &f.tdo, f.lse, &prm, &f.tdq, &f.tdk, &f.tdv, NULL, 0);
            CHECK(st == FLASHC_STATUS_INVALID_ARGUMENT && strstr(flashc_context_last_error(ctx), "dropout_p"),
                  "backward with dropout_p %g: %s", (double)bad[a], flashc_status_string(st));
            CHECK(all_poison(f.o, f.nqe * 4) && all_poison(f.dq, f.nqe * 4) && all_poison(f.dk, f.nke * 4) &&
                      all_poison(f.dv, f.nke * 4),
                  "dropout_p %g: an output was written", (double)bad[a]);
            CHECK(flashc_supported(ctx, FLASHC_OP_FORWARD, &f.tq, &f.tk, &f.tv, &prm) ==
                      FLASHC_STATUS_INVALID_ARGUMENT,
                  "supported with dropout_p %g", (double)bad[a]);
            uint8_t m[16];
            memset(m, 0xab, sizeof m);
            CHECK(flashc_dropout_mask(&prm, 1, 1, 4, 4, m) == FLASHC_STATUS_INVALID_ARGUMENT &&
                      strstr(flashc_context_last_error(NULL), "dropout_p") && m[0] == 0xab &&
                      m[15] == 0xab,
                  "dropout_mask with dropout_p %g", (double)bad[a]);
        }
        free(base);
        free(other);
        fixture_free(&f);
    }
    /* flashc_dropout_mask's own arguments */
    flashc_params prm = flashc_params_default();
    prm.dropout_p = 0.1f;
    uint8_t m[64];
    CHECK(flashc_dropout_mask(NULL, 1, 1, 1, 1, m) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: params NULL");
    CHECK(flashc_dropout_mask(&prm, 1, 1, 1, 1, NULL) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: mask NULL");
    CHECK(flashc_dropout_mask(&prm, 0, 1, 1, 1, m) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: B 0");
    CHECK(flashc_dropout_mask(&prm, 1, 1, -3, 1, m) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: Nq -3");
    CHECK(flashc_dropout_mask(&prm, INT64_MAX, 2, 1, 1, m) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: size overflow");
    flashc_params odd = prm;
    odd.struct_size = 3;
    CHECK(flashc_dropout_mask(&odd, 1, 1, 1, 1, m) == FLASHC_STATUS_INVALID_ARGUMENT, "mask: struct_size 3");
    prm.dropout_p = 0.0f;
    memset(m, 7, sizeof m);
    CHECK(flashc_dropout_mask(&prm, 2, 2, 4, 4, m) == FLASHC_STATUS_OK && m[0] == 1 && m[63] == 1,
          "mask: p 0 keeps all");

    /* the CUDA backend takes dropout, forward and backward (tests/gpu_dropout.cu checks its mask and results) */
    if (flashc_device_count(FLASHC_BACKEND_CUDA) > 0) {
        flashc_context_t gpu = NULL;
        if (flashc_context_create(&gpu, FLASHC_BACKEND_CUDA, 0) == FLASHC_STATUS_OK) {
            flashc_tensor q = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_BF16, 1, 128, 4, 64);
            flashc_params d = flashc_params_default();
            d.dropout_p = 0.1f;
            for (int op = 0; op < 2; op++) {
                const flashc_status st = flashc_supported(gpu, (flashc_op)op, &q, &q, &q, &d);
                CHECK(st == FLASHC_STATUS_OK, "CUDA %s with dropout: %s (%s)", op ? "backward" : "forward",
                      flashc_status_string(st), flashc_context_last_error(gpu));
            }
            flashc_context_destroy(gpu);
        }
    }
}

int main(void) {
    const char *env = getenv("FLASHC_SEED");
    const uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL);
    printf("test_dropout: FLASHC_SEED=%" PRIu64 "\n", seed);
    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "cannot create a CPU context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    test_philox();
    test_kernels();
    test_statistics();
    test_reveal(ctx, seed);
    test_oracle(ctx, seed);
    test_gradcheck(ctx, seed);
    test_edges(ctx, seed);
    flashc_context_destroy(ctx);
    printf("test_dropout: %d of %d checks passed (FLASHC_SEED=%" PRIu64 ")\n", checks - failures, checks, seed);
    return failures ? 1 : 0;
}
