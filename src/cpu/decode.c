/*
 * The CPU forward for few query rows (decode, Nq = 1 against a KV cache; chunked prefill up to DEC_MAX_NQ rows):
 * flash-decoding (Dao, Haziza, Massa, Sizov 2023) on the CPU.
 *
 * The query rows of a GQA group, G = H / Hkv heads times nq rows, are packed into one tile, so that each K and V
 * row is read from memory once for all of them; the tile forward (attn.c) reads it once per head, through a
 * 64-row query tile that is nearly all padding at Nq = 1. Per key step (L->bc keys, DEC_BC at most): scores by dot
 * products over D (kern->dots_kv), the online softmax along each row (kern->softmax_rows), then O = alpha O + P V in
 * one pass over the O rows (kern->pv). Both kernels read fp32 and bf16 K and V rows in place (bf16 widened in
 * registers), through a table of the step's row addresses (a paged cache's step may span pages); other dtypes and
 * layouts are converted to fp32 rows first.
 *
 * Work: each sequence's keys are cut into `splits` pieces, chosen from the shape alone (enough units to spread
 * over many threads, pieces of at least DEC_MIN_PIECE keys). One unit per (sequence, piece, block of kv heads, row
 * block) leaves its unnormalized (O, m, l) per head in the workspace; a second pass merges each row block's pieces
 * by log-sum-exp in piece order. Since the split, the tiles and every summation order depend on the shape only,
 * results are bitwise the same at any thread count and from run to run (and a paged cache's are the contiguous
 * cache's when both have the same Nk: max_pages * page_size against the contiguous rows, which set the pieces). A
 * unit walks its kv heads inside each key step, so it reads one contiguous range of a (B, N, Hkv, D) cache rather
 * than one head's strided rows.
 *
 * Rows r = g * nq + i stand for head hk * G + g and query i, so each head's rows are contiguous (the store writes
 * them per head); row blocks of DEC_MAX_ROWS rows bound the tile when G * nq is large.
 *
 * Masks and score options follow the tile forward: causal / window ranges per row (a piece outside every row's range
 * is skipped, partial tiles are masked element-wise), block-sparse masks (a key step no row sees is skipped),
 * softcap, ALiBi, seqused_k, sinks and varlen; dropout row by row (each packed row is its own (head, query) stream),
 * with the generic kernel's cost, as decode rarely trains.
 *
 * Extra memory: per thread the packed Q and O of a unit's heads (about 2 * DEC_STATE_FLOATS), the score tile
 * (rows * DEC_BC) and converted K, V rows (2 * DEC_BC * dp); with splits > 1 each unit's (O, m, l): rows / piece
 * times K's fp32 size (pieces of 128 keys or more against at most 64 rows; 4 rows against 256 keys or more at Nq 1
 * with 4 query heads per kv head).
 */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

enum {
    DEC_MAX_NQ = 16,        /* query rows per sequence this path takes */
    DEC_MAX_ROWS = 64,      /* packed rows per tile */
    /* Keys per step (a multiple of 16: softmax_rows' padding). Steps of 16 keys had measured faster than 64 with
     * the prefetches into L1 (2-core EPYC VM, AVX2, lab/LOG.md), fp32 faster than 32 there; with the prefetches into
     * L2 (dots_kv's), 32 measured faster for fp32 too (Zen 4 VM, 1 thread, cold, 8/2/32 Nk 1k-32k 1.01-1.17x,
     * 32/8/128 0.99-1.06x), the per-step work (row maxima, alphas, the O rows' load and store) spread
     * over twice the keys. bf16 had measured faster with 32 than with 16 already. bf16 K at D <= 32 takes steps of
     * 64 keys (DEC_BC, the buffers' size; make_layout): its rows are an eighth of fp32 D 128's, the per-step work a
     * larger share (Zen 4 VM, 1 thread, cold, 8/2/32 bf16 1.06-1.09x); fp32 at 8/2/32 had measured 0.74-0.79x with
     * 64 at Nk 8k (1.00-1.02x at 1k and 32k). */
    DEC_BC = 64,
    DEC_BC_LONG = 32, /* keys per step otherwise */
    DEC_MIN_PIECE = 256,    /* keys per piece at least */
    DEC_TARGET_UNITS = 128, /* units the split aims for */
    DEC_MAX_HEADS = 16,     /* kv heads per unit at most */
    DEC_STATE_FLOATS = 32768 /* packed Q and O of a unit's heads, about (128 KiB each) */
};

#define SMUL flashc_size_mul
#define SADD flashc_size_add

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/*
 * A key step's raw K and V rows: the addresses of rows [n0, n0 + cols) of sequence b at head 0, a paged cache's page
 * piece by page piece (one table lookup per piece). Filled once per step for all the unit's heads (a head adds its
 * offset), and read twice: by the prefetch lists of the head-steps two ahead, then by the kernels (head_rows).
 * Before tables, pages of 16 had their V rows gathered into a buffer (pv's sum runs over the whole step) and K read by
 * one dots_kv call per page, 1.3-1.6x the contiguous time (a quarter of it the copy; lab/LOG.md), and pages of 1 had
 * all but two of each step's rows fetched by nothing ahead of use.
 */
typedef struct dec_step {
    const void *k[DEC_BC], *v[DEC_BC];
    int cols;
} dec_step;

static void step_tables(const flashc_problem *p, int64_t b, int64_t n0, int cols, dec_step *st) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    const flashc_tensor *t[2] = {&p->k, &p->v};
    const void **tab[2] = {st->k, st->v};
    st->cols = cols;
    for (int i = 0; i < 2; i++) {
        const int64_t es = (int64_t)flashc_dtype_size(t[i]->dtype), ld = t[i]->stride[1] * es;
        for (int c = 0; c < cols;) {
            const int64_t row = n0 + c;
            int n = cols - c;
            if (p->block_table && n > p->page_size - row % p->page_size) n = (int)(p->page_size - row % p->page_size);
            const char *x = (const char *)t[i]->data + flashc_kv_offset(p, t[i], b, tb, row, 0) * es;
            for (int r = 0; r < n; r++) tab[i][c + r] = x + r * ld;
            c += n;
        }
    }
}

/* The prefetch lists of head h's rows of step st. */
static void step_prefetch(const flashc_problem *p, const dec_step *st, int64_t h, flashc_cpu_prefetch *pf) {
    const flashc_tensor *t[2] = {&p->k, &p->v};
    pf->rows[0] = st->k, pf->rows[1] = st->v;
    pf->n = st->cols;
    pf->spread = flashc_cpu_pf_spread(p->k.stride[1] * (int64_t)flashc_dtype_size(p->k.dtype));
    for (int i = 0; i < 2; i++) {
        const int64_t es = (int64_t)flashc_dtype_size(t[i]->dtype);
        pf->off[i] = h * t[i]->stride[2] * es;
        /* a row's span: D elements with unit stride; rows strided along D (read through a conversion) are prefetched
         * only while their span stays within 4 D elements, since a (B, Hkv, D, N) view's span covers N rows of keys */
        const int64_t s3 = t[i]->stride[3], span = ((p->D - 1) * s3 + 1) * es;
        pf->bytes[i] = s3 >= 1 && s3 <= 4 ? (int)span : 0;
    }
}

/*
 * Head h's K-like rows of a step (tab: the step's raw rows at head 0, [row0, row0 + rows) of sequence b) as dots_kv
 * and pv take them, in out; returns their element type. In place when the view holds fp32 or bf16 with unit stride
 * along D (bf16 widened inside the kernels; a paged step one call over the contiguous cache's values in its order,
 * hence its bits); otherwise (fp16, other strides) converted to fp32 rows in buf (leading dim buf_ld).
 */
static int head_rows(const flashc_cpu_kernels *kern, const flashc_problem *p, const flashc_tensor *t,
                     const void *const *tab, int64_t b, int64_t row0, int rows, int64_t h, float *buf, int64_t buf_ld,
                     const void **out) {
    const int bf16 = t->dtype == FLASHC_DTYPE_BF16;
    if ((bf16 || t->dtype == FLASHC_DTYPE_F32) && t->stride[3] == 1) {
        const int64_t off = h * t->stride[2] * (bf16 ? 2 : 4);
        for (int c = 0; c < rows; c++) out[c] = (const char *)tab[c] + off;
        return bf16 ? FLASHC_CPU_KV_BF16 : FLASHC_CPU_KV_F32;
    }
    int64_t ld;
    const float *x = flashc_cpu_kv_rows(kern, p, t, b, row0, rows, h, buf, buf_ld, &ld);
    for (int c = 0; c < rows; c++) out[c] = x + c * ld;
    return FLASHC_CPU_KV_F32;
}

/* What one packed row stands for. */
typedef struct dec_row {
    int64_t h, i;        /* query head, query row within the sequence */
    int64_t lo, hi;      /* keys it may see through causal / window masks */
    const uint8_t *mask; /* its row of the block mask, NULL without one */
    float slope2;        /* ALiBi slope in log2 units */
    float pad_;
} dec_row;

/* The sizes every unit shares. */
typedef struct dec_layout {
    int64_t G, nrb;        /* query heads per kv head, row blocks per (sequence, kv head) */
    int64_t hb, nhb;       /* kv heads per unit, kv-head blocks */
    int64_t splits, piece; /* pieces per sequence, keys per piece (a multiple of bc) */
    int cap, dp;           /* rows per tile at most, D rounded up to 16 */
    int bc, pad_;          /* keys per step (DEC_BC at most) */
    size_t hs;             /* floats of one head's state: O (cap x dp), m (cap), l (cap), padded to 16 */
    size_t per_thread, part; /* floats: per-thread buffers, one unit's partial result */
} dec_layout;

/*
 * A unit takes hb kv heads at once: their K and V rows of a key step lie side by side in a (B, N, Hkv, D) cache, so
 * the unit streams one contiguous range where a single head's rows would be strided (measured 6.8 -> 10.4 GB/s on one
 * thread at D 32). hb is bounded so that the heads' packed Q and O stay near L2's size.
 */
static dec_layout make_layout(const flashc_problem *p, int64_t splits) {
    dec_layout L;
    L.G = p->H / p->Hkv;
    const int64_t rows = L.G * p->Nq;
    L.cap = (int)(rows < DEC_MAX_ROWS ? rows : DEC_MAX_ROWS);
    L.nrb = ceil_div(rows, DEC_MAX_ROWS);
    L.dp = (int)((p->D + 15) / 16 * 16);
    L.hb = DEC_STATE_FLOATS / ((int64_t)L.cap * L.dp);
    if (L.hb > DEC_MAX_HEADS) L.hb = DEC_MAX_HEADS;
    if (L.hb > p->Hkv) L.hb = p->Hkv;
    if (L.hb < 1) L.hb = 1;
    L.nhb = ceil_div(p->Hkv, L.hb);
    L.splits = splits;
    L.bc = p->D <= 32 && p->k.dtype == FLASHC_DTYPE_BF16 ? DEC_BC : DEC_BC_LONG;
    L.piece = splits > 0 ? ceil_div(ceil_div(p->Nk, splits), L.bc) * L.bc : 0;
    const size_t cap = (size_t)L.cap, dp = (size_t)L.dp, hb = (size_t)L.hb;
    L.hs = (cap * dp + 2 * cap + 15) / 16 * 16;
    const size_t info = (hb * cap * sizeof(dec_row) + 63) / 64 * 16;
    L.per_thread = info + hb * cap * dp + hb * L.hs + (cap + 15) / 16 * 16 + cap * DEC_BC + 2 * (size_t)DEC_BC * dp;
    L.part = hb * L.hs;
    return L;
}

int64_t flashc_cpu_decode_splits(const flashc_problem *p) {
    if (p->op != FLASHC_OP_FORWARD || p->Nq > DEC_MAX_NQ) return 0;
    const dec_layout L = make_layout(p, 0);
    const int64_t blocks = p->B * L.nhb * L.nrb, max_pieces = ceil_div(p->Nk, DEC_MIN_PIECE);
    const int64_t want = ceil_div(DEC_TARGET_UNITS, blocks);
    const int64_t s = want < max_pieces ? want : max_pieces;
    return s < 1 ? 1 : s;
}

static size_t units_of(const flashc_problem *p, const dec_layout *L) {
    return SMUL(SMUL(SMUL(flashc_size_of_i64(p->B), flashc_size_of_i64(L->splits)), flashc_size_of_i64(L->nhb)),
                flashc_size_of_i64(L->nrb));
}

size_t flashc_cpu_decode_workspace(const flashc_problem *p, int nthreads, int64_t splits) {
    const dec_layout L = make_layout(p, splits);
    const size_t parts = splits > 1 ? SMUL(units_of(p, &L), L.part) : 0;
    return SADD(SMUL(SADD(SMUL((size_t)nthreads, L.per_thread), parts), sizeof(float)), 64);
}

/* Per-thread buffers, each 64-byte aligned. Head j of a unit: packed Q rows q + j * cap * dp, row facts
 * rows + j * cap, state st + j * hs (O, then m, then l). */
typedef struct dec_bufs {
    dec_row *rows;
    float *q, *st;
    float *alpha;       /* cap */
    float *s;           /* cap x DEC_BC: scores, then P */
    float *kbuf, *vbuf; /* DEC_BC x dp: converted K, V rows */
} dec_bufs;

static dec_bufs carve(float *x, const dec_layout *L) {
    dec_bufs t;
    const size_t cap = (size_t)L->cap, dp = (size_t)L->dp, hb = (size_t)L->hb;
    t.rows = (dec_row *)x, x += (hb * cap * sizeof(dec_row) + 63) / 64 * 16;
    t.q = x, x += hb * cap * dp;
    t.st = x, x += hb * L->hs;
    t.alpha = x, x += (cap + 15) / 16 * 16;
    t.s = x, x += cap * DEC_BC;
    t.kbuf = x, x += (size_t)DEC_BC * dp;
    t.vbuf = x;
    return t;
}

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
    const int64_t diag = flashc_seq_diag(p, nq, nk); /* ALiBi distances |i + diag - j| */
    for (int r = 0; r < n; r++) {
        const dec_row *x = &rows[r];
        float *row = s + (size_t)r * DEC_BC;
        if (cap > 0.0f)
            for (int c = 0; c < cols; c++) row[c] = cap * tanhf(row[c] / cap) * FLASHC_LOG2E;
        if (x->slope2 != 0.0f)
            for (int c = 0; c < cols; c++) row[c] -= x->slope2 * (float)llabs(x->i + diag - (j0 + c));
        const int64_t lo = x->lo - j0, hi = x->hi - j0;
        for (int c = 0; c < cols; c++)
            if (c < lo || c >= hi) row[c] = -INFINITY;
        if (x->mask)
            for (int c = 0; c < cols; c++)
                if (!x->mask[(j0 + c) / p->bm_k]) row[c] = -INFINITY;
    }
}

/*
 * The unit a thread takes after this one, when the thread knows it (one thread: units in order) and it reads the
 * same kv heads (one head block, one row block): the last head-steps of a unit then prefetch the first two of the
 * next, which would otherwise start with nothing fetched ahead (units of 256 keys at 32/8/128 are 64 head-steps).
 */
typedef struct dec_next {
    int chained; /* this unit's first head-steps were prefetched by the unit before */
    int on;      /* prefetch the next unit's keys [lo, hi) of sequence b (first key row k0) */
    int issued;  /* out: this unit reached its key steps (and so its last head-steps' prefetches) */
    int pad_;
    int64_t b, k0, lo, hi;
} dec_next;

/* The tables of step x of a unit with nsteps steps of bc keys over [jlo, jhi) (first key row k0); steps past the
 * unit's are the next unit's (nx), or empty (cols 0). */
static void fill_step(const flashc_problem *p, int64_t b, int64_t k0, int64_t jlo, int64_t jhi, int64_t nsteps, int bc,
                      const dec_next *nx, int64_t x, dec_step *st) {
    if (x >= nsteps) {
        st->cols = 0;
        if (!nx->on) return;
        b = nx->b, k0 = nx->k0, jlo = nx->lo, jhi = nx->hi, x -= nsteps;
    }
    const int64_t n0 = jlo + x * bc;
    if (n0 < jhi) step_tables(p, b, k0 + n0, (int)(jhi - n0 < bc ? jhi - n0 : bc), st);
}

/*
 * One unit: the rows of row block rb of (sequence b, kv heads hk0 .. hk0 + nh - 1) against piece s of its keys.
 * Leaves each head's unnormalized O, m and l in t.st; returns the rows per head (0: none).
 */
static int decode_unit(const flashc_problem *p, const flashc_cpu_kernels *kern, const dec_layout *L, dec_bufs *t,
                       int64_t b, int64_t s, int64_t hk0, int nh, int64_t rb, dec_next *nx) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    int n = 0;
    for (int j = 0; j < nh; j++) n = block_rows(p, L, b, hk0 + j, rb, nq, nk, t->rows + (size_t)j * L->cap);
    if (n == 0) return 0;
    const int D = (int)p->D, dp = L->dp;
    const int64_t tb = flashc_cpu_tensor_batch(p, b);

    /* This piece's keys, clipped to what some row may see (the ranges depend on the query row, not the head). */
    int64_t jlo = s * L->piece, jhi = jlo + L->piece, lo_all = nk, hi_all = 0;
    for (int r = 0; r < n; r++) {
        const dec_row *x = &t->rows[r];
        if (x->lo < x->hi && x->lo < lo_all) lo_all = x->lo;
        if (x->lo < x->hi && x->hi > hi_all) hi_all = x->hi;
    }
    if (jlo < lo_all) jlo = lo_all;
    if (jhi > hi_all) jhi = hi_all;

    for (int j = 0; j < nh; j++) {
        float *o = t->st + (size_t)j * L->hs, *m = o + (size_t)L->cap * dp, *l = m + L->cap;
        memset(o, 0, sizeof(float) * (size_t)n * dp);
        for (int r = 0; r < n; r++) m[r] = -INFINITY, l[r] = 0.0f;
    }
    if (jlo >= jhi) return n;

    /* With bf16 keys the queries are packed unscaled and the scores scaled after the dot products: bf16 queries then
     * stay bf16 values, which the avx512bf16 dots_kv takes as one bf16 term instead of two (hi and lo parts). */
    const float qs = flashc_cpu_qscale(p), qk = p->k.dtype == FLASHC_DTYPE_BF16 ? 1.0f : qs, sk = qs / qk;
    for (int j = 0; j < nh; j++)
        for (int r = 0; r < n; r++) {
            const dec_row *x = &t->rows[(size_t)j * L->cap + r];
            float *dst = t->q + ((size_t)j * L->cap + r) * dp;
            int64_t ld;
            const float *src = flashc_cpu_rows(kern, &p->q, tb, q0 + x->i, 1, x->h, D, dst, dp, &ld);
            for (int d = 0; d < D; d++) dst[d] = src[d] * qk;
            for (int d = D; d < dp; d++) dst[d] = 0.0f;
        }
    const int bc = L->bc;
    /* P to bf16's need where pv rounds it (V's bf16 rows read in place, head_rows) */
    const flashc_cpu_softmax_rows_fn softmax_rows =
        kern->softmax_rows_p16 && p->v.dtype == FLASHC_DTYPE_BF16 && p->v.stride[3] == 1 ? kern->softmax_rows_p16
                                                                                          : kern->softmax_rows;
    /* The raw rows of steps si, si + 1 and si + 2 in ring[si % 3]: the head-step two ahead lies up to two steps ahead
     * (one kv head per unit); steps past the unit's are the next unit's (nx). */
    dec_step ring[3];
    const int64_t nsteps = ceil_div(jhi - jlo, bc);
    nx->issued = 1;
    for (int64_t si = 0; si < 2; si++) fill_step(p, b, k0, jlo, jhi, nsteps, bc, nx, si, &ring[si]);
    /* The unit's first two head-steps, unless the unit before prefetched them, issued at once: with pieces of 256
     * keys they are an eighth of a unit's rows at 8/2/32 (1 thread, cold: 1.09-1.11x there, 1.00-1.05x at 32/8/128,
     * where they are a 32nd). */
    for (int j = 0; !nx->chained && j < 2 && j / nh < nsteps; j++) {
        flashc_cpu_prefetch pf;
        flashc_cpu_pf_cursor cur;
        step_prefetch(p, &ring[j / nh], hk0 + j % nh, &pf);
        flashc_cpu_pf_begin(&cur, &pf, 1);
        flashc_cpu_pf_issue(&cur);
    }
    for (int64_t j0 = jlo, si = 0; j0 < jhi; j0 += bc, si++) {
        const int cols = (int)(jhi - j0 < bc ? jhi - j0 : bc), padded = (cols + 15) / 16 * 16;
        const dec_step *st = &ring[si % 3];
        fill_step(p, b, k0, jlo, jhi, nsteps, bc, nx, si + 2, &ring[(si + 2) % 3]);
        for (int j = 0; j < nh; j++) {
            const int64_t hk = hk0 + j;
            const dec_row *rows = t->rows + (size_t)j * L->cap;
            float *o = t->st + (size_t)j * L->hs, *m = o + (size_t)L->cap * dp, *l = m + L->cap;
            if (!step_visible(p, rows, n, j0, cols)) continue;
            /* The rows of the head-step two ahead (the next head but one of this step, or of the next step) are
             * fetched into L2 while the dot products run (dots_kv's prefetches), 8-32 KiB ahead of use. On the Zen 4
             * VM (1 thread, cold, lab/LOG.md), against the next head-step into L1 as before: 32/8/128 1.4-1.6x,
             * whose rows of one head lie 2-4 KiB apart, a pattern the hardware prefetchers do not follow (the
             * same reads with no arithmetic: 9.6-11.6 GB/s, against 24-25 in address order); into L1 two or more
             * head-steps ahead had lost (lines evicted before use), into L2 three or more measured no better than
             * two, and the whole head-step issued at once before the dots lost (1.2x against 1.5x). */
            flashc_cpu_prefetch pf;
            const int64_t ahead = si + (j + 2) / nh;
            const int have = ring[ahead % 3].cols > 0;
            if (have) step_prefetch(p, &ring[ahead % 3], hk0 + (j + 2) % nh, &pf);
            const void *krow[DEC_BC], *vrow[DEC_BC];
            const int kt = head_rows(kern, p, &p->k, st->k, b, k0 + j0, cols, hk, t->kbuf, dp, krow);
            kern->dots_kv(n, cols, D, t->q + (size_t)j * L->cap * dp, dp, krow, kt, t->s, DEC_BC,
                          have ? &pf : NULL);
            if (sk != 1.0f)
                for (int r = 0; r < n; r++)
                    for (int c = 0; c < cols; c++) t->s[(size_t)r * DEC_BC + c] *= sk;
            if (step_needs_epilogue(p, rows, n, j0, cols)) step_epilogue(p, rows, n, nq, nk, j0, cols, t->s);
            if (cols < padded)
                for (int r = 0; r < n; r++)
                    for (int c = cols; c < padded; c++) t->s[(size_t)r * DEC_BC + c] = -INFINITY;
            softmax_rows(n, padded, t->s, DEC_BC, m, l, t->alpha);
            if (p->dropout_p > 0.0f) /* as the tile forward: l summed P undropped, the store scales by 1 / (1 - p) */
                for (int r = 0; r < n; r++) {
                    flashc_cpu_dropout drop;
                    flashc_cpu_dropout_of(p, b, rows[r].h, 1.0f, &drop);
                    kern->dropout(cols, 1, t->s + (size_t)r * DEC_BC, 1, &drop, rows[r].i, j0);
                }
            const int vt = head_rows(kern, p, &p->v, st->v, b, k0 + j0, cols, hk, t->vbuf, dp, vrow);
            kern->pv(n, cols, D, t->s, DEC_BC, t->alpha, vrow, vt, o, dp); /* O = alpha O + P V */
        }
    }
    return n;
}

/* Writes the n rows of row block rb of (b, hk) from a head's state, head by head of its group (each query head's
 * rows are contiguous). */
static void store_block(const flashc_problem *p, const dec_layout *L, float *st, int64_t b, int64_t hk, int64_t rb,
                        int n) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    float *o = st, *m = o + (size_t)L->cap * L->dp, *l = m + L->cap;
    const int64_t r0 = rb * DEC_MAX_ROWS;
    for (int r = 0; r < n;) {
        const int64_t g = (r0 + r) / nq, i = (r0 + r) % nq;
        const int count = (int)(nq - i < n - r ? nq - i : n - r);
        flashc_cpu_forward_store(p, NULL, L->dp, o + (size_t)r * L->dp, m + r, l + r, b, hk * L->G + g, i, count);
        r += count;
    }
}

/* What the decode's team shares. */
typedef struct decode_job {
    const flashc_problem *p;
    const flashc_cpu_kernels *kern;
    dec_layout L;
    float *base, *parts;
    int64_t nunits;
    int nthreads, chain; /* chain: units prefetch their successor's first head-steps (dec_next) */
} decode_job;

/* One thread's part of the decode: the units (pieces of them with split-KV), then the pieces' merge. */
static void decode_body(void *arg, int tid) {
    const decode_job *J = arg;
    const flashc_problem *p = J->p;
    const dec_layout *L = &J->L;
    const int64_t per_piece = L->nhb * L->nrb;
    dec_bufs t = carve(J->base + (size_t)tid * L->per_thread, L);
    int chained = 0; /* the unit before prefetched this one's first head-steps */
    /* unit u = ((b * splits + s) * nhb + kv-head block) * nrb + rb */
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t u = 0; u < J->nunits; u++) {
        const int64_t b = u / (L->splits * per_piece), s = u / per_piece % L->splits, hk0 = u / L->nrb % L->nhb * L->hb,
                      rb = u % L->nrb;
        const int nh = (int)(p->Hkv - hk0 < L->hb ? p->Hkv - hk0 : L->hb);
        /* With one thread, one head block and one row block, unit u + 1 is this thread's next, on the next piece's
         * keys of the same heads (dec_next). Only where the rows lie 1 KiB or more apart: at 8/2/32 bf16 (rows of 128
         * B) it measured 0.94-0.98x (f32 0.99-1.03x). */
        dec_next nx = {.chained = chained};
        if (J->nthreads == 1 && L->nhb == 1 && L->nrb == 1 && u + 1 < J->nunits && J->chain) {
            int64_t q0, nq, k0, nk;
            nx.b = (u + 1) / L->splits;
            flashc_seq_bounds(p, nx.b, &q0, &nq, &k0, &nk);
            nx.k0 = k0, nx.lo = (u + 1) % L->splits * L->piece;
            nx.hi = nx.lo + L->piece < nk ? nx.lo + L->piece : nk;
            nx.on = nx.lo < nx.hi;
        }
        const int n = decode_unit(p, J->kern, L, &t, b, s, hk0, nh, rb, &nx);
        chained = nx.on && nx.issued;
        if (n == 0) continue;
        if (L->splits == 1) {
            for (int j = 0; j < nh; j++) store_block(p, L, t.st + (size_t)j * L->hs, b, hk0 + j, rb, n);
            continue;
        }
        memcpy(J->parts + (size_t)u * L->part, t.st, sizeof(float) * (size_t)nh * L->hs);
    }
    if (L->splits > 1) {
        /* the pieces of (b, hk, rb): head hk % hb of units ((b * splits + s) * nhb + hk / hb) * nrb + rb */
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t w = 0; w < p->B * p->Hkv * L->nrb; w++) {
            const int64_t b = w / (p->Hkv * L->nrb), hk = w / L->nrb % p->Hkv, rb = w % L->nrb;
            int64_t q0, nq, k0, nk;
            flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
            const int64_t total = L->G * nq, r0 = rb * DEC_MAX_ROWS;
            if (r0 >= total) continue;
            const int n = (int)(total - r0 < DEC_MAX_ROWS ? total - r0 : DEC_MAX_ROWS);
            const size_t u0 = (size_t)(((b * L->splits) * L->nhb + hk / L->hb) * L->nrb + rb);
            const float *first = J->parts + u0 * L->part + (size_t)(hk % L->hb) * L->hs;
            float *o = t.st, *m = o + (size_t)L->cap * L->dp, *l = m + L->cap;
            flashc_cpu_merge_pieces(first, (size_t)per_piece * L->part, L->splits, L->cap, n, (int)p->D, L->dp, o, m,
                                    l);
            store_block(p, L, t.st, b, hk, rb, n);
        }
    }
}

void flashc_cpu_decode(const flashc_problem *p, const flashc_cpu_kernels *kern, int nthreads, int64_t splits,
                       void *workspace) {
    decode_job J = {.p = p, .kern = kern, .L = make_layout(p, splits)};
    J.base = flashc_cpu_align64(workspace);
    J.parts = J.base + (size_t)nthreads * J.L.per_thread;
    J.nunits = (int64_t)units_of(p, &J.L);
    J.nthreads = nthreads;
    J.chain = flashc_cpu_pf_spread(p->k.stride[1] * (int64_t)flashc_dtype_size(p->k.dtype));
    /* the longer of decode_body's two loops */
    const int64_t merges = J.L.splits > 1 ? p->B * p->Hkv * J.L.nrb : 0;
    flashc_cpu_team(nthreads, J.nunits > merges ? J.nunits : merges, decode_body, &J);
}
