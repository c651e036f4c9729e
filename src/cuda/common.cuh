/*
 * common.cuh - the small device helpers that every tensor-core kernel uses, of either generation (fwd_sm80.cuh,
 * bwd_sm80.cuh, sm90.cuh and the Hopper kernels): the shared-memory opt-in and address, exp2 and tanh as the
 * scores need them, and the rounding of fp32 accumulators to the 16-bit operand type. C++ (nvcc) only.
 */
#ifndef FLASHC_CUDA_COMMON_CUH
#define FLASHC_CUDA_COMMON_CUH

#include "score.h" /* FC_LOG2E */

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* cudaFuncSetAttribute(Kernel, MaxDynamicSharedMemorySize, bytes) once per kernel and device: a call costs about
 * 2 us of host time, and before a launch at a small shape that is time the GPU waits (the backward asked it 15
 * times per call). Kernel is the kernel's address, so that every kernel keeps its own record. */
template <auto Kernel>
static cudaError_t fc_smem_optin(int bytes) {
    static int done[64]; /* per device: the bytes already set, 0 before */
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const bool known = dev >= 0 && dev < 64;
    if (known && __atomic_load_n(&done[dev], __ATOMIC_ACQUIRE) == bytes) return cudaSuccess;
    e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess && known) __atomic_store_n(&done[dev], bytes, __ATOMIC_RELEASE);
    return e;
}

static __device__ __forceinline__ uint32_t fc_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* ex2.approx.ftz.f32: 2^x with ~2 ulp relative error; 2^-inf = +0, which the masked scores rely on. */
static __device__ __forceinline__ float fc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* tanh for the softcapped score: the special-function unit's tanh.approx.f32, one instruction (the form before it,
 * 1 - 2 / (e^2x + 1), took two, an ex2 and a reciprocal, beside the softmax's ex2: the softcap forward ran at the
 * special-function unit's rate). Its error, measured over [-20, 20] against tanh in fp64 (lab/tanh_probe.cu):
 * see bench/RESULTS.md; the score c tanh(s / c) carries c times it. Forward and backward call the same function,
 * so the backward's P is the forward's. */
static __device__ __forceinline__ float fc_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Two floats to a packed pair of the operand type, round to nearest even; lo goes to the low half (lower k). */
template <int BF>
static __device__ __forceinline__ uint32_t fc_pack2(float lo, float hi) {
    uint32_t u;
    if (BF) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        u = *(const uint32_t *)&v;
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        u = *(const uint32_t *)&v;
    }
    return u;
}
/* fc_pack2's inverse: the two values of a packed pair as floats (lo in .x). */
template <int BF>
static __device__ __forceinline__ float2 fc_unpack2(uint32_t u) {
    if (BF) return __bfloat1622float2(*(const __nv_bfloat162 *)&u);
    return __half22float2(*(const __half2 *)&u);
}
template <int BF>
static __device__ __forceinline__ uint16_t fc_round16(float x) {
    return BF ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

#endif /* FLASHC_CUDA_COMMON_CUH */
