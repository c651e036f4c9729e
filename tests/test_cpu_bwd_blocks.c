/*
 * test_cpu_bwd_blocks: the CPU backward's key groups and edge tiles (src/cpu/attn.c, head_task and tile_ds) against
 * the fp64 oracle.
 *
 * Key groups: with one task per (sequence, head) the backward passes over the query blocks once per group of key
 * blocks (up to FLASHC_CPU_MAX_GK), with K, V (and q, dO) packed into contiguous rows. The "grp_" cases have more
 * key blocks than a group (Nk > 16 x 64), so a head takes several groups and the last is cut short: causal and window
 * bands that leave some blocks of a group without a query block, GQA (per-head dK, dV), varlen, paged K/V with
 * seqused_k, dropout with softcap, 16-bit inputs converted into the group's slots, and rows already contiguous
 * (BHND at D 128, not copied). A "grp_" case whose backward would not group on 2 threads, or would fit in one
 * group, fails rather than passing on the one-group path.
 *
 * Edge tiles: a tile that a causal or window mask cuts runs its five products in strips over the (key, row) pairs the
 * mask leaves, and sets P and dS to 0 on the rest. The cases put such tiles everywhere the strips can go wrong: the
 * causal diagonal at both backward tile shapes (D 64: 128 query rows x 64 keys, so the diagonal crosses half the
 * key blocks mid-tile; D 128: 64 x 64), bottom-right alignment with Nq > Nk and Nq < Nk, windows narrower than a
 * strip and bands that cross a tile on both sides, last blocks of few rows, rows that see no key, block masks,
 * softcap, ALiBi, dropout and varlen on edge tiles, GQA, positions (the diagonal and the window moved by q_position -
 * k_position, in a key group too); at 2 threads both backward modes (B * H >= 2: one task per
 * head; B * H = 1: dK/dV and dQ passes). Each kernel set this CPU runs is tested in its own process (the strip height
 * follows the microkernel's register tile: 16 rows generic, 18 AVX2, 24 AVX-512).
 *
 * Fresh inputs every run (the seed is printed; FLASHC_SEED=<n> replays).
 */
#define _POSIX_C_SOURCE 200809L /* fork, setenv */
#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define F32 FLASHC_DTYPE_F32
#define F16 FLASHC_DTYPE_F16
#define BF16 FLASHC_DTYPE_BF16
#define BNHD FLASHC_LAYOUT_BNHD

/* name, dtype, B, Nq, Nk, H, Hkv, D, causal, window (left, right), softcap, alibi, block (q, k), varlen, layout,
 * backward, seqused_k, sinks, page size, dropout, positions (on, q_position, k_position) */
static const flashc_case cases[] = {
    /* the diagonal at both tile shapes, one head per task and the two-pass mode (B * H = 1) */
    {"causal_d64", F32, 1, 300, 300, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_d128_bf16", BF16, 1, 300, 300, 2, 1, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_d64_two_pass", F32, 1, 333, 333, 1, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_d128_two_pass_f16", F16, 1, 200, 200, 1, 1, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    /* bottom-right alignment: rows that see no key (Nq > Nk), the diagonal off the tile corners (Nq < Nk) */
    {"causal_nq_gt_nk", F32, 1, 400, 150, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_nq_lt_nk_d96", F32, 1, 150, 437, 2, 2, 96, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    /* windows: a band narrower than a strip, and one wider than a tile with both edges in it */
    {"window_5_2", F32, 1, 260, 260, 2, 2, 64, 0, 5, 2, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"window_70_40_bf16_d128", BF16, 1, 300, 280, 2, 2, 128, 0, 70, 40, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_window_30_two_pass", F32, 1, 300, 300, 1, 1, 32, 1, 30, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    /* edge tiles with score options, masks, dropout, varlen, GQA */
    {"causal_softcap_alibi", F32, 2, 200, 200, 2, 1, 64, 1, -1, -1, 15.0f, 1, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_blockmask_d128", F32, 1, 260, 260, 2, 2, 128, 1, -1, -1, 0, 0, 40, 24, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"causal_dropout_sinks", F32, 1, 270, 270, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 1, 0, 0.2f, 0, 0, 0},
    {"window_dropout_two_pass", F32, 1, 250, 250, 1, 1, 64, 0, 33, 17, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0.1f, 0, 0, 0},
    {"varlen_causal_gqa_bf16", BF16, 3, 300, 300, 4, 2, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"paged_used_k_causal", F32, 2, 200, 260, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 32, 0, 0, 0, 0},
    /* key groups: 17 to 21 key blocks per head */
    {"grp_f32_d64", F32, 1, 200, 1200, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"grp_bf16_causal_d128", BF16, 1, 1100, 1100, 2, 2, 128, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"grp_f16_window_gqa", F16, 1, 300, 1300, 4, 2, 64, 0, 200, 100, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"grp_varlen_causal", F32, 3, 1200, 1200, 2, 1, 64, 1, -1, -1, 0, 0, 0, 0, 1, BNHD, 1, 0, 0, 0, 0, 0, 0, 0},
    {"grp_paged_used_k", F32, 2, 100, 1300, 2, 2, 64, 0, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 1, 0, 64, 0, 0, 0, 0},
    {"grp_dropout_softcap_bf16", BF16, 1, 150, 1150, 2, 2, 64, 1, -1, -1, 10.0f, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0.1f, 0,
     0, 0},
    {"grp_bhnd_d128_blockmask", F32, 1, 100, 1100, 2, 2, 128, 0, -1, -1, 0, 0, 50, 70, 0, FLASHC_LAYOUT_BHND, 1, 0,
     0, 0, 0, 0, 0, 0},
    /* positions: the diagonal where q_position - k_position puts it, rows before the keys seeing none, windows */
    {"pos_causal_keys_later", F32, 1, 300, 280, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 1, 0, 90},
    {"pos_window_alibi_two_pass", F32, 1, 260, 300, 1, 1, 64, 0, 40, 25, 0, 1, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 1, 1000,
     930},
    {"grp_pos_causal_bf16", BF16, 1, 400, 1200, 2, 2, 64, 1, -1, -1, 0, 0, 0, 0, 0, BNHD, 1, 0, 0, 0, 0, 1, 700, 0},
};

/* Key blocks per group of c's backward on threads threads (the choice depends on B, H, Nq, Nk, D), and the key
 * blocks of its longest sequence in *blocks. */
static int group_of(const flashc_case *c, int threads, int64_t *blocks) {
    flashc_tensor q = flashc_tensor_contiguous(NULL, c->dtype, c->B, c->Nq, c->H, c->D);
    flashc_tensor k = flashc_tensor_contiguous(NULL, c->dtype, c->B, c->Nk, c->Hkv, c->D);
    flashc_params prm = flashc_params_default();
    flashc_problem p;
    if (flashc_problem_build(NULL, FLASHC_OP_BACKWARD, &q, &k, &k, &prm, NULL, NULL, NULL, NULL, NULL, NULL, &p) !=
        FLASHC_STATUS_OK)
        return -1;
    const int64_t bc = flashc_cpu_choose_tiles(c->D, 1).bc;
    *blocks = (c->Nk + bc - 1) / bc;
    return flashc_cpu_backward_group(&p, threads);
}

static int run_cases(const char *kernels, uint64_t seed) {
    int failed = 0, total = 0;
    for (int threads = 1; threads <= 2; threads++) {
        flashc_context_t ctx = NULL;
        if (flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0) != FLASHC_STATUS_OK ||
            flashc_context_set_threads(ctx, threads) != FLASHC_STATUS_OK) {
            fprintf(stderr, "cannot set up a CPU context: %s\n", flashc_context_last_error(NULL));
            return 1;
        }
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const flashc_case *c = &cases[i];
            flashc_case_result r;
            memset(&r, 0, sizeof r);
            const int ran = flashc_case_run(ctx, c, seed + 7919u * i + 104729u * (uint64_t)threads, &r) == 0;
            int64_t blocks = 0;
            const int g = group_of(c, 2, &blocks);
            const int grouped = strncmp(c->name, "grp_", 4) != 0 || (g > 1 && blocks > g);
            const int ok = ran && r.pass && grouped;
            failed += !ok;
            total++;
            printf("[%s, %d thr] %-28s %5s G %2d of %3" PRId64 " %10.2e %10.2e %10.2e %10.2e  %s%s%s\n", kernels,
                   threads, c->name, flashc_dtype_name(c->dtype), g, blocks, r.err_out, r.tol_out, r.err_grad,
                   r.tol_grad, ok ? "PASS" : "FAIL", !ran ? " (could not run)" : "",
                   !grouped ? " (the backward does not take several key groups on this shape)"
                   : ran && !r.pass ? r.message : "");
        }
        flashc_context_destroy(ctx);
    }
    printf("test_cpu_bwd_blocks [%s]: %d of %d cases failed\n", kernels, failed, total);
    return failed != 0;
}

int main(int argc, char **argv) {
    const char *env = getenv("FLASHC_SEED");
    const uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    const char *forced = getenv("FLASHC_CPU_KERNELS");
    if (forced) {
        const char *ran = flashc_cpu_select_kernels()->name;
        if (strncmp(ran, forced, strlen(forced)) != 0) {
            fprintf(stderr, "test_cpu_bwd_blocks: FLASHC_CPU_KERNELS=%s ran %s\n", forced, ran);
            return 1;
        }
        printf("test_cpu_bwd_blocks: FLASHC_SEED=%" PRIu64 ", kernels %s\n", seed, ran);
        return run_cases(ran, seed);
    }
    /* Once per kernel set this CPU runs, each in its own process (the choice is made once per process); the same
     * seed in each. */
    static const char *sets[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
    char seed_text[32];
    snprintf(seed_text, sizeof seed_text, "%" PRIu64, seed);
    int bad = 0;
    for (int i = 0; i < (int)(sizeof sets / sizeof sets[0]); i++) {
        if (!flashc_cpu_kernels_by_name(sets[i])) {
            printf("test_cpu_bwd_blocks: %s kernels not on this CPU, skipped\n", sets[i]);
            continue;
        }
        fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            setenv("FLASHC_CPU_KERNELS", sets[i], 1);
            setenv("FLASHC_SEED", seed_text, 1);
            execv(argv[0], argv);
            _exit(127);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "test_cpu_bwd_blocks: the %s run failed (status %d)\n", sets[i], status);
            bad++;
        }
    }
    (void)argc;
    return bad != 0;
}
