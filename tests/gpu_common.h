/*
 * gpu_common.h - what the GPU test programs share: check macros (tests may exit on failure) and the device-memory
 * hooks through which the case runner (src/ref/testkit.h) allocates and copies the tensors.
 */
#ifndef FLASHC_TESTS_GPU_COMMON_H
#define FLASHC_TESTS_GPU_COMMON_H

#include "flashc.h"
#include "ref/testkit.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
/* The two-sequence varlen problem of the NaN-neighbour tests (gpu_fwd, gpu_bwd): sequences of VL_L0 and VL_L1 rows
 * packed into VL_T, VL_H heads; its cu_seqlens on the device, and params naming them for q and k alike. */
enum { VL_H = 2, VL_L0 = 100, VL_L1 = 300, VL_T = VL_L0 + VL_L1 };
static int32_t *varlen_pair_cu(void) {
    const int32_t cu[3] = {0, VL_L0, VL_T};
    int32_t *dcu;
    CHECK_CUDA(cudaMalloc(&dcu, sizeof cu));
    CHECK_CUDA(cudaMemcpy(dcu, cu, sizeof cu, cudaMemcpyHostToDevice));
    return dcu;
}
static flashc_params varlen_pair_params(const int32_t *dcu) {
    flashc_params prm = flashc_params_default();
    prm.cu_seqlens_q = prm.cu_seqlens_k = dcu;
    prm.num_seqs = 2;
    prm.max_seqlen_q = prm.max_seqlen_k = VL_L1;
    return prm;
}

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

/* The kernels a test went through, by flashc_kernel_name, so that it asserts the paths it means to exercise. */
typedef struct kernel_tally {
    const char *name[32];
    int count[32];
    int n;
} kernel_tally;

static void tally_add(kernel_tally *t, const char *kernel) {
    if (!kernel) kernel = "(none)";
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->name[i], kernel)) {
            t->count[i]++;
            return;
        }
    if (t->n < 32) t->name[t->n] = kernel, t->count[t->n++] = 1;
}

/* Cases whose kernel name starts with prefix. */
static int tally_count(const kernel_tally *t, const char *prefix) {
    int c = 0;
    for (int i = 0; i < t->n; i++)
        if (!strncmp(t->name[i], prefix, strlen(prefix))) c += t->count[i];
    return c;
}

static int tally_total(const kernel_tally *t) { return tally_count(t, ""); }

static void tally_print(const char *what, const kernel_tally *t) {
    for (int i = 0; i < t->n; i++) printf("     %s: %4d x %s\n", what, t->count[i], t->name[i]);
}

/* 1 when device 0 is a Hopper GPU (compute capability 9.0), where the sm90 kernels must run. */
static int gpu_is_hopper(void) {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    return prop.major == 9 && prop.minor == 0;
}

/* A context created with NAME=VALUE in the environment (the CUDA backend reads its switches once per context). */
static flashc_context_t gpu_context_with(const char *name, const char *value) {
    const char *was = getenv(name);
    char *saved = was ? strdup(was) : NULL;
    setenv(name, value, 1);
    flashc_context_t ctx = NULL;
    CHECK_FC(NULL, flashc_context_create(&ctx, FLASHC_BACKEND_CUDA, 0));
    if (saved) setenv(name, saved, 1);
    else unsetenv(name);
    free(saved);
    return ctx;
}

/* Pseudo-normal values (hash + Box-Muller) of index i, so that inputs are written straight on the GPU: multi-GB
 * tensors without host traffic, and the same values for any launch shape. */
static __device__ float hash_normal(int64_t i, uint64_t seed) {
    uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u1 = ((float)(uint32_t)(z >> 40) + 1.f) * (1.f / 16777217.f);
    const float u2 = (float)(uint32_t)(z & 0xffffff) * (1.f / 16777216.f);
    return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

/* n elements of scale x hash_normal in dtype dt (rounded to nearest even). */
static __global__ void fill_normal(void *x, flashc_dtype dt, int64_t n, uint64_t seed, float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = scale * hash_normal(i, seed);
        if (dt == FLASHC_DTYPE_F32) ((float *)x)[i] = v;
        else if (dt == FLASHC_DTYPE_F16) ((__half *)x)[i] = __float2half_rn(v);
        else ((__nv_bfloat16 *)x)[i] = __float2bfloat16_rn(v);
    }
}

#endif /* FLASHC_TESTS_GPU_COMMON_H */
