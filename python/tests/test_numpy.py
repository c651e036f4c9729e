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
    assert not p.seqused_k and not p.sinks and not p.dsinks
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


# ---- seqused_k and attention sinks (flashc_params 0.3) ---------------------------------------------------------------
def make_sinks(rng, h):
    """Sinks around a row's own lse (log Nk + a little), so that the sink takes a real share of every row."""
    return (rng.standard_normal(h) + 3.0).astype(np.float32)


def lse_with_sink(lse_plain, sinks, varlen=False):
    """lse = logsumexp over [scores..., sink], from the reference's lse without sinks (+inf where no key is seen,
    which is -inf's place in a logsumexp)."""
    s = sinks[:, None] if varlen else sinks[None, :, None]
    s = np.broadcast_to(s.astype(np.float64), lse_plain.shape)
    return np.where(np.isinf(lse_plain), s, np.logaddexp(np.where(np.isinf(lse_plain), -np.inf, lse_plain), s))


def dsinks_scale(sinks, lse, do, out, varlen=False):
    """Per head: the sum of |exp(sink - lse_i) dO_id O_id| over batch, rows i and the head dim d, i.e. the absolute
    sum of the products that dsinks = -sum_i exp(sink - lse_i) rowsum(dO o O)_i adds up. dsinks is a short vector
    (H) of sums that cancel (dO . O has either sign), typically to 1/100 of that sum, and fp32 accumulation errs
    in proportion to the terms, not to what is left: ||got - ref|| / ||ref|| failed at 1.21e-5 > 1e-5 on a random
    seed (FLASHC_TEST_SEED=2182704896, block_mask) with an error of 1.7e-8 of this scale. lse and out (fp64 reference
    or flashc's own): (B, H, Nq) and (B, Nq, H, D), or (H, total) and (total, H, D) with varlen."""
    s = np.asarray(sinks, np.float64)
    lse = np.asarray(lse, np.float64)
    dd = np.abs(np.asarray(do, np.float64) * np.asarray(out, np.float64)).sum(-1)  # (B, Nq, H) or (total, H)
    if varlen:
        return (np.exp(s[:, None] - lse) * dd.T).sum(-1)
    return (np.exp(s[None, :, None] - lse) * dd.transpose(0, 2, 1)).sum(axis=(0, 2))


def assert_dsinks_close(got, want, scale, what="dsinks"):
    """CONVENTIONS.md's fp32 1e-5, relative to the absolute sum of dsinks' terms (dsinks_scale), for each head."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert got.shape == want.shape and np.all(err <= 1e-5 * scale), (what, err, 1e-5 * scale)


SINK_CASES = [c for c in CASES if c[0] in ("plain", "causal_q_gt_k", "window_causal", "softcap", "alibi_h", "gqa",
                                           "mqa", "block_mask")]


@pytest.mark.parametrize("case", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_sinks_forward_backward(case, rng):
    """out, lse (logsumexp over the scores and the sink) and dq, dk, dv, dsinks against the fp64 reference."""
    _, b, nq, nk, h, hkv, d, opts = case
    opts = resolve(opts, rng, b, nq, nk, h)
    q, k, v, do = make_inputs(rng, (b, nq, h, d), (b, nk, hkv, d), np.float32)
    sinks = make_sinks(rng, h)
    out, lse = flashc.attention(q, k, v, sinks=sinks, **opts)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, sinks=sinks, **opts)
    _, plain_lse, _ = refattn.attention(q, k, v, **opts)
    np.testing.assert_allclose(ref_lse, lse_with_sink(plain_lse, sinks), rtol=1e-12, atol=1e-12)
    assert np.all(np.isfinite(lse)), "with a sink every row has a finite lse"
    assert refattn.rel_err(out, ref_out) <= 1e-5
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    plain_out, _ = flashc.attention(q, k, v, **opts)
    assert refattn.rel_err(plain_out, ref_out) > 1e-2, "the sinks change the output: the comparison is not vacuous"
    grads = flashc.attention_backward(do, q, k, v, out, lse, sinks=sinks, **opts)
    assert len(grads) == 4 and grads[3].shape == (h,) and grads[3].dtype == np.float32
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_g):
        assert got.shape == want.shape
        assert refattn.rel_err(got, want) <= 1e-5, name
    assert_dsinks_close(grads[3], ref_g[3], dsinks_scale(sinks, ref_lse, do, ref_out))
    empty = np.isinf(plain_lse)  # rows that see no key: out 0, lse = the head's sink
    if empty.any():
        assert np.all(out[empty.transpose(0, 2, 1)] == 0)
        assert np.array_equal(lse[empty], np.broadcast_to(sinks[None, :, None], lse.shape)[empty])


def test_sinks_f16(rng):
    """fp16 with sinks: CONVENTIONS.md's rule against the naive algorithm in fp16 (the sink's term in fp32, as
    given)."""
    b, nq, nk, h, hkv, d = 2, 40, 56, 4, 2, 64
    q, k, v, do = make_inputs(rng, (b, nq, h, d), (b, nk, hkv, d), np.float16)
    sinks = make_sinks(rng, h)
    out, lse = flashc.attention(q, k, v, causal=True, sinks=sinks)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, causal=True, sinks=sinks)
    low_out, _, low_g = refattn.attention(q, k, v, do, causal=True, sinks=sinks, rnd=refattn.rounder(np.float16))
    refattn.check_lowp("out", out, ref_out, low_out, 2)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    grads = flashc.attention_backward(do, q, k, v, out, lse, causal=True, sinks=sinks)
    for name, got, want, low in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        refattn.check_lowp(name, got, want, low, 3)
    # dsinks = -sum_{b,i} P_sink D_i with D_i = rowsum(dO_i o O_i) over the stored fp16 out (as flash-attn forms D):
    # (1) the same formula in fp64 on flashc's own out and lse, which leaves only fp32 accumulation, so fp32's bound
    # relative to the absolute sum of the terms (dsinks_scale; an rtol on the cancelled sum is not); (2) against the
    # reference within 3x the naive fp16 error plus one rounding of out per term (u sum |P_sink dO O|): a sum of
    # B Nq terms whose naive error can cancel below flashc's (seen: 0.00138 against 3 x 0.000383)
    o64, do64 = out.astype(np.float64), do.astype(np.float64)
    psink = np.exp(np.asarray(sinks, np.float64)[None, :, None] - np.asarray(lse, np.float64))  # (B, H, Nq)
    own = -(psink * (do64 * o64).sum(-1).transpose(0, 2, 1)).sum(axis=(0, 2))
    assert_dsinks_close(grads[3], own, dsinks_scale(sinks, lse, do64, o64), "dsinks against its formula")
    extra = 2.0 ** -11 * (psink * np.abs(do64 * ref_out).sum(-1).transpose(0, 2, 1)).sum(axis=(0, 2))
    err, base = np.abs(grads[3] - ref_g[3]), np.abs(low_g[3] - ref_g[3]).max()
    assert np.all(err <= 3 * base + extra + 1e-5), ("dsinks", err, base, extra)


def poison_unused(k, v, used, cu_k=None):
    """NaN in every key / value row past a sequence's used ones (the library must never read them)."""
    k, v = k.copy(), v.copy()
    for b, u in enumerate(used):
        rows = slice(cu_k[b] + u, cu_k[b + 1]) if cu_k is not None else (b, slice(u, None))
        k[rows] = np.nan
        v[rows] = np.nan
    return k, v


SEQUSED_OPTS = [dict(), dict(causal=True), dict(window_size=(6, 2), softcap=3.0),
                dict(alibi_slopes=np.array([0.5, 0.3, 0.2, 0.1], np.float32), causal=True)]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("opts", SEQUSED_OPTS, ids=["plain", "causal", "window_softcap", "alibi_causal"])
def test_seqused_k_fixed_length(opts, with_sinks, rng):
    """Batch b uses its first seqused_k[b] keys: the result equals the reference run on those keys alone (so causal,
    window and ALiBi align to the used length), NaN in the unused rows never shows, and their dk, dv are 0."""
    b, nq, nk, h, hkv, d = 4, 20, 37, 4, 2, 32
    used = np.array([37, 20, 0, 9], np.int32)  # all keys, as many as queries, none, fewer than the queries
    q, k, v, do = make_inputs(rng, (b, nq, h, d), (b, nk, hkv, d), np.float32)
    k, v = poison_unused(k, v, used)
    sinks = make_sinks(rng, h) if with_sinks else None
    out, lse = flashc.attention(q, k, v, seqused_k=used, sinks=sinks, **opts)
    assert np.all(np.isfinite(out))
    grads = flashc.attention_backward(do, q, k, v, out, lse, seqused_k=used, sinks=sinks, **opts)
    dsinks_ref, dsinks_abs = np.zeros(h), np.zeros(h)
    for i, u in enumerate(used):
        ref_out, ref_lse, ref_g = refattn.attention(q[i:i + 1], k[i:i + 1, :u], v[i:i + 1, :u], do[i:i + 1],
                                                    sinks=sinks, **opts)
        assert refattn.rel_err(out[i], ref_out[0]) <= 1e-5, i
        assert np.array_equal(np.isinf(lse[i]), np.isinf(ref_lse[0]))
        fin = np.isfinite(ref_lse[0])
        np.testing.assert_allclose(lse[i][fin], ref_lse[0][fin], rtol=1e-5, atol=1e-5)
        assert refattn.rel_err(grads[0][i], ref_g[0][0]) <= 1e-5, ("dq", i)
        for name, got, want in (("dk", grads[1], ref_g[1]), ("dv", grads[2], ref_g[2])):
            assert refattn.rel_err(got[i, :u], want[0]) <= 1e-5, (name, i)
            assert np.all(got[i, u:] == 0), "%s of batch %d past its %d used keys must be exactly 0" % (name, i, u)
        if with_sinks:
            dsinks_ref += ref_g[3]
            dsinks_abs += dsinks_scale(sinks, ref_lse, do[i:i + 1], ref_out)
    if with_sinks:
        assert_dsinks_close(grads[3], dsinks_ref, dsinks_abs)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_seqused_k_varlen(with_sinks, rng):
    """Varlen with seqused_k: the same as packing only the used keys of each sequence."""
    lens_q = [5, 0, 17, 33, 1, 12]
    lens_k = [9, 4, 17, 20, 0, 30]
    used = np.array([9, 2, 0, 11, 0, 30], np.int32)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    cu_used = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    h, hkv, d = 4, 2, 32
    q, k, v, do = make_inputs(rng, (cq[-1], h, d), (ck[-1], hkv, d), np.float32)
    k, v = poison_unused(k, v, used, ck)
    kept = np.concatenate([np.arange(ck[i], ck[i] + u) for i, u in enumerate(used)])
    sinks = make_sinks(rng, h) if with_sinks else None
    for opts in SEQUSED_OPTS:
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, seqused_k=used, sinks=sinks, **opts)
        out, lse = flashc.attention(q, k, v, **kw)
        assert np.all(np.isfinite(out))
        ref_out, ref_lse, ref_g = refattn.attention(q, k[kept], v[kept], do, cu_seqlens_q=cq, cu_seqlens_k=cu_used,
                                                    sinks=sinks, **opts)
        assert refattn.rel_err(out, ref_out) <= 1e-5, opts
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
        grads = flashc.attention_backward(do, q, k, v, out, lse, **kw)
        assert refattn.rel_err(grads[0], ref_g[0]) <= 1e-5, ("dq", opts)
        unused = np.setdiff1d(np.arange(ck[-1]), kept)
        for name, got, want in (("dk", grads[1], ref_g[1]), ("dv", grads[2], ref_g[2])):
            assert refattn.rel_err(got[kept], want) <= 1e-5, (name, opts)
            assert np.all(got[unused] == 0), name
        if with_sinks:
            assert_dsinks_close(grads[3], ref_g[3], dsinks_scale(sinks, ref_lse, do, ref_out, varlen=True),
                                ("dsinks", opts))


def test_sinks_without_keys(rng):
    """No keys at all (answered without the library): out 0, lse the heads' sinks, zero gradients."""
    q, k, v, do = make_inputs(rng, (2, 5, 3, 16), (2, 0, 3, 16), np.float32, n_outliers=0)
    sinks = np.array([0.5, -1.0, 2.0], np.float32)
    out, lse = flashc.attention(q, k, v, sinks=sinks)
    assert np.all(out == 0) and np.array_equal(lse, np.broadcast_to(sinks[None, :, None], (2, 3, 5)))
    dq, dk, dv, dsinks = flashc.attention_backward(do, q, k, v, out, lse, sinks=sinks)
    assert np.all(dq == 0) and dk.shape == k.shape and np.all(dsinks == 0)
    cu = np.array([0, 5], np.int32)
    out, lse = flashc.attention(q[0], k[0], v[0], sinks=sinks, cu_seqlens_q=cu,
                                cu_seqlens_k=np.array([0, 0], np.int32))
    assert np.array_equal(lse, np.broadcast_to(sinks[:, None], (3, 5)))


def test_seqused_k_and_sinks_errors(monkeypatch):
    """Shapes and dtypes are checked in Python before any library call; values the library refuses come back as
    its INVALID_ARGUMENT with its message."""
    q, k, v = _qkv()  # (1, 8, 4, 32)
    cu = np.array([0, 3, 8], np.int32)

    def no_call(*args):
        raise AssertionError("the library was called")

    with monkeypatch.context() as m:
        m.setattr(_core, "forward_status", no_call)
        with pytest.raises(ValueError, match=r"sinks must be 1-d .*\(H,\) = \(4,\), got shape \(3,\)"):
            flashc.attention(q, k, v, sinks=np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="sinks"):
            flashc.attention(q, k, v, sinks=np.zeros((1, 4), np.float32))
        with pytest.raises(ValueError, match="sinks"):
            flashc.attention(q, k, v, sinks=0.5)
        with pytest.raises(ValueError, match=r"seqused_k must be 1-d .*\(B,\) = \(1,\), got shape \(2,\)"):
            flashc.attention(q, k, v, seqused_k=np.array([8, 8], np.int32))
        with pytest.raises(ValueError, match=r"seqused_k .*\(num_seqs,\) = \(2,\)"):
            flashc.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=np.array([3], np.int32))
        with pytest.raises(TypeError, match="seqused_k must be an integer"):
            flashc.attention(q, k, v, seqused_k=np.array([4.0]))
        with pytest.raises(ValueError, match="int32"):
            flashc.attention(q, k, v, seqused_k=np.array([2**32 + 3], np.int64))
    with pytest.raises(ValueError, match="sinks"):
        flashc.attention_backward(q, q, k, v, q, np.zeros((1, 4, 8), np.float32), sinks=np.zeros(5, np.float32))
    for bad in ([9], [-1]):
        with pytest.raises(flashc.FlashcError, match="seqused_k") as e:
            flashc.attention(q, k, v, seqused_k=np.array(bad, np.int32))
        assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    with pytest.raises(flashc.FlashcError, match=r"seqused_k\[1\] is 6") as e:
        flashc.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=np.array([3, 6], np.int32))
    with pytest.raises(flashc.FlashcError, match="sinks must be finite") as e:
        flashc.attention(q, k, v, sinks=np.array([0, np.inf, 0, 0], np.float32))
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"


def test_new_fields_need_a_library_that_has_them(monkeypatch):
    """Against a libflashc older than 0.3 (no flashc_params.sinks / seqused_k) the options are refused, never
    silently dropped (a ctypes attribute that is not a field would be)."""
    q, k, v = _qkv()
    monkeypatch.setattr(_core, "_FIELDS", _core._FIELDS - {"seqused_k", "sinks", "dsinks"})
    with pytest.raises(NotImplementedError, match="sinks needs libflashc 0.3"):
        flashc.attention(q, k, v, sinks=np.zeros(4, np.float32))
    with pytest.raises(NotImplementedError, match="seqused_k needs libflashc 0.3"):
        flashc.attention(q, k, v, seqused_k=np.array([3], np.int32))


def test_reference_sinks_gradient_by_finite_differences(rng):
    """The oracle's sinks (and its q, k, v gradients with a sink) against central differences of its own forward."""
    q, k, v, do = (a.astype(np.float64) for a in make_inputs(rng, (2, 6, 4, 8), (2, 7, 2, 8), np.float64))
    sinks = rng.standard_normal(4)
    opts = dict(softcap=1.5, window_size=(3, 1), causal=True)
    _, _, grads = refattn.attention(q, k, v, do, sinks=sinks, **opts)
    eps = 1e-6
    args = [q, k, v, sinks]
    for which, g in enumerate(grads):
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            plus, minus = args[which].copy(), args[which].copy()
            plus[idx] += eps
            minus[idx] -= eps

            def loss(x):
                a = [x if i == which else t for i, t in enumerate(args)]
                return (refattn.attention(*a[:3], sinks=a[3], **opts)[0] * do).sum()

            num[idx] = (loss(plus) - loss(minus)) / (2 * eps)
        assert np.abs(num - g).max() <= 1e-6 * max(1.0, np.abs(g).max()), "q k v sinks".split()[which]


# ---- positions (flashc_params 0.6) ----------------------------------------------------------------------------------
POSITION_CASES = [
    # (name, B, Nq, Nk, H, Hkv, options, (q_position, k_position))
    ("alibi_keys_after", 2, 30, 45, 4, 2, dict(alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05], np.float32)), (0, 50)),
    ("alibi_bh_keys_before", 2, 40, 25, 2, 2, dict(alibi_slopes=np.array([[0.3, 0.1], [0.7, 0.05]], np.float32)),
     (400, 350)),
    ("causal_rows_without_keys", 1, 40, 30, 2, 1, dict(causal=True), (5, 20)),
    ("window_negative", 2, 33, 47, 2, 2, dict(window_size=(10, 3), softcap=3.0), (-30, -60)),
    ("causal_window_gqa", 2, 48, 48, 6, 2, dict(causal=True, window_size=(12, -1)), (100, 70)),
]


@pytest.mark.parametrize("case", POSITION_CASES, ids=[c[0] for c in POSITION_CASES])
def test_positions_forward_backward(case, rng):
    """positions=(q_position, k_position): the band and ALiBi measured between q_position + i and k_position + j,
    against refattn with the same positions (rows that see no key included); bottom-right alignment written as
    positions (q_position - k_position = Nk - Nq) is the call without them, bit for bit."""
    from flashc import _numpy

    _, b, nq, nk, h, hkv, opts, positions = case
    q, k, v, do = make_inputs(rng, (b, nq, h, 32), (b, nk, hkv, 32), np.float32)
    out, lse = _numpy.attention(q, k, v, positions=positions, **opts)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, positions=positions, **opts)
    plain, _, _ = refattn.attention(q, k, v, do, **opts)
    assert refattn.rel_err(out, ref_out) <= 1e-5
    assert refattn.rel_err(ref_out, plain) > 1e-2, "the positions change the result: the comparison is not vacuous"
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    grads = _numpy.attention_backward(do, q, k, v, out, lse, positions=positions, **opts)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_g):
        assert refattn.rel_err(got, want) <= 1e-5, name
    base_out, base_lse = _numpy.attention(q, k, v, **opts)
    same_out, same_lse = _numpy.attention(q, k, v, positions=(7 + nk - nq, 7), **opts)
    assert np.array_equal(base_out, same_out) and np.array_equal(base_lse, same_lse)


def test_positions_varlen_seqused_k(rng):
    """Every varlen sequence sits at the same positions; seqused_k limits the keys but does not move them."""
    from flashc import _numpy

    lens_q, lens_k = [7, 0, 20, 13], [15, 9, 25, 30]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v, do = make_inputs(rng, (cq[-1], 4, 32), (ck[-1], 2, 32), np.float32)
    slopes = np.array([0.4, 0.2, 0.1, 0.05], np.float32)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, alibi_slopes=slopes, positions=(12, 0))
    out, lse = _numpy.attention(q, k, v, **kw)
    ref_out, ref_lse, ref_g = refattn.attention(q, k, v, do, **kw)
    assert refattn.rel_err(out, ref_out) <= 1e-5
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    grads = _numpy.attention_backward(do, q, k, v, out, lse, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_g):
        assert refattn.rel_err(got, want) <= 1e-5, name
    # seqused_k: batch b's first used[b] keys, at the same positions (the reference slices the keys)
    qb, kb, vb, dob = make_inputs(rng, (3, 16, 2, 32), (3, 24, 2, 32), np.float32)
    used = np.array([10, 0, 24], np.int32)
    out, lse = _numpy.attention(qb, kb, vb, seqused_k=used, causal=True, positions=(20, 8))
    for i, u in enumerate(used):
        if u == 0:
            assert np.all(out[i] == 0) and np.all(np.isinf(lse[i]))
            continue
        ref_out, ref_lse, _ = refattn.attention(qb[i:i + 1], kb[i:i + 1, :u], vb[i:i + 1, :u], causal=True,
                                                positions=(20, 8))
        assert refattn.rel_err(out[i:i + 1], ref_out) <= 1e-5, i


def test_positions_errors_and_older_library(monkeypatch):
    from flashc import _numpy

    q, k, v = _qkv()
    with pytest.raises(flashc.FlashcError, match="2\\^40") as e:
        _numpy.attention(q, k, v, positions=(0, -2**40))
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    with pytest.raises(ValueError, match="pair of ints"):
        _numpy.attention(q, k, v, positions=(1, 2, 3))
    monkeypatch.setattr(_core, "_FIELDS", _core._FIELDS - {"positions", "q_position", "k_position"})
    with pytest.raises(NotImplementedError, match="needs libflashc 0.6"):
        _numpy.attention(q, k, v, positions=(3, 0))
