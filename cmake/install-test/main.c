/*
 * main.c - a program outside the flashc tree, linked against an installed libflashc (run.sh builds it through
 * pkg-config and through find_package). It runs one small attention on the CPU backend and checks one output row
 * against a direct computation, and asks how many GPUs the CUDA backend sees: with the static library that call
 * goes through the CUDA runtime linked in from libcudart_static, so a missing link dependency fails the link.
 */
#include <flashc.h>

#include <math.h>
#include <stdio.h>

enum { N = 5, D = 4 }; /* B 1, H 1 */

int main(void) {
    float q[N * D], k[N * D], v[N * D], o[N * D];
    for (int i = 0; i < N * D; i++) {
        q[i] = (float)sin(0.7 * i);
        k[i] = (float)cos(0.3 * i);
        v[i] = (float)(i % 7) - 3.0f;
    }
    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    const flashc_tensor tq = flashc_tensor_contiguous(q, FLASHC_DTYPE_F32, 1, N, 1, D);
    const flashc_tensor tk = flashc_tensor_contiguous(k, FLASHC_DTYPE_F32, 1, N, 1, D);
    const flashc_tensor tv = flashc_tensor_contiguous(v, FLASHC_DTYPE_F32, 1, N, 1, D);
    const flashc_tensor to = flashc_tensor_contiguous(o, FLASHC_DTYPE_F32, 1, N, 1, D);
    const flashc_params prm = flashc_params_default();
    if (flashc_forward(ctx, &tq, &tk, &tv, &prm, &to, NULL, NULL, 0) != FLASHC_STATUS_OK) {
        fprintf(stderr, "forward: %s\n", flashc_context_last_error(ctx));
        return 1;
    }
    flashc_context_destroy(ctx);

    /* the last query row, which sees every key */
    double s[N], m = -INFINITY, sum = 0.0, err = 0.0;
    for (int j = 0; j < N; j++) {
        s[j] = 0.0;
        for (int d = 0; d < D; d++) s[j] += (double)q[(N - 1) * D + d] * k[j * D + d] / sqrt((double)D);
        m = s[j] > m ? s[j] : m;
    }
    for (int j = 0; j < N; j++) sum += (s[j] = exp(s[j] - m));
    for (int d = 0; d < D; d++) {
        double ref = 0.0;
        for (int j = 0; j < N; j++) ref += s[j] / sum * v[j * D + d];
        err = fmax(err, fabs(ref - o[(N - 1) * D + d]));
    }
    printf("flashc %s: cpu forward max error %.1e; cuda backend %s, %d GPU(s)\n", flashc_version(), err,
           flashc_backend_compiled(FLASHC_BACKEND_CUDA) ? "compiled" : "not compiled",
           flashc_device_count(FLASHC_BACKEND_CUDA));
    return err < 1e-5 ? 0 : 1;
}
