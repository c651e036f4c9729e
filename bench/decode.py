#!/usr/bin/env python3
"""Decode (one new query per sequence against a KV cache) on the GPU: flashc beside cuDNN and torch's flash backend,
each captured in a CUDA graph so that no host time is counted.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/decode.py [--rows 16x4096,16x32768,1x131072] [--pages 16,256]

Shape (issue 17's): Nq 1, H 32 query heads over Hkv 8 kv heads (GQA), D 128, bf16, the cache full (cache_seqlens =
Nk). flashc: flash_attn_with_kvcache (cache_seqlens given, so the call attends through seqused_k) where the package
has it, else flash_attn_func on the cache. Peers: torch SDPA under the cuDNN and flash backends with enable_gqa, on
(B, H, N, D) views of the same tensors. Time: median of --runs replays of a graph holding --calls calls, in turns
(CUDA events). Bandwidth: the K and V bytes one call reads over its time, beside a device-to-device copy of the same
bytes (the memory-speed ceiling; its bandwidth counts the bytes read and written).
--pages: flashc again on a paged copy of the same cache for each page size (pools of (num_pages, page_size, Hkv, D)
with the pages in a shuffled order, through flash_attn_with_kvcache's block_table), checked bitwise against the
contiguous result and timed in the same turns; the second table gives paged time over contiguous time.
"""
import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def graph_of(fn, calls):
    """fn captured `calls` times in one CUDA graph (after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def time_graphs(graphs, runs, calls):
    """Median microseconds per call of each graph, replayed in turns."""
    times = {name: [] for name in graphs}
    for _ in range(runs):
        for name, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            try:
                b.synchronize()
            except RuntimeError as e:
                raise RuntimeError(f"replaying the graph of {name}: {e}") from e
            times[name].append(a.elapsed_time(b) * 1000.0 / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16x4096,16x32768,1x131072", help="B x Nk pairs")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hkv", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--pages", default="", help="page sizes to time paged caches at, e.g. 1,16,64,256")
    ap.add_argument("--no-peers", action="store_true", help="flashc (and the copy) only")
    args = ap.parse_args()
    H, Hkv, D, dt = args.H, args.Hkv, args.D, torch.bfloat16
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, torch {torch.__version__}, flashc {flashc.library_version()} ({flashc.library_path})")
    print(f"# decode: Nq 1, H {H}, Hkv {Hkv}, D {D}, bf16, CUDA graphs of {args.calls} calls, median of {args.runs}")
    kvcache = getattr(flashc, "flash_attn_with_kvcache", None)
    out_rows = []
    for row in args.rows.split(","):
        B, N = (int(x) for x in row.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=dt, generator=g)
        kc, vc = (torch.randn(B, N, Hkv, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        use_kv = kvcache is not None
        if use_kv:
            try:
                kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
            except NotImplementedError:
                use_kv = False

        def fc():
            if use_kv:
                return kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
            return flashc.flash_attn_func(q, kc, vc, causal=True)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        copy_src = torch.empty(2 * B * N * Hkv * D, device="cuda", dtype=dt)
        copy_dst = torch.empty_like(copy_src)
        graphs = {"flashc": graph_of(fc, args.calls),
                  "copy": graph_of(lambda: copy_dst.copy_(copy_src), args.calls)}
        paged_same = {}
        held = []  # the page pools and tables the paged graphs read
        for ps in (int(x) for x in args.pages.split(",") if x):
            pages = (N + ps - 1) // ps
            perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(ps)).to("cuda", torch.int32)
            table = perm.view(B, pages)
            kp, vp = (torch.zeros(B * pages, ps, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
            for src, pool in ((kc, kp), (vc, vp)):
                padded = torch.zeros(B, pages * ps, Hkv, D, device="cuda", dtype=dt)
                padded[:, :N] = src
                pool[table.flatten().long()] = padded.view(B * pages, ps, Hkv, D)

            def fcp(kp=kp, vp=vp, table=table):
                return kvcache(q, kp, vp, cache_seqlens=lens, causal=True, block_table=table)

            # 0: the same bits (the same kernel); else the largest difference (page sizes the Hopper kernel does not
            # take run the mma.sync kernels, whose rounding differs; tests hold both to the fp64 oracle)
            paged_same[ps] = (fcp().float() - fc().float()).abs().max().item()
            graphs[f"paged {ps}"] = graph_of(fcp, args.calls)
            held.append((kp, vp, table))  # a graph holds no reference to what it reads: keep the pools to its replays
        peers = () if args.no_peers else (("cuDNN", SDPBackend.CUDNN_ATTENTION),
                                          ("torch flash", SDPBackend.FLASH_ATTENTION))
        for name, backend in peers:
            try:
                with sdpa_kernel(backend):
                    graphs[name] = graph_of(sdpa, args.calls)
            except RuntimeError as e:  # a backend that does not take the shape
                print(f"# {name} at {row}: {str(e).splitlines()[0]}")
        # the answer first: flashc against SDPA's math on the same inputs
        ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True)
        err = (fc().float().transpose(1, 2) - ref).abs().max().item()
        t = time_graphs(graphs, args.runs, args.calls)
        kv_bytes = 2 * B * N * Hkv * D * 2
        out_rows.append((row, t, kv_bytes, err, paged_same))
        print(f"# {row}: done ({'flash_attn_with_kvcache' if use_kv else 'flash_attn_func'}; max |flashc - fp32 "
              f"reference| {err:.2g})", flush=True)
    print("\n| B x Nk | flashc | cuDNN | torch flash | flashc / cuDNN speed | flashc K+V bandwidth | copy bandwidth (read + write) |")
    print("|---|---|---|---|---|---|---|")
    for row, t, kv_bytes, _, _ in out_rows:
        def us(name):
            return f"{t[name]:.0f} µs" if name in t else "-"
        ratio = f"{t['cuDNN'] / t['flashc']:.2f}" if "cuDNN" in t else "-"
        print(f"| {row.replace('x', ' × ')} | {us('flashc')} | {us('cuDNN')} | {us('torch flash')} | {ratio} | "
              f"{kv_bytes / t['flashc'] / 1e6:.2f} TB/s | {kv_bytes * 2 / t['copy'] / 1e6:.2f} TB/s |")
    if args.pages:
        sizes = [int(x) for x in args.pages.split(",") if x]
        head = " | ".join(f"paged {ps} (time / contiguous)" for ps in sizes)
        print(f"\n| B x Nk | flashc contiguous | {head} |")
        print("|---|---|" + "---|" * len(sizes))
        for row, t, _, _, same in out_rows:
            cells = []
            for ps in sizes:
                tp = t[f"paged {ps}"]
                diff = '' if same[ps] == 0 else f', another kernel: differs by {same[ps]:.1g} at most'
                cells.append(f"{tp:.0f} µs ({tp / t['flashc']:.2f}{diff})")
            print(f"| {row.replace('x', ' × ')} | {t['flashc']:.0f} µs | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
