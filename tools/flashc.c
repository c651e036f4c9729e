/*
 * flashc.c - the flashc command: `info`, `run` on .npy tensors, `check` against the oracle, `bench`.
 * This file holds main, the help texts, `info` and `run`; check.c and bench.c hold the other two.
 */
#include "cli.h"
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static const char main_usage[] =
    "flashc - exact attention (FlashAttention) on the CPU and CUDA\n"
    "\n"
    "usage: flashc <command> [options]\n"
    "\n"
    "commands:\n"
    "  info     version, backends compiled in, CPU features, OpenMP threads, GPUs\n"
    "  run      attention on .npy tensors:  flashc run --q q.npy --k k.npy --v v.npy --out o.npy\n"
    "  check    run the test case table against the fp64 oracle and print a pass/fail table\n"
    "  bench    sweep N and compare flash attention with standard (materialized) attention\n"
    "  help     this text; 'flashc help <command>' or 'flashc <command> --help' for its options\n"
    "  version  print the library version\n";

static const char info_usage[] =
    "usage: flashc info\n"
    "\n"
    "Prints the library version, the backends compiled in, the CPU features the library uses, the number of\n"
    "OpenMP threads, and the GPUs the CUDA backend finds.\n";

static const char run_usage[] =
    "usage: flashc run --q Q.npy --k K.npy --v V.npy --out O.npy [options]\n"
    "\n"
    "Attention on your own tensors: out = softmax(scale * q k^T [masked]) v, written in q's dtype.\n"
    "Inputs are NumPy .npy files, C order, little-endian float32 ('<f4'), float16 ('<f2'), or bfloat16 stored\n"
    "as uint16 bits ('<u2'). q is (B, Nq, H, D) and k, v are (B, Nk, Hkv, D) with H a multiple of Hkv; 3-d\n"
    "files (N, H, D) mean B = 1 and give 3-d outputs.\n"
    "\n"
    "options:\n"
    "  --q FILE, --k FILE, --v FILE   the inputs (required)\n"
    "  --out FILE                     the output, shaped like q (required)\n"
    "  --lse FILE                     also write the log-sum-exp, float32 (B, H, Nq) ((H, Nq) for 3-d inputs)\n"
    "  --layout bnhd|bhnd             axis order of every file: (B, N, H, D) (default) or (B, H, N, D)\n"
    "  --causal                       causal mask, aligned to the bottom right when Nq != Nk\n"
    "  --window L,R                   sliding window: key j is kept iff i+Nk-Nq-L <= j <= i+Nk-Nq+R; -1 unbounded\n"
    "  --scale S                      softmax scale (default, or 0: 1/sqrt(D)); a finite fp32 value\n"
    "  --softcap C                    scores become C * tanh(scores / C); C >= 0, 0 is off\n"
    "  --backend auto|cpu|cuda        default auto: CUDA when this command can reach a GPU and the GPU kernels\n"
    "                                 run the problem, else the CPU. CUDA computes float32 inputs with bf16\n"
    "                                 operands (fp32 accumulation); --backend cpu keeps full fp32 accuracy\n"
    "  --device N                     GPU index for --backend cuda (default 0)\n"
    "  --threads T                    CPU threads (default: OpenMP's)\n"
    "\n"
    "Outputs are written to a temporary file beside each name and renamed into place once all of them are\n"
    "written, so a failed run (exit status 1 or 2) leaves existing files as they were. A name that is a device\n"
    "or FIFO (e.g. /dev/null) is written straight through. An output may not name the same file as an input\n"
    "or as the other output.\n";

/* ---- info ----------------------------------------------------------------------------------------------------- */

int cli_info(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (cli_is_help(argv[i])) {
            fputs(info_usage, stdout);
            return 0;
        }
        return cli_usage_error("info", "unknown argument '%s'", argv[i]);
    }
    char name[256];
    printf("flashc %s\n", flashc_version());
    printf("backends:  cpu%s, cuda%s\n", flashc_backend_compiled(FLASHC_BACKEND_CPU) ? "" : " (not compiled)",
           flashc_backend_compiled(FLASHC_BACKEND_CUDA) ? "" : " (not compiled)");
    if (flashc_device_name(FLASHC_BACKEND_CPU, 0, name, sizeof name) != FLASHC_STATUS_OK) snprintf(name, sizeof name, "?");
    printf("cpu:       %s\n", name);
    printf("features:  %s\n", flashc_cpu_features());
#ifdef _OPENMP
    printf("openmp:    %d threads (%d processors)\n", omp_get_max_threads(), omp_get_num_procs());
#else
    printf("openmp:    not available in this command (1 thread)\n");
#endif
    if (flashc_backend_compiled(FLASHC_BACKEND_CUDA)) {
        int n = flashc_device_count(FLASHC_BACKEND_CUDA);
        printf("gpus:      %d\n", n);
        for (int d = 0; d < n; d++) {
            if (flashc_device_name(FLASHC_BACKEND_CUDA, d, name, sizeof name) != FLASHC_STATUS_OK)
                snprintf(name, sizeof name, "?");
            printf("  cuda:%d    %s\n", d, name);
        }
        /* What run, check and bench do with --backend auto: CUDA only with a GPU to run on. */
        if (!cli_cuda_runtime())
            printf("command:   built without the CUDA runtime: run, check and bench use the CPU\n");
        else if (n > 0)
            printf("command:   run, check and bench can use CUDA (the default with --backend auto)\n");
        else
            printf("command:   no GPU found: run, check and bench use the CPU\n");
        flashc_context_t ctx = NULL;
        if (n > 0 && flashc_context_create(&ctx, FLASHC_BACKEND_CUDA, 0) == FLASHC_STATUS_OK) {
            /* Which kernels cuda:0 runs, at the benchmark sweep's shape (bf16, B 1, N 4096, H 2048 / D). */
            printf("kernels on cuda:0 (bf16, N 4096; forward | backward):\n");
            static const int dims[] = {64, 96, 128, 192, 256};
            for (int i = 0; i < (int)(sizeof dims / sizeof dims[0]); i++)
                for (int causal = 0; causal < 2; causal++) {
                    const flashc_tensor t = flashc_tensor_contiguous(NULL, FLASHC_DTYPE_BF16, 1, 4096, 2048 / dims[i],
                                                                     dims[i]);
                    flashc_params prm = flashc_params_default();
                    prm.causal = causal;
                    const char *f = flashc_kernel_name(ctx, FLASHC_OP_FORWARD, &t, &t, &t, &prm);
                    const char *b = flashc_kernel_name(ctx, FLASHC_OP_BACKWARD, &t, &t, &t, &prm);
                    printf("  d %3d %-7s %s | %s\n", dims[i], causal ? "causal" : "", f ? f : "not supported",
                           b ? b : "not supported");
                }
            flashc_context_destroy(ctx);
        }
    } else {
        printf("gpus:      - (CUDA backend not compiled)\n");
    }
    return 0;
}

/* ---- run ------------------------------------------------------------------------------------------------------ */

typedef struct run_input {
    const char *path;
    npy_array arr;
    flashc_tensor view; /* host view over arr.data, (B, N, H, D) through the layout's strides */
} run_input;

/* Views a 3-d or 4-d array as (B, N, H, D). bhnd files are (B, H, N, D) in storage. */
static flashc_tensor run_view(void *data, flashc_dtype dtype, int ndim, const int64_t *shape, int bhnd) {
    int64_t s[4] = {1, 0, 0, 0};
    for (int i = 0; i < ndim; i++) s[4 - ndim + i] = shape[i];
    flashc_tensor t = flashc_tensor_contiguous(data, dtype, s[0], s[1], s[2], s[3]);
    if (bhnd) {
        /* storage (B, H, N, D) = (s0, s1, s2, s3); logical (B, N, H, D) */
        t.shape[0] = s[0];
        t.shape[1] = s[2];
        t.shape[2] = s[1];
        t.shape[3] = s[3];
        t.stride[3] = 1;
        t.stride[1] = s[3];
        t.stride[2] = s[2] * s[3];
        t.stride[0] = s[1] * s[2] * s[3];
    }
    return t;
}

static int parse_window(const char *s, int64_t *left, int64_t *right) {
    const char *comma = strchr(s, ',');
    if (!comma || strchr(comma + 1, ','))
        return cli_usage_error("run", "--window wants two integers L,R (e.g. 128,0 or -1,64), not '%s'", s), -1;
    char buf[64];
    size_t n = (size_t)(comma - s);
    if (n >= sizeof buf) return cli_usage_error("run", "--window value too long"), -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    if (cli_parse_i64("run", "window", buf, -1, INT64_MAX, left) != 0) return -1;
    if (cli_parse_i64("run", "window", comma + 1, -1, INT64_MAX, right) != 0) return -1;
    return 0;
}

static void run_release(run_input *in, int n) {
    for (int i = 0; i < n; i++) npy_free(&in[i].arr);
}

/* A file option given twice is refused rather than letting the last one win: "--q a.npy --q b.npy" is far more
 * often a typo for --k than a deliberate override. */
static int run_path(const char **slot, const char *opt, const char *v) {
    if (*slot) return cli_usage_error("run", "--%s given twice ('%s' and '%s')", opt, *slot, v);
    if (!v[0]) return cli_usage_error("run", "--%s needs a file name, got an empty string", opt);
    *slot = v;
    return 0;
}

/* Writing an output over an input would destroy the input (and, for --out and --lse, one output over the
 * other): refuse every pair that names one file, whatever the spelling (./a.npy, a hard link, a symbolic link). */
static int run_check_paths(const char *const *path, const char *const *role, int inputs, int n) {
    for (int o = inputs; o < n; o++) {
        if (!path[o]) continue;
        for (int j = 0; j < n; j++) {
            if (j == o || !path[j] || (j > o && j >= inputs)) continue;
            if (cli_same_file(path[o], path[j]))
                return cli_usage_error("run", "--%s %s and --%s %s are the same file; writing it would destroy %s",
                                       role[o], path[o], role[j], path[j],
                                       j < inputs ? "the input" : "the other output");
        }
    }
    return 0;
}

int cli_run(int argc, char **argv) {
    run_input in[3] = {{0}};
    const char *out_path = NULL, *lse_path = NULL;
    flashc_params prm = flashc_params_default();
    flashc_backend requested = FLASHC_BACKEND_AUTO;
    int bhnd = 0;
    int64_t device = 0, threads = 0;

    for (int i = 1; i < argc; i++) {
        const char *v = NULL, *a = argv[i];
        int m;
        if (cli_is_help(a)) {
            fputs(run_usage, stdout);
            return 0;
        }
        if ((m = cli_opt(argc, argv, &i, "q", &v)) != 0) {
            if (m < 0 || run_path(&in[0].path, "q", v) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "k", &v)) != 0) {
            if (m < 0 || run_path(&in[1].path, "k", v) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "v", &v)) != 0) {
            if (m < 0 || run_path(&in[2].path, "v", v) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "out", &v)) != 0) {
            if (m < 0 || run_path(&out_path, "out", v) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "lse", &v)) != 0) {
            if (m < 0 || run_path(&lse_path, "lse", v) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "layout", &v)) != 0) {
            if (m < 0) return 2;
            if (strcmp(v, "bnhd") == 0) bhnd = 0;
            else if (strcmp(v, "bhnd") == 0) bhnd = 1;
            else return cli_usage_error("run", "--layout wants bnhd or bhnd, not '%s'", v);
        } else if (cli_flag(a, "causal")) {
            prm.causal = 1;
        } else if ((m = cli_opt(argc, argv, &i, "window", &v)) != 0) {
            if (m < 0 || parse_window(v, &prm.window_left, &prm.window_right) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "scale", &v)) != 0) {
            if (m < 0 || cli_parse_f32("run", "scale", v, &prm.softmax_scale) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "softcap", &v)) != 0) {
            if (m < 0 || cli_parse_f32("run", "softcap", v, &prm.softcap) != 0) return 2;
            if (prm.softcap < 0.0f) return cli_usage_error("run", "--softcap wants a number >= 0 (0: off), not %s", v);
        } else if ((m = cli_opt(argc, argv, &i, "backend", &v)) != 0) {
            if (m < 0 || cli_parse_backend("run", v, &requested) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "device", &v)) != 0) {
            if (m < 0 || cli_parse_i64("run", "device", v, 0, 1024, &device) != 0) return 2;
        } else if ((m = cli_opt(argc, argv, &i, "threads", &v)) != 0) {
            if (m < 0 || cli_parse_i64("run", "threads", v, 0, 4096, &threads) != 0) return 2;
        } else if (strncmp(a, "--causal=", 9) == 0) {
            return cli_usage_error("run", "--causal takes no value (got '%s')", a);
        } else {
            return cli_usage_error("run", "unknown argument '%s'", a);
        }
    }
    if (!in[0].path || !in[1].path || !in[2].path || !out_path)
        return cli_usage_error("run", "--q, --k, --v and --out are required");
    static const char *const role[5] = {"q", "k", "v", "out", "lse"};
    const char *const paths[5] = {in[0].path, in[1].path, in[2].path, out_path, lse_path};
    if (run_check_paths(paths, role, 3, 5) != 0) return 2;
    /* With --out /dev/stdout the summary line would land inside the .npy bytes: send it to stderr then. */
    FILE *summary = cli_same_file(out_path, "/dev/stdout") || (lse_path && cli_same_file(lse_path, "/dev/stdout"))
                        ? stderr
                        : stdout;

    flashc_backend backend = cli_resolve_backend(requested);
    if (cli_backend_usable("run", backend, (int)device) != 0) return 1;

    /* The outputs are opened first - as temporaries beside their names, see npy.c - so a name that cannot be
     * written fails before any work, and so that exit status 1 can mean that no file changed. */
    char err[512];
    npy_out outs[2];
    memset(outs, 0, sizeof outs);
    if (npy_out_open(&outs[0], out_path, err, sizeof err) != 0) return cli_fail("run", "%s", err);
    if (lse_path && npy_out_open(&outs[1], lse_path, err, sizeof err) != 0) {
        npy_out_discard(&outs[0]);
        return cli_fail("run", "%s", err);
    }

    for (int t = 0; t < 3; t++) {
        if (npy_read(in[t].path, &in[t].arr, err, sizeof err) != 0) {
            run_release(in, 3);
            npy_out_discard(&outs[0]);
            npy_out_discard(&outs[1]);
            return cli_fail("run", "%s", err);
        }
        const npy_array *a = &in[t].arr;
        if (a->ndim != 3 && a->ndim != 4) {
            cli_fail("run", "%s: %s must be 3-d (N, H, D) or 4-d (B, N, H, D)%s, got %d-d", in[t].path, role[t],
                     bhnd ? " in bhnd order: (H, N, D) or (B, H, N, D)" : "", a->ndim);
            run_release(in, 3);
            npy_out_discard(&outs[0]);
            npy_out_discard(&outs[1]);
            return 1;
        }
        if (a->ndim != in[0].arr.ndim) {
            cli_fail("run", "%s: %s is %d-d but %s is %d-d", in[t].path, role[t], a->ndim, in[0].path,
                     in[0].arr.ndim);
            run_release(in, 3);
            npy_out_discard(&outs[0]);
            npy_out_discard(&outs[1]);
            return 1;
        }
        in[t].view = run_view(in[t].arr.data, a->dtype, a->ndim, a->shape, bhnd);
    }

    const npy_array *qa = &in[0].arr;
    const flashc_tensor *qv = &in[0].view;
    int64_t B = qv->shape[0], Nq = qv->shape[1], H = qv->shape[2];
    size_t esize = cli_dtype_size(qa->dtype);
    size_t out_bytes = qa->count * esize;
    /* The reader bounds the product of the nonzero sizes by INT64_MAX / 2, so B * H * Nq cannot overflow; its
     * bytes can (an f16 q with D = 0 holds nothing, yet may name 2^62 rows). */
    size_t lse_count = (size_t)(B * H * Nq);
    int rc = 1;
    if (lse_path && lse_count > SIZE_MAX / sizeof(float)) {
        cli_fail("run", "%s: the lse for B=%lld H=%lld Nq=%lld is too large for this machine", in[0].path,
                 (long long)B, (long long)H, (long long)Nq);
        npy_out_discard(&outs[0]);
        npy_out_discard(&outs[1]);
        run_release(in, 3);
        return 1;
    }
    flashc_context_t ctx = NULL;
    void *dev[5] = {NULL, NULL, NULL, NULL, NULL}; /* q, k, v, out, lse where the backend computes */
    void *out_host = malloc(out_bytes ? out_bytes : 1);
    float *lse_host = lse_path ? (float *)malloc(lse_count ? lse_count * sizeof(float) : 1) : NULL;
    if (!out_host || (lse_path && !lse_host)) {
        cli_fail("run", "out of memory for the outputs");
        goto done;
    }

    if (flashc_context_create(&ctx, backend, (int)device) != FLASHC_STATUS_OK) {
        cli_fail("run", "cannot create a %s context: %s", flashc_backend_name(backend),
                 flashc_context_last_error(NULL));
        goto done;
    }
    if (requested == FLASHC_BACKEND_AUTO && backend != FLASHC_BACKEND_CPU &&
        flashc_supported(ctx, FLASHC_OP_FORWARD, &in[0].view, &in[1].view, &in[2].view, &prm) ==
            FLASHC_STATUS_NOT_SUPPORTED) {
        /* auto means "the fastest backend that runs it"; invalid arguments are reported by the forward below */
        fprintf(stderr, "flashc run: %s does not run this (%s); using the CPU\n", flashc_backend_name(backend),
                flashc_context_last_error(ctx));
        flashc_context_destroy(ctx);
        ctx = NULL;
        backend = FLASHC_BACKEND_CPU;
        if (flashc_context_create(&ctx, backend, 0) != FLASHC_STATUS_OK) {
            cli_fail("run", "cannot create a cpu context: %s", flashc_context_last_error(NULL));
            goto done;
        }
    }
    if (threads > 0 && flashc_context_set_threads(ctx, (int)threads) != FLASHC_STATUS_OK) {
        cli_fail("run", "%s", flashc_context_last_error(ctx));
        goto done;
    }

    flashc_tensor qt = in[0].view, kt = in[1].view, vt = in[2].view;
    flashc_tensor ot = run_view(out_host, qa->dtype, qa->ndim, qa->shape, bhnd);
    float *lse = lse_host;
    if (backend == FLASHC_BACKEND_CUDA) {
        /* Same views, device storage: the strides stay valid because the copies are byte for byte. */
        flashc_tensor *views[3] = {&qt, &kt, &vt};
        if (cli_set_device(backend, (int)device) != 0) goto done;
        for (int t = 0; t < 3; t++) {
            size_t bytes = in[t].arr.count * cli_dtype_size(in[t].arr.dtype);
            if (!(dev[t] = cli_mem_alloc(backend, bytes)) ||
                cli_mem_to_backend(backend, dev[t], in[t].arr.data, bytes) != 0) {
                cli_fail("run", "cannot copy %s to the GPU", in[t].path);
                goto done;
            }
            views[t]->data = dev[t];
        }
        if (!(dev[3] = cli_mem_alloc(backend, out_bytes)) ||
            (lse_path && !(dev[4] = cli_mem_alloc(backend, lse_count * sizeof(float))))) {
            cli_fail("run", "out of GPU memory for the outputs");
            goto done;
        }
        ot.data = dev[3];
        lse = (float *)dev[4];
    }

    double t0 = cli_now();
    if (flashc_forward(ctx, &qt, &kt, &vt, &prm, &ot, lse, NULL, 0) != FLASHC_STATUS_OK) {
        /* The library speaks of q, k and v; say which files those were. */
        cli_fail("run", "--q %s, --k %s, --v %s: %s", in[0].path, in[1].path, in[2].path,
                 flashc_context_last_error(ctx));
        goto done;
    }
    if (backend == FLASHC_BACKEND_CUDA) {
        if (cli_mem_to_host(backend, out_host, dev[3], out_bytes) != 0 ||
            (lse_path && cli_mem_to_host(backend, lse_host, dev[4], lse_count * sizeof(float)) != 0)) {
            cli_fail("run", "cannot copy the results back from the GPU");
            goto done;
        }
    }
    double secs = cli_now() - t0;

    /* Every output is written in full before any is renamed into place, so a failure leaves the old files as
     * they were. Temporaries go first and devices/FIFOs (written straight through) last: bytes sent to a device
     * cannot be taken back, so they are sent only once everything that can still fail on disk has succeeded. */
    {
        /* lse: (B, H, Nq), or (H, Nq) when the inputs had no batch axis */
        int64_t lshape[3] = {B, H, Nq};
        int lnd = qa->ndim == 3 ? 2 : 3;
        const int n_out = lse_path ? 2 : 1;
        for (int pass = 0; pass < 2; pass++)
            for (int o = 0; o < n_out; o++) {
                if (outs[o].direct != pass) continue;
                int w = o == 0 ? npy_out_write(&outs[0], qa->dtype, qa->ndim, qa->shape, out_host, err, sizeof err)
                               : npy_out_write(&outs[1], FLASHC_DTYPE_F32, lnd, lshape + (3 - lnd), lse_host, err,
                                               sizeof err);
                if (w != 0) {
                    cli_fail("run", "%s", err);
                    goto done;
                }
            }
        for (int o = 0; o < n_out; o++) {
            if (npy_out_commit(&outs[o], err, sizeof err) != 0) {
                /* Only a rename can fail here; an earlier output may already be in place, so say which. */
                if (o > 0) cli_fail("run", "%s was written, but:", out_path);
                cli_fail("run", "%s", err);
                goto done;
            }
        }
    }
    fprintf(summary, "flashc run: %s %s B=%lld Nq=%lld Nk=%lld H=%lld Hkv=%lld D=%lld%s -> %s%s%s (%.3f ms)\n",
           flashc_backend_name(backend), flashc_dtype_name(qa->dtype), (long long)B, (long long)Nq,
           (long long)kt.shape[1], (long long)H, (long long)kt.shape[2], (long long)qt.shape[3],
           prm.causal ? " causal" : "", out_path, lse_path ? ", " : "", lse_path ? lse_path : "", 1e3 * secs);
    rc = 0;

done:
    npy_out_discard(&outs[0]);
    npy_out_discard(&outs[1]);
    for (int t = 0; t < 5; t++) cli_mem_free(backend, dev[t]);
    flashc_context_destroy(ctx);
    free(out_host);
    free(lse_host);
    run_release(in, 3);
    return rc;
}

/* ---- main ----------------------------------------------------------------------------------------------------- */

typedef struct cli_command {
    const char *name;
    int (*fn)(int argc, char **argv);
} cli_command;

static const cli_command commands[] = {
    {"info", cli_info}, {"run", cli_run}, {"check", cli_check}, {"bench", cli_bench}};

static const cli_command *find_command(const char *name) {
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(commands[i].name, name) == 0) return &commands[i];
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(main_usage, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (cli_is_help(cmd)) {
        if (argc > 2) {
            const cli_command *c = find_command(argv[2]);
            if (!c) {
                fprintf(stderr, "flashc: unknown command '%s'\n\n%s", argv[2], main_usage);
                return 2;
            }
            char help[] = "--help";
            char *sub[2] = {argv[2], help};
            return c->fn(2, sub);
        }
        fputs(main_usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        if (argc > 2) {
            fprintf(stderr, "flashc: %s takes no arguments (got '%s')\n", cmd, argv[2]);
            return 2;
        }
        printf("flashc %s\n", flashc_version());
        return 0;
    }
    const cli_command *c = find_command(cmd);
    if (!c) {
        fprintf(stderr, "flashc: unknown command '%s'\n\n%s", cmd, main_usage);
        return 2;
    }
    return c->fn(argc - 1, argv + 1);
}
