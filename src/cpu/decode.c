/*
 * The CPU forward for few query rows (decode, Nq = 1 against a KV cache; chunked prefill up to DEC_MAX_NQ rows):
 * flash-decoding (Dao, Haziza, Massa, Sizov 2023) on the CPU.
 *
 * The query rows of a GQA group, G = H / Hkv heads times nq rows, are packed into one tile, so that each K and V
 * row is read from memory once for all of them; the tile forward (attn.c) reads it once per head, through a
 * 64-row query tile that is nearly all padding at Nq = 1. Per key step of DEC_BC keys: scores by dot products over
 * D, eight keys at a time (kern->dots), the online softmax along each row (kern->softmax_rows), then O += P V by
 * the gemm microkernel with the packed rows as its M.
 *
 * Work: each sequence's keys are cut into `splits` pieces, chosen from the shape alone (enough units to spread
 * over many threads, pieces of at least DEC_MIN_PIECE keys). One unit per (sequence, piece, kv head, row block)
 * leaves its unnormalized (O, m, l) in the workspace; a second pass merges each row block's pieces by log-sum-exp
 * in piece order. Since the split, the tiles and every summation order depend on the shape only, results are
 * bitwise the same at any thread count and from run to run. Units run piece first, then kv head, so that threads
 * working at once read neighbouring memory of a (B, N, Hkv, D) cache.
 *
 * Rows r = g * nq + i stand for head hk * G + g and query i, so each head's rows are contiguous (the store writes
 * them per head); row blocks of DEC_MAX_ROWS rows bound the tile when G * nq is large.
 *
 * Masks and score options follow the tile forward: causal / window ranges per row (a piece outside every row's range
 * is skipped, partial tiles are masked element-wise), block-sparse masks (a key step no row sees is skipped),
 * softcap, ALiBi, seqused_k, sinks and varlen.
 *
 * Extra memory: per thread the packed Q and O (2 * rows * dp), the score tile (rows * DEC_BC) and converted K, V
 * rows (2 * DEC_BC * dp); with splits > 1 each unit's (O, m, l), about 1 / 8 of K's size at most.
 */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#  include <omp.h>
#endif

enum {
    DEC_MAX_NQ = 16,      /* query rows per sequence this path takes */
    DEC_MAX_ROWS = 64,    /* packed rows per tile */
    DEC_BC = 64,          /* keys per step (a multiple of 16: softmax_rows' padding) */
    DEC_MIN_PIECE = 256,  /* keys per piece at least */
    DEC_TARGET_UNITS = 128 /* units the split aims for */
};

#define SMUL flashc_size_mul
#define SADD flashc_size_add

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t flashc_cpu_decode_splits(const flashc_problem *p) {
    if (p->op != FLASHC_OP_FORWARD || p->Nq > DEC_MAX_NQ) return 0;
    const int64_t pairs = p->B * p->Hkv, max_pieces = ceil_div(p->Nk, DEC_MIN_PIECE);
    const int64_t want = ceil_div(DEC_TARGET_UNITS, pairs);
    const int64_t s = want < max_pieces ? want : max_pieces;
    return s < 1 ? 1 : s;
}

/* The sizes every unit shares. */
typedef struct dec_layout {
    int64_t G, nrb, splits, piece; /* heads per group, row blocks, pieces, keys per piece (a multiple of DEC_BC) */
    int cap, dp;                   /* rows per tile at most, D rounded up to 16 */
    size_t per_thread, part;       /* floats */
} dec_layout;

static dec_layout make_layout(const flashc_problem *p, int64_t splits) {
    dec_layout L;
    L.G = p->H / p->Hkv;
    const int64_t rows = L.G * p->Nq;
    L.cap = (int)(rows < DEC_MAX_ROWS ? rows : DEC_MAX_ROWS);
    L.nrb = ceil_div(rows, DEC_MAX_ROWS);
    L.splits = splits;
    L.piece = ceil_div(ceil_div(p->Nk, splits), DEC_BC) * DEC_BC;
    L.dp = (int)((p->D + 15) / 16 * 16);
    const size_t cap = (size_t)L.cap, dp = (size_t)L.dp;
    L.per_thread = 2 * cap * dp + cap * DEC_BC + 2 * (size_t)DEC_BC * dp + 3 * cap + 16;
    L.per_thread = (L.per_thread + 15) / 16 * 16;
    L.part = cap * dp + 2 * cap;
    return L;
}

static size_t units_of(const flashc_problem *p, const dec_layout *L) {
    return SMUL(SMUL(SMUL(flashc_size_of_i64(p->B), flashc_size_of_i64(L->splits)), flashc_size_of_i64(p->Hkv)),
                flashc_size_of_i64(L->nrb));
}

size_t flashc_cpu_decode_workspace(const flashc_problem *p, int nthreads, int64_t splits) {
    const dec_layout L = make_layout(p, splits);
    const size_t parts = splits > 1 ? SMUL(units_of(p, &L), L.part) : 0;
    return SADD(SMUL(SADD(SMUL((size_t)nthreads, L.per_thread), parts), sizeof(float)), 64);
}

/* Per-thread buffers, 64-byte aligned pieces. */
typedef struct dec_bufs {
    float *q, *o;       /* cap x dp: packed (scale Q) rows, unnormalized O */
    float *s;           /* cap x DEC_BC: scores, then P */
    float *kbuf, *vbuf; /* DEC_BC x dp: converted K, V rows */
    float *m, *l, *alpha;
} dec_bufs;

static dec_bufs carve(float *x, const dec_layout *L) {
    dec_bufs t;
    const size_t cap = (size_t)L->cap, dp = (size_t)L->dp;
    t.q = x, x += cap * dp;
    t.o = x, x += cap * dp;
    t.s = x, x += cap * DEC_BC;
    t.kbuf = x, x += (size_t)DEC_BC * dp;
    t.vbuf = x, x += (size_t)DEC_BC * dp;
    t.m = x, x += cap;
    t.l = x, x += cap;
    t.alpha = x;
    return t;
}

/* What one packed row stands for. */
typedef struct dec_row {
    int64_t h, i;     /* query head, query row within the sequence */
    int64_t lo, hi;   /* keys it may see through causal / window masks */
    float slope2;     /* ALiBi slope in log2 units */
    const uint8_t *mask; /* its row of the block mask, NULL without one */
} dec_row;

/* The rows of row block rb of (sequence b, kv head hk): how many, and what each is. */
static int block_rows(const flashc_problem *p, const dec_layout *L, int64_t b, int64_t hk, int64_t rb, int64_t nq,
                      int64_t nk, dec_row *rows) {
    const int64_t r0 = rb * DEC_MAX_ROWS, total = L->G * nq;
    const int n = r0 >= total ? 0 : (int)(total - r0 < DEC_MAX_ROWS ? total - r0 : DEC_MAX_ROWS);
    for (int r = 0; r < n; r++) {
        dec_row *x = &rows[r];
        x->h = hk * L->G + (r0 + r) / nq;
        x->i = (r0 + r) % nq;
        flashc_row_key_range(p, x->i, nq, nk, &x->lo, &x->hi);
        if (x->lo < 0) x->lo = 0;
        if (x->hi > nk) x->hi = nk;
        x->slope2 = flashc_alibi_slope(p, b, x->h) * FLASHC_LOG2E;
        x->mask = NULL;
        if (p->block_mask) {
            const int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : x->h;
            x->mask = p->block_mask + ((mb * p->bm_heads + mh) * p->bm_nqb + x->i / p->bm_q) * p->bm_nkb;
        }
    }
    return n;
}

/* Whether some row sees some key of [j0, j0 + cols) through the block mask (ranges are checked per element). */
static int step_visible(const flashc_problem *p, const dec_row *rows, int n, int64_t j0, int cols) {
    if (!p->block_mask) return 1;
    for (int r = 0; r < n; r++)
        for (int64_t kb = j0 / p->bm_k; kb <= (j0 + cols - 1) / p->bm_k; kb++)
            if (rows[r].mask[kb]) return 1;
    return 0;
}

/* Whether the step needs the epilogue: softcap, ALiBi, or a row whose range or mask cuts [j0, j0 + cols). */
static int step_needs_epilogue(const flashc_problem *p, const dec_row *rows, int n, int64_t j0, int cols) {
    if (p->softcap > 0.0f || p->block_mask) return 1;
    for (int r = 0; r < n; r++)
        if (rows[r].slope2 != 0.0f || rows[r].lo > j0 || rows[r].hi < j0 + cols) return 1;
    return 0;
}

/*
 * Finishes the row-major score tile s[r][c] (keys j0 + c) into log2 units, as flashc_cpu_score_epilogue does the
 * tile forward's: softcap, ALiBi, then -inf outside each row's range and where its block mask is 0.
 */
static void step_epilogue(const flashc_problem *p, const dec_row *rows, int n, int64_t nq, int64_t nk, int64_t j0,
                          int cols, float *s) {
    const float cap = p->softcap;
    for (int r = 0; r < n; r++) {
        const dec_row *x = &rows[r];
        float *row = s + (size_t)r * DEC_BC;
        if (cap > 0.0f)
            for (int c = 0; c < cols; c++) row[c] = cap * tanhf(row[c] / cap) * FLASHC_LOG2E;
        if (x->slope2 != 0.0f)
            for (int c = 0; c < cols; c++) row[c] -= x->slope2 * (float)llabs(x->i + nk - nq - (j0 + c));
        const int64_t lo = x->lo - j0, hi = x->hi - j0;
        for (int c = 0; c < cols; c++)
            if (c < lo || c >= hi) row[c] = -INFINITY;
        if (x->mask)
            for (int c = 0; c < cols; c++)
                if (!x->mask[(j0 + c) / p->bm_k]) row[c] = -INFINITY;
    }
}

/*
 * One unit: the rows of row block rb of (sequence b, kv head hk) against piece s of its keys. Leaves the
 * unnormalized O, m and l of its n rows in t.
 */
static int decode_unit(const flashc_problem *p, const flashc_cpu_kernels *kern, const dec_layout *L, dec_bufs *t,
                       int64_t b, int64_t s, int64_t hk, int64_t rb) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    dec_row rows[DEC_MAX_ROWS];
    const int n = block_rows(p, L, b, hk, rb, nq, nk, rows);
    if (n == 0) return 0;
    const int D = (int)p->D, dp = L->dp;
    const int64_t tb = flashc_cpu_tensor_batch(p, b);

    /* This piece's keys, clipped to what some row may see (lo and hi grow with the query row). */
    int64_t jlo = s * L->piece, jhi = jlo + L->piece;
    int64_t lo_all = nk, hi_all = 0;
    for (int r = 0; r < n; r++) {
        if (rows[r].lo < rows[r].hi && rows[r].lo < lo_all) lo_all = rows[r].lo;
        if (rows[r].lo < rows[r].hi && rows[r].hi > hi_all) hi_all = rows[r].hi;
    }
    if (jlo < lo_all) jlo = lo_all;
    if (jhi > hi_all) jhi = hi_all;

    memset(t->o, 0, sizeof(float) * (size_t)n * dp);
    for (int r = 0; r < n; r++) {
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
    }
    if (jlo >= jhi) return n;

    const float qs = flashc_cpu_qscale(p);
    for (int r = 0; r < n; r++) {
        float *dst = t->q + (size_t)r * dp;
        int64_t ld;
        const float *src = flashc_cpu_rows(kern, &p->q, tb, q0 + rows[r].i, 1, rows[r].h, D, dst, dp, &ld);
        for (int d = 0; d < D; d++) dst[d] = src[d] * qs;
        for (int d = D; d < dp; d++) dst[d] = 0.0f;
    }
    for (int64_t j0 = jlo; j0 < jhi; j0 += DEC_BC) {
        const int cols = (int)(jhi - j0 < DEC_BC ? jhi - j0 : DEC_BC), padded = (cols + 15) / 16 * 16;
        if (!step_visible(p, rows, n, j0, cols)) continue;
        int64_t ldk, ldv;
        const float *k = flashc_cpu_rows(kern, &p->k, tb, k0 + j0, cols, hk, D, t->kbuf, dp, &ldk);
        kern->dots(n, cols, D, t->q, dp, k, ldk, t->s, DEC_BC);
        if (step_needs_epilogue(p, rows, n, j0, cols)) step_epilogue(p, rows, n, nq, nk, j0, cols, t->s);
        for (int r = 0; r < n; r++)
            for (int c = cols; c < padded; c++) t->s[(size_t)r * DEC_BC + c] = -INFINITY;
        kern->softmax_rows(n, padded, t->s, DEC_BC, t->m, t->l, t->alpha);
        for (int r = 0; r < n; r++)
            if (t->alpha[r] != 1.0f) {
                float *orow = t->o + (size_t)r * dp;
                for (int d = 0; d < D; d++) orow[d] *= t->alpha[r];
            }
        const float *v = flashc_cpu_rows(kern, &p->v, tb, k0 + j0, cols, hk, D, t->vbuf, dp, &ldv);
        kern->gemm(n, D, cols, t->s, DEC_BC, 1, v, ldv, t->o, dp, 1); /* O += P V */
    }
    return n;
}

/* Writes the n rows of a block, head by head (each head's rows are contiguous). */
static void store_block(const flashc_problem *p, const dec_layout *L, dec_bufs *t, int64_t b, int64_t hk, int64_t rb,
                        int n) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t r0 = rb * DEC_MAX_ROWS;
    for (int r = 0; r < n;) {
        const int64_t g = (r0 + r) / nq, i = (r0 + r) % nq;
        const int count = (int)(nq - i < n - r ? nq - i : n - r);
        const size_t off = (size_t)r;
        flashc_cpu_forward_store(p, L->dp, t->o + off * L->dp, t->m + off, t->l + off, b, hk * L->G + g, i, count);
        r += count;
    }
}

void flashc_cpu_decode(const flashc_problem *p, const flashc_cpu_kernels *kern, int nthreads, int64_t splits,
                       void *workspace) {
    const dec_layout L = make_layout(p, splits);
    float *base = (float *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    float *parts = base + (size_t)nthreads * L.per_thread;
    const int64_t nunits = (int64_t)units_of(p, &L), per_seq = L.splits * p->Hkv * L.nrb;
#ifdef _OPENMP
#  pragma omp parallel num_threads(nthreads)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        dec_bufs t = carve(base + (size_t)tid * L.per_thread, &L);
        /* unit = ((b * splits + s) * Hkv + hk) * nrb + rb */
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t u = 0; u < nunits; u++) {
            const int64_t b = u / per_seq, s = u / (p->Hkv * L.nrb) % L.splits, hk = u / L.nrb % p->Hkv,
                          rb = u % L.nrb;
            const int n = decode_unit(p, kern, &L, &t, b, s, hk, rb);
            if (n == 0) continue;
            if (L.splits == 1) {
                store_block(p, &L, &t, b, hk, rb, n);
                continue;
            }
            float *part = parts + (size_t)u * L.part;
            memcpy(part, t.o, sizeof(float) * (size_t)n * L.dp);
            memcpy(part + (size_t)L.cap * L.dp, t.m, sizeof(float) * (size_t)n);
            memcpy(part + (size_t)L.cap * L.dp + L.cap, t.l, sizeof(float) * (size_t)n);
        }
        if (L.splits > 1) {
            /* merge the pieces of (b, hk, rb): units ((b * splits + s) * Hkv + hk) * nrb + rb, s = 0 .. splits - 1 */
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t w = 0; w < p->B * p->Hkv * L.nrb; w++) {
                const int64_t b = w / (p->Hkv * L.nrb), hk = w / L.nrb % p->Hkv, rb = w % L.nrb;
                int64_t q0, nq, k0, nk;
                flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
                const int64_t total = L.G * nq, r0 = rb * DEC_MAX_ROWS;
                if (r0 >= total) continue;
                const int n = (int)(total - r0 < DEC_MAX_ROWS ? total - r0 : DEC_MAX_ROWS);
                const float *first = parts + (size_t)((b * L.splits * p->Hkv + hk) * L.nrb + rb) * L.part;
                flashc_cpu_merge_pieces(first, (size_t)(p->Hkv * L.nrb) * L.part, L.splits, L.cap, n, (int)p->D, L.dp,
                                        t.o, t.m, t.l);
                store_block(p, &L, &t, b, hk, rb, n);
            }
        }
    }
    (void)nthreads;
}
