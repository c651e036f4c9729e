/*
 * gpu_common.h - what the GPU test programs share: check macros (tests may exit on failure) and the device-memory
 * hooks through which the case runner (src/ref/testkit.h) allocates and copies the tensors.
 */
#ifndef FLASHC_TESTS_GPU_COMMON_H
#define FLASHC_TESTS_GPU_COMMON_H

#include "flashc.h"
#include "ref/testkit.h"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK_CUDA(call)                                                                                     \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));           \
            exit(2);                                                                                         \
        }                                                                                                    \
    } while (0)
#define CHECK_FC(ctx, call)                                                                                  \
    do {                                                                                                     \
        flashc_status s_ = (call);                                                                           \
        if (s_ != FLASHC_STATUS_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, flashc_status_string(s_),     \
                    flashc_context_last_error(ctx));                                                         \
            exit(2);                                                                                         \
        }                                                                                                    \
    } while (0)

/* ---- memory hooks for the case runner ----------------------------------------------------------------- */

static void *dev_alloc(size_t n) {
    void *p = NULL;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}
static void dev_free(void *p) { cudaFree(p); }
static int to_device(void *d, const void *s, size_t n) {
    return cudaMemcpy(d, s, n, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
}
static int to_host(void *d, const void *s, size_t n) {
    return cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
}

/* A context on GPU 0 whose case runs allocate on the device; prints the device's name. Exits on failure. */
static flashc_context_t gpu_test_context(void) {
    flashc_context_t ctx = NULL;
    CHECK_FC(NULL, flashc_context_create(&ctx, FLASHC_BACKEND_CUDA, 0));
    char name[256];
    CHECK_FC(NULL, flashc_device_name(FLASHC_BACKEND_CUDA, 0, name, sizeof name));
    printf("device: %s\n", name);
    static const flashc_case_memory mem = {dev_alloc, dev_free, to_device, to_host};
    flashc_case_set_memory(&mem);
    return ctx;
}

#endif /* FLASHC_TESTS_GPU_COMMON_H */
