/*
 * npy.c - the .npy reader and writer behind `flashc run` (format: numpy.lib.format, versions 1.0-3.0).
 *
 * File layout: the magic "\x93NUMPY", a major and minor version byte, the header length (uint16 little-endian
 * in 1.0, uint32 in 2.0 and 3.0), then a Python dict literal such as
 *   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 * padded with spaces and a final newline so the data starts on a 64-byte boundary, then the raw elements.
 * The header is parsed strictly (exactly those three keys, nothing after the dict but padding) because a file
 * that does not look like NumPy's own output is more likely corrupt than creative.
 */
#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
/* NumPy itself refuses headers over 10000 bytes unless told otherwise; leave room but stop absurd sizes. */
#define NPY_MAX_HEADER (1u << 20)
#define NPY_ALIGN 64

static int npy_fail(char *err, size_t errlen, const char *name, const char *fmt, ...) {
    if (err && errlen) {
        int n = snprintf(err, errlen, "%s: ", name ? name : "(npy)");
        if (n < 0) n = 0;
        if ((size_t)n < errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
            va_end(ap);
        }
    }
    return -1;
}

static size_t npy_elem_size(flashc_dtype t) { return t == FLASHC_DTYPE_F32 ? 4 : 2; }

const char *npy_descr(flashc_dtype dtype) {
    switch (dtype) {
    case FLASHC_DTYPE_F32: return "<f4";
    case FLASHC_DTYPE_F16: return "<f2";
    case FLASHC_DTYPE_BF16: return "<u2";
    }
    return "?";
}

/* .npy data is little-endian; on a big-endian host the elements are swapped on the way in and out. */
static int npy_host_is_big_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 0;
}

static void npy_swap(void *data, size_t count, size_t size) {
    unsigned char *p = (unsigned char *)data;
    for (size_t i = 0; i < count; i++, p += size) {
        for (size_t a = 0, b = size - 1; a < b; a++, b--) {
            unsigned char t = p[a];
            p[a] = p[b];
            p[b] = t;
        }
    }
}

/* ---- header parser ---------------------------------------------------------------------------------------- */

typedef struct npy_cursor {
    const char *p, *end;
} npy_cursor;

static void npy_skip_ws(npy_cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int npy_eat(npy_cursor *c, char ch) {
    npy_skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A quoted Python string without escapes (descr and key names never need them). */
static int npy_string(npy_cursor *c, char *out, size_t outlen) {
    npy_skip_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return -1;
    char quote = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != quote) {
        if (*c->p == '\\' || n + 1 >= outlen) return -1;
        out[n++] = *c->p++;
    }
    if (c->p >= c->end) return -1;
    c->p++;
    out[n] = '\0';
    return 0;
}

static int npy_word(npy_cursor *c, const char *word) {
    size_t n = strlen(word);
    npy_skip_ws(c);
    if ((size_t)(c->end - c->p) >= n && memcmp(c->p, word, n) == 0) {
        c->p += n;
        return 1;
    }
    return 0;
}

/* A shape tuple: (), (n,), (n, m), ... Python 2 files may carry an L suffix on each number. */
static int npy_shape(npy_cursor *c, int64_t *shape, int *ndim, const char *name, char *err, size_t errlen) {
    *ndim = 0;
    if (!npy_eat(c, '(')) return npy_fail(err, errlen, name, "bad header: 'shape' is not a tuple");
    for (;;) {
        npy_skip_ws(c);
        if (npy_eat(c, ')')) return 0;
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return npy_fail(err, errlen, name, "bad header: 'shape' holds something other than sizes");
        int64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            int digit = *c->p++ - '0';
            if (v > (INT64_MAX - digit) / 10) return npy_fail(err, errlen, name, "bad header: a size overflows");
            v = v * 10 + digit;
        }
        if (c->p < c->end && (*c->p == 'L' || *c->p == 'l')) c->p++;
        if (*ndim >= NPY_MAX_NDIM)
            return npy_fail(err, errlen, name, "bad header: more than %d dimensions", NPY_MAX_NDIM);
        shape[(*ndim)++] = v;
        if (npy_eat(c, ',')) continue;
        if (npy_eat(c, ')')) return 0;
        return npy_fail(err, errlen, name, "bad header: malformed 'shape' tuple");
    }
}

static int npy_parse_descr(const char *descr, flashc_dtype *dtype, const char *name, char *err, size_t errlen) {
    if (strcmp(descr, "<f4") == 0) *dtype = FLASHC_DTYPE_F32;
    else if (strcmp(descr, "<f2") == 0) *dtype = FLASHC_DTYPE_F16;
    else if (strcmp(descr, "<u2") == 0) *dtype = FLASHC_DTYPE_BF16;
    else if (descr[0] == '>' && (strcmp(descr + 1, "f4") == 0 || strcmp(descr + 1, "f2") == 0 ||
                                 strcmp(descr + 1, "u2") == 0))
        return npy_fail(err, errlen, name,
                        "big-endian dtype '%s' is not supported; save it with arr.astype('<%s')", descr,
                        descr + 1);
    else
        return npy_fail(err, errlen, name,
                        "unsupported dtype '%s' (flashc reads '<f4' float32, '<f2' float16, and '<u2' holding "
                        "bfloat16 bits)",
                        descr);
    return 0;
}

static int npy_parse_header(const char *h, size_t len, npy_array *a, const char *name, char *err, size_t errlen) {
    npy_cursor c = {h, h + len};
    int seen_descr = 0, seen_order = 0, seen_shape = 0;
    if (!npy_eat(&c, '{')) return npy_fail(err, errlen, name, "bad header: not a dict");
    for (;;) {
        if (npy_eat(&c, '}')) break;
        char key[32];
        if (npy_string(&c, key, sizeof key) != 0) return npy_fail(err, errlen, name, "bad header: malformed key");
        if (!npy_eat(&c, ':')) return npy_fail(err, errlen, name, "bad header: missing ':' after '%s'", key);
        if (strcmp(key, "descr") == 0 && !seen_descr) {
            char descr[64];
            npy_skip_ws(&c);
            if (c.p < c.end && *c.p == '[')
                return npy_fail(err, errlen, name, "structured dtypes are not supported");
            if (npy_string(&c, descr, sizeof descr) != 0)
                return npy_fail(err, errlen, name, "bad header: malformed 'descr'");
            if (npy_parse_descr(descr, &a->dtype, name, err, errlen) != 0) return -1;
            seen_descr = 1;
        } else if (strcmp(key, "fortran_order") == 0 && !seen_order) {
            if (npy_word(&c, "True"))
                return npy_fail(err, errlen, name,
                                "Fortran-ordered arrays are not supported; save np.ascontiguousarray(arr)");
            if (!npy_word(&c, "False"))
                return npy_fail(err, errlen, name, "bad header: 'fortran_order' is not True or False");
            seen_order = 1;
        } else if (strcmp(key, "shape") == 0 && !seen_shape) {
            if (npy_shape(&c, a->shape, &a->ndim, name, err, errlen) != 0) return -1;
            seen_shape = 1;
        } else {
            return npy_fail(err, errlen, name, "bad header: unexpected or repeated key '%s'", key);
        }
        if (npy_eat(&c, ',')) continue;
        if (npy_eat(&c, '}')) break;
        return npy_fail(err, errlen, name, "bad header: expected ',' or '}' after '%s'", key);
    }
    npy_skip_ws(&c);
    if (c.p != c.end) return npy_fail(err, errlen, name, "bad header: text after the dict");
    if (!seen_descr || !seen_order || !seen_shape)
        return npy_fail(err, errlen, name, "bad header: missing '%s'",
                        !seen_descr ? "descr" : !seen_order ? "fortran_order" : "shape");
    return 0;
}

/* ---- reading ---------------------------------------------------------------------------------------------- */

void npy_free(npy_array *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

int npy_read_stream(FILE *f, const char *name, npy_array *a, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    unsigned char pre[NPY_MAGIC_LEN + 2 + 4];
    size_t got = fread(pre, 1, NPY_MAGIC_LEN + 2, f);
    if (got < NPY_MAGIC_LEN || memcmp(pre, NPY_MAGIC, NPY_MAGIC_LEN) != 0)
        return npy_fail(err, errlen, name, "not a NumPy .npy file (bad magic)");
    if (got < NPY_MAGIC_LEN + 2) return npy_fail(err, errlen, name, "truncated header");
    unsigned major = pre[NPY_MAGIC_LEN], minor = pre[NPY_MAGIC_LEN + 1];
    if (major < 1 || major > 3 || minor != 0)
        return npy_fail(err, errlen, name, "unsupported .npy format version %u.%u", major, minor);
    size_t lenbytes = major == 1 ? 2 : 4;
    if (fread(pre + NPY_MAGIC_LEN + 2, 1, lenbytes, f) != lenbytes)
        return npy_fail(err, errlen, name, "truncated header");
    const unsigned char *lp = pre + NPY_MAGIC_LEN + 2;
    size_t hlen = (size_t)lp[0] | (size_t)lp[1] << 8;
    if (lenbytes == 4) hlen |= (size_t)lp[2] << 16 | (size_t)lp[3] << 24;
    if (hlen == 0 || hlen > NPY_MAX_HEADER)
        return npy_fail(err, errlen, name, "bad header: implausible header length %zu", hlen);

    char *h = (char *)malloc(hlen);
    if (!h) return npy_fail(err, errlen, name, "out of memory reading the header");
    if (fread(h, 1, hlen, f) != hlen) {
        free(h);
        return npy_fail(err, errlen, name, "truncated header");
    }
    int rc = npy_parse_header(h, hlen, a, name, err, errlen);
    free(h);
    if (rc != 0) {
        memset(a, 0, sizeof *a);
        return -1;
    }

    size_t esize = npy_elem_size(a->dtype), count = 1;
    for (int i = 0; i < a->ndim; i++) {
        if (a->shape[i] != 0 && count > SIZE_MAX / esize / (uint64_t)a->shape[i]) {
            memset(a, 0, sizeof *a);
            return npy_fail(err, errlen, name, "bad header: the array is too large for this machine");
        }
        count *= (size_t)a->shape[i];
    }
    size_t bytes = count * esize;
    a->count = count;
    a->data = malloc(bytes ? bytes : 1);
    if (!a->data) {
        memset(a, 0, sizeof *a);
        return npy_fail(err, errlen, name, "out of memory (%zu bytes of data)", bytes);
    }
    size_t have = fread(a->data, 1, bytes, f);
    if (have != bytes) {
        int failed = ferror(f);
        npy_free(a);
        if (failed) return npy_fail(err, errlen, name, "read error");
        return npy_fail(err, errlen, name, "truncated data: the header promises %zu bytes, the file holds %zu",
                        bytes, have);
    }
    if (npy_host_is_big_endian()) npy_swap(a->data, count, esize);
    return 0;
}

int npy_read(const char *path, npy_array *a, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    FILE *f = fopen(path, "rb");
    if (!f) return npy_fail(err, errlen, path, "cannot open: %s", strerror(errno));
    int rc = npy_read_stream(f, path, a, err, errlen);
    fclose(f);
    return rc;
}

/* ---- writing ---------------------------------------------------------------------------------------------- */

int npy_write_stream(FILE *f, const char *name, flashc_dtype dtype, int ndim, const int64_t *shape,
                     const void *data, char *err, size_t errlen) {
    if (dtype != FLASHC_DTYPE_F32 && dtype != FLASHC_DTYPE_F16 && dtype != FLASHC_DTYPE_BF16)
        return npy_fail(err, errlen, name, "cannot write dtype %d", (int)dtype);
    if (ndim < 0 || ndim > NPY_MAX_NDIM) return npy_fail(err, errlen, name, "cannot write %d dimensions", ndim);

    /* The dict as numpy.lib.format writes it: a 1-d shape keeps its trailing comma. */
    char dict[64 + NPY_MAX_NDIM * 24];
    size_t n = (size_t)snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                                npy_descr(dtype));
    size_t esize = npy_elem_size(dtype), count = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return npy_fail(err, errlen, name, "cannot write a negative size");
        if (shape[i] != 0 && count > SIZE_MAX / esize / (uint64_t)shape[i])
            return npy_fail(err, errlen, name, "array too large");
        count *= (size_t)shape[i];
        n += (size_t)snprintf(dict + n, sizeof dict - n, i == 0 ? "%lld" : ", %lld", (long long)shape[i]);
    }
    n += (size_t)snprintf(dict + n, sizeof dict - n, ndim == 1 ? ",), }" : "), }");

    /* Version 1.0 always suffices: the dict is under 1 KiB even at NPY_MAX_NDIM dimensions. */
    const size_t pre = NPY_MAGIC_LEN + 2 + 2;
    size_t hlen = (n + 1 + pre + NPY_ALIGN - 1) / NPY_ALIGN * NPY_ALIGN - pre;
    unsigned char head[NPY_MAGIC_LEN + 2 + 2];
    memcpy(head, NPY_MAGIC, NPY_MAGIC_LEN);
    head[NPY_MAGIC_LEN] = 1;
    head[NPY_MAGIC_LEN + 1] = 0;
    head[NPY_MAGIC_LEN + 2] = (unsigned char)(hlen & 0xff);
    head[NPY_MAGIC_LEN + 3] = (unsigned char)(hlen >> 8);

    char hdr[sizeof dict + NPY_ALIGN + 1];
    memcpy(hdr, dict, n);
    memset(hdr + n, ' ', hlen - n - 1);
    hdr[hlen - 1] = '\n';

    if (fwrite(head, 1, pre, f) != pre || fwrite(hdr, 1, hlen, f) != hlen)
        return npy_fail(err, errlen, name, "write error: %s", strerror(errno));

    size_t bytes = count * esize;
    if (npy_host_is_big_endian() && bytes) {
        void *tmp = malloc(bytes);
        if (!tmp) return npy_fail(err, errlen, name, "out of memory");
        memcpy(tmp, data, bytes);
        npy_swap(tmp, count, esize);
        size_t w = fwrite(tmp, 1, bytes, f);
        free(tmp);
        if (w != bytes) return npy_fail(err, errlen, name, "write error: %s", strerror(errno));
    } else if (bytes && fwrite(data, 1, bytes, f) != bytes) {
        return npy_fail(err, errlen, name, "write error: %s", strerror(errno));
    }
    return 0;
}

int npy_write(const char *path, flashc_dtype dtype, int ndim, const int64_t *shape, const void *data, char *err,
              size_t errlen) {
    FILE *f = fopen(path, "wb");
    if (!f) return npy_fail(err, errlen, path, "cannot create: %s", strerror(errno));
    int rc = npy_write_stream(f, path, dtype, ndim, shape, data, err, errlen);
    if (fclose(f) != 0 && rc == 0) rc = npy_fail(err, errlen, path, "write error: %s", strerror(errno));
    if (rc != 0) remove(path);
    return rc;
}
