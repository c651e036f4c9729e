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
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* fstat, mkstemp, fsync, readlink, rename into place */
#endif

#include "npy.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

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

/* Data from a stream without a size (a pipe) is read in pieces of this size, doubling, up to what the header says. */
#define NPY_READ_PIECE ((size_t)1 << 26)

/* "(2, 3)", as NumPy prints a shape, for messages. */
static void npy_shape_text(const int64_t *shape, int ndim, char *buf, size_t len) {
    size_t n = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < ndim && n < len; i++)
        n += (size_t)snprintf(buf + n, len - n, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (n < len) snprintf(buf + n, len - n, ndim == 1 ? ",)" : ")");
}

void npy_free(npy_array *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

int npy_read_stream(FILE *f, const char *name, npy_array *a, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    unsigned char pre[NPY_MAGIC_LEN + 2 + 4];
    size_t got = fread(pre, 1, NPY_MAGIC_LEN + 2, f);
    if (got < NPY_MAGIC_LEN && ferror(f)) return npy_fail(err, errlen, name, "read error: %s", strerror(errno));
    if (got == 0) return npy_fail(err, errlen, name, "not a NumPy .npy file (bad magic: the file is empty)");
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

    char shape_text[NPY_MAX_NDIM * 22 + 8];
    npy_shape_text(a->shape, a->ndim, shape_text, sizeof shape_text);
    /* The product is taken with zero sizes counted as one: an array with an empty axis holds nothing, but the
     * command still builds int64 strides from the other sizes, and those must not overflow either. */
    size_t esize = npy_elem_size(a->dtype), count = 1, span = 1;
    const uint64_t limit = ((uint64_t)INT64_MAX < (uint64_t)SIZE_MAX ? (uint64_t)INT64_MAX : (uint64_t)SIZE_MAX) / esize;
    for (int i = 0; i < a->ndim; i++) {
        uint64_t d = (uint64_t)a->shape[i], dd = d ? d : 1;
        if (d > limit || span > limit / dd) {
            memset(a, 0, sizeof *a);
            return npy_fail(err, errlen, name,
                            "bad header: shape %s is too large for this machine (the product of its nonzero sizes "
                            "exceeds %llu elements)",
                            shape_text, (unsigned long long)limit);
        }
        span *= (size_t)dd;
        count *= (size_t)d;
    }
    size_t bytes = count * esize;

    /* Compare the promise with the file before allocating: a 64-byte file whose header claims 128 GiB is
     * truncated, not a reason to ask the system for 128 GiB. Pipes have no size; they are read in growing
     * pieces instead, so memory follows the data that actually arrives. */
    struct stat st;
    off_t pos = ftello(f);
    int regular = fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && pos >= 0;
    if (regular) {
        uint64_t have = st.st_size > pos ? (uint64_t)(st.st_size - pos) : 0;
        if (have < (uint64_t)bytes) {
            memset(a, 0, sizeof *a);
            return npy_fail(err, errlen, name,
                            "truncated data: the header says %zu bytes of data (shape %s, %zu bytes each), the file "
                            "has %llu after the header",
                            bytes, shape_text, esize, (unsigned long long)have);
        }
    }
    size_t cap = regular || bytes <= NPY_READ_PIECE ? bytes : NPY_READ_PIECE, have = 0;
    unsigned char *data = (unsigned char *)malloc(cap ? cap : 1);
    for (;;) {
        if (!data) {
            memset(a, 0, sizeof *a);
            return npy_fail(err, errlen, name, "out of memory for %zu bytes of data (shape %s)", cap, shape_text);
        }
        have += fread(data + have, 1, cap - have, f);
        if (have < cap || cap == bytes) break;
        size_t next = cap <= bytes / 2 ? cap * 2 : bytes;
        unsigned char *grown = (unsigned char *)realloc(data, next);
        if (!grown) free(data);
        data = grown;
        cap = next;
    }
    if (have != bytes) {
        int failed = ferror(f);
        free(data);
        memset(a, 0, sizeof *a);
        if (failed) return npy_fail(err, errlen, name, "read error: %s", strerror(errno));
        return npy_fail(err, errlen, name,
                        "truncated data: the header says %zu bytes of data (shape %s, %zu bytes each), the file has "
                        "%zu after the header",
                        bytes, shape_text, esize, have);
    }
    a->count = count;
    a->data = data;
    if (npy_host_is_big_endian()) npy_swap(a->data, count, esize);
    return 0;
}

int npy_read(const char *path, npy_array *a, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    if (!path[0]) return npy_fail(err, errlen, "''", "cannot open: the file name is empty");
    FILE *f = fopen(path, "rb");
    if (!f) return npy_fail(err, errlen, path, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(f);
        return npy_fail(err, errlen, path, "is a directory, not a .npy file");
    }
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

/* ---- output files: whole or not at all -------------------------------------------------------------------
 *
 * The rule, so that a failed run never costs the user a file:
 *  - a regular file (new, or existing and to be replaced) is written to a temporary file beside it,
 *    ".<name>.flashc-XXXXXX" in the same directory, flushed, synced and closed, and only then renamed over the
 *    name; a failure removes that temporary and nothing else. The old file stays whole until the rename.
 *    Replacing an existing file keeps its permission bits (and, when allowed, its owner); a hard link to it
 *    keeps the old contents, as with any replace-by-rename.
 *  - a name that is a symbolic link is followed: the file it points to is the one replaced, the link stays.
 *  - a name that exists and is neither a regular file nor a directory (a character device such as /dev/null,
 *    a FIFO, a socket) is written straight through: there is nothing to rename over, and it is never removed,
 *    whatever happens. So is a regular file reached through a link that names no path (/dev/stdout redirected
 *    to a file, through /proc/self/fd/1): it is truncated and written in place, and never removed.
 *  - a directory is refused.
 */

/* Links followed per name before giving up, as the kernel's own limit for path lookups (ELOOP). */
#define NPY_MAX_LINKS 40

static char *npy_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = (char *)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* The name at the end of a chain of symbolic links (relative targets are taken from the link's directory),
 * or NULL with errno set. The last name need not exist. */
static char *npy_follow_links(const char *path) {
    char *cur = npy_strdup(path);
    for (int hop = 0; cur; hop++) {
        struct stat st;
        if (lstat(cur, &st) != 0) {
            if (errno == ENOENT) return cur;
            free(cur);
            return NULL;
        }
        if (!S_ISLNK(st.st_mode)) return cur;
        if (hop == NPY_MAX_LINKS) {
            free(cur);
            errno = ELOOP;
            return NULL;
        }
        size_t cap = st.st_size > 0 ? (size_t)st.st_size + 1 : 4096;
        char *link = (char *)malloc(cap);
        ssize_t n = link ? readlink(cur, link, cap) : -1;
        if (n < 0 || (size_t)n >= cap) {
            free(link);
            free(cur);
            if (n >= 0) errno = ENAMETOOLONG; /* the link changed between lstat and readlink */
            return NULL;
        }
        link[n] = '\0';
        const char *slash = strrchr(cur, '/');
        if (link[0] == '/' || !slash) {
            free(cur);
            cur = link;
        } else {
            size_t dlen = (size_t)(slash - cur) + 1;
            char *next = (char *)malloc(dlen + (size_t)n + 1);
            if (next) {
                memcpy(next, cur, dlen);
                memcpy(next + dlen, link, (size_t)n + 1);
            }
            free(link);
            free(cur);
            cur = next;
        }
    }
    errno = ENOMEM;
    return NULL;
}

void npy_out_discard(npy_out *o) {
    if (o->f) fclose(o->f);
    if (o->tmp) unlink(o->tmp); /* only ever the temporary this process created; never the name itself */
    free(o->tmp);
    free(o->target);
    memset(o, 0, sizeof *o);
}

/* Opens path for writing in place. Without O_CREAT, so a name that vanished since the stat fails instead of
 * being created; O_TRUNC only where the caller saw a regular file (a device or FIFO has nothing to cut). */
static int npy_out_direct(npy_out *o, const char *path, int regular, char *err, size_t errlen) {
    int fd = open(path, O_WRONLY | O_NOCTTY | (regular ? O_TRUNC : 0));
    struct stat now;
    if (fd < 0 || fstat(fd, &now) != 0 || S_ISDIR(now.st_mode) || (!regular && S_ISREG(now.st_mode))) {
        int e = fd < 0 ? errno : EBUSY; /* EBUSY: it was swapped for a regular file since the stat */
        if (fd >= 0) close(fd);
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "cannot open for writing: %s", strerror(e));
    }
    o->direct = 1;
    o->f = fdopen(fd, "wb");
    if (!o->f) {
        int e = errno;
        close(fd);
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "cannot open for writing: %s", strerror(e));
    }
    return 0;
}

int npy_out_open(npy_out *o, const char *path, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    o->name = path;
    if (!path[0]) return npy_fail(err, errlen, "''", "cannot create: the file name is empty");

    struct stat st;
    int exists = stat(path, &st) == 0;
    if (!exists && errno != ENOENT) return npy_fail(err, errlen, path, "cannot create: %s", strerror(errno));
    if (exists && S_ISDIR(st.st_mode))
        return npy_fail(err, errlen, path, "is a directory; an output wants a file name");
    if (exists && !S_ISREG(st.st_mode)) return npy_out_direct(o, path, 0, err, errlen);

    o->target = npy_follow_links(path);
    if (!o->target) return npy_fail(err, errlen, path, "cannot create: %s", strerror(errno));
    struct stat resolved;
    if (exists && (stat(o->target, &resolved) != 0 || resolved.st_dev != st.st_dev || resolved.st_ino != st.st_ino)) {
        /* A link whose text is not a path to the file, as /proc/self/fd/1 behind /dev/stdout: there is no
         * name to rename over, so the file is written in place like a device (and, like one, never removed). */
        free(o->target);
        o->target = NULL;
        return npy_out_direct(o, path, 1, err, errlen);
    }

    /* A rename needs only the directory's permission; a file the user made read-only must still stop us, as
     * it stops a plain open for writing. */
    if (exists && access(o->target, W_OK) != 0) {
        int e = errno;
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "cannot write: %s", strerror(e));
    }

    /* ".<name>.flashc-XXXXXX" beside the target, so the final rename stays within one file system. Long
     * names are shortened in the temporary's name only (NAME_MAX is 255 on common file systems). */
    const char *slash = strrchr(o->target, '/');
    const char *base = slash ? slash + 1 : o->target;
    size_t dlen = slash ? (size_t)(slash - o->target) + 1 : 0, blen = strlen(base);
    if (blen == 0) {
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "names a directory, not a file");
    }
    if (blen > 200) blen = 200;
    static const char suffix[] = ".flashc-XXXXXX";
    o->tmp = (char *)malloc(dlen + 1 + blen + sizeof suffix);
    if (!o->tmp) {
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "out of memory");
    }
    memcpy(o->tmp, o->target, dlen);
    o->tmp[dlen] = '.';
    memcpy(o->tmp + dlen + 1, base, blen);
    memcpy(o->tmp + dlen + 1 + blen, suffix, sizeof suffix);
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        int e = errno;
        free(o->tmp);
        o->tmp = NULL; /* nothing was created: nothing to remove */
        char dir[4096];
        snprintf(dir, sizeof dir, "%.*s", dlen > 1 ? (int)dlen - 1 : 1, dlen ? o->target : ".");
        npy_out_discard(o);
        if (e == ENOENT || e == ENOTDIR)
            return npy_fail(err, errlen, path, "cannot create: the directory %s does not exist", dir);
        return npy_fail(err, errlen, path,
                        "cannot create a file in %s: %s (outputs are written to a temporary file there, then "
                        "renamed over the name)",
                        dir, strerror(e));
    }
    /* mkstemp makes the file 0600; give it what the replaced file had, or what a plain fopen would give. */
    mode_t mode;
    if (exists) {
        mode = st.st_mode & 07777;
        if ((st.st_uid != geteuid() || st.st_gid != getegid()) && fchown(fd, st.st_uid, st.st_gid) != 0) {
            /* not permitted for an ordinary user; the file then belongs to whoever ran the command */
        }
    } else {
        mode_t mask = umask(0);
        umask(mask);
        mode = 0666 & ~mask;
    }
    if (fchmod(fd, mode) != 0 || !(o->f = fdopen(fd, "wb"))) {
        int e = errno;
        if (!o->f) close(fd);
        npy_out_discard(o);
        return npy_fail(err, errlen, path, "cannot create: %s", strerror(e));
    }
    return 0;
}

int npy_out_write(npy_out *o, flashc_dtype dtype, int ndim, const int64_t *shape, const void *data, char *err,
                  size_t errlen) {
    int rc = npy_write_stream(o->f, o->name, dtype, ndim, shape, data, err, errlen);
    if (rc != 0) { /* err says why; the temporary is the caller's to discard */
        fclose(o->f);
        o->f = NULL;
        return rc;
    }
    return npy_out_close(o, err, errlen);
}

int npy_out_close(npy_out *o, char *err, size_t errlen) {
    int rc = ferror(o->f) ? npy_fail(err, errlen, o->name, "write error") : 0;
    if (rc == 0 && fflush(o->f) != 0) rc = npy_fail(err, errlen, o->name, "write error: %s", strerror(errno));
    /* A temporary must be on disk before it replaces the old file, or a crash could leave an empty name.
     * Devices, FIFOs and some file systems do not sync (EINVAL, ENOTSUP): nothing more can be done there. */
    if (rc == 0 && fsync(fileno(o->f)) != 0 && errno != EINVAL && errno != ENOTSUP && errno != ENOSYS)
        rc = npy_fail(err, errlen, o->name, "write error: %s", strerror(errno));
    int closed = fclose(o->f);
    o->f = NULL;
    if (rc == 0 && closed != 0) rc = npy_fail(err, errlen, o->name, "write error: %s", strerror(errno));
    return rc;
}

int npy_out_commit(npy_out *o, char *err, size_t errlen) {
    int rc = 0;
    if (o->tmp) {
        if (rename(o->tmp, o->target) != 0) {
            rc = npy_fail(err, errlen, o->name, "cannot replace: %s", strerror(errno));
        } else {
            free(o->tmp);
            o->tmp = NULL;
            /* Makes the rename itself durable; best effort, not every file system allows it. */
            const char *slash = strrchr(o->target, '/');
            if (slash) *(char *)(slash == o->target ? slash + 1 : slash) = '\0';
            int dfd = open(slash ? o->target : ".", O_RDONLY | O_DIRECTORY);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
        }
    }
    npy_out_discard(o);
    return rc;
}

int npy_write(const char *path, flashc_dtype dtype, int ndim, const int64_t *shape, const void *data, char *err,
              size_t errlen) {
    npy_out o;
    if (npy_out_open(&o, path, err, errlen) != 0) return -1;
    if (npy_out_write(&o, dtype, ndim, shape, data, err, errlen) != 0) {
        npy_out_discard(&o);
        return -1;
    }
    return npy_out_commit(&o, err, errlen);
}
