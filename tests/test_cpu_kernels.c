/*
 * The CPU microkernels against plain double-precision loops: gemm with both A layouts and ragged tile edges,
 * the online-softmax step (key-major and row-major), decode's dot products, and the vector exp2's accuracy in ulp
 * over [-126, 127] (every 61st float of [-30, 0] by bit pattern, about 18 million inputs, and a dense sweep
 * elsewhere), for every kernel set this CPU runs.
 */
#include "cpu/cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Under sanitizers every check runs ~50x slower: sample the exp2 range more thinly there. */
#if defined(__SANITIZE_ADDRESS__)
#  define EXP2_STRIDE 6007u
#else
#  define EXP2_STRIDE 61u
#endif

static int failures;
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                                          \
            printf("\n");                                                                                          \
            failures++;                                                                                            \
        }                                                                                                          \
    } while (0)

static uint64_t state = 88172645463325252ull;
static float frand(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (float)((state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ulp distance between two non-negative finite floats. */
static uint32_t ulp_dist(float a, float b) {
    uint32_t x = bits(a), y = bits(b);
    return x > y ? x - y : y - x;
}

static void test_gemm(const flashc_cpu_kernels *k) {
    static const int shapes[][3] = {{1, 1, 1}, {6, 16, 8}, {12, 32, 64}, {7, 17, 5}, {64, 64, 128}, {13, 59, 111},
                                    {64, 128, 64}, {5, 3, 256}, {33, 47, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int m = shapes[s][0], n = shapes[s][1], kk = shapes[s][2];
        for (int trans = 0; trans < 2; trans++)
            for (int acc = 0; acc < 2; acc++) {
                const int lda = (trans ? m : kk) + 3, ldb = n + 5, ldc = n + 2;
                float *a = malloc(sizeof(float) * (size_t)lda * (trans ? kk : m));
                float *b = malloc(sizeof(float) * (size_t)ldb * kk);
                float *c = malloc(sizeof(float) * (size_t)ldc * m);
                double *ref = malloc(sizeof(double) * (size_t)m * n);
                for (int i = 0; i < lda * (trans ? kk : m); i++) a[i] = frand();
                for (int i = 0; i < ldb * kk; i++) b[i] = frand();
                for (int i = 0; i < ldc * m; i++) c[i] = frand();
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double x = acc ? c[i * ldc + j] : 0.0;
                        for (int p = 0; p < kk; p++)
                            x += (double)(trans ? a[p * lda + i] : a[i * lda + p]) * b[p * ldb + j];
                        ref[i * n + j] = x;
                    }
                /* Columns past n in each C row must be left alone. */
                const float sentinel = c[ldc - 1];
                k->gemm(m, n, kk, a, trans ? 1 : lda, trans ? lda : 1, b, ldb, c, ldc, acc);
                double err = 0.0;
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) err = fmax(err, fabs(c[i * ldc + j] - ref[i * n + j]));
                CHECK(err <= 1e-5 * (kk + 1), "%s gemm m=%d n=%d k=%d trans=%d acc=%d: max error %g", k->name, m, n,
                      kk, trans, acc, err);
                CHECK(c[ldc - 1] == sentinel, "%s gemm m=%d n=%d k=%d wrote past n", k->name, m, n, kk);
                free(a), free(b), free(c), free(ref);
            }
    }
}

static void test_softmax(const flashc_cpu_kernels *k) {
    enum { COLS = 37, ROWS = 32 };
    float st[COLS * ROWS], m[ROWS], l[ROWS], alpha[ROWS];
    double m_ref[ROWS], l_ref[ROWS];
    for (int r = 0; r < ROWS; r++) {
        m[r] = m_ref[r] = r % 3 == 0 ? -INFINITY : frand() * 4.0f;
        l[r] = (float)(l_ref[r] = m[r] == -INFINITY ? 0.0 : 1.0 + frand() * 0.5);
    }
    for (int i = 0; i < COLS * ROWS; i++) st[i] = frand() * 8.0f;
    for (int c = 0; c < COLS; c++) st[c * ROWS + 5] = -INFINITY; /* row 5 sees nothing in this tile */
    for (int c = 0; c < COLS; c++) st[c * ROWS + 6] = -INFINITY; /* row 6 neither, and had nothing before */
    m[6] = -INFINITY, l[6] = 0.0f, m_ref[6] = -INFINITY, l_ref[6] = 0.0;
    float orig[COLS * ROWS];
    memcpy(orig, st, sizeof st);
    k->softmax(COLS, ROWS, st, ROWS, m, l, alpha);
    for (int r = 0; r < ROWS; r++) {
        double mx = m_ref[r];
        for (int c = 0; c < COLS; c++) mx = fmax(mx, orig[c * ROWS + r]);
        if (mx == -INFINITY) {
            CHECK(m[r] == -INFINITY && l[r] == 0.0f && alpha[r] == 1.0f, "%s softmax empty row %d", k->name, r);
            for (int c = 0; c < COLS; c++) CHECK(st[c * ROWS + r] == 0.0f, "%s softmax empty row %d p != 0", k->name, r);
            continue;
        }
        double a = exp2(m_ref[r] - mx), sum = 0.0;
        for (int c = 0; c < COLS; c++) {
            double p = exp2(orig[c * ROWS + r] - mx);
            sum += p;
            CHECK(fabs(st[c * ROWS + r] - p) <= 1e-6 * (p + 1e-30) + 1e-37, "%s softmax p[%d][%d] %g vs %g", k->name,
                  c, r, st[c * ROWS + r], p);
        }
        CHECK(fabs(alpha[r] - a) <= 1e-6 * a + 1e-37, "%s softmax alpha[%d] %g vs %g", k->name, r, alpha[r], a);
        CHECK(fabs(l[r] - (l_ref[r] * a + sum)) <= 1e-5 * (l_ref[r] * a + sum), "%s softmax l[%d]", k->name, r);
        CHECK(m[r] == (float)mx, "%s softmax m[%d]", k->name, r);
    }
}

/* Decode scores: every row against every key, ragged key groups and D tails; K rows carry NaN past D (read in place,
 * so the tail must be masked), and nothing past cols in a score row is written. */
static void test_dots(const flashc_cpu_kernels *k) {
    static const int shapes[][3] = {{1, 1, 1}, {4, 8, 32}, {4, 64, 128}, {3, 13, 59}, {8, 17, 7}, {64, 64, 256},
                                    {5, 1, 16}, {2, 9, 9}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int rows = shapes[i][0], cols = shapes[i][1], D = shapes[i][2];
        const int ldq = (D + 15) / 16 * 16, ldk = D + 5, lds = cols + 3;
        float *q = malloc(sizeof(float) * (size_t)rows * ldq), *kk = malloc(sizeof(float) * (size_t)cols * ldk);
        float *s = malloc(sizeof(float) * (size_t)rows * lds);
        for (int r = 0; r < rows; r++)
            for (int d = 0; d < ldq; d++) q[r * ldq + d] = d < D ? frand() : 0.0f;
        for (int c = 0; c < cols; c++)
            for (int d = 0; d < ldk; d++) kk[c * ldk + d] = d < D ? frand() : NAN;
        for (int j = 0; j < rows * lds; j++) s[j] = 12345.0f;
        k->dots(rows, cols, D, q, ldq, kk, ldk, s, lds);
        double err = 0.0;
        int past = 0;
        for (int r = 0; r < rows; r++) {
            for (int c = 0; c < cols; c++) {
                double x = 0.0;
                for (int d = 0; d < D; d++) x += (double)q[r * ldq + d] * kk[c * ldk + d];
                err = fmax(err, fabs(s[r * lds + c] - x)); /* a NaN makes fmax keep err: counted below */
                if (!(fabs(s[r * lds + c] - x) <= 1e-5 * (D + 1))) past++;
            }
            for (int c = cols; c < lds; c++) past += s[r * lds + c] != 12345.0f;
        }
        CHECK(past == 0 && err <= 1e-5 * (D + 1), "%s dots rows=%d cols=%d D=%d: max error %g, %d bad elements",
              k->name, rows, cols, D, err, past);
        free(q), free(kk), free(s);
    }
}

/* The row-major online-softmax step: as test_softmax, with rows along memory; fn is k->softmax_rows, or
 * k->softmax_rows_p16 (P to bf16's need) with its P held to ptol relative instead of 1e-6. */
static void test_softmax_rows(const flashc_cpu_kernels *k, flashc_cpu_softmax_rows_fn fn, double ptol) {
    enum { ROWS = 7, COLS = 48, LDS = 64 };
    float s[ROWS * LDS], orig[ROWS * LDS], m[ROWS], l[ROWS], alpha[ROWS];
    double m_ref[ROWS], l_ref[ROWS];
    for (int r = 0; r < ROWS; r++) {
        m[r] = (float)(m_ref[r] = r % 3 == 0 ? -INFINITY : frand() * 4.0f);
        l[r] = (float)(l_ref[r] = m[r] == -INFINITY ? 0.0 : 1.0 + frand() * 0.5);
        for (int c = 0; c < LDS; c++) s[r * LDS + c] = c < 41 ? frand() * 8.0f : -INFINITY; /* padding from 41 */
    }
    for (int c = 0; c < COLS; c++) s[1 * LDS + c] = -INFINITY; /* row 1 sees nothing in this tile */
    for (int c = 0; c < COLS; c++) s[3 * LDS + c] = -INFINITY; /* row 3 neither, and had nothing before */
    memcpy(orig, s, sizeof s);
    fn(ROWS, COLS, s, LDS, m, l, alpha);
    for (int r = 0; r < ROWS; r++) {
        double mx = m_ref[r];
        for (int c = 0; c < COLS; c++) mx = fmax(mx, orig[r * LDS + c]);
        if (mx == -INFINITY) {
            CHECK(m[r] == -INFINITY && l[r] == 0.0f && alpha[r] == 1.0f, "%s softmax_rows empty row %d", k->name, r);
            for (int c = 0; c < COLS; c++) CHECK(s[r * LDS + c] == 0.0f, "%s softmax_rows empty row %d p != 0", k->name, r);
            continue;
        }
        double a = exp2(m_ref[r] - mx), sum = 0.0;
        for (int c = 0; c < COLS; c++) {
            double p = exp2(orig[r * LDS + c] - mx);
            sum += p;
            CHECK(fabs(s[r * LDS + c] - p) <= ptol * (p + 1e-30) + 1e-37, "%s softmax_rows p[%d][%d] %g vs %g",
                  k->name, r, c, s[r * LDS + c], p);
        }
        CHECK(fabs(alpha[r] - a) <= 1e-6 * a + 1e-37, "%s softmax_rows alpha[%d] %g vs %g", k->name, r, alpha[r], a);
        CHECK(fabs(l[r] - (l_ref[r] * a + sum)) <= 1e-5 * (l_ref[r] * a + sum), "%s softmax_rows l[%d]", k->name, r);
        CHECK(m[r] == (float)mx, "%s softmax_rows m[%d]", k->name, r);
        for (int c = COLS; c < LDS; c++) CHECK(s[r * LDS + c] == orig[r * LDS + c], "%s softmax_rows wrote past cols", k->name);
    }
    /* A NaN score is skipped by the max but makes its row's sum NaN. */
    float x[16], mm = 0.0f, ll = 1.0f, aa;
    for (int c = 0; c < 16; c++) x[c] = c == 3 ? NAN : (float)c;
    fn(1, 16, x, 16, &mm, &ll, &aa);
    CHECK(mm == 15.0f && isnan(ll), "%s softmax_rows with a NaN score: m %g, l %g", k->name, mm, ll);
}

/*
 * softmax_rows_p16's 2^x (exp2_avx512.h, flashc_exp2_p16_avx512) against exp2 in double: rows whose first score is
 * 0 and m 0, so that P = 2^s, over every 61st float of [-30, 0] and a sweep of [-126, -30]: the largest relative
 * error where 2^s is a normal float, and 0 at -inf and below -150. Returns that error.
 */
static double test_exp2_p16(const flashc_cpu_kernels *k) {
    enum { CHUNK = 4096 };
    static float x[CHUNK], y[CHUNK];
    double worst = 0.0;
    float worst_x = 0.0f;
    long count = 0;
    uint32_t u = bits(-30.0f);
    for (int s = 0, done = 0; !done; s++) {
        int n = 1;
        x[0] = 0.0f;
        for (; n < CHUNK; n++) {
            if (s < 64) {
                x[n] = -126.0f + 96.0f * (float)(s * CHUNK + n) / (64.0f * CHUNK);
            } else if (u < 0x80000000u + EXP2_STRIDE) { /* past -0 */
                done = 1;
                break;
            } else {
                memcpy(&x[n], &u, 4);
                u -= EXP2_STRIDE;
            }
        }
        for (int i = n; i < (n + 15) / 16 * 16; i++) x[i] = i % 2 ? -INFINITY : -1000.0f;
        float m = 0.0f, l = 0.0f, a;
        memcpy(y, x, sizeof x);
        k->softmax_rows_p16(1, (n + 15) / 16 * 16, y, CHUNK, &m, &l, &a);
        for (int i = 0; i < n; i++) {
            const double want = exp2((double)x[i]), e = fabs(y[i] - want) / want;
            if (e > worst) worst = e, worst_x = x[i];
        }
        for (int i = n; i < (n + 15) / 16 * 16; i++)
            CHECK(y[i] == 0.0f, "%s softmax_rows_p16: 2^%g = %g", k->name, x[i], y[i]);
        CHECK(y[0] == 1.0f, "%s softmax_rows_p16: 2^0 = %.9g", k->name, y[0]);
        count += n;
    }
    printf("%-8s softmax_rows_p16's exp2: max relative error %.3g at x = %.9g over %ld inputs in [-126, 0]\n", k->name,
           worst, worst_x, count);
    return worst;
}

/* Max ulp error of k->exp2 against exp2 in double rounded to float, over inputs where 2^x is a normal float. */
static uint32_t test_exp2(const flashc_cpu_kernels *k) {
    enum { CHUNK = 4096 };
    float x[CHUNK], y[CHUNK];
    uint32_t worst = 0;
    float worst_x = 0.0f;
    long count = 0;
    /* [-30, 0], where softmax lives after subtracting the max, by bit pattern; then a sweep to the ends */
    uint32_t u = bits(-30.0f);
    int done = 0;
    while (!done) {
        int n = 0;
        for (; n < CHUNK; n++) {
            if (u < 0x80000000u + EXP2_STRIDE) { /* past -0 */
                done = 1;
                break;
            }
            memcpy(&x[n], &u, 4);
            u -= EXP2_STRIDE; /* negative floats: smaller patterns are closer to zero */
        }
        k->exp2(n, x, y);
        for (int i = 0; i < n; i++) {
            uint32_t d = ulp_dist(y[i], (float)exp2((double)x[i]));
            if (d > worst) worst = d, worst_x = x[i];
        }
        count += n;
    }
    for (int s = 0; s < 64; s++) {
        for (int i = 0; i < CHUNK; i++) x[i] = -126.0f + 253.0f * (float)(s * CHUNK + i) / (64.0f * CHUNK);
        k->exp2(CHUNK, x, y);
        for (int i = 0; i < CHUNK; i++) {
            uint32_t d = ulp_dist(y[i], (float)exp2((double)x[i]));
            if (d > worst) worst = d, worst_x = x[i];
        }
        count += CHUNK;
    }
    /* special values: exact 1 at 0, zero for masked (-inf) and far-negative inputs */
    float sx[5] = {0.0f, -INFINITY, -127.0f, -1000.0f, 1.0f}, sy[5];
    k->exp2(5, sx, sy);
    CHECK(sy[0] == 1.0f, "%s exp2(0) = %g", k->name, sy[0]);
    CHECK(sy[1] == 0.0f && sy[3] == 0.0f, "%s exp2(-inf) = %g, exp2(-1000) = %g", k->name, sy[1], sy[3]);
    CHECK(sy[2] >= 0.0f && sy[2] < 1e-37f, "%s exp2(-127) = %g", k->name, sy[2]);
    CHECK(sy[4] == 2.0f, "%s exp2(1) = %g", k->name, sy[4]);
    printf("%-8s exp2: max error %u ulp at x = %.9g over %ld inputs in [-126, 127]\n", k->name, worst, worst_x, count);
    return worst;
}

int main(void) {
    static const char *names[] = {"generic", "avx2", "avx512"};
    for (int i = 0; i < 3; i++) {
        const flashc_cpu_kernels *k = flashc_cpu_kernels_by_name(names[i]);
        if (!k) {
            printf("%-8s not available on this CPU/build, skipped\n", names[i]);
            continue;
        }
        test_gemm(k);
        test_softmax(k);
        test_dots(k);
        test_softmax_rows(k, k->softmax_rows, 1e-6);
        /* The vector exp2 is stated to be within 2 ulp; libm's exp2f (generic) within 1. */
        uint32_t worst = test_exp2(k);
        CHECK(worst <= 2, "%s exp2 max error %u ulp > 2", k->name, worst);
    }
    /* The avx512bf16 set's softmax_rows for P that pv rounds to bf16 (its other kernels here are avx512's) */
    const flashc_cpu_kernels *b = flashc_cpu_kernels_by_name("avx512bf16");
    if (b && b->softmax_rows_p16) {
        const double worst = test_exp2_p16(b);
        CHECK(worst <= 3.2e-6, "%s softmax_rows_p16's exp2: relative error %.3g > 3.2e-6", b->name, worst);
        test_softmax_rows(b, b->softmax_rows_p16, 3.2e-6);
    } else {
        printf("avx512bf16 not available on this CPU/build: softmax_rows_p16 not tested\n");
    }
    printf("test_cpu_kernels: %s\n", failures ? "FAILED" : "all passed");
    return failures != 0;
}
