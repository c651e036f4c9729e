#!/usr/bin/env python3
"""Where a backward call's GPU time goes, kernel by kernel: flashc.attention_backward beside torch SDPA's cuDNN
backward (autograd through a retained graph), at sweep shapes (hidden 2048, B = 16384 / N, bf16).

    FLASHC_LIBRARY=build-gpu/libflashc.so PYTHONPATH=python python3 lab/bwd_split.py [--dims 64,128,256] [--lens 1024]

torch.profiler's CUDA activities over --runs calls of each (after warm-up); per kernel (memsets included) its
device time per call in us, and the sum; the kernels run on one stream, one after another, so the sum is the
call's GPU time less the gaps between kernels.
"""
import argparse
import collections
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def per_kernel_us(fn, runs):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    t = collections.OrderedDict()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t[ev.name] = t.get(ev.name, 0.0) + ev.device_time / runs  # us
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="1024")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    print("device: %s; torch %s; cudnn %s" % (torch.cuda.get_device_name(), torch.__version__,
                                              torch.backends.cudnn.version()))
    for d in (int(x) for x in args.dims.split(",")):
        for n in (int(x) for x in args.lens.split(",")):
            H, B = 2048 // d, max(1, 16384 // n)
            q, k, v, g = (torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                out, lse = flashc.attention(q, k, v, causal=causal)
                fc = per_kernel_us(lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=causal), args.runs)
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                gt = g.transpose(1, 2)
                cu = per_kernel_us(lambda: torch.autograd.grad(o, (qt, kt, vt), gt, retain_graph=True), args.runs)
                for who, t in (("flashc", fc), ("cuDNN", cu)):
                    parts = ", ".join("%s %.1f" % (name[:48], us) for name, us in t.items())
                    print("D %d N %d causal %d %-6s sum %7.1f us: %s" % (d, n, causal, who, sum(t.values()), parts))
                del qt, kt, vt, o
            del q, k, v, g
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
