/*
 * test_params: flashc_params as bindings see it (flashc_params_field and flashc_params_size agree with the
 * compiler's layout) and as it grows (struct_size: a newer caller's larger struct is read when it sets nothing
 * new, refused when it does).
 */
#include "flashc.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_checks, g_failed;

static void check(const char *what, int cond) {
    g_checks++;
    g_failed += !cond;
    printf("%-66s %s\n", what, cond ? "PASS" : "FAIL");
}

/* What the compiler says of each field; the library's table must say the same, in this order. */
#define FIELD(f, type) {#f, offsetof(flashc_params, f), sizeof(((flashc_params *)0)->f), type}
static const struct {
    const char *name;
    size_t offset, size;
    char type;
} expected[] = {
    FIELD(struct_size, 'I'),      FIELD(softmax_scale, 'f'),    FIELD(causal, 'i'),
    FIELD(window_left, 'q'),      FIELD(window_right, 'q'),     FIELD(softcap, 'f'),
    FIELD(alibi_slopes, 'p'),     FIELD(alibi_batch_stride, 'q'), FIELD(block_mask, 'p'),
    FIELD(block_mask_q, 'q'),     FIELD(block_mask_k, 'q'),     FIELD(block_mask_batch, 'q'),
    FIELD(block_mask_heads, 'q'), FIELD(cu_seqlens_q, 'p'),     FIELD(cu_seqlens_k, 'p'),
    FIELD(num_seqs, 'q'),         FIELD(max_seqlen_q, 'q'),     FIELD(max_seqlen_k, 'q'),
    FIELD(dropout_p, 'f'),        FIELD(dropout_seed, 'Q'),     FIELD(dropout_offset, 'Q'),
    FIELD(deterministic, 'i'),    FIELD(seqused_k, 'p'),        FIELD(sinks, 'p'),
    FIELD(dsinks, 'p'),           FIELD(block_table, 'p'),      FIELD(block_table_max_pages, 'q'),
    FIELD(block_table_stride, 'q'), FIELD(page_size, 'q'),     FIELD(dropout_rng, 'p'),
    FIELD(positions, 'i'),        FIELD(q_position, 'q'),       FIELD(k_position, 'q'),
};
#define NFIELDS (sizeof expected / sizeof expected[0])

static void test_introspection(void) {
    check("flashc_params_size() == sizeof(flashc_params)", flashc_params_size() == sizeof(flashc_params));
    check("flashc_params_default() sets struct_size",
          flashc_params_default().struct_size == (uint32_t)sizeof(flashc_params));
    size_t end = 0;
    int n = 0;
    for (int i = 0;; i++) {
        const char *name = NULL;
        size_t offset = 0, size = 0;
        char type = 0, what[96];
        if (!flashc_params_field(i, &name, &offset, &size, &type)) break;
        n++;
        if ((size_t)i >= NFIELDS) {
            snprintf(what, sizeof what, "field %d (%s) is one the test does not know", i, name);
            check(what, 0);
            continue;
        }
        snprintf(what, sizeof what, "field %d: %s at offset %zu, %zu bytes, type '%c'", i, expected[i].name,
                 expected[i].offset, expected[i].size, expected[i].type);
        check(what, name && !strcmp(name, expected[i].name) && offset == expected[i].offset &&
                        size == expected[i].size && type == expected[i].type);
        if (offset < end) check("  ... fields come in order and do not overlap", 0);
        end = offset + size;
    }
    check("the library lists every field", n == (int)NFIELDS);
    check("the fields end within the struct", end <= sizeof(flashc_params));
    const char *name = "untouched";
    check("index -1 and past the end: 0, outputs untouched",
          !flashc_params_field(-1, &name, NULL, NULL, NULL) && !flashc_params_field(n, &name, NULL, NULL, NULL) &&
              !strcmp(name, "untouched"));
    check("NULL outputs are allowed", flashc_params_field(0, NULL, NULL, NULL, NULL) == 1);
}

/* A caller built against a newer flashc.h: its struct is ours followed by fields this library lacks. */
typedef struct newer_params {
    flashc_params known;
    int64_t later[4];
} newer_params;

enum { B = 1, N = 24, H = 2, D = 16 };
#define EL ((size_t)B * N * H * D)

static void test_growth(void) {
    float *q = malloc(EL * sizeof(float)), *out = malloc(EL * sizeof(float)), *want = malloc(EL * sizeof(float));
    float lse[B * H * N];
    if (!q || !out || !want) exit(1);
    for (size_t i = 0; i < EL; i++) q[i] = (float)((i * 7919) % 23) / 23.0f - 0.5f;
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) exit(1);
    const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, B, N, H, D);
    const flashc_tensor to = flashc_tensor_contiguous(out, FLASHC_DTYPE_F32, B, N, H, D);
    flashc_params prm = flashc_params_default();
    prm.causal = 1;
    prm.softcap = 3.0f;
    check("this layout: forward runs",
          flashc_forward(ctx, &tq, &tq, &tq, &prm, &to, lse, NULL, 0) == FLASHC_STATUS_OK);
    memcpy(want, out, EL * sizeof(float));

    newer_params np;
    memset(&np, 0, sizeof np);
    np.known = prm;
    np.known.struct_size = (uint32_t)sizeof np;
    memset(out, 0, EL * sizeof(float));
    check("a newer layout that sets no newer field: forward runs",
          flashc_forward(ctx, &tq, &tq, &tq, &np.known, &to, lse, NULL, 0) == FLASHC_STATUS_OK);
    check("  ... and reads the fields this library knows", !memcmp(out, want, EL * sizeof(float)));

    /* A caller built against 0.2's flashc.h: its struct ends before seqused_k; whatever lies past it is not its. */
    flashc_params old = prm;
    old.struct_size = (uint32_t)offsetof(flashc_params, seqused_k);
    old.seqused_k = (const int32_t *)(uintptr_t)1; /* garbage a 0.2 caller never wrote */
    old.sinks = (const float *)(uintptr_t)1;
    memset(out, 0, EL * sizeof(float));
    check("the 0.2 layout: forward runs, the 0.3 fields at their defaults",
          flashc_forward(ctx, &tq, &tq, &tq, &old, &to, lse, NULL, 0) == FLASHC_STATUS_OK &&
              !memcmp(out, want, EL * sizeof(float)));

    /* A caller built against 0.3's flashc.h: its struct ends after dsinks (padded to the struct's alignment). */
    flashc_params old3 = prm;
    old3.struct_size = (uint32_t)((offsetof(flashc_params, dsinks) + sizeof(float *) + _Alignof(flashc_params) - 1) /
                                  _Alignof(flashc_params) * _Alignof(flashc_params));
    old3.block_table = (const int32_t *)(uintptr_t)1; /* garbage a 0.3 caller never wrote */
    old3.block_table_max_pages = -5;
    memset(out, 0, EL * sizeof(float));
    check("the 0.3 layout: forward runs, the 0.4 fields (block table) at their defaults",
          flashc_forward(ctx, &tq, &tq, &tq, &old3, &to, lse, NULL, 0) == FLASHC_STATUS_OK &&
              !memcmp(out, want, EL * sizeof(float)));

    /* A caller built against 0.4's flashc.h: its struct ends after page_size (8-aligned: no padding). */
    flashc_params old4 = prm;
    old4.struct_size = (uint32_t)(offsetof(flashc_params, page_size) + sizeof(int64_t));
    old4.dropout_p = 0.5f;
    old4.dropout_rng = (const uint64_t *)(uintptr_t)1; /* garbage a 0.4 caller never wrote: must not be read */
    memset(out, 0, EL * sizeof(float));
    flashc_params want4 = prm;
    want4.dropout_p = 0.5f;
    float *want4_out = malloc(EL * sizeof(float)), *outv = malloc(EL * sizeof(float));
    check("the 0.4 layout: forward runs, dropout_rng at its default (the values used)",
          flashc_forward(ctx, &tq, &tq, &tq, &want4, &to, lse, NULL, 0) == FLASHC_STATUS_OK &&
              (memcpy(want4_out, out, EL * sizeof(float)), memset(out, 0, EL * sizeof(float)),
               flashc_forward(ctx, &tq, &tq, &tq, &old4, &to, lse, NULL, 0) == FLASHC_STATUS_OK) &&
              !memcmp(out, want4_out, EL * sizeof(float)));

    /* A caller built against 0.5's flashc.h: its struct ends after dropout_rng (8-aligned: no padding). */
    flashc_params old5 = prm;
    old5.struct_size = (uint32_t)(offsetof(flashc_params, dropout_rng) + sizeof(const uint64_t *));
    old5.positions = 1; /* garbage a 0.5 caller never wrote: must not be read */
    old5.q_position = INT64_MAX;
    old5.k_position = -3;
    memset(out, 0, EL * sizeof(float));
    check("the 0.5 layout: forward runs, the 0.6 fields (positions) at their defaults",
          flashc_forward(ctx, &tq, &tq, &tq, &old5, &to, lse, NULL, 0) == FLASHC_STATUS_OK &&
              !memcmp(out, want, EL * sizeof(float)));

    /* dropout_rng given: the pair it points at replaces dropout_seed and dropout_offset. */
    const uint64_t rng[2] = {0x1234567890abcdefull, 77};
    flashc_params byval = prm, byptr = prm;
    byval.dropout_p = byptr.dropout_p = 0.3f;
    byval.dropout_seed = rng[0];
    byval.dropout_offset = rng[1];
    byptr.dropout_seed = 5; /* ignored */
    byptr.dropout_rng = rng;
    check("dropout_rng: the same output as the pair passed by value",
          flashc_forward(ctx, &tq, &tq, &tq, &byval, &to, lse, NULL, 0) == FLASHC_STATUS_OK &&
              (memcpy(outv, out, EL * sizeof(float)), memset(out, 0, EL * sizeof(float)),
               flashc_forward(ctx, &tq, &tq, &tq, &byptr, &to, lse, NULL, 0) == FLASHC_STATUS_OK) &&
              !memcmp(out, outv, EL * sizeof(float)) && memcmp(out, want, EL * sizeof(float)));
    free(want4_out);
    free(outv);

    np.later[2] = 1;
    memset(out, 0x7f, EL * sizeof(float));
    const flashc_status st = flashc_forward(ctx, &tq, &tq, &tq, &np.known, &to, lse, NULL, 0);
    const char *msg = flashc_context_last_error(ctx);
    check("a newer layout that sets a newer field: INVALID_ARGUMENT", st == FLASHC_STATUS_INVALID_ARGUMENT);
    check("  ... the message says what to do",
          strstr(msg, "flashc_params_default()") != NULL && strstr(msg, "does not know") != NULL);
    int untouched = 1;
    for (size_t i = 0; i < EL; i++) untouched &= out[i] != 0.0f && out[i] == out[0];
    check("  ... and out is untouched", untouched);
    flashc_context_destroy(ctx);
    free(q);
    free(out);
    free(want);
}

int main(void) {
    test_introspection();
    test_growth();
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed != 0;
}
