#!/usr/bin/env python3
"""Decode (one new query per sequence against a KV cache) on the CPU: flashc beside torch's CPU SDPA at the same
thread count, with the machine's memory bandwidth beside them.

    PYTHONPATH=python FLASHC_LIBRARY=build/libflashc.so python3 bench/decode_cpu.py [--threads 1,2] [--nk 1024,8192,32768]

Shapes (B 1, Nq 1): H 32 query heads over Hkv 8 kv heads at D 128 (issue 17's GPU shape) and H 8 over Hkv 2 at D 32
(its CPU baseline), f32 and bf16, the cache full. flashc: flash_attn_with_kvcache with cache_seqlens = Nk (so the
call goes through seqused_k, as a static cache does); torch: scaled_dot_product_attention(enable_gqa=True) on
(B, H, N, D) views of the same tensors. Both through their Python entry points, host time included.

Caches are cold, as in a model whose layers each have their own: every timed call reads the next of enough copies
of the cache that together they span more than --cold-bytes (default 3x this CPU's L3 cache, at least 64 MiB), in
the same rotation for both. Time: median over --runs rounds of the per-call mean of one pass over the copies, the
two libraries in turns. Bandwidth: K+V bytes one call reads over its time; beside it the machine's copy (torch
copy_ of a 512 MiB buffer at the same thread count, read + write bytes over time) and read (torch sum of it).

--pages P,...: flashc again on a paged copy of each cache per page size (pools of (pages, P, Hkv, D) in a shuffled
order, through flash_attn_with_kvcache's block_table), checked bit for bit against the contiguous result and timed in
the same turns; a second table gives paged time over contiguous time.

OMP_WAIT_POLICY defaults to active here (set it to override): on the 2-vCPU dev VM an OpenMP worker that has gone to
sleep between calls took 8-16 ms to wake while other processes ran, for torch and flashc alike (both use libgomp), so
the default policy measured the hypervisor's scheduling rather than either library.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "active")  # before libgomp loads (torch or flashc)
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def l3_bytes():
    try:
        return os.sysconf("SC_LEVEL3_CACHE_SIZE") or 32 << 20
    except (ValueError, OSError):
        return 32 << 20


def bandwidth(threads, nbytes=512 << 20, runs=7):
    """(copy, read) in GB/s at the given torch thread count: copy counts the bytes read plus those written."""
    torch.set_num_threads(threads)
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    copy, read = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        b.copy_(a)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a.sum()
        read.append(time.perf_counter() - t0)
    return 2 * nbytes / min(copy) / 1e9, nbytes / min(read) / 1e9


def time_pair(fns, copies, runs):
    """Median microseconds per call of each fn(i) over passes i = 0 .. copies - 1, in turns."""
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for i in range(copies):
                fn(i)
            times[name].append((time.perf_counter() - t0) * 1e6 / copies)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,%d" % os.cpu_count(), help="thread counts, comma-separated")
    ap.add_argument("--nk", default="1024,8192,32768", help="cache lengths, comma-separated")
    ap.add_argument("--shapes", default="32/8/128,8/2/32", help="H/Hkv/D, comma-separated")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--min-calls", type=int, default=8, help="at least this many calls per timed pass")
    ap.add_argument("--cold-bytes", type=int, default=max(3 * l3_bytes(), 64 << 20))
    ap.add_argument("--pages", default="", help="page sizes to time paged caches at, e.g. 1,16,256")
    ap.add_argument("--no-torch", action="store_true", help="leave torch out of the timed turns (its column shows "
                    "nan): paged-vs-contiguous runs, where torch's calls take most of the time")
    args = ap.parse_args()
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    threads = [int(x) for x in args.threads.split(",")]
    pages = [int(x) for x in args.pages.split(",") if x]
    cpu = flashc.device_name(flashc.BACKEND_CPU, 0) if hasattr(flashc, "device_name") else "cpu"
    print(f"# {cpu}: {os.cpu_count()} cores, L3 {l3_bytes() >> 20} MiB; torch {torch.__version__}, flashc "
          f"{flashc.library_version()} ({flashc.library_path}), kernels {flashc.cpu_features()}")
    print(f"# decode: B 1, Nq 1, cache full (cache_seqlens = Nk), caches cold (copies spanning "
          f"{args.cold_bytes >> 20} MiB), median of {args.runs}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    bw = {}
    for n in threads:
        bw[n] = bandwidth(n)
        print(f"# {n} thread(s): copy {bw[n][0]:.1f} GB/s (read + write), read {bw[n][1]:.1f} GB/s", flush=True)

    rows = []
    for shape in args.shapes.split(","):
        H, Hkv, D = (int(x) for x in shape.split("/"))
        for dname in args.dtypes.split(","):
            dt = dtypes[dname]
            for N in (int(x) for x in args.nk.split(",")):
                kv_bytes = 2 * N * Hkv * D * torch.tensor([], dtype=dt).element_size()
                copies = max(args.min_calls, -(-args.cold_bytes // kv_bytes))
                g = torch.Generator().manual_seed(0)
                q = [torch.randn(1, 1, H, D, generator=g).to(dt) for _ in range(copies)]
                kc = [torch.randn(1, N, Hkv, D, generator=g).to(dt) for _ in range(copies)]
                vc = [torch.randn(1, N, Hkv, D, generator=g).to(dt) for _ in range(copies)]
                lens = torch.full((1,), N, dtype=torch.int32)

                def fc(i):
                    return flashc.flash_attn_with_kvcache(q[i], kc[i], vc[i], cache_seqlens=lens, causal=True)

                def sdpa(i):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q[i].transpose(1, 2), kc[i].transpose(1, 2), vc[i].transpose(1, 2), enable_gqa=True)

                fns = {"flashc": fc} if args.no_torch else {"flashc": fc, "torch": sdpa}
                for ps in pages:
                    fns["paged %d" % ps] = paged_call(q, kc, vc, lens, ps, g)

                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[0].transpose(1, 2).double(), kc[0].transpose(1, 2).double(), vc[0].transpose(1, 2).double(),
                    enable_gqa=True).transpose(1, 2)
                for n in threads:
                    torch.set_num_threads(n)
                    flashc.set_num_threads(n)
                    err = (fc(0).double() - ref).abs().max().item()
                    err_t = (sdpa(0).transpose(1, 2).double() - ref).abs().max().item()
                    same = {ps: torch.equal(fns["paged %d" % ps](0), fc(0)) for ps in pages}
                    t = time_pair(fns, copies, args.runs)
                    t.setdefault("torch", float("nan"))
                    rows.append((H, Hkv, D, dname, N, n, t, kv_bytes, err, err_t, same))
                    print(f"# H {H} Hkv {Hkv} D {D} {dname} Nk {N} threads {n}: flashc {t['flashc']:.0f} us, torch "
                          f"{t['torch']:.0f} us; max |err| flashc {err:.2g}, torch {err_t:.2g}", flush=True)
                del q, kc, vc, fns

    print("\n| H/Hkv/D | dtype | Nk | threads | flashc | torch SDPA | flashc / torch speed | flashc K+V bandwidth "
          "| % of copy | copy (read + write) | read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for H, Hkv, D, dname, N, n, t, kv_bytes, _, _, _ in rows:
        gbs = kv_bytes / t["flashc"] / 1e3
        print(f"| {H}/{Hkv}/{D} | {dname} | {N} | {n} | {t['flashc']:.0f} µs | {t['torch']:.0f} µs | "
              f"{t['torch'] / t['flashc']:.2f} | {gbs:.1f} GB/s | {100 * gbs / bw[n][0]:.0f}% | {bw[n][0]:.1f} GB/s | "
              f"{bw[n][1]:.1f} GB/s |")
    if pages:
        print("\n| H/Hkv/D | dtype | Nk | threads | flashc contiguous | " +
              " | ".join("paged %d (time / contiguous)" % ps for ps in pages) + " |")
        print("|---|---|---|---|---|" + "---|" * len(pages))
        for H, Hkv, D, dname, N, n, t, _, _, _, same in rows:
            cells = ["%.0f µs (%.2f%s)" % (t["paged %d" % ps], t["paged %d" % ps] / t["flashc"],
                                           "" if same[ps] else ", DIFFERS") for ps in pages]
            print(f"| {H}/{Hkv}/{D} | {dname} | {N} | {n} | {t['flashc']:.0f} µs | " + " | ".join(cells) + " |")
    return 0


def paged_call(q, kc, vc, lens, ps, g):
    """fn(i): flash_attn_with_kvcache on copy i of the cache as a pool of pages of ps rows in a shuffled order."""
    N, Hkv, D = kc[0].shape[1:]
    npages = -(-N // ps)
    pools, tables = [], []
    for k, v in zip(kc, vc):
        perm = torch.randperm(npages, generator=g)  # page j of the sequence is pool page perm[j]
        pair = []
        for c in (k, v):
            flat = torch.zeros(npages * ps, Hkv, D, dtype=c.dtype)
            flat[:N] = c[0]
            pool = torch.empty(npages, ps, Hkv, D, dtype=c.dtype)
            pool[perm] = flat.view(npages, ps, Hkv, D)
            pair.append(pool)
        pools.append(tuple(pair))
        tables.append(perm.to(torch.int32)[None])

    def fn(i):
        return flashc.flash_attn_with_kvcache(q[i], pools[i][0], pools[i][1], cache_seqlens=lens,
                                              block_table=tables[i], causal=True)
    return fn


if __name__ == "__main__":
    sys.exit(main())
