/*
 * test_cpu_groups: the CPU forward's query groups (src/cpu/attn.c, forward_group) against the fp64 oracle. Each case
 * is shaped so that, on 2 threads, the forward puts several query blocks in one task and walks the key blocks
 * outside them: groups cut short by the sequence's end or by varlen lengths, blocks of one group with different key
 * ranges (causal, windows, rows that see no key), block masks, softcap and ALiBi, paged K/V, dropout and sinks, 16-bit
 * inputs converted once per key block for the whole group. A case whose forward would not group (e.g. a CPU with a
 * tiny last-level cache) fails rather than passing on the one-block path.
 *
 * Fresh inputs every run (the seed is printed; FLASHC_SEED=<n> replays).
 */
#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define F32 FLASHC_DTYPE_F32
#define F16 FLASHC_DTYPE_F16
#define BF16 FLASHC_DTYPE_BF16
#define BNHD FLASHC_LAYOUT_BNHD

/* name, dtype, B, Nq, Nk, H, Hkv, D, causal, window (left, right), softcap, alibi, block (q, k), varlen, layout,
 * backward, seqused_k, sinks, page size, dropout, positions (on, q_position, k_position) */
static const flashc_case cases[] = {
    /* 2 x 18 blocks: groups of 4, the last of each head 2 */
    {"grp_f32_d64", F32, 1, 1100, 900, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"grp_bf16_causal_gqa_d128", BF16, 1, 700, 700, 4, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    /* the blocks of a group see different, partly disjoint key ranges */
    {"grp_f16_window", F16, 1, 1000, 1000, 2, 2, 64, 0, 100, 30, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    {"grp_mask_softcap_alibi", F32, 1, 900, 1000, 2, 2, 64, 0, -1, -1, 20.0f, 1, 48, 80, 0, BNHD, 0, 0, 0, 0, 0, 0, 0,
     0},
    /* groups of up to 12 blocks cut by the sequences' random lengths */
    {"grp_varlen_bf16_causal", BF16, 3, 1000, 1000, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"grp_paged_used_k", F32, 2, 600, 800, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 1, 0, 64, 0, 0, 0, 0},
    {"grp_dropout_sinks_causal", F32, 1, 800, 800, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 1, 0, 0.15f, 0, 0,
     0},
    /* bottom-right causal: rows 0..699 see no key, so whole groups and parts of groups have nothing to do */
    {"grp_causal_nq_gt_nk", F32, 1, 1000, 300, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
    /* positions (a ring's chunk pair): the blocks' key ranges and ALiBi from q_position - k_position, not Nk - Nq; a
     * causal pair whose keys start later (leading rows see nothing), and a window with dropout at the positions */
    {"grp_pos_causal_alibi", F32, 1, 1000, 800, 2, 2, 64, 1, -1, -1, 0, 1, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 1, 2000, 2300},
    {"grp_pos_window_dropout_bf16", BF16, 1, 900, 1000, 2, 1, 64, 0, 150, 40, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0.1f, 1,
     4000, 3800},
    {"grp_bf16_d256", BF16, 1, 600, 600, 2, 2, 256, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 0, 0, 0, 0, 0, 0, 0, 0},
};

/* What the forward groups for c's shape on threads threads (the choice depends on B, H, Nq, D only). */
static int group_of(const flashc_case *c, int threads) {
    flashc_tensor q = flashc_tensor_contiguous(NULL, c->dtype, c->B, c->Nq, c->H, c->D);
    flashc_tensor k = flashc_tensor_contiguous(NULL, c->dtype, c->B, c->Nk, c->Hkv, c->D);
    flashc_params prm = flashc_params_default();
    flashc_problem p;
    if (flashc_problem_build(NULL, FLASHC_OP_FORWARD, &q, &k, &k, &prm, NULL, NULL, NULL, NULL, NULL, NULL, &p) !=
        FLASHC_STATUS_OK)
        return -1;
    return flashc_cpu_forward_group(&p, threads);
}

int main(void) {
    const char *env = getenv("FLASHC_SEED");
    uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    const int threads = 2;
    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK ||
        flashc_context_set_threads(ctx, threads) != FLASHC_STATUS_OK) {
        fprintf(stderr, "cannot set up a CPU context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    const flashc_cpu_caches cs = flashc_cpu_cache_sizes();
    printf("test_cpu_groups: FLASHC_SEED=%" PRIu64 ", %d threads, caches L1d %ld KiB, L2 %ld KiB, L3 %ld KiB\n", seed,
           threads, cs.l1d >> 10, cs.l2 >> 10, cs.l3 >> 10);
    printf("%-28s %5s %3s %10s %10s %10s %10s  %s\n", "case", "dtype", "G", "err_out", "tol_out", "err_grad",
           "tol_grad", "verdict");
    int failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const flashc_case *c = &cases[i];
        const int g = group_of(c, threads);
        flashc_case_result r;
        memset(&r, 0, sizeof r);
        const uint64_t case_seed = seed + 7919u * i;
        const int ran = flashc_case_run(ctx, c, case_seed, &r) == 0;
        const int ok = ran && r.pass && g > 1;
        failed += !ok;
        printf("%-28s %5s %3d %10.2e %10.2e %10.2e %10.2e  %s%s%s\n", c->name, flashc_dtype_name(c->dtype), g,
               r.err_out, r.tol_out, r.err_grad, r.tol_grad, ok ? "PASS" : "FAIL",
               !ran ? " (could not run)" : g <= 1 ? " (the forward does not group this shape)" : "",
               ran && !r.pass ? r.message : "");
    }
    flashc_context_destroy(ctx);
    printf("test_cpu_groups: %d of %zu cases failed\n", failed, sizeof cases / sizeof cases[0]);
    return failed ? 1 : 0;
}
