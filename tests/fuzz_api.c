/*
 * fuzz_api.c - a seeded random driver (and, with -DFLASHC_LIBFUZZER, a libFuzzer harness) for the public API of
 * flashc on the CPU backend.
 *
 * One input (a byte string) decodes into one call sequence on a fresh CPU context:
 *   flashc_supported, flashc_kernel_name, flashc_{forward,backward}_workspace_size (shape-only queries), then
 *   flashc_forward and, when asked, flashc_backward on real buffers,
 * with every field of the tensors and params fuzzed (shapes, strides, dtypes, aliasing, ALiBi, block mask,
 * varlen cu_seqlens, windows, positions, softcap, thread counts, workspace sizes and alignment, NULL pointers,
 * parameter arrays placed inside output buffers). run_input() is that per-input function; LLVMFuzzerTestOneInput
 * calls it.
 *
 * The driver (main, built unless FLASHC_LIBFUZZER is defined) generates each case's input from a splitmix64
 * stream of (seed, case index): a structured generator (gen_case) fills the decoded case with mostly valid,
 * small problems and, in about half the cases, 1-3 hostile mutations biased toward the values that break
 * arithmetic (0, +-1, INT64_MAX/MIN, near-overflow products, NaN, +-inf, denormals, huge windows, block sizes
 * near INT64_MAX, huge max_seqlen, overlapping/negative/zero strides, invalid enums, NULLs, tiny or misaligned
 * workspaces, thread counts up to 40000 and INT32_MAX), then encodes it with the same codec the decoder uses.
 * So every driver case is also a libFuzzer input (--write DIR saves them as a corpus).
 *
 *   fuzz_api [--seed S] [--seconds T] [--runs N] [--index I] [--kernels generic|avx2|avx512|avx512bf16|amx|all]
 *            [--verbose]
 *   fuzz_api --case HEX_OR_FILE [--kernels K] [--verbose]       replays one input
 *   fuzz_api --seed S --runs N --write DIR                       writes the generated inputs, runs nothing
 *   --avoid 4,13 leaves those hostile mutation kinds (the case labels in gen_case) out, to look past a known finding;
 *   the replay command of a finding must then carry the same --avoid.
 * Without --kernels (and without FLASHC_CPU_KERNELS in the environment) the time is split between one child
 * process per kernel set this CPU runs (FLASHC_CPU_KERNELS is read once per process), same seed in each.
 * A case whose thread count is above THREADS_SANE runs in a child process (so that a library that lets the
 * OpenMP runtime exit cannot end the run): the child must exit 0.
 *
 * Checks (a violation prints the seed, the case index and a replay command, and exits 1):
 *   - every status is a known value; a failing call leaves a "file:line: message" error, a successful one "";
 *   - nothing is written outside the buffers: every buffer has GUARD canary bytes before and after it, checked
 *     after each call (in sanitized builds they are also poisoned, so ASan reports reads there too);
 *   - a call never writes into its inputs (q, k, v; out, dout, lse in the backward) when they share no memory
 *     with an output, writes an output only inside its view, and a failing call leaves its outputs untouched;
 *   - a call that succeeds had no output overlapping itself (self-overlapping strides) or overlapping the
 *     cu_seqlens, ALiBi slopes or block mask it reads;
 *   - every successful forward is compared with the fp64 oracle (src/ref/oracle.c), and so is the backward when
 *     it ran on the forward's own out and lse; a deterministic backward run twice gives the same bits.
 *
 * Comparison with the oracle (CONVENTIONS.md rule, widened only by the fp32 rounding of large logits):
 *   L = |scale| * D * max|q| * max|k| + max|slope| * (Nq + Nk) bounds every logit (inputs are in [-1, 1)).
 *   fp32:     relative Frobenius error <= max(1e-5, 4 eps L) (gradients max(1e-4, 16 eps L)), eps = 2^-24:
 *             a logit of size L carries an absolute error of about eps L, which moves every probability by
 *             that relative amount;
 *   f16/bf16: max abs error <= max(2 (gradients 3) * max|naive_lowp - ref|, one ulp of max|ref| in the dtype)
 *             + 1e-5, naive_lowp being the oracle's emulation of the plain algorithm in that dtype (the ulp floor:
 *             on a few elements the naive error can be smaller than the last rounding into the dtype);
 *   lse:      +inf exactly where the reference row sees no key, else |lse - ref| <= 1e-5 (1 + |ref|) + 4 eps L
 *             (+ 2 max|naive_lowp - ref| for f16/bf16).
 *   Compared only when L <= LOGIT_CAP and the data and slopes are finite. Non-finite inputs (NaN, +-inf, and
 *   finite values so large that the scores overflow) are fuzzed too, but checked only for the status, the
 *   message, the guards and the views: their semantics (NaN propagates per row) are the library's to define.
 *   Varlen rows outside every sequence (past cu_seqlens[num_seqs]) are not compared.
 *
 * Input layout (libFuzzer): a fixed-width header (see decode()) followed by a pool of bytes for contents
 * (block-mask bytes, cu_seqlens, ALiBi slopes). FUZZ_VERBOSE=1 (or --verbose) prints the decoded case and each
 * call's status. Build and run under libFuzzer: tests/fuzz/README.md.
 */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#  define _POSIX_C_SOURCE 200809L
#endif

#include "cpu/cpu.h"
#include "ref/testkit.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__unix__) || defined(__APPLE__)
#  include <sys/wait.h>
#  include <unistd.h>
#  define FZ_POSIX 1
#else
#  define FZ_POSIX 0
#endif

#if defined(__SANITIZE_ADDRESS__)
#  define FZ_ASAN 1
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer)
#    define FZ_ASAN 1
#  endif
#endif
#ifndef FZ_ASAN
#  define FZ_ASAN 0
#endif
#if FZ_ASAN
#  include <sanitizer/asan_interface.h>
#  include <sanitizer/common_interface_defs.h>
#endif

/* Bulk loops of the harness (fills, hashes, view marks) stay out of the coverage feedback: they are slow under it
 * and say nothing about the library. */
#if defined(__clang__)
#  define NOCOV __attribute__((no_sanitize("coverage")))
#else
#  define NOCOV
#endif

#if defined(__GNUC__)
__extension__ typedef __int128 i128;
#else
#  error "fuzz_api.c needs a 128-bit integer type (gcc, clang)"
#endif

#define CAP ((size_t)1 << 20)        /* bytes per harness buffer */
#define WS_CAP ((size_t)64 << 20)   /* the most workspace the harness lets the library (or itself) allocate */
#define FLOP_CAP 8.0e6                /* B*H*Nq*Nk*D per data call */
#define TASK_CAP 1.0e5                /* B*H*Nq/16 + B*Hkv*Nk/16 per data call */
#define GUARD 64                      /* canary bytes before and after every buffer */
#define THREADS_SANE 64               /* above: the case runs in a child process */
#define LOGIT_CAP 1.0e4               /* compare with the oracle only below this logit bound */

/* ---- input decoding ------------------------------------------------------------------------------------- */

/* The header codec: one description of the layout (decode() below) that reads a header into an fcase, or, with
 * out set, writes the header of an fcase (for FUZZ_WRITE_SEEDS). Past the end of the input every field reads 0. */
typedef struct reader {
    const uint8_t *p;
    size_t n, i;
    uint8_t *out; /* writing: bytes go here (n is its capacity) */
} reader;

static uint8_t rd_u8(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static void wr_u8(reader *r, uint8_t v) {
    if (r->i < r->n) r->out[r->i++] = v;
}
static uint64_t rd_bytes(reader *r, int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; k++) v |= (uint64_t)rd_u8(r) << (8 * k);
    return v;
}
static void wr_bytes(reader *r, uint64_t v, int n) {
    for (int k = 0; k < n; k++) wr_u8(r, (uint8_t)(v >> (8 * k)));
}
static void f_u8(reader *r, uint8_t *v) {
    if (r->out) wr_u8(r, *v);
    else *v = rd_u8(r);
}
static void f_u32(reader *r, uint32_t *v) {
    if (r->out) wr_bytes(r, *v, 4);
    else *v = (uint32_t)rd_bytes(r, 4);
}
static void f_u64(reader *r, uint64_t *v) {
    if (r->out) wr_bytes(r, *v, 8);
    else *v = rd_bytes(r, 8);
}

static const int64_t specials[32] = {
    0, -1, 1, 2, -2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257,
    INT32_MAX, (int64_t)INT32_MAX + 1, INT32_MIN, (int64_t)UINT32_MAX, (int64_t)1 << 32, (int64_t)1 << 40,
    (int64_t)1 << 62, INT64_MAX, INT64_MIN, INT64_MAX - 1, INT64_MIN + 1, -((int64_t)1 << 62),
    ((int64_t)1 << 31) - 64, (int64_t)1 << 20, -((int64_t)1 << 20)};

/* 9 bytes: selector (0: def; 1..191: lo..hi; 192..223: specials; 224..255: the raw int64) and a raw value. */
static void f_int(reader *r, int64_t *v, int64_t lo, int64_t hi, int64_t def) {
    if (r->out) {
        uint8_t sel = 0;
        uint64_t raw = 0;
        if (*v == def) sel = 0;
        else if (*v >= lo && *v <= hi && *v - lo < 191) sel = (uint8_t)(*v - lo + 1);
        else sel = 224, raw = (uint64_t)*v;
        wr_u8(r, sel);
        wr_bytes(r, raw, 8);
        return;
    }
    uint8_t sel = rd_u8(r);
    uint64_t raw = rd_bytes(r, 8);
    if (sel == 0) *v = def;
    else if (sel < 192) *v = lo + (int64_t)((uint64_t)(sel - 1) % (uint64_t)(hi - lo + 1));
    else if (sel < 224) *v = specials[sel - 192];
    else *v = (int64_t)raw;
}

static const float ftab[] = {0.0f, 1.0f, -1.0f, 0.5f, 2.0f, NAN, INFINITY, -INFINITY, 1e-30f, 1e30f, FLT_MAX,
                             -FLT_MAX, 1e-45f, -0.0f, 30.0f, 50.0f, 0.125f, 1e-5f, 0.999f, 1.0001f, 3e38f, -1e-30f,
                             100.0f, -3.0f};
/* 5 bytes: selector (0: def; 1..127: table; 128..255: raw bits) and raw bits. */
static void f_float(reader *r, float *v, float def) {
    if (r->out) {
        uint32_t raw;
        memcpy(&raw, v, sizeof raw);
        wr_u8(r, memcmp(v, &def, sizeof def) ? 128 : 0);
        wr_bytes(r, raw, 4);
        return;
    }
    uint8_t sel = rd_u8(r);
    uint32_t raw = (uint32_t)rd_bytes(r, 4);
    if (sel == 0) *v = def;
    else if (sel < 128) *v = ftab[(sel - 1) % (sizeof ftab / sizeof ftab[0])];
    else memcpy(v, &raw, sizeof *v);
}

/* Contents: pool bytes while there are any, then a PRNG. */
static uint64_t g_rng;
static reader g_pool;
static uint64_t rng(void) { return flashc_rand_u64(&g_rng); }
static uint8_t pool_u8(void) { return g_pool.i < g_pool.n ? g_pool.p[g_pool.i++] : (uint8_t)rng(); }
static uint32_t pool_u32(void) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) v |= (uint32_t)pool_u8() << (8 * k);
    return v;
}
static float pool_float(int specials_on) {
    uint8_t s = pool_u8();
    if (specials_on && s >= 240) return ftab[s % (sizeof ftab / sizeof ftab[0])];
    return ((float)(rng() >> 40) / (float)(1 << 24)) * 2.0f - 1.0f;
}

/* ---- the decoded case ----------------------------------------------------------------------------------- */

enum { TQ, TK, TV, TO, TDO, TDQ, TDK, TDV, TLSE, NITEM };
static const char *item_names[NITEM] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse"};

typedef struct tspec {
    uint8_t pert, dsel, layout, perm, flip, zero, group, shift, nullsel;
    int64_t pert_val, raw_stride[4];
    uint32_t draw;
} tspec;

typedef struct fcase {
    uint8_t ops;
    int64_t threads;
    uint8_t dsel;
    uint32_t draw;
    int64_t B, Nq, Nk, H, Hkv, D;
    uint8_t vmode, cu_null;
    int64_t num_seqs, total_q, total_k, maxq, maxk;
    tspec ts[8];
    uint8_t lmode, lshift, lfill;
    uint8_t pnull;
    float scale, softcap, dropout;
    uint8_t causal_sel;
    uint32_t causal_raw;
    int64_t wl, wr;
    uint8_t amode;
    int64_t astride;
    uint8_t bmode;
    int64_t bq, bk, bb, bh;
    uint64_t dseed, doff;
    uint8_t det;
    uint8_t fws, bws;
    int64_t fws_extra, bws_extra;
    uint8_t fill;
    uint64_t seed;
    uint8_t misc;
    int64_t misc_int;
    /* appended fields (inputs written before them decode with 0 there) */
    uint8_t pin;      /* bit 0-2: cu_seqlens / slopes / block mask placed inside an output; bits 4-7: which */
    uint32_t pin_off; /* where inside it */
    uint8_t pmode;    /* positions: 0 off, 255 a nonzero value other than 1, else on */
    uint64_t qpos, kpos; /* q_position, k_position (two's complement) */
} fcase;

static void decode(reader *r, fcase *c) {
    if (!r->out) memset(c, 0, sizeof *c);
    f_u8(r, &c->ops);
    f_int(r, &c->threads, 0, 4, 0);
    f_u8(r, &c->dsel);
    f_u32(r, &c->draw);
    f_int(r, &c->B, 1, 4, 2);
    f_int(r, &c->Nq, 1, 190, 13);
    f_int(r, &c->Nk, 1, 190, 17);
    f_int(r, &c->H, 1, 6, 2);
    f_int(r, &c->Hkv, 1, 6, 1);
    f_int(r, &c->D, 1, 80, 16);
    f_u8(r, &c->vmode);
    f_u8(r, &c->cu_null);
    f_int(r, &c->num_seqs, 1, 6, 2);
    f_int(r, &c->total_q, 1, 190, 0);
    f_int(r, &c->total_k, 1, 190, 0);
    f_int(r, &c->maxq, 1, 190, 0);
    f_int(r, &c->maxk, 1, 190, 0);
    for (int i = 0; i < 8; i++) {
        tspec *t = &c->ts[i];
        f_u8(r, &t->pert);
        f_int(r, &t->pert_val, -2, 300, 1);
        f_u8(r, &t->dsel);
        f_u32(r, &t->draw);
        f_u8(r, &t->layout);
        f_u8(r, &t->perm);
        f_u8(r, &t->flip);
        f_u8(r, &t->zero);
        for (int d = 0; d < 4; d++) f_int(r, &t->raw_stride[d], -70, 70, 0);
        f_u8(r, &t->group);
        f_u8(r, &t->shift);
        f_u8(r, &t->nullsel);
    }
    f_u8(r, &c->lmode);
    f_u8(r, &c->lshift);
    f_u8(r, &c->lfill);
    f_u8(r, &c->pnull);
    f_float(r, &c->scale, 0.0f);
    f_u8(r, &c->causal_sel);
    f_u32(r, &c->causal_raw);
    f_int(r, &c->wl, -1, 70, -1);
    f_int(r, &c->wr, -1, 70, -1);
    f_float(r, &c->softcap, 0.0f);
    f_u8(r, &c->amode);
    f_int(r, &c->astride, 0, 8, 0);
    f_u8(r, &c->bmode);
    f_int(r, &c->bq, 1, 70, 16);
    f_int(r, &c->bk, 1, 70, 16);
    f_int(r, &c->bb, 1, 6, 1);
    f_int(r, &c->bh, 1, 6, 1);
    f_float(r, &c->dropout, 0.0f);
    f_u64(r, &c->dseed);
    f_u64(r, &c->doff);
    f_u8(r, &c->det);
    f_u8(r, &c->fws);
    f_int(r, &c->fws_extra, 0, 256, 0);
    f_u8(r, &c->bws);
    f_int(r, &c->bws_extra, 0, 256, 0);
    f_u8(r, &c->fill);
    f_u64(r, &c->seed);
    f_u8(r, &c->misc);
    f_int(r, &c->misc_int, 0, 300, 64);
    f_u8(r, &c->pin);
    f_u32(r, &c->pin_off);
    f_u8(r, &c->pmode);
    f_u64(r, &c->qpos);
    f_u64(r, &c->kpos);
}

static flashc_dtype pick_dtype(uint8_t sel, uint32_t raw) { return sel < 240 ? (flashc_dtype)(sel % 3) : (flashc_dtype)(int32_t)raw; }

/* ---- buffers -------------------------------------------------------------------------------------------- */

typedef struct item {
    flashc_tensor t;
    int present;    /* descriptor pointer non-NULL */
    int want_null;  /* data forced NULL */
    int fits;       /* span computed and <= CAP */
    int group, shift;
    size_t esz;
    int64_t neg, pos; /* element offsets: lowest (<= 0) and highest (>= 0) the view reaches */
    uint8_t *base;    /* group buffer */
    size_t base_size;
    int sole;         /* the only member of its buffer */
} item;

/* Products for sizing, saturated at +-2^100 (a view or buffer that large never fits). */
#define SAT ((i128)1 << 100)
static i128 sat(i128 x) { return x > SAT ? SAT : x < -SAT ? -SAT : x; }
static i128 smul(i128 a, i128 b) {
    if (a == 0 || b == 0) return 0;
    i128 aa = a < 0 ? -a : a, bb = b < 0 ? -b : b;
    if (aa >= SAT || bb >= SAT || aa > SAT / bb) return (a < 0) != (b < 0) ? -SAT : SAT;
    return a * b;
}

static int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }

static const int perms[24][4] = {
    {0, 1, 2, 3}, {0, 1, 3, 2}, {0, 2, 1, 3}, {0, 2, 3, 1}, {0, 3, 1, 2}, {0, 3, 2, 1}, {1, 0, 2, 3}, {1, 0, 3, 2},
    {1, 2, 0, 3}, {1, 2, 3, 0}, {1, 3, 0, 2}, {1, 3, 2, 0}, {2, 0, 1, 3}, {2, 0, 3, 1}, {2, 1, 0, 3}, {2, 1, 3, 0},
    {2, 3, 0, 1}, {2, 3, 1, 0}, {3, 0, 1, 2}, {3, 0, 2, 1}, {3, 1, 0, 2}, {3, 1, 2, 0}, {3, 2, 0, 1}, {3, 2, 1, 0}};

/* Strides of a contiguous layout whose dims run outer to inner in ord (wrapping arithmetic: a view that large
 * is over CAP anyway and is then passed without data). */
static void contiguous(const int64_t *sh, const int *ord, int64_t mult, int64_t *st) {
    int64_t s = mult;
    for (int i = 3; i >= 0; i--) {
        st[ord[i]] = s;
        s = wrap_mul(s, sh[ord[i]]);
    }
}

static void make_view(item *it, const tspec *ts, const int64_t *shape, flashc_dtype common) {
    flashc_tensor *t = &it->t;
    memcpy(t->shape, shape, sizeof t->shape);
    if (ts->pert >= 200) t->shape[ts->pert % 4] = ts->pert_val;
    t->dtype = ts->dsel < 224 ? common : ts->dsel < 240 ? (flashc_dtype)(ts->dsel % 3) : (flashc_dtype)(int32_t)ts->draw;
    static const int bnhd[4] = {0, 1, 2, 3}, bhnd[4] = {0, 2, 1, 3};
    switch (ts->layout & 7) {
    case 0:
    case 6: contiguous(t->shape, bnhd, 1, t->stride); break;
    case 1:
    case 7: contiguous(t->shape, bhnd, 1, t->stride); break;
    case 2: contiguous(t->shape, perms[ts->perm % 24], 1, t->stride); break;
    case 3: /* padded rows, heads and batches */
        t->stride[3] = 1;
        t->stride[2] = wrap_add(t->shape[3], ts->raw_stride[2] & 7);
        t->stride[1] = wrap_add(wrap_mul(t->shape[2], t->stride[2]), ts->raw_stride[1] & 15);
        t->stride[0] = wrap_add(wrap_mul(t->shape[1], t->stride[1]), ts->raw_stride[0] & 31);
        break;
    case 4:
        for (int d = 0; d < 4; d++) t->stride[d] = ts->raw_stride[d];
        break;
    case 5: contiguous(t->shape, bnhd, 2, t->stride); break; /* every other element: stride 2 along D */
    }
    if (ts->layout & 8)
        for (int d = 0; d < 4; d++)
            if (ts->flip >> d & 1) t->stride[d] = (int64_t)(0 - (uint64_t)t->stride[d]);
    if (ts->layout & 16)
        for (int d = 0; d < 4; d++)
            if (ts->zero >> d & 1) t->stride[d] = 0;
    it->present = ts->nullsel != 250;
    it->want_null = ts->nullsel > 250;
    it->group = ts->group >= 200 ? ts->group % NITEM : -1;
    it->shift = (ts->shift % 8) * 4;
}

/* The element range the view reaches; fits = within CAP bytes. A view with a non-positive dim reaches nothing (the
 * front rejects it) and gets a 16-byte buffer. */
static void measure(item *it) {
    const flashc_tensor *t = &it->t;
    it->esz = t->dtype == FLASHC_DTYPE_F16 || t->dtype == FLASHC_DTYPE_BF16 ? 2 : 4;
    it->neg = 0;
    it->pos = 0;
    it->fits = 0;
    for (int d = 0; d < 4; d++)
        if (t->shape[d] <= 0) {
            it->pos = 16 / (int64_t)it->esz - 1;
            it->fits = 1;
            return;
        }
    i128 neg = 0, pos = 0;
    for (int d = 0; d < 4; d++) {
        i128 reach = smul(t->shape[d] - 1, t->stride[d]);
        if (reach < 0) neg = sat(neg + reach);
        else pos = sat(pos + reach);
    }
    if ((pos - neg + 1) * (i128)it->esz > (i128)CAP) return;
    it->neg = (int64_t)neg;
    it->pos = (int64_t)pos;
    it->fits = 1;
}

/* ---- the driver's context for reports ----------------------------------------------------------------------- */

static int g_verbose;
static int g_driver;        /* running under main(), not libFuzzer */
static int g_in_process;    /* a child: never spawn another */
static char g_replay[1024]; /* what a report prints: seed, case index, replay command */
__attribute__((unused)) static const char *g_exe = "fuzz_api";
__attribute__((unused)) static const char *g_kernels; /* --kernels, as passed on */

__attribute__((unused)) static void print_replay(void) {
    if (g_replay[0]) {
        fputs(g_replay, stderr);
        fputc('\n', stderr);
    }
}

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_api: CHECK FAILED: %s (%s)\n", what, detail ? detail : "");
#ifdef FLASHC_LIBFUZZER
    abort();
#else
    print_replay();
    fflush(stdout);
    fflush(stderr);
    _Exit(1);
#endif
}

#if FZ_ASAN
static void on_sanitizer_death(void) {
    fputs("fuzz_api: the sanitizer stopped the run\n", stderr);
    print_replay();
}
#elif FZ_POSIX && !defined(FLASHC_LIBFUZZER)
static void on_signal(int sig) {
    static const char msg[] = "fuzz_api: fatal signal in the library or the harness\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    w = write(2, g_replay, strlen(g_replay));
    w = write(2, "\n", 1);
    (void)w;
    signal(sig, SIG_DFL);
    raise(sig);
}
#endif

/* ---- guarded buffers: GUARD canary bytes on each side ------------------------------------------------------- */

typedef struct gblock {
    uint8_t *raw, *p;
    size_t n;
    struct gblock *next;
} gblock;
static gblock *g_blocks;

static uint8_t guard_byte(size_t i) { return (uint8_t)(0xC3u ^ (unsigned)(i * 29u)); }

static void guards_poison(gblock *b, int on) {
#if FZ_ASAN
    if (on) {
        ASAN_POISON_MEMORY_REGION(b->p - GUARD, GUARD);
        ASAN_POISON_MEMORY_REGION(b->p + b->n, GUARD);
    } else {
        ASAN_UNPOISON_MEMORY_REGION(b->p - GUARD, GUARD);
        ASAN_UNPOISON_MEMORY_REGION(b->p + b->n, GUARD);
    }
#else
    (void)b;
    (void)on;
#endif
}

/* n zeroed bytes, 64-byte aligned plus misalign, between two guards. */
static void *galloc(size_t n, size_t misalign) {
    gblock *b = calloc(1, sizeof *b);
    if (!b) fail("harness out of memory", NULL);
    b->raw = malloc(n + 2 * GUARD + 128);
    if (!b->raw) fail("harness out of memory", NULL);
    uintptr_t a = ((uintptr_t)b->raw + GUARD + 63) & ~(uintptr_t)63;
    b->p = (uint8_t *)a + (misalign & 63);
    b->n = n;
    memset(b->p, 0, n);
    for (size_t i = 0; i < GUARD; i++) b->p[-(ptrdiff_t)GUARD + (ptrdiff_t)i] = guard_byte(i), b->p[n + i] = guard_byte(i + 1);
    guards_poison(b, 1);
    b->next = g_blocks;
    g_blocks = b;
    return b->p;
}

NOCOV static void guards_check(const char *call) {
    for (gblock *b = g_blocks; b; b = b->next) {
        guards_poison(b, 0);
        for (size_t i = 0; i < GUARD; i++) {
            int before = b->p[-(ptrdiff_t)GUARD + (ptrdiff_t)i] != guard_byte(i), after = b->p[b->n + i] != guard_byte(i + 1);
            if (before || after) {
                char buf[160];
                snprintf(buf, sizeof buf, "%s: byte %s%zu of a %zu-byte buffer", call, before ? "-" : "+",
                         before ? GUARD - i : i, b->n);
                fail("a write outside a buffer (guard bytes changed)", buf);
            }
        }
        guards_poison(b, 1);
    }
}

static void gfree_all(void) {
    while (g_blocks) {
        gblock *b = g_blocks;
        g_blocks = b->next;
        guards_poison(b, 0);
        free(b->raw);
        free(b);
    }
}

typedef struct group_buf {
    uint8_t *mem;
    size_t size;
    int members;
} group_buf;

/* ---- checks --------------------------------------------------------------------------------------------- */

/* A failure message must read "file:line: message". */
static int message_ok(const char *m) {
    const char *colon = strchr(m, ':');
    if (!colon || colon == m) return 0;
    const char *d = colon + 1;
    if (*d < '0' || *d > '9') return 0;
    while (*d >= '0' && *d <= '9') d++;
    return d[0] == ':' && d[1] == ' ' && d[2] != '\0';
}

static void check_status(const char *call, flashc_status st, flashc_context_t ctx) {
    if ((int)st < 0 || (int)st > 5) fail("unknown status", call);
    const char *msg = flashc_context_last_error(ctx);
    if (!msg) fail("last_error returned NULL", call);
    if (g_verbose) fprintf(stderr, "  %s -> %s \"%s\"\n", call, flashc_status_string(st), msg);
    if (st != FLASHC_STATUS_OK) {
        if (!message_ok(msg)) {
            char buf[600];
            snprintf(buf, sizeof buf, "%s: \"%s\"", call, msg);
            fail("failure without a \"file:line: message\" error", buf);
        }
    } else if (ctx && msg[0]) {
        fail("success leaves an error message", call);
    }
}

NOCOV __attribute__((noinline)) static uint64_t hash_buf(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

#define CANARY 0xFF /* all-ones: a NaN in every dtype that no arithmetic produces */

/* How many elements of the view cover each byte of its buffer; *self: some byte is covered twice. */
NOCOV static uint8_t *view_bytes(const item *it, uint8_t *data, int *self) {
    uint8_t *mark = calloc(it->base_size ? it->base_size : 1, 1);
    if (!mark) return NULL;
    *self = 0;
    const flashc_tensor *t = &it->t;
    for (int64_t a = 0; a < t->shape[0]; a++)
        for (int64_t b = 0; b < t->shape[1]; b++)
            for (int64_t c = 0; c < t->shape[2]; c++)
                for (int64_t d = 0; d < t->shape[3]; d++) {
                    int64_t off = a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + d * t->stride[3];
                    size_t byte = (size_t)(data - it->base) + (size_t)(off * (int64_t)it->esz);
                    for (size_t e = 0; e < it->esz; e++) {
                        if (mark[byte + e]) *self = 1;
                        mark[byte + e] = 1;
                    }
                }
    return mark;
}

/* ---- the harness ---------------------------------------------------------------------------------------- */

enum { PIN_CU, PIN_ALIBI, PIN_MASK, NPIN };
static const char *pin_names[NPIN] = {"cu_seqlens", "alibi_slopes", "block_mask"};

typedef struct state {
    fcase c;
    item it[NITEM];
    group_buf g[NITEM];
    int varlen;           /* both cu_seqlens set */
    int32_t *cu_q, *cu_k; /* as passed */
    int32_t *cu_mem;
    size_t cu_n;          /* int32 entries in cu_mem */
    int cu_ok;            /* cu buffers cover num_seqs + 1 entries (or num_seqs <= 0) */
    float *alibi_mem;
    size_t alibi_n;
    int64_t alibi_lo;     /* slopes pointer = alibi_mem + alibi_lo */
    int alibi_ok;
    uint8_t *mask;
    size_t mask_n;
    int mask_ok;
    flashc_params prm;
    /* parameter arrays placed inside an output buffer (c.pin) */
    int pin_item[NPIN];   /* item whose buffer holds it, -1: none */
    uint8_t *pin_at[NPIN];
    size_t pin_bytes[NPIN];
    uint8_t *pre[NITEM];  /* output buffers as the call got them */
} state;

NOCOV static void fill_input(item *it, uint8_t *data, int specials_on) {
    if (!data || !it->fits) return;
    uint8_t *lo = data + it->neg * (int64_t)it->esz;
    size_t n = (size_t)(it->pos - it->neg + 1);
    for (size_t i = 0; i < n; i++) {
        float f = pool_float(specials_on);
        if (it->esz == 4) memcpy(lo + 4 * i, &f, 4);
        else {
            uint32_t u;
            memcpy(&u, &f, 4);
            uint16_t h = (uint16_t)(u >> 16); /* bf16-ish bits; as f16 bits only finite when specials are off */
            if (!specials_on && it->t.dtype == FLASHC_DTYPE_F16) h = flashc_f32_to_f16(f);
            memcpy(lo + 2 * i, &h, 2);
        }
    }
}

static uint8_t *item_data(const state *s, int i) { return (uint8_t *)s->it[i].t.data; }

static void print_case(const state *s) {
    const fcase *c = &s->c;
    fprintf(stderr, "case: ops=%u threads=%lld varlen=%d num_seqs=%lld max_seqlen=(%lld,%lld) fill=%u pin=%u\n",
            c->ops, (long long)c->threads, s->varlen, (long long)s->prm.num_seqs, (long long)s->prm.max_seqlen_q,
            (long long)s->prm.max_seqlen_k, c->fill, c->pin);
    for (int i = 0; i < NITEM; i++) {
        const item *it = &s->it[i];
        const flashc_tensor *t = &it->t;
        fprintf(stderr, "  %-4s %s dtype=%d shape=(%lld,%lld,%lld,%lld) stride=(%lld,%lld,%lld,%lld) data=%s group=%d\n",
                item_names[i], it->present ? "" : "NULL-ptr", (int)t->dtype, (long long)t->shape[0],
                (long long)t->shape[1], (long long)t->shape[2], (long long)t->shape[3], (long long)t->stride[0],
                (long long)t->stride[1], (long long)t->stride[2], (long long)t->stride[3], t->data ? "buf" : "NULL",
                it->group);
    }
    const flashc_params *p = &s->prm;
    fprintf(stderr,
            "  params%s: scale=%a causal=%d window=(%lld,%lld) softcap=%a alibi=%s stride=%lld block_mask=%s "
            "(%lld,%lld,%lld,%lld) dropout=%a det=%d positions=%d (%lld,%lld)\n",
            c->pnull == 255 ? "(NULL)" : "", (double)p->softmax_scale, p->causal, (long long)p->window_left,
            (long long)p->window_right, (double)p->softcap, p->alibi_slopes ? "set" : "NULL",
            (long long)p->alibi_batch_stride, p->block_mask ? "set" : "NULL", (long long)p->block_mask_q,
            (long long)p->block_mask_k, (long long)p->block_mask_batch, (long long)p->block_mask_heads,
            (double)p->dropout_p, p->deterministic, p->positions, (long long)p->q_position, (long long)p->k_position);
    if (s->cu_q && s->cu_ok && s->prm.num_seqs > 0 && s->prm.num_seqs < 64) {
        fprintf(stderr, "  cu_q:");
        for (int64_t b = 0; b <= s->prm.num_seqs; b++) fprintf(stderr, " %d", s->cu_q[b]);
        fprintf(stderr, "\n  cu_k:");
        for (int64_t b = 0; b <= s->prm.num_seqs; b++) fprintf(stderr, " %d", s->cu_k[b]);
        fprintf(stderr, "\n");
    }
    for (int k = 0; k < NPIN; k++)
        if (s->pin_item[k] >= 0) fprintf(stderr, "  %s placed inside %s's buffer\n", pin_names[k], item_names[s->pin_item[k]]);
}

/* Which items an op writes. */
static int is_output(int op, int i) { return op == 0 ? (i == TO || i == TLSE) : (i == TDQ || i == TDK || i == TDV); }
static int is_input(int op, int i) {
    return op == 0 ? (i == TQ || i == TK || i == TV) : (i == TQ || i == TK || i == TV || i == TO || i == TDO || i == TLSE);
}

typedef struct snapshot {
    uint64_t hash[NITEM];
    int shares_output[NITEM];
} snapshot;

/* Copies the parameter arrays into their places inside output buffers (after the outputs got their canaries). */
static void apply_pins(state *s) {
    const void *src[NPIN] = {s->cu_mem, s->alibi_mem, s->mask};
    for (int k = 0; k < NPIN; k++)
        if (s->pin_item[k] >= 0) memcpy(s->pin_at[k], src[k], s->pin_bytes[k]);
}

NOCOV static void snap_before(state *s, int op, snapshot *sn) {
    /* outputs start as canaries */
    for (int i = 0; i < NITEM; i++)
        if (is_output(op, i) && item_data(s, i) && s->it[i].sole) memset(s->it[i].base, CANARY, s->it[i].base_size);
    apply_pins(s);
    for (int i = 0; i < NITEM; i++) {
        sn->shares_output[i] = 0;
        free(s->pre[i]);
        s->pre[i] = NULL;
        if (!item_data(s, i)) continue;
        for (int j = 0; j < NITEM; j++)
            if (is_output(op, j) && item_data(s, j) && s->it[j].base == s->it[i].base) sn->shares_output[i] = 1;
        sn->hash[i] = hash_buf(s->it[i].base, s->it[i].base_size);
        if (is_output(op, i) && s->it[i].sole) {
            s->pre[i] = malloc(s->it[i].base_size);
            if (!s->pre[i]) fail("harness out of memory", NULL);
            memcpy(s->pre[i], s->it[i].base, s->it[i].base_size);
        }
    }
}

/* Whether an output of op holds a parameter array the call reads, and an element of its view covers it. */
static int pinned_overlap(state *s, int op, char *what, size_t len) {
    const void *used[NPIN] = {s->varlen ? (const void *)s->prm.cu_seqlens_q : NULL, s->prm.alibi_slopes,
                              s->prm.block_mask};
    for (int k = 0; k < NPIN; k++) {
        int i = s->pin_item[k];
        if (i < 0 || !used[k] || !is_output(op, i) || !item_data(s, i)) continue;
        item *it = &s->it[i];
        size_t off = (size_t)(s->pin_at[k] - it->base);
        int hit = 0;
        if (i == TLSE) {
            size_t lo = (size_t)(item_data(s, i) - it->base), hi = lo + (size_t)(it->pos + 1) * 4;
            hit = off < hi && lo < off + s->pin_bytes[k];
        } else {
            int self = 0;
            uint8_t *mark = view_bytes(it, item_data(s, i), &self);
            for (size_t b = off; mark && b < off + s->pin_bytes[k] && !hit; b++) hit = mark[b];
            free(mark);
        }
        if (hit) {
            snprintf(what, len, "%s overlaps %s", item_names[i], pin_names[k]);
            return 1;
        }
    }
    return 0;
}

NOCOV static void check_after(state *s, int op, const snapshot *sn, flashc_status st, const char *call) {
    char buf[160];
    guards_check(call);
    if (st == FLASHC_STATUS_OK && pinned_overlap(s, op, buf, sizeof buf)) {
        char b2[240];
        snprintf(b2, sizeof b2, "%s: %s", call, buf);
        fail("a call succeeded with an output overlapping a parameter array it reads", b2);
    }
    for (int i = 0; i < NITEM; i++) {
        if (!item_data(s, i) || !s->it[i].present) continue;
        if (is_input(op, i) && !sn->shares_output[i] && hash_buf(s->it[i].base, s->it[i].base_size) != sn->hash[i]) {
            snprintf(buf, sizeof buf, "%s: input %s", call, item_names[i]);
            fail("the call wrote into an input", buf);
        }
        if (is_output(op, i) && s->it[i].sole) {
            const item *it = &s->it[i];
            int valid_view = it->fits && it->t.shape[0] > 0 && it->t.shape[1] > 0 && it->t.shape[2] > 0 && it->t.shape[3] > 0;
            int self = 0;
            uint8_t *mark = (st == FLASHC_STATUS_OK && valid_view && i != TLSE) ? view_bytes(it, item_data(s, i), &self) : NULL;
            if (self) {
                snprintf(buf, sizeof buf, "%s: %s strides (%lld, %lld, %lld, %lld)", call, item_names[i],
                         (long long)it->t.stride[0], (long long)it->t.stride[1], (long long)it->t.stride[2],
                         (long long)it->t.stride[3]);
                free(mark);
                fail("a call succeeded with an output view that overlaps itself", buf);
            }
            for (size_t b = 0; b < it->base_size; b++) {
                int inside = i == TLSE ? st == FLASHC_STATUS_OK : (mark ? mark[b] : 0);
                if (!inside && it->base[b] != s->pre[i][b]) {
                    snprintf(buf, sizeof buf, "%s: %s byte %zu of %zu (status %d)", call, item_names[i], b,
                             it->base_size, (int)st);
                    free(mark);
                    fail(st == FLASHC_STATUS_OK ? "an output written outside its view" : "a failing call wrote an output",
                         buf);
                }
            }
            free(mark);
        }
    }
}

/* ---- comparison with the fp64 oracle ----------------------------------------------------------------------- */

typedef struct stats {
    uint64_t cases, ok, refused, queries_only, fwd_ok, cmp_fwd, cmp_bwd, isolated;
} stats;
static stats g_st;

static double elem_at(const flashc_tensor *t, int64_t off, uint32_t *bits) {
    if (t->dtype == FLASHC_DTYPE_F32) {
        float f;
        memcpy(&f, (const float *)t->data + off, 4);
        memcpy(bits, &f, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const uint16_t *)t->data + off, 2);
    *bits = h;
    return t->dtype == FLASHC_DTYPE_F16 ? flashc_f16_to_f32(h) : flashc_bf16_to_f32(h);
}

/*
 * One output view against the reference (contiguous, in the view's logical order). Rows (dim 1) at or past
 * row_end are not compared (varlen rows outside every sequence). unwritten: the buffer was pre-filled with
 * canaries, so an element still holding them was never written.
 */
/*
 * floor (fp32 only): the size of the terms a gradient is summed from. Where those cancel (a broadcast V makes every
 * dP in a row equal, so dS = P (dP - D) = 0 and dq, dk vanish), the fp64 reference is ~1e-17 and a relative error
 * means nothing: the reference's rms is then taken as at least 1% of floor, so fp32 rounding of O(floor) terms
 * passes while any real error, of the order of the terms, still fails.
 */
NOCOV static void compare_tensor(const item *it, const double *ref, const double *lowp, double rel_tol, double mult,
                                 int64_t row_end, const char *name, const char *call, double floor) {
    const flashc_tensor *t = &it->t;
    const int lp = t->dtype != FLASHC_DTYPE_F32;
    /* Above big the fp32 sums on the way (or the dtype itself) may overflow where fp64 does not: not compared. */
    const double big = t->dtype == FLASHC_DTYPE_F16 ? 32752.0 : 1.0e30;
    const uint32_t canary = t->dtype == FLASHC_DTYPE_F32 ? 0xFFFFFFFFu : 0xFFFFu;
    double num = 0, den = 0, maxabs = 0, lowp_err = 0, worst_x = 0, worst_r = 0, maxref = 0;
    int64_t worst[4] = {-1, -1, -1, -1}, idx = 0;
    int lowp_bad = 0;
    char buf[400];
    for (int64_t a = 0; a < t->shape[0]; a++)
        for (int64_t b = 0; b < t->shape[1]; b++)
            for (int64_t c = 0; c < t->shape[2]; c++)
                for (int64_t d = 0; d < t->shape[3]; d++, idx++) {
                    if (b >= row_end) continue;
                    int64_t off = a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + d * t->stride[3];
                    uint32_t bits;
                    double x = elem_at(t, off, &bits), r = ref[idx];
                    if (it->sole && bits == canary) {
                        snprintf(buf, sizeof buf, "%s: %s[%lld, %lld, %lld, %lld] never written", call, name,
                                 (long long)a, (long long)b, (long long)c, (long long)d);
                        fail("an output element was not written", buf);
                    }
                    if (!isfinite(r) || fabs(r) > big) continue; /* the oracle's own overflow: no yardstick */
                    if (!isfinite(x)) {
                        snprintf(buf, sizeof buf, "%s: %s[%lld, %lld, %lld, %lld] = %g, reference %.9g", call, name,
                                 (long long)a, (long long)b, (long long)c, (long long)d, x, r);
                        fail("a non-finite output where the oracle's is finite", buf);
                    }
                    double e = fabs(x - r);
                    num += e * e;
                    den += r * r;
                    if (fabs(r) > maxref) maxref = fabs(r);
                    if (e > maxabs || worst[0] < 0) {
                        maxabs = e, worst_x = x, worst_r = r;
                        worst[0] = a, worst[1] = b, worst[2] = c, worst[3] = d;
                    }
                    if (lp) {
                        double le = fabs(lowp[idx] - r);
                        if (!isfinite(le)) lowp_bad = 1;
                        else if (le > lowp_err) lowp_err = le;
                    }
                }
    if (lp && lowp_bad) return; /* the naive low-precision algorithm overflows: no yardstick */
    /* (and at least 1e-30: a scale near 2^-149 leaves results in fp32's subnormal range, where one unit is the
     * whole value) */
    const double fl = 0.01 * floor > 1e-30 ? 0.01 * floor : 1e-30;
    const double nref = (double)(idx > 0 ? idx : 1), den_floor = nref * fl * fl;
    if (den < den_floor) den = den_floor;
    double err = lp ? maxabs : (den > 0 ? sqrt(num / den) : maxabs);
    /* low precision: at least one unit in the last place of the largest reference value, since storing an
     * fp32 result in the dtype may round either way (on a handful of elements the naive algorithm's own error can
     * happen to be smaller than that) */
    double ulp = maxref * (t->dtype == FLASHC_DTYPE_BF16 ? 1.0 / 128 : 1.0 / 1024);
    double tol = lp ? (mult * lowp_err > ulp ? mult * lowp_err : ulp) + 1e-5 : rel_tol;
    if (g_verbose) fprintf(stderr, "  oracle %s %s: error %.3g, bound %.3g\n", call, name, err, tol);
    if (!(err <= tol)) {
        snprintf(buf, sizeof buf,
                 "%s: %s %s error %.3g > bound %.3g; worst [%lld, %lld, %lld, %lld]: %.9g, reference %.9g", call,
                 name, lp ? "max abs" : "relative", err, tol, (long long)worst[0], (long long)worst[1],
                 (long long)worst[2], (long long)worst[3], worst_x, worst_r);
        fail("result differs from the fp64 oracle", buf);
    }
}

/* lse (nb, H, rows) contiguous fp32: +inf exactly where the reference is, else within the bound above. */
NOCOV static void compare_lse(const float *lse, int sole, const double *ref, const double *lowp, int64_t nb, int64_t H,
                              int64_t rows, int64_t row_end, double logit_tol, const char *call) {
    double lowp_err = 0;
    if (lowp)
        for (int64_t i = 0; i < nb * H * rows; i++)
            if (i % rows < row_end && isfinite(ref[i])) {
                double le = fabs(lowp[i] - ref[i]);
                if (le > lowp_err || !isfinite(le)) lowp_err = le;
            }
    if (!isfinite(lowp_err)) lowp_err = 0;
    char buf[300];
    for (int64_t i = 0; i < nb * H * rows; i++) {
        if (i % rows >= row_end) continue;
        uint32_t bits;
        memcpy(&bits, lse + i, 4);
        double x = lse[i], r = ref[i];
        if (sole && bits == 0xFFFFFFFFu) {
            snprintf(buf, sizeof buf, "%s: lse[%lld] never written", call, (long long)i);
            fail("an output element was not written", buf);
        }
        double tol = 1e-5 * (1 + fabs(r)) + logit_tol + 2 * lowp_err;
        int ok = isinf(r) ? (isinf(x) && x > 0) : (isfinite(x) && fabs(x - r) <= tol);
        if (!ok) {
            snprintf(buf, sizeof buf, "%s: lse[%lld] (head-major row %lld) = %.9g, reference %.9g, bound %.3g", call,
                     (long long)i, (long long)(i % rows), x, r, tol);
            fail("lse differs from the fp64 oracle", buf);
        }
    }
}

static double *dalloc(size_t n) {
    double *p = malloc((n ? n : 1) * sizeof(double));
    if (!p) fail("harness out of memory", NULL);
    return p;
}

/* The logit bound L of the header comment, or -1 when the case is not compared (non-finite data or slopes). */
static double logit_bound(const state *s, const flashc_params *p, const flashc_tensor *q, const flashc_tensor *k) {
    if (s->c.fill & 1) return -1;
    double D = (double)q->shape[3];
    double scale = p->softmax_scale == 0.0f ? 1.0 / sqrt(D) : fabs((double)p->softmax_scale);
    double L = scale * D;
    if (p->alibi_slopes) {
        double m = 0;
        for (size_t i = 0; i < s->alibi_n; i++) {
            if (!isfinite(s->alibi_mem[i])) return -1;
            if (fabs(s->alibi_mem[i]) > m) m = fabs(s->alibi_mem[i]);
        }
        /* the largest ALiBi distance: with positions |q_position - k_position| further */
        double dist = (double)(q->shape[1] + k->shape[1]);
        if (p->positions) dist += fabs((double)p->q_position - (double)p->k_position);
        L += m * dist;
    }
    return isfinite(L) ? L : -1;
}

/* The largest |element| a view addresses (finite ones; the oracle is not run on non-finite inputs). */
NOCOV static double view_maxabs(const flashc_tensor *t) {
    double m = 0;
    uint32_t bits;
    for (int64_t a = 0; a < t->shape[0]; a++)
        for (int64_t b = 0; b < t->shape[1]; b++)
            for (int64_t c = 0; c < t->shape[2]; c++)
                for (int64_t d = 0; d < t->shape[3]; d++) {
                    const double x = fabs(elem_at(t, a * t->stride[0] + b * t->stride[1] + c * t->stride[2] +
                                                         d * t->stride[3], &bits));
                    if (x > m) m = x;
                }
    return m;
}

/* After a successful call of op: the oracle on the same views, parameters and (for the backward) dout. */
static void oracle_check(state *s, int op, const flashc_params *p, float *lse) {
    const flashc_tensor *q = &s->it[TQ].t, *k = &s->it[TK].t, *v = &s->it[TV].t;
    double L = logit_bound(s, p, q, k);
    if (L < 0 || L > LOGIT_CAP) return; /* dropout too: the oracle applies the same keep bits (dropout.h) */
    const double eps = 1.0 / 16777216.0;
    flashc_problem pb;
    flashc_status st = flashc_problem_build(NULL, op ? FLASHC_OP_BACKWARD : FLASHC_OP_FORWARD, q, k, v, p, &s->it[TO].t,
                                            lse, op ? &s->it[TDO].t : NULL, op ? &s->it[TDQ].t : NULL,
                                            op ? &s->it[TDK].t : NULL, op ? &s->it[TDV].t : NULL, &pb);
    if (st != FLASHC_STATUS_OK) fail("the oracle's problem_build refuses what the call accepted", flashc_context_last_error(NULL));
    const flashc_dtype dt = q->dtype;
    const int lp = dt != FLASHC_DTYPE_F32;
    const int64_t nb = pb.varlen ? 1 : pb.B, rows_q = pb.varlen ? pb.total_q : pb.Nq, rows_k = pb.varlen ? pb.total_k : pb.Nk;
    const int64_t end_q = pb.varlen ? pb.cu_q[pb.B] : rows_q, end_k = pb.varlen ? pb.cu_k[pb.B] : rows_k;
    const size_t nq_el = (size_t)(nb * rows_q * pb.H * pb.D), nk_el = (size_t)(nb * rows_k * pb.Hkv * pb.D);
    if (op == 0) {
        size_t nl = (size_t)(nb * pb.H * rows_q);
        double *ro = dalloc(nq_el), *rl = dalloc(nl), *lo = lp ? dalloc(nq_el) : NULL, *ll = lp ? dalloc(nl) : NULL;
        if (flashc_ref_forward(&pb, FLASHC_DTYPE_F32, ro, rl) || (lp && flashc_ref_forward(&pb, dt, lo, ll)))
            fail("the oracle failed (memory)", NULL);
        double rel = 4 * eps * L > 1e-5 ? 4 * eps * L : 1e-5;
        compare_tensor(&s->it[TO], ro, lo, rel, 2.0, end_q, "out", "forward", 0.0);
        if (lse) compare_lse(lse, s->it[TLSE].sole, rl, ll, nb, pb.H, rows_q, end_q, 4 * eps * L, "forward");
        free(ro), free(rl), free(lo), free(ll);
        g_st.cmp_fwd++;
    } else {
        double *r[3] = {dalloc(nq_el), dalloc(nk_el), dalloc(nk_el)}, *l[3] = {NULL, NULL, NULL};
        if (lp) l[0] = dalloc(nq_el), l[1] = dalloc(nk_el), l[2] = dalloc(nk_el);
        if (flashc_ref_backward(&pb, FLASHC_DTYPE_F32, r[0], r[1], r[2]) ||
            (lp && flashc_ref_backward(&pb, dt, l[0], l[1], l[2])))
            fail("the oracle failed (memory)", NULL);
        double rel = 16 * eps * L > 1e-4 ? 16 * eps * L : 1e-4;
        /* The terms' sizes: dq = scale sum_j dS_ij k_j and dk = scale sum_i dS_ij q_i, dS ~ dO . V summed over D;
         * dv = sum_i P_ij dO_i. */
        const double mq = view_maxabs(q), mk = view_maxabs(k), mv = view_maxabs(v), mo = view_maxabs(&s->it[TDO].t);
        const double dp = mo * mv * (double)pb.D * fabs((double)pb.scale);
        /* dP = dO . V and D_i = dO . O in fp32: beyond ~1e30 they may overflow to inf - inf = NaN where fp64 does not
         * (values of 1e21 reach that): the fp32 range, not an error; such cases are not compared. */
        const double mout = view_maxabs(&s->it[TO].t);
        if (mo * (mv > mout ? mv : mout) * (double)pb.D > 1e30) {
            for (int i = 0; i < 3; i++) free(r[i]), free(l[i]);
            return;
        }
        /* Low precision: 4x the naive algorithm's error, not the case table's 3x. The backward reads the stored
         * 16-bit O for D_i = rowsum(dO o O), as flash-attn does; at random corners (D 1, a few keys, ALiBi) that
         * rounding alone reached 3.3x (seed 5, case 6312: f16 dk 3.9e-4 against a naive 1.2e-4, 3 units of 0.13). */
        compare_tensor(&s->it[TDQ], r[0], l[0], rel, 4.0, end_q, "dq", "backward", dp * mk);
        compare_tensor(&s->it[TDK], r[1], l[1], rel, 4.0, end_k, "dk", "backward", dp * mq);
        compare_tensor(&s->it[TDV], r[2], l[2], rel, 4.0, end_k, "dv", "backward", mo);
        for (int i = 0; i < 3; i++) free(r[i]), free(l[i]);
        g_st.cmp_bwd++;
    }
}

/* Workspace for a data call: NULL (the library allocates) only when it is within WS_CAP; otherwise a buffer the
 * front must refuse as too small. Guarded like every buffer (freed with the case). */
static void *make_workspace(uint8_t mode, int64_t extra, size_t need, int need_known, size_t *bytes) {
    *bytes = 0;
    if (!need_known) {
        /* the query failed, so the call fails the same checks before any workspace is looked at */
        if ((mode & 7) == 0) return NULL;
        *bytes = 64;
        return galloc(64, 0);
    }
    if (need > WS_CAP) {
        *bytes = 64;
        return galloc(64, 0);
    }
    switch (mode & 7) {
    case 0:
    case 6: return NULL;
    case 1: /* exact */
    case 7: *bytes = need; return galloc(need, 0);
    case 2: { /* one byte short (or more) */
        size_t short_by = 1 + (size_t)((uint64_t)extra % 64);
        *bytes = need > short_by ? need - short_by : 0;
        return galloc(*bytes, 0);
    }
    case 3: /* larger */
        *bytes = need + (size_t)((uint64_t)extra % 4096);
        return galloc(*bytes, 0);
    case 4: /* misaligned */
        *bytes = need;
        return galloc(need, 1 + (size_t)((uint64_t)extra % 63));
    case 5: /* non-NULL, 0 bytes declared */
        return galloc(1, 0);
    }
    return NULL;
}

static void misc_calls(const fcase *c) {
    flashc_context_t x = NULL;
    const flashc_backend asked = (flashc_backend)(int)(c->misc_int % 5 - 1);
    flashc_status st = flashc_context_create(&x, asked, (int)(c->misc_int % 3) - 1);
    check_status("context_create(odd)", st, NULL);
    if (st == FLASHC_STATUS_OK) {
        /* AUTO and CUDA give a CUDA context where a GPU is present (the GPU machine runs this test too). */
        const flashc_backend got = flashc_context_backend(x);
        const int cuda_ok = got == FLASHC_BACKEND_CUDA && asked != FLASHC_BACKEND_CPU &&
                            flashc_device_count(FLASHC_BACKEND_CUDA) > 0;
        if (got != FLASHC_BACKEND_CPU && !cuda_ok) fail("context backend", NULL);
        flashc_context_destroy(x);
    } else if (x) {
        fail("failed context_create left *ctx set", NULL);
    }
    check_status("context_create(NULL)", flashc_context_create(NULL, FLASHC_BACKEND_CPU, 0), NULL);
    (void)flashc_status_string((flashc_status)(int)c->misc_int);
    (void)flashc_dtype_name((flashc_dtype)(int)c->misc_int);
    (void)flashc_backend_name((flashc_backend)(int)c->misc_int);
    (void)flashc_backend_compiled((flashc_backend)(int)c->misc_int);
    (void)flashc_device_count((flashc_backend)(int)(c->misc_int % 4));
    (void)flashc_version();
    /* the contiguous-view helper, on the fuzzed dims */
    flashc_tensor tc = flashc_tensor_contiguous(NULL, (flashc_dtype)(int)(c->misc_int % 4), c->B, c->Nq, c->H, c->D);
    if (tc.shape[0] != c->B || tc.shape[3] != c->D || tc.stride[3] != 1) fail("tensor_contiguous", NULL);
    (void)flashc_cpu_features();
    if (c->misc & 2) {
        size_t len = (size_t)((uint64_t)c->misc_int % 300);
        char *buf = len ? malloc(len) : NULL;
        flashc_status s2 = flashc_device_name((flashc_backend)(int)((c->misc >> 2) & 3), (int)(c->misc >> 4) - 1, buf, len);
        check_status("device_name", s2, NULL);
        if (s2 == FLASHC_STATUS_OK && !memchr(buf, 0, len)) fail("device_name not NUL-terminated", NULL);
        free(buf);
    }
}

/* ---- a case whose thread count is huge runs in a child process --------------------------------------------- */

static int run_isolated(const uint8_t *data, size_t size) {
#if FZ_POSIX && !defined(FLASHC_LIBFUZZER)
    size_t len = strlen(g_exe) + 2 * size + 256;
    char *cmd = malloc(len);
    if (!cmd) fail("harness out of memory", NULL);
    int n = snprintf(cmd, len, "'%s' --in-process%s%s --case ", g_exe, g_kernels ? " --kernels " : "",
                     g_kernels ? g_kernels : "");
    for (size_t i = 0; i < size; i++) n += snprintf(cmd + n, len - (size_t)n, "%02x", data[i]);
    snprintf(cmd + n, len - (size_t)n, " 2>&1");
    fflush(stdout);
    fflush(stderr);
    FILE *f = popen(cmd, "r");
    free(cmd);
    if (!f) fail("cannot start a child process", strerror(errno));
    char out[2048];
    size_t got = fread(out, 1, sizeof out - 1, f);
    out[got] = '\0';
    char rest[512];
    while (fread(rest, 1, sizeof rest, f) > 0) {
    }
    int status = pclose(f);
    if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char buf[2300];
        if (status != -1 && WIFSIGNALED(status))
            snprintf(buf, sizeof buf, "killed by signal %d; its output: %s", WTERMSIG(status), out);
        else
            snprintf(buf, sizeof buf, "exit status %d; its output: %s", status == -1 ? -1 : WEXITSTATUS(status), out);
        fail("the case (a huge thread count) ended its process", buf);
    }
    g_st.isolated++;
    return 1;
#else
    (void)data;
    (void)size;
    return 0;
#endif
}

/* ---- one input ---------------------------------------------------------------------------------------------- */

static void run_input(const uint8_t *data, size_t size) {
    static state S;
    state *s = &S;
    memset(s, 0, sizeof *s);
    for (int k = 0; k < NPIN; k++) s->pin_item[k] = -1;
    reader r = {data, size, 0, NULL};
    fcase *c = &s->c;
    decode(&r, c);
    g_pool.p = data + r.i;
    g_pool.n = size > r.i ? size - r.i : 0;
    g_pool.i = 0;
    g_rng = c->seed;
    const int specials_on = c->fill & 1;
    int refused = 0, data_called = 0;
    g_st.cases++;

    if (g_driver && !g_in_process && (int)c->threads > THREADS_SANE && run_isolated(data, size)) return;

    if (c->misc & 1) misc_calls(c);

    flashc_context_t ctx = NULL;
    flashc_status st = flashc_context_create(&ctx, FLASHC_BACKEND_CPU, 0);
    if (st != FLASHC_STATUS_OK || !ctx) fail("context_create(cpu, 0)", flashc_context_last_error(NULL));
    st = flashc_context_set_threads(ctx, (int)c->threads);
    check_status("set_threads", st, ctx);
    if (c->misc & 4) check_status("set_stream", flashc_context_set_stream(ctx, (c->misc & 8) ? (void *)s : NULL), ctx);

    /* ---- params and varlen ---- */
    flashc_params *p = &s->prm;
    *p = flashc_params_default();
    p->softmax_scale = c->scale;
    p->causal = c->causal_sel == 255 ? (int)c->causal_raw : (c->causal_sel & 1);
    p->window_left = c->wl;
    p->window_right = c->wr;
    p->softcap = c->softcap;
    p->dropout_p = c->dropout;
    p->dropout_seed = c->dseed;
    p->dropout_offset = c->doff;
    p->deterministic = c->det == 255 ? -7 : (c->det & 1);
    p->positions = c->pmode == 0 ? 0 : c->pmode == 255 ? -9 : 1;
    p->q_position = (int64_t)c->qpos;
    p->k_position = (int64_t)c->kpos;

    const flashc_dtype common = pick_dtype(c->dsel, c->draw);
    int64_t B = c->B, Nq = c->Nq, Nk = c->Nk;
    const int want_varlen = c->vmode & 1;
    s->cu_ok = 1;
    if (want_varlen) {
        int64_t ns = c->num_seqs;
        p->num_seqs = ns;
        /* Lengths: generated (and then maybe perturbed) or raw. */
        int64_t lenq_cap = c->maxq > 0 && c->maxq <= 190 ? c->maxq : 24;
        int64_t lenk_cap = c->maxk > 0 && c->maxk <= 190 ? c->maxk : 24;
        int64_t entries = ns >= 0 && ns < (int64_t)CAP ? ns + 1 : 0;
        int64_t cq = 0, ck = 0, mq = 0, mk = 0;
        if (ns > 0 && entries > 0 && entries * 4 <= (int64_t)CAP) {
            s->cu_n = 2 * (size_t)entries;
            s->cu_mem = galloc(s->cu_n * sizeof(int32_t), 0);
            int32_t *a = s->cu_mem, *b = s->cu_mem + entries;
            a[0] = b[0] = 0;
            for (int64_t i = 1; i < entries; i++) {
                int64_t lq = pool_u8() % (lenq_cap + 1), lk = pool_u8() % (lenk_cap + 1);
                cq += lq;
                ck += lk;
                if (cq > INT32_MAX / 2) cq = INT32_MAX / 2;
                if (ck > INT32_MAX / 2) ck = INT32_MAX / 2;
                if (lq > mq) mq = lq;
                if (lk > mk) mk = lk;
                a[i] = (int32_t)cq;
                b[i] = (int32_t)ck;
            }
            switch ((c->vmode >> 1) & 3) {
            case 1: /* raw entries */
                for (int64_t i = 0; i < 2 * entries; i++) s->cu_mem[i] = (int32_t)pool_u32();
                break;
            case 2: { /* one entry perturbed */
                int64_t i = pool_u8() % (2 * entries);
                uint8_t m = pool_u8();
                s->cu_mem[i] = m < 64 ? (int32_t)((uint32_t)s->cu_mem[i] + (uint32_t)(int8_t)pool_u8())
                               : m < 128 ? (int32_t)specials[m % 32] : (int32_t)pool_u32();
                break;
            }
            case 3: /* small signed steps */
                for (int64_t i = 1; i < 2 * entries; i++)
                    if (i != entries) s->cu_mem[i] = s->cu_mem[i - 1] + (int8_t)pool_u8() % 8;
                break;
            default: break;
            }
            s->cu_q = a;
            s->cu_k = b;
        } else if (ns <= 0) {
            /* num_seqs <= 0 is refused before cu_seqlens are read */
            s->cu_n = 2;
            s->cu_mem = galloc(2 * sizeof(int32_t), 0);
            s->cu_q = s->cu_mem;
            s->cu_k = s->cu_mem + 1;
        } else {
            /* num_seqs too large for a buffer: queries only (they read no data) */
            s->cu_n = 2;
            s->cu_mem = galloc(2 * sizeof(int32_t), 0);
            s->cu_q = s->cu_mem;
            s->cu_k = s->cu_mem + 1;
            s->cu_ok = 0;
        }
        p->cu_seqlens_q = (c->cu_null & 3) == 1 ? NULL : s->cu_q;
        p->cu_seqlens_k = (c->cu_null & 3) == 2 ? NULL : (c->cu_null & 3) == 3 ? s->cu_q : s->cu_k;
        p->max_seqlen_q = c->maxq ? c->maxq : (mq > 0 ? mq : 1);
        p->max_seqlen_k = c->maxk ? c->maxk : (mk > 0 ? mk : 1);
        B = 1;
        Nq = c->total_q ? c->total_q : (cq > 0 ? cq : 1);
        Nk = c->total_k ? c->total_k : (ck > 0 ? ck : 1);
    }

    /* ---- tensors ---- */
    const int64_t qshape[4] = {B, Nq, c->H, c->D}, kshape[4] = {B, Nk, c->Hkv, c->D};
    for (int i = 0; i < 8; i++) {
        int qlike = i == TQ || i == TO || i == TDO || i == TDQ;
        make_view(&s->it[i], &c->ts[i], qlike ? qshape : kshape, common);
        measure(&s->it[i]);
    }
    /* the library's view of the problem, from what is actually passed */
    const flashc_tensor *q = &s->it[TQ].t, *k = &s->it[TK].t;
    s->varlen = p->cu_seqlens_q && p->cu_seqlens_k;
    const int64_t pB = s->varlen ? p->num_seqs : q->shape[0], pH = q->shape[2];
    const int64_t pNq = s->varlen ? p->max_seqlen_q : q->shape[1], pNk = s->varlen ? p->max_seqlen_k : k->shape[1];
    int data_ok = 1; /* whether every pointer a data call would get is covered (or refused before reading) */

    /* lse: (B, H, Nq) or varlen (H, total_q) floats */
    {
        item *it = &s->it[TLSE];
        memset(it, 0, sizeof *it);
        it->t.dtype = FLASHC_DTYPE_F32;
        it->esz = 4;
        it->present = (c->lmode % 8) != 1;
        it->group = c->lmode >= 200 ? c->lmode % NITEM : -1;
        it->shift = (c->lshift % 8) * 4;
        i128 n = s->varlen ? smul(pH, q->shape[1]) : smul(smul(q->shape[0], pH), q->shape[1]);
        if (n <= 0) n = 4;
        if (n * 4 <= (i128)CAP) {
            it->fits = 1;
            it->pos = (int64_t)n - 1;
        }
        it->t.shape[0] = 1;
        it->t.shape[1] = 1;
        it->t.shape[2] = 1;
        it->t.shape[3] = (int64_t)n;
        it->t.stride[3] = 1;
    }

    /* ---- buffers: one per group of aliased items ---- */
    int gid[NITEM];
    for (int i = 0; i < NITEM; i++) gid[i] = s->it[i].group >= 0 ? s->it[i].group : i;
    for (int g = 0; g < NITEM; g++) {
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        int members = 0;
        for (int i = 0; i < NITEM; i++) {
            item *it = &s->it[i];
            if (gid[i] != g || !it->present || it->want_null || !it->fits) continue;
            int64_t l = it->shift + it->neg * (int64_t)it->esz, h = it->shift + (it->pos + 1) * (int64_t)it->esz;
            if (l < lo) lo = l;
            if (h > hi) hi = h;
            members++;
        }
        if (!members) continue;
        lo = lo >= 0 ? lo / 4 * 4 : -((-lo + 3) / 4 * 4);
        size_t size = (size_t)(hi - lo);
        if (size > 2 * CAP) continue;
        uint8_t *mem = galloc(size, 0);
        s->g[g].mem = mem;
        s->g[g].size = size;
        s->g[g].members = members;
        for (int i = 0; i < NITEM; i++) {
            item *it = &s->it[i];
            if (gid[i] != g || !it->present || it->want_null || !it->fits) continue;
            it->base = mem;
            it->base_size = size;
            it->sole = members == 1;
            it->t.data = mem + (it->shift - lo);
        }
    }
    /* A view over CAP keeps data NULL, which every data call refuses before reading (lse: the forward runs
     * without it, the backward refuses it). */
    /* inputs get values */
    for (int i = 0; i < NITEM; i++)
        if (i == TQ || i == TK || i == TV || i == TDO || i == TO) fill_input(&s->it[i], item_data(s, i), specials_on);
    float *lse = s->it[TLSE].present ? (float *)s->it[TLSE].t.data : NULL;

    /* ---- ALiBi: slopes[b * stride + h] for b < B, h < H ---- */
    s->alibi_ok = 1;
    if (c->amode & 1) {
        int64_t stride = (c->amode & 2) ? pH : c->astride;
        p->alibi_batch_stride = stride;
        i128 a = smul(pB > 1 ? pB - 1 : 0, stride), lo = a < 0 ? a : 0;
        i128 hi = sat((a > 0 ? a : 0) + (pH > 0 ? pH : 1));
        if (pB <= 0 || pH <= 0 || (stride < 0 && (hi - lo) * 4 > (i128)CAP)) { /* refused before reading */
            s->alibi_n = 16;
            s->alibi_mem = galloc(16 * sizeof(float), 0);
            for (int i = 0; i < 16; i++) s->alibi_mem[i] = 0.5f;
        } else if ((hi - lo) * 4 <= (i128)CAP) {
            s->alibi_n = (size_t)(hi - lo);
            s->alibi_mem = galloc(s->alibi_n * sizeof(float), 0);
            for (size_t i = 0; i < s->alibi_n; i++) s->alibi_mem[i] = pool_float(specials_on) * 4.0f;
            s->alibi_lo = (int64_t)(-lo);
        } else {
            s->alibi_n = 16;
            s->alibi_mem = galloc(16 * sizeof(float), 0);
            s->alibi_ok = 0;
        }
        p->alibi_slopes = s->alibi_mem + s->alibi_lo;
    }

    /* ---- block mask: contiguous (bb, bh, ceil(Nq / bq), ceil(Nk / bk)) ---- */
    s->mask_ok = 1;
    if (c->bmode & 1) {
        p->block_mask_q = c->bq;
        p->block_mask_k = c->bk;
        p->block_mask_batch = (c->bmode & 2) ? pB : c->bb;
        p->block_mask_heads = (c->bmode & 4) ? pH : c->bh;
        int valid = p->block_mask_q > 0 && p->block_mask_k > 0 && pNq > 0 && pNk > 0 && pB > 0 && pH > 0 &&
                    (p->block_mask_batch == 1 || p->block_mask_batch == pB) &&
                    (p->block_mask_heads == 1 || p->block_mask_heads == pH);
        i128 n = 0;
        if (valid) {
            i128 nqb = ((i128)pNq + p->block_mask_q - 1) / p->block_mask_q;
            i128 nkb = ((i128)pNk + p->block_mask_k - 1) / p->block_mask_k;
            n = smul(smul(smul(p->block_mask_batch, p->block_mask_heads), nqb), nkb);
        }
        if (valid && n <= (i128)CAP) {
            s->mask_n = (size_t)n;
            s->mask = galloc(s->mask_n, 0);
            int fm = (c->bmode >> 3) & 3;
            for (size_t i = 0; i < (size_t)n; i++) {
                uint8_t b = pool_u8();
                s->mask[i] = fm == 0 ? 1 : fm == 1 ? b : fm == 2 ? (b & 3) == 0 : 0;
            }
        } else {
            s->mask_n = 16;
            s->mask = galloc(16, 0);
            memset(s->mask, 1, 16);
            if (valid) s->mask_ok = 0; /* valid but too large: queries only */
        }
        p->block_mask = s->mask;
    }

    /* ---- parameter arrays inside an output buffer ---- */
    if (c->pin & 7) {
        static const int targets[5] = {TO, TLSE, TDQ, TDK, TDV};
        const size_t bytes[NPIN] = {s->cu_n * 4, s->alibi_n * 4, s->mask_n};
        uint8_t *const src[NPIN] = {(uint8_t *)s->cu_mem, (uint8_t *)s->alibi_mem, s->mask};
        for (int kk = 0; kk < NPIN; kk++) {
            if (!(c->pin >> kk & 1) || !src[kk] || !bytes[kk]) continue;
            int t = targets[((c->pin >> 4) + kk) % 5];
            item *it = &s->it[t];
            if (!it->base || it->base_size < bytes[kk]) continue;
            size_t off = ((size_t)c->pin_off % (it->base_size - bytes[kk] + 1)) & ~(size_t)3;
            s->pin_item[kk] = t;
            s->pin_at[kk] = it->base + off;
            s->pin_bytes[kk] = bytes[kk];
            if (kk == PIN_CU) {
                if (p->cu_seqlens_q) p->cu_seqlens_q = (const int32_t *)(s->pin_at[kk] + ((uint8_t *)p->cu_seqlens_q - src[kk]));
                if (p->cu_seqlens_k) p->cu_seqlens_k = (const int32_t *)(s->pin_at[kk] + ((uint8_t *)p->cu_seqlens_k - src[kk]));
            } else if (kk == PIN_ALIBI && p->alibi_slopes) {
                p->alibi_slopes = (const float *)(s->pin_at[kk] + (size_t)s->alibi_lo * 4);
            } else if (kk == PIN_MASK && p->block_mask) {
                p->block_mask = s->pin_at[kk];
            }
        }
        apply_pins(s);
    }

    const flashc_tensor *tp[8];
    for (int i = 0; i < 8; i++) tp[i] = s->it[i].present ? &s->it[i].t : NULL;
    const flashc_params *pp = c->pnull == 255 ? NULL : p;

    if (g_verbose) print_case(s);

    /* ---- queries ---- */
    flashc_op qop = (c->ops & 0xF0) == 0xF0 ? (flashc_op)((int)(c->ops & 0x0F) - 2) : FLASHC_OP_FORWARD;
    st = flashc_supported(ctx, qop, tp[TQ], tp[TK], tp[TV], pp);
    check_status("supported(fwd)", st, ctx);
    refused |= st != FLASHC_STATUS_OK;
    check_status("supported(bwd)", flashc_supported(ctx, FLASHC_OP_BACKWARD, tp[TQ], tp[TK], tp[TV], pp), ctx);
    const char *kn = flashc_kernel_name(ctx, qop, tp[TQ], tp[TK], tp[TV], pp);
    if (!kn) check_status("kernel_name", FLASHC_STATUS_INVALID_ARGUMENT, ctx);
    size_t fneed = 0, bneed = 0;
    if ((c->ops & 0x0E) == 0x0E)
        check_status("forward_workspace_size(bytes NULL)",
                     flashc_forward_workspace_size(ctx, tp[TQ], tp[TK], tp[TV], pp, NULL), ctx);
    st = flashc_forward_workspace_size(ctx, tp[TQ], tp[TK], tp[TV], pp, &fneed);
    check_status("forward_workspace_size", st, ctx);
    const int fknown = st == FLASHC_STATUS_OK;
    st = flashc_backward_workspace_size(ctx, tp[TQ], tp[TK], tp[TV], pp, &bneed);
    check_status("backward_workspace_size", st, ctx);
    const int bknown = st == FLASHC_STATUS_OK;
    guards_check("queries");

    /* ---- data calls, when their cost is small and every pointer is covered ---- */
    if (s->varlen && !s->cu_ok) data_ok = 0;
    if (p->alibi_slopes && !s->alibi_ok) data_ok = 0;
    if (p->block_mask && !s->mask_ok) data_ok = 0;
    {
        /* varlen work follows the packed rows, not max_seqlen (which may be far above them) */
        double dB = (double)(s->varlen ? 1 : pB), dH = (double)pH, dHkv = (double)k->shape[2],
               dNq = (double)q->shape[1], dNk = (double)k->shape[1], dD = (double)q->shape[3];
        if (tp[TQ] && tp[TK] && dB > 0 && dH > 0 && dHkv > 0 && dNq > 0 && dNk > 0 && dD > 0) {
            double tasks = dB * dH * (dNq / 16 + 1) + dB * dHkv * (dNk / 16 + 1);
            double flops = dB * dH * dNq * dNk * dD;
            if (s->varlen) tasks += (double)pB * (dH + dHkv);
            if (tasks > TASK_CAP || flops > FLOP_CAP) data_ok = 0;
        }
    }
    if (!data_ok) goto done;

    {
        data_called = 1;
        size_t wsb = 0;
        void *ws = make_workspace(c->fws, c->fws_extra, fneed, fknown, &wsb);
        snapshot sn;
        snap_before(s, 0, &sn);
        st = flashc_forward(ctx, tp[TQ], tp[TK], tp[TV], pp, tp[TO], lse, ws, wsb);
        check_status("forward", st, ctx);
        check_after(s, 0, &sn, st, "forward");
        const int fwd_ok = st == FLASHC_STATUS_OK;
        refused = !fwd_ok;
        if (fwd_ok) {
            g_st.fwd_ok++;
            oracle_check(s, 0, p, lse);
        }

        if (c->ops & 1) {
            /* backward inputs: out and lse from the forward, or fresh values */
            int own = fwd_ok && !(c->lfill & 1);
            if (!own) {
                fill_input(&s->it[TO], item_data(s, TO), specials_on);
                if (lse && s->it[TLSE].fits)
                    for (int64_t i = 0; i <= s->it[TLSE].pos; i++) {
                        float f = (c->lfill & 2) ? pool_float(1) * 8.0f : pool_float(0) + 3.0f;
                        memcpy((uint8_t *)lse + 4 * i, &f, 4);
                    }
            }
            void *bws = make_workspace(c->bws, c->bws_extra, bneed, bknown, &wsb);
            snap_before(s, 1, &sn);
            st = flashc_backward(ctx, tp[TQ], tp[TK], tp[TV], tp[TO], tp[TDO], lse, pp, tp[TDQ], tp[TDK], tp[TDV], bws,
                                 wsb);
            check_status("backward", st, ctx);
            check_after(s, 1, &sn, st, "backward");
            refused |= st != FLASHC_STATUS_OK;
            if (st == FLASHC_STATUS_OK && own && pp) oracle_check(s, 1, p, lse);
            if (st == FLASHC_STATUS_OK && pp && p->deterministic == 1) {
                /* a second run gives the same bits */
                uint8_t *first[3] = {NULL, NULL, NULL};
                for (int i = 0; i < 3; i++) {
                    item *it = &s->it[TDQ + i];
                    if (!it->base) continue;
                    first[i] = malloc(it->base_size);
                    if (!first[i]) fail("harness out of memory", NULL);
                    memcpy(first[i], it->base, it->base_size);
                }
                snap_before(s, 1, &sn);
                st = flashc_backward(ctx, tp[TQ], tp[TK], tp[TV], tp[TO], tp[TDO], lse, pp, tp[TDQ], tp[TDK], tp[TDV],
                                     bws, wsb);
                check_status("backward (again)", st, ctx);
                check_after(s, 1, &sn, st, "backward (again)");
                for (int i = 0; i < 3; i++) {
                    item *it = &s->it[TDQ + i];
                    if (first[i] && st == FLASHC_STATUS_OK && memcmp(first[i], it->base, it->base_size) != 0)
                        fail("a deterministic backward gave different bits on a second run", item_names[TDQ + i]);
                    free(first[i]);
                }
            }
        }
    }

done:
    if (refused) g_st.refused++;
    else if (!data_called) g_st.queries_only++;
    else g_st.ok++;
    flashc_context_destroy(ctx);
    for (int i = 0; i < NITEM; i++) free(s->pre[i]), s->pre[i] = NULL;
    gfree_all();
}

#ifdef FLASHC_LIBFUZZER
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    g_verbose = getenv("FUZZ_VERBOSE") != NULL;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    run_input(data, size);
    return 0;
}
#endif

#ifndef FLASHC_LIBFUZZER
/* ---- the generator: one case from (seed, index) ------------------------------------------------------------- */

static uint64_t gstate;
static const char *g_avoid_arg = "99"; /* as passed on to children (99: nothing) */
static uint32_t g_avoid; /* --avoid: hostile mutation kinds (0-17, see gen_case) left out, to look past a known finding */
static uint64_t G(void) { return flashc_rand_u64(&gstate); }
static int64_t below(int64_t n) { return n <= 1 ? 0 : (int64_t)(G() % (uint64_t)n); }
static int chance(int pct) { return below(100) < pct; }

/* Values that break arithmetic: the specials, near-overflow products, and a raw draw. */
static int64_t hostile_int(void) {
    static const int64_t extra[] = {3037000499LL, 3037000500LL, 46341, 65536, 65537, INT64_MAX / 2 + 1,
                                    INT64_MAX - 15, INT64_MAX - 63, (int64_t)1 << 31, ((int64_t)1 << 31) - 1,
                                    (int64_t)1 << 33, 5000, 100000, -3, INT32_MAX - 1};
    switch (below(4)) {
    case 0:
    case 1: return specials[below(32)];
    case 2: return extra[below((int64_t)(sizeof extra / sizeof extra[0]))];
    default: return (int64_t)G() >> below(63);
    }
}
static float hostile_float(void) {
    static const float f[] = {NAN, INFINITY, -INFINITY, 1e30f, FLT_MAX, -FLT_MAX, 1e-45f, 1e-40f, -0.0f, 3e38f,
                              -1.0f, 1e-30f, 100.0f, 1e4f};
    return f[below((int64_t)(sizeof f / sizeof f[0]))];
}

static void gen_case(uint64_t seed, uint64_t index, fcase *c) {
    gstate = seed * 0x9e3779b97f4a7c15ull ^ (index + 1) * 0xd1b54a32d192ed03ull;
    (void)G();
    reader in = {NULL, 0, 0, NULL};
    decode(&in, c); /* every field at its default */
    c->seed = G();
    c->ops = (uint8_t)chance(50);
    c->threads = chance(60) ? 0 : chance(85) ? 1 + below(4) : 8 << below(2);
    c->dsel = (uint8_t)(chance(50) ? 0 : 1 + below(2));
    /* sizes: mostly tiny, so that the library and the oracle take well under a millisecond */
    int cls = (int)below(100);
    int64_t nmax = cls < 70 ? 24 : cls < 95 ? 80 : 190;
    c->Hkv = 1 + below(cls < 70 ? 2 : 3);
    c->H = c->Hkv * (1 + below(3));
    c->B = 1 + below(cls < 95 ? 3 : 2);
    c->Nq = 1 + below(nmax);
    c->Nk = 1 + below(nmax);
    static const int64_t dims[] = {1, 2, 3, 4, 7, 8, 16, 24, 31, 32, 33, 40, 48, 64, 80, 96, 128, 160, 192, 256};
    c->D = cls < 70 ? dims[below(10)] : cls < 95 ? dims[below(15)] : dims[below(20)];
    if (c->D > 80) c->B = 1, c->H = c->Hkv = 1, c->Nq = 1 + below(48);
    if (chance(25)) { /* varlen */
        c->vmode = 1;
        c->num_seqs = 1 + below(5);
        c->maxq = chance(50) ? 0 : 1 + below(nmax);
        c->maxk = chance(50) ? 0 : 1 + below(nmax);
    }
    for (int i = 0; i < 8; i++) {
        tspec *t = &c->ts[i];
        int l = (int)below(10);
        t->layout = (uint8_t)(l < 4 ? 0 : l < 6 ? 1 : l == 6 ? 2 : l == 7 ? 3 : l == 8 ? 5 : 8);
        t->perm = (uint8_t)below(24);
        t->raw_stride[0] = below(31), t->raw_stride[1] = below(15), t->raw_stride[2] = below(7);
        if (t->layout == 8) t->flip = (uint8_t)below(16); /* negative strides on a contiguous layout */
        t->shift = (uint8_t)below(8);
    }
    if (chance(15)) c->ts[TV].group = (uint8_t)(200 + TK); /* k and v in one buffer (overlapping: inputs may) */
    if (chance(10)) c->ts[TK].group = (uint8_t)(200 + TQ);
    c->lmode = (uint8_t)(chance(85) ? 0 : 1);
    c->lshift = (uint8_t)below(8);
    c->lfill = (uint8_t)(chance(90) ? 0 : 1 + 2 * below(2));
    static const float scales[] = {0.125f, 0.5f, 1.0f, 2.0f, -1.0f, 0.3f, 10.0f};
    c->scale = chance(60) ? 0.0f : scales[below(7)];
    c->causal_sel = (uint8_t)chance(30);
    if (chance(20)) c->wl = below(nmax + 2) - 1, c->wr = below(nmax + 2) - 1;
    static const float caps[] = {0.5f, 1.0f, 5.0f, 30.0f, 50.0f};
    if (chance(20)) c->softcap = caps[below(5)];
    if (chance(20)) c->amode = (uint8_t)(1 | 2 * below(2)), c->astride = chance(50) ? 0 : 1 + below(8);
    if (chance(20)) {
        c->bmode = (uint8_t)(1 | (below(2) << 1) | (below(2) << 2) | (below(4) << 3));
        c->bq = 1 + below(40), c->bk = 1 + below(40);
    }
    c->det = (uint8_t)chance(40);
    static const uint8_t wsm[] = {0, 0, 0, 1, 1, 3};
    c->fws = wsm[below(6)], c->bws = wsm[below(6)];
    c->fws_extra = below(256), c->bws_extra = below(256);
    c->misc = (uint8_t)(chance(10) ? G() : 0);
    c->misc_int = below(300);

    if (chance(45)) { /* hostile: 1-3 mutations */
        int n = 1 + (int)below(3);
        for (int m = 0; m < n; m++) {
            tspec *t = &c->ts[below(8)];
            int kind = (int)below(18);
            if (g_avoid >> kind & 1) continue;
            switch (kind) {
            case 0: t->pert = (uint8_t)(200 + below(4)), t->pert_val = hostile_int(); break;
            case 1:
                t->layout = (uint8_t)(4 | (chance(30) ? 8 : 0) | (chance(30) ? 16 : 0));
                for (int d = 0; d < 4; d++) t->raw_stride[d] = chance(60) ? below(141) - 70 : hostile_int();
                t->flip = (uint8_t)below(16), t->zero = (uint8_t)below(16);
                break;
            case 2:
                if (chance(50)) t->dsel = (uint8_t)(224 + below(32)), t->draw = chance(50) ? (uint32_t)(3 + below(5)) : (uint32_t)G();
                else c->dsel = 240, c->draw = (uint32_t)(chance(50) ? (uint32_t)-1 : G());
                break;
            case 3: t->nullsel = (uint8_t)(250 + below(2)); break;
            case 4: /* aliasing: an output with something */
                c->ts[TO + below(5) % 5 == 0 ? TO : TDQ + below(3)].group = (uint8_t)(200 + below(NITEM));
                if (chance(40)) c->lmode = (uint8_t)(200 + below(NITEM) * 1);
                break;
            case 5:
                if (chance(50)) c->wl = hostile_int();
                else c->wr = hostile_int();
                break;
            case 6:
                c->bmode |= 1;
                switch (below(4)) {
                case 0: c->bq = hostile_int(); break;
                case 1: c->bk = hostile_int(); break;
                case 2: c->bb = hostile_int(), c->bmode &= (uint8_t)~2; break;
                default: c->bh = hostile_int(), c->bmode &= (uint8_t)~4; break;
                }
                break;
            case 7:
                c->vmode |= 1;
                switch (below(6)) {
                case 0: c->maxq = hostile_int(); break;
                case 1: c->maxk = hostile_int(); break;
                case 2: c->vmode = (uint8_t)(1 | (1 + below(3)) << 1); break;
                case 3: c->cu_null = (uint8_t)(1 + below(3)); break;
                case 4: c->num_seqs = hostile_int(); break;
                default:
                    if (chance(50)) c->total_q = hostile_int();
                    else c->total_k = 1 + below(200);
                    break;
                }
                break;
            case 8:
                if (chance(50)) c->fws = (uint8_t)(2 + below(4)), c->fws_extra = below(64);
                else c->bws = (uint8_t)(2 + below(4)), c->bws_extra = below(64);
                break;
            case 9:
                if (chance(25)) { /* a huge thread count (runs in a child process) */
                    static const int64_t th[] = {40000, INT32_MAX, 1 << 20, 257, 1000, 65};
                    c->threads = th[below(6)];
                } else {
                    c->threads = chance(50) ? -1 - below(3) : hostile_int();
                }
                break;
            case 10:
                if (chance(50)) c->scale = hostile_float();
                else c->softcap = hostile_float();
                break;
            case 11: c->fill |= 1; break; /* non-finite and huge data, slopes */
            case 12:
                switch (below(5)) {
                case 0: c->dropout = chance(50) ? 0.1f : hostile_float(); break;
                case 1: c->det = 255; break;
                case 2: c->causal_sel = 255, c->causal_raw = (uint32_t)(chance(50) ? 2 : G()); break;
                case 3: c->pnull = 255; break;
                default: c->ops = (uint8_t)(0xF0 | below(16)); break;
                }
                break;
            case 13: /* parameter arrays inside an output */
                c->pin = (uint8_t)((1 + below(7)) | (below(16) << 4)), c->pin_off = (uint32_t)G();
                c->vmode |= (uint8_t)(chance(50) ? 1 : 0);
                if (chance(50)) c->amode |= 1;
                if (chance(50)) c->bmode |= 1;
                break;
            case 14: c->amode |= 1, c->astride = hostile_int(); break;
            case 15:
                switch (below(5)) {
                case 0: c->D = chance(50) ? 257 + below(4) : hostile_int(); break;
                case 1: c->H = 1 + below(7), c->Hkv = 1 + below(4); break;
                case 2: c->B = hostile_int(); break;
                case 3: c->Nq = hostile_int(); break;
                default: c->Hkv = hostile_int(); break;
                }
                break;
            case 16: { /* an output whose strides overlap itself */
                tspec *o = &c->ts[chance(40) ? TO : TDQ + below(3)];
                o->layout = 4;
                for (int d = 0; d < 4; d++) o->raw_stride[d] = below(5);
                break;
            }
            default: c->misc = (uint8_t)G(), c->misc_int = hostile_int(); break;
            }
        }
    }
    /* positions, drawn last so that the fields above come out as they did before positions existed: small ones on
     * either side (multiples of 4 or not, for dropout), or hostile values (the 2^40 bound, 32-bit counters, extremes) */
    if (chance(25)) {
        c->pmode = (uint8_t)(chance(95) ? 1 : 255);
        c->qpos = (uint64_t)(below(600) - 200);
        c->kpos = (uint64_t)(chance(50) ? 4 * (below(150) - 50) : below(600) - 200);
        if (chance(15)) {
            static const int64_t big[] = {((int64_t)1 << 40) - 1, (int64_t)1 << 40, -((int64_t)1 << 40) + 1,
                                          -((int64_t)1 << 40), ((int64_t)1 << 32) - 20, ((int64_t)1 << 34) - 64,
                                          ((int64_t)1 << 29) + 3, INT64_MIN, INT64_MAX};
            if (chance(50)) c->qpos = (uint64_t)(chance(70) ? big[below(9)] : hostile_int());
            else c->kpos = (uint64_t)(chance(70) ? big[below(9)] : hostile_int());
        }
    }
}

/* The case's input bytes: the header, then a pool. */
static size_t encode_case(fcase *c, uint8_t *buf, size_t cap) {
    reader out = {NULL, cap, 0, buf};
    decode(&out, c);
    size_t pool = 64 + (size_t)below(448);
    for (size_t k = 0; k < pool; k++) wr_u8(&out, (uint8_t)G());
    return out.i;
}

/* ---- main ---------------------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int usage(void) {
    fprintf(stderr, "usage: fuzz_api [--seed S] [--seconds T] [--runs N] [--index I] [--kernels generic|avx2|avx512|avx512bf16|amx|all]\n"
                    "                [--avoid K,K,...] [--verbose] [--case HEX_OR_FILE] [--write DIR]\n");
    return 2;
}

static uint8_t *load_case(const char *arg, size_t *n) {
    size_t len = strlen(arg);
    int hex = len > 0 && len % 2 == 0;
    for (size_t i = 0; i < len && hex; i++) hex = strchr("0123456789abcdefABCDEF", arg[i]) != NULL;
    uint8_t *buf;
    if (hex) {
        buf = malloc(len / 2 + 1);
        for (size_t i = 0; buf && i < len / 2; i++) {
            unsigned v;
            sscanf(arg + 2 * i, "%2x", &v);
            buf[i] = (uint8_t)v;
        }
        *n = len / 2;
        return buf;
    }
    FILE *f = fopen(arg, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_api: cannot open %s: %s\n", arg, strerror(errno));
        exit(2);
    }
    size_t capn = 1 << 16;
    buf = malloc(capn);
    *n = buf ? fread(buf, 1, capn, f) : 0;
    fclose(f);
    return buf;
}

/* Without --kernels: one child per kernel set this CPU runs, the time split between them. */
static int run_all_kernels(uint64_t seed, double seconds, uint64_t runs, uint64_t first, int verbose) {
#if FZ_POSIX
    const char *feat = flashc_cpu_features();
    const char *sets[5];
    int n = 0;
    sets[n++] = "generic";
    if (strstr(feat, "avx2")) sets[n++] = "avx2";
    if (strstr(feat, "avx512f")) sets[n++] = "avx512";
    if (flashc_cpu_kernels_by_name("avx512bf16")) sets[n++] = "avx512bf16"; /* built in, and this CPU has it */
    if (flashc_cpu_kernels_by_name("amx")) sets[n++] = "amx";               /* AMX here, or an emulation build */
    stats tot;
    memset(&tot, 0, sizeof tot);
    int failed = 0;
    double t0 = now_s();
    for (int i = 0; i < n; i++) {
        char cmd[1400];
        snprintf(cmd, sizeof cmd,
                 "'%s' --kernels %s --seed %" PRIu64 " --seconds %.3f --runs %" PRIu64 " --index %" PRIu64 "%s",
                 g_exe, sets[i], seed, seconds / n, runs, first, verbose ? " --verbose" : "");
        fflush(stdout);
        FILE *f = popen(cmd, "r");
        if (!f) {
            fprintf(stderr, "fuzz_api: cannot run %s\n", cmd);
            return 1;
        }
        char line[2048];
        while (fgets(line, sizeof line, f)) {
            stats s;
            if (sscanf(line, "@stats %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64,
                       &s.cases, &s.ok, &s.refused, &s.queries_only, &s.cmp_fwd, &s.cmp_bwd, &s.isolated) == 7) {
                tot.cases += s.cases, tot.ok += s.ok, tot.refused += s.refused;
                tot.queries_only += s.queries_only, tot.cmp_fwd += s.cmp_fwd, tot.cmp_bwd += s.cmp_bwd;
                tot.isolated += s.isolated;
                continue;
            }
            fputs(line, stdout);
        }
        int st = pclose(f);
        if (st != 0) failed++;
    }
    printf("fuzz_api: %" PRIu64 " cases (seed %" PRIu64 ", %.1f s, %d kernel sets): %" PRIu64 " ok, %" PRIu64
           " refused with a message, %" PRIu64 " queries only, %" PRIu64 " in a child; %" PRIu64 " forwards and %" PRIu64
           " backwards compared with the oracle; %d failures\n",
           tot.cases, seed, now_s() - t0, n, tot.ok, tot.refused, tot.queries_only, tot.isolated, tot.cmp_fwd,
           tot.cmp_bwd, failed);
    return failed ? 1 : 0;
#else
    (void)seed, (void)seconds, (void)runs, (void)first, (void)verbose;
    return -1;
#endif
}

int main(int argc, char **argv) {
    uint64_t seed = 1, runs = UINT64_MAX, first = 0;
    double seconds = 10;
    const char *case_arg = NULL, *write_dir = NULL;
    int runs_set = 0;
    g_driver = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--verbose")) g_verbose = 1;
        else if (!strcmp(a, "--in-process")) g_in_process = 1;
        else if (!v) return usage();
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 0), i++;
        else if (!strcmp(a, "--seconds")) seconds = strtod(v, NULL), i++;
        else if (!strcmp(a, "--runs")) runs = strtoull(v, NULL, 0), runs_set = 1, i++;
        else if (!strcmp(a, "--index")) first = strtoull(v, NULL, 0), i++;
        else if (!strcmp(a, "--kernels")) g_kernels = v, i++;
        else if (!strcmp(a, "--case")) case_arg = v, i++;
        else if (!strcmp(a, "--write")) write_dir = v, i++;
        else if (!strcmp(a, "--avoid")) { /* comma-separated mutation kinds */
            for (const char *q = v; *q;) {
                long kind = strtol(q, (char **)&q, 10);
                if (kind >= 0 && kind < 32) g_avoid |= 1u << kind;
                g_avoid_arg = v;
                if (*q == ',') q++;
                else if (*q) return usage();
            }
            i++;
        }
        else return usage();
    }
    if (getenv("FUZZ_VERBOSE")) g_verbose = 1;
#if FZ_POSIX
    /* idle OpenMP threads must not spin on cores the library's own threads (and other jobs) share */
    setenv("OMP_WAIT_POLICY", "passive", 0);
#endif
#if FZ_POSIX && defined(__linux__)
    static char exe[1024];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = '\0', g_exe = exe;
    else g_exe = argv[0];
#else
    g_exe = argv[0];
#endif
#if FZ_ASAN
    __sanitizer_set_death_callback(on_sanitizer_death);
#elif FZ_POSIX
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGFPE, on_signal);
    signal(SIGILL, on_signal);
    signal(SIGABRT, on_signal);
#endif
    static uint8_t buf[1 << 16];

    if (write_dir) {
        if (!runs_set) runs = 1000;
        for (uint64_t i = first; i < first + runs; i++) {
            fcase c;
            gen_case(seed, i, &c);
            size_t len = encode_case(&c, buf, sizeof buf);
            char path[1200];
            snprintf(path, sizeof path, "%s/s%" PRIu64 "_%" PRIu64, write_dir, seed, i);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(buf, 1, len, f) != len) {
                fprintf(stderr, "fuzz_api: cannot write %s\n", path);
                return 1;
            }
            fclose(f);
        }
        printf("fuzz_api: wrote %" PRIu64 " inputs to %s\n", runs, write_dir);
        return 0;
    }

    if (!case_arg && !g_kernels && !getenv("FLASHC_CPU_KERNELS") && !g_in_process) {
        int rc = run_all_kernels(seed, seconds, runs, first, g_verbose);
        if (rc >= 0) return rc;
    }
    if (g_kernels && strcmp(g_kernels, "all") != 0) {
#if FZ_POSIX
        setenv("FLASHC_CPU_KERNELS", g_kernels, 1); /* before the first flashc call: read once per process */
#endif
    }
    const char *kset = getenv("FLASHC_CPU_KERNELS");

    if (case_arg) {
        size_t len = 0;
        uint8_t *data = load_case(case_arg, &len);
        snprintf(g_replay, sizeof g_replay, "fuzz_api: replay: %s%s%s --case %s --verbose", g_exe,
                 kset ? " --kernels " : "", kset ? kset : "", strlen(case_arg) < 200 ? case_arg : "<the input>");
        run_input(data, len);
        free(data);
        printf("fuzz_api: the input ran without a finding\n");
        return 0;
    }

    double t0 = now_s();
    uint64_t i = first;
    for (; i - first < runs; i++) {
        if (now_s() - t0 >= seconds) break;
        fcase c;
        gen_case(seed, i, &c);
        size_t len = encode_case(&c, buf, sizeof buf);
        snprintf(g_replay, sizeof g_replay,
                 "fuzz_api: seed %" PRIu64 ", case %" PRIu64 "%s%s; replay: %s --seed %" PRIu64 " --index %" PRIu64
                 " --runs 1 --verbose%s%s%s%s",
                 seed, i, kset ? ", kernels " : "", kset ? kset : "", g_exe, seed, i, kset ? " --kernels " : "",
                 kset ? kset : "", g_avoid ? " --avoid " : "", g_avoid ? g_avoid_arg : "");
        if (g_verbose) fprintf(stderr, "fuzz_api: case %" PRIu64 "\n", i);
        run_input(buf, len);
    }
    g_replay[0] = '\0';
    printf("fuzz_api: %" PRIu64 " cases (seed %" PRIu64 ", %.1f s, kernels %s): %" PRIu64 " ok, %" PRIu64
           " refused with a message, %" PRIu64 " queries only (too large to run), %" PRIu64 " in a child; %" PRIu64
           " forwards and %" PRIu64 " backwards compared with the oracle; 0 failures\n",
           g_st.cases, seed, now_s() - t0, kset ? kset : "default", g_st.ok, g_st.refused, g_st.queries_only,
           g_st.isolated, g_st.cmp_fwd, g_st.cmp_bwd);
    printf("@stats %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", g_st.cases,
           g_st.ok, g_st.refused, g_st.queries_only, g_st.cmp_fwd, g_st.cmp_bwd, g_st.isolated);
    return 0;
}
#endif /* FLASHC_LIBFUZZER */
