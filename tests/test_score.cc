/*
 * test_score.cc - the shared score and mask step of the CUDA kernels (src/cuda/score.h), on the host: every GPU
 * kernel forms its scores, its band, its block mask and its tile ranges through these functions, so a new score
 * modifier or mask is tested here first, against plain definitions:
 *   - fc_score / fc_bwd_elem (fc_exact_math) against the formulas in double: scale, softcap and its derivative,
 *     ALiBi, P and dS;
 *   - fc_keeps and fc_row_keys (the same band, two forms) against the band's definition, element by element, at
 *     fc_diag's alignments (bottom-right, and positions before, inside and past the keys);
 *   - fc_key_tiles, fc_query_rows, fc_query_tiles and fc_band_cuts against brute force over every element of the
 *     tiles;
 *   - fc_bm_scan and the block-mask addressing against the bytes, over every thread split.
 * Exhaustive over small sizes and every window pair, so no case is drawn at random. Plain C++17, no CUDA.
 */
#include "cuda/score.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <vector>

static int failures = 0;
#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            if (failures < 20) {                                                                             \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                  \
                printf(__VA_ARGS__);                                                                         \
                printf("\n");                                                                                \
            }                                                                                                \
            failures++;                                                                                      \
        }                                                                                                    \
    } while (0)

/* The kernel arguments' score and mask fields, as launch.h fills them. */
struct args {
    FC_SCORE_FIELDS;
};

static args make_args(double scale, double softcap, int wl, int wr) {
    args a = {};
    if (softcap > 0) {
        a.score_mul = (float)(scale / softcap);
        a.softcap2 = (float)(softcap * 1.4426950408889634);
    } else {
        a.score_mul = (float)(scale * 1.4426950408889634);
        a.softcap2 = 0.f;
    }
    a.win_left = wl, a.win_right = wr;
    return a;
}

/* The band by definition: row i keeps key j < nk with i + diag - wl <= j <= i + diag + wr (-1: unbounded). */
static bool band_keeps(int wl, int wr, int i, int j, int diag, int nk) {
    return j >= 0 && j < nk && (wl < 0 || j >= i + diag - wl) && (wr < 0 || j <= i + diag + wr);
}

static void test_scores(void) {
    const double scales[] = {0.125, 0.0883883, 1.0}, caps[] = {0.0, 5.0, 30.0}, slopes[] = {0.0, 0.25};
    const double raws[] = {-40.0, -3.5, -0.01, 0.0, 0.7, 12.0, 300.0};
    for (double scale : scales)
        for (double cap : caps)
            for (double slope : slopes)
                for (double s : raws) {
                    const args a = make_args(scale, cap, -1, -1);
                    const int dist = 7; /* i + diag - j */
                    /* natural-log score and its derivative */
                    double x = s * scale, dcap = 1.0;
                    if (cap > 0) {
                        const double th = tanh(x / cap);
                        x = cap * th;
                        dcap = 1.0 - th * th;
                    }
                    x -= slope * dist;
                    float dc;
                    const float x2 = fc_score<fc_exact_math>(a, (float)s, dc) - fc_alibi((float)(slope * FC_LOG2E), dist);
                    CHECK(fabs(x2 / FC_LOG2E - x) <= 1e-5 * (1 + fabs(x)), "score s %g scale %g cap %g: %g vs %g", s,
                          scale, cap, x2 / FC_LOG2E, x);
                    CHECK(fabs(dc - dcap) <= 1e-6, "softcap derivative %g vs %g", dc, dcap);
                    CHECK(fc_score_plain(a) == (cap == 0), "fc_score_plain with softcap %g", cap);
                    /* the backward's element: P = exp(x - lse), dS = P (dP - D) dcap; an lse at or above the
                     * row's scores, as the forward's is */
                    const double lse = x + 0.5, dpv = 0.75, dv = -0.3;
                    float p = (float)s, ds = (float)dpv;
                    fc_bwd_elem<fc_exact_math>(a, p, ds, (float)(lse * FC_LOG2E), (float)dv,
                                               fc_alibi((float)(slope * FC_LOG2E), dist), true);
                    const double pr = exp(x - lse), dsr = pr * (dpv - dv) * dcap;
                    CHECK(fabs(p - pr) <= 2e-5 * pr + 1e-30, "P %g vs %g (s %g cap %g)", p, pr, s, cap);
                    CHECK(fabs(ds - dsr) <= 2e-5 * fabs(pr) * (fabs(dpv - dv) + 1) + 1e-30, "dS %g vs %g", ds, dsr);
                    float p0 = (float)s, ds0 = (float)dpv;
                    fc_bwd_elem<fc_exact_math>(a, p0, ds0, 0.f, 0.f, 0.f, false);
                    CHECK(p0 == 0.f && ds0 == 0.f, "a masked element gives P = dS = 0");
                }
}

/* The band of one (nq, nk, window) at a's alignment (fc_diag): fc_keeps, fc_row_keys, fc_key_tiles, fc_band_cuts
 * fc_query_rows and fc_query_tiles against the definition, element by element (and fc_keeps_lr,
 * fc_band_cuts_lr, the same tests with the sides passed apart). */
static void check_band(const args &a, int nq, int nk, int wl, int wr) {
    const int diag = fc_diag(a, nq, nk);
    for (int i = 0; i < nq; i++) {
        int jlo, jhi;
        fc_row_keys(a, i, diag, nk, jlo, jhi);
        for (int j = 0; j < nk + 2; j++) {
            const bool want = band_keeps(wl, wr, i, j, diag, nk);
            CHECK(fc_keeps(a, i, j, diag, nk) == want, "fc_keeps i %d j %d nq %d nk %d wl %d wr %d", i, j, nq,
                  nk, wl, wr);
            CHECK(fc_keeps_lr(a, wl, wr, i, j, diag, nk) == want, "fc_keeps_lr i %d j %d nq %d nk %d wl %d wr %d", i,
                  j, nq, nk, wl, wr);
            CHECK((j >= jlo && j <= jhi) == want, "fc_row_keys i %d j %d nq %d nk %d wl %d wr %d", i, j,
                  nq, nk, wl, wr);
        }
    }
    /* Tiles: every (row tile, key tile) pair of sizes 1..4 x 1..4. */
    for (int br = 1; br <= 4; br++)
        for (int bc = 1; bc <= 4; bc++)
            for (int i0 = 0; i0 < nq; i0 += br) {
                const int i1 = (i0 + br < nq ? i0 + br : nq) - 1;
                int tb, te;
                fc_key_tiles(a, i0, i1, diag, nk, bc, &tb, &te);
                int first = -1, last = -1; /* the key tiles with some kept element */
                for (int t = 0; t * bc < nk; t++) {
                    const int j0 = t * bc, j1 = j0 + bc - 1;
                    bool any = false, all = true;
                    for (int i = i0; i <= i1; i++)
                        for (int j = j0; j <= j1; j++) {
                            const bool k = band_keeps(wl, wr, i, j, diag, nk);
                            any |= k;
                            all &= k;
                        }
                    if (any && first < 0) first = t;
                    if (any) last = t;
                    /* a tile the band or the end cuts must be masked element by element */
                    if (any && !all)
                        CHECK(fc_band_cuts(a, i0, i1, j0, j1, diag, nk) &&
                                  fc_band_cuts_lr(a, wl, wr, i0, i1, j0, j1, diag, nk),
                              "fc_band_cuts / _lr miss a cut tile");
                    if (all)
                        CHECK(!fc_band_cuts(a, i0, i1, j0, j1, diag, nk) &&
                                  !fc_band_cuts_lr(a, wl, wr, i0, i1, j0, j1, diag, nk),
                              "fc_band_cuts / _lr: uncut tile");
                }
                if (first < 0) {
                    CHECK(tb >= te, "fc_key_tiles: rows %d..%d see no key, got [%d, %d)", i0, i1, tb, te);
                } else {
                    /* the range covers every tile with a kept key; those between are kept too
                     * (the band is an interval per row that moves by one key per row) */
                    CHECK(tb == first && te == last + 1, "fc_key_tiles rows %d..%d: [%d, %d) vs [%d, %d]",
                          i0, i1, tb, te, first, last);
                }
            }
    /* The reverse: query rows that a key range meets. */
    for (int j0 = 0; j0 < nk; j0++)
        for (int j1 = j0; j1 < nk; j1++) {
            int lo, hi, blo = -1, bhi = -2;
            fc_query_rows(a, j0, j1, diag, nq, &lo, &hi);
            for (int i = 0; i < nq; i++)
                for (int j = j0; j <= j1; j++)
                    if (band_keeps(wl, wr, i, j, diag, nk)) {
                        if (blo < 0) blo = i;
                        bhi = i;
                    }
            if (blo < 0)
                CHECK(lo > hi, "fc_query_rows keys %d..%d: rows %d..%d, none see them", j0, j1, lo, hi);
            else
                CHECK(lo == blo && hi == bhi, "fc_query_rows keys %d..%d: %d..%d vs %d..%d", j0, j1, lo,
                      hi, blo, bhi);
            /* Its tile form (the wgmma backward's walk) at tiles of 1..4 rows: the tiles of those rows, or with
             * no row at all at most one tile (whose elements the band then masks). */
            for (int bm = 1; bm <= 4; bm++) {
                int tlo, thi;
                const int n = fc_query_tiles(a, wl, wr, j0, j1, diag, nq, bm, &tlo, &thi);
                if (blo < 0)
                    CHECK(n <= 1, "fc_query_tiles keys %d..%d bm %d: %d tiles, no row sees them", j0, j1, bm, n);
                else
                    CHECK(n == thi - tlo + 1 && tlo == blo / bm && thi == bhi / bm,
                          "fc_query_tiles keys %d..%d bm %d: %d tiles [%d, %d] vs rows %d..%d", j0, j1, bm, n, tlo,
                          thi, blo, bhi);
            }
        }
}

/* With positions every sequence's diag is pos_diag (q_position - k_position): before the keys, inside them and past
 * them; without, nk - nq. */
static const int pos_diags[] = {-12, -5, -1, 0, 3, 8, 13};

static void test_band(void) {
    const int npos = (int)(sizeof pos_diags / sizeof pos_diags[0]);
    for (int nq = 1; nq <= 9; nq++)
        for (int nk = 0; nk <= 9; nk++)
            for (int wl = -1; wl <= 10; wl++)
                for (int wr = -1; wr <= 10; wr++)
                    for (int pos = -1; pos < npos; pos++) { /* -1: no positions */
                        args a = make_args(1, 0, wl, wr);
                        a.positions = pos >= 0;
                        a.pos_diag = pos >= 0 ? pos_diags[pos] : 0;
                        CHECK(fc_diag(a, nq, nk) == (pos >= 0 ? pos_diags[pos] : nk - nq), "fc_diag nq %d nk %d pos %d",
                              nq, nk, pos);
                        check_band(a, nq, nk, wl, wr);
                    }
}

static void test_block_mask(void) {
    const int B = 2, H = 3, nq = 11, nk = 13;
    for (int bq = 1; bq <= 5; bq++)
        for (int bk = 1; bk <= 5; bk++)
            for (int per_bh = 0; per_bh < 2; per_bh++) {
                args a = make_args(1, 0, -1, -1);
                a.bm_q = bq, a.bm_k = bk, a.bm_nqb = (nq + bq - 1) / bq, a.bm_nkb = (nk + bk - 1) / bk;
                a.bm_batch = per_bh ? B : 1, a.bm_heads = per_bh ? H : 1;
                std::vector<uint8_t> bytes((size_t)a.bm_batch * a.bm_heads * a.bm_nqb * a.bm_nkb);
                uint32_t r = 12345u + bq * 31 + bk;
                for (auto &v : bytes) v = (r = r * 1103515245u + 12345u) >> 30 == 0; /* about a quarter kept */
                a.bm = bytes.data();
                for (int b = 0; b < B; b++)
                    for (int h = 0; h < H; h++) {
                        const uint8_t *base = fc_bm_base(a, b, h);
                        const size_t off = ((size_t)(per_bh ? b : 0) * a.bm_heads + (per_bh ? h : 0)) * a.bm_nqb * a.bm_nkb;
                        CHECK(base == bytes.data() + off, "fc_bm_base (%d, %d)", b, h);
                        for (int i = 0; i < nq; i++)
                            for (int j = 0; j < nk; j++)
                                CHECK(fc_bm_keeps(a, fc_bm_row(a, base, i), j) == (base[(i / bq) * a.bm_nkb + j / bk] != 0),
                                      "fc_bm_keeps (%d, %d)", i, j);
                        for (int i0 = 0; i0 < nq; i0 += 3)
                            for (int j0 = 0; j0 < nk; j0 += 4) {
                                const int i1 = i0 + 2 < nq ? i0 + 2 : nq - 1, j1 = j0 + 3 < nk ? j0 + 3 : nk - 1;
                                int on_want = 0, off_want = 0;
                                for (int i = i0; i <= i1; i++)
                                    for (int j = j0; j <= j1; j++) {
                                        on_want |= base[(i / bq) * a.bm_nkb + j / bk] != 0;
                                        off_want |= base[(i / bq) * a.bm_nkb + j / bk] == 0;
                                    }
                                for (int nt = 1; nt <= 5; nt++) {
                                    int on = 0, off = 0;
                                    for (int tid = 0; tid < nt; tid++) fc_bm_scan(a, base, i0, i1, j0, j1, tid, nt, &on, &off);
                                    CHECK(on == on_want && off == off_want, "fc_bm_scan rows %d..%d keys %d..%d, %d threads",
                                          i0, i1, j0, j1, nt);
                                }
                            }
                    }
            }
}

int main(void) {
    test_scores();
    test_band();
    test_block_mask();
    if (failures) {
        printf("test_score: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_score: ok (scores, band, tile ranges, block mask)\n");
    return 0;
}
