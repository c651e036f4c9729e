#!/usr/bin/env python3
"""The cost of fused dropout: flashc with dropout_p = 0.1 against itself without, and torch SDPA's flash backend the
same way, through the API users call (flashc.flash_attn_func, torch's scaled_dot_product_attention), in one process.

    FLASHC_LIBRARY=build/libflashc.so python3 bench/dropout.py [--dims 64,128,256] [--lens 1024,4096] [--cpu]

GPU: the CONVENTIONS.md shapes (hidden 2048: H = 2048 / D, B = 16384 / N), bf16, causal off/on; forward (no_grad)
and forward + backward (autograd), each the median of --runs CUDA-event timings taken in turns with its peers.
--cpu: torch CPU tensors (fp32, the process's threads, B 1, H 8), wall-clock medians in turns; torch's CPU SDPA is
the peer. Prints per-shape lines, then a table: TFLOP/s (GFLOP/s on the CPU) of each and the with/without ratios.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def medians(fns, runs, warmup, cuda):
    """Median ms of each callable, timed in turns (one call of each per round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def calls(q, k, v, g, causal, p, peer):
    """(forward, forward + backward) of flashc and of the torch peer at dropout p."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gt = g.transpose(1, 2)

    def f_fwd():
        with torch.no_grad():
            flashc.flash_attn_func(q, k, v, dropout_p=p, causal=causal)

    def f_fb():
        o = flashc.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
        torch.autograd.grad(o, (q, k, v), g)

    pick = (lambda: sdpa_kernel(peer)) if peer is not None else contextlib.nullcontext

    def t_fwd():
        with torch.no_grad(), pick():
            F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)

    def t_fb():
        with pick():
            o = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), gt)
    return f_fwd, f_fb, t_fwd, t_fb


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="1024,4096")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    cuda = not args.cpu
    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16 if cuda else torch.float32
    # the GPU peer is torch's flash backend (flash-attn 2 with its fused dropout); on the CPU torch picks its own kernel
    peer = SDPBackend.FLASH_ATTENTION if cuda else None
    name = torch.cuda.get_device_properties(0).name if cuda else "CPU, %d threads" % torch.get_num_threads()
    print("device: %s; torch %s; dropout_p %.2f; median of %d runs in turns" % (name, torch.__version__, args.p,
                                                                              args.runs))
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for n in (int(x) for x in args.lens.split(",")):
            H, B = (2048 // d, max(1, 16384 // n)) if cuda else (8, 1)
            q, k, v, g = (torch.randn(B, n, H, d, device=dev, dtype=dt) for _ in range(4))
            for x in (q, k, v):
                x.requires_grad_()
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                fns = {}
                for p in (0.0, args.p):
                    f_fwd, f_fb, t_fwd, t_fb = calls(q, k, v, g, causal, p, peer)
                    tag = "p" if p else "0"
                    fns.update({"f_fwd_" + tag: f_fwd, "t_fwd_" + tag: t_fwd, "f_fb_" + tag: f_fb,
                                "t_fb_" + tag: t_fb})
                t = medians(fns, args.runs, 2, cuda)
                flops = 4.0 * B * H * n * n * d * (0.5 if causal else 1.0)
                rate = lambda ms, m: flops * m / (ms * 1e-3) * (1e-12 if cuda else 1e-9)  # noqa: E731
                r = (d, n, int(causal), rate(t["f_fwd_0"], 1), rate(t["f_fwd_p"], 1), rate(t["t_fwd_0"], 1),
                     rate(t["t_fwd_p"], 1), rate(t["f_fb_0"], 3.5), rate(t["f_fb_p"], 3.5), rate(t["t_fb_0"], 3.5),
                     rate(t["t_fb_p"], 3.5))
                rows.append(r)
                print("  D=%d N=%d causal=%d fwd flashc %.1f / %.1f torch %.1f / %.1f | f+b flashc %.1f / %.1f "
                      "torch %.1f / %.1f" % r, flush=True)
            del q, k, v, g
            if cuda:
                torch.cuda.empty_cache()
    unit = "TFLOP/s" if cuda else "GFLOP/s"
    print("\n%s (p 0 / p %.2f); ratio = with dropout / without" % (unit, args.p))
    print("| D | N | causal | fwd flashc | ratio | fwd torch | ratio | f+b flashc | ratio | f+b torch | ratio | "
          "flashc/torch f+b with dropout |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, n, c, f0, fp, t0, tp, b0, bp, u0, up in rows:
        print("| %d | %d | %d | %.1f / %.1f | %.2f | %.1f / %.1f | %.2f | %.1f / %.1f | %.2f | %.1f / %.1f | %.2f | "
              "%.2f |" % (d, n, c, f0, fp, fp / f0, t0, tp, tp / t0, b0, bp, bp / b0, u0, up, up / u0, bp / up))


if __name__ == "__main__":
    main()
