/*
 * testkit.h - the fp64 oracle and the shared case table, used by tests/, `flashc check` and the GPU tests.
 * Built as the static library flashc_testkit; not part of the installed API. flashc_problem_build, which
 * turns public arguments into the oracle's problem, comes with internal.h.
 */
#ifndef FLASHC_TESTKIT_H
#define FLASHC_TESTKIT_H

#include "flashc.h"
#include "../internal.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The naive oracle: materializes S and P for each (sequence, head) and reads inputs through the problem's
 * views (host memory) converted exactly to double.
 *
 * round: FLASHC_DTYPE_F32 computes in fp64 throughout (the reference). F16 / BF16 emulate the plain
 * low-precision algorithm instead (S, P, O and the backward's intermediates rounded to that dtype after each
 * step, accumulation in fp32), which gives the "naive_lowp" error of the CONVENTIONS.md rule.
 *
 * Dropout (p->dropout_p > 0) takes dropout.h's keep bits, computed here from the problem's seed and offset.
 * Outputs are contiguous doubles: out (total rows, H, D) i.e. (B, Nq, H, D) or (1, total_q, H, D);
 * lse (B, H, Nq) (varlen: (H, total_q)), +inf for rows that see no key;
 * dq like out; dk, dv (B, Nk, Hkv, D) or (1, total_k, Hkv, D), with a block table the page pools (num_pages,
 * page_size, Hkv, D) (0 on rows no used key maps to). K and V are read through flashc_kv_offset, as the CPU backend
 * reads them. Any output pointer may be NULL.
 * The backward reads dout from p->dout and computes its own P (it does not use p->lse or p->out).
 * Returns 0, or -1 when memory runs out.
 */
int flashc_ref_forward(const flashc_problem *p, flashc_dtype round, double *out, double *lse);
int flashc_ref_backward(const flashc_problem *p, flashc_dtype round, double *dq, double *dk, double *dv);
/* With attention sinks: dL/dsinks (H doubles, fp64) for the problem's dout, and (mag, may be NULL) per head the
 * scale of its rounding error: its terms P_sink,i D_i with each D_i = sum_j P_ij dO_i . V_j taken over the products'
 * absolute values (D_i cancels). Returns -1 without sinks. */
int flashc_ref_sinks_grad(const flashc_problem *p, double *dsinks, double *mag);

/* Layout of the test tensors. */
typedef enum flashc_case_layout {
    FLASHC_LAYOUT_BNHD = 0,    /* contiguous (B, N, H, D) */
    FLASHC_LAYOUT_BHND = 1,    /* (B, H, N, D) storage viewed through permuted strides */
    FLASHC_LAYOUT_PADDED = 2   /* (B, N, H, D) with padding after D and after H (non-contiguous strides) */
} flashc_case_layout;

/* One row of the case table. */
typedef struct flashc_case {
    const char *name;
    flashc_dtype dtype;
    int64_t B, Nq, Nk, H, Hkv, D;
    int causal;
    int64_t window_left, window_right; /* -1 unbounded */
    float softcap;
    int alibi;                         /* 0 off, 1 per head, 2 per batch x head */
    int64_t block_q, block_k;          /* block-sparse mask block sizes; 0 = no mask */
    int varlen;                        /* 1: B sequences of random lengths <= Nq/Nk packed, one of length 0 */
    flashc_case_layout layout;
    int backward;                      /* 1: also check gradients */
    int seqused;                       /* 1: seqused_k, one sequence using no key, one all, NaN in the unused */
    int sinks;                         /* 1: attention sinks (and their gradient with backward) */
    int64_t page_size;                 /* > 0: paged K/V, pages of this many rows allocated in a shuffled order from a
                                          pool with unused pages holding NaN (0: k, v are (B, Nk, Hkv, D)) */
    float dropout;                     /* > 0: dropout_p, with a seed and offset drawn from the case's seed */
    int positions;                     /* 1: flashc_params positions on, at q_position and k_position below */
    int64_t q_position, k_position;
} flashc_case;

/* Result of running one case against the fp64 oracle: relative Frobenius errors for fp32 (an identically zero
 * reference is held to the bound in absolute terms), max-abs errors for f16/bf16 (and for fp32 on CUDA, which
 * runs fp32 through bf16 operands and is held to the bf16 rule). */
typedef struct flashc_case_result {
    int pass;
    double err_out, tol_out;  /* ours vs ref, and the allowed bound */
    double err_lse, tol_lse;
    double err_grad, tol_grad; /* worst of dq, dk, dv (each compared with its own bound) */
    int unwritten;            /* elements still holding the poison after the call */
    int nonfinite;            /* NaN/inf where a finite value was expected */
    flashc_status status;     /* status of the library call */
    char message[256];        /* why it failed, if it did */
    const char *kernel_fwd;   /* flashc_kernel_name of the forward (and backward) the case ran; NULL if not run */
    const char *kernel_bwd;
    int skipped;              /* 1: a case refused with NOT_SUPPORTED as expected (the paged backward on the CUDA
                                 backend; dropout with positions it does not take, below 0 or k_position not a
                                 multiple of 4, on any backend; pass 1, message "skipped (not supported): ...");
                                 nothing was checked */
} flashc_case_result;

/* The shared case table: full = every row; otherwise a reduced table for quick runs (sanitizers, racecheck). */
const flashc_case *flashc_case_table(int full, size_t *count);

/*
 * Runs one case on ctx with fresh random inputs drawn from seed: allocates the tensors (host memory, or device
 * memory through the hooks below when ctx is a CUDA context), poisons outputs, calls flashc_forward (and
 * flashc_backward when c->backward), and compares with the oracle using the CONVENTIONS.md rule:
 *   fp32:     relative error ||ours - ref|| / ||ref|| <= 1e-5 (gradients 1e-4)
 *   f16/bf16: max|ours - ref| <= 2 * max|naive_lowp - ref| + 1e-5 (gradients 3x);
 *   fp32 on the CUDA backend: the bf16 rule, with the naive algorithm's inputs rounded to bf16 too.
 * A paged case's backward (page_size > 0) on a CUDA context, which does not run that yet, and a case with dropout at
 * positions dropout does not take (below 0, or k_position not a multiple of 4) are reported as skipped when
 * flashc_supported refuses them with NOT_SUPPORTED (res->skipped; pass 1, nothing checked); any other backend or
 * status counts as a failure.
 * Returns 0 when the case ran (pass or fail is in res), -1 when it could not be set up.
 */
int flashc_case_run(flashc_context_t ctx, const flashc_case *c, uint64_t seed, flashc_case_result *res);

/* Memory hooks for backends whose tensors are not host memory (set by the GPU test program / CLI). */
typedef struct flashc_case_memory {
    void *(*alloc)(size_t bytes);
    void (*free)(void *ptr);
    int (*to_device)(void *dst, const void *src, size_t bytes);
    int (*to_host)(void *dst, const void *src, size_t bytes);
} flashc_case_memory;
void flashc_case_set_memory(const flashc_case_memory *mem); /* NULL: host malloc/memcpy */
/* Reruns per case (0: none, the default): the forward again that many times, out and lse compared bit for bit with
 * the first run, and the backward likewise (dK and dV, which have one writer each in every mode, and dQ too when
 * deterministic); a difference fails the case ("forward rerun R differs ..."). */
void flashc_case_set_reruns(int reruns);

/* Deterministic random numbers for tests: splitmix64 + Box-Muller. */
uint64_t flashc_rand_u64(uint64_t *state);
double flashc_rand_normal(uint64_t *state);

#ifdef __cplusplus
}
#endif

#endif /* FLASHC_TESTKIT_H */
