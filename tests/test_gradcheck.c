/*
 * test_gradcheck: the oracle's backward against central differences of the oracle's forward, in fp64, on
 * small shapes with every masking and scoring option (attention sinks' gradient included); then the library's fp32 CPU forward and backward against
 * the oracle on the same problems.
 *
 * The loss is L = sum(out * dout) for a random dout, so dL/dq, dL/dk, dL/dv are exactly what the backward
 * computes from dout. Inputs lie on a 2^-12 grid and the step is 2^-10, so x +- h is exact in fp32 and the
 * central difference (L(x + h) - L(x - h)) / 2h is taken at exactly the intended points; its error is
 * O(h^2) = O(1e-6) relative.
 */
#include "ref/testkit.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct gcase {
    const char *name;
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
    int64_t wl, wr;
    float scale, softcap;
    int alibi;          /* 0, 1 per head, 2 per (batch, head) */
    int64_t bq, bk;     /* block mask block sizes, 0 = none */
    const int32_t *lens; /* varlen: B (nq, nk) pairs, NULL = not varlen */
    const int32_t *used; /* seqused_k: B values, NULL = every key */
    int sinks;           /* 1: attention sinks, their gradient checked too */
} gcase;

static const int32_t lens_a[] = {3, 5, 0, 4, 6, 2};
static const int32_t lens_b[] = {4, 4, 2, 0, 5, 7};
static const int32_t used_a[] = {5, 0, 7};
static const int32_t used_b[] = {2, 3, 0}; /* within lens_a's key lengths 5, 4, 2 */

static const gcase cases[] = {
    {"plain", 2, 5, 7, 2, 2, 4, 0, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"causal_nq>nk", 1, 9, 6, 2, 1, 5, 1, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"causal_nq<nk", 1, 5, 9, 2, 2, 4, 1, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"window_2_1", 1, 8, 8, 2, 2, 4, 0, 2, 1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"window_inf_0_nq<nk", 1, 6, 9, 1, 1, 3, 0, -1, 0, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"softcap", 2, 6, 7, 2, 2, 4, 0, -1, -1, 1.0f, 1.5f, 0, 0, 0, NULL, NULL, 0},
    {"alibi_head", 2, 6, 7, 2, 2, 4, 0, -1, -1, 0, 0, 1, 0, 0, NULL, NULL, 0},
    {"alibi_batch_causal", 2, 7, 6, 2, 1, 4, 1, -1, -1, 0, 0, 2, 0, 0, NULL, NULL, 0},
    {"gqa_h4_kv2", 1, 5, 6, 4, 2, 4, 0, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"mqa_h3_kv1", 2, 4, 5, 3, 1, 3, 0, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 0},
    {"varlen", 3, 6, 5, 2, 2, 4, 0, -1, -1, 0, 0, 0, 0, 0, lens_a, NULL, 0},
    {"varlen_causal_gqa", 3, 5, 7, 4, 2, 3, 1, -1, -1, 0, 0, 0, 0, 0, lens_b, NULL, 0},
    {"block_mask", 2, 7, 8, 2, 2, 4, 0, -1, -1, 0, 0, 0, 2, 3, NULL, NULL, 0},
    {"all", 3, 6, 7, 4, 2, 4, 1, 3, -1, 0.8f, 2.0f, 2, 2, 3, lens_a, NULL, 0},
    {"used_k_causal", 3, 4, 7, 2, 1, 4, 1, -1, -1, 0, 0, 0, 0, 0, NULL, used_a, 0},
    {"sinks", 2, 5, 7, 4, 2, 4, 0, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 1},
    {"sinks_causal_empty", 1, 8, 5, 2, 2, 4, 1, -1, -1, 0, 0, 0, 0, 0, NULL, NULL, 1}, /* rows 0-2 see no key */
    {"all_used_sinks", 3, 6, 7, 4, 2, 4, 1, 3, -1, 0.8f, 2.0f, 2, 2, 3, lens_a, used_b, 1},
};

typedef struct setup {
    int64_t nb, rows_q, rows_k;
    int64_t nq_el, nk_el, lse_n;
    float *q, *k, *v, *out, *dout, *dq, *dk, *dv, *lse, *slopes, sinks[8], dsinks[8];
    uint8_t *mask;
    int32_t cu_q[8], cu_k[8];
    flashc_tensor tq, tk, tv, tout, tdout, tdq, tdk, tdv;
    flashc_params prm;
} setup;

static float grid_normal(uint64_t *rng) { /* a normal value on the 2^-12 grid */
    return (float)(nearbyint(flashc_rand_normal(rng) * 4096.0) / 4096.0);
}

static int setup_case(const gcase *c, uint64_t *rng, setup *s) {
    memset(s, 0, sizeof *s);
    s->nb = c->lens ? 1 : c->B;
    s->rows_q = c->Nq;
    s->rows_k = c->Nk;
    if (c->lens) {
        s->rows_q = s->rows_k = 0;
        for (int64_t b = 0; b < c->B; b++) {
            s->cu_q[b + 1] = s->cu_q[b] + c->lens[2 * b];
            s->cu_k[b + 1] = s->cu_k[b] + c->lens[2 * b + 1];
        }
        s->rows_q = s->cu_q[c->B];
        s->rows_k = s->cu_k[c->B];
    }
    s->nq_el = s->nb * s->rows_q * c->H * c->D;
    s->nk_el = s->nb * s->rows_k * c->Hkv * c->D;
    s->lse_n = s->nb * c->H * s->rows_q;
    s->q = malloc((size_t)s->nq_el * 4);
    s->out = malloc((size_t)s->nq_el * 4);
    s->dout = malloc((size_t)s->nq_el * 4);
    s->dq = malloc((size_t)s->nq_el * 4);
    s->k = malloc((size_t)s->nk_el * 4);
    s->v = malloc((size_t)s->nk_el * 4);
    s->dk = malloc((size_t)s->nk_el * 4);
    s->dv = malloc((size_t)s->nk_el * 4);
    s->lse = malloc((size_t)s->lse_n * 4);
    s->slopes = malloc((size_t)(c->B * c->H) * 4);
    int64_t nqb = c->bq ? (c->Nq + c->bq - 1) / c->bq : 0, nkb = c->bk ? (c->Nk + c->bk - 1) / c->bk : 0;
    s->mask = malloc((size_t)(c->B * c->H * nqb * nkb) + 1);
    if (!s->q || !s->out || !s->dout || !s->dq || !s->k || !s->v || !s->dk || !s->dv || !s->lse || !s->slopes ||
        !s->mask)
        return -1;
    for (int64_t i = 0; i < s->nq_el; i++) {
        s->q[i] = grid_normal(rng);
        s->dout[i] = grid_normal(rng);
    }
    for (int64_t i = 0; i < s->nk_el; i++) {
        s->k[i] = grid_normal(rng);
        s->v[i] = grid_normal(rng);
    }
    for (int64_t i = 0; i < c->B * c->H; i++) s->slopes[i] = (float)(0.1 + 0.5 * (double)(flashc_rand_u64(rng) % 1000) / 1000.0);
    for (int64_t i = 0; i < c->B * c->H * nqb * nkb; i++) s->mask[i] = flashc_rand_u64(rng) % 3 != 0;

    s->tq = flashc_tensor_contiguous(s->q, FLASHC_DTYPE_F32, s->nb, s->rows_q, c->H, c->D);
    s->tk = flashc_tensor_contiguous(s->k, FLASHC_DTYPE_F32, s->nb, s->rows_k, c->Hkv, c->D);
    s->tv = flashc_tensor_contiguous(s->v, FLASHC_DTYPE_F32, s->nb, s->rows_k, c->Hkv, c->D);
    s->tout = flashc_tensor_contiguous(s->out, FLASHC_DTYPE_F32, s->nb, s->rows_q, c->H, c->D);
    s->tdout = flashc_tensor_contiguous(s->dout, FLASHC_DTYPE_F32, s->nb, s->rows_q, c->H, c->D);
    s->tdq = flashc_tensor_contiguous(s->dq, FLASHC_DTYPE_F32, s->nb, s->rows_q, c->H, c->D);
    s->tdk = flashc_tensor_contiguous(s->dk, FLASHC_DTYPE_F32, s->nb, s->rows_k, c->Hkv, c->D);
    s->tdv = flashc_tensor_contiguous(s->dv, FLASHC_DTYPE_F32, s->nb, s->rows_k, c->Hkv, c->D);

    flashc_params *p = &s->prm;
    *p = flashc_params_default();
    p->softmax_scale = c->scale;
    p->causal = c->causal;
    p->window_left = c->wl;
    p->window_right = c->wr;
    p->softcap = c->softcap;
    if (c->alibi) {
        p->alibi_slopes = s->slopes;
        p->alibi_batch_stride = c->alibi == 2 ? c->H : 0;
    }
    if (c->bq) {
        p->block_mask = s->mask;
        p->block_mask_q = c->bq;
        p->block_mask_k = c->bk;
        p->block_mask_batch = c->B;
        p->block_mask_heads = c->H;
    }
    if (c->used) p->seqused_k = c->used;
    if (c->sinks) {
        for (int64_t h = 0; h < c->H; h++) s->sinks[h] = grid_normal(rng);
        p->sinks = s->sinks;
        p->dsinks = s->dsinks;
    }
    if (c->lens) {
        p->cu_seqlens_q = s->cu_q;
        p->cu_seqlens_k = s->cu_k;
        p->num_seqs = c->B;
        p->max_seqlen_q = c->Nq;
        p->max_seqlen_k = c->Nk;
    }
    return 0;
}

static void setup_free(setup *s) {
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->out);
    free(s->dout);
    free(s->dq);
    free(s->dk);
    free(s->dv);
    free(s->lse);
    free(s->slopes);
    free(s->mask);
}

/* sum(out * dout) with out from the fp64 oracle */
static double loss(const flashc_problem *p, const setup *s, double *out) {
    if (flashc_ref_forward(p, FLASHC_DTYPE_F32, out, NULL) != 0) return NAN;
    double l = 0;
    for (int64_t i = 0; i < s->nq_el; i++) l += out[i] * s->dout[i];
    return l;
}

/* max |a - b| / max |b| (b the reference), 0 when both are zero */
static double rel_max(const double *a, const double *b, int64_t n) {
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (fabs(a[i] - b[i]) > e || isnan(a[i])) e = isnan(a[i]) ? INFINITY : fabs(a[i] - b[i]);
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return m > 0 ? e / m : e;
}

/* ||a - b|| / ||b|| for a float array against doubles; absolute when b is all zero */
static double rel_norm_f(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int main(void) {
    const char *env = getenv("FLASHC_SEED");
    uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL);
    printf("test_gradcheck: FLASHC_SEED=%" PRIu64 "\n", seed);
    const double fd_tol = 1e-5, lib_out_tol = 1e-5, lib_grad_tol = 1e-4;
    printf("%-20s %10s %10s %10s   %10s %10s %10s %10s  %s\n", "case", "fd_dq", "fd_dk", "fd_dv", "lib_out", "lib_dq",
           "lib_dk", "lib_dv", "verdict");

    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "cannot create a CPU context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    int failed = 0;
    const size_t ncases = sizeof cases / sizeof cases[0];
    for (size_t ci = 0; ci < ncases; ci++) {
        const gcase *c = &cases[ci];
        uint64_t rng = seed * 1000003u + ci;
        setup s;
        flashc_problem p;
        double *ref[3] = {0}, *fd[3] = {0}, *out = NULL, *ref_out = NULL;
        int ok = setup_case(c, &rng, &s) == 0;
        if (ok && flashc_problem_build(NULL, FLASHC_OP_BACKWARD, &s.tq, &s.tk, &s.tv, &s.prm, &s.tout, s.lse, &s.tdout,
                                       &s.tdq, &s.tdk, &s.tdv, &p) != FLASHC_STATUS_OK) {
            printf("%-20s problem rejected: %s\n", c->name, flashc_context_last_error(NULL));
            ok = 0;
        }
        const int64_t n_el[3] = {s.nq_el, s.nk_el, s.nk_el};
        float *inputs[3] = {s.q, s.k, s.v};
        for (int t = 0; ok && t < 3; t++) {
            ref[t] = malloc((size_t)n_el[t] * sizeof(double));
            fd[t] = malloc((size_t)n_el[t] * sizeof(double));
            ok = ref[t] && fd[t];
        }
        out = malloc((size_t)s.nq_el * sizeof(double));
        ref_out = malloc((size_t)s.nq_el * sizeof(double));
        ok = ok && out && ref_out && flashc_ref_backward(&p, FLASHC_DTYPE_F32, ref[0], ref[1], ref[2]) == 0 &&
             flashc_ref_forward(&p, FLASHC_DTYPE_F32, ref_out, NULL) == 0;
        if (!ok) {
            printf("%-20s could not be set up\n", c->name);
            failed++;
            goto next;
        }

        /* central differences of the oracle's forward */
        const float h = 1.0f / 1024.0f;
        double err_fd[3];
        for (int t = 0; t < 3; t++) {
            for (int64_t i = 0; i < n_el[t]; i++) {
                float x = inputs[t][i];
                inputs[t][i] = x + h;
                double lp = loss(&p, &s, out);
                inputs[t][i] = x - h;
                double lm = loss(&p, &s, out);
                inputs[t][i] = x;
                fd[t][i] = (lp - lm) / (2.0 * (double)h);
            }
            err_fd[t] = rel_max(fd[t], ref[t], n_el[t]);
        }

        /* the sinks' gradient: the oracle's against central differences of its forward */
        double err_sink_fd = 0, err_sink_lib = 0, dsink_ref[8];
        if (c->sinks) {
            double fd_s[8];
            if (flashc_ref_sinks_grad(&p, dsink_ref, NULL) != 0) {
                printf("%-20s could not be set up\n", c->name);
                failed++;
                goto next;
            }
            for (int64_t hh = 0; hh < c->H; hh++) {
                const float x = s.sinks[hh];
                s.sinks[hh] = x + h;
                const double lp = loss(&p, &s, out);
                s.sinks[hh] = x - h;
                const double lm = loss(&p, &s, out);
                s.sinks[hh] = x;
                fd_s[hh] = (lp - lm) / (2.0 * (double)h);
            }
            err_sink_fd = rel_max(fd_s, dsink_ref, c->H);
        }

        /* the library's fp32 forward and backward */
        double err_lib[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
        flashc_status st = flashc_forward(ctx, &s.tq, &s.tk, &s.tv, &s.prm, &s.tout, s.lse, NULL, 0);
        if (st == FLASHC_STATUS_OK)
            st = flashc_backward(ctx, &s.tq, &s.tk, &s.tv, &s.tout, &s.tdout, s.lse, &s.prm, &s.tdq, &s.tdk, &s.tdv,
                                 NULL, 0);
        if (st == FLASHC_STATUS_OK) {
            err_lib[0] = rel_norm_f(s.out, ref_out, s.nq_el);
            err_lib[1] = rel_norm_f(s.dq, ref[0], s.nq_el);
            err_lib[2] = rel_norm_f(s.dk, ref[1], s.nk_el);
            err_lib[3] = rel_norm_f(s.dv, ref[2], s.nk_el);
            if (c->sinks) err_sink_lib = rel_norm_f(s.dsinks, dsink_ref, c->H);
        }
        int pass = st == FLASHC_STATUS_OK;
        for (int t = 0; t < 3; t++) pass &= err_fd[t] <= fd_tol;
        pass &= err_lib[0] <= lib_out_tol;
        for (int t = 1; t < 4; t++) pass &= err_lib[t] <= lib_grad_tol;
        pass &= err_sink_fd <= fd_tol && err_sink_lib <= lib_grad_tol;
        printf("%-20s %10.2e %10.2e %10.2e   %10.2e %10.2e %10.2e %10.2e  %s\n", c->name, err_fd[0], err_fd[1],
               err_fd[2], err_lib[0], err_lib[1], err_lib[2], err_lib[3], pass ? "PASS" : "FAIL");
        if (c->sinks)
            printf("    dsinks: finite differences %.2e, library %.2e\n", err_sink_fd, err_sink_lib);
        if (st != FLASHC_STATUS_OK)
            printf("    library: %s: %s\n", flashc_status_string(st), flashc_context_last_error(ctx));
        failed += !pass;
    next:
        for (int t = 0; t < 3; t++) {
            free(ref[t]);
            free(fd[t]);
        }
        free(out);
        free(ref_out);
        setup_free(&s);
    }
    printf("test_gradcheck: %zu of %zu passed (finite differences <= %.0e of max |grad|; library out <= %.0e, "
           "gradients <= %.0e relative)\n",
           ncases - (size_t)failed, ncases, fd_tol, lib_out_tol, lib_grad_tol);
    flashc_context_destroy(ctx);
    return failed ? 1 : 0;
}
