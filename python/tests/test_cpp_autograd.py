"""flashc.cpp_autograd: the C++ autograd function gives the Python path's bits (out, lse, gradients, their layouts)
for flash_attn_func, flashc.attention and flashc.scaled_dot_product_attention, planned calls go through it once it is
enabled (asserted by the grad_fn autograd records), and autograd's checks still hold.

The module is compiled against the running torch on first use (about half a minute; cached afterwards): these tests
need a C++ compiler and Python's headers, and skip without them."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

torch = pytest.importorskip("torch")

import flashc  # noqa: E402
from flashc import cpp_autograd  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flashc.cuda_available() else [])


def _toolchain():
    cxx = (os.environ.get("CXX") or "c++").split()[0]
    return shutil.which(cxx) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.fixture(scope="module", autouse=True)
def built():
    if not _toolchain():
        pytest.skip("no C++ compiler or no Python headers: flashc.cpp_autograd cannot be built here")
    cpp_autograd.enable()  # a failure to build or load fails the tests: the toolchain is there
    cpp_autograd.disable()
    yield
    cpp_autograd.disable()


def _is_cpp(t):
    return "CppNode" in t.grad_fn.name()


# (name, q shape, kv shape, options)
CASES = [
    ("plain", (2, 37, 4, 64), (2, 45, 4, 64), {}),
    ("causal_gqa", (2, 40, 6, 32), (2, 40, 2, 32), dict(causal=True)),
    ("window_softcap_scale", (1, 50, 2, 64), (1, 61, 1, 64), dict(window_size=(9, 3), softcap=2.5,
                                                                   softmax_scale=0.2)),
    ("deterministic_lse", (2, 33, 2, 128), (2, 20, 2, 128), dict(causal=True, deterministic=True,
                                                                  return_attn_probs=True)),
]


def _step(fn, q0, k0, v0, g, opts, cpp):
    (cpp_autograd.enable if cpp else cpp_autograd.disable)()
    try:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        for _ in range(2):  # the first call of a key takes the full path and plans it; the second the plan
            r = fn(q, k, v, **opts)
        out = r[0] if isinstance(r, tuple) else r
        lse = r[1] if isinstance(r, tuple) else None
        grads = torch.autograd.grad(out, (q, k, v), g)
        return out, lse, grads, _is_cpp(out)
    finally:
        cpp_autograd.disable()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("api", ["flash_attn_func", "attention"])
def test_same_bits_as_python(api, case, dtype, device):
    _, sq, skv, opts = case
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(s, generator=gen).to(device, dtype) for s in (sq, skv, skv))
    g = torch.randn(sq, generator=gen).to(device, dtype)
    if api == "attention":
        opts = {n: o for n, o in opts.items() if n != "return_attn_probs"}
        fn = flashc.attention
    else:
        fn = flashc.flash_attn_func
    out_p, lse_p, grads_p, cpp_p = _step(fn, q, k, v, g, opts, cpp=False)
    out_c, lse_c, grads_c, cpp_c = _step(fn, q, k, v, g, opts, cpp=True)
    assert not cpp_p and cpp_c, "the C++ function must run exactly when enabled"
    assert torch.equal(out_p, out_c)
    assert (lse_p is None) == (lse_c is None) and (lse_p is None or torch.equal(lse_p, lse_c))
    assert lse_c is None or not lse_c.requires_grad
    for a, b in zip(grads_p, grads_c):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    assert out_p.stride() == out_c.stride()


# (name, q shape (B, H, N, D), kv shape, options of scaled_dot_product_attention)
SDPA_CASES = [
    ("plain", (2, 4, 37, 64), (2, 4, 45, 64), {}),
    ("causal_scale", (1, 3, 40, 32), (1, 3, 40, 32), dict(is_causal=True, scale=0.3)),
    ("gqa", (2, 6, 33, 128), (2, 2, 20, 128), dict(enable_gqa=True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_same_bits_as_python(case, dtype, device):
    _, sq, skv, opts = case
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(s, generator=gen).to(device, dtype) for s in (sq, skv, skv))
    g = torch.randn(sq, generator=gen).to(device, dtype)
    out_p, _, grads_p, cpp_p = _step(flashc.scaled_dot_product_attention, q, k, v, g, opts, cpp=False)
    out_c, _, grads_c, cpp_c = _step(flashc.scaled_dot_product_attention, q, k, v, g, opts, cpp=True)
    assert not cpp_p and cpp_c, "the C++ function must run exactly when enabled"
    assert out_p.stride() == out_c.stride() and torch.equal(out_p, out_c)
    for a, b in zip(grads_p, grads_c):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_checks(device):
    q, k, v = (torch.randn(1, 24, 2, 32, device=device, requires_grad=True) for _ in range(3))
    cpp_autograd.enable()
    try:
        flashc.flash_attn_func(q, k, v)
        out = flashc.flash_attn_func(q, k, v)
        assert _is_cpp(out)
        # an input changed in place after the forward: autograd refuses the backward
        with torch.no_grad():
            v.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        # a second backward without retain_graph is refused; with it, the same gradients twice
        out = flashc.flash_attn_func(q, k, v, causal=True)
        g1 = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True)
        g2 = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
        with pytest.raises(RuntimeError):
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        # without a gradient to compute the forward alone runs (no autograd function)
        with torch.no_grad():
            assert flashc.flash_attn_func(q, k, v).grad_fn is None
    finally:
        cpp_autograd.disable()


def test_environment_enables():
    code = ("import torch, flashc\n"
            "from flashc import cpp_autograd\n"
            "q = torch.randn(1, 8, 1, 16, requires_grad=True)\n"
            "for _ in range(3):  # a key is planned by its first or second call (when flashc.ops is imported)\n"
            "    out = flashc.flash_attn_func(q, q, q)\n"
            "print(cpp_autograd.enabled(), 'CppNode' in out.grad_fn.name())\n")
    env = dict(os.environ, FLASHC_CPP_AUTOGRAD="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr
