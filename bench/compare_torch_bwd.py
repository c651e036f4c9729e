#!/usr/bin/env python3
"""flashc's CUDA backward vs torch SDPA's flash and cuDNN backends, backward alone, in one process.

    FLASHC_LIBRARY=build-gpu/libflashc.so PYTHONPATH=python python3 bench/compare_torch_bwd.py [--lens 1024,4096]

Shapes of the CONVENTIONS.md sweep (hidden 2048: H = 2048/D, B = 16384/N). Backward FLOPs = 2.5 x forward
(4*B*H*N^2*D, halved when causal). flashc: flashc.attention_backward on the forward's out and lse; torch:
torch.autograd.grad through a retained graph. CUDA events, median of --runs after warm-up.
"""
import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def cuda_median_ms(fn, runs, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", default="1024,4096")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    dt = torch.bfloat16
    print("%4s %6s %6s | %10s %10s %10s %10s | %8s %8s   (backward TFLOP/s; det: deterministic mode)" %
          ("D", "N", "causal", "flashc", "flashc-det", "torch-fa", "cuDNN", "/fa", "/cuDNN"))
    for d in (int(x) for x in args.dims.split(",")):
        for n in (int(x) for x in args.lens.split(",")):
            for causal in (False, True):
                H, B = 2048 // d, 16384 // n
                q, k, v = (torch.randn(B, n, H, d, device="cuda", dtype=dt) for _ in range(3))
                g = torch.randn(B, n, H, d, device="cuda", dtype=dt)
                out, lse = flashc.attention(q, k, v, causal=causal)
                t_f = cuda_median_ms(lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=causal), args.runs)
                t_d = cuda_median_ms(lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=causal,
                                                                       deterministic=True), args.runs)
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                gt = g.transpose(1, 2)
                peers = []
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    try:
                        with sdpa_kernel(backend):
                            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            peers.append(cuda_median_ms(
                                lambda: torch.autograd.grad(o, (qt, kt, vt), gt, retain_graph=True), args.runs))
                    except RuntimeError as e:  # a backend that refuses the shape
                        print("  %s: %s" % (backend, str(e).splitlines()[0]), file=sys.stderr)
                        peers.append(float("nan"))
                flops = 2.5 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)
                tf = lambda ms: flops / (ms * 1e-3) * 1e-12  # noqa: E731
                print("%4d %6d %6d | %10.1f %10.1f %10.1f %10.1f | %7.2fx %7.2fx" %
                      (d, n, int(causal), tf(t_f), tf(t_d), tf(peers[0]), tf(peers[1]), peers[0] / t_f,
                       peers[1] / t_f))
                del q, k, v, g, out, lse, qt, kt, vt, o


if __name__ == "__main__":
    main()
