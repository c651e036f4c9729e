/*
 * cli_util.c - option parsing, messages, timing and half-precision conversions for the flashc command.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* clock_gettime, sysconf, isatty */
#endif

#include "cli.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- options ------------------------------------------------------------------------------------------------ */

int cli_opt(int argc, char **argv, int *i, const char *name, const char **val) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, "--", 2) != 0 || strncmp(a + 2, name, n) != 0) return 0;
    if (a[2 + n] == '=') {
        *val = a + 3 + n;
        return 1;
    }
    if (a[2 + n] != '\0') return 0;
    if (*i + 1 >= argc) {
        cli_usage_error(argv[0], "option --%s needs a value", name);
        return -1;
    }
    *val = argv[++*i];
    return 1;
}

int cli_flag(const char *arg, const char *name) {
    return strncmp(arg, "--", 2) == 0 && strcmp(arg + 2, name) == 0;
}

int cli_is_help(const char *arg) {
    return strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0 || strcmp(arg, "help") == 0;
}

/* strtoll and strtod skip leading blanks; a strict parser must not, or "--window ' 5,3'" would pass. */
static int cli_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

int cli_parse_i64(const char *cmd, const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (s[0] == '\0') {
        cli_usage_error(cmd, "--%s needs a value, got an empty string", opt);
        return -1;
    }
    char *end = (char *)s;
    errno = 0;
    long long v = cli_blank(s[0]) ? 0 : strtoll(s, &end, 10);
    if (end == s || *end != '\0') {
        cli_usage_error(cmd, "--%s wants an integer in [%lld, %lld], not '%s'", opt, (long long)lo, (long long)hi,
                        s);
        return -1;
    }
    if (errno == ERANGE) {
        cli_usage_error(cmd, "--%s %s does not fit in a 64-bit integer; it wants an integer in [%lld, %lld]", opt, s,
                        (long long)lo, (long long)hi);
        return -1;
    }
    if (v < lo || v > hi) {
        cli_usage_error(cmd, "--%s wants an integer in [%lld, %lld], not %s", opt, (long long)lo, (long long)hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_f32(const char *cmd, const char *opt, const char *s, float *out) {
    if (s[0] == '\0') {
        cli_usage_error(cmd, "--%s needs a value, got an empty string", opt);
        return -1;
    }
    char *end = (char *)s;
    errno = 0;
    double v = cli_blank(s[0]) ? 0.0 : strtod(s, &end);
    if (end == s || *end != '\0') {
        cli_usage_error(cmd, "--%s wants a number, not '%s'", opt, s);
        return -1;
    }
    int range = errno == ERANGE;
    if (!range && !isfinite(v)) {
        cli_usage_error(cmd, "--%s wants a finite number, not '%s'", opt, s);
        return -1;
    }
    /* The library computes in fp32: a value past FLT_MAX would become inf, and one below FLT_MIN would become
     * a subnormal or 0 (which --scale reads as "the default" and --softcap as "off") - neither what was asked. */
    if ((range && fabs(v) > 1.0) || fabs(v) > (double)FLT_MAX) {
        cli_usage_error(cmd, "--%s %s is too large for fp32 (the largest is %g)", opt, s, (double)FLT_MAX);
        return -1;
    }
    float f = (float)v;
    if ((range && fabs(v) <= 1.0) || (v != 0.0 && fabsf(f) < FLT_MIN)) {
        cli_usage_error(cmd,
                        "--%s %s is not representable as a normal fp32 value: nonzero values need a magnitude of "
                        "at least %g",
                        opt, s, (double)FLT_MIN);
        return -1;
    }
    *out = f;
    return 0;
}

int cli_parse_backend(const char *cmd, const char *s, flashc_backend *out) {
    if (strcmp(s, "auto") == 0) *out = FLASHC_BACKEND_AUTO;
    else if (strcmp(s, "cpu") == 0) *out = FLASHC_BACKEND_CPU;
    else if (strcmp(s, "cuda") == 0) *out = FLASHC_BACKEND_CUDA;
    else {
        cli_usage_error(cmd, "--backend wants auto, cpu or cuda, not '%s'", s);
        return -1;
    }
    return 0;
}

int cli_parse_dtype(const char *cmd, const char *s, flashc_dtype *out) {
    if (strcmp(s, "f32") == 0 || strcmp(s, "fp32") == 0) *out = FLASHC_DTYPE_F32;
    else if (strcmp(s, "f16") == 0 || strcmp(s, "fp16") == 0) *out = FLASHC_DTYPE_F16;
    else if (strcmp(s, "bf16") == 0) *out = FLASHC_DTYPE_BF16;
    else {
        cli_usage_error(cmd, "--dtype wants f32, f16 or bf16, not '%s'", s);
        return -1;
    }
    return 0;
}

/* ---- paths ---------------------------------------------------------------------------------------------------- */

/* The (device, inode) of the directory a path's last component lives in, and that component. */
static int cli_parent_id(const char *path, struct stat *dir, const char **base) {
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash) return stat(".", dir);
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char *d = (char *)malloc(n + 1);
    if (!d) return -1;
    memcpy(d, path, n);
    d[n] = '\0';
    int rc = stat(d, dir);
    free(d);
    return rc;
}

int cli_same_file(const char *a, const char *b) {
    struct stat sa, sb;
    int ea = stat(a, &sa) == 0, eb = stat(b, &sb) == 0;
    if (ea && eb) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    if (ea || eb) return 0;
    /* Neither exists yet: the same name in the same directory, however the directory was spelled. */
    const char *ba, *bb;
    if (cli_parent_id(a, &sa, &ba) != 0 || cli_parent_id(b, &sb, &bb) != 0) return 0;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino && ba[0] && strcmp(ba, bb) == 0;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "flashc %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry 'flashc %s --help'.\n", cmd);
    return 2;
}

int cli_fail(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "flashc %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

/* ---- formatting, time ----------------------------------------------------------------------------------------- */

const char *cli_bytes(double bytes, char *buf, size_t len) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) {
        bytes /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, len, "%.0f B", bytes);
    else snprintf(buf, len, bytes < 10.0 ? "%.2f %s" : bytes < 100.0 ? "%.1f %s" : "%.0f %s", bytes, unit[u]);
    return buf;
}

double cli_now(void) {
#if defined(CLOCK_MONOTONIC)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int cli_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ---- half precision ----------------------------------------------------------------------------------------- */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float cli_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in fp32 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | mant << 13);
    return bits_f32(sign | (exp + 112u) << 23 | mant << 13);
}

uint16_t cli_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;    /* NaN stays a (quiet) NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00u;   /* rounds past the largest half, 65504 */
    if (u < 0x38800000u) {                          /* below the smallest normal half, 2^-14 */
        float r = bits_f32(u) * 16777216.0f;        /* in units of 2^-24, exact */
        uint32_t i = (uint32_t)r;
        float frac = r - (float)i;
        if (frac > 0.5f || (frac == 0.5f && (i & 1u))) i++;
        return sign | (uint16_t)i;
    }
    u += 0xfffu + ((u >> 13) & 1u);                /* round to nearest even at bit 13 */
    return sign | (uint16_t)((u - 0x38000000u) >> 13);
}

float cli_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t cli_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

size_t cli_dtype_size(flashc_dtype dtype) { return dtype == FLASHC_DTYPE_F32 ? 4 : 2; }

float cli_load(const void *data, flashc_dtype dtype, size_t i) {
    switch (dtype) {
    case FLASHC_DTYPE_F32: return ((const float *)data)[i];
    case FLASHC_DTYPE_F16: return cli_f16_to_f32(((const uint16_t *)data)[i]);
    case FLASHC_DTYPE_BF16: return cli_bf16_to_f32(((const uint16_t *)data)[i]);
    }
    return 0.0f;
}

void cli_store(void *data, flashc_dtype dtype, size_t i, float x) {
    switch (dtype) {
    case FLASHC_DTYPE_F32: ((float *)data)[i] = x; break;
    case FLASHC_DTYPE_F16: ((uint16_t *)data)[i] = cli_f32_to_f16(x); break;
    case FLASHC_DTYPE_BF16: ((uint16_t *)data)[i] = cli_f32_to_bf16(x); break;
    }
}
