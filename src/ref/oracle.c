/*
 * oracle.c - the naive attention every test is measured against.
 *
 * For each (sequence, head) it materializes the whole score matrix S = scale * Q K^T (softcap, ALiBi and the
 * causal / window / block-sparse masks applied; the band and ALiBi measured between the positions of query_pos and
 * key_pos), P = softmax(S) row by row, O = P V, and for the backward
 * dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)), dQ = scale * dS K, dK = scale * dS^T Q, with the
 * softcap's chain rule (d/dx c*tanh(x/c) = 1 - tanh^2(x/c)) folded into dS. A sequence's keys are its first
 * seqused_k[b] when that is set (flashc_seq_bounds); an attention sink is one more term of each row's softmax
 * denominator, and its gradient is flashc_ref_sinks_grad's. With dropout, Z_ij = keep_ij / (1 - p) from dropout.h's
 * keep bit (never from the library's code paths): O = (P o Z) V, dV = (P o Z)^T dO, dS = P o (Z o dP - D) with
 * D_i = rowsum(P o Z o dP) = rowsum(dO o O); lse stays the undropped softmax's. Nothing is tiled or fused, so the code
 * can be checked against the formulas line by line.
 *
 * round == F32: every step in fp64 (the reference).
 * round == F16 / BF16: the same algorithm the way a framework runs it on low-precision tensors: every
 * materialized matrix (S, P, O, dP, dS, gradients) is rounded to the dtype, every sum is accumulated in fp32.
 * Its distance to the fp64 result is the "naive_lowp" error of the CONVENTIONS.md rule.
 */
#include "testkit.h"
#include "../dropout.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct oracle {
    const flashc_problem *p;
    flashc_dtype round;
    int lowp;
    int64_t D;
    /* per (sequence, head) scratch, sized for the longest sequence */
    double *q, *k, *v, *dout; /* (nq | nk, D) */
    double *s;                /* scores, -inf where masked (nq, nk) */
    double *g;                /* softcap derivative d s / d (scale q.k) (nq, nk), softcap only */
    double *pm;               /* probabilities (nq, nk) */
    double *lse;              /* (nq) */
    double *acc;              /* (nk, D) accumulator */
    double *acc2;             /* (nk, D) accumulator */
    double *row;              /* (D) */
    double *dp;               /* (nk) */
    double *zrow, *pzrow;     /* (nk): dropout factors Z of one row, and P o Z */
} oracle;

/* Rounds to the emulated storage dtype (identity for the fp64 reference). */
static double store(const oracle *o, double x) {
    switch (o->round) {
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(flashc_f32_to_f16((float)x));
    case FLASHC_DTYPE_BF16: return flashc_bf16_to_f32(flashc_f32_to_bf16((float)x));
    default: return x;
    }
}

/* Dropout factor Z of element (i, j) of sequence b, head h: 0 when dropped, 1 / (1 - p) when kept, 1 without
 * dropout. With positions dropout's (i, j) are the positions q_position + i, k_position + j (flashc.h). */
static double dropout_z(const flashc_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (!(p->dropout_p > 0.0f)) return 1.0;
    const uint64_t stream = flashc_dropout_stream(p->dropout_offset, b, p->H, h);
    const int64_t di = p->positions ? p->q_position + i : i, dj = p->positions ? p->k_position + j : j;
    return flashc_dropout_keep(p->dropout_seed, stream, di, dj, flashc_dropout_threshold(p->dropout_p))
               ? 1.0 / (1.0 - (double)p->dropout_p)
               : 0.0;
}

/* Rounds to the accumulator type: fp32 when emulating low precision. */
static double accum(const oracle *o, double x) { return o->lowp ? (double)(float)x : x; }

static double dot(const oracle *o, const double *a, const double *b, int64_t n) {
    /* four independent partial sums (as a blocked GEMM has): the oracle's cost is dominated by this loop */
    if (o->lowp) {
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            s0 += (float)a[i] * (float)b[i];
            s1 += (float)a[i + 1] * (float)b[i + 1];
            s2 += (float)a[i + 2] * (float)b[i + 2];
            s3 += (float)a[i + 3] * (float)b[i + 3];
        }
        for (; i < n; i++) s0 += (float)a[i] * (float)b[i];
        return (s0 + s1) + (s2 + s3);
    }
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

/* y += a * x, with y an fp32 accumulator when emulating low precision. */
static void axpy(const oracle *o, double *y, double a, const double *x, int64_t n) {
    if (o->lowp) {
        for (int64_t i = 0; i < n; i++) y[i] = (double)((float)y[i] + (float)a * (float)x[i]);
    } else {
        for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
    }
}

static double load_at(const flashc_tensor *t, int64_t off) {
    switch (t->dtype) {
    case FLASHC_DTYPE_F32: return ((const float *)t->data)[off];
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)t->data)[off]);
    case FLASHC_DTYPE_BF16: return flashc_bf16_to_f32(((const uint16_t *)t->data)[off]);
    }
    return NAN;
}

static double load(const flashc_tensor *t, int64_t b, int64_t n, int64_t h, int64_t d) {
    return load_at(t, b * t->stride[0] + n * t->stride[1] + h * t->stride[2] + d * t->stride[3]);
}

/*
 * Copies rows [r0, r0 + n) of head h of a (possibly packed) view into a contiguous (n, D) block. When emulating a
 * low precision on fp32 inputs (a backend that computes fp32 through bf16/f16 operands), the inputs are rounded
 * to it too; f16/bf16 inputs are exact already.
 */
static void gather(const oracle *o, const flashc_tensor *t, int64_t tb, int64_t r0, int64_t n, int64_t h, int64_t D,
                   double *dst) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d++) dst[i * D + d] = store(o, load(t, tb, r0 + i, h, d));
}

/* Keys [0, n) of sequence b (rows k0 .. of batch tb, or through the block table), head h, as gather does. */
static void gather_kv(const oracle *o, const flashc_tensor *t, int64_t b, int64_t tb, int64_t k0, int64_t n, int64_t h,
                      int64_t D, double *dst) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t off = flashc_kv_offset(o->p, t, b, tb, k0 + i, h);
        for (int64_t d = 0; d < D; d++) dst[i * D + d] = store(o, load_at(t, off + d * t->stride[3]));
    }
}

static void oracle_free(oracle *o) {
    free(o->q);
    free(o->k);
    free(o->v);
    free(o->dout);
    free(o->s);
    free(o->g);
    free(o->pm);
    free(o->lse);
    free(o->acc);
    free(o->acc2);
    free(o->row);
    free(o->dp);
    free(o->zrow);
    free(o->pzrow);
}

static int oracle_init(oracle *o, const flashc_problem *p, flashc_dtype round) {
    memset(o, 0, sizeof *o);
    o->p = p;
    o->round = round;
    o->lowp = round != FLASHC_DTYPE_F32;
    o->D = p->D;
    /* with varlen, Nq/Nk are only bounds: size the scratch from the actual sequences */
    int64_t mq = 1, mk = 1;
    for (int64_t b = 0; b < p->B; b++) {
        int64_t q0, nq, k0, nk;
        flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
        if (nq > mq) mq = nq;
        if (nk > mk) mk = nk;
    }
    size_t D = (size_t)p->D, sq = (size_t)mq, sk = (size_t)mk;
    o->q = malloc(sq * D * sizeof(double));
    o->dout = malloc(sq * D * sizeof(double));
    o->k = malloc(sk * D * sizeof(double));
    o->v = malloc(sk * D * sizeof(double));
    o->s = malloc(sq * sk * sizeof(double));
    o->g = malloc(sq * sk * sizeof(double));
    o->pm = malloc(sq * sk * sizeof(double));
    o->lse = malloc(sq * sizeof(double));
    o->acc = malloc(sk * D * sizeof(double));
    o->acc2 = malloc(sk * D * sizeof(double));
    o->row = malloc(D * sizeof(double));
    o->dp = malloc(sk * sizeof(double));
    o->zrow = malloc(sk * sizeof(double));
    o->pzrow = malloc(sk * sizeof(double));
    if (!o->q || !o->dout || !o->k || !o->v || !o->s || !o->g || !o->pm || !o->lse || !o->acc || !o->acc2 ||
        !o->row || !o->dp || !o->zrow || !o->pzrow) {
        oracle_free(o);
        return -1;
    }
    return 0;
}

/*
 * S and P of sequence b, head h from o->q, o->k (already gathered): fills o->s, o->g (softcap), o->pm and
 * o->lse (+inf for a row that sees no key, whose P row is then all zero).
 */
/* Positions of query row i and key j of a sequence of nq queries and nk (used) keys, as flashc.h defines them: with
 * positions q_position + i and k_position + j; else bottom-right aligned, row i at i + nk - nq, key j at j. Read here
 * from the definition, not through the library's helpers (flashc_row_key_range, flashc_seq_diag). */
static int64_t query_pos(const flashc_problem *p, int64_t i, int64_t nq, int64_t nk) {
    return p->positions ? p->q_position + i : i + nk - nq;
}
static int64_t key_pos(const flashc_problem *p, int64_t j) { return p->positions ? p->k_position + j : j; }

/* Whether the causal / window band lets query position qp see key position kp: kp in [qp - left, qp + right]. */
static int band_keeps(const flashc_problem *p, int64_t qp, int64_t kp) {
    return (p->win_left < 0 || kp >= qp - p->win_left) && (p->win_right < 0 || kp <= qp + p->win_right);
}

static void scores_and_probs(oracle *o, int64_t b, int64_t h, int64_t nq, int64_t nk) {
    const flashc_problem *p = o->p;
    const int64_t D = o->D;
    const double scale = p->scale, cap = p->softcap, slope = flashc_alibi_slope(p, b, h);
    for (int64_t i = 0; i < nq; i++) {
        double *s = o->s + i * nk, *g = o->g + i * nk, *pr = o->pm + i * nk;
        const int64_t qp = query_pos(p, i, nq, nk);
        double m = -INFINITY;
        for (int64_t j = 0; j < nk; j++) {
            s[j] = -INFINITY;
            g[j] = 0.0;
            if (!band_keeps(p, qp, key_pos(p, j)) || !flashc_block_visible(p, b, h, i, j)) continue;
            double x = store(o, scale * dot(o, o->q + i * D, o->k + j * D, D));
            if (cap > 0) {
                double t = store(o, tanh(store(o, x / cap)));
                x = store(o, cap * t);
                g[j] = store(o, 1.0 - t * t);
            }
            if (p->alibi) x = store(o, x - accum(o, slope * (double)llabs(qp - key_pos(p, j))));
            s[j] = x;
            if (x > m) m = x;
        }
        if (m == -INFINITY) {
            for (int64_t j = 0; j < nk; j++) pr[j] = 0.0;
            o->lse[i] = p->sinks ? (double)p->sinks[h] : INFINITY;
            continue;
        }
        double sum = 0.0;
        if (p->sinks) { /* the sink joins the denominator: one more term, exp(sink - m), without a value */
            const double sink = p->sinks[h];
            if (sink > m) m = sink;
            sum = accum(o, exp(accum(o, sink - m)));
        }
        for (int64_t j = 0; j < nk; j++) {
            pr[j] = accum(o, exp(accum(o, s[j] - m))); /* exp(-inf) = 0 for masked keys */
            sum = accum(o, sum + pr[j]);
        }
        for (int64_t j = 0; j < nk; j++) pr[j] = store(o, pr[j] / sum);
        o->lse[i] = accum(o, m + log(sum));
    }
}

int flashc_ref_forward(const flashc_problem *p, flashc_dtype round, double *out, double *lse) {
    oracle o;
    if (oracle_init(&o, p, round) != 0) return -1;
    const int64_t H = p->H, D = p->D, group = p->H / p->Hkv;
    const int64_t rows_q = p->varlen ? p->total_q : p->Nq;
    const int64_t nbatch = p->varlen ? 1 : p->B;
    if (out) memset(out, 0, (size_t)(nbatch * rows_q * H * D) * sizeof(double));
    if (lse)
        for (int64_t i = 0; i < nbatch * H * rows_q; i++) lse[i] = INFINITY;

    for (int64_t b = 0; b < p->B; b++) {
        int64_t q0, nq, k0, nk;
        flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
        int64_t tb = p->varlen ? 0 : b;
        if (nq == 0) continue;
        for (int64_t h = 0; h < H; h++) {
            int64_t hk = h / group;
            gather(&o, &p->q, tb, q0, nq, h, D, o.q);
            gather_kv(&o, &p->k, b, tb, k0, nk, hk, D, o.k);
            gather_kv(&o, &p->v, b, tb, k0, nk, hk, D, o.v);
            scores_and_probs(&o, b, h, nq, nk);
            for (int64_t i = 0; i < nq; i++) {
                int64_t row = tb * rows_q + q0 + i;
                if (lse) lse[(tb * H + h) * rows_q + q0 + i] = o.lse[i];
                if (!out) continue;
                double *acc = o.acc;
                for (int64_t d = 0; d < D; d++) acc[d] = 0.0;
                const double *pr = o.pm + i * nk;
                for (int64_t j = 0; j < nk; j++)
                    if (pr[j] != 0.0) axpy(&o, acc, store(&o, pr[j] * dropout_z(p, b, h, i, j)), o.v + j * D, D);
                double *dst = out + (row * H + h) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = store(&o, acc[d]);
            }
        }
    }
    oracle_free(&o);
    return 0;
}

int flashc_ref_backward(const flashc_problem *p, flashc_dtype round, double *dq, double *dk, double *dv) {
    oracle o;
    if (oracle_init(&o, p, round) != 0) return -1;
    const int64_t H = p->H, Hkv = p->Hkv, D = p->D, group = p->H / p->Hkv;
    const int64_t rows_q = p->varlen ? p->total_q : p->Nq;
    const int64_t rows_k = p->varlen ? p->total_k : p->Nk;
    const int64_t nbatch = p->varlen ? 1 : p->B;
    const double scale = p->scale;
    /* dk, dv: like k, i.e. with a block table the page pools (num_pages, page_size, Hkv, D), 0 where no key lies */
    const size_t nq_el = (size_t)(nbatch * rows_q * H * D),
                 nk_el = p->block_table ? (size_t)(p->num_pages * p->page_size * Hkv * D)
                                        : (size_t)(nbatch * rows_k * Hkv * D);
    /* dk/dv are summed over a group's heads in these, also when the caller does not want them */
    double *sum_dk = dk ? dk : malloc(nk_el * sizeof(double));
    double *sum_dv = dv ? dv : malloc(nk_el * sizeof(double));
    if (!sum_dk || !sum_dv) {
        if (!dk) free(sum_dk);
        if (!dv) free(sum_dv);
        oracle_free(&o);
        return -1;
    }
    if (dq) memset(dq, 0, nq_el * sizeof(double));
    memset(sum_dk, 0, nk_el * sizeof(double));
    memset(sum_dv, 0, nk_el * sizeof(double));

    for (int64_t b = 0; b < p->B; b++) {
        int64_t q0, nq, k0, nk;
        flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
        int64_t tb = p->varlen ? 0 : b;
        if (nq == 0 || nk == 0) continue;
        double *dpr = o.dp, *drow = o.row;
        for (int64_t h = 0; h < H; h++) {
            int64_t hk = h / group;
            gather(&o, &p->q, tb, q0, nq, h, D, o.q);
            gather_kv(&o, &p->k, b, tb, k0, nk, hk, D, o.k);
            gather_kv(&o, &p->v, b, tb, k0, nk, hk, D, o.v);
            gather(&o, &p->dout, tb, q0, nq, h, D, o.dout);
            scores_and_probs(&o, b, h, nq, nk);
            double *dk_h = o.acc, *dv_h = o.acc2; /* this head's dK (before scale) and dV */
            memset(dk_h, 0, (size_t)(nk * D) * sizeof(double));
            memset(dv_h, 0, (size_t)(nk * D) * sizeof(double));
            for (int64_t i = 0; i < nq; i++) {
                const double *pr = o.pm + i * nk, *g = o.g + i * nk, *doi = o.dout + i * D, *qi = o.q + i * D;
                double *z = o.zrow, *pz = o.pzrow; /* dropout factors, and P o Z as the forward used it */
                for (int64_t j = 0; j < nk; j++) {
                    z[j] = dropout_z(p, b, h, i, j);
                    pz[j] = store(&o, pr[j] * z[j]);
                }
                /* dP = dO V^T */
                for (int64_t j = 0; j < nk; j++)
                    dpr[j] = pr[j] == 0.0 ? 0.0 : store(&o, dot(&o, doi, o.v + j * D, D));
                /* D_i = rowsum(P o dP) = rowsum(dO o O). The reference takes the first form, which is exactly
                 * zero-sum for a row that sees one key (P = 1) as the math says. The emulation takes the second
                 * with O as the forward stored it, in the dtype: that rounding reaches every low-precision
                 * backward that reads O, so the yardstick must carry it too. */
                double di = 0.0;
                if (o.lowp) {
                    for (int64_t d = 0; d < D; d++) drow[d] = 0.0;
                    for (int64_t j = 0; j < nk; j++)
                        if (pz[j] != 0.0) axpy(&o, drow, pz[j], o.v + j * D, D);
                    for (int64_t d = 0; d < D; d++) di = accum(&o, di + doi[d] * store(&o, drow[d]));
                } else {
                    for (int64_t j = 0; j < nk; j++) di += pz[j] * dpr[j];
                }
                for (int64_t d = 0; d < D; d++) drow[d] = 0.0;
                for (int64_t j = 0; j < nk; j++) {
                    if (pr[j] == 0.0) continue;
                    if (pz[j] != 0.0) axpy(&o, dv_h + j * D, pz[j], doi, D);
                    const double zdp = z[j] == 1.0 ? dpr[j] : store(&o, z[j] * dpr[j]); /* dL/dP: through Z */
                    double ds = store(&o, pr[j] * accum(&o, zdp - di));
                    if (p->softcap > 0) ds = store(&o, ds * g[j]);
                    axpy(&o, drow, ds, o.k + j * D, D);
                    axpy(&o, dk_h + j * D, ds, qi, D);
                }
                if (dq) {
                    double *dst = dq + ((tb * rows_q + q0 + i) * H + h) * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = store(&o, scale * drow[d]);
                }
            }
            for (int64_t j = 0; j < nk; j++) {
                const int64_t krow = p->block_table ? p->block_table[b * p->bt_stride + j / p->page_size] *
                                                              p->page_size + j % p->page_size
                                                    : tb * rows_k + k0 + j;
                double *ddk = sum_dk + (krow * Hkv + hk) * D;
                double *ddv = sum_dv + (krow * Hkv + hk) * D;
                for (int64_t d = 0; d < D; d++) {
                    ddk[d] += store(&o, scale * dk_h[j * D + d]);
                    ddv[d] += store(&o, dv_h[j * D + d]);
                }
            }
        }
    }
    if (o.lowp && group > 1) { /* the sum over a group's heads is one more fp32 sum, stored in the dtype */
        for (size_t i = 0; i < nk_el; i++) {
            sum_dk[i] = store(&o, sum_dk[i]);
            sum_dv[i] = store(&o, sum_dv[i]);
        }
    }
    if (!dk) free(sum_dk);
    if (!dv) free(sum_dv);
    oracle_free(&o);
    return 0;
}

int flashc_ref_sinks_grad(const flashc_problem *p, double *dsinks, double *mag) {
    if (!p->sinks) return -1;
    oracle o;
    if (oracle_init(&o, p, FLASHC_DTYPE_F32) != 0) return -1;
    const int64_t H = p->H, D = p->D, group = p->H / p->Hkv;
    for (int64_t h = 0; h < H; h++) {
        dsinks[h] = 0.0;
        if (mag) mag[h] = 0.0;
    }
    for (int64_t b = 0; b < p->B; b++) {
        int64_t q0, nq, k0, nk;
        flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
        const int64_t tb = p->varlen ? 0 : b;
        if (nq == 0) continue;
        for (int64_t h = 0; h < H; h++) {
            gather(&o, &p->q, tb, q0, nq, h, D, o.q);
            gather_kv(&o, &p->k, b, tb, k0, nk, h / group, D, o.k);
            gather_kv(&o, &p->v, b, tb, k0, nk, h / group, D, o.v);
            gather(&o, &p->dout, tb, q0, nq, h, D, o.dout);
            scores_and_probs(&o, b, h, nq, nk);
            for (int64_t i = 0; i < nq; i++) {
                /* d sink = -P_sink D_i, P_sink = exp(sink - lse_i), D_i = sum_j P_ij dP_ij, dP_ij = dO_i . V_j.
                 * mag: the same sum over the products' absolute values, the scale of D_i's rounding (D_i cancels:
                 * a library forms it as dO_i . O_i from rounded values) */
                const double *pr = o.pm + i * nk;
                double di = 0.0, dabs = 0.0; /* with dropout D_i = sum_j P_ij Z_ij dP_ij = dO_i . O_i */
                for (int64_t j = 0; j < nk; j++)
                    if (pr[j] != 0.0) {
                        const double pz = pr[j] * dropout_z(p, b, h, i, j);
                        const double *dr = o.dout + i * D, *vr = o.v + j * D;
                        di += pz * dot(&o, dr, vr, D);
                        if (mag)
                            for (int64_t d = 0; d < D; d++) dabs += fabs(pz * dr[d] * vr[d]);
                    }
                const double ps = exp((double)p->sinks[h] - o.lse[i]);
                dsinks[h] -= ps * di;
                if (mag) mag[h] += ps * dabs;
            }
        }
    }
    oracle_free(&o);
    return 0;
}
