#!/usr/bin/env python3
"""Decode time against where the cache sits: the same K/V bytes copied into --copies fresh allocations, flashc
(flash_attn_with_kvcache) and cuDNN (SDPA) timed on each in turns (bench/decode.py's graphs). The question: does
flashc's time over cuDNN's move with the cache's addresses (paged pools of the same bytes ran 0.88-1.15x the
contiguous time in three runs), or is it the same on every copy?

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 lab/alloc_probe.py --B 16 --N 32768 --copies 4
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
ap.add_argument("--copies", type=int, default=4)
ap.add_argument("--runs", type=int, default=10)
ap.add_argument("--calls", type=int, default=20)
a = ap.parse_args()
B, N, H, Hkv, D, dt = a.B, a.N, 32, 8, 128, torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, 1, H, D, device="cuda", dtype=dt, generator=g)
k0, v0 = (torch.randn(B, N, Hkv, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
graphs, caches = {}, []
for c in range(a.copies):
    if c:
        torch.empty(c * 7 << 20, dtype=torch.uint8, device="cuda")  # shift the next allocation
    kc, vc = k0.clone(), v0.clone()
    caches.append((kc, vc))
    graphs[f"flashc {c}"] = graph_of(lambda kc=kc, vc=vc: flashc.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, causal=True), a.calls)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        graphs[f"cuDNN {c}"] = graph_of(lambda qt=qt, kt=kt, vt=vt: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=True), a.calls)
t = time_graphs(graphs, a.runs, a.calls)
print(f"# {torch.cuda.get_device_name()}, B {B} N {N} H {H} Hkv {Hkv} D {D} bf16, median us per call")
for c, (kc, vc) in enumerate(caches):
    print(f"copy {c} (k at {kc.data_ptr():#x}, v at {vc.data_ptr():#x}): flashc {t[f'flashc {c}']:.1f} us, "
          f"cuDNN {t[f'cuDNN {c}']:.1f} us, cuDNN / flashc {t[f'cuDNN {c}'] / t[f'flashc {c}']:.3f}")
