#!/usr/bin/env python3
"""The FlashAttention papers' claims measured on this machine: PNG figures and CSV numbers (issue 20).

    FLASHC_LIBRARY=build/libflashc.so PYTHONPATH=python python3 bench/paper.py [--quick] [--out DIR] [--device cpu|cuda]

Five figures, each with a CSV of its numbers and a caption (machine, date, commit, command) in DIR/figures.md:
  1. runtime vs N: flashc against standard attention (materialized S = QK^T and P = softmax(S)), forward and
     forward + backward. Standard attention is torch's math SDPA backend on the GPU, torch.matmul - softmax -
     matmul (BLAS) on the CPU; both differentiated by torch autograd, flashc through its torch binding.
  2. extra memory vs N beyond the inputs, outputs and gradients. GPU: torch.cuda.max_memory_allocated minus the
     memory allocated before the call. CPU: computed, not measured: standard attention holds S and P (two N x N
     fp32 matrices per head) at its peak, flashc the log-sum-exp (N fp32 per head; its per-thread tiles do not
     grow with N and are not counted). Standard attention is not run past a cap (--cap-gib, stated in the figure).
  3. HBM bytes of one forward vs N, from Nsight Compute (dram__bytes_read.sum + dram__bytes_write.sum over the
     call's kernels) when `ncu` is on PATH and the device is a GPU, beside the models Theta(N^2 d^2 / M) (flashc,
     M = this GPU's shared memory per SM) and Theta(N d + N^2) (standard), constant 1, in bytes.
  4. block-sparse forward and forward + backward time vs the fraction of blocks kept (flashc's block_mask; random
     blocks plus the diagonal, so every row sees a key), over dense flashc's time, beside the ideal (the density).
  5. the backward alone: flashc's (recomputes P from Q, K and the log-sum-exp) against standard attention's
     backward through torch autograd, which reads the P its forward stored.
Times are medians of --reps runs taken in turns (flashc, peer, flashc, peer, ...) after a warm-up; CUDA events on
the GPU, time.perf_counter on the CPU. Shapes: CPU B 1, H 4, D 64, fp32; GPU B 1, H 16, D 64, fp16.
"""
import argparse
import csv
import datetime
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import flashc  # noqa: E402

GIB = 1 << 30


# --- progress and captions ------------------------------------------------------------------------------------

class Progress:
    """One line on stderr, rewritten in place: figure, step, elapsed seconds."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, msg):
        line = "[paper %5.1fs] %s" % (time.perf_counter() - self.t0, msg)
        if self.tty:
            sys.stderr.write("\r" + line[:118].ljust(118))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self):
        if self.tty:
            sys.stderr.write("\n")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit():
    if os.environ.get("FLASHC_COMMIT"):  # a tree copied without its .git (a remote machine's run) names it
        return os.environ["FLASHC_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                           timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def machine_name(dev, threads):
    if dev == "cuda":
        return "%s (torch %s, CUDA %s)" % (torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    return "%s, %d threads of %d cores (torch %s)" % (cpu_model(), threads, os.cpu_count() or 0, torch.__version__)


# --- timing ---------------------------------------------------------------------------------------------------

def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def medians_in_turns(fns, reps, dev, warmup=1):
    """Median seconds of each callable in fns (name -> fn), one call of each per round so that a slow stretch of
    the machine (a neighbour on the VM, GPU clocks) falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(dev)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def medians_or_oom(fns, reps, dev):
    """medians_in_turns; when the peer ("standard") runs out of device memory, flashc's alone, the peer's
    time missing (NaN): where standard attention runs out below the cap, the figures show it as a gap."""
    try:
        return medians_in_turns(fns, reps, dev)
    except torch.OutOfMemoryError:
        if "standard" not in fns:
            raise
        fns = {n: f for n, f in fns.items() if n != "standard"}
        torch.cuda.empty_cache()
        sys.stderr.write("\nstandard attention ran out of memory; flashc alone at this N\n")
        return medians_in_turns(fns, reps, dev)


# --- the two implementations, on (B, H, N, D) tensors -----------------------------------------------------------

def standard_attention(q, k, v, dev):
    """Materialized attention: S = scale Q K^T and P = softmax(S) are N x N per head."""
    if dev == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def flashc_attention(q, k, v, **kw):
    """flashc on the same (B, H, N, D) tensors, passed as (B, N, H, D) views (strides, no copies)."""
    out, lse = flashc.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2), lse


def make_inputs(B, H, N, D, dtype, dev, seed=0, grad=True):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(B, H, N, D, dtype=dtype, device=dev, generator=g).requires_grad_(grad and i < 3)
            for i in range(4)]


def std_bytes(B, H, N, dtype):
    """Bytes of the N x N matrices standard attention holds at its peak: S and P (the math backend computes them
    in the inputs' dtype on the GPU; fp32 on the CPU here)."""
    return 2 * B * H * N * N * torch.tensor([], dtype=dtype).element_size()


# --- figures --------------------------------------------------------------------------------------------------

def write_csv(path, caption, header, rows):
    with open(path, "w", newline="") as f:
        for line in caption.splitlines():
            f.write("# " + line + "\n")
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow(["" if (isinstance(x, float) and math.isnan(x)) else
                        (("%.6g" % x) if isinstance(x, float) else x) for x in r])


def fig_runtime(cfg, prog):
    B, H, D, dt, dev = cfg.B, cfg.H, cfg.D, cfg.dtype, cfg.dev
    rows = []
    for i, N in enumerate(cfg.ns):
        prog("1/5 runtime vs N: N %d (%d/%d)" % (N, i + 1, len(cfg.ns)))
        q, k, v, g = make_inputs(B, H, N, D, dt, dev)
        run_std = std_bytes(B, H, N, dt) <= cfg.cap
        fwd = {"flashc": lambda: flashc_attention(q.detach(), k.detach(), v.detach())}
        fb = {"flashc": lambda: torch.autograd.grad(flashc_attention(q, k, v)[0], (q, k, v), g)}
        if run_std:
            def std_fwd():
                with torch.no_grad():
                    standard_attention(q, k, v, dev)
            fwd["standard"] = std_fwd
            fb["standard"] = lambda: torch.autograd.grad(standard_attention(q, k, v, dev), (q, k, v), g)
        tf = medians_or_oom(fwd, cfg.reps, dev)
        tb = medians_or_oom(fb, cfg.reps, dev)
        nan = float("nan")
        rows.append((N, tf["flashc"] * 1e3, tf.get("standard", nan) * 1e3, tb["flashc"] * 1e3,
                     tb.get("standard", nan) * 1e3))
    return rows


def plot_runtime(plt, rows, cfg, path):
    ns = [r[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, (fi, si), title in zip(axes, ((1, 2), (3, 4)), ("forward", "forward + backward")):
        ax.plot(ns, [r[fi] for r in rows], "o-", label="flashc")
        sn = [(r[0], r[si]) for r in rows if not math.isnan(r[si])]
        if sn:
            ax.plot(*zip(*sn), "s--", label="standard (%s)" % cfg.std_name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("runtime vs N, B %d H %d D %d %s" % (cfg.B, cfg.H, cfg.D, cfg.dtype_name), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg.dpi)
    plt.close(fig)


def fig_memory(cfg, prog):
    B, H, D, dt, dev = cfg.B, cfg.H, cfg.D, cfg.dtype, cfg.dev
    rows = []
    ns = cfg.mem_ns
    for i, N in enumerate(ns):
        prog("2/5 extra memory vs N: N %d (%d/%d)" % (N, i + 1, len(ns)))
        over = std_bytes(B, H, N, dt) > cfg.cap
        if dev == "cuda":
            res = []
            for name in ("flashc", "standard"):
                if name == "standard" and over:
                    res += [float("nan"), float("nan")]
                    continue
                q, k, v, g = make_inputs(B, H, N, D, dt, dev)
                f = (lambda: flashc_attention(q, k, v)[0]) if name == "flashc" else \
                    (lambda: standard_attention(q, k, v, dev))
                for with_bwd in (False, True):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    try:
                        if with_bwd:
                            out = f()
                            torch.autograd.grad(out, (q, k, v), g)
                            # the outputs and gradients are what the caller asked for, not extra
                            own = out.numel() * out.element_size() * 4
                            del out
                        else:
                            with torch.no_grad():
                                out = f()
                            own = out.numel() * out.element_size()
                            del out
                        torch.cuda.synchronize()
                        res.append((torch.cuda.max_memory_allocated() - base - own) / 2 ** 20)
                    except torch.OutOfMemoryError:
                        res.append(float("nan"))
                        torch.cuda.empty_cache()
                del q, k, v, g
                torch.cuda.empty_cache()
            rows.append((N, res[0], res[2], res[1], res[3], int(over)))
        else:
            fl = B * H * N * 4 / 2 ** 20
            st = std_bytes(B, H, N, dt) / 2 ** 20
            # forward alone (no grad) and forward + backward hold the same S and P at the peak.
            rows.append((N, fl, st, fl, st, int(over)))
    return rows


def plot_memory(plt, rows, cfg, path):
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ns = [r[0] for r in rows]
    ax.plot(ns, [max(r[3], 1e-3) for r in rows], "o-", label="flashc")
    run = [(r[0], r[4]) for r in rows if not r[5] and not math.isnan(r[4])]
    if run:
        ax.plot(*zip(*run), "s--", label="standard (%s)" % cfg.std_name)
    would = [(r[0], r[4]) for r in rows if r[5] and not math.isnan(r[4])]
    if would and run:  # the CPU's computed S and P past the cap: what standard attention would need
        ax.plot(*zip(run[-1], *would), "s:", color="C1", alpha=0.4, label="standard, would need (not run)")
    over = [r[0] for r in rows if r[5]]
    if over:
        ax.axvline(min(over), color="red", alpha=0.5)
        ax.text(min(over), ax.get_ylim()[1], " standard over the %.2g GiB cap" % (cfg.cap / GIB), color="red",
                fontsize=7, va="top")
    ax.axhline(cfg.cap / 2 ** 20, color="red", ls=":", alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("extra MiB (%s)" % ("measured, fwd+bwd" if cfg.dev == "cuda" else "computed"))
    ax.set_title("extra memory vs N, B %d H %d D %d %s" % (cfg.B, cfg.H, cfg.D, cfg.dtype_name), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg.dpi)
    plt.close(fig)


def ncu_worker(args):
    """Runs inside ncu: one forward of one implementation, between cudaProfilerStart and Stop."""
    dt = torch.float16
    q, k, v, _ = make_inputs(1, args.heads or 16, args.ncu_n, 64, dt, "cuda", grad=False)
    f = (lambda: flashc_attention(q, k, v)) if args.ncu_impl == "flashc" else \
        (lambda: standard_attention(q, k, v, "cuda"))
    f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def ncu_bytes(impl, N, cfg):
    cmd = ["ncu", "--profile-from-start", "off", "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
           "--csv", "--print-units", "base", sys.executable, os.path.abspath(__file__), "--_ncu-impl", impl,
           "--_ncu-n", str(N), "--heads", str(cfg.H)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    total, seen = 0.0, False
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name", "").startswith("dram__bytes"):
            total += float(row["Metric Value"].replace(",", ""))
            seen = True
    if not seen:
        raise RuntimeError("ncu gave no dram bytes (rc %d): %s" % (r.returncode, (r.stderr or r.stdout)[-300:]))
    return total


def smem_per_sm():
    p = torch.cuda.get_device_properties(0)
    for name in ("shared_memory_per_multiprocessor", "shared_memory_per_block_optin", "shared_memory_per_block"):
        if getattr(p, name, 0):
            return int(getattr(p, name)), name
    return 228 * 1024, "assumed 228 KiB"


def fig_hbm(cfg, prog):
    """Returns (rows, message); rows empty when the figure is skipped."""
    if cfg.dev != "cuda":
        return [], "HBM bytes: skipped: no GPU (device cpu); the figure needs Nsight Compute on a GPU"
    from shutil import which
    if which("ncu") is None:
        return [], "HBM bytes: skipped: Nsight Compute (ncu) is not on PATH"
    M, mname = smem_per_sm()
    B, H, D, elt = 1, cfg.H, cfg.D, 2
    rows = []
    for i, N in enumerate(cfg.hbm_ns):
        prog("3/5 HBM bytes (ncu): N %d (%d/%d)" % (N, i + 1, len(cfg.hbm_ns)))
        try:
            fl = ncu_bytes("flashc", N, cfg)
            st = ncu_bytes("standard", N, cfg) if std_bytes(B, H, N, torch.float16) <= cfg.cap else float("nan")
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # e.g. no permission for the counters
            return [], "HBM bytes: skipped: ncu failed at N %d: %s" % (N, str(e)[:300])
        m_fl = B * H * (N * N * D * D * elt / M + 4 * N * D * elt)
        m_st = B * H * (4 * N * D + 4 * N * N) * elt
        rows.append((N, fl / 1e6, st / 1e6, m_fl / 1e6, m_st / 1e6, M))
    return rows, "HBM bytes: measured with ncu, M = %d bytes (%s)" % (M, mname)


def plot_hbm(plt, rows, cfg, path):
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ns = [r[0] for r in rows]
    ax.plot(ns, [r[1] for r in rows], "o-", label="flashc (ncu)")
    st = [(r[0], r[2]) for r in rows if not math.isnan(r[2])]
    if st:
        ax.plot(*zip(*st), "s-", label="standard (ncu)")
    ax.plot(ns, [r[3] for r in rows], "k:", label="model N²d²/M + 4Nd (M %d KiB)" % (rows[0][5] // 1024))
    ax.plot(ns, [r[4] for r in rows], "k--", label="model 4Nd + 4N²")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("DRAM MB, one forward")
    ax.set_title("HBM traffic vs N, B 1 H %d D %d fp16" % (cfg.H, cfg.D), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg.dpi)
    plt.close(fig)


def fig_blocksparse(cfg, prog):
    B, H, D, dt, dev, N, blk = cfg.B, cfg.H, cfg.D, cfg.dtype, cfg.dev, cfg.bs_n, cfg.bs_block
    q, k, v, g = (x.detach() for x in make_inputs(B, H, N, D, dt, dev))
    nb = (N + blk - 1) // blk

    def fns(mask):
        kw = dict(block_mask=mask, block_size=(blk, blk)) if mask is not None else {}

        def fwd():
            flashc_attention(q, k, v, **kw)

        def fb():
            o, lse = flashc_attention(q, k, v, **kw)
            flashc.attention_backward(g.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                      v.transpose(1, 2), o.transpose(1, 2), lse, **kw)
        return fwd, fb

    rows = []
    for i, dens in enumerate(cfg.densities):
        prog("4/5 block-sparse: density %g (%d/%d)" % (dens, i + 1, len(cfg.densities)))
        m = torch.rand(nb, nb, generator=torch.Generator().manual_seed(1)) < dens
        m |= torch.eye(nb, dtype=torch.bool)
        kept = m.float().mean().item()
        f, fb = fns(m.to(torch.uint8).to(dev))
        df, dfb = fns(None)
        t = medians_in_turns({"dense_f": df, "f": f, "dense_fb": dfb, "fb": fb}, cfg.reps, dev)
        rows.append((dens, kept, t["f"] * 1e3, t["fb"] * 1e3, t["dense_f"] * 1e3, t["dense_fb"] * 1e3,
                     t["f"] / t["dense_f"], t["fb"] / t["dense_fb"]))
    return rows


def plot_blocksparse(plt, rows, cfg, path):
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    kept = [r[1] for r in rows]
    ax.plot(kept, [r[6] for r in rows], "o-", label="forward")
    ax.plot(kept, [r[7] for r in rows], "s-", label="forward + backward")
    ax.plot([0, 1], [0, 1], "k:", label="ideal (time ∝ blocks kept)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, max(1.1, max(max(r[6], r[7]) for r in rows) * 1.05))
    ax.set_xlabel("fraction of %dx%d blocks kept" % (cfg.bs_block, cfg.bs_block))
    ax.set_ylabel("time / dense flashc time")
    ax.set_title("block-sparse flashc, N %d B %d H %d D %d %s" % (cfg.bs_n, cfg.B, cfg.H, cfg.D, cfg.dtype_name),
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg.dpi)
    plt.close(fig)


def fig_backward(cfg, prog):
    B, H, D, dt, dev = cfg.B, cfg.H, cfg.D, cfg.dtype, cfg.dev
    rows = []
    ns = [n for n in cfg.ns if std_bytes(B, H, n, dt) <= cfg.cap]
    for i, N in enumerate(ns):
        prog("5/5 backward, recompute vs stored P: N %d (%d/%d)" % (N, i + 1, len(ns)))
        q, k, v, g = make_inputs(B, H, N, D, dt, dev)
        qd, kd, vd, gd = (x.detach().transpose(1, 2) for x in (q, k, v, g))
        o, lse = flashc.attention(qd, kd, vd)
        fns = {"flashc": lambda: flashc.attention_backward(gd, qd, kd, vd, o, lse)}
        try:
            out_std = standard_attention(q, k, v, dev)  # its autograd graph holds P
            fns["standard"] = lambda: torch.autograd.grad(out_std, (q, k, v), g, retain_graph=True)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
        t = medians_or_oom(fns, cfg.reps, dev)
        out_std = None
        rows.append((N, t["flashc"] * 1e3, t.get("standard", float("nan")) * 1e3,
                     std_bytes(B, H, N, dt) / 2 / 2 ** 20,
                     B * H * N * 4 / 2 ** 20))
    return rows


def plot_backward(plt, rows, cfg, path):
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    x = list(range(len(rows)))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r[1] for r in rows], w, label="flashc backward (recomputes P from Q, K, lse)")
    ax.bar([i + w / 2 for i in x], [r[2] for r in rows], w,
           label="standard backward, torch autograd (reads the stored P)")
    ax.set_xticks(x)
    ax.set_xticklabels(["N %d" % r[0] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("backward ms (median)")
    ax.set_title("backward alone, B %d H %d D %d %s" % (cfg.B, cfg.H, cfg.D, cfg.dtype_name), fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg.dpi)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------------------

def ints(s):
    return [int(x) for x in s.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small N, few repetitions (about a minute on 2 cores)")
    ap.add_argument("--out", default="paper-figures")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cuda when torch sees a GPU and flashc has the CUDA backend")
    ap.add_argument("--ns", default=None, help="sequence lengths for figures 1, 2 and 5 (comma list)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per point (median)")
    ap.add_argument("--bs-n", type=int, default=None, help="N of the block-sparse figure")
    ap.add_argument("--bs-block", type=int, default=None, help="block size of the block-sparse figure")
    ap.add_argument("--densities", default="1,0.5,0.25,0.1")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="standard attention is not run when its S and P would exceed this (default: CPU 2, "
                         "quick 0.25; GPU a third of the device's memory)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: all cores)")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--dpi", type=int, default=80)
    ap.add_argument("--_ncu-impl", dest="ncu_impl", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_ncu-n", dest="ncu_n", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ncu_impl:
        return ncu_worker(args)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dev = args.device or ("cuda" if torch.cuda.is_available() and flashc.cuda_available() else "cpu")
    cfg = argparse.Namespace(dev=dev, dpi=args.dpi, B=1, D=64)
    if dev == "cuda":
        cfg.H, cfg.dtype, cfg.dtype_name, cfg.std_name = args.heads or 16, torch.float16, "fp16", "torch math SDPA"
        cfg.ns = ints(args.ns) if args.ns else ([512, 1024, 2048, 4096] if args.quick else
                                                [512, 1024, 2048, 4096, 8192, 16384])
        cfg.mem_ns = cfg.ns + ([] if args.ns else [32768, 65536])
        cfg.hbm_ns = [n for n in cfg.ns if n <= 8192]
        cfg.reps = args.reps or (5 if args.quick else 20)
        cfg.bs_n, cfg.bs_block = args.bs_n or (4096 if args.quick else 8192), args.bs_block or 128
        cap = args.cap_gib * GIB if args.cap_gib else torch.cuda.get_device_properties(0).total_memory / 3
        threads = torch.get_num_threads()
    else:
        cfg.H, cfg.dtype, cfg.dtype_name, cfg.std_name = args.heads or 4, torch.float32, "fp32", "matmul-softmax-matmul"
        threads = args.threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        flashc.set_num_threads(threads)
        cfg.ns = ints(args.ns) if args.ns else ([256, 512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096])
        cfg.mem_ns = cfg.ns + ([] if args.ns else [8192, 16384, 32768, 65536])
        cfg.hbm_ns = []
        cfg.reps = args.reps or (3 if args.quick else 7)
        # 128 x 128 blocks: at 64 x 64 a kept block still costs the CPU kernel's whole tile of rows.
        cfg.bs_n, cfg.bs_block = args.bs_n or (2048 if args.quick else 4096), args.bs_block or 128
        cap = (args.cap_gib or (0.25 if args.quick else 2.0)) * GIB
    cfg.cap = cap
    cfg.densities = [float(x) for x in args.densities.split(",")]
    os.makedirs(args.out, exist_ok=True)

    machine = machine_name(dev, threads)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit()
    command = "FLASHC_LIBRARY=%s PYTHONPATH=python python3 bench/paper.py %s" % (
        os.environ.get("FLASHC_LIBRARY", flashc.library_path), " ".join(shlex.quote(a) for a in
                                                                         (argv if argv is not None else sys.argv[1:])))
    head = "machine: %s\ndate: %s\ncommit: %s (flashc %s)\ncommand: %s" % (machine, date, commit,
                                                                         flashc.library_version(), command)
    prog = Progress()
    md = ["# flashc paper figures", "", head.replace("\n", "  \n"), ""]
    t_start = time.perf_counter()

    def emit(name, title, what, header, rows):
        cap_text = "%s\n%s\n%s" % (title, what, head)
        write_csv(os.path.join(args.out, name + ".csv"), cap_text, header, rows)
        md.extend(["## %s" % title, "", "![%s](%s.png)" % (title, name), "", what, "",
                   "Numbers: [%s.csv](%s.csv)" % (name, name), ""])

    rows = fig_runtime(cfg, prog)
    plot_runtime(plt, rows, cfg, os.path.join(args.out, "fig1_runtime.png"))
    emit("fig1_runtime", "1. Runtime vs N",
         "flashc against standard attention (%s), B %d H %d D %d %s, medians of %d runs in turns; forward (no "
         "grad) and forward + backward (torch autograd). Standard not run where S and P exceed %.3g GiB."
         % (cfg.std_name, cfg.B, cfg.H, cfg.D, cfg.dtype_name, cfg.reps, cap / GIB),
         ["N", "flashc_fwd_ms", "standard_fwd_ms", "flashc_fwdbwd_ms", "standard_fwdbwd_ms"], rows)

    rows = fig_memory(cfg, prog)
    plot_memory(plt, rows, cfg, os.path.join(args.out, "fig2_memory.png"))
    how = ("measured: torch.cuda.max_memory_allocated() minus memory_allocated() before the call, less the "
           "output (and, with backward, the three gradients)" if dev == "cuda" else
           "computed, not measured: standard = S and P, 2·B·H·N² fp32; flashc = the log-sum-exp, B·H·N fp32 "
           "(its per-thread tiles do not grow with N and are not counted)")
    emit("fig2_memory", "2. Extra memory vs N",
         "Extra memory beyond inputs and outputs, %s. Cap: standard attention is not run where its S and P would "
         "exceed %.3g GiB (over_cap = 1; on the CPU the computed value is still listed)." % (how, cap / GIB),
         ["N", "flashc_fwd_MiB", "standard_fwd_MiB", "flashc_fwdbwd_MiB", "standard_fwdbwd_MiB", "over_cap"], rows)

    rows, msg = fig_hbm(cfg, prog)
    if rows:
        plot_hbm(plt, rows, cfg, os.path.join(args.out, "fig3_hbm.png"))
        emit("fig3_hbm", "3. HBM bytes vs N",
             "%s. One forward, B 1 H %d D %d fp16; DRAM read + write bytes summed over the call's kernels; "
             "models in bytes with constant 1." % (msg, cfg.H, cfg.D),
             ["N", "flashc_MB", "standard_MB", "model_flash_MB", "model_standard_MB", "M_bytes"], rows)
    else:
        md.extend(["## 3. HBM bytes vs N", "", msg + ".", ""])
        prog.done()
        print(msg, flush=True)

    rows = fig_blocksparse(cfg, prog)
    plot_blocksparse(plt, rows, cfg, os.path.join(args.out, "fig4_blocksparse.png"))
    emit("fig4_blocksparse", "4. Block-sparse time vs density",
         "flashc.attention with block_mask (%dx%d blocks, random plus the diagonal, one mask for all heads) at "
         "N %d, B %d H %d D %d %s; forward and forward + backward (flashc.attention_backward), each over dense "
         "flashc (no mask) timed in the same turns; kept = the fraction of blocks actually kept."
         % (cfg.bs_block, cfg.bs_block, cfg.bs_n, cfg.B, cfg.H, cfg.D, cfg.dtype_name),
         ["density", "kept", "fwd_ms", "fwdbwd_ms", "dense_fwd_ms", "dense_fwdbwd_ms", "fwd_over_dense",
          "fwdbwd_over_dense"], rows)

    rows = fig_backward(cfg, prog)
    plot_backward(plt, rows, cfg, os.path.join(args.out, "fig5_backward.png"))
    emit("fig5_backward", "5. Backward: recomputation vs stored P",
         "The backward alone. flashc: flashc.attention_backward, which recomputes P blockwise from Q, K and the "
         "log-sum-exp (keeps lse_MiB between forward and backward). standard: torch.autograd.grad through %s, "
         "whose forward stored P (P_MiB). B %d H %d D %d %s, medians of %d runs in turns."
         % (cfg.std_name, cfg.B, cfg.H, cfg.D, cfg.dtype_name, cfg.reps),
         ["N", "flashc_bwd_ms", "standard_bwd_ms", "P_MiB", "lse_MiB"], rows)

    prog("done in %.1f s" % (time.perf_counter() - t_start))
    prog.done()
    with open(os.path.join(args.out, "figures.md"), "w") as f:
        f.write("\n".join(md))
    print("wrote %s (figures.md, fig*.png, fig*.csv) in %.1f s" % (args.out, time.perf_counter() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
