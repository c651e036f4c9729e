/*
 * rotary_common.h - the checks of flashc_rotary that test_rotary.c (CPU backend) and gpu_rotary.cu (CUDA backend)
 * share, written once for both: tensors live where the context's backend computes, reached through a
 * flashc_case_memory (src/ref/testkit.h; rot_host_memory for the CPU), and every result is judged on host copies.
 *
 * rotary_case: x (B, N, H, D) in f32, f16 or bf16 and one of four layouts (contiguous; (B, H, N, D) storage with
 *   padded rows; a stride of 2 along D; a negative stride along N), tables (1, P, 1, R/2) in fp32 or x's dtype with
 *   padded rows, R = D or R < D, GPT-NeoX halves or GPT-J interleaved pairs, seq_start NULL or per sequence (one of
 *   them ending at the tables' last row), out in place or in another layout, poisoned before the call:
 *   - the whole out buffer bit for bit what the documented formula gives (fmaf(-x[b], s, x[a] * c), fmaf(x[b], c,
 *     x[a] * s), rounded once), dims R .. D - 1 copied (untouched in place), nothing outside the view written;
 *   - every rotated element within one rounding to the dtype (plus fp32's) of the fp64 rotation of the stored values.
 *   bad: seq_start puts one sequence's last row one past the tables and another's first row at -1: the CPU backend
 *   refuses (INVALID_ARGUMENT) and writes nothing; the CUDA backend writes NaN to those rows' first R elements and the
 *   rest as above.
 *   cpu (the GPU test): the same call on the CPU backend on host copies, which must give the CUDA result bit for bit.
 * Plain C that also compiles as CUDA C++.
 */
#ifndef FLASHC_TESTS_ROTARY_COMMON_H
#define FLASHC_TESTS_ROTARY_COMMON_H

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

static void *rot_host_alloc(size_t n) { return malloc(n ? n : 1); }
static int rot_host_copy(void *dst, const void *src, size_t n) {
    memcpy(dst, src, n);
    return 0;
}
static const flashc_case_memory rot_host_memory = {rot_host_alloc, free, rot_host_copy, rot_host_copy};

static void *rot_dev_copy_of(const flashc_case_memory *mem, const void *host, size_t n) {
    void *p = mem->alloc(n ? n : 1);
    if (!p || mem->to_device(p, host, n)) {
        fprintf(stderr, "device allocation or copy of %zu bytes failed\n", n);
        exit(2);
    }
    return p;
}

/* ---- elements ---------------------------------------------------------------------------------------------- */

static float rot_load(const void *p, flashc_dtype t, int64_t i) {
    switch (t) {
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)p)[i]);
    case FLASHC_DTYPE_BF16: return flashc_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static void rot_store(void *p, flashc_dtype t, int64_t i, float v) {
    switch (t) {
    case FLASHC_DTYPE_F16: ((uint16_t *)p)[i] = flashc_f32_to_f16(v); break;
    case FLASHC_DTYPE_BF16: ((uint16_t *)p)[i] = flashc_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

static int rot_same_bits(const void *a, const void *b, flashc_dtype t, int64_t i) {
    return t == FLASHC_DTYPE_F32 ? ((const uint32_t *)a)[i] == ((const uint32_t *)b)[i]
                                 : ((const uint16_t *)a)[i] == ((const uint16_t *)b)[i];
}

/* Unit roundoff of a dtype. */
static double rot_unit(flashc_dtype t) {
    return t == FLASHC_DTYPE_F32 ? ldexp(1.0, -24) : t == FLASHC_DTYPE_F16 ? ldexp(1.0, -11) : ldexp(1.0, -8);
}

/* ---- layouts ----------------------------------------------------------------------------------------------- */

enum { ROT_LAYOUTS = 4 };
static const char *const rot_layout_names[ROT_LAYOUTS] = {"contiguous", "BHND padded", "D stride 2", "N stride < 0"};

/* Strides of layout l for shape sh; returns the elements the buffer needs and sets *offset, the element of the buffer
 * where the view's data points (past the negative strides' reach). */
static int64_t rot_layout(int l, const int64_t sh[4], int64_t st[4], int64_t *offset) {
    const int64_t N = sh[1], H = sh[2], D = sh[3];
    switch (l) {
    case 1: st[3] = 1, st[1] = D + 3, st[2] = N * (D + 3), st[0] = H * N * (D + 3); break; /* (B, H, N, D + 3) */
    case 2: st[3] = 2, st[2] = 2 * D, st[1] = (H + 1) * 2 * D, st[0] = N * (H + 1) * 2 * D; break;
    case 3: st[3] = 1, st[2] = D, st[1] = -H * D, st[0] = N * H * D; break;
    default: st[3] = 1, st[2] = D, st[1] = H * D, st[0] = N * H * D;
    }
    int64_t reach = 0, neg = 0;
    for (int i = 0; i < 4; i++) {
        const int64_t r = (sh[i] - 1) * st[i];
        if (r < 0) neg -= r, reach -= r;
        else reach += r;
    }
    *offset = neg;
    return reach + 1;
}

static int64_t rot_at(const int64_t st[4], int64_t b, int64_t i, int64_t h, int64_t d) {
    return b * st[0] + i * st[1] + h * st[2] + d * st[3];
}

/* ---- one case ------------------------------------------------------------------------------------------------ */

typedef struct rot_case {
    flashc_dtype dt, tdt; /* x and out; the tables */
    int64_t B, N, H, D, R;
    int interleaved;
    int layout;     /* x's */
    int out_layout; /* -1: in place (out is x's view) */
    int starts;     /* 0: seq_start NULL; 1: per sequence */
    int bad;        /* 1: two sequences' rows reach outside the tables (needs B >= 3 and starts) */
} rot_case;

static void rot_case_name(const rot_case *c, char *buf, size_t n) {
    snprintf(buf, n, "%s tables %s B%lld N%lld H%lld D%lld R%lld %s x %s, out %s, seq_start %s%s",
             flashc_dtype_name(c->dt), flashc_dtype_name(c->tdt), (long long)c->B, (long long)c->N, (long long)c->H,
             (long long)c->D, (long long)c->R, c->interleaved ? "interleaved" : "halves", rot_layout_names[c->layout],
             c->out_layout < 0 ? "in place" : rot_layout_names[c->out_layout], c->starts ? "set" : "NULL",
             c->bad ? ", rows outside the tables" : "");
}

/* Runs c on ctx (its tensors in mem) and checks it; cpu: a CPU context to compare with bit for bit, or NULL. */
static void rotary_case(flashc_context_t ctx, const flashc_case_memory *mem, flashc_context_t cpu, const rot_case *c,
                        uint64_t seed) {
    const int64_t sh[4] = {c->B, c->N, c->H, c->D}, half = c->R / 2, step = c->interleaved ? 2 : 1,
                  other = c->interleaved ? 1 : half;
    const size_t esz = flashc_dtype_size(c->dt), tsz = flashc_dtype_size(c->tdt);
    const int on_cpu = flashc_context_backend(ctx) == FLASHC_BACKEND_CPU;
    char name[256], what[400];
    rot_case_name(c, name, sizeof name);
    uint64_t rng = seed;

    /* sequence starts: 0, 7, 2, 5, ...; the tables end at the longest one's last row */
    int32_t *starts = (int32_t *)xmalloc((size_t)c->B * 4);
    int64_t P = c->N;
    for (int64_t b = 0; b < c->B; b++) {
        starts[b] = c->starts ? (int32_t)((b * 7) % 11) : 0;
        if (starts[b] + c->N > P) P = starts[b] + c->N;
    }
    if (c->bad) starts[1] = (int32_t)(P - c->N + 1), starts[2] = -1;

    /* x, and out's buffer poisoned (all-ones bytes: NaN in every dtype) */
    int64_t xst[4], xoff, ost[4], ooff;
    const int64_t xn = rot_layout(c->layout, sh, xst, &xoff);
    const int64_t on = c->out_layout < 0 ? xn : rot_layout(c->out_layout, sh, ost, &ooff);
    if (c->out_layout < 0) memcpy(ost, xst, sizeof ost), ooff = xoff;
    void *xh = xmalloc((size_t)xn * esz), *oh = xmalloc((size_t)on * esz);
    for (int64_t i = 0; i < xn; i++) rot_store(xh, c->dt, i, (float)(2.0 * flashc_rand_normal(&rng)));
    if (c->out_layout >= 0) memset(oh, 0xff, (size_t)on * esz);

    /* tables with padded rows: (1, P, 1, R/2), row stride R/2 + 1 */
    const int64_t rs = half + 1, tn = P * rs;
    void *ch = xmalloc((size_t)tn * tsz), *sh_ = xmalloc((size_t)tn * tsz);
    for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < rs; j++) {
            const double ang = (double)p * pow(10000.0, -2.0 * (double)j / (double)c->R);
            rot_store(ch, c->tdt, p * rs + j, j < half ? (float)cos(ang) : NAN);
            rot_store(sh_, c->tdt, p * rs + j, j < half ? (float)sin(ang) : NAN);
        }

    /* what out's buffer must hold afterwards: the formula on the view's rows, the rest as it was; nan: elements that
     * must come out NaN (CUDA, rows outside the tables) */
    const void *src0 = c->out_layout < 0 ? xh : oh;
    void *want = xmalloc((size_t)on * esz);
    unsigned char *nan = (unsigned char *)calloc((size_t)on, 1);
    if (!nan) exit(2);
    memcpy(want, src0, (size_t)on * esz);
    double worst = 0.0; /* largest |error| / bound against fp64 over the rotated elements */
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t i = 0; i < c->N; i++)
            for (int64_t h = 0; h < c->H; h++) {
                const int64_t p = (int64_t)starts[b] + i, xo = xoff + rot_at(xst, b, i, h, 0),
                              oo = ooff + rot_at(ost, b, i, h, 0);
                const int outside = p < 0 || p >= P;
                for (int64_t d = c->R; d < c->D; d++)
                    rot_store(want, c->dt, oo + d * ost[3], rot_load(xh, c->dt, xo + d * xst[3]));
                for (int64_t j = 0; j < half; j++) {
                    const int64_t a = j * step, e = a + other;
                    if (outside) {
                        nan[oo + a * ost[3]] = nan[oo + e * ost[3]] = 1;
                        continue;
                    }
                    const float xa = rot_load(xh, c->dt, xo + a * xst[3]), xb = rot_load(xh, c->dt, xo + e * xst[3]),
                                cs = rot_load(ch, c->tdt, p * rs + j), sn = rot_load(sh_, c->tdt, p * rs + j);
                    const float pa = xa * cs, pb = xa * sn; /* rounded products, then one fma each */
                    rot_store(want, c->dt, oo + a * ost[3], fmaf(-xb, sn, pa));
                    rot_store(want, c->dt, oo + e * ost[3], fmaf(xb, cs, pb));
                    const double ra = (double)xa * cs - (double)xb * sn, rb = (double)xa * sn + (double)xb * cs;
                    const double mag = fabs((double)xa * cs) + fabs((double)xb * sn) + fabs((double)xa * sn) +
                                       fabs((double)xb * cs);
                    const double tol = rot_unit(c->dt) * fmax(fabs(ra), fabs(rb)) + 3.0 * ldexp(1.0, -24) * mag +
                                       ldexp(1.0, -25);
                    const double ea = fabs(rot_load(want, c->dt, oo + a * ost[3]) - ra) / tol,
                                 eb = fabs(rot_load(want, c->dt, oo + e * ost[3]) - rb) / tol;
                    if (!(ea <= worst)) worst = ea;
                    if (!(eb <= worst)) worst = eb;
                }
            }

    /* the call, on ctx's memory */
    void *xd = rot_dev_copy_of(mem, xh, (size_t)xn * esz);
    void *od = c->out_layout < 0 ? xd : rot_dev_copy_of(mem, oh, (size_t)on * esz);
    void *cd = rot_dev_copy_of(mem, ch, (size_t)tn * tsz), *sd = rot_dev_copy_of(mem, sh_, (size_t)tn * tsz);
    int32_t *startd = c->starts ? (int32_t *)rot_dev_copy_of(mem, starts, (size_t)c->B * 4) : NULL;
    flashc_tensor tx = {(char *)xd + xoff * (int64_t)esz, c->dt, {sh[0], sh[1], sh[2], sh[3]},
                        {xst[0], xst[1], xst[2], xst[3]}};
    flashc_tensor to = {(char *)od + ooff * (int64_t)esz, c->dt, {sh[0], sh[1], sh[2], sh[3]},
                        {ost[0], ost[1], ost[2], ost[3]}};
    flashc_tensor tc = {cd, c->tdt, {1, P, 1, half}, {P * rs, rs, half, 1}}, ts = tc;
    ts.data = sd;
    const flashc_status st = flashc_rotary(ctx, &tx, &tc, &ts, startd, c->interleaved, &to);
    void *got = xmalloc((size_t)on * esz);
    if (mem->to_host(got, od, (size_t)on * esz)) {
        fprintf(stderr, "copy back failed\n");
        exit(2);
    }

    if (c->bad && on_cpu) {
        snprintf(what, sizeof what, "%s: refused (INVALID_ARGUMENT, \"seq_start\" in the message), nothing written",
                 name);
        check(what, st == FLASHC_STATUS_INVALID_ARGUMENT && strstr(flashc_context_last_error(ctx), "seq_start") &&
                        !memcmp(got, src0, (size_t)on * esz));
    } else {
        int bits = st == FLASHC_STATUS_OK, nans = 1;
        for (int64_t i = 0; i < on && bits; i++) {
            if (nan[i]) nans &= rot_load(got, c->dt, i) != rot_load(got, c->dt, i);
            else bits &= rot_same_bits(got, want, c->dt, i);
        }
        snprintf(what, sizeof what, "%s: the formula bit for bit, nothing else written%s", name,
                 c->bad ? ", NaN rows outside" : "");
        check(what, bits && nans);
        if (st != FLASHC_STATUS_OK) printf("    %s: %s\n", flashc_status_string(st), flashc_context_last_error(ctx));
        if (!c->bad) {
            snprintf(what, sizeof what, "%s: fp64 rotation within one rounding (%.2f of the bound)", name, worst);
            check(what, worst <= 1.0);
        }
    }

    /* the CPU backend on host copies: the same bits */
    if (cpu && !c->bad) {
        void *x2 = xmalloc((size_t)xn * esz), *o2 = c->out_layout < 0 ? x2 : xmalloc((size_t)on * esz);
        memcpy(x2, xh, (size_t)xn * esz);
        if (c->out_layout >= 0) memcpy(o2, oh, (size_t)on * esz);
        flashc_tensor hx = tx, ho = to, hc = tc, hs = ts;
        hx.data = (char *)x2 + xoff * (int64_t)esz, ho.data = (char *)o2 + ooff * (int64_t)esz;
        hc.data = ch, hs.data = sh_;
        const flashc_status s2 = flashc_rotary(cpu, &hx, &hc, &hs, c->starts ? starts : NULL, c->interleaved, &ho);
        snprintf(what, sizeof what, "%s: the CPU backend's bits", name);
        check(what, s2 == FLASHC_STATUS_OK && !memcmp(o2, got, (size_t)on * esz));
        if (o2 != x2) free(o2);
        free(x2);
    }

    mem->free(xd);
    if (od != xd) mem->free(od);
    mem->free(cd), mem->free(sd);
    if (startd) mem->free(startd);
    free(starts), free(xh), free(oh), free(ch), free(sh_), free(want), free(nan), free(got);
}

/* The case table both programs run: every dtype pair, both pair layouts, R = D and R < D, every x layout with out in
 * place or in the next layout, seq_start NULL or set; then head dims 2 (one pair), 6 with R = 4 and 256 with R = 128,
 * contiguous rows with R < D (the CUDA backend's 16-byte path), and the rows outside the tables. */
static void rotary_cases(flashc_context_t ctx, const flashc_case_memory *mem, flashc_context_t cpu) {
    static const flashc_dtype dts[3] = {FLASHC_DTYPE_F32, FLASHC_DTYPE_F16, FLASHC_DTYPE_BF16};
    uint64_t seed = 1;
    for (int t = 0; t < 3; t++)
        for (int tt = 0; tt < 2; tt++)
            for (int il = 0; il < 2; il++)
                for (int r = 0; r < 2; r++)
                    for (int l = 0; l < ROT_LAYOUTS; l++)
                        for (int ip = 0; ip < 2; ip++) {
                            const rot_case c = {dts[t], tt ? dts[t] : FLASHC_DTYPE_F32, 3, 5, 3, 32, r ? 12 : 32,
                                                il, l, ip ? -1 : (l + 1) % ROT_LAYOUTS, (l + ip) % 2, 0};
                            rotary_case(ctx, mem, cpu, &c, seed++);
                        }
    const rot_case more[] = {
        {FLASHC_DTYPE_F32, FLASHC_DTYPE_F32, 2, 3, 2, 2, 2, 0, 0, 1, 1, 0},
        {FLASHC_DTYPE_BF16, FLASHC_DTYPE_F32, 2, 3, 2, 6, 4, 0, 2, -1, 1, 0},
        {FLASHC_DTYPE_F16, FLASHC_DTYPE_F32, 2, 4, 2, 6, 4, 1, 1, 0, 1, 0},
        {FLASHC_DTYPE_F16, FLASHC_DTYPE_F16, 2, 17, 4, 256, 128, 0, 1, 0, 1, 0},
        {FLASHC_DTYPE_BF16, FLASHC_DTYPE_BF16, 1, 9, 8, 256, 128, 1, 0, -1, 1, 0},
        /* contiguous rows with R < D: the CUDA backend's 16-byte path with the copy past R, and in place */
        {FLASHC_DTYPE_F32, FLASHC_DTYPE_F32, 2, 5, 3, 32, 16, 0, 0, 0, 1, 0},
        {FLASHC_DTYPE_BF16, FLASHC_DTYPE_BF16, 2, 5, 3, 64, 32, 1, 3, 0, 1, 0},
        {FLASHC_DTYPE_F16, FLASHC_DTYPE_F32, 2, 5, 3, 64, 16, 0, 0, -1, 1, 0},
        {FLASHC_DTYPE_F16, FLASHC_DTYPE_F32, 3, 4, 2, 64, 48, 0, 0, 0, 1, 1},
        {FLASHC_DTYPE_F32, FLASHC_DTYPE_F32, 3, 4, 2, 32, 8, 1, 0, -1, 1, 1},
        {FLASHC_DTYPE_F32, FLASHC_DTYPE_F32, 3, 4, 2, 32, 16, 0, 0, 1, 1, 1},
        {FLASHC_DTYPE_BF16, FLASHC_DTYPE_F32, 3, 4, 2, 32, 32, 1, 1, -1, 1, 1},
        {FLASHC_DTYPE_F16, FLASHC_DTYPE_F16, 4, 1, 2, 64, 64, 0, 3, -1, 1, 1},
    };
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) rotary_case(ctx, mem, cpu, &more[i], seed++);
}

#endif /* FLASHC_TESTS_ROTARY_COMMON_H */
