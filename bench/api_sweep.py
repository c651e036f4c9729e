#!/usr/bin/env python3
"""The standard sweep as users call it: flashc.flash_attn_func against F.scaled_dot_product_attention's cuDNN and
flash backends, forward, backward and forward + backward, in one process, peers timed in turns.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/api_sweep.py [--dtypes bf16,fp16] [--dims 64,128,256]
        [--lens 1024,4096,16384] [--causal 0,1] [--runs 10] [--ahead 0]

Shapes of the CONVENTIONS.md sweep (hidden 2048: H = 2048/D, B = 16384/N). The data are (B, N, H, D) tensors, as a
model's projections give them: flashc takes them as they are, torch their (B, H, N, D) views (transpose(1, 2), no
copy), as a transformers model calls SDPA. Rows, each timed in turns with both torch backends (one call of each per
round, median of --runs after warm-up; CUDA events around the call, synchronized after it):
  fwd   the forward under torch.no_grad()
  bwd   torch.autograd.grad of a forward recorded once (a shape's second call: planned), retain_graph=True (the
        backward alone, as autograd runs it)
  f+b   a forward of inputs that require grad, then torch.autograd.grad (a training step's attention)
--ahead 0 (the default) puts each call's host time on the clock (the GPU waits for the launches); --ahead N makes the
GPU sleep N cycles before each start event, so that the host queues the call meanwhile and the time is the GPU's.
FLOPs: forward 4*B*H*N^2*D (halved when causal), backward 2.5x, forward + backward 3.5x. flashc's autograd function
is whichever flashc.cpp_autograd gives (FLASHC_CPP_AUTOGRAD; the header and last lines name it). The header also gives
torch's bf16 matmul rate (8192^3, median of 30), and the end d 128's non-causal N >= 4k rows as a share of it.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashc  # noqa: E402
from compare_torch_bwd import interleaved_medians, sweep_shapes  # noqa: E402

BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))


def torch_call(backend, causal):
    def call(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return call


def row_times(calls, q, k, v, g, runs, ahead):
    """{kind: {name: ms}} for kind in fwd, bwd, f+b; calls: name -> fn(q, k, v) -> out (B, N, H, D)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def fb(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, g)

    # the graph the bwd row differentiates is a later call's, as in a training loop: a call's first one with a key
    # takes flashc's full path and plans the key for the next ones (flashc.ops), whose backward differs
    for fn in calls.values():
        fn(*leaves)
    outs = {name: fn(*leaves) for name, fn in calls.items()}

    def bwd(name):
        return lambda: torch.autograd.grad(outs[name], leaves, g, retain_graph=True)

    t = {"fwd": interleaved_medians({n: fwd(fn) for n, fn in calls.items()}, runs, ahead=ahead),
         "bwd": interleaved_medians({n: bwd(n) for n in calls}, runs, ahead=ahead)}
    outs.clear()
    t["f+b"] = interleaved_medians({n: fb(fn) for n, fn in calls.items()}, runs, ahead=ahead)
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ahead", type=int, default=0, help="GPU cycles slept before each start event (0: host time "
                                                         "on the clock)")
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_properties(0)
    # a small call that needs gradients, twice: the second is planned (flashc.ops' per-shape plans), and
    # FLASHC_CPP_AUTOGRAD decides there (=1 waits for its build)
    x = [torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    for _ in range(2):
        torch.autograd.grad(flashc.flash_attn_func(*x), x, torch.ones_like(x[0]))
    from flashc import cpp_autograd
    # the bf16 matmul rate on this GPU, the reference of the "% of matmul" targets
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm = 2.0 * 8192 ** 3 / (interleaved_medians({"mm": lambda: a @ b}, 30, warmup=5)["mm"] * 1e-3) * 1e-12
    del a, b
    print("device: %s; torch %s; cudnn %s; median of %d runs; ahead %d; flashc's C++ autograd function: %s; bf16 "
          "matmul 8192^3: %.1f TFLOP/s" % (dev.name, torch.__version__, torch.backends.cudnn.version(), args.runs,
                                          args.ahead, cpp_autograd.status(), mm), flush=True)
    rows = []
    for dname, dt, d, n, H, B in sweep_shapes(args):
        q, k, v, g = (torch.randn(B, n, H, d, device="cuda", dtype=dt) for _ in range(4))
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            calls = {"flashc": lambda q, k, v, c=causal: flashc.flash_attn_func(q, k, v, causal=c)}
            for name, backend in BACKENDS:
                try:
                    torch_call(backend, causal)(q, k, v)
                    calls[name] = torch_call(backend, causal)
                except RuntimeError as e:  # a backend that refuses the shape
                    print("  %s: %s" % (name, str(e).splitlines()[0][:100]), file=sys.stderr)
            t = row_times(calls, q, k, v, g, args.runs, args.ahead)
            f1 = 4.0 * B * H * n * n * d * (0.5 if causal else 1.0)
            tf = {kind: {nm: f1 * m / (ms * 1e-3) * 1e-12 for nm, ms in t[kind].items()}
                  for kind, m in (("fwd", 1.0), ("bwd", 2.5), ("f+b", 3.5))}
            rows.append((dname, d, n, int(causal), tf))
            print("  %s D=%d N=%d causal=%d " % (dname, d, n, causal) + " | ".join(
                "%s %s" % (kind, " ".join("%s %.1f" % kv for kv in tf[kind].items())) for kind in tf) +
                " TFLOP/s", flush=True)
        del q, k, v, g
        torch.cuda.empty_cache()

    print("\nTFLOP/s, flashc / cuDNN (ratio); last columns: flashc / torch's flash backend")
    print("\n| dtype | D | N | causal | forward | backward | forward + backward | fwd / flash | bwd / flash "
          "| f+b / flash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for dname, d, n, c, tf in rows:
        cells = []
        for kind in ("fwd", "bwd", "f+b"):
            a, b = tf[kind]["flashc"], tf[kind].get("cudnn", nan)
            cells.append("%.1f / %.1f (%.2f)" % (a, b, a / b))
        for kind in ("fwd", "bwd", "f+b"):
            cells.append("%.2f" % (tf[kind]["flashc"] / tf[kind].get("flash", nan)))
        print("| %s | %d | %d | %s | %s |" % (dname, d, n, "causal" if c else "-", " | ".join(cells)))
    for kind in ("fwd", "bwd", "f+b"):
        r = [tf[kind]["flashc"] / tf[kind]["cudnn"] for *_, tf in rows if "cudnn" in tf[kind]]
        if r:
            print("%s / cuDNN: %.2f-%.2f over %d rows" % (kind, min(r), max(r), len(r)))
    for kind in ("fwd", "bwd"):
        r = ["%s N %d %.0f%%" % (dname, n, 100 * tf[kind]["flashc"] / mm) for dname, d, n, c, tf in rows
             if d == 128 and n >= 4096 and not c]
        if r:
            print("d 128 non-causal N >= 4k %s, flashc / bf16 matmul: %s" % (kind, ", ".join(r)))
    print("flashc's C++ autograd function at the end: %s" % cpp_autograd.status())


if __name__ == "__main__":
    main()
