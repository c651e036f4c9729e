"""The numpy API (CPU backend) against the fp64 reference in refattn.py: forward, lse and backward over the
features (causal, window, softcap, ALiBi, GQA/MQA, block mask, varlen, strided views), plus errors and the
ctypes mirror of flashc.h."""

import ctypes
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

import flashc
import refattn
from flashc import _core, _lib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_inputs(rng, shape_q, shape_k, dtype, n_outliers=3):
    """Random normal q, k, v, dout with a few query rows scaled up so that some rows have large logits."""
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_k)
    v = rng.standard_normal(shape_k)
    do = rng.standard_normal(shape_q)
    rows = rng.choice(shape_q[-3], size=min(n_outliers, shape_q[-3]), replace=False)
    q[..., rows, :, :] *= 6.0
    return tuple(a.astype(dtype) for a in (q, k, v, do))


# (name, B, Nq, Nk, H, Hkv, D, options)
CASES = [
    ("plain", 2, 33, 47, 4, 4, 32, {}),
    ("causal_q_lt_k", 2, 17, 40, 2, 2, 64, dict(causal=True)),
    ("causal_q_gt_k", 1, 40, 17, 2, 1, 64, dict(causal=True)),  # the first 23 rows see no key
    ("window", 1, 64, 64, 2, 2, 32, dict(window_size=(8, 4))),
    ("window_causal", 2, 50, 70, 2, 2, 16, dict(window_size=(16, -1), causal=True)),
    ("window_right_only", 1, 30, 45, 3, 3, 40, dict(window_size=(-1, 3))),
    ("softcap", 2, 30, 30, 2, 2, 48, dict(softcap=2.5)),
    ("alibi_h", 2, 24, 36, 4, 2, 32, dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32),
                                          causal=True)),
    ("alibi_bh", 2, 20, 20, 2, 2, 32, dict(alibi_slopes=np.array([[0.3, 0.1], [0.7, 0.05]], np.float32))),
    ("gqa", 2, 32, 32, 6, 2, 64, dict(causal=True)),
    ("mqa", 1, 37, 29, 4, 1, 32, {}),
    ("scale", 1, 16, 24, 2, 2, 32, dict(softmax_scale=0.37)),
    ("d128", 1, 70, 90, 2, 2, 128, dict(causal=True)),
    ("d256", 1, 40, 40, 1, 1, 256, {}),
    ("d_odd", 1, 21, 13, 2, 2, 24, {}),
    ("block_mask", 2, 40, 48, 2, 2, 32, dict(block_size=(16, 16), block_mask="random")),
    ("block_mask_causal", 1, 64, 64, 2, 1, 32, dict(block_size=(8, 32), block_mask="random", causal=True)),
]


def resolve(opts, rng, b, nq, nk, h):
    opts = dict(opts)
    if isinstance(opts.get("block_mask"), str):
        bq, bk = opts["block_size"]
        m = rng.random((b, h, -(-nq // bq), -(-nk // bk))) < 0.6
        m[:, :, 0, 0] = True
        opts["block_mask"] = m.astype(np.uint8)
    return opts


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_f32_forward_backward(case, rng):
    _, b, nq, nk, h, hkv, d, opts = case
    opts = resolve(opts, rng, b, nq, nk, h)
    q, k, v, do = make_inputs(rng, (b, nq, h, d), (b, nk, hkv, d), np.float32)
    out, lse = flashc.attention(q, k, v, **opts)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, **opts)
    assert out.shape == q.shape and out.dtype == np.float32
    assert lse.shape == (b, h, nq) and lse.dtype == np.float32
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), "rows with no visible key must have lse = +inf"
    assert refattn.rel_err(out, ref_out) <= 1e-5
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    dq, dk, dv = flashc.attention_backward(do, q, k, v, out, lse, **opts)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g):
        assert got.shape == want.shape
        assert refattn.rel_err(got, want) <= 1e-5, name
    if np.isinf(ref_lse).any():
        empty = np.isinf(ref_lse).transpose(0, 2, 1)  # (B, Nq, H)
        assert np.all(out[empty] == 0) and np.all(dq[empty] == 0)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in (
    "plain", "causal_q_gt_k", "window_causal", "softcap", "alibi_h", "gqa", "d128", "block_mask")],
    ids=lambda c: c[0])
def test_f16_forward_backward(case, rng):
    """fp16: CONVENTIONS.md's rule against the naive algorithm run with fp16 rounding after each stage."""
    _, b, nq, nk, h, hkv, d, opts = case
    opts = resolve(opts, rng, b, nq, nk, h)
    q, k, v, do = make_inputs(rng, (b, nq, h, d), (b, nk, hkv, d), np.float16)
    out, lse = flashc.attention(q, k, v, **opts)
    assert out.dtype == np.float16
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, **opts)
    low_out, _, low_g = refattn.attention(q, k, v, do, rnd=refattn.rounder(np.float16), **opts)
    refattn.check_lowp("out", out, ref_out, low_out, 2)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(lse), ~fin)
    # lse is accumulated and stored in fp32 from the fp16 inputs, so it is held to fp32's bound.
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=2e-5, atol=2e-5)
    grads = flashc.attention_backward(do, q, k, v, out, lse, **opts)
    for name, got, want, low in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        assert got.dtype == np.float16
        refattn.check_lowp(name, got, want, low, 3)


def test_varlen(rng):
    lens_q = [5, 0, 17, 33, 1]
    lens_k = [9, 4, 17, 20, 0]  # an empty query sequence and an empty key sequence
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    h, hkv, d = 4, 2, 32
    q, k, v, do = make_inputs(rng, (cq[-1], h, d), (ck[-1], hkv, d), np.float32)
    for opts in (dict(), dict(causal=True), dict(window_size=(4, 2), softcap=3.0),
                 dict(alibi_slopes=np.array([0.5, 0.3, 0.2, 0.1], np.float32), causal=True)):
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **opts)
        out, lse = flashc.attention(q, k, v, **kw)
        assert out.shape == q.shape and lse.shape == (h, cq[-1])
        ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, **kw)
        assert refattn.rel_err(out, ref_out) <= 1e-5, opts
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
        grads = flashc.attention_backward(do, q, k, v, out, lse, max_seqlen_q=max(lens_q),
                                          max_seqlen_k=max(lens_k), **kw)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_g):
            assert refattn.rel_err(got, want) <= 1e-5, (name, opts)


def test_varlen_equals_batched(rng):
    """Packing equal-length sequences must give exactly the per-batch problem's numbers."""
    b, n, h, d = 3, 24, 2, 32
    q, k, v, _ = make_inputs(rng, (b, n, h, d), (b, n, h, d), np.float32)
    out, lse = flashc.attention(q, k, v, causal=True)
    cu = np.arange(0, (b + 1) * n, n, dtype=np.int32)
    out_v, lse_v = flashc.attention(q.reshape(b * n, h, d), k.reshape(b * n, h, d), v.reshape(b * n, h, d),
                                    cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    np.testing.assert_allclose(out_v.reshape(b, n, h, d), out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_v, lse.transpose(1, 0, 2).reshape(h, b * n), rtol=1e-6, atol=1e-6)


def test_strided_views(rng):
    """(B, H, N, D) storage, a reversed sequence axis and a sliced head dim go in as strides, not copies."""
    b, n, h, d = 2, 30, 3, 32
    qs = rng.standard_normal((b, h, n, d)).astype(np.float32)  # (B, H, N, D) storage
    ks = rng.standard_normal((b, h, n + 5, 2 * d)).astype(np.float32)
    vs = rng.standard_normal((b, n + 5, h, d)).astype(np.float32)[:, ::-1]  # negative N stride
    q = qs.transpose(0, 2, 1, 3)
    k = ks.transpose(0, 2, 1, 3)[..., 1::2]  # D stride 2
    v = vs
    assert not q.flags.c_contiguous and k.strides[-1] == 8 and v.strides[1] < 0
    do = rng.standard_normal((b, h, n, d)).astype(np.float32).transpose(0, 2, 1, 3)
    out, lse = flashc.attention(q, k, v, causal=True)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, causal=True)
    assert refattn.rel_err(out, ref_out) <= 1e-5
    grads = flashc.attention_backward(do, q, k, v, out, lse, causal=True)
    for got, want in zip(grads, ref_g):
        assert refattn.rel_err(got, want) <= 1e-5


def test_deterministic_backward_is_bitwise_reproducible(rng):
    q, k, v, do = make_inputs(rng, (2, 64, 4, 64), (2, 80, 2, 64), np.float32)
    out, lse = flashc.attention(q, k, v, causal=True)
    a = flashc.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
    b = flashc.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
    for x, y in zip(a, b):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def test_no_keys_and_no_queries(rng):
    q, k, v, do = make_inputs(rng, (2, 5, 2, 16), (2, 0, 2, 16), np.float32, n_outliers=0)
    out, lse = flashc.attention(q, k, v)
    assert np.all(out == 0) and np.all(np.isposinf(lse))
    dq, dk, dv = flashc.attention_backward(do, q, k, v, out, lse)
    assert np.all(dq == 0) and dk.shape == k.shape
    out, lse = flashc.attention(q[:, :0], k[:, :0], v[:, :0])
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)


def test_threads_do_not_change_results(rng):
    q, k, v, _ = make_inputs(rng, (2, 96, 4, 32), (2, 96, 4, 32), np.float32)
    base, _ = flashc.attention(q, k, v, causal=True)
    try:
        flashc.set_num_threads(1)
        one, _ = flashc.attention(q, k, v, causal=True)
    finally:
        flashc.set_num_threads(0)
    np.testing.assert_allclose(one, base, rtol=1e-6, atol=1e-6)


def test_huge_thread_counts_are_capped_not_wrapped(rng):
    """2**32 + 3 threads once reached the C int as 3, and 40000 made OpenMP end the process: both now run, capped."""
    q, k, v, _ = make_inputs(rng, (1, 40, 2, 16), (1, 40, 2, 16), np.float32)
    base, _ = flashc.attention(q, k, v)
    try:
        for n in (40000, 2**32 + 3, 2**40):
            flashc.set_num_threads(n)
            assert flashc.get_num_threads() == 2**31 - 1 or flashc.get_num_threads() == n < 2**31
            out, _ = flashc.attention(q, k, v)
            np.testing.assert_allclose(out, base, rtol=1e-6, atol=1e-6)
    finally:
        flashc.set_num_threads(0)


# ---- errors ---------------------------------------------------------------------------------------------------------
def _qkv(h=4, hkv=4, d=32, dtype=np.float32, n=8):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, n, h, d)).astype(dtype), rng.standard_normal((1, n, hkv, d)).astype(dtype),
            rng.standard_normal((1, n, hkv, d)).astype(dtype))


def test_error_carries_status_and_message():
    q, k, v = _qkv(h=4, hkv=3)
    with pytest.raises(flashc.FlashcError) as e:
        flashc.attention(q, k, v)
    assert isinstance(e.value, RuntimeError)
    assert e.value.status == 1 and e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    assert "not a multiple" in e.value.message and "flashc.c:" in e.value.message
    assert "FLASHC_STATUS_INVALID_ARGUMENT" in str(e.value) and e.value.message in str(e.value)


def test_error_not_supported_head_dim():
    q, k, v = _qkv(d=264, n=2)
    with pytest.raises(flashc.FlashcError) as e:
        flashc.attention(q, k, v)
    assert e.value.status_name == "FLASHC_STATUS_NOT_SUPPORTED" and "264" in e.value.message


def test_error_mixed_dtypes_and_bad_values():
    q, k, v = _qkv()
    with pytest.raises(flashc.FlashcError, match="dtypes differ"):
        flashc.attention(q, k.astype(np.float16), v)
    with pytest.raises(flashc.FlashcError, match="softcap"):
        flashc.attention(q, k, v, softcap=-1.0)
    with pytest.raises(flashc.FlashcError, match="window"):
        flashc.attention(q, k, v, window_size=(-3, 0))
    bad = np.array([0, 5, 3], np.int32)  # decreasing offsets
    with pytest.raises(flashc.FlashcError) as e:
        flashc.attention(q[0], k[0], v[0], cu_seqlens_q=bad, cu_seqlens_k=bad, max_seqlen_q=8, max_seqlen_k=8)
    assert e.value.message


def test_error_python_side():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="dropout"):
        flashc.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="float64"):
        flashc.attention(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match="block_size"):
        flashc.attention(q, k, v, block_mask=np.ones((1, 1), np.uint8))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashc.attention(q, k, v, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="4-d"):
        flashc.attention(q[0], k[0], v[0])


# ---- the ctypes mirror ------------------------------------------------------------------------------------------------
def test_library_info():
    assert flashc.library_version().count(".") >= 2
    assert os.path.exists(flashc.library_path)
    assert _lib.status_string(1)
    assert _lib.backend_compiled(_lib.BACKEND_CPU)
    assert _lib.device_count(_lib.BACKEND_CPU) == 1
    assert _lib.cpu_features()
    assert _lib.device_name(_lib.BACKEND_CPU, 0)


def test_params_default_read_through_the_mirror():
    """flashc_params_default() comes back by value through the ctypes struct: fields land where flashc.h has them."""
    p = _lib.lib.flashc_params_default()
    assert p.softmax_scale == 0.0 and p.causal == 0 and p.softcap == 0.0
    assert p.window_left == -1 and p.window_right == -1
    assert not p.alibi_slopes and not p.block_mask and not p.cu_seqlens_q and not p.cu_seqlens_k
    assert p.dropout_p == 0.0 and p.deterministic == 0
    t = _lib.lib.flashc_tensor_contiguous(None, _lib.DTYPE_BF16, 2, 3, 4, 5)
    assert t.dtype == _lib.DTYPE_BF16 and list(t.shape) == [2, 3, 4, 5] and list(t.stride) == [60, 20, 5, 1]


def _library_params_fields():
    """(name, offset, size, type code) of every flashc_params field, as the library describes them."""
    name, off, size, code = ctypes.c_char_p(), ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_char()
    out = []
    while _lib.lib.flashc_params_field(len(out), ctypes.byref(name), ctypes.byref(off), ctypes.byref(size),
                                       ctypes.byref(code)):
        out.append((name.value.decode(), off.value, size.value, code.value.decode()))
    return out


def test_params_struct_is_the_libraries():
    """Params is built from flashc_params_field: the same fields at the same offsets, the same size, and
    flashc_params_default() fills struct_size with that size."""
    fields = _library_params_fields()
    assert fields[0][0] == "struct_size" and len(fields) == len(_lib.Params._fields_)
    for (name, off, size, _), (pyname, ctype) in zip(fields, _lib.Params._fields_):
        assert (pyname, getattr(_lib.Params, pyname).offset, ctypes.sizeof(ctype)) == (name, off, size)
    assert ctypes.sizeof(_lib.Params) == _lib.lib.flashc_params_size()
    assert _lib.lib.flashc_params_default().struct_size == _lib.lib.flashc_params_size()


def test_params_round_trip(rng):
    """Options given to the Python API land at the offsets the library reports, and the library acts on them:
    the result matches the reference with the options and differs from the one without."""
    opts = dict(softmax_scale=0.3, causal=True, window_size=(5, -1), softcap=2.0)
    p = _core.make_params(softmax_scale=0.3, causal=True, window=(5, -1), softcap=2.0, deterministic=True)
    raw = ctypes.string_at(ctypes.addressof(p), ctypes.sizeof(p))
    fmt = {"I": "I", "i": "i", "f": "f", "q": "q", "Q": "Q", "p": "P"}
    got = {name: struct.unpack_from("@" + fmt[code], raw, off)[0] for name, off, _, code in _library_params_fields()}
    assert got["struct_size"] == ctypes.sizeof(p)
    assert got["causal"] == 1 and got["window_left"] == 5 and got["window_right"] == -1
    assert got["softcap"] == 2.0 and abs(got["softmax_scale"] - 0.3) < 1e-7 and got["deterministic"] == 1
    assert got["block_mask_batch"] == 1 and got["block_mask_heads"] == 1 and got["alibi_slopes"] in (0, None)

    q, k, v, do = make_inputs(rng, (1, 40, 2, 32), (1, 40, 2, 32), np.float32)
    out, _ = flashc.attention(q, k, v, **opts)
    ref_out, _, _ = refattn.attention(q, k, v, do, **opts)
    plain, _, _ = refattn.attention(q, k, v, do)
    assert refattn.rel_err(out, ref_out) <= 1e-5
    assert refattn.rel_err(out, plain) > 1e-2


@pytest.mark.parametrize("size", [0, 7, 0xDEADBEEF])
def test_params_with_a_foreign_struct_size_are_refused(size):
    """A flashc_params not made by flashc_params_default() of this flashc.h is refused with a message that says
    what to do, not read with its fields misplaced."""
    p = _lib.lib.flashc_params_default()
    p.struct_size = size
    t = _lib.lib.flashc_tensor_contiguous(None, _lib.DTYPE_F32, 1, 4, 1, 8)
    ctx = _lib.context(_lib.BACKEND_CPU)
    st = _lib.lib.flashc_supported(ctx.handle, _lib.OP_FORWARD, t, t, t, p)
    assert _lib.STATUS_NAMES[st] == "FLASHC_STATUS_INVALID_ARGUMENT"
    msg = _core.last_error(ctx)
    assert "struct_size" in msg and "flashc_params_default()" in msg


@pytest.mark.skipif(shutil.which("cc") is None or not os.path.exists(os.path.join(REPO, "include", "flashc.h")),
                    reason="needs a C compiler and the repository's include/flashc.h")
def test_struct_layout_matches_header(tmp_path):
    """Every field offset and struct size of the ctypes mirror equals the C compiler's for flashc.h."""
    fields = {"flashc_tensor": _lib.Tensor, "flashc_params": _lib.Params}
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "flashc.h"', "int main(void) {"]
    for cname, py in fields.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (cname, cname))
        for f, _ in py._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (cname, f, cname, f))
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", "-I", os.path.join(REPO, "include"), str(src), "-o", str(exe)], check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    for cname, py in fields.items():
        assert int(got[cname]) == ctypes.sizeof(py), cname
        for f, _ in py._fields_:
            assert int(got["%s.%s" % (cname, f)]) == getattr(py, f).offset, (cname, f)


def test_reference_gradients_by_finite_differences(rng):
    """The oracle's hand-written backward (GQA sums, softcap's chain rule, ALiBi, window) against central
    differences of its own forward in fp64, so the gradient tests above compare with something proven."""
    q, k, v, do = (a.astype(np.float64) for a in make_inputs(rng, (1, 6, 4, 8), (1, 7, 2, 8), np.float64))
    opts = dict(softcap=1.5, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]), window_size=(3, 1))
    _, _, grads = refattn.attention(q, k, v, do, **opts)
    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            plus, minus = args[which].copy(), args[which].copy()
            plus[idx] += eps
            minus[idx] -= eps
            fp = (refattn.attention(*[plus if i == which else a for i, a in enumerate(args)], **opts)[0] * do).sum()
            fm = (refattn.attention(*[minus if i == which else a for i, a in enumerate(args)], **opts)[0] * do).sum()
            num[idx] = (fp - fm) / (2 * eps)
        assert np.abs(num - g).max() <= 1e-6 * max(1.0, np.abs(g).max()), "qkv"[which]
