#!/usr/bin/env python3
"""What a query tile costs beside its key-tile steps, on the Hopper forward and backward: times of sliding windows of
several widths and of block masks of several densities against their exact counts of query tiles and key-tile steps,
fitted as  time = a * query_tiles + b * key_steps  (least squares), so that a / b is the fixed cost of a query
tile in key-tile steps. Every case of a family has the same query tiles, so a also holds whatever a call costs
apart from its steps (the launch; in the backward, the preprocess and dQ conversion kernels, which go by rows).

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 lab/short_rows.py [--B 4 --N 4096 --H 16 --D 128] [--runs 15]

The counts follow the forward's tiles (128 x 128 at d 128; --br / --bc otherwise): a window (left, 0) visits, for
query tile m, the key tiles from (128 m - left) / 128 to m; a block mask of 128 x 128 blocks visits its kept blocks.
Each call is timed alone (CUDA events) after a GPU sleep that lets the host queue it, so host time is not counted;
all cases of a family are timed in turns. Printed: per case the time and the counts; per family the fit, the
fixed cost per query tile (us, and in key-tile steps) and each case's residual.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402
from compare_torch_bwd import interleaved_medians  # noqa: E402


def fit(rows):
    """Least squares time = a q + b k over rows (q, k, t); returns (a, b)."""
    import numpy as np
    A = np.array([[q, k] for q, k, _ in rows], dtype=float)
    y = np.array([t for _, _, t in rows])
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    return tuple(float(x) for x in sol)


def report(name, rows, labels):
    a, b = fit(rows)
    q0 = rows[0][0]
    print(f"\n{name}: time = {a * 1e6:.2f} ns x query tiles + {b * 1e6:.2f} ns x key steps (fixed part "
          f"{a * q0 * 1e3:.1f} us)  -> a query tile's fixed cost = {a / b:.2f} key-tile steps")
    for (q, k, t), lab in zip(rows, labels):
        print(f"  {lab:24s} q {q:7d}  k {k:8d}  k/q {k / q:6.2f}  {t * 1e3:9.1f} us  fit {1e3 * (a * q + b * k):9.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--br", type=int, default=128)
    ap.add_argument("--bc", type=int, default=128)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--lefts", default="127,255,511,1023,2047,4095")
    ap.add_argument("--densities", default="1,0.5,0.25,0.12,0.06")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--sleep", type=int, default=2_000_000, help="GPU cycles slept before each timed call")
    args = ap.parse_args(argv)
    B, N, H, D, br, bc = args.B, args.N, args.H, args.D, args.br, args.bc
    print(f"# {torch.cuda.get_device_name()}, flashc {flashc.library_version()} ({flashc.library_path}); "
          f"B {B} N {N} H {H} D {D} bf16, tiles {br} x {bc}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    nq = (N + br - 1) // br
    qtiles = nq * B * H

    def window_steps(left):
        s = 0
        for m in range(nq):
            r0, r1 = m * br, min(N, m * br + br) - 1
            s += r1 // bc - max(0, r0 - left) // bc + 1
        return s * B * H

    def mask_of(dens):
        gen = torch.Generator().manual_seed(1)
        m = torch.rand(nq, nq, generator=gen) < dens
        m |= torch.eye(nq, dtype=torch.bool)
        return m

    # family -> {case: (attention's keyword arguments, (query tiles, key-tile steps))}
    wins = {f"window ({left}, 0)": (dict(window_size=(left, 0)), (qtiles, window_steps(left)))
            for left in (int(x) for x in args.lefts.split(",") if x)}
    masks = {}
    for dens in (float(x) for x in args.densities.split(",") if x):
        m = mask_of(dens)
        masks[f"block mask {m.float().mean().item():.3f}"] = (
            dict(block_mask=m.to(torch.uint8).cuda(), block_size=(br, bc)), (qtiles, int(m.sum().item()) * B * H))
    masks["dense (no mask)"] = (dict(), (qtiles, nq * nq * B * H))

    for name, cases in (("sliding windows", wins), ("block masks", masks)):
        fwd = {lab: (lambda kw=kw: flashc.attention(q, k, v, **kw)) for lab, (kw, _) in cases.items()}
        t = interleaved_medians(fwd, args.runs, warmup=2, ahead=args.sleep)
        report(name + ", forward", [c + (t[lab],) for lab, (_, c) in cases.items()], list(cases))
        if args.no_bwd:
            continue
        bwd = {}
        for lab, (kw, _) in cases.items():
            o, lse = fwd[lab]()
            bwd[lab] = (lambda o=o, lse=lse, kw=kw: flashc.attention_backward(do, q, k, v, o, lse, **kw))
        t = interleaved_medians(bwd, args.runs, warmup=2, ahead=args.sleep)
        report(name + ", backward", [c + (t[lab],) for lab, (_, c) in cases.items()], list(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
