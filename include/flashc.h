/*
 * flashc.h - exact, IO-aware softmax attention (FlashAttention) as a C11 library.
 *
 * Glossary, used by every shape comment below:
 *   B    batch                       Nq  query length        Nk   key/value length
 *   H    query heads                 Hkv key/value heads     D    head dimension
 *   (H % Hkv == 0; query head h reads kv head h / (H / Hkv): GQA when Hkv < H, MQA when Hkv == 1.)
 *
 * Layout: q is (B, Nq, H, D), k and v are (B, Nk, Hkv, D), out/dout/dq like q, dk/dv like k. Every tensor is
 * a view with int64 strides in elements, so (B, H, N, D) tensors are passed without copies by permuting the
 * strides. The last dimension must have stride 1 on the CUDA backend.
 * softmax_lse is fp32, contiguous (B, H, Nq), natural log.
 *
 * Semantics are flash-attn 2.x's:
 *   s = scale * q.k                    (scale 0 selects 1/sqrt(D))
 *   s = softcap * tanh(s / softcap)     when softcap > 0
 *   s = s - slope * |i + Nk - Nq - j|   with ALiBi
 *   causal is bottom-right aligned:     query i sees key j iff j <= i + Nk - Nq
 *   window (left, right), -1 unbounded: key j is kept iff i+Nk-Nq-left <= j <= i+Nk-Nq+right
 *   with positions (flashc_params 0.6), i + Nk - Nq above is i + q_position - k_position instead
 *   a row that sees no key has output 0, lse +inf and zero gradients (lse = the sink with attention sinks).
 *
 * Memory: every pointer (tensor data, lse, slopes, block mask, cu_seqlens, workspace) lives where the
 * context's backend computes: host memory for the CPU backend, device memory for the CUDA backend.
 *
 * Errors: every function returns a flashc_status; nothing in the library aborts or exits, whatever the input.
 * A refused call writes no output. The last error is kept as "file:line: message" per thread: see
 * flashc_context_last_error.
 *
 * Threads: contexts may be shared. Attention calls (supported, kernel_name, workspace sizes, forward, backward)
 * on one context may run from several threads at once; set the stream and thread count before that, not
 * concurrently with calls on the same context. On CUDA, calls from several threads go to the context's one stream
 * in the order they arrive.
 *
 * Non-finite values (as torch and flash-attn): a NaN in q, k or v that a row sees, or a score that overflows to
 * +inf, makes that row's output and lse NaN, and its gradients NaN. Rows that do not see it are unchanged when the
 * NaN is in q or k; a NaN in v at a masked key may still reach rows of the same tile (0 * NaN). A non-finite
 * scale, softcap or (CPU) ALiBi slope is refused.
 *
 * Limits: D <= 256; Nq, Nk and varlen totals at most 2^31 - 1024 rows; B * H * max(Nq, Nk) * 256 within int64; every view's byte
 * span within half the address space. Larger problems are refused with NOT_SUPPORTED or INVALID_ARGUMENT, never
 * wrapped. Window sides >= Nk (left) or >= Nq (right) are unbounded (with positions: >= Nq + q_position - k_position
 * (left) or >= Nk - q_position + k_position (right)); block-mask block sizes longer than the sequence are one block.
 */
#ifndef FLASHC_H
#define FLASHC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(FLASHC_SHARED)
#  ifdef FLASHC_BUILDING
#    define FLASHC_API __declspec(dllexport)
#  else
#    define FLASHC_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__)
#  define FLASHC_API __attribute__((visibility("default")))
#else
#  define FLASHC_API
#endif

#define FLASHC_VERSION_MAJOR 0
#define FLASHC_VERSION_MINOR 6
#define FLASHC_VERSION_PATCH 0

/* Status codes. Values are only ever appended. */
typedef enum flashc_status {
    FLASHC_STATUS_OK = 0,
    FLASHC_STATUS_INVALID_ARGUMENT = 1,
    FLASHC_STATUS_NOT_SUPPORTED = 2,
    FLASHC_STATUS_OUT_OF_MEMORY = 3,
    FLASHC_STATUS_DEVICE_ERROR = 4,
    FLASHC_STATUS_INTERNAL = 5
} flashc_status;

typedef enum flashc_backend {
    FLASHC_BACKEND_AUTO = 0, /* CUDA when compiled in and a GPU is present, else CPU */
    FLASHC_BACKEND_CPU = 1,
    FLASHC_BACKEND_CUDA = 2
} flashc_backend;

typedef enum flashc_dtype {
    FLASHC_DTYPE_F32 = 0,
    FLASHC_DTYPE_F16 = 1,
    FLASHC_DTYPE_BF16 = 2
} flashc_dtype;

typedef enum flashc_op {
    FLASHC_OP_FORWARD = 0,
    FLASHC_OP_BACKWARD = 1
} flashc_op;

/* A strided 4-d view. shape/stride are in elements; strides may be any value for inputs. An output must not
 * address one element twice (no zero strides, no overlapping rows) and must share no byte with any other buffer of
 * the call (inputs, other outputs, lse, cu_seqlens, slopes, block mask, workspace). */
typedef struct flashc_tensor {
    void *data;
    flashc_dtype dtype;
    int64_t shape[4];
    int64_t stride[4];
} flashc_tensor;

/*
 * Attention parameters. Always start from flashc_params_default(), which sets struct_size to
 * sizeof(flashc_params) of the flashc.h it was compiled with; then set the fields you need.
 *
 * Growing safely: fields are only ever appended, each after the previous version's last byte (never into its
 * tail padding), and a new field's zero bytes mean what its default means. So the library reads
 *   - struct_size of a layout an older flashc.h published (0.2 on): as that layout, newer fields at their
 *     defaults;
 *   - struct_size larger than this library's sizeof(flashc_params) (a newer flashc.h): as this layout, when
 *     every byte past it is zero (the caller set none of the newer fields), else refused;
 * and refuses anything else (a struct_size of 0, or one no flashc.h published) with INVALID_ARGUMENT. A program
 * built against a flashc.h older than 0.2 has no struct_size: rebuild it against this one.
 */
typedef struct flashc_params {
    uint32_t struct_size; /* sizeof(flashc_params) as the caller compiled it: set by flashc_params_default() */
    float softmax_scale;  /* 0: 1/sqrt(D) */
    int causal;           /* bottom-right aligned (or at positions, 0.6); same as window (left, 0) */
    int64_t window_left;  /* -1: unbounded */
    int64_t window_right; /* -1: unbounded */
    float softcap;        /* 0: off */

    /* ALiBi: fp32 slopes, slope(b, h) = alibi_slopes[b * alibi_batch_stride + h]. NULL: off.
     * alibi_batch_stride 0 gives one slope per head (H), H gives one per batch and head (B, H). */
    const float *alibi_slopes;
    int64_t alibi_batch_stride;

    /* Block-sparse mask: one byte per (query block, key block); 0 skips the block entirely. Contiguous
     * (mask_batch, mask_heads, ceil(Nq / block_mask_q), ceil(Nk / block_mask_k)), mask_batch in {1, B} and
     * mask_heads in {1, H} broadcast. Blocks count from the start of each sequence (also with varlen, where
     * Nq, Nk are max_seqlen_q, max_seqlen_k). NULL: off. */
    const uint8_t *block_mask;
    int64_t block_mask_q;
    int64_t block_mask_k;
    int64_t block_mask_batch;
    int64_t block_mask_heads;

    /* Varlen: when cu_seqlens_q and cu_seqlens_k are set, q is (1, total_q, H, D), k/v are (1, total_k, Hkv, D)
     * holding num_seqs sequences packed back to back; sequence b is rows cu_seqlens[b] .. cu_seqlens[b+1]-1
     * (int32, num_seqs + 1 entries, non-decreasing, starting at 0). max_seqlen_* bound every sequence's length.
     * softmax_lse is then (1, H, total_q) = (H, total_q). max_seqlen_q / _k may not exceed total_q / total_k. */
    const int32_t *cu_seqlens_q;
    const int32_t *cu_seqlens_k;
    int64_t num_seqs;
    int64_t max_seqlen_q;
    int64_t max_seqlen_k;

    /* Dropout of the attention probabilities: element (b, h, i, j) of P is dropped with probability dropout_p, and kept
     * ones are scaled by 1 / (1 - dropout_p) after the softmax normalization (softmax_lse is of the undropped softmax),
     * as flash-attn does: O = (P o Z) V. Which elements are dropped is a pure function of (dropout_seed,
     * dropout_offset, b, h, i, j), i and j counted within each sequence (with positions, 0.6 below: q_position + i and
     * k_position + j) (Philox4x32-10, src/dropout.h gives the exact formula; flashc_dropout_mask materializes it): the
     * same on every path, thread count and split, recomputed by the backward from the same params, never stored. A call
     * uses the Philox streams dropout_offset .. dropout_offset + B * H - 1 (B = num_seqs with varlen): advance
     * dropout_offset by at least B * H for a fresh mask on the next call. dropout_p in [0, 1) (NaN, < 0 and >= 1 are
     * refused); 0: off. dropout_rng (0.5, below) passes the seed and offset by pointer instead. */
    float dropout_p;
    uint64_t dropout_seed;
    uint64_t dropout_offset;

    /* Backward only: bitwise-reproducible gradients. */
    int deterministic;

    /* ---- 0.3 ---- */

    /* Keys each sequence uses (flash-attn's seqused_k), int32, one per sequence (B, or num_seqs with varlen):
     * sequence b attends to its first seqused_k[b] keys as if it had only those, so causal and window bands and
     * ALiBi distances align to that length (unless positions, 0.6, place them); the keys past it are never read into any result (NaN there
     * included) and get dk = dv = 0. Each value must lie in [0, the sequence's key length]: the CPU backend
     * refuses others, the CUDA backend (which does not read device memory before its launch) clamps them.
     * NULL: every key. What a padded or static KV cache needs. */
    const int32_t *seqused_k;

    /* Attention sinks (as GPT-OSS uses): one fp32 logit per query head (H), in natural-log units and not scaled,
     * that joins every row's softmax denominator without a value: lse_i = log(exp(sinks[h]) + sum_j exp(s_ij)),
     * P_ij = exp(s_ij - lse_i), O = P V. softmax_lse includes the sink, so a row that sees no key gets O = 0
     * and lse = sinks[h]. Sinks must be finite (the CPU backend refuses others; on CUDA they give NaN). NULL: off.
     * dsinks (backward only): where dL/dsinks is written, H fp32 summed over batch and rows; NULL: not computed. */
    const float *sinks;
    float *dsinks;

    /* ---- 0.4 ---- */

    /* Paged KV cache (flash-attn's block_table, vLLM's page table). When block_table is set, k and v are page pools
     * (num_pages, page_size, Hkv, D), any strides, and block_table is int32 (B, block_table_max_pages) with row
     * stride block_table_stride elements (0: block_table_max_pages; B is num_seqs with varlen): key j of sequence b
     * is row j % page_size of page block_table[b * stride + j / page_size]. Each sequence then has
     * Nk = block_table_max_pages * page_size logical key rows (varlen: cu_seqlens_k[b+1] - cu_seqlens_k[b] of them,
     * lengths only: the pool is not packed, and max_seqlen_k <= Nk), of which it uses the first seqused_k[b] when
     * seqused_k is set (flash-attn's cache_seqlens; the usual way to give each sequence its length). Only the pages
     * those used keys lie on are read, and they must be in [0, num_pages): the CPU backend checks every one (and
     * that no length needs more pages than a row of the table holds) and refuses the call before writing anything;
     * entries past them may hold anything (-1, say). Pages may be shared between sequences (a common prefix).
     * page_size: 0 takes k's shape[1]; otherwise it must equal it. Any page size >= 1.
     * Backward with a block table: dk and dv are page pools of k's shape (any strides), each row holding the
     * gradient of the key that lives there, and 0 on every row no used key maps to (unused pages included). A page
     * that the used keys of two sequences (or one sequence twice) lie on is refused with NOT_SUPPORTED: its rows
     * would get two gradients. The CUDA backend runs the forward and the append paged; it does not read device
     * memory before a launch, so it cannot refuse a bad entry: a page outside [0, num_pages) is never read, and the
     * rows of every query tile that met one come out NaN (out and lse); the append skips rows on such pages. Its
     * backward with a block table is NOT_SUPPORTED for now.
     * NULL: k, v are (B, Nk, Hkv, D). */
    const int32_t *block_table;
    int64_t block_table_max_pages;
    int64_t block_table_stride;
    int64_t page_size;

    /* ---- 0.5 ---- */

    /* Dropout's (seed, offset) by pointer: when set (and dropout_p > 0), two uint64 values { seed, offset } read in
     * place of dropout_seed and dropout_offset, from the call's device memory (CUDA: read by the kernels when they
     * run, so a caller can pass a generator's state that lives on the GPU without reading it back: no device sync,
     * and a CUDA graph replays whatever the pair holds at replay time) or host memory (CPU backend and
     * flashc_dropout_mask: read when the call is made). NULL: dropout_seed and dropout_offset. */
    const uint64_t *dropout_rng;

    /* ---- 0.6 ---- */

    /* Positions: where this call's rows and keys sit in a longer attention (context / ring parallelism, where each
     * call is one (query chunk, key chunk) pair of one long sequence). When positions is nonzero, query row i of
     * every sequence (every batch entry, every varlen sequence) sits at position q_position + i and key j at
     * k_position + j, and the band and ALiBi are measured between those positions: row i keeps the keys whose
     * position lies in [q_position + i - window_left, q_position + i + window_right] (each side -1: unbounded;
     * causal is window_right 0), and ALiBi adds -slope * |(q_position + i) - (k_position + j)|. In the terms of the
     * formulas at the top, i + Nk - Nq becomes i + q_position - k_position. seqused_k still limits which keys
     * exist, but no longer moves the alignment. The block mask still counts blocks from each sequence's first row
     * and key in this call, not from the positions.
     * A window side that hides no key of any row is treated as unbounded (left >= Nq + q_position - k_position,
     * right >= Nk - q_position + k_position).
     * |q_position| and |k_position| must be below 2^40 (INVALID_ARGUMENT otherwise); the CUDA backend, whose
     * kernels count rows in int32, takes |q_position - k_position| up to 2^29 and refuses more (NOT_SUPPORTED).
     * ALiBi distances are formed in fp32 (as flash-attn forms them): past 2^24 they are rounded. And the bias enters
     * the fp32 score whole: when every key a row sees is far away (distance dmin, e.g. a chunk pair far off the
     * diagonal), the differences between its keys' biases are resolved only to about fp32's unit roundoff of
     * slope * dmin, so such a call alone can miss the fp32 accuracy rule (a relative error of ~3e-5 measured at
     * slope 1, dmin 1500); in a ring that pair's part is weighted by about exp(-slope * dmin) in the merge.
     * Positions that change nothing (both sides unbounded after the rule above, no ALiBi, no dropout) are dropped:
     * the call is the plain one.
     * Dropout's (i, j) are the positions too, (q_position + i, k_position + j), so that the chunk pairs of a longer
     * attention drop exactly its elements (with the same dropout_seed and dropout_offset, and the same b and h); this
     * needs q_position >= 0, k_position >= 0 and a multiple of 4 (Philox's groups of four keys stay aligned),
     * q_position + Nq <= 2^32 and k_position + Nk <= 2^34 (dropout's 32-bit counters): other positions with
     * dropout_p > 0 are refused with NOT_SUPPORTED (flashc_dropout_mask likewise, with its Nq and Nk).
     * positions 0: off, bottom-right alignment as before (q_position and k_position are not read). */
    int positions;
    int64_t q_position;
    int64_t k_position;
} flashc_params;

typedef struct flashc_context *flashc_context_t;

/* ---- library ----------------------------------------------------------------------------------------- */

FLASHC_API const char *flashc_version(void);
FLASHC_API const char *flashc_status_string(flashc_status status);
FLASHC_API const char *flashc_dtype_name(flashc_dtype dtype);
FLASHC_API const char *flashc_backend_name(flashc_backend backend);
/* 1 when the backend was compiled into this library. */
FLASHC_API int flashc_backend_compiled(flashc_backend backend);
/* Number of devices the backend can use now (CPU: 1; CUDA: GPUs found, 0 when none or not compiled). */
FLASHC_API int flashc_device_count(flashc_backend backend);
/* Name of a device into buf (always NUL-terminated). */
FLASHC_API flashc_status flashc_device_name(flashc_backend backend, int device, char *buf, size_t len);
/* CPU features this build detects and uses, e.g. "avx2 fma f16c avx512f". */
FLASHC_API const char *flashc_cpu_features(void);

FLASHC_API flashc_params flashc_params_default(void);
/* sizeof(flashc_params) in this library, for bindings that build the struct without this header. */
FLASHC_API size_t flashc_params_size(void);
/*
 * Field index of flashc_params (0, 1, ... in declaration order): its name, byte offset, size and type code
 * ('I' uint32_t, 'i' int, 'f' float, 'q' int64_t, 'Q' uint64_t, 'p' pointer). Returns 1, or 0 past the last
 * field (and for a negative index), leaving the outputs untouched. Any output pointer may be NULL.
 */
FLASHC_API int flashc_params_field(int index, const char **name, size_t *offset, size_t *size, char *type);

/* ---- context ----------------------------------------------------------------------------------------- */

/* Creates a context on a backend and device. On failure *ctx is NULL and the reason is
 * flashc_context_last_error(NULL) (kept per thread). */
FLASHC_API flashc_status flashc_context_create(flashc_context_t *ctx, flashc_backend backend, int device);
FLASHC_API void flashc_context_destroy(flashc_context_t ctx);
/* The backend this context runs on (never AUTO). */
FLASHC_API flashc_backend flashc_context_backend(flashc_context_t ctx);
/* CUDA: a cudaStream_t (NULL: the legacy default stream). CPU: refused with NOT_SUPPORTED unless NULL. */
FLASHC_API flashc_status flashc_context_set_stream(flashc_context_t ctx, void *stream);
/* CPU: threads used per call (0: OpenMP's default, omp_get_max_threads()). A count above 4 per processor this
 * process may run on (omp_get_num_procs(), at most 1024 in all) is capped there: OpenMP would otherwise end the
 * process when it cannot start them. Ignored on CUDA. */
FLASHC_API flashc_status flashc_context_set_threads(flashc_context_t ctx, int threads);
/* Threads a call on this context runs, after the cap above (1 on CUDA or without OpenMP; 0 when ctx is NULL). */
FLASHC_API int flashc_context_threads(flashc_context_t ctx);
/* The message of the calling thread's last call on ctx ("" after a success); with ctx NULL, of the calling
 * thread's last failure of any call (context creation included). Other threads' calls never change it. */
FLASHC_API const char *flashc_context_last_error(flashc_context_t ctx);

/* ---- attention --------------------------------------------------------------------------------------- */

/* Whether this backend runs the configuration: OK, or NOT_SUPPORTED / INVALID_ARGUMENT with the reason in the
 * last error. Only shapes, dtypes, strides and parameters are read; no data is touched. For FORWARD pass the
 * forward's tensors (out may be NULL); for BACKWARD q, k, v (the rest is checked by flashc_backward). */
FLASHC_API flashc_status flashc_supported(flashc_context_t ctx, flashc_op op, const flashc_tensor *q,
                                          const flashc_tensor *k, const flashc_tensor *v,
                                          const flashc_params *params);

/* Which kernel this backend would run for the configuration, as a short static string (e.g. "sm90 (wgmma, TMA,
 * warp-specialized)" or "tensor cores (mma.sync)" on CUDA); NULL when it is not supported (the reason is then the
 * last error). Arguments as for flashc_supported. */
FLASHC_API const char *flashc_kernel_name(flashc_context_t ctx, flashc_op op, const flashc_tensor *q,
                                          const flashc_tensor *k, const flashc_tensor *v,
                                          const flashc_params *params);

/* Bytes of workspace flashc_forward / flashc_backward need for this problem. */
FLASHC_API flashc_status flashc_forward_workspace_size(flashc_context_t ctx, const flashc_tensor *q,
                                                       const flashc_tensor *k, const flashc_tensor *v,
                                                       const flashc_params *params, size_t *bytes);
FLASHC_API flashc_status flashc_backward_workspace_size(flashc_context_t ctx, const flashc_tensor *q,
                                                        const flashc_tensor *k, const flashc_tensor *v,
                                                        const flashc_params *params, size_t *bytes);

/*
 * Forward.  q (B, Nq, H, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, D) -> out (B, Nq, H, D) in q's dtype,
 * softmax_lse (B, H, Nq) fp32 when not NULL. workspace: NULL lets the library allocate what it needs,
 * otherwise at least flashc_forward_workspace_size() bytes, 16-byte aligned (as malloc and cudaMalloc give it).
 */
FLASHC_API flashc_status flashc_forward(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                                        const flashc_tensor *v, const flashc_params *params,
                                        const flashc_tensor *out, float *softmax_lse, void *workspace,
                                        size_t workspace_bytes);

/*
 * Backward.  q, k, v, out, dout (like out), softmax_lse (B, H, Nq) from the forward ->
 * dq (like q), dk, dv (like k); with GQA the gradients of the heads sharing a kv head are summed.
 * params->deterministic asks for bitwise-reproducible results. workspace: as for the forward, with
 * flashc_backward_workspace_size().
 */
FLASHC_API flashc_status flashc_backward(flashc_context_t ctx, const flashc_tensor *q, const flashc_tensor *k,
                                         const flashc_tensor *v, const flashc_tensor *out,
                                         const flashc_tensor *dout, const float *softmax_lse,
                                         const flashc_params *params, const flashc_tensor *dq,
                                         const flashc_tensor *dk, const flashc_tensor *dv, void *workspace,
                                         size_t workspace_bytes);

/*
 * KV cache: appends new keys and values in place. k_new, v_new (B, Nnew, Hkv, D) go to rows cache_seqlens[b] ..
 * cache_seqlens[b] + Nnew - 1 of batch b of k_cache, v_cache (B, Nk_max, Hkv, D), same dtype; every other cache row
 * is left as it was; k_cache and v_cache may interleave (the halves of one packed (B, Nk_max, 2, Hkv, D) cache) but
 * share no element, and neither shares a byte with the inputs. cache_seqlens: int32 (B), where the context's backend
 * computes. Then attend to the cache with
 * flashc_forward and params.seqused_k = cache_seqlens + Nnew per sequence (flash-attn's flash_attn_with_kvcache:
 * causal queries then sit at the end of each sequence's used keys). Rows that would land outside [0, Nk_max): the
 * CPU backend refuses the call and writes nothing; the CUDA backend (which does not read device memory before its
 * launch) skips them. Queued on the context's stream like the attention calls.
 * Rotary embedding (flash-attn's rotary_cos, rotary_sin), before the append: flashc_rotary of k_new at seq_start =
 * cache_seqlens (new row i at cache_seqlens[b] + i, into a copy or in place), then of q at cache_seqlens too (with
 * causal or a window flash-attn puts query i at cache_seqlens[b] + i: q as it is; without, every query at
 * cache_seqlens[b]: q viewed as (B, 1, Nq * H, D)); then append the rotated keys, then flashc_forward the rotated q.
 */
FLASHC_API flashc_status flashc_kvcache_append(flashc_context_t ctx, const flashc_tensor *k_cache,
                                               const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                               const flashc_tensor *v_new, const int32_t *cache_seqlens);

/*
 * Paged KV cache: appends in place as flashc_kvcache_append does, into page pools k_cache, v_cache (num_pages,
 * page_size, Hkv, D), any strides: new row i of sequence b (k_new, v_new (B, Nnew, Hkv, D)) goes to logical row
 * cache_seqlens[b] + i, i.e. row (cache_seqlens[b] + i) % page_size of page
 * block_table[b * block_table_stride + (cache_seqlens[b] + i) / page_size] (block_table int32 (B, max_pages), stride 0:
 * max_pages), as flashc_params describes it. Then attend with the same table and seqused_k = cache_seqlens + Nnew
 * (flash-attn's flash_attn_with_kvcache with block_table). Every other row is left as it was. The CPU backend refuses,
 * writing nothing, a length below 0 or whose new rows pass the table's max_pages * page_size, a page the new rows
 * need outside [0, num_pages), and two sequences writing one row; the CUDA backend (which does not read device memory
 * before its launch) skips rows past the table and pages outside the pool, and of a row two sequences name keeps one
 * write.
 * flash-attn's cache_batch_idx and cache_leftpad are block tables over contiguous caches (B_cache, Nk_max, Hkv, D):
 * sequence b on cache idx[b] is the caches as a pool of B_cache pages of Nk_max rows with block_table[b] = idx[b]
 * (max_pages 1); keys from row leftpad[b] are pages of one row (the caches viewed as (B_cache * Nk_max, 1, Hkv, D))
 * with block_table[b * Nk_max + j] = idx[b] * Nk_max + leftpad[b] + j, appended at cache_seqlens[b] - leftpad[b] and
 * attended with seqused_k = cache_seqlens[b] + Nnew - leftpad[b] (masks and ALiBi then count keys from the padding's
 * end, as in flash-attn). The Python package builds these tables (flash_attn_with_kvcache).
 */
FLASHC_API flashc_status flashc_kvcache_append_paged(flashc_context_t ctx, const flashc_tensor *k_cache,
                                                     const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                                     const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                                     const int32_t *block_table, int64_t block_table_max_pages,
                                                     int64_t block_table_stride);

/*
 * Merge of two partial attention results, each over its own set of keys (cascade attention: a shared prefix and
 * each sequence's suffix; split-KV; context and ring parallelism): out_a, out_b (B, Nq, H, D), each normalized over
 * its keys, with their softmax_lse lse_a, lse_b (B, H, Nq), as flashc_forward writes them (varlen: out views
 * (1, total_q, H, D) and lse (H, total_q)) -> the attention over both key sets,
 *   lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b,
 * computed in fp32 and rounded once to out's dtype. out_a, out_b and out share one shape and dtype, any strides;
 * the lse arrays are fp32 and contiguous; every pointer is aligned to its elements. lse: NULL leaves it unwritten.
 * A part whose lse is +inf (flashc's and flash-attn's row that saw no key) or -inf (the log of an empty sum) is
 * empty and its out is not used: the other part comes out as it went in, bit for bit (its out, its lse); two empty
 * parts give out 0 and lse +inf. A NaN lse makes that row NaN. With attention sinks, let one part only hold each
 * head's sink (its lse includes it).
 * In place: out may be out_a or out_b (the same view: data and strides), lse may be lse_a or lse_b; otherwise no
 * output shares a byte with an input or with the other output. The merge is associative up to rounding: more
 * parts merge two at a time. Queued on the context's stream like the attention calls.
 */
FLASHC_API flashc_status flashc_merge(flashc_context_t ctx, const flashc_tensor *out_a, const float *lse_a,
                                      const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out,
                                      float *lse);

/*
 * Rotary position embedding (RoPE), flash-attn's apply_rotary_emb with seqlen_offsets: x (B, N, H, D) -> out
 * (B, N, H, D), one shape and dtype, any strides, where row i of batch b sits at position p = seq_start[b] + i
 * (seq_start: int32 (B), where the context's backend computes, as cache_seqlens; NULL: 0 for every b). cos, sin: the
 * (P, R/2) tables as views of shape (1, P, 1, R/2) (P positions along shape[1], R/2 frequencies along shape[3]), any
 * strides, f32, f16 or bf16 (one dtype for both, x's or another), R = 2 * shape[3] <= D the rotary dimension. For
 * j < R/2, with c = cos[p][j], s = sin[p][j] and the pair of dims (u, w) = (j, j + R/2) (interleaved 0: GPT-NeoX
 * halves) or (2j, 2j + 1) (interleaved nonzero: GPT-J), in each head's row:
 *   out[u] = x[u] c - x[w] s,   out[w] = x[u] s + x[w] c,
 * computed in fp32 as fmaf(-x[w], s, x[u] * c) and fmaf(x[w], c, x[u] * s) (the products x[u] c and x[u] s rounded
 * to fp32 first, as torch's x1 * c then addcmul give it) and rounded once to out's dtype: the same bits on both
 * backends. Dims R .. D - 1 are copied as they are. In place: out may be x's very view (the same data and strides);
 * otherwise out shares no byte with x; and never one with cos, sin or seq_start. Every pointer aligned to its
 * elements.
 * A position outside [0, P) (p < 0 or p >= P): the CPU backend refuses the call and writes nothing; the CUDA backend
 * (which does not read device memory before its launch) writes NaN to that row's first R elements of out (the rest
 * copied as above) and never reads outside the tables. Queued on the context's stream like the attention calls.
 */
FLASHC_API flashc_status flashc_rotary(flashc_context_t ctx, const flashc_tensor *x, const flashc_tensor *cos,
                                       const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                                       const flashc_tensor *out);

/* Fills a view of a contiguous (d0, d1, d2, d3) tensor. A stride that would overflow int64 is set to INT64_MIN,
 * which every call refuses. */
FLASHC_API flashc_tensor flashc_tensor_contiguous(void *data, flashc_dtype dtype, int64_t d0, int64_t d1,
                                                  int64_t d2, int64_t d3);

/*
 * Dropout keep mask, for tests and for flash-attn's return_attn_probs: mask (B, H, Nq, Nk) contiguous bytes in host
 * memory, mask[((b * H + h) * Nq + i) * Nk + j] = 1 where flashc_forward / flashc_backward with these params keep
 * element (b, h, i, j) of P and 0 where they drop it. Reads dropout_p, dropout_seed, dropout_offset and the positions
 * (params checked as every call checks them; dropout_p 0 gives all ones). Pass the problem's H; with varlen
 * B = num_seqs and Nq, Nk at least the longest sequence's, sequence b's bits lying in the first rows and columns of its
 * (b, h) planes. No attention mask (causal, window, block mask, seqused_k) is applied. flash-attn's S_dmask is P with
 * the dropped entries negated: where(mask, P, -P). Needs no context; on failure nothing is written and the reason is
 * flashc_context_last_error(NULL).
 */
FLASHC_API flashc_status flashc_dropout_mask(const flashc_params *params, int64_t B, int64_t H, int64_t Nq,
                                             int64_t Nk, uint8_t *mask);

#ifdef __cplusplus
}
#endif

#endif /* FLASHC_H */
