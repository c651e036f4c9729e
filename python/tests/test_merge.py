"""flashc.merge_attention (the library's flashc_merge): two partial attention results over disjoint keys into one, on
torch tensors (CPU, and CUDA when torch sees a GPU and libflashc has the CUDA backend) and numpy arrays.

The keys of a problem are split in two; flashc.attention on each half (the first half with window (-1, Nk - s), so
that the causal band keeps the full problem's diagonal) merged must match test_torch's fp64 reference on all keys, by
CONVENTIONS.md's rule (fp32: relative error 1e-5; f16/bf16: 2x the naive low-precision algorithm + 1e-5, plus one
rounding of each part, which is stored in the dtype). Rows one half saw nothing of (lse +inf) must come out as the
other half, bit for bit. In place (out=out_a, lse=lse_a) gives the
same bits; packed (varlen) parts the same as their batched form; gradients match autograd through a plain torch merge.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashc  # noqa: E402
# gen: test_torch's seeded-generator fixture, used by name
from test_torch import CUDA_REASON, attn_ref, check_close, cuda_ready, gen, rule_dtype  # noqa: E402,F401

needs_cuda = pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def split_parts(q, k, v, s, causal):
    """flashc.attention on keys [0, s) and [s, Nk): (out_a, lse_a), (out_b, lse_b)."""
    nk = k.shape[1]
    a = flashc.attention(q, k[:, :s], v[:, :s], window_size=(-1, nk - s) if causal else (-1, -1))
    b = flashc.attention(q, k[:, s:], v[:, s:], causal=causal)
    return a, b


def merge_ref(out_a, lse_a, out_b, lse_b):
    """The merge in fp64 with plain torch operations (differentiable); +inf lse is an empty part."""
    la, lb = lse_a.double(), lse_b.double()
    ea, eb = torch.isinf(la), torch.isinf(lb)
    la, lb = la.masked_fill(ea, float("-inf")), lb.masked_fill(eb, float("-inf"))  # weight exp(-inf) = 0
    lse = torch.logaddexp(la, lb).masked_fill(ea & eb, float("inf"))
    wa = torch.exp(la - lse).transpose(1, 2)[..., None]
    wb = torch.exp(lb - lse).transpose(1, 2)[..., None]
    return wa * out_a.double() + wb * out_b.double(), lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 64, 64, 4, 2, 64, True, 24), (2, 1, 200, 8, 2, 128, True, 77),
                                   (1, 37, 90, 2, 2, 32, False, 45)], ids=["causal", "decode", "plain"])
def test_split_keys_merge_to_the_whole(shape, dtype, device, gen):
    b, nq, nk, h, hkv, d, causal, s = shape
    q, k, v = (torch.randn(sh, device=device).to(dtype) for sh in ((b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    q[:, nq // 3] *= 6.0  # a row with large logits
    (oa, la), (ob, lb) = split_parts(q, k, v, s, causal)
    out, lse = flashc.merge_attention(oa, la, ob, lb)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, nq) and lse.dtype == torch.float32
    rd = rule_dtype(dtype, device)
    # fp32 on CUDA runs on bf16 operands: the reference is the fp64 attention of those (test_kvcache.operand_dtype;
    # against the fp32 values the operands' rounding alone moved lse past 2 x naive at CI's seed, plain, on an H200)
    ref, ref_lse = attn_ref(*(t.to(rd) if rd != dtype else t for t in (q, k, v)), causal=causal)
    if rd == torch.float32:
        check_close("out", out.cpu(), ref.cpu(), None, rd, 2)
    else:
        # the rule, plus one rounding of each part (stored in the dtype): max (wa |out_a| + wb |out_b|) u
        naive, _ = attn_ref(*(t.to(rd) for t in (q, k, v)), causal=causal, upcast=False)
        u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 2.0 ** -24)  # the parts are stored in dtype
        parts = merge_ref(oa.abs(), la, ob.abs(), lb)[0].max().item() * u
        err = (out.double() - ref).abs().max().item()
        base = (naive.double() - ref).abs().max().item()
        assert err <= 2 * base + parts + 1e-5, "out: max error %.3g > 2 x naive %.3g + %.3g" % (err, base, parts)
    if rd == torch.float32:
        check_close("lse", lse.cpu(), ref_lse.cpu(), None, torch.float32, 2)
    else:  # the parts' lse come from 16-bit operands (fp32 on CUDA: bf16): the rule against the naive one's lse
        _, naive_lse = attn_ref(*(t.to(rd) for t in (q, k, v)), causal=causal, upcast=False)
        check_close("lse", lse.cpu(), ref_lse.cpu(), naive_lse.cpu(), rd, 2)
    # rows the second half saw nothing of (causal, Nq = Nk): the first half's, bit for bit
    empty = torch.isinf(lb)
    if causal and nq == nk:
        assert empty.any()
    rows = empty.transpose(1, 2)  # (B, Nq, H)
    assert torch.equal(out[rows], oa[rows]) and torch.equal(lse[empty], la[empty])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_and_views(dtype, device, gen):
    b, n, h, d = 2, 33, 4, 64
    oa = torch.randn(b, h, n, d, device=device).to(dtype).transpose(1, 2)  # (B, N, H, D) over (B, H, N, D) storage
    ob = torch.randn(b, n, h, d, device=device).to(dtype)
    la, lb = torch.randn(b, h, n, device=device) * 3, torch.randn(b, h, n, device=device) * 3
    la[0, 1, :5] = float("inf")  # empty rows in a, in b, in both
    lb[1, 2, 3:9] = float("inf")
    lb[0, 1, 2] = float("-inf")
    out, lse = flashc.merge_attention(oa, la, ob, lb)
    ref, ref_lse = merge_ref(oa, la, ob, lb)
    tol = {torch.float32: 1e-6, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}[dtype]
    assert ((out.double() - ref).abs() <= tol * ref.abs() + 1e-6).all()
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert lse[0, 1, 2].item() == float("inf") and torch.equal(out[0, 2, 1], torch.zeros_like(out[0, 2, 1]))
    # in place into a, then into b: the same bits
    ia, ila = oa.clone(), la.clone()
    r = flashc.merge_attention(ia, ila, ob, lb, out=ia, lse=ila)
    assert r[0] is ia and r[1] is ila and torch.equal(ia, out) and torch.equal(ila, lse)
    ib, ilb = ob.clone(), lb.clone()
    flashc.merge_attention(oa, la, ib, ilb, out=ib, lse=ilb)
    assert torch.equal(ib, out) and torch.equal(ilb, lse)
    # packed (total, H, D) parts with lse (H, total): the batched form's bits, batch by batch
    for i in range(b):
        po, pl = flashc.merge_attention(oa[i], la[i].clone(), ob[i], lb[i].clone())
        assert torch.equal(po, out[i]) and torch.equal(pl, lse[i])


@pytest.mark.parametrize("device", DEVICES)
def test_gradients(device, gen):
    b, n, h, d = 2, 9, 3, 16
    oa = torch.randn(b, n, h, d, device=device, requires_grad=True)
    ob = torch.randn(b, n, h, d, device=device, requires_grad=True)
    la0, lb0 = torch.randn(b, h, n, device=device) * 2, torch.randn(b, h, n, device=device) * 2
    la0[0, 0, 3] = float("inf")  # an empty part: its gradients are 0
    la = la0.clone().requires_grad_()
    lb = lb0.clone().requires_grad_()
    dout, dlse = torch.randn(b, n, h, d, device=device), torch.randn(b, h, n, device=device)
    out, lse = flashc.merge_attention(oa, la, ob, lb)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (oa, la, ob, lb))
    ra, rb = oa.detach().double().requires_grad_(), ob.detach().double().requires_grad_()
    rla, rlb = la0.double().requires_grad_(), lb0.double().requires_grad_()
    ro, rl = merge_ref(ra, rla, rb, rlb)
    finite = torch.isfinite(rl)
    want = torch.autograd.grad((ro * dout.double()).sum() + (rl[finite] * dlse.double()[finite]).sum(),
                               (ra, rla, rb, rlb), allow_unused=True)
    for name, g, w in zip(("out_a", "lse_a", "out_b", "lse_b"), got, want):
        assert torch.allclose(g.double(), w, rtol=1e-5, atol=1e-5), name
    assert got[1][0, 0, 3].item() == 0.0 and torch.all(got[0][0, 3, 0] == 0)
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        flashc.merge_attention(oa, la, ob, lb, out=torch.empty_like(oa))


def test_numpy(rng):
    b, nq, nk, h, d, s = 2, 40, 40, 2, 32, 15
    q = rng.standard_normal((b, nq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, nk, h, d)).astype(np.float32)
    v = rng.standard_normal((b, nk, h, d)).astype(np.float32)
    oa, la = flashc.attention(q, k[:, :s], v[:, :s], window_size=(-1, nk - s))
    ob, lb = flashc.attention(q, k[:, s:], v[:, s:], causal=True)
    out, lse = flashc.merge_attention(oa, la, ob, lb)
    whole, whole_lse = flashc.attention(q, k, v, causal=True)
    assert np.linalg.norm(out - whole) <= 1e-5 * np.linalg.norm(whole)
    assert np.allclose(lse, whole_lse, rtol=1e-5, atol=1e-5)
    rows = np.isinf(lb).transpose(0, 2, 1)
    assert rows.any() and np.array_equal(out[rows], oa[rows])
    h16 = flashc.merge_attention(oa.astype(np.float16), la, ob.astype(np.float16), lb)[0]
    assert h16.dtype == np.float16 and np.abs(h16 - out).max() <= 2 ** -10 * np.abs(out).max()
    r = flashc.merge_attention(oa, la, ob, lb, out=oa, lse=la)  # in place
    assert r[0] is oa and np.array_equal(oa, out) and np.array_equal(la, lse)


def test_refusals(gen):
    oa, ob = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    la, lb = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="one shape"):
        flashc.merge_attention(oa, la, ob[:, :7], lb)
    with pytest.raises(ValueError, match="lse_b must be"):
        flashc.merge_attention(oa, la, ob, lb.transpose(1, 2))
    with pytest.raises(TypeError, match="one dtype"):
        flashc.merge_attention(oa, la, ob.half(), lb)
    buf = torch.randn(2 * 8 * 2 * 16 + 1)
    a = buf[:256].view(1, 8, 2, 16)
    shifted = buf[1:257].view(1, 8, 2, 16)  # overlaps out_a without being its view
    with pytest.raises(flashc.FlashcError, match="overlaps out_a") as e:
        flashc.merge_attention(a, la, ob, lb, out=shifted)
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    # nothing degenerate reaches the library: a head dim of 0 still merges the lse
    z, zl = flashc.merge_attention(torch.empty(1, 3, 2, 0), torch.tensor([[[1.0, float("inf"), float("inf")]] * 2]),
                                   torch.empty(1, 3, 2, 0), torch.tensor([[[2.0, 5.0, float("-inf")]] * 2]))
    assert z.shape == (1, 3, 2, 0) and zl[0, 0, 1].item() == 5.0 and zl[0, 0, 2].item() == float("inf")
