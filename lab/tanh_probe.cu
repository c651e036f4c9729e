// tanh_probe.cu - the error of the CUDA kernels' tanh (common.cuh's fc_tanh) against tanh in fp64, over a dense
// grid of [-20, 20]: max absolute and max relative error. nvcc -O3 -arch=sm_90a -Isrc lab/tanh_probe.cu
#include "cuda/common.cuh"

#include <cmath>
#include <cstdio>

/* the form fc_tanh replaced: 1 - 2 / (e^2x + 1) */
__device__ float old_tanh(float x) { return 1.f - __fdividef(2.f, fc_exp2(x * (2.f * FC_LOG2E)) + 1.f); }

__global__ void probe(const float *x, float *y, int n, int which) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = which ? old_tanh(x[i]) : fc_tanh(x[i]);
}

int main() {
    const int n = 1 << 24;
    float *x, *y;
    cudaMallocManaged(&x, n * sizeof(float));
    cudaMallocManaged(&y, n * sizeof(float));
    for (int i = 0; i < n; i++) x[i] = -20.f + 40.f * (float)i / (float)n;
    for (int which = 0; which < 2; which++) {
    probe<<<(n + 255) / 256, 256>>>(x, y, n, which);
    cudaDeviceSynchronize();
    double abs_err = 0, rel_err = 0, at_abs = 0, at_rel = 0;
    for (int i = 0; i < n; i++) {
        const double t = std::tanh((double)x[i]), e = std::fabs(y[i] - t);
        if (e > abs_err) abs_err = e, at_abs = x[i];
        if (t != 0 && e / std::fabs(t) > rel_err) rel_err = e / std::fabs(t), at_rel = x[i];
    }
    std::printf("%s over [-20, 20], %d points: max abs error %.3g (2^%.2f) at %g, max rel error %.3g (2^%.2f) at %g\n",
                which ? "1 - 2 / (e^2x + 1)" : "fc_tanh (tanh.approx)", n, abs_err, std::log2(abs_err), at_abs, rel_err, std::log2(rel_err), at_rel);
    }
    return 0;
}
