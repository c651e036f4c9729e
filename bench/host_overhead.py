#!/usr/bin/env python3
"""Host time of one flashc CUDA call (Python binding + library, before and between the kernel launches) at a tiny
shape where the GPU work is negligible, beside torch's SDPA backends, and a cProfile of the binding's backward.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/host_overhead.py [--profile]
"""
import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    q, k, v, g = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flashc.attention(q, k, v, causal=True)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    gt = g.transpose(1, 2)
    # (name, call, the context it is timed under: a torch forward picks its backend when it runs)
    rows = [("flashc forward", lambda: flashc.attention(q, k, v, causal=True), contextlib.nullcontext),
            ("flashc backward", lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=True),
             contextlib.nullcontext)]
    for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        rows.append((name + " forward",
                     lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                     (lambda b: lambda: sdpa_kernel(b))(backend)))
        rows.append((name + " backward",
                     (lambda o: lambda: torch.autograd.grad(o, (qt, kt, vt), gt, retain_graph=True))(o),
                     contextlib.nullcontext))
    for name, fn, context in rows:
        with context():
            us = host_us(fn)
        print("%-22s %7.1f us of host time per call" % (name, us))
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            flashc.attention_backward(g, q, k, v, out, lse, causal=True)
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
