/*
 * benchkit.h - the small pieces the C benchmarks share (cpu_speed.c, cpu_bwd_ab.c, decode_ab.c): a fixed-seed
 * generator of uniform [-1, 1) inputs, float -> bf16 rounding to nearest even, a qsort comparator for medians, and
 * "a,b,c" integer lists from the command line. Header-only (static), so each program stays one file to compile
 * (benchlib.h: the A/B programs' library loading).
 */
#ifndef FLASHC_BENCHKIT_H
#define FLASHC_BENCHKIT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

#endif
