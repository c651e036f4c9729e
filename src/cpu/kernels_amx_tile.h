/*
 * kernels_amx_tile.h - the five AMX tile operations kernels_amx.c is written against: configure, load, store, zero
 * and TDPBF16PS. Built normally they are the instructions (_tile_loadconfig, _tile_loadd, _tile_stored, _tile_zero,
 * _tile_dpbf16ps; -mamx-tile -mamx-bf16). Built with FLASHC_CPU_AMX_EMULATE they are portable C with the
 * instructions' semantics, per thread as the tile state is, so that the AMX kernels run and are tested on a CPU
 * without AMX:
 *   - LDTILECFG: palette 1, up to 8 tiles of at most 16 rows x 64 bytes; every tile is zeroed. A tile that its
 *     operation needs unconfigured, or shapes that disagree, raise #UD on the hardware: the emulation traps too.
 *   - TILELOADD / TILESTORED: rows x colsb bytes at base + row * stride; a load zeroes the rest of the tile.
 *   - TDPBF16PS (Intel SDM): for each row m, pair k < A.colsb / 4, column n < C.colsb / 4:
 *       C[m][n] = C[m][n] + fp32(A[m][2k]) fp32(B[k][2n]);  C[m][n] = C[m][n] + fp32(A[m][2k + 1]) fp32(B[k][2n + 1])
 *     two FMAs in that order, each rounded to nearest even, with bf16 denormal inputs read as zero and denormal
 *     results flushed to zero; MXCSR neither read nor written. (A product of two bf16 is exact in fp32, so each FMA
 *     is one rounding of the sum.) That is the SDM's description; a Xeon with AMX rounds otherwise: 21523 of 29698
 *     elements of test_cpu_bf16's gemm differ from it in the last bits (within the error bound), so the emulation
 *     checks the kernels' logic, not the hardware's bits.
 * Tile numbers must be constants (the instructions encode them).
 */
#ifndef FLASHC_KERNELS_AMX_TILE_H
#define FLASHC_KERNELS_AMX_TILE_H

#include <stdint.h>
#include <string.h>

/* The 64-byte operand of LDTILECFG: palette, start_row, 14 reserved bytes (0), bytes per row of tiles 0-15, rows of
 * tiles 0-15 (palette 1: tiles 8-15 must be 0). */
typedef struct flashc_amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} flashc_amx_cfg;
_Static_assert(sizeof(flashc_amx_cfg) == 64, "LDTILECFG takes 64 bytes");

#if defined(FLASHC_CPU_AMX_EMULATE)
#  include <float.h>
#  include <math.h>

typedef struct flashc_amx_state {
    flashc_amx_cfg cfg;
    int valid;
    _Alignas(64) unsigned char t[8][16][64];
} flashc_amx_state;
static _Thread_local flashc_amx_state flashc_amx_emu;

/* #UD on the hardware: a bug in the kernel, never the caller's input. */
#  define FLASHC_AMX_UD(cond)                                                                                      \
      do {                                                                                                         \
          if (cond) __builtin_trap();                                                                              \
      } while (0)

static inline void flashc_amx_emu_config(const flashc_amx_cfg *c) {
    FLASHC_AMX_UD(c->palette != 1 || c->start_row != 0);
    for (int i = 0; i < 16; i++)
        FLASHC_AMX_UD(i >= 8 ? c->rows[i] || c->colsb[i]
                             : c->rows[i] > 16 || c->colsb[i] > 64 || (c->rows[i] == 0) != (c->colsb[i] == 0));
    flashc_amx_emu.cfg = *c;
    flashc_amx_emu.valid = 1;
    memset(flashc_amx_emu.t, 0, sizeof flashc_amx_emu.t);
}

static inline void flashc_amx_emu_used(int t) {
    FLASHC_AMX_UD(!flashc_amx_emu.valid || t < 0 || t >= 8 || flashc_amx_emu.cfg.rows[t] == 0);
}

static inline void flashc_amx_emu_load(int t, const void *base, int64_t stride) {
    flashc_amx_emu_used(t);
    const int rows = flashc_amx_emu.cfg.rows[t], colsb = flashc_amx_emu.cfg.colsb[t];
    memset(flashc_amx_emu.t[t], 0, sizeof flashc_amx_emu.t[t]);
    for (int r = 0; r < rows; r++) memcpy(flashc_amx_emu.t[t][r], (const char *)base + r * stride, (size_t)colsb);
}

static inline void flashc_amx_emu_store(int t, void *base, int64_t stride) {
    flashc_amx_emu_used(t);
    const int rows = flashc_amx_emu.cfg.rows[t], colsb = flashc_amx_emu.cfg.colsb[t];
    for (int r = 0; r < rows; r++) memcpy((char *)base + r * stride, flashc_amx_emu.t[t][r], (size_t)colsb);
}

static inline void flashc_amx_emu_zero(int t) {
    flashc_amx_emu_used(t);
    memset(flashc_amx_emu.t[t], 0, sizeof flashc_amx_emu.t[t]);
}

/* fp32 of a bf16 with a denormal read as (signed) zero. */
static inline float flashc_amx_emu_bf16(uint16_t x) {
    if ((x & 0x7f80u) == 0) x &= 0x8000u;
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A denormal result flushed to zero of its sign (NaN and infinities pass). */
static inline float flashc_amx_emu_ftz(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

static inline void flashc_amx_emu_dpbf16ps(int c, int a, int b) {
    flashc_amx_emu_used(c), flashc_amx_emu_used(a), flashc_amx_emu_used(b);
    const flashc_amx_cfg *g = &flashc_amx_emu.cfg;
    const int rows = g->rows[c], n = g->colsb[c] / 4, kp = g->colsb[a] / 4;
    FLASHC_AMX_UD(g->colsb[c] % 4 || g->colsb[a] % 4 || g->colsb[b] % 4 || g->rows[a] != rows ||
                  g->rows[b] != kp || g->colsb[b] != g->colsb[c]);
    float b0[16][16], b1[16][16];
    for (int k = 0; k < kp; k++)
        for (int j = 0; j < n; j++) {
            uint16_t w[2];
            memcpy(w, flashc_amx_emu.t[b][k] + 4 * j, sizeof w);
            b0[k][j] = flashc_amx_emu_bf16(w[0]);
            b1[k][j] = flashc_amx_emu_bf16(w[1]);
        }
    for (int m = 0; m < rows; m++) {
        float acc[16];
        memcpy(acc, flashc_amx_emu.t[c][m], sizeof acc);
        for (int k = 0; k < kp; k++) {
            uint16_t w[2];
            memcpy(w, flashc_amx_emu.t[a][m] + 4 * k, sizeof w);
            const float a0 = flashc_amx_emu_bf16(w[0]), a1 = flashc_amx_emu_bf16(w[1]);
            for (int j = 0; j < n; j++) {
                acc[j] = flashc_amx_emu_ftz(fmaf(a0, b0[k][j], acc[j]));
                acc[j] = flashc_amx_emu_ftz(fmaf(a1, b1[k][j], acc[j]));
            }
        }
        memcpy(flashc_amx_emu.t[c][m], acc, sizeof(float) * (size_t)n);
    }
}

#  define FLASHC_AMX_CONFIG(cfg) flashc_amx_emu_config(cfg)
#  define FLASHC_AMX_LOAD(t, base, stride) flashc_amx_emu_load(t, base, stride)
#  define FLASHC_AMX_STORE(t, base, stride) flashc_amx_emu_store(t, base, stride)
#  define FLASHC_AMX_ZERO(t) flashc_amx_emu_zero(t)
#  define FLASHC_AMX_DPBF16PS(c, a, b) flashc_amx_emu_dpbf16ps(c, a, b)
#else
#  include <immintrin.h>
/* Compiler barriers around every tile operation that reads or writes memory: gcc's _tile_loadd is an asm statement
 * that names no memory (and _tile_loadconfig only the configuration's first 8 bytes), so the compiler may move or
 * drop the stores that fill a packed panel, a B tile or the configuration before the tile load reads them, or
 * reuse a buffer before the load is done. The emulation's loads are C and never had the problem: on the Xeon the
 * packed edge tiles (m 5 x n 3, D 1, 8, 111) came out wrong while every full tile was right. */
#  define FLASHC_AMX_FENCE() __asm__ volatile("" ::: "memory")
#  define FLASHC_AMX_FENCED(op)                                                                                    \
      do {                                                                                                         \
          FLASHC_AMX_FENCE();                                                                                      \
          op;                                                                                                      \
          FLASHC_AMX_FENCE();                                                                                      \
      } while (0)
#  define FLASHC_AMX_CONFIG(cfg) FLASHC_AMX_FENCED(_tile_loadconfig(cfg))
#  define FLASHC_AMX_LOAD(t, base, stride) FLASHC_AMX_FENCED(_tile_loadd(t, base, stride))
#  define FLASHC_AMX_STORE(t, base, stride) FLASHC_AMX_FENCED(_tile_stored(t, base, stride))
#  define FLASHC_AMX_ZERO(t) _tile_zero(t)
#  define FLASHC_AMX_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

#endif
