#!/usr/bin/env python3
"""One flashc forward and backward on the GPU at a sweep shape, for profilers (ncu, nsys, compute-sanitizer).

    FLASHC_LIBRARY=build-gpu/libflashc.so PYTHONPATH=python ncu -k regex:fc_bwd python3 bench/run_once.py --d 128 --n 4096

Shape: hidden 2048 (H = 2048 / D), B = 16384 / N, bf16, as in the CONVENTIONS.md sweep.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--no-bwd", action="store_true", help="the forward alone")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--b", type=int, default=0, help="batch (default 16384 / N)")
    ap.add_argument("--h", type=int, default=0, help="heads (default 2048 / D)")
    ap.add_argument("--window", default="-1,-1", help="window_size left,right (-1: unbounded)")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes 2^(-8 h / H)")
    ap.add_argument("--varlen", action="store_true", help="B sequences of lengths in [N/2, N] packed (cu_seqlens)")
    ap.add_argument("--used", action="store_true", help="seqused_k: each sequence uses a random part of its keys")
    ap.add_argument("--sinks", action="store_true", help="attention sinks, one per head (and their gradient)")
    ap.add_argument("--blockmask", type=int, default=0, metavar="BLK",
                    help="a random block mask (about half the blocks kept) of BLK x BLK blocks, per head")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout_p: the forward through flashc.attention, the backward through flash_attn_func's "
                         "autograd (attention_backward takes no dropout)")
    ap.add_argument("--decode", action="store_true",
                    help="decode instead: one query per sequence against a full KV cache of --n keys (H query heads "
                         "over --hkv kv heads) through flash_attn_with_kvcache")
    ap.add_argument("--hkv", type=int, default=8, help="kv heads of --decode")
    ap.add_argument("--pages", type=int, default=0, help="--decode from a paged cache of this page size (pages "
                                                         "shuffled in the pool)")
    ap.add_argument("--peer", choices=("cudnn", "flash"), help="torch SDPA's backend of that name instead of flashc "
                    "(forward + autograd backward on the (B, H, N, D) views; plain and causal only), for a profile "
                    "beside flashc's")
    args = ap.parse_args()
    if args.decode:
        return decode(args)
    if args.peer:
        return peer(args)
    H, B = args.h or 2048 // args.d, args.b or max(1, 16384 // args.n)
    q, k, v, g = (torch.randn(B, args.n, H, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    kw = dict(causal=args.causal, window_size=tuple(int(x) for x in args.window.split(",")), softcap=args.softcap)
    if args.varlen:
        lens = torch.randint(args.n // 2, args.n + 1, (B,), generator=torch.Generator().manual_seed(0))
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        total = int(cu[-1])
        q, k, v, g = (x.reshape(B * args.n, H, args.d)[:total].contiguous() for x in (q, k, v, g))
        cu = cu.cuda()
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()))
    if args.alibi:
        kw["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda")
    if args.used:
        kw["seqused_k"] = torch.randint(0, args.n + 1, (B,), generator=torch.Generator().manual_seed(1),
                                        dtype=torch.int32).cuda()
        if args.varlen:
            kw["seqused_k"] = torch.minimum(kw["seqused_k"].cpu(), lens.to(torch.int32)).cuda()
    if args.sinks:
        kw["sinks"] = torch.randn(H, device="cuda")
    if args.blockmask:
        nb = (args.n + args.blockmask - 1) // args.blockmask
        kw["block_mask"] = (torch.rand(H, nb, nb, generator=torch.Generator().manual_seed(2)) < 0.5).to(torch.uint8).cuda()
        kw["block_size"] = (args.blockmask, args.blockmask)
    if args.dropout:
        kw["dropout_p"] = args.dropout
    for _ in range(args.repeat):
        if args.dropout and not args.no_bwd:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            o = flashc.flash_attn_func(qg, kg, vg, dropout_p=args.dropout, causal=args.causal,
                                       deterministic=args.deterministic)
            torch.autograd.grad(o, (qg, kg, vg), g)
            continue
        out, lse = flashc.attention(q, k, v, **kw)
        if not args.no_bwd:
            flashc.attention_backward(g, q, k, v, out, lse, deterministic=args.deterministic, **kw)
    torch.cuda.synchronize()
    print("ran B %d N %d H %d D %d %s" % (B, args.n, H, args.d, {x: y for x, y in kw.items() if x not in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks", "block_mask")}))


def peer(args):
    """--repeat forward + backward calls of F.scaled_dot_product_attention under the --peer backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[args.peer]
    H, B = args.h or 2048 // args.d, args.b or max(1, 16384 // args.n)
    q, k, v, g = (torch.randn(B, args.n, H, args.d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        for _ in range(args.repeat):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            if not args.no_bwd:
                torch.autograd.grad(o, (q, k, v), g)
    torch.cuda.synchronize()
    print("ran %s: B %d N %d H %d D %d causal %d" % (args.peer, B, args.n, H, args.d, args.causal))


def decode(args):
    """One flash_attn_with_kvcache call per --repeat: B (default 16) sequences, Nq 1, a full cache of --n keys."""
    B, H, D, n = args.b or 16, args.h or 32, args.d, args.n
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, n, args.hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    kw = {}
    if args.pages:
        per = (n + args.pages - 1) // args.pages
        perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(3)).to(torch.int32).cuda()
        table = perm.reshape(B, per)
        pool_k = torch.empty(B * per, args.pages, args.hkv, D, device="cuda", dtype=torch.bfloat16)
        pool_v = torch.empty_like(pool_k)
        pad = per * args.pages - n
        for src, pool in ((kc, pool_k), (vc, pool_v)):
            full = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, pad)).reshape(B * per, args.pages, args.hkv, D)
            pool[table.reshape(-1).long()] = full
        kc, vc, kw = pool_k, pool_v, dict(block_table=table)
    for _ in range(args.repeat):
        flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, **kw)
    torch.cuda.synchronize()
    print("decode B %d Nk %d H %d Hkv %d D %d%s" % (B, n, H, args.hkv, D, " pages of %d" % args.pages if args.pages
                                                   else ""))


if __name__ == "__main__":
    main()
