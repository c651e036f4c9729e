/*
 * gpu_merge.cu - flashc_merge on the CUDA backend (ctest label gpu).
 *
 * The checks of tests/merge_common.h on device memory: against an fp64 merge in f32, f16 and bf16 over four layouts
 * (16-byte rows take the vectorized kernel; padded rows, an odd head dim and a stride along D the element-wise one)
 * and head dims from 1 to 256 (1 to 32 lanes per row), every kind of row (an empty part by lse +inf or -inf, both
 * empty, one dominating, a NaN lse), lse = NULL and in place; then the keys of a problem split in two, each half's
 * CUDA forward, merged, against the fp64 oracle (f16 and bf16, by CONVENTIONS.md's rule); a refused overlap that
 * writes nothing. Last, not a check: the merge's bandwidth beside a device-to-device copy. Exits non-zero on any
 * failure.
 */
#include "gpu_common.h"
#include "merge_common.h"

/* Bytes moved per second by a merge of B x N x H rows of D bf16 (reads out_a, out_b, lse_a, lse_b; writes out, lse),
 * beside cudaMemcpy of one part (read + write), median of 20 after a warm-up. */
static void bandwidth(flashc_context_t ctx, int64_t B, int64_t N, int64_t H, int64_t D) {
    const int64_t rows = B * N * H;
    const size_t bytes = (size_t)(rows * D) * 2, lbytes = (size_t)rows * 4;
    void *a, *b, *o;
    float *la, *lb, *lo;
    CHECK_CUDA(cudaMalloc(&a, bytes));
    CHECK_CUDA(cudaMalloc(&b, bytes));
    CHECK_CUDA(cudaMalloc(&o, bytes));
    CHECK_CUDA(cudaMalloc(&la, lbytes));
    CHECK_CUDA(cudaMalloc(&lb, lbytes));
    CHECK_CUDA(cudaMalloc(&lo, lbytes));
    fill_normal<<<1024, 256>>>(a, FLASHC_DTYPE_BF16, rows * D, 1, 1.f);
    fill_normal<<<1024, 256>>>(b, FLASHC_DTYPE_BF16, rows * D, 2, 1.f);
    fill_normal<<<1024, 256>>>(la, FLASHC_DTYPE_F32, rows, 3, 3.f);
    fill_normal<<<1024, 256>>>(lb, FLASHC_DTYPE_F32, rows, 4, 3.f);
    CHECK_CUDA(cudaGetLastError());
    const flashc_tensor ta = flashc_tensor_contiguous(a, FLASHC_DTYPE_BF16, B, N, H, D),
                        tb = flashc_tensor_contiguous(b, FLASHC_DTYPE_BF16, B, N, H, D),
                        to = flashc_tensor_contiguous(o, FLASHC_DTYPE_BF16, B, N, H, D);
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    float t_merge[20], t_copy[20];
    for (int rep = -3; rep < 20; rep++) {
        float ms;
        CHECK_CUDA(cudaEventRecord(e0, NULL));
        CHECK_FC(ctx, flashc_merge(ctx, &ta, la, &tb, lb, &to, lo));
        CHECK_CUDA(cudaEventRecord(e1, NULL));
        CHECK_CUDA(cudaEventSynchronize(e1));
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) t_merge[rep] = ms;
        CHECK_CUDA(cudaEventRecord(e0, NULL));
        CHECK_CUDA(cudaMemcpyAsync(o, a, bytes, cudaMemcpyDeviceToDevice, NULL));
        CHECK_CUDA(cudaEventRecord(e1, NULL));
        CHECK_CUDA(cudaEventSynchronize(e1));
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) t_copy[rep] = ms;
    }
    for (int i = 0; i < 20; i++) /* sort both for the medians */
        for (int j = i + 1; j < 20; j++) {
            if (t_merge[j] < t_merge[i]) { const float x = t_merge[i]; t_merge[i] = t_merge[j]; t_merge[j] = x; }
            if (t_copy[j] < t_copy[i]) { const float x = t_copy[i]; t_copy[i] = t_copy[j]; t_copy[j] = x; }
        }
    const double tm = t_merge[10] * 1e-3, tc = t_copy[10] * 1e-3;
    printf("bandwidth: merge of B %lld N %lld H %lld D %lld bf16: %.1f us, %.2f TB/s; device copy of one part %.1f us, "
           "%.2f TB/s\n", (long long)B, (long long)N, (long long)H, (long long)D, tm * 1e6,
           (3.0 * bytes + 3.0 * lbytes) / tm * 1e-12, tc * 1e6, 2.0 * bytes / tc * 1e-12);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(a), cudaFree(b), cudaFree(o), cudaFree(la), cudaFree(lb), cudaFree(lo);
}

/* One refused call on device memory: out shifted one element into out_a; nothing may be written. */
static void refusal(flashc_context_t ctx) {
    enum { N = 16, H = 2, D = 64, EL = N * H * D };
    uint16_t *buf;
    float *l;
    CHECK_CUDA(cudaMalloc(&buf, 3 * EL * 2));
    CHECK_CUDA(cudaMalloc(&l, 3 * N * H * 4));
    CHECK_CUDA(cudaMemset(buf, 0xff, 3 * EL * 2));
    const flashc_tensor ta = flashc_tensor_contiguous(buf, FLASHC_DTYPE_BF16, 1, N, H, D),
                        tb = flashc_tensor_contiguous(buf + EL, FLASHC_DTYPE_BF16, 1, N, H, D),
                        to = flashc_tensor_contiguous(buf + 1, FLASHC_DTYPE_BF16, 1, N, H, D);
    const flashc_status st = flashc_merge(ctx, &ta, l, &tb, l + N * H, &to, l + 2 * N * H);
    uint16_t *h = (uint16_t *)xmalloc(3 * EL * 2);
    CHECK_CUDA(cudaMemcpy(h, buf, 3 * EL * 2, cudaMemcpyDeviceToHost));
    int untouched = 1;
    for (int i = 0; i < 3 * EL; i++) untouched &= h[i] == 0xffffu;
    char what[256];
    snprintf(what, sizeof what, "out overlapping out_a is refused, nothing written (%s)",
             flashc_context_last_error(ctx));
    check(what, st == FLASHC_STATUS_INVALID_ARGUMENT && untouched);
    free(h);
    cudaFree(buf), cudaFree(l);
}

int main(void) {
    flashc_context_t ctx = gpu_test_context();
    static const flashc_case_memory mem = {dev_alloc, dev_free, to_device, to_host};
    static const flashc_dtype dtypes[3] = {FLASHC_DTYPE_F32, FLASHC_DTYPE_F16, FLASHC_DTYPE_BF16};
    for (int ti = 0; ti < 3; ti++) {
        for (int layout = 0; layout < LAYOUTS; layout++)
            merge_against_fp64(ctx, &mem, dtypes[ti], layout, 2, 29, 3, 64);
        static const int64_t dims[] = {1, 8, 36, 40, 128, 256};
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            merge_against_fp64(ctx, &mem, dtypes[ti], LAYOUT_BNHD, 3, 41, 5, dims[di]);
    }
    merge_against_fp64(ctx, &mem, FLASHC_DTYPE_BF16, LAYOUT_BNHD, 4, 512, 16, 128); /* many blocks */
    for (int ti = 1; ti < 3; ti++) {
        const flashc_dtype t = dtypes[ti];
        merge_against_forward(ctx, &mem, t, 2, 256, 256, 4, 2, 128, 1, 100); /* the second half's first rows see none */
        merge_against_forward(ctx, &mem, t, 2, 77, 600, 4, 2, 64, 0, 250);
        merge_against_forward(ctx, &mem, t, 4, 1, 1000, 8, 2, 128, 1, 384);  /* decode, GQA */
        merge_against_forward(ctx, &mem, t, 2, 40, 24, 4, 2, 64, 1, 10);     /* the first 16 rows see no key at all */
    }
    refusal(ctx);
    bandwidth(ctx, 8, 4096, 32, 128);
    flashc_context_destroy(ctx);
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed != 0;
}
