/*
 * The CPU attention drivers: FlashAttention-2 (Dao 2023, Algorithms 1 and 2) on fp32 tiles.
 *
 * Forward: one task per (sequence, head, block of br query rows). The query block stays resident while key/value
 * blocks of bc rows stream past it; the online-softmax state (running max m, running sum l, output accumulator
 * O) is updated per block in base 2, and only O and the lse are written. Causal and window masks bound the key
 * range of each query block and the block-sparse mask skips whole tiles; partial tiles mask element-wise.
 *
 * Backward: P is recomputed from q, k and the saved lse, never stored. D_i = rowsum(dO o O) is computed first;
 * then one pass per (sequence, kv head, key block) accumulates dK, dV over every query head of its group and
 * every query block, and a second pass per (sequence, head, query block) accumulates dQ over the key blocks.
 * Every gradient element has exactly one writer and a fixed summation order, so the result is deterministic
 * and race-free at the cost of recomputing S and dP twice.
 *
 * Extra memory: per thread a few tiles (see workspace sizes below), plus D (B x H x Nq floats) in backward.
 */
#include "cpu.h"

#include <string.h>
#ifdef _OPENMP
#  include <omp.h>
#endif

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static int imin(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

/* Per-thread buffer layout, in floats; every piece starts 64-byte aligned. */
typedef struct tile_bufs {
    float *q, *o, *s, *kt, *v, *m, *l;           /* forward */
    float *k, *vt, *dk, *dv, *dout, *dp, *t, *lse, *di, *dq; /* backward */
} tile_bufs;

typedef struct layout {
    int br, bc, dp;
    size_t per_thread; /* floats */
} layout;

static layout make_layout(const flashc_problem *p, int backward) {
    flashc_cpu_tiles t = flashc_cpu_choose_tiles(p->D);
    layout L;
    L.br = t.br;
    L.bc = t.bc;
    L.dp = (int)round_up(p->D, 16);
    size_t br = (size_t)L.br, bc = (size_t)L.bc, dp = (size_t)L.dp;
    if (!backward)
        L.per_thread = 2 * br * dp + 2 * bc * dp + br * bc + 2 * round_up(L.br, 16);
    else
        L.per_thread = 3 * br * dp + 5 * bc * dp + 3 * br * bc + 2 * round_up(L.br, 16);
    return L;
}

static float *align64(void *ptr) { return (float *)(((uintptr_t)ptr + 63) & ~(uintptr_t)63); }

static tile_bufs carve(float *base, const layout *L, int backward) {
    tile_bufs b;
    memset(&b, 0, sizeof b);
    size_t br = (size_t)L->br, bc = (size_t)L->bc, dp = (size_t)L->dp, vr = (size_t)round_up(L->br, 16);
    float *x = base;
#define TAKE(ptr, n) (ptr = x, x += (n))
    TAKE(b.q, br * dp);
    TAKE(b.s, br * bc);
    TAKE(b.kt, bc * dp);
    if (!backward) {
        TAKE(b.o, br * dp);
        TAKE(b.v, bc * dp);
        TAKE(b.m, vr);
        TAKE(b.l, vr);
    } else {
        TAKE(b.k, bc * dp);
        TAKE(b.vt, bc * dp);
        TAKE(b.dk, bc * dp);
        TAKE(b.dv, bc * dp);
        TAKE(b.dout, br * dp);
        TAKE(b.dq, br * dp);
        TAKE(b.dp, br * bc);
        TAKE(b.t, br * bc);
        TAKE(b.lse, vr);
        TAKE(b.di, vr);
    }
#undef TAKE
    return b;
}

size_t flashc_cpu_forward_workspace(const struct flashc_context *ctx, const flashc_problem *p) {
    layout L = make_layout(p, 0);
    return (size_t)flashc_cpu_thread_count(ctx) * L.per_thread * sizeof(float) + 64;
}

static size_t di_floats(const flashc_problem *p) {
    return (size_t)round_up(p->varlen ? p->H * p->total_q : p->B * p->H * p->Nq, 16);
}

size_t flashc_cpu_backward_workspace(const struct flashc_context *ctx, const flashc_problem *p) {
    layout L = make_layout(p, 1);
    return ((size_t)flashc_cpu_thread_count(ctx) * L.per_thread + di_floats(p)) * sizeof(float) + 64;
}

/* Key range [*lo, *hi) any row of the query block [i0, i0 + rows) may see through causal/window masks. */
static void block_key_range(const flashc_problem *p, int64_t i0, int rows, int64_t nq, int64_t nk, int64_t *lo,
                            int64_t *hi) {
    int64_t l0, h0, l1, h1;
    flashc_row_key_range(p, i0, nq, nk, &l0, &h0);
    flashc_row_key_range(p, i0 + rows - 1, nq, nk, &l1, &h1);
    *lo = l0 < 0 ? 0 : l0;
    *hi = h1 > nk ? nk : h1;
}

/* ---- forward ---------------------------------------------------------------------------------------------- */

/* Online-softmax update for one tile: s (log2 units) becomes P, the running max/sum move, O rows rescale. */
static void softmax_update(float *s, int lds, int rows, int cols, float *m, float *l, float *o, int ldo, int D) {
    for (int r = 0; r < rows; r++) {
        float *row = s + (size_t)r * lds;
        float mx = m[r];
        for (int c = 0; c < cols; c++) mx = row[c] > mx ? row[c] : mx;
        if (mx == -INFINITY) { /* nothing visible yet in this row */
            for (int c = 0; c < cols; c++) row[c] = 0.0f;
            continue;
        }
        const float alpha = exp2f(m[r] - mx); /* 0 when m was -inf */
        float sum = 0.0f;
        for (int c = 0; c < cols; c++) {
            row[c] = exp2f(row[c] - mx);
            sum += row[c];
        }
        l[r] = l[r] * alpha + sum;
        m[r] = mx;
        if (alpha != 1.0f) {
            float *orow = o + (size_t)r * ldo;
            for (int d = 0; d < D; d++) orow[d] *= alpha;
        }
    }
}

static void forward_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                         int64_t b, int64_t h, int64_t qb) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t i0 = qb * L->br;
    if (i0 >= nq) return;
    const int rows = imin(L->br, nq - i0), D = (int)p->D, dp = L->dp, bc = L->bc;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), hk = h / (p->H / p->Hkv);

    flashc_cpu_load_rows(t->q, dp, &p->q, tb, q0 + i0, rows, rows, h, D, p->scale);
    memset(t->o, 0, sizeof(float) * (size_t)rows * dp);
    for (int r = 0; r < rows; r++) {
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
    }
    int64_t lo, hi;
    block_key_range(p, i0, rows, nq, nk, &lo, &hi);
    for (int64_t j0 = lo; j0 < hi; j0 += bc) {
        const int cols = imin(bc, hi - j0);
        if (!flashc_cpu_tile_visible(p, b, h, i0, rows, j0, cols)) continue;
        flashc_cpu_load_rows_t(t->kt, bc, &p->k, tb, k0 + j0, cols, cols, hk, D);
        flashc_cpu_load_rows(t->v, dp, &p->v, tb, k0 + j0, cols, cols, hk, D, 1.0f);
        kern->gemm_nn(rows, cols, D, t->q, dp, t->kt, bc, t->s, bc, 0); /* S = (scale Q) K^T */
        flashc_cpu_score_epilogue(p, b, h, nq, nk, i0, rows, j0, cols, t->s, bc, NULL);
        softmax_update(t->s, bc, rows, cols, t->m, t->l, t->o, dp, D);
        kern->gemm_nn(rows, D, cols, t->s, bc, t->v, dp, t->o, dp, 1); /* O += P V */
    }
    float *lse = p->lse ? p->lse + flashc_cpu_lse_offset(p, b, h, q0) + i0 : NULL;
    for (int r = 0; r < rows; r++) {
        float *orow = t->o + (size_t)r * dp;
        if (t->l[r] == 0.0f) { /* no visible key: output 0, lse +inf */
            memset(orow, 0, sizeof(float) * (size_t)D);
            if (lse) lse[r] = INFINITY;
            continue;
        }
        const float inv = 1.0f / t->l[r];
        for (int d = 0; d < D; d++) orow[d] *= inv;
        if (lse) lse[r] = (t->m[r] + log2f(t->l[r])) * FLASHC_LN2;
    }
    flashc_cpu_store_rows(&p->out, tb, q0 + i0, rows, h, D, t->o, dp);
}

flashc_status flashc_cpu_forward(struct flashc_context *ctx, const flashc_problem *p, void *workspace) {
    FLASHC_TRY(flashc_cpu_check_varlen(ctx, p));
    const flashc_cpu_kernels *kern = flashc_cpu_select_kernels();
    const layout L = make_layout(p, 0);
    const int nthreads = flashc_cpu_thread_count(ctx);
    const int64_t nqb = (p->Nq + L.br - 1) / L.br, ntasks = p->B * p->H * nqb;
    float *base = align64(workspace);
#ifdef _OPENMP
#  pragma omp parallel num_threads(nthreads)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        tile_bufs t = carve(base + (size_t)tid * L.per_thread, &L, 0);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t task = 0; task < ntasks; task++) {
            const int64_t qb = task % nqb, bh = task / nqb;
            forward_task(p, kern, &L, &t, bh / p->H, bh % p->H, qb);
        }
    }
    (void)nthreads;
    return FLASHC_STATUS_OK;
}

/* ---- backward --------------------------------------------------------------------------------------------- */

/* Recomputes P (into s) and dS (into dp) for one tile; s holds scale * q.k on entry. */
static void recompute_ds(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                         int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t i0, int rows, int64_t j0, int cols) {
    const int bc = L->bc, dp = L->dp, D = (int)p->D;
    flashc_cpu_score_epilogue(p, b, h, nq, nk, i0, rows, j0, cols, t->s, bc, p->softcap > 0.0f ? t->t : NULL);
    for (int r = 0; r < rows; r++) {
        float *row = t->s + (size_t)r * bc;
        const float l2 = t->lse[r] * FLASHC_LOG2E;
        for (int c = 0; c < cols; c++) row[c] = row[c] == -INFINITY ? 0.0f : exp2f(row[c] - l2);
    }
    kern->gemm_nn(rows, cols, D, t->dout, dp, t->vt, bc, t->dp, bc, 0); /* dP = dO V^T */
    for (int r = 0; r < rows; r++) {
        const float *prow = t->s + (size_t)r * bc;
        float *dsrow = t->dp + (size_t)r * bc;
        const float di = t->di[r];
        for (int c = 0; c < cols; c++) dsrow[c] = prow[c] * (dsrow[c] - di);
        if (p->softcap > 0.0f) { /* d(c tanh(x/c))/dx = 1 - tanh^2 */
            const float *trow = t->t + (size_t)r * bc;
            for (int c = 0; c < cols; c++) dsrow[c] *= 1.0f - trow[c] * trow[c];
        }
    }
}

/* Loads the query-side tiles of one block: scale*Q, dO, lse and D. */
static void load_query_side(const flashc_problem *p, const layout *L, tile_bufs *t, const float *dvec, int64_t b,
                            int64_t h, int64_t q0, int64_t i0, int rows) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    flashc_cpu_load_rows(t->q, L->dp, &p->q, tb, q0 + i0, rows, rows, h, p->D, p->scale);
    flashc_cpu_load_rows(t->dout, L->dp, &p->dout, tb, q0 + i0, rows, rows, h, p->D, 1.0f);
    const int64_t off = flashc_cpu_lse_offset(p, b, h, q0) + i0;
    memcpy(t->lse, p->lse + off, sizeof(float) * (size_t)rows);
    memcpy(t->di, dvec + off, sizeof(float) * (size_t)rows);
}

/* Loads the key-side tiles of one block: K, K^T and V^T. */
static void load_key_side(const flashc_problem *p, const layout *L, tile_bufs *t, int64_t b, int64_t hk,
                          int64_t k0, int64_t j0, int cols) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    flashc_cpu_load_rows(t->k, L->dp, &p->k, tb, k0 + j0, cols, cols, hk, p->D, 1.0f);
    flashc_cpu_load_rows_t(t->kt, L->bc, &p->k, tb, k0 + j0, cols, cols, hk, p->D);
    flashc_cpu_load_rows_t(t->vt, L->bc, &p->v, tb, k0 + j0, cols, cols, hk, p->D);
}

/* D_i = rowsum(dO o O) for every row of (b, h). */
static void dvec_task(const flashc_problem *p, float *dvec, float *o, float *dout, int64_t b, int64_t h) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t tb = flashc_cpu_tensor_batch(p, b), D = p->D;
    float *dst = dvec + flashc_cpu_lse_offset(p, b, h, q0);
    for (int64_t i = 0; i < nq; i++) {
        flashc_cpu_load_rows(o, (int)D, &p->out, tb, q0 + i, 1, 1, h, D, 1.0f);
        flashc_cpu_load_rows(dout, (int)D, &p->dout, tb, q0 + i, 1, 1, h, D, 1.0f);
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc += o[d] * dout[d];
        dst[i] = acc;
    }
}

static void dkdv_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                      const float *dvec, int64_t b, int64_t hk, int64_t kb) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t j0 = kb * L->bc;
    if (j0 >= nk) return;
    const int cols = imin(L->bc, nk - j0), D = (int)p->D, dp = L->dp, bc = L->bc, br = L->br;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), group = p->H / p->Hkv;
    load_key_side(p, L, t, b, hk, k0, j0, cols);
    memset(t->dk, 0, sizeof(float) * (size_t)cols * dp);
    memset(t->dv, 0, sizeof(float) * (size_t)cols * dp);
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int64_t i0 = 0; i0 < nq; i0 += br) {
            const int rows = imin(br, nq - i0);
            int64_t lo, hi;
            block_key_range(p, i0, rows, nq, nk, &lo, &hi);
            if (hi <= j0 || lo >= j0 + cols) continue;
            if (!flashc_cpu_tile_visible(p, b, h, i0, rows, j0, cols)) continue;
            load_query_side(p, L, t, dvec, b, h, q0, i0, rows);
            kern->gemm_nn(rows, cols, D, t->q, dp, t->kt, bc, t->s, bc, 0);
            recompute_ds(p, kern, L, t, b, h, nq, nk, i0, rows, j0, cols);
            kern->gemm_tn(cols, D, rows, t->s, bc, t->dout, dp, t->dv, dp, 1); /* dV += P^T dO */
            kern->gemm_tn(cols, D, rows, t->dp, bc, t->q, dp, t->dk, dp, 1);   /* dK += dS^T (scale Q) */
        }
    }
    flashc_cpu_store_rows(&p->dk, tb, k0 + j0, cols, hk, D, t->dk, dp);
    flashc_cpu_store_rows(&p->dv, tb, k0 + j0, cols, hk, D, t->dv, dp);
}

static void dq_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                    const float *dvec, int64_t b, int64_t h, int64_t qb) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t i0 = qb * L->br;
    if (i0 >= nq) return;
    const int rows = imin(L->br, nq - i0), D = (int)p->D, dp = L->dp, bc = L->bc;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), hk = h / (p->H / p->Hkv);
    load_query_side(p, L, t, dvec, b, h, q0, i0, rows);
    memset(t->dq, 0, sizeof(float) * (size_t)rows * dp);
    int64_t lo, hi;
    block_key_range(p, i0, rows, nq, nk, &lo, &hi);
    for (int64_t j0 = lo; j0 < hi; j0 += bc) {
        const int cols = imin(bc, hi - j0);
        if (!flashc_cpu_tile_visible(p, b, h, i0, rows, j0, cols)) continue;
        load_key_side(p, L, t, b, hk, k0, j0, cols);
        kern->gemm_nn(rows, cols, D, t->q, dp, t->kt, bc, t->s, bc, 0);
        recompute_ds(p, kern, L, t, b, h, nq, nk, i0, rows, j0, cols);
        kern->gemm_nn(rows, D, cols, t->dp, bc, t->k, dp, t->dq, dp, 1); /* dQ += dS K */
    }
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < D; d++) t->dq[(size_t)r * dp + d] *= p->scale;
    flashc_cpu_store_rows(&p->dq, tb, q0 + i0, rows, h, D, t->dq, dp);
}

flashc_status flashc_cpu_backward(struct flashc_context *ctx, const flashc_problem *p, void *workspace) {
    FLASHC_TRY(flashc_cpu_check_varlen(ctx, p));
    const flashc_cpu_kernels *kern = flashc_cpu_select_kernels();
    const layout L = make_layout(p, 1);
    const int nthreads = flashc_cpu_thread_count(ctx);
    const int64_t nqb = (p->Nq + L.br - 1) / L.br, nkb = (p->Nk + L.bc - 1) / L.bc;
    float *dvec = align64(workspace);
    float *base = dvec + di_floats(p);

#ifdef _OPENMP
#  pragma omp parallel num_threads(nthreads)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        tile_bufs t = carve(base + (size_t)tid * L.per_thread, &L, 1);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t bh = 0; bh < p->B * p->H; bh++) dvec_task(p, dvec, t.q, t.dout, bh / p->H, bh % p->H);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t task = 0; task < p->B * p->Hkv * nkb; task++) {
            const int64_t kb = task % nkb, bh = task / nkb;
            dkdv_task(p, kern, &L, &t, dvec, bh / p->Hkv, bh % p->Hkv, kb);
        }
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t task = 0; task < p->B * p->H * nqb; task++) {
            const int64_t qb = task % nqb, bh = task / nqb;
            dq_task(p, kern, &L, &t, dvec, bh / p->H, bh % p->H, qb);
        }
    }
    (void)nthreads;
    return FLASHC_STATUS_OK;
}
