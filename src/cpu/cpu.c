/*
 * The CPU backend's vtable and shared pieces: feature detection, thread count, tile sizes, strided tile loads
 * and stores with dtype conversion, the score epilogue (softcap, ALiBi, masks) and varlen checks.
 */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#  include <omp.h>
#endif

/* ---- features, threads, tiles -------------------------------------------------------------------------- */

const char *flashc_cpu_features(void) {
    static char buf[128];
    if (buf[0]) return buf;
    char tmp[128] = "";
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) strcat(tmp, "sse4.2 ");
    if (__builtin_cpu_supports("avx")) strcat(tmp, "avx ");
    if (__builtin_cpu_supports("avx2")) strcat(tmp, "avx2 ");
    if (__builtin_cpu_supports("fma")) strcat(tmp, "fma ");
    if (__builtin_cpu_supports("avx512f")) strcat(tmp, "avx512f ");
    if (__builtin_cpu_supports("avx512bw")) strcat(tmp, "avx512bw ");
#elif defined(__aarch64__)
    strcat(tmp, "neon ");
#endif
#ifdef _OPENMP
    strcat(tmp, "openmp ");
#endif
    size_t n = strlen(tmp);
    if (n) tmp[n - 1] = '\0';
    else strcpy(tmp, "generic");
    memcpy(buf, tmp, sizeof buf);
    return buf;
}

const flashc_cpu_kernels *flashc_cpu_select_kernels(void) { return &flashc_cpu_kernels_generic; }

int flashc_cpu_thread_count(const struct flashc_context *ctx) {
#ifdef _OPENMP
    return ctx->threads > 0 ? ctx->threads : omp_get_max_threads();
#else
    (void)ctx;
    return 1;
#endif
}

/* Keep the per-thread working set (Q, K, V, O tiles and S) inside a typical 256 KiB-1 MiB L2. */
flashc_cpu_tiles flashc_cpu_choose_tiles(int64_t D) {
    flashc_cpu_tiles t;
    t.br = D <= 128 ? 64 : 32;
    t.bc = 64;
    return t;
}

/* ---- loads and stores ---------------------------------------------------------------------------------- */

static inline float load_elem(const void *base, flashc_dtype dt, int64_t off) {
    switch (dt) {
    case FLASHC_DTYPE_F32: return ((const float *)base)[off];
    case FLASHC_DTYPE_F16: return flashc_f16_to_f32(((const uint16_t *)base)[off]);
    default: return flashc_bf16_to_f32(((const uint16_t *)base)[off]);
    }
}

static void load_row(float *dst, const flashc_tensor *t, int64_t off, int64_t D, float scale) {
    const int64_t sd = t->stride[3];
    if (t->dtype == FLASHC_DTYPE_F32 && sd == 1) {
        const float *src = (const float *)t->data + off;
        for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
    } else {
        for (int64_t d = 0; d < D; d++) dst[d] = load_elem(t->data, t->dtype, off + d * sd) * scale;
    }
}

void flashc_cpu_load_rows(float *dst, int ld, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                          int pad_rows, int64_t h, int64_t D, float scale) {
    for (int r = 0; r < rows; r++) {
        float *row = dst + (size_t)r * ld;
        load_row(row, t, flashc_cpu_offset(t, b, row0 + r, h), D, scale);
        for (int d = (int)D; d < ld; d++) row[d] = 0.0f;
    }
    for (int r = rows; r < pad_rows; r++) memset(dst + (size_t)r * ld, 0, sizeof(float) * (size_t)ld);
}

void flashc_cpu_load_rows_t(float *dst, int ld, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                            int pad_rows, int64_t h, int64_t D) {
    float tmp[FLASHC_MAX_HEAD_DIM];
    for (int r = 0; r < rows; r++) {
        load_row(tmp, t, flashc_cpu_offset(t, b, row0 + r, h), D, 1.0f);
        for (int64_t d = 0; d < D; d++) dst[(size_t)d * ld + r] = tmp[d];
    }
    for (int64_t d = 0; d < D; d++)
        for (int r = rows; r < pad_rows; r++) dst[(size_t)d * ld + r] = 0.0f;
}

void flashc_cpu_store_rows(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                           const float *src, int ld) {
    const int64_t sd = t->stride[3];
    for (int r = 0; r < rows; r++) {
        const float *row = src + (size_t)r * ld;
        int64_t off = flashc_cpu_offset(t, b, row0 + r, h);
        switch (t->dtype) {
        case FLASHC_DTYPE_F32:
            for (int64_t d = 0; d < D; d++) ((float *)t->data)[off + d * sd] = row[d];
            break;
        case FLASHC_DTYPE_F16:
            for (int64_t d = 0; d < D; d++) ((uint16_t *)t->data)[off + d * sd] = flashc_f32_to_f16(row[d]);
            break;
        default:
            for (int64_t d = 0; d < D; d++) ((uint16_t *)t->data)[off + d * sd] = flashc_f32_to_bf16(row[d]);
            break;
        }
    }
}

/* ---- masks ------------------------------------------------------------------------------------------------ */

int flashc_cpu_tile_visible(const flashc_problem *p, int64_t b, int64_t h, int64_t i0, int rows, int64_t j0,
                            int cols) {
    if (!p->block_mask) return 1;
    int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
    const uint8_t *m = p->block_mask + (mb * p->bm_heads + mh) * p->bm_nqb * p->bm_nkb;
    for (int64_t qb = i0 / p->bm_q; qb <= (i0 + rows - 1) / p->bm_q; qb++)
        for (int64_t kb = j0 / p->bm_k; kb <= (j0 + cols - 1) / p->bm_k; kb++)
            if (m[qb * p->bm_nkb + kb]) return 1;
    return 0;
}

void flashc_cpu_score_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                               int64_t i0, int rows, int64_t j0, int cols, float *s, int lds, float *tanh_out) {
    const float cap = p->softcap, slope = flashc_alibi_slope(p, b, h);
    const float neg_inf = -INFINITY;
    for (int r = 0; r < rows; r++) {
        const int64_t i = i0 + r;
        float *row = s + (size_t)r * lds;
        float *trow = tanh_out ? tanh_out + (size_t)r * lds : NULL;
        int64_t lo, hi;
        flashc_row_key_range(p, i, nq, nk, &lo, &hi);
        const uint8_t *mrow = NULL;
        if (p->block_mask) {
            int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
            mrow = p->block_mask + ((mb * p->bm_heads + mh) * p->bm_nqb + i / p->bm_q) * p->bm_nkb;
        }
        const int64_t diag = i + nk - nq;
        for (int c = 0; c < cols; c++) {
            const int64_t j = j0 + c;
            float x = row[c];
            if (cap > 0.0f) {
                float t = tanhf(x / cap);
                if (trow) trow[c] = t;
                x = cap * t;
            }
            if (slope != 0.0f) x -= slope * (float)llabs(diag - j);
            if (j < lo || j >= hi || (mrow && !mrow[j / p->bm_k])) x = neg_inf;
            row[c] = x * FLASHC_LOG2E;
        }
    }
}

flashc_status flashc_cpu_check_varlen(struct flashc_context *ctx, const flashc_problem *p) {
    if (!p->varlen) return FLASHC_STATUS_OK;
    if (p->cu_q[0] != 0 || p->cu_k[0] != 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "cu_seqlens must start at 0 (got %d, %d)",
                          (int)p->cu_q[0], (int)p->cu_k[0]);
    for (int64_t b = 0; b < p->B; b++) {
        int64_t lq = (int64_t)p->cu_q[b + 1] - p->cu_q[b], lk = (int64_t)p->cu_k[b + 1] - p->cu_k[b];
        if (lq < 0 || lk < 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "cu_seqlens decrease at sequence %lld",
                              (long long)b);
        if (lq > p->Nq || lk > p->Nk)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "sequence %lld has lengths (%lld, %lld) above max_seqlen (%lld, %lld)", (long long)b,
                              (long long)lq, (long long)lk, (long long)p->Nq, (long long)p->Nk);
    }
    if (p->cu_q[p->B] > p->total_q || p->cu_k[p->B] > p->total_k)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "cu_seqlens end at (%d, %d), beyond the packed tensors' %lld query and %lld key rows",
                          (int)p->cu_q[p->B], (int)p->cu_k[p->B], (long long)p->total_q, (long long)p->total_k);
    return FLASHC_STATUS_OK;
}

/* ---- vtable ----------------------------------------------------------------------------------------------- */

static size_t cpu_workspace_size(struct flashc_context *ctx, const flashc_problem *p) {
    return p->op == FLASHC_OP_FORWARD ? flashc_cpu_forward_workspace(ctx, p) : flashc_cpu_backward_workspace(ctx, p);
}

static flashc_status cpu_workspace_alloc(struct flashc_context *ctx, size_t bytes, void **ptr) {
    *ptr = NULL;
    void *m = NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes || !(m = aligned_alloc(64, rounded)))
        return FLASHC_ERR(ctx, FLASHC_STATUS_OUT_OF_MEMORY, "could not allocate %zu bytes of workspace", bytes);
    *ptr = m;
    return FLASHC_STATUS_OK;
}

static void cpu_workspace_free(struct flashc_context *ctx, void *ptr) { free(ptr); }

const flashc_backend_ops flashc_cpu_ops = {
    FLASHC_BACKEND_CPU,
    NULL, /* init */
    NULL, /* fini */
    NULL, /* set_stream: only NULL is accepted */
    NULL, /* supported: every validated problem runs */
    cpu_workspace_size,
    cpu_workspace_alloc,
    cpu_workspace_free,
    flashc_cpu_forward,
    flashc_cpu_backward,
};
