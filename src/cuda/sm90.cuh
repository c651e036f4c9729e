/*
 * sm90.cuh - the Hopper (sm_90a) building blocks both wgmma kernels use (fwd_sm90.cu, bwd_sm90.cu): mbarriers,
 * named barriers, TMA loads and the tensor maps they read, setmaxnreg, and the wgmma instructions with their
 * shared-memory descriptors. Every operand tile is in the 128-byte swizzled layout that TMA writes with
 * CU_TENSOR_MAP_SWIZZLE_128B: a tile of R rows and c columns (16-bit) is c / 64 column chunks, each R rows x 128
 * bytes, the 16-byte pieces of row r XORed with r % 8, every chunk 1024-byte aligned. C++ (nvcc) only.
 */
#ifndef FLASHC_CUDA_SM90_CUH
#define FLASHC_CUDA_SM90_CUH

#include "common.cuh" /* fc_pack2 */

#include <cuda.h>         /* CUtensorMap and its enums: types only, the driver function is looked up at run time */
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled */
#include <cuda_runtime.h>
#include <stdint.h>

/* A warpgroup: four warps that issue wgmma together (and the unit of setmaxnreg). */
#define FC90_WG_THREADS 128
/* The 128-byte swizzle's row: 64 16-bit columns. A tile of R rows and c columns is c / 64 chunks of R rows of
 * FC90_SW_ROW bytes; the k16 steps of a K-major operand advance 32 bytes within a row. */
#define FC90_SW_ROW 128
#define FC90_SW_COLS 64

/* Only the sm_90a pass has wgmma and setmaxnreg; elsewhere the kernel compiles to an empty body that the host
 * never launches (flashc_fwd_sm90_available checks which binary the GPU loaded). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FC90_DEVICE 1
#else
#define FC90_DEVICE 0
#endif

#if FC90_DEVICE

/* ---- mbarriers ------------------------------------------------------------------------------------------ */

/* mbarrier.init: a phase completes after `count` arrivals (and all bytes announced with expect_tx). */
static __device__ __forceinline__ void fc90_bar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* fence.mbarrier_init: makes the initializations visible to the other threads (and to TMA) before use. */
static __device__ __forceinline__ void fc90_bar_init_fence(void) {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* mbarrier.arrive.expect_tx: one arrival, and the current phase also waits for `bytes` of TMA writes. */
static __device__ __forceinline__ void fc90_bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/* mbarrier.arrive: one arrival (release: this thread's earlier reads of the slot are done). */
static __device__ __forceinline__ void fc90_bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* mbarrier.try_wait.parity in a loop: returns once the phase of the given parity has completed (acquire: the
 * TMA bytes / the arriving threads' accesses of that phase are visible). The label is local to the braces. */
static __device__ __forceinline__ void fc90_bar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n"
                 ".reg .pred fc90_done;\n"
                 "fc90_retry:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 fc90_done, [%0], %1;\n"
                 "@!fc90_done bra fc90_retry;\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/*
 * A ring of ST slots, each with a "full" and an "empty" mbarrier: the producer waits until a slot is empty, loads
 * into it (its expect_tx and the TMA bytes complete the full barrier's phase), the consumers wait until it is full
 * and release it once their reads are complete. Uses are numbered over the block's whole run: use u takes slot
 * u % ST in round u / ST, whose phase has parity (u / ST) & 1; the producer waits for the empty phase of the round
 * before (parity flipped), which a fresh mbarrier reports complete at once, so round 0 needs no releases. The use
 * count is any integer type (U); a kernel keeps the type its arithmetic was tuned with.
 */
template <int ST>
struct fc90_ring {
    uint32_t full, empty; /* shared-memory addresses of slot 0's mbarriers; slot s's are 8 s bytes further */

    template <typename U>
    __device__ __forceinline__ U slot(U u) const { return u % ST; }
    template <typename U>
    __device__ __forceinline__ uint32_t full_bar(U u) const { return full + 8 * (u % ST); }
    /* One thread, before use: the arrivals each phase of a full / an empty barrier takes. */
    __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
        for (int s = 0; s < ST; ++s) {
            fc90_bar_init(full + 8 * s, full_arrivals);
            fc90_bar_init(empty + 8 * s, empty_arrivals);
        }
    }
    /* Producer: returns once use u's slot is free, then announces its bytes (one arrival); the TMA loads
     * complete on full_bar(u). */
    template <typename U>
    __device__ __forceinline__ void wait_empty(U u) const {
        fc90_bar_wait(empty + 8 * (u % ST), ((u / ST) & 1) ^ 1);
    }
    template <typename U>
    __device__ __forceinline__ void expect(U u, uint32_t bytes) const { fc90_bar_expect(full_bar(u), bytes); }
    /* An arrival on use u's full barrier without bytes (a producer thread that wrote the slot itself). */
    template <typename U>
    __device__ __forceinline__ void arrive_full(U u) const { fc90_bar_arrive(full_bar(u)); }
    /* Consumers: returns once use u's data is in its slot; release: this thread's reads of it are done. */
    template <typename U>
    __device__ __forceinline__ void wait_full(U u) const { fc90_bar_wait(full_bar(u), (u / ST) & 1); }
    template <typename U>
    __device__ __forceinline__ void release(U u) const { fc90_bar_arrive(empty + 8 * (u % ST)); }
    /* The same by slot, for a consumer that keeps the slot of a use it releases later. */
    __device__ __forceinline__ void release_slot(uint32_t s) const { fc90_bar_arrive(empty + 8 * s); }
};

/* ---- named barriers between the two consumer warpgroups --------------------------------------------------- */

/* bar.sync id, n: returns once n threads have reached barrier id: for a turn, this warpgroup's 128 by syncing
 * here and the previous one's by bar.arrive (which does not wait). Id 0 is __syncthreads'. */
static __device__ __forceinline__ void fc90_nbar_sync(int id, int n = 256) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
static __device__ __forceinline__ void fc90_nbar_arrive(int id) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

/* ---- shared memory written by the threads, read by the async proxy ---------------------------------------- */

/* Makes this thread's generic-proxy shared-memory writes visible to later async-proxy reads (wgmma, TMA stores). */
static __device__ __forceinline__ void fc90_fence_proxy_async(void) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* stmatrix.m8n8.x4.b16: lanes 8j..8j+7 give the shared addresses of matrix j's 8 rows (16 bytes each); register j
 * of each lane holds matrix j's pair in row lane / 4, columns 2 (lane % 4), +1: the layout of an mma accumulator's
 * packed pairs. One instruction for what takes four 4-byte stores per lane. */
static __device__ __forceinline__ void fc90_stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                        uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

/* ldmatrix.m8n8.x4.b16: stmatrix's inverse, with the same addresses and registers. */
static __device__ __forceinline__ void fc90_ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/*
 * Varlen: rows [valid, rows) of a swizzled tile of `rows` rows and D columns (D / 64 chunks) at shared address
 * tile hold the next sequence's values (TMA zero-fills only past the packed tensor). Their P (and dS) are 0, but
 * 0 x inf or NaN is NaN, so each consumer warpgroup clears them (16-byte zeros over whole rows) before its products
 * read them, fences the writes to the async proxy and syncs its 128 threads t on named barrier bar. Consumers that
 * share the tile clear the same rows with the same zeros.
 */
template <int D>
static __device__ __forceinline__ void fc90_clear_rows(uint32_t tile, int rows, int valid, int bar, int t,
                                                       bool groups = false) {
    const int n = rows - valid, pieces = n * (D / FC90_SW_COLS) * 8; /* 8 pieces of 16 bytes per chunk row */
    /* chunk after chunk, or (groups: fc90_map_pages' layout) 8-row groups of every chunk, group after group */
    const uint32_t cs = groups ? 1024 : rows * FC90_SW_ROW, gs = groups ? (D / FC90_SW_COLS) * 1024 : 1024;
    for (int e = t; e < pieces; e += FC90_WG_THREADS) {
        const int piece = e % 8, r = valid + (e / 8) % n, c = e / 8 / n;
        const uint32_t addr = tile + c * cs + (r / 8) * gs + (r % 8) * FC90_SW_ROW + piece * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
    }
    fc90_fence_proxy_async();
    fc90_nbar_sync(bar, FC90_WG_THREADS);
}

/* ---- TMA ------------------------------------------------------------------------------------------------- */

/* cp.async.bulk.tensor.4d: the box of the tensor map at coordinates (c0 innermost, .., c3) goes to shared memory
 * at dst, laid out (swizzled) as the map says, out-of-bounds elements zero; its bytes complete_tx on bar. The
 * map is a __grid_constant__ kernel parameter, passed by its generic address. */
static __device__ __forceinline__ void fc90_tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0,
                                                     int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}
/* The same from a 5-dimensional map (fc90_map with chunks: the column chunks of a row as a dimension). */
static __device__ __forceinline__ void fc90_tma_load5(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0,
                                                      int c1, int c2, int c3, int c4) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
                 : "memory");
}
/* prefetch.tensormap: brings the map's 128 bytes into the descriptor cache ahead of the first load. */
static __device__ __forceinline__ void fc90_tma_prefetch(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)map) : "memory");
}

/* ---- registers ------------------------------------------------------------------------------------------- */

/* setmaxnreg: the whole warpgroup moves its per-thread register budget to N (dec frees, inc waits until the
 * block's pool can give). */
template <int N>
static __device__ __forceinline__ void fc90_regs_dec(void) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
static __device__ __forceinline__ void fc90_regs_inc(void) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* ---- wgmma ----------------------------------------------------------------------------------------------- */

/* wgmma.fence: orders this warpgroup's earlier register writes (accumulators, A fragments) before the next
 * wgmma reads them. commit_group closes the wgmmas issued since the last commit into a group; wait_group N
 * returns when at most N groups are still in flight (their accumulators are then written). */
static __device__ __forceinline__ void fc90_wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void fc90_wgmma_commit(void) {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void fc90_wgmma_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* An empty volatile asm that takes each register in and out: the compiler must have the value ready at this
 * point of the instruction stream and may not move its uses across. Placed before wgmma.fence (inputs written
 * by ordinary instructions) and after wgmma.wait_group (accumulators written asynchronously); without it the
 * compiler sees the wgmma asm as producing its outputs at issue and could read them before the wait. */
template <int N>
static __device__ __forceinline__ void fc90_pin(float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
template <int N>
static __device__ __forceinline__ void fc90_pin(uint32_t (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(x[i][0]), "+r"(x[i][1]), "+r"(x[i][2]), "+r"(x[i][3])::"memory");
}

/*
 * Ends the basic block after work whose results are the bits b (dropout's keep bits, computed while a wgmma runs),
 * so that ptxas cannot hoist the wgmma.wait_group that follows above that work (it schedules within a block, and
 * would otherwise move independent integer work after the wait, onto the critical path). The branch depends on a
 * value known only at run time; what it guards (a fence) changes nothing when taken.
 */
template <int N>
static __device__ __forceinline__ void fc90_block_end_bits(uint32_t (&b)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(b[i])::"memory");
    if (b[0] == 0x9e3779b9u) asm volatile("membar.cta;\n" ::: "memory");
}

/*
 * Shared-memory matrix descriptor of wgmma: bits 0-13 start address >> 4, 16-29 leading-dimension byte offset
 * >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 base offset (0: tiles are 1024-byte aligned), 62-63
 * swizzle mode (1: 128-byte). For a 128B-swizzled operand:
 *   K-major (Q as A, K as B of S = Q K^T: rows of d contiguous): SBO = 1024, the step between 8-row groups;
 *     LBO unused (a k16 step, 32 bytes, stays inside one 128-byte row); the k16 steps advance the start
 *     address by 32 bytes inside a 64-column chunk, and by a chunk (rows x 128 bytes) every 4 steps.
 *   MN-major (V as B of O += P V, N = d contiguous): LBO = the step between 64-column chunks of d (bc x 128
 *     bytes), SBO = 1024, the step between 8-key groups; a k16 step (16 keys) advances 2048 bytes.
 */
static __device__ __forceinline__ uint64_t fc90_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32 | (uint64_t)1 << 62;
}

#define FC90_ACC8(d, i)                                                                                      \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define FC90_ACC16(d) FC90_ACC8(d, 0), FC90_ACC8(d, 8)
#define FC90_ACC32(d, i) FC90_ACC8(d, i), FC90_ACC8(d, i + 8), FC90_ACC8(d, i + 16), FC90_ACC8(d, i + 24)
#define FC90_ACC40(d) FC90_ACC32(d, 0), FC90_ACC8(d, 32)
#define FC90_ACC64(d) FC90_ACC32(d, 0), FC90_ACC32(d, 32)
#define FC90_ACC96(d) FC90_ACC32(d, 0), FC90_ACC32(d, 32), FC90_ACC32(d, 64)
#define FC90_ACC128(d) FC90_ACC32(d, 0), FC90_ACC32(d, 32), FC90_ACC32(d, 64), FC90_ACC32(d, 96)
#define FC90_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FC90_REGS32                                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FC90_REGS40                                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FC90_REGS64                                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FC90_REGS96                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
    "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
    "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define FC90_REGS128                                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
    "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
    "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, " \
    "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "      \
    "%123, %124, %125, %126, %127}"
/* D = A B (+ D when scale-d is true), A and B from descriptors, both K-major (transpose bits TR = "0, 0") or both
 * MN-major ("1, 1"). */
#define FC90_SS(N, TY, REGS, DA, DB, SC, TR)                                                                 \
    "{\n.reg .pred fc90_acc;\nsetp.ne.b32 fc90_acc, " SC ", 0;\nwgmma.mma_async.sync.aligned.m64n" N          \
    "k16.f32." TY "." TY " " REGS ", " DA ", " DB ", fc90_acc, 1, 1, " TR ";\n}\n"
/* D += A B, A from four registers, B from a descriptor, N-major (transpose bit 1). */
#define FC90_RS(N, TY, REGS, A0, DB)                                                                         \
    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS ", {" A0 "}, " DB ", 1, 1, 1, 1;\n"
/* The f16 and bf16 forms of one shape (the type is part of the instruction's text). */
#define FC90_SS_ASM(N, REGS, ACC, DA, DB, SC)                                                                \
    if constexpr (BF && !MN)                                                                                 \
        asm volatile(FC90_SS(N, "bf16", REGS, DA, DB, SC, "0, 0") : ACC : "l"(da), "l"(db), "r"(acc));       \
    else if constexpr (!MN)                                                                                  \
        asm volatile(FC90_SS(N, "f16", REGS, DA, DB, SC, "0, 0") : ACC : "l"(da), "l"(db), "r"(acc));        \
    else if constexpr (BF)                                                                                   \
        asm volatile(FC90_SS(N, "bf16", REGS, DA, DB, SC, "1, 1") : ACC : "l"(da), "l"(db), "r"(acc));       \
    else                                                                                                     \
        asm volatile(FC90_SS(N, "f16", REGS, DA, DB, SC, "1, 1") : ACC : "l"(da), "l"(db), "r"(acc))
#define FC90_RS_ASM(N, REGS, ACC, A0, DB)                                                                    \
    if constexpr (BF)                                                                                        \
        asm volatile(FC90_RS(N, "bf16", REGS, A0, DB) : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db)); \
    else                                                                                                     \
        asm volatile(FC90_RS(N, "f16", REGS, A0, DB) : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

/*
 * wgmma.mma_async.m64nNk16.f32 with A and B in shared memory (S = Q K^T: N is the key tile bc), both K-major,
 * with MN = 1 both MN-major (the backward's dQ = dS K, dS stored keys x queries and K keys x d). Accumulator
 * layout (per warpgroup, 64 x N): warp w holds rows 16w..16w+15; for each n8 block j, thread lane holds d[4j],
 * d[4j+1] at row 16w + lane/4, columns 8j + 2(lane%4) + {0, 1}, and d[4j+2], d[4j+3] at row 16w + lane/4 + 8,
 * same columns.
 */
template <int N, int BF, int MN = 0>
static __device__ __forceinline__ void fc90_mma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
    static_assert(N == 32 || N == 64 || N == 80 || N == 128 || N == 192, "wgmma N: a tile of the tile tables");
    if constexpr (N == 192) {
        FC90_SS_ASM("192", FC90_REGS96, FC90_ACC96(d), "%96", "%97", "%98");
    } else if constexpr (N == 128) {
        FC90_SS_ASM("128", FC90_REGS64, FC90_ACC64(d), "%64", "%65", "%66");
    } else if constexpr (N == 80) {
        FC90_SS_ASM("80", FC90_REGS40, FC90_ACC40(d), "%40", "%41", "%42");
    } else if constexpr (N == 64) {
        FC90_SS_ASM("64", FC90_REGS32, FC90_ACC32(d, 0), "%32", "%33", "%34");
    } else {
        FC90_SS_ASM("32", FC90_REGS16, FC90_ACC16(d), "%16", "%17", "%18");
    }
}

/*
 * wgmma.mma_async.m64nNk16.f32 with A (64 x 16) in registers (O += P V: N is the head dim): warp w holds rows
 * 16w..16w+15; a[0] = row 16w + lane/4, k 2(lane%4) + {0, 1} (low half first); a[1] = the same k, row + 8;
 * a[2] = row, k + 8; a[3] = row + 8, k + 8. That is the accumulator layout above for the n8 blocks 2c and
 * 2c + 1 of S, so P needs no data movement between the two products.
 */
template <int N, int BF>
static __device__ __forceinline__ void fc90_mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db) {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma N of O: a head dim of the tile table");
    if constexpr (N == 256) {
        FC90_RS_ASM("256", FC90_REGS128, FC90_ACC128(d), "%128, %129, %130, %131", "%132");
    } else if constexpr (N == 128) {
        FC90_RS_ASM("128", FC90_REGS64, FC90_ACC64(d), "%64, %65, %66, %67", "%68");
    } else {
        FC90_RS_ASM("64", FC90_REGS32, FC90_ACC32(d, 0), "%32, %33, %34, %35", "%36");
    }
}

/* An accumulator tile (64 x BC, fp32) rounded to the operand type as wgmma A fragments (fc90_mma_rs): k16 step c
 * takes the accumulator's n8 blocks 2c and 2c + 1 (the forward's P; the backward's P^T and dS^T). */
template <int BC, int BF>
static __device__ __forceinline__ void fc90_pack_p(uint32_t (&pa)[BC / 16][4], const float (&p)[BC / 2]) {
#pragma unroll
    for (int c = 0; c < BC / 16; ++c) {
        pa[c][0] = fc_pack2<BF>(p[8 * c + 0], p[8 * c + 1]);
        pa[c][1] = fc_pack2<BF>(p[8 * c + 2], p[8 * c + 3]);
        pa[c][2] = fc_pack2<BF>(p[8 * c + 4], p[8 * c + 5]);
        pa[c][3] = fc_pack2<BF>(p[8 * c + 6], p[8 * c + 7]);
    }
}

#endif /* FC90_DEVICE */

/* ---- the launch order of both kernels ------------------------------------------------------------------ */

/*
 * Launch index t -> (tile, item): `items` (the forward's (head, sequence) pairs, the backward's (kv head,
 * sequence) pairs) in ng groups of sizes that differ by at most one (rem groups of q + 1, then ng - rem of q),
 * each group's per tiles one after the other, the group's items fastest. Returns the tile's place in its group's
 * order (0 .. per - 1) and sets *item. 32-bit: the launches keep per x items below 2^31.
 */
static __host__ __device__ __forceinline__ uint32_t fc90_group_order(uint32_t t, uint32_t per, uint32_t items,
                                                                     uint32_t ng, uint32_t *item) {
    const uint32_t q = items / ng, rem = items - q * ng, big = rem * (q + 1) * per;
    const uint32_t gs = t < big ? q + 1 : q, t0 = t < big ? t : t - big; /* t0: in its run of equal groups */
    const uint32_t g = t0 / (gs * per), r = t0 - g * gs * per;
    *item = (t < big ? 0 : rem * (q + 1)) + g * gs + r % gs;
    return r / gs;
}

/* Groups for fc90_group_order: enough that none holds more items than have bytes_per_item in half the L2 together;
 * at least one, and one per item where an item alone does not fit (or the L2 size is unknown: 0). */
static inline int fc90_group_count(int64_t items, double bytes_per_item, long long l2_bytes) {
    const double fit = bytes_per_item > 0 ? (double)(l2_bytes / 2) / bytes_per_item : 1.0;
    const int64_t per = fit < 1.0 ? 1 : fit >= (double)items ? items : (int64_t)fit;
    return per > 0 ? (int)((items + per - 1) / per) : 1;
}

/* ---- host ------------------------------------------------------------------------------------------------ */

/* cuTensorMapEncodeTiled from the driver the runtime already loaded (no -lcuda), looked up once. */
static PFN_cuTensorMapEncodeTiled_v12000 fc90_encoder(void) {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return NULL;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)p;
    }();
    return fn;
}

/* TMA wants a 16-byte aligned base and row strides that are positive multiples of 16 bytes below 2^40. */
static int fc90_tma_ok(const void *base, const int64_t extent[3], const int64_t stride[3]) {
    if (!base || (uintptr_t)base % 16) return 0;
    for (int i = 0; i < 3; i++)
        if (extent[i] > 1 && (stride[i] <= 0 || (stride[i] * 2) % 16 || stride[i] * 2 >= (INT64_C(1) << 40)))
            return 0;
    return 1;
}

/*
 * A 16-bit (d, rows, heads, batch) tensor with element strides (1, sn, sh, sb), boxes of 64 columns x box_rows
 * rows, 128-byte swizzle, out-of-bounds elements zero. A dimension of extent 1 is never stepped, so its stride
 * (free in flashc's API) is replaced by the packed one, which meets TMA's rules for any tensor below 1 TB.
 * L2 promotion: 256 bytes (a row's first 64-column chunk fetches the second's with it), or with l2_128 128 bytes,
 * one chunk's row (fwd_sm90.cu takes it for decode, where each K/V row is read once).
 * chunks (d a multiple of 64): a 5-dimensional map (64, rows, d / 64, heads, batch) whose third dimension steps 128
 * bytes along the row, with boxes of every chunk: one load (fc90_tma_load5) fills box_rows rows of all d columns,
 * laid out in shared memory chunk after chunk as the 4-dimensional map's d / 64 boxes would be.
 */
static cudaError_t fc90_map(CUtensorMap *map, const void *base, int bf16, int d, int64_t rows, int64_t heads,
                            int64_t batch, int64_t sn, int64_t sh, int64_t sb, int box_rows, bool l2_128 = false,
                            bool chunks = false) {
    const PFN_cuTensorMapEncodeTiled_v12000 enc = fc90_encoder();
    if (!enc) return cudaErrorNotSupported;
    if (chunks && d % 64) return cudaErrorInvalidValue;
    const int64_t ext[4] = {d, rows, heads, batch}, el[3] = {sn, sh, sb};
    cuuint64_t dim[5], str[4];
    int64_t packed = (int64_t)d * 2;
    for (int i = 0; i < 4; i++) dim[i] = (cuuint64_t)ext[i];
    for (int i = 0; i < 3; i++) {
        const int64_t s = ext[i + 1] > 1 ? el[i] * 2 : packed;
        if (s >= (INT64_C(1) << 40)) return cudaErrorInvalidValue;
        str[i] = (cuuint64_t)s;
        packed = s < (INT64_C(1) << 40) / ext[i + 1] ? s * ext[i + 1] : INT64_C(1) << 40;
    }
    cuuint32_t box[5] = {64, (cuuint32_t)box_rows, 1, 1, 1};
    const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
    if (chunks) { /* (64, rows, d / 64, heads, batch): the chunk dimension between the rows and the heads */
        dim[0] = 64;
        dim[4] = dim[3];
        dim[3] = dim[2];
        dim[2] = (cuuint64_t)(d / 64);
        str[3] = str[2];
        str[2] = str[1];
        str[1] = 128;
        box[2] = (cuuint32_t)(d / 64);
    }
    const CUresult r = enc(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                           chunks ? 5 : 4, (void *)base, dim, str, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           CU_TENSOR_MAP_SWIZZLE_128B,
                           l2_128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/*
 * A paged 16-bit pool (d, page_size, heads, num_pages), element strides (1, sn, sh, sb) with sb = page_size sn (the
 * pages one after another in rows), as the 5-dimensional map (64, 8, d / 64, num_pages page_size / 8, heads): 64
 * columns, 8 rows, the column chunk (128 bytes along the row), the 8-row group of the pool (8 sn), the head. A box of
 * box_rows / 8 groups (box_rows a multiple of 8 inside one page) brings box_rows rows of all d columns in one load,
 * laid out group after group, each group's chunks one after another (1024 bytes each): the 8-row group stride is
 * d / 64 x 1024 bytes and the chunk stride 1024, for the descriptors of both products (fwd_sm90.cu's kv_groups).
 * Pages of 16 rows then take one load per page and operand, not one per page and chunk.
 */
static cudaError_t fc90_map_pages(CUtensorMap *map, const void *base, int bf16, int d, int64_t page_size, int64_t heads,
                                  int64_t num_pages, int64_t sn, int64_t sh, int box_rows, bool l2_128) {
    const PFN_cuTensorMapEncodeTiled_v12000 enc = fc90_encoder();
    if (!enc) return cudaErrorNotSupported;
    if (d % 64 || page_size % 8 || box_rows % 8 || box_rows > page_size || box_rows / 8 > 256)
        return cudaErrorInvalidValue;
    const int64_t groups = num_pages * (page_size / 8), gstride = 8 * sn * 2;
    if (groups >= (INT64_C(1) << 31) || gstride >= (INT64_C(1) << 40) || sh * 2 >= (INT64_C(1) << 40))
        return cudaErrorInvalidValue;
    const cuuint64_t dim[5] = {64, 8, (cuuint64_t)(d / 64), (cuuint64_t)groups, (cuuint64_t)heads};
    /* a head dimension of extent 1 is never stepped: the row stride stands in for its (free) stride */
    const cuuint64_t str[4] = {(cuuint64_t)(sn * 2), 128, (cuuint64_t)gstride, (cuuint64_t)(heads > 1 ? sh * 2 : sn * 2)};
    const cuuint32_t box[5] = {64, 8, (cuuint32_t)(d / 64), (cuuint32_t)(box_rows / 8), 1};
    const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
    const CUresult r = enc(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
                           (void *)base, dim, str, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           l2_128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

#endif /* FLASHC_CUDA_SM90_CUH */
