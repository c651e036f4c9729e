#!/usr/bin/env python3
"""Host time per call of flashc's Python API at tiny shapes where the attention itself costs little, beside torch's
SDPA, and a cProfile of one flashc call.

On CUDA (the default when a GPU is visible) it times the host side of each call (kernels are queued, not waited for):
flashc.attention / attention_backward and flashc.flash_attn_func against SDPA's flash and cuDNN backends.
On the CPU (--device cpu) there is no queue, so the time per call is the whole call; at these shapes (B 1, N 16 and 128)
the arithmetic is a few microseconds, the rest is Python, torch and library overhead. Rows:
  fwd        flash_attn_func(q, k, v, causal=True) under torch.no_grad() against F.scaled_dot_product_attention
             (torch's default CPU choice, its flash kernel for these inputs) on the (B, H, N, D) views of the same data
  fwd+bwd    the same with q, k, v requiring grad, then torch.autograd.grad of the output
  sdpa fwd, sdpa fwd+bwd   the same with flashc.scaled_dot_product_attention on the (B, H, N, D) views
On CUDA the table also has forward + backward rows: flash_attn_func, flashc.attention and
flashc.scaled_dot_product_attention with q, k, v requiring grad, then torch.autograd.grad of the output, beside SDPA's
flash and cuDNN backends doing the same (host time of the whole step: autograd runs CUDA backward passes on its own
device thread, which the calling thread waits for).
Every row is timed in several rounds taken in turns (flashc, torch, flashc, ...), so that a noisy machine (a VM
shared with other jobs) affects both alike; the table gives the median round and the min.

    FLASHC_LIBRARY=build/libflashc.so python3 bench/host_overhead.py [--device cpu] [--threads 1] [--rounds 7] [--profile]
                                                                     [--clock thread]

--threads 1 takes OpenMP's fork and join out of the CPU numbers (and its sensitivity to other jobs on the cores).
--clock thread (CPU only) times with the calling thread's CPU time instead of the wall clock: on a VM whose cores other
jobs use, time spent waiting for a core no longer counts (a CPU call runs its autograd backward on the calling thread,
so nothing of the call is missed; flashc's OpenMP workers would be, hence --threads 1 with it).
--profile prints a cProfile of flashc's forward and of its forward + backward (CPU: flash_attn_func at N 16; CUDA:
attention_backward, and flash_attn_func's forward + backward).
--cpp-autograd adds the forward + backward rows again with flashc.cpp_autograd enabled (flashc's autograd function
in C++; it is compiled first if its cache has none), timed in the same turns as the others.
Every forward + backward row names the autograd function its calls went through, taken from the grad_fn of a call made
as the row's calls are: "Py" (flashc's Python torch.autograd.Function: the other rows run with flashc.cpp_autograd
disabled, whatever FLASHC_CPP_AUTOGRAD says, so no build starts in the background while rows are timed) or "C++".
"""
import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


_clock = time.perf_counter  # --clock thread: time.thread_time


def host_us(fn, device, n):
    """Mean host microseconds per call over n calls (after a warm-up)."""
    for _ in range(20):
        fn()
    sync(device)
    t0 = _clock()
    for _ in range(n):
        fn()
    t1 = _clock()
    sync(device)
    return (t1 - t0) / n * 1e6


@contextlib.contextmanager
def cpp_autograd_on():
    """flashc.cpp_autograd enabled for the block (built on first use)."""
    from flashc import cpp_autograd

    cpp_autograd.enable()
    try:
        yield
    finally:
        cpp_autograd.disable()


@contextlib.contextmanager
def cpp_autograd_off():
    """flashc's Python autograd function for the block (flashc.cpp_autograd disabled, as main() leaves it)."""
    from flashc import cpp_autograd

    cpp_autograd.disable()
    yield


def autograd_path(fn, context):
    """"Py" or "C++": the autograd function a call of fn.forward (the forward of a forward + backward row) records,
    made under the row's context after a planning call; "" for a row without one."""
    forward = getattr(fn, "forward", None)
    if forward is None:
        return ""
    with context():
        forward()
        name = forward().grad_fn.name()
    return "C++" if "CppNode" in name else "Py"


def rows_cpu(b, n, h, d, dtype):
    q, k, v = (torch.randn(b, n, h, d, dtype=dtype) for _ in range(3))
    g = torch.randn(b, n, h, d, dtype=dtype)
    qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, g))
    ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
    qtl, ktl, vtl = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

    def fa_fwd():
        with torch.no_grad():
            return flashc.flash_attn_func(q, k, v, causal=True)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def fa_fwd_bwd():
        out = flashc.flash_attn_func(ql, kl, vl, causal=True)
        return torch.autograd.grad(out, (ql, kl, vl), g)
    fa_fwd_bwd.forward = lambda: flashc.flash_attn_func(ql, kl, vl, causal=True)

    def sdpa_fwd_bwd():
        out = F.scaled_dot_product_attention(qtl, ktl, vtl, is_causal=True)
        return torch.autograd.grad(out, (qtl, ktl, vtl), gt)

    def fc_sdpa_fwd():
        with torch.no_grad():
            return flashc.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def fc_sdpa_fwd_bwd():
        out = flashc.scaled_dot_product_attention(qtl, ktl, vtl, is_causal=True)
        return torch.autograd.grad(out, (qtl, ktl, vtl), gt)
    fc_sdpa_fwd_bwd.forward = lambda: flashc.scaled_dot_product_attention(qtl, ktl, vtl, is_causal=True)

    return [("fwd", fa_fwd, sdpa_fwd), ("fwd+bwd", fa_fwd_bwd, sdpa_fwd_bwd),
            ("sdpa fwd", fc_sdpa_fwd, sdpa_fwd), ("sdpa fwd+bwd", fc_sdpa_fwd_bwd, sdpa_fwd_bwd)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per row, taken in turns with the peer")
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (flashc's CPU calls follow torch's count); 0 leaves it")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="wall: time.perf_counter; thread: the calling thread's CPU time (--device cpu only)")
    ap.add_argument("--cpp-autograd", action="store_true",
                    help="also the forward + backward rows with flashc.cpp_autograd enabled")
    args = ap.parse_args()
    from flashc import cpp_autograd

    cpp_autograd.disable()  # the Python rows stay Python, and FLASHC_CPP_AUTOGRAD=auto builds nothing meanwhile
    if args.cpp_autograd:
        with cpp_autograd_on():  # built here, before anything is timed
            pass
    if args.clock == "thread":
        if args.device != "cpu":
            ap.error("--clock thread times the calling thread only: CUDA backward passes run on autograd's device "
                     "thread, so it is for --device cpu")
        global _clock
        _clock = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print("torch %s, flashc %s (%s), %s, %d torch threads, %s clock" % (
        torch.__version__, flashc.__version__, flashc.library_path, args.device, torch.get_num_threads(), args.clock))
    if args.device == "cpu":
        cpu_table(args)
    else:
        cuda_table(args)


def cpu_table(args):
    print("%-30s %-16s %12s %12s %7s   (median of %d rounds; min in brackets)"
          % ("shape", "row", "flashc us", "torch us", "ratio", args.rounds))
    for shape in ((1, 16, 2, 32), (1, 128, 2, 64)):
        rows = [r + (cpp_autograd_off,) for r in rows_cpu(*shape, torch.float32)]
        if args.cpp_autograd:
            rows += [(name, ours, peer, cpp_autograd_on) for name, ours, peer, _ in rows if "fwd+bwd" in name]
        for name, ours, peer, context in rows:
            name = (name + " " + autograd_path(ours, context)).strip()
            t_ours, t_peer = [], []
            for _ in range(args.rounds):
                with context():
                    t_ours.append(host_us(ours, "cpu", args.calls))
                t_peer.append(host_us(peer, "cpu", args.calls))
            mo, mp = statistics.median(t_ours), statistics.median(t_peer)
            print("B%d N%d H%d D%d f32 causal        %-16s %6.1f [%4.1f] %6.1f [%4.1f] %6.2fx"
                  % (*shape, name, mo, min(t_ours), mp, min(t_peer), mo / mp))
    if args.profile:
        rows = rows_cpu(1, 16, 2, 32, torch.float32)
        for name, ours, _ in rows[:2]:
            print("\ncProfile of flash_attn_func, %s (B1 N16 H2 D32 f32 causal):" % name)
            profile(ours, "cpu")


def cuda_table(args, device="cuda", backends=(("torch-flash", SDPBackend.FLASH_ATTENTION),
                                              ("cuDNN", SDPBackend.CUDNN_ATTENTION))):
    q, k, v, g = (torch.randn(1, 128, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(4))
    out, lse = flashc.attention(q, k, v, causal=True)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
    gt = g.transpose(1, 2)

    def fa_fwd_bwd():
        o = flashc.flash_attn_func(ql, kl, vl, causal=True)
        return torch.autograd.grad(o, (ql, kl, vl), g)
    fa_fwd_bwd.forward = lambda: flashc.flash_attn_func(ql, kl, vl, causal=True)

    def attention_fwd_bwd():
        o, _ = flashc.attention(ql, kl, vl, causal=True)
        return torch.autograd.grad(o, (ql, kl, vl), g)
    attention_fwd_bwd.forward = lambda: flashc.attention(ql, kl, vl, causal=True)[0]

    def fc_sdpa_fwd_bwd():
        o = flashc.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(o, (qt, kt, vt), gt)
    fc_sdpa_fwd_bwd.forward = lambda: flashc.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def sdpa_fwd_bwd():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(o, (qt, kt, vt), gt)

    # (name, call, the context it is timed under: a torch forward picks its backend when it runs)
    rows = [("flashc forward", lambda: flashc.attention(q, k, v, causal=True), contextlib.nullcontext),
            ("flashc flash_attn_func", lambda: flashc.flash_attn_func(q, k, v, causal=True), contextlib.nullcontext),
            ("flashc backward", lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=True),
             contextlib.nullcontext),
            ("flash_attn_func fwd+bwd", fa_fwd_bwd, cpp_autograd_off),
            ("attention fwd+bwd", attention_fwd_bwd, cpp_autograd_off),
            ("flashc sdpa fwd+bwd", fc_sdpa_fwd_bwd, cpp_autograd_off)]
    if args.cpp_autograd:
        rows += [("flash_attn_func fwd+bwd", fa_fwd_bwd, cpp_autograd_on),
                 ("attention fwd+bwd", attention_fwd_bwd, cpp_autograd_on),
                 ("flashc sdpa fwd+bwd", fc_sdpa_fwd_bwd, cpp_autograd_on)]
    for name, backend in backends:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        rows.append((name + " forward", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                     (lambda b: lambda: sdpa_kernel(b))(backend)))
        rows.append((name + " backward",
                     (lambda o: lambda: torch.autograd.grad(o, (qt, kt, vt), gt, retain_graph=True))(o),
                     contextlib.nullcontext))
        rows.append((name + " fwd+bwd", sdpa_fwd_bwd, (lambda b: lambda: sdpa_kernel(b))(backend)))
    # the forward + backward rows named by the autograd function they ran through (Py or C++)
    rows = [((name + " " + autograd_path(fn, context)).strip(), fn, context) for name, fn, context in rows]
    times = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, fn, context in rows:
            with context():
                times[name].append(host_us(fn, device, min(args.calls, 300)))
    for name, _, _ in rows:
        print("%-28s %7.1f us of host time per call (median of %d rounds, min %.1f)"
              % (name, statistics.median(times[name]), args.rounds, min(times[name])))
    if args.profile:
        print("\ncProfile of attention_backward:")
        profile(lambda: flashc.attention_backward(g, q, k, v, out, lse, causal=True), device)
        print("\ncProfile of flash_attn_func's forward + backward:")
        profile(fa_fwd_bwd, device)


def profile(fn, device):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    sync(device)
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
