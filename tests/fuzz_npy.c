/*
 * fuzz_npy.c - a seeded random driver for the .npy reader of the flashc command (tools/npy.c, compiled in here
 * as tests/test_npy.c does, so the command's own code is what is tested).
 *
 * Each case builds a valid .npy file (dtype '<f4', '<f2' or '<u2', rank 0-4, format 1.0, 2.0 or 3.0, keys in
 * any order, NumPy's padding or an older 16-byte one, quotes and trailing commas as NumPy versions wrote them),
 * or one written by npy_write_stream, then in about two cases of three mutates it: header bytes, shape numbers
 * (huge, overflowing, negative, a 64-byte file claiming 128 GiB), dtype strings, fortran_order, the header length
 * and version bytes, the magic, padding, truncation at any point, appended garbage. The bytes are read back from
 * memory (fmemopen; otherwise a temporary file, and now and then through npy_read on a real file).
 *
 * Checks (a violation prints the seed, the case index and a replay command, and exits 1):
 *   - the reader returns 0 or -1; on -1 the message is "<file name>: <why>" and nothing is left in the array;
 *   - an unmutated file (or one with bytes appended after its data) is read back with its dtype, shape and data;
 *   - a file that is read holds count = prod(shape) elements, all of them inside the file;
 *   - the reader never asks malloc/realloc for more than the file could hold: its length plus the largest header
 *     the reader takes (1 MiB), plus, for a stream without a size (fmemopen, standing in for a pipe), the piece
 *     the reader grows such a stream by (NPY_READ_PIECE); a larger request is refused here (NULL) and reported,
 *     as is an "out of memory" message.
 * Files go through one regular temporary file (the reader can compare the header's promise with the file
 * size), through fmemopen (no size) and, one case in 50, through npy_read on a path.
 *
 *   fuzz_npy [--seed S] [--seconds T] [--runs N] [--index I] [--verbose] [--case HEX_OR_FILE]
 */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#  define _POSIX_C_SOURCE 200809L
#endif

#include <stdlib.h>

#include "../tools/cli_util.c"

/* The reader's allocations go through fz_malloc, which knows how long the file being read is. */
static size_t g_alloc_cap; /* the most one allocation may ask for while the current file is read */
static size_t g_biggest_alloc;
static void *fz_malloc(size_t n) {
    if (n > g_biggest_alloc) g_biggest_alloc = n;
    if (n > g_alloc_cap) return NULL; /* never really ask for it: it is the finding */
    return malloc(n);
}
static void *fz_realloc(void *p, size_t n) {
    if (n > g_biggest_alloc) g_biggest_alloc = n;
    if (n > g_alloc_cap) return NULL;
    return realloc(p, n);
}
#define malloc(n) fz_malloc(n)
#define realloc(p, n) fz_realloc(p, n)
#include "../tools/npy.c"
#undef malloc
#undef realloc

/* A stream without a size (a pipe; fmemopen here) is read in pieces of this size, when the reader has them. */
#ifdef NPY_READ_PIECE
#  define FZ_PIECE ((size_t)NPY_READ_PIECE)
#else
#  define FZ_PIECE ((size_t)0)
#endif

#include "ref/testkit.h" /* flashc_rand_u64 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__unix__) || defined(__APPLE__)
#  include <unistd.h>
#  define FZ_POSIX 1
#else
#  define FZ_POSIX 0
#endif

#define MAX_FILE 8192

static int g_verbose;
static char g_replay[512];
static char g_tmp_path[512];

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_npy: CHECK FAILED: %s (%s)\n", what, detail ? detail : "");
    if (g_replay[0]) fprintf(stderr, "%s\n", g_replay);
    fflush(stdout);
    fflush(stderr);
    if (g_tmp_path[0]) remove(g_tmp_path);
    _Exit(1);
}

static uint64_t gstate;
static uint64_t G(void) { return flashc_rand_u64(&gstate); }
static size_t below(size_t n) { return n <= 1 ? 0 : (size_t)(G() % n); }
static int chance(int pct) { return (int)below(100) < pct; }

/* ---- the file of a case ------------------------------------------------------------------------------------- */

typedef struct npcase {
    uint8_t bytes[MAX_FILE];
    size_t len;
    /* what an unmutated read must give */
    int exact;                /* 1: unmutated (appended bytes allowed): the read must succeed and match */
    int may_succeed_appended; /* bytes were appended only */
    flashc_dtype dtype;
    int ndim;
    int64_t shape[4];
    size_t data_off, data_len;
    char what[256];           /* the mutations, for reports */
} npcase;

static void note(npcase *c, const char *s) {
    size_t n = strlen(c->what);
    snprintf(c->what + n, sizeof c->what - n, "%s%s", n ? ", " : "", s);
}

/* A valid file by hand: the dict with its keys in some order, padded, in format major.0. */
static void build_valid(npcase *c) {
    static const char *descr[3] = {"<f4", "<f2", "<u2"};
    c->dtype = (flashc_dtype)below(3);
    c->ndim = chance(10) ? 0 : 1 + (int)below(4);
    size_t count = 1, esz = c->dtype == FLASHC_DTYPE_F32 ? 4 : 2;
    for (int i = 0; i < c->ndim; i++) {
        c->shape[i] = chance(5) ? 0 : 1 + (int64_t)below(chance(80) ? 6 : 40);
        count *= (size_t)c->shape[i];
    }
    while (count * esz > MAX_FILE - 512) { /* keep it in the buffer */
        for (int i = 0; i < c->ndim; i++) c->shape[i] = (c->shape[i] + 1) / 2;
        count = 1;
        for (int i = 0; i < c->ndim; i++) count *= (size_t)c->shape[i];
    }
    if (chance(20)) { /* the library's own writer */
        FILE *f = tmpfile();
        if (!f) fail("tmpfile", strerror(errno));
        uint8_t data[MAX_FILE];
        for (size_t i = 0; i < count * esz; i++) data[i] = (uint8_t)G();
        char err[256];
        if (npy_write_stream(f, "w.npy", c->dtype, c->ndim, c->shape, data, err, sizeof err) != 0) fail("npy_write_stream", err);
        long end = ftell(f);
        rewind(f);
        c->len = fread(c->bytes, 1, (size_t)end, f);
        fclose(f);
        c->data_len = count * esz;
        c->data_off = c->len - c->data_len;
        c->exact = 1;
        note(c, "written by npy_write_stream");
        return;
    }
    char q = chance(90) ? '\'' : '"';
    char shape[160];
    size_t n = 0;
    n += (size_t)snprintf(shape + n, sizeof shape - n, "(");
    for (int i = 0; i < c->ndim; i++)
        n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld%s", i ? ", " : "", (long long)c->shape[i],
                              chance(5) ? "L" : "");
    n += (size_t)snprintf(shape + n, sizeof shape - n, c->ndim == 1 ? ",)" : ")");
    char items[3][200];
    snprintf(items[0], sizeof items[0], "%cdescr%c: %c%s%c", q, q, q, descr[c->dtype], q);
    snprintf(items[1], sizeof items[1], "%cfortran_order%c: False", q, q);
    snprintf(items[2], sizeof items[2], "%cshape%c: %s", q, q, shape);
    int order[3] = {0, 1, 2};
    if (chance(30))
        for (int i = 2; i > 0; i--) {
            int j = (int)below((size_t)i + 1), t = order[i];
            order[i] = order[j], order[j] = t;
        }
    char dict[700];
    snprintf(dict, sizeof dict, "{%s, %s, %s%s}", items[order[0]], items[order[1]], items[order[2]],
             chance(70) ? ", " : "");
    int major = chance(70) ? 1 : chance(50) ? 2 : 3;
    size_t pre = major == 1 ? 10 : 12, dl = strlen(dict), align = chance(85) ? 64 : 16;
    size_t hlen = (pre + dl + 1 + align - 1) / align * align - pre;
    memcpy(c->bytes, "\x93NUMPY", 6);
    c->bytes[6] = (uint8_t)major;
    c->bytes[7] = 0;
    for (size_t i = 0; i < pre - 8; i++) c->bytes[8 + i] = (uint8_t)(hlen >> (8 * i));
    memcpy(c->bytes + pre, dict, dl);
    memset(c->bytes + pre + dl, ' ', hlen - dl - 1);
    c->bytes[pre + hlen - 1] = '\n';
    c->data_off = pre + hlen;
    c->data_len = count * esz;
    for (size_t i = 0; i < c->data_len; i++) c->bytes[c->data_off + i] = (uint8_t)G();
    c->len = c->data_off + c->data_len;
    c->exact = 1;
}

/* Replaces the first occurrence of needle in the header with repl (the file shifts; the length field is kept). */
static int replace_in_header(npcase *c, const char *needle, const char *repl) {
    size_t hdr_end = c->data_off < c->len ? c->data_off : c->len, nl = strlen(needle), rl = strlen(repl);
    for (size_t i = 0; i + nl <= hdr_end; i++)
        if (memcmp(c->bytes + i, needle, nl) == 0) {
            if (c->len - nl + rl > MAX_FILE) return 0;
            memmove(c->bytes + i + rl, c->bytes + i + nl, c->len - i - nl);
            memcpy(c->bytes + i, repl, rl);
            c->len = c->len - nl + rl;
            if (rl != nl) c->data_off = c->data_off + rl - nl; /* now wrong w.r.t. the length field: mutated */
            return 1;
        }
    return 0;
}

static void mutate(npcase *c) {
    int n = 1 + (int)below(3);
    char buf[200];
    for (int m = 0; m < n; m++) {
        switch (below(12)) {
        case 0: { /* header bytes */
            size_t hdr = c->data_off < c->len ? c->data_off : c->len;
            static const char chars[] = "{}()[],:'\" \n\t\r0123456789LTrueFalse<>|fuibc\x93\x00\xff-+.eE";
            size_t k = 1 + below(4);
            for (size_t i = 0; i < k && hdr; i++)
                c->bytes[below(hdr)] = chance(50) ? (uint8_t)chars[below(sizeof chars - 1)] : (uint8_t)G();
            note(c, "header bytes");
            break;
        }
        case 1: { /* a shape number */
            static const char *huge[] = {"34359738368", "137438953472", "9223372036854775807", "9223372036854775808",
                                         "99999999999999999999999", "18446744073709551615", "4294967296",
                                         "4611686018427387904", "2305843009213693952", "-1", "1e3", "0x10", "",
                                         "3037000500", "65536, 65536, 65536, 65536", "1152921504606846976"};
            const char *h = huge[below(sizeof huge / sizeof huge[0])];
            snprintf(buf, sizeof buf, "'shape': (%s%s", h, chance(50) ? "," : ", 2,");
            if (replace_in_header(c, "'shape': (", buf)) note(c, "shape number");
            break;
        }
        case 2: { /* the dtype */
            static const char *d[] = {"'>f4'", "'<f8'", "'|u1'", "'<f2 '", "''", "'<i4'", "'f4'", "'<F4'",
                                      "[('a', '<f4')]", "'<u2\\x00'", "'<c8'", "'=f4'", "'<f4", "<f4'", "'<U2'"};
            const char *from = c->dtype == FLASHC_DTYPE_F32 ? "'<f4'" : c->dtype == FLASHC_DTYPE_F16 ? "'<f2'" : "'<u2'";
            if (replace_in_header(c, from, d[below(sizeof d / sizeof d[0])])) note(c, "dtype");
            break;
        }
        case 3: {
            static const char *f[] = {"True", "false", "0", "None", "Fals", "False False"};
            if (replace_in_header(c, "False", f[below(sizeof f / sizeof f[0])])) note(c, "fortran_order");
            break;
        }
        case 4: { /* the header length field */
            size_t pre = c->bytes[6] == 1 ? 10 : 12, w = pre - 8;
            static const uint32_t v[] = {0, 1, 0xffff, 0xffffffffu, 0x100000, 0x100001, 70000};
            uint32_t x = chance(50) ? v[below(7)] : (uint32_t)G();
            if (chance(50)) x = (uint32_t)((c->data_off - pre) + below(9) - 4);
            for (size_t i = 0; i < w; i++) c->bytes[8 + i] = (uint8_t)(x >> (8 * i));
            note(c, "header length");
            break;
        }
        case 5:
            c->bytes[6 + below(2)] = chance(50) ? (uint8_t)below(5) : (uint8_t)G();
            note(c, "version");
            break;
        case 6:
            c->bytes[below(6)] ^= (uint8_t)(1 + below(255));
            note(c, "magic");
            break;
        case 7: { /* padding */
            static const uint8_t p[] = {'\t', '\n', '\r', 0, 'x', '}'};
            size_t hdr = c->data_off < c->len ? c->data_off : c->len;
            for (size_t i = 10; i < hdr; i++)
                if (c->bytes[i] == ' ' && chance(30)) c->bytes[i] = p[below(6)];
            if (chance(30) && hdr) c->bytes[hdr - 1] = ' ';
            note(c, "padding");
            break;
        }
        case 8: /* truncation */
            c->len = below(c->len + 1);
            note(c, "truncated");
            break;
        case 9: { /* appended bytes */
            size_t k = below(200);
            if (c->len + k > MAX_FILE) k = MAX_FILE - c->len;
            for (size_t i = 0; i < k; i++) c->bytes[c->len + i] = (uint8_t)G();
            c->len += k;
            note(c, "appended");
            if (c->exact && n == 1) c->may_succeed_appended = 1;
            break;
        }
        case 10: { /* many dims */
            char dims[700] = "'shape': (";
            size_t k = 30 + below(8);
            for (size_t i = 0; i < k; i++) strcat(dims, "1, ");
            if (replace_in_header(c, "'shape': (", dims)) note(c, "many dims");
            break;
        }
        default: { /* a 64-byte file claiming 128 GiB, in a header of the right length */
            static const char *d[] = {"<f4", "<f2", "<u2"};
            const char *sh[] = {"(34359738368,)", "(131072, 262144)", "(4, 8589934592)", "(9223372036854775807,)",
                                "(2147483648, 2147483648)", "(1, 2, 3, 4611686018427387904)"};
            char dict[200];
            int dl = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                              d[below(3)], sh[below(6)]);
            size_t hlen = ((size_t)(10 + dl + 1) + 63) / 64 * 64 - 10;
            memcpy(c->bytes, "\x93NUMPY\x01\x00", 8);
            c->bytes[8] = (uint8_t)hlen, c->bytes[9] = (uint8_t)(hlen >> 8);
            memcpy(c->bytes + 10, dict, (size_t)dl);
            memset(c->bytes + 10 + dl, ' ', hlen - (size_t)dl - 1);
            c->bytes[10 + hlen - 1] = '\n';
            size_t tail = below(65);
            for (size_t i = 0; i < tail; i++) c->bytes[10 + hlen + i] = (uint8_t)G();
            c->len = 10 + hlen + tail;
            note(c, "huge claimed size");
            break;
        }
        }
    }
    if (!c->may_succeed_appended) c->exact = 0;
}

static void gen_case(uint64_t seed, uint64_t index, npcase *c) {
    memset(c, 0, sizeof *c);
    gstate = seed * 0x9e3779b97f4a7c15ull ^ (index + 1) * 0xd1b54a32d192ed03ull;
    (void)G();
    build_valid(c);
    if (chance(65)) mutate(c);
}

/* ---- one read ------------------------------------------------------------------------------------------------ */

typedef struct stats {
    uint64_t cases, exact_ok, other_ok, refused;
} stats;
static stats g_st;

static FILE *g_tmpf; /* one regular file, rewritten for each case */

/* The bytes as a stream: a regular file (*sized = 1), or fmemopen's stream that has no size. */
static FILE *open_bytes(const uint8_t *b, size_t n, int memory, int *sized) {
#if FZ_POSIX
    if (memory && n) {
        *sized = 0;
        return fmemopen((void *)b, n, "rb");
    }
    if (!g_tmpf) g_tmpf = tmpfile();
    if (!g_tmpf || ftruncate(fileno(g_tmpf), 0) != 0) fail("cannot truncate the temporary file", strerror(errno));
    rewind(g_tmpf);
    if (n && fwrite(b, 1, n, g_tmpf) != n) fail("cannot write the temporary file", strerror(errno));
    fflush(g_tmpf);
    rewind(g_tmpf);
    *sized = 1;
    return g_tmpf;
#else
    (void)memory;
    FILE *f = tmpfile();
    if (f && n) fwrite(b, 1, n, f);
    if (f) rewind(f);
    *sized = 1;
    return f;
#endif
}

static void run_case(const npcase *c, int via_path, int memory) {
    const char *name = "fz.npy";
    npy_array a;
    char err[512];
    err[0] = '\0';
    memset(&a, 0x5a, sizeof a);
    int sized = 1;
    g_alloc_cap = c->len + ((size_t)1 << 20) + 64 + (memory ? FZ_PIECE : 0);
    g_biggest_alloc = 0;
    int rc;
    if (via_path && FZ_POSIX) {
        FILE *f = fopen(g_tmp_path, "wb");
        if (!f || (c->len && fwrite(c->bytes, 1, c->len, f) != c->len)) fail("cannot write a temporary file", g_tmp_path);
        fclose(f);
        name = g_tmp_path;
        rc = npy_read(g_tmp_path, &a, err, sizeof err);
    } else {
        FILE *f = open_bytes(c->bytes, c->len, memory, &sized);
        if (!f) fail("cannot open the bytes as a stream", strerror(errno));
        rc = npy_read_stream(f, name, &a, err, sizeof err);
        if (f != g_tmpf) fclose(f);
    }
    if (g_verbose) fprintf(stderr, "  %zu bytes (%s): rc %d \"%s\"\n", c->len, c->what[0] ? c->what : "valid", rc, err);
    char buf[900];
    snprintf(buf, sizeof buf, "%zu-byte %s (%s); reader said: %s", c->len,
             via_path ? "file by path" : sized ? "regular file" : "stream without a size", c->what[0] ? c->what : "valid",
             rc ? err : "ok");
    if (g_biggest_alloc > g_alloc_cap) {
        char b2[1000];
        snprintf(b2, sizeof b2, "asked for %zu bytes; %s", g_biggest_alloc, buf);
        fail("the reader allocates more than the file could hold", b2);
    }
    if (rc != 0 && rc != -1) fail("status neither 0 nor -1", buf);
    if (rc == -1) {
        size_t nl = strlen(name);
        if (strncmp(err, name, nl) != 0 || strncmp(err + nl, ": ", 2) != 0 || !err[nl + 2])
            fail("a failure without a message naming the file", buf);
        if (strstr(err, "out of memory")) fail("an allocation failure (the size was not checked against the file)", buf);
        if (a.data || a.count) fail("a failed read left data in the array", buf);
        if (c->exact && !c->may_succeed_appended) fail("a valid file was refused", buf);
        g_st.refused++;
        return;
    }
    /* read: the elements are inside the file */
    size_t esz = a.dtype == FLASHC_DTYPE_F32 ? 4 : 2, count = 1;
    if (a.dtype != FLASHC_DTYPE_F32 && a.dtype != FLASHC_DTYPE_F16 && a.dtype != FLASHC_DTYPE_BF16) fail("unknown dtype read", buf);
    if (a.ndim < 0 || a.ndim > NPY_MAX_NDIM) fail("rank out of range", buf);
    for (int i = 0; i < a.ndim; i++) {
        if (a.shape[i] < 0) fail("a negative size was read", buf);
        count *= (size_t)a.shape[i];
    }
    if (count != a.count) fail("count is not the product of the shape", buf);
    if (count * esz > c->len) fail("more data read than the file holds", buf);
    if (count && !a.data) fail("no data for a non-empty array", buf);
    if (c->exact) {
        if (a.dtype != c->dtype || a.ndim != c->ndim) fail("dtype or rank read back wrong", buf);
        for (int i = 0; i < c->ndim; i++)
            if (a.shape[i] != c->shape[i]) fail("shape read back wrong", buf);
        if (count * esz != c->data_len || (count && memcmp(a.data, c->bytes + c->data_off, c->data_len) != 0))
            fail("data read back wrong", buf);
        g_st.exact_ok++;
    } else {
        g_st.other_ok++;
    }
    npy_free(&a);
}

/* ---- main ---------------------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int usage(void) {
    fprintf(stderr, "usage: fuzz_npy [--seed S] [--seconds T] [--runs N] [--index I] [--verbose] [--case HEX_OR_FILE]\n");
    return 2;
}

int main(int argc, char **argv) {
    uint64_t seed = 1, runs = UINT64_MAX, first = 0;
    double seconds = 10;
    const char *case_arg = NULL;
    (void)&fz_realloc; /* a reader without realloc leaves it unused */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--verbose")) g_verbose = 1;
        else if (!v) return usage();
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 0), i++;
        else if (!strcmp(a, "--seconds")) seconds = strtod(v, NULL), i++;
        else if (!strcmp(a, "--runs")) runs = strtoull(v, NULL, 0), i++;
        else if (!strcmp(a, "--index")) first = strtoull(v, NULL, 0), i++;
        else if (!strcmp(a, "--case")) case_arg = v, i++;
        else if (!strcmp(a, "--kernels")) i++; /* accepted for symmetry with fuzz_api; no kernels here */
        else return usage();
    }
    const char *tmp = getenv("TMPDIR");
#if FZ_POSIX
    snprintf(g_tmp_path, sizeof g_tmp_path, "%s/fuzz_npy_%ld.npy", tmp && *tmp ? tmp : "/tmp", (long)getpid());
#else
    (void)tmp;
    snprintf(g_tmp_path, sizeof g_tmp_path, "fuzz_npy.npy");
#endif
    static npcase c;
    if (case_arg) { /* the raw bytes of a file, as hex or a path: only the generic checks apply */
        memset(&c, 0, sizeof c);
        size_t len = strlen(case_arg);
        int hex = len % 2 == 0;
        for (size_t i = 0; i < len && hex; i++) hex = strchr("0123456789abcdefABCDEF", case_arg[i]) != NULL;
        if (hex) {
            for (size_t i = 0; i < len / 2 && i < MAX_FILE; i++) {
                unsigned x;
                sscanf(case_arg + 2 * i, "%2x", &x);
                c.bytes[i] = (uint8_t)x;
            }
            c.len = len / 2 < MAX_FILE ? len / 2 : MAX_FILE;
        } else {
            FILE *f = fopen(case_arg, "rb");
            if (!f) return fprintf(stderr, "fuzz_npy: cannot open %s\n", case_arg), 2;
            c.len = fread(c.bytes, 1, MAX_FILE, f);
            fclose(f);
        }
        snprintf(c.what, sizeof c.what, "replayed input");
        g_verbose = 1;
        run_case(&c, 0, 0);
        run_case(&c, 0, 1);
        printf("fuzz_npy: the input ran without a finding\n");
        return 0;
    }
    double t0 = now_s();
    uint64_t i = first;
    for (; i - first < runs; i++) {
        if (now_s() - t0 >= seconds) break;
        gen_case(seed, i, &c);
        snprintf(g_replay, sizeof g_replay,
                 "fuzz_npy: seed %" PRIu64 ", case %" PRIu64 "; replay: %s --seed %" PRIu64 " --index %" PRIu64
                 " --runs 1 --verbose",
                 seed, i, argv[0], seed, i);
        if (g_verbose) fprintf(stderr, "fuzz_npy: case %" PRIu64 "\n", i);
        g_st.cases++;
        run_case(&c, (i % 50) == 49, (i % 4) == 1);
    }
    remove(g_tmp_path);
    if (g_tmpf) fclose(g_tmpf);
    printf("fuzz_npy: %" PRIu64 " cases (seed %" PRIu64 ", %.1f s): %" PRIu64 " valid files read back exactly, %" PRIu64
           " damaged files read, %" PRIu64 " refused with a message, 0 failures\n",
           g_st.cases, seed, now_s() - t0, g_st.exact_ok, g_st.other_ok, g_st.refused);
    return 0;
}
