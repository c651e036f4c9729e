#!/usr/bin/env python3
"""Where the host time of a forward + backward step goes (issue 18): flashc's flash_attn_func through autograd against
SDPA, beside the same library calls without autograd (the per-shape plan's forward and backward called directly), and
an empty Python autograd.Function (forward x.view_as(x), backward returning its gradient) through the same
torch.autograd.grad call. On CUDA autograd runs a Python backward on its device thread, which must take the GIL from
the calling thread; torch's own SDPA backward is C++ and needs no hand-over.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 lab/autograd_probe.py [--device cuda] [--rounds 5] [--calls 2000]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402
from flashc import ops  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--calls", type=int, default=2000)
ap.add_argument("--shape", default="1,128,2,64")
a = ap.parse_args()
dev = a.device
dt = torch.bfloat16 if dev == "cuda" else torch.float32
B, N, H, D = (int(x) for x in a.shape.split(","))
q, k, v = (torch.randn(B, N, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
g = torch.ones(B, N, H, D, device=dev, dtype=dt)
gt = g.transpose(1, 2)


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gx):
        return gx


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


out = flashc.flash_attn_func(q, k, v, causal=True)
plan = None
for p in ops._plans().values():
    plan = p
fo, lse = plan.forward(q.detach(), k.detach(), v.detach(), True)

rows = {
    "flashc flash_attn_func fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
        flashc.flash_attn_func(q, k, v, causal=True), (q, k, v), g),
    "SDPA fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), gt),
    "flashc plan.forward + plan.backward (no autograd)": lambda: plan.backward(
        g, q.detach(), k.detach(), v.detach(), *plan.forward(q.detach(), k.detach(), v.detach(), True)),
    "flashc plan.forward alone": lambda: plan.forward(q.detach(), k.detach(), v.detach(), True),
    "flashc plan.backward alone": lambda: plan.backward(g, q.detach(), k.detach(), v.detach(), fo, lse),
    "empty Python Function fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(Empty.apply(q), (q,), g),
    "x * 1 fwd+bwd (autograd.grad, C++ backward)": lambda: torch.autograd.grad(q * 1, (q,), g),
}
times = {n: [] for n in rows}
for fn in rows.values():
    for _ in range(50):
        fn()
sync()
for _ in range(a.rounds):
    for n, fn in rows.items():
        sync()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        t1 = time.perf_counter()
        sync()
        times[n].append((t1 - t0) / a.calls * 1e6)
print(f"# {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}, {dev}, shape {a.shape}, "
      f"{dt}; host us per call, median of {a.rounds} rounds in turns (min)")
for n, t in times.items():
    print(f"{n:52s} {statistics.median(t):8.1f} ({min(t):.1f})")
