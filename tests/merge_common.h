/*
 * merge_common.h - the checks of flashc_merge that test_merge.c (CPU backend) and gpu_merge.cu (CUDA backend) share,
 * written once for both: tensors live where the context's backend computes, reached through a flashc_case_memory
 * (src/ref/testkit.h; merge_host_memory for the CPU), and every result is judged on host copies.
 *
 * merge_against_fp64: random parts in f32, f16 or bf16 and one of four layouts, with rows of every kind: an empty
 *   part (lse +inf or -inf, its out NaN garbage that must reach nothing), both parts empty, one part dominating by
 *   e^100, a NaN lse, and plain random rows. Plain rows against an fp64 merge of the stored inputs (one rounding to
 *   the dtype plus fp32 arithmetic); empty-part rows bit for bit the other part; every element of the view written
 *   and none outside it. Then lse = NULL, and in place (out = out_a, lse = lse_a; out = out_b, lse = lse_b): the same
 *   bits.
 * merge_against_forward: the keys split in two at s, each half's forward with its lse (the first half with window
 *   (-1, Nk - s), so that the causal band keeps the full problem's diagonal; the second plain causal), merged,
 *   against the fp64 oracle by CONVENTIONS.md's rule (f32: relative error 1e-5; f16/bf16: 2x the naive
 *   low-precision algorithm's error + 1e-5, plus one rounding of each part, which is stored in the dtype). Rows
 *   one half saw nothing of must be the other half's bit for bit; rows no key reaches out 0 and lse +inf.
 * Plain C that also compiles as CUDA C++.
 */
#ifndef FLASHC_TESTS_MERGE_COMMON_H
#define FLASHC_TESTS_MERGE_COMMON_H

#include "ref/testkit.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_checks, g_failed;

static void check(const char *what, int cond) {
    g_checks++;
    g_failed += !cond;
    printf("%-100s %s\n", what, cond ? "PASS" : "FAIL");
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    return p;
}

/* ---- memory where the backend computes ------------------------------------------------------------------ */

static void *host_alloc(size_t n) { return malloc(n ? n : 1); }
static int host_copy(void *dst, const void *src, size_t n) {
    memcpy(dst, src, n);
    return 0;
}
static const flashc_case_memory merge_host_memory = {host_alloc, free, host_copy, host_copy};

static void *dev_new(const flashc_case_memory *mem, size_t n) {
    void *p = mem->alloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}
static void *dev_copy_of(const flashc_case_memory *mem, const void *host, size_t n) {
    void *p = dev_new(mem, n);
    if (mem->to_device(p, host, n)) exit(2);
    return p;
}
static void dev_poison(const flashc_case_memory *mem, void *dev, size_t n) {
    void *h = xmalloc(n);
    memset(h, 0xff, n);
    if (mem->to_device(dev, h, n)) exit(2);
    free(h);
}
static void *host_copy_of(const flashc_case_memory *mem, const void *dev, size_t n) {
    void *h = xmalloc(n);
    if (mem->to_host(h, dev, n)) exit(2);
    return h;
}

/* ---- elements ----------------------------------------------------------------------------------------------- */

static double get(const void *data, flashc_dtype t, int64_t off) {
    switch (t) {
    case FLASHC_DTYPE_F32: return ((const float *)data)[off];
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)data)[off]);
    default: return flashc_bf16_to_f32(((const uint16_t *)data)[off]);
    }
}

static void set(void *data, flashc_dtype t, int64_t off, double x) {
    switch (t) {
    case FLASHC_DTYPE_F32: ((float *)data)[off] = (float)x; break;
    case FLASHC_DTYPE_F16: ((uint16_t *)data)[off] = flashc_f32_to_f16((float)x); break;
    default: ((uint16_t *)data)[off] = flashc_f32_to_bf16((float)x); break;
    }
}

/* The element's bits, for bit-for-bit comparisons and the poison check. */
static uint32_t bits(const void *data, flashc_dtype t, int64_t off) {
    if (t == FLASHC_DTYPE_F32) {
        uint32_t u;
        memcpy(&u, (const float *)data + off, 4);
        return u;
    }
    return ((const uint16_t *)data)[off];
}

static uint32_t poison_bits(flashc_dtype t) { return t == FLASHC_DTYPE_F32 ? 0xffffffffu : 0xffffu; }

static uint32_t fbits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static size_t esize(flashc_dtype t) { return t == FLASHC_DTYPE_F32 ? 4 : 2; }

static int64_t offset(const flashc_tensor *t, int64_t b, int64_t i, int64_t h, int64_t d) {
    return b * t->stride[0] + i * t->stride[1] + h * t->stride[2] + d * t->stride[3];
}

/* ---- layouts ------------------------------------------------------------------------------------------------ */

enum { LAYOUT_BNHD, LAYOUT_BHND, LAYOUT_PADDED, LAYOUT_STRIDED_D, LAYOUTS };
static const char *const layout_names[LAYOUTS] = {"contiguous", "(B, H, N, D) strides", "padded rows",
                                                  "every other element along D"};

/* A view of shape (B, N, H, D) over a buffer of *elems elements laid out as asked (data set later). */
static flashc_tensor make_view(flashc_dtype t, int64_t B, int64_t N, int64_t H, int64_t D, int layout, int64_t *elems) {
    flashc_tensor v = flashc_tensor_contiguous(NULL, t, B, N, H, D);
    if (layout == LAYOUT_BHND) { /* storage (B, H, N, D) */
        v.stride[3] = 1, v.stride[1] = D, v.stride[2] = N * D, v.stride[0] = H * N * D;
    } else if (layout == LAYOUT_PADDED) { /* D padded to D + 3, H to H + 1: rows not 16-byte aligned */
        v.stride[3] = 1, v.stride[2] = D + 3, v.stride[1] = (H + 1) * (D + 3), v.stride[0] = N * (H + 1) * (D + 3);
    } else if (layout == LAYOUT_STRIDED_D) { /* stride 2 along D */
        v.stride[3] = 2, v.stride[2] = 2 * D, v.stride[1] = 2 * H * D, v.stride[0] = 2 * N * H * D;
    }
    *elems = B * v.stride[0];
    return v;
}

/* ---- 1. against an fp64 merge -------------------------------------------------------------------------------- */

enum { ROW_A_EMPTY, ROW_B_EMPTY, ROW_BOTH_EMPTY, ROW_A_NEG, ROW_B_NEG, ROW_BOTH_NEG, ROW_MIXED_EMPTY, ROW_A_DOMINATES,
       ROW_NAN, ROW_KINDS };

static int row_kind(int64_t l) { return l % 13 < ROW_KINDS ? (int)(l % 13) : ROW_KINDS; } /* ROW_KINDS: plain */

static void merge_against_fp64(flashc_context_t ctx, const flashc_case_memory *mem, flashc_dtype t, int layout,
                               int64_t B, int64_t N, int64_t H, int64_t D) {
    uint64_t rng = 99 + (uint64_t)t * 7 + (uint64_t)layout * 131 + (uint64_t)D + (uint64_t)N * 3;
    const int64_t rows = B * N * H;
    const size_t esz = esize(t);
    int64_t el;
    const flashc_tensor v = make_view(t, B, N, H, D, layout, &el);
    const size_t bytes = (size_t)el * esz, lbytes = (size_t)rows * 4;
    void *a = xmalloc(bytes), *b = xmalloc(bytes);
    float *la = (float *)xmalloc(lbytes), *lb = (float *)xmalloc(lbytes);
    memset(a, 0xff, bytes), memset(b, 0xff, bytes); /* outside the view: poison (NaN) */
    for (int64_t l = 0; l < rows; l++) {
        const int kind = row_kind(l);
        la[l] = (float)(3.0 * flashc_rand_normal(&rng));
        lb[l] = (float)(3.0 * flashc_rand_normal(&rng));
        if (kind == ROW_A_EMPTY || kind == ROW_BOTH_EMPTY || kind == ROW_MIXED_EMPTY) la[l] = INFINITY;
        if (kind == ROW_B_EMPTY || kind == ROW_BOTH_EMPTY) lb[l] = INFINITY;
        if (kind == ROW_A_NEG || kind == ROW_BOTH_NEG) la[l] = -INFINITY;
        if (kind == ROW_B_NEG || kind == ROW_BOTH_NEG || kind == ROW_MIXED_EMPTY) lb[l] = -INFINITY;
        if (kind == ROW_A_DOMINATES) la[l] = lb[l] + 100.0f;
        if (kind == ROW_NAN) la[l] = NAN;
    }
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t i = 0; i < N; i++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t l = (bb * H + h) * N + i;
                for (int64_t d = 0; d < D; d++) { /* an empty part's row holds NaN: it must reach nothing */
                    set(a, t, offset(&v, bb, i, h, d), isinf(la[l]) ? NAN : flashc_rand_normal(&rng));
                    set(b, t, offset(&v, bb, i, h, d), isinf(lb[l]) ? NAN : flashc_rand_normal(&rng));
                }
            }
    void *da = dev_copy_of(mem, a, bytes), *db = dev_copy_of(mem, b, bytes), *dout = dev_new(mem, bytes);
    float *dla = (float *)dev_copy_of(mem, la, lbytes), *dlb = (float *)dev_copy_of(mem, lb, lbytes),
          *dlo = (float *)dev_new(mem, lbytes);
    dev_poison(mem, dout, bytes);
    dev_poison(mem, dlo, lbytes);
    flashc_tensor va = v, vb = v, vo = v;
    va.data = da, vb.data = db, vo.data = dout;
    const flashc_status st = flashc_merge(ctx, &va, dla, &vb, dlb, &vo, dlo);
    char what[256];
    snprintf(what, sizeof what, "%s %s B %lld N %lld H %lld D %lld: flashc_merge runs (%s)", flashc_dtype_name(t),
             layout_names[layout], (long long)B, (long long)N, (long long)H, (long long)D,
             flashc_context_last_error(ctx));
    check(what, st == FLASHC_STATUS_OK);
    void *o = host_copy_of(mem, dout, bytes);
    float *lo = (float *)host_copy_of(mem, dlo, lbytes);

    /* fp64 reference on the stored (rounded) inputs; tolerance: one rounding to the dtype plus fp32 arithmetic */
    const double u = t == FLASHC_DTYPE_BF16 ? 1.0 / 256 : t == FLASHC_DTYPE_F16 ? 1.0 / 2048 : 0.0;
    double worst = 0, worst_lse = 0;
    int plain_ok = 1, empty_ok = 1, both_ok = 1, nan_ok = 1, written = 1, outside = 1;
    char *in = (char *)calloc((size_t)el, 1);
    if (!in) exit(2);
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t i = 0; i < N; i++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t l = (bb * H + h) * N + i;
                const double xa = la[l], xb = lb[l];
                const int ea = isinf(xa), eb = isinf(xb);
                for (int64_t d = 0; d < D; d++) {
                    const int64_t k = offset(&v, bb, i, h, d);
                    in[k] = 1;
                    written &= bits(o, t, k) != poison_bits(t);
                    if (isnan(xa) || isnan(xb)) {
                        nan_ok &= isnan(get(o, t, k)) != 0;
                    } else if (ea && eb) {
                        both_ok &= bits(o, t, k) == 0;
                    } else if (ea || eb) { /* bit for bit the other part */
                        empty_ok &= bits(o, t, k) == bits(ea ? b : a, t, k);
                    } else {
                        const double m = xa > xb ? xa : xb, lse = m + log(exp(xa - m) + exp(xb - m));
                        const double wa = exp(xa - lse), wb = exp(xb - lse), ya = get(a, t, k), yb = get(b, t, k);
                        const double ref = wa * ya + wb * yb, e = fabs(get(o, t, k) - ref);
                        if (!(e <= u * fabs(ref) + 1e-6 * (wa * fabs(ya) + wb * fabs(yb)) + 1e-7)) plain_ok = 0;
                        if (!(e <= worst)) worst = e;
                    }
                }
                if (isnan(xa) || isnan(xb)) {
                    nan_ok &= isnan(lo[l]) != 0;
                } else if (ea && eb) {
                    both_ok &= lo[l] == INFINITY;
                } else if (ea || eb) {
                    empty_ok &= fbits(lo[l]) == fbits(ea ? lb[l] : la[l]);
                } else {
                    const double m = xa > xb ? xa : xb, lse = m + log(exp(xa - m) + exp(xb - m)),
                                 e = fabs(lo[l] - lse);
                    if (!(e <= 5e-7 * fmax(1.0, fabs(lse)))) plain_ok = 0;
                    if (!(e <= worst_lse)) worst_lse = e;
                }
            }
    for (int64_t k = 0; k < el; k++)
        if (!in[k]) outside &= bits(o, t, k) == poison_bits(t);
    free(in);
    snprintf(what, sizeof what, "  plain rows against fp64 (max |diff| out %.2g, lse %.2g)", worst, worst_lse);
    check(what, st == FLASHC_STATUS_OK && plain_ok);
    check("  one part empty (lse +inf or -inf, out NaN): the other part bit for bit",
          st == FLASHC_STATUS_OK && empty_ok);
    check("  both parts empty: out +0, lse +inf", st == FLASHC_STATUS_OK && both_ok);
    check("  a NaN lse: that row's out and lse NaN", st == FLASHC_STATUS_OK && nan_ok);
    check("  every element of the view written, none outside it", st == FLASHC_STATUS_OK && written && outside);

    /* lse NULL: the same out */
    dev_poison(mem, dout, bytes);
    const flashc_status st2 = flashc_merge(ctx, &va, dla, &vb, dlb, &vo, NULL);
    void *o2 = host_copy_of(mem, dout, bytes);
    check("  lse = NULL: the same out, bit for bit", st2 == FLASHC_STATUS_OK && !memcmp(o, o2, bytes));
    free(o2);

    /* in place, into either part */
    for (int side = 0; side < 2; side++) {
        void *dp = dev_copy_of(mem, side ? b : a, bytes);
        float *dlp = (float *)dev_copy_of(mem, side ? lb : la, lbytes);
        flashc_tensor vp = v;
        vp.data = dp;
        const flashc_status s3 = side ? flashc_merge(ctx, &va, dla, &vp, dlp, &vp, dlp)
                                      : flashc_merge(ctx, &vp, dlp, &vb, dlb, &vp, dlp);
        void *p = host_copy_of(mem, dp, bytes), *lp = host_copy_of(mem, dlp, lbytes);
        snprintf(what, sizeof what, "  in place (out = out_%c, lse = lse_%c): the same bits (%s)", side ? 'b' : 'a',
                 side ? 'b' : 'a', flashc_context_last_error(ctx));
        check(what, s3 == FLASHC_STATUS_OK && !memcmp(p, o, bytes) && !memcmp(lp, lo, lbytes));
        free(p), free(lp);
        mem->free(dp), mem->free(dlp);
    }
    mem->free(da), mem->free(db), mem->free(dout), mem->free(dla), mem->free(dlb), mem->free(dlo);
    free(a), free(b), free(o), free(la), free(lb), free(lo);
}

/* ---- 2. against the forward on all keys ---------------------------------------------------------------------- */

/* Max |x - ref| and the sums for the relative error; an infinite reference (a row no key reaches) wants +inf. */
typedef struct merge_err {
    double max, num, den;
    int nonfinite;
} merge_err;

static void err_add(merge_err *e, double x, double ref) {
    if (isinf(ref)) {
        if (!(isinf(x) && x > 0)) e->nonfinite++;
        return;
    }
    if (!isfinite(x)) {
        e->nonfinite++;
        return;
    }
    const double d = fabs(x - ref);
    if (d > e->max) e->max = d;
    e->num += d * d;
    e->den += ref * ref;
}

static double err_rel(const merge_err *e) { return e->den > 0 ? sqrt(e->num / e->den) : e->max; }

static void merge_against_forward(flashc_context_t ctx, const flashc_case_memory *mem, flashc_dtype t, int64_t B,
                                  int64_t Nq, int64_t Nk, int64_t H, int64_t Hkv, int64_t D, int causal, int64_t s) {
    uint64_t rng = 7 + (uint64_t)t * 1000 + (uint64_t)Nq * 10 + (uint64_t)causal + (uint64_t)D;
    const size_t esz = esize(t), q_el = (size_t)(B * Nq * H * D), k_el = (size_t)(B * Nk * Hkv * D),
                 lrows = (size_t)(B * H * Nq);
    void *q = xmalloc(q_el * esz), *k = xmalloc(k_el * esz), *v = xmalloc(k_el * esz);
    for (size_t i = 0; i < q_el; i++) /* every eighth query row with large logits */
        set(q, t, (int64_t)i, ((i / (size_t)(H * D)) % 8 == 3 ? 6.0 : 1.0) * flashc_rand_normal(&rng));
    for (size_t i = 0; i < k_el; i++) set(k, t, (int64_t)i, flashc_rand_normal(&rng));
    for (size_t i = 0; i < k_el; i++) set(v, t, (int64_t)i, flashc_rand_normal(&rng));
    void *dq = dev_copy_of(mem, q, q_el * esz), *dk = dev_copy_of(mem, k, k_el * esz),
         *dv = dev_copy_of(mem, v, k_el * esz), *doa = dev_new(mem, q_el * esz), *dob = dev_new(mem, q_el * esz),
         *dom = dev_new(mem, q_el * esz);
    float *dla = (float *)dev_new(mem, lrows * 4), *dlb = (float *)dev_new(mem, lrows * 4),
          *dlm = (float *)dev_new(mem, lrows * 4);
    dev_poison(mem, dom, q_el * esz);
    dev_poison(mem, dlm, lrows * 4);
    const flashc_tensor tq = flashc_tensor_contiguous(dq, t, B, Nq, H, D),
                        tk = flashc_tensor_contiguous(dk, t, B, Nk, Hkv, D),
                        tv = flashc_tensor_contiguous(dv, t, B, Nk, Hkv, D);
    flashc_tensor tka = tk, tva = tv, tkb = tk, tvb = tv; /* keys [0, s) and [s, Nk): views, the same strides */
    tka.shape[1] = tva.shape[1] = s;
    tkb.shape[1] = tvb.shape[1] = Nk - s;
    tkb.data = (char *)dk + (size_t)(s * Hkv * D) * esz;
    tvb.data = (char *)dv + (size_t)(s * Hkv * D) * esz;
    const flashc_tensor toa = flashc_tensor_contiguous(doa, t, B, Nq, H, D),
                        tob = flashc_tensor_contiguous(dob, t, B, Nq, H, D),
                        tom = flashc_tensor_contiguous(dom, t, B, Nq, H, D);
    flashc_params pf = flashc_params_default(), pa = pf, pb = pf;
    pf.causal = pb.causal = causal;
    if (causal) pa.window_right = Nk - s; /* key j <= i + Nk - Nq, from the first half's own diagonal i + s - Nq */
    const int ok = flashc_forward(ctx, &tq, &tka, &tva, &pa, &toa, dla, NULL, 0) == FLASHC_STATUS_OK &&
                   flashc_forward(ctx, &tq, &tkb, &tvb, &pb, &tob, dlb, NULL, 0) == FLASHC_STATUS_OK &&
                   flashc_merge(ctx, &toa, dla, &tob, dlb, &tom, dlm) == FLASHC_STATUS_OK;
    char what[256];
    snprintf(what, sizeof what, "%s B %lld Nq %lld Nk %lld H %lld Hkv %lld D %lld%s, keys split at %lld: forwards and "
             "merge run (%s)", flashc_dtype_name(t), (long long)B, (long long)Nq, (long long)Nk, (long long)H,
             (long long)Hkv, (long long)D, causal ? " causal" : "", (long long)s, flashc_context_last_error(ctx));
    check(what, ok);
    if (ok) {
        void *oa = host_copy_of(mem, doa, q_el * esz), *ob = host_copy_of(mem, dob, q_el * esz),
             *om = host_copy_of(mem, dom, q_el * esz);
        float *la = (float *)host_copy_of(mem, dla, lrows * 4), *lb = (float *)host_copy_of(mem, dlb, lrows * 4),
              *lm = (float *)host_copy_of(mem, dlm, lrows * 4);
        /* the oracle on the whole problem (host copies), and the naive low-precision algorithm for the rule */
        flashc_tensor hq = tq, hk = tk, hv = tv, ho = tom;
        hq.data = q, hk.data = k, hv.data = v, ho.data = om;
        flashc_problem p;
        double *ref = (double *)xmalloc(q_el * 8), *rlse = (double *)xmalloc(lrows * 8), *lowp = NULL, *llse = NULL;
        if (flashc_problem_build(NULL, FLASHC_OP_FORWARD, &hq, &hk, &hv, &pf, &ho, lm, NULL, NULL, NULL, NULL, &p) ||
            flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref, rlse))
            exit(2);
        if (t != FLASHC_DTYPE_F32) {
            lowp = (double *)xmalloc(q_el * 8), llse = (double *)xmalloc(lrows * 8);
            if (flashc_ref_forward(&p, t, lowp, llse)) exit(2);
        }
        /* The parts are stored in the dtype, so each carries one rounding more than the whole problem's output:
         * the rule's bound grows by max (wa |out_a| + wb |out_b|) u, u the dtype's unit roundoff. */
        const double u = t == FLASHC_DTYPE_BF16 ? 1.0 / 256 : t == FLASHC_DTYPE_F16 ? 1.0 / 2048 : 0.0;
        double parts = 0;
        merge_err em = {0, 0, 0, 0}, el = em, en = em, eln = em;
        for (size_t i = 0; i < q_el; i++) {
            err_add(&em, get(om, t, (int64_t)i), ref[i]);
            if (lowp) err_add(&en, lowp[i], ref[i]);
            const int64_t row = (int64_t)i / (H * D), bq = row / Nq, iq = row % Nq, h = (int64_t)i / D % H;
            const int64_t l = (bq * H + h) * Nq + iq; /* element i is (bq, iq, h, d) */
            const double xa = la[l], xb = lb[l], m = xa > xb ? xa : xb;
            if (isinf(xa) || isinf(xb) || !isfinite(m)) continue;
            const double lse = m + log(exp(xa - m) + exp(xb - m)), ya = get(oa, t, (int64_t)i),
                         yb = get(ob, t, (int64_t)i), mag = exp(xa - lse) * fabs(ya) + exp(xb - lse) * fabs(yb);
            if (mag > parts) parts = mag;
        }
        for (size_t i = 0; i < lrows; i++) {
            err_add(&el, lm[i], rlse[i]);
            if (llse) err_add(&eln, llse[i], rlse[i]);
        }
        const int lp = t != FLASHC_DTYPE_F32;
        const double e_out = lp ? em.max : err_rel(&em), tol_out = lp ? 2 * en.max + parts * u + 1e-5 : 1e-5;
        const double e_lse = lp ? el.max : err_rel(&el), tol_lse = lp ? 2 * eln.max + 1e-5 : 1e-5;
        snprintf(what, sizeof what, "  the merged halves against fp64: out %.3g (tol %.3g = 2 x %.3g + %.3g), lse %.3g "
                 "(tol %.3g)", e_out, tol_out, en.max, parts * u, e_lse, tol_lse);
        check(what, em.nonfinite == 0 && el.nonfinite == 0 && e_out <= tol_out && e_lse <= tol_lse);

        /* rows one half saw nothing of: the other half's bits; rows no key reaches: out 0, lse +inf */
        int one_empty = 0, none = 0, one_ok = 1, none_ok = 1;
        for (int64_t bb = 0; bb < B; bb++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < Nq; i++) {
                    const size_t l = (size_t)((bb * H + h) * Nq + i);
                    const int ea = isinf(la[l]), eb = isinf(lb[l]);
                    if (ea && eb) {
                        none++;
                        none_ok &= lm[l] == INFINITY && rlse[l] == INFINITY;
                        for (int64_t d = 0; d < D; d++) none_ok &= bits(om, t, offset(&tom, bb, i, h, d)) == 0;
                    } else if (ea || eb) {
                        one_empty++;
                        one_ok &= fbits(lm[l]) == fbits(ea ? lb[l] : la[l]);
                        for (int64_t d = 0; d < D; d++) {
                            const int64_t x = offset(&tom, bb, i, h, d);
                            one_ok &= bits(om, t, x) == bits(ea ? ob : oa, t, x);
                        }
                    }
                }
        if (one_empty) {
            snprintf(what, sizeof what, "  %d rows that one half saw nothing of: the other half, bit for bit",
                     one_empty);
            check(what, one_ok);
        }
        if (none) {
            snprintf(what, sizeof what, "  %d rows that no key reaches: out 0, lse +inf, as the oracle", none);
            check(what, none_ok);
        }
        free(ref), free(rlse), free(lowp), free(llse);
        free(oa), free(ob), free(om), free(la), free(lb), free(lm);
    }
    mem->free(dq), mem->free(dk), mem->free(dv), mem->free(doa), mem->free(dob), mem->free(dom);
    mem->free(dla), mem->free(dlb), mem->free(dlm);
    free(q), free(k), free(v);
}

#endif /* FLASHC_TESTS_MERGE_COMMON_H */
