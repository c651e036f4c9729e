/*
 * test_kvcache: flashc_kvcache_append and attention against the cache it fills (flash-attn's
 * flash_attn_with_kvcache on a contiguous cache), on the CPU backend.
 *
 * A cache of capacity 64 whose unfilled rows hold NaN, sequences filled to 0, 17 and 50 rows, Nnew new rows (1:
 * decode, 5: a chunk of prefill): after the append the new rows are in the cache bit for bit and every other row is
 * untouched; then attention with seqused_k = cache_seqlens + Nnew (causal, and with a window) must equal, per
 * sequence, attention on a contiguous copy of its used keys alone (the same library, no seqused_k). A packed cache
 * (k and v halves interleaved) is taken. Refusals: rows past the capacity (nothing written), caches that share
 * elements or overlap an input, shapes that do not fit. Decode against a long cache gives the same bits at any thread
 * count. Paged caches (flashc_kvcache_append_paged, block_table): the same steps through a shuffled page pool give
 * the contiguous cache's rows and attention bit for bit; bad tables, lengths and pages are refused, nothing written.
 */
#include "internal.h" /* flashc_f32_to_bf16 */
#include "ref/testkit.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_checks, g_failed;

static void check(const char *what, int cond) {
    g_checks++;
    g_failed += !cond;
    printf("%-78s %s\n", what, cond ? "PASS" : "FAIL");
}

enum { B = 3, CAP = 64, HKV = 2, H = 4, D = 32 };
static const int32_t filled[B] = {0, 17, 50};

static float frand(uint64_t *rng) { return (float)flashc_rand_normal(rng); }

/* One decode or chunked-prefill step with nnew rows and the masks given; returns 1 when every check held. */
static void step(flashc_context_t ctx, int nnew, int causal, int64_t wl, const char *name) {
    uint64_t rng = 1234 + (uint64_t)nnew * 7 + (uint64_t)wl;
    const size_t cache_el = (size_t)B * CAP * HKV * D, new_el = (size_t)B * nnew * HKV * D,
                 q_el = (size_t)B * nnew * H * D;
    float *kc = malloc(cache_el * 4), *vc = malloc(cache_el * 4), *kc0 = malloc(cache_el * 4),
          *vc0 = malloc(cache_el * 4), *kn = malloc(new_el * 4), *vn = malloc(new_el * 4), *q = malloc(q_el * 4),
          *out = malloc(q_el * 4), *lse = malloc((size_t)B * H * nnew * 4);
    if (!kc || !vc || !kc0 || !vc0 || !kn || !vn || !q || !out || !lse) exit(2);
    for (size_t i = 0; i < cache_el; i++) {
        const size_t row = i / (HKV * D) % CAP, b = i / ((size_t)CAP * HKV * D);
        kc[i] = row < (size_t)filled[b] ? frand(&rng) : NAN; /* unfilled rows: NaN, which must reach nothing */
        vc[i] = row < (size_t)filled[b] ? frand(&rng) : NAN;
    }
    for (size_t i = 0; i < new_el; i++) kn[i] = frand(&rng), vn[i] = frand(&rng);
    for (size_t i = 0; i < q_el; i++) q[i] = frand(&rng);
    memcpy(kc0, kc, cache_el * 4);
    memcpy(vc0, vc, cache_el * 4);
    const flashc_tensor tkc = flashc_tensor_contiguous(kc, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        tvc = flashc_tensor_contiguous(vc, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        tkn = flashc_tensor_contiguous(kn, FLASHC_DTYPE_F32, B, nnew, HKV, D),
                        tvn = flashc_tensor_contiguous(vn, FLASHC_DTYPE_F32, B, nnew, HKV, D),
                        tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, B, nnew, H, D),
                        to = flashc_tensor_contiguous(out, FLASHC_DTYPE_F32, B, nnew, H, D);
    char what[128];

    /* the append */
    flashc_status st = flashc_kvcache_append(ctx, &tkc, &tvc, &tkn, &tvn, filled);
    int rows_ok = st == FLASHC_STATUS_OK, rest_ok = 1;
    for (int b = 0; b < B; b++)
        for (int r = 0; r < CAP; r++) {
            const size_t off = ((size_t)b * CAP + r) * HKV * D, n = (size_t)HKV * D * 4;
            if (r >= filled[b] && r < filled[b] + nnew) {
                const size_t src = ((size_t)b * nnew + (r - filled[b])) * HKV * D;
                rows_ok &= !memcmp(kc + off, kn + src, n) && !memcmp(vc + off, vn + src, n);
            } else {
                rest_ok &= !memcmp(kc + off, kc0 + off, n) && !memcmp(vc + off, vc0 + off, n);
            }
        }
    snprintf(what, sizeof what, "%s: the new rows are in the cache bit for bit", name);
    check(what, rows_ok);
    snprintf(what, sizeof what, "%s: every other cache row is untouched", name);
    check(what, rest_ok);

    /* attention against the cache, each sequence against its used keys copied out */
    int32_t used[B];
    for (int b = 0; b < B; b++) used[b] = filled[b] + nnew;
    flashc_params prm = flashc_params_default();
    prm.causal = causal;
    prm.window_left = wl;
    prm.seqused_k = used;
    st = flashc_forward(ctx, &tq, &tkc, &tvc, &prm, &to, lse, NULL, 0);
    double worst = st == FLASHC_STATUS_OK ? 0.0 : INFINITY, worst_lse = worst;
    for (int b = 0; b < B && st == FLASHC_STATUS_OK; b++) {
        const int nk = used[b];
        float *k1 = malloc((size_t)nk * HKV * D * 4), *v1 = malloc((size_t)nk * HKV * D * 4),
              *o1 = malloc((size_t)nnew * H * D * 4), *l1 = malloc((size_t)H * nnew * 4);
        if (!k1 || !v1 || !o1 || !l1) exit(2);
        memcpy(k1, kc + (size_t)b * CAP * HKV * D, (size_t)nk * HKV * D * 4);
        memcpy(v1, vc + (size_t)b * CAP * HKV * D, (size_t)nk * HKV * D * 4);
        const flashc_tensor a_k = flashc_tensor_contiguous(k1, FLASHC_DTYPE_F32, 1, nk, HKV, D),
                            a_v = flashc_tensor_contiguous(v1, FLASHC_DTYPE_F32, 1, nk, HKV, D),
                            a_q = flashc_tensor_contiguous(q + (size_t)b * nnew * H * D, FLASHC_DTYPE_F32, 1, nnew, H, D),
                            a_o = flashc_tensor_contiguous(o1, FLASHC_DTYPE_F32, 1, nnew, H, D);
        flashc_params p1 = prm;
        p1.seqused_k = NULL;
        if (flashc_forward(ctx, &a_q, &a_k, &a_v, &p1, &a_o, l1, NULL, 0) != FLASHC_STATUS_OK) {
            worst = INFINITY;
        } else {
            for (size_t i = 0; i < (size_t)nnew * H * D; i++) {
                const double e = fabs((double)out[(size_t)b * nnew * H * D + i] - o1[i]);
                if (!(e <= worst)) worst = e; /* NaN counts as worst */
            }
            for (int i = 0; i < H * nnew; i++) {
                const double e = fabs((double)lse[(size_t)b * H * nnew + i] - l1[i]);
                if (!(e <= worst_lse)) worst_lse = e;
            }
        }
        free(k1), free(v1), free(o1), free(l1);
    }
    snprintf(what, sizeof what, "%s: attention on the cache = on the used keys alone (max |diff| %.2g, lse %.2g)",
             name, worst, worst_lse);
    check(what, worst <= 1e-5 && worst_lse <= 1e-5);

    /* rows past the capacity: refused, nothing written */
    const int32_t too_far[B] = {0, CAP - nnew + 1, 3};
    memcpy(kc0, kc, cache_el * 4);
    st = flashc_kvcache_append(ctx, &tkc, &tvc, &tkn, &tvn, too_far);
    snprintf(what, sizeof what, "%s: rows past the capacity are refused, the cache untouched (%s)", name,
             flashc_context_last_error(ctx));
    check(what, st == FLASHC_STATUS_INVALID_ARGUMENT && !memcmp(kc, kc0, cache_el * 4));

    free(kc), free(vc), free(kc0), free(vc0), free(kn), free(vn), free(q), free(out), free(lse);
}

/* One packed cache (B, CAP, 2, HKV, D), its k and v halves interleaved row by row, as flash-attn's modules pass it:
 * the halves share no element, so the append takes them, and each half gets its own rows. */
static void packed_cache(flashc_context_t ctx) {
    const size_t el = (size_t)B * CAP * 2 * HKV * D;
    float *kv = calloc(el, 4), *kn = malloc((size_t)B * HKV * D * 4), *vn = malloc((size_t)B * HKV * D * 4);
    if (!kv || !kn || !vn) exit(2);
    for (size_t i = 0; i < (size_t)B * HKV * D; i++) kn[i] = (float)i + 0.5f, vn[i] = -(float)i - 0.5f;
    flashc_tensor kc = flashc_tensor_contiguous(kv, FLASHC_DTYPE_F32, B, CAP, HKV, D);
    kc.stride[1] = 2 * HKV * D;
    kc.stride[0] = (int64_t)CAP * 2 * HKV * D;
    flashc_tensor vc = kc;
    vc.data = kv + HKV * D;
    const flashc_tensor tkn = flashc_tensor_contiguous(kn, FLASHC_DTYPE_F32, B, 1, HKV, D),
                        tvn = flashc_tensor_contiguous(vn, FLASHC_DTYPE_F32, B, 1, HKV, D);
    const flashc_status st = flashc_kvcache_append(ctx, &kc, &vc, &tkn, &tvn, filled);
    int ok = st == FLASHC_STATUS_OK;
    for (int b = 0; b < B && ok; b++)
        for (int j = 0; j < HKV * D; j++) {
            const float *row = kv + ((size_t)b * CAP + filled[b]) * 2 * HKV * D;
            ok &= row[j] == kn[(size_t)b * HKV * D + j] && row[HKV * D + j] == vn[(size_t)b * HKV * D + j];
        }
    check("a packed cache's interleaved k and v halves take the append", ok);
    flashc_tensor shifted = vc; /* half a head further: now the halves share elements */
    shifted.data = kv + HKV * D / 2;
    check("  ... but halves that share elements are refused",
          flashc_kvcache_append(ctx, &kc, &shifted, &tkn, &tvn, filled) == FLASHC_STATUS_INVALID_ARGUMENT);
    free(kv), free(kn), free(vn);
}

static void refusals(flashc_context_t ctx) {
    float *buf = calloc((size_t)B * CAP * HKV * D * 3, 4);
    if (!buf) exit(2);
    const int32_t lens[B] = {0, 0, 0};
    const flashc_tensor kc = flashc_tensor_contiguous(buf, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        vc = flashc_tensor_contiguous(buf + (size_t)B * CAP * HKV * D, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        kn = flashc_tensor_contiguous(buf + (size_t)2 * B * CAP * HKV * D, FLASHC_DTYPE_F32, B, 1, HKV, D);
    flashc_tensor bad = kn;
    check("the caches may not overlap (v_cache = k_cache)",
          flashc_kvcache_append(ctx, &kc, &kc, &kn, &kn, lens) == FLASHC_STATUS_INVALID_ARGUMENT);
    check("the new rows may not lie in a cache",
          flashc_kvcache_append(ctx, &kc, &vc, &vc, &vc, lens) == FLASHC_STATUS_INVALID_ARGUMENT);
    bad.shape[2] = HKV + 1;
    check("new rows of another head count are refused",
          flashc_kvcache_append(ctx, &kc, &vc, &bad, &bad, lens) == FLASHC_STATUS_INVALID_ARGUMENT);
    bad = kn;
    bad.dtype = FLASHC_DTYPE_BF16;
    check("new rows of another dtype are refused",
          flashc_kvcache_append(ctx, &kc, &vc, &bad, &bad, lens) == FLASHC_STATUS_INVALID_ARGUMENT);
    check("NULL cache_seqlens is refused",
          flashc_kvcache_append(ctx, &kc, &vc, &kn, &kn, NULL) == FLASHC_STATUS_INVALID_ARGUMENT);
    const int32_t negative[B] = {0, -1, 0};
    check("a negative cache length is refused",
          flashc_kvcache_append(ctx, &kc, &vc, &kn, &kn, negative) == FLASHC_STATUS_INVALID_ARGUMENT);
    free(buf);
}

/* A paged twin of the contiguous cache: pages of PS rows from a pool of NP pages (the table's MP pages per sequence in
 * a shuffled order, the rest NaN). Appending and attending through it must give the contiguous cache's bits. */
enum { PS = 16, MP = CAP / PS, NP = B * MP + 3 };
static void paged(flashc_context_t ctx, int nnew) {
    uint64_t rng = 4242 + (uint64_t)nnew;
    const size_t row = (size_t)HKV * D, cache_el = (size_t)B * CAP * row, pool_el = (size_t)NP * PS * row;
    float *kc = malloc(cache_el * 4), *vc = malloc(cache_el * 4), *kp = malloc(pool_el * 4), *vp = malloc(pool_el * 4);
    float *kp0 = malloc(pool_el * 4), *kn = malloc((size_t)B * nnew * row * 4), *vn = malloc((size_t)B * nnew * row * 4);
    float *q = malloc((size_t)B * nnew * H * D * 4), *o1 = malloc((size_t)B * nnew * H * D * 4),
          *o2 = malloc((size_t)B * nnew * H * D * 4), lse1[B * H * 8], lse2[B * H * 8];
    if (!kc || !vc || !kp || !vp || !kp0 || !kn || !vn || !q || !o1 || !o2 || nnew > 8) exit(2);
    int32_t table[B * (MP + 1)], perm[NP];
    for (int i = 0; i < NP; i++) perm[i] = i;
    for (int i = NP - 1; i > 0; i--) {
        const int j = (int)(flashc_rand_u64(&rng) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int b = 0; b < B; b++) /* row stride MP + 1: one padding entry per row */
        for (int i = 0; i <= MP; i++) table[b * (MP + 1) + i] = i < MP ? perm[b * MP + i] : -3;
    for (size_t i = 0; i < pool_el; i++) kp[i] = vp[i] = NAN;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < CAP; j++)
            for (size_t e = 0; e < row; e++) {
                const size_t c = ((size_t)b * CAP + j) * row + e,
                             pidx = ((size_t)table[b * (MP + 1) + j / PS] * PS + j % PS) * row + e;
                kc[c] = j < filled[b] ? frand(&rng) : NAN;
                vc[c] = j < filled[b] ? frand(&rng) : NAN;
                kp[pidx] = kc[c], vp[pidx] = vc[c];
            }
    for (size_t i = 0; i < (size_t)B * nnew * row; i++) kn[i] = frand(&rng), vn[i] = frand(&rng);
    for (size_t i = 0; i < (size_t)B * nnew * H * D; i++) q[i] = frand(&rng);
    const flashc_tensor tkc = flashc_tensor_contiguous(kc, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        tvc = flashc_tensor_contiguous(vc, FLASHC_DTYPE_F32, B, CAP, HKV, D),
                        tkp = flashc_tensor_contiguous(kp, FLASHC_DTYPE_F32, NP, PS, HKV, D),
                        tvp = flashc_tensor_contiguous(vp, FLASHC_DTYPE_F32, NP, PS, HKV, D),
                        tkn = flashc_tensor_contiguous(kn, FLASHC_DTYPE_F32, B, nnew, HKV, D),
                        tvn = flashc_tensor_contiguous(vn, FLASHC_DTYPE_F32, B, nnew, HKV, D),
                        tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, B, nnew, H, D),
                        to1 = flashc_tensor_contiguous(o1, FLASHC_DTYPE_F32, B, nnew, H, D),
                        to2 = flashc_tensor_contiguous(o2, FLASHC_DTYPE_F32, B, nnew, H, D);
    char what[160];
    int ok = flashc_kvcache_append(ctx, &tkc, &tvc, &tkn, &tvn, filled) == FLASHC_STATUS_OK &&
             flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, filled, table, MP, MP + 1) == FLASHC_STATUS_OK;
    int same = 1, untouched = 1;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < CAP; j++)
            for (size_t e = 0; e < row; e++) {
                const size_t c = ((size_t)b * CAP + j) * row + e,
                             pidx = ((size_t)table[b * (MP + 1) + j / PS] * PS + j % PS) * row + e;
                same &= !memcmp(&kc[c], &kp[pidx], 4) && !memcmp(&vc[c], &vp[pidx], 4);
            }
    for (int pg = B * MP; pg < NP; pg++) /* pages the table does not name */
        for (size_t e = 0; e < (size_t)PS * row; e++) untouched &= isnan(kp[(size_t)perm[pg] * PS * row + e]);
    snprintf(what, sizeof what, "paged append of %d rows (pages of %d, shuffled): the contiguous cache's bits", nnew, PS);
    check(what, ok && same && untouched);

    int32_t used[B];
    for (int b = 0; b < B; b++) used[b] = filled[b] + nnew;
    flashc_params pc = flashc_params_default(), pp;
    pc.causal = 1;
    pc.seqused_k = used;
    pp = pc;
    pp.block_table = table;
    pp.block_table_max_pages = MP;
    pp.block_table_stride = MP + 1;
    ok = flashc_forward(ctx, &tq, &tkc, &tvc, &pc, &to1, lse1, NULL, 0) == FLASHC_STATUS_OK &&
         flashc_forward(ctx, &tq, &tkp, &tvp, &pp, &to2, lse2, NULL, 0) == FLASHC_STATUS_OK;
    snprintf(what, sizeof what, "  ... attention through the table: the contiguous cache's bits (Nq %d)", nnew);
    check(what, ok && !memcmp(o1, o2, (size_t)B * nnew * H * D * 4) && !memcmp(lse1, lse2, sizeof(float) * B * H * nnew));
    {
        /* The same in bf16: a kernel set's bf16 path may round differently from its fp32 one (the avx512bf16 set's
         * decode kernels take products and P in bf16), so the steps that cross pages must take it too. */
        const size_t qel = (size_t)B * nnew * H * D;
        uint16_t *kc16 = malloc(cache_el * 2), *vc16 = malloc(cache_el * 2), *kp16 = malloc(pool_el * 2),
                 *vp16 = malloc(pool_el * 2), *q16 = malloc(qel * 2), *o116 = malloc(qel * 2), *o216 = malloc(qel * 2);
        if (!kc16 || !vc16 || !kp16 || !vp16 || !q16 || !o116 || !o216) exit(2);
        for (size_t i = 0; i < cache_el; i++) kc16[i] = flashc_f32_to_bf16(kc[i]), vc16[i] = flashc_f32_to_bf16(vc[i]);
        for (size_t i = 0; i < pool_el; i++) kp16[i] = flashc_f32_to_bf16(kp[i]), vp16[i] = flashc_f32_to_bf16(vp[i]);
        for (size_t i = 0; i < qel; i++) q16[i] = flashc_f32_to_bf16(q[i]);
        const flashc_tensor bkc = flashc_tensor_contiguous(kc16, FLASHC_DTYPE_BF16, B, CAP, HKV, D),
                            bvc = flashc_tensor_contiguous(vc16, FLASHC_DTYPE_BF16, B, CAP, HKV, D),
                            bkp = flashc_tensor_contiguous(kp16, FLASHC_DTYPE_BF16, NP, PS, HKV, D),
                            bvp = flashc_tensor_contiguous(vp16, FLASHC_DTYPE_BF16, NP, PS, HKV, D),
                            bq = flashc_tensor_contiguous(q16, FLASHC_DTYPE_BF16, B, nnew, H, D),
                            bo1 = flashc_tensor_contiguous(o116, FLASHC_DTYPE_BF16, B, nnew, H, D),
                            bo2 = flashc_tensor_contiguous(o216, FLASHC_DTYPE_BF16, B, nnew, H, D);
        ok = flashc_forward(ctx, &bq, &bkc, &bvc, &pc, &bo1, lse1, NULL, 0) == FLASHC_STATUS_OK &&
             flashc_forward(ctx, &bq, &bkp, &bvp, &pp, &bo2, lse2, NULL, 0) == FLASHC_STATUS_OK;
        const char *kn16 = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &bq, &bkp, &bvp, &pp);
        snprintf(what, sizeof what, "  ... and in bf16 (Nq %d, %s)", nnew, kn16 ? kn16 : "?");
        check(what, ok && !memcmp(o116, o216, qel * 2) && !memcmp(lse1, lse2, sizeof(float) * B * H * nnew));
        free(kc16), free(vc16), free(kp16), free(vp16), free(q16), free(o116), free(o216);
    }

    /* refusals: nothing written */
    memcpy(kp0, kp, pool_el * 4);
    memset(o2, 0x7f, (size_t)B * nnew * H * D * 4);
    const float o2_first = o2[0];
    flashc_params bad = pp;
    table[1 * (MP + 1) + 1] = NP; /* sequence 1 uses 17 + nnew keys: pages 0 and 1 */
    flashc_status st = flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0);
    check("a page past the pool, where used keys lie: INVALID_ARGUMENT, out untouched",
          st == FLASHC_STATUS_INVALID_ARGUMENT && o2[0] == o2_first &&
              strstr(flashc_context_last_error(ctx), "block_table[1][1]") != NULL);
    table[1 * (MP + 1) + 1] = -1;
    check("  ... and -1 there", flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) ==
                                    FLASHC_STATUS_INVALID_ARGUMENT && o2[0] == o2_first);
    table[1 * (MP + 1) + 1] = perm[1 * MP + 1];
    table[1 * (MP + 1) + 3] = -1; /* past what sequence 1 uses: never read */
    check("  ... but -1 past the used keys' pages is fine",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_OK &&
              !memcmp(o1, o2, (size_t)B * nnew * H * D * 4));
    table[1 * (MP + 1) + 3] = perm[1 * MP + 3];
    memset(o2, 0x7f, (size_t)B * nnew * H * D * 4);
    int32_t too_long[B] = {0, CAP + 1, 3}, negative[B] = {0, -2, 3};
    bad.seqused_k = too_long;
    check("a length longer than the table (max_pages * page_size): INVALID_ARGUMENT",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_INVALID_ARGUMENT &&
              strstr(flashc_context_last_error(ctx), "too short") != NULL && o2[0] == o2_first);
    bad.seqused_k = negative;
    check("a negative length: INVALID_ARGUMENT",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_INVALID_ARGUMENT &&
              o2[0] == o2_first);
    bad = pp;
    bad.page_size = PS * 2;
    check("page_size other than k's shape[1]: INVALID_ARGUMENT",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_INVALID_ARGUMENT);
    bad = pp;
    bad.block_table_max_pages = 0;
    check("max_pages 0: INVALID_ARGUMENT",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_INVALID_ARGUMENT);
    bad = pp;
    bad.block_table_stride = MP - 1;
    check("a row stride shorter than a row: INVALID_ARGUMENT",
          flashc_forward(ctx, &tq, &tkp, &tvp, &bad, &to2, lse2, NULL, 0) == FLASHC_STATUS_INVALID_ARGUMENT);

    /* the backward refuses a page shared by two sequences (its dk rows would get two gradients) */
    {
        float *dq = malloc((size_t)B * nnew * H * D * 4), *dk = malloc(pool_el * 4), *dv = malloc(pool_el * 4);
        if (!dq || !dk || !dv) exit(2);
        const flashc_tensor tdq = flashc_tensor_contiguous(dq, FLASHC_DTYPE_F32, B, nnew, H, D),
                            tdk = flashc_tensor_contiguous(dk, FLASHC_DTYPE_F32, NP, PS, HKV, D),
                            tdv = flashc_tensor_contiguous(dv, FLASHC_DTYPE_F32, NP, PS, HKV, D);
        ok = flashc_forward(ctx, &tq, &tkp, &tvp, &pp, &to2, lse2, NULL, 0) == FLASHC_STATUS_OK &&
             flashc_backward(ctx, &tq, &tkp, &tvp, &to2, &to1, lse2, &pp, &tdq, &tdk, &tdv, NULL, 0) ==
                 FLASHC_STATUS_OK;
        const int32_t keep = table[2 * (MP + 1)];
        table[2 * (MP + 1)] = table[1 * (MP + 1)]; /* sequences 1 and 2 share their first page (a prefix) */
        memset(dk, 0x7f, pool_el * 4);
        st = flashc_backward(ctx, &tq, &tkp, &tvp, &to2, &to1, lse2, &pp, &tdq, &tdk, &tdv, NULL, 0);
        check("paged backward runs; a page shared by two sequences: NOT_SUPPORTED, dk untouched",
              ok && st == FLASHC_STATUS_NOT_SUPPORTED && dk[0] == dk[pool_el - 1]);
        check("  ... while the forward reads a shared page",
              flashc_forward(ctx, &tq, &tkp, &tvp, &pp, &to2, lse2, NULL, 0) == FLASHC_STATUS_OK);
        table[2 * (MP + 1)] = keep;
        free(dq), free(dk), free(dv);
    }

    /* append refusals */
    const int32_t past[B] = {0, CAP - nnew + 1, 0}, neg[B] = {0, -1, 0};
    check("paged append past the table's rows: INVALID_ARGUMENT, nothing written",
          flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, past, table, MP, MP + 1) ==
                  FLASHC_STATUS_INVALID_ARGUMENT && !memcmp(kp, kp0, pool_el * 4));
    check("paged append at a negative length: INVALID_ARGUMENT",
          flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, neg, table, MP, MP + 1) ==
              FLASHC_STATUS_INVALID_ARGUMENT);
    table[2 * (MP + 1) + filled[2] / PS] = NP + 5;
    check("paged append onto a page past the pool: INVALID_ARGUMENT, nothing written",
          flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, filled, table, MP, MP + 1) ==
                  FLASHC_STATUS_INVALID_ARGUMENT && !memcmp(kp, kp0, pool_el * 4));
    const int32_t lens2[B] = {3, 3, 3};
    table[2 * (MP + 1)] = table[1 * (MP + 1)]; /* two sequences append to one page at the same rows */
    check("two sequences appending to one row: INVALID_ARGUMENT, nothing written",
          flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, lens2, table, MP, MP + 1) ==
                  FLASHC_STATUS_INVALID_ARGUMENT && !memcmp(kp, kp0, pool_el * 4));
    check("paged append with a NULL table: INVALID_ARGUMENT",
          flashc_kvcache_append_paged(ctx, &tkp, &tvp, &tkn, &tvn, filled, NULL, MP, 0) ==
              FLASHC_STATUS_INVALID_ARGUMENT);
    free(kc), free(vc), free(kp), free(vp), free(kp0), free(kn), free(vn), free(q), free(o1), free(o2);
}

/* Decode against a long cache (keys split into pieces merged by lse) gives the same bits at any thread count and
 * from run to run: the split and every summation order come from the shape alone. */
static void decode_threads(void) {
    enum { NK = 5000, USED = 4999, DH = 8, DKV = 2, DD = 64 };
    uint64_t rng = 77;
    const size_t kv_el = (size_t)NK * DKV * DD;
    float *k = malloc(kv_el * 4), *v = malloc(kv_el * 4), *q = malloc(DH * DD * 4), *out = malloc(DH * DD * 4),
          *out1 = malloc(DH * DD * 4), lse[DH], lse1[DH], sinks[DH];
    if (!k || !v || !q || !out || !out1) exit(2);
    for (size_t i = 0; i < kv_el; i++) k[i] = frand(&rng), v[i] = frand(&rng);
    for (int i = 0; i < DH * DD; i++) q[i] = 3.0f * frand(&rng);
    for (int h = 0; h < DH; h++) sinks[h] = frand(&rng);
    const int32_t used = USED;
    const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, 1, 1, DH, DD),
                        tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_F32, 1, NK, DKV, DD),
                        tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_F32, 1, NK, DKV, DD),
                        to = flashc_tensor_contiguous(out, FLASHC_DTYPE_F32, 1, 1, DH, DD);
    flashc_params prm = flashc_params_default();
    prm.causal = 1;
    prm.seqused_k = &used;
    prm.sinks = sinks;
    static const int threads[] = {1, 2, 3, 7, 2};
    int same = 1, ran = 1;
    const char *kernel = NULL;
    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
        flashc_context_t ctx;
        if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) exit(2);
        flashc_context_set_threads(ctx, threads[t]);
        if (!kernel) kernel = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &tq, &tk, &tv, &prm);
        ran &= flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, lse, NULL, 0) == FLASHC_STATUS_OK;
        if (t == 0) {
            memcpy(out1, out, DH * DD * 4);
            memcpy(lse1, lse, sizeof lse);
        } else {
            same &= memcmp(out1, out, DH * DD * 4) == 0 && memcmp(lse1, lse, sizeof lse) == 0;
        }
        flashc_context_destroy(ctx);
    }
    check("decode of 5000 keys runs on the CPU decode path", kernel && strncmp(kernel, "CPU decode", 10) == 0);
    check("  ... and gives the same bits at 1, 2, 3, 7 threads and again at 2", ran && same);
    free(k), free(v), free(q), free(out), free(out1);
}

int main(void) {
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) return 2;
    step(ctx, 1, 1, -1, "decode, causal");
    step(ctx, 5, 1, -1, "prefill chunk of 5, causal");
    step(ctx, 5, 1, 8, "prefill chunk of 5, window (8, 0)");
    step(ctx, 1, 0, -1, "decode, not causal");
    packed_cache(ctx);
    refusals(ctx);
    paged(ctx, 1);
    paged(ctx, 5);
    decode_threads();
    flashc_context_destroy(ctx);
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed != 0;
}
