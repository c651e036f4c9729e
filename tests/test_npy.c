/*
 * test_npy.c - the .npy reader/writer and the half conversions of the flashc command (tools/npy.c,
 * tools/cli_util.c, compiled in here so the command's own code is what is tested).
 *
 * Round trips every dtype at several ranks with fresh random data; reads headers in the variants NumPy has
 * written over the years; and feeds damaged files (bad magic, truncated at every byte, wrong dtypes, Fortran
 * order, malformed dicts) that must each fail with a message naming the file, never crash.
 */
#define _POSIX_C_SOURCE 200809L

#include "../tools/cli_util.c"
#include "../tools/npy.c"

#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures = 0;

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            failures++;                                                                                      \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);                         \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fputc('\n', stderr);                                                                             \
        }                                                                                                    \
    } while (0)

static uint64_t rng_state;

static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The bytes of a stream, from the start. */
static unsigned char *slurp(FILE *f, size_t *len) {
    fflush(f);
    long end = ftell(f);
    rewind(f);
    unsigned char *buf = (unsigned char *)malloc((size_t)end + 1);
    *len = fread(buf, 1, (size_t)end, f);
    return buf;
}

static FILE *from_bytes(const void *data, size_t len) {
    FILE *f = tmpfile();
    if (!f) {
        fprintf(stderr, "tmpfile failed\n");
        exit(1);
    }
    if (len) fwrite(data, 1, len, f);
    rewind(f);
    return f;
}

/* A file made of a version-1.0 preamble, a header text padded like NumPy's, and data bytes. */
static size_t make_npy(unsigned char *out, int major, const char *dict, size_t align, const void *data,
                       size_t data_len) {
    size_t pre = major == 1 ? 10 : 12, n = strlen(dict);
    size_t hlen = (pre + n + 1 + align - 1) / align * align - pre;
    memcpy(out, "\x93NUMPY", 6);
    out[6] = (unsigned char)major;
    out[7] = 0;
    for (size_t i = 0; i < pre - 8; i++) out[8 + i] = (unsigned char)(hlen >> (8 * i));
    memcpy(out + pre, dict, n);
    memset(out + pre + n, ' ', hlen - n - 1);
    out[pre + hlen - 1] = '\n';
    if (data_len) memcpy(out + pre + hlen, data, data_len);
    return pre + hlen + data_len;
}

/* Reads bytes as a file named "t.npy"; returns the reader's status, message in err. */
static int read_bytes(const void *bytes, size_t len, npy_array *a, char *err, size_t errlen) {
    FILE *f = from_bytes(bytes, len);
    err[0] = '\0';
    int rc = npy_read_stream(f, "t.npy", a, err, errlen);
    fclose(f);
    return rc;
}

static void expect_fail(const void *bytes, size_t len, const char *needle, const char *what) {
    npy_array a;
    char err[512];
    int rc = read_bytes(bytes, len, &a, err, sizeof err);
    CHECK(rc == -1, "%s: accepted a damaged file", what);
    CHECK(a.data == NULL, "%s: data left behind on failure", what);
    CHECK(strncmp(err, "t.npy: ", 7) == 0, "%s: message does not name the file: '%s'", what, err);
    CHECK(!needle || strstr(err, needle), "%s: message '%s' lacks '%s'", what, err, needle);
    if (rc == 0) npy_free(&a);
}

/* ---- round trips ------------------------------------------------------------------------------------------- */

static void test_round_trip(void) {
    static const int64_t shapes[][4] = {{0}, {7}, {3, 5}, {2, 17, 3}, {2, 9, 4, 8}, {1, 0, 4, 8}, {1, 1, 1, 1}};
    static const int ranks[] = {0, 1, 2, 3, 4, 4, 4};
    const flashc_dtype dtypes[3] = {FLASHC_DTYPE_F32, FLASHC_DTYPE_F16, FLASHC_DTYPE_BF16};
    for (int t = 0; t < 3; t++) {
        for (size_t s = 0; s < sizeof ranks / sizeof ranks[0]; s++) {
            int nd = ranks[s];
            size_t count = 1, esize = t == 0 ? 4 : 2;
            for (int i = 0; i < nd; i++) count *= (size_t)shapes[s][i];
            unsigned char *data = (unsigned char *)malloc(count * esize + 1);
            for (size_t i = 0; i < count * esize; i++) data[i] = (unsigned char)rnd();

            FILE *f = tmpfile();
            char err[512];
            int rc = npy_write_stream(f, "w.npy", dtypes[t], nd, shapes[s], data, err, sizeof err);
            CHECK(rc == 0, "write %s rank %d: %s", npy_descr(dtypes[t]), nd, err);
            size_t len;
            unsigned char *bytes = slurp(f, &len);
            fclose(f);
            /* the data starts on a 64-byte boundary, after a header that ends in a newline */
            CHECK(len >= count * esize && (len - count * esize) % 64 == 0, "header of %zu bytes not aligned",
                  len - count * esize);
            CHECK(bytes[len - count * esize - 1] == '\n', "header does not end in a newline");
            CHECK(bytes[6] == 1 && bytes[7] == 0, "not a version 1.0 file");

            npy_array a;
            rc = read_bytes(bytes, len, &a, err, sizeof err);
            CHECK(rc == 0, "read back %s rank %d: %s", npy_descr(dtypes[t]), nd, err);
            if (rc == 0) {
                CHECK(a.dtype == dtypes[t], "dtype %d read back as %d", (int)dtypes[t], (int)a.dtype);
                CHECK(a.ndim == nd, "rank %d read back as %d", nd, a.ndim);
                for (int i = 0; i < nd && i < a.ndim; i++)
                    CHECK(a.shape[i] == shapes[s][i], "dim %d: %lld vs %lld", i, (long long)a.shape[i],
                          (long long)shapes[s][i]);
                CHECK(a.count == count, "count %zu vs %zu", a.count, count);
                CHECK(count == 0 || memcmp(a.data, data, count * esize) == 0, "data differs after a round trip");
                npy_free(&a);
            }
            /* every proper prefix of a valid file is a truncated file */
            for (size_t cut = 0; cut < len; cut++) {
                npy_array b;
                int r = read_bytes(bytes, cut, &b, err, sizeof err);
                CHECK(r == -1, "prefix of %zu of %zu bytes accepted", cut, len);
                CHECK(strncmp(err, "t.npy: ", 7) == 0, "prefix %zu: message '%s'", cut, err);
                if (r == 0) npy_free(&b);
            }
            free(bytes);
            free(data);
        }
    }
}

/* The dict text exactly as numpy.lib.format writes it, so numpy and other readers accept our files. */
static void test_header_text(void) {
    const int64_t s2[2] = {2, 3}, s1[1] = {5};
    const float data[6] = {1, 2, 3, 4, 5, 6};
    struct {
        int nd;
        const int64_t *shape;
        flashc_dtype dtype;
        const char *dict;
    } cases[] = {
        {2, s2, FLASHC_DTYPE_F32, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"},
        {1, s1, FLASHC_DTYPE_F16, "{'descr': '<f2', 'fortran_order': False, 'shape': (5,), }"},
        {0, s1, FLASHC_DTYPE_BF16, "{'descr': '<u2', 'fortran_order': False, 'shape': (), }"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        FILE *f = tmpfile();
        char err[256];
        CHECK(npy_write_stream(f, "h.npy", cases[c].dtype, cases[c].nd, cases[c].shape, data, err, sizeof err) == 0,
              "%s", err);
        size_t len;
        unsigned char *bytes = slurp(f, &len);
        fclose(f);
        size_t hlen = (size_t)bytes[8] | (size_t)bytes[9] << 8, n = strlen(cases[c].dict);
        CHECK(memcmp(bytes, "\x93NUMPY\x01\x00", 8) == 0, "magic");
        CHECK(hlen >= n + 1 && memcmp(bytes + 10, cases[c].dict, n) == 0, "dict %zu: got '%.*s'", c, (int)n,
              (const char *)bytes + 10);
        for (size_t i = 10 + n; i + 1 < 10 + hlen; i++) CHECK(bytes[i] == ' ', "padding byte %zu is %d", i, bytes[i]);
        free(bytes);
    }
}

/* Headers NumPy (and others) have written: version 2.0 and 3.0, 16-byte alignment of old NumPy, keys in any
 * order, double quotes, Python 2 long suffixes, no trailing comma, a 1-element shape without spaces. */
static void test_header_variants(void) {
    float data[12];
    for (int i = 0; i < 12; i++) data[i] = (float)rnd() / 1e19f;
    struct {
        int major;
        size_t align;
        const char *dict;
        int ndim;
        int64_t shape[3];
    } cases[] = {
        {2, 64, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 2, {3, 4}},
        {3, 64, "{'descr': '<f4', 'fortran_order': False, 'shape': (12,), }", 1, {12}},
        {1, 16, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2, 3), }", 3, {2, 2, 3}},
        {1, 64, "{'shape': (4, 3), 'fortran_order': False, 'descr': '<f4'}", 2, {4, 3}},
        {1, 64, "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (6, 2)}", 2, {6, 2}},
        {1, 64, "{'descr': '<f4', 'fortran_order': False, 'shape': (3L, 4L), }", 2, {3, 4}},
        {1, 64, "{'descr':'<f4','fortran_order':False,'shape':(12,)}", 1, {12}},
        {1, 64, "{ 'descr' : '<f4' , 'fortran_order' : False , 'shape' : ( 2 , 6 ) , }", 2, {2, 6}},
    };
    unsigned char buf[512];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t len = make_npy(buf, cases[c].major, cases[c].dict, cases[c].align, data, sizeof data);
        npy_array a;
        char err[512];
        int rc = read_bytes(buf, len, &a, err, sizeof err);
        CHECK(rc == 0, "variant %zu (%s): %s", c, cases[c].dict, err);
        if (rc != 0) continue;
        CHECK(a.dtype == FLASHC_DTYPE_F32 && a.ndim == cases[c].ndim, "variant %zu: dtype/rank", c);
        for (int i = 0; i < a.ndim && i < cases[c].ndim; i++)
            CHECK(a.shape[i] == cases[c].shape[i], "variant %zu dim %d", c, i);
        CHECK(a.count == 12 && memcmp(a.data, data, sizeof data) == 0, "variant %zu: data", c);
        npy_free(&a);
    }
}

static void test_bad_files(void) {
    unsigned char buf[512];
    const float data[4] = {1, 2, 3, 4};
    size_t len;

    expect_fail("", 0, "bad magic", "empty file");
    expect_fail("\x93NUMP", 5, "bad magic", "short magic");
    static const char zip[] = "PK\x03\x04 this is a zip";
    expect_fail(zip, sizeof zip - 1, "bad magic", "npz given as npy");
    len = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", 64, data, sizeof data);
    buf[0] = 'X';
    expect_fail(buf, len, "bad magic", "wrong first byte");

    len = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", 64, data, sizeof data);
    buf[6] = 4;
    expect_fail(buf, len, "version 4.0", "future version");
    buf[6] = 1;
    buf[7] = 1;
    expect_fail(buf, len, "version 1.1", "minor version");
    buf[7] = 0;
    buf[8] = buf[9] = 0;
    expect_fail(buf, len, "header length", "zero header length");
    buf[8] = buf[9] = 0xff;
    expect_fail(buf, len, "truncated", "header length past the end");

    static const struct {
        const char *dict, *needle, *what;
    } bad[] = {
        {"{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", "unsupported dtype '<f8'", "float64"},
        {"{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", "unsupported dtype '<i4'", "int32"},
        {"{'descr': '|u1', 'fortran_order': False, 'shape': (16,), }", "unsupported dtype '|u1'", "uint8"},
        {"{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", "unsupported dtype", "complex64"},
        {"{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", "big-endian", "big-endian f4"},
        {"{'descr': '>f2', 'fortran_order': False, 'shape': (8,), }", "big-endian", "big-endian f2"},
        {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", "structured", "structured"},
        {"{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", "Fortran", "fortran order"},
        {"{'descr': '<f4', 'fortran_order': 0, 'shape': (4,), }", "fortran_order", "fortran_order not a bool"},
        {"{'descr': '<f4', 'fortran_order': False}", "missing 'shape'", "no shape"},
        {"{'fortran_order': False, 'shape': (4,)}", "missing 'descr'", "no descr"},
        {"{'descr': '<f4', 'shape': (4,)}", "missing 'fortran_order'", "no fortran_order"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'extra': 1}", "'extra'", "extra key"},
        {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,)}", "repeated", "repeated key"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [4], }", "not a tuple", "shape as a list"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (-4,), }", "shape", "negative size"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 2), }", "shape", "missing comma"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", "shape", "not a number"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", "overflow", "huge size"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } junk", "after the dict", "trailing text"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4,), ", "bad header", "unterminated dict"},
        {"['descr', '<f4']", "not a dict", "not a dict"},
        {"{'descr: '<f4', 'fortran_order': False, 'shape': (4,), }", "bad header", "broken quote"},
        {"{descr: '<f4', 'fortran_order': False, 'shape': (4,), }", "malformed key", "bare key"},
        {"{'descr' '<f4', 'fortran_order': False, 'shape': (4,), }", "missing ':'", "no colon"},
        {"{'descr': '<f4' 'fortran_order': False, 'shape': (4,), }", "expected ','", "no comma"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (4000000000, 4000000000, 4000000000), }", "too large",
         "element count overflows"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        len = make_npy(buf, 1, bad[i].dict, 64, data, sizeof data);
        expect_fail(buf, len, bad[i].needle, bad[i].what);
    }

    /* a header that promises more data than the file holds */
    len = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", 64, data, sizeof data);
    expect_fail(buf, len, "truncated data", "one element short");
    len = make_npy(buf, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3, 4), }", 64, data, 7);
    expect_fail(buf, len, "truncated data", "odd bytes");

    /* trailing bytes after the data are what np.save leaves when arrays are appended: accepted */
    len = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 64, data, sizeof data);
    npy_array a;
    char err[512];
    CHECK(read_bytes(buf, len, &a, err, sizeof err) == 0 && a.count == 3, "trailing data refused: %s", err);
    if (a.data) npy_free(&a);

    /* random damage anywhere in a valid header never crashes, and success still means a consistent array */
    size_t good = make_npy(buf, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 4), }", 64, data,
                           sizeof data);
    for (int trial = 0; trial < 4000; trial++) {
        unsigned char dmg[512];
        memcpy(dmg, buf, good);
        size_t pos = rnd() % 74;
        dmg[pos] = (unsigned char)rnd();
        int r = read_bytes(dmg, good, &a, err, sizeof err);
        if (r == 0) {
            size_t count = 1;
            for (int d = 0; d < a.ndim; d++) count *= (size_t)a.shape[d];
            CHECK(a.count == count && count * (a.dtype == FLASHC_DTYPE_F32 ? 4 : 2) <= sizeof data,
                  "damaged header at %zu gave an inconsistent array", pos);
            npy_free(&a);
        } else {
            CHECK(strncmp(err, "t.npy: ", 7) == 0, "damaged header at %zu: message '%s'", pos, err);
        }
    }
}

static void test_paths(void) {
    npy_array a;
    char err[512];
    CHECK(npy_read("/nonexistent-flashc-dir/q.npy", &a, err, sizeof err) == -1, "missing file accepted");
    CHECK(strstr(err, "/nonexistent-flashc-dir/q.npy: cannot open") != NULL, "message '%s'", err);
    const int64_t shape[1] = {2};
    const float data[2] = {1, 2};
    CHECK(npy_write("/nonexistent-flashc-dir/o.npy", FLASHC_DTYPE_F32, 1, shape, data, err, sizeof err) == -1,
          "write into a missing directory succeeded");
    CHECK(strstr(err, "/nonexistent-flashc-dir/o.npy: cannot create") != NULL, "message '%s'", err);
}

/* ---- half conversions --------------------------------------------------------------------------------------- */

static int same_bits_or_both_nan(float a, float b) {
    if (a != a || b != b) return a != a && b != b;
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y;
}

/* The nearest representable value wins; a tie goes to the even code. Checked against neighbours, not a copy of
 * the conversion. */
static int is_nearest(float x, uint16_t h, float (*widen)(uint16_t)) {
    double v = widen(h), e = fabs(v - (double)x);
    uint16_t mag = h & 0x7fffu;
    for (int dir = -1; dir <= 1; dir += 2) {
        if ((dir < 0 && mag == 0)) continue;
        uint16_t nb = (uint16_t)((h & 0x8000u) | (uint16_t)(mag + dir));
        double w = widen(nb);
        if (w != w || isinf(w)) continue;
        double en = fabs(w - (double)x);
        if (en < e || (en == e && (h & 1u))) return 0;
    }
    if (mag == 0) { /* the other side of zero */
        double w = widen((uint16_t)((h ^ 0x8000u) | 1u));
        if (fabs(w - (double)x) < e) return 0;
    }
    return 1;
}

static void test_half(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float a = cli_f16_to_f32((uint16_t)h), b = flashc_f16_to_f32((uint16_t)h);
        CHECK(same_bits_or_both_nan(a, b), "f16 %04x widens to %a, library %a", h, a, b);
        if (a == a) CHECK(cli_f32_to_f16(a) == h, "f16 %04x does not survive a round trip", h);
        else CHECK((cli_f32_to_f16(a) & 0x7c00u) == 0x7c00u && (cli_f32_to_f16(a) & 0x3ffu), "NaN %04x", h);
        float c = cli_bf16_to_f32((uint16_t)h);
        if (c == c) CHECK(cli_f32_to_bf16(c) == h, "bf16 %04x does not survive a round trip", h);
    }
    for (int i = 0; i < 200000; i++) {
        uint32_t bits = (uint32_t)rnd();
        /* half of the draws inside the f16 range, where rounding matters */
        if (i & 1) bits = (bits & 0x80000000u) | (0x33000000u + (bits % (0x47800000u - 0x33000000u)));
        float x;
        memcpy(&x, &bits, 4);
        if (x != x) continue;
        uint16_t h = cli_f32_to_f16(x), hb = cli_f32_to_bf16(x);
        CHECK(h == flashc_f32_to_f16(x), "f16(%a): %04x, library %04x", x, h, flashc_f32_to_f16(x));
        CHECK(hb == flashc_f32_to_bf16(x), "bf16(%a): %04x, library %04x", x, hb, flashc_f32_to_bf16(x));
        if (fabsf(x) < 65504.0f) CHECK(is_nearest(x, h, cli_f16_to_f32), "f16(%a) = %04x is not nearest", x, h);
        if (isfinite(cli_bf16_to_f32(hb)))
            CHECK(is_nearest(x, hb, cli_bf16_to_f32), "bf16(%a) = %04x is not nearest", x, hb);
    }
    CHECK(cli_f32_to_f16(65520.0f) == 0x7c00u && cli_f32_to_f16(65519.0f) == 0x7bffu, "f16 overflow edge");
    CHECK(cli_f32_to_f16(0x1p-25f) == 0 && cli_f32_to_f16(0x1.000002p-25f) == 1, "f16 underflow edge");
}

int main(void) {
    rng_state = (uint64_t)time(NULL) ^ 0x6e707921ull;
    printf("test_npy: seed %llu\n", (unsigned long long)rng_state);
    test_round_trip();
    test_header_text();
    test_header_variants();
    test_bad_files();
    test_paths();
    test_half();
    if (failures) {
        printf("test_npy: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_npy: all checks passed\n");
    return 0;
}
