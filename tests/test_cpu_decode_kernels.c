/*
 * Decode's two in-place kernels against plain double-precision loops, for every kernel set this CPU runs:
 *   dots_kv: scores of query rows against K rows read in place as fp32 or bf16 (ragged key groups, odd row counts,
 *            D tails; K rows carry NaN past D, so a read past D shows; nothing past cols is written; fp32 scores are
 *            dots' bit for bit; with a prefetch list too);
 *   pv:      O = alpha O + P V with V rows read in place as fp32 or bf16 (NaN past D), alpha 0, 1 and between, O
 *            past D left alone.
 * Both take their rows through a table of addresses (decode's paged caches): half the cases name the rows in memory
 * order, half in reverse, so a kernel that reads row c at first row + c * stride shows.
 * bf16 inputs are compared with the reference on the same bf16 values (the kernels widen them exactly). The
 * avx512bf16 set takes bf16 rows on vdpbf16ps: its dots_kv splits q into two bf16 terms, or one when q holds bf16
 * values (both cases run: q of fp32 values without the prefetch list, of bf16 values with it; within the same bound),
 * its pv rounds P to bf16 first, so its bf16 pv is checked against the reference on P so rounded.
 */
#include "cpu/cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                                          \
            printf("\n");                                                                                          \
            failures++;                                                                                            \
        }                                                                                                          \
    } while (0)

static uint64_t state = 0x2545f4914f6cdd1dull;
static float frand(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (float)((state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

/* The addresses of rows 0 .. rows - 1 of x (row pitch ld elements of es bytes): tab[c] row c, or row rows - 1 - c
 * when reversed. */
static const void **row_table(const void *x, int rows, int ld, int es, int reversed) {
    const void **tab = malloc(sizeof(void *) * (size_t)(rows > 0 ? rows : 1));
    for (int c = 0; c < rows; c++) tab[c] = (const char *)x + (size_t)(reversed ? rows - 1 - c : c) * ld * es;
    return tab;
}

/* rows x ld K-like rows of random values in [-1, 1) for d < D, NaN past D, as fp32 (kt 0) or bf16 (kt 1); vals
 * receives the values as fp32 (what the kernels must see). */
static void *kv_rows(int kt, int rows, int D, int ld, float *vals) {
    void *x = malloc((size_t)rows * ld * (kt ? 2 : 4));
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < ld; d++) {
            const float f = d < D ? frand() : NAN;
            if (kt) {
                ((uint16_t *)x)[r * ld + d] = flashc_f32_to_bf16(f);
                vals[r * ld + d] = flashc_bf16_to_f32(flashc_f32_to_bf16(f));
            } else {
                ((float *)x)[r * ld + d] = f;
                vals[r * ld + d] = f;
            }
        }
    return x;
}

static void test_dots_kv(const flashc_cpu_kernels *k) {
    static const int shapes[][3] = {{1, 1, 1},  {4, 16, 32}, {4, 32, 32},  {4, 32, 128}, {3, 13, 59}, {8, 17, 7},
                                    {5, 9, 16}, {2, 9, 9},   {7, 31, 64},  {6, 25, 40},  {1, 8, 256}, {9, 3, 24},
                                    {4, 32, 96}, {2, 33, 48}, {1, 40, 33}, {12, 20, 256}, {21, 37, 32}, {17, 5, 20}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int kt = 0; kt < 2; kt++)
            for (int use_pf = 0; use_pf < 2; use_pf++) {
                const int qb = use_pf; /* q of bf16 values (decode's unscaled bf16 queries) with the prefetch list */
                const int rows = shapes[i][0], cols = shapes[i][1], D = shapes[i][2];
                const int ldq = (D + 15) / 16 * 16, ldk = D + 5, lds = cols + 3;
                float *q = malloc(sizeof(float) * (size_t)rows * ldq), *kv = malloc(sizeof(float) * (size_t)cols * ldk);
                float *s = malloc(sizeof(float) * (size_t)rows * lds), *s2 = malloc(sizeof(float) * (size_t)rows * lds);
                for (int r = 0; r < rows; r++)
                    for (int d = 0; d < ldq; d++) {
                        const float x = d < D ? 4.0f * frand() : 0.0f;
                        q[r * ldq + d] = qb ? flashc_bf16_to_f32(flashc_f32_to_bf16(x)) : x;
                    }
                void *kk = kv_rows(kt, cols, D, ldk, kv);
                for (int j = 0; j < rows * lds; j++) s[j] = s2[j] = 12345.0f;
                const int es = kt ? 2 : 4, rev = (int)(i % 2); /* reversed: row c of the table at memory row kr(c) */
                const void **tab = row_table(kk, cols, ldk, es, rev);
                const flashc_cpu_prefetch pf = {{tab, tab}, {0, 0}, cols, {D * es, D * es}, (int)(i / 2 % 2)};
                k->dots_kv(rows, cols, D, q, ldq, tab, kt ? FLASHC_CPU_KV_BF16 : FLASHC_CPU_KV_F32, s, lds,
                           use_pf ? &pf : NULL);
                double err = 0.0;
                int bad = 0;
                for (int r = 0; r < rows; r++) {
                    for (int c = 0; c < cols; c++) {
                        double x = 0.0;
                        const int kr = rev ? cols - 1 - c : c;
                        for (int d = 0; d < D; d++) x += (double)q[r * ldq + d] * kv[kr * ldk + d];
                        const double e = fabs(s[r * lds + c] - x);
                        if (e > err) err = e;
                        if (!(e <= 4e-5 * (D + 1))) bad++;
                    }
                    for (int c = cols; c < lds; c++) bad += s[r * lds + c] != 12345.0f;
                }
                CHECK(bad == 0,
                      "%s dots_kv %s rows=%d cols=%d D=%d pf=%d q bf16=%d reversed=%d: max error %g, %d bad elements",
                      k->name, kt ? "bf16" : "f32", rows, cols, D, use_pf, qb, rev, err, bad);
                if (!kt && !rev) { /* fp32: dots' scores bit for bit */
                    k->dots(rows, cols, D, q, ldq, (const float *)kk, ldk, s2, lds);
                    CHECK(memcmp(s, s2, sizeof(float) * (size_t)rows * lds) == 0,
                          "%s dots_kv f32 rows=%d cols=%d D=%d differs from dots", k->name, rows, cols, D);
                }
                free(q), free(kv), free(s), free(s2), free(kk), free(tab);
            }
}

static void test_pv(const flashc_cpu_kernels *k) {
    static const int shapes[][3] = {{1, 1, 1},  {4, 16, 32}, {4, 32, 32}, {4, 32, 128}, {3, 13, 59}, {8, 17, 7},
                                    {5, 9, 16}, {2, 9, 9},   {7, 31, 64}, {6, 25, 40},  {1, 8, 256}, {9, 3, 24},
                                    {4, 32, 96}, {2, 33, 48}, {1, 70, 33}, {12, 130, 256}, {5, 0, 32}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int vt = 0; vt < 2; vt++) {
            const int rows = shapes[i][0], cols = shapes[i][1], D = shapes[i][2];
            const int ldp = cols + 3, ldv = D + 7, ldo = (D + 15) / 16 * 16 + 16;
            float *p = malloc(sizeof(float) * (size_t)rows * ldp), *vv = malloc(sizeof(float) * (size_t)cols * ldv);
            float *o = malloc(sizeof(float) * (size_t)rows * ldo), *o0 = malloc(sizeof(float) * (size_t)rows * ldo);
            float *alpha = malloc(sizeof(float) * (size_t)rows);
            for (int r = 0; r < rows; r++) {
                alpha[r] = r % 3 == 0 ? 1.0f : r % 3 == 1 ? 0.0f : 0.5f * (frand() + 1.0f);
                for (int c = 0; c < ldp; c++) p[r * ldp + c] = c < cols ? 0.5f * (frand() + 1.0f) : NAN;
                for (int d = 0; d < ldo; d++) o[r * ldo + d] = o0[r * ldo + d] = d < D ? 4.0f * frand() : 777.0f;
            }
            void *v = kv_rows(vt, cols, D, ldv, vv);
            const int p_bf16 = vt && !strncmp(k->name, "avx512bf16", 10); /* P rounded to bf16 before P V */
            const int rev = (int)(i % 2);
            const void **tab = row_table(v, cols, ldv, vt ? 2 : 4, rev);
            k->pv(rows, cols, D, p, ldp, alpha, tab, vt ? FLASHC_CPU_KV_BF16 : FLASHC_CPU_KV_F32, o, ldo);
            double err = 0.0;
            int bad = 0;
            for (int r = 0; r < rows; r++)
                for (int d = 0; d < ldo; d++) {
                    if (d >= D) {
                        bad += o[r * ldo + d] != 777.0f;
                        continue;
                    }
                    double x = (double)alpha[r] * o0[r * ldo + d], mag = fabs(x);
                    for (int c = 0; c < cols; c++) {
                        const float pr = p[r * ldp + c], pc = p_bf16 ? flashc_bf16_to_f32(flashc_f32_to_bf16(pr)) : pr;
                        const int vr = rev ? cols - 1 - c : c;
                        x += (double)pc * vv[vr * ldv + d];
                        mag += fabs((double)pc * vv[vr * ldv + d]);
                    }
                    const double e = fabs(o[r * ldo + d] - x);
                    if (e > err) err = e;
                    if (!(e <= 1e-6 * (mag + 1.0))) bad++;
                }
            CHECK(bad == 0, "%s pv %s rows=%d cols=%d D=%d reversed=%d: max error %g, %d bad elements", k->name,
                  vt ? "bf16" : "f32", rows, cols, D, rev, err, bad);
            free(p), free(vv), free(o), free(o0), free(alpha), free(v), free(tab);
        }
}

int main(void) {
    static const char *names[] = {"generic", "avx2", "avx512", "avx512bf16"};
    for (int i = 0; i < 4; i++) {
        const flashc_cpu_kernels *k = flashc_cpu_kernels_by_name(names[i]);
        if (!k) {
            printf("%-8s not available on this CPU/build, skipped\n", names[i]);
            continue;
        }
        test_dots_kv(k);
        test_pv(k);
        printf("%-8s dots_kv, pv checked\n", names[i]);
    }
    printf("test_cpu_decode_kernels: %s\n", failures ? "FAILED" : "all passed");
    return failures != 0;
}
