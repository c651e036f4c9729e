/*
 * benchlib.h - two or more builds of libflashc in one process, for the A/B benchmarks (cpu_bwd_ab.c, decode_ab.c):
 * the entry points they call, each build dlopen'ed with RTLD_LOCAL so that builds of the same symbols live side by
 * side, and the clock both use (wall, or with cpu_clock set process CPU time / nthreads: what a run would take with
 * its cores to itself on a machine shared with other jobs). Header-only (static); link with -ldl.
 */
#ifndef FLASHC_BENCHLIB_H
#define FLASHC_BENCHLIB_H

#include "flashc.h"

#include <dlfcn.h>
#include <stdio.h>
#include <time.h>

typedef struct lib {
    const char *path;
    flashc_status (*context_create)(flashc_context_t *, flashc_backend, int);
    void (*context_destroy)(flashc_context_t);
    flashc_status (*set_threads)(flashc_context_t, int);
    const char *(*last_error)(flashc_context_t);
    flashc_params (*params_default)(void);
    flashc_tensor (*tensor_contiguous)(void *, flashc_dtype, int64_t, int64_t, int64_t, int64_t);
    flashc_status (*fwd_ws)(flashc_context_t, const flashc_tensor *, const flashc_tensor *, const flashc_tensor *,
                            const flashc_params *, size_t *);
    flashc_status (*bwd_ws)(flashc_context_t, const flashc_tensor *, const flashc_tensor *, const flashc_tensor *,
                            const flashc_params *, size_t *);
    flashc_status (*forward)(flashc_context_t, const flashc_tensor *, const flashc_tensor *, const flashc_tensor *,
                             const flashc_params *, const flashc_tensor *, float *, void *, size_t);
    flashc_status (*backward)(flashc_context_t, const flashc_tensor *, const flashc_tensor *, const flashc_tensor *,
                              const flashc_tensor *, const flashc_tensor *, const float *, const flashc_params *,
                              const flashc_tensor *, const flashc_tensor *, const flashc_tensor *, void *, size_t);
    flashc_context_t ctx;
} lib;

static int cpu_clock, nthreads = 1;
static double now(void) {
    struct timespec t;
    clock_gettime(cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return ((double)t.tv_sec + 1e-9 * (double)t.tv_nsec) / (cpu_clock ? nthreads : 1);
}

/* l->path's build: its entry points and a CPU context on `threads` threads; prog names the caller in messages. */
#define SYM(field, name)                                                                                              \
    if (!(*(void **)&l->field = dlsym(h, name))) {                                                                    \
        fprintf(stderr, "%s: no %s\n", l->path, name);                                                                \
        return 1;                                                                                                     \
    }
static int lib_open(lib *l, int threads, const char *prog) {
    void *h = dlopen(l->path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "%s: %s\n", prog, dlerror());
        return 1;
    }
    SYM(context_create, "flashc_context_create")
    SYM(context_destroy, "flashc_context_destroy")
    SYM(set_threads, "flashc_context_set_threads")
    SYM(last_error, "flashc_context_last_error")
    SYM(params_default, "flashc_params_default")
    SYM(tensor_contiguous, "flashc_tensor_contiguous")
    SYM(fwd_ws, "flashc_forward_workspace_size")
    SYM(bwd_ws, "flashc_backward_workspace_size")
    SYM(forward, "flashc_forward")
    SYM(backward, "flashc_backward")
    if (l->context_create(&l->ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK ||
        l->set_threads(l->ctx, threads) != FLASHC_STATUS_OK) {
        fprintf(stderr, "%s: cannot set up a CPU context\n", l->path);
        return 1;
    }
    return 0;
}
#undef SYM

#endif
