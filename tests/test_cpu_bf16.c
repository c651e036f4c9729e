/*
 * test_cpu_bf16: bf16 on dot-product instructions (AVX512-BF16 vdpbf16ps, the "avx512bf16" kernel set), forward and
 * backward.
 *
 *  1. The set is the default on a CPU with AVX512-BF16 (unless FLASHC_CPU_KERNELS forces another), and the fp32 sets
 *     stay selectable by name.
 *  2. Its kernels against double loops: the pair gemm in the two A layouts the forward passes (K's bf16 rows at any
 *     row stride, odd ones giving unaligned pairs; P's pair rows), ragged tile edges, alpha and accumulate, within the
 *     bound of fp32 summation; the pair rows of fp32 (rounded to nearest even, with a leading zero row and an odd
 *     row count) and the plain conversion bit for bit against flashc_f32_to_bf16, the pair rows of bf16 rows bit for
 *     bit.
 *  3. bf16 forwards through the library on this set against the fp64 oracle (CONVENTIONS.md: max |ours - ref| <=
 *     2 max |naive_bf16 - ref| + 1e-5), at 1 and 2 threads, on shapes that put pairs at odd offsets: windows whose
 *     tiles start on the second key of a pair, split-KV pieces, odd D (K copied and padded), odd key counts, paged
 *     K/V with blocks across pages (copied), strided views, softcap, ALiBi, dropout, sinks, GQA (one case with its
 *     backward; tests/test_cpu_bwd_blocks.c runs its backward cases on this set too).
 *  4. The driver's fp32 O and gradients before the store against fp64 within bounds derived from the bf16 rounding of
 *     P (and dS), much tighter than the rule of 3. (test_direct, test_direct_backward say how.)
 *
 * The same on the "amx" set (AMX-BF16 tiles for the pair gemm, kernels_amx.c), whose gemm is also held bit for bit
 * to a scalar model of the SDM's TDPBF16PS (test_amx_bits), with `test_cpu_bf16 amx` under
 * FLASHC_CPU_KERNELS=amx (ctest's test_cpu_bf16_amx): on AMX hardware, or anywhere in a FLASHC_CPU_AMX_EMULATE build.
 * Where the CPU or the compiler lacks AVX512-BF16 (or AMX) it says so and passes: there bf16 runs on the fp32 kernels
 * (or the avx512bf16 set), which the other CPU tests cover. Fresh inputs every run (the seed is printed;
 * FLASHC_SEED=<n> replays).
 */
#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures;
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                                          \
            printf("\n");                                                                                          \
            failures++;                                                                                            \
        }                                                                                                          \
    } while (0)

static uint64_t rng;
/* A normal value times 2^e, e in [-6, 6]: several binades, never subnormal. */
static float value(void) {
    const int e = (int)(flashc_rand_u64(&rng) % 13) - 6;
    return ldexpf((float)flashc_rand_normal(&rng), e);
}
static uint16_t bf16_value(void) { return flashc_f32_to_bf16(value()); }

/* ---- kernels ------------------------------------------------------------------------------------------------ */

/*
 * C (+)= alpha A B over k pairs, A's pair (i, p) at a + i rs + p cs. layout 0: K's rows (rs = 2k + pad, cs = 2);
 * layout 1: P's pair rows (rs = 2, cs = 2 (m + pad)).
 */
static void test_gemm(const flashc_cpu_kernels *kern) {
    static const int shapes[][3] = {{1, 1, 1},   {12, 32, 64}, {7, 17, 5},  {13, 59, 55}, {64, 128, 64},
                                    {128, 64, 32}, {5, 3, 128}, {33, 47, 1}, {25, 80, 40}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int layout = 0; layout < 2; layout++)
            for (int acc = 0; acc < 2; acc++) {
                const int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
                const int64_t rs = layout ? 2 : 2 * k + 1, cs = layout ? 2 * (m + 3) : 2;
                const int64_t a_len = layout ? cs * k : rs * m + 1, ldb = 2 * (n + 5), ldc = n + 2;
                const float alpha = acc ? 1.0f : 0.37f;
                uint16_t *a = malloc(2 * (size_t)a_len), *b = malloc(2 * (size_t)(ldb * k));
                float *c = malloc(sizeof(float) * (size_t)(ldc * m)), *c0 = malloc(sizeof(float) * (size_t)(ldc * m));
                for (int64_t i = 0; i < a_len; i++) a[i] = bf16_value();
                for (int64_t i = 0; i < ldb * k; i++) b[i] = bf16_value();
                for (int64_t i = 0; i < ldc * m; i++) c[i] = c0[i] = value();
                kern->bf16->gemm(m, n, k, a, rs, cs, b, ldb, c, ldc, alpha, acc);
                double worst = 0.0;
                int outside = 0;
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < ldc; j++) {
                        if (j >= n) { /* past the n columns: untouched */
                            outside |= memcmp(&c[i * ldc + j], &c0[i * ldc + j], sizeof(float)) != 0;
                            continue;
                        }
                        double ref = 0.0, mag = 0.0;
                        for (int p = 0; p < k; p++)
                            for (int e = 0; e < 2; e++) {
                                const double x = flashc_bf16_to_f32(a[i * rs + p * cs + e]) *
                                                 (double)flashc_bf16_to_f32(b[p * ldb + 2 * j + e]);
                                ref += x, mag += fabs(x);
                            }
                        ref *= alpha, mag *= alpha;
                        if (acc) ref += c0[i * ldc + j], mag += fabs(c0[i * ldc + j]);
                        /* fp32 summation of 2k + 1 terms (the products of bf16 are exact in fp32), then alpha */
                        const double err = fabs(c[i * ldc + j] - ref) / ((2.0 * k + 3.0) * 0x1p-24 * mag + 1e-30);
                        if (err > worst) worst = err;
                    }
                CHECK(worst <= 1.0 && !outside,
                      "bf16 gemm m %d n %d k %d layout %d acc %d: error %.2f of the fp32 summation bound%s", m, n, k,
                      layout, acc, worst, outside ? ", wrote past n" : "");
                free(a), free(b), free(c), free(c0);
            }
}

/*
 * The amx set's gemm bit for bit against a scalar model of TDPBF16PS as the Intel SDM states it: per element one fp32
 * chain over the pairs in order, c = fma(a0, b0, c) then c = fma(a1, b1, c), each rounded to nearest even, bf16
 * denormal inputs read as 0 and denormal results flushed to 0; the chain starts from C where the gemm accumulates in
 * the tiles (whole 32 x 32 blocks, alpha 1), else from 0 and then alpha * sum (+ C) as the vdpbf16ps gemm does.
 * Inputs include bf16 denormals and products below FLT_MIN. Under FLASHC_CPU_AMX_EMULATE this checks the kernel
 * drives the tiles as intended; on AMX hardware a mismatch means the hardware's rounding differs from the SDM's text
 * (and the emulation): reported, not failed, since the error bound of test_gemm still holds.
 */
static float sdm_bf16(uint16_t x) { return flashc_bf16_to_f32((x & 0x7f80u) == 0 ? (uint16_t)(x & 0x8000u) : x); }
static float sdm_ftz(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }
static uint16_t odd_bf16(void) {
    const uint64_t r = flashc_rand_u64(&rng) % 16;
    if (r == 0) return (uint16_t)(flashc_rand_u64(&rng) % 0x7f + 1) | (r & 1 ? 0x8000u : 0); /* a denormal */
    if (r == 1) return flashc_f32_to_bf16(ldexpf((float)flashc_rand_normal(&rng), -66)); /* products < FLT_MIN */
    return bf16_value();
}
static void test_amx_bits(const flashc_cpu_kernels *kern) {
    static const struct { int m, n, k, acc; float alpha; } shapes[] = {{64, 64, 32, 1, 1.0f},  {64, 96, 48, 0, 1.0f},
                                                                       {40, 50, 37, 0, 0.37f}, {33, 17, 5, 1, 0.5f},
                                                                       {32, 64, 64, 0, 0.0625f}};
    const int emulated = strstr(kern->name, "emulated") != NULL;
    long total = 0, differ = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int layout = 0; layout < 2; layout++) {
            const int m = shapes[si].m, n = shapes[si].n, k = shapes[si].k, acc = shapes[si].acc;
            const float alpha = shapes[si].alpha;
            const int64_t rs = layout ? 2 : 2 * k + 2, cs = layout ? 2 * (m + 1) : 2;
            const int64_t a_len = layout ? cs * k : rs * m, ldb = 2 * (n + 3), ldc = n + 1;
            uint16_t *a = malloc(2 * (size_t)a_len), *b = malloc(2 * (size_t)(ldb * k));
            float *c = malloc(sizeof(float) * (size_t)(ldc * m)), *c0 = malloc(sizeof(float) * (size_t)(ldc * m));
            for (int64_t i = 0; i < a_len; i++) a[i] = odd_bf16();
            for (int64_t i = 0; i < ldb * k; i++) b[i] = odd_bf16();
            for (int64_t i = 0; i < ldc * m; i++) c[i] = c0[i] = value();
            kern->bf16->gemm(m, n, k, a, rs, cs, b, ldb, c, ldc, alpha, acc);
            const int in_tiles = acc && alpha == 1.0f && m % 32 == 0 && n % 32 == 0;
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    float x = in_tiles ? c0[i * ldc + j] : 0.0f;
                    for (int p = 0; p < k; p++)
                        for (int e = 0; e < 2; e++)
                            x = sdm_ftz(fmaf(sdm_bf16(a[i * rs + p * cs + e]), sdm_bf16(b[p * ldb + 2 * j + e]), x));
                    if (!in_tiles) {
                        x = x * alpha;
                        if (acc) x = x + c0[i * ldc + j];
                    }
                    total++;
                    differ += memcmp(&x, &c[i * ldc + j], sizeof x) != 0;
                }
            free(a), free(b), free(c), free(c0);
        }
    printf("test_cpu_bf16 [%s]: gemm against the SDM's TDPBF16PS, bit for bit: %ld of %ld elements differ\n",
           kern->name, differ, total);
    CHECK(!emulated || differ == 0, "the emulated amx gemm differs from the SDM model in %ld of %ld elements", differ,
          total);
}

static void test_pairs(const flashc_cpu_kernels *kern) {
    static const int rows_list[] = {1, 2, 7, 64, 127, 128}, ns[] = {16, 80, 5, 59};
    for (size_t ri = 0; ri < sizeof rows_list / sizeof rows_list[0]; ri++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            for (int lead = 0; lead < 2; lead++) {
                const int rows = rows_list[ri], n = ns[ni], pairs = (rows + lead + 1) / 2;
                const int64_t lds = n + 3, ldd = 2 * (n + 7);
                float *src = malloc(sizeof(float) * (size_t)(lds * rows));
                const size_t dst_len = (size_t)(ldd * pairs > lds * rows ? ldd * pairs : lds * rows);
                uint16_t *s16 = malloc(2 * (size_t)(lds * rows)), *dst = malloc(2 * dst_len);
                for (int64_t i = 0; i < lds * rows; i++) src[i] = value(), s16[i] = bf16_value();
                int bad32 = 0, bad16 = 0;
                kern->bf16->pairs_f32(rows, lead, n, src, lds, dst, ldd);
                for (int p = 0; p < pairs; p++)
                    for (int j = 0; j < n; j++)
                        for (int e = 0; e < 2; e++) {
                            const int r = 2 * p + e - lead;
                            const uint16_t want = r >= 0 && r < rows ? flashc_f32_to_bf16(src[r * lds + j]) : 0;
                            bad32 += dst[p * ldd + 2 * j + e] != want;
                        }
                if (!lead) {
                    kern->bf16->pairs_bf16(rows, n, s16, lds, dst, ldd);
                    for (int p = 0; p < pairs; p++)
                        for (int j = 0; j < n; j++)
                            for (int e = 0; e < 2; e++) {
                                const int r = 2 * p + e;
                                bad16 += dst[p * ldd + 2 * j + e] != (r < rows ? s16[r * lds + j] : 0);
                            }
                }
                int bad_cvt = 0; /* to_bf16 over the same values, contiguous */
                kern->bf16->to_bf16((int)(lds * rows), src, dst);
                for (int64_t i = 0; i < lds * rows; i++) bad_cvt += dst[i] != flashc_f32_to_bf16(src[i]);
                /* out_bf16 (the forward's output rows) over the same values scaled, with subnormals, NaN, infinities
                 * and ties among them: flashc_f32_to_bf16's bits, where to_bf16 flushes subnormals */
                int bad_out = 0;
                if (kern->bf16->out_bf16) {
                    const int64_t len = lds * rows;
                    const float scale = 0.75f;
                    for (int64_t i = 0; i < len; i += 5) {
                        static const uint32_t special[] = {0x00000001u, 0x807fffffu, 0x00408000u, 0x7fc00001u,
                                                           0xff800001u, 0x7f800000u, 0x3f808000u, 0x3f818000u};
                        const uint32_t u = special[(i / 5) % 8];
                        memcpy(&src[i], &u, sizeof u);
                    }
                    kern->bf16->out_bf16((int)len, src, scale, dst);
                    for (int64_t i = 0; i < len; i++) bad_out += dst[i] != flashc_f32_to_bf16(src[i] * scale);
                }
                CHECK(!bad32 && !bad16 && !bad_cvt && !bad_out,
                      "pairs rows %d n %d lead %d: %d fp32 and %d bf16 pair elements, %d to_bf16, %d out_bf16 values "
                      "wrong", rows, n, lead, bad32, bad16, bad_cvt, bad_out);
                free(src), free(s16), free(dst);
            }
}

/* ---- the forward through the library ------------------------------------------------------------------------ */

#define BF16 FLASHC_DTYPE_BF16
#define BNHD FLASHC_LAYOUT_BNHD
#define BHND FLASHC_LAYOUT_BHND
#define PAD FLASHC_LAYOUT_PADDED

/* name, dtype, B, Nq, Nk, H, Hkv, D, causal, window (left, right), softcap, alibi, block (q, k), varlen, layout,
 * backward, seqused_k, sinks, page size, dropout, positions (on, q_position, k_position) */
static const flashc_case cases[] = {
    {"d128_causal", BF16, 2, 300, 300, 4, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"d64_long_keys", BF16, 1, 200, 1500, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"odd_d59_odd_nk", BF16, 2, 150, 301, 2, 1, 59, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"d1", BF16, 1, 70, 91, 2, 2, 1, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"window_odd_edges", BF16, 1, 300, 333, 2, 2, 64, 0, 36, 11, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"split_kv_window", BF16, 1, 40, 2000, 1, 1, 128, 0, 777, 5, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"split_kv_causal_d96", BF16, 1, 30, 1001, 1, 1, 96, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"paged_48_d80", BF16, 2, 150, 400, 2, 1, 80, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 48, 0, 0, 0, 0},
    {"bhnd_softcap_dropout", BF16, 2, 128, 255, 2, 2, 64, 0, -1, -1, 10.0f, 0, 0, 0, 0, BHND, 0, 0, 0, 0, 0.1f, 0, 0,
     0},
    {"padded_alibi_mask", BF16, 2, 200, 250, 4, 2, 128, 1, 90, -1, 0, 2, 24, 40, 0, PAD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"varlen_sinks_used", BF16, 3, 130, 255, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 0, 1, 1, 0, 0, 0, 0, 0},
    {"d256_gqa_bwd", BF16, 1, 130, 260, 4, 1, 256, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"positions_window", BF16, 1, 113, 200, 2, 2, 64, 1, 64, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 1, 150, 3},
};

static void test_forward(uint64_t seed) {
    for (int threads = 1; threads <= 2; threads++) {
        flashc_context_t ctx;
        if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK ||
            flashc_context_set_threads(ctx, threads) != FLASHC_STATUS_OK) {
            CHECK(0, "cannot set up a CPU context: %s", flashc_context_last_error(NULL));
            return;
        }
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const flashc_case *c = &cases[i];
            flashc_case_result r;
            memset(&r, 0, sizeof r);
            const int ran = flashc_case_run(ctx, c, seed + 7919u * i + 104729u * (uint64_t)threads, &r) == 0;
            const int tiles = r.kernel_fwd && strncmp(r.kernel_fwd, "CPU tiles", 9) == 0;
            const int ok = ran && r.pass && tiles;
            printf("[%d thr] %-22s out %9.2e (bound %9.2e, %4.0f%%)  lse %9.2e (%9.2e)  %s%s%s\n", threads, c->name,
                   r.err_out, r.tol_out, 100.0 * r.err_out / r.tol_out, r.err_lse, r.tol_lse, ok ? "PASS" : "FAIL",
                   ran && !tiles ? " (not the tile forward)" : "", ran && !r.pass ? r.message : "");
            CHECK(ok, "forward case %s at %d threads", c->name, threads);
        }
        flashc_context_destroy(ctx);
    }
}

/*
 * The driver's fp32 O before the store (the problem's out switched to an fp32 view after validation), on the bf16
 * products and on the AVX-512 fp32 kernels, against the fp64 oracle on the same bf16 inputs. With the bf16 products
 * the scores are exact products summed in fp32 and only P is rounded, to bf16 (relative error <= 2^-8, the unit
 * roundoff of an 8-bit significand; l sums the unrounded P), so |O - O_ref| <= 2^-8 max_j |V_j| per row, plus fp32
 * rounding: a bound much tighter than
 * the CONVENTIONS.md rule's (whose naive bf16 algorithm rounds S and O too), which a product that drops or misplaces
 * keys, or a P rounded wrongly, exceeds. The lse (fp32 both ways) is held to 1e-4.
 */
typedef struct direct_case {
    const char *name;
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
    int64_t left, right;
    int threads;
} direct_case;

static const direct_case direct_cases[] = {
    {"d128", 1, 300, 300, 2, 1, 128, 0, -1, -1, 1},
    {"d64_causal", 2, 257, 257, 2, 2, 64, 1, -1, -1, 2},
    {"d59_window", 1, 200, 333, 2, 2, 59, 0, 136, 11, 1},
    {"d96_split_kv_window", 1, 40, 1500, 1, 1, 96, 0, 501, 3, 2},
};

/* Max |out - ref| and max |lse - ref| of one forward on kern. */
static void direct_run(const flashc_problem *p, const flashc_cpu_kernels *kern, int threads, void *ws,
                       const double *ref, const double *ref_lse, double *err, double *err_lse) {
    const size_t no = (size_t)(p->B * p->Nq * p->H * p->D), nl = (size_t)(p->B * p->H * p->Nq);
    float *out = (float *)p->out.data;
    for (size_t i = 0; i < no; i++) out[i] = NAN; /* poison: every element must be written */
    flashc_cpu_forward(p, kern, threads, ws);
    *err = *err_lse = 0.0;
    for (size_t i = 0; i < no; i++) {
        const double e = fabs(out[i] - ref[i]);
        *err = e > *err || isnan(e) ? e : *err;
    }
    for (size_t i = 0; i < nl; i++) {
        const double e = fabs(p->lse[i] - ref_lse[i]);
        *err_lse = e > *err_lse || isnan(e) ? e : *err_lse;
    }
}

static void test_direct(const flashc_cpu_kernels *kern) {
    const flashc_cpu_kernels *f32 = flashc_cpu_kernels_by_name("avx512");
    for (size_t ci = 0; ci < sizeof direct_cases / sizeof direct_cases[0]; ci++) {
        const direct_case *c = &direct_cases[ci];
        const size_t nq = (size_t)(c->B * c->Nq * c->H * c->D), nk = (size_t)(c->B * c->Nk * c->Hkv * c->D);
        uint16_t *q = malloc(2 * nq), *k = malloc(2 * nk), *v = malloc(2 * nk), *o16 = malloc(2 * nq);
        float *o32 = malloc(sizeof(float) * nq), *lse = malloc(sizeof(float) * (size_t)(c->B * c->H * c->Nq));
        double *ref = malloc(sizeof(double) * nq), *ref_lse = malloc(sizeof(double) * (size_t)(c->B * c->H * c->Nq));
        double vmax = 0.0;
        for (size_t i = 0; i < nq; i++) /* every 7th query row 4x larger: large logits */
            q[i] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng) * ((i / (size_t)c->D) % 7 ? 1.0f : 4.0f));
        for (size_t i = 0; i < nk; i++) {
            k[i] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng));
            v[i] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng));
            vmax = fmax(vmax, fabs(flashc_bf16_to_f32(v[i])));
        }
        flashc_tensor tq = flashc_tensor_contiguous(q, BF16, c->B, c->Nq, c->H, c->D);
        flashc_tensor tk = flashc_tensor_contiguous(k, BF16, c->B, c->Nk, c->Hkv, c->D);
        flashc_tensor tv = flashc_tensor_contiguous(v, BF16, c->B, c->Nk, c->Hkv, c->D);
        flashc_tensor to = flashc_tensor_contiguous(o16, BF16, c->B, c->Nq, c->H, c->D);
        flashc_params prm = flashc_params_default();
        prm.causal = c->causal;
        prm.window_left = c->left;
        prm.window_right = c->right;
        flashc_problem p;
        if (flashc_problem_build(NULL, FLASHC_OP_FORWARD, &tq, &tk, &tv, &prm, &to, lse, NULL, NULL, NULL, NULL,
                                 &p) != FLASHC_STATUS_OK ||
            flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref, ref_lse) != 0) {
            CHECK(0, "direct %s: could not set up (%s)", c->name, flashc_context_last_error(NULL));
            continue;
        }
        p.out = flashc_tensor_contiguous(o32, FLASHC_DTYPE_F32, c->B, c->Nq, c->H, c->D);
        void *ws = malloc(flashc_cpu_forward_workspace(&p, c->threads));
        double e16, l16, e32, l32;
        direct_run(&p, kern, c->threads, ws, ref, ref_lse, &e16, &l16);
        direct_run(&p, f32, c->threads, ws, ref, ref_lse, &e32, &l32);
        const double bound = 0x1p-8 * vmax * (1.0 + 1e-3) + 1e-5;
        printf("direct %-20s %d thr: fp32 O error %.2e (bound 2^-8 max|V| = %.2e, %3.0f%%), lse %.2e; on the fp32 "
               "kernels %.2e, lse %.2e\n",
               c->name, c->threads, e16, bound, 100.0 * e16 / bound, l16, e32, l32);
        CHECK(e16 <= bound && l16 <= 1e-4, "direct %s: bf16 products O error %.3g (bound %.3g), lse %.3g (1e-4)",
              c->name, e16, bound, l16);
        free(ws), free(q), free(k), free(v), free(o16), free(o32), free(lse), free(ref), free(ref_lse);
    }
}

/*
 * The backward's fp32 gradients before the store (dq, dk, dv switched to fp32 views, out to the forward's fp32 O so
 * that D_i = rowsum(dO o O) is not the rounded output's), on the bf16 products, against the fp64 oracle. P and dS are
 * rounded to bf16 (relative error <= 2^-8 each) and D_i comes from an O whose P was rounded (error <= 2^-8 A_i,
 * A_i = sum_j P_ij a_ij, a_ij = sum_d |dO_id V_jd|), the rest is fp32, so to first order, per element,
 *   |dV - ref| <= 2^-8 sum_i P_ij |dO_i|,   |dK - ref| <= 2^-8 scale sum_i m_ij |Q_i|,
 *   |dQ - ref| <= 2^-8 scale sum_j m_ij |K_j|,   m_ij = |dS_ij| + P_ij (a_ij + A_i)
 * (the P_ij (a_ij + A_i) term also covers fp32's cancellation in dP_ij - D_i on rows that see few keys), plus 1e-5
 * of the largest gradient; P and dS from fp64 loops here (one head, optionally causal). The fp32 kernels' gradients
 * came to 0-2% of this bound, the bf16 products' to 2-60%.
 */
typedef struct grad_bounds {
    double *dq, *dk, *dv; /* per element: the magnitude sums above */
} grad_bounds;

/* The magnitude sums for one (batch 0, head 0, kv head 0) problem with contiguous bf16 q, k, v, dO (B 1, H 1). */
static void grad_magnitudes(int64_t n, int64_t D, int causal, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            const uint16_t *dout, grad_bounds *g) {
    const double scale = 1.0 / sqrt((double)D);
    double *s = malloc(sizeof(double) * (size_t)n), *dp = malloc(sizeof(double) * (size_t)n);
    double *a = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double mx = -INFINITY, l = 0.0, di = 0.0, ai = 0.0;
        for (int64_t j = 0; j <= (causal ? i : n - 1); j++) {
            double acc = 0.0, dacc = 0.0, aacc = 0.0;
            for (int64_t d = 0; d < D; d++) {
                acc += (double)flashc_bf16_to_f32(q[i * D + d]) * flashc_bf16_to_f32(k[j * D + d]);
                dacc += (double)flashc_bf16_to_f32(dout[i * D + d]) * flashc_bf16_to_f32(v[j * D + d]);
                aacc += fabs((double)flashc_bf16_to_f32(dout[i * D + d]) * flashc_bf16_to_f32(v[j * D + d]));
            }
            s[j] = acc * scale, dp[j] = dacc, a[j] = aacc;
            mx = fmax(mx, s[j]);
        }
        const int64_t last = causal ? i : n - 1;
        for (int64_t j = 0; j <= last; j++) l += exp(s[j] - mx);
        for (int64_t j = 0; j <= last; j++) di += exp(s[j] - mx) / l * dp[j], ai += exp(s[j] - mx) / l * a[j];
        for (int64_t j = 0; j <= last; j++) {
            const double pij = exp(s[j] - mx) / l, ds = fabs(pij * (dp[j] - di)) + pij * (a[j] + ai);
            for (int64_t d = 0; d < D; d++) {
                g->dv[j * D + d] += pij * fabs(flashc_bf16_to_f32(dout[i * D + d]));
                g->dk[j * D + d] += scale * ds * fabs(flashc_bf16_to_f32(q[i * D + d]));
                g->dq[i * D + d] += scale * ds * fabs(flashc_bf16_to_f32(k[j * D + d]));
            }
        }
    }
    free(s), free(dp), free(a);
}

/* max over elements of |ours - ref| / (2^-8 mag + 1e-5 max|ref|): at most 1 within the bound. */
static double grad_excess(const float *ours, const double *ref, const double *mag, size_t n) {
    double rmax = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) rmax = fmax(rmax, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) {
        const double e = fabs(ours[i] - ref[i]) / (0x1p-8 * mag[i] + 1e-5 * rmax);
        worst = e > worst || isnan(e) ? e : worst;
    }
    return worst;
}

static void test_direct_backward(const flashc_cpu_kernels *kern) {
    static const struct {
        int64_t n, D;
        int causal, threads;
    } shapes[] = {{300, 64, 0, 1}, {257, 128, 1, 2}, {161, 59, 1, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, D = shapes[si].D;
        const int causal = shapes[si].causal, threads = shapes[si].threads;
        const size_t ne = (size_t)(n * D);
        uint16_t *x[5]; /* q, k, v, dO, and the bf16 out the front's checks take */
        for (int i = 0; i < 5; i++) {
            x[i] = malloc(2 * ne);
            for (size_t e = 0; e < ne; e++) x[i][e] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng));
        }
        float *o32 = malloc(sizeof(float) * ne), *lse = malloc(sizeof(float) * (size_t)n), *g32[3];
        double *ref[3], *mag[3];
        for (int i = 0; i < 3; i++) {
            g32[i] = malloc(sizeof(float) * ne);
            ref[i] = malloc(sizeof(double) * ne);
            mag[i] = calloc(ne, sizeof(double));
        }
        flashc_tensor t[5], tg[3];
        for (int i = 0; i < 5; i++) t[i] = flashc_tensor_contiguous(x[i], BF16, 1, n, 1, D);
        flashc_params prm = flashc_params_default();
        prm.causal = causal;
        flashc_problem pf, pb;
        int ok = flashc_problem_build(NULL, FLASHC_OP_FORWARD, &t[0], &t[1], &t[2], &prm, &t[4], lse, NULL, NULL,
                                      NULL, NULL, &pf) == FLASHC_STATUS_OK;
        pf.out = flashc_tensor_contiguous(o32, FLASHC_DTYPE_F32, 1, n, 1, D);
        void *ws = ok ? malloc(flashc_cpu_forward_workspace(&pf, threads)) : NULL;
        if (ok) flashc_cpu_forward(&pf, kern, threads, ws);
        free(ws);
        /* bf16 gradient views for the front's checks, switched to fp32 ones below */
        uint16_t *gbuf[3];
        for (int i = 0; i < 3; i++) {
            gbuf[i] = malloc(2 * ne);
            tg[i] = flashc_tensor_contiguous(gbuf[i], BF16, 1, n, 1, D);
        }
        ok = ok && flashc_problem_build(NULL, FLASHC_OP_BACKWARD, &t[0], &t[1], &t[2], &prm, &t[4], lse, &t[3], &tg[0],
                                        &tg[1], &tg[2], &pb) == FLASHC_STATUS_OK &&
             flashc_ref_backward(&pb, FLASHC_DTYPE_F32, ref[0], ref[1], ref[2]) == 0;
        if (!ok) {
            CHECK(0, "direct backward n %lld D %lld: could not set up (%s)", (long long)n, (long long)D,
                  flashc_context_last_error(NULL));
        } else {
            pb.out = pf.out; /* the forward's fp32 O: D_i then carries only the forward's P rounding */
            pb.dq = flashc_tensor_contiguous(g32[0], FLASHC_DTYPE_F32, 1, n, 1, D);
            pb.dk = flashc_tensor_contiguous(g32[1], FLASHC_DTYPE_F32, 1, n, 1, D);
            pb.dv = flashc_tensor_contiguous(g32[2], FLASHC_DTYPE_F32, 1, n, 1, D);
            ws = malloc(flashc_cpu_backward_workspace(&pb, threads));
            flashc_cpu_backward(&pb, kern, threads, ws);
            free(ws);
            grad_bounds gb = {mag[0], mag[1], mag[2]};
            grad_magnitudes(n, D, causal, x[0], x[1], x[2], x[3], &gb);
            double ex[3];
            for (int i = 0; i < 3; i++) ex[i] = grad_excess(g32[i], ref[i], mag[i], ne);
            printf("direct backward n %lld D %lld causal %d, %d thr: error / bound dq %.2f, dk %.2f, dv %.2f\n",
                   (long long)n, (long long)D, causal, threads, ex[0], ex[1], ex[2]);
            CHECK(ex[0] <= 1.0 && ex[1] <= 1.0 && ex[2] <= 1.0,
                  "direct backward n %lld D %lld: gradient errors above the bf16-rounding bound (%.2f, %.2f, %.2f)",
                  (long long)n, (long long)D, ex[0], ex[1], ex[2]);
        }
        for (int i = 0; i < 5; i++) free(x[i]);
        for (int i = 0; i < 3; i++) free(g32[i]), free(ref[i]), free(mag[i]), free(gbuf[i]);
        free(o32), free(lse);
    }
}

/* argv[1]: the set to test, "avx512bf16" (default) or "amx" (ctest runs it as test_cpu_bf16_amx with
 * FLASHC_CPU_KERNELS=amx, so that the library forwards of 3. run on it too). */
int main(int argc, char **argv) {
    const char *env = getenv("FLASHC_SEED");
    const uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    rng = seed ^ 0x9e3779b97f4a7c15ull;
    const char *features = flashc_cpu_features(), *set = argc > 1 ? argv[1] : "avx512bf16";
    const flashc_cpu_kernels *kern = flashc_cpu_kernels_by_name(set);
    printf("test_cpu_bf16: FLASHC_SEED=%" PRIu64 ", features: %s\n", seed, features);
    if (!kern) {
        if (!strcmp(set, "amx"))
            printf("test_cpu_bf16: no amx kernel set (%s), skipped\n",
                   strstr(features, "amx-bf16") ? "not built with AMX" : "no AMX-BF16 here, and not emulated");
        else
            printf("test_cpu_bf16: no %s kernel set (%s), skipped\n", set,
                   strstr(features, "avx512bf16") ? "the compiler lacks -mavx512bf16" : "the CPU lacks AVX512-BF16");
        return 0;
    }
    CHECK(kern->bf16 && kern->bf16->gemm && kern->bf16->pairs_f32 && kern->bf16->pairs_bf16,
          "the %s set has no bf16 products", set);
    if (failures) return 1;
    const char *forced = getenv("FLASHC_CPU_KERNELS"), *chosen = flashc_cpu_select_kernels()->name;
    /* the default: amx on AMX hardware (never emulated), else avx512bf16 */
    const flashc_cpu_kernels *amx = flashc_cpu_kernels_by_name("amx");
    const char *best =
        amx && !strstr(amx->name, "emulated") ? amx->name : flashc_cpu_kernels_by_name("avx512bf16")->name;
    CHECK(forced || strcmp(chosen, best) == 0, "the default kernel set is %s, not %s", chosen, best);
    CHECK(!forced || strncmp(forced, set, strlen(set)) != 0 || strcmp(chosen, kern->name) == 0,
          "FLASHC_CPU_KERNELS=%s chose %s", forced, chosen);
    CHECK(flashc_cpu_kernels_by_name("avx512") && !flashc_cpu_kernels_by_name("avx512")->bf16,
          "the AVX-512 set is not selectable without the bf16 products");
    test_gemm(kern);
    if (!strncmp(kern->name, "amx", 3)) test_amx_bits(kern);
    test_pairs(kern);
    if (strcmp(chosen, kern->name) != 0) /* forced elsewhere, or amx the default (test_cpu_bf16_amx runs them there) */
        printf("test_cpu_bf16: the library runs %s: its forwards are left out (they would not run on %s)\n", chosen,
               kern->name);
    else
        test_forward(seed);
    test_direct(kern);
    test_direct_backward(kern);
    printf("test_cpu_bf16 [%s]: %d failed\n", kern->name, failures);
    return failures != 0;
}
