/*
 * flashc.c - the front: contexts, argument checks into a validated flashc_problem, backend choice, status
 * strings. Backends (src/cpu, src/cuda) only ever see a problem that passed these checks.
 */
#include "dropout.h"
#include "internal.h"

#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FLASHC_STR2(x) #x
#define FLASHC_STR(x) FLASHC_STR2(x)

#if defined(__STDC_NO_THREADS__) || !defined(__STDC_VERSION__)
#  if defined(__GNUC__)
#    define FLASHC_THREAD_LOCAL __thread
#  else
#    define FLASHC_THREAD_LOCAL
#  endif
#else
#  define FLASHC_THREAD_LOCAL _Thread_local
#endif

/*
 * Last errors are kept per thread, so that threads sharing a context never read (or tear) each other's message:
 * each thread has a slot for calls without a context and a few slots keyed by context, reused least recently
 * used first. A thread that alternates between more contexts than there are slots loses the oldest message
 * (flashc_context_last_error then gives "").
 */
#define ERROR_SLOTS 8
typedef struct error_slot {
    unsigned long long ctx; /* the context's id; 0: free */
    unsigned long long used; /* this thread's call count when last written: the LRU order */
    char msg[FLASHC_ERROR_LEN];
} error_slot;
static FLASHC_THREAD_LOCAL char thread_error[FLASHC_ERROR_LEN];
static FLASHC_THREAD_LOCAL error_slot ctx_errors[ERROR_SLOTS];
static FLASHC_THREAD_LOCAL unsigned long long error_clock;

/* The calling thread's slot for ctx; with create, one is taken (the least recently used) when it has none. Slots
 * are keyed by the context's id, not its address, so a new context never inherits a destroyed one's message. */
static error_slot *slot_of(const struct flashc_context *ctx, int create) {
    error_slot *oldest = &ctx_errors[0];
    for (int i = 0; i < ERROR_SLOTS; i++) {
        if (ctx_errors[i].ctx == ctx->id) {
            ctx_errors[i].used = ++error_clock;
            return &ctx_errors[i];
        }
        if (ctx_errors[i].used < oldest->used) oldest = &ctx_errors[i];
    }
    if (!create) return NULL;
    oldest->ctx = ctx->id;
    oldest->used = ++error_clock;
    oldest->msg[0] = '\0';
    return oldest;
}

/* File names in messages are shown from src/ on, not as build-machine paths. */
static const char *short_path(const char *file) {
    const char *s = strstr(file, "src/");
    return s ? s : file;
}

flashc_status flashc_set_error(struct flashc_context *ctx, flashc_status status, const char *file, int line,
                               const char *fmt, ...) {
    char *buf = thread_error;
    int n = snprintf(buf, FLASHC_ERROR_LEN, "%s:%d: ", short_path(file), line);
    if (n < 0 || n >= FLASHC_ERROR_LEN) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, FLASHC_ERROR_LEN - (size_t)n, fmt, ap);
    va_end(ap);
    if (ctx) memcpy(slot_of(ctx, 1)->msg, thread_error, FLASHC_ERROR_LEN);
    return status;
}

void flashc_clear_error(struct flashc_context *ctx) {
    error_slot *s = slot_of(ctx, 0);
    if (s) s->msg[0] = '\0';
}

/* Frees this thread's slot of a context that is going away. */
static void forget_errors(const struct flashc_context *ctx) {
    error_slot *s = slot_of(ctx, 0);
    if (s) {
        s->ctx = 0;
        s->used = 0;
        s->msg[0] = '\0';
    }
}

static unsigned long long next_context_id(void) {
    static unsigned long long last;
#if defined(__GNUC__)
    return __atomic_add_fetch(&last, 1, __ATOMIC_RELAXED);
#else
    return ++last; /* compilers without the GNU atomics: contexts must then be created from one thread */
#endif
}

/* ---- backends ------------------------------------------------------------------------------------------ */

/* The compiled-in backend tables, in the order AUTO prefers them: the first with a device wins. */
#ifdef FLASHC_WITH_CUDA
static const flashc_backend_ops *const backends[] = {&flashc_cuda_ops, &flashc_cpu_ops};
#else
static const flashc_backend_ops *const backends[] = {&flashc_cpu_ops};
#endif

static const flashc_backend_ops *find_backend(flashc_backend backend) {
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (backends[i]->kind == backend) return backends[i];
    return NULL;
}

/* AUTO's choice: the first compiled-in backend with a device (the CPU always has one). */
static const flashc_backend_ops *auto_backend(void) {
    const size_t n = sizeof backends / sizeof backends[0];
    for (size_t i = 0; i + 1 < n; i++)
        if (backends[i]->device_count() > 0) return backends[i];
    return backends[n - 1];
}

/* The table of a concrete backend, or why there is none. */
static flashc_status backend_table(flashc_backend backend, const flashc_backend_ops **ops) {
    *ops = backend == FLASHC_BACKEND_AUTO ? NULL : find_backend(backend);
    if (*ops) return FLASHC_STATUS_OK;
    if (backend == FLASHC_BACKEND_CPU || backend == FLASHC_BACKEND_CUDA)
        return FLASHC_ERR(NULL, FLASHC_STATUS_NOT_SUPPORTED, "this flashc was built without the %s backend",
                          backend == FLASHC_BACKEND_CUDA ? "CUDA" : "CPU");
    return FLASHC_STATUS_INVALID_ARGUMENT; /* the caller says what it wanted of it */
}

/* ---- library ------------------------------------------------------------------------------------------- */

const char *flashc_version(void) {
    return FLASHC_STR(FLASHC_VERSION_MAJOR) "." FLASHC_STR(FLASHC_VERSION_MINOR) "." FLASHC_STR(
        FLASHC_VERSION_PATCH);
}

const char *flashc_status_string(flashc_status status) {
    switch (status) {
    case FLASHC_STATUS_OK: return "FLASHC_STATUS_OK";
    case FLASHC_STATUS_INVALID_ARGUMENT: return "FLASHC_STATUS_INVALID_ARGUMENT";
    case FLASHC_STATUS_NOT_SUPPORTED: return "FLASHC_STATUS_NOT_SUPPORTED";
    case FLASHC_STATUS_OUT_OF_MEMORY: return "FLASHC_STATUS_OUT_OF_MEMORY";
    case FLASHC_STATUS_DEVICE_ERROR: return "FLASHC_STATUS_DEVICE_ERROR";
    case FLASHC_STATUS_INTERNAL: return "FLASHC_STATUS_INTERNAL";
    }
    return "FLASHC_STATUS_UNKNOWN";
}

const char *flashc_dtype_name(flashc_dtype dtype) {
    switch (dtype) {
    case FLASHC_DTYPE_F32: return "f32";
    case FLASHC_DTYPE_F16: return "f16";
    case FLASHC_DTYPE_BF16: return "bf16";
    }
    return "unknown";
}

const char *flashc_backend_name(flashc_backend backend) {
    switch (backend) {
    case FLASHC_BACKEND_AUTO: return "auto";
    case FLASHC_BACKEND_CPU: return "cpu";
    case FLASHC_BACKEND_CUDA: return "cuda";
    }
    return "unknown";
}

int flashc_backend_compiled(flashc_backend backend) {
    return backend == FLASHC_BACKEND_AUTO || find_backend(backend) != NULL;
}

int flashc_device_count(flashc_backend backend) {
    const flashc_backend_ops *ops = backend == FLASHC_BACKEND_AUTO ? auto_backend() : find_backend(backend);
    return ops ? ops->device_count() : 0;
}

flashc_status flashc_device_name(flashc_backend backend, int device, char *buf, size_t len) {
    if (!buf || len == 0) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "buf is NULL or len is 0");
    buf[0] = '\0';
    const flashc_backend_ops *ops;
    const flashc_status st = backend_table(backend, &ops);
    if (st == FLASHC_STATUS_INVALID_ARGUMENT)
        return FLASHC_ERR(NULL, st, "backend %d has no devices to name", (int)backend);
    FLASHC_TRY(st);
    return ops->device_name(device, buf, len);
}

flashc_params flashc_params_default(void) {
    flashc_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = (uint32_t)sizeof p;
    p.window_left = -1;
    p.window_right = -1;
    p.block_mask_batch = 1;
    p.block_mask_heads = 1;
    return p;
}

size_t flashc_params_size(void) { return sizeof(flashc_params); }

#define PARAMS_FIELD(f, type) {#f, offsetof(flashc_params, f), sizeof(((flashc_params *)0)->f), type}
static const struct params_field {
    const char *name;
    size_t offset, size;
    char type;
} params_fields[] = {
    PARAMS_FIELD(struct_size, 'I'),       PARAMS_FIELD(softmax_scale, 'f'),    PARAMS_FIELD(causal, 'i'),
    PARAMS_FIELD(window_left, 'q'),       PARAMS_FIELD(window_right, 'q'),     PARAMS_FIELD(softcap, 'f'),
    PARAMS_FIELD(alibi_slopes, 'p'),      PARAMS_FIELD(alibi_batch_stride, 'q'), PARAMS_FIELD(block_mask, 'p'),
    PARAMS_FIELD(block_mask_q, 'q'),      PARAMS_FIELD(block_mask_k, 'q'),     PARAMS_FIELD(block_mask_batch, 'q'),
    PARAMS_FIELD(block_mask_heads, 'q'),  PARAMS_FIELD(cu_seqlens_q, 'p'),     PARAMS_FIELD(cu_seqlens_k, 'p'),
    PARAMS_FIELD(num_seqs, 'q'),          PARAMS_FIELD(max_seqlen_q, 'q'),     PARAMS_FIELD(max_seqlen_k, 'q'),
    PARAMS_FIELD(dropout_p, 'f'),         PARAMS_FIELD(dropout_seed, 'Q'),     PARAMS_FIELD(dropout_offset, 'Q'),
    PARAMS_FIELD(deterministic, 'i'),     PARAMS_FIELD(seqused_k, 'p'),        PARAMS_FIELD(sinks, 'p'),
    PARAMS_FIELD(dsinks, 'p'),            PARAMS_FIELD(block_table, 'p'),      PARAMS_FIELD(block_table_max_pages, 'q'),
    PARAMS_FIELD(block_table_stride, 'q'), PARAMS_FIELD(page_size, 'q'),
    PARAMS_FIELD(dropout_rng, 'p'),       PARAMS_FIELD(positions, 'i'),        PARAMS_FIELD(q_position, 'q'),
    PARAMS_FIELD(k_position, 'q'),
};

int flashc_params_field(int index, const char **name, size_t *offset, size_t *size, char *type) {
    if (index < 0 || (size_t)index >= sizeof params_fields / sizeof params_fields[0]) return 0;
    const struct params_field *f = &params_fields[index];
    if (name) *name = f->name;
    if (offset) *offset = f->offset;
    if (size) *size = f->size;
    if (type) *type = f->type;
    return 1;
}

/*
 * The end of the last field of every published flashc_params layout, oldest first (the rule is in flashc.h).
 * Appending a field: add the layout it extends here and move PARAMS_END_NOW to the new last field.
 */
#define PARAMS_END_0_2 (offsetof(flashc_params, deterministic) + sizeof(int))
#define PARAMS_END_0_3 (offsetof(flashc_params, dsinks) + sizeof(float *))
#define PARAMS_END_0_4 (offsetof(flashc_params, page_size) + sizeof(int64_t))
#define PARAMS_END_0_5 (offsetof(flashc_params, dropout_rng) + sizeof(const uint64_t *))
#define PARAMS_END_0_6 (offsetof(flashc_params, k_position) + sizeof(int64_t))
#define PARAMS_END_NOW PARAMS_END_0_6
static const size_t params_layout_ends[] = {PARAMS_END_0_2, PARAMS_END_0_3, PARAMS_END_0_4, PARAMS_END_0_5,
                                            PARAMS_END_0_6};
#define PARAMS_ALIGN _Alignof(flashc_params)
#define PARAMS_LAYOUT_SIZE(end) (((end) + PARAMS_ALIGN - 1) / PARAMS_ALIGN * PARAMS_ALIGN)
_Static_assert(sizeof(flashc_params) == PARAMS_LAYOUT_SIZE(PARAMS_END_NOW),
               "flashc_params grew: add its previous layout to params_layout_ends and move PARAMS_END_NOW");
/* A struct_size above this is garbage rather than a newer flashc.h: the bytes past ours are not read then. */
#define PARAMS_MAX_SIZE 4096

/* The caller's params in this library's layout, or INVALID_ARGUMENT for a struct_size it cannot read. */
static flashc_status params_read(flashc_context_t ctx, const flashc_params *in, flashc_params *out) {
    const size_t n = in->struct_size, known = sizeof(flashc_params);
    if (n > known && n <= PARAMS_MAX_SIZE && n % PARAMS_ALIGN == 0) {
        const unsigned char *newer = (const unsigned char *)in + known;
        for (size_t i = 0; i < n - known; i++)
            if (newer[i])
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                  "params (struct_size %zu) set fields that this library (flashc %s, %zu bytes) does "
                                  "not know: start from flashc_params_default() and rebuild against this library's "
                                  "flashc.h, or use a newer library",
                                  n, flashc_version(), known);
        memcpy(out, in, known);
        return FLASHC_STATUS_OK;
    }
    for (size_t i = 0; i < sizeof params_layout_ends / sizeof params_layout_ends[0]; i++)
        if (n == PARAMS_LAYOUT_SIZE(params_layout_ends[i])) {
            *out = flashc_params_default();
            memcpy(out, in, params_layout_ends[i]);
            return FLASHC_STATUS_OK;
        }
    return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                      "params->struct_size is %zu, not the size of any flashc_params layout (this library's is %zu): "
                      "start from flashc_params_default() and rebuild against this flashc.h",
                      n, known);
}

flashc_tensor flashc_tensor_contiguous(void *data, flashc_dtype dtype, int64_t d0, int64_t d1, int64_t d2,
                                       int64_t d3) {
    flashc_tensor t;
    t.data = data;
    t.dtype = dtype;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.shape[2] = d2;
    t.shape[3] = d3;
    /* Shapes whose strides overflow int64 get the stride INT64_MIN, which every call refuses ("out of range"). */
    int64_t s1 = INT64_MIN, s0 = INT64_MIN;
    if (flashc_mul_i64(d2, d3, &s1) && !flashc_mul_i64(s1, d1, &s0)) s0 = INT64_MIN;
    t.stride[3] = 1;
    t.stride[2] = d3;
    t.stride[1] = s1;
    t.stride[0] = s0;
    return t;
}

/* dropout_p in [0, 1): NaN, negative values and 1 or more are refused (nothing would be kept at 1). */
static flashc_status check_dropout_p(flashc_context_t ctx, float p) {
    if (!(p >= 0.0f && p < 1.0f))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "dropout_p %g must be in [0, 1): the probability of dropping an element of P", (double)p);
    return FLASHC_STATUS_OK;
}

/* Positions (flashc_params 0.6): each strictly inside +-2^40, so that every position sum stays far from int64's ends. */
static flashc_status check_positions(flashc_context_t ctx, int64_t q_position, int64_t k_position) {
    if (!(q_position > -FLASHC_MAX_POSITION && q_position < FLASHC_MAX_POSITION && k_position > -FLASHC_MAX_POSITION &&
          k_position < FLASHC_MAX_POSITION))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "positions (q_position %lld, k_position %lld): each must lie strictly between -2^40 and 2^40",
                          (long long)q_position, (long long)k_position);
    return FLASHC_STATUS_OK;
}

/* Dropout with positions takes dropout's (i, j) at the positions (q_position + i, k_position + j), so they must lie
 * where Philox's counter words hold them: rows in [0, 2^32), key groups of four in [0, 2^32), and k_position a
 * multiple of 4 so that a call's groups of four keys are the longer attention's (the GPU kernels compute a group at a
 * time). nq, nk: the longest sequence's lengths. */
static flashc_status check_dropout_positions(flashc_context_t ctx, int64_t q_position, int64_t k_position, int64_t nq,
                                             int64_t nk) {
    if (q_position < 0 || k_position < 0 || k_position % 4 != 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "dropout with positions (q_position %lld, k_position %lld) needs both >= 0 and k_position a "
                          "multiple of 4: dropout's (row, key) are the positions, counted in Philox's groups of four "
                          "keys",
                          (long long)q_position, (long long)k_position);
    if (q_position + nq > (INT64_C(1) << 32) || k_position + nk > (INT64_C(1) << 34))
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "dropout with positions: rows up to q_position + Nq = %lld and keys up to k_position + Nk = "
                          "%lld do not fit dropout's 32-bit row and key-group counters (2^32 rows, 2^34 keys)",
                          (long long)(q_position + nq), (long long)(k_position + nk));
    return FLASHC_STATUS_OK;
}

flashc_status flashc_dropout_mask(const flashc_params *params, int64_t B, int64_t H, int64_t Nq, int64_t Nk,
                                  uint8_t *mask) {
    if (!params)
        return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "params is NULL (use flashc_params_default())");
    flashc_params prm;
    FLASHC_TRY(params_read(NULL, params, &prm));
    FLASHC_TRY(check_dropout_p(NULL, prm.dropout_p));
    int64_t n;
    if (B <= 0 || H <= 0 || Nq <= 0 || Nk <= 0)
        return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "mask shape (%lld, %lld, %lld, %lld) must be positive",
                          (long long)B, (long long)H, (long long)Nq, (long long)Nk);
    if (Nq > FLASHC_MAX_ROWS || Nk > FLASHC_MAX_ROWS || !flashc_mul_i64(B, H, &n) || !flashc_mul_i64(n, Nq, &n) ||
        !flashc_mul_i64(n, Nk, &n) || (uint64_t)n > (uint64_t)SIZE_MAX / 2)
        return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT,
                          "mask shape (%lld, %lld, %lld, %lld) does not fit the address space (or rows above 2^31 - "
                          "1024)",
                          (long long)B, (long long)H, (long long)Nq, (long long)Nk);
    if (!mask) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "mask is NULL");
    const int64_t row0 = prm.positions ? prm.q_position : 0, col0 = prm.positions ? prm.k_position : 0;
    if (prm.positions) {
        FLASHC_TRY(check_positions(NULL, row0, col0));
        if (prm.dropout_p > 0.0f) FLASHC_TRY(check_dropout_positions(NULL, row0, col0, Nq, Nk));
    }
    if (prm.dropout_rng) { /* host memory here */
        prm.dropout_seed = prm.dropout_rng[0];
        prm.dropout_offset = prm.dropout_rng[1];
    }
    const uint32_t t = flashc_dropout_threshold(prm.dropout_p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const uint64_t stream = flashc_dropout_stream(prm.dropout_offset, b, H, h);
            uint8_t *m = mask + (b * H + h) * Nq * Nk;
            for (int64_t i = 0; i < Nq; i++, m += Nk)
                for (int64_t g = 0; g < (Nk + 3) / 4; g++) { /* col0 is a multiple of 4 */
                    const flashc_u32x4 x = flashc_dropout_bits4(prm.dropout_seed, stream, row0 + i, col0 / 4 + g);
                    for (int64_t k = 0; k < 4 && 4 * g + k < Nk; k++) m[4 * g + k] = x.x[k] >= t;
                }
        }
    thread_error[0] = '\0';
    return FLASHC_STATUS_OK;
}

/* ---- context ------------------------------------------------------------------------------------------- */

flashc_status flashc_context_create(flashc_context_t *out, flashc_backend backend, int device) {
    if (!out) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx output pointer is NULL");
    *out = NULL;
    const flashc_backend_ops *ops = NULL;
    if (backend == FLASHC_BACKEND_AUTO) ops = auto_backend();
    else {
        const flashc_status st = backend_table(backend, &ops);
        if (st == FLASHC_STATUS_INVALID_ARGUMENT)
            return FLASHC_ERR(NULL, st, "unknown backend %d", (int)backend);
        FLASHC_TRY(st);
    }
    if (device < 0) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "device index %d is negative", device);

    struct flashc_context *ctx = (struct flashc_context *)calloc(1, sizeof *ctx);
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_OUT_OF_MEMORY, "out of host memory for the context");
    ctx->ops = ops;
    ctx->id = next_context_id();
    ctx->backend = ops->kind;
    ctx->device = device;
    flashc_status st = ops->init ? ops->init(ctx) : FLASHC_STATUS_OK;
    if (st != FLASHC_STATUS_OK) { /* the message is in thread_error too */
        forget_errors(ctx);
        free(ctx);
        return st;
    }
    thread_error[0] = '\0';
    *out = ctx;
    return FLASHC_STATUS_OK;
}

void flashc_context_destroy(flashc_context_t ctx) {
    if (!ctx) return;
    if (ctx->ops->fini) ctx->ops->fini(ctx);
    forget_errors(ctx);
    free(ctx);
}

flashc_backend flashc_context_backend(flashc_context_t ctx) { return ctx ? ctx->backend : FLASHC_BACKEND_AUTO; }

flashc_status flashc_context_set_stream(flashc_context_t ctx, void *stream) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (!ctx->ops->set_stream) {
        if (stream) return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "the %s backend has no streams",
                                      flashc_backend_name(ctx->backend));
        flashc_clear_error(ctx);
        return FLASHC_STATUS_OK;
    }
    FLASHC_TRY(ctx->ops->set_stream(ctx, stream));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_context_set_threads(flashc_context_t ctx, int threads) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (threads < 0) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "thread count %d is negative", threads);
    /* The backend caps it further where it runs (flashc_context_threads() tells the count in use). */
    ctx->threads = threads > FLASHC_MAX_THREADS ? FLASHC_MAX_THREADS : threads;
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

int flashc_context_threads(flashc_context_t ctx) {
    if (!ctx) return 0;
    return ctx->ops->threads ? ctx->ops->threads(ctx) : 1;
}

const char *flashc_context_last_error(flashc_context_t ctx) {
    if (!ctx) return thread_error;
    error_slot *s = slot_of(ctx, 0);
    return s ? s->msg : "";
}

/* ---- argument checks ----------------------------------------------------------------------------------- */

/*
 * An output must not address one element from two indices, or threads race on it and the result depends on
 * their order. Sufficient test: with the dimensions of extent > 1 sorted by |stride|, each stride exceeds the
 * largest offset the smaller ones reach (every permuted, padded or sliced dense view passes; interleaved layouts
 * that happen not to collide are refused too, and the message says what to pass instead).
 */
static flashc_status check_no_self_overlap(flashc_context_t ctx, const char *name, const flashc_tensor *t) {
    int64_t st[4], sh[4];
    int n = 0;
    for (int i = 0; i < 4; i++)
        if (t->shape[i] > 1) {
            int64_t a = t->stride[i] < 0 ? -t->stride[i] : t->stride[i];
            int j = n++;
            for (; j > 0 && st[j - 1] > a; j--) st[j] = st[j - 1], sh[j] = sh[j - 1];
            st[j] = a, sh[j] = t->shape[i];
        }
    int64_t reach = 0; /* largest offset of the dimensions so far (check_view bounded every product) */
    for (int i = 0; i < n; i++) {
        if (st[i] <= reach)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "%s: strides (%lld, %lld, %lld, %lld) make elements overlap (or interleave): an output "
                              "needs each dimension's stride to exceed the span of the smaller ones",
                              name, (long long)t->stride[0], (long long)t->stride[1], (long long)t->stride[2],
                              (long long)t->stride[3]);
        reach += (sh[i] - 1) * st[i];
    }
    return FLASHC_STATUS_OK;
}

/* Checks one 4-d view: positive shape, element count and address span within int64/size_t. Computes the byte
 * range [lo, hi) the view touches (for aliasing checks). need_data: data must be non-NULL. */
static flashc_status check_view(flashc_context_t ctx, const char *name, const flashc_tensor *t, int need_data,
                                int is_output, uintptr_t *lo, uintptr_t *hi) {
    if (!t) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
    if (need_data && !t->data) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s->data is NULL", name);
    if (t->dtype != FLASHC_DTYPE_F32 && t->dtype != FLASHC_DTYPE_F16 && t->dtype != FLASHC_DTYPE_BF16)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s has unknown dtype %d", name, (int)t->dtype);
    int64_t count = 1, span = 0; /* span: largest element offset reachable, in elements */
    for (int i = 0; i < 4; i++) {
        if (t->shape[i] <= 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s shape[%d] = %lld must be positive", name, i,
                              (long long)t->shape[i]);
        if (!flashc_mul_i64(count, t->shape[i], &count))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: element count overflows int64", name);
        if (t->stride[i] == INT64_MIN)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s stride[%d] is out of range", name, i);
        int64_t s = t->stride[i] < 0 ? -t->stride[i] : t->stride[i];
        if (is_output && s == 0 && t->shape[i] > 1)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "%s stride[%d] is 0: an output cannot broadcast", name, i);
        int64_t reach;
        if (!flashc_mul_i64(t->shape[i] - 1, s, &reach) || span > INT64_MAX - reach)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: strides reach beyond int64 elements", name);
        span += reach;
    }
    int64_t esz = (int64_t)flashc_dtype_size(t->dtype), bytes;
    if (!flashc_mul_i64(span + 1, esz, &bytes) || (uint64_t)bytes > (uint64_t)SIZE_MAX / 2)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: byte size overflows the address space", name);
    /* Lowest and highest byte touched, accounting for negative strides. */
    int64_t neg = 0;
    for (int i = 0; i < 4; i++)
        if (t->stride[i] < 0) neg += (t->shape[i] - 1) * t->stride[i];
    uintptr_t base = (uintptr_t)t->data;
    uintptr_t off = (uintptr_t)(-neg * esz);
    if (need_data && base < off)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: negative strides reach below address 0", name);
    *lo = base - (need_data ? off : 0);
    *hi = *lo + (uintptr_t)bytes;
    if (need_data && *hi < *lo)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: the view wraps around the address space", name);
    if (is_output) FLASHC_TRY(check_no_self_overlap(ctx, name, t));
    return FLASHC_STATUS_OK;
}

static int overlaps(uintptr_t alo, uintptr_t ahi, uintptr_t blo, uintptr_t bhi) { return alo < bhi && blo < ahi; }

static int same_shape(const flashc_tensor *a, const flashc_tensor *b) {
    return a->shape[0] == b->shape[0] && a->shape[1] == b->shape[1] && a->shape[2] == b->shape[2] &&
           a->shape[3] == b->shape[3];
}

/* Records a byte range the call touches (front only: for the workspace check). */
static void note_range(flashc_problem *p, uintptr_t lo, uintptr_t hi) {
    if (p->nranges < (int)(sizeof p->range_lo / sizeof p->range_lo[0]) && hi > lo) {
        p->range_lo[p->nranges] = lo;
        p->range_hi[p->nranges] = hi;
        p->nranges++;
    }
}

/* [lo, hi) of count elements of esz bytes at ptr; INVALID_ARGUMENT when that wraps the address space. */
static flashc_status byte_range(flashc_context_t ctx, const char *name, const void *ptr, int64_t count, int64_t esz,
                                uintptr_t *lo, uintptr_t *hi) {
    int64_t bytes;
    if (!flashc_mul_i64(count, esz, &bytes) || (uint64_t)bytes > (uint64_t)SIZE_MAX / 2 ||
        (uintptr_t)ptr > UINTPTR_MAX - (uintptr_t)bytes)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s: %lld elements do not fit the address space", name,
                          (long long)count);
    *lo = (uintptr_t)ptr;
    *hi = *lo + (uintptr_t)bytes;
    return FLASHC_STATUS_OK;
}

/* The block table's description into p: k, v are page pools (num_pages, page_size, Hkv, D), and each sequence has
 * max_pages * page_size logical key rows (p->Nk, p->total_k; varlen replaces Nk by max_seqlen_k later). */
static flashc_status paged_read(flashc_context_t ctx, const flashc_params *params, const flashc_tensor *k,
                                flashc_problem *p) {
    const int64_t ps = params->page_size ? params->page_size : k->shape[1], mp = params->block_table_max_pages;
    const int64_t stride = params->block_table_stride ? params->block_table_stride : mp;
    if (ps != k->shape[1])
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "page_size %lld differs from k's shape[1] (%lld): with a block table k and v are page pools "
                          "(num_pages, page_size, Hkv, D)",
                          (long long)params->page_size, (long long)k->shape[1]);
    if (mp <= 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "block_table_max_pages is %lld: a block table needs at least one page per sequence",
                          (long long)mp);
    if (stride < mp)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "block_table_stride %lld is shorter than a row of the table (%lld pages)", (long long)stride,
                          (long long)mp);
    int64_t nk;
    if (!flashc_mul_i64(mp, ps, &nk) || nk > FLASHC_MAX_ROWS)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "block_table_max_pages * page_size = %lld * %lld keys per sequence: more than 2^31 - 1024 "
                          "are not supported",
                          (long long)mp, (long long)ps);
    p->block_table = params->block_table;
    p->bt_max_pages = mp;
    p->bt_stride = stride;
    p->page_size = ps;
    p->num_pages = k->shape[0];
    p->Nk = p->total_k = nk;
    return FLASHC_STATUS_OK;
}

flashc_status flashc_problem_build(flashc_context_t ctx, flashc_op op, const flashc_tensor *q,
                                   const flashc_tensor *k, const flashc_tensor *v, const flashc_params *params,
                                   const flashc_tensor *out, float *lse, const flashc_tensor *dout,
                                   const flashc_tensor *dq, const flashc_tensor *dk, const flashc_tensor *dv,
                                   flashc_problem *p) {
    /* Queries (supported / workspace size) pass out == NULL and look at shapes only. */
    int query = (op == FLASHC_OP_FORWARD && !out) || (op == FLASHC_OP_BACKWARD && !dq && !dk && !dv && !dout);
    int need = !query;
    memset(p, 0, sizeof *p);
    if (!params) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "params is NULL (use flashc_params_default())");
    flashc_params layout_now;
    FLASHC_TRY(params_read(ctx, params, &layout_now));
    params = &layout_now;
    if (op != FLASHC_OP_FORWARD && op != FLASHC_OP_BACKWARD)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "unknown op %d", (int)op);

    /* Every buffer of a data call: the views, then lse, cu_seqlens q / k, slopes, block mask. */
    enum { IQ, IK, IV, IO, IDO, IDQ, IDK, IDV, ILSE, ICUQ, ICUK, ISLOPE, IMASK, IUSED, ISINK, IDSINK, ITABLE, NRANGE };
    static const char *names[NRANGE] = {"q",  "k",  "v",           "out",          "dout",        "dq",     "dk",
                                        "dv", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
                                        "block_mask", "seqused_k", "sinks", "dsinks", "block_table"};
    uintptr_t lo[NRANGE] = {0}, hi[NRANGE] = {0};
    FLASHC_TRY(check_view(ctx, "q", q, need, 0, &lo[IQ], &hi[IQ]));
    FLASHC_TRY(check_view(ctx, "k", k, need, 0, &lo[IK], &hi[IK]));
    FLASHC_TRY(check_view(ctx, "v", v, need, 0, &lo[IV], &hi[IV]));
    if (k->dtype != q->dtype || v->dtype != q->dtype)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "q, k, v dtypes differ (%s, %s, %s)",
                          flashc_dtype_name(q->dtype), flashc_dtype_name(k->dtype), flashc_dtype_name(v->dtype));
    if (!same_shape(k, v))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "k (%lld, %lld, %lld, %lld) and v (%lld, %lld, %lld, %lld) shapes differ",
                          (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2],
                          (long long)k->shape[3], (long long)v->shape[0], (long long)v->shape[1],
                          (long long)v->shape[2], (long long)v->shape[3]);
    if (k->shape[0] != q->shape[0] && !params->block_table)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "batch of q (%lld) and k (%lld) differ",
                          (long long)q->shape[0], (long long)k->shape[0]);
    if (k->shape[3] != q->shape[3])
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "head dim of q (%lld) and k (%lld) differ",
                          (long long)q->shape[3], (long long)k->shape[3]);
    p->op = op;
    p->dtype = q->dtype;
    p->B = q->shape[0];
    p->Nq = q->shape[1];
    p->Nk = k->shape[1];
    p->H = q->shape[2];
    p->Hkv = k->shape[2];
    p->D = q->shape[3];
    p->total_q = p->Nq;
    p->total_k = p->Nk;
    if (params->block_table) FLASHC_TRY(paged_read(ctx, params, k, p));
    if (p->H % p->Hkv != 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "H (%lld) is not a multiple of Hkv (%lld)",
                          (long long)p->H, (long long)p->Hkv);
    if (p->D > FLASHC_MAX_HEAD_DIM)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "head dim %lld is larger than %d", (long long)p->D,
                          FLASHC_MAX_HEAD_DIM);

    /* scores and masks */
    float scale = params->softmax_scale;
    if (!isfinite(scale)) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "softmax_scale is not finite");
    p->scale = scale == 0.0f ? (float)(1.0 / sqrt((double)p->D)) : scale;
    if (!(params->softcap >= 0.0f) || !isfinite(params->softcap))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "softcap %g must be finite and >= 0",
                          (double)params->softcap);
    p->softcap = params->softcap;
    if (params->window_left < -1 || params->window_right < -1)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "window (%lld, %lld): each side must be >= -1",
                          (long long)params->window_left, (long long)params->window_right);
    p->win_left = params->window_left;
    p->win_right = params->window_right;
    if (params->causal) p->win_right = 0; /* causal == window (left, 0), bottom-right aligned */
    if (params->alibi_slopes) {
        if (params->alibi_batch_stride < 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "alibi_batch_stride %lld is negative",
                              (long long)params->alibi_batch_stride);
        p->alibi = params->alibi_slopes;
        p->alibi_batch_stride = params->alibi_batch_stride;
    }
    FLASHC_TRY(check_dropout_p(ctx, params->dropout_p));
    p->dropout_p = params->dropout_p;
    p->dropout_seed = params->dropout_seed;
    p->dropout_offset = params->dropout_offset;
    p->dropout_rng = NULL;
    if (p->dropout_p > 0.0f && params->dropout_rng) {
        /* The CUDA kernels read the pair from device memory when they run; everyone else reads host memory now. */
        if (ctx && ctx->backend == FLASHC_BACKEND_CUDA) {
            p->dropout_rng = params->dropout_rng;
        } else {
            p->dropout_seed = params->dropout_rng[0];
            p->dropout_offset = params->dropout_rng[1];
        }
    }
    p->deterministic = params->deterministic != 0;

    /* positions (0.6) */
    if (params->positions) {
        const int64_t qp = params->q_position, kp = params->k_position;
        FLASHC_TRY(check_positions(ctx, qp, kp));
        p->positions = 1;
        p->q_position = qp;
        p->k_position = kp;
    }

    /* varlen */
    if ((params->cu_seqlens_q == NULL) != (params->cu_seqlens_k == NULL))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "varlen needs both cu_seqlens_q and cu_seqlens_k");
    if (params->cu_seqlens_q) {
        if (q->shape[0] != 1)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "varlen tensors are packed: q's batch dimension must be 1, not %lld",
                              (long long)q->shape[0]);
        if (params->num_seqs <= 0 || params->max_seqlen_q <= 0 || params->max_seqlen_k <= 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "varlen needs num_seqs, max_seqlen_q, max_seqlen_k > 0 (got %lld, %lld, %lld)",
                              (long long)params->num_seqs, (long long)params->max_seqlen_q,
                              (long long)params->max_seqlen_k);
        if (params->num_seqs > INT32_MAX)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "num_seqs %lld is too large",
                              (long long)params->num_seqs);
        /* No sequence is longer than the packed rows that hold it: a larger bound is a mistake, and it would size
         * the work (tasks, grids, the block mask's rows) by rows that do not exist. */
        if (params->max_seqlen_q > q->shape[1] || params->max_seqlen_k > (p->block_table ? p->Nk : k->shape[1]))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "max_seqlen (%lld, %lld) exceeds the packed totals (%lld query, %lld key rows%s)",
                              (long long)params->max_seqlen_q, (long long)params->max_seqlen_k,
                              (long long)q->shape[1], (long long)(p->block_table ? p->Nk : k->shape[1]),
                              p->block_table ? ": block_table_max_pages * page_size" : "");
        p->varlen = 1;
        p->cu_q = params->cu_seqlens_q;
        p->cu_k = params->cu_seqlens_k;
        p->B = params->num_seqs;
        p->Nq = params->max_seqlen_q;
        p->Nk = params->max_seqlen_k;
        p->total_q = q->shape[1];
        p->total_k = p->block_table ? p->Nk : k->shape[1]; /* paged: rows are not packed (flashc_seq_key_rows) */
    }
    /* Row counts stay in int32 even after the kernels round them up to whole tiles (at most 1024 rows). */
    if (p->total_q > FLASHC_MAX_ROWS || p->total_k > FLASHC_MAX_ROWS)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "sequences of (%lld, %lld) rows: more than 2^31 - 1024 are not supported",
                          (long long)p->total_q, (long long)p->total_k);
    /* The backends count work in int64 as B * H * N * D (tasks, per-head buffers, lse rows): it must fit. */
    int64_t work;
    const int64_t nmax = p->Nq > p->Nk ? p->Nq : p->Nk;
    if (!flashc_mul_i64(p->B, p->H, &work) || !flashc_mul_i64(work, nmax, &work) ||
        !flashc_mul_i64(work, FLASHC_MAX_HEAD_DIM, &work))
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "B * H * max(Nq, Nk) * %d = %lld * %lld * %lld * %d does not fit in int64",
                          FLASHC_MAX_HEAD_DIM, (long long)p->B, (long long)p->H, (long long)nmax,
                          FLASHC_MAX_HEAD_DIM);
    /* A window side that hides no key of any row is unbounded, and says so, which also keeps i + diag -/+ window
     * within int64 in every kernel (and what is left within Nq + |diag| and Nk + |diag|). Row i keeps keys from
     * i + diag - left, which is <= 0 for every row when left >= Nq - 1 + diag, up to i + diag + right, >= nk - 1
     * for every row when right >= nk - 1 - diag. Bottom-right aligned, diag = nk - nq: left >= Nk and right >= Nq
     * (for every sequence, at the maximum lengths). With positions diag is q_position - k_position for every
     * sequence. */
    {
        const int64_t diag = flashc_seq_diag(p, p->Nq, p->Nk);
        if (p->win_left >= p->Nq + diag) p->win_left = -1;
        if (p->win_right >= p->Nk - diag) p->win_right = -1;
    }
    /* Positions that change nothing (no band side left, no ALiBi, no dropout) are dropped: the plain problem, which
     * every kernel takes whatever the positions' size. */
    if (p->positions && p->win_left < 0 && p->win_right < 0 && !p->alibi && !(p->dropout_p > 0.0f)) {
        p->positions = 0;
        p->q_position = p->k_position = 0;
    }
    if (p->positions && p->dropout_p > 0.0f)
        FLASHC_TRY(check_dropout_positions(ctx, p->q_position, p->k_position, p->Nq, p->Nk));

    /* used keys per sequence, sinks */
    p->seqused_k = params->seqused_k;
    p->sinks = params->sinks;
    if (params->dsinks && !params->sinks)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "dsinks is set but sinks is NULL");
    if (op == FLASHC_OP_BACKWARD) p->dsinks = params->dsinks;

    /* block-sparse mask */
    if (params->block_mask) {
        if (params->block_mask_q <= 0 || params->block_mask_k <= 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "block mask block sizes (%lld, %lld) must be > 0",
                              (long long)params->block_mask_q, (long long)params->block_mask_k);
        if (!(params->block_mask_batch == 1 || params->block_mask_batch == p->B) ||
            !(params->block_mask_heads == 1 || params->block_mask_heads == p->H))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "block mask (batch %lld, heads %lld) must broadcast to (B %lld, H %lld): use 1 or the "
                              "full size",
                              (long long)params->block_mask_batch, (long long)params->block_mask_heads,
                              (long long)p->B, (long long)p->H);
        p->block_mask = params->block_mask;
        /* A block longer than the sequence is one block: clamping changes no mask byte's meaning and keeps the
         * kernels' index arithmetic small. */
        p->bm_q = params->block_mask_q < p->Nq ? params->block_mask_q : p->Nq;
        p->bm_k = params->block_mask_k < p->Nk ? params->block_mask_k : p->Nk;
        p->bm_batch = params->block_mask_batch;
        p->bm_heads = params->block_mask_heads;
        p->bm_nqb = p->Nq / p->bm_q + (p->Nq % p->bm_q != 0);
        p->bm_nkb = p->Nk / p->bm_k + (p->Nk % p->bm_k != 0);
        int64_t mask_bytes;
        if (!flashc_mul_i64(p->bm_batch, p->bm_heads, &mask_bytes) ||
            !flashc_mul_i64(mask_bytes, p->bm_nqb, &mask_bytes) || !flashc_mul_i64(mask_bytes, p->bm_nkb, &mask_bytes))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "the block mask's size overflows int64");
        if (need) FLASHC_TRY(byte_range(ctx, "block_mask", p->block_mask, mask_bytes, 1, &lo[IMASK], &hi[IMASK]));
    }

    p->q = *q;
    p->k = *k;
    p->v = *v;
    if (query) return FLASHC_STATUS_OK;

    /* The small inputs' byte ranges, for the aliasing checks below. */
    if (p->varlen) {
        FLASHC_TRY(byte_range(ctx, "cu_seqlens_q", p->cu_q, p->B + 1, 4, &lo[ICUQ], &hi[ICUQ]));
        FLASHC_TRY(byte_range(ctx, "cu_seqlens_k", p->cu_k, p->B + 1, 4, &lo[ICUK], &hi[ICUK]));
    }
    if (p->alibi) { /* slope(b, h) = alibi[b * stride + h]: (B - 1) * stride + H floats */
        int64_t n;
        if (!flashc_mul_i64(p->B - 1, p->alibi_batch_stride, &n) || !flashc_add_i64(n, p->H, &n))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "alibi_batch_stride %lld overflows int64 offsets",
                              (long long)p->alibi_batch_stride);
        FLASHC_TRY(byte_range(ctx, "alibi_slopes", p->alibi, n, 4, &lo[ISLOPE], &hi[ISLOPE]));
    }
    if (p->seqused_k) FLASHC_TRY(byte_range(ctx, "seqused_k", p->seqused_k, p->B, 4, &lo[IUSED], &hi[IUSED]));
    if (p->sinks) FLASHC_TRY(byte_range(ctx, "sinks", p->sinks, p->H, 4, &lo[ISINK], &hi[ISINK]));
    if (p->block_table) { /* (B - 1) * stride + max_pages entries */
        int64_t n;
        if (!flashc_mul_i64(p->B - 1, p->bt_stride, &n) || !flashc_add_i64(n, p->bt_max_pages, &n))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "block_table_stride %lld overflows int64 offsets",
                              (long long)p->bt_stride);
        FLASHC_TRY(byte_range(ctx, "block_table", p->block_table, n, 4, &lo[ITABLE], &hi[ITABLE]));
    }
    if (lse) {
        int64_t n; /* (B, H, Nq), varlen (H, total_q) */
        if (!flashc_mul_i64(p->H, p->total_q, &n) || !flashc_mul_i64(n, p->varlen ? 1 : p->B, &n))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "softmax_lse's size overflows int64");
        FLASHC_TRY(byte_range(ctx, "softmax_lse", lse, n, 4, &lo[ILSE], &hi[ILSE]));
    }

    /* outputs and backward inputs */
    int outputs[5], nout = 0;
    if (op == FLASHC_OP_FORWARD) {
        FLASHC_TRY(check_view(ctx, "out", out, 1, 1, &lo[IO], &hi[IO]));
        if (!same_shape(out, q) || out->dtype != q->dtype)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "out must have q's shape and dtype");
        p->out = *out;
        p->lse = lse;
        outputs[nout++] = IO;
        if (lse) outputs[nout++] = ILSE;
    } else {
        if (!lse)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "backward needs softmax_lse from the forward");
        FLASHC_TRY(check_view(ctx, "out", out, 1, 0, &lo[IO], &hi[IO]));
        FLASHC_TRY(check_view(ctx, "dout", dout, 1, 0, &lo[IDO], &hi[IDO]));
        FLASHC_TRY(check_view(ctx, "dq", dq, 1, 1, &lo[IDQ], &hi[IDQ]));
        FLASHC_TRY(check_view(ctx, "dk", dk, 1, 1, &lo[IDK], &hi[IDK]));
        FLASHC_TRY(check_view(ctx, "dv", dv, 1, 1, &lo[IDV], &hi[IDV]));
        const flashc_tensor *like_q[3] = {out, dout, dq}, *like_k[2] = {dk, dv};
        static const char *qnames[3] = {"out", "dout", "dq"}, *knames[2] = {"dk", "dv"};
        for (int i = 0; i < 3; i++)
            if (!same_shape(like_q[i], q) || like_q[i]->dtype != q->dtype)
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s must have q's shape and dtype", qnames[i]);
        for (int i = 0; i < 2; i++)
            if (!same_shape(like_k[i], k) || like_k[i]->dtype != q->dtype)
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s must have k's shape and q's dtype",
                                  knames[i]);
        p->out = *out;
        p->dout = *dout;
        p->dq = *dq;
        p->dk = *dk;
        p->dv = *dv;
        p->lse = lse;
        outputs[nout++] = IDQ;
        outputs[nout++] = IDK;
        outputs[nout++] = IDV;
        if (p->dsinks) {
            FLASHC_TRY(byte_range(ctx, "dsinks", p->dsinks, p->H, 4, &lo[IDSINK], &hi[IDSINK]));
            outputs[nout++] = IDSINK;
        }
    }
    /* An output shares no byte with any other buffer of the call: inputs would change under the kernels' feet and
     * two outputs would race. (Inputs may overlap each other: they are only read.) */
    for (int oi = 0; oi < nout; oi++) {
        const int o = outputs[oi];
        for (int i = 0; i < NRANGE; i++)
            if (i != o && hi[i] > lo[i] && overlaps(lo[o], hi[o], lo[i], hi[i]))
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s overlaps %s in memory", names[o], names[i]);
    }
    for (int i = 0; i < NRANGE; i++) note_range(p, lo[i], hi[i]);
    return FLASHC_STATUS_OK;
}

/* ---- attention ----------------------------------------------------------------------------------------- */

/* The backend's one decision for this call; a workspace that does not fit (the backends saturate at SIZE_MAX)
 * is refused here. */
static flashc_status plan_call(flashc_context_t ctx, const flashc_problem *p, flashc_plan *plan) {
    memset(plan, 0, sizeof *plan);
    FLASHC_TRY(ctx->ops->plan(ctx, p, plan));
    if (plan->workspace > SIZE_MAX / 2)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                          "the workspace for this problem does not fit in this address space");
    return FLASHC_STATUS_OK;
}

/* A query (supported, kernel name, workspace size): shapes and parameters only, then the plan. */
static flashc_status plan_query(flashc_context_t ctx, flashc_op op, const flashc_tensor *q, const flashc_tensor *k,
                                const flashc_tensor *v, const flashc_params *params, flashc_plan *plan) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    flashc_problem p;
    FLASHC_TRY(flashc_problem_build(ctx, op, q, k, v, params, NULL, NULL, NULL, NULL, NULL, NULL, &p));
    FLASHC_TRY(plan_call(ctx, &p, plan));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_supported(flashc_context_t ctx, flashc_op op, const flashc_tensor *q, const flashc_tensor *k,
                               const flashc_tensor *v, const flashc_params *params) {
    flashc_plan plan;
    return plan_query(ctx, op, q, k, v, params, &plan);
}

const char *flashc_kernel_name(flashc_context_t ctx, flashc_op op, const flashc_tensor *q, const flashc_tensor *k,
                               const flashc_tensor *v, const flashc_params *params) {
    flashc_plan plan;
    return plan_query(ctx, op, q, k, v, params, &plan) == FLASHC_STATUS_OK ? plan.kernel : NULL;
}

static flashc_status workspace_size(flashc_context_t ctx, flashc_op op, const flashc_tensor *q,
                                    const flashc_tensor *k, const flashc_tensor *v, const flashc_params *params,
                                    size_t *bytes) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (!bytes) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "bytes is NULL");
    *bytes = 0;
    flashc_plan plan;
    FLASHC_TRY(plan_query(ctx, op, q, k, v, params, &plan));
    *bytes = plan.workspace;
    return FLASHC_STATUS_OK;
}

flashc_status flashc_forward_workspace_size(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                                            const flashc_tensor *v, const flashc_params *params, size_t *bytes) {
    return workspace_size(ctx, FLASHC_OP_FORWARD, q, k, v, params, bytes);
}

flashc_status flashc_backward_workspace_size(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                                             const flashc_tensor *v, const flashc_params *params, size_t *bytes) {
    return workspace_size(ctx, FLASHC_OP_BACKWARD, q, k, v, params, bytes);
}

typedef flashc_status (*run_fn)(struct flashc_context *, const flashc_problem *, const flashc_plan *, void *);

/* Plans p, then runs it with the caller's workspace or one the backend allocates for this call. */
static flashc_status plan_and_run(flashc_context_t ctx, const flashc_problem *p, run_fn fn, void *workspace,
                                  size_t workspace_bytes) {
    flashc_plan plan;
    FLASHC_TRY(plan_call(ctx, p, &plan));
    const size_t need = plan.workspace;
    if (workspace && workspace_bytes < need)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "workspace has %zu bytes, this problem needs %zu",
                          workspace_bytes, need);
    /* The kernels read and write it 16 bytes at a time (and hand it to the TMA): malloc and cudaMalloc give that. */
    if (workspace && need > 0 && (uintptr_t)workspace % 16)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "workspace %p is not 16-byte aligned", workspace);
    if (workspace && need > 0) {
        const uintptr_t wlo = (uintptr_t)workspace, whi = wlo + need;
        if (whi < wlo)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "workspace %p + %zu bytes wraps the address space",
                              workspace, need);
        for (int i = 0; i < p->nranges; i++)
            if (overlaps(wlo, whi, p->range_lo[i], p->range_hi[i]))
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                  "the workspace's first %zu bytes overlap a tensor or parameter array of the call",
                                  need);
    }
    void *owned = NULL;
    if (!workspace && need > 0) {
        FLASHC_TRY(ctx->ops->workspace_alloc(ctx, need, &owned));
        workspace = owned;
    }
    flashc_status st = fn(ctx, p, &plan, need > 0 ? workspace : NULL);
    if (owned) ctx->ops->workspace_free(ctx, owned);
    return st;
}

flashc_status flashc_forward(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                             const flashc_tensor *v, const flashc_params *params, const flashc_tensor *out,
                             float *softmax_lse, void *workspace, size_t workspace_bytes) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (!out) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "out is NULL");
    flashc_problem p;
    FLASHC_TRY(flashc_problem_build(ctx, FLASHC_OP_FORWARD, q, k, v, params, out, softmax_lse, NULL, NULL, NULL,
                                    NULL, &p));
    FLASHC_TRY(plan_and_run(ctx, &p, ctx->ops->forward, workspace, workspace_bytes));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

/* Whether d = sum_k c_k stride[k] with |c_k| < shape[k] over dims [0, n) sorted by decreasing stride (sd, nd), i.e.
 * whether two views of one shape and strides, d elements apart, share an element. Each stride must exceed the span
 * of the smaller ones (nested dims): then only the two coefficients around d / stride can leave a remainder the
 * smaller dims reach, and the search is exact. */
static int shifted_views_meet(int64_t d, const int64_t *sd, const int64_t *nd, const int64_t *span, int n) {
    if (n == 0) return d == 0;
    const int64_t c0 = d >= 0 ? d / sd[0] : -((-d + sd[0] - 1) / sd[0]); /* floor */
    for (int64_t c = c0; c <= c0 + 1; c++) {
        if (c <= -nd[0] || c >= nd[0]) continue;
        const int64_t r = d - c * sd[0];
        if (r >= -span[1] && r <= span[1] && shifted_views_meet(r, sd + 1, nd + 1, span + 1, n - 1)) return 1;
    }
    return 0;
}

/* Whether views a and b (same dtype) may share an element: exact for two views of one shape and strides whose dims
 * nest (a packed KV cache's k and v halves, interleaved but disjoint); otherwise whether their byte ranges meet. */
static int views_may_meet(const flashc_tensor *a, const flashc_tensor *b, uintptr_t alo, uintptr_t ahi, uintptr_t blo,
                          uintptr_t bhi) {
    if (!overlaps(alo, ahi, blo, bhi)) return 0;
    const int64_t esz = (int64_t)flashc_dtype_size(a->dtype);
    const int64_t bytes = (int64_t)((uintptr_t)b->data - (uintptr_t)a->data);
    if (!same_shape(a, b) || bytes % esz) return 1;
    int64_t sd[4], nd[4], span[5];
    int n = 0;
    for (int i = 0; i < 4; i++) {
        if (a->stride[i] != b->stride[i]) return 1;
        if (a->shape[i] > 1) {
            if (a->stride[i] <= 0) return 1;
            sd[n] = a->stride[i], nd[n] = a->shape[i], n++;
        }
    }
    for (int i = 0; i < n; i++) /* sort by decreasing stride */
        for (int j = i + 1; j < n; j++)
            if (sd[j] > sd[i]) {
                int64_t t = sd[i]; sd[i] = sd[j]; sd[j] = t;
                t = nd[i]; nd[i] = nd[j]; nd[j] = t;
            }
    span[n] = 0; /* span[k]: the largest offset dims k.. reach */
    for (int i = n - 1; i >= 0; i--) {
        span[i] = span[i + 1] + (nd[i] - 1) * sd[i];
        if (i < n - 1 && sd[i] <= span[i + 1]) return 1; /* not nested */
    }
    return shifted_views_meet(bytes / esz, sd, nd, span, n);
}

/* What both appends check: the views, their shapes and dtypes, and that the caches share no byte with each other's
 * elements or with the inputs (extra: one more input range, the block table, or none). paged: the caches are page
 * pools (num_pages, page_size, Hkv, D) whose batch need not match k_new's, and whose rows the new ones need not fit. */
static flashc_status append_checks(flashc_context_t ctx, const flashc_tensor *k_cache, const flashc_tensor *v_cache,
                                   const flashc_tensor *k_new, const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                   int paged, const char *extra_name, const void *extra, int64_t extra_count) {
    if (!cache_seqlens) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "cache_seqlens is NULL");
    enum { KC, VC, KN, VN, SL, EX, N };
    const char *names[N] = {"k_cache", "v_cache", "k_new", "v_new", "cache_seqlens", extra_name};
    uintptr_t lo[N] = {0}, hi[N] = {0};
    FLASHC_TRY(check_view(ctx, "k_cache", k_cache, 1, 1, &lo[KC], &hi[KC]));
    FLASHC_TRY(check_view(ctx, "v_cache", v_cache, 1, 1, &lo[VC], &hi[VC]));
    FLASHC_TRY(check_view(ctx, "k_new", k_new, 1, 0, &lo[KN], &hi[KN]));
    FLASHC_TRY(check_view(ctx, "v_new", v_new, 1, 0, &lo[VN], &hi[VN]));
    if (!same_shape(k_cache, v_cache) || !same_shape(k_new, v_new))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "k_cache and v_cache (and k_new and v_new) must have "
                                                               "the same shape");
    if (k_cache->dtype != v_cache->dtype || k_new->dtype != k_cache->dtype || v_new->dtype != k_cache->dtype)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "the caches and the new keys and values must share "
                                                               "one dtype");
    if ((!paged && k_new->shape[0] != k_cache->shape[0]) || k_new->shape[2] != k_cache->shape[2] ||
        k_new->shape[3] != k_cache->shape[3])
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "k_new (%lld, %lld, %lld, %lld) does not fit k_cache (%lld, %lld, %lld, %lld): %skv heads "
                          "and head dim must match",
                          (long long)k_new->shape[0], (long long)k_new->shape[1], (long long)k_new->shape[2],
                          (long long)k_new->shape[3], (long long)k_cache->shape[0], (long long)k_cache->shape[1],
                          (long long)k_cache->shape[2], (long long)k_cache->shape[3], paged ? "" : "batch, ");
    if (!paged && k_new->shape[1] > k_cache->shape[1])
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%lld new rows do not fit a cache of %lld",
                          (long long)k_new->shape[1], (long long)k_cache->shape[1]);
    FLASHC_TRY(byte_range(ctx, "cache_seqlens", cache_seqlens, k_new->shape[0], 4, &lo[SL], &hi[SL]));
    if (extra) FLASHC_TRY(byte_range(ctx, extra_name, extra, extra_count, 4, &lo[EX], &hi[EX]));
    /* The caches are written: they share no byte with each other or with the inputs. The two caches may interleave
     * without sharing an element (the k and v halves of one packed (B, N, 2, Hkv, D) cache). */
    if (views_may_meet(k_cache, v_cache, lo[KC], hi[KC], lo[VC], hi[VC]))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "k_cache and v_cache share elements in memory");
    for (int o = KC; o <= VC; o++)
        for (int i = KN; i < N; i++)
            if (hi[i] > lo[i] && overlaps(lo[o], hi[o], lo[i], hi[i]))
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s overlaps %s in memory", names[o], names[i]);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_kvcache_append(flashc_context_t ctx, const flashc_tensor *k_cache,
                                    const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                    const flashc_tensor *v_new, const int32_t *cache_seqlens) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    FLASHC_TRY(append_checks(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens, 0, "", NULL, 0));
    if (!ctx->ops->kvcache_append)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "the %s backend has no KV-cache append",
                          flashc_backend_name(ctx->backend));
    FLASHC_TRY(ctx->ops->kvcache_append(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_kvcache_append_paged(flashc_context_t ctx, const flashc_tensor *k_cache,
                                          const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                          const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                          const int32_t *block_table, int64_t block_table_max_pages,
                                          int64_t block_table_stride) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (!block_table) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "block_table is NULL");
    const int64_t mp = block_table_max_pages, stride = block_table_stride ? block_table_stride : mp;
    if (mp <= 0 || stride < mp)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "block table of %lld pages per row, row stride %lld: it needs at least one page, and the "
                          "stride at least a row",
                          (long long)mp, (long long)stride);
    if (!k_new) return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "k_new is NULL");
    int64_t n = 0; /* (B - 1) * stride + max_pages entries, when k_new's shape is sane (checked again below) */
    if (k_new->shape[0] <= 0 || !flashc_mul_i64(k_new->shape[0] - 1, stride, &n) || !flashc_add_i64(n, mp, &n))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "k_new's batch %lld with a block table row stride of %lld: out of range",
                          (long long)k_new->shape[0], (long long)stride);
    FLASHC_TRY(append_checks(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens, 1, "block_table", block_table, n));
    int64_t rows;
    if (!flashc_mul_i64(mp, k_cache->shape[1], &rows) || rows > FLASHC_MAX_ROWS)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "%lld pages of %lld rows per sequence: more than 2^31 - "
                          "1024 rows are not supported", (long long)mp, (long long)k_cache->shape[1]);
    if (k_new->shape[1] > rows)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "%lld new rows do not fit a block table of %lld pages of %lld rows",
                          (long long)k_new->shape[1], (long long)mp, (long long)k_cache->shape[1]);
    if (!ctx->ops->kvcache_append_paged)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "paged KV (block_table) append is not supported by the %s "
                          "backend yet", flashc_backend_name(ctx->backend));
    FLASHC_TRY(ctx->ops->kvcache_append_paged(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, mp,
                                              stride));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

static int same_view(const flashc_tensor *a, const flashc_tensor *b) {
    return a->data == b->data && a->dtype == b->dtype && same_shape(a, b) && a->stride[0] == b->stride[0] &&
           a->stride[1] == b->stride[1] && a->stride[2] == b->stride[2] && a->stride[3] == b->stride[3];
}

flashc_status flashc_merge(flashc_context_t ctx, const flashc_tensor *out_a, const float *lse_a,
                           const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out, float *lse) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    enum { OA, OB, O, LA, LB, L, N };
    static const char *names[N] = {"out_a", "out_b", "out", "lse_a", "lse_b", "lse"};
    uintptr_t lo[N] = {0}, hi[N] = {0};
    FLASHC_TRY(check_view(ctx, "out_a", out_a, 1, 0, &lo[OA], &hi[OA]));
    FLASHC_TRY(check_view(ctx, "out_b", out_b, 1, 0, &lo[OB], &hi[OB]));
    FLASHC_TRY(check_view(ctx, "out", out, 1, 1, &lo[O], &hi[O]));
    if (!same_shape(out_a, out_b) || !same_shape(out_a, out))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "out_a (%lld, %lld, %lld, %lld), out_b (%lld, %lld, %lld, %lld) and out (%lld, %lld, %lld, "
                          "%lld) must have one shape (B, Nq, H, D)",
                          (long long)out_a->shape[0], (long long)out_a->shape[1], (long long)out_a->shape[2],
                          (long long)out_a->shape[3], (long long)out_b->shape[0], (long long)out_b->shape[1],
                          (long long)out_b->shape[2], (long long)out_b->shape[3], (long long)out->shape[0],
                          (long long)out->shape[1], (long long)out->shape[2], (long long)out->shape[3]);
    if (out_b->dtype != out_a->dtype || out->dtype != out_a->dtype)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "out_a, out_b and out dtypes differ (%s, %s, %s)",
                          flashc_dtype_name(out_a->dtype), flashc_dtype_name(out_b->dtype),
                          flashc_dtype_name(out->dtype));
    if (!lse_a || !lse_b)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s is NULL: each part needs its softmax_lse",
                          !lse_a ? "lse_a" : "lse_b");
    /* lse (B, H, Nq): check_view bounded the element count, so this product fits */
    const int64_t rows = out->shape[0] * out->shape[1] * out->shape[2];
    FLASHC_TRY(byte_range(ctx, "lse_a", lse_a, rows, 4, &lo[LA], &hi[LA]));
    FLASHC_TRY(byte_range(ctx, "lse_b", lse_b, rows, 4, &lo[LB], &hi[LB]));
    if (lse) FLASHC_TRY(byte_range(ctx, "lse", lse, rows, 4, &lo[L], &hi[L]));
    /* Whole elements only: a GPU faults (and its context stays broken) on a misaligned load. */
    const void *ptrs[N] = {out_a->data, out_b->data, out->data, lse_a, lse_b, lse};
    for (int i = 0; i < N; i++) {
        const uintptr_t align = i < LA ? (uintptr_t)flashc_dtype_size(out->dtype) : 4;
        if ((uintptr_t)ptrs[i] % align)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s (%p) is not aligned to its %u-byte elements",
                              names[i], ptrs[i], (unsigned)align);
    }
    /* In place: an output may be an input's very view (each row is read before it is written, by whoever writes it);
     * otherwise it shares no byte with any input or with the other output. Inputs may overlap each other. */
    const int same[N][N] = {[O] = {[OA] = same_view(out, out_a), [OB] = same_view(out, out_b)},
                            [L] = {[LA] = lse && lse == lse_a, [LB] = lse && lse == lse_b}};
    const int outputs[2] = {O, L};
    for (int oi = 0; oi < 2; oi++) {
        const int o = outputs[oi];
        for (int i = 0; i < N; i++)
            if (i != o && hi[o] > lo[o] && hi[i] > lo[i] && !same[o][i] && overlaps(lo[o], hi[o], lo[i], hi[i]))
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s overlaps %s in memory%s", names[o],
                                  names[i],
                                  (o == O && (i == OA || i == OB)) || (o == L && (i == LA || i == LB))
                                      ? " (in place, it must be that very view: the same data and strides)"
                                      : "");
    }
    if (!ctx->ops->merge)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "the %s backend has no merge",
                          flashc_backend_name(ctx->backend));
    FLASHC_TRY(ctx->ops->merge(ctx, out_a, lse_a, out_b, lse_b, out, lse));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_rotary(flashc_context_t ctx, const flashc_tensor *x, const flashc_tensor *cos,
                            const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                            const flashc_tensor *out) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    enum { X, C, S, SS, O, N };
    static const char *names[N] = {"x", "cos", "sin", "seq_start", "out"};
    uintptr_t lo[N] = {0}, hi[N] = {0};
    FLASHC_TRY(check_view(ctx, "x", x, 1, 0, &lo[X], &hi[X]));
    FLASHC_TRY(check_view(ctx, "cos", cos, 1, 0, &lo[C], &hi[C]));
    FLASHC_TRY(check_view(ctx, "sin", sin, 1, 0, &lo[S], &hi[S]));
    FLASHC_TRY(check_view(ctx, "out", out, 1, 1, &lo[O], &hi[O]));
    if (!same_shape(x, out) || out->dtype != x->dtype)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "x (%lld, %lld, %lld, %lld) %s and out (%lld, %lld, %lld, %lld) %s must have one shape "
                          "(B, N, H, D) and dtype",
                          (long long)x->shape[0], (long long)x->shape[1], (long long)x->shape[2],
                          (long long)x->shape[3], flashc_dtype_name(x->dtype), (long long)out->shape[0],
                          (long long)out->shape[1], (long long)out->shape[2], (long long)out->shape[3],
                          flashc_dtype_name(out->dtype));
    if (!same_shape(cos, sin) || sin->dtype != cos->dtype || cos->shape[0] != 1 || cos->shape[2] != 1)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "cos (%lld, %lld, %lld, %lld) %s and sin (%lld, %lld, %lld, %lld) %s must be tables of one "
                          "shape (1, P, 1, R/2) and dtype",
                          (long long)cos->shape[0], (long long)cos->shape[1], (long long)cos->shape[2],
                          (long long)cos->shape[3], flashc_dtype_name(cos->dtype), (long long)sin->shape[0],
                          (long long)sin->shape[1], (long long)sin->shape[2], (long long)sin->shape[3],
                          flashc_dtype_name(sin->dtype));
    if (cos->shape[3] > x->shape[3] / 2)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "the rotary dim 2 * %lld (twice the tables' shape[3]) exceeds the head dim %lld",
                          (long long)cos->shape[3], (long long)x->shape[3]);
    if (seq_start) FLASHC_TRY(byte_range(ctx, "seq_start", seq_start, x->shape[0], 4, &lo[SS], &hi[SS]));
    /* Whole elements only: a GPU faults (and its context stays broken) on a misaligned load. */
    const void *ptrs[N] = {x->data, cos->data, sin->data, seq_start, out->data};
    const flashc_dtype types[N] = {x->dtype, cos->dtype, sin->dtype, FLASHC_DTYPE_F32, out->dtype};
    for (int i = 0; i < N; i++)
        if ((uintptr_t)ptrs[i] % flashc_dtype_size(types[i]))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "%s (%p) is not aligned to its %u-byte elements",
                              names[i], ptrs[i], (unsigned)flashc_dtype_size(types[i]));
    /* In place: out may be x's very view (each pair is read before it is written, by the thread that writes it);
     * otherwise it shares no byte with x. The tables and seq_start are never written over. */
    for (int i = X; i < O; i++)
        if (hi[i] > lo[i] && overlaps(lo[O], hi[O], lo[i], hi[i]) && !(i == X && same_view(out, x)))
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "out overlaps %s in memory%s", names[i],
                              i == X ? " (in place, it must be x's very view: the same data and strides)" : "");
    if (!ctx->ops->rotary)
        return FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED, "the %s backend has no rotary embedding",
                          flashc_backend_name(ctx->backend));
    FLASHC_TRY(ctx->ops->rotary(ctx, x, cos, sin, seq_start, interleaved != 0, out));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}

flashc_status flashc_backward(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                              const flashc_tensor *v, const flashc_tensor *out, const flashc_tensor *dout,
                              const float *softmax_lse, const flashc_params *params, const flashc_tensor *dq,
                              const flashc_tensor *dk, const flashc_tensor *dv, void *workspace,
                              size_t workspace_bytes) {
    if (!ctx) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "ctx is NULL");
    if (!out || !dout || !dq || !dk || !dv)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "backward needs out, dout, dq, dk and dv");
    flashc_problem p;
    FLASHC_TRY(flashc_problem_build(ctx, FLASHC_OP_BACKWARD, q, k, v, params, out, (float *)softmax_lse, dout, dq,
                                    dk, dv, &p));
    FLASHC_TRY(plan_and_run(ctx, &p, ctx->ops->backward, workspace, workspace_bytes));
    flashc_clear_error(ctx);
    return FLASHC_STATUS_OK;
}
