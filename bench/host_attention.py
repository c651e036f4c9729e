#!/usr/bin/env python3
"""Host time per call of flashc.attention (flashc's own function) at tiny shapes, beside torch's SDPA: the rows
bench/host_overhead.py's CPU table does not have (it times the flash-attn functions and flashc's SDPA there).

Rows, each timed in rounds taken in turns with the peer (host_overhead.py's method and timer):
  attention fwd      flashc.attention(q, k, v, causal=True) under torch.no_grad() against
                     F.scaled_dot_product_attention(is_causal=True) on the (B, H, N, D) views of the same data
  attention fwd+bwd  the same with q, k, v requiring grad, then torch.autograd.grad of out
  attention_backward flashc.attention_backward (no autograd) against torch.autograd.grad of a stored SDPA output
On CUDA the time is the host side of each call (kernels queued, not waited for); on the CPU the whole call.

    FLASHC_LIBRARY=build/libflashc.so python3 bench/host_attention.py [--device cpu] [--threads 1] [--rounds 5]
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "python"))
sys.path.insert(0, _HERE)
import flashc  # noqa: E402
from host_overhead import host_us  # noqa: E402


def rows(b, n, h, d, dtype, device):
    q, k, v, g = (torch.randn(b, n, h, d, dtype=dtype, device=device) for _ in range(4))
    qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, g))
    ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
    qtl, ktl, vtl = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    out, lse = flashc.attention(q, k, v, causal=True)
    o_t = F.scaled_dot_product_attention(qtl, ktl, vtl, is_causal=True)

    def fc_fwd():
        with torch.no_grad():
            return flashc.attention(q, k, v, causal=True)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def fc_fwd_bwd():
        o, _ = flashc.attention(ql, kl, vl, causal=True)
        return torch.autograd.grad(o, (ql, kl, vl), g)

    def sdpa_fwd_bwd():
        o = F.scaled_dot_product_attention(qtl, ktl, vtl, is_causal=True)
        return torch.autograd.grad(o, (qtl, ktl, vtl), gt)

    def fc_bwd():
        return flashc.attention_backward(g, q, k, v, out, lse, causal=True)

    def sdpa_bwd():
        return torch.autograd.grad(o_t, (qtl, ktl, vtl), gt, retain_graph=True)

    return [("attention fwd", fc_fwd, sdpa_fwd), ("attention fwd+bwd", fc_fwd_bwd, sdpa_fwd_bwd),
            ("attention_backward", fc_bwd, sdpa_bwd)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per row, taken in turns with the peer")
    ap.add_argument("--calls", type=int, default=1000, help="calls per round")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (flashc's CPU calls follow torch's count); 0 leaves it")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("torch %s, flashc %s (%s), %s, %d torch threads" % (torch.__version__, flashc.__version__,
                                                               flashc.library_path, args.device,
                                                               torch.get_num_threads()))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    calls = args.calls if args.device == "cpu" else min(args.calls, 300)
    print("%-30s %-20s %14s %14s %7s   (median of %d rounds; min in brackets)"
          % ("shape", "row", "flashc us", "torch us", "ratio", args.rounds))
    for shape in ((1, 16, 2, 32), (1, 128, 2, 64)):
        for name, ours, peer in rows(*shape, dtype, args.device):
            t_ours, t_peer = [], []
            for _ in range(args.rounds):
                t_ours.append(host_us(ours, args.device, calls))
                t_peer.append(host_us(peer, args.device, calls))
            mo, mp = statistics.median(t_ours), statistics.median(t_peer)
            print("B%d N%d H%d D%d %s causal    %-20s %7.1f [%5.1f] %7.1f [%5.1f] %6.2fx"
                  % (*shape, str(dtype).replace("torch.", ""), name, mo, min(t_ours), mp, min(t_peer), mo / mp))


if __name__ == "__main__":
    main()
