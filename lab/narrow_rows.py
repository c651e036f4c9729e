"""lab: the Hopper forward's d 64 time at short and long rows through flash_attn_func, for the narrow tile's rule
(fwd_sm90.h, FC90_NARROW_NQ and FC90_NARROW_PAD): H 8, bf16, B = max(4, 16384 / Nq); CUDA events around 20 calls
in a row (so that the GPU, not the host, sets the pace from about 50 us a call), median of 15 such runs.
    FLASHC_LIBRARY=<build>/libflashc.so PYTHONPATH=python python3 lab/narrow_rows.py [causal|noncausal]"""
import statistics
import sys

import torch

import flashc

H, D = 8, 64
causal = len(sys.argv) > 1 and sys.argv[1] == "causal"
shapes = [(256, 8192), (1024, 1024), (512, 4096)] if causal else \
    [(64, 8192), (128, 8192), (256, 8192), (640, 4096), (512, 4096), (1024, 1024)]
for nq, nk in shapes:
    B = max(4, 16384 // nq)
    q = torch.randn(B, nq, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, nk, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, nk, H, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        flashc.flash_attn_func(q, k, v, causal=causal)
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            flashc.flash_attn_func(q, k, v, causal=causal)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 20)
    pairs = sum(min(nk, i + nk - nq + 1) for i in range(nq)) if causal else nq * nk
    us = statistics.median(ts)
    print("%s B %3d Nq %5d Nk %5d  %8.1f us  %6.1f TFLOP/s" % ("causal" if causal else "full", B, nq, nk, us,
                                                             4 * B * H * D * pairs / us / 1e6))
    del q, k, v
