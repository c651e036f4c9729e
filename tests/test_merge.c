/*
 * test_merge: flashc_merge (two partial attention results into one) on the CPU backend.
 *
 * 1. Against an fp64 merge of the same stored inputs, in f32, f16 and bf16 and four layouts, with every kind of row
 *    (one part empty by lse +inf or -inf, both empty, one dominating, a NaN lse), lse = NULL and in place
 *    (tests/merge_common.h, which gpu_merge.cu runs on the CUDA backend), then a merge large enough for threads.
 * 2. Against flashc's own forward on all keys, the keys split in two (merge_common.h): non-causal, causal with
 *    Nq = Nk (the second half's first rows see no key: the first half's rows come out bit for bit), decode-like
 *    shapes, and causal with Nq > Nk (rows no key reaches: out 0, lse +inf).
 * 3. Refusals: mismatched shapes and dtypes, NULL lse inputs, outputs that overlap inputs without being their very
 *    view, or each other: INVALID_ARGUMENT with a message, and nothing written.
 */
#include "merge_common.h"

/* ---- 3. refusals -------------------------------------------------------------------------------------------- */

static void refusals(flashc_context_t ctx) {
    enum { B = 1, N = 8, H = 2, D = 16, EL = B * N * H * D, ROWS = B * H * N };
    float *buf = calloc(3 * EL + 3 * ROWS + 512, 4);
    if (!buf) exit(2);
    float *a = buf, *b = buf + EL, *o = buf + 2 * EL, *la = buf + 3 * EL, *lb = la + ROWS, *lo = lb + ROWS;
    for (int i = 0; i < 2 * EL; i++) buf[i] = (float)i;
    const flashc_tensor ta = flashc_tensor_contiguous(a, FLASHC_DTYPE_F32, B, N, H, D),
                        tb = flashc_tensor_contiguous(b, FLASHC_DTYPE_F32, B, N, H, D),
                        to = flashc_tensor_contiguous(o, FLASHC_DTYPE_F32, B, N, H, D);
    struct {
        const char *what;
        flashc_tensor out;
        const float *la, *lb;
        float *lse;
        int shape_b; /* out_b with another shape */
        int dtype_b; /* out_b with another dtype */
    } cases[] = {
        {"out_b of another shape", to, la, lb, lo, 1, 0},
        {"out_b of another dtype", to, la, lb, lo, 0, 1},
        {"lse_a NULL", to, NULL, lb, lo, 0, 0},
        {"lse_b NULL", to, la, NULL, lo, 0, 0},
        {"out shifted one element into out_a", to, la, lb, lo, 0, 0},
        {"out = out_a's data with other strides", to, la, lb, lo, 0, 0},
        {"out overlapping lse_b and lse", to, la, lb, lo, 0, 0},
        {"lse overlapping lse_a shifted by one", to, la, lb, la + 1, 0, 0},
        {"lse overlapping out", to, la, lb, o + 3, 0, 0},
        {"lse overlapping out_b", to, la, lb, b, 0, 0},
        {"out broadcast (a zero stride)", to, la, lb, lo, 0, 0},
        {"lse_b not 4-byte aligned", to, la, (const float *)((const char *)lb + 2), lo, 0, 0},
        {"out not aligned to its elements", to, la, lb, lo, 0, 0},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    cases[4].out.data = a + 1;
    cases[5].out.data = a, cases[5].out.stride[1] = D, cases[5].out.stride[2] = N * D; /* (B, H, N, D) over out_a */
    cases[6].out.data = lb;
    cases[10].out.stride[1] = 0;
    cases[12].out.data = (char *)o + 2;
    for (int c = 0; c < n; c++) {
        memset(o, 0xff, EL * 4);
        memset(lo, 0xff, ROWS * 4);
        float la0[ROWS], lb0[ROWS];
        for (int i = 0; i < ROWS; i++) la[i] = lb[i] = (float)i, la0[i] = lb0[i] = (float)i;
        float a0[EL], b0[EL];
        memcpy(a0, a, sizeof a0);
        memcpy(b0, b, sizeof b0);
        flashc_tensor tb2 = tb;
        if (cases[c].shape_b) tb2.shape[1] = N - 1;
        if (cases[c].dtype_b) tb2.dtype = FLASHC_DTYPE_BF16;
        const flashc_status st = flashc_merge(ctx, &ta, cases[c].la, &tb2, cases[c].lb, &cases[c].out, cases[c].lse);
        int untouched = memcmp(a, a0, sizeof a0) == 0 && memcmp(b, b0, sizeof b0) == 0 &&
                        memcmp(la, la0, sizeof la0) == 0 && memcmp(lb, lb0, sizeof lb0) == 0;
        for (int i = 0; i < EL; i++) untouched &= fbits(o[i]) == 0xffffffffu;
        for (int i = 0; i < ROWS; i++) untouched &= fbits(lo[i]) == 0xffffffffu;
        const char *msg = flashc_context_last_error(ctx);
        char what[300];
        snprintf(what, sizeof what, "refused, nothing written: %s (%s)", cases[c].what, msg);
        check(what, st == FLASHC_STATUS_INVALID_ARGUMENT && msg[0] && untouched);
    }
    check("NULL ctx is refused", flashc_merge(NULL, &ta, la, &tb, lb, &to, lo) == FLASHC_STATUS_INVALID_ARGUMENT);
    check("NULL out is refused", flashc_merge(ctx, &ta, la, &tb, lb, NULL, lo) == FLASHC_STATUS_INVALID_ARGUMENT);
    /* allowed: out_a and out_b the same view (inputs may overlap), out a third buffer */
    check("out_a = out_b (inputs may overlap) is taken",
          flashc_merge(ctx, &ta, la, &ta, la, &to, lo) == FLASHC_STATUS_OK &&
              fabsf(lo[1] - (1.0f + logf(2.0f))) < 1e-6f && o[5] == a[5]);
    free(buf);
}

int main(void) {
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) return 2;
    const flashc_case_memory *mem = &merge_host_memory;
    static const flashc_dtype dtypes[3] = {FLASHC_DTYPE_F32, FLASHC_DTYPE_F16, FLASHC_DTYPE_BF16};
    for (int ti = 0; ti < 3; ti++)
        for (int layout = 0; layout < LAYOUTS; layout++) merge_against_fp64(ctx, mem, dtypes[ti], layout, 2, 29, 3, 40);
    merge_against_fp64(ctx, mem, FLASHC_DTYPE_BF16, LAYOUT_BNHD, 1, 1, 1, 1);
    merge_against_fp64(ctx, mem, FLASHC_DTYPE_BF16, LAYOUT_BNHD, 1, 7, 32, 128); /* (total, H, D) of varlen */
    for (int ti = 0; ti < 3; ti++) {
        const flashc_dtype t = dtypes[ti];
        merge_against_forward(ctx, mem, t, 2, 96, 96, 4, 2, 64, 1, 40); /* the second half's first 40 rows see no key */
        merge_against_forward(ctx, mem, t, 2, 33, 150, 4, 2, 64, 0, 57);
        merge_against_forward(ctx, mem, t, 3, 1, 300, 8, 2, 64, 1, 100); /* decode, GQA */
        merge_against_forward(ctx, mem, t, 2, 40, 24, 4, 2, 64, 1, 10);  /* the first 16 rows see no key at all */
    }
    /* the threaded path: a merge of 4 x 64 x 8 rows of 128 */
    flashc_context_set_threads(ctx, 4);
    merge_against_fp64(ctx, mem, FLASHC_DTYPE_F32, LAYOUT_BHND, 4, 64, 8, 128);
    refusals(ctx);
    flashc_context_destroy(ctx);
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed != 0;
}
