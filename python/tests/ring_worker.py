"""One rank of test_distributed's runs: flashc.distributed.ring_attention on this rank's shard of a case table,
forward and backward, against test_torch's fp64 reference of the whole sequence (every rank computes the same
reference from the same seed and checks its own shard). Writes what it found as JSON; asserts nothing itself, so that
every rank makes the same collective calls whatever a check says (a rank that stopped early would leave the others
waiting on the ring).

    python ring_worker.py RANK WORLD STORE_FILE SEED OUT_JSON [--backend gloo|nccl] [--device cpu|cuda]

With --backend nccl each rank takes GPU RANK (one process per GPU, as torchrun starts them).
"""

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashc  # noqa: E402
import flashc.distributed as fcd  # noqa: E402
from test_torch import attn_ref, check_close, rule_dtype  # noqa: E402

# name, B, N (whole sequence), H, Hkv, D, causal, window, softcap, layout
CASES = [
    ("plain", 2, 48, 2, 2, 32, False, (-1, -1), 0.0, "zigzag"),
    ("causal_gqa", 2, 48, 4, 2, 64, True, (-1, -1), 0.0, "zigzag"),
    ("causal_contiguous", 1, 40, 2, 1, 32, True, (-1, -1), 0.0, "contiguous"),
    ("window", 2, 48, 2, 2, 32, False, (13, 5), 0.0, "zigzag"),
    ("window_left_causal_softcap", 1, 64, 2, 2, 64, True, (21, -1), 5.0, "zigzag"),
    ("window_right_only", 1, 48, 2, 2, 32, False, (-1, 7), 0.0, "contiguous"),
    ("window_tiny", 1, 48, 2, 2, 32, False, (1, 0), 0.0, "zigzag"),
]


def case_tensors(case, dtype, device, seed):
    name, b, n, h, hkv, d = case[:6]
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn((b, n, h, d), generator=g) for _ in range(2))
    k, v = (torch.randn((b, n, hkv, d), generator=g) for _ in range(2))
    q[:, n // 3] *= 6.0  # a row with large logits
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def run_case(case, dtype, device, seed, group, record):
    name, b, n, h, hkv, d, causal, window, softcap, layout = case
    tag = "%s/%s" % (name, str(dtype).replace("torch.", ""))
    q, k, v, do = case_tensors(case, dtype, device, seed)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    qs, ks, vs, dos = (fcd.shard(t, group, layout=layout).detach().requires_grad_(t is not do) for t in (q, k, v, do))
    out, lse = fcd.ring_attention(qs, ks, vs, group, layout=layout, return_lse=True, **opts)
    out.backward(dos)
    rd = rule_dtype(dtype, device)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attn_ref(qr, kr, vr, **opts)
    ref.backward(do.double())
    naive = [None] * 5
    if rd != torch.float32:
        ql, kl, vl = (t.detach().to(rd).requires_grad_() for t in (q, k, v))
        no, nl = attn_ref(ql, kl, vl, upcast=False, **opts)
        no.backward(do.to(rd))
        naive = [no, nl, ql.grad, kl.grad, vl.grad]
    pairs = [("out", out, ref, 2), ("lse", lse, ref_lse, 2), ("dq", qs.grad, qr.grad, 3), ("dk", ks.grad, kr.grad, 3),
             ("dv", vs.grad, vr.grad, 3)]
    for (what, got, want, factor), nv in zip(pairs, naive):
        seq_dim = 2 if what == "lse" else 1
        want = fcd.shard(want.detach(), group, dim=seq_dim, layout=layout)
        nv = None if nv is None else fcd.shard(nv.detach(), group, dim=seq_dim, layout=layout).cpu()
        try:
            check_close(what, got.detach().cpu(), want.cpu(), nv, rd, factor)
        except AssertionError as e:
            record["failures"].append("%s: %s" % (tag, e))
    record["checked"].append(tag)
    # the same call again gives the same bits (the merge order and the ring are fixed)
    with torch.no_grad():
        again = fcd.ring_attention(qs, ks, vs, group, layout=layout, **opts)
    if not torch.equal(again, out.detach()):
        record["failures"].append("%s: a second run differs (max %.3g)" % (tag, (again - out).abs().max().item()))


def expect_error(record, tag, kind, fragment, fn):
    try:
        fn()
    except kind as e:
        if fragment not in str(e):
            record["failures"].append("%s: message %r lacks %r" % (tag, str(e), fragment))
        else:
            record["errors"].append(tag)
        return
    except Exception as e:  # noqa: BLE001
        record["failures"].append("%s: raised %s: %s, expected %s" % (tag, type(e).__name__, e, kind.__name__))
        return
    record["failures"].append("%s: no error, expected %s" % (tag, kind.__name__))


def refusals(device, group, record):
    rank = dist.get_rank(group)
    x = torch.randn((1, 8 + (2 if rank == 0 else 0), 2, 16), device=device)
    expect_error(record, "uneven", ValueError, "same number of tokens", lambda: fcd.ring_attention(x, x, x, group))
    y = torch.randn((1, 7, 2, 16), device=device)
    expect_error(record, "odd_zigzag", ValueError, "must be even", lambda: fcd.ring_attention(y, y, y, group))
    z = torch.randn((1, 8, 2, 16), device=device)
    expect_error(record, "alibi", NotImplementedError, "absolute positions",
                 lambda: fcd.ring_attention(z, z, z, group, alibi_slopes=torch.ones(2)))
    expect_error(record, "unknown", TypeError, "unexpected argument",
                 lambda: fcd.ring_attention(z, z, z, group, bogus=None))
    expect_error(record, "layout", ValueError, "layout must be", lambda: fcd.ring_attention(z, z, z, group, layout="x"))
    # after the refusals the ring still works (nothing was left in flight)
    with torch.no_grad():
        fcd.ring_attention(z, z, z, group, causal=True)
    record["errors"].append("ring_after_refusals")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("store")
    ap.add_argument("seed", type=int)
    ap.add_argument("out")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    device = torch.device(a.device if a.device == "cpu" else "cuda:%d" % a.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    flashc.set_num_threads(1)
    record = {"rank": a.rank, "checked": [], "errors": [], "failures": []}
    dist.init_process_group(a.backend, init_method="file://" + a.store, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    try:
        dtypes = [torch.float32, torch.bfloat16]
        for i, case in enumerate(CASES):
            for dt in dtypes:
                run_case(case, dt, device, a.seed + i, group, record)
        refusals(device, group, record)
    except Exception:  # noqa: BLE001
        record["failures"].append("exception: " + traceback.format_exc())
    with open(a.out, "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
