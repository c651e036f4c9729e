/*
 * test_rotary: flashc_rotary (rotary position embedding, flash-attn's apply_rotary_emb) on the CPU backend.
 *
 * 1. The case table of tests/rotary_common.h (which gpu_rotary.cu runs on the CUDA backend): f32, f16 and bf16 with
 *    fp32 tables or tables in x's dtype, GPT-NeoX halves and GPT-J pairs, R = D and R < D, four layouts of x, out in
 *    place or elsewhere, seq_start NULL or per sequence: bit for bit the documented formula, within one rounding of the
 *    fp64 rotation, nothing outside the view written; rows outside the tables refused with nothing written.
 * 2. A rotation large enough for threads: the same bits on 1 and 2 threads.
 * 3. Refusals: NULL arguments, mismatched shapes and dtypes, tables that are not (1, P, 1, R/2) or whose R exceeds D,
 *    out overlapping x without being its view, or the tables or seq_start, misaligned pointers, a broadcast out:
 *    INVALID_ARGUMENT with a message, nothing written; a success clears the message.
 */
#include "rotary_common.h"

/* ---- 2. threads ---------------------------------------------------------------------------------------------- */

static void threads(flashc_context_t ctx) {
    enum { B = 2, N = 300, H = 8, D = 128, HALF = 48, P = 400 };
    const size_t el = (size_t)B * N * H * D;
    uint16_t *x = (uint16_t *)xmalloc(el * 2), *o1 = (uint16_t *)xmalloc(el * 2), *o2 = (uint16_t *)xmalloc(el * 2);
    float *cs = (float *)xmalloc((size_t)P * HALF * 4), *sn = (float *)xmalloc((size_t)P * HALF * 4);
    uint64_t rng = 99;
    for (size_t i = 0; i < el; i++) x[i] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng));
    for (int i = 0; i < P * HALF; i++) cs[i] = (float)cos(0.01 * i), sn[i] = (float)sin(0.01 * i);
    const int32_t starts[B] = {0, 100};
    const flashc_tensor tx = flashc_tensor_contiguous(x, FLASHC_DTYPE_BF16, B, N, H, D),
                        t1 = flashc_tensor_contiguous(o1, FLASHC_DTYPE_BF16, B, N, H, D),
                        t2 = flashc_tensor_contiguous(o2, FLASHC_DTYPE_BF16, B, N, H, D),
                        tc = flashc_tensor_contiguous(cs, FLASHC_DTYPE_F32, 1, P, 1, HALF),
                        ts = flashc_tensor_contiguous(sn, FLASHC_DTYPE_F32, 1, P, 1, HALF);
    flashc_context_set_threads(ctx, 1);
    const flashc_status s1 = flashc_rotary(ctx, &tx, &tc, &ts, starts, 1, &t1);
    flashc_context_set_threads(ctx, 2);
    const flashc_status s2 = flashc_rotary(ctx, &tx, &tc, &ts, starts, 1, &t2);
    flashc_context_set_threads(ctx, 0);
    char what[160];
    snprintf(what, sizeof what, "B %d N %d H %d D %d bf16 (%zu elements): 1 and 2 threads give the same bits", B, N, H,
             D, el);
    check(what, s1 == FLASHC_STATUS_OK && s2 == FLASHC_STATUS_OK && !memcmp(o1, o2, el * 2));
    free(x), free(o1), free(o2), free(cs), free(sn);
}

/* ---- 3. refusals -------------------------------------------------------------------------------------------- */

static void refusals(flashc_context_t ctx) {
    enum { B = 2, N = 4, H = 2, D = 16, HALF = 4, P = 8, EL = B * N * H * D, TEL = P * HALF };
    float *buf = (float *)calloc(2 * EL + 2 * TEL + 64, 4);
    if (!buf) exit(2);
    float *x = buf, *o = buf + EL, *cs = buf + 2 * EL, *sn = cs + TEL;
    int32_t starts[B + 1] = {0, 4, 0};
    const flashc_tensor tx = flashc_tensor_contiguous(x, FLASHC_DTYPE_F32, B, N, H, D),
                        to = flashc_tensor_contiguous(o, FLASHC_DTYPE_F32, B, N, H, D),
                        tc = flashc_tensor_contiguous(cs, FLASHC_DTYPE_F32, 1, P, 1, HALF),
                        ts = flashc_tensor_contiguous(sn, FLASHC_DTYPE_F32, 1, P, 1, HALF);
    struct {
        const char *what, *msg; /* msg: a piece the message must hold */
        flashc_tensor x, cos, sin, out;
        const int32_t *starts;
        int null; /* 1: x NULL, 2: cos NULL, 3: out NULL */
    } cases[] = {
        {"x NULL", "x is NULL", tx, tc, ts, to, starts, 1},
        {"cos NULL", "cos is NULL", tx, tc, ts, to, starts, 2},
        {"out NULL", "out is NULL", tx, tc, ts, to, starts, 3},
        {"out of another shape", "one shape", tx, tc, ts, to, starts, 0},
        {"out of another dtype", "one shape", tx, tc, ts, to, starts, 0},
        {"sin of another shape", "tables of one shape", tx, tc, ts, to, starts, 0},
        {"sin of another dtype", "tables of one shape", tx, tc, ts, to, starts, 0},
        {"tables (P, 1, 1, R/2)", "(1, P, 1, R/2)", tx, tc, ts, to, starts, 0},
        {"tables with R = 18 > D = 16", "exceeds the head dim", tx, tc, ts, to, starts, 0},
        {"a position past the tables (seq_start 5, N 4, P 8)", "seq_start[1] = 5", tx, tc, ts, to, starts, 0},
        {"a negative position (seq_start -1)", "seq_start[0] = -1", tx, tc, ts, to, starts, 0},
        {"out shifted one element into x", "out overlaps x", tx, tc, ts, to, starts, 0},
        {"out = x's data with other strides", "very view", tx, tc, ts, to, starts, 0},
        {"out over the cos table", "out overlaps cos", tx, tc, ts, to, starts, 0},
        {"out over seq_start", "out overlaps seq_start", tx, tc, ts, to, starts, 0},
        {"in place over a broadcast x (zero stride)", "cannot broadcast", tx, tc, ts, to, starts, 0},
        {"x not aligned to its elements", "not aligned", tx, tc, ts, to, starts, 0},
        {"seq_start not 4-byte aligned", "not aligned", tx, tc, ts, to, starts, 0},
        {"an unknown dtype", "unknown dtype", tx, tc, ts, to, starts, 0},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    cases[3].out.shape[2] = 1;
    cases[4].out.dtype = FLASHC_DTYPE_F16;
    cases[5].sin.shape[3] = 2;
    cases[6].sin.dtype = FLASHC_DTYPE_BF16;
    for (int t = 0; t < 2; t++) { /* (P, 1, 1, R/2): P along shape[0] */
        flashc_tensor *v = t ? &cases[7].sin : &cases[7].cos;
        v->shape[0] = P, v->shape[1] = 1;
    }
    cases[8].cos.shape[3] = cases[8].sin.shape[3] = 9, cases[8].cos.shape[1] = cases[8].sin.shape[1] = 7;
    cases[10].starts = starts + 1; /* its seq_start[0] is starts[1], set to -1 below */
    cases[11].out.data = x + 1;
    cases[12].out.data = x, cases[12].out.stride[1] = D, cases[12].out.stride[2] = N * D; /* (B, H, N, D) over x */
    cases[13].out.data = cs;
    cases[14].out.data = starts;
    cases[15].x.stride[1] = 0, cases[15].out = cases[15].x;
    cases[16].x.data = (char *)x + 2;
    cases[17].starts = (const int32_t *)((const char *)starts + 2);
    cases[18].x.dtype = (flashc_dtype)7;
    for (int c = 0; c < n; c++) {
        for (int i = 0; i < 2 * EL + 2 * TEL; i++) buf[i] = (float)(i % 61) * 0.25f;
        starts[0] = 0, starts[1] = 4, starts[2] = 0;
        if (c == 9) starts[1] = 5;
        if (c == 10) starts[1] = -1; /* cases[10].starts[0] */
        float *before = (float *)xmalloc((2 * EL + 2 * TEL) * 4);
        memcpy(before, buf, (2 * EL + 2 * TEL) * 4);
        int32_t st0[B + 1];
        memcpy(st0, starts, sizeof st0);
        const flashc_status st =
            flashc_rotary(ctx, cases[c].null == 1 ? NULL : &cases[c].x, cases[c].null == 2 ? NULL : &cases[c].cos,
                          &cases[c].sin, cases[c].starts, 0, cases[c].null == 3 ? NULL : &cases[c].out);
        const char *msg = flashc_context_last_error(ctx);
        char what[200];
        snprintf(what, sizeof what, "refused: %s (INVALID_ARGUMENT, nothing written)", cases[c].what);
        const int ok = st == FLASHC_STATUS_INVALID_ARGUMENT && strstr(msg, cases[c].msg) &&
                       !memcmp(before, buf, (2 * EL + 2 * TEL) * 4) && !memcmp(st0, starts, sizeof st0);
        check(what, ok);
        if (!ok) printf("    status %s, message \"%s\"\n", flashc_status_string(st), msg);
        free(before);
    }
    check("refused: a NULL context (INVALID_ARGUMENT, message in the thread's slot)",
          flashc_rotary(NULL, &tx, &tc, &ts, NULL, 0, &to) == FLASHC_STATUS_INVALID_ARGUMENT &&
              strstr(flashc_context_last_error(NULL), "ctx is NULL"));
    /* a success after a refusal clears the message; the last position of the tables is taken; in place */
    starts[0] = 0, starts[1] = P - N;
    flashc_rotary(ctx, &tx, &tc, &ts, starts, 0, &cases[11].out); /* refused: sets the message */
    const flashc_status ok = flashc_rotary(ctx, &tx, &tc, &ts, starts, 1, &tx);
    check("a success (in place, a sequence ending at the tables' last row) clears the message",
          ok == FLASHC_STATUS_OK && flashc_context_last_error(ctx)[0] == '\0');
    free(buf);
}

int main(void) {
    flashc_context_t ctx;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "context: %s\n", flashc_context_last_error(NULL));
        return 2;
    }
    rotary_cases(ctx, &rot_host_memory, NULL);
    threads(ctx);
    refusals(ctx);
    flashc_context_destroy(ctx);
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed ? 1 : 0;
}
