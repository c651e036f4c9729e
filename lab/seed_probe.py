#!/usr/bin/env python3
"""One case of python/tests/test_torch.py's CUDA table at a given seed (the tests print theirs as FLASHC_TEST_SEED),
with dq's worst element and the rows over the bound printed before the test's own check.

    FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so PYTHONPATH=python \
        python3 lab/seed_probe.py 3157567562 --case sinks_causal_q_gt_k --dtype float32 --repeat 3
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
import test_torch as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("--case", default="sinks_causal_q_gt_k")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    case = next(c for c in T.GPU_CASES if c[0] == args.case)
    check_close = T.check_close

    def report(name, got, ref, naive, dtype, factor, naive_ref=None):
        if name == "dq":
            err = (got.double() - ref).abs()
            worst = torch.nonzero(err == err.max())[0].tolist()
            base = (naive.double() - (ref if naive_ref is None else naive_ref)).abs().max().item()
            over = sorted(set(torch.nonzero(err > factor * base + 1e-5)[:, 1].tolist()))
            print("dq max err %.4g at (b, n, h, d) %s; bound %d x %.4g; ref %.4g got %.4g; rows over: %s" % (
                err.max().item(), worst, factor, base, ref[tuple(worst)].item(), got[tuple(worst)].item(), over[:20]))
        return check_close(name, got, ref, naive, dtype, factor, naive_ref)

    T.check_close = report
    for _ in range(args.repeat):
        torch.manual_seed(args.seed)
        try:
            T.run_flash_attn_case(case, getattr(torch, args.dtype), torch.device("cuda"))
            print("pass")
        except AssertionError as e:
            print("FAIL", str(e).splitlines()[0])


if __name__ == "__main__":
    main()
