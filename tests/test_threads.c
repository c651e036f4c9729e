/*
 * test_threads: flashc called from several user threads at once (pthreads), public API only.
 *
 *   (a) the first calls of the process - flashc_cpu_features() and a first forward, each on its own context -
 *       race from 8 threads (the lazily detected CPU features and kernel choice are set once per process);
 *   (b) ONE context shared by 4 threads, each running forwards and backwards on its own buffers (some with a
 *       workspace of their own, some letting the library allocate one): every result is bitwise the one the same
 *       call gives single-threaded;
 *   (c) in one shared context, two threads make failing calls (a NULL q; a negative window of their own), 16 per
 *       good call, while two others make only good calls: right after each call, flashc_context_last_error(ctx) names the calling thread's own
 *       mistake, and is "" after its own successful call. The contract: flashc_context_last_error(ctx) returns
 *       the message of the calling thread's last call on ctx.
 *
 *   (d) four threads of the caller's own OpenMP parallel region, each calling at one library thread on its own
 *       context: every result is bitwise a plain call's (the library's loops stay its own).
 * Threads per call inside the library: flashc_context_set_threads(ctx, T), T from FLASHC_TEST_OMP_THREADS
 * (default 2; `make tsan` may set 1). Iterations scale with FLASHC_TEST_ITERS (default 40).
 * Prints one line per check, then "test_threads: N passed, M failed"; exits non-zero on a failure.
 */
#define _POSIX_C_SOURCE 200809L
#include "flashc.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_passed, g_failed;

static void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "PASS" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (ok) g_passed++;
    else g_failed++;
    fflush(stdout);
}

static int env_int(const char *name, int dflt, int lo, int hi) {
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    long v = strtol(s, NULL, 10);
    return v < lo ? lo : v > hi ? hi : (int)v;
}

static int g_omp_threads = 2, g_iters = 40;

/* ---- one problem: inputs, outputs, gradients -------------------------------------------------------------- */

/* Nq = 96 spans two 64-row forward blocks, so a call with 2 threads splits its work. */
enum { B = 1, NQ = 96, NK = 80, H = 2, D = 32 };
#define QEL ((size_t)B * NQ * H * D)
#define KEL ((size_t)B * NK * H * D)
#define LSEL ((size_t)B * H * NQ)

typedef struct problem {
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    flashc_params params;
} problem;

static uint32_t lcg(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s;
}

static float *filled(size_t n, uint32_t *seed) {
    float *p = malloc(n * sizeof *p);
    if (!p) {
        fprintf(stderr, "test_threads: out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < n; i++) p[i] = (float)((lcg(seed) >> 8) & 0xffff) / 32768.0f - 1.0f;
    return p;
}

/* Variant i: plain, causal, softcap, sliding window. */
static void problem_init(problem *p, int variant, uint32_t seed) {
    p->q = filled(QEL, &seed);
    p->k = filled(KEL, &seed);
    p->v = filled(KEL, &seed);
    p->dout = filled(QEL, &seed);
    p->out = calloc(QEL, sizeof(float));
    p->lse = calloc(LSEL, sizeof(float));
    p->dq = calloc(QEL, sizeof(float));
    p->dk = calloc(KEL, sizeof(float));
    p->dv = calloc(KEL, sizeof(float));
    if (!p->out || !p->lse || !p->dq || !p->dk || !p->dv) {
        fprintf(stderr, "test_threads: out of memory\n");
        exit(2);
    }
    p->params = flashc_params_default();
    p->params.deterministic = 1;
    switch (variant % 4) {
    case 1: p->params.causal = 1; break;
    case 2: p->params.softcap = 5.0f; break;
    case 3: p->params.window_left = 17; p->params.window_right = 9; break;
    default: break;
    }
}

static void problem_free(problem *p) {
    free(p->q), free(p->k), free(p->v), free(p->out), free(p->lse);
    free(p->dout), free(p->dq), free(p->dk), free(p->dv);
}

/* Results of one forward + backward. */
typedef struct result {
    float *out, *lse, *dq, *dk, *dv;
} result;

static void result_alloc(result *r) {
    r->out = malloc(QEL * sizeof(float));
    r->lse = malloc(LSEL * sizeof(float));
    r->dq = malloc(QEL * sizeof(float));
    r->dk = malloc(KEL * sizeof(float));
    r->dv = malloc(KEL * sizeof(float));
    if (!r->out || !r->lse || !r->dq || !r->dk || !r->dv) {
        fprintf(stderr, "test_threads: out of memory\n");
        exit(2);
    }
}

static void result_free(result *r) { free(r->out), free(r->lse), free(r->dq), free(r->dk), free(r->dv); }

static flashc_status run_forward(flashc_context_t ctx, problem *p, void *ws, size_t ws_bytes) {
    flashc_tensor tq = flashc_tensor_contiguous(p->q, FLASHC_DTYPE_F32, B, NQ, H, D);
    flashc_tensor tk = flashc_tensor_contiguous(p->k, FLASHC_DTYPE_F32, B, NK, H, D);
    flashc_tensor tv = flashc_tensor_contiguous(p->v, FLASHC_DTYPE_F32, B, NK, H, D);
    flashc_tensor to = flashc_tensor_contiguous(p->out, FLASHC_DTYPE_F32, B, NQ, H, D);
    return flashc_forward(ctx, &tq, &tk, &tv, &p->params, &to, p->lse, ws, ws_bytes);
}

static flashc_status run_backward(flashc_context_t ctx, problem *p, void *ws, size_t ws_bytes) {
    flashc_tensor tq = flashc_tensor_contiguous(p->q, FLASHC_DTYPE_F32, B, NQ, H, D);
    flashc_tensor tk = flashc_tensor_contiguous(p->k, FLASHC_DTYPE_F32, B, NK, H, D);
    flashc_tensor tv = flashc_tensor_contiguous(p->v, FLASHC_DTYPE_F32, B, NK, H, D);
    flashc_tensor to = flashc_tensor_contiguous(p->out, FLASHC_DTYPE_F32, B, NQ, H, D);
    flashc_tensor tdo = flashc_tensor_contiguous(p->dout, FLASHC_DTYPE_F32, B, NQ, H, D);
    flashc_tensor tdq = flashc_tensor_contiguous(p->dq, FLASHC_DTYPE_F32, B, NQ, H, D);
    flashc_tensor tdk = flashc_tensor_contiguous(p->dk, FLASHC_DTYPE_F32, B, NK, H, D);
    flashc_tensor tdv = flashc_tensor_contiguous(p->dv, FLASHC_DTYPE_F32, B, NK, H, D);
    return flashc_backward(ctx, &tq, &tk, &tv, &to, &tdo, p->lse, &p->params, &tdq, &tdk, &tdv, ws, ws_bytes);
}

static void save(result *r, const problem *p) {
    memcpy(r->out, p->out, QEL * sizeof(float));
    memcpy(r->lse, p->lse, LSEL * sizeof(float));
    memcpy(r->dq, p->dq, QEL * sizeof(float));
    memcpy(r->dk, p->dk, KEL * sizeof(float));
    memcpy(r->dv, p->dv, KEL * sizeof(float));
}

/* Bitwise; names the first buffer that differs, or NULL. */
static const char *differs(const result *r, const problem *p, int with_grads) {
    if (memcmp(r->out, p->out, QEL * sizeof(float))) return "out";
    if (memcmp(r->lse, p->lse, LSEL * sizeof(float))) return "lse";
    if (!with_grads) return NULL;
    if (memcmp(r->dq, p->dq, QEL * sizeof(float))) return "dq";
    if (memcmp(r->dk, p->dk, KEL * sizeof(float))) return "dk";
    if (memcmp(r->dv, p->dv, KEL * sizeof(float))) return "dv";
    return NULL;
}

static flashc_context_t new_context(void) {
    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "test_threads: flashc_context_create: %s\n", flashc_context_last_error(NULL));
        exit(2);
    }
    if (flashc_context_set_threads(ctx, g_omp_threads) != FLASHC_STATUS_OK) {
        fprintf(stderr, "test_threads: flashc_context_set_threads: %s\n", flashc_context_last_error(ctx));
        exit(2);
    }
    return ctx;
}

/* ---- (a) first calls of the process, concurrently ---------------------------------------------------------- */

enum { A_THREADS = 8 };
static pthread_barrier_t a_barrier;

typedef struct a_arg {
    int id;
    const char *features; /* what flashc_cpu_features() returned to this thread */
    char features_copy[256];
    flashc_status status;
    problem p;
} a_arg;

static void *a_main(void *argp) {
    a_arg *a = argp;
    pthread_barrier_wait(&a_barrier);
    if (a->id % 2 == 0) { /* even threads ask for the features first, odd ones run a forward first */
        a->features = flashc_cpu_features();
        snprintf(a->features_copy, sizeof a->features_copy, "%s", a->features ? a->features : "(null)");
    }
    flashc_context_t ctx = NULL;
    a->status = flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0);
    if (a->status == FLASHC_STATUS_OK) a->status = flashc_context_set_threads(ctx, g_omp_threads);
    if (a->status == FLASHC_STATUS_OK) a->status = run_forward(ctx, &a->p, NULL, 0);
    flashc_context_destroy(ctx);
    if (a->id % 2 == 1) {
        a->features = flashc_cpu_features();
        snprintf(a->features_copy, sizeof a->features_copy, "%s", a->features ? a->features : "(null)");
    }
    return NULL;
}

static void part_a(void) {
    a_arg args[A_THREADS];
    pthread_t th[A_THREADS];
    memset(args, 0, sizeof args);
    pthread_barrier_init(&a_barrier, NULL, A_THREADS);
    for (int i = 0; i < A_THREADS; i++) {
        args[i].id = i;
        problem_init(&args[i].p, 0, 1234u); /* the same problem everywhere */
        if (pthread_create(&th[i], NULL, a_main, &args[i])) {
            fprintf(stderr, "test_threads: pthread_create failed\n");
            exit(2);
        }
    }
    for (int i = 0; i < A_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&a_barrier);

    /* Now single-threaded: what the process says afterwards, and the forward's reference result. */
    const char *features = flashc_cpu_features();
    printf("cpu features: %s; library threads per call: %d\n", features, g_omp_threads);
    flashc_context_t ctx = new_context();
    problem ref;
    problem_init(&ref, 0, 1234u);
    flashc_status st = run_forward(ctx, &ref, NULL, 0);
    check(st == FLASHC_STATUS_OK, "(a) reference forward: %s %s", flashc_status_string(st),
          flashc_context_last_error(ctx));
    result r;
    result_alloc(&r);
    save(&r, &ref);
    for (int i = 0; i < A_THREADS; i++) {
        check(args[i].features == features && !strcmp(args[i].features_copy, features),
              "(a) thread %d: first-call flashc_cpu_features() is the process's (\"%s\")", i, args[i].features_copy);
        const char *bad = args[i].status == FLASHC_STATUS_OK ? differs(&r, &args[i].p, 0) : "status";
        check(!bad, "(a) thread %d: concurrent first forward is %s, bitwise the reference%s%s", i,
              flashc_status_string(args[i].status), bad ? "; differs in " : "", bad ? bad : "");
        problem_free(&args[i].p);
    }
    result_free(&r);
    problem_free(&ref);
    flashc_context_destroy(ctx);
}

/* ---- (b) one context, 4 threads, forwards and backwards on their own buffers ------------------------------ */

enum { B_THREADS = 4 };

typedef struct b_arg {
    int id;
    flashc_context_t ctx;
    problem p;
    result ref;
    int runs, bad_status, bad_bits;
    char first_problem[600];
} b_arg;

static void note(char *dst, size_t n, const char *fmt, ...) {
    if (dst[0]) return; /* the first one only */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, n, fmt, ap);
    va_end(ap);
}

static void *b_main(void *argp) {
    b_arg *a = argp;
    void *ws = NULL;
    size_t ws_bytes = 0;
    if (a->id % 2 == 1) { /* odd threads bring a workspace of their own, large enough for either direction */
        size_t f = 0, b = 0;
        flashc_tensor tq = flashc_tensor_contiguous(a->p.q, FLASHC_DTYPE_F32, B, NQ, H, D);
        flashc_tensor tk = flashc_tensor_contiguous(a->p.k, FLASHC_DTYPE_F32, B, NK, H, D);
        flashc_tensor tv = flashc_tensor_contiguous(a->p.v, FLASHC_DTYPE_F32, B, NK, H, D);
        if (flashc_forward_workspace_size(a->ctx, &tq, &tk, &tv, &a->p.params, &f) != FLASHC_STATUS_OK ||
            flashc_backward_workspace_size(a->ctx, &tq, &tk, &tv, &a->p.params, &b) != FLASHC_STATUS_OK) {
            a->bad_status++;
            note(a->first_problem, sizeof a->first_problem, "workspace size query failed");
            return NULL;
        }
        ws_bytes = f > b ? f : b;
        if (ws_bytes) {
            ws = aligned_alloc(64, (ws_bytes + 63) / 64 * 64);
            if (!ws) return NULL;
        }
    }
    for (int it = 0; it < a->runs; it++) {
        memset(a->p.out, 0xff, QEL * sizeof(float)); /* NaN, so a call that writes nothing is caught */
        memset(a->p.dq, 0xff, QEL * sizeof(float));
        flashc_status st = run_forward(a->ctx, &a->p, ws, ws_bytes);
        const int do_bwd = it % 2 == 1 || it == a->runs - 1;
        if (st == FLASHC_STATUS_OK && do_bwd) st = run_backward(a->ctx, &a->p, ws, ws_bytes);
        if (st != FLASHC_STATUS_OK) {
            a->bad_status++;
            note(a->first_problem, sizeof a->first_problem, "run %d: %s", it, flashc_status_string(st));
            continue;
        }
        const char *bad = differs(&a->ref, &a->p, do_bwd);
        if (bad) {
            a->bad_bits++;
            note(a->first_problem, sizeof a->first_problem, "run %d: %s differs from the single-threaded run", it,
                 bad);
        }
    }
    free(ws);
    return NULL;
}

static void part_b(void) {
    flashc_context_t ctx = new_context();
    b_arg args[B_THREADS];
    memset(args, 0, sizeof args);
    /* References: the same calls, one after another, on the same context. */
    for (int i = 0; i < B_THREADS; i++) {
        args[i].id = i;
        args[i].ctx = ctx;
        args[i].runs = g_iters;
        problem_init(&args[i].p, i, 100u + 7u * (uint32_t)i);
        flashc_status st = run_forward(ctx, &args[i].p, NULL, 0);
        if (st == FLASHC_STATUS_OK) st = run_backward(ctx, &args[i].p, NULL, 0);
        check(st == FLASHC_STATUS_OK, "(b) single-threaded reference %d: %s %s", i, flashc_status_string(st),
              flashc_context_last_error(ctx));
        result_alloc(&args[i].ref);
        save(&args[i].ref, &args[i].p);
    }
    pthread_t th[B_THREADS];
    for (int i = 0; i < B_THREADS; i++)
        if (pthread_create(&th[i], NULL, b_main, &args[i])) {
            fprintf(stderr, "test_threads: pthread_create failed\n");
            exit(2);
        }
    for (int i = 0; i < B_THREADS; i++) pthread_join(th[i], NULL);
    static const char *variant[] = {"plain", "causal", "softcap", "window"};
    for (int i = 0; i < B_THREADS; i++) {
        check(!args[i].bad_status && !args[i].bad_bits,
              "(b) shared context, thread %d (%s, %s workspace): %d runs, %d failed, %d not bitwise the reference%s%s",
              i, variant[i % 4], i % 2 ? "own" : "library", args[i].runs, args[i].bad_status, args[i].bad_bits,
              args[i].first_problem[0] ? "; first: " : "", args[i].first_problem);
        result_free(&args[i].ref);
        problem_free(&args[i].p);
    }
    flashc_context_destroy(ctx);
}

/* ---- (c) one context, per-thread last error ----------------------------------------------------------------- */

enum { C_THREADS = 4 };
static pthread_barrier_t c_barrier;

typedef struct c_arg {
    int id;
    flashc_context_t ctx;
    problem p;
    int runs, failing_right, failing_wrong, ok_right, ok_wrong;
    char first_failing[800], first_ok[800];
} c_arg;

static void *c_main(void *argp) {
    c_arg *a = argp;
    char want[64];
    /* Thread 0 forgets q; thread 1 asks for a window of its own negative size. 2 and 3 only make good calls. */
    if (a->id == 1) snprintf(want, sizeof want, "window (%d,", -(100 + a->id));
    else snprintf(want, sizeof want, "q is NULL");
    pthread_barrier_wait(&c_barrier);
    for (int it = 0; it < a->runs; it++) {
        /* Many failing calls per good one (they are cheap: refused before any work), so that the failing threads'
         * messages keep crossing each other and the good calls of the others. */
        for (int f = 0; a->id < 2 && f < 16; f++) {
            flashc_status st;
            if (a->id == 0) {
                flashc_tensor tk = flashc_tensor_contiguous(a->p.k, FLASHC_DTYPE_F32, B, NK, H, D);
                flashc_tensor tv = flashc_tensor_contiguous(a->p.v, FLASHC_DTYPE_F32, B, NK, H, D);
                flashc_tensor to = flashc_tensor_contiguous(a->p.out, FLASHC_DTYPE_F32, B, NQ, H, D);
                st = flashc_forward(a->ctx, NULL, &tk, &tv, &a->p.params, &to, a->p.lse, NULL, 0);
            } else {
                flashc_params good = a->p.params;
                a->p.params.window_left = -(100 + a->id);
                st = run_forward(a->ctx, &a->p, NULL, 0);
                a->p.params = good;
            }
            if (f % 2) sched_yield(); /* lets the others make calls between this one and its read of the message */
            const char *msg = flashc_context_last_error(a->ctx);
            int ok = st == FLASHC_STATUS_INVALID_ARGUMENT && msg && strstr(msg, want);
            if (ok) a->failing_right++;
            else {
                a->failing_wrong++;
                note(a->first_failing, sizeof a->first_failing,
                     "run %d.%d: failing call gave %s, last error \"%s\" (wanted it to contain \"%s\")", it, f,
                     flashc_status_string(st), msg ? msg : "(null)", want);
            }
        }
        /* Everybody: a good call, after which the last error is "". */
        flashc_status st = it % 4 == 3 ? run_backward(a->ctx, &a->p, NULL, 0) : run_forward(a->ctx, &a->p, NULL, 0);
        if (it % 2) sched_yield();
        const char *msg = flashc_context_last_error(a->ctx);
        if (st == FLASHC_STATUS_OK && msg && msg[0] == '\0') a->ok_right++;
        else {
            a->ok_wrong++;
            note(a->first_ok, sizeof a->first_ok, "run %d: good call gave %s, last error \"%s\" (wanted \"\")",
                 it, flashc_status_string(st), msg ? msg : "(null)");
        }
    }
    return NULL;
}

static void part_c(void) {
    flashc_context_t ctx = new_context();
    c_arg args[C_THREADS];
    memset(args, 0, sizeof args);
    pthread_barrier_init(&c_barrier, NULL, C_THREADS);
    pthread_t th[C_THREADS];
    for (int i = 0; i < C_THREADS; i++) {
        args[i].id = i;
        args[i].ctx = ctx;
        args[i].runs = g_iters * 8;
        problem_init(&args[i].p, i, 900u + (uint32_t)i);
        /* First the backward needs a forward's out and lse. */
        if (run_forward(ctx, &args[i].p, NULL, 0) != FLASHC_STATUS_OK) {
            check(0, "(c) set-up forward %d: %s", i, flashc_context_last_error(ctx));
            return;
        }
    }
    for (int i = 0; i < C_THREADS; i++)
        if (pthread_create(&th[i], NULL, c_main, &args[i])) {
            fprintf(stderr, "test_threads: pthread_create failed\n");
            exit(2);
        }
    for (int i = 0; i < C_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&c_barrier);
    for (int i = 0; i < C_THREADS; i++) {
        if (i < 2)
            check(!args[i].failing_wrong, "(c) shared context, thread %d: its failing calls' last error names its own "
                  "mistake: %d of %d%s%s", i, args[i].failing_right, args[i].failing_right + args[i].failing_wrong,
                  args[i].failing_wrong ? "; first wrong: " : "", args[i].first_failing);
        check(!args[i].ok_wrong, "(c) shared context, thread %d: last error is \"\" after its good calls: %d of %d%s%s",
              i, args[i].ok_right, args[i].ok_right + args[i].ok_wrong,
              args[i].ok_wrong ? "; first wrong: " : "", args[i].first_ok);
        problem_free(&args[i].p);
    }
    flashc_context_destroy(ctx);
}

/* ---- (d) called from inside the caller's OpenMP parallel region ------------------------------------------- */

/* Four threads of the caller's own parallel region each run a forward and a backward at one library thread on a
 * context of their own: each result is bitwise the one a plain call gives. (A one-thread call runs without a region
 * of its own; inside the caller's region it must still not share its loops with the caller's threads.) */
static void part_d(void) {
#ifdef _OPENMP
    enum { NT = 4 };
    result want[4];
    for (int v = 0; v < 4; v++) {
        problem p;
        problem_init(&p, v, 4000u + (uint32_t)v);
        flashc_context_t ctx = new_context();
        flashc_context_set_threads(ctx, 1);
        if (run_forward(ctx, &p, NULL, 0) != FLASHC_STATUS_OK || run_backward(ctx, &p, NULL, 0) != FLASHC_STATUS_OK) {
            check(0, "(d) reference call: %s", flashc_context_last_error(ctx));
            exit(1);
        }
        result_alloc(&want[v]);
        save(&want[v], &p);
        flashc_context_destroy(ctx);
        problem_free(&p);
    }
    const char *bad[NT] = {0};
    int status[NT] = {0};
#pragma omp parallel num_threads(NT)
    {
        const int t = omp_get_thread_num();
        problem p;
        problem_init(&p, t % 4, 4000u + (uint32_t)(t % 4));
        flashc_context_t ctx = new_context();
        flashc_context_set_threads(ctx, 1);
        for (int it = 0; it < 4 && !bad[t] && !status[t]; it++) {
            status[t] = run_forward(ctx, &p, NULL, 0);
            if (!status[t]) status[t] = run_backward(ctx, &p, NULL, 0);
            if (!status[t]) bad[t] = differs(&want[t % 4], &p, 1);
        }
        flashc_context_destroy(ctx);
        problem_free(&p);
    }
    for (int t = 0; t < NT; t++)
        check(!status[t] && !bad[t], "(d) inside the caller's parallel region, thread %d: %s", t,
              status[t] ? "a call failed" : bad[t] ? bad[t] : "forward and backward bitwise as a plain call");
    for (int v = 0; v < 4; v++) result_free(&want[v]);
#else
    printf("(d) skipped: built without OpenMP\n");
#endif
}

int main(void) {
    g_omp_threads = env_int("FLASHC_TEST_OMP_THREADS", 2, 0, 64);
    g_iters = env_int("FLASHC_TEST_ITERS", 40, 1, 1000000);
    part_a(); /* first: the process has not called flashc yet */
    part_b();
    part_c();
    part_d();
    printf("test_threads: %d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
