"""lab: the Hopper forward's d 64 causal time at short and long rows through flash_attn_func, for the narrow tile's
rule (fwd_sm90.h, FC90_NARROW_NQ): B 16, H 8, bf16, causal (bottom-right), CUDA events around 50 calls, median.
    FLASHC_LIBRARY=<build>/libflashc.so PYTHONPATH=python python3 lab/narrow_rows.py"""
import statistics

import torch

import flashc

B, H, D = 16, 8, 64
for nq, nk in [(512, 512), (1024, 1024), (512, 4096), (1024, 4096), (256, 8192)]:
    q = torch.randn(B, nq, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, nk, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, nk, H, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        flashc.flash_attn_func(q, k, v, causal=True)
    ts = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        flashc.flash_attn_func(q, k, v, causal=True)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    pairs = sum(min(nk, i + nk - nq + 1) for i in range(nq))
    us = statistics.median(ts)
    print("Nq %5d Nk %5d  %8.1f us  %6.1f TFLOP/s" % (nq, nk, us, 4 * B * H * D * pairs / us / 1e6))
