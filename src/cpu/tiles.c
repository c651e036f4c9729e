/*
 * What the CPU drivers (attn.c) build their loops from: tile sizes from the caches, strided tile loads and
 * stores with dtype conversion, and the score epilogue (softcap, ALiBi, masks). Nothing here knows the backend
 * table or the context.
 */
#define _GNU_SOURCE /* sysconf cache sizes */
#include "cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- tiles --------------------------------------------------------------------------------------------- */

/*
 * Data cache sizes of cpu0, read once: /sys/devices/system/cpu/cpu0/cache/index<i>/{level,type,size} first, since
 * glibc's sysconf answers from cpuid and can be far off in a VM (256 MiB of L3 on the 2-core AMD EPYC dev VM,
 * whose /sys and lscpu say 32 MiB); then sysconf; then 32 KiB, 1 MiB, 8 MiB.
 */
static flashc_cpu_caches caches;
static pthread_once_t caches_once = PTHREAD_ONCE_INIT;

/* A number in a /sys file, with its K or M suffix applied; -1 when absent. */
static long read_sys_long(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char buf[64] = {0};
    const int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok) return -1;
    char *end;
    long v = strtol(buf, &end, 10);
    if (end == buf || v <= 0) return -1;
    return *end == 'K' ? v << 10 : *end == 'M' ? v << 20 : v;
}

static void caches_init(void) {
    long size[4] = {0, 0, 0, 0};
    for (int i = 0; i < 8; i++) {
        char path[96], type[32] = {0};
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        FILE *f = fopen(path, "r");
        if (!f) break;
        const int ok = fgets(type, sizeof type, f) != NULL;
        fclose(f);
        if (!ok || !strncmp(type, "Instruction", 11)) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        const long level = read_sys_long(path);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        const long bytes = read_sys_long(path);
        if (level >= 1 && level <= 3 && bytes > 0) size[level] = bytes;
    }
#if defined(_SC_LEVEL2_CACHE_SIZE)
    if (size[1] <= 0) size[1] = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (size[2] <= 0) size[2] = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (size[3] <= 0) size[3] = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    caches.l1d = size[1] > 0 ? size[1] : 32L << 10;
    caches.l2 = size[2] > 0 ? size[2] : 1L << 20;
    caches.l3 = size[3] > 0 ? size[3] : 8L << 20;
}

flashc_cpu_caches flashc_cpu_cache_sizes(void) {
    pthread_once(&caches_once, caches_init);
    return caches;
}

/*
 * Per-thread working sets in floats, which must stay within half of L2 (dp = D rounded up to 16):
 *   forward:  Q^T and O, resident (2 * br * dp), the score tile (bc * br), converted K and V tiles (2 * bc * dp);
 *   backward: also dO^T, dQ and the dP, dS tiles: 4 * br * dp + 3 * bc * br + 2 * bc * dp.
 * Forward: 64 query rows against 128-key steps (bc halved, down to 32, where a large D would not fit). On the
 * 2-core AMD EPYC at 2 threads this ran 3-9% faster than 128 rows x 64 keys (D = 64 and 128, N = 1k-4k, causal
 * and not): P V then has k = 128, so its C tile (O) is read and written half as often per FLOP, and a causal
 * query block wastes fewer masked scores on the diagonal.
 * Backward: bc keeps a K or V tile within L1 where possible (64 keys at D <= 128, else 32-64); br is the largest
 * multiple of 16 (<= 128) that fits. There the same swap measured no better.
 */
flashc_cpu_tiles flashc_cpu_choose_tiles(int64_t D, int backward) {
    const flashc_cpu_caches c = flashc_cpu_cache_sizes();
    long l2 = c.l2, l1 = c.l1d;
    if (l2 < (256L << 10)) l2 = 256L << 10;
    if (l2 > (2L << 20)) l2 = 2L << 20;
    flashc_cpu_tiles t;
    const int64_t dpad = (D + 15) / 16 * 16;
    const long budget = l2 / 2 / 4; /* floats */
    if (!backward) {
        t.br = 64;
        for (t.bc = 128; t.bc > 32; t.bc /= 2)
            if (2L * t.br * dpad + (long)t.bc * t.br + 2L * t.bc * dpad <= budget) break;
        return t;
    }
    t.bc = dpad * 4 * 64 <= l1 ? 64 : 32;
    if (t.bc < 64 && dpad <= 128) t.bc = 64;
    int br = FLASHC_CPU_MAX_BR;
    for (; br > 16; br -= 16) {
        long need = 4L * br * dpad + 3L * t.bc * br + 2L * t.bc * dpad;
        if (need <= budget) break;
    }
    t.br = br;
    return t;
}

/*
 * The forward's query group (attn.c): with the key-block loop outside the group's query blocks, a K/V block is read
 * from memory once per group instead of once per query block. The K/V block and the score tile are touched by every
 * block of the group, so they stay in L2 while the blocks' (scale Q)^T and O tiles pass through it; those G tiles
 * per thread must stay in the last-level cache, so G is the most that fill at most half of this thread's share of
 * L3 (and at most FLASHC_CPU_MAX_GQ). A group of G costs one K/V read from memory (or, for a short head that L3
 * holds, from L3 through strided rows, a TLB miss per row where the row stride is 4 KiB) per G blocks; on the
 * 2-core AMD EPYC (L2 512 KiB, L3 32 MiB), Nq 2048 against Nk 32768, H 8, f32, CPU time: G = 1, 4, 8, 16 ran at
 * 103-110, 121-127, 129-131, 131-132 GFLOP/s at D = 128 (D = 64: 91-97, 123-129, 134, 139-141), the same order at
 * Nk 8192 (lab/LOG.md).
 */
int flashc_cpu_query_group(int64_t D, flashc_cpu_tiles t, int nthreads) {
    const flashc_cpu_caches c = flashc_cpu_cache_sizes();
    const long dp = (long)((D + 15) / 16 * 16), ld = t.br + FLASHC_CPU_LD_PAD;
    const long per_block = dp * ld + (long)t.br * dp + 2L * t.br; /* floats of Q^T, O, m and l */
    const long share = c.l3 / 4 / 2 / (nthreads > 0 ? nthreads : 1); /* floats */
    const long g = share / per_block;
    return g < 1 ? 1 : g > FLASHC_CPU_MAX_GQ ? FLASHC_CPU_MAX_GQ : (int)g;
}

/*
 * The backward's key group (attn.c, head_task): with the query-block loop inside a group of key blocks, the whole
 * sequence's query side (Q^T, dO^T, q and dO rows, dQ) is read from memory once per group instead of once per key
 * block. The query block, touched by every key block of the group, stays in L2 while the blocks' K, V, dK and dV
 * tiles (four bc x dp fp32 tiles each, converted K and V included) pass through it; those must stay in the
 * last-level cache, so G is the most that fill at most half of this thread's share of L3 (and at most
 * FLASHC_CPU_MAX_GK), as the forward's query group. On the 2-core AMD EPYC (L2 512 KiB, L3 32 MiB; Nq 32768 against
 * Nk 2048, H 8, D 128, 2 threads, CPU time, rows packed) G = 1, 4, 8 ran at 129, 147, 151 GFLOP/s in f32 (bf16: 127,
 * 143, 151), G = 16 as 8; one block per pass without packing, 110-113.
 */
int flashc_cpu_key_group(int64_t D, flashc_cpu_tiles t, int nthreads) {
    const flashc_cpu_caches c = flashc_cpu_cache_sizes();
    const long dp = (long)((D + 15) / 16 * 16);
    const long per_block = 4L * t.bc * dp; /* floats of K, V, dK and dV */
    const long share = c.l3 / 4 / 2 / (nthreads > 0 ? nthreads : 1); /* floats */
    const long g = share / per_block;
    return g < 1 ? 1 : g > FLASHC_CPU_MAX_GK ? FLASHC_CPU_MAX_GK : (int)g;
}

/* ---- loads and stores ---------------------------------------------------------------------------------- */

/* One row of D values to fp32; contiguous rows go through the ISA's converters. */
static void load_row(const flashc_cpu_kernels *kern, float *dst, const flashc_tensor *t, int64_t off, int64_t D) {
    const int64_t sd = t->stride[3];
    if (sd == 1) {
        switch (t->dtype) {
        case FLASHC_DTYPE_F32: memcpy(dst, (const float *)t->data + off, sizeof(float) * (size_t)D); return;
        case FLASHC_DTYPE_F16: kern->f16_to_f32((int)D, (const uint16_t *)t->data + off, dst); return;
        default: kern->bf16_to_f32((int)D, (const uint16_t *)t->data + off, dst); return;
        }
    }
    for (int64_t d = 0; d < D; d++) dst[d] = flashc_cpu_load_elem(t->data, t->dtype, off + d * sd);
}

const float *flashc_cpu_rows(const flashc_cpu_kernels *kern, const flashc_tensor *t, int64_t b, int64_t row0,
                             int rows, int64_t h, int64_t D, float *buf, int64_t buf_ld, int64_t *ld) {
    if (t->dtype == FLASHC_DTYPE_F32 && t->stride[3] == 1) {
        *ld = t->stride[1];
        return (const float *)t->data + flashc_cpu_offset(t, b, row0, h);
    }
    for (int r = 0; r < rows; r++) load_row(kern, buf + (size_t)r * buf_ld, t, flashc_cpu_offset(t, b, row0 + r, h), D);
    *ld = buf_ld;
    return buf;
}

const float *flashc_cpu_kv_rows(const flashc_cpu_kernels *kern, const flashc_problem *p, const flashc_tensor *t,
                                int64_t b, int64_t row0, int rows, int64_t h, float *buf, int64_t buf_ld, int64_t *ld) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    if (!p->block_table) return flashc_cpu_rows(kern, t, tb, row0, rows, h, p->D, buf, buf_ld, ld);
    /* Rows on one page lie at the page's row stride: read in place when fp32 with unit stride along D. */
    if (t->dtype == FLASHC_DTYPE_F32 && t->stride[3] == 1 && row0 / p->page_size == (row0 + rows - 1) / p->page_size) {
        *ld = t->stride[1];
        return (const float *)t->data + flashc_kv_offset(p, t, b, tb, row0, h);
    }
    for (int r = 0; r < rows; r++)
        load_row(kern, buf + (size_t)r * buf_ld, t, flashc_kv_offset(p, t, b, tb, row0 + r, h), p->D);
    *ld = buf_ld;
    return buf;
}

/*
 * Rows go through a block of LOAD_T_ROWS converted rows so that each store run dst[d][r0 .. r0 + LOAD_T_ROWS) is
 * a contiguous 64-byte line: writing one row at a time touches D lines ld floats apart per row, and when ld is a
 * large power of two (the whole sequence's Q^T in the backward) they all fall into one L1 set.
 */
#define LOAD_T_ROWS 16
void flashc_cpu_load_t(const flashc_cpu_kernels *kern, float *dst, int64_t ld, const flashc_tensor *t, int64_t b,
                       int64_t row0, int rows, int pad_rows, int64_t h, int64_t D, float scale) {
    float tmp[LOAD_T_ROWS][FLASHC_MAX_HEAD_DIM];
    for (int r0 = 0; r0 < rows; r0 += LOAD_T_ROWS) {
        const int n = rows - r0 < LOAD_T_ROWS ? rows - r0 : LOAD_T_ROWS;
        for (int r = 0; r < n; r++) load_row(kern, tmp[r], t, flashc_cpu_offset(t, b, row0 + r0 + r, h), D);
        for (int64_t d = 0; d < D; d++) {
            float *out = dst + (size_t)d * ld + r0;
            for (int r = 0; r < n; r++) out[r] = tmp[r][d] * scale;
        }
    }
    for (int64_t d = 0; d < D; d++)
        for (int r = rows; r < pad_rows; r++) dst[(size_t)d * ld + r] = 0.0f;
}

/* ---- bf16 operands of the dot-product kernels ------------------------------------------------------------- */

/* Element offset of K-like row `row` (flashc_seq_key_rows' counting) of sequence b, head h: through the block table
 * when there is one. */
static int64_t kv_row_offset(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t row, int64_t h) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    return p->block_table ? flashc_kv_offset(p, t, b, tb, row, h) : flashc_cpu_offset(t, tb, row, h);
}

const uint16_t *flashc_cpu_rows_bf16(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                                     uint16_t *buf, int64_t buf_ld, int64_t *ld) {
    const uint16_t *data = (const uint16_t *)t->data;
    const int64_t sd = t->stride[3];
    if (sd == 1) {
        *ld = t->stride[1];
        return data + flashc_cpu_offset(t, b, row0, h);
    }
    for (int r = 0; r < rows; r++) {
        const int64_t off = flashc_cpu_offset(t, b, row0 + r, h);
        for (int64_t d = 0; d < D; d++) buf[(size_t)r * buf_ld + d] = data[off + d * sd];
    }
    *ld = buf_ld;
    return buf;
}

const uint16_t *flashc_cpu_kv_rows_bf16(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t row0,
                                        int rows, int64_t h, uint16_t *buf, int64_t buf_ld, int64_t *ld) {
    const int64_t D = p->D, sd = t->stride[3];
    const uint16_t *data = (const uint16_t *)t->data;
    const int one_page = !p->block_table || row0 / p->page_size == (row0 + rows - 1) / p->page_size;
    if (sd == 1 && D % 2 == 0 && one_page) { /* a pair never reaches past its row */
        *ld = t->stride[1];
        return data + kv_row_offset(p, t, b, row0, h);
    }
    for (int r = 0; r < rows; r++) {
        const int64_t off = kv_row_offset(p, t, b, row0 + r, h);
        uint16_t *dst = buf + (size_t)r * buf_ld;
        for (int64_t d = 0; d < D; d++) dst[d] = data[off + d * sd];
        if (D % 2) dst[D] = 0;
    }
    *ld = buf_ld;
    return buf;
}

void flashc_cpu_load_pairs_t(const flashc_cpu_kernels *kern, uint16_t *dst, int64_t ld, const flashc_tensor *t,
                             int64_t b, int64_t row0, int rows, int pad_rows, int64_t h, int64_t D) {
    const uint16_t *data = (const uint16_t *)t->data;
    const int64_t sd = t->stride[3], pairs = (D + 1) / 2;
    if (sd == 1 && D % 2 == 0 && kern->bf16 && kern->bf16->pairs_t) {
        kern->bf16->pairs_t(rows, pad_rows, (int)pairs, data + flashc_cpu_offset(t, b, row0, h), t->stride[1], dst,
                            2 * ld);
        return;
    }
    if (sd == 1 && D % 2 == 0) { /* each pair is a 32-bit word of its row: a transpose of words */
        const uint32_t zero = 0;
        for (int r = 0; r < pad_rows; r++) {
            const uint16_t *row = r < rows ? data + flashc_cpu_offset(t, b, row0 + r, h) : NULL;
            for (int64_t q = 0; q < pairs; q++)
                memcpy(dst + 2 * (q * ld + r), row ? (const void *)(row + 2 * q) : (const void *)&zero, 4);
        }
        return;
    }
    for (int r = 0; r < pad_rows; r++) {
        const int64_t off = r < rows ? flashc_cpu_offset(t, b, row0 + r, h) : 0;
        for (int64_t d = 0; d < 2 * pairs; d++)
            dst[(d / 2) * 2 * ld + 2 * r + d % 2] = r < rows && d < D ? data[off + d * sd] : 0;
    }
}

/* One row of D values at element offset off of t, scaled and converted to its dtype. bf16 with unit stride takes
 * flashc_f32_to_bf16's rounding without its branch (a select), a loop the compiler vectorizes: the backward stores
 * its three gradients so, and the scalar loop had taken 4-5% of a bf16 backward at N 1024 (perf, 2-core Zen 4). */
static void store_row(const flashc_tensor *t, int64_t off, int64_t D, const float *row, float scale) {
    const int64_t sd = t->stride[3];
    if (t->dtype == FLASHC_DTYPE_BF16 && sd == 1) {
        uint16_t *dst = (uint16_t *)t->data + off;
        for (int64_t d = 0; d < D; d++) {
            const float f = row[d] * scale;
            uint32_t u;
            memcpy(&u, &f, sizeof u);
            const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
            dst[d] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
        }
        return;
    }
    switch (t->dtype) {
    case FLASHC_DTYPE_F32:
        for (int64_t d = 0; d < D; d++) ((float *)t->data)[off + d * sd] = row[d] * scale;
        break;
    case FLASHC_DTYPE_F16:
        for (int64_t d = 0; d < D; d++) ((uint16_t *)t->data)[off + d * sd] = flashc_f32_to_f16(row[d] * scale);
        break;
    default:
        for (int64_t d = 0; d < D; d++) ((uint16_t *)t->data)[off + d * sd] = flashc_f32_to_bf16(row[d] * scale);
        break;
    }
}

void flashc_cpu_kv_store_rows(const flashc_problem *p, const flashc_tensor *t, int64_t b, int64_t row0, int rows,
                              int64_t h, const float *src, int64_t ld, float scale) {
    const int64_t tb = flashc_cpu_tensor_batch(p, b);
    for (int r = 0; r < rows; r++)
        store_row(t, flashc_kv_offset(p, t, b, tb, row0 + r, h), p->D, src + (size_t)r * ld, scale);
}

void flashc_cpu_store_rows(const flashc_tensor *t, int64_t b, int64_t row0, int rows, int64_t h, int64_t D,
                           const float *src, int64_t ld, float scale) {
    for (int r = 0; r < rows; r++) store_row(t, flashc_cpu_offset(t, b, row0 + r, h), D, src + (size_t)r * ld, scale);
}

/* ---- masks --------------------------------------------------------------------------------------------- */

int flashc_cpu_tile_visible(const flashc_problem *p, int64_t b, int64_t h, int64_t i0, int rows, int64_t j0,
                            int cols) {
    if (!p->block_mask) return 1;
    int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
    const uint8_t *m = p->block_mask + (mb * p->bm_heads + mh) * p->bm_nqb * p->bm_nkb;
    for (int64_t qb = i0 / p->bm_q; qb <= (i0 + rows - 1) / p->bm_q; qb++)
        for (int64_t kb = j0 / p->bm_k; kb <= (j0 + cols - 1) / p->bm_k; kb++)
            if (m[qb * p->bm_nkb + kb]) return 1;
    return 0;
}

void flashc_cpu_block_key_range(const flashc_problem *p, int64_t i0, int rows, int64_t nq, int64_t nk, int64_t *lo,
                                int64_t *hi) {
    int64_t l0, h0, l1, h1;
    flashc_row_key_range(p, i0, nq, nk, &l0, &h0);
    flashc_row_key_range(p, i0 + rows - 1, nq, nk, &l1, &h1);
    *lo = l0 < 0 ? 0 : l0;
    *hi = h1 > nk ? nk : h1;
}

int flashc_cpu_row_ranges(const flashc_problem *p, int64_t nq, int64_t nk, int64_t i0, int rows, int64_t j0,
                          int cols, int *lo, int *hi) {
    int partial = 0;
    for (int r = 0; r < rows; r++) {
        int64_t l, h;
        flashc_row_key_range(p, i0 + r, nq, nk, &l, &h);
        l -= j0;
        h -= j0;
        lo[r] = l < 0 ? 0 : l > cols ? cols : (int)l;
        hi[r] = h < 0 ? 0 : h > cols ? cols : (int)h;
        partial |= lo[r] > 0 || hi[r] < cols;
    }
    return partial;
}

int flashc_cpu_tile_needs_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                                   int64_t i0, int rows, int64_t j0, int cols) {
    if (p->softcap > 0.0f || flashc_alibi_slope(p, b, h) != 0.0f) return 1;
    int64_t lo_last, hi_last, lo_first, hi_first;
    flashc_row_key_range(p, i0 + rows - 1, nq, nk, &lo_last, &hi_last);
    flashc_row_key_range(p, i0, nq, nk, &lo_first, &hi_first);
    if (lo_last > j0 || hi_first < j0 + cols) return 1; /* lo and hi grow with the row */
    if (p->block_mask) {
        int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
        const uint8_t *m = p->block_mask + (mb * p->bm_heads + mh) * p->bm_nqb * p->bm_nkb;
        for (int64_t qb = i0 / p->bm_q; qb <= (i0 + rows - 1) / p->bm_q; qb++)
            for (int64_t kb = j0 / p->bm_k; kb <= (j0 + cols - 1) / p->bm_k; kb++)
                if (!m[qb * p->bm_nkb + kb]) return 1;
    }
    return 0;
}

void flashc_cpu_score_epilogue(const flashc_problem *p, int64_t b, int64_t h, int64_t nq, int64_t nk,
                               int64_t i0, int rows, int64_t j0, int cols, float *st, int64_t ld, float *tanh_out) {
    const float cap = p->softcap, slope2 = flashc_alibi_slope(p, b, h) * FLASHC_LOG2E;
    const int64_t diag = flashc_seq_diag(p, nq, nk); /* row i's ALiBi distance to key j: |i + diag - j| */
    const float neg_inf = -INFINITY;
    const uint8_t *mbase = NULL;
    if (p->block_mask) {
        int64_t mb = p->bm_batch == 1 ? 0 : b, mh = p->bm_heads == 1 ? 0 : h;
        mbase = p->block_mask + (mb * p->bm_heads + mh) * p->bm_nqb * p->bm_nkb;
    }
    /* Each row's visible columns [lo, hi) of this tile, once per tile rather than once per element, as ints so the
     * column loop below vectorizes. */
    int lo[FLASHC_CPU_MAX_BR], hi[FLASHC_CPU_MAX_BR];
    flashc_cpu_row_ranges(p, nq, nk, i0, rows, j0, cols, lo, hi);
    /* lo and hi grow with the row, so column c's masked rows are a prefix (hi <= c, rows before ra) and a suffix
     * (lo > c, rows from rb on), and both bounds grow with c: only those rows are written, where a select over every
     * row of every column cost the causal bf16 forward about 5% of its time at N 512 */
    int ra = 0, rb = 0;
    for (int c = 0; c < cols; c++) {
        const int64_t j = j0 + c;
        float *col = st + (size_t)c * ld;
        float *tcol = tanh_out ? tanh_out + (size_t)c * ld : NULL;
        if (cap > 0.0f) {
            for (int r = 0; r < rows; r++) {
                float t = tanhf(col[r] / cap);
                if (tcol) tcol[r] = t;
                col[r] = cap * t * FLASHC_LOG2E;
            }
        }
        if (slope2 != 0.0f)
            for (int r = 0; r < rows; r++) col[r] -= slope2 * (float)llabs(i0 + r + diag - j);
        while (ra < rows && hi[ra] <= c) ra++;
        while (rb < rows && lo[rb] <= c) rb++;
        for (int r = 0; r < ra; r++) col[r] = neg_inf;
        for (int r = rb; r < rows; r++) col[r] = neg_inf;
        if (mbase)
            for (int r = 0; r < rows; r++)
                if (!mbase[((i0 + r) / p->bm_q) * p->bm_nkb + j / p->bm_k]) col[r] = neg_inf;
    }
}
