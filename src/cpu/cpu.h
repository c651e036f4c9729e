/*
 * cpu.h - the CPU backend's pieces, top down: backend.c (the table, feature detection, the kernel choice),
 * attn.c (the forward/backward drivers), tiles.c (tile sizes, loads/stores, the score epilogue) and the
 * microkernel table that kernels_*.c fill (BLIS's split: a portable framework in C and small per-ISA kernels
 * chosen at run time). Each calls only the ones below it: the drivers get their kernels and thread count as
 * arguments.
 */
#ifndef FLASHC_CPU_H
#define FLASHC_CPU_H

#include "../dropout.h"
#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Microkernels. Every product of the forward and backward is one call of gemm:
 *   C[i][j] (+)= sum_p A(i, p) * B[p][j],   A(i, p) = a[i * rs_a + p * cs_a],   B and C rows unit-stride.
 * General A strides let the same kernel take A as given or transposed (BLIS's rs/cs), so K and V tiles are read
 * in place when they are fp32 with unit stride along D:
 *   S^T = K . (scale Q)^T      O += P . V          (forward, scores kept key-major: St[key][query])
 *   dP^T = V . dO^T   dV += P^T . dO   dK += dS^T . Q   dQ += dS . K     (backward)
 * accumulate = 0 overwrites C.
 */
typedef void (*flashc_cpu_gemm_fn)(int m, int n, int k, const float *a, int64_t rs_a, int64_t cs_a,
                                   const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate);

/*
 * Online-softmax step on a key-major score tile st[c][r] (cols keys x rows queries, log2 units, rows a
 * multiple of 16): for each query r, m' = max(m, max_c st), alpha = 2^(m - m'), st = 2^(st - m'),
 * l = l * alpha + sum_c st, m = m'. Rows that have seen no key keep m = -inf, alpha 1 and p = 0.
 */
typedef void (*flashc_cpu_softmax_fn)(int cols, int rows, float *st, int64_t ld, float *m, float *l,
                                      float *alpha);

/* st[c][r] = 2^(st[c][r] - sub[r]) in place (-inf gives 0): the backward's P from the lse. */
typedef void (*flashc_cpu_exp2_sub_fn)(int cols, int rows, float *st, int64_t ld, const float *sub);

/* dst[i] = exp2(src[i]) for n values (vectorized where the ISA allows): exposed for the accuracy test. */
typedef void (*flashc_cpu_exp2_fn)(int n, const float *src, float *dst);

/* Contiguous conversions to fp32 (F16C / shifts where available). */
typedef void (*flashc_cpu_cvt_fn)(int n, const uint16_t *src, float *dst);

/*
 * Decode scores, query-row-major: s[r][c] = sum_{d < D} q[r][d] k[c][d] for r < rows, c < cols (any counts). K rows
 * at k + c * ldk are read in place, only their first D values; q rows (stride ldq) are zero-padded to a multiple of
 * 16. Dot products over D, eight keys at a time: with the few query rows of decode the gemm's register tile, which
 * runs along the query rows, would be mostly padding.
 */
typedef void (*flashc_cpu_dots_fn)(int rows, int cols, int D, const float *q, int64_t ldq, const float *k,
                                   int64_t ldk, float *s, int64_t lds);
/*
 * Cache lines to start on their way (into L2) while a kernel computes: list i (K's rows, then V's, of the key step
 * decode reads next) is n rows of bytes[i] bytes each at (const char *)rows[i][r] + off[i], a table of row addresses
 * as the decode kernels take (a paged cache's step may lie on several pages) and a head's offset from them. dots_kv
 * issues them a few at a time between its dot products, so that they overlap the arithmetic instead of stalling the
 * loads in one burst. spread: the rows go out in a bit-reversed order within each 32 (0, 16, 8, 24, ...) instead of
 * the table's, for rows far apart (flashc_cpu_pf_spread).
 */
#define FLASHC_CPU_PF_LISTS 2
typedef struct flashc_cpu_prefetch {
    const void *const *rows[FLASHC_CPU_PF_LISTS];
    int64_t off[FLASHC_CPU_PF_LISTS];
    int n, bytes[FLASHC_CPU_PF_LISTS], spread;
} flashc_cpu_prefetch;
/*
 * Whether rows ld bytes apart are prefetched out of order. Measured on the Zen 4 VM (decode, cold, 1 thread,
 * lab/LOG.md): rows 2-4 KiB apart (32/8/128) prefetched in address order cost the contiguous cache 5-18%, and pages of 16 rows took
 * 1.3x the time of pages of 1 to 8 at bf16 (each page's rows in address order, then a jump); rows 128-256 B apart
 * (8/2/32, a step's rows nearly one stream) lost 8-15% scrambled. Why is not measured (the VM has no counters).
 */
static inline int flashc_cpu_pf_spread(int64_t ld) { return ld >= 1024 || ld <= -1024; }
/*
 * A kernel's walk over a prefetch list: begin with the number of times the kernel will call issue, then each call
 * issues the next few rows, every line of each, into L2 (T2). Measured on the Zen 4 VM (decode, cold): T1 as T2, T0
 * and NTA 1.3-1.5x slower at 32/8/128 (lines in L2 wait there without taking L1's fill buffers and space from the
 * loads of the data in use); every other line alone lost nearly all the gain. Whole rows with the list's fields in the
 * cursor: a line at a time, through the list's fields, had cost 30-40% of the decode time with the cache in L2.
 */
typedef struct flashc_cpu_pf_cursor {
    const flashc_cpu_prefetch *pf;
    const void *const *row; /* list i's table */
    int64_t off;
    int i, left, next;      /* list, rows left in it, next position in the order */
    int lines, per;         /* lines per row of list i, rows per issue */
    int n, spread;          /* the list's */
} flashc_cpu_pf_cursor;

static inline void flashc_cpu_pf_list(flashc_cpu_pf_cursor *c) {
    const flashc_cpu_prefetch *pf = c->pf;
    c->left = 0;
    if (c->i < FLASHC_CPU_PF_LISTS) {
        c->row = pf->rows[c->i];
        c->off = pf->off[c->i];
        c->left = pf->n;
        c->next = 0;
        c->lines = (pf->bytes[c->i] + 63) / 64;
    }
}

static inline void flashc_cpu_pf_begin(flashc_cpu_pf_cursor *c, const flashc_cpu_prefetch *pf, int calls) {
    /* every field set: with no list (pf NULL, no calls or rows) issue never reads past per and left, but gcc -O1
     * cannot see that and warns */
    *c = (flashc_cpu_pf_cursor){.pf = pf};
    if (!pf || calls <= 0 || pf->n <= 0) return;
    c->n = pf->n, c->spread = pf->spread;
    c->per = (FLASHC_CPU_PF_LISTS * pf->n + calls - 1) / calls;
    flashc_cpu_pf_list(c);
}

static inline void flashc_cpu_pf_issue(flashc_cpu_pf_cursor *c) {
    static const unsigned char order[32] = {0, 16, 8, 24, 4, 20, 12, 28, 2, 18, 10, 26, 6, 22, 14, 30,
                                            1, 17, 9, 25, 5, 21, 13, 29, 3, 19, 11, 27, 7, 23, 15, 31};
    for (int n = c->per; n > 0 && c->left > 0;) {
        const int k = n < c->left ? n : c->left, lines = c->lines;
        const int64_t off = c->off;
        const void *const *row = c->row;
        int next = c->next;
        if (!c->spread)
            for (int j = 0; j < k; j++, next++) {
                const char *r = (const char *)row[next] + off;
                for (int x = 0; x < lines; x++) __builtin_prefetch(r + 64 * x, 0, 1); /* locality 1: prefetcht2 */
            }
        else
            for (int j = 0, rows = c->n; j < k; j++) {
                int idx;
                do idx = order[next & 31] + next / 32 * 32;
                while (++next, idx >= rows); /* (positions past n skipped) */
                const char *r = (const char *)row[idx] + off;
                for (int x = 0; x < lines; x++) __builtin_prefetch(r + 64 * x, 0, 1);
            }
        c->next = next, c->left -= k, n -= k;
        if (c->left == 0) c->i++, flashc_cpu_pf_list(c);
    }
}
/*
 * How decode's kernels read K and V rows in place: fp32 or bf16 elements, unit stride along D, row c of a key step at
 * the address k[c] of a table (one per key). A table rather than (first row, row stride): a paged cache's step that
 * crosses page boundaries is still one call reading every page in place, and its sums run over the same values in
 * the same order as the contiguous cache's, so both give the same bits when their Nk (the contiguous cache's rows,
 * the paged one's max_pages * page_size) are equal: decode cuts the keys into pieces by Nk (decode.c).
 */
enum { FLASHC_CPU_KV_F32 = 0, FLASHC_CPU_KV_BF16 = 1 };
/*
 * dots on the K rows k[0 .. cols) of element type kt (FLASHC_CPU_KV_*) read in place, and the lines of pf (NULL:
 * none) prefetched along the way. With fp32 K the scores are dots' bit for bit; bf16 rows are widened to fp32 inside.
 */
typedef void (*flashc_cpu_dots_kv_fn)(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k,
                                      int kt, float *s, int64_t lds, const flashc_cpu_prefetch *pf);
/*
 * Decode's O update for one key step: o[r][d] = alpha[r] o[r][d] + sum_{c < cols} p[r][c] v[c][d] for r < rows,
 * d < D, the V rows v[0 .. cols) of element type vt (FLASHC_CPU_KV_*) read in place, only their first D values; o
 * past D is left alone. The online softmax's rescale and the product in one pass over the O rows.
 */
typedef void (*flashc_cpu_pv_fn)(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                                 const void *const *v, int vt, float *o, int64_t ldo);

/*
 * The online-softmax step of softmax_fn on a query-row-major tile s[r][c] (cols a multiple of 16; the caller fills
 * the padding columns with -inf): per row r, m' = max(m, max_c s), alpha = 2^(m - m'), s = 2^(s - m'),
 * l = l * alpha + sum_c s, m = m'.
 */
typedef void (*flashc_cpu_softmax_rows_fn)(int rows, int cols, float *s, int64_t lds, float *m, float *l,
                                           float *alpha);

/*
 * Dropout on a key-major tile st[c][r] (keys j0 + c, query rows i0 + r of one (sequence, head) stream): each element
 * becomes st * kept where dropout.h keeps (row0 + i0 + r, col0 + j0 + c), else 0. One Philox call per (row, group of
 * four keys), SIMD lanes over rows. ld = 1, rows = 1 takes one row of a row-major tile.
 */
typedef struct flashc_cpu_dropout {
    uint64_t seed, stream; /* Philox key, and the counter's high half (flashc_dropout_stream) */
    uint32_t threshold;    /* dropped iff x < threshold */
    float kept;            /* factor of kept elements: 1 in the forward (the store scales), 1 / (1 - p) in backward */
    int64_t row0, col0;    /* where the sequence's row 0 and key 0 sit in dropout's (i, j): the positions, or 0 */
} flashc_cpu_dropout;
typedef void (*flashc_cpu_dropout_fn)(int cols, int rows, float *st, int64_t ld, const flashc_cpu_dropout *d,
                                      int64_t i0, int64_t j0);

/*
 * bf16 products on dot-product instructions (AVX512-BF16 vdpbf16ps: per f32 lane, c += a0 b0 + a1 b1 over a pair of
 * bf16, accumulated in f32). The reduction index runs in pairs: k counts pairs, and the operands hold both members
 * of a pair side by side.
 *   C[i][j] (+)= alpha * sum_{p < k} (A(i, 2p) B[2p][j] + A(i, 2p + 1) B[2p + 1][j])
 * A's pair (i, p) is two adjacent bf16 at a + i * rs_a + p * cs_a (bf16 elements; a K row read in place has rs_a its
 * row stride, cs_a = 2); B's pair row p lies at b + p * ldb as (B[2p][j], B[2p + 1][j]) at 2j, 2j + 1 (the "VNNI"
 * layout). accumulate = 0 overwrites C.
 */
typedef void (*flashc_cpu_gemm_bf16_fn)(int m, int n, int k, const uint16_t *a, int64_t rs_a, int64_t cs_a,
                                        const uint16_t *b, int64_t ldb, float *c, int64_t ldc, float alpha,
                                        int accumulate);
/*
 * Pair rows from rows: dst[p][2j + e] = x(2p + e - lead, j) for p < (rows + lead + 1) / 2, j < n, e in {0, 1}, where
 * x(r, j) = src[r * lds + j] for 0 <= r < rows and 0 otherwise (lead: 0 or 1 zero rows in front). pairs_f32 rounds
 * fp32 to bf16 (to nearest even: P before P V), pairs_bf16 moves bf16 bits as they are (V rows).
 */
typedef void (*flashc_cpu_pairs_f32_fn)(int rows, int lead, int n, const float *src, int64_t lds, uint16_t *dst,
                                        int64_t ldd);
typedef void (*flashc_cpu_pairs_bf16_fn)(int rows, int n, const uint16_t *src, int64_t lds, uint16_t *dst,
                                         int64_t ldd);
/* dst[i] = bf16(src[i]) for n values, rounded to nearest even (the backward's P and dS, kept key-major). */
typedef void (*flashc_cpu_to_bf16_fn)(int n, const float *src, uint16_t *dst);
/* dst[i] = bf16(src[i] * scale) for n values, rounded as flashc_f32_to_bf16 rounds (nearest even, NaN quieted,
 * subnormals kept, where vcvtneps2bf16 flushes them): the forward's output rows, the same bits as the scalar store. */
typedef void (*flashc_cpu_out_bf16_fn)(int n, const float *src, float scale, uint16_t *dst);
/*
 * The backward's elementwise step of a key-major tile (cols keys x rows queries, rows a multiple of 16) in one pass,
 * for the bf16 products: from the masked scores st (log2 units) and dP^T (dpt), P = 2^(st - lse2[r]) to bf16's need
 * (exp2_avx512.h, flashc_exp2_p16_avx512, 3e-6 relative, where exp2_sub's P is fp32's) and dS = P (dP - di[r]) in fp32,
 * written only as bf16 (nearest even): P and dS key-major (p16, ds16, leading dim ld as st and dpt) and dS's pair rows
 * along the keys (ds2: (cols + 1) / 2 rows of leading dim 2 ld, the second key of the last pair 0 after an odd count),
 * the operands of dV += P^T dO, dK += dS^T Q and dQ += dS K. st and dpt are only read. With dropout, keep (NULL
 * without) holds the keep_fn masks of the tile (leading dim ldk) and Z = kept where kept, else 0: dS = P (Z dP - di[r])
 * and p16 gets P Z, the arithmetic of attn.c's unfused loop.
 */
typedef void (*flashc_cpu_ds_bf16_fn)(int cols, int rows, const float *st, const float *dpt, int64_t ld,
                                      const float *lse2, const float *di, const uint16_t *keep, int64_t ldk,
                                      float kept, uint16_t *p16, uint16_t *ds16, uint16_t *ds2);
/*
 * Dropout's keep bits of a key-major tile, as flashc_cpu_dropout_fn decides them, for the fused steps: keep[r / 16 *
 * ldk + c] bit b is 1 where element (row r + b, key c) is kept, for rows rounded up to 16 (ldk >= cols; keys side by
 * side, so that a pair of keys' masks is one 32-bit word).
 */
typedef void (*flashc_cpu_keep_fn)(int cols, int rows, uint16_t *keep, int64_t ldk, const flashc_cpu_dropout *d,
                                   int64_t i0, int64_t j0);
/*
 * Pair rows along D from rows whose pairs are 32-bit words: dst[q * ldd + 2 r + e] = src[r * lds + 2 q + e] for
 * q < pairs, e in {0, 1} and r < rows, 0 for rows <= r < pad_rows (Q and dO as the B operands of S^T = K Q^T and
 * dP^T = V dO^T): a transpose of words.
 */
typedef void (*flashc_cpu_pairs_t_fn)(int rows, int pad_rows, int pairs, const uint16_t *src, int64_t lds,
                                      uint16_t *dst, int64_t ldd);
/*
 * The forward's online-softmax step for the bf16 products, P written only as bf16 pair rows: m and alpha as
 * softmax_fn computes them from the scores qs st (cols keys x rows queries, rows a multiple of 16; st is only read;
 * qs 1, or the Q scale > 0 that the gemm's alpha would have applied: each qs st rounded once, the same bits as scaling
 * st first, so masked -inf stay -inf), P = 2^(qs st - m') to bf16's need (exp2_avx512.h, flashc_exp2_p16_avx512,
 * 3e-6 relative, where softmax_fn's P is fp32's) summed into l in softmax_fn's order and rounded to nearest even into
 * pair rows p2 as pairs_f32(cols, lead, rows, P, ...) lays them out (leading dim ldp), and the first D values of each
 * O row r (o, leading dim ldo) multiplied by alpha[r].
 * With dropout, keep (NULL without) holds the keep_fn masks of the tile (leading dim ldk): l sums P undropped, and the
 * pair rows take 0 where dropped (as dropout_fn with kept 1 between the two).
 */
typedef void (*flashc_cpu_softmax_pairs_fn)(int cols, int rows, const float *st, int64_t ld, float qs, float *m,
                                            float *l, float *alpha, const uint16_t *keep, int64_t ldk, int lead,
                                            uint16_t *p2, int64_t ldp, float *o, int64_t ldo, int D);
typedef struct flashc_cpu_bf16_kernels {
    flashc_cpu_gemm_bf16_fn gemm;
    flashc_cpu_pairs_f32_fn pairs_f32;
    flashc_cpu_pairs_bf16_fn pairs_bf16;
    flashc_cpu_to_bf16_fn to_bf16;
    flashc_cpu_ds_bf16_fn ds;
    flashc_cpu_pairs_t_fn pairs_t;
    flashc_cpu_softmax_pairs_fn softmax_pairs;
    flashc_cpu_keep_fn keep;
    /* softmax_pairs with P's pair words query-major instead: p2[r * ldp + 2 ((c + lead) / 2) + (c + lead) % 2] =
     * P(r, c), rows of key pairs (ldp >= 2 * ((cols + lead + 1) / 2)), which O += P V then reads in place (rs_a ldp,
     * cs_a 2); the same values. NULL: the forward uses softmax_pairs. */
    flashc_cpu_softmax_pairs_fn softmax_prows;
    flashc_cpu_out_bf16_fn out_bf16;
} flashc_cpu_bf16_kernels;

typedef struct flashc_cpu_kernels {
    const char *name; /* e.g. "avx2_6x16" */
    int mr, nr;       /* register tile of gemm */
    flashc_cpu_gemm_fn gemm;
    flashc_cpu_softmax_fn softmax;
    flashc_cpu_exp2_sub_fn exp2_sub;
    flashc_cpu_exp2_fn exp2;
    flashc_cpu_cvt_fn f16_to_f32;
    flashc_cpu_cvt_fn bf16_to_f32;
    flashc_cpu_dots_fn dots;                 /* decode.c */
    flashc_cpu_softmax_rows_fn softmax_rows; /* decode.c */
    /* decode.c: softmax_rows for a tile whose P this set's pv rounds to bf16 (bf16 V rows read in place), its P to
     * that need (exp2_avx512.h, flashc_exp2_p16_avx512); NULL: softmax_rows */
    flashc_cpu_softmax_rows_fn softmax_rows_p16;
    flashc_cpu_dropout_fn dropout;
    flashc_cpu_dots_kv_fn dots_kv; /* decode.c */
    flashc_cpu_pv_fn pv;           /* decode.c */
    /* bf16 products on dot-product instructions (register tile mr x nr as gemm's); NULL: bf16 inputs are widened
     * to fp32 and go through gemm */
    const flashc_cpu_bf16_kernels *bf16;
} flashc_cpu_kernels;

extern const flashc_cpu_kernels flashc_cpu_kernels_generic;
#if defined(FLASHC_CPU_X86)
extern const flashc_cpu_kernels flashc_cpu_kernels_avx2;
extern const flashc_cpu_kernels flashc_cpu_kernels_avx512;
#  if defined(FLASHC_CPU_AVX512BF16)
/* kernels_avx512bf16.c: the bf16 products that the "avx512bf16" set adds to the AVX-512 table (backend.c). */
extern const flashc_cpu_bf16_kernels flashc_cpu_bf16_kernels_avx512;
/* ... and its decode kernels: bf16 K / V rows on vdpbf16ps (fp32 rows go to the AVX-512 set's). */
void flashc_cpu_dots_kv_avx512bf16(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k,
                                   int kt, float *s, int64_t lds, const flashc_cpu_prefetch *pf);
void flashc_cpu_softmax_rows_p16_avx512bf16(int rows, int cols, float *s, int64_t lds, float *m, float *l,
                                            float *alpha);
void flashc_cpu_pv_avx512bf16(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                              const void *const *v, int vt, float *o, int64_t ldo);
/* ... and softmax_pairs writing P query-major (the softmax_prows that the amx set takes). */
void flashc_cpu_softmax_prows_avx512bf16(int cols, int rows, const float *st, int64_t ld, float qs, float *m,
                                         float *l, float *alpha, const uint16_t *keep, int64_t ldk, int lead,
                                         uint16_t *p, int64_t ldp, float *o, int64_t ldo, int D);
#  endif
#  if defined(FLASHC_CPU_AMX)
/* kernels_amx.c: the "amx" set's bf16 kernels, the avx512bf16 ones with gemm on AMX-BF16 tiles (emulated in C when
 * built with FLASHC_CPU_AMX_EMULATE). */
void flashc_cpu_bf16_kernels_amx_fill(flashc_cpu_bf16_kernels *k);
#  endif
/* The AVX2 decode kernels (kernels_avx2.c), which the AVX-512 sets take where they have none of their own (fp32 K
 * rows at D > 32, bf16 rows in the avx512 set). */
void flashc_cpu_dots_avx2(int rows, int cols, int D, const float *q, int64_t ldq, const float *k, int64_t ldk,
                          float *s, int64_t lds);
void flashc_cpu_dots_kv_avx2(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, int kt,
                             float *s, int64_t lds, const flashc_cpu_prefetch *pf);
void flashc_cpu_pv_avx2(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                        const void *const *v, int vt, float *o, int64_t ldo);
void flashc_cpu_softmax_rows_avx2(int rows, int cols, float *s, int64_t lds, float *m, float *l, float *alpha);
/* The AVX-512 set's dots_kv (kernels_avx512.c): fp32 K rows in 16-wide blocks at D <= 32 (the AVX2 kernel's beyond),
 * bf16 rows the AVX2 kernel's. */
void flashc_cpu_dots_kv_avx512(int rows, int cols, int D, const float *q, int64_t ldq, const void *const *k, int kt,
                               float *s, int64_t lds, const flashc_cpu_prefetch *pf);
#endif
/* The portable dropout (kernels_generic.c): the definition the SIMD ones must match bit for bit. */
void flashc_cpu_dropout_generic(int cols, int rows, float *st, int64_t ld, const flashc_cpu_dropout *d, int64_t i0,
                                int64_t j0);
/* backend.c: the best kernels this CPU runs (environment FLASHC_CPU_KERNELS=generic|avx2|avx512|avx512bf16|amx forces
 * a choice). "amx" is the default only on a CPU with AMX-BF16 whose OS grants the tile state, never emulated. */
const flashc_cpu_kernels *flashc_cpu_select_kernels(void);
/* Kernels by name ("generic", "avx2", "avx512", "avx512bf16", "amx"); NULL when not built in or this CPU lacks the
 * ISA (or, for "amx", the OS refused the tile state). */
const flashc_cpu_kernels *flashc_cpu_kernels_by_name(const char *name);

/* Tile sizes: query rows resident per task (a multiple of 16, at most FLASHC_CPU_MAX_BR), key rows streamed per
 * step. */
#define FLASHC_CPU_MAX_BR 128
typedef struct flashc_cpu_tiles {
    int br, bc;
} flashc_cpu_tiles;
/* Chosen from the head dim and the L1/L2 sizes of this CPU so the per-thread working set stays in L2. */
flashc_cpu_tiles flashc_cpu_choose_tiles(int64_t D, int backward);
/* Data cache sizes in bytes (L1d and L2 per core, L3 as cpu0 sees it), detected once per process. */
typedef struct flashc_cpu_caches {
    long l1d, l2, l3;
} flashc_cpu_caches;
flashc_cpu_caches flashc_cpu_cache_sizes(void);
/*
 * The forward's query group: how many query blocks of br rows one task holds, so that each K/V block it loads
 * meets all of them while it is in L2, from L3's size and the thread count (tiles.c explains the sizes). From 1 to
 * FLASHC_CPU_MAX_GQ.
 */
#define FLASHC_CPU_MAX_GQ 16
int flashc_cpu_query_group(int64_t D, flashc_cpu_tiles t, int nthreads);
/*
 * The backward's key group: how many key blocks of bc rows one pass over a (sequence, head)'s query blocks serves, so
 * that each query block meets all of them while it is in L2, from L3's size and the thread count (tiles.c). From 1
 * to FLASHC_CPU_MAX_GK.
 */
#define FLASHC_CPU_MAX_GK 16
int flashc_cpu_key_group(int64_t D, flashc_cpu_tiles t, int nthreads);
/*
 * The query-major tiles (Q^T, dO^T, S^T, dP^T) have leading dim br + FLASHC_CPU_LD_PAD, one cache line past a
 * multiple of 16 floats: with ld = br = 128 (512 bytes) the rows of a 32-column stripe of Q^T fall into a quarter
 * of the L1 sets and evict each other, and with the whole sequence's Q^T in the backward (ld = Nq) into one set.
 */
#define FLASHC_CPU_LD_PAD 16


/* The first 64-byte boundary at or after ptr: where a workspace's float buffers start (one cache line). */
/* Element i of a tensor's data in dtype t, as fp32 (f16 / bf16 widened exactly); the store rounds v to t once. */
static inline float flashc_cpu_load_elem(const void *p, flashc_dtype t, int64_t i) {
    switch (t) {
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)p)[i]);
    case FLASHC_DTYPE_BF16: return flashc_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}
static inline void flashc_cpu_store_elem(void *p, flashc_dtype t, int64_t i, float v) {
    switch (t) {
    case FLASHC_DTYPE_F16: ((uint16_t *)p)[i] = flashc_f32_to_f16(v); break;
    case FLASHC_DTYPE_BF16: ((uint16_t *)p)[i] = flashc_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

static inline float *flashc_cpu_align64(void *ptr) { return (float *)(((uintptr_t)ptr + 63) & ~(uintptr_t)63); }

/* Element offset of (batch b, row n, head h, dim 0) in a view. */
static inline int64_t flashc_cpu_offset(const flashc_tensor *t, int64_t b, int64_t n, int64_t h) {
    return b * t->stride[0] + n * t->stride[1] + h * t->stride[2];
}

/*
 * fp32 rows [row0, row0 + rows) of head h: a pointer into the tensor itself when it is fp32 with unit stride
 * along D (then *ld is its row stride), otherwise the rows converted into buf (leading dim buf_ld).
 */
const float *flashc_cpu_rows(const flashc_cpu_kernels *kern, const flashc_tensor *t, int64_t b, int64_t row0,
                             int rows, int64_t h, int64_t D, float *buf, int64_t buf_ld, int64_t *ld);
/*
 * K-like rows (k, v) [row0, row0 + rows) of sequence b, head h, as flashc_cpu_rows gives them: row0 counts as
 * flashc_seq_key_rows does (k0 + key), and with a block table each row is found through it (flashc_kv_offset), in
 * place where the rows lie on one page of an fp32 view with unit stride along D, else converted into buf. What the
 * tile forward, the decode path and the backward read K and V with.
 */
const float *flashc_cpu_kv_rows(const flashc_cpu_kernels *kern, const flashc_problem *p, const flashc_tensor *t,
                                int64_t b, int64_t row0, int rows, int64_t h, float *buf, int64_t buf_ld, int64_t *ld);
/* Stores scale * src[r][0..D) into K-like rows (dk, dv) [row0, row0 + rows) of sequence b, head h (paged or not). */
void flashc_cpu_kv_store_rows(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                              int64_t h, const float *src, int64_t ld, float scale);
/* Transposed load dst[d][r] = scale * t(row0 + r, d) for r < rows, zero for rows <= r < pad_rows. */
void flashc_cpu_load_t(const flashc_cpu_kernels *kern, float *dst, int64_t ld, const flashc_tensor *t, int64_t b,
                       int64_t row0, int rows, int pad_rows, int64_t h, int64_t D, float scale);
/*
 * The bf16 operands of the dot-product kernels (a bf16 view: its elements are copied as they are, never rounded).
 * rows_bf16: rows [row0, row0 + rows) of head h (any view), in place with unit stride along D, else copied into buf.
 * kv_rows_bf16: K-like rows [row0, row0 + rows) of sequence b, head h as flashc_cpu_kv_rows counts them, as bf16 rows
 * whose pairs (d, d + 1) are adjacent: in place where the view has unit stride along D, D is even and (paged) the rows
 * lie on one page, else copied into buf (leading dim buf_ld >= D + 1), an odd D padded with a zero.
 * load_pairs_t: the query rows as pair rows, dst[(d / 2) * 2 ld + 2 r + d % 2] = t(row0 + r, d) for r < rows and d < D,
 * zero for rows <= r < pad_rows and for d = D when D is odd (the B operand of S^T = K Q^T); by kern's pairs_t where the
 * view has unit stride along D and D is even.
 */
const uint16_t *flashc_cpu_rows_bf16(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                                     uint16_t *buf, int64_t buf_ld, int64_t *ld);
const uint16_t *flashc_cpu_kv_rows_bf16(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t row0,
                                        int rows, int64_t h, uint16_t *buf, int64_t buf_ld, int64_t *ld);
void flashc_cpu_load_pairs_t(const flashc_cpu_kernels *kern, uint16_t *dst, int64_t ld, const flashc_tensor *t,
                             int64_t b, int64_t row0, int rows, int pad_rows, int64_t h, int64_t D);
/* Stores scale * src[r][0..D) into rows [row0, row0 + rows) of head h, converting to the view's dtype. */
void flashc_cpu_store_rows(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                           const float *src, int64_t ld, float scale);

/* Batch index of sequence b inside the tensors (0 with varlen, which packs along N). */
static inline int64_t flashc_cpu_tensor_batch(const flashc_problem *p, int64_t b) { return p->varlen ? 0 : b; }
/* Offset of lse(b, h, row 0) in the (B, H, Nq) / varlen (H, total_q) array. */
static inline int64_t flashc_cpu_lse_offset(const flashc_problem *p, int64_t b, int64_t h, int64_t q0) {
    return p->varlen ? h * p->total_q + q0 : (b * p->H + h) * p->Nq;
}

/* Dropout of (sequence b, query head h), with kept elements multiplied by kept; 0 when the problem has none. */
static inline int flashc_cpu_dropout_of(const flashc_problem *p, int64_t b, int64_t h, float kept,
                                        flashc_cpu_dropout *d) {
    if (!(p->dropout_p > 0.0f)) return 0;
    d->seed = p->dropout_seed;
    d->stream = flashc_dropout_stream(p->dropout_offset, b, p->H, h);
    d->threshold = flashc_dropout_threshold(p->dropout_p);
    d->kept = kept;
    d->row0 = p->positions ? p->q_position : 0; /* the front checked both >= 0 with dropout */
    d->col0 = p->positions ? p->k_position : 0;
    return 1;
}

/* Scale applied to q before the product: scale, times log2(e) when no softcap needs the natural units. */
static inline float flashc_cpu_qscale(const flashc_problem *p) {
    return p->softcap > 0.0f ? p->scale : p->scale * 1.4426950408889634f;
}

/*
 * Finishes a key-major score tile st[c][r] (keys j0 + c, queries i0 + r) into log2 units: softcap, ALiBi, and
 * -inf outside the causal/window range or the block mask. st holds qscale * q.k on entry. With softcap,
 * tanh_out (if not NULL) receives tanh(s / softcap) for the backward's derivative.
 */
void flashc_cpu_score_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                               int64_t i0, int rows, int64_t j0, int cols, float *st, int64_t ld, float *tanh_out);
/* Each row's visible columns [lo[r], hi[r]) of the tile (queries i0 .. i0 + rows, keys j0 .. j0 + cols) under the
 * causal / window band, clipped to [0, cols); returns 1 when some row sees only part of the tile. */
int flashc_cpu_row_ranges(const flashc_problem *p, int64_t nq, int64_t nk, int64_t i0, int rows, int64_t j0,
                          int cols, int *lo, int *hi);
/* Whether the epilogue has work on this tile (softcap, ALiBi, or some element masked). */
int flashc_cpu_tile_needs_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                                   int64_t i0, int rows, int64_t j0, int cols);
/* 1 when some mask block overlapping the tile [i0, i0+rows) x [j0, j0+cols) is non-zero (or no mask). */
int flashc_cpu_tile_visible(const flashc_problem *p, int64_t b, int64_t h, int64_t i0, int rows, int64_t j0,
                            int cols);
/* Key range [lo, hi) that any row of the query block [i0, i0 + rows) may see through causal/window masks. */
void flashc_cpu_block_key_range(const flashc_problem *p, int64_t i0, int rows, int64_t nq, int64_t nk, int64_t *lo,
                                int64_t *hi);

/*
 * backend.c: a driver's parallel part is one function body(arg, tid) whose loops are orphaned `omp for` constructs
 * (their implicit barriers order the loops). flashc_cpu_team runs it on min(threads, pieces) threads, pieces being
 * the most iterations any of its loops has (tid: 0 .. that count - 1, each with its own per-thread workspace). On
 * one thread, outside any active parallel region, it calls body(arg, 0) directly: no region is opened, the loops
 * bind to no team and run every iteration in order on the caller, with no barrier - an OpenMP runtime would
 * otherwise make a wake-up syscall at each barrier even in a team of one. The loops hand out the same iterations
 * either way, and every iteration writes its own outputs, so the results are the same bits.
 */
typedef void (*flashc_cpu_body)(void *arg, int tid);
void flashc_cpu_team(int threads, int64_t pieces, flashc_cpu_body body, void *arg);

/*
 * attn.c: the drivers on a validated problem whose host-memory inputs backend.c has checked, with threads
 * OpenMP threads and workspace of at least the size the matching function gives for the same thread count.
 */
size_t flashc_cpu_forward_workspace(const flashc_problem *p, int threads);
size_t flashc_cpu_backward_workspace(const flashc_problem *p, int threads);
void flashc_cpu_forward(const flashc_problem *p, const flashc_cpu_kernels *kern, int threads, void *workspace);
/* Query blocks per task that flashc_cpu_forward groups for p on threads threads (tests check a case groups). */
int flashc_cpu_forward_group(const flashc_problem *p, int threads);
/* Key blocks per pass over the queries that flashc_cpu_backward groups for p on threads threads (1 in its two-pass
 * mode; tests check a case groups). */
int flashc_cpu_backward_group(const flashc_problem *p, int threads);
void flashc_cpu_backward(const flashc_problem *p, const flashc_cpu_kernels *kern, int threads, void *workspace);

/*
 * Normalizes the unnormalized O rows (leading dim dp) by l and the sink, and writes out and lse of query rows
 * [i0, i0 + rows) of sequence b, head h; rows that saw no key get 0 and +inf (the sink). kern (NULL: none) with a
 * bf16 out_bf16 writes a bf16 output with unit stride along D in one pass, normalizing as it rounds (the same bits);
 * o is left unnormalized then.
 */
void flashc_cpu_forward_store(const flashc_problem *p, const flashc_cpu_kernels *kern, int dp, float *o,
                              const float *m, const float *l, int64_t b, int64_t h, int64_t i0, int rows);
/*
 * Split-KV: merges n pieces of the same rows by log-sum-exp in piece order, into o (rows x dp), m, l. Piece s lies
 * at parts + s * stride: O (cap x dp), then m (cap), then l (cap). A piece that saw no key (l = 0) is skipped.
 */
void flashc_cpu_merge_pieces(const float *parts, size_t stride, int64_t n, int cap, int rows, int D, int dp,
                             float *o, float *m, float *l);

/*
 * decode.c: the forward for few query rows (decode, chunked prefill). flashc_cpu_decode_splits gives 0 when the
 * problem is not one (the tile forward runs), else the pieces each sequence's keys are cut into, from the shape
 * alone; the workspace and the driver take that count.
 */
int64_t flashc_cpu_decode_splits(const flashc_problem *p);
size_t flashc_cpu_decode_workspace(const flashc_problem *p, int threads, int64_t splits);
void flashc_cpu_decode(const flashc_problem *p, const flashc_cpu_kernels *kern, int threads, int64_t splits,
                       void *workspace);

/* merge.c: flashc_merge on views the front validated (one shape and dtype; lse fp32 (B, H, N), NULL: not written),
 * with threads OpenMP threads. */
void flashc_cpu_merge(const flashc_tensor *out_a, const float *lse_a, const flashc_tensor *out_b,
                      const float *lse_b, const flashc_tensor *out, float *lse, int threads);

/* rotary.c: flashc_rotary on views the front validated and positions cpu_rotary checked (all in [0, P)), with
 * threads OpenMP threads; in_place: out is x's very view (the dims past R are not copied onto themselves). */
void flashc_cpu_rotary(const flashc_tensor *x, const flashc_tensor *cos, const flashc_tensor *sin,
                       const int32_t *seq_start, int interleaved, const flashc_tensor *out, int in_place, int threads);

/*
 * 2^f ~ 1 + f (C1 + f (C2 + ... + f C6)) on [-1/2, 1/2]: a near-minimax fit of the relative error (iteratively
 * reweighted least squares on Chebyshev nodes), 2e-9 relative before rounding, against 6e-9 for the degree-7
 * Taylor series it replaces; one multiply-add and the f * ln2 scaling fewer per value. The vector exp2's
 * measured error is in tests/test_cpu_kernels.c.
 */
#define FLASHC_EXP2_C1 6.9314720286e-01f
#define FLASHC_EXP2_C2 2.4022647913e-01f
#define FLASHC_EXP2_C3 5.5503324641e-02f
#define FLASHC_EXP2_C4 9.6184373934e-03f
#define FLASHC_EXP2_C5 1.3398876758e-03f
#define FLASHC_EXP2_C6 1.5353357724e-04f

/*
 * 2^f ~ 1 + f (C1 + f (C2 + f (C3 + f C4))) on [0, 1], for a P rounded to bf16 next (exp2_avx512.h,
 * flashc_exp2_p16_avx512): the minimax fit of the relative error with p(0) = 1 (Remez), 2.9e-6 relative before
 * rounding, 3.0e-6 evaluated in fp32, against bf16's 2^-9 rounding of P.
 */
#define FLASHC_EXP2_P16_C1 6.9304484129e-01f
#define FLASHC_EXP2_P16_C2 2.4128019810e-01f
#define FLASHC_EXP2_P16_C3 5.2242472768e-02f
#define FLASHC_EXP2_P16_C4 1.3426683843e-02f

#define FLASHC_LOG2E 1.4426950408889634f
#define FLASHC_LN2 0.6931471805599453f

#ifdef __cplusplus
}
#endif

#endif
