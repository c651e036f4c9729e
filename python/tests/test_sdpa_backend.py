"""flashc.torch_backend: flashc registered as torch's flash-attention implementation.

CPU (runs here): torch's SDPA flash backend on the CPU is aten::_scaled_dot_product_flash_attention_for_cpu and its
backward, which enable() overrides; F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (and
torch's default choice, which is the flash backend for these inputs) must then run flashc (counted in
flashc.torch_backend.calls), give flashc.scaled_dot_product_attention's bits and match torch's SDPA math in fp64
(CONVENTIONS.md's fp32 rule, relative error <= 1e-5), under torch.compile too; what flashc does not take (attn_mask,
float64, is_causal with Nq != Nk, dropout) must run torch's own kernel (the same bits as before enable()) without
recursing; disable() must give torch its kernels back.

CUDA (skipped without a GPU and a CUDA libflashc): SDPA's flash backend (aten::_scaled_dot_product_flash_attention)
forward and backward in fp16 / bf16 against the fp64 reference with flash-attn's error rule, GQA, torch.compile,
torch.nn.attention.varlen.varlen_attn (aten::_flash_attention_forward / backward, varlen), the in-place varlen
forward, a CUDA-graph capture, and the fallback of dropout to torch's kernel.
"""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashc  # noqa: E402
import flashc.torch_backend as tb  # noqa: E402
# gen: test_torch's seeded-generator fixture, used by name
from test_torch import CUDA_REASON, cuda_ready, gen, rel_err  # noqa: E402,F401

needs_cuda = pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)


@pytest.fixture
def backend():
    """flashc enabled for the test, torch's kernels back afterwards; the counters start at 0."""
    tb.enable()
    tb.calls.clear()
    tb.fallbacks.clear()
    yield tb
    tb.disable()


def flash(fn, *args, **kw):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return fn(*args, **kw)


def leaves(*ts):
    return tuple(t.detach().clone().requires_grad_() for t in ts)


def bhnd(b, h, n, d, device="cpu", dtype=torch.float32, transposed=False):
    """(B, H, N, D) inputs, contiguous or as the transposed view of (B, N, H, D) storage (what models pass)."""
    if transposed:
        return torch.randn(b, n, h, d, device=device).to(dtype).transpose(1, 2)
    return torch.randn(b, h, n, d, device=device).to(dtype)


def math_ref(q, k, v, dout, **kw):
    """out and grads of torch's SDPA math backend in fp64."""
    q64, k64, v64 = leaves(*(t.double() for t in (q, k, v)))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q64, k64, v64, **kw)
    return out.detach(), torch.autograd.grad(out, (q64, k64, v64), dout.double())


# ---- CPU ----------------------------------------------------------------------------------------------------------
def test_registration(backend):
    assert tb.is_enabled()
    if tb.has_torch_registry():
        assert torch.nn.attention.current_flash_attention_impl() == tb.IMPL_NAME
        assert tb.IMPL_NAME in torch.nn.attention.list_flash_attention_impls()
    tb.disable()
    assert not tb.is_enabled()
    if tb.has_torch_registry():
        assert torch.nn.attention.current_flash_attention_impl() is None
    tb.enable()
    assert tb.is_enabled()


CPU_CASES = [
    # (name, B, H, Hkv, Nq, Nk, D, is_causal, scale, transposed)
    ("plain", 2, 4, 4, 33, 47, 32, False, None, False),
    ("causal", 2, 4, 4, 40, 40, 64, True, None, True),
    ("gqa_causal_scale", 1, 8, 2, 37, 37, 32, True, 0.3, True),
    ("decode", 3, 4, 1, 1, 70, 16, False, None, False),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_cpu_sdpa_runs_flashc(case, backend, gen):
    _, b, h, hkv, nq, nk, d, causal, scale, tr = case
    q = bhnd(b, h, nq, d, transposed=tr)
    k, v = bhnd(b, hkv, nk, d, transposed=tr), bhnd(b, hkv, nk, d, transposed=tr)
    do = torch.randn(b, h, nq, d)
    kw = dict(is_causal=causal, scale=scale, enable_gqa=h != hkv)
    a = leaves(q, k, v)
    out = flash(F.scaled_dot_product_attention, *a, **kw)
    grads = torch.autograd.grad(out, a, do)
    assert tb.calls["_scaled_dot_product_flash_attention_for_cpu"] == 1
    assert tb.calls["_scaled_dot_product_flash_attention_for_cpu_backward"] == 1
    assert not tb.fallbacks
    # the same library calls as flashc's own SDPA: the same bits
    c = leaves(q, k, v)
    out_c = flashc.scaled_dot_product_attention(*c, **kw)
    assert torch.equal(out, out_c)
    for x, y in zip(grads, torch.autograd.grad(out_c, c, do)):
        assert torch.equal(x, y)
    # and torch's SDPA math in fp64
    ref, ref_grads = math_ref(q, k, v, do, **kw)
    assert rel_err(out, ref) <= 1e-5
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 1e-5, name
    # torch's meta function's layouts: out like query, lse (B, Nq, H) seen as (B, H, Nq), grads (B, N, H, D)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scale) \
        if h == hkv else (None, None)
    if o is not None:
        assert o.stride() == torch.empty_like(q).stride() and lse.transpose(1, 2).is_contiguous()


def test_cpu_default_choice_runs_flashc(backend, gen):
    """Without sdpa_kernel torch picks its flash backend for these inputs, so flashc runs too; low precision too."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = (bhnd(1, 2, 24, 32, dtype=dtype) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(out, flashc.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert tb.calls["_scaled_dot_product_flash_attention_for_cpu"] == 3


FALLBACK_CASES = [
    # (name, kwargs maker, reason)
    ("attn_mask", lambda q, k: dict(attn_mask=torch.rand(q.shape[-2], k.shape[-2]) > 0.3), "attn_mask"),
    ("float64", None, "dtype torch.float64/torch.float64/torch.float64"),
    ("causal_non_square", lambda q, k: dict(is_causal=True), "is_causal with Nq != Nk (top-left)"),
]


@pytest.mark.parametrize("case", FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES])
def test_cpu_fallback_is_torchs_kernel(case, gen):
    """What flashc does not take runs the kernel torch had before enable(): the same bits as without flashc, and no
    recursion into flashc's override."""
    name, make, reason = case
    dtype = torch.float64 if name == "float64" else torch.float32
    q = bhnd(2, 4, 20, 32, dtype=dtype)
    k, v = bhnd(2, 4, 29, 32, dtype=dtype), bhnd(2, 4, 29, 32, dtype=dtype)
    kw = make(q, k) if make else {}
    do = torch.randn(2, 4, 20, 32, dtype=dtype)
    a, b = leaves(q, k, v), leaves(q, k, v)
    before = flash(F.scaled_dot_product_attention, *a, **kw)
    g_before = torch.autograd.grad(before, a, do)
    tb.enable()
    try:
        tb.calls.clear()
        tb.fallbacks.clear()
        after = flash(F.scaled_dot_product_attention, *b, **kw)
        g_after = torch.autograd.grad(after, b, do)
    finally:
        tb.disable()
    assert not tb.calls
    assert tb.fallbacks[("_scaled_dot_product_flash_attention_for_cpu", reason)] == 1
    assert torch.equal(before, after)
    for x, y in zip(g_before, g_after):
        assert torch.equal(x, y)


def test_cpu_dropout_falls_back(backend, gen):
    """torch's SDPA does not choose its CPU flash backend with dropout, so the operator is called directly: flashc
    hands it to torch's kernel, whose own refusal comes back."""
    q, k, v = (bhnd(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5)
    assert not tb.calls
    assert tb.fallbacks[("_scaled_dot_product_flash_attention_for_cpu", "dropout_p > 0")] == 1


def test_disable_restores_torch(gen):
    q, k, v = (bhnd(1, 2, 16, 16) for _ in range(3))
    expect = flash(F.scaled_dot_product_attention, q, k, v)
    tb.enable()
    tb.disable()
    tb.calls.clear()
    assert torch.equal(flash(F.scaled_dot_product_attention, q, k, v), expect) and not tb.calls
    tb.disable()  # twice: no-op


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_cpu_compile(compiler, backend, gen):
    """torch.compile(fullgraph=True) of SDPA: the graph keeps torch's flash operator, which runs flashc (Inductor
    calls it as a fallback kernel with the meta function's strides); the same bits as eager."""
    torch._dynamo.reset()

    def f(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (bhnd(2, 4, 40, 32, transposed=True) for _ in range(3))
    do = torch.randn(2, 4, 40, 32)
    a, b = leaves(q, k, v), leaves(q, k, v)
    out_c = torch.compile(f, backend=compiler, fullgraph=True)(*a)
    g_c = torch.autograd.grad(out_c, a, do)
    assert tb.calls["_scaled_dot_product_flash_attention_for_cpu"] == 1
    assert tb.calls["_scaled_dot_product_flash_attention_for_cpu_backward"] == 1
    out_e = f(*b)
    assert torch.equal(out_c, out_e)
    for x, y in zip(g_c, torch.autograd.grad(out_e, b, do)):
        assert torch.equal(x, y)


# ---- CUDA (written on a machine without a GPU) ----------------------------------------------------------------------
def naive_lowp_err(q, k, v, do, ref, ref_grads, **kw):
    """Errors of SDPA math run in the low precision itself: flash-attn's yardstick."""
    a = leaves(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*a, **kw)
    grads = torch.autograd.grad(out, a, do)
    return ((out.double() - ref).abs().max().item(),
            [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 8, 256, 256, 64, True), (2, 8, 2, 200, 333, 128, False),
                                   (4, 16, 4, 1, 1024, 128, False)], ids=["causal", "gqa", "decode_gqa"])
def test_cuda_sdpa_runs_flashc(shape, dtype, backend, gen):
    b, h, hkv, nq, nk, d, causal = shape
    q = bhnd(b, h, nq, d, "cuda", dtype, transposed=True)
    k, v = bhnd(b, hkv, nk, d, "cuda", dtype, True), bhnd(b, hkv, nk, d, "cuda", dtype, True)
    do = torch.randn(b, h, nq, d, device="cuda").to(dtype)
    kw = dict(is_causal=causal, enable_gqa=h != hkv)
    a = leaves(q, k, v)
    out = flash(F.scaled_dot_product_attention, *a, **kw)
    grads = torch.autograd.grad(out, a, do)
    assert tb.calls["_scaled_dot_product_flash_attention"] == 1, (dict(tb.calls), dict(tb.fallbacks))
    assert tb.calls["_scaled_dot_product_flash_attention_backward"] == 1
    ref, ref_grads = math_ref(q, k, v, do, **kw)
    e_out, e_grads = naive_lowp_err(q, k, v, do, ref, ref_grads, **kw)
    assert (out.double() - ref).abs().max().item() <= 2 * e_out + 1e-5
    for name, g, r, e in zip("qkv", grads, ref_grads, e_grads):
        assert (g.double() - r).abs().max().item() <= 3 * e + 1e-5, name


@needs_cuda
def test_cuda_compile_and_graph(backend, gen):
    """torch.compile(fullgraph=True) (Inductor keeps the aten flash operator, flashc runs), then a forward and
    backward captured in a CUDA graph and replayed: the same bits as the eager call."""
    torch._dynamo.reset()
    q, k, v = (bhnd(2, 8, 128, 64, "cuda", torch.bfloat16, True) for _ in range(3))
    do = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)

    def f(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    a, b = leaves(q, k, v), leaves(q, k, v)
    out_c = torch.compile(f, fullgraph=True)(*a)
    out_e = f(*b)
    assert torch.equal(out_c, out_e) and tb.calls["_scaled_dot_product_flash_attention"] == 2
    static = leaves(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(f(*static), static, do)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = f(*static)
        grads_g = torch.autograd.grad(out_g, static, do)
    new = [bhnd(2, 8, 128, 64, "cuda", torch.bfloat16, True) for _ in range(3)]
    with torch.no_grad():
        for s, t in zip(static, new):
            s.copy_(t)
    graph.replay()
    e = leaves(*new)
    out_x = f(*e)
    grads_x = torch.autograd.grad(out_x, e, do)
    torch.cuda.synchronize()
    assert torch.equal(out_g, out_x)
    assert torch.equal(grads_g[1], grads_x[1]) and torch.equal(grads_g[2], grads_x[2])  # dk, dv bitwise (README)


@needs_cuda
def test_cuda_varlen_attn(backend, gen):
    """torch.nn.attention.varlen.varlen_attn (aten::_flash_attention_forward / backward with cu_seqlens): flashc
    runs; each sequence against the fp64 reference of that sequence alone (bottom-right causal = top-left here, as
    each sequence's q and k lengths are equal)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    lens = [37, 128, 5]
    cu = torch.tensor([0, 37, 165, 170], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(170, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    a = leaves(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = varlen.varlen_attn(*a, cu, cu, max(lens), max(lens), window_size=(-1, 0))  # causal
    grads = torch.autograd.grad(out, a, do)
    assert tb.calls["_flash_attention_forward"] + tb.calls["_flash_attention_forward_no_dropout_inplace"] >= 1, \
        (dict(tb.calls), dict(tb.fallbacks))
    assert tb.calls["_flash_attention_backward"] == 1
    start = 0
    for n in lens:
        s = slice(start, start + n)
        sq = [t[None, s].transpose(1, 2) for t in (q, k, v)]
        ref, ref_grads = math_ref(*sq, do[None, s].transpose(1, 2), is_causal=True)
        e_out, e_grads = naive_lowp_err(*sq, do[None, s].transpose(1, 2), ref, ref_grads, is_causal=True)
        assert (out[s].double() - ref[0].transpose(0, 1)).abs().max().item() <= 2 * e_out + 1e-5
        for g, r, e in zip(grads, ref_grads, e_grads):
            assert (g[s].double() - r[0].transpose(0, 1)).abs().max().item() <= 3 * e + 1e-5
        start += n


@needs_cuda
def test_cuda_flash_forward_op_window(backend, gen):
    """aten::_flash_attention_forward called as flash-attn is (bottom-right causal, sliding window) gives
    flashc.flash_attn_func's bits."""
    q = torch.randn(2, 100, 8, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 160, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 100, 160, 0.0, True, False,
                                                       window_size_left=32, window_size_right=0)[:2]
    expect, expect_lse, _ = flashc.flash_attn_func(q, k, v, causal=True, window_size=(32, 0), return_attn_probs=True)
    assert tb.calls["_flash_attention_forward"] == 1
    assert torch.equal(out, expect) and torch.equal(lse, expect_lse)


@needs_cuda
def test_cuda_dropout_falls_back(backend, gen):
    q, k, v = (bhnd(1, 4, 128, 64, "cuda", torch.float16) for _ in range(3))
    out = flash(F.scaled_dot_product_attention, q, k, v, dropout_p=0.3)
    assert out.shape == q.shape and not tb.calls
    assert tb.fallbacks[("_scaled_dot_product_flash_attention", "dropout_p > 0")] == 1


def test_without_torch_registry(monkeypatch, gen):
    """A torch without register_flash_attention_impl: enable() registers the same kernels itself."""
    monkeypatch.setattr(tb, "_registry", lambda: None)
    q, k, v = (bhnd(1, 2, 16, 16) for _ in range(3))
    tb.enable()
    try:
        tb.calls.clear()
        flash(F.scaled_dot_product_attention, q, k, v)
        assert tb.is_enabled() and tb.calls["_scaled_dot_product_flash_attention_for_cpu"] == 1
    finally:
        tb.disable()
    assert not tb.is_enabled()
    tb.calls.clear()
    flash(F.scaled_dot_product_attention, q, k, v)
    assert not tb.calls
