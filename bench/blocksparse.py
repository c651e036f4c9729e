#!/usr/bin/env python3
"""Block-sparse attention: time against the fraction of blocks kept, as FlashAttention's block-sparse claim states it
(time falls in proportion to the blocks kept), with FlexAttention on the same mask as the peer.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/blocksparse.py [--D 128] [--no-flex]

Shape B 2, H 16, N 8192, bf16, 128 x 128 blocks: random blocks plus the diagonal (so every row sees a key), one mask
for all heads, at several densities. flashc.attention with block_mask; the forward alone, and forward + backward
(through flashc.attention_backward). Reported: each time over dense flashc's (density 1, no mask, timed again in
the same turns as each density), the ideal (the density), and FlexAttention's time over the same dense flashc time.
CUDA events, medians, in turns; the GPU sleeps before each timed call, so that the host queues it meanwhile and the
time is the GPU's (--host-time: the host's time per call on the clock too).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402
from compare_torch_bwd import interleaved_medians  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--densities", default="1,0.5,0.25,0.12")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--host-time", action="store_true", help="the host's time per call on the clock too")
    args = ap.parse_args(argv)
    B, N, H, D, blk = args.B, args.N, args.H, args.D, args.block
    print(f"# {torch.cuda.get_device_name()}, flashc {flashc.library_version()}; B {B} N {N} H {H} D {D} bf16, "
          f"{blk}x{blk} blocks, FLASHC_CUDA_FWD={os.environ.get('FLASHC_CUDA_FWD', '')}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    nb = (N + blk - 1) // blk

    def fwd(mask):
        return lambda: flashc.attention(q, k, v, block_mask=mask, block_size=(blk, blk) if mask is not None else None)

    def fb(mask):
        kw = dict(block_mask=mask, block_size=(blk, blk)) if mask is not None else {}

        def run():
            o, lse = flashc.attention(q, k, v, **kw)
            flashc.attention_backward(do, q, k, v, o, lse, **kw)
        return run

    ahead = 0 if args.host_time else 4_000_000  # GPU cycles (~2 ms), longer than the host takes to queue a call
    dense = interleaved_medians({"f": fwd(None), "fb": fb(None)}, args.runs, ahead=ahead)
    rows = []
    for dens in (float(x) for x in args.densities.split(",")):
        gen = torch.Generator().manual_seed(1)
        m = (torch.rand(nb, nb, generator=gen) < dens)
        m |= torch.eye(nb, dtype=torch.bool)
        kept = m.float().mean().item()
        mask = m.to(torch.uint8).cuda()
        fns = {"f": fwd(mask), "fb": fb(mask), "df": fwd(None), "dfb": fb(None)}  # dense again, in the same turns
        if not args.no_flex:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                mm = m.cuda()

                def mask_mod(b, h, qi, kj):
                    return mm[qi // blk, kj // blk]
                bm = create_block_mask(mask_mod, None, None, N, N, device="cuda", BLOCK_SIZE=blk)
                fa = torch.compile(flex_attention, dynamic=False)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                fns["flex"] = lambda: fa(qt, kt, vt, block_mask=bm)
            except Exception as e:  # a torch without FlexAttention, or a compile failure: flashc alone
                print(f"# FlexAttention skipped: {type(e).__name__}: {str(e)[:120]}")
        t = interleaved_medians(fns, args.runs, ahead=ahead)
        rows.append((kept, t["f"] / t["df"], t["fb"] / t["dfb"], t.get("flex", float("nan")) / t["df"]))
        print(f"# density {kept:.2f}: done", flush=True)
    print(f"\ndense flashc: forward {dense['f']:.3f} ms, forward + backward {dense['fb']:.3f} ms")
    print("| density (blocks kept) | fwd time / dense fwd | fwd+bwd time / dense fwd+bwd | ideal | FlexAttention fwd / dense flashc fwd |")
    print("|---|---|---|---|---|")
    for kept, f, fb_, fx in rows:
        print(f"| {kept:.2f} | {f:.2f} | {fb_:.2f} | {kept:.2f} | {fx:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
