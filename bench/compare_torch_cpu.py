#!/usr/bin/env python3
"""flashc's CPU backend vs torch's CPU scaled_dot_product_attention, same shapes, same thread count, one process.

    FLASHC_LIBRARY=build/libflashc.so PYTHONPATH=python python3 bench/compare_torch_cpu.py --threads 2,16

Both run on the same (B, H, N, D) tensors (flashc through its torch binding, strides passed without copies).
Times are medians after a warm-up, the peers of a row timed in turns (one run of each per round); forward FLOPs
4*B*H*N^2*D (halved when causal), forward+backward 3.5x that. bfloat16 rows also time flashc's float32 forward on the
same values in the same turns (bf16 / f32: what the bf16 kernels gain over fp32). Also prints the matmul rates of
torch (torch.mm, f32 and bf16) and numpy (OpenBLAS, f32) on the same threads as the ceilings.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def median_time(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def times_in_turns(fns, reps, warmup=1):
    """Median seconds of each function, run in turns: a round runs each once, so a slow spell of the machine
    touches every peer alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def bf16_mm_rate(threads):
    torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_time(lambda: torch.mm(a, b), 5) * 1e-9


def sgemm_rates(threads):
    torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    t_torch = median_time(lambda: torch.mm(a, b), 5)
    rate_np = float("nan")
    try:
        import numpy as np

        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            threadpool_limits = None
        an, bn = a.numpy(), b.numpy()
        if threadpool_limits is not None:
            with threadpool_limits(limits=threads):
                rate_np = 2 * n ** 3 / median_time(lambda: np.dot(an, bn), 5) * 1e-9
        else:
            rate_np = 2 * n ** 3 / median_time(lambda: np.dot(an, bn), 5) * 1e-9
    except ImportError:
        pass
    return 2 * n ** 3 / t_torch * 1e-9, rate_np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,16")
    ap.add_argument("--ns", default="512,1024,2048,4096")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--no-bwd", action="store_true")
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    print("flashc %s (%s), torch %s, cpu features: %s" % (flashc.library_version(), flashc.library_path,
                                                          torch.__version__, flashc.cpu_features()))
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        flashc.set_num_threads(t)
        rt, rn = sgemm_rates(t)
        rb = bf16_mm_rate(t)
        print("threads %d: sgemm torch.mm %.1f GFLOP/s, numpy %.1f GFLOP/s; bf16 torch.mm %.1f GFLOP/s" % (t, rt, rn, rb))
        for dtname in args.dtypes.split(","):
            dt = getattr(torch, dtname)
            for d in (int(x) for x in args.dims.split(",")):
                for causal in (False, True):
                    for n in (int(x) for x in args.ns.split(",")):
                        B, H = args.batch, args.heads
                        print("  %s d=%d causal=%d N=%d ..." % (dtname, d, causal, n), end="\r", file=sys.stderr)
                        q, k, v = (torch.randn(B, H, n, d, dtype=dt, requires_grad=True) for _ in range(3))
                        g = torch.randn(B, H, n, d, dtype=dt)
                        q32, k32, v32 = (x.detach().float() for x in (q, k, v))
                        flops = 4 * B * H * n * n * d * (0.5 if causal else 1.0)
                        reps = 3 if flops > 5e10 else 7

                        def fwd_torch():
                            with torch.no_grad():
                                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def fwd_flashc():
                            with torch.no_grad():
                                flashc.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def fwd_flashc_f32():
                            with torch.no_grad():
                                flashc.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)

                        def fb_torch():
                            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(out, (q, k, v), g)

                        def fb_flashc():
                            out = flashc.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(out, (q, k, v), g)

                        fwds = [fwd_torch, fwd_flashc] + ([fwd_flashc_f32] if dt != torch.float32 else [])
                        tf = times_in_turns(fwds, reps)
                        tf_t, tf_f, tf_32 = tf[0], tf[1], tf[2] if len(tf) > 2 else float("nan")
                        tb_t = tb_f = float("nan")
                        if not args.no_bwd:
                            tb_t, tb_f = times_in_turns([fb_torch, fb_flashc], reps)
                        rows.append((t, dtname, d, int(causal), n, flops / tf_f * 1e-9, flops / tf_t * 1e-9,
                                     tf_t / tf_f, tf_32 / tf_f, 100.0 * flops / tf_f * 1e-9 / rb,
                                     3.5 * flops / tb_f * 1e-9, 3.5 * flops / tb_t * 1e-9, tb_t / tb_f))
    print()
    hdr = ("thr", "dtype", "D", "causal", "N", "fwd flashc", "fwd torch", "ratio", "/f32", "%bf16mm", "f+b flashc",
           "f+b torch", "ratio")
    print("%3s %-8s %4s %6s %6s | %10s %10s %6s %6s %7s | %10s %10s %6s   (GFLOP/s)" % hdr)
    for r in rows:
        print("%3d %-8s %4d %6d %6d | %10.1f %10.1f %5.2fx %5.2fx %6.0f%% | %10.1f %10.1f %5.2fx" % r)


if __name__ == "__main__":
    main()
