#!/usr/bin/env python3
"""The CUDA forward into an output whose rows are not 16-byte aligned (head pitch d + 4), inputs contiguous: the
same kernel as into a contiguous output, so out and lse must match bit for bit (the 2-byte store path of the Hopper
epilogue). FLASHC_CUDA_LOG=1 names the kernel.

    FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so PYTHONPATH=python python3 lab/unaligned_out_probe.py
"""
import sys

import torch

from flashc import _torch as ft


def main():
    fails = 0
    empty_like = torch.empty_like
    for d in (64, 128, 256):
        for n, causal in ((700, True), (1000, False)):
            g = torch.Generator(device="cuda").manual_seed(d + n)
            q, k, v = (torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            ref, ref_lse = ft._forward(q, k, v, ft._Options(q, k, causal=causal))

            def padded(t, memory_format=None):
                b, s, h, dd = t.shape
                return torch.full((b, s, h, dd + 4), float("nan"), device=t.device, dtype=t.dtype)[..., :dd]

            torch.empty_like = padded
            try:
                out, lse = ft._forward(q, k, v, ft._Options(q, k, causal=causal))
            finally:
                torch.empty_like = empty_like
            same = torch.equal(out, ref) and torch.equal(lse, ref_lse) and out.stride(2) == d + 4
            fails += not same
            print(f"{'ok  ' if same else 'FAIL'} d {d} n {n} causal {causal}: out stride {tuple(out.stride())}, "
                  f"max |diff| {(out.float() - ref.float()).abs().max().item():.3g}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
