"""Fused dropout through the torch front end (issue 19), on the CPU backend: the keep fraction, the mask against
flashc_dropout_mask, seeding from torch's generator, forward and backward against an fp64 reference that applies the
same mask, finite differences, S_dmask, p = 0 unchanged, torch.compile, and the CUDA backend's refusal."""

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashc  # noqa: E402
from flashc import _core, _lib, _torch  # noqa: E402

U64 = 2**64 - 1


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("FLASHC_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print("FLASHC_TEST_SEED=%d (%s)" % (seed, request.node.name))
    torch.manual_seed(seed)
    return seed


def drawn(seed):
    """The (seed, offset) a call with dropout makes right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    s, o = _torch.dropout_rng(torch.device("cpu")).tolist()
    return s & U64, o & U64


def library_mask(p, seed, offset, b, h, nq, nk):
    """flashc_dropout_mask's keep bits (B, H, Nq, Nk) as a bool tensor."""
    params = _core.make_params(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    keep = torch.empty((b, h, nq, nk), dtype=torch.uint8)
    _core.dropout_mask(params, b, h, nq, nk, keep.data_ptr())
    return keep.bool()


def identity_readback(p, b, h, nq, seed):
    """The keep mask (B, H, Nq, Nk = D) read back from the output: with V = identity, out[b, i, h, :] is row i of
    P o Z / (1 - p), and every P > 0 without a mask, so out != 0 exactly where an element is kept."""
    nk = 64
    q = torch.randn(b, nq, h, nk)  # the library wants one D for q, k and v
    k = torch.randn(b, nk, h, nk)
    v = torch.eye(nk).expand(b, h, nk, nk).transpose(1, 2).contiguous()  # v[b, j, h, :] = e_j
    torch.manual_seed(seed)
    out = flashc.flash_attn_func(q, k, v, dropout_p=p)
    return (out != 0).permute(0, 2, 1, 3)  # (B, H, Nq, Nk)


@pytest.mark.parametrize("p", [0.1, 0.17, 0.5])
def test_keep_fraction(p, gen):
    """The dropped fraction within 5 sigma of p (one Bernoulli trial per element), and the mask read back from the
    output equal to flashc_dropout_mask's for the (seed, offset) the call drew."""
    b, h, nq = 2, 4, 96
    keep = identity_readback(p, b, h, nq, gen)
    n = keep.numel()
    dropped = 1.0 - keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) <= 5 * sigma, (dropped, p, sigma)
    seed, offset = drawn(gen)
    assert torch.equal(keep, library_mask(p, seed, offset, b, h, nq, 64))


def test_mask_varlen_matches_library(gen):
    """varlen: sequence b's bits are those of flashc_dropout_mask's (b, h) planes, rows and columns counted from the
    sequence's start (read back with V = identity per sequence)."""
    p, h, d = 0.3, 2, 12
    lq, lk = [5, 9, 3], [7, 4, 11]
    cq = torch.tensor([0] + list(np.cumsum(lq)), dtype=torch.int32)
    ck = torch.tensor([0] + list(np.cumsum(lk)), dtype=torch.int32)
    q = torch.randn(sum(lq), h, d)
    k = torch.randn(sum(lk), h, d)
    # v: key j of its sequence carries e_j (D = 12 >= max Nk = 11)
    v = torch.zeros(sum(lk), h, d)
    for b, n in enumerate(lk):
        v[ck[b]:ck[b] + n, :, :n] = torch.eye(n)[:, None, :]
    torch.manual_seed(gen)
    out = flashc.flash_attn_varlen_func(q, k, v.contiguous(), cq, ck, max(lq), max(lk), dropout_p=p)
    seed, offset = drawn(gen)
    ref = library_mask(p, seed, offset, len(lq), h, max(lq), max(lk))
    for b in range(len(lq)):
        got = (out[cq[b]:cq[b + 1], :, :lk[b]] != 0).permute(1, 0, 2)
        assert torch.equal(got, ref[b, :, :lq[b], :lk[b]]), b


def test_seed_replays_and_calls_differ(gen):
    """torch.manual_seed(s) twice: the same output and gradients bit for bit; the next call draws a fresh mask."""
    q, k, v = (torch.randn(2, 24, 4, 32) for _ in range(3))
    do = torch.randn(2, 24, 4, 32)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashc.flash_attn_func(*leaves, dropout_p=0.2, causal=True)
        return (out,) + torch.autograd.grad(out, leaves, do)

    torch.manual_seed(7)
    a = run()
    b = run()
    torch.manual_seed(7)
    c = run()
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    assert not torch.equal(a[0], b[0])
    torch.manual_seed(7)
    s1 = flashc.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.2)
    torch.manual_seed(7)
    s2 = flashc.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.2)
    assert torch.equal(s1, s2)


def reference(q, k, v, keep, p, causal=False, scale=None):
    """fp64 attention with dropout: O = (P o Z / (1 - p)) V, P the softmax of the masked scaled scores, Z = keep
    (B, H, Nq, Nk); q (B, Nq, H, D), k, v (B, Nk, Hkv, D). Differentiable (torch autograd in fp64)."""
    h, hkv = q.shape[2], k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    nq, nk = s.shape[-2:]
    if causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    # the kernel scales by 1 / (1 - p) rounded once to fp32, with p as the fp32 flashc_params holds
    factor = float(np.float32(1.0 / (1.0 - float(np.float32(p)))))
    out = (torch.softmax(s, -1) * keep.double() * factor) @ v
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_against_reference(dtype, gen):
    """Forward and backward (causal, GQA, Nq != Nk) against the fp64 reference given the library's mask for the
    call's (seed, offset): fp32 relative error <= 1e-5; bf16 by CONVENTIONS' rule (2x the naive bf16 algorithm's
    error, 3x for gradients)."""
    p, b, nq, nk, h, hkv, d = 0.17, 2, 33, 47, 4, 2, 32
    q = torch.randn(b, nq, h, d) * 1.5
    k = torch.randn(b, nk, hkv, d)
    v = torch.randn(b, nk, hkv, d)
    do = torch.randn(b, nq, h, d)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(gen)
    out = flashc.flash_attn_func(*leaves, dropout_p=p, causal=True)
    grads = torch.autograd.grad(out, leaves, do)
    seed, offset = drawn(gen)
    keep = library_mask(p, seed, offset, b, h, nq, nk)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, keep, p, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()

    if dtype == torch.float32:
        assert rel(out, ref) <= 1e-5
        for g, r, n in zip(grads, ref_grads, "qkv"):
            assert rel(g, r) <= 1e-5, n
        return
    # the naive algorithm in bf16: each step rounded to bf16
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive = reference_lowp(*low, keep, p, dtype)
    naive_grads = torch.autograd.grad(naive, low, do)
    for name, got, r, nv, factor in [("out", out, ref, naive, 2)] + [
            ("d" + n, g, rg, ng, 3) for n, g, rg, ng in zip("qkv", grads, ref_grads, naive_grads)]:
        err = (got.double() - r).abs().max().item()
        base = (nv.double() - r).abs().max().item()
        assert err <= factor * base + 1e-5, (name, err, base)


def reference_lowp(q, k, v, keep, p, dtype):
    """The plain materialized algorithm with every tensor in dtype (torch's ops round each result)."""
    h, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(h // hkv, 1), vt.repeat_interleave(h // hkv, 1)
    s = (qt @ kt.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    nq, nk = s.shape[-2:]
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    s = s.masked_fill(j > i + nk - nq, float("-inf"))
    pr = torch.softmax(s.float(), -1).to(dtype)
    out = (pr * keep.to(dtype) * (1.0 / (1.0 - p))).to(dtype) @ vt
    return out.transpose(1, 2)


def test_gradcheck_fp64(gen):
    """torch.autograd.gradcheck on fp64 tensors through a wrapper that runs flashc in fp32 (the library computes in
    f32 / f16 / bf16, never fp64), with the generator reseeded on every evaluation so each one drops the same
    elements; the step and tolerances are sized for fp32 rounding (a wrong or missing mask in the backward is off by
    O(1))."""
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        with torch.random.fork_rng():
            torch.manual_seed(gen)
            return flashc.flash_attn_func(q.float(), k.float(), v.float(), dropout_p=0.3, causal=True).double()

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-2)


def test_s_dmask(gen):
    """return_attn_probs=True with dropout: S_dmask (B, H, Nq, Nk) holds P = exp(s - lse) (the normalized, undropped
    softmax; 0 where causal hides a key) negated where the element is dropped. Without dropout it stays None."""
    p, b, nq, nk, h, d = 0.25, 2, 12, 20, 2, 16
    q, k, v = torch.randn(b, nq, h, d), torch.randn(b, nk, h, d), torch.randn(b, nk, h, d)
    torch.manual_seed(gen)
    out, lse, s_dmask = flashc.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    seed, offset = drawn(gen)
    keep = library_mask(p, seed, offset, b, h, nq, nk)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(d)
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    probs = torch.softmax(s.masked_fill(j > i + nk - nq, float("-inf")), -1)
    assert s_dmask.shape == (b, h, nq, nk) and s_dmask.dtype == q.dtype
    assert (s_dmask.abs().double() - probs).abs().max() <= 1e-5
    visible = probs > 0
    assert torch.equal(s_dmask[visible] >= 0, keep[visible])
    assert torch.equal(s_dmask.abs(), s_dmask.abs() * visible)
    # the output is what S_dmask implies: O = (max(S_dmask, 0) / (1 - p)) V
    implied = torch.einsum("bhij,bjhd->bihd", s_dmask.clamp(min=0).double() / (1 - p), v.double())
    assert ((out.double() - implied).norm() / implied.norm()) <= 1e-5
    # packed and varlen forms return it too (varlen padded to (num_seqs, H, max_q, max_k))
    cu = torch.tensor([0, nq], dtype=torch.int32)
    _, _, sv = flashc.flash_attn_varlen_qkvpacked_func(torch.randn(nq, 3, h, d), cu, nq, dropout_p=p,
                                                       return_attn_probs=True)
    assert sv.shape == (1, h, nq, nq)
    assert flashc.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_p0_unchanged(gen):
    """dropout_p = 0 is the call without dropout, bit for bit, and draws nothing from the generator."""
    q, k, v = (torch.randn(2, 16, 2, 32, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 16, 2, 32)
    state = torch.get_rng_state()
    a = flashc.flash_attn_func(q, k, v, causal=True)
    b = flashc.flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)
    ga = torch.autograd.grad(a, (q, k, v), do)
    gb = torch.autograd.grad(b, (q, k, v), do)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_compile_fullgraph_equals_eager(gen):
    """torch.compile(fullgraph=True) of flash_attn_func and scaled_dot_product_attention with dropout: no graph break
    (torch.randint and torch.ops.flashc.fwd in the graph) and, with the same torch.manual_seed, the same out and
    gradients as eager bit for bit (aot_eager runs the graph's ops as eager does; Inductor's own RNG lowering would
    draw other numbers, as it does for torch's dropout)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    do = torch.randn(1, 20, 2, 16)

    def fa(q, k, v):
        return flashc.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)

    def sd(q, k, v):
        return flashc.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   dropout_p=0.3).transpose(1, 2)

    for fn in (fa, sd):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        results = []
        for f in (compiled, fn):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(gen)
            out = f(*leaves)
            results.append((out,) + torch.autograd.grad(out, leaves, do))
        assert all(torch.equal(x, y) for x, y in zip(*results)), fn.__name__


@pytest.mark.skipif(not (torch.cuda.is_available() and _lib.backend_compiled(_lib.BACKEND_CUDA)),
                    reason="needs a CUDA device and a libflashc with the CUDA backend")
def test_cuda_refuses_dropout():
    """The CUDA backend does not run dropout yet: a clear error naming it, never a silent run without dropout."""
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises((flashc.FlashcError, NotImplementedError), match="(?i)dropout.*CUDA|CUDA.*dropout"):
        flashc.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises((flashc.FlashcError, NotImplementedError), match="(?i)dropout.*CUDA|CUDA.*dropout"):
        flashc.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), dropout_p=0.1)


def test_operators_take_dropout(gen):
    """torch.ops.flashc.fwd / bwd called directly with dropout_p and dropout_rng: the mask of that (seed, offset)
    (checked through V = identity), the same bits as flash_attn_func after the same draw, and a clear error when the
    pair is missing."""
    from flashc import ops  # noqa: F401  (registers the operators)

    p, nk = 0.4, 32
    q, k = torch.randn(1, 8, 2, nk), torch.randn(1, nk, 2, nk)
    v = torch.eye(nk).expand(1, 2, nk, nk).transpose(1, 2).contiguous()
    rng = torch.tensor([123456789, -5], dtype=torch.int64)
    args = (None, None, 0, 0, None, False, -1, -1, 0.0, None, None, 0, 0, None, None, False, None)
    out, lse = torch.ops.flashc.fwd(q, k, v, *args, p, rng)
    keep = library_mask(p, 123456789, (-5) & U64, 1, 2, 8, nk)
    assert torch.equal((out != 0).permute(0, 2, 1, 3), keep)
    torch.manual_seed(gen)
    direct = flashc.flash_attn_func(q, k, v, dropout_p=p)
    torch.manual_seed(gen)
    out, _ = torch.ops.flashc.fwd(q, k, v, *args, p, _torch.dropout_rng(q.device))
    assert torch.equal(out, direct)
    with pytest.raises(ValueError, match="dropout_rng"):
        torch.ops.flashc.fwd(q, k, v, *args, p, None)
