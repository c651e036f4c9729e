/*
 * test_misuse: wrong calls must come back with the right status and a "file:line: why" message, must not
 * touch the outputs, and must never crash. One line per check.
 */
#include "ref/testkit.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_checks, g_failed;

/* "something.c:123: text" or "something.cu:45: text" somewhere in msg */
static int has_file_line(const char *msg) {
    for (const char *p = strstr(msg, ".c"); p; p = strstr(p + 1, ".c")) {
        const char *s = p + 2;
        if (*s == 'u') s++;
        if (*s != ':' || !isdigit((unsigned char)s[1])) continue;
        s++;
        while (isdigit((unsigned char)*s)) s++;
        if (*s == ':' && s[1] == ' ' && s[2]) return 1;
    }
    return 0;
}

static void expect(const char *what, flashc_status got, flashc_status want, flashc_context_t ctx) {
    const char *msg = flashc_context_last_error(ctx);
    int ok = got == want && (want == FLASHC_STATUS_OK ? msg[0] == '\0' : has_file_line(msg));
    g_checks++;
    g_failed += !ok;
    printf("%-58s %-32s %s\n", what, flashc_status_string(got), ok ? "PASS" : "FAIL");
    if (!ok) printf("    expected %s; message: \"%s\"\n", flashc_status_string(want), msg);
}

static void check_true(const char *what, int cond) {
    g_checks++;
    g_failed += !cond;
    printf("%-58s %-32s %s\n", what, "", cond ? "PASS" : "FAIL");
}

/* A valid problem; every check starts from a copy and breaks one thing. */
enum { B = 2, NQ = 16, NK = 24, H = 4, HKV = 2, D = 32 };
#define QEL ((size_t)B * NQ * H * D)
#define KEL ((size_t)B * NK * HKV * D)

typedef struct fixture {
    flashc_tensor q, k, v, out, dout, dq, dk, dv;
    float *lse;
    flashc_params prm;
} fixture;

static float *g_out_mem;

static int out_untouched(void) {
    for (size_t i = 0; i < QEL; i++) {
        uint32_t bits;
        memcpy(&bits, &g_out_mem[i], 4);
        if (bits != 0xffffffffu) return 0;
    }
    return 1;
}

static flashc_status fwd(flashc_context_t ctx, const fixture *f) {
    memset(g_out_mem, 0xff, QEL * sizeof(float));
    return flashc_forward(ctx, &f->q, &f->k, &f->v, &f->prm, &f->out, f->lse, NULL, 0);
}

static flashc_status bwd(flashc_context_t ctx, const fixture *f) {
    return flashc_backward(ctx, &f->q, &f->k, &f->v, &f->out, &f->dout, f->lse, &f->prm, &f->dq, &f->dk, &f->dv,
                           NULL, 0);
}

/* a forward that must fail with want and leave out alone */
static void expect_fwd(const char *what, flashc_context_t ctx, const fixture *f, flashc_status want) {
    flashc_status st = fwd(ctx, f);
    expect(what, st, want, ctx);
    if (st != FLASHC_STATUS_OK && !out_untouched()) {
        g_failed++;
        printf("    the failed call wrote into out\n");
    }
}

int main(void) {
    /* generous buffers: some checks enlarge shapes, and validation must fail before any data is touched */
    const size_t cap = 1u << 20;
    float *mem[9];
    for (int i = 0; i < 9; i++) {
        mem[i] = calloc(cap, sizeof(float));
        if (!mem[i]) return 1;
    }
    for (size_t i = 0; i < QEL; i++) mem[0][i] = (float)((i * 7919) % 17) / 17.0f - 0.5f;
    for (size_t i = 0; i < KEL; i++) {
        mem[1][i] = (float)((i * 104729) % 13) / 13.0f - 0.5f;
        mem[2][i] = (float)((i * 15485863) % 11) / 11.0f - 0.5f;
    }
    for (size_t i = 0; i < QEL; i++) mem[4][i] = (float)((i * 31) % 19) / 19.0f - 0.5f;
    g_out_mem = mem[3];

    fixture base;
    base.q = flashc_tensor_contiguous(mem[0], FLASHC_DTYPE_F32, B, NQ, H, D);
    base.k = flashc_tensor_contiguous(mem[1], FLASHC_DTYPE_F32, B, NK, HKV, D);
    base.v = flashc_tensor_contiguous(mem[2], FLASHC_DTYPE_F32, B, NK, HKV, D);
    base.out = flashc_tensor_contiguous(mem[3], FLASHC_DTYPE_F32, B, NQ, H, D);
    base.dout = flashc_tensor_contiguous(mem[4], FLASHC_DTYPE_F32, B, NQ, H, D);
    base.dq = flashc_tensor_contiguous(mem[5], FLASHC_DTYPE_F32, B, NQ, H, D);
    base.dk = flashc_tensor_contiguous(mem[6], FLASHC_DTYPE_F32, B, NK, HKV, D);
    base.dv = flashc_tensor_contiguous(mem[7], FLASHC_DTYPE_F32, B, NK, HKV, D);
    base.lse = mem[8];
    base.prm = flashc_params_default();
    fixture f;

    /* ---- contexts ---- */
    flashc_context_t ctx = NULL, bad = (flashc_context_t)0x1;
    expect("context_create: ctx pointer NULL", flashc_context_create(NULL, FLASHC_BACKEND_CPU, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    expect("context_create: unknown backend 99", flashc_context_create(&bad, (flashc_backend)99, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    check_true("context_create failure leaves *ctx NULL", bad == NULL);
    expect("context_create: cpu device 1", flashc_context_create(&bad, FLASHC_BACKEND_CPU, 1),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    expect("context_create: device -1", flashc_context_create(&bad, FLASHC_BACKEND_CPU, -1),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    if (!flashc_backend_compiled(FLASHC_BACKEND_CUDA))
        expect("context_create: cuda in a build without it", flashc_context_create(&bad, FLASHC_BACKEND_CUDA, 0),
               FLASHC_STATUS_NOT_SUPPORTED, NULL);
    else if (flashc_device_count(FLASHC_BACKEND_CUDA) > 0)
        check_true("context_create: cuda device 1000 fails",
                   flashc_context_create(&bad, FLASHC_BACKEND_CUDA, 1000) != FLASHC_STATUS_OK && bad == NULL);
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        printf("cannot create a CPU context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    expect("set_stream: non-NULL stream on cpu", flashc_context_set_stream(ctx, (void *)&f), FLASHC_STATUS_NOT_SUPPORTED,
           ctx);
    check_true("set_stream: NULL stream on cpu is OK", flashc_context_set_stream(ctx, NULL) == FLASHC_STATUS_OK);
    expect("set_stream: NULL ctx", flashc_context_set_stream(NULL, NULL), FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    expect("set_threads: -1", flashc_context_set_threads(ctx, -1), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("set_threads: NULL ctx", flashc_context_set_threads(NULL, 2), FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    char name[64];
    expect("device_name: NULL buffer", flashc_device_name(FLASHC_BACKEND_CPU, 0, NULL, 10),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    expect("device_name: cpu device 3", flashc_device_name(FLASHC_BACKEND_CPU, 3, name, sizeof name),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);

    /* ---- the valid problem works, and clears the error ---- */
    f = base;
    expect("valid forward", fwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    expect("valid backward", bwd(ctx, &f), FLASHC_STATUS_OK, ctx);

    /* ---- NULL pointers ---- */
    memset(g_out_mem, 0xff, QEL * sizeof(float));
    expect("forward: NULL ctx",
           flashc_forward(NULL, &base.q, &base.k, &base.v, &base.prm, &base.out, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    check_true("forward: NULL ctx left out alone", out_untouched());
    expect("forward: NULL q", flashc_forward(ctx, NULL, &base.k, &base.v, &base.prm, &base.out, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("forward: NULL k", flashc_forward(ctx, &base.q, NULL, &base.v, &base.prm, &base.out, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("forward: NULL v", flashc_forward(ctx, &base.q, &base.k, NULL, &base.prm, &base.out, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("forward: NULL out", flashc_forward(ctx, &base.q, &base.k, &base.v, &base.prm, NULL, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("forward: NULL params", flashc_forward(ctx, &base.q, &base.k, &base.v, NULL, &base.out, base.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.q.data = NULL;
    expect_fwd("forward: q.data NULL", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.v.data = NULL;
    expect_fwd("forward: v.data NULL", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.out.data = NULL;
    expect("forward: out.data NULL", fwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    expect("backward: NULL softmax_lse",
           flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, &f.dout, NULL, &f.prm, &f.dq, &f.dk, &f.dv, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("backward: NULL dout",
           flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, NULL, f.lse, &f.prm, &f.dq, &f.dk, &f.dv, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("backward: NULL dv",
           flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, &f.dout, f.lse, &f.prm, &f.dq, &f.dk, NULL, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f.dk.data = NULL;
    expect("backward: dk.data NULL", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("backward: NULL ctx", bwd(NULL, &base), FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    size_t bytes = 0;
    expect("supported: NULL ctx", flashc_supported(NULL, FLASHC_OP_FORWARD, &base.q, &base.k, &base.v, &base.prm),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);
    expect("supported: unknown op 7", flashc_supported(ctx, (flashc_op)7, &base.q, &base.k, &base.v, &base.prm),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    check_true("kernel_name: NULL ctx gives NULL",
               flashc_kernel_name(NULL, FLASHC_OP_FORWARD, &base.q, &base.k, &base.v, &base.prm) == NULL);
    check_true("kernel_name: unknown op gives NULL",
               flashc_kernel_name(ctx, (flashc_op)7, &base.q, &base.k, &base.v, &base.prm) == NULL);
    check_true("kernel_name: a valid forward is named",
               flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &base.q, &base.k, &base.v, &base.prm) != NULL);
    expect("workspace_size: NULL bytes",
           flashc_forward_workspace_size(ctx, &base.q, &base.k, &base.v, &base.prm, NULL),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("workspace_size: NULL ctx",
           flashc_backward_workspace_size(NULL, &base.q, &base.k, &base.v, &base.prm, &bytes),
           FLASHC_STATUS_INVALID_ARGUMENT, NULL);

    /* ---- sizes ---- */
    f = base;
    f.q.shape[1] = 0;
    f.out.shape[1] = 0;
    expect_fwd("forward: Nq = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.k.shape[1] = f.v.shape[1] = -3;
    expect_fwd("forward: Nk = -3", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.q.shape[0] = f.k.shape[0] = f.v.shape[0] = f.out.shape[0] = -1;
    expect_fwd("forward: B = -1", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.q.shape[3] = f.k.shape[3] = f.v.shape[3] = f.out.shape[3] = 0;
    expect_fwd("forward: D = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.q.shape[3] = f.k.shape[3] = f.v.shape[3] = f.out.shape[3] = 257;
    expect_fwd("forward: D = 257", ctx, &f, FLASHC_STATUS_NOT_SUPPORTED);
    expect("supported: D = 257", flashc_supported(ctx, FLASHC_OP_FORWARD, &f.q, &f.k, &f.v, &f.prm),
           FLASHC_STATUS_NOT_SUPPORTED, ctx);
    f = base;
    f.q.shape[3] = f.k.shape[3] = f.v.shape[3] = f.out.shape[3] = 100000;
    expect_fwd("forward: D = 100000", ctx, &f, FLASHC_STATUS_NOT_SUPPORTED);
    f = base;
    f.q.shape[2] = f.out.shape[2] = 3; /* H 3, Hkv 2 */
    expect_fwd("forward: H % Hkv != 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.k.shape[2] = f.v.shape[2] = 8; /* Hkv 8 > H 4 */
    expect_fwd("forward: Hkv > H", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.k.shape[0] = f.v.shape[0] = 1;
    expect_fwd("forward: batch of k != batch of q", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.k.shape[3] = f.v.shape[3] = 16;
    expect_fwd("forward: head dim of k != head dim of q", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.v.shape[1] = NK - 1;
    expect_fwd("forward: Nk of k != Nk of v", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.v.shape[3] = 16;
    expect_fwd("forward: head dim of v != head dim of k", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.out.shape[1] = NQ - 1;
    expect("forward: out shape != q shape", fwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dq.shape[2] = 2;
    expect("backward: dq shape != q shape", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dk.shape[1] = NK + 1;
    expect("backward: dk shape != k shape", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dout.shape[0] = 1;
    expect("backward: dout shape != q shape", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);

    /* ---- dtypes ---- */
    f = base;
    f.k.dtype = FLASHC_DTYPE_F16;
    expect_fwd("forward: k f16 with q f32", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.v.dtype = FLASHC_DTYPE_BF16;
    expect_fwd("forward: v bf16 with q f32", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.out.dtype = FLASHC_DTYPE_BF16;
    expect("forward: out bf16 with q f32", fwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.q.dtype = f.k.dtype = f.v.dtype = f.out.dtype = (flashc_dtype)9;
    expect_fwd("forward: unknown dtype 9", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.dv.dtype = FLASHC_DTYPE_F16;
    expect("backward: dv f16 with q f32", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);

    /* ---- aliasing ---- */
    f = base;
    f.out.data = f.q.data;
    expect("forward: out aliases q", flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.out.data = (float *)f.v.data + 5; /* partial overlap */
    expect("forward: out overlaps v", flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    expect("forward: softmax_lse inside out",
           flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, (float *)f.out.data + 8, NULL, 0),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dq.data = f.dk.data;
    expect("backward: dq aliases dk", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dv.data = f.v.data;
    expect("backward: dv aliases v", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.dq.data = f.dout.data;
    expect("backward: dq aliases dout", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.out.stride[1] = 0;
    expect("forward: out with a zero (broadcast) stride", fwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);

    /* ---- sizes whose element count or extent overflows ---- */
    const int64_t big = (int64_t)1 << 40;
    f = base;
    f.q.shape[0] = f.k.shape[0] = f.v.shape[0] = f.out.shape[0] = big;
    f.q.shape[1] = f.out.shape[1] = big;
    expect_fwd("forward: q shape (2^40, 2^40, 4, 32)", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    for (int i = 0; i < 3; i++) f.k.shape[i] = f.v.shape[i] = big;
    f.q.shape[0] = f.out.shape[0] = big;
    f.q.shape[2] = f.out.shape[2] = big;
    expect_fwd("forward: k shape (2^40, 2^40, 2^40, 32)", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base; /* 2^61 elements: the count fits in int64, the bytes do not fit in the address space */
    f.q = flashc_tensor_contiguous(f.q.data, FLASHC_DTYPE_F32, 2, big, (int64_t)1 << 15, D);
    f.out = flashc_tensor_contiguous(f.out.data, FLASHC_DTYPE_F32, 2, big, (int64_t)1 << 15, D);
    expect_fwd("forward: q (2, 2^40, 2^15, 32), 2^63 bytes", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.k.stride[1] = (int64_t)1 << 62;
    expect_fwd("forward: k stride 2^62", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.q.stride[2] = INT64_MIN;
    expect_fwd("forward: q stride INT64_MIN", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);

    /* ---- parameters ---- */
    /* params not from flashc_params_default() of this flashc.h: a struct_size no layout has */
    const uint32_t foreign_sizes[] = {0, 4, (uint32_t)sizeof(flashc_params) - 4, (uint32_t)sizeof(flashc_params) + 3,
                                      1u << 20, 0xdeadbeefu};
    for (size_t i = 0; i < sizeof foreign_sizes / sizeof foreign_sizes[0]; i++) {
        char what[64];
        snprintf(what, sizeof what, "forward: params struct_size %u", (unsigned)foreign_sizes[i]);
        f = base;
        f.prm.struct_size = foreign_sizes[i];
        expect_fwd(what, ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
        check_true("  ... the message says to start from flashc_params_default()",
                   strstr(flashc_context_last_error(ctx), "flashc_params_default()") != NULL);
    }
    f = base;
    f.prm.struct_size = 0;
    expect("backward: params struct_size 0", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    expect("supported: params struct_size 0", flashc_supported(ctx, FLASHC_OP_FORWARD, &f.q, &f.k, &f.v, &f.prm),
           FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f = base;
    f.prm.window_left = -2;
    expect_fwd("forward: window_left = -2", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.window_right = -100;
    expect_fwd("forward: window_right = -100", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.softcap = -1.0f;
    expect_fwd("forward: softcap = -1", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.softcap = NAN;
    expect_fwd("forward: softcap = NaN", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.softmax_scale = INFINITY;
    expect_fwd("forward: softmax_scale = inf", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.alibi_slopes = (const float *)mem[8];
    f.prm.alibi_batch_stride = -4;
    expect_fwd("forward: alibi_batch_stride = -4", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm.dropout_p = NAN; /* (dropout itself: tests/test_dropout.c) */
    expect_fwd("forward: dropout_p = NaN", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    expect("backward: dropout_p = NaN", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f.prm.dropout_p = 1.0f;
    expect_fwd("forward: dropout_p = 1", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.dropout_p = -0.5f;
    expect_fwd("forward: dropout_p = -0.5", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);

    /* positions (0.6): each strictly inside (-2^40, 2^40); with dropout both >= 0, k_position a multiple of 4 and
     * within dropout's 32-bit counters */
    const int64_t two40 = INT64_C(1) << 40;
    f = base;
    f.prm.positions = 1;
    f.prm.q_position = two40 - 1;
    f.prm.k_position = -(two40 - 1);
    f.prm.causal = 1;
    expect("forward: positions at +-(2^40 - 1)", fwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    f.prm.q_position = two40;
    expect_fwd("forward: q_position = 2^40", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    check_true("  ... the message names the bound", strstr(flashc_context_last_error(ctx), "2^40") != NULL);
    expect("backward: q_position = 2^40", bwd(ctx, &f), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f.prm.q_position = 0;
    f.prm.k_position = -two40;
    expect_fwd("forward: k_position = -2^40", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.k_position = INT64_MIN;
    expect_fwd("forward: k_position = INT64_MIN", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.k_position = INT64_MAX;
    expect("supported: k_position = INT64_MAX",
           flashc_supported(ctx, FLASHC_OP_FORWARD, &f.q, &f.k, &f.v, &f.prm), FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    f.prm.positions = 0; /* off: the two are not read */
    expect("forward: positions 0 with k_position = INT64_MAX", fwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    f = base;
    f.prm.positions = 1;
    f.prm.q_position = 100;
    f.prm.k_position = 40;
    f.prm.dropout_p = 0.1f;
    expect("forward: positions (100, 40) with dropout", fwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    expect("backward: positions (100, 40) with dropout", bwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    static const struct {
        int64_t qp, kp;
        const char *what;
    } drop_bad[] = {
        {-1, 40, "forward: dropout with q_position -1"},
        {100, -4, "forward: dropout with k_position -4"},
        {100, 42, "forward: dropout with k_position 42 (not a multiple of 4)"},
        {(INT64_C(1) << 32) - NQ + 1, 0, "forward: dropout with q_position + Nq = 2^32 + 1"},
        {0, (INT64_C(1) << 34) - NK + 4, "forward: dropout with k_position + Nk = 2^34 + 4"},
    };
    for (size_t i = 0; i < sizeof drop_bad / sizeof drop_bad[0]; i++) {
        f.prm.q_position = drop_bad[i].qp;
        f.prm.k_position = drop_bad[i].kp;
        expect_fwd(drop_bad[i].what, ctx, &f, FLASHC_STATUS_NOT_SUPPORTED);
        check_true("  ... the message says why", strstr(flashc_context_last_error(ctx), "dropout") != NULL &&
                                                      strstr(flashc_context_last_error(ctx), "positions") != NULL);
    }
    f.prm.q_position = (INT64_C(1) << 32) - NQ; /* the last rows that fit */
    f.prm.k_position = (INT64_C(1) << 34) - NK;
    expect("forward: dropout at the counters' last rows and keys", fwd(ctx, &f), FLASHC_STATUS_OK, ctx);
    f.prm.k_position = 42;
    expect("backward: dropout with k_position 42", bwd(ctx, &f), FLASHC_STATUS_NOT_SUPPORTED, ctx);
    {
        uint8_t bits[4] = {7, 7, 7, 7};
        expect("dropout_mask: dropout with k_position 42", flashc_dropout_mask(&f.prm, 1, 1, 2, 2, bits),
               FLASHC_STATUS_NOT_SUPPORTED, NULL);
        check_true("  ... nothing written", bits[0] == 7 && bits[3] == 7);
        f.prm.k_position = INT64_C(1) << 40;
        expect("dropout_mask: k_position 2^40", flashc_dropout_mask(&f.prm, 1, 1, 2, 2, bits),
               FLASHC_STATUS_INVALID_ARGUMENT, NULL);
        f.prm.dropout_p = 0.0f; /* no dropout: positions are not dropout's, only their range is checked */
        f.prm.k_position = 42;
        expect("dropout_mask: p 0 with k_position 42", flashc_dropout_mask(&f.prm, 1, 1, 2, 2, bits),
               FLASHC_STATUS_OK, NULL);
    }
    f.prm.dropout_p = NAN; /* an invalid dropout_p is still INVALID_ARGUMENT */
    expect_fwd("forward: positions with dropout_p = NaN", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);

    /* block-sparse mask */
    static uint8_t mask[B * H * 8 * 8];
    memset(mask, 1, sizeof mask);
    f = base;
    f.prm.block_mask = mask;
    f.prm.block_mask_q = 0;
    f.prm.block_mask_k = 8;
    f.prm.block_mask_batch = f.prm.block_mask_heads = 1;
    expect_fwd("forward: block_mask_q = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.block_mask_q = 8;
    f.prm.block_mask_k = -8;
    expect_fwd("forward: block_mask_k = -8", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.block_mask_k = 8;
    f.prm.block_mask_batch = 3;
    expect_fwd("forward: block_mask_batch = 3 with B = 2", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.block_mask_batch = 1;
    f.prm.block_mask_heads = 2;
    expect_fwd("forward: block_mask_heads = 2 with H = 4", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f.prm.block_mask_heads = 0;
    expect_fwd("forward: block_mask_heads = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);

    /* varlen: two sequences (7, 10) and (9, 14) packed into (1, 16, H, D) and (1, 24, Hkv, D) */
    static int32_t cu_q[3] = {0, 7, 16}, cu_k[3] = {0, 10, 24};
    fixture vl = base;
    flashc_tensor *qlike[] = {&vl.q, &vl.out, &vl.dout, &vl.dq}, *klike[] = {&vl.k, &vl.v, &vl.dk, &vl.dv};
    for (int i = 0; i < 4; i++) {
        *qlike[i] = flashc_tensor_contiguous(qlike[i]->data, FLASHC_DTYPE_F32, 1, NQ, H, D);
        *klike[i] = flashc_tensor_contiguous(klike[i]->data, FLASHC_DTYPE_F32, 1, NK, HKV, D);
    }
    vl.prm.cu_seqlens_q = cu_q;
    vl.prm.cu_seqlens_k = cu_k;
    vl.prm.num_seqs = 2;
    vl.prm.max_seqlen_q = 9;
    vl.prm.max_seqlen_k = 14;
    expect("varlen: valid forward", fwd(ctx, &vl), FLASHC_STATUS_OK, ctx);
    expect("varlen: valid backward", bwd(ctx, &vl), FLASHC_STATUS_OK, ctx);
    f = vl;
    f.prm.num_seqs = 0;
    expect_fwd("varlen: num_seqs = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.cu_seqlens_k = NULL;
    expect_fwd("varlen: only cu_seqlens_q set", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.cu_seqlens_q = NULL;
    expect_fwd("varlen: only cu_seqlens_k set", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.max_seqlen_q = 0;
    expect_fwd("varlen: max_seqlen_q = 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.max_seqlen_k = 8; /* the second sequence has 14 keys */
    expect_fwd("varlen: a sequence longer than max_seqlen_k", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = base;
    f.prm = vl.prm;
    expect_fwd("varlen: q with batch dimension 2", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    static int32_t cu_bad_order[3] = {0, 12, 9}, cu_bad_end[3] = {0, 9, 30}, cu_bad_start[3] = {2, 9, 16};
    f = vl;
    f.prm.cu_seqlens_q = cu_bad_order;
    f.prm.max_seqlen_q = 16;
    expect_fwd("varlen: decreasing cu_seqlens_q", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.cu_seqlens_k = cu_bad_end;
    f.prm.max_seqlen_k = 24;
    expect_fwd("varlen: cu_seqlens_k beyond the packed rows", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);
    f = vl;
    f.prm.cu_seqlens_q = cu_bad_start;
    expect_fwd("varlen: cu_seqlens_q not starting at 0", ctx, &f, FLASHC_STATUS_INVALID_ARGUMENT);

    /* ---- workspace ---- */
    f = base;
    bytes = 0;
    expect("forward_workspace_size: valid",
           flashc_forward_workspace_size(ctx, &f.q, &f.k, &f.v, &f.prm, &bytes), FLASHC_STATUS_OK, ctx);
    if (bytes > 0) {
        unsigned char *ws = malloc(bytes);
        memset(g_out_mem, 0xff, QEL * sizeof(float));
        expect("forward: workspace one byte too small",
               flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, ws, bytes - 1),
               FLASHC_STATUS_INVALID_ARGUMENT, ctx);
        check_true("forward: too small workspace left out alone", out_untouched());
        unsigned char *ws2 = malloc(bytes + 16);
        expect("forward: workspace not 16-byte aligned",
               flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, ws2 + 1, bytes),
               FLASHC_STATUS_INVALID_ARGUMENT, ctx);
        free(ws2);
        expect("forward: exact workspace", flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, ws, bytes),
               FLASHC_STATUS_OK, ctx);
        free(ws);
    } else {
        static unsigned char one;
        expect("forward: workspace of 0 bytes (none needed)",
               flashc_forward(ctx, &f.q, &f.k, &f.v, &f.prm, &f.out, f.lse, &one, 0), FLASHC_STATUS_OK, ctx);
    }
    bytes = 0;
    expect("backward_workspace_size: valid",
           flashc_backward_workspace_size(ctx, &f.q, &f.k, &f.v, &f.prm, &bytes), FLASHC_STATUS_OK, ctx);
    if (bytes > 0) {
        unsigned char *ws = malloc(bytes);
        expect("backward: workspace one byte too small",
               flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, &f.dout, f.lse, &f.prm, &f.dq, &f.dk, &f.dv, ws,
                               bytes - 1),
               FLASHC_STATUS_INVALID_ARGUMENT, ctx);
        unsigned char *ws2 = malloc(bytes + 16);
        expect("backward: workspace not 16-byte aligned",
               flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, &f.dout, f.lse, &f.prm, &f.dq, &f.dk, &f.dv, ws2 + 4,
                               bytes),
               FLASHC_STATUS_INVALID_ARGUMENT, ctx);
        free(ws2);
        expect("backward: exact workspace",
               flashc_backward(ctx, &f.q, &f.k, &f.v, &f.out, &f.dout, f.lse, &f.prm, &f.dq, &f.dk, &f.dv, ws, bytes),
               FLASHC_STATUS_OK, ctx);
        free(ws);
    }

    /* ---- a failure does not poison the context ---- */
    f = base;
    f.prm.softcap = -1.0f;
    (void)fwd(ctx, &f);
    expect("valid forward after a failure", fwd(ctx, &base), FLASHC_STATUS_OK, ctx);

    /* ---- status strings ---- */
    static const flashc_status all[] = {FLASHC_STATUS_OK,           FLASHC_STATUS_INVALID_ARGUMENT,
                                        FLASHC_STATUS_NOT_SUPPORTED, FLASHC_STATUS_OUT_OF_MEMORY,
                                        FLASHC_STATUS_DEVICE_ERROR,  FLASHC_STATUS_INTERNAL};
    const size_t nall = sizeof all / sizeof all[0];
    int distinct = 1;
    for (size_t i = 0; i < nall; i++) {
        const char *s = flashc_status_string(all[i]);
        if (!s || !s[0]) distinct = 0;
        for (size_t j = 0; distinct && j < i; j++)
            if (strcmp(s, flashc_status_string(all[j])) == 0) distinct = 0;
    }
    check_true("status_string: every status named, all distinct", distinct);
    const flashc_status odd[] = {(flashc_status)-1, (flashc_status)6, (flashc_status)1000};
    int odd_ok = 1;
    for (size_t i = 0; i < 3; i++) {
        const char *s = flashc_status_string(odd[i]);
        if (!s || !s[0]) odd_ok = 0;
        for (size_t j = 0; odd_ok && j < nall; j++)
            if (strcmp(s, flashc_status_string(all[j])) == 0) odd_ok = 0;
    }
    check_true("status_string: out-of-range values named as unknown", odd_ok);

    flashc_context_destroy(ctx);
    flashc_context_destroy(NULL);
    for (int i = 0; i < 9; i++) free(mem[i]);
    printf("test_misuse: %d of %d checks passed\n", g_checks - g_failed, g_checks);
    return g_failed ? 1 : 0;
}
