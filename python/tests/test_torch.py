"""The torch front end: flash-attn-compatible functions, SDPA, flashc.attention, autograd, on CPU and (when torch
sees a GPU and libflashc has the CUDA backend) CUDA.

Accuracy follows CONVENTIONS.md: fp32 within 1e-5 relative error of an fp64 reference, fp16/bf16 within 2x (out)
and 3x (gradients) of the naive materialized algorithm run in the same low precision, plus 1e-5. The reference
is plain torch (materialized scores, softmax, autograd for the gradients), independent of the library.
"""

import contextlib
import math
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashc  # noqa: E402


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("FLASHC_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print("FLASHC_TEST_SEED=%d (%s)" % (seed, request.node.name))
    torch.manual_seed(seed)
    return seed


def cuda_ready():
    return torch.cuda.is_available() and flashc.cuda_available()


CUDA_REASON = ("needs a GPU visible to torch and a libflashc built with the CUDA backend (torch.cuda: %s)"
               % torch.cuda.is_available())
needs_cuda = pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)


# ---- reference ---------------------------------------------------------------------------------------------------
def keep_mask(nq, nk, causal, window, device):
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    diag = i + nk - nq
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep


def attn_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             upcast=True, keep=None):
    """(B, Nq, H, D) attention materialized in fp64 (upcast) or in the inputs' dtype (the naive low-precision
    algorithm); differentiable. keep: an explicit (Nq, Nk) boolean mask instead of causal/window. Returns out,
    lse (B, H, Nq)."""
    dt = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        sl = alibi_slopes.to(dt)
        sl = sl[None, :, None, None] if sl.dim() == 1 else sl[:, :, None, None]
        dist = (torch.arange(nq, device=q.device)[:, None] + nk - nq - torch.arange(nk, device=q.device)[None]).abs()
        s = s - sl * dist.to(dt)
    if keep is None:
        keep = keep_mask(nq, nk, causal, window_size, q.device)
    s = s.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1)  # (Nq,)
    p = torch.softmax(s, dim=-1).masked_fill(empty[:, None], 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.logsumexp(s.double(), dim=-1).masked_fill(empty, float("inf"))
    return out, lse


def ref_with_grads(q, k, v, dout, upcast=True, **opts):
    """out, lse, (dq, dk, dv) of the reference."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attn_ref(*leaves, upcast=upcast, **opts)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), tuple(t.grad for t in leaves)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_close(name, got, ref, naive, dtype, factor):
    if dtype == torch.float32:
        assert rel_err(got, ref) <= 1e-5, "%s: relative error %.3g" % (name, rel_err(got, ref))
    else:
        err = (got.double() - ref).abs().max().item()
        base = (naive.double() - ref).abs().max().item()
        assert err <= factor * base + 1e-5, "%s: max error %.3g > %d x naive %.3g" % (name, err, factor, base)


def inputs(shape_q, shape_k, dtype, device, outliers=3):
    q = torch.randn(shape_q, device=device)
    k = torch.randn(shape_k, device=device)
    v = torch.randn(shape_k, device=device)
    do = torch.randn(shape_q, device=device)
    rows = torch.randperm(shape_q[1])[:outliers]
    q[:, rows] *= 6.0  # a few query rows with large logits
    return tuple(t.to(dtype) for t in (q, k, v, do))


# (name, B, Nq, Nk, H, Hkv, D, options)
CASES = [
    ("plain", 2, 45, 61, 4, 4, 64, {}),
    ("causal_gqa_q_gt_k", 2, 70, 33, 6, 2, 64, dict(causal=True)),
    ("window_softcap", 1, 96, 96, 2, 1, 128, dict(window_size=(20, 5), softcap=4.0)),
    ("alibi_causal", 2, 40, 72, 4, 4, 32, dict(causal=True, alibi="h")),
    ("alibi_bh_scale", 2, 33, 33, 2, 2, 96, dict(alibi="bh", softmax_scale=0.2)),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def resolve(opts, b, h, device):
    opts = dict(opts)
    if opts.get("alibi") == "h":
        opts["alibi_slopes"] = torch.rand(h, device=device) * 0.5
    elif opts.get("alibi") == "bh":
        opts["alibi_slopes"] = torch.rand(b, h, device=device) * 0.5
    opts.pop("alibi", None)
    return opts


def rule_dtype(dtype, device):
    """The precision the accuracy rule holds a result to. The CUDA backend runs fp32 inputs on bf16 tensor-core
    operands (src/cuda/cuda.cu), so fp32 on CUDA is held to the bf16 rule; everything else to its own dtype."""
    if torch.device(device).type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


@contextlib.contextmanager
def backend_may_refuse(device):
    """On CUDA a configuration the backend does not run yet (e.g. the backward) skips the rest of the test with
    the library's reason, after what ran before it was checked; on the CPU every configuration must run."""
    try:
        yield
    except flashc.FlashcError as e:
        if torch.device(device).type == "cuda" and e.status_name == "FLASHC_STATUS_NOT_SUPPORTED":
            pytest.skip("CUDA backend: %s" % e.message)
        raise


def run_flash_attn_case(case, dtype, device):
    _, b, nq, nk, h, hkv, d, opts = case
    opts = resolve(opts, b, h, device)
    q, k, v, do = inputs((b, nq, h, d), (b, nk, hkv, d), dtype, device)
    low = rule_dtype(dtype, device)
    lq, lk, lv, ldo = (t.to(low) for t in (q, k, v, do))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with backend_may_refuse(device):
        out, lse, s_dmask = flashc.flash_attn_func(*leaves, return_attn_probs=True, **opts)
    assert s_dmask is None
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32
    ref_out, ref_lse, ref_g = ref_with_grads(q, k, v, do, **opts)
    low_out, low_lse, low_g = ref_with_grads(lq, lk, lv, ldo, upcast=False, **opts)
    check_close("out", out, ref_out, low_out, low, 2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    if low == dtype:
        # the scores of these very inputs are accumulated in fp32: lse is held to fp32's bound
        torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=2e-5, atol=2e-5)
    else:
        check_close("lse", lse[fin], ref_lse[fin], low_lse[fin], low, 2)
    with backend_may_refuse(device):
        out.backward(do)
    for name, leaf, want, lw in zip(("dq", "dk", "dv"), leaves, ref_g, low_g):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype
        check_close(name, leaf.grad, want, lw, low, 3)


# ---- CPU -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attn_func_cpu(case, dtype, gen):
    run_flash_attn_case(case, dtype, torch.device("cpu"))


def test_packed_variants_cpu(gen):
    """qkv- and kv-packed inputs give the unpacked results, and their gradients arrive in the packed tensor."""
    b, n, h, d = 2, 37, 4, 32
    qkv = torch.randn(b, n, 3, h, d)
    do = torch.randn(b, n, h, d)
    a = qkv.clone().requires_grad_()
    out = flashc.flash_attn_qkvpacked_func(a, causal=True, softcap=3.0)
    out.backward(do)
    ref_out, _, ref_g = ref_with_grads(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], do, causal=True, softcap=3.0)
    assert rel_err(out, ref_out) <= 1e-5
    assert a.grad.shape == qkv.shape
    for i in range(3):
        assert rel_err(a.grad[:, :, i], ref_g[i]) <= 1e-5

    hkv, nk = 2, 50
    q = torch.randn(b, n, h, d, requires_grad=True)
    kv = torch.randn(b, nk, 2, hkv, d, requires_grad=True)
    out = flashc.flash_attn_kvpacked_func(q, kv, window_size=(10, 10))
    out.backward(do)
    ref_out, _, ref_g = ref_with_grads(q, kv[:, :, 0], kv[:, :, 1], do, window_size=(10, 10))
    assert rel_err(out, ref_out) <= 1e-5
    for got, want in zip((q.grad, kv.grad[:, :, 0], kv.grad[:, :, 1]), ref_g):
        assert rel_err(got, want) <= 1e-5


def varlen_case(device, dtype):
    lens_q = [7, 30, 1, 19]
    lens_k = [12, 30, 5, 3]
    cq = torch.tensor([0] + np.cumsum(lens_q).tolist(), dtype=torch.int32, device=device)
    ck = torch.tensor([0] + np.cumsum(lens_k).tolist(), dtype=torch.int32, device=device)
    return lens_q, lens_k, cq, ck


def varlen_ref(q, k, v, do, cq, ck, **opts):
    outs, lses, grads = [], [], [[], [], []]
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, lse, g = ref_with_grads(q[None, sq], k[None, sk], v[None, sk], do[None, sq], **opts)
        outs.append(o[0])
        lses.append(lse[0])
        for acc, gi in zip(grads, g):
            acc.append(gi[0])
    return torch.cat(outs), torch.cat(lses, dim=1), [torch.cat(g) for g in grads]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_varlen_functions(device, gen):
    """The three varlen functions against per-sequence references: all forwards first, then the backwards."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    lens_q, lens_k, cq, ck = varlen_case(device, dtype)
    h, hkv, d = 4, 2, 64
    nq, nk = int(cq[-1]), int(ck[-1])
    q, k, v, do = (t[0] for t in inputs((1, nq, h, d), (1, nk, hkv, d), dtype, device))
    qkv = torch.randn(nq, 3, h, d, device=device).to(dtype)
    kv = torch.randn(nk, 2, hkv, d, device=device).to(dtype)
    runs = []  # (name, leaves, grads of the inputs as q/k/v views, reference inputs, cu_k, options)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashc.flash_attn_varlen_func(*leaves, cq, ck, max(lens_q), max(lens_k), causal=True,
                                                return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, nq)
    runs.append(("varlen", out, lambda: [t.grad for t in leaves], (q, k, v), ck, dict(causal=True)))
    a = qkv.clone().requires_grad_()
    out = flashc.flash_attn_varlen_qkvpacked_func(a, cq, max(lens_q), causal=True)
    runs.append(("qkvpacked", out, lambda: [a.grad[:, i] for i in range(3)], (qkv[:, 0], qkv[:, 1], qkv[:, 2]), cq,
                 dict(causal=True)))
    qq, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = flashc.flash_attn_varlen_kvpacked_func(qq, b, cq, ck, max(lens_q), max(lens_k), window_size=(3, 3))
    runs.append(("kvpacked", out, lambda: [qq.grad, b.grad[:, 0], b.grad[:, 1]], (q, kv[:, 0], kv[:, 1]), ck,
                 dict(window_size=(3, 3))))

    refs = []
    for name, out, _, (rq, rk, rv), cuk, opts in runs:
        ref_out, ref_lse, ref_g = varlen_ref(rq, rk, rv, do, cq, cuk, **opts)
        low_out, _, low_g = varlen_ref(rq, rk, rv, do, cq, cuk, upcast=False, **opts)
        check_close(name + " out", out, ref_out, low_out, dtype, 2)
        if name == "varlen":
            fin = torch.isfinite(ref_lse)
            assert torch.equal(torch.isinf(lse), ~fin)
            torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=2e-5, atol=2e-5)
        refs.append((ref_g, low_g))
    for (name, out, grads, _, _, _), (ref_g, low_g) in zip(runs, refs):
        with backend_may_refuse(device):
            out.backward(do)
        for gname, got, want, low in zip(("dq", "dk", "dv"), grads(), ref_g, low_g):
            check_close("%s %s" % (name, gname), got, want, low, dtype, 3)


SDPA_SHAPES = [(40, 40), (25, 60), (60, 25)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("nq,nk", SDPA_SHAPES, ids=["square", "q_lt_k", "q_gt_k"])
def test_sdpa_matches_torch(nq, nk, device, gen):
    """torch's is_causal is top-left aligned; flashc's must match it for every Nq/Nk, forward and backward.
    The reference is torch's own SDPA in fp64; the low-precision tolerance comes from the materialized
    algorithm with the same top-left mask (torch's low-precision SDPA may run fused kernels, not the naive one)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, h, hkv, d = 2, 4, 2, 64
    q = torch.randn(b, h, nq, d, device=device).to(dtype)
    k = torch.randn(b, hkv, nk, d, device=device).to(dtype)
    v = torch.randn(b, hkv, nk, d, device=device).to(dtype)
    do = torch.randn(b, h, nq, d, device=device).to(dtype)
    runs = []
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashc.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.3, enable_gqa=True)
        assert out.shape == (b, h, nq, d)
        r = [t.double().clone().requires_grad_() for t in (q, k, v)]
        # repeat_interleave instead of enable_gqa keeps this working on torch versions without it
        rk, rv = (t.repeat_interleave(h // hkv, dim=1) for t in r[1:])
        ref_out = F.scaled_dot_product_attention(r[0], rk, rv, is_causal=causal, scale=0.3)
        ref_out.backward(do.double())
        ref_g = [t.grad for t in r]
        keep = (torch.ones(nq, nk, dtype=torch.bool, device=device).tril() if causal
                else torch.ones(nq, nk, dtype=torch.bool, device=device))
        t = [x.transpose(1, 2) for x in (q, k, v, do)]
        mine, _, mine_g = ref_with_grads(*t, softmax_scale=0.3, keep=keep)
        torch.testing.assert_close(mine.transpose(1, 2), ref_out.detach(), rtol=1e-9, atol=1e-9)
        low_out, _, low_g = ref_with_grads(*t, upcast=False, softmax_scale=0.3, keep=keep)
        check_close("out causal=%s" % causal, out, ref_out.detach(), low_out.transpose(1, 2), dtype, 2)
        if causal and nq != nk:
            # flash-attn's bottom-right causal is a different mask here: the test above is not vacuous.
            br = flashc.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=0.3,
                                        causal=True).transpose(1, 2)
            assert rel_err(br, ref_out.detach()) > 1e-2
        runs.append((causal, out, leaves, ref_g, [g.transpose(1, 2) for g in low_g]))
    for causal, out, leaves, ref_g, low_g in runs:
        with backend_may_refuse(device):
            out.backward(do)
        for name, leaf, want, low in zip(("dq", "dk", "dv"), leaves, ref_g, low_g):
            check_close("%s causal=%s" % (name, causal), leaf.grad, want, low, dtype, 3)


def test_sdpa_shapes_and_errors(gen):
    q = torch.randn(3, 20, 32)  # (H, N, D): no batch dimension
    out = flashc.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
    assert out.shape == q.shape and rel_err(out, ref) <= 1e-5
    q5 = torch.randn(2, 2, 3, 20, 32)  # two leading batch dimensions
    out = flashc.scaled_dot_product_attention(q5, q5, q5)
    ref = F.scaled_dot_product_attention(q5.double(), q5.double(), q5.double())
    assert out.shape == q5.shape and rel_err(out, ref) <= 1e-5
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashc.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(20, 20, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        flashc.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashc.scaled_dot_product_attention(torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16),
                                            torch.randn(1, 2, 8, 16))


def no_copy_ops(fn):
    """aten ops run by fn that copy tensor data (clone, copy_, contiguous-style _to_copy)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        pytest.skip("torch without TorchDispatchMode")

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return [name for name in seen if any(c in name for c in ("clone", "copy", "contiguous"))]


def test_no_hidden_copies_cpu(gen):
    """Contiguous inputs, SDPA's (B, H, N, D) layout and packed qkv reach the library without copies."""
    q = torch.randn(2, 4, 32, 64)
    assert no_copy_ops(lambda: flashc.scaled_dot_product_attention(q, q, q, is_causal=True)) == []
    x = torch.randn(2, 32, 4, 64)
    assert no_copy_ops(lambda: flashc.flash_attn_func(x, x, x, causal=True)) == []
    qkv = torch.randn(2, 32, 3, 4, 64)
    assert no_copy_ops(lambda: flashc.flash_attn_qkvpacked_func(qkv)) == []


def test_finite_differences_cpu(gen):
    """The autograd wiring checked on its own: flashc's gradients against central differences of flashc's own
    forward. torch.autograd.gradcheck wants fp64 inputs, which the library does not take (it computes on
    f32/f16/bf16), so this is the same check in fp32: the directional derivative along a random direction,
    with a step and tolerance sized for fp32 rounding (a wrong or swapped gradient is off by O(1))."""
    b, nq, nk, h, hkv, d = 1, 9, 11, 4, 2, 16
    opts = dict(causal=True, softcap=2.0, alibi_slopes=torch.tensor([0.2, 0.1, 0.3, 0.05]))
    q, k, v = (torch.randn(s) for s in ((b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    w = torch.randn(b, nq, h, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (flashc.flash_attn_func(*leaves, **opts) * w).sum().backward()
    eps = 1e-2
    for i in range(3):
        u = torch.randn_like(leaves[i])
        plus = [t.detach().clone() for t in leaves]
        minus = [t.detach().clone() for t in leaves]
        plus[i] += eps * u
        minus[i] -= eps * u
        fd = ((flashc.flash_attn_func(*plus, **opts) * w).sum().double()
              - (flashc.flash_attn_func(*minus, **opts) * w).sum().double()) / (2 * eps)
        an = (leaves[i].grad.double() * u.double()).sum()
        assert abs(fd - an) <= 1e-2 * max(1.0, abs(an.item())), ("qkv"[i], fd.item(), an.item())


def test_attention_api_and_backward_cpu(gen):
    """flashc.attention / attention_backward on tensors: autograd gradients equal the explicit backward."""
    q, k, v, do = inputs((2, 30, 4, 32), (2, 40, 1, 32), torch.float32, "cpu")
    mask = torch.rand(2, 4, 2, 3) < 0.7
    mask[..., 0, 0] = True
    opts = dict(causal=True, block_mask=mask, block_size=(16, 16), window_size=(-1, 8))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashc.attention(*leaves, **opts)
    out.backward(do)
    dq, dk, dv = flashc.attention_backward(do, q, k, v, out.detach(), lse, deterministic=True, **opts)
    for got, want in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, want.grad, rtol=1e-6, atol=1e-6)
    # the numpy API on the same data agrees
    np_out, np_lse = flashc.attention(q.numpy(), k.numpy(), v.numpy(), **{**opts, "block_mask": mask.numpy()})
    np.testing.assert_allclose(np_out, out.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_partial_requires_grad_and_no_grad(gen):
    q, k, v, do = inputs((1, 16, 2, 32), (1, 16, 2, 32), torch.float32, "cpu")
    kk = k.clone().requires_grad_()
    out = flashc.flash_attn_func(q, kk, v)
    out.backward(do)
    assert kk.grad is not None and kk.grad.abs().sum() > 0
    with torch.no_grad():
        out = flashc.flash_attn_func(q, kk, v)
    assert out.grad_fn is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_forward_without_autograd_node(device, gen):
    """Inputs that need no gradient (or torch.no_grad()) take the forward without an autograd node: the same
    bits as with one, for the (B, N, H, D), varlen and packed layouts."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, _ = inputs((2, 24, 4, 32), (2, 40, 2, 32), dtype, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_g, lse_g = flashc.attention(*leaves, causal=True)
    out, lse = flashc.attention(q, k, v, causal=True)
    assert out_g.grad_fn is not None and out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, out_g.detach()) and torch.equal(lse, lse_g)
    with torch.no_grad():
        out_ng, lse_ng = flashc.attention(*leaves, causal=True)
    assert out_ng.grad_fn is None and torch.equal(out_ng, out) and torch.equal(lse_ng, lse)

    lens_q, lens_k, cq, ck = varlen_case(device, dtype)
    nq, nk = int(cq[-1]), int(ck[-1])
    q, k, v, _ = (t[0] for t in inputs((1, nq, 4, 32), (1, nk, 2, 32), dtype, device))
    args = (cq, ck, max(lens_q), max(lens_k))
    out_g = flashc.flash_attn_varlen_func(*[t.clone().requires_grad_() for t in (q, k, v)], *args, causal=True)
    out = flashc.flash_attn_varlen_func(q, k, v, *args, causal=True)
    assert out.shape == q.shape and out.grad_fn is None and torch.equal(out, out_g.detach())
    qkv = torch.randn(nq, 3, 4, 32, device=device).to(dtype)
    out_g = flashc.flash_attn_varlen_qkvpacked_func(qkv.clone().requires_grad_(), cq, max(lens_q), causal=True)
    out = flashc.flash_attn_varlen_qkvpacked_func(qkv, cq, max(lens_q), causal=True)
    assert out.shape == (nq, 4, 32) and out.grad_fn is None and torch.equal(out, out_g.detach())


def test_errors_torch(gen):
    q = torch.randn(1, 8, 4, 32)
    with pytest.raises(flashc.FlashcError, match="not a multiple") as e:
        flashc.flash_attn_func(q, torch.randn(1, 8, 3, 32), torch.randn(1, 8, 3, 32))
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    with pytest.raises(NotImplementedError, match="dropout"):
        flashc.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="KV cache"):
        flashc.flash_attn_with_kvcache(q, q, q)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        flashc.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, block_table=torch.zeros(1, 1))
    with pytest.raises(TypeError, match="float64"):
        flashc.flash_attn_func(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="4-d"):
        flashc.flash_attn_func(q[0], q[0], q[0])


# ---- CUDA ------------------------------------------------------------------------------------------------------
GPU_CASES = CASES + [
    ("long_causal", 2, 1024, 1024, 8, 2, 128, dict(causal=True)),
    ("d256", 1, 200, 300, 2, 2, 256, {}),
]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_flash_attn_func_cuda(case, dtype, gen):
    try:
        run_flash_attn_case(case, dtype, torch.device("cuda"))
    except flashc.FlashcError as e:
        if e.status_name == "FLASHC_STATUS_NOT_SUPPORTED":
            pytest.skip("the CUDA backend does not run this configuration: %s" % e.message)
        raise


@needs_cuda
def test_cuda_streams(gen):
    """Calls run on torch's current stream. On a side stream (torch makes them non-blocking), the input is written
    by a copy queued behind a long sleep: a call on any other stream would read it before the copy lands."""
    q, k, v, _ = inputs((4, 512, 8, 64), (4, 512, 8, 64), torch.float16, "cuda")
    ref = flashc.flash_attn_func(q, k, v, causal=True)
    staged = torch.zeros_like(q)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)  # GPU cycles: a long while after the host moves on
        else:
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                a = a @ a / 64
        staged.copy_(q)
        out = flashc.flash_attn_func(staged, k, v, causal=True)
    side.synchronize()
    assert torch.equal(out, ref)
    again = flashc.flash_attn_func(q, k, v, causal=True)  # back on the default stream
    assert torch.equal(again, ref)


@needs_cuda
def test_cuda_layouts_and_warnings(gen):
    """SDPA's (B, H, N, D) tensors and packed qkv run without a copy; a gradient with stride 0 (from .sum()) is
    either taken as is or copied with a FlashcCopyWarning that says why, and the result is right either way."""
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(2, 256, 3, 8, 64, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flashc.FlashcCopyWarning)
        out = flashc.scaled_dot_product_attention(q, q, q, is_causal=True)
        packed = flashc.flash_attn_qkvpacked_func(qkv)
    t = q.transpose(1, 2)
    ref, _ = attn_ref(t, t, t, causal=True)
    low, _ = attn_ref(t, t, t, causal=True, upcast=False)
    check_close("sdpa out", out.transpose(1, 2), ref, low, torch.bfloat16, 2)
    ref, _ = attn_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    low, _ = attn_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], upcast=False)
    check_close("packed out", packed, ref, low, torch.bfloat16, 2)

    x = t.clone().requires_grad_()
    y = t.clone().requires_grad_()
    with backend_may_refuse("cuda"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flashc.flash_attn_func(x, x, x).sum().backward()
        flashc.flash_attn_func(y, y, y).backward(torch.ones_like(y))
    for w in caught:
        if issubclass(w.category, flashc.FlashcCopyWarning):
            assert "refused" in str(w.message)
    # The two gradients may take different kernels (a stride-0 dout is not a tile the tensor cores load), so each
    # is held to the reference by the gradient rule rather than to the other bit for bit.
    grads = []
    for upcast in (True, False):
        leaf = t.detach().clone().requires_grad_()
        attn_ref(leaf, leaf, leaf, upcast=upcast)[0].backward(torch.ones_like(t))
        grads.append(leaf.grad)
    check_close("grad, dout from .sum()", x.grad, grads[0], grads[1], torch.bfloat16, 3)
    check_close("grad, dout = ones", y.grad, grads[0], grads[1], torch.bfloat16, 3)


@needs_cuda
def test_cuda_device_checks(gen):
    q = torch.randn(1, 8, 2, 32, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="device"):
        flashc.flash_attn_func(q, q.cpu(), q)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_second_device(gen):
    q, k, v, _ = inputs((1, 128, 4, 64), (1, 128, 4, 64), torch.float16, "cuda:1")
    out = flashc.flash_attn_func(q, k, v)
    assert out.device == q.device
    ref, _ = attn_ref(q, k, v)
    low, _ = attn_ref(q, k, v, upcast=False)
    check_close("out", out, ref, low, torch.float16, 2)


@needs_cuda
def test_cuda_deterministic_backward(gen):
    q, k, v, do = inputs((2, 384, 8, 64), (2, 384, 2, 64), torch.bfloat16, "cuda")
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with backend_may_refuse("cuda"):
            flashc.flash_attn_func(*leaves, causal=True, deterministic=True).backward(do)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
