/*
 * The CPU backend: its table, what the CPU has (cpuid features, the microkernel set they allow, the model name,
 * how many threads may run) and the checks of host-memory inputs before the drivers in attn.c run.
 */
#define _GNU_SOURCE /* syscall (arch_prctl for the AMX tile state) */
#include "cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#  include <omp.h>
#endif

/* ---- features and kernels ------------------------------------------------------------------------------ */

/*
 * Features come from cpuid itself rather than __builtin_cpu_supports: clang (14 at least) does not know the
 * "f16c" name, and the AVX states must also be enabled by the OS (XGETBV), which cpuid alone does not say.
 */
#if defined(FLASHC_CPU_X86)
#  include <cpuid.h>
#  if defined(__linux__)
#    include <sys/syscall.h>
#    include <unistd.h>
#  endif
enum { CPU_SSE42 = 1, CPU_AVX = 2, CPU_AVX2 = 4, CPU_FMA = 8, CPU_F16C = 16, CPU_AVX512F = 32, CPU_AVX512BW = 64,
       CPU_AVX512BF16 = 128, CPU_AMX_BF16 = 256, CPU_AVX512DQ = 512 };

/*
 * AMX-BF16 present: cpuid leaf 7 EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), the OS saving the tile state (XCR0 bits
 * 17, 18), palette 1 with 8 tiles of 16 rows x 64 bytes (leaf 0x1D). Using it also takes the process's permission
 * for the tile data on Linux (amx_permission), asked only when the amx set is chosen.
 */
static int amx_usable(unsigned edx7, unsigned long long xcr0) {
    if (!(edx7 >> 22 & 1) || !(edx7 >> 24 & 1) || (xcr0 & 0x60000) != 0x60000) return 0;
    if (__get_cpuid_max(0, NULL) < 0x1d) return 0;
    unsigned a, b, c, d;
    __cpuid_count(0x1d, 0, a, b, c, d);
    if (a < 1) return 0; /* highest palette */
    __cpuid_count(0x1d, 1, a, b, c, d);
    if ((b & 0xffff) < 64 || (b >> 16) < 8 || (c & 0xffff) < 16) return 0; /* bytes per row, tiles, rows */
    return 1;
}

/*
 * Linux (5.16 on) kills a process at its first tile load unless it asked for the tile data (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). The permission is the whole process's and enlarges its signal frames
 * (a later sigaltstack smaller than that fails), so it is asked once, only when the amx set is chosen (by default, or
 * FLASHC_CPU_KERNELS=amx), never when another set is forced or by a build without the (not emulated) amx set. A
 * refusal leaves the avx512bf16 set, silently.
 */
#  if defined(FLASHC_CPU_AMX) && !defined(FLASHC_CPU_AMX_EMULATE)
static int amx_permitted;
static pthread_once_t amx_permission_once = PTHREAD_ONCE_INIT;
static void amx_permission_ask(void) {
#    if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#    else
    amx_permitted = 0; /* no way known here to ask the OS for the tile data */
#    endif
}
static int amx_permission(void) {
    pthread_once(&amx_permission_once, amx_permission_ask);
    return amx_permitted;
}
#  elif defined(FLASHC_CPU_AMX)
static int amx_permission(void) { return 1; } /* emulated tiles: no tile state to ask for */
#  endif

static unsigned detect_x86(void) {
    unsigned a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned long long xcr0 = 0;
    if (c >> 27 & 1) { /* OSXSAVE: XGETBV tells which register states the OS saves */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((unsigned long long)hi << 32) | lo;
    }
    const int avx_os = (xcr0 & 6) == 6, avx512_os = (xcr0 & 0xe6) == 0xe6;
    if (c >> 20 & 1) f |= CPU_SSE42;
    if ((c >> 28 & 1) && avx_os) f |= CPU_AVX;
    if ((c >> 12 & 1) && avx_os) f |= CPU_FMA;
    if ((c >> 29 & 1) && avx_os) f |= CPU_F16C;
    if (__get_cpuid_max(0, NULL) >= 7) {
        unsigned a7, b7, c7, d7;
        __cpuid_count(7, 0, a7, b7, c7, d7);
        if ((b7 >> 5 & 1) && avx_os) f |= CPU_AVX2;
        if ((b7 >> 16 & 1) && avx512_os) f |= CPU_AVX512F;
        if ((b7 >> 30 & 1) && avx512_os) f |= CPU_AVX512BW;
        if ((b7 >> 17 & 1) && avx512_os) f |= CPU_AVX512DQ; /* vreduceps: kernels_avx512bf16.c's exp2 of P */
        if (a7 >= 1) { /* subleaf 1, EAX bit 5: AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16, vcvtneps2bf16) */
            unsigned a71, b71, c71, d71;
            __cpuid_count(7, 1, a71, b71, c71, d71);
            if ((a71 >> 5 & 1) && avx512_os) f |= CPU_AVX512BF16;
        }
        if (amx_usable(d7, xcr0)) f |= CPU_AMX_BF16;
    }
    return f;
}
#endif

/* Everything detected once per process; pthread_once keeps concurrent first calls from racing. */
static struct {
    char features[128];
    const flashc_cpu_kernels *kernels;
    unsigned x86;
} cpu_info;
static pthread_once_t cpu_info_once = PTHREAD_ONCE_INIT;

/*
 * The "avx512bf16" set: the AVX-512 table with the bf16 products on vdpbf16ps (kernels_avx512bf16.c), put together
 * once: its fp32 kernels are the AVX-512 set's, so only what differs is written twice.
 */
#if defined(FLASHC_CPU_X86) && defined(FLASHC_CPU_AVX512BF16)
static flashc_cpu_kernels kernels_avx512bf16;
static pthread_once_t avx512bf16_once = PTHREAD_ONCE_INIT;
/* decode's O += P V: bf16 V rows on vdpbf16ps, fp32 rows the AVX-512 set's kernel */
static void pv_avx512bf16(int rows, int cols, int D, const float *p, int64_t ldp, const float *alpha,
                          const void *const *v, int vt, float *o, int64_t ldo) {
    if (vt == FLASHC_CPU_KV_BF16) flashc_cpu_pv_avx512bf16(rows, cols, D, p, ldp, alpha, v, vt, o, ldo);
    else flashc_cpu_kernels_avx512.pv(rows, cols, D, p, ldp, alpha, v, vt, o, ldo);
}
static void avx512bf16_init(void) {
    kernels_avx512bf16 = flashc_cpu_kernels_avx512;
    kernels_avx512bf16.name = "avx512bf16_12x32";
    kernels_avx512bf16.bf16 = &flashc_cpu_bf16_kernels_avx512;
    kernels_avx512bf16.dots_kv = flashc_cpu_dots_kv_avx512bf16;
    kernels_avx512bf16.softmax_rows_p16 = flashc_cpu_softmax_rows_p16_avx512bf16;
    kernels_avx512bf16.pv = pv_avx512bf16;
}
#endif

/*
 * The "amx" set: the avx512bf16 set with its bf16 gemm on AMX tiles (kernels_amx.c); its register tile is a 32 x 32
 * block of C tiles, and the edge strips of attn.c are one A tile tall (mr 16). Built with FLASHC_CPU_AMX_EMULATE the
 * tiles are emulated in C: then the set runs on any CPU with AVX512-BF16, only when forced, and says so in its name.
 */
#if defined(FLASHC_CPU_X86) && defined(FLASHC_CPU_AMX)
static flashc_cpu_kernels kernels_amx;
static flashc_cpu_bf16_kernels bf16_amx;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_init(void) {
    pthread_once(&avx512bf16_once, avx512bf16_init);
    flashc_cpu_bf16_kernels_amx_fill(&bf16_amx);
    kernels_amx = kernels_avx512bf16;
#  if defined(FLASHC_CPU_AMX_EMULATE)
    kernels_amx.name = "amx_32x32_emulated";
#  else
    kernels_amx.name = "amx_32x32";
#  endif
    kernels_amx.mr = 16;
    kernels_amx.nr = 32;
    kernels_amx.bf16 = &bf16_amx;
}
#endif

static const flashc_cpu_kernels *kernels_by_name(unsigned x86, const char *name) {
    if (!strcmp(name, "generic")) return &flashc_cpu_kernels_generic;
#if defined(FLASHC_CPU_X86)
    const unsigned avx2 = CPU_AVX2 | CPU_FMA | CPU_F16C, avx512 = CPU_AVX512F | CPU_FMA | CPU_F16C;
    if (!strcmp(name, "avx2") && (x86 & avx2) == avx2) return &flashc_cpu_kernels_avx2;
    if (!strcmp(name, "avx512") && (x86 & avx512) == avx512) return &flashc_cpu_kernels_avx512;
#  if defined(FLASHC_CPU_AVX512BF16)
    const unsigned bf16 = avx512 | CPU_AVX512BW | CPU_AVX512DQ | CPU_AVX512BF16;
    if (!strcmp(name, "avx512bf16") && (x86 & bf16) == bf16) {
        pthread_once(&avx512bf16_once, avx512bf16_init);
        return &kernels_avx512bf16;
    }
#    if defined(FLASHC_CPU_AMX)
#      if defined(FLASHC_CPU_AMX_EMULATE)
    const unsigned amx = bf16;
#      else
    const unsigned amx = bf16 | CPU_AMX_BF16;
#      endif
    if (!strcmp(name, "amx") && (x86 & amx) == amx && amx_permission()) {
        pthread_once(&amx_once, amx_init);
        return &kernels_amx;
    }
#    endif
#  endif
#endif
    (void)x86;
    return NULL;
}

static void cpu_info_init(void) {
    char *buf = cpu_info.features;
    buf[0] = '\0';
#if defined(FLASHC_CPU_X86)
    const unsigned f = detect_x86();
    cpu_info.x86 = f;
    static const struct { unsigned bit; const char *name; } names[] = {
        {CPU_SSE42, "sse4.2"}, {CPU_AVX, "avx"}, {CPU_AVX2, "avx2"}, {CPU_FMA, "fma"}, {CPU_F16C, "f16c"},
        {CPU_AVX512F, "avx512f"}, {CPU_AVX512BW, "avx512bw"}, {CPU_AVX512DQ, "avx512dq"},
        {CPU_AVX512BF16, "avx512bf16"}, {CPU_AMX_BF16, "amx-bf16"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (f & names[i].bit) strcat(buf, names[i].name), strcat(buf, " ");
#elif defined(__aarch64__)
    strcat(buf, "neon ");
#endif
#ifdef _OPENMP
    strcat(buf, "openmp ");
#endif
    size_t n = strlen(buf);
    if (n) buf[n - 1] = '\0';
    else strcpy(buf, "generic");

    const flashc_cpu_kernels *k = NULL;
    /* generic | avx2 | avx512 | avx512bf16 | amx, when this CPU runs it */
    const char *force = getenv("FLASHC_CPU_KERNELS");
    if (force) k = kernels_by_name(cpu_info.x86, force);
#if !defined(FLASHC_CPU_AMX_EMULATE)
    if (!k) k = kernels_by_name(cpu_info.x86, "amx");
#endif
    if (!k) k = kernels_by_name(cpu_info.x86, "avx512bf16");
    if (!k) k = kernels_by_name(cpu_info.x86, "avx512");
    if (!k) k = kernels_by_name(cpu_info.x86, "avx2");
    if (!k) k = &flashc_cpu_kernels_generic;
    cpu_info.kernels = k;
}

const char *flashc_cpu_features(void) {
    pthread_once(&cpu_info_once, cpu_info_init);
    return cpu_info.features;
}

const flashc_cpu_kernels *flashc_cpu_kernels_by_name(const char *name) {
    pthread_once(&cpu_info_once, cpu_info_init);
    return kernels_by_name(cpu_info.x86, name);
}

const flashc_cpu_kernels *flashc_cpu_select_kernels(void) {
    pthread_once(&cpu_info_once, cpu_info_init);
    return cpu_info.kernels;
}

/* ---- threads ------------------------------------------------------------------------------------------- */

/* Never more than 4 threads per processor this process may run on (and FLASHC_MAX_THREADS): libgomp exits the
 * process when it cannot start the threads a parallel region asks for, so no user-given count reaches OpenMP
 * unbounded. A few per processor still lets tests run more threads than cores. Taken once per process: libgomp's
 * omp_get_num_procs asks the kernel for the thread's affinity mask at every call, and the limit ICV is fixed at
 * start-up. */
static int thread_limit_value = 1;
static pthread_once_t thread_limit_once = PTHREAD_ONCE_INIT;
static void thread_limit_init(void) {
#ifdef _OPENMP
    const int procs = omp_get_num_procs(), tl = omp_get_thread_limit();
    int lim = procs > 0 ? (procs < FLASHC_MAX_THREADS / 4 ? 4 * procs : FLASHC_MAX_THREADS) : 1;
    if (tl > 0 && tl < lim) lim = tl;
    thread_limit_value = lim;
#endif
}

static int thread_limit(void) {
    pthread_once(&thread_limit_once, thread_limit_init);
    return thread_limit_value;
}

/* The context holds the count asked for (0: OpenMP's default, read at every call since omp_set_num_threads - which
 * torch.set_num_threads calls - changes it); the cap is applied here, where it is known. */
static int cpu_threads(const struct flashc_context *ctx) {
#ifdef _OPENMP
    const int n = ctx->threads > 0 ? ctx->threads : omp_get_max_threads(), lim = thread_limit();
    return n < 1 ? 1 : n > lim ? lim : n;
#else
    (void)ctx;
    return 1;
#endif
}

/* Inside a caller's active parallel region body runs in a region of its own even on one thread (nested, so
 * normally inactive: a team of one), since its orphaned loops would otherwise bind to the caller's team and share
 * their iterations with the caller's other threads. */
void flashc_cpu_team(int threads, int64_t pieces, flashc_cpu_body body, void *arg) {
    const int n = pieces < threads ? (pieces > 1 ? (int)pieces : 1) : threads;
#ifdef _OPENMP
    if (n > 1 || omp_in_parallel()) {
#  pragma omp parallel num_threads(n)
        body(arg, omp_get_thread_num());
        return;
    }
#endif
    (void)n;
    body(arg, 0);
}

/* ---- the table ----------------------------------------------------------------------------------------- */

static flashc_status check_seqlens(struct flashc_context *ctx, const flashc_problem *p);
static flashc_status check_pages(struct flashc_context *ctx, const flashc_problem *p);

/* What lives in host memory, which only a backend that reads it can check: cu_seqlens and seqused_k against the
 * problem, the ALiBi slopes and the sinks. */
static flashc_status check_inputs(struct flashc_context *ctx, const flashc_problem *p) {
    /* A non-finite slope is refused like a non-finite scale: it would turn every score of its head to NaN or
     * infinity, which no caller means. (The CUDA backend cannot read device memory without a synchronizing
     * copy, so there such a slope gives NaN.) */
    if (p->alibi)
        for (int64_t b = 0; b < (p->alibi_batch_stride ? p->B : 1); b++)
            for (int64_t h = 0; h < p->H; h++) {
                const float m = p->alibi[b * p->alibi_batch_stride + h];
                if (!isfinite(m))
                    return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                      "alibi slope of batch %lld, head %lld is %g: slopes must be finite",
                                      (long long)b, (long long)h, (double)m);
            }
    if (p->sinks)
        for (int64_t h = 0; h < p->H; h++)
            if (!isfinite(p->sinks[h]))
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "sink of head %lld is %g: sinks must be finite",
                                  (long long)h, (double)p->sinks[h]);
    FLASHC_TRY(check_seqlens(ctx, p));
    if (p->seqused_k)
        for (int64_t b = 0; b < p->B; b++) {
            int64_t k0, rows;
            flashc_seq_key_rows(p, b, &k0, &rows);
            if (p->seqused_k[b] < 0 || p->seqused_k[b] > rows)
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                  "seqused_k[%lld] is %d: it must lie in [0, %lld], the sequence's key rows%s",
                                  (long long)b, (int)p->seqused_k[b], (long long)rows,
                                  p->block_table && !p->varlen ? " (the block table's max_pages * page_size: the "
                                                                 "table is too short for this length)"
                                                               : "");
        }
    if (p->block_table) FLASHC_TRY(check_pages(ctx, p));
    return FLASHC_STATUS_OK;
}

/* Paged K/V: every page the used keys of a sequence lie on is in [0, num_pages) (entries past them are not read).
 * The backward writes dk, dv through the table, so there a page named twice (two sequences sharing a prefix, or one
 * naming it twice) would have two writers: refused. */
static flashc_status check_pages(struct flashc_context *ctx, const flashc_problem *p) {
    int32_t *owner = NULL;
    if (p->op == FLASHC_OP_BACKWARD) {
        owner = (int32_t *)malloc(sizeof(int32_t) * (size_t)p->num_pages);
        if (!owner) return FLASHC_ERR(ctx, FLASHC_STATUS_OUT_OF_MEMORY, "out of host memory checking the block table");
        for (int64_t i = 0; i < p->num_pages; i++) owner[i] = -1;
    }
    flashc_status st = FLASHC_STATUS_OK;
    for (int64_t b = 0; b < p->B && st == FLASHC_STATUS_OK; b++) {
        int64_t q0, nq, k0, nk;
        flashc_seq_bounds(p, b, &q0, &nq, &k0, &nk);
        const int64_t pages = (nk + p->page_size - 1) / p->page_size;
        const int32_t *row = p->block_table + b * p->bt_stride;
        for (int64_t i = 0; i < pages; i++) {
            const int64_t page = row[i];
            if (page < 0 || page >= p->num_pages) {
                st = FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                "block_table[%lld][%lld] = %lld is not a page of k and v (num_pages %lld): sequence "
                                "%lld's %lld keys lie on its first %lld pages",
                                (long long)b, (long long)i, (long long)page, (long long)p->num_pages, (long long)b,
                                (long long)nk, (long long)pages);
                break;
            }
            if (owner && owner[page] >= 0) {
                st = FLASHC_ERR(ctx, FLASHC_STATUS_NOT_SUPPORTED,
                                "page %lld is named by the block table of sequence %d and of sequence %lld: the "
                                "backward writes dk, dv through the table, and a shared page would have two writers",
                                (long long)page, (int)owner[page], (long long)b);
                break;
            }
            if (owner) owner[page] = (int32_t)b;
        }
    }
    free(owner);
    return st;
}

/* cu_seqlens against the problem: starting at 0, non-decreasing, within max_seqlen and the packed rows. */
static flashc_status check_seqlens(struct flashc_context *ctx, const flashc_problem *p) {
    if (!p->varlen) return FLASHC_STATUS_OK;
    if (p->cu_q[0] != 0 || p->cu_k[0] != 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "cu_seqlens must start at 0 (got %d, %d)",
                          (int)p->cu_q[0], (int)p->cu_k[0]);
    for (int64_t b = 0; b < p->B; b++) {
        int64_t lq = (int64_t)p->cu_q[b + 1] - p->cu_q[b], lk = (int64_t)p->cu_k[b + 1] - p->cu_k[b];
        if (lq < 0 || lk < 0)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "cu_seqlens decrease at sequence %lld",
                              (long long)b);
        if (p->block_table && lk > p->bt_max_pages * p->page_size)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "sequence %lld has %lld keys (cu_seqlens_k): more than its block table row's %lld pages "
                              "of %lld hold",
                              (long long)b, (long long)lk, (long long)p->bt_max_pages, (long long)p->page_size);
        if (lq > p->Nq || lk > p->Nk)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "sequence %lld has lengths (%lld, %lld) above max_seqlen (%lld, %lld)", (long long)b,
                              (long long)lq, (long long)lk, (long long)p->Nq, (long long)p->Nk);
    }
    /* (paged: cu_seqlens_k only gives lengths, the keys are not packed) */
    if (p->cu_q[p->B] > p->total_q || (!p->block_table && p->cu_k[p->B] > p->total_k))
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                          "cu_seqlens end at (%d, %d), beyond the packed tensors' %lld query and %lld key rows",
                          (int)p->cu_q[p->B], (int)p->cu_k[p->B], (long long)p->total_q, (long long)p->total_k);
    return FLASHC_STATUS_OK;
}

static flashc_status cpu_init(struct flashc_context *ctx) {
    if (ctx->device != 0)
        return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT, "the cpu backend has only device 0, not %d", ctx->device);
    return FLASHC_STATUS_OK;
}

static int cpu_device_count(void) { return 1; }

/* The model name where the OS tells it, else "cpu". */
static flashc_status cpu_device_name(int device, char *buf, size_t len) {
    if (device != 0) return FLASHC_ERR(NULL, FLASHC_STATUS_INVALID_ARGUMENT, "cpu device %d does not exist", device);
    snprintf(buf, len, "cpu");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f)) {
            char *colon = strchr(line, ':');
            if (strncmp(line, "model name", 10) == 0 && colon) {
                colon += strspn(colon + 1, " \t") + 1;
                colon[strcspn(colon, "\n")] = '\0';
                snprintf(buf, len, "%s", colon);
                break;
            }
        }
        fclose(f);
    }
    return FLASHC_STATUS_OK;
}

/* Every validated problem runs on the CPU; the plan fixes the path (decode.c's for a forward of few query rows, else
 * attn.c's tiles), the thread count the workspace is sized for and, for decode, how the keys are split. */
enum { CPU_PATH_TILES = 0, CPU_PATH_DECODE = 1 };
static flashc_status cpu_plan(struct flashc_context *ctx, const flashc_problem *p, flashc_plan *plan) {
    plan->threads = cpu_threads(ctx);
    const int64_t splits = flashc_cpu_decode_splits(p);
    if (splits > 0) {
        plan->kernel = "CPU decode (GQA rows packed, split-KV, SIMD dots)";
        plan->path = CPU_PATH_DECODE;
        plan->nsplit = (int)splits;
        plan->workspace = flashc_cpu_decode_workspace(p, plan->threads, splits);
        return FLASHC_STATUS_OK;
    }
    plan->kernel = "CPU tiles (SIMD microkernels)";
    plan->path = CPU_PATH_TILES;
    plan->workspace = p->op == FLASHC_OP_FORWARD ? flashc_cpu_forward_workspace(p, plan->threads)
                                                 : flashc_cpu_backward_workspace(p, plan->threads);
    return FLASHC_STATUS_OK;
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

static flashc_status cpu_forward(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                                 void *workspace) {
    FLASHC_TRY(check_inputs(ctx, p));
    if (plan->path == CPU_PATH_DECODE)
        flashc_cpu_decode(p, flashc_cpu_select_kernels(), plan->threads, plan->nsplit, workspace);
    else
        flashc_cpu_forward(p, flashc_cpu_select_kernels(), plan->threads, workspace);
    return FLASHC_STATUS_OK;
}

static flashc_status cpu_backward(struct flashc_context *ctx, const flashc_problem *p, const flashc_plan *plan,
                                  void *workspace) {
    FLASHC_TRY(check_inputs(ctx, p));
    flashc_cpu_backward(p, flashc_cpu_select_kernels(), plan->threads, workspace);
    return FLASHC_STATUS_OK;
}

/* Checks every sequence's rows first, so that a refused call writes nothing; then copies row by row (any strides,
 * one dtype: bytes move as they are). */
static flashc_status cpu_kvcache_append(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                        const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                        const flashc_tensor *v_new, const int32_t *cache_seqlens) {
    const int64_t B = k_cache->shape[0], cap = k_cache->shape[1], n = k_new->shape[1];
    for (int64_t b = 0; b < B; b++)
        if (cache_seqlens[b] < 0 || cache_seqlens[b] > cap - n)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "cache_seqlens[%lld] = %d: %lld new rows from there do not fit the cache's %lld",
                              (long long)b, (int)cache_seqlens[b], (long long)n, (long long)cap);
    const size_t esz = flashc_dtype_size(k_cache->dtype);
    const flashc_tensor *dst[2] = {k_cache, v_cache}, *src[2] = {k_new, v_new};
    for (int w = 0; w < 2; w++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t h = 0; h < k_cache->shape[2]; h++)
                    for (int64_t d = 0; d < k_cache->shape[3]; d++) {
                        const int64_t so = b * src[w]->stride[0] + i * src[w]->stride[1] + h * src[w]->stride[2] +
                                           d * src[w]->stride[3];
                        const int64_t to = b * dst[w]->stride[0] + (cache_seqlens[b] + i) * dst[w]->stride[1] +
                                           h * dst[w]->stride[2] + d * dst[w]->stride[3];
                        memcpy((char *)dst[w]->data + to * (int64_t)esz, (const char *)src[w]->data + so * (int64_t)esz,
                               esz);
                    }
    return FLASHC_STATUS_OK;
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The paged append: checks every sequence's rows and pages first (nothing written on refusal), and that no two new
 * rows land on one cache row; then copies row by row through the table. */
static flashc_status cpu_kvcache_append_paged(struct flashc_context *ctx, const flashc_tensor *k_cache,
                                              const flashc_tensor *v_cache, const flashc_tensor *k_new,
                                              const flashc_tensor *v_new, const int32_t *cache_seqlens,
                                              const int32_t *block_table, int64_t max_pages, int64_t stride) {
    const int64_t B = k_new->shape[0], n = k_new->shape[1], ps = k_cache->shape[1], npages = k_cache->shape[0];
    const int64_t cap = max_pages * ps; /* the front checked it fits */
    for (int64_t b = 0; b < B; b++) {
        if (cache_seqlens[b] < 0 || cache_seqlens[b] > cap - n)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "cache_seqlens[%lld] = %d: %lld new rows from there do not fit the block table's %lld "
                              "pages of %lld rows",
                              (long long)b, (int)cache_seqlens[b], (long long)n, (long long)max_pages, (long long)ps);
        for (int64_t j = cache_seqlens[b] / ps; n > 0 && j <= (cache_seqlens[b] + n - 1) / ps; j++) {
            const int64_t page = block_table[b * stride + j];
            if (page < 0 || page >= npages)
                return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                                  "block_table[%lld][%lld] = %lld is not a page of the caches (num_pages %lld), and "
                                  "new rows of sequence %lld go there",
                                  (long long)b, (long long)j, (long long)page, (long long)npages, (long long)b);
        }
    }
    /* Two sequences writing one row would leave the cache depending on the order of the copies. */
    int64_t *dst = NULL, total;
    if (!flashc_mul_i64(B, n, &total) || !(dst = (int64_t *)malloc(sizeof(int64_t) * (size_t)(total ? total : 1))))
        return FLASHC_ERR(ctx, FLASHC_STATUS_OUT_OF_MEMORY, "out of host memory checking the block table");
    for (int64_t b = 0, k = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++, k++) {
            const int64_t j = cache_seqlens[b] + i;
            dst[k] = (int64_t)block_table[b * stride + j / ps] * ps + j % ps;
        }
    qsort(dst, (size_t)total, sizeof(int64_t), cmp_i64);
    for (int64_t k = 1; k < total; k++)
        if (dst[k] == dst[k - 1]) {
            const int64_t row = dst[k];
            free(dst);
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "two new rows go to row %lld of page %lld: the block table gives two sequences (or one "
                              "twice) the same page",
                              (long long)(row % ps), (long long)(row / ps));
        }
    free(dst);
    const size_t esz = flashc_dtype_size(k_cache->dtype);
    const flashc_tensor *to[2] = {k_cache, v_cache}, *src[2] = {k_new, v_new};
    for (int w = 0; w < 2; w++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t j = cache_seqlens[b] + i, page = block_table[b * stride + j / ps];
                for (int64_t h = 0; h < k_cache->shape[2]; h++)
                    for (int64_t d = 0; d < k_cache->shape[3]; d++) {
                        const int64_t so = b * src[w]->stride[0] + i * src[w]->stride[1] + h * src[w]->stride[2] +
                                           d * src[w]->stride[3];
                        const int64_t o = page * to[w]->stride[0] + (j % ps) * to[w]->stride[1] +
                                          h * to[w]->stride[2] + d * to[w]->stride[3];
                        memcpy((char *)to[w]->data + o * (int64_t)esz, (const char *)src[w]->data + so * (int64_t)esz,
                               esz);
                    }
            }
    return FLASHC_STATUS_OK;
}

static flashc_status cpu_merge(struct flashc_context *ctx, const flashc_tensor *out_a, const float *lse_a,
                               const flashc_tensor *out_b, const float *lse_b, const flashc_tensor *out, float *lse) {
    flashc_cpu_merge(out_a, lse_a, out_b, lse_b, out, lse, cpu_threads(ctx));
    return FLASHC_STATUS_OK;
}

/* Checks every sequence's positions first (nothing written on refusal): rows seq_start[b] .. seq_start[b] + N - 1 must
 * all have a row of the tables. */
static flashc_status cpu_rotary(struct flashc_context *ctx, const flashc_tensor *x, const flashc_tensor *cos,
                                const flashc_tensor *sin, const int32_t *seq_start, int interleaved,
                                const flashc_tensor *out) {
    const int64_t B = x->shape[0], N = x->shape[1], P = cos->shape[1];
    for (int64_t b = 0; b < B; b++) {
        const int64_t p0 = seq_start ? seq_start[b] : 0;
        if (p0 < 0 || p0 > P - N)
            return FLASHC_ERR(ctx, FLASHC_STATUS_INVALID_ARGUMENT,
                              "seq_start[%lld] = %lld: rows at positions %lld .. %lld, outside the tables' %lld "
                              "positions [0, %lld)",
                              (long long)b, (long long)p0, (long long)p0, (long long)(p0 + N - 1), (long long)P,
                              (long long)P);
    }
    const int in_place = out->data == x->data; /* the front let out meet x only as x's very view */
    flashc_cpu_rotary(x, cos, sin, seq_start, interleaved, out, in_place, cpu_threads(ctx));
    return FLASHC_STATUS_OK;
}

/* No set_stream: only the NULL stream is accepted. */
const flashc_backend_ops flashc_cpu_ops = {
    .kind = FLASHC_BACKEND_CPU,
    .device_count = cpu_device_count,
    .device_name = cpu_device_name,
    .init = cpu_init,
    .threads = cpu_threads,
    .plan = cpu_plan,
    .workspace_alloc = cpu_workspace_alloc,
    .workspace_free = cpu_workspace_free,
    .forward = cpu_forward,
    .backward = cpu_backward,
    .kvcache_append = cpu_kvcache_append,
    .merge = cpu_merge,
    .kvcache_append_paged = cpu_kvcache_append_paged,
    .rotary = cpu_rotary,
};
