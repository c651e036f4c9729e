#!/usr/bin/env python3
"""flashc's CUDA forward vs torch SDPA (flash-attn 2 backend, cuDNN backend), one process, CUDA events.

The CONVENTIONS.md sweep: hidden 2048 (H = 2048 / D), B = 16384 / N, N in 512..16k, D in {64, 128, 256}, causal
off/on, bf16 and fp16. flashc is called through ctypes on libflashc.so with the torch tensors' pointers, on
torch's current stream. Each implementation: warm-up, then the median of --runs timed calls, inputs rotated over
sets that together exceed the L2. Prints TFLOP/s (forward FLOPs 4 B H N^2 D, halved when causal) and ratios, and
flashc's peak memory against torch's math backend at a long N.

  python3 bench/compare_torch.py --lib build-gpu/libflashc.so [--quick] [--dtypes bf16] [--dims 128] ...
  python3 bench/compare_torch.py --backward [--lib ...] [...]   backward and forward + backward
                                                                (bench/compare_torch_bwd.py, its options)
"""
import argparse
import ctypes
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# ---- a minimal ctypes shim over include/flashc.h ------------------------------------------------------------

DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BACKEND_CUDA = 2


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", ctypes.c_int64 * 4),
                ("stride", ctypes.c_int64 * 4)]


def params_type(path):
    """flashc_params as the library at path lays it out: the Python package's ctypes structure, which it builds
    from the library's own description (flashc_params_field), so this shim copies no layout by hand."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    os.environ["FLASHC_LIBRARY"] = os.path.abspath(path)
    from flashc import _lib
    return _lib.Params


class Flashc:
    def __init__(self, path):
        lib = ctypes.CDLL(path)
        Params = params_type(path)
        lib.flashc_params_default.restype = Params
        lib.flashc_context_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.flashc_context_set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.flashc_context_last_error.argtypes = [ctypes.c_void_p]
        lib.flashc_context_last_error.restype = ctypes.c_char_p
        lib.flashc_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(Tensor), ctypes.POINTER(Tensor),
                                       ctypes.POINTER(Tensor), ctypes.POINTER(Params), ctypes.POINTER(Tensor),
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.flashc_forward_workspace_size.argtypes = [ctypes.c_void_p, ctypes.POINTER(Tensor), ctypes.POINTER(Tensor),
                                                      ctypes.POINTER(Tensor), ctypes.POINTER(Params),
                                                      ctypes.POINTER(ctypes.c_size_t)]
        self.lib = lib
        self.ctx = ctypes.c_void_p()
        self.check(lib.flashc_context_create(ctypes.byref(self.ctx), BACKEND_CUDA, torch.cuda.current_device()),
                   "context_create")

    def check(self, status, what):
        if status != 0:
            msg = self.lib.flashc_context_last_error(self.ctx if self.ctx else None)
            raise RuntimeError(f"flashc {what}: status {status}: {msg.decode() if msg else ''}")

    @staticmethod
    def view(t):
        assert t.dim() == 4
        return Tensor(t.data_ptr(), DTYPE[t.dtype], (ctypes.c_int64 * 4)(*t.shape), (ctypes.c_int64 * 4)(*t.stride()))

    def prepare(self, q, k, v, out, lse=None, causal=False, dropout_p=0.0):
        """A call of flashc_forward on torch CUDA tensors q (B, N, H, D), k/v (B, Nk, Hkv, D) with its ctypes
        arguments built once (the timed loop then pays one foreign call), on torch's current stream."""
        p = self.lib.flashc_params_default()
        p.causal = int(causal)
        if dropout_p:
            p.dropout_p, p.dropout_seed, p.dropout_offset = dropout_p, 0x5EED, 0
        tq, tk, tv, to = self.view(q), self.view(k), self.view(v), self.view(out)
        self.check(self.lib.flashc_context_set_stream(self.ctx, torch.cuda.current_stream().cuda_stream), "set_stream")
        ws = ctypes.c_size_t(0)
        self.check(self.lib.flashc_forward_workspace_size(self.ctx, tq, tk, tv, p, ctypes.byref(ws)), "workspace")
        buf = torch.empty(max(ws.value, 1), dtype=torch.uint8, device=q.device)
        lse_ptr = lse.data_ptr() if lse is not None else None
        fwd, ctx, args = self.lib.flashc_forward, self.ctx, (tq, tk, tv, p, to, lse_ptr, buf.data_ptr(), ws.value)

        def call():
            st = fwd(ctx, *args)
            if st != 0:
                self.check(st, "forward")
        call.keep = (buf, tq, tk, tv, to, p)
        return call

    def forward(self, q, k, v, out, lse=None, causal=False):
        self.prepare(q, k, v, out, lse, causal)()


# ---- timing ---------------------------------------------------------------------------------------------

def time_ms(calls, warmup, runs):
    """Median over runs of one call each, rotating over calls (one per input set), timed with CUDA events. The
    host does not wait between runs, so launch overhead hides behind the previous run as it would in a model."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for i, (a, b) in enumerate(ev):
        a.record()
        calls[i % len(calls)]()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def sdpa(backend, s, causal):
    q, k, v = (t.transpose(1, 2) for t in s[:3])  # (B, N, H, D) storage viewed as (B, H, N, D), no copies

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def main():
    if "--backward" in sys.argv[1:]:
        # The backward and forward + backward sweep lives beside this file; same shapes, same peers.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import compare_torch_bwd
        os.environ.setdefault("FLASHC_LIBRARY", "build-gpu/libflashc.so")
        argv = [a for a in sys.argv[1:] if a != "--backward"]
        if "--lib" in argv:
            i = argv.index("--lib")
            os.environ["FLASHC_LIBRARY"] = argv[i + 1]
            del argv[i:i + 2]
        return compare_torch_bwd.main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("FLASHC_LIBRARY", "build-gpu/libflashc.so"))
    ap.add_argument("--quick", action="store_true", help="bf16 only, N in {1k, 4k, 16k}, D in {64, 128}")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--lens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory comparison")
    ap.add_argument("--no-peers", action="store_true", help="time flashc only (lab runs of tile variants)")
    ap.add_argument("--dropout", type=float, default=0.0, help="flashc's calls with this dropout_p (peers without)")
    args = ap.parse_args()
    if args.quick:
        args.dtypes, args.dims, args.lens = "bf16", "64,128", "1024,4096,16384"
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[x] for x in args.dtypes.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    lens = [int(x) for x in args.lens.split(",")]
    causals = [bool(int(x)) for x in args.causal.split(",")]

    fc = Flashc(args.lib)
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}; cudnn "
          f"{torch.backends.cudnn.version()}; median of {args.runs} runs after {args.warmup} warm-up, inputs rotated")
    l2 = getattr(dev, "L2_cache_size", 50 << 20)

    rows = []
    for dt in dtypes:
        for D in dims:
            H = 2048 // D
            for N in lens:
                B = max(1, 16384 // N)
                per_set = 4 * B * N * H * D * 2
                nsets = max(2, math.ceil(3 * l2 / per_set))
                sets = []
                for _ in range(nsets):
                    q = torch.randn(B, N, H, D, device="cuda", dtype=dt)
                    k = torch.randn(B, N, H, D, device="cuda", dtype=dt)
                    v = torch.randn(B, N, H, D, device="cuda", dtype=dt)
                    sets.append((q, k, v, torch.empty_like(q)))
                for causal in causals:
                    flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
                    res = {}
                    # correctness against the flash backend on the first set
                    q, k, v, o = sets[0]
                    fc.forward(q, k, v, o, causal=causal)
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=causal).transpose(1, 2)
                    diff = (o.float() - ref.float()).abs().max().item()
                    res["flashc"] = time_ms([fc.prepare(*s, causal=causal, dropout_p=args.dropout) for s in sets],
                                            args.warmup, args.runs)
                    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        if args.no_peers:
                            res[name] = None
                            continue
                        try:
                            res[name] = time_ms([sdpa(be, s, causal) for s in sets], args.warmup, args.runs)
                        except RuntimeError as e:  # backend refuses the shape
                            res[name] = None
                            print(f"  {name} n/a for D={D} N={N}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
                    rows.append((str(dt).replace("torch.", ""), D, N, B, H, causal, flops, res, diff))
                    tf = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else float("nan")
                    print(f"  {rows[-1][0]:8s} D={D:3d} N={N:5d} B={B:2d} H={H:2d} causal={int(causal)} "
                          f"flashc {tf(res['flashc']):6.1f}  flash {tf(res['flash']):6.1f}  cudnn {tf(res['cudnn']):6.1f}"
                          f"  TFLOP/s  max|flashc-flash| {diff:.3g}", flush=True)
                del sets
                torch.cuda.empty_cache()

    if not args.no_memory:
        # peak memory at long N: flashc (out only beyond the inputs) vs the math backend (materializes S and P)
        B, H, D, N, dt = 1, 16, 128, 16384, torch.bfloat16
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=dt) for _ in range(3))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = torch.empty_like(q)
        fc.forward(q, k, v, o, causal=True)
        torch.cuda.synchronize()
        peak_fc = torch.cuda.max_memory_allocated() - base
        del o
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            with sdpa_kernel(SDPBackend.MATH):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True)
            torch.cuda.synchronize()
            peak_math = (torch.cuda.max_memory_allocated() - base) / 2**20
            del o
        except torch.OutOfMemoryError:
            peak_math = float("nan")
        print(f"\npeak memory beyond the inputs, B={B} H={H} N={N} D={D} bf16 causal: flashc {peak_fc / 2**20:.0f} MiB, "
              f"torch math backend {peak_math:.0f} MiB")

    print("\n| dtype | D | N | causal | flashc TFLOP/s | torch-flash | cuDNN | flashc/flash | flashc/cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = None
    for dt, D, N, B, H, causal, flops, res, diff in rows:
        tf = {k: (flops / (v * 1e-3) / 1e12 if v else None) for k, v in res.items()}
        r1 = tf["flashc"] / tf["flash"] if tf["flash"] else None
        r2 = tf["flashc"] / tf["cudnn"] if tf["cudnn"] else None
        if r1 is not None and (worst is None or r1 < worst[0]):
            worst = (r1, dt, D, N, causal)
        fmt = lambda x, p=1: f"{x:.{p}f}" if x is not None else "n/a"
        print(f"| {dt} | {D} | {N} | {int(causal)} | {fmt(tf['flashc'])} | {fmt(tf['flash'])} | {fmt(tf['cudnn'])} | "
              f"{fmt(r1, 2)} | {fmt(r2, 2)} |")
    if worst:
        print(f"\nlowest flashc/flash ratio: {worst[0]:.2f} ({worst[1]} D={worst[2]} N={worst[3]} causal={int(worst[4])})")


if __name__ == "__main__":
    main()
