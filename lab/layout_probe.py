#!/usr/bin/env python3
"""Decode time against the cache's memory layout (one question: is the contiguous cache slower than a shuffled page
pool of the same bytes because of where the bytes sit?). Same timing as bench/decode.py (graphs, turns).

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 lab/layout_probe.py --B 16 --N 32768
"""
import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, os.path.join(here, "..", "bench"))
import flashc  # noqa: E402
from decode import graph_of, time_graphs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--B", type=int, default=16)
ap.add_argument("--N", type=int, default=32768)
ap.add_argument("--runs", type=int, default=10)
ap.add_argument("--calls", type=int, default=20)
a = ap.parse_args()
B, N, H, Hkv, D, dt = a.B, a.N, 32, 8, 128, torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, 1, H, D, device="cuda", dtype=dt, generator=g)
kc, vc = (torch.randn(B, N, Hkv, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
ref = flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
fns, same = {}, {}


def add(name, fn):
    fns[name] = fn
    same[name] = torch.equal(fn(), ref)


add("contiguous", lambda: flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True))
for pad in (16, 128):
    kp, vp = (torch.empty(B, N + pad, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
    kp[:, :N], vp[:, :N] = kc, vc
    add(f"rows padded +{pad}", lambda kp=kp, vp=vp: flashc.flash_attn_with_kvcache(
        q, kp[:, :N], vp[:, :N], cache_seqlens=lens, causal=True))
for ps in (128, 256, 1024):
    for order in ("shuffled", "in order"):
        pages = N // ps
        perm = (torch.randperm(B * pages, generator=torch.Generator().manual_seed(ps)) if order == "shuffled"
                else torch.arange(B * pages)).to("cuda", torch.int32)
        table = perm.view(B, pages)
        pools = []
        for src in (kc, vc):
            pool = torch.empty(B * pages, ps, Hkv, D, device="cuda", dtype=dt)
            pool[table.flatten().long()] = src.reshape(B * pages, ps, Hkv, D)
            pools.append(pool)
        add(f"pages {ps} {order}", lambda p=pools, t=table: flashc.flash_attn_with_kvcache(
            q, p[0], p[1], cache_seqlens=lens, causal=True, block_table=t))
qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
graphs = {n: graph_of(f, a.calls) for n, f in fns.items()}
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    graphs["cuDNN"] = graph_of(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                               a.calls)
t = time_graphs(graphs, a.runs, a.calls)
print(f"# {torch.cuda.get_device_name()}, B {B} N {N} H {H} Hkv {Hkv} D {D} bf16, median us per call")
for n in graphs:
    print(f"{n:24s} {t[n]:8.1f} us  {t[n] / t['contiguous']:.3f}x contiguous  {'' if n == 'cuDNN' else ('same bits' if same[n] else 'DIFFERS')}")
