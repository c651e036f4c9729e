/*
 * gpu_rotary.cu - flashc_rotary on the CUDA backend (ctest label gpu).
 *
 * The case table of tests/rotary_common.h on device memory: f32, f16 and bf16 with fp32 tables or tables in x's dtype,
 * GPT-NeoX halves and GPT-J pairs, R = D and R < D, four layouts of x, out in place or elsewhere, seq_start NULL or per
 * sequence: the whole out buffer bit for bit the documented formula (nothing outside the view written) and bit for
 * bit the CPU backend's result on host copies; rows whose positions lie outside the tables come out NaN in their first
 * R elements. Then a refused call on device memory that writes nothing, one rotation on a non-default stream, and,
 * not a check, the rotation's bandwidth beside a device-to-device copy. Exits non-zero on any failure.
 */
#include "gpu_common.h"
#include "rotary_common.h"

/* out shifted one element into x on device memory: refused by the front, nothing written. */
static void refusal(flashc_context_t ctx) {
    enum { N = 8, H = 2, D = 32, HALF = 8, EL = N * H * D };
    float *buf, *tab;
    CHECK_CUDA(cudaMalloc(&buf, 2 * EL * 4));
    CHECK_CUDA(cudaMalloc(&tab, 2 * N * HALF * 4));
    CHECK_CUDA(cudaMemset(buf, 0x3f, 2 * EL * 4));
    CHECK_CUDA(cudaMemset(tab, 0, 2 * N * HALF * 4));
    const flashc_tensor tx = flashc_tensor_contiguous(buf, FLASHC_DTYPE_F32, 1, N, H, D),
                        to = flashc_tensor_contiguous(buf + 1, FLASHC_DTYPE_F32, 1, N, H, D),
                        tc = flashc_tensor_contiguous(tab, FLASHC_DTYPE_F32, 1, N, 1, HALF),
                        ts = flashc_tensor_contiguous(tab + N * HALF, FLASHC_DTYPE_F32, 1, N, 1, HALF);
    const flashc_status st = flashc_rotary(ctx, &tx, &tc, &ts, NULL, 0, &to);
    CHECK_CUDA(cudaDeviceSynchronize());
    uint32_t *h = (uint32_t *)xmalloc(2 * EL * 4);
    CHECK_CUDA(cudaMemcpy(h, buf, 2 * EL * 4, cudaMemcpyDeviceToHost));
    int same = 1;
    for (int i = 0; i < 2 * EL; i++) same &= h[i] == 0x3f3f3f3fu;
    check("refused on device memory: out shifted one element into x (INVALID_ARGUMENT, nothing written)",
          st == FLASHC_STATUS_INVALID_ARGUMENT && same);
    free(h);
    cudaFree(buf), cudaFree(tab);
}

/* One in-place rotation on a stream of its own (set on the context), compared with the CPU backend's. */
static void on_stream(flashc_context_t ctx, flashc_context_t cpu) {
    enum { B = 2, N = 64, H = 4, D = 64, HALF = 32, P = 128, EL = B * N * H * D };
    uint16_t *xh = (uint16_t *)xmalloc(EL * 2), *got = (uint16_t *)xmalloc(EL * 2);
    float *th = (float *)xmalloc(2 * P * HALF * 4);
    uint64_t rng = 5;
    for (int i = 0; i < EL; i++) xh[i] = flashc_f32_to_bf16((float)flashc_rand_normal(&rng));
    for (int i = 0; i < P * HALF; i++) th[i] = (float)cos(0.03 * i), th[P * HALF + i] = (float)sin(0.03 * i);
    const int32_t starts[B] = {3, 64};
    uint16_t *xd;
    float *td;
    int32_t *sd;
    CHECK_CUDA(cudaMalloc(&xd, EL * 2));
    CHECK_CUDA(cudaMalloc(&td, 2 * P * HALF * 4));
    CHECK_CUDA(cudaMalloc(&sd, sizeof starts));
    CHECK_CUDA(cudaMemcpy(xd, xh, EL * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(td, th, 2 * P * HALF * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(sd, starts, sizeof starts, cudaMemcpyHostToDevice));
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_FC(ctx, flashc_context_set_stream(ctx, s));
    const flashc_tensor tx = flashc_tensor_contiguous(xd, FLASHC_DTYPE_BF16, B, N, H, D),
                        tc = flashc_tensor_contiguous(td, FLASHC_DTYPE_F32, 1, P, 1, HALF),
                        ts = flashc_tensor_contiguous(td + P * HALF, FLASHC_DTYPE_F32, 1, P, 1, HALF);
    CHECK_FC(ctx, flashc_rotary(ctx, &tx, &tc, &ts, sd, 0, &tx));
    CHECK_CUDA(cudaStreamSynchronize(s));
    CHECK_FC(ctx, flashc_context_set_stream(ctx, NULL));
    CHECK_CUDA(cudaMemcpy(got, xd, EL * 2, cudaMemcpyDeviceToHost));
    const flashc_tensor hx = flashc_tensor_contiguous(xh, FLASHC_DTYPE_BF16, B, N, H, D),
                        hc = flashc_tensor_contiguous(th, FLASHC_DTYPE_F32, 1, P, 1, HALF),
                        hs = flashc_tensor_contiguous(th + P * HALF, FLASHC_DTYPE_F32, 1, P, 1, HALF);
    CHECK_FC(cpu, flashc_rotary(cpu, &hx, &hc, &hs, starts, 0, &hx));
    check("in place on a non-default stream (bf16, a sequence ending at the tables' last row): the CPU's bits",
          !memcmp(got, xh, EL * 2));
    CHECK_CUDA(cudaStreamDestroy(s));
    cudaFree(xd), cudaFree(td), cudaFree(sd);
    free(xh), free(got), free(th);
}

/* Bytes moved per second by a rotation of a (B, N, H, D) bf16 tensor into another (reads x, writes out; R = D, fp32
 * tables of 4096 positions), beside cudaMemcpy of x, median of 20 after a warm-up. */
static void bandwidth(flashc_context_t ctx, int64_t B, int64_t N, int64_t H, int64_t D, int interleaved) {
    const int64_t P = 4096, half = D / 2;
    const size_t bytes = (size_t)(B * N * H * D) * 2;
    void *x, *o;
    float *t;
    int32_t *sd;
    CHECK_CUDA(cudaMalloc(&x, bytes));
    CHECK_CUDA(cudaMalloc(&o, bytes));
    CHECK_CUDA(cudaMalloc(&t, (size_t)(2 * P * half) * 4));
    CHECK_CUDA(cudaMalloc(&sd, (size_t)B * 4));
    CHECK_CUDA(cudaMemset(sd, 0, (size_t)B * 4));
    fill_normal<<<1024, 256>>>(x, FLASHC_DTYPE_BF16, B * N * H * D, 1, 1.f);
    fill_normal<<<1024, 256>>>(t, FLASHC_DTYPE_F32, 2 * P * half, 2, 1.f);
    CHECK_CUDA(cudaGetLastError());
    const flashc_tensor tx = flashc_tensor_contiguous(x, FLASHC_DTYPE_BF16, B, N, H, D),
                        to = flashc_tensor_contiguous(o, FLASHC_DTYPE_BF16, B, N, H, D),
                        tc = flashc_tensor_contiguous(t, FLASHC_DTYPE_F32, 1, P, 1, half),
                        ts = flashc_tensor_contiguous(t + P * half, FLASHC_DTYPE_F32, 1, P, 1, half);
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    float t_rot[20], t_copy[20];
    for (int rep = -3; rep < 20; rep++) {
        float ms;
        CHECK_CUDA(cudaEventRecord(e0, NULL));
        CHECK_FC(ctx, flashc_rotary(ctx, &tx, &tc, &ts, sd, interleaved, &to));
        CHECK_CUDA(cudaEventRecord(e1, NULL));
        CHECK_CUDA(cudaEventSynchronize(e1));
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) t_rot[rep] = ms;
        CHECK_CUDA(cudaEventRecord(e0, NULL));
        CHECK_CUDA(cudaMemcpyAsync(o, x, bytes, cudaMemcpyDeviceToDevice, NULL));
        CHECK_CUDA(cudaEventRecord(e1, NULL));
        CHECK_CUDA(cudaEventSynchronize(e1));
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) t_copy[rep] = ms;
    }
    for (int i = 0; i < 20; i++) /* sort both for the medians */
        for (int j = i + 1; j < 20; j++) {
            if (t_rot[j] < t_rot[i]) { const float v = t_rot[i]; t_rot[i] = t_rot[j]; t_rot[j] = v; }
            if (t_copy[j] < t_copy[i]) { const float v = t_copy[i]; t_copy[i] = t_copy[j]; t_copy[j] = v; }
        }
    const double tr = t_rot[10] * 1e-3, tcp = t_copy[10] * 1e-3;
    printf("bandwidth: rotary (%s) of B %lld N %lld H %lld D %lld bf16: %.1f us, %.2f TB/s; device copy %.1f us, "
           "%.2f TB/s\n", interleaved ? "interleaved" : "halves",
           (long long)B, (long long)N, (long long)H, (long long)D, tr * 1e6, 2.0 * bytes / tr * 1e-12, tcp * 1e6,
           2.0 * bytes / tcp * 1e-12);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(x), cudaFree(o), cudaFree(t), cudaFree(sd);
}

int main(void) {
    flashc_context_t ctx = gpu_test_context(), cpu;
    if (flashc_context_create(&cpu, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "CPU context: %s\n", flashc_context_last_error(NULL));
        return 2;
    }
    static const flashc_case_memory mem = {dev_alloc, dev_free, to_device, to_host};
    rotary_cases(ctx, &mem, cpu);
    refusal(ctx);
    on_stream(ctx, cpu);
    bandwidth(ctx, 1, 8192, 32, 128, 0);
    bandwidth(ctx, 1, 8192, 32, 128, 1);
    bandwidth(ctx, 16, 1, 8, 128, 0); /* a decode step's keys: launch-bound */
    flashc_context_destroy(cpu);
    flashc_context_destroy(ctx);
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed ? 1 : 0;
}
