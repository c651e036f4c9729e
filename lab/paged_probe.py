#!/usr/bin/env python3
"""One decode shape through flash_attn_with_kvcache, contiguous or paged, for Nsight Compute: a few warm-up calls,
then --repeat calls (profile with --launch-skip over the warm-up).

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 lab/paged_probe.py --B 16 --N 32768 --page 16
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--B", type=int, default=16)
ap.add_argument("--N", type=int, default=32768)
ap.add_argument("--H", type=int, default=32)
ap.add_argument("--Hkv", type=int, default=8)
ap.add_argument("--D", type=int, default=128)
ap.add_argument("--page", type=int, default=0, help="0: contiguous cache")
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--repeat", type=int, default=1)
a = ap.parse_args()
dt = torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(a.B, 1, a.H, a.D, device="cuda", dtype=dt, generator=g)
kc, vc = (torch.randn(a.B, a.N, a.Hkv, a.D, device="cuda", dtype=dt, generator=g) for _ in range(2))
lens = torch.full((a.B,), a.N, device="cuda", dtype=torch.int32)
kw = {}
if a.page:
    pages = (a.N + a.page - 1) // a.page
    perm = torch.randperm(a.B * pages, generator=torch.Generator().manual_seed(a.page)).to("cuda", torch.int32)
    table = perm.view(a.B, pages)
    pools = []
    for src in (kc, vc):
        pool = torch.zeros(a.B * pages, a.page, a.Hkv, a.D, device="cuda", dtype=dt)
        padded = torch.zeros(a.B, pages * a.page, a.Hkv, a.D, device="cuda", dtype=dt)
        padded[:, :a.N] = src
        pool[table.flatten().long()] = padded.view(a.B * pages, a.page, a.Hkv, a.D)
        pools.append(pool)
    kc, vc = pools
    kw["block_table"] = table
for _ in range(a.warmup + a.repeat):
    flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, **kw)
torch.cuda.synchronize()
print("done", a)
