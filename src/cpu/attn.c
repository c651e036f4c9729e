/*
 * The CPU attention drivers: FlashAttention-2 (Dao 2023, Algorithms 1 and 2) on fp32 tiles.
 *
 * Forward: one task per (sequence, head, group of G blocks of br query rows). The group's query blocks stay
 * resident (as scale*Q^T) while key/value blocks of bc rows stream past them, the key-block loop outside the block
 * loop, so each K/V block is read from memory once per group and meets the G blocks from L2 (G from the cache sizes,
 * tiles.c); scores are kept key-major (St[key][query]) so K and V are read in place when they are fp32 with unit
 * stride along D, and so the online-softmax state (running max m, running sum l, output O) updates with vector
 * operations across query rows. Scores are in base 2 (log2(e) folded into the Q scale). Causal and window masks
 * bound the key range of each query block, the block-sparse mask skips whole tiles, and partial tiles mask
 * element-wise. When there are fewer tasks than threads (few heads, long keys) the groups are of one block and the
 * key range of each task is split across threads, the partial (m, l, O) merging by log-sum-exp (flash-decoding). Forwards of at most 16 query rows (decode) run decode.c's path instead, which packs
 * a GQA group's rows into one tile.
 *
 * Backward: P is recomputed from q, k and the saved lse, never stored. D_i = rowsum(dO o O) is computed first.
 * When there are at least as many (sequence, head) pairs as threads, one task per pair walks the key blocks in
 * groups (sized from L3, tiles.c); for each group it passes once over the query blocks, accumulating dK_j, dV_j of
 * every key block of the group in tiles and adding dS K_j into a per-thread fp32 dQ of the whole sequence (five
 * products per tile), so the query side streams from memory once per group rather than once per key block. With
 * GQA, each head's dK, dV go to a per-head fp32 buffer that a last pass sums over the group in head order. With
 * fewer pairs than threads (long sequences, few heads), two passes share the work finer: one per (sequence, kv
 * head, key block) for dK, dV, one per (sequence, head, query block) for dQ, at the cost of computing S and dP
 * twice. Either way every gradient element has one writer and a fixed summation order, so results are race-free and
 * bitwise reproducible from run to run at any thread count (and any key group). The two modes group a GQA head
 * group's dK, dV sums differently, so with GQA a thread count that switches the mode can change their last bits.
 *
 * Tiles that a causal or window mask cuts run their products in strips over the pairs the mask leaves (tile_edge),
 * in the forward and the backward.
 *
 * bf16 inputs on a kernel set with bf16 products (layout.bf16: AVX512-BF16's vdpbf16ps) run every product on bf16
 * operands with fp32 sums, as flash-attn does on tensor cores: K and V as bf16 rows or pair rows (two rows side by
 * side, the operand form of a reduction over them), Q and dO as pair rows, and P (forward and backward) and dS rounded
 * to bf16 after the fp32 softmax and dS steps, which stay as above; score_operands, pv_operands, kv_block and key_side
 * carry either form to the same loops. Without softcap the backward's P, dS and their bf16 forms come from one kernel
 * pass over the tile (the bf16 kernels' ds), and the forward's P and its pair rows from another (softmax_pairs).
 *
 * Dropout (src/dropout.h): each (sequence, head) is a Philox stream and the keep bit of (i, j) depends on nothing
 * else, so tiles, split-KV pieces, the backward's modes and thread counts all drop the same elements. The forward
 * zeroes dropped entries of the tile's P after the online-softmax step (l keeps the undropped sum, so the lse is the
 * whole softmax's) and the store scales by 1 / (1 - p) with 1 / l; the backward regenerates Z = keep / (1 - p) per
 * tile into a buffer, dS = P (Z dP - D) and dV += (P Z)^T dO. With the bf16 products the keep bits go to the fused
 * steps (softmax_pairs, ds) as a tile of 16-bit masks instead, so dropout keeps their one pass over the tile.
 *
 * Extra memory: per thread a few tiles (sizes below, O(G * br * D + bc * D + br * bc)); split-KV partials
 * (O(threads * br * D)); in backward D (B * H * Nq floats), and in the single-pass mode dQ, Q^T and dO^T of one
 * sequence per thread (3 * Nq * D floats) plus, with GQA, per-head dK, dV (2 * B * H * Nk * D floats); with dropout
 * one more bc x br tile per thread in backward, and bc x br bits of keep masks in both.
 */
#include "cpu.h"

#include <string.h>

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
/* floats that hold the keep masks of a bc x br tile (16-bit words of 16 rows), a whole number of cache lines */
static size_t keep_floats(size_t bc, size_t br) { return (size_t)round_up((int64_t)(bc * ((br + 15) / 16)), 32) / 2; }
static int imin(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

/* Per-thread tiles; every piece 64-byte aligned (sizes are multiples of 16 floats). */
typedef struct tile_bufs {
    float *qt, *dot;    /* (scale Q)^T, dO^T: dp x ld (forward: one per block of the query group) */
    float *o, *dq;      /* br x dp (o: one per block of the query group, as are m and l) */
    float *st, *dpt, *t; /* bc x ld: scores / P, dP / dS, tanh for softcap */
    float *kbuf, *vbuf; /* bc x dp: converted K, V rows (backward: one per key block of the group) */
    float *qbuf, *dobuf; /* br x dp: converted Q, dO rows */
    float *dk, *dv;     /* bc x dp, one per key block of the backward's group */
    float *z;           /* bc x ld: the backward's dropout factors (0 or 1 / (1 - p)); NULL without dropout */
    uint16_t *keep;     /* br / 16 x bc: dropout's keep masks for the bf16 kernels' fused steps; NULL without dropout */
    uint16_t *p2;       /* forward, bf16 inputs: P's pair rows (bc / 2 + 1 of them, leading dim 2 ld bf16), or with
                         * the kernels' softmax_prows its rows of key pairs (br of them, leading dim prows_ld) */
    uint16_t *p16, *ds16, *ds2; /* backward, bf16 inputs: P and dS in bf16 (bc x ld), dS's pair rows (as p2) */
    float *m, *l, *alpha, *lse2, *di; /* br */
} tile_bufs;

typedef struct layout {
    int br, bc, dp;
    int ld; /* leading dim of the query-major tiles (Q^T, dO^T, S^T, dP^T): br + FLASHC_CPU_LD_PAD */
    int64_t nqb, nkb;
    int gq;      /* forward: query blocks per task (tiles.c, flashc_cpu_query_group); 1 in backward */
    int64_t ngq; /* forward: query groups per (sequence, head), ceil(nqb / gq) */
    int gk;      /* backward, one task per head: key blocks per pass over the queries (flashc_cpu_key_group); else 1 */
    int dropout;       /* a tile of keep masks, and in the backward one of dropout factors */
    int pairs;         /* bf16 inputs: tiles for the bf16 products' operands */
    int bf16;          /* the products run on the kernels' bf16 products (flashc_cpu_forward / _backward set it) */
    size_t per_thread; /* floats */
} layout;

/* The backward's single pass per (sequence, head) when that alone fills the threads. */
static int single_pass(const flashc_problem *p, int nthreads) { return p->B * p->H >= nthreads; }

/* The forward's P as rows of key pairs (softmax_prows): at most bc / 2 pairs a row (a tile's keys and its lead
 * stay within the K/V block), and a cache line more, so that rows are not a power of two bytes apart (256 at bc 128). */
static int64_t prows_ld(int bc) { return bc + 32; }
/* floats of the forward's p2: either layout */
static size_t p2_floats(size_t br, size_t bc, size_t ld) {
    const size_t pairs = (bc / 2 + 1) * ld, rows = br * (size_t)prows_ld((int)bc) / 2;
    return pairs > rows ? pairs : rows;
}

/* q, k and v in bf16: what the bf16 products take (the front checked that they share one dtype). */
static int bf16_inputs(const flashc_problem *p) {
    return p->q.dtype == FLASHC_DTYPE_BF16 && p->k.dtype == FLASHC_DTYPE_BF16 && p->v.dtype == FLASHC_DTYPE_BF16;
}

/* Tiles of the forward (backward = 0) or backward run on nthreads threads. */
static layout make_layout(const flashc_problem *p, int backward, int nthreads) {
    flashc_cpu_tiles t = flashc_cpu_choose_tiles(p->D, backward);
    layout L;
    L.br = t.br;
    L.bc = t.bc;
    /* A query side shorter than the tile makes the tile only as tall as it (the score products, the softmax and the
     * backward's exp2 and dS passes run over the tile's br rows: at Nq 16 against the backward's br of 128 they
     * computed eight times the rows there are): in strips of 16 for the backward, of 32 for the forward (48-row
     * forward tiles at Nq 40 ran 3-10% slower than 64 in one A/B). Each row's arithmetic is the same: the results
     * keep their bits. */
    const int64_t tall = round_up(p->Nq, backward ? 16 : 32);
    if (tall < L.br) L.br = (int)tall;
    L.dp = (int)round_up(p->D, 16);
    L.ld = L.br + FLASHC_CPU_LD_PAD;
    L.nqb = (p->Nq + L.br - 1) / L.br;
    L.nkb = (p->Nk + L.bc - 1) / L.bc;
    /* A group shares its K/V blocks but is one task of the dynamic schedule: keep at least four tasks per thread,
     * so the threads still end close together (and split-KV, for fewer tasks than threads, sees groups of one). */
    L.gq = backward ? 1 : flashc_cpu_query_group(p->D, t, nthreads);
    const int64_t blocks = p->B * p->H * L.nqb;
    if (L.gq > 1 && blocks < (int64_t)4 * nthreads * L.gq) L.gq = (int)(blocks / (4 * (int64_t)nthreads));
    if (L.gq > L.nqb) L.gq = (int)L.nqb;
    if (L.gq < 1) L.gq = 1;
    L.ngq = (L.nqb + L.gq - 1) / L.gq;
    L.gk = backward && single_pass(p, nthreads) ? flashc_cpu_key_group(p->D, t, nthreads) : 1;
    if (L.gk > L.nkb) L.gk = (int)L.nkb;
    if (L.gk < 1) L.gk = 1;
    size_t br = (size_t)L.br, bc = (size_t)L.bc, dp = (size_t)L.dp, ld = (size_t)L.ld, gq = (size_t)L.gq;
    const size_t gk = (size_t)L.gk;
    if (!backward)
        L.per_thread = gq * (dp * ld + br * dp + 2 * br) + bc * ld + 2 * bc * dp + br;
    else
        L.per_thread = 2 * dp * ld + br * dp + 3 * bc * ld + 4 * gk * bc * dp + 2 * br * dp + 2 * br;
    L.dropout = p->dropout_p > 0.0f;
    if (L.dropout) L.per_thread += (backward ? bc * ld : 0) + keep_floats(bc, br);
    L.pairs = bf16_inputs(p);
    if (L.pairs) L.per_thread += backward ? bc * ld + (bc / 2 + 1) * ld : p2_floats(br, bc, ld); /* 2 bf16 a float */
    L.bf16 = 0;
    return L;
}

static tile_bufs carve(float *x, const layout *L, int backward) {
    tile_bufs b;
    memset(&b, 0, sizeof b);
    size_t br = (size_t)L->br, bc = (size_t)L->bc, dp = (size_t)L->dp, ld = (size_t)L->ld, gq = (size_t)L->gq;
    const size_t gk = (size_t)L->gk;
#define TAKE(ptr, n) (ptr = x, x += (n))
    TAKE(b.qt, gq * dp * ld);
    TAKE(b.st, bc * ld);
    TAKE(b.kbuf, gk * bc * dp);
    TAKE(b.vbuf, gk * bc * dp);
    if (!backward) {
        TAKE(b.o, gq * br * dp);
        TAKE(b.m, gq * br);
        TAKE(b.l, gq * br);
        TAKE(b.alpha, br);
        if (L->pairs) b.p2 = (uint16_t *)x, x += p2_floats(br, bc, ld);
    } else {
        TAKE(b.dot, dp * ld);
        TAKE(b.dq, br * dp);
        TAKE(b.dpt, bc * ld);
        TAKE(b.t, bc * ld);
        TAKE(b.dk, gk * bc * dp);
        TAKE(b.dv, gk * bc * dp);
        TAKE(b.qbuf, br * dp);
        TAKE(b.dobuf, br * dp);
        TAKE(b.lse2, br);
        TAKE(b.di, br);
        if (L->dropout) TAKE(b.z, bc * ld);
        if (L->pairs) {
            b.p16 = (uint16_t *)x, x += bc * ld / 2;
            b.ds16 = (uint16_t *)x, x += bc * ld / 2;
            b.ds2 = (uint16_t *)x, x += (bc / 2 + 1) * ld;
        }
    }
    if (L->dropout) b.keep = (uint16_t *)x, x += keep_floats(bc, br);
#undef TAKE
    return b;
}

/* ---- forward ---------------------------------------------------------------------------------------------- */

/* Split-KV plan: how many pieces each task's key range is cut into. */
static int64_t kv_splits(const flashc_problem *p, const layout *L, int nthreads) {
    const int64_t tasks = p->B * p->H * L->ngq;
    if (tasks >= nthreads || L->nkb < 2 || L->gq > 1) return 1;
    int64_t s = (nthreads + tasks - 1) / tasks;
    return s < L->nkb ? s : L->nkb;
}

static size_t partial_floats(const layout *L) { return (size_t)L->br * L->dp + 2 * (size_t)L->br; }

/* Sizes in saturating arithmetic (internal.h): a problem whose workspace does not fit reads as SIZE_MAX. */
#define SMUL flashc_size_mul
#define SADD flashc_size_add

size_t flashc_cpu_forward_workspace(const flashc_problem *p, int nthreads) {
    const layout L = make_layout(p, 0, nthreads);
    const int64_t splits = kv_splits(p, &L, nthreads);
    const size_t tasks = SMUL(SMUL(flashc_size_of_i64(p->B), flashc_size_of_i64(p->H)), flashc_size_of_i64(L.ngq));
    const size_t partials = splits > 1 ? SMUL(SMUL(tasks, (size_t)splits), partial_floats(&L)) : 0;
    return SADD(SMUL(SADD(SMUL((size_t)nthreads, L.per_thread), partials), sizeof(float)), 64);
}

/* Query block g of a group: its (scale Q)^T, unnormalized O, m and l in the thread's tiles. */
typedef struct query_block {
    float *qt, *o, *m, *l;
    int64_t i0; /* first row, within the sequence */
    int rows;
    int64_t lo, hi; /* the keys it sees, within the group's key range */
} query_block;

static query_block group_block(const layout *L, tile_bufs *t, int g) {
    query_block q;
    memset(&q, 0, sizeof q);
    q.qt = t->qt + (size_t)g * L->dp * L->ld;
    q.o = t->o + (size_t)g * L->br * L->dp;
    q.m = t->m + (size_t)g * L->br;
    q.l = t->l + (size_t)g * L->br;
    return q;
}

/*
 * Each row's visible columns [lo[r], hi[r]) of the tile (keys j0 .. j0 + cols) for r < rows, clipped to [0, cols);
 * both grow with r (causal and window masks). Returns 1, with the ranges filled, when some row sees only part of
 * the tile (the tile lies on the diagonal of a causal mask or on a window's edge), else 0 without filling them.
 */
static int tile_row_ranges(const flashc_problem *p, int64_t nq, int64_t nk, int64_t i0, int rows, int64_t j0,
                           int cols, int *lo, int *hi) {
    int64_t lo_last, hi_last, lo_first, hi_first; /* lo and hi grow with the row: the first and last rows decide */
    flashc_row_key_range(p, i0 + rows - 1, nq, nk, &lo_last, &hi_last);
    flashc_row_key_range(p, i0, nq, nk, &lo_first, &hi_first);
    if (lo_last <= j0 && hi_first >= j0 + cols) return 0;
    return flashc_cpu_row_ranges(p, nq, nk, i0, rows, j0, cols, lo, hi);
}

/*
 * The two products of a tile, on fp32 operands or, with the kernels' bf16 products (layout bf16), on bf16 ones.
 * score_operands: st[c][r] = alpha sum_d k[c][d] qt[d][r], k rows and qt query-major in fp32 (alpha 1: the scale is
 * in qt), or k's bf16 rows and qt's pair rows (k16, qt2; alpha the Q scale, applied to the fp32 sums since Q stays
 * the caller's bf16, exact).
 */
typedef struct score_operands {
    const float *k, *qt;
    const uint16_t *k16, *qt2;
    int64_t ldk, ldq; /* k's row stride; qt's leading dim in queries */
    int D;
    float alpha;
} score_operands;

static score_operands f32_scores(const float *k, int64_t ldk, const float *qt, int64_t ldq, int D) {
    score_operands s = {k, qt, NULL, NULL, ldk, ldq, D, 1.0f};
    return s;
}

/* st[c][r] for keys [c0, c1) and rows [r0, r1). */
static void score_product(const flashc_cpu_kernels *kern, const score_operands *s, int c0, int c1, int r0, int r1,
                          float *st, int64_t ld) {
    float *c = st + (size_t)c0 * ld + r0;
    if (s->k16)
        kern->bf16->gemm(c1 - c0, r1 - r0, (s->D + 1) / 2, s->k16 + (int64_t)c0 * s->ldk, s->ldk, 2,
                         s->qt2 + 2 * (int64_t)r0, 2 * s->ldq, c, ld, s->alpha, 0);
    else
        kern->gemm(c1 - c0, r1 - r0, s->D, s->k + (int64_t)c0 * s->ldk, s->ldk, 1, s->qt + r0, s->ldq, c, ld, 0);
}

/*
 * pv_operands: O += P V with P key-major in fp32 (st) and V's fp32 rows, or P's and V's pair rows (p2, v2), the tile's
 * key c in pair (c + lead) / 2 (lead 1: the tile starts on the second key of a pair of the K/V block, whose first
 * P is 0). P's pair (row r, pair p) lies at p2 + r * prs + p * pcs: pair rows (prs 2, pcs 2 ld) or, from softmax_prows,
 * rows of key pairs (prs prows_ld, pcs 2).
 */
typedef struct pv_operands {
    const float *st, *v;
    const uint16_t *p2, *v2;
    int64_t ld, ldv; /* st's leading dim in queries; v's row stride (v2: 2 dp) */
    int64_t prs, pcs;
    int lead, D;
} pv_operands;

/* O rows [r0, r1) (o: row r0, leading dim dp) += P V over the tile's keys [k0, k1); the bf16 form widens the keys to
 * whole pairs, whose extra P are 0. */
static void pv_product(const flashc_cpu_kernels *kern, const pv_operands *v, int r0, int r1, int k0, int k1, float *o,
                       int dp) {
    if (v->p2) {
        const int p0 = (k0 + v->lead) / 2, p1 = (k1 + v->lead + 1) / 2;
        kern->bf16->gemm(r1 - r0, v->D, p1 - p0, v->p2 + p0 * v->pcs + r0 * v->prs, v->prs, v->pcs,
                         v->v2 + (int64_t)p0 * v->ldv, v->ldv, o, dp, 1.0f, 1);
    } else {
        kern->gemm(r1 - r0, v->D, k1 - k0, v->st + (size_t)k0 * v->ld + r0, 1, v->ld, v->v + (int64_t)k0 * v->ldv,
                   v->ldv, o, dp, 1);
    }
}

/*
 * S^T = K (scale Q)^T and O += P V on a tile that only part of each row sees (causal diagonal, window edges), in
 * strips of ch keys (for S) and ch query rows (for P V), each product over the rows / keys some element of the strip
 * sees: on a causal 64 x 64 diagonal block about 3/4 of the masked triangle is not computed where the whole tile
 * computes all of it. Scores left out are masked ones, which the epilogue overwrites with -inf; P is exactly 0
 * there, so the P V strips leave out only zero terms (and no NaN of a masked key's V reaches O, except, with the bf16
 * products, a key that shares its pair with a visible one). Padding rows (rows .. br) get their scores as in a whole
 * tile.
 * edge_scores: st[c][r] for the (key, row) pairs the strips cover; the backward's dP^T (v and dO^T in place of k and
 * Q^T) takes the same strips.
 */
static void edge_scores(const flashc_cpu_kernels *kern, int br, int rows, const int *lo, const int *hi,
                        const score_operands *s, int cols, float *st, int64_t ld, int ch) {
    const int nr = kern->nr;
    for (int c0 = 0; c0 < cols; c0 += ch) {
        const int c1 = c0 + ch < cols ? c0 + ch : cols;
        int rs = 0, re = rows; /* rows meeting keys [c0, c1): hi > c0 from rs on, lo < c1 before re */
        while (rs < rows && hi[rs] <= c0) rs++;
        while (re > rs && lo[re - 1] >= c1) re--;
        if (rows < br) re = br;
        rs = rs / nr * nr;
        re = (re + nr - 1) / nr * nr;
        if (re > br) re = br;
        if (re > rs) score_product(kern, s, c0, c1, rs, re, st, ld);
    }
}

static void edge_pv(const flashc_cpu_kernels *kern, const layout *L, const query_block *q, const int *lo,
                    const int *hi, const pv_operands *v, int cols, int ch) {
    const int rows = q->rows;
    for (int r0 = 0; r0 < rows; r0 += ch) {
        const int r1 = r0 + ch < rows ? r0 + ch : rows;
        const int k0 = lo[r0], k1 = hi[r1 - 1] < cols ? hi[r1 - 1] : cols;
        if (k1 > k0) pv_product(kern, v, r0, r1, k0, k1, q->o + (size_t)r0 * L->dp, L->dp);
    }
}

/*
 * A K/V block as the tile products read it: fp32 rows (in place or converted), or for the bf16 products K's bf16
 * rows and V's pair rows (2 dp bf16 each: V[2p][d], V[2p + 1][d] side by side).
 */
typedef struct kv_block {
    const float *k, *v;
    const uint16_t *k16, *v2;
    int64_t ldk, ldv;
} kv_block;

static kv_block load_kv_block(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                              int64_t b, int64_t row0, int cols, int64_t hk) {
    kv_block kv;
    memset(&kv, 0, sizeof kv);
    const int dp = L->dp;
    if (!L->bf16) {
        kv.k = flashc_cpu_kv_rows(kern, p, &p->k, b, row0, cols, hk, t->kbuf, dp, &kv.ldk);
        kv.v = flashc_cpu_kv_rows(kern, p, &p->v, b, row0, cols, hk, t->vbuf, dp, &kv.ldv);
        return kv;
    }
    /* vbuf holds bc x dp floats: V's pair rows take its first half, V rows copied from a strided view the second */
    uint16_t *v2 = (uint16_t *)t->vbuf, *vrows = v2 + (size_t)L->bc * dp;
    int64_t ldv;
    kv.k16 = flashc_cpu_kv_rows_bf16(p, &p->k, b, row0, cols, hk, (uint16_t *)t->kbuf, dp, &kv.ldk);
    const uint16_t *v = flashc_cpu_kv_rows_bf16(p, &p->v, b, row0, cols, hk, vrows, dp, &ldv);
    kern->bf16->pairs_bf16(cols, (int)p->D, v, ldv, v2, 2 * (int64_t)dp);
    kv.v2 = v2;
    kv.ldv = 2 * (int64_t)dp;
    return kv;
}

/* The tile's operands: keys from off (within the K/V block) on, against query block q. */
static score_operands tile_scores(const flashc_problem *p, const layout *L, const query_block *q,
                                  const kv_block *kv, int off) {
    if (!L->bf16) return f32_scores(kv->k + off * kv->ldk, kv->ldk, q->qt, L->ld, (int)p->D);
    score_operands s = {NULL, NULL, kv->k16 + off * kv->ldk, (const uint16_t *)q->qt, kv->ldk, L->ld, (int)p->D,
                        flashc_cpu_qscale(p)};
    return s;
}

static pv_operands tile_pv(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L,
                           const tile_bufs *t, const kv_block *kv, int off) {
    pv_operands v = {t->st, NULL, NULL, NULL, L->ld, kv->ldv, 0, 0, 0, (int)p->D};
    if (!L->bf16) {
        v.v = kv->v + off * kv->ldv;
        return v;
    }
    v.p2 = t->p2;
    const int prows = kern->bf16->softmax_prows != NULL;
    v.prs = prows ? prows_ld(L->bc) : 2;
    v.pcs = prows ? 2 : 2 * (int64_t)L->ld;
    v.lead = off % 2;
    v.v2 = kv->v2 + (off / 2) * kv->ldv;
    return v;
}

/*
 * Whether S^T's Q scale goes to the softmax step instead of the gemm: with softmax_prows (the amx set, whose gemm
 * scales in a pass of its own over the stored tile, where the avx512bf16 gemm scales in registers), where the score
 * epilogue at most writes -inf (no softcap, no ALiBi, which need the scaled scores) and the scale is > 0 (-inf scaled
 * stays -inf). The step multiplies each score as it reads it: the same product, the same bits.
 */
static int scale_in_softmax(const flashc_problem *p, const pv_operands *v, int64_t b, int64_t h) {
    return v->p2 && v->prs != 2 && p->softcap <= 0.0f && flashc_alibi_slope(p, b, h) == 0.0f &&
           flashc_cpu_qscale(p) > 0.0f;
}

/*
 * One step of the online softmax (FlashAttention-2, Algorithm 1, lines 8-10) for query block q against keys
 * [j0, j0 + cols), which start at row off of the K/V block kv: S^T = K (scale Q)^T, the score epilogue, m and l, O
 * rescaled by alpha, O += P V. With the bf16 products P is rounded to bf16 for P V (its pair rows), as flash-attn
 * does on the GPU; l sums the fp32 P.
 */
static void forward_tile(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                         const query_block *q, int64_t b, int64_t h, int64_t nq, int64_t nk, const kv_block *kv,
                         int off, int64_t j0, int cols, const flashc_cpu_dropout *drop) {
    const int D = (int)p->D, dp = L->dp, br = L->br, ld = L->ld, rows = q->rows;
    /* strips of the edge products: whole register tiles of the microkernel, about 16 rows */
    const int ch = (16 + kern->mr - 1) / kern->mr * kern->mr;
    int lo[FLASHC_CPU_MAX_BR], hi[FLASHC_CPU_MAX_BR];
    const int edge = tile_row_ranges(p, nq, nk, q->i0, rows, j0, cols, lo, hi);
    const pv_operands v = tile_pv(p, kern, L, t, kv, off);
    score_operands s = tile_scores(p, L, q, kv, off);
    float qs = 1.0f; /* the factor the softmax step applies to st */
    if (scale_in_softmax(p, &v, b, h)) qs = s.alpha, s.alpha = 1.0f;
    if (edge) edge_scores(kern, br, rows, lo, hi, &s, cols, t->st, ld, ch);
    else score_product(kern, &s, 0, cols, 0, br, t->st, ld); /* S^T = K (scale Q)^T, or K Q^T scaled by qs */
    if (edge || flashc_cpu_tile_needs_epilogue(p, b, h, nq, nk, q->i0, rows, j0, cols))
        flashc_cpu_score_epilogue(p, b, h, nq, nk, q->i0, rows, j0, cols, t->st, ld, NULL);
    if (v.p2) { /* the softmax writes P's pair words (with dropout 0 where dropped) and rescales O itself */
        if (drop) kern->bf16->keep(cols, br, t->keep, L->bc, drop, q->i0, j0);
        const flashc_cpu_softmax_pairs_fn sp = v.prs == 2 ? kern->bf16->softmax_pairs : kern->bf16->softmax_prows;
        sp(cols, br, t->st, ld, qs, q->m, q->l, t->alpha, drop ? t->keep : NULL, L->bc, v.lead, t->p2,
           v.prs == 2 ? v.pcs : v.prs, q->o, dp, D);
    } else {
        kern->softmax(cols, br, t->st, ld, q->m, q->l, t->alpha);
        for (int r = 0; r < rows; r++)
            if (t->alpha[r] != 1.0f) {
                float *orow = q->o + (size_t)r * dp;
                for (int d = 0; d < D; d++) orow[d] *= t->alpha[r];
            }
        /* l has summed P undropped (the lse is of the whole softmax); O takes only the kept entries */
        if (drop) kern->dropout(cols, br, t->st, ld, drop, q->i0, j0);
    }
    if (edge) edge_pv(kern, L, q, lo, hi, &v, cols, ch);
    else pv_product(kern, &v, 0, rows, 0, cols, q->o, dp); /* O += P V */
}

/*
 * The forward of n consecutive query blocks of (b, h), the first at row i0, with the key-block loop outside the
 * block loop: each K/V block is read (and converted) once and meets every block of the group while it is in
 * cache, where one block at a time would stream the whole K and V of the head from memory again per block once
 * they outgrow the last-level cache. Each block sees the keys of its own visible range within [jlo, jhi) (a
 * split-KV piece, else all keys); the key blocks start at the group's first visible key, so a group of one steps
 * exactly as a lone block does. Leaves block g's unnormalized O, m and l in slot g of t.
 */
static void forward_group(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                          int64_t b, int64_t h, int64_t i0, int n, int64_t jlo, int64_t jhi) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int D = (int)p->D, dp = L->dp, bc = L->bc, br = L->br;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), hk = h / (p->H / p->Hkv);
    flashc_cpu_dropout drop; /* kept values are scaled by 1 / (1 - p) in the store, with 1 / l */
    const int dropout = flashc_cpu_dropout_of(p, b, h, 1.0f, &drop);

    query_block qb[FLASHC_CPU_MAX_GQ];
    int64_t glo = jhi, ghi = jlo; /* the union of the blocks' key ranges */
    for (int g = 0; g < n; g++) {
        query_block *q = &qb[g];
        *q = group_block(L, t, g);
        q->i0 = i0 + (int64_t)g * br;
        q->rows = imin(br, nq - q->i0);
        flashc_cpu_block_key_range(p, q->i0, q->rows, nq, nk, &q->lo, &q->hi);
        if (q->lo < jlo) q->lo = jlo;
        if (q->hi > jhi) q->hi = jhi;
        if (q->hi > q->lo) {
            if (q->lo < glo) glo = q->lo;
            if (q->hi > ghi) ghi = q->hi;
        }
        if (L->bf16) flashc_cpu_load_pairs_t(kern, (uint16_t *)q->qt, L->ld, &p->q, tb, q0 + q->i0, q->rows, br, h, D);
        else flashc_cpu_load_t(kern, q->qt, L->ld, &p->q, tb, q0 + q->i0, q->rows, br, h, D, flashc_cpu_qscale(p));
        memset(q->o, 0, sizeof(float) * (size_t)br * dp);
        for (int r = 0; r < br; r++) {
            q->m[r] = -INFINITY;
            q->l[r] = 0.0f;
        }
    }
    for (int64_t j0 = glo; j0 < ghi; j0 += bc) {
        const int cols = imin(bc, ghi - j0);
        kv_block kv;
        int loaded = 0;
        for (int g = 0; g < n; g++) {
            const query_block *q = &qb[g];
            const int64_t a = q->lo > j0 ? q->lo : j0, e = q->hi < j0 + cols ? q->hi : j0 + cols;
            if (e <= a || !flashc_cpu_tile_visible(p, b, h, q->i0, q->rows, a, (int)(e - a))) continue;
            if (!loaded) { /* the first block that needs these keys loads them */
                kv = load_kv_block(p, kern, L, t, b, k0 + j0, cols, hk);
                loaded = 1;
            }
            forward_tile(p, kern, L, t, q, b, h, nq, nk, &kv, (int)(a - j0), a, (int)(e - a),
                         dropout ? &drop : NULL);
        }
    }
}

void flashc_cpu_forward_store(const flashc_problem *p, const flashc_cpu_kernels *kern, int dp, float *o,
                              const float *m, const float *l, int64_t b, int64_t h, int64_t i0, int rows) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int D = (int)p->D;
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    float *lse = p->lse ? p->lse + flashc_cpu_lse_offset(p, b, h, q0) + i0 : NULL;
    const int dropout = p->dropout_p > 0.0f;
    const float keep_scale = dropout ? flashc_dropout_scale(p->dropout_p) : 1.0f;
    /* bf16 rows with unit stride: normalized and rounded in one vector pass (the scalar store ran at about 10% of
     * the bf16 forward's time at N 512) */
    const flashc_cpu_out_bf16_fn out16 = kern && kern->bf16 && p->out.dtype == FLASHC_DTYPE_BF16 &&
                                                 p->out.stride[3] == 1
                                             ? kern->bf16->out_bf16
                                             : NULL;
    for (int r = 0; r < rows; r++) {
        float *orow = o + (size_t)r * dp;
        float inv = 1.0f; /* the factor still to apply to orow */
        if (p->sinks) { /* the sink joins the denominator */
            float lse_r;
            float f = flashc_sink_fold(p->sinks[h], m[r], l[r], &lse_r);
            if (dropout) f *= keep_scale;
            for (int d = 0; d < D; d++) orow[d] = f == 0.0f ? 0.0f : orow[d] * f;
            if (lse) lse[r] = lse_r;
        } else if (l[r] == 0.0f) {
            memset(orow, 0, sizeof(float) * (size_t)D);
            if (lse) lse[r] = INFINITY;
        } else {
            inv = 1.0f / l[r];
            if (dropout) inv *= keep_scale; /* kept entries of P scaled by 1 / (1 - p), after the normalization */
            if (lse) lse[r] = (m[r] + log2f(l[r])) * FLASHC_LN2;
        }
        if (out16) {
            out16(D, orow, inv, (uint16_t *)p->out.data + flashc_cpu_offset(&p->out, tb, q0 + i0 + r, h));
        } else if (inv != 1.0f) {
            for (int d = 0; d < D; d++) orow[d] *= inv;
        }
    }
    if (!out16) flashc_cpu_store_rows(&p->out, tb, q0 + i0, rows, h, D, o, dp, 1.0f);
}

void flashc_cpu_merge_pieces(const float *parts, size_t stride, int64_t n, int cap, int rows, int D, int dp,
                             float *o, float *m, float *l) {
    /* m = max_s m_s, l = sum_s l_s 2^(m_s - m), O = sum_s O_s 2^(m_s - m). */
    const size_t mo = (size_t)cap * dp, lo = mo + (size_t)cap;
    memset(o, 0, sizeof(float) * (size_t)rows * dp);
    for (int r = 0; r < rows; r++) {
        float mx = -INFINITY;
        for (int64_t s = 0; s < n; s++) mx = fmaxf(mx, parts[s * stride + mo + r]);
        float sum = 0.0f;
        float *orow = o + (size_t)r * dp;
        for (int64_t s = 0; s < n; s++) {
            const float *part = parts + s * stride;
            const float ms = part[mo + r], ls = part[lo + r];
            /* Only a piece that saw no key is skipped: one whose scores were all NaN has m = -inf but l = NaN, and
             * must make the row NaN as it does unsplit. */
            if (ls == 0.0f) continue;
            const float w = exp2f(ms - mx);
            sum += ls * w;
            const float *prow = part + (size_t)r * dp;
            for (int d = 0; d < D; d++) orow[d] += w * prow[d];
        }
        m[r] = mx;
        l[r] = sum;
    }
}

/* Query rows [*i0, *i0 + *rows) of task index task (b, h, qb); 0 when the block lies past the sequence. */
static int task_rows(const flashc_problem *p, const layout *L, int64_t task, int64_t *b, int64_t *h, int64_t *i0,
                     int *rows, int64_t *lo, int64_t *hi) {
    /* Query blocks in decreasing order within each head: with causal masks the last blocks see the most keys, so
     * the dynamic schedule hands out the long tasks first and ends on short ones. */
    const int64_t qb = L->nqb - 1 - task % L->nqb, bh = task / L->nqb;
    *b = bh / p->H;
    *h = bh % p->H;
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, *b, &q0, &nq, &k0, &nk);
    *i0 = qb * L->br;
    if (*i0 >= nq) return 0;
    *rows = imin(L->br, nq - *i0);
    flashc_cpu_block_key_range(p, *i0, *rows, nq, nk, lo, hi);
    return 1;
}

int flashc_cpu_forward_group(const flashc_problem *p, int nthreads) { return make_layout(p, 0, nthreads).gq; }
int flashc_cpu_backward_group(const flashc_problem *p, int nthreads) { return make_layout(p, 1, nthreads).gk; }

/* Query group task of (b, h): its first row *i0 and its blocks *n; 0 when it lies past the sequence. Groups in
 * decreasing order within each head, as task_rows orders blocks. */
static int task_group(const flashc_problem *p, const layout *L, int64_t task, int64_t *b, int64_t *h, int64_t *i0,
                      int *n) {
    const int64_t gi = L->ngq - 1 - task % L->ngq, bh = task / L->ngq;
    *b = bh / p->H;
    *h = bh % p->H;
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, *b, &q0, &nq, &k0, &nk);
    *i0 = gi * L->gq * L->br;
    if (*i0 >= nq) return 0;
    const int64_t left = (nq - *i0 + L->br - 1) / L->br, last = L->nqb - gi * L->gq;
    *n = imin(L->gq, left < last ? left : last);
    return 1;
}

/* What the forward's team shares. */
typedef struct forward_job {
    const flashc_problem *p;
    const flashc_cpu_kernels *kern;
    layout L;
    int64_t ntasks, splits;
    float *base, *partials;
    size_t pf;
} forward_job;

/* One thread's part of the forward: the tasks (pieces of them with split-KV), then the pieces' merge. */
static void forward_body(void *arg, int tid) {
    const forward_job *J = arg;
    const flashc_problem *p = J->p;
    const layout *L = &J->L;
    const int64_t ntasks = J->ntasks, splits = J->splits;
    const size_t pf = J->pf;
    tile_bufs t = carve(J->base + (size_t)tid * L->per_thread, L, 0);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t work = 0; work < ntasks * splits; work++) {
        const int64_t task = work / splits, s = work % splits;
        if (splits == 1) {
            int64_t b, h, i0;
            int n;
            if (!task_group(p, L, task, &b, &h, &i0, &n)) continue;
            int64_t q0, nq, k0, nk;
            flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
            forward_group(p, J->kern, L, &t, b, h, i0, n, 0, nk);
            for (int g = 0; g < n; g++) {
                const query_block q = group_block(L, &t, g);
                const int64_t ig = i0 + (int64_t)g * L->br;
                flashc_cpu_forward_store(p, J->kern, L->dp, q.o, q.m, q.l, b, h, ig, imin(L->br, nq - ig));
            }
            continue;
        }
        /* Piece s of the visible key range of one block (groups are of one here), cut at key-block boundaries. */
        int64_t b, h, i0, lo, hi;
        int rows;
        if (!task_rows(p, L, task, &b, &h, &i0, &rows, &lo, &hi)) continue;
        const int64_t nblk = hi > lo ? (hi - lo + L->bc - 1) / L->bc : 0, per = (nblk + splits - 1) / splits;
        const int64_t jlo = lo + s * per * L->bc, jhi = jlo + per * L->bc < hi ? jlo + per * L->bc : hi;
        forward_group(p, J->kern, L, &t, b, h, i0, 1, jlo, jhi > jlo ? jhi : jlo);
        float *part = J->partials + (size_t)work * pf;
        memcpy(part, t.o, sizeof(float) * (size_t)rows * L->dp);
        memcpy(part + (size_t)L->br * L->dp, t.m, sizeof(float) * (size_t)rows);
        memcpy(part + (size_t)L->br * L->dp + L->br, t.l, sizeof(float) * (size_t)rows);
    }
    if (splits > 1) {
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t task = 0; task < ntasks; task++) {
            int64_t b, h, i0, lo, hi;
            int rows;
            if (!task_rows(p, L, task, &b, &h, &i0, &rows, &lo, &hi)) continue;
            flashc_cpu_merge_pieces(J->partials + (size_t)task * splits * pf, pf, splits, L->br, rows, (int)p->D,
                                    L->dp, t.o, t.m, t.l);
            flashc_cpu_forward_store(p, J->kern, L->dp, t.o, t.m, t.l, b, h, i0, rows);
        }
    }
}

void flashc_cpu_forward(const flashc_problem *p, const flashc_cpu_kernels *kern, int nthreads, void *workspace) {
    forward_job J = {.p = p, .kern = kern, .L = make_layout(p, 0, nthreads)};
    J.L.bf16 = J.L.pairs && kern->bf16 != NULL;
    J.ntasks = p->B * p->H * J.L.ngq;
    J.splits = kv_splits(p, &J.L, nthreads);
    J.base = flashc_cpu_align64(workspace);
    J.partials = J.base + (size_t)nthreads * J.L.per_thread;
    J.pf = partial_floats(&J.L);
    flashc_cpu_team(nthreads, J.ntasks * J.splits, forward_body, &J); /* the merge loop has fewer (ntasks) */
}

/* ---- backward --------------------------------------------------------------------------------------------- */

static size_t di_floats(const flashc_problem *p) { /* the front checked B * H * Nq * 256 fits in int64 */
    return (size_t)round_up(p->varlen ? p->H * p->total_q : p->B * p->H * p->Nq, 16);
}

/* Per thread in the single-pass mode: dQ, (scale Q)^T and dO^T of one sequence, its lse and D. */
static size_t dq_seq_floats(const flashc_problem *p, const layout *L) {
    const size_t npad = flashc_size_of_i64(L->nqb * L->br);
    return SADD(SMUL(SADD(SMUL(3, npad), 2 * FLASHC_CPU_LD_PAD), (size_t)L->dp), SMUL(2, npad));
}

static size_t dkv_head_floats(const flashc_problem *p, const layout *L) {
    return SMUL(flashc_size_of_i64(p->varlen ? p->total_k : p->Nk), (size_t)L->dp);
}

/* Which batch of the per-head dK, dV buffers sequence b's rows lie in: its tensor batch, or with a block table (whose
 * rows are counted per sequence, also with varlen) the sequence itself. */
static int64_t dkv_batch(const flashc_problem *p, int64_t b) {
    return p->block_table ? b : flashc_cpu_tensor_batch(p, b);
}

size_t flashc_cpu_backward_workspace(const flashc_problem *p, int nthreads) {
    const layout L = make_layout(p, 1, nthreads);
    size_t floats = SADD(SMUL((size_t)nthreads, L.per_thread), di_floats(p));
    if (single_pass(p, nthreads)) {
        floats = SADD(floats, SMUL((size_t)nthreads, dq_seq_floats(p, &L)));
        if (p->H != p->Hkv) { /* per-head fp32 dK and dV: 2 * B * H * Nk * dp floats */
            const size_t heads =
                SMUL(flashc_size_of_i64(p->varlen && !p->block_table ? 1 : p->B), flashc_size_of_i64(p->H));
            floats = SADD(floats, SMUL(SMUL(2, heads), dkv_head_floats(p, &L)));
        }
    }
    return SADD(SMUL(floats, sizeof(float)), 64);
}

/* The query side of a backward tile: (scale Q)^T and dO^T (D x br, leading dim ld), or for the bf16 products Q's
 * and dO's pair rows along D (qt2, dot2: ((D + 1) / 2) x 2 ld bf16, Q unscaled), lse in log2 units (+inf on padding
 * rows) and D_i, for br rows. */
typedef struct query_side {
    const float *qt, *dot, *lse2, *di;
    const uint16_t *qt2, *dot2;
    int64_t ld;
} query_side;

/* Fills the query side of rows [i0, i0 + rows) of (b, h) into qt, dot (leading dim ld), lse2 and di, padding to
 * pad_rows; the whole sequence at once in the single-pass mode, one block otherwise. */
static query_side load_query_side(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, float *qt,
                                  float *dot, float *lse2, float *di, int64_t ld, const float *dvec, int64_t b,
                                  int64_t h, int64_t q0, int64_t i0, int rows, int pad_rows) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    query_side qs = {qt, dot, lse2, di, NULL, NULL, ld};
    if (L->bf16) {
        flashc_cpu_load_pairs_t(kern, (uint16_t *)qt, ld, &p->q, tb, q0 + i0, rows, pad_rows, h, p->D);
        flashc_cpu_load_pairs_t(kern, (uint16_t *)dot, ld, &p->dout, tb, q0 + i0, rows, pad_rows, h, p->D);
        qs.qt = qs.dot = NULL;
        qs.qt2 = (const uint16_t *)qt, qs.dot2 = (const uint16_t *)dot;
    } else {
        flashc_cpu_load_t(kern, qt, ld, &p->q, tb, q0 + i0, rows, pad_rows, h, p->D, flashc_cpu_qscale(p));
        flashc_cpu_load_t(kern, dot, ld, &p->dout, tb, q0 + i0, rows, pad_rows, h, p->D, 1.0f);
    }
    const int64_t off = flashc_cpu_lse_offset(p, b, h, q0) + i0;
    for (int r = 0; r < pad_rows; r++) {
        lse2[r] = r < rows ? p->lse[off + r] * FLASHC_LOG2E : INFINITY;
        di[r] = r < rows ? dvec[off + r] : 0.0f;
    }
    return qs;
}

/* The query side from row i0 on of one loaded for a whole sequence. */
static query_side query_side_at(const query_side *w, int64_t i0) {
    query_side qs = *w;
    qs.lse2 += i0, qs.di += i0;
    if (w->qt2) qs.qt2 += 2 * i0, qs.dot2 += 2 * i0;
    else qs.qt += i0, qs.dot += i0;
    return qs;
}

static query_side block_query_side(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L,
                                   tile_bufs *t, const float *dvec, int64_t b, int64_t h, int64_t q0, int64_t i0,
                                   int rows) {
    return load_query_side(p, kern, L, t->qt, t->dot, t->lse2, t->di, L->ld, dvec, b, h, q0, i0, rows, L->br);
}

/*
 * A key block as the backward's products read it: fp32 K and V rows, or for the bf16 products K's and V's bf16 rows
 * (k16, v16) and K's pair rows along the keys (k2, 2 dp bf16 each: the B operand of dQ += dS K).
 */
typedef struct key_side {
    const float *k, *v;
    const uint16_t *k16, *v16, *k2;
    int64_t ldk, ldv;
} key_side;

/* Keys [row0, row0 + cols) of (b, kv head hk) into the slots kbuf, vbuf (bc x dp floats each); with pack, rows read
 * in place (fp32 or bf16) are copied contiguous (pack_rows). */
static const float *pack_rows(const float *src, int64_t *ld, int rows, int D, float *buf, int dp);
static key_side load_key_side(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, float *kbuf,
                              float *vbuf, int64_t b, int64_t row0, int cols, int64_t hk, int pack) {
    key_side ks;
    memset(&ks, 0, sizeof ks);
    const int dp = L->dp;
    if (!L->bf16) {
        ks.k = flashc_cpu_kv_rows(kern, p, &p->k, b, row0, cols, hk, kbuf, dp, &ks.ldk);
        ks.v = flashc_cpu_kv_rows(kern, p, &p->v, b, row0, cols, hk, vbuf, dp, &ks.ldv);
        if (pack) {
            ks.k = pack_rows(ks.k, &ks.ldk, cols, (int)p->D, kbuf, dp);
            ks.v = pack_rows(ks.v, &ks.ldv, cols, (int)p->D, vbuf, dp);
        }
        return ks;
    }
    /* a slot is 2 bc dp bf16: the copied rows in its first half, K's pair rows in the second */
    uint16_t *k16 = (uint16_t *)kbuf, *k2 = k16 + (size_t)L->bc * dp;
    ks.k16 = flashc_cpu_kv_rows_bf16(p, &p->k, b, row0, cols, hk, k16, dp, &ks.ldk);
    ks.v16 = flashc_cpu_kv_rows_bf16(p, &p->v, b, row0, cols, hk, (uint16_t *)vbuf, dp, &ks.ldv);
    if (pack) { /* rows read in place copied contiguous (pack_rows says why) */
        if (ks.k16 != k16) {
            for (int r = 0; r < cols; r++) memcpy(k16 + (size_t)r * dp, ks.k16 + r * ks.ldk, 2 * (size_t)p->D);
            ks.k16 = k16, ks.ldk = dp;
        }
        if (ks.v16 != (uint16_t *)vbuf) {
            uint16_t *v16 = (uint16_t *)vbuf;
            for (int r = 0; r < cols; r++) memcpy(v16 + (size_t)r * dp, ks.v16 + r * ks.ldv, 2 * (size_t)p->D);
            ks.v16 = v16, ks.ldv = dp;
        }
    }
    kern->bf16->pairs_bf16(cols, (int)p->D, ks.k16, ks.ldk, k2, 2 * (int64_t)dp);
    ks.k2 = k2;
    return ks;
}

/*
 * Where a backward tile is cut by a causal or window mask: each row's visible columns [lo[r], hi[r]) (tile_row_ranges)
 * when on, and the strip height of the edge products. On such a tile the five products run in strips over the
 * (key, row) pairs some element of the strip sees, as the forward's edge tiles do: S^T and dP^T in strips of ch keys
 * (edge_scores), dV and dK in strips of ch keys over the rows that see them, dQ in strips of ch rows over the keys
 * they see. Every element they leave out has P = 0 and dS = 0 (set so below, not left to 0 * dP of an uncomputed
 * dP), so the strips drop only zero terms, and the gradients are those of the whole tile.
 */
typedef struct tile_edge {
    int on, ch;
    int lo[FLASHC_CPU_MAX_BR], hi[FLASHC_CPU_MAX_BR];
} tile_edge;

/*
 * One (query block, key block) tile of the backward: P (into st) and dS (into dpt), key-major. k and v are the
 * key-side rows, qs the query side. With dropout, Z = keep / (1 - p) comes from the same Philox bits as the forward's:
 * O = (P o Z) V, so dS = P o (Z o dP - D) and st leaves as P o Z, what dV = (P o Z)^T dO needs. Fills e.
 */
static void tile_ds(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                    const query_side *qs, const key_side *ks, int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t i0,
                    int rows, int64_t j0, int cols, tile_edge *e) {
    const int br = L->br, ld = L->ld, D = (int)p->D;
    e->ch = (16 + kern->mr - 1) / kern->mr * kern->mr; /* whole register tiles of the microkernel, about 16 rows */
    e->on = tile_row_ranges(p, nq, nk, i0, rows, j0, cols, e->lo, e->hi);
    score_operands s_ops = f32_scores(ks->k, ks->ldk, qs->qt, qs->ld, D);
    score_operands dp_ops = f32_scores(ks->v, ks->ldv, qs->dot, qs->ld, D);
    if (L->bf16) {
        s_ops = (score_operands){NULL, NULL, ks->k16, qs->qt2, ks->ldk, qs->ld, D, flashc_cpu_qscale(p)};
        dp_ops = (score_operands){NULL, NULL, ks->v16, qs->dot2, ks->ldv, qs->ld, D, 1.0f};
    }
    if (e->on) edge_scores(kern, br, rows, e->lo, e->hi, &s_ops, cols, t->st, ld, e->ch);
    else score_product(kern, &s_ops, 0, cols, 0, br, t->st, ld); /* S^T = K (scale Q)^T */
    if (e->on || flashc_cpu_tile_needs_epilogue(p, b, h, nq, nk, i0, rows, j0, cols))
        flashc_cpu_score_epilogue(p, b, h, nq, nk, i0, rows, j0, cols, t->st, ld, p->softcap > 0.0f ? t->t : NULL);
    /* bf16 products without softcap: P, dS and their bf16 forms in one pass after dP (fused), dropout's factors
     * from keep masks */
    flashc_cpu_dropout drop;
    const int dropout = flashc_cpu_dropout_of(p, b, h, flashc_dropout_scale(p->dropout_p), &drop);
    const int fused = L->bf16 && !(p->softcap > 0.0f);
    if (!fused) kern->exp2_sub(cols, br, t->st, ld, qs->lse2); /* P = 2^(S - lse) */
    if (e->on) edge_scores(kern, br, rows, e->lo, e->hi, &dp_ops, cols, t->dpt, ld, e->ch);
    else score_product(kern, &dp_ops, 0, cols, 0, br, t->dpt, ld); /* dP^T = V dO^T */
    if (fused) {
        /* The masked scores are -inf (P = 0) on an edge tile wherever its strips computed no dP: a 0 there keeps an
         * uncomputed dP out of dS, which is then 0 (of either sign; the products' sums start from +0). */
        for (int c = 0, ra = 0, rb = 0; e->on && c < cols; c++) {
            float *dsc = t->dpt + (size_t)c * ld;
            while (ra < rows && e->hi[ra] <= c) ra++;
            if (rb < ra) rb = ra;
            while (rb < rows && e->lo[rb] <= c) rb++;
            for (int r = 0; r < ra; r++) dsc[r] = 0.0f;
            for (int r = rb; r < br; r++) dsc[r] = 0.0f;
        }
        if (dropout) kern->bf16->keep(cols, br, t->keep, L->bc, &drop, i0, j0);
        kern->bf16->ds(cols, br, t->st, t->dpt, ld, qs->lse2, qs->di, dropout ? t->keep : NULL, L->bc,
                       dropout ? drop.kept : 1.0f, t->p16, t->ds16, t->ds2);
        return;
    }
    if (dropout) {
        for (int c = 0; c < cols; c++)
            for (int r = 0; r < br; r++) t->z[(size_t)c * ld + r] = 1.0f;
        kern->dropout(cols, br, t->z, ld, &drop, i0, j0);
    }
    int ra = 0, rb = 0; /* edge tile: the rows [ra, rb) that see key c, both growing with c */
    for (int c = 0; c < cols; c++) {
        float *pc = t->st + (size_t)c * ld;
        float *dsc = t->dpt + (size_t)c * ld;
        int r0 = 0, r1 = br;
        if (e->on) {
            while (ra < rows && e->hi[ra] <= c) ra++;
            if (rb < ra) rb = ra;
            while (rb < rows && e->lo[rb] <= c) rb++;
            r0 = ra, r1 = rb;
            for (int r = 0; r < r0; r++) dsc[r] = pc[r] = 0.0f;
            for (int r = r1; r < br; r++) dsc[r] = pc[r] = 0.0f;
        }
        if (dropout) { /* dS = P (Z dP - D), then P o Z */
            const float *zc = t->z + (size_t)c * ld;
            for (int r = r0; r < r1; r++) {
                dsc[r] = pc[r] * (zc[r] * dsc[r] - qs->di[r]);
                pc[r] *= zc[r];
            }
        } else {
            for (int r = r0; r < r1; r++) dsc[r] = pc[r] * (dsc[r] - qs->di[r]); /* dS = P (dP - D) */
        }
        if (p->softcap > 0.0f) { /* d(c tanh(x / c)) / dx = 1 - tanh^2 */
            const float *tc = t->t + (size_t)c * ld;
            for (int r = r0; r < (r1 < rows ? r1 : rows); r++) dsc[r] *= 1.0f - tc[r] * tc[r];
        }
    }
    if (L->bf16) { /* P and dS rounded to bf16 for the products that take them, as flash-attn does on the GPU */
        for (int c = 0; c < cols; c++) {
            kern->bf16->to_bf16(br, t->st + (size_t)c * ld, t->p16 + (size_t)c * ld);
            kern->bf16->to_bf16(br, t->dpt + (size_t)c * ld, t->ds16 + (size_t)c * ld);
        }
        kern->bf16->pairs_f32(cols, 0, br, t->dpt, ld, t->ds2, 2 * (int64_t)ld);
    }
}

/* D_i = rowsum(dO o O) for every row of (b, h). Rows go 16 at a time, transposed (load_t), so that the sums run
 * across rows in vector lanes, each row's still over d in order (the bits of a plain loop per row, whose one chain of
 * dependent adds per row had left the arithmetic waiting on the adder's latency). o, dout: 16 D floats each. */
static void dvec_task(const flashc_problem *p, const flashc_cpu_kernels *kern, float *dvec, float *o, float *dout,
                      int64_t b, int64_t h) {
    enum { R = 16 };
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t tb = flashc_cpu_tensor_batch(p, b), D = p->D;
    float *dst = dvec + flashc_cpu_lse_offset(p, b, h, q0);
    for (int64_t i0 = 0; i0 < nq; i0 += R) {
        const int rows = imin(R, nq - i0);
        flashc_cpu_load_t(kern, o, R, &p->out, tb, q0 + i0, rows, R, h, D, 1.0f);
        flashc_cpu_load_t(kern, dout, R, &p->dout, tb, q0 + i0, rows, R, h, D, 1.0f);
        float acc[R] = {0.0f};
        for (int64_t d = 0; d < D; d++)
            for (int r = 0; r < R; r++) acc[r] += o[d * R + r] * dout[d * R + r];
        for (int r = 0; r < rows; r++) dst[i0 + r] = acc[r];
    }
}

/* Whether query block [i0, i0 + rows) sees any key of [j0, j0 + cols) through the masks. */
static int tile_meets(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t i0, int rows,
                      int64_t j0, int cols) {
    int64_t lo, hi;
    flashc_cpu_block_key_range(p, i0, rows, nq, nk, &lo, &hi);
    if (hi <= j0 || lo >= j0 + cols) return 0;
    return flashc_cpu_tile_visible(p, b, h, i0, rows, j0, cols);
}

/*
 * rows x D fp32 rows at src (leading dim *ld) as contiguous rows (leading dim dp): copied into buf unless they are
 * there already (converted from 16 bits) or contiguous in place. In place, the rows of one head lie H * D floats
 * apart, 4 KiB at H 8, D 128, each on its own page: a key group's 2 * gk * bc K and V rows and a query block's q and
 * dO rows take more pages than the TLB holds, the packed copies a few. On the 2-core EPYC (f32, D 128, Nq 32768
 * against Nk 2048, CPU time) packing alone took the one-block loop from 110 to 129 GFLOP/s, and key groups of 8-16
 * from 118-119 unpacked to 150-151 packed.
 */
static const float *pack_rows(const float *src, int64_t *ld, int rows, int D, float *buf, int dp) {
    if (src == buf || *ld == dp) return src; /* converted, or already contiguous */
    for (int r = 0; r < rows; r++) memcpy(buf + (size_t)r * dp, src + r * *ld, sizeof(float) * (size_t)D);
    *ld = dp;
    return buf;
}

/* The fp32 rows of q and dO of one query block: in place, or converted into the thread's buffers; with pack always
 * there. For the bf16 products their pair rows along the queries instead (q2, do2: 2 dp bf16 each, zero past
 * rows), the B operands of dK += dS^T Q and dV += P^T dO. */
typedef struct query_rows {
    const float *q, *dout;
    const uint16_t *q2, *do2;
    int64_t ldq, ldo;
} query_rows;

/* The pair rows of rows [row0, row0 + rows) of t into buf (br x dp floats: the pairs in its first half, rows copied
 * from a strided view in the second). */
static const uint16_t *query_pairs(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L,
                                   const flashc_tensor *t, int64_t tb, int64_t h, int64_t row0, int rows, float *buf) {
    uint16_t *pairs = (uint16_t *)buf, *copy = pairs + (size_t)L->br * L->dp;
    int64_t ld;
    const uint16_t *src = flashc_cpu_rows_bf16(t, tb, row0, rows, h, p->D, copy, L->dp, &ld);
    kern->bf16->pairs_bf16(rows, (int)p->D, src, ld, pairs, 2 * (int64_t)L->dp);
    return pairs;
}

static query_rows load_query_rows(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L,
                                  tile_bufs *t, int64_t tb, int64_t h, int64_t row0, int rows, int pack) {
    query_rows qr;
    memset(&qr, 0, sizeof qr);
    if (L->bf16) {
        qr.q2 = query_pairs(p, kern, L, &p->q, tb, h, row0, rows, t->qbuf);
        qr.do2 = query_pairs(p, kern, L, &p->dout, tb, h, row0, rows, t->dobuf);
        return qr;
    }
    qr.q = flashc_cpu_rows(kern, &p->q, tb, row0, rows, h, p->D, t->qbuf, L->dp, &qr.ldq);
    qr.dout = flashc_cpu_rows(kern, &p->dout, tb, row0, rows, h, p->D, t->dobuf, L->dp, &qr.ldo);
    if (pack) {
        qr.q = pack_rows(qr.q, &qr.ldq, rows, (int)p->D, t->qbuf, L->dp);
        qr.dout = pack_rows(qr.dout, &qr.ldo, rows, (int)p->D, t->dobuf, L->dp);
    }
    return qr;
}

/* dV += P^T dO and dK += dS^T Q (dk, dv: cols x dp) for one tile whose P (st) and dS (dpt) tile_ds has just
 * computed. */
/* The bf16 form of accumulate_dkdv's products over keys [c0, c1) and rows [r0, r1), widened to whole pairs of rows
 * (P and dS are 0 on the rows a strip leaves out, and on the padding row of an odd count). */
static void dkdv_bf16(const flashc_cpu_kernels *kern, const layout *L, const tile_bufs *t, const query_rows *qr, int D,
                      int c0, int c1, int r0, int r1, float *dk, float *dv) {
    const int dp = L->dp, ld = L->ld, p0 = r0 / 2, p1 = (r1 + 1) / 2;
    const size_t a = (size_t)c0 * ld + 2 * (size_t)p0, bo = (size_t)p0 * 2 * dp, co = (size_t)c0 * dp;
    kern->bf16->gemm(c1 - c0, D, p1 - p0, t->p16 + a, ld, 2, qr->do2 + bo, 2 * dp, dv + co, dp, 1.0f, 1);
    kern->bf16->gemm(c1 - c0, D, p1 - p0, t->ds16 + a, ld, 2, qr->q2 + bo, 2 * dp, dk + co, dp, 1.0f, 1);
}

static void accumulate_dkdv(const flashc_cpu_kernels *kern, const layout *L, const tile_bufs *t, const tile_edge *e,
                            const query_rows *qr, int D, int rows, int cols, float *dk, float *dv) {
    const int dp = L->dp, ld = L->ld;
    const float *q = qr->q, *dout = qr->dout;
    const int64_t ldq = qr->ldq, ldo = qr->ldo;
    if (!e->on && qr->q2) {
        dkdv_bf16(kern, L, t, qr, D, 0, cols, 0, rows, dk, dv); /* dV += P^T dO, dK += dS^T Q */
        return;
    }
    if (!e->on) {
        kern->gemm(cols, D, rows, t->st, ld, 1, dout, ldo, dv, dp, 1); /* dV += P^T dO */
        kern->gemm(cols, D, rows, t->dpt, ld, 1, q, ldq, dk, dp, 1);   /* dK += dS^T Q */
        return;
    }
    for (int c0 = 0; c0 < cols; c0 += e->ch) { /* keys [c0, c1) over the rows [rs, re) that see one of them */
        const int c1 = c0 + e->ch < cols ? c0 + e->ch : cols;
        int rs = 0, re = rows;
        while (rs < rows && e->hi[rs] <= c0) rs++;
        while (re > rs && e->lo[re - 1] >= c1) re--;
        if (re <= rs) continue;
        if (qr->q2) {
            dkdv_bf16(kern, L, t, qr, D, c0, c1, rs, re, dk, dv);
            continue;
        }
        const size_t off = (size_t)c0 * ld + rs;
        kern->gemm(c1 - c0, D, re - rs, t->st + off, ld, 1, dout + rs * ldo, ldo, dv + (size_t)c0 * dp, dp, 1);
        kern->gemm(c1 - c0, D, re - rs, t->dpt + off, ld, 1, q + rs * ldq, ldq, dk + (size_t)c0 * dp, dp, 1);
    }
}

/* dQ rows [r0, r1) += dS K over keys [k0, k1) (dq: the tile's row 0, leading dim dp); the bf16 form widens the keys
 * to whole pairs (dS is 0 on the keys a strip leaves out, K's pair rows 0 past the block). */
static void dq_product(const flashc_cpu_kernels *kern, const layout *L, const tile_bufs *t, const key_side *ks, int D,
                       int r0, int r1, int k0, int k1, float *dq) {
    const int dp = L->dp, ld = L->ld;
    float *c = dq + (size_t)r0 * dp;
    if (ks->k2) {
        const int p0 = k0 / 2, p1 = (k1 + 1) / 2;
        kern->bf16->gemm(r1 - r0, D, p1 - p0, t->ds2 + (size_t)p0 * 2 * ld + 2 * (size_t)r0, 2, 2 * ld,
                         ks->k2 + (size_t)p0 * 2 * dp, 2 * dp, c, dp, 1.0f, 1);
    } else {
        kern->gemm(r1 - r0, D, k1 - k0, t->dpt + (size_t)k0 * ld + r0, 1, ld, ks->k + (int64_t)k0 * ks->ldk, ks->ldk,
                   c, dp, 1);
    }
}

/* dQ += dS K for one tile (dq: its rows, leading dim dp). */
static void accumulate_dq(const flashc_cpu_kernels *kern, const layout *L, const tile_bufs *t, const tile_edge *e,
                          const key_side *ks, int D, int rows, int cols, float *dq) {
    if (!e->on) {
        dq_product(kern, L, t, ks, D, 0, rows, 0, cols, dq);
        return;
    }
    for (int r0 = 0; r0 < rows; r0 += e->ch) { /* rows [r0, r1) over the keys [k0, k1) one of them sees */
        const int r1 = r0 + e->ch < rows ? r0 + e->ch : rows;
        const int k0 = e->lo[r0], k1 = e->hi[r1 - 1];
        if (k1 > k0) dq_product(kern, L, t, ks, D, r0, r1, k0, k1, dq);
    }
}

static void dkdv_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                      const float *dvec, int64_t b, int64_t hk, int64_t kb) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t j0 = kb * L->bc;
    if (j0 >= nk) return;
    const int cols = imin(L->bc, nk - j0), dp = L->dp, br = L->br;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), group = p->H / p->Hkv;
    const key_side ks = load_key_side(p, kern, L, t->kbuf, t->vbuf, b, k0 + j0, cols, hk, 0);
    memset(t->dk, 0, sizeof(float) * (size_t)cols * dp);
    memset(t->dv, 0, sizeof(float) * (size_t)cols * dp);
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int64_t i0 = 0; i0 < nq; i0 += br) {
            const int rows = imin(br, nq - i0);
            if (!tile_meets(p, b, h, nq, nk, i0, rows, j0, cols)) continue;
            const query_side qs = block_query_side(p, kern, L, t, dvec, b, h, q0, i0, rows);
            tile_edge e;
            tile_ds(p, kern, L, t, &qs, &ks, b, h, nq, nk, i0, rows, j0, cols, &e);
            const query_rows qr = load_query_rows(p, kern, L, t, tb, h, q0 + i0, rows, 0);
            accumulate_dkdv(kern, L, t, &e, &qr, (int)p->D, rows, cols, t->dk, t->dv);
        }
    }
    flashc_cpu_kv_store_rows(p, &p->dk, b, k0 + j0, cols, hk, t->dk, dp, p->scale);
    flashc_cpu_kv_store_rows(p, &p->dv, b, k0 + j0, cols, hk, t->dv, dp, 1.0f);
}

static void dq_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                    const float *dvec, int64_t task) {
    int64_t b, h, i0, lo, hi;
    int rows;
    if (!task_rows(p, L, task, &b, &h, &i0, &rows, &lo, &hi)) return;
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int D = (int)p->D, dp = L->dp, bc = L->bc;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), hk = h / (p->H / p->Hkv);
    const query_side qs = block_query_side(p, kern, L, t, dvec, b, h, q0, i0, rows);
    memset(t->dq, 0, sizeof(float) * (size_t)rows * dp);
    for (int64_t j0 = lo; j0 < hi; j0 += bc) {
        const int cols = imin(bc, hi - j0);
        if (!flashc_cpu_tile_visible(p, b, h, i0, rows, j0, cols)) continue;
        const key_side ks = load_key_side(p, kern, L, t->kbuf, t->vbuf, b, k0 + j0, cols, hk, 0);
        tile_edge e;
        tile_ds(p, kern, L, t, &qs, &ks, b, h, nq, nk, i0, rows, j0, cols, &e);
        accumulate_dq(kern, L, t, &e, &ks, D, rows, cols, t->dq); /* dQ += dS K */
    }
    flashc_cpu_store_rows(&p->dq, tb, q0 + i0, rows, h, D, t->dq, dp, p->scale);
}

/*
 * Single-pass backward of one (sequence, head): dK, dV per key block, dQ of the whole sequence in dq_seq.
 * dkv_heads: with GQA, where this head's dK, dV rows go (per-head fp32 rows), else NULL (the gradients themselves).
 * The key blocks go in groups of gk: each pass over the query blocks serves a group, every query block meeting the
 * group's key blocks in turn while its Q^T, dO^T, q, dO and dQ rows are in L2. One key block per pass would stream
 * the whole sequence's query side (5 Nq D floats with dQ read and written) from memory again for every 64 keys once
 * it outgrows the last-level cache; a group reads it once per gk blocks, and its K, V, dK, dV tiles wait in L3.
 * Sums keep their order (dQ over key blocks, dK and dV over query blocks, both ascending), so the results are
 * those of one block per pass, bit for bit.
 */
static void head_task(const flashc_problem *p, const flashc_cpu_kernels *kern, const layout *L, tile_bufs *t,
                      const float *dvec, float *seq, float *dkv_heads, int64_t b, int64_t h) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int D = (int)p->D, dp = L->dp, bc = L->bc, br = L->br;
    const int64_t tb = flashc_cpu_tensor_batch(p, b), hk = h / (p->H / p->Hkv), npad = L->nqb * L->br;
    /* The query side of the whole sequence, transposed once: dQ (npad x dp), Q^T, dO^T (dp x ldq), lse, D. */
    const int64_t ldq = npad + FLASHC_CPU_LD_PAD;
    float *dq_seq = seq, *qt = dq_seq + (size_t)npad * dp, *dot = qt + (size_t)ldq * dp;
    float *lse2 = dot + (size_t)ldq * dp, *di = lse2 + npad;
    const int padded = (int)((nq + br - 1) / br * br);
    const query_side whole = load_query_side(p, kern, L, qt, dot, lse2, di, ldq, dvec, b, h, q0, 0, (int)nq, padded);
    memset(dq_seq, 0, sizeof(float) * (size_t)nq * dp);
    const size_t tile = (size_t)bc * dp; /* one key block's K, V, dK or dV slot */
    for (int64_t jg = 0; jg < nk; jg += (int64_t)L->gk * bc) {
        const int n = imin(L->gk, (nk - jg + bc - 1) / bc); /* key blocks in this group */
        key_side ks[FLASHC_CPU_MAX_GK];
        for (int g = 0; g < n; g++) {
            const int64_t j0 = jg + (int64_t)g * bc;
            const int cols = imin(bc, nk - j0);
            ks[g] = load_key_side(p, kern, L, t->kbuf + g * tile, t->vbuf + g * tile, b, k0 + j0, cols, hk, 1);
        }
        memset(t->dk, 0, sizeof(float) * n * tile);
        memset(t->dv, 0, sizeof(float) * n * tile);
        for (int64_t i0 = 0; i0 < nq; i0 += br) {
            const int rows = imin(br, nq - i0);
            const query_side qs = query_side_at(&whole, i0);
            query_rows qr;
            int loaded = 0;
            for (int g = 0; g < n; g++) {
                const int64_t j0 = jg + (int64_t)g * bc;
                const int cols = imin(bc, nk - j0);
                if (!tile_meets(p, b, h, nq, nk, i0, rows, j0, cols)) continue;
                if (!loaded) { /* the first key block that meets this query block loads (converts) its rows */
                    qr = load_query_rows(p, kern, L, t, tb, h, q0 + i0, rows, 1);
                    loaded = 1;
                }
                tile_edge e;
                tile_ds(p, kern, L, t, &qs, &ks[g], b, h, nq, nk, i0, rows, j0, cols, &e);
                accumulate_dkdv(kern, L, t, &e, &qr, D, rows, cols, t->dk + g * tile, t->dv + g * tile);
                /* dQ += dS K */
                accumulate_dq(kern, L, t, &e, &ks[g], D, rows, cols, dq_seq + (size_t)i0 * dp);
            }
        }
        for (int g = 0; g < n; g++) {
            const int64_t j0 = jg + (int64_t)g * bc;
            const int cols = imin(bc, nk - j0);
            const float *dk = t->dk + g * tile, *dv = t->dv + g * tile;
            if (!dkv_heads) {
                flashc_cpu_kv_store_rows(p, &p->dk, b, k0 + j0, cols, hk, dk, dp, p->scale);
                flashc_cpu_kv_store_rows(p, &p->dv, b, k0 + j0, cols, hk, dv, dp, 1.0f);
            } else { /* this head's share; summed over the group afterwards */
                const size_t hf = dkv_head_floats(p, L);
                float *dkh = dkv_heads + ((size_t)dkv_batch(p, b) * p->H + h) * 2 * hf + (size_t)(k0 + j0) * dp;
                memcpy(dkh, dk, sizeof(float) * (size_t)cols * dp);
                memcpy(dkh + hf, dv, sizeof(float) * (size_t)cols * dp);
            }
        }
    }
    flashc_cpu_store_rows(&p->dq, tb, q0, (int)nq, h, D, dq_seq, dp, p->scale);
}

/* GQA: dK, dV of kv head hk (rows of sequence b) = sum over its query heads, in head order. */
static void reduce_group(const flashc_problem *p, const layout *L, const float *dkv_heads, float *acc, int64_t b,
                         int64_t hk) {
    int64_t q0, nq, k0, nk;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    const int64_t tb = dkv_batch(p, b), group = p->H / p->Hkv;
    const size_t hf = dkv_head_floats(p, L), dp = (size_t)L->dp;
    for (int which = 0; which < 2; which++)
        for (int64_t j = 0; j < nk; j++) {
            memset(acc, 0, sizeof(float) * dp);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                const float *src = dkv_heads + ((size_t)tb * p->H + h) * 2 * hf + which * hf + (size_t)(k0 + j) * dp;
                for (size_t d = 0; d < dp; d++) acc[d] += src[d];
            }
            flashc_cpu_kv_store_rows(p, which ? &p->dv : &p->dk, b, k0 + j, 1, hk, acc, (int64_t)dp,
                                  which ? 1.0f : p->scale);
        }
}

/* dk = dv = 0 on the key rows of sequence b, kv head hk, past the ones it uses (seqused_k). zero: D zeros. */
static void unused_keys_zero(const flashc_problem *p, const float *zero, int64_t b, int64_t hk) {
    int64_t q0, nq, k0, nk, rows;
    flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
    flashc_seq_key_rows(p, b, &k0, &rows);
    for (int64_t j = nk; j < rows; j++) {
        flashc_cpu_kv_store_rows(p, &p->dk, b, k0 + j, 1, hk, zero, p->D, 1.0f);
        flashc_cpu_kv_store_rows(p, &p->dv, b, k0 + j, 1, hk, zero, p->D, 1.0f);
    }
}

/* The sinks' gradient: lse includes the sink, so P_sink,i = exp(sink_h - lse_i), and dL/dsink_h = -sum over the
 * rows of (b, h) of P_sink,i D_i (D_i = rowsum(dO o O) = sum_j P_ij dP_ij). In a fixed order (reproducible). */
static void sinks_grad(const flashc_problem *p, const float *dvec) {
    for (int64_t h = 0; h < p->H; h++) {
        double acc = 0.0;
        for (int64_t b = 0; b < p->B; b++) {
            int64_t q0, nq, k0, nk;
            flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
            const int64_t off = flashc_cpu_lse_offset(p, b, h, q0);
            for (int64_t i = 0; i < nq; i++) acc -= exp((double)p->sinks[h] - p->lse[off + i]) * dvec[off + i];
        }
        p->dsinks[h] = (float)acc;
    }
}

/* What the backward's team shares. */
typedef struct backward_job {
    const flashc_problem *p;
    const flashc_cpu_kernels *kern;
    layout L;
    int single;
    float *dvec, *base, *extra, *dkv_heads;
} backward_job;

/* One thread's part of the backward: the paged pools' zeroing, D, then one mode's tasks, then unused keys. */
static void backward_body(void *arg, int tid) {
    const backward_job *J = arg;
    const flashc_problem *p = J->p;
    const flashc_cpu_kernels *kern = J->kern;
    const layout *L = &J->L;
    const int single = J->single;
    float *dvec = J->dvec;
    tile_bufs t = carve(J->base + (size_t)tid * L->per_thread, L, 1);
    if (p->block_table) { /* paged: dk, dv are whole pools, 0 where no used key lies (the rows below overwrite) */
        float *zero = t.dv;
        memset(zero, 0, sizeof(float) * (size_t)L->dp);
#ifdef _OPENMP
#  pragma omp for schedule(static)
#endif
        for (int64_t w = 0; w < p->num_pages * p->page_size; w++)
            for (int64_t hk = 0; hk < p->Hkv; hk++) {
                flashc_cpu_store_rows(&p->dk, w / p->page_size, w % p->page_size, 1, hk, p->D, zero, 0, 1.0f);
                flashc_cpu_store_rows(&p->dv, w / p->page_size, w % p->page_size, 1, hk, p->D, zero, 0, 1.0f);
            }
    }
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t bh = 0; bh < p->B * p->H; bh++) dvec_task(p, kern, dvec, t.qbuf, t.dobuf, bh / p->H, bh % p->H);
    if (single) {
        float *dq_seq = J->extra + (size_t)tid * dq_seq_floats(p, L);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t bh = 0; bh < p->B * p->H; bh++)
            head_task(p, kern, L, &t, dvec, dq_seq, J->dkv_heads, bh / p->H, bh % p->H);
        if (J->dkv_heads) {
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t bh = 0; bh < p->B * p->Hkv; bh++)
                reduce_group(p, L, J->dkv_heads, dq_seq, bh / p->Hkv, bh % p->Hkv);
        }
    }
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t task = 0; task < (single ? 0 : p->B * p->Hkv * L->nkb); task++) {
        const int64_t kb = task % L->nkb, bh = task / L->nkb;
        dkdv_task(p, kern, L, &t, dvec, bh / p->Hkv, bh % p->Hkv, kb);
    }
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t task = 0; task < (single ? 0 : p->B * p->H * L->nqb); task++) dq_task(p, kern, L, &t, dvec, task);
    if (p->seqused_k && !p->block_table) { /* keys past a sequence's used ones get no gradient (paged: zeroed) */
        float *zero = t.dk;
        memset(zero, 0, sizeof(float) * (size_t)L->dp);
#ifdef _OPENMP
#  pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t bh = 0; bh < p->B * p->Hkv; bh++) unused_keys_zero(p, zero, bh / p->Hkv, bh % p->Hkv);
    }
}

static int64_t imax64(int64_t a, int64_t b) { return a > b ? a : b; }

void flashc_cpu_backward(const flashc_problem *p, const flashc_cpu_kernels *kern, int nthreads, void *workspace) {
    backward_job J = {.p = p, .kern = kern, .L = make_layout(p, 1, nthreads), .single = single_pass(p, nthreads)};
    J.L.bf16 = J.L.pairs && kern->bf16 != NULL;
    J.dvec = flashc_cpu_align64(workspace);
    J.base = J.dvec + di_floats(p);
    J.extra = J.base + (size_t)nthreads * J.L.per_thread; /* single pass: per-thread dQ, then per-head dK, dV */
    J.dkv_heads = J.single && p->H != p->Hkv ? J.extra + (size_t)nthreads * dq_seq_floats(p, &J.L) : NULL;
    /* the longest of backward_body's loops (the others, over B * Hkv, are no longer) */
    int64_t pieces = J.single ? p->B * p->H : imax64(p->B * p->Hkv * J.L.nkb, p->B * p->H * J.L.nqb);
    if (p->block_table) pieces = imax64(pieces, p->num_pages * p->page_size);
    flashc_cpu_team(nthreads, pieces, backward_body, &J);
    if (p->dsinks) sinks_grad(p, J.dvec);
}
