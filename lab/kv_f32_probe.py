#!/usr/bin/env python3
"""Where does the fp32-on-CUDA KV-cache path's lse error come from? For the kvcache test's prefill_causal shape
(B 3, Nk_max 64, Nq 5, 5 new rows, H 4 / Hkv 2, D 64, one query row x 6), over seeds: the max |lse - fp64| of
  a  flash_attn_with_kvcache on fp32 (what the test checks),
  b  flash_attn_with_kvcache on the same values rounded to bf16 (bf16 tensors),
  c  flash_attn_func (no cache: the used keys sliced out per sequence) on fp32,
  e  the fp64 reference on the bf16-rounded values (the error rounding q, k, v alone gives),
and whether a and b are the same bits. Run on the GPU machine: FLASHC_LIBRARY=... python3 lab/kv_f32_probe.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
import flashc  # noqa: E402
import test_kvcache as T  # noqa: E402

dev = "cuda"
b, nk, nq, nnew, h, hkv, d, filled = 3, 64, 5, 5, 4, 2, 64, [0, 17, 59]
rows = []
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    torch.manual_seed(seed)
    kc, vc = T.make_cache(b, nk, hkv, d, filled, torch.float32, dev)
    q = torch.randn(b, nq, h, d, device=dev)
    q[:, torch.randperm(nq)[:1]] *= 6.0
    k = torch.randn(b, nnew, hkv, d, device=dev)
    v = torch.randn(b, nnew, hkv, d, device=dev)
    sl = torch.tensor(filled, dtype=torch.int32, device=dev)
    ref_out, ref_lse, _ = T.reference(q, kc, vc, k, v, filled, dict(causal=True), None)
    rb = lambda t: t.to(torch.bfloat16)
    e_out, e_lse, _ = T.reference(rb(q).float(), rb(kc).float(), rb(vc).float(), rb(k).float(), rb(v).float(), filled,
                                  dict(causal=True), None)
    _, n_lse, _ = T.reference(q, kc, vc, k, v, filled, dict(causal=True), None, low=torch.bfloat16)
    oa, la = flashc.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=sl, causal=True,
                                            return_softmax_lse=True)
    ob, lb = flashc.flash_attn_with_kvcache(rb(q), rb(kc), rb(vc), rb(k), rb(v), cache_seqlens=sl, causal=True,
                                            return_softmax_lse=True)
    lc = []
    for i, n in enumerate(filled):
        ks = torch.cat([kc[i:i + 1, :n], k[i:i + 1]], 1)
        vs = torch.cat([vc[i:i + 1, :n], v[i:i + 1]], 1)
        _, l_i, _ = flashc.flash_attn_func(q[i:i + 1], ks, vs, causal=True, return_attn_probs=True)
        lc.append(l_i)
    lc = torch.cat(lc)
    fin = torch.isfinite(ref_lse)
    err = lambda x: (x[fin].double() - ref_lse[fin]).abs().max().item()
    rows.append((seed, err(la), err(lb), err(lc), err(e_lse), torch.equal(la, lb),
                 (oa.double() - ref_out).abs().max().item(), (e_out - ref_out).abs().max().item(),
                 (la[fin].double() - e_lse[fin]).abs().max().item(), (oa.double() - e_out).abs().max().item(), err(n_lse)))
print("seed  a:kvcache f32  b:kvcache bf16  c:func f32  e:fp64 on bf16 inputs  a==b bits  out a  out e  |lse a - e|  |out a - e|  naive lse")
for r in rows:
    print("%4d  %12.4g  %14.4g  %10.4g  %20.4g  %9s  %6.3g  %6.3g  %10.3g  %10.3g  %9.4g" % r)
