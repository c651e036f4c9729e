/*
 * emu_bwd_simt.cc - the CUDA backward's kernel bodies (src/cuda/bwd_simt.cu) run on the CPU, checked against the
 * fp64 oracle through the shared case table. No GPU needed: it checks the kernels' index math, masks, tile
 * skipping and output coverage before they ever run on a device.
 *
 * Emulation: one host thread per CUDA thread of a block (256), a pthread barrier for __syncthreads, blocks of a
 * grid one after another with a barrier in between (the shared-memory struct is reused). The emulated backward
 * replaces the backward of a CPU context (forward, workspace allocation and everything else stay the CPU
 * backend's), so fp32 cases are held to the fp32 rule (relative 1e-4 on gradients), stricter than the bf16 rule
 * the GPU is held to. The workspace is poisoned with NaN before each call so that a D_i read before it is written
 * shows. Built with -fsanitize=thread it also reports a missing barrier as a data race; with
 * -fsanitize=address, any read or write outside the tensors.
 *
 *   emu_bwd_simt [--quick] [--gpu-numerics] [--dropout] [NAME]
 *       the full (or reduced) case table, rows with backward [whose name contains NAME]. --gpu-numerics gives fp32
 *       cases the GPU's conditions: a forward on q, k, v rounded to bf16 (as the CUDA forward's operands are), so
 *       and the backward reads them rounded the same way (fc_bwd_args.qkv_bf16), with the GPU test's bf16 rule.
 *       Without it fp32 cases run on unrounded operands end to end and are held to the fp32 rule. --dropout runs
 *       every row with dropout_p 0.17 (the mask's factors against the oracle's).
 * Build with the host C++ compiler (not nvcc: the kernels must compile as host code), e.g. against a CPU-only build:
 *   g++ -std=c++17 -O2 -Iinclude -Isrc -I<cuda>/include tests/emu_bwd_simt.cc <build>/libflashc_testkit.a
 *       <build>/libflashc.a -fopenmp -lpthread -lm
 */
/* An own name for the host entry point, so that a library built with CUDA (which has the real one) links. */
#define flashc_cuda_bwd_simt_unsupported emu_bwd_simt_unsupported
#include "../src/cuda/bwd_simt.cu"

#include "ref/testkit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- block emulation -------------------------------------------------------------------------------------- */

static pthread_barrier_t g_barrier;
static thread_local int t_tid;
static int g_or[FC_BWD_NT];

void fc_sync(void) { pthread_barrier_wait(&g_barrier); }

int fc_sync_or(int x) {
    g_or[t_tid] = x;
    fc_sync();
    int any = 0;
    for (int t = 0; t < FC_BWD_NT; ++t) any |= g_or[t];
    fc_sync(); /* nobody overwrites g_or before everyone has read it */
    return any;
}

static double g_part[FC_BWD_NT]; /* the sinks' block sums (the kernel's shared array) */

typedef struct launch {
    int kernel; /* 0 dvec, 1 dkdv, 2 dq, 3 unused keys' zeros, 4 sinks' gradient */
    int64_t blocks;
    const flashc_problem *p;
    const fc_bwd_args *a;
    fc_bwd_smem *sm;
} launch;

template <typename T, int NDC>
static void run_block(const launch *l, int64_t bid, int tid) {
    if (l->kernel == 0) fc_bwd_dvec_body<T>(*l->a, bid * FC_BWD_NT + tid);
    else if (l->kernel == 1) fc_bwd_dkdv_body<T, NDC>(*l->a, *l->sm, bid, tid);
    else if (l->kernel == 2) fc_bwd_dq_body<T, NDC>(*l->a, *l->sm, bid, tid);
    else if (l->kernel == 3) fc_bwd_unused_body<T>(*l->a, bid * FC_BWD_NT + tid);
    else fc_bwd_sinks_body(*l->a, g_part, bid, tid);
}

template <typename T>
static void run_block_dtype(const launch *l, int64_t bid, int tid) {
    switch (fc_bwd_ndc(l->p->D)) {
    case 1: run_block<T, 1>(l, bid, tid); break;
    case 2: run_block<T, 2>(l, bid, tid); break;
    default: run_block<T, 4>(l, bid, tid); break;
    }
}

typedef struct worker_arg {
    const launch *l;
    int tid;
} worker_arg;

static void *worker(void *arg) {
    const worker_arg *w = (const worker_arg *)arg;
    t_tid = w->tid;
    for (int64_t bid = 0; bid < w->l->blocks; ++bid) {
        switch (w->l->p->dtype) {
        case FLASHC_DTYPE_F32: run_block_dtype<float>(w->l, bid, w->tid); break;
        case FLASHC_DTYPE_F16: run_block_dtype<__half>(w->l, bid, w->tid); break;
        case FLASHC_DTYPE_BF16: run_block_dtype<__nv_bfloat16>(w->l, bid, w->tid); break;
        }
        fc_sync(); /* the block is over before the next one reuses the shared memory */
    }
    return NULL;
}

static int run_grid(const launch *l) {
    if (l->blocks <= 0) return 0;
    pthread_t th[FC_BWD_NT];
    worker_arg wa[FC_BWD_NT];
    if (pthread_barrier_init(&g_barrier, NULL, FC_BWD_NT)) return -1;
    for (int t = 0; t < FC_BWD_NT; ++t) {
        wa[t].l = l;
        wa[t].tid = t;
        if (pthread_create(&th[t], NULL, worker, &wa[t])) {
            fprintf(stderr, "pthread_create failed\n");
            exit(2);
        }
    }
    for (int t = 0; t < FC_BWD_NT; ++t) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&g_barrier);
    return 0;
}

/* ---- the emulated backend --------------------------------------------------------------------------------- */

static int64_t g_launches;
static int g_gpu_numerics;

/* What the CUDA backward refuses before it picks a path (bwd.cu), then the baseline's own limits. */
static const char *emu_bwd_unsupported(const flashc_problem *p) {
    if (p->D > FLASHC_MAX_HEAD_DIM) return "the CUDA backward supports head dims up to 256";
    return emu_bwd_simt_unsupported(p);
}

/* The baseline's workspace: D_i, one fp32 per (head, query row). */
static size_t emu_bwd_workspace(const flashc_problem *p) { return (size_t)fc_bwd_rows(p) * p->H * sizeof(float); }

static flashc_status emu_backward(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                                  void *workspace) {
    (void)plan;
    const char *why = emu_bwd_unsupported(p);
    if (why) return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "%s", why);
    const size_t ws = emu_bwd_workspace(p);
    if (ws > 0 && !workspace) return FLASHC_ERR(ctx, FLASHC_STATUS_INTERNAL, "no workspace for %zu bytes", ws);
    if (ws > 0) memset(workspace, 0xff, ws);
    fc_bwd_args a = fc_bwd_make_args(p, workspace);
    if (!g_gpu_numerics) a.qkv_bf16 = 0; /* the CPU forward's fp32 operands: fp32 gradients, held to the fp32 rule */
    static fc_bwd_smem sm;
    int64_t grids[5];
    fc_bwd_grids(p, &grids[0], &grids[1], &grids[2]);
    fc_bwd_post_grids(p, &grids[3], &grids[4]);
    for (int k = 0; k < 5; ++k) {
        const launch l = {k, grids[k], p, &a, &sm};
        if (run_grid(&l)) return FLASHC_ERR(ctx, FLASHC_STATUS_INTERNAL, "barrier set-up failed");
        g_launches += grids[k] > 0;
    }
    return FLASHC_STATUS_OK;
}

/* A forward on bf16-rounded copies of fp32 q, k, v, as the CUDA forward computes them; 16-bit inputs unchanged. */
static flashc_status emu_forward_bf16_operands(struct flashc_context *ctx, const flashc_problem *p,
                                               const flashc_plan *plan, void *workspace) {
    if (p->dtype != FLASHC_DTYPE_F32) return flashc_cpu_ops.forward(ctx, p, plan, workspace);
    flashc_problem r = *p;
    flashc_tensor *ts[3] = {&r.q, &r.k, &r.v};
    float *bufs[3] = {NULL, NULL, NULL};
    flashc_status st = FLASHC_STATUS_OK;
    for (int t = 0; t < 3; t++) {
        flashc_tensor *x = ts[t];
        const int64_t *n = x->shape;
        bufs[t] = (float *)malloc((size_t)(n[0] * n[1] * n[2] * n[3] + 1) * sizeof(float));
        if (!bufs[t]) {
            st = FLASHC_ERR(ctx, FLASHC_STATUS_OUT_OF_MEMORY, "emulator: out of host memory");
            break;
        }
        float *dst = bufs[t];
        for (int64_t i0 = 0; i0 < n[0]; i0++)
            for (int64_t i1 = 0; i1 < n[1]; i1++)
                for (int64_t i2 = 0; i2 < n[2]; i2++)
                    for (int64_t i3 = 0; i3 < n[3]; i3++) {
                        const float v = ((const float *)x->data)[i0 * x->stride[0] + i1 * x->stride[1] +
                                                                 i2 * x->stride[2] + i3 * x->stride[3]];
                        *dst++ = flashc_bf16_to_f32(flashc_f32_to_bf16(v));
                    }
        *x = flashc_tensor_contiguous(bufs[t], FLASHC_DTYPE_F32, n[0], n[1], n[2], n[3]);
    }
    if (st == FLASHC_STATUS_OK) st = flashc_cpu_ops.forward(ctx, &r, plan, workspace);
    for (int t = 0; t < 3; t++) free(bufs[t]);
    return st;
}

/* The emulated backend's plan: the CPU forward's, and the CUDA-core backward's support and workspace. */
static flashc_status emu_plan(struct flashc_context *ctx, const flashc_problem *p, flashc_plan *plan) {
    if (p->op == FLASHC_OP_FORWARD) return flashc_cpu_ops.plan(ctx, p, plan);
    const char *why = emu_bwd_unsupported(p);
    if (why) return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "%s", why);
    plan->kernel = "CUDA cores (emulated on the CPU)";
    plan->workspace = emu_bwd_workspace(p);
    return FLASHC_STATUS_OK;
}

int main(int argc, char **argv) {
    int quick = 0, gpu_numerics = 0, dropout = 0;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else if (strcmp(argv[i], "--gpu-numerics") == 0) gpu_numerics = 1;
        else if (strcmp(argv[i], "--dropout") == 0) dropout = 1;
        else only = argv[i];
    }
    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "context: %s\n", flashc_context_last_error(NULL));
        return 2;
    }
    static flashc_backend_ops ops;
    ops = flashc_cpu_ops;
    ops.plan = emu_plan;
    ops.backward = emu_backward;
    g_gpu_numerics = gpu_numerics;
    if (gpu_numerics) {
        ops.forward = emu_forward_bf16_operands;
        ctx->backend = FLASHC_BACKEND_CUDA; /* the case runner then holds fp32 to the bf16 rule */
    }
    ctx->ops = &ops;

    size_t n = 0;
    const flashc_case *table = flashc_case_table(!quick, &n);
    int ran = 0, passed = 0;
    for (size_t i = 0; i < n; i++) {
        if (!table[i].backward || (only && !strstr(table[i].name, only))) continue;
        if (table[i].page_size > 0) { /* the CUDA kernels do not follow a block table (cuda.cu refuses paged K/V) */
            printf("skip %-26s paged K/V: not supported by the CUDA backend yet\n", table[i].name);
            continue;
        }
        flashc_case_result r;
        flashc_case c = table[i];
        if (dropout) c.dropout = 0.17f; /* every row again with dropout: the kernel's Z against the oracle's */
        ran++;
        if (flashc_case_run(ctx, &c, 2000 + i, &r) != 0) {
            printf("FAIL %-26s could not be set up\n", table[i].name);
            continue;
        }
        printf("%s %-26s %-4s grad %.3g (tol %.3g) out %.3g%s%s\n", r.pass ? "ok  " : "FAIL", table[i].name,
               flashc_dtype_name(table[i].dtype), r.err_grad, r.tol_grad, r.err_out, r.message[0] ? " -- " : "",
               r.message);
        fflush(stdout);
        passed += r.pass;
    }
    printf("emulated CUDA backward, %s table%s%s: %d / %d passed (%lld kernel launches)\n", quick ? "quick" : "full",
           gpu_numerics ? ", GPU numerics" : "", dropout ? ", dropout 0.17" : "", passed, ran, (long long)g_launches);
    flashc_context_destroy(ctx);
    return passed == ran ? 0 : 1;
}
