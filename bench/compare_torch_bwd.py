#!/usr/bin/env python3
"""flashc's CUDA backward (and forward + backward) vs torch SDPA's flash and cuDNN backends, in one process.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/compare_torch_bwd.py [--dtypes bf16] [--lens 1024,4096]
    python3 bench/compare_torch.py --backward ...      (the same, from the forward benchmark's entry point)

Shapes of the CONVENTIONS.md sweep (hidden 2048: H = 2048/D, B = 16384/N, N 512..16k, D 64/128/256, causal off/on,
bf16 and fp16). FLOPs: backward 2.5 x forward (4*B*H*N^2*D, halved when causal), forward + backward 3.5 x.
flashc: flashc.attention_backward on the forward's out and lse (default mode: dQ by fp32 atomics; det: the
deterministic mode); forward + backward: flashc.attention then attention_backward. torch: autograd.grad through a
retained graph (backward), forward + autograd.grad (forward + backward). CUDA events, median of --runs after
warm-up; the backward timings of flashc and the torch backends are taken in turns (one call of each per round),
so that a slow stretch of the GPU does not fall on one of them alone; the backward is compute-bound, so inputs
are not rotated.
"""
import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def interleaved_medians(fns, runs, warmup=3, ahead=0):
    """Median ms of each callable in fns (name -> fn), timed in turns (one call of each per round) so that a
    slow stretch of the GPU (clocks, a neighbour) falls on all of them alike rather than on one. ahead > 0: the GPU
    sleeps that many cycles before each start event, so that the host queues the call meanwhile and the time is the
    GPU's alone (as in a training step, where the host runs ahead); 0: the host's time per call is on the clock."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if ahead:
                torch.cuda._sleep(ahead)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    return {name: statistics.median(ts) for name, ts in times.items()}


def sweep_shapes(args):
    """(dtype name, torch dtype, D, N, H, B) of the CONVENTIONS.md sweep (hidden 2048: H = 2048 / D, B = 16384 / N)
    that args.dtypes, args.dims and args.lens select."""
    for dname in args.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname]
        for d in (int(x) for x in args.dims.split(",")):
            for n in (int(x) for x in args.lens.split(",")):
                yield dname, dt, d, n, 2048 // d, max(1, 16384 // n)


def cuda_median_ms(fn, runs, warmup=3):
    """Median ms of fn alone."""
    return interleaved_medians({"fn": fn}, runs, warmup)["fn"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-det", action="store_true", help="skip the deterministic mode's column")
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_properties(0)
    print("device: %s; torch %s; cudnn %s; median of %d runs" % (dev.name, torch.__version__,
                                                                 torch.backends.cudnn.version(), args.runs))
    rows = []
    for dname, dt, d, n, H, B in sweep_shapes(args):
        q, k, v, g = (torch.randn(B, n, H, d, device="cuda", dtype=dt) for _ in range(4))
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            out, lse = flashc.attention(q, k, v, causal=causal)
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            gt = g.transpose(1, 2)
            # Backward alone: flashc (and its deterministic mode) and each torch backend's backward through
            # a graph its forward recorded, timed in turns.
            bwd = {"bwd": lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=causal)}
            if not args.no_det:
                bwd["det"] = lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=causal,
                                                               deterministic=True)
            graphs = {}
            for name, backend in (("fa", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        graphs[name] = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                                        is_causal=causal)
                    bwd[name] = (lambda o: lambda: torch.autograd.grad(o, (qt, kt, vt), gt,
                                                                       retain_graph=True))(graphs[name])
                except RuntimeError as e:  # a backend that refuses the shape
                    print("  %s: %s" % (backend, str(e).splitlines()[0][:100]), file=sys.stderr)
            t = {"det": None, "fa": None, "cudnn": None, "fa_fb": None, "cudnn_fb": None}
            t.update(interleaved_medians(bwd, args.runs))
            graphs.clear()

            # Forward + backward: each under its own backend choice, one after the other.
            def fb():
                o, l = flashc.attention(q, k, v, causal=causal)
                flashc.attention_backward(g, q, k, v, o, l, causal=causal)
            t["fb"] = cuda_median_ms(fb, args.runs)
            for name, backend in (("fa", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                if t[name] is None:
                    continue
                with sdpa_kernel(backend):
                    def tfb():
                        oo = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        torch.autograd.grad(oo, (qt, kt, vt), gt)
                    t[name + "_fb"] = cuda_median_ms(tfb, args.runs)
            f1 = 4.0 * B * H * n * n * d * (0.5 if causal else 1.0)
            tf = lambda ms, m: f1 * m / (ms * 1e-3) * 1e-12 if ms else float("nan")  # noqa: E731
            r = (dname, d, n, int(causal), tf(t["bwd"], 2.5), tf(t["det"], 2.5), tf(t["fa"], 2.5),
                 tf(t["cudnn"], 2.5), tf(t["fb"], 3.5), tf(t["fa_fb"], 3.5), tf(t["cudnn_fb"], 3.5))
            rows.append(r)
            print("  %s D=%d N=%d causal=%d bwd flashc %.1f det %.1f fa %.1f cudnn %.1f | f+b flashc %.1f "
                  "fa %.1f cudnn %.1f TFLOP/s" % r, flush=True)
            del qt, kt, vt, out, lse
        del q, k, v, g
        torch.cuda.empty_cache()

    print("\n| dtype | D | N | causal | bwd flashc | bwd det | bwd torch-flash | bwd cuDNN | /flash | /cuDNN "
          "| f+b flashc | f+b torch-flash | f+b cuDNN | /flash | /cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratio = lambda a, b: "%.2f" % (a / b) if b == b and b > 0 else "n/a"  # noqa: E731
    for dname, d, n, c, b, det, fa, cu, fb, fafb, cufb in rows:
        print("| %s | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %s | %s | %.1f | %.1f | %.1f | %s | %s |" %
              (dname, d, n, c, b, det, fa, cu, ratio(b, fa), ratio(b, cu), fb, fafb, cufb, ratio(fb, fafb),
               ratio(fb, cufb)))


if __name__ == "__main__":
    main()
