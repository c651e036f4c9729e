/*
 * check.c - `flashc check`: the shared case table against the fp64 oracle, as a pass/fail table.
 *
 * Each case gets fresh random inputs from the run's seed (printed, and settable with --seed, so a failure can
 * be replayed). Per case the table shows the component (out, lse or grad) that came closest to its bound,
 * because one line per case is what a person scans; the full message follows a failing row.
 */
#include "cli.h"
#include "ref/testkit.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

static const char check_usage[] =
    "usage: flashc check [--backend cpu|cuda] [--quick] [--seed S] [--filter TEXT] [--threads T]\n"
    "\n"
    "Runs the test case table against the fp64 oracle (fp32: relative error <= 1e-5; f16/bf16: at most twice the\n"
    "error of the naive algorithm in the same precision). Prints one row per case (the column 'what' names the\n"
    "output, lse or gradient closest to its bound) and a summary; exits 1 when any case fails. On CUDA, cases the\n"
    "backend reports as not supported are listed as skipped; on the CPU every case must pass.\n"
    "\n"
    "options:\n"
    "  --backend auto|cpu|cuda   default auto\n"
    "  --device N                GPU index (default 0)\n"
    "  --quick                   the reduced table instead of the full one\n"
    "  --seed S                  seed of the random inputs (default: from the clock, printed)\n"
    "  --filter TEXT             only cases whose name contains TEXT\n"
    "  --threads T               CPU threads (default: OpenMP's)\n";

/* The case stopped at flashc_supported: the backend does not run this configuration. */
static int unsupported(const flashc_case_result *r) {
    return !r->pass && r->status == FLASHC_STATUS_NOT_SUPPORTED && strncmp(r->message, "supported:", 10) == 0;
}

/* The component with the largest err/tol; returns its name. */
static const char *worst_component(const flashc_case *c, const flashc_case_result *r, double *err, double *tol) {
    const char *names[3] = {"out", "lse", "grad"};
    double e[3] = {r->err_out, r->err_lse, r->err_grad}, t[3] = {r->tol_out, r->tol_lse, r->tol_grad};
    int n = c->backward ? 3 : 2, best = 0;
    double best_ratio = -1.0;
    for (int i = 0; i < n; i++) {
        double ratio = t[i] > 0.0 ? e[i] / t[i] : (e[i] > 0.0 ? 1e300 : 0.0);
        if (ratio != ratio) ratio = 1e300; /* NaN error: always the worst */
        if (ratio > best_ratio) {
            best_ratio = ratio;
            best = i;
        }
    }
    *err = e[best];
    *tol = t[best];
    return names[best];
}

int cli_check(int argc, char **argv) {
    flashc_backend requested = FLASHC_BACKEND_AUTO;
    int quick = 0, have_seed = 0;
    int64_t device = 0, threads = 0, seed_arg = 0;
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL, *a = argv[i];
        int m;
        if (cli_is_help(a)) {
            fputs(check_usage, stdout);
            return 0;
        }
        if (cli_flag(a, "quick")) {
            quick = 1;
        } else if ((m = cli_opt(argc, argv, &i, "backend", &v)) != 0) {
            if (m < 0 || cli_parse_backend("check", v, &requested) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "device", &v)) != 0) {
            if (m < 0 || cli_parse_i64("check", "device", v, 0, 1024, &device) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "seed", &v)) != 0) {
            if (m < 0 || cli_parse_i64("check", "seed", v, 0, INT64_MAX, &seed_arg) != 0) return 2;
            have_seed = 1;
        } else if ((m = cli_opt(argc, argv, &i, "filter", &v)) != 0) {
            if (m < 0) return 2;
            filter = v;
        } else if ((m = cli_opt(argc, argv, &i, "threads", &v)) != 0) {
            if (m < 0 || cli_parse_i64("check", "threads", v, 0, 4096, &threads) != 0) return 2;
        } else {
            return cli_usage_error("check", "unknown argument '%s'", a);
        }
    }

    flashc_backend backend = cli_resolve_backend(requested);
    if (cli_backend_usable("check", backend, (int)device) != 0) return 1;
    if (cli_set_device(backend, (int)device) != 0) return 1;
    uint64_t seed = have_seed ? (uint64_t)seed_arg : ((uint64_t)time(NULL) ^ (uint64_t)(cli_now() * 1e9)) & INT64_MAX;

    size_t count = 0;
    const flashc_case *table = flashc_case_table(!quick, &count);
    if (!table || count == 0) return cli_fail("check", "the case table is empty");

    flashc_context_t ctx = NULL;
    if (flashc_context_create(&ctx, backend, (int)device) != FLASHC_STATUS_OK)
        return cli_fail("check", "cannot create a %s context: %s", flashc_backend_name(backend),
                        flashc_context_last_error(NULL));
    if (threads > 0 && flashc_context_set_threads(ctx, (int)threads) != FLASHC_STATUS_OK) {
        cli_fail("check", "%s", flashc_context_last_error(ctx));
        flashc_context_destroy(ctx);
        return 1;
    }
    cli_case_memory(backend);

    int width = 4;
    size_t selected = 0;
    for (size_t i = 0; i < count; i++) {
        if (filter && !strstr(table[i].name, filter)) continue;
        int n = (int)strlen(table[i].name);
        if (n > width) width = n;
        selected++;
    }
    if (selected == 0) {
        flashc_context_destroy(ctx);
        cli_case_memory(FLASHC_BACKEND_CPU);
        return cli_fail("check", "no case matches --filter '%s'", filter);
    }

    printf("flashc check: %s backend, %s table (%zu cases), seed %llu\n", flashc_backend_name(backend),
           quick ? "quick" : "full", selected, (unsigned long long)seed);
    printf("%4s  %-*s  %-5s  %-4s  %9s  %9s  %9s  %s\n", "#", width, "case", "dtype", "what", "err", "tol", "ms",
           "result");
    size_t passed = 0, failed = 0, skipped = 0, row = 0;
    double t_all = cli_now();
    for (size_t i = 0; i < count; i++) {
        const flashc_case *c = &table[i];
        if (filter && !strstr(c->name, filter)) continue;
        row++;
        flashc_case_result r;
        memset(&r, 0, sizeof r);
        double t0 = cli_now();
        int ran = flashc_case_run(ctx, c, seed + i, &r);
        int fwd_only = 0;
        if (ran == 0 && backend != FLASHC_BACKEND_CPU && c->backward && unsupported(&r)) {
            /* a backend without this backward still has its forward checked on the same case */
            flashc_case fwd = *c;
            fwd.backward = 0;
            flashc_case_result rf;
            memset(&rf, 0, sizeof rf);
            if (flashc_case_run(ctx, &fwd, seed + i, &rf) == 0 && !unsupported(&rf)) {
                r = rf;
                fwd_only = 1;
            }
        }
        double ms = 1e3 * (cli_now() - t0);
        if (ran != 0) {
            printf("%4zu  %-*s  %-5s  %-4s  %9s  %9s  %9.1f  FAIL (could not set up: %s)\n", row, width, c->name,
                   flashc_dtype_name(c->dtype), "-", "-", "-", ms, r.message[0] ? r.message : "out of memory?");
            failed++;
        } else if (backend != FLASHC_BACKEND_CPU && unsupported(&r)) {
            /* the GPU backends cover a subset (dtypes, head dims, backward); the CPU backend must run every case */
            printf("%4zu  %-*s  %-5s  %-4s  %9s  %9s  %9.1f  skip (%s)\n", row, width, c->name,
                   flashc_dtype_name(c->dtype), "-", "-", "-", ms, r.message);
            skipped++;
        } else {
            double err, tol;
            const char *what = worst_component(c, &r, &err, &tol);
            printf("%4zu  %-*s  %-5s  %-4s  %9.2e  %9.2e  %9.1f  %s%s\n", row, width, c->name,
                   flashc_dtype_name(c->dtype), what, err, tol, ms, r.pass ? "pass" : "FAIL",
                   fwd_only ? " (forward only: no backward on this backend)" : "");
            if (!r.pass) {
                failed++;
                printf("      %s%s(status %s, unwritten %d, nonfinite %d)\n", r.message, r.message[0] ? " " : "",
                       flashc_status_string(r.status), r.unwritten, r.nonfinite);
            } else {
                passed++;
            }
        }
        fflush(stdout);
    }
    printf("flashc check: %zu passed, %zu failed, %zu skipped (not supported) of %zu cases (%s, seed %llu, %.1f s)\n",
           passed, failed, skipped, selected, flashc_backend_name(backend), (unsigned long long)seed,
           cli_now() - t_all);
    flashc_context_destroy(ctx);
    cli_case_memory(FLASHC_BACKEND_CPU);
    return failed ? 1 : 0;
}
