#!/usr/bin/env python3
"""Ring attention over the GPUs of one host: flashc.distributed.ring_attention (NCCL) against flashc on one GPU at the
same per-GPU sequence length, and torch's context parallelism (DTensor's ring over SDPA) as the peer.

    torchrun --standalone --nproc_per_node 2 bench/ring.py [--ns 65536,131072,262144,524288] [--cp-ns 131072]

Shape: B 1, H 16, D 128 (hidden 2048), bf16, each rank holding N / W tokens in the zig-zag layout; causal off and
on; forward (no autograd) and forward + backward (autograd). A ring time is the slowest rank's CUDA-event time of one
call (all ranks start together after a barrier), the median of --runs after --warmup, every variant timed in
turns (one call of each per round). FLOPs: 4 B H N^2 D (halved
causal), forward + backward 3.5x that; per-GPU TFLOP/s divides by W. The one-GPU row is flashc.flash_attn_func on
(B, N / W, H, D) on each GPU alone, W calls back to back per timed run (the ring's per-GPU work, over as long a run);
efficiency = ring per-GPU TFLOP/s / one-GPU TFLOP/s.

--check first compares the ring's output and gradients (unsharded) with one GPU's flashc on the whole sequence at the
smallest N. --cp-ns: torch.distributed.tensor.experimental.context_parallel around F.scaled_dot_product_attention
with SDPA's cuDNN backend, torch's flash backend, and the flash backend run by flashc (flashc.torch_backend), at those
N; the same timing rule. Rank 0 prints one line per measurement and the tables last; --json FILE writes the rows.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402
import flashc.distributed as fcd  # noqa: E402

B, H, D = 1, 16, 128


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def _timed(fn):
    dist.barrier()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    t = torch.tensor([a.elapsed_time(b)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def turns(entries, runs, warmup):
    """Median over runs of the slowest rank's CUDA-event time of each entry, timed in turns (one call of each per
    round). entries: name -> (context factory or None, fn); the context (torch's context parallel, which shards its
    buffers on entry and restores them on exit) is entered around each call, outside the timed region. A failing
    entry is dropped with its reason printed (None)."""
    out = {name: [] for name in entries}
    for rnd in range(warmup + runs):
        for name, (ctx, fn) in entries.items():
            if out[name] is None:
                continue
            try:
                if ctx is None:
                    t = _timed(fn)
                else:
                    with ctx():
                        t = _timed(fn)
            except Exception as e:  # noqa: BLE001
                say("  %s failed: %s: %s" % (name, type(e).__name__, str(e)[:300]))
                out[name] = None
                continue
            if rnd >= warmup:
                out[name].append(t)
    return {name: (statistics.median(ts) if ts else None) for name, ts in out.items()}


def flops(n, causal, mode):
    f = 4.0 * B * H * n * n * D / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def tensors(n, dev, grad):
    g = torch.Generator(device=dev).manual_seed(1234 + n)
    q, k, v, do = (torch.randn((B, n, H, D), device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    return [t.requires_grad_(grad) for t in (q, k, v)] + [do]


ALIBI = {}  # --alibi: the slopes passed to every flashc call (ring and one GPU)


def ring_call(q, k, v, do, causal, mode):
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                fcd.ring_attention(q, k, v, causal=causal, **ALIBI)
    else:
        def fn():
            o = fcd.ring_attention(q, k, v, causal=causal, **ALIBI)
            torch.autograd.grad(o, (q, k, v), do)
    return fn


def one_gpu_call(q, k, v, do, causal, mode, times):
    """flash_attn_func `times` times back to back: as long a run as the ring's (W steps), so that both are timed at
    the clocks a GPU holds over that long."""
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                for _ in range(times):
                    flashc.flash_attn_func(q, k, v, causal=causal, **ALIBI)
    else:
        def fn():
            for _ in range(times):
                o = flashc.flash_attn_func(q, k, v, causal=causal, **ALIBI)
                torch.autograd.grad(o, (q, k, v), do)
    return fn


def check(n, world, dev):
    """Ring vs one GPU on the whole sequence: max |difference| over the max |one-GPU value|, per output."""
    res = {}
    for causal in (False, True):
        q, k, v, do = tensors(n, dev, True)
        ref = flashc.flash_attn_func(q, k, v, causal=causal, **ALIBI)
        rq, rk, rv = torch.autograd.grad(ref, (q, k, v), do)
        qs, ks, vs, dos = (fcd.shard(t.detach(), None).requires_grad_() for t in (q, k, v, do))
        out = fcd.ring_attention(qs, ks, vs, causal=causal, **ALIBI)
        gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), dos)
        for name, got, want in (("out", out, ref), ("dq", gq, rq), ("dk", gk, rk), ("dv", gv, rv)):
            full = fcd.unshard(got.detach().contiguous(), None)
            res["%s %s" % ("causal" if causal else "full", name)] = (
                (full.float() - want.float()).abs().max().item() / want.float().abs().max().item())
        del q, k, v, do, ref, rq, rk, rv, qs, ks, vs, dos, out, gq, gk, gv
    return res


def torch_cp_entries(n, world, dev, causal, mode, backends):
    """name -> (context factory, fn): torch's context parallel around F.scaled_dot_product_attention on the whole
    (B, H, N, D) tensors, one entry per SDPA backend (cudnn, torch's flash, flash run by flashc.torch_backend)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashc.torch_backend as tb

    try:  # torch's load balancing (head-tail chunks) is for causal attention only
        from torch.distributed.tensor.experimental import _attention as cp_attention
        cp_attention._cp_options.enable_load_balance = bool(causal)
    except (ImportError, AttributeError) as e:
        say("  (torch's context parallel options not found: %s)" % e)
    mesh = init_device_mesh("cuda", (world,))
    q, k, v, do = (t.detach().transpose(1, 2).contiguous() for t in tensors(n, dev, False))
    entries = {}
    for name in backends:
        backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION

        @contextlib.contextmanager
        def ctx(name=name, backend=backend):
            if name == "flashc":
                tb.enable()
            try:
                with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
                    with sdpa_kernel(backend):
                        yield
            finally:
                if name == "flashc":
                    tb.disable()

        if mode == "fwd":
            def fn():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        else:
            def fn():
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal))
                torch.autograd.grad(o, (qg, kg, vg), do)
        entries["cp_" + name] = (ctx, fn)
    return entries


def profile(fns, title):
    """torch.profiler's CUDA kernel table of one call of each fn (every rank runs them; rank 0 prints)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        say("\n---- profile: %s, %s ----" % (title, name))
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="65536,131072,262144,524288")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--cp-ns", default="131072")
    ap.add_argument("--cp-backends", default="cudnn,flash,flashc")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes 2^(-8 (h + 1) / H) on every call (the ring "
                    "then passes positions, one call per chunk pair)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables at the first N (forward)")
    ap.add_argument("--json")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, dev = dist.get_world_size(), torch.device("cuda", local)
    if a.alibi:
        ALIBI["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=dev)
    say("ring.py: %d x %s, torch %s, NCCL %s, flashc %s%s" % (
        world, torch.cuda.get_device_name(), torch.__version__, ".".join(map(str, torch.cuda.nccl.version())),
        flashc.library_version(), ", ALiBi" if a.alibi else ""))
    ns = [int(x) for x in a.ns.split(",") if x]
    if a.check:
        for k_, v_ in check(ns[0], world, dev).items():
            say("check N %d %-12s max|ring - one GPU| / max|one GPU| = %.2e" % (ns[0], k_, v_))
    rows = []
    for n in ns:
        nl = n // world
        for causal in (int(c) for c in a.causal.split(",")):
            for mode in a.modes.split(","):
                q, k, v, do = tensors(nl, dev, mode != "fwd")
                entries = {"one_gpu": (None, one_gpu_call(q, k, v, do, causal, mode, world)),
                           "ring": (None, ring_call(q, k, v, do, causal, mode))}
                if n in [int(x) for x in a.cp_ns.split(",") if x]:
                    entries.update(torch_cp_entries(n, world, dev, causal, mode, a.cp_backends.split(",")))
                if a.profile and n == ns[0] and mode == "fwd":
                    profile({"ring": entries["ring"][1], "one GPU x W": entries["one_gpu"][1]},
                            "N %d causal %d %s" % (n, causal, mode))
                ms = turns(entries, a.runs, a.warmup)
                tr, t1 = ms.pop("ring"), ms.pop("one_gpu") / world
                del q, k, v, do, entries
                row = dict(world=world, n=n, n_local=nl, causal=causal, mode=mode, ring_ms=tr, one_gpu_ms=t1,
                           ring_tflops_per_gpu=flops(n, causal, mode) / world / tr / 1e9,
                           one_gpu_tflops=flops(nl, causal, mode) / t1 / 1e9)
                row["efficiency"] = row["ring_tflops_per_gpu"] / row["one_gpu_tflops"]
                row.update({k_ + "_ms": v_ for k_, v_ in ms.items()})
                if "cp_flashc" in ms:
                    import flashc.torch_backend as tb
                    say("  flashc.torch_backend calls so far: %s" % dict(tb.calls))
                rows.append(row)
                say("N %7d (%6d / GPU) causal %d %-7s ring %9.2f ms %6.1f TFLOP/s/GPU | one GPU %9.2f ms %6.1f | "
                    "eff %.3f%s" % (n, nl, causal, mode, tr, row["ring_tflops_per_gpu"], t1, row["one_gpu_tflops"],
                                    row["efficiency"], "".join(" | cp %s %s ms" % (k_[3:-3], "%.2f" % v_ if v_ else "-")
                                                              for k_, v_ in row.items() if k_.startswith("cp_"))))
    say("\n| W | N | N / GPU | causal | pass | ring ms | ring TFLOP/s per GPU | one GPU TFLOP/s | efficiency |")
    say("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        say("| %d | %d | %d | %d | %s | %.2f | %.1f | %.1f | %.3f |" % (
            r["world"], r["n"], r["n_local"], r["causal"], r["mode"], r["ring_ms"], r["ring_tflops_per_gpu"],
            r["one_gpu_tflops"], r["efficiency"]))
    cps = [r for r in rows if any(k_.startswith("cp_") for k_ in r)]
    if cps:
        say("\n| N | causal | pass | flashc ring ms | torch CP + cuDNN ms | torch CP + torch flash ms | "
            "torch CP + flashc (torch_backend) ms |")
        say("|---|---|---|---|---|---|---|")
        for r in cps:
            say("| %d | %d | %s | %.2f | %s | %s | %s |" % (
                r["n"], r["causal"], r["mode"], r["ring_ms"],
                *("%.2f" % r[c] if r.get(c) else "-" for c in ("cp_cudnn_ms", "cp_flash_ms", "cp_flashc_ms"))))
    if a.json and dist.get_rank() == 0:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
