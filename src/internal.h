/*
 * internal.h - what the front (src/flashc.c) and the backends share: the validated problem, the backend
 * vtable, and the error helpers. Not installed.
 *
 * Layers, each calling only the one below it (and this header):
 *   front      src/flashc.c: arguments into a flashc_problem, error slots; knows the backends by their tables
 *   table      struct flashc_backend_ops below: the only way from the front into a backend
 *   backends   src/cpu/backend.c, src/cuda/cuda.cu: fill a table, choose kernels, threads, launches
 *   drivers    src/cpu/attn.c (tiled loops, over src/cpu/tiles.c), src/cuda/{fwd,bwd}_*.cu
 *   kernels    per ISA or GPU generation: src/cpu/kernels_avx2.c, src/cuda/fwd_sm90.cu and their siblings
 * src/ref (the fp64 oracle and case table) sits beside the library, for tests and the command; nothing in the
 * library includes it.
 */
#ifndef FLASHC_INTERNAL_H
#define FLASHC_INTERNAL_H

#include "flashc.h"

#include <math.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHC_ERROR_LEN 512
#define FLASHC_MAX_HEAD_DIM 256
/* The most threads a context may ask for (the CPU backend caps further, at 4 per processor it may run on). */
#define FLASHC_MAX_THREADS 1024
/* The most rows of q or k (packed totals with varlen): 2^31 - 1024, so that rounding up to tiles stays in int32. */
#define FLASHC_MAX_ROWS (INT32_MAX - 1023)
/* Positions (flashc_params 0.6) lie strictly between -2^40 and 2^40: a row's or key's position, their difference
 * and a window side added to it all stay far inside int64 (and inside fp64's exact integers, for the oracle). */
#define FLASHC_MAX_POSITION (INT64_C(1) << 40)

/*
 * Checked arithmetic on sizes that come from the user. One rule everywhere: signed products and sums of
 * non-negative int64 values return 0 when they do not fit; size_t products and sums saturate at SIZE_MAX, which
 * the front reads as "does not fit in this address space" (no real workspace is SIZE_MAX bytes).
 */
static inline int flashc_mul_i64(int64_t a, int64_t b, int64_t *r) {
    if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a)) return 0;
    *r = a * b;
    return 1;
}
static inline int flashc_add_i64(int64_t a, int64_t b, int64_t *r) {
    if (a < 0 || b < 0 || a > INT64_MAX - b) return 0;
    *r = a + b;
    return 1;
}
static inline size_t flashc_size_mul(size_t a, size_t b) {
    return a != 0 && b > SIZE_MAX / a ? SIZE_MAX : a * b;
}
static inline size_t flashc_size_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }
/* A non-negative int64 as size_t, saturating (size_t may be 32 bits). */
static inline size_t flashc_size_of_i64(int64_t a) {
    return a < 0 ? SIZE_MAX : (uint64_t)a > (uint64_t)SIZE_MAX ? SIZE_MAX : (size_t)a;
}

/*
 * A validated attention problem. The front fills it from the public arguments; backends only read it.
 * Dimensions follow the glossary of flashc.h. With varlen, B is num_seqs, Nq/Nk are the max lengths and the
 * tensors' batch dimension is 1 (row offsets come from cu_seqlens).
 */
typedef struct flashc_problem {
    flashc_op op;
    flashc_dtype dtype;
    int64_t B, Nq, Nk, H, Hkv, D;
    int varlen;
    int64_t total_q, total_k; /* varlen: rows of the packed tensors; else Nq, Nk */

    float scale;      /* resolved: never 0 */
    float softcap;    /* 0: off */
    int64_t win_left;  /* -1 unbounded; causal folded in as win_right = 0 */
    int64_t win_right; /* -1 unbounded */
    /* Positions: row i of every sequence sits at q_position + i, key j at k_position + j (flashc_seq_diag); 0: off,
     * bottom-right alignment (the two are then 0) */
    int positions;
    int64_t q_position, k_position;
    const float *alibi;
    int64_t alibi_batch_stride;
    const uint8_t *block_mask;
    int64_t bm_q, bm_k, bm_batch, bm_heads, bm_nqb, bm_nkb;
    const int32_t *cu_q, *cu_k;
    const int32_t *seqused_k; /* keys each sequence uses (NULL: all); the CUDA kernels clamp, the CPU checked */
    const float *sinks;       /* per query head; NULL: none */
    /* Paged K/V: k, v (and dk, dv) are page pools (num_pages, page_size, Hkv, D); key j of sequence b is row
     * j % page_size of page block_table[b * bt_stride + j / page_size] (flashc_kv_offset). Nk is then
     * bt_max_pages * page_size, and with varlen cu_k gives lengths only (k0 is 0). NULL: not paged. */
    const int32_t *block_table;
    int64_t bt_max_pages, bt_stride, page_size, num_pages;
    float *dsinks;            /* backward: the sinks' gradient (H), NULL: not asked for */
    float dropout_p;
    uint64_t dropout_seed, dropout_offset;
    const uint64_t *dropout_rng; /* CUDA: device memory holding { seed, offset }, read by the kernels; NULL: the values */
    int deterministic;

    /* views (data may be NULL in a supported()/workspace query) */
    flashc_tensor q, k, v;
    flashc_tensor out;  /* forward output, backward input */
    float *lse;         /* forward: may be NULL; backward: input */
    flashc_tensor dout, dq, dk, dv; /* backward only */

    /* Front only: the byte ranges [lo, hi) of every buffer a data call reads or writes (views, lse, cu_seqlens,
     * slopes, block mask), so that a caller's workspace can be checked against them too. */
    int nranges;
    uintptr_t range_lo[20], range_hi[20];
} flashc_problem;

struct flashc_context;

/*
 * Builds and validates a problem from the public arguments, exactly as flashc_forward / flashc_backward do
 * (src/flashc.c); also what the oracle's callers use to get the same problem. ctx may be NULL (errors then go
 * to the thread's slot).
 */
flashc_status flashc_problem_build(flashc_context_t ctx, flashc_op op, const flashc_tensor *q,
                                   const flashc_tensor *k, const flashc_tensor *v, const flashc_params *params,
                                   const flashc_tensor *out, float *lse, const flashc_tensor *dout,
                                   const flashc_tensor *dq, const flashc_tensor *dk, const flashc_tensor *dv,
                                   flashc_problem *p);

/*
 * One table of functions per backend (src/cpu/backend.c, src/cuda/cuda.cu), filled with designated
 * initializers. Members are only appended; those marked "NULL:" may be left out, the others are required.
 */
/*
 * What a backend decided for one call (its plan member), once: supported(), the workspace size, kernel_name() and
 * the launch of that call all read this, and nothing is chosen again. The front keeps it on its stack.
 */
typedef struct flashc_plan {
    const char *kernel; /* the kernel(s) the call runs, a static string (flashc_kernel_name) */
    size_t workspace;   /* bytes; the backend's size arithmetic saturates, and the front refuses SIZE_MAX */
    int threads;        /* CPU: threads of this call (the workspace is sized for them) */
    int path;           /* the backend's own: which kernel path */
    int entry;          /* the backend's own: index into its kernel table */
    int nsplit;         /* the backend's own: key-range pieces (split-KV) */
} flashc_plan;

typedef struct flashc_backend_ops {
    flashc_backend kind;
    /* Devices usable now; 0 makes AUTO pass this backend over. */
    int (*device_count)(void);
    /* A device's name into buf (len > 0; always NUL-terminated). A device that does not exist: INVALID_ARGUMENT,
     * recorded with no context (flashc_set_error(NULL, ...)). */
    flashc_status (*device_name)(int device, char *buf, size_t len);
    flashc_status (*init)(struct flashc_context *ctx); /* NULL: nothing to set up */
    void (*fini)(struct flashc_context *ctx);          /* NULL: nothing to release */
    flashc_status (*set_stream)(struct flashc_context *ctx, void *stream); /* NULL: only the NULL stream */
    /* Threads a call on ctx runs, after the backend's caps on ctx->threads. NULL: 1. */
    int (*threads)(const struct flashc_context *ctx);
    /* The one decision of a call on a validated problem (a query's or a data call's): OK with *plan filled, or
     * NOT_SUPPORTED with the reason set through flashc_set_error. */
    flashc_status (*plan)(struct flashc_context *ctx, const flashc_problem *p, flashc_plan *plan);
    flashc_status (*workspace_alloc)(struct flashc_context *ctx, size_t bytes, void **ptr);
    void (*workspace_free)(struct flashc_context *ctx, void *ptr);
    /* Run p as planned, with plan->workspace bytes of workspace (NULL when 0). */
    flashc_status (*forward)(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                             void *workspace);
    flashc_status (*backward)(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                              void *workspace);
    /* flashc_kvcache_append on validated views (shapes, dtypes, no overlap of the caches with anything else); the
     * backend checks or clamps cache_seqlens. NULL: not supported. */
    flashc_status (*kvcache_append)(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                    const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                    const flashc_tensor *v_new, const int32_t *cache_seqlens);
    /* flashc_merge on validated views: out_a, out_b, out of one shape (B, N, H, D) and dtype; lse_a, lse_b and lse
     * (NULL: not written) fp32 contiguous (B, H, N). out is out_a's or out_b's very view or shares no byte with
     * either, lse likewise lse_a or lse_b: each row's lse is read before its own lse is written. NULL: not
     * supported. */
    flashc_status (*merge)(struct flashc_context *ctx, const flashc_tensor *out_a, const float *lse_a,
                           const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out, float *lse);
    /* flashc_kvcache_append_paged on validated views (k_cache, v_cache page pools (num_pages, page_size, Hkv, D),
     * k_new, v_new (B, Nnew, Hkv, D)); the backend checks or clamps cache_seqlens and the table's entries. NULL: not
     * supported. */
    flashc_status (*kvcache_append_paged)(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                          const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                          const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                          const int32_t *block_table, int64_t max_pages, int64_t stride);
    /* flashc_rotary on validated views: x and out of one shape (B, N, H, D) and dtype, out x's very view or sharing no
     * byte with it; cos and sin (1, P, 1, R/2) of one dtype, R <= D; seq_start int32 (B) or NULL (0). The backend
     * checks (CPU) or handles (CUDA: NaN) positions outside [0, P). NULL: not supported. */
    flashc_status (*rotary)(struct flashc_context *ctx, const flashc_tensor *x, const flashc_tensor *cos,
                            const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                            const flashc_tensor *out);
} flashc_backend_ops;

/*
 * A context is shared freely between threads for the attention calls: nothing in it changes during one. The
 * configuration (stream, threads) is set before calls run. The last-error text is kept per calling thread
 * (src/flashc.c), so it is not in here.
 */
struct flashc_context {
    const flashc_backend_ops *ops;
    flashc_backend backend;
    int device;
    int threads; /* as asked (0: the backend's default), at most FLASHC_MAX_THREADS */
    void *stream;
    void *backend_state;
    unsigned long long id; /* unique per process: what the per-thread error slots are keyed by */
};

/* Records "file:line: message" as the calling thread's last error on ctx (or its context-free slot when ctx is
 * NULL) and returns status. */
flashc_status flashc_set_error(struct flashc_context *ctx, flashc_status status, const char *file, int line,
                               const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* Clears the calling thread's last error on ctx (a call succeeded). */
void flashc_clear_error(struct flashc_context *ctx);

#define FLASHC_ERR(ctx, status, ...) flashc_set_error((ctx), (status), __FILE__, __LINE__, __VA_ARGS__)
#define FLASHC_TRY(expr)                                                                                     \
    do {                                                                                                     \
        flashc_status flashc_try_status_ = (expr);                                                           \
        if (flashc_try_status_ != FLASHC_STATUS_OK) return flashc_try_status_;                               \
    } while (0)

extern const flashc_backend_ops flashc_cpu_ops;
#ifdef FLASHC_WITH_CUDA
extern const flashc_backend_ops flashc_cuda_ops;
#endif

/* ---- helpers shared by backends and the oracle ---------------------------------------------------------- */

static inline size_t flashc_dtype_size(flashc_dtype t) { return t == FLASHC_DTYPE_F32 ? 4 : 2; }

/* Sequence b's key rows inside the (possibly packed) tensors: from *k0, *rows of them. */
static inline void flashc_seq_key_rows(const flashc_problem *p, int64_t b, int64_t *k0, int64_t *rows) {
    *k0 = p->varlen && !p->block_table ? p->cu_k[b] : 0; /* paged: rows are found through the block table */
    *rows = p->varlen ? (int64_t)p->cu_k[b + 1] - p->cu_k[b] : p->Nk;
}

/* Element offset of (key row n, head h, dim 0) of sequence b in a k-like view t (k, v, dk, dv): with a block table
 * row n % page_size of the page the table names, else (batch tb, row n) as flashc_seq_key_rows counts rows (tb is 0
 * with varlen). The one place that maps keys to memory: the CPU drivers and the oracle both read K and V through
 * it. */
static inline int64_t flashc_kv_offset(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t tb,
                                       int64_t n, int64_t h) {
    if (p->block_table) {
        const int64_t page = p->block_table[b * p->bt_stride + n / p->page_size];
        return page * t->stride[0] + (n % p->page_size) * t->stride[1] + h * t->stride[2];
    }
    return tb * t->stride[0] + n * t->stride[1] + h * t->stride[2];
}

/* Sequence b's row range inside the (possibly packed) tensors: queries [q0, q0 + nq) and the keys it uses,
 * [k0, k0 + nk): its key rows, or the first seqused_k[b] of them (clamped to [0, rows], as the CUDA kernels do;
 * the CPU backend refuses values outside). */
static inline void flashc_seq_bounds(const flashc_problem *p, int64_t b, int64_t *q0, int64_t *nq, int64_t *k0,
                                     int64_t *nk) {
    *q0 = p->varlen ? p->cu_q[b] : 0;
    *nq = p->varlen ? (int64_t)p->cu_q[b + 1] - p->cu_q[b] : p->Nq;
    flashc_seq_key_rows(p, b, k0, nk);
    if (p->seqused_k) {
        const int64_t used = p->seqused_k[b];
        *nk = used < 0 ? 0 : used < *nk ? used : *nk;
    }
}

/* Attention sinks: the end of a row's softmax, m2 the max of its base-2 scores and l the sum of 2^(x - m2) (0: the
 * row saw no key), with the sink's logit (natural log) joining the denominator. Returns the factor the row's
 * unnormalized output takes (in place of 1 / l) and sets its natural-log lse (the sink itself when l is 0). */
static inline float flashc_sink_fold(float sink, float m2, float l, float *lse) {
    if (l == 0.0f) {
        *lse = sink;
        return 0.0f;
    }
    const float s2 = sink * 1.4426950408889634f, mx = m2 > s2 ? m2 : s2;
    const float em = exp2f(m2 - mx), lt = l * em + exp2f(s2 - mx);
    *lse = (mx + log2f(lt)) * 0.6931471805599453f;
    return em / lt;
}

#if defined(__CUDACC__)
#  define FLASHC_HOST_DEVICE __host__ __device__
#else
#  define FLASHC_HOST_DEVICE
#endif

/* flashc_merge's rule for one row, in one place for both backends: the merged natural-log lse of two parts and their
 * weights, out = wa * out_a + wb * out_b. An infinite lse marks an empty part (+inf: a row that saw no key, as the
 * forward writes it; -inf: the log of an empty sum): its weight is 0, the other's exactly 1 and the lse the other's;
 * both empty: lse +inf. A NaN lse gives NaN weights and lse. A weight of 0 means "leave that part out" (its out is not
 * used, so garbage in an empty part's row reaches nothing). */
static inline FLASHC_HOST_DEVICE float flashc_merge_weights(float la, float lb, float *wa, float *wb) {
    const int ea = fabsf(la) == INFINITY, eb = fabsf(lb) == INFINITY;
    if (ea || eb) {
        *wa = ea ? 0.0f : 1.0f;
        *wb = eb ? 0.0f : 1.0f;
        return ea && eb ? INFINITY : ea ? lb : la;
    }
    /* The weights from the difference, not from the rounded lse, so that their error does not grow with |lse|: the
     * larger part's weight is 1 / (1 + e), e = exp(-|la - lb|) <= 1, the smaller's e times that. NaN in, NaN out. */
    const int a_larger = la >= lb;
    const float e = expf(a_larger ? lb - la : la - lb), w = 1.0f / (1.0f + e);
    *wa = a_larger ? w : e * w;
    *wb = a_larger ? e * w : w;
    return (a_larger ? la : lb) + log1pf(e);
}

/* One merged element from the weights above (fp32): a part of weight 0 is left out, not multiplied by 0. */
static inline FLASHC_HOST_DEVICE float flashc_merge_value(float wa, float a, float wb, float b) {
    return wa == 0.0f ? (wb == 0.0f ? 0.0f : wb * b) : wb == 0.0f ? wa * a : wa * a + wb * b;
}

/* flashc_rotary's rule for one pair (a, b) of a row, in one place for both backends: out[a] = x[a] c - x[b] s, out[b] =
 * x[a] s + x[b] c in fp32, each as one fma onto the rounded product x[a] c or x[a] s (torch's x1 * c then addcmul, as
 * CUDA contracts it). The device multiply is __fmul_rn so that no compiler fuses it into the fma either. */
static inline FLASHC_HOST_DEVICE void flashc_rotary_pair(float xa, float xb, float c, float s, float *oa, float *ob) {
#if defined(__CUDA_ARCH__)
    *oa = fmaf(-xb, s, __fmul_rn(xa, c));
    *ob = fmaf(xb, c, __fmul_rn(xa, s));
#else
    *oa = fmaf(-xb, s, xa * c);
    *ob = fmaf(xb, c, xa * s);
#endif
}

/* The alignment of a sequence of nq queries and nk (used) keys: row i's diagonal key is i + diag, where the band is
 * centred and from which ALiBi measures distances. With positions q_position - k_position, the same for every
 * sequence; else nk - nq (bottom-right aligned). The one place it is decided on the CPU. */
static inline int64_t flashc_seq_diag(const flashc_problem *p, int64_t nq, int64_t nk) {
    return p->positions ? p->q_position - p->k_position : nk - nq;
}
/* What positions add to every sequence's own alignment: q_position - k_position with positions, else 0 (the bound the
 * CUDA kernels check, the reach of their windows). */
static inline int64_t flashc_pos_diag(const flashc_problem *p) {
    return p->positions ? p->q_position - p->k_position : 0;
}

/* Visible key range [lo, hi) of query row i (0-based within a sequence of nq queries and nk keys) from the
 * causal/window masks alone; empty when lo >= hi. */
static inline void flashc_row_key_range(const flashc_problem *p, int64_t i, int64_t nq, int64_t nk, int64_t *lo,
                                        int64_t *hi) {
    int64_t diag = i + flashc_seq_diag(p, nq, nk);
    int64_t l = 0, h = nk;
    if (p->win_left >= 0 && diag - p->win_left > l) l = diag - p->win_left;
    if (p->win_right >= 0 && diag + p->win_right + 1 < h) h = diag + p->win_right + 1;
    *lo = l;
    *hi = h;
}

/* The block-sparse mask byte for (b, h, query row i, key j) within a sequence; 1 when no mask is set. */
static inline int flashc_block_visible(const flashc_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (!p->block_mask) return 1;
    int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
    const uint8_t *m = p->block_mask + ((mb * p->bm_heads + mh) * p->bm_nqb + i / p->bm_q) * p->bm_nkb;
    return m[j / p->bm_k] != 0;
}

static inline float flashc_alibi_slope(const flashc_problem *p, int64_t b, int64_t h) {
    return p->alibi ? p->alibi[b * p->alibi_batch_stride + h] : 0.0f;
}

/* bf16/f16 <-> f32, round to nearest even. */
static inline float flashc_bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}
static inline uint16_t flashc_f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* quiet NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}
float flashc_f16_to_f32(uint16_t h);
uint16_t flashc_f32_to_f16(float f);

#ifdef __cplusplus
}
#endif

#endif /* FLASHC_INTERNAL_H */
