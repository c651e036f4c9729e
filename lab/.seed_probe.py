import os, sys, torch
sys.path.insert(0, "python/tests")
import test_torch as T
seed = int(sys.argv[1]); reps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
case = next(c for c in T.GPU_CASES if c[0] == "sinks_causal_q_gt_k")
orig = T.check_close
def cc(name, got, ref, naive, dtype, factor, naive_ref=None):
    if name == "dq":
        err = (got.double() - ref).abs()
        idx = torch.nonzero(err == err.max())[0].tolist()
        base = (naive.double() - (ref if naive_ref is None else naive_ref)).abs().max().item()
        print("dq max err %.4g at (b, n, h, d) %s; bound 3 x %.4g; ref there %.4g got %.4g; rows > bound: %s" % (
            err.max().item(), idx, base, ref[tuple(idx)].item(), got[tuple(idx)].item(),
            sorted(set(torch.nonzero(err > 3 * base + 1e-5)[:, 1].tolist()))[:20]))
    return orig(name, got, ref, naive, dtype, factor, naive_ref)
T.check_close = cc
for r in range(reps):
    torch.manual_seed(seed)
    try:
        T.run_flash_attn_case(case, torch.float32, torch.device("cuda")); print("pass")
    except AssertionError as e:
        print("FAIL", str(e).splitlines()[0])
