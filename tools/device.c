/*
 * device.c - host or device memory, and timing, for the backend a command runs on.
 *
 * The library's public header carries no CUDA types and has no copy helpers, so moving tensors to a GPU needs
 * the CUDA runtime here. That part is compiled only when the build defines FLASHC_WITH_CUDA for the command
 * (and links cudart); without it every command runs on the CPU backend and says so when asked for CUDA.
 */
#include "cli.h"
#include "ref/testkit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FLASHC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

int cli_cuda_runtime(void) {
#ifdef FLASHC_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

flashc_backend cli_resolve_backend(flashc_backend requested) {
    if (requested != FLASHC_BACKEND_AUTO) return requested;
    if (cli_cuda_runtime() && flashc_backend_compiled(FLASHC_BACKEND_CUDA) &&
        flashc_device_count(FLASHC_BACKEND_CUDA) > 0)
        return FLASHC_BACKEND_CUDA;
    return FLASHC_BACKEND_CPU;
}

int cli_backend_usable(const char *cmd, flashc_backend b, int device) {
    if (b == FLASHC_BACKEND_CPU) return 0;
    if (!flashc_backend_compiled(FLASHC_BACKEND_CUDA)) {
        cli_fail(cmd, "this libflashc was built without the CUDA backend");
        return -1;
    }
    if (!cli_cuda_runtime()) {
        cli_fail(cmd, "this flashc command was built without the CUDA runtime, so it runs the CPU backend only "
                      "(use --backend cpu)");
        return -1;
    }
    int n = flashc_device_count(FLASHC_BACKEND_CUDA);
    if (device < 0 || device >= n) {
        cli_fail(cmd, "CUDA device %d not found (%d GPU%s visible)", device, n, n == 1 ? "" : "s");
        return -1;
    }
    return 0;
}

#ifdef FLASHC_WITH_CUDA
static int cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    fprintf(stderr, "flashc: %s: %s\n", what, cudaGetErrorString(e));
    return -1;
}
#endif

void *cli_mem_alloc(flashc_backend b, size_t bytes) {
    if (bytes == 0) bytes = 1;
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA) {
        void *p = NULL;
        return cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc") == 0 ? p : NULL;
    }
#endif
    (void)b;
    return malloc(bytes);
}

void cli_mem_free(flashc_backend b, void *ptr) {
    if (!ptr) return;
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA) {
        cudaFree(ptr);
        return;
    }
#endif
    (void)b;
    free(ptr);
}

int cli_mem_to_backend(flashc_backend b, void *dst, const void *src, size_t bytes) {
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA) return cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
#endif
    (void)b;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

int cli_mem_to_host(flashc_backend b, void *dst, const void *src, size_t bytes) {
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA) return cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
#endif
    (void)b;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

int cli_set_device(flashc_backend b, int device) {
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA) return cuda_ok(cudaSetDevice(device), "cudaSetDevice");
#endif
    (void)b;
    (void)device;
    return 0;
}

#ifdef FLASHC_WITH_CUDA
static void *case_cuda_alloc(size_t bytes) { return cli_mem_alloc(FLASHC_BACKEND_CUDA, bytes); }
static void case_cuda_free(void *p) { cli_mem_free(FLASHC_BACKEND_CUDA, p); }
static int case_cuda_to_device(void *dst, const void *src, size_t bytes) {
    return cli_mem_to_backend(FLASHC_BACKEND_CUDA, dst, src, bytes);
}
static int case_cuda_to_host(void *dst, const void *src, size_t bytes) {
    return cli_mem_to_host(FLASHC_BACKEND_CUDA, dst, src, bytes);
}
#endif

void cli_case_memory(flashc_backend b) {
#ifdef FLASHC_WITH_CUDA
    static const flashc_case_memory cuda_mem = {case_cuda_alloc, case_cuda_free, case_cuda_to_device,
                                                case_cuda_to_host};
    if (b == FLASHC_BACKEND_CUDA) {
        flashc_case_set_memory(&cuda_mem);
        return;
    }
#endif
    (void)b;
    flashc_case_set_memory(NULL);
}

/* ---- timing --------------------------------------------------------------------------------------------------- */

struct cli_timer {
    flashc_backend backend;
    double t0;
#ifdef FLASHC_WITH_CUDA
    cudaEvent_t start, stop;
#endif
};

cli_timer *cli_timer_create(flashc_backend b) {
    cli_timer *t = (cli_timer *)calloc(1, sizeof *t);
    if (!t) return NULL;
    t->backend = b;
#ifdef FLASHC_WITH_CUDA
    if (b == FLASHC_BACKEND_CUDA &&
        (cuda_ok(cudaEventCreate(&t->start), "cudaEventCreate") != 0 ||
         cuda_ok(cudaEventCreate(&t->stop), "cudaEventCreate") != 0)) {
        free(t);
        return NULL;
    }
#endif
    return t;
}

void cli_timer_start(cli_timer *t) {
#ifdef FLASHC_WITH_CUDA
    if (t->backend == FLASHC_BACKEND_CUDA) {
        cudaEventRecord(t->start, 0);
        return;
    }
#endif
    t->t0 = cli_now();
}

double cli_timer_stop(cli_timer *t) {
#ifdef FLASHC_WITH_CUDA
    if (t->backend == FLASHC_BACKEND_CUDA) {
        float ms = 0.0f;
        if (cuda_ok(cudaEventRecord(t->stop, 0), "cudaEventRecord") != 0 ||
            cuda_ok(cudaEventSynchronize(t->stop), "cudaEventSynchronize") != 0 ||
            cuda_ok(cudaEventElapsedTime(&ms, t->start, t->stop), "cudaEventElapsedTime") != 0)
            return -1.0;
        return 1e-3 * (double)ms;
    }
#endif
    return cli_now() - t->t0;
}

void cli_timer_destroy(cli_timer *t) {
    if (!t) return;
#ifdef FLASHC_WITH_CUDA
    if (t->backend == FLASHC_BACKEND_CUDA) {
        cudaEventDestroy(t->start);
        cudaEventDestroy(t->stop);
    }
#endif
    free(t);
}
