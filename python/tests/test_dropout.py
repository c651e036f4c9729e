"""Fused dropout through the torch front end (issue 19). On the CPU backend: the keep fraction, the mask against
flashc_dropout_mask, seeding from torch's generator, forward and backward against an fp64 reference that applies the
same mask, finite differences, S_dmask, p = 0 unchanged, torch.compile, and the (seed, offset) pair passed to the
library by address (flashc_params.dropout_rng). On a GPU (marked gpu, skipped without one): the same mask bits as
the CPU, out and gradients against the CPU run with the same pair, S_dmask, torch.manual_seed replays with no host
synchronization, CUDA-graph replays drawing fresh masks, or, from a CUDA backend that does not run dropout, its clear
refusal."""

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


def reference_lowp(q, k, v, keep, p, dtype, causal=True):
    """The plain materialized algorithm with every tensor in dtype (torch's ops round each result)."""
    h, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(h // hkv, 1), vt.repeat_interleave(h // hkv, 1)
    s = (qt @ kt.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    nq, nk = s.shape[-2:]
    if causal:
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


# ---- the (seed, offset) pair by address -------------------------------------------------------------------------
def identity_problem(b, h, nq, nk=64):
    """q (B, Nq, H, Nk), k (B, Nk, H, Nk) random, v (B, Nk, H, Nk) with v[b, j, h, :] = e_j: out != 0 exactly where
    an element is kept (identity_readback's problem, fp32 on the CPU)."""
    q = torch.randn(b, nq, h, nk)
    k = torch.randn(b, nk, h, nk)
    v = torch.eye(nk).expand(b, h, nk, nk).transpose(1, 2).contiguous()
    return q, k, v


def kept(out):
    """The keep mask (B, H, Nq, Nk) read back from an identity problem's out, on the host."""
    return (out != 0).permute(0, 2, 1, 3).cpu()


def test_pair_travels_by_address(gen):
    """_Options points flashc_params.dropout_rng at the pair's tensor and leaves dropout_seed / dropout_offset at 0; the
    library reads the pair when the call is made, so a pair changed in place after the params were built gives that
    pair's mask."""
    p, b, h, nq = 0.3, 2, 2, 24
    q, k, v = identity_problem(b, h, nq)
    rng = torch.tensor([987654321, 42], dtype=torch.int64)
    opts = _torch._Options(q, k, dropout_p=p, dropout_rng=rng)
    params = opts.params()
    assert opts.rng.data_ptr() == rng.data_ptr()  # contiguous int64 on q's device already: no copy
    assert params.dropout_rng == rng.data_ptr()
    assert params.dropout_seed == 0 and params.dropout_offset == 0 and params.dropout_p == pytest.approx(p)
    rng.copy_(torch.tensor([-3, 2**62 + 5]))
    out, _ = _torch._forward(q, k, v, opts)
    assert torch.equal(kept(out), library_mask(p, (-3) & U64, 2**62 + 5, b, h, nq, 64))
    assert not torch.equal(kept(out), library_mask(p, 987654321, 42, b, h, nq, 64))


def test_pair_layouts_and_errors():
    """A strided (2,) view is made contiguous before its address is taken (the library reads 16 contiguous bytes: the
    view's own memory would give (seed, 111)); a pair of another dtype or shape is refused with a ValueError."""
    from flashc import ops  # noqa: F401  (registers the operators)

    p, b, h, nq = 0.4, 1, 2, 16
    q, k, v = identity_problem(b, h, nq)
    base = torch.tensor([123456789, 111, 77, 222], dtype=torch.int64)
    args = (None, None, 0, 0, None, False, -1, -1, 0.0, None, None, 0, 0, None, None, False, None)
    out, _ = torch.ops.flashc.fwd(q, k, v, *args, p, base[::2])
    assert torch.equal(kept(out), library_mask(p, 123456789, 77, b, h, nq, 64))
    for bad in (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 2, 3]), torch.tensor([[1, 2]])):
        with pytest.raises(ValueError, match="dropout_rng"):
            torch.ops.flashc.fwd(q, k, v, *args, p, bad)


def test_no_host_readback_on_cpu(gen, monkeypatch):
    """A forward and backward with dropout never read a tensor back to Python (the pair goes to the library by
    address): Tensor.tolist and Tensor.item raise if called, through flash_attn_func, flashc.attention and SDPA."""
    q, k, v = (torch.randn(1, 12, 2, 16, requires_grad=True) for _ in range(3))

    def boom(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "item", boom)
    outs = [flashc.flash_attn_func(q, k, v, dropout_p=0.2, causal=True),
            flashc.attention(q, k, v, dropout_p=0.2)[0],
            flashc.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                dropout_p=0.2).transpose(1, 2)]
    for out in outs:
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


def test_library_without_dropout_rng_refused(monkeypatch):
    """A libflashc older than 0.5 has no flashc_params.dropout_rng: dropout raises NotImplementedError naming it
    rather than running with a mask the library never read."""
    monkeypatch.setattr(_core, "_FIELDS", _core._FIELDS - {"dropout_rng"})
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout_rng.*0.5|0.5.*dropout_rng"):
        flashc.flash_attn_func(q, q, q, dropout_p=0.1)


# ---- CUDA (marked gpu; skipped without a GPU and a libflashc with the CUDA backend) --------------------------------
def cuda_ready():
    return torch.cuda.is_available() and flashc.cuda_available()


needs_cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a GPU visible to torch and a libflashc built with the "
                                "CUDA backend (torch.cuda: %s)" % torch.cuda.is_available())


def gpu(test):
    return pytest.mark.gpu(needs_cuda(test))


def cuda_refusals(q, k, v, causal=False):
    """(forward, backward): None where the loaded library's CUDA backend runs dropout for this problem
    (flashc_supported, which reads no data), else its status and message."""
    device = q.device
    rng = torch.zeros(2, dtype=torch.int64, device=device)
    params = _core.make_params(causal=causal, dropout_p=0.17, dropout_rng_ptr=rng.data_ptr())
    why = []
    with torch.cuda.device(device):
        ctx = _torch._context(device)
        views = [_torch._view(t) for t in (q, k, v)]
        for op in (_lib.OP_FORWARD, _lib.OP_BACKWARD):
            st = _lib.lib.flashc_supported(ctx.handle, op, *views, params)
            why.append(None if st == _lib.STATUS_OK else "%s: %s" % (_lib.STATUS_NAMES.get(st, st),
                                                                      _core.last_error(ctx)))
    return tuple(why)


def require_cuda_dropout(q, k, v, causal=False, backward=True):
    fwd, bwd = cuda_refusals(q, k, v, causal)
    why = fwd or (bwd if backward else None)
    if why is not None:
        pytest.skip("the loaded libflashc's CUDA backend does not run dropout for this problem (%s); "
                    "test_cuda_dropout_refused checks its refusal" % why)


def fixed_pair(monkeypatch, seed):
    """Every call with dropout gets the same (seed, offset), copied to its device, instead of a draw from torch's
    generator (whose CPU and CUDA streams differ); returns the pair mod 2**64."""
    g = np.random.default_rng(seed)
    s, o = (int(x) for x in g.integers(-2**63, 2**63 - 1, size=2, dtype=np.int64))
    monkeypatch.setattr(_torch, "dropout_rng", lambda device: torch.tensor([s, o], dtype=torch.int64, device=device))
    return s & U64, o & U64


@gpu
def test_cuda_dropout_refused(gen):
    """A CUDA backend that does not run dropout: each entry point raises the library's NOT_SUPPORTED as a FlashcError
    naming dropout (never a run without dropout), and reaches the library without reading the pair back (no host
    synchronization: torch's sync debug mode set to error). A backend that runs the forward but not the backward
    raises so from autograd's backward. Skipped once the backend runs both (the tests below check them then)."""
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    fwd, bwd = cuda_refusals(q, q, q)
    if fwd is None and bwd is None:
        pytest.skip("the CUDA backend runs dropout")
    qt = q.transpose(1, 2)
    if fwd is None:  # the forward runs: the backward's refusal, through autograd
        ql = q.clone().requires_grad_()
        qlt = ql.transpose(1, 2)
        calls = [lambda: torch.autograd.grad(flashc.flash_attn_func(ql, ql, ql, dropout_p=0.1).sum(), ql),
                 lambda: torch.autograd.grad(flashc.attention(ql, ql, ql, dropout_p=0.1)[0].sum(), ql),
                 lambda: torch.autograd.grad(
                     flashc.scaled_dot_product_attention(qlt, qlt, qlt, dropout_p=0.1).sum(), ql)]
    else:
        calls = [lambda: flashc.flash_attn_func(q, q, q, dropout_p=0.1),
                 lambda: flashc.attention(q, q, q, dropout_p=0.1),
                 lambda: flashc.scaled_dot_product_attention(qt, qt, qt, dropout_p=0.1)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            with pytest.raises(flashc.FlashcError, match="(?i)dropout") as e:
                call()
            assert e.value.status_name == "FLASHC_STATUS_NOT_SUPPORTED"
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
@pytest.mark.parametrize("p", [0.1, 0.17, 0.5])
def test_cuda_mask_bits(p, gen, monkeypatch):
    """The same keep bits on CUDA as flashc_dropout_mask (and so the CPU) for one (seed, offset), read back from out
    with V = identity: fixed-length (Nq not a multiple of a tile) and varlen (rows and columns counted from each
    sequence's start)."""
    pair = fixed_pair(monkeypatch, gen)
    b, h, nq = 2, 4, 97
    q, k, v = (t.to("cuda", torch.bfloat16) for t in identity_problem(b, h, nq))
    require_cuda_dropout(q, k, v, backward=False)
    out = flashc.flash_attn_func(q, k, v, dropout_p=p)
    assert torch.equal(kept(out), library_mask(p, *pair, b, h, nq, 64))
    out_cpu = flashc.flash_attn_func(q.float().cpu(), k.float().cpu(), v.float().cpu(), dropout_p=p)
    assert torch.equal(kept(out), kept(out_cpu))
    # varlen: key j of its sequence carries e_j
    d, lq, lk = 64, [37, 64, 5], [50, 9, 64]
    cq = torch.tensor([0] + list(np.cumsum(lq)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(np.cumsum(lk)), dtype=torch.int32, device="cuda")
    qv = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(sum(lk), h, d, device="cuda", dtype=torch.bfloat16)
    vv = torch.zeros(sum(lk), h, d, device="cuda", dtype=torch.bfloat16)
    for i, n in enumerate(lk):
        vv[int(ck[i]):int(ck[i]) + n, :, :n] = torch.eye(n, device="cuda", dtype=torch.bfloat16)[:, None, :]
    out = flashc.flash_attn_varlen_func(qv, kv, vv, cq, ck, max(lq), max(lk), dropout_p=p).cpu()
    ref = library_mask(p, *pair, len(lq), h, max(lq), max(lk))
    cqh = cq.tolist()
    for i in range(len(lq)):
        got = (out[cqh[i]:cqh[i + 1], :, :lk[i]] != 0).permute(1, 0, 2)
        assert torch.equal(got, ref[i, :, :lq[i], :lk[i]]), i


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_cpu(causal, gen, monkeypatch):
    """flash_attn_func with dropout_p 0.17 (GQA, Nq != Nk, neither a multiple of a tile) on CUDA in bf16 and on the CPU
    in fp32 on the same bf16-rounded inputs, the same (seed, offset) copied to each device: against the fp64 reference
    given flashc_dropout_mask's bits, CUDA's out within 2x and its gradients within 3x the naive bf16 algorithm's
    error (+1e-5), the CPU's within 1e-5 relative; and CUDA against the CPU within that bound plus the CPU's own
    error (never exact equality across devices)."""
    p, b, nq, nk, h, hkv, d = 0.17, 2, 97, 130, 4, 2, 64
    pair = fixed_pair(monkeypatch, gen)
    q = (torch.randn(b, nq, h, d) * 1.5).bfloat16()
    k, v = (torch.randn(b, nk, hkv, d).bfloat16() for _ in range(2))
    do = torch.randn(b, nq, h, d).bfloat16()
    cuda_leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    require_cuda_dropout(*cuda_leaves, causal=causal)
    out_c = flashc.flash_attn_func(*cuda_leaves, dropout_p=p, causal=causal)
    grads_c = torch.autograd.grad(out_c, cuda_leaves, do.cuda())
    cpu_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out_f = flashc.flash_attn_func(*cpu_leaves, dropout_p=p, causal=causal)
    grads_f = torch.autograd.grad(out_f, cpu_leaves, do.float())
    keep = library_mask(p, *pair, b, h, nq, nk)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, keep, p, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    naive = reference_lowp(*low, keep, p, torch.bfloat16, causal=causal)
    naive_grads = torch.autograd.grad(naive, low, do)
    rows = [("out", out_c, out_f, ref, naive, 2)] + [
        ("d" + n, gc, gf, r, nv, 3) for n, gc, gf, r, nv in zip("qkv", grads_c, grads_f, ref_grads, naive_grads)]
    for name, got_c, got_f, r, nv, factor in rows:
        got_c, got_f = got_c.detach().cpu().double(), got_f.detach().double()
        base = (nv.detach().double() - r).abs().max().item()
        err_c = (got_c - r).abs().max().item()
        err_f = (got_f - r).abs().max().item()
        assert ((got_f - r).norm() / r.norm()).item() <= 1e-5, (name, "cpu")
        assert err_c <= factor * base + 1e-5, (name, err_c, base)
        assert (got_c - got_f).abs().max().item() <= factor * base + err_f + 1e-5, (name, base, err_f)


@gpu
def test_cuda_s_dmask(gen, monkeypatch):
    """return_attn_probs=True with dropout on CUDA: S_dmask on the tensors' device, its sign the keep bits of
    flashc_dropout_mask for the call's pair (copied to the host for it) where a key is visible, |S_dmask| the fp64
    softmax within bf16 rounding, and out what S_dmask implies, O = (max(S_dmask, 0) / (1 - p)) V, within 2e-2
    relative (bf16)."""
    p, b, nq, nk, h, d = 0.25, 2, 40, 72, 2, 64
    pair = fixed_pair(monkeypatch, gen)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for n in (nq, nk, nk))
    require_cuda_dropout(q, k, v, causal=True, backward=False)
    out, lse, s_dmask = flashc.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (b, h, nq, nk) and s_dmask.dtype == q.dtype and s_dmask.device == q.device
    keep = library_mask(p, *pair, b, h, nq, nk)
    s = torch.einsum("bihd,bjhd->bhij", q.double().cpu(), k.double().cpu()) / math.sqrt(d)
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    probs = torch.softmax(s.masked_fill(j > i + nk - nq, float("-inf")), -1)
    sd = s_dmask.cpu().double()
    assert ((sd.abs() - probs).abs() <= 2**-7 * probs + 1e-4).all()
    visible = probs > 0
    assert torch.equal(sd[visible] >= 0, keep[visible])
    assert torch.equal(sd.abs(), sd.abs() * visible)
    implied = torch.einsum("bhij,bjhd->bihd", sd.clamp(min=0) / (1 - p), v.double().cpu())
    assert ((out.cpu().double() - implied).norm() / implied.norm()).item() <= 2e-2


@gpu
def test_cuda_seed_replays_without_sync(gen):
    """torch.manual_seed(s) twice on CUDA: the same out and gradients bit for bit (deterministic=True), a call without
    reseeding drops other elements, through flash_attn_func and SDPA, with torch's sync debug mode set to error for
    all of it (the pair is drawn on the GPU and read there by the kernels, never brought to the host)."""
    q, k, v, do = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    require_cuda_dropout(q, k, v, causal=True)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashc.flash_attn_func(*leaves, dropout_p=0.2, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, leaves, do)

    def sdpa():
        return flashc.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   dropout_p=0.2)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.manual_seed(gen)
        a = run()
        b = run()
        torch.manual_seed(gen)
        c = run()
        torch.manual_seed(gen)
        s1 = sdpa()
        torch.manual_seed(gen)
        s2 = sdpa()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, c):
        assert torch.equal(x, y), name
    assert not torch.equal(a[0], b[0])
    assert torch.equal(s1, s2)


def _warm_up_and_capture(step):
    """step() three times on a side stream (allocator pools, lazy initialization), then captured into a CUDA graph;
    returns (graph, what the captured step returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


@gpu
def test_cuda_graph_replays_fresh_masks(gen, monkeypatch):
    """A dropout forward captured in a CUDA graph (torch.randint of the pair is captured too: torch's graph-safe
    generator state advances the offset on each replay): every replay drops the elements of the pair the graph drew
    in that replay (read back after it, checked against flashc_dropout_mask through V = identity), so the kernels read
    the pair at replay time; three replays draw three pairs; torch.manual_seed before a replay repeats its draw."""
    p, b, h, nq = 0.3, 2, 4, 64
    q, k, v = (t.to("cuda", torch.bfloat16) for t in identity_problem(b, h, nq))
    require_cuda_dropout(q, k, v, backward=False)
    drawn_pairs = []
    real = _torch.dropout_rng

    def recording(device):
        t = real(device)
        drawn_pairs.append(t)
        return t

    monkeypatch.setattr(_torch, "dropout_rng", recording)
    graph, out = _warm_up_and_capture(lambda: flashc.flash_attn_func(q, k, v, dropout_p=p))
    rng = drawn_pairs[-1]  # drawn inside the capture: the graph refills it on each replay
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        pair = tuple(x & U64 for x in rng.tolist())
        keep = kept(out)
        assert torch.equal(keep, library_mask(p, *pair, b, h, nq, 64)), pair
        seen.append((pair, keep))
    assert len({pair for pair, _ in seen}) == 3
    assert not torch.equal(seen[0][1], seen[1][1])
    replays = []
    for _ in range(2):
        torch.manual_seed(gen)
        graph.replay()
        torch.cuda.synchronize()
        replays.append((rng.tolist(), out.clone()))
    assert replays[0][0] == replays[1][0] and torch.equal(replays[0][1], replays[1][1])


@gpu
def test_cuda_graph_forward_backward_dropout(gen, monkeypatch):
    """Forward and backward with dropout captured in one CUDA graph, replayed: out and the gradients are the eager
    call's bit for bit (deterministic=True) when the eager call is given the pair the replay drew, so the captured
    backward read the same pair as its forward at replay time."""
    p, shape_q, shape_k = 0.2, (2, 128, 8, 64), (2, 160, 2, 64)
    q, k, v, do = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in (shape_q, shape_k, shape_k, shape_q))
    require_cuda_dropout(q, k, v, causal=True)
    drawn_pairs = []
    real = _torch.dropout_rng

    def recording(device):
        t = real(device)
        drawn_pairs.append(t)
        return t

    monkeypatch.setattr(_torch, "dropout_rng", recording)
    static = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flashc.flash_attn_func(*static, dropout_p=p, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, static, do)

    graph, results = _warm_up_and_capture(step)
    rng = drawn_pairs[-1]
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        s, o = rng.tolist()
        monkeypatch.setattr(_torch, "dropout_rng",
                            lambda device: torch.tensor([s, o], dtype=torch.int64, device=device))
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashc.flash_attn_func(*eager, dropout_p=p, causal=True, deterministic=True)
        expect = (out,) + torch.autograd.grad(out, eager, do)
        torch.cuda.synchronize()
        for name, got, want in zip(("out", "dq", "dk", "dv"), results, expect):
            assert torch.equal(got, want), name
        monkeypatch.setattr(_torch, "dropout_rng", recording)
