#!/usr/bin/env python3
"""Where a backward call's time goes as users call it: torch.autograd.grad through flashc.flash_attn_func beside
SDPA's cuDNN backend on the same (B, N, H, D) data (bench/api_sweep.py's bwd row), kernel by kernel. flashc's rows:
"flashc-full" differentiates a shape's first call (the full path), "flashc" its second (the planned path).

    FLASHC_LIBRARY=build-api/libflashc.so PYTHONPATH=python python3 lab/api_split.py [--dims 128] [--lens 4096]

Per caller: the call's time (CUDA events around it, synchronized after, median of --runs, host time on the clock as
in api_sweep.py), then torch.profiler's CUDA activities over --runs calls: each kernel's (memsets and copies
included) device time per call in us and their sum. Call time minus the sum is what the GPU did not spend in
kernels: launch gaps, host time the GPU waited for. --cpu adds the host side: torch.profiler's CPU activities over
the same calls, the --top entries by self CPU time per call (torch ops, the autograd node, CUDA runtime calls).
--timeline N: one call's CUDA runtime calls and GPU rows in time order, with the GPU's idle gaps.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashc  # noqa: E402
from bwd_split import per_kernel_us  # noqa: E402  (lab/: each kernel's device time per call)


def call_ms(fn, runs):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def host_us(fn, runs, top):
    """The top CPU events by self time, us per call: [(name, self us, calls per call)]."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key, e.self_cpu_time_total / runs, e.count / runs) for e in ev]


def timeline(fn, rows):
    """One call under torch.profiler (CPU and CUDA): the first --timeline rows of CUDA runtime/driver calls and GPU
    activities in time order, us from the call's start (a record_function around it), the GPU rows with their
    duration and the idle gap before them: where the GPU waits on the host."""
    from torch.profiler import record_function
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("api_split_call"):
            fn()
        torch.cuda.synchronize()
    evs = prof.events()
    t0 = min(e.time_range.start for e in evs if e.name == "api_split_call")
    out, last_end = [], None
    for e in sorted(evs, key=lambda e: e.time_range.start):
        gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if not gpu and not e.name.startswith(("cu", "aten::empty", "aten::zero", "aten::copy_", "autograd::engine")):
            continue
        gap = ""
        if gpu:
            gap = "" if last_end is None else " gap %.1f" % (e.time_range.start - last_end)
            last_end = e.time_range.end
        out.append("      %8.1f %s %-48s %8.1f us%s" % (e.time_range.start - t0, "GPU" if gpu else "CPU", e.name[:48],
                                                       e.time_range.end - e.time_range.start, gap))
    print("\n".join(out[:rows]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128")
    ap.add_argument("--lens", default="1024,4096")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="the host side too (CPU events, self time)")
    ap.add_argument("--top", type=int, default=12, help="CPU events listed with --cpu")
    ap.add_argument("--timeline", type=int, default=0, help="one call's first N runtime calls and GPU rows, in time")
    args = ap.parse_args()
    from flashc import cpp_autograd
    # a small call that needs gradients, twice, as bench/api_sweep.py starts: FLASHC_CPP_AUTOGRAD decides at the second
    x = [torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    for _ in range(2):
        torch.autograd.grad(flashc.flash_attn_func(*x), x, torch.ones_like(x[0]))
    print("device: %s; torch %s; cudnn %s; flashc's C++ autograd function: %s" % (
        torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version(), cpp_autograd.status()))
    for d in (int(x) for x in args.dims.split(",")):
        for n in (int(x) for x in args.lens.split(",")):
            H, B = 2048 // d, max(1, 16384 // n)
            q, k, v, g = (torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                # a key's first call takes the full path (as packed and varlen calls always do) and plans the key;
                # the next ones, a training loop's, go through the plan (flashc.ops, flashc.cpp_autograd)
                outs = {"flashc-full": flashc.flash_attn_func(*leaves, causal=causal),
                        "flashc": flashc.flash_attn_func(*leaves, causal=causal)}
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    outs["cuDNN"] = F.scaled_dot_product_attention(
                        *(t.transpose(1, 2) for t in leaves), is_causal=causal).transpose(1, 2)
                for who, o in outs.items():
                    fn = lambda o=o, lv=leaves, gg=g: torch.autograd.grad(o, lv, gg, retain_graph=True)  # noqa: E731
                    ms = call_ms(fn, args.runs)
                    t = per_kernel_us(fn, args.runs)
                    tot = sum(t.values())
                    print("D %d N %d causal %d %s: call %.1f us, kernels %.1f us, outside %.1f us; %s" % (
                        d, n, causal, who, ms * 1e3, tot, ms * 1e3 - tot,
                        "; ".join("%s %.1f" % (k[:60], us) for k, us in t.items())), flush=True)
                    if args.cpu:
                        print("    host, self us per call: " + "; ".join(
                            "%s %.1f (x%.0f)" % (name[:48], us, calls)
                            for name, us, calls in host_us(fn, args.runs, args.top)),
                            flush=True)
                    if args.timeline:
                        timeline(fn, args.timeline)
            del q, k, v, g, leaves
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
