"""One rank of test_distributed's runs: flashc.distributed.ring_attention on this rank's shard of a case table,
forward and backward, against test_torch's fp64 reference of the whole sequence (every rank computes the same
reference from the same seed and checks the gathered results, each rank the same).

The rule is CONVENTIONS.md's (fp32: relative error 1e-5; 16-bit: 2x, gradients 3x the naive low-precision
algorithm's error + 1e-5) plus what the ring must add in 16-bit: the library returns each call's out, dq, dk and dv in
the inputs' dtype, so every partial result is rounded once before the fp32 sums. Those roundings are bounded by
u * (the sum of the absolute terms), u the dtype's unit roundoff: for out_i, sum_j P_ij |v_j|; for dq_i,
scale * sum_j |dS_ij| |k_j|; for dk_j, scale * sum_i |dS_ij| |q_i|; for dv_j, sum_i P_ij |dO_i| (since the calls
split those sums into disjoint parts, the parts' absolute values add up to at most that), as test_merge adds one
rounding per part. In 16-bit the gradients are held against the fp64 backward of the operands the backward is
given, the returned out among them (its D_i = rowsum(dO o out) reads it; test_torch.add_given_out_grads), and the
naive algorithm's against the exact gradients. Writes what it found as JSON; asserts nothing itself, so that every
rank makes the same collective calls whatever a check says (a rank that stopped early would leave the others waiting
on the ring).

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
from test_torch import add_given_out_grads, attn_ref, check_close, keep_mask, rule_dtype  # noqa: E402

# name, B, N (whole sequence), H, Hkv, D, causal, window, softcap, layout, cu_seqlens (varlen: B is 1, the packed
# sequences' offsets; every length a multiple of 8 = 2W at 4 ranks), ALiBi slopes ("h": (H,), "bh": one row per
# batch entry or packed sequence; None: none)
CASES = [
    ("plain", 2, 48, 2, 2, 32, False, (-1, -1), 0.0, "zigzag", None, None),
    ("causal_gqa", 2, 48, 4, 2, 64, True, (-1, -1), 0.0, "zigzag", None, None),
    ("causal_contiguous", 1, 40, 2, 1, 32, True, (-1, -1), 0.0, "contiguous", None, None),
    ("window", 2, 48, 2, 2, 32, False, (13, 5), 0.0, "zigzag", None, None),
    ("window_left_causal_softcap", 1, 64, 2, 2, 64, True, (21, -1), 5.0, "zigzag", None, None),
    ("window_right_only", 1, 48, 2, 2, 32, False, (-1, 7), 0.0, "contiguous", None, None),
    ("window_tiny", 1, 48, 2, 2, 32, False, (1, 0), 0.0, "zigzag", None, None),
    ("varlen_causal", 1, 72, 4, 2, 32, True, (-1, -1), 0.0, "zigzag", [0, 16, 16, 56, 64, 72], None),
    ("varlen_window_softcap", 1, 64, 2, 2, 32, False, (9, 2), 4.0, "contiguous", [0, 24, 32, 64], None),
    ("alibi_causal_gqa", 2, 48, 4, 2, 32, True, (-1, -1), 0.0, "zigzag", None, "h"),
    ("alibi_window", 2, 48, 2, 2, 32, False, (11, 6), 0.0, "contiguous", None, "bh"),
    ("alibi_varlen_softcap", 1, 64, 2, 2, 32, False, (-1, -1), 3.0, "zigzag", [0, 16, 48, 64], "bh"),
]


def case_tensors(case, dtype, device, seed):
    name, b, n, h, hkv, d = case[:6]
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn((b, n, h, d), generator=g) for _ in range(2))
    k, v = (torch.randn((b, n, hkv, d), generator=g) for _ in range(2))
    q[:, n // 3] *= 6.0  # a row with large logits
    # ALiBi slopes in [0.05, 0.45]: biases of several units across these lengths
    slopes = {"h": (h,), "bh": (b if case[10] is None else len(case[10]) - 1, h)}
    alibi = None if case[11] is None else 0.05 + 0.4 * torch.rand(slopes[case[11]], generator=g)
    if case[10] is not None:  # packed: (total, H, D)
        q, k, v, do = (t[0] for t in (q, k, v, do))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)] + [
        None if alibi is None else alibi.to(device)]


def per_sequence(fn, cu, alibi, *ts):
    """fn(slopes, *ts) on each packed sequence of ts (total, ...) as a batch of one, with that sequence's ALiBi
    slopes (a (num_seqs, H) alibi gives its row as (1, H)); its outputs (..., L, ...) packed again: tensors of rank 4
    along dim 1 as (total, ...), lse (1, H, L) as (H, total)."""
    if cu is None:
        return fn(alibi, *ts)
    outs = [fn(alibi[i:i + 1] if alibi is not None and alibi.dim() == 2 else alibi, *(t[a:b].unsqueeze(0) for t in ts))
            for i, (a, b) in enumerate(zip(cu, cu[1:]))]
    return [torch.cat([o[i][0] for o in outs], dim=0 if outs[0][i].dim() == 4 else 1) for i in range(len(outs[0]))]


def part_rounding(alibi, q, k, v, do, causal, window, softcap, rd):
    """u * the absolute sums of the module docstring, in fp64, for out, dq, dk, dv (the inputs the kernels see)."""
    u = 2.0 ** -8 if rd == torch.bfloat16 else 2.0 ** -11
    q, k, v, do = (t.detach().cpu().to(rd).double() for t in (q, k, v, do))
    b, n, h, d = q.shape
    g = h // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = 1.0 / d ** 0.5
    s = torch.einsum("bihd,bjhd->bhij", q, kr) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:
        sl = alibi.cpu().double()
        sl = sl[None, :, None, None] if sl.dim() == 1 else sl[:, :, None, None]
        s = s - sl * (torch.arange(n)[:, None] - torch.arange(n)[None]).abs().double()
    p = torch.softmax(s.masked_fill(~keep_mask(n, n, causal, window, "cpu"), float("-inf")), -1)
    o = torch.einsum("bhij,bjhd->bihd", p, vr)
    dp = torch.einsum("bihd,bjhd->bhij", do, vr)
    ds = p * (dp - (do * o).sum(-1).transpose(1, 2)[..., None])
    if softcap:
        ds = ds * (1 - t * t)
    ds = ds.abs()

    def groups(x):  # the heads that share a kv head add up
        return x.reshape(b, n, h // g, g, d).sum(3)

    return [u * x for x in (torch.einsum("bhij,bjhd->bihd", p, vr.abs()),
                            scale * torch.einsum("bhij,bjhd->bihd", ds, kr.abs()),
                            groups(scale * torch.einsum("bhij,bihd->bjhd", ds, q.abs())),
                            groups(torch.einsum("bhij,bihd->bjhd", p, do.abs())))]


# dropout: name, B, N, H, Hkv, D, causal, window, softcap, layout, cu_seqlens, ALiBi, dropout_p (every chunk a
# multiple of 4 tokens at 1, 2 and 4 ranks)
DROPOUT_CASES = [
    ("dropout_causal_gqa", 2, 64, 4, 2, 32, True, (-1, -1), 0.0, "zigzag", None, None, 0.17),
    ("dropout_window_alibi", 1, 64, 2, 2, 32, False, (13, 5), 2.0, "zigzag", None, "h", 0.5),
    ("dropout_varlen_alibi", 1, 96, 2, 2, 32, False, (-1, -1), 0.0, "contiguous", [0, 32, 64, 96], "bh", 0.1),
]


def run_dropout_case(case, device, seed, group, record):
    """fp32: the ring with dropout against flashc's one call on the whole sequence with the same (seed, offset)
    (torch.manual_seed(seed) before each; flashc's one-call dropout is checked against the fp64 oracle by its own
    tests): the same elements must be dropped, so the two agree to fp32 summation order (CUDA: to its bf16
    operands' rounding of P), while the mask itself moves the result by far more."""
    name, b, n, h, hkv, d, causal, window, softcap, layout, cu, _, p = case
    tag = "%s/float32" % name
    q, k, v, do, alibi = case_tensors(case[:12], torch.float32, device, seed)
    opts = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    sh = dict(layout=layout, cu_seqlens=cu)
    qs, ks, vs, dos = (fcd.shard(t, group, **sh).detach().requires_grad_(t is not do) for t in (q, k, v, do))
    torch.manual_seed(seed)
    out = fcd.ring_attention(qs, ks, vs, group, dropout_p=p, **sh, **opts)
    out.backward(dos)
    got = [fcd.unshard(t.detach(), group, **sh).cpu() for t in (out, qs.grad, ks.grad, vs.grad)]

    def one_call(p_):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(seed)
        if cu is None:
            o = flashc.flash_attn_func(qr, kr, vr, dropout_p=p_, **opts)
        else:
            c = torch.tensor(cu, dtype=torch.int32, device=device)
            m = max(y - x for x, y in zip(cu, cu[1:]))
            o = flashc.flash_attn_varlen_func(qr, kr, vr, c, c, m, m, dropout_p=p_, **opts)
        o.backward(do)
        return [t.detach().cpu() for t in (o, qr.grad, kr.grad, vr.grad)]

    want, undropped = one_call(p), one_call(0.0)
    tol = 1e-5 if device.type == "cpu" else 1e-2
    for what, g_, w_, u_ in zip(("out", "dq", "dk", "dv"), got, want, undropped):
        scale = w_.abs().max().item()
        err = (g_ - w_).abs().max().item() / scale
        moved = (u_ - w_).abs().max().item() / scale
        if not err <= tol:
            record["failures"].append("%s: %s: ring vs one call %.3g > %g of max" % (tag, what, err, tol))
        if not moved > 10 * tol:
            record["failures"].append("%s: %s: the mask moved the result by %.3g only" % (tag, what, moved))
    record["checked"].append(tag)


def run_case(case, dtype, device, seed, group, record):
    name, b, n, h, hkv, d, causal, window, softcap, layout, cu, _ = case
    tag = "%s/%s" % (name, str(dtype).replace("torch.", ""))
    q, k, v, do, alibi = case_tensors(case, dtype, device, seed)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    sh = dict(layout=layout, cu_seqlens=cu)
    qs, ks, vs, dos = (fcd.shard(t, group, **sh).detach().requires_grad_(t is not do) for t in (q, k, v, do))
    out, lse = fcd.ring_attention(qs, ks, vs, group, return_lse=True, alibi_slopes=alibi, **sh, **opts)
    out.backward(dos)
    rd = rule_dtype(dtype, device)
    # fp32 on CUDA runs on bf16 operands (rule_dtype): the reference then takes the operands the kernels see, so the
    # rule measures the attention's error, not the inputs' rounding (as the bf16 rows do)
    qr, kr, vr = (t.detach().to(rd).double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = per_sequence(lambda al, *t: attn_ref(*t, alibi_slopes=al, **opts), cu, alibi, qr, kr, vr)
    ref.backward(do.to(rd).double(), retain_graph=True)
    exact = [ref, ref_lse] + [t.grad.clone() for t in (qr, kr, vr)]  # the naive algorithm's oracle
    if rd != torch.float32:
        # 16-bit: the fp64 backward given the out returned, gathered (test_torch.add_given_out_grads: its
        # D_i = rowsum(dO o out) reads that out); out itself is held to the rule against the exact oracle below
        got_out = fcd.unshard(out.detach(), group, dim=1 if cu is None else 0, **sh).to(ref.device, torch.float64)
        add_given_out_grads(ref, ref_lse, do.to(rd), got_out)
    naive = [None] * 5
    if rd != torch.float32:
        ql, kl, vl = (t.detach().to(rd).requires_grad_() for t in (q, k, v))
        no, nl = per_sequence(lambda al, *t: attn_ref(*t, alibi_slopes=al, upcast=False, **opts), cu, alibi, ql, kl,
                              vl)
        no.backward(do.to(rd))
        naive = [no, nl, ql.grad, kl.grad, vl.grad]
    pairs = [("out", out, ref, 2), ("lse", lse, ref_lse, 2), ("dq", qs.grad, qr.grad, 3), ("dk", ks.grad, kr.grad, 3),
             ("dv", vs.grad, vr.grad, 3)]
    parts = [None] * 5
    if rd != torch.float32:
        po, pq, pk, pv = per_sequence(lambda al, *t: part_rounding(al, *t, causal, window, softcap, rd), cu, alibi,
                                      q, k, v, do)
        parts = [po, None, pq, pk, pv]
    for (what, got, want, factor), nv, part, oracle in zip(pairs, naive, parts, exact):
        # the rule's maxima are over the whole sequence, as for one process: the ranks' results gathered
        seq_dim = (2 if what == "lse" else 1) if cu is None else (1 if what == "lse" else 0)
        want = want.detach().cpu()
        got = fcd.unshard(got.detach(), group, dim=seq_dim, **sh).cpu()
        if nv is None:
            ok, msg = True, None
            try:
                check_close(what, got, want, None, rd, factor)
            except AssertionError as e:
                ok, msg = False, str(e)
        else:
            nv = nv.detach().cpu()
            err = (got.double() - want).abs().max().item()
            base = (nv.double() - oracle.detach().cpu()).abs().max().item()
            extra = 0.0 if part is None else part.max().item()
            ok = err <= factor * base + extra + 1e-5
            msg = "%s: max error %.3g > %d x naive %.3g + partial roundings %.3g" % (what, err, factor, base, extra)
        if not ok:
            record["failures"].append("%s: %s" % (tag, msg))
    record["checked"].append(tag)
    # the same call again gives the same bits (the merge order and the ring are fixed)
    with torch.no_grad():
        again = fcd.ring_attention(qs, ks, vs, group, alibi_slopes=alibi, **sh, **opts)
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
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > 1:  # (one rank cannot disagree with itself)
        x = torch.randn((1, 8 + (2 if rank == 0 else 0), 2, 16), device=device)
        expect_error(record, "uneven", ValueError, "same number of tokens",
                     lambda: fcd.ring_attention(x, x, x, group))
    y = torch.randn((1, 7, 2, 16), device=device)
    expect_error(record, "odd_zigzag", ValueError, "must be even", lambda: fcd.ring_attention(y, y, y, group))
    z = torch.randn((1, 8, 2, 16), device=device)
    expect_error(record, "dropout_chunks", ValueError, "multiple of 4 tokens",
                 lambda: fcd.ring_attention(z[:, :4], z[:, :4], z[:, :4], group, dropout_p=0.1))
    expect_error(record, "alibi_shape", ValueError, "alibi_slopes must be",
                 lambda: fcd.ring_attention(z, z, z, group, alibi_slopes=torch.ones(3)))
    expect_error(record, "unknown", TypeError, "unexpected argument",
                 lambda: fcd.ring_attention(z, z, z, group, bogus=None))
    expect_error(record, "layout", ValueError, "layout must be", lambda: fcd.ring_attention(z, z, z, group, layout="x"))
    p = torch.randn((64 // world, 2, 16), device=device)
    expect_error(record, "varlen_length", ValueError, "sequence 0 has 5 tokens",
                 lambda: fcd.ring_attention(p, p, p, group, cu_seqlens=[0, 5, 64]))
    if world > 1:
        cu = [0, 32, 64] if rank == 0 else [0, 16, 64]
        expect_error(record, "varlen_differ", ValueError, "cu_seqlens differ",
                     lambda: fcd.ring_attention(p, p, p, group, cu_seqlens=cu))
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
        for i, case in enumerate(DROPOUT_CASES):
            run_dropout_case(case, device, a.seed + 100 + i, group, record)
        refusals(device, group, record)
    except Exception:  # noqa: BLE001
        record["failures"].append("exception: " + traceback.format_exc())
    with open(a.out, "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
