/*
 * test_cases: the shared case table on the CPU backend against the fp64 oracle, one line per case.
 *
 * Every run draws new inputs: the seed is taken from the clock and printed, FLASHC_SEED=<n> replays a run.
 * FLASHC_QUICK=1 (and any sanitizer build) runs the reduced table. With FLASHC_CPU_KERNELS=<set> the table runs on that
 * kernel set, checked to be the one chosen; a set this CPU or build lacks is skipped (ctest's test_cases_amx).
 */
#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__SANITIZE_ADDRESS__)
#  define FLASHC_SANITIZED 1
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer)
#    define FLASHC_SANITIZED 1
#  endif
#endif
#ifndef FLASHC_SANITIZED
#  define FLASHC_SANITIZED 0
#endif

static double now_s(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/*
 * Memory hooks that stand in for a device: separate allocations and explicit copies, so that the runner's
 * device path (the one the GPU tests take) is exercised on the CPU backend too. Counts allocations to catch
 * leaks in the runner.
 */
static long g_live;
static void *emu_alloc(size_t bytes) {
    void *p = malloc(bytes);
    if (p) g_live++;
    return p;
}
static void emu_free(void *p) {
    if (p) g_live--;
    free(p);
}
static int emu_copy(void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
    return 0;
}

static uint64_t pick_seed(void) {
    const char *env = getenv("FLASHC_SEED");
    if (env && *env) return strtoull(env, NULL, 0);
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    uint64_t s = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec;
    return flashc_rand_u64(&s);
}

int main(void) {
    const char *quick_env = getenv("FLASHC_QUICK");
    int full = !(FLASHC_SANITIZED || (quick_env && *quick_env && strcmp(quick_env, "0") != 0));
    uint64_t seed = pick_seed();
    const char *forced = getenv("FLASHC_CPU_KERNELS");
    if (forced && *forced) {
        const flashc_cpu_kernels *want = flashc_cpu_kernels_by_name(forced), *ran = flashc_cpu_select_kernels();
        if (!want) {
            printf("test_cases: FLASHC_CPU_KERNELS=%s: no such kernel set on this CPU/build (features: %s), skipped\n",
                   forced, flashc_cpu_features());
            return 0;
        }
        if (ran != want) {
            fprintf(stderr, "test_cases: FLASHC_CPU_KERNELS=%s chose %s, not %s\n", forced, ran->name, want->name);
            return 1;
        }
        printf("test_cases: kernels %s\n", ran->name);
    }
    size_t n = 0;
    const flashc_case *table = flashc_case_table(full, &n);

    flashc_context_t ctx = NULL;
    flashc_status st = flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0);
    if (st != FLASHC_STATUS_OK) {
        fprintf(stderr, "cannot create a CPU context: %s\n", flashc_context_last_error(NULL));
        return 1;
    }
    printf("test_cases: %s table, %zu cases, FLASHC_SEED=%" PRIu64 "\n", full ? "full" : "reduced", n, seed);
    printf("%-26s %-5s %10s %10s  %10s %10s  %10s %10s %7s  %s\n", "case", "dtype", "err_out", "tol_out", "err_lse",
           "tol_lse", "err_grad", "tol_grad", "time_s", "verdict");

    int failed = 0;
    double t_all = now_s();
    for (size_t i = 0; i < n; i++) {
        const flashc_case *c = &table[i];
        uint64_t s = seed + 0x9e3779b97f4a7c15ull * (i + 1);
        uint64_t case_seed = flashc_rand_u64(&s);
        flashc_case_result r;
        double t0 = now_s();
        int rc = flashc_case_run(ctx, c, case_seed, &r);
        double dt = now_s() - t0;
        int pass = rc == 0 && r.pass;
        /* Which forward path ran: the decode rows (dec_*) on decode.c's, every row of more than 16 queries on the
         * tiles. */
        const char *want = strncmp(c->name, "dec_", 4) == 0 ? "CPU decode" : c->Nq > 16 ? "CPU tiles" : NULL;
        if (rc == 0 && want && (!r.kernel_fwd || strncmp(r.kernel_fwd, want, strlen(want)) != 0)) {
            snprintf(r.message, sizeof r.message, "ran on \"%s\", expected %s", r.kernel_fwd ? r.kernel_fwd : "?",
                     want);
            pass = 0;
        }
        failed += !pass;
        if (rc == 0 && r.status == FLASHC_STATUS_OK) {
            printf("%-26s %-5s %10.3g %10.3g  %10.3g %10.3g  ", c->name, flashc_dtype_name(c->dtype), r.err_out,
                   r.tol_out, r.err_lse, r.tol_lse);
            if (c->backward) printf("%10.3g %10.3g", r.err_grad, r.tol_grad);
            else printf("%10s %10s", "-", "-");
            printf(" %7.2f  %s\n", dt, pass ? "PASS" : "FAIL");
        } else {
            printf("%-26s %-5s %69s %7.2f  FAIL\n", c->name, flashc_dtype_name(c->dtype), "", dt);
        }
        if (!pass) printf("    %s\n", r.message);
        fflush(stdout);
    }

    /* the reduced table again through the memory hooks */
    size_t nq = 0;
    const flashc_case *quick = flashc_case_table(0, &nq);
    const flashc_case_memory emu = {emu_alloc, emu_free, emu_copy, emu_copy};
    flashc_case_set_memory(&emu);
    flashc_case_set_reruns(2); /* and each call twice more, bit for bit (the GPU programs run it 100 times) */
    int hook_failed = 0;
    for (size_t i = 0; i < nq; i++) {
        uint64_t s = seed ^ (0xd1b54a32d192ed03ull * (i + 1));
        flashc_case_result r;
        int rc = flashc_case_run(ctx, &quick[i], flashc_rand_u64(&s), &r);
        if (rc != 0 || !r.pass) {
            hook_failed++;
            printf("hooks: %-19s FAIL  %s\n", quick[i].name, r.message);
        }
    }
    flashc_case_set_memory(NULL);
    flashc_case_set_reruns(0);
    printf("hooks: %zu reduced cases through emulated device memory, each call rerun twice: %zu passed, %ld "
           "allocations left\n", nq,
           nq - (size_t)hook_failed, g_live);
    failed += hook_failed + (g_live != 0);

    printf("test_cases: %zu of %zu passed in %.1f s (FLASHC_SEED=%" PRIu64 ")\n", n - (size_t)(failed - hook_failed - (g_live != 0)), n,
           now_s() - t_all, seed);
    flashc_context_destroy(ctx);
    return failed ? 1 : 0;
}
