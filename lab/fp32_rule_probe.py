#!/usr/bin/env python3
"""The bf16 rule for fp32 inputs on CUDA, on the CPU with no GPU: how often an ideal kernel misses it.

The CUDA backend runs fp32 inputs on bf16 operands (q, k, v rounded once), and its backward takes the gradient of
the function its forward computed (bwd_simt.cu's fc_bwd_make_args). The ideal such kernel is fp64 arithmetic on the
rounded q, k, v. This script runs python/tests/test_torch.py's case (inputs, sinks, references and rule) over many
seeds with that ideal kernel (dout in fp32) in place of flashc and counts the gradients over the rule's bound: what
the rule allows a kernel that makes no error of its own. --rule picks the oracle (the test's, the exact gradients,
or lab/fp32_rule.patch's rounded operands).

    PYTHONPATH=python python3 lab/fp32_rule_probe.py --case sinks_causal_q_gt_k --seeds 400
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
import test_torch as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="sinks_causal_q_gt_k")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--rule", default="given", choices=("given", "exact", "operands"),
                    help="the gradients' oracle: the test's (exact gradients given the out), the exact ones, or "
                         "lab/fp32_rule.patch's (the rounded q, k, v, dout, given the out; the naive error measured "
                         "against the same)")
    args = ap.parse_args()
    _, b, nq, nk, h, hkv, d, opts0 = next(c for c in T.GPU_CASES if c[0] == args.case)
    worst, misses = {}, {}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        opts = T.resolve(opts0, b, h, "cpu")
        q, k, v, do = T.inputs((b, nq, h, d), (b, nk, hkv, d), torch.float32, "cpu")
        sinks = opts.pop("sinks", None)
        lq, lk, lv, ldo = (t.to(torch.bfloat16) for t in (q, k, v, do))
        # the ideal kernel: fp64 on the rounded q, k, v (dO as given), its out returned in fp32
        ideal_out, _, ideal_g = T.ref_with_grads(lq.float(), lk.float(), lv.float(), do, sinks=sinks, **opts)
        ref_out, _, ref_g = T.ref_with_grads(q, k, v, do, sinks=sinks, **opts)
        _, _, low_g = T.ref_with_grads(lq, lk, lv, ldo, upcast=False, sinks=sinks, **opts)
        exact_g = ref_g
        if args.rule == "exact":
            given = ref_g
        elif args.rule == "given":
            given = T.ref_with_grads(q, k, v, do, sinks=sinks, given_out=ideal_out.float(), **opts)[2]
        else:
            rq, rk, rv, rdo = (t.to(torch.bfloat16).float() for t in (q, k, v, do))
            exact_g = T.ref_with_grads(rq, rk, rv, rdo, sinks=sinks, **opts)[2]
            given = T.ref_with_grads(rq, rk, rv, rdo, sinks=sinks, given_out=ideal_out.float(), **opts)[2]
        for name, got, want, lw, exact in zip(("dq", "dk", "dv", "dsinks"), ideal_g, given, low_g, exact_g):
            err = (got.double() - want.double()).abs().max().item()
            base = (lw.double() - exact.double()).abs().max().item()
            r = err / (3 * base + 1e-5)
            worst[name] = max(worst.get(name, 0.0), r)
            if r > 1:
                misses.setdefault(name, []).append((seed, round(r, 2)))
    print("case %s, %d seeds, %s reference: worst error / bound per gradient %s" % (
        args.case, args.seeds, args.rule, {n: round(r, 2) for n, r in worst.items()}))
    for n, m in misses.items():
        print("  %s over the bound at %d seeds: %s" % (n, len(m), m[:10]))


if __name__ == "__main__":
    main()
