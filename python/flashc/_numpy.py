"""numpy front end: attention and attention_backward on host arrays (CPU backend).

Layout (B, N, H, D), or packed varlen (total, H, D) when cu_seqlens_q/cu_seqlens_k are given. Any strides that
are whole elements are passed to the library as they are (no copy); float32 and float16 only (numpy has no
bfloat16: use torch tensors for bf16).
"""

import numpy as np

from . import _core, _lib

_DTYPES = {np.dtype(np.float32): _lib.DTYPE_F32, np.dtype(np.float16): _lib.DTYPE_F16}


def _dtype(name, a):
    try:
        return _DTYPES[a.dtype]
    except KeyError:
        raise TypeError(
            "flashc: %s has dtype %s; the library computes on float32 and float16 arrays (bfloat16 through torch). "
            "Convert with %s.astype(np.float32)." % (name, a.dtype, name)) from None


def _array(name, a, ndim):
    if not isinstance(a, np.ndarray):
        raise TypeError("flashc: %s must be a numpy array (or a torch tensor), got %s" % (name, type(a).__name__))
    if a.ndim != ndim:
        layout = "(total, H, D) with cu_seqlens" if ndim == 3 else "(B, N, H, D)"
        raise ValueError("flashc: %s must be %d-d %s, got shape %s" % (name, ndim, layout, a.shape))
    return a


def _view(a):
    """flashc_tensor for a 4-d array; strides that are not whole elements (rare) need a copy first."""
    dtype = _DTYPES[a.dtype]
    item = a.itemsize
    if any(s % item for s in a.strides):
        a = np.ascontiguousarray(a)
    return _lib.make_tensor(a.ctypes.data, dtype, a.shape, [s // item for s in a.strides]), a


class _Options:
    """Everything besides the tensors, converted once into what flashc_params points at (kept alive here)."""

    def __init__(self, q4, k4, softmax_scale, causal, window_size, softcap, alibi_slopes, block_mask, block_size,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, deterministic=False,
                 seqused_k=None, sinks=None, dsinks=None, positions=None):
        if _core.check_dropout(dropout_p):
            # no generator to draw a seed from (torch's is what controls flashc's dropout) and no autograd to carry it
            # to the backward: dropout runs on torch tensors
            raise NotImplementedError(
                "flashc: dropout (dropout_p > 0) runs on torch tensors (seeded from torch's generator, the mask "
                "replayed by autograd's backward), not on numpy arrays")
        self.varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self.keep = []
        kw = dict(softmax_scale=softmax_scale, causal=causal, window=_core.window_pair(window_size),
                  softcap=softcap, deterministic=deterministic, positions=positions)
        if self.varlen:
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ValueError("flashc: varlen needs both cu_seqlens_q and cu_seqlens_k")
            cq = np.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
            ck = np.ascontiguousarray(cu_seqlens_k, dtype=np.int32)
            if cq.ndim != 1 or ck.shape != cq.shape or cq.size < 2:
                raise ValueError("flashc: cu_seqlens_q and cu_seqlens_k must be 1-d with the same length B + 1 >= 2, "
                                 "got %s and %s" % (cq.shape, ck.shape))
            self.keep += [cq, ck]
            self.num_seqs = cq.size - 1
            # The host has the offsets, so the maxima are cheap to compute when the caller leaves them out.
            self.max_q = int(max_seqlen_q) if max_seqlen_q is not None else int(np.diff(cq).max())
            self.max_k = int(max_seqlen_k) if max_seqlen_k is not None else int(np.diff(ck).max())
            kw.update(cu_q_ptr=cq.ctypes.data, cu_k_ptr=ck.ctypes.data, num_seqs=self.num_seqs,
                      max_seqlen_q=self.max_q, max_seqlen_k=self.max_k)
            self.B, self.Nq, self.Nk = self.num_seqs, self.max_q, self.max_k
        else:
            self.B, self.Nq, self.Nk = q4.shape[0], q4.shape[1], k4.shape[1]
        self.H = q4.shape[2]
        if alibi_slopes is not None:
            a = np.ascontiguousarray(alibi_slopes, dtype=np.float32)
            if a.shape not in ((self.H,), (self.B, self.H)):
                raise ValueError("flashc: alibi_slopes must be (H,) = (%d,) or (B, H) = (%d, %d), got %s"
                                 % (self.H, self.B, self.H, a.shape))
            self.keep.append(a)
            kw.update(alibi_ptr=a.ctypes.data, alibi_batch_stride=0 if a.ndim == 1 else self.H)
        if block_mask is not None:
            bq, bk = _core.block_size_pair(block_size)
            m = np.ascontiguousarray(block_mask).astype(np.uint8, copy=False)
            _core.check_mask_shape(m.shape, bq, bk, self.Nq, self.Nk)
            self.keep.append(m)
            kw.update(block_mask_ptr=m.ctypes.data, block_size=(bq, bk), block_mask_dims=_core.mask_dims(m.shape))
        if seqused_k is not None:
            u = np.asarray(seqused_k)
            if u.dtype.kind not in "iu":
                raise TypeError("flashc: seqused_k must be an integer array (int32), got %s" % u.dtype)
            _core.check_seqused_k_shape(u.shape, self.B, self.varlen)
            _core.check_int32_range("seqused_k", u)
            u = np.ascontiguousarray(u, dtype=np.int32)
            self.keep.append(u)
            kw.update(seqused_k_ptr=u.ctypes.data)
        self.sinks = None
        if sinks is not None:
            s = np.asarray(sinks)
            _core.check_sinks_shape(s.shape, self.H)
            self.sinks = s = np.ascontiguousarray(s, dtype=np.float32)
            kw.update(sinks_ptr=s.ctypes.data)
            if dsinks is not None:
                kw.update(dsinks_ptr=dsinks.ctypes.data)
        self.params = _core.make_params(**kw)

    def lse_shape(self, q4):
        return (self.H, q4.shape[1]) if self.varlen else (q4.shape[0], self.H, q4.shape[1])

    def empty_lse(self):
        """lse of rows that see no key, broadcastable to lse_shape: +inf, or each head's sink."""
        if self.sinks is None:
            return np.inf
        return self.sinks[:, None] if self.varlen else self.sinks[None, :, None]


def _as4(a, varlen):
    return a[None] if varlen else a


def _empty_problem(q4, k4):
    """True when the answer needs no library call: no query rows, or no keys (every row sees nothing)."""
    return 0 in q4.shape[:3] or k4.shape[1] == 0


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              block_mask=None, block_size=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, dropout_p=0.0, seqused_k=None, sinks=None, positions=None):
    """out, softmax_lse = attention(q, k, v, ...) on numpy arrays (see flashc.attention). positions: None, or
    (q_position, k_position) (flashc_params.positions: query row i at q_position + i, key j at k_position + j, causal,
    windows and ALiBi measured between them)."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    nd = 3 if varlen else 4
    q, k, v = (_array(n, a, nd) for n, a in (("q", q), ("k", k), ("v", v)))
    for n, a in (("q", q), ("k", k), ("v", v)):
        _dtype(n, a)
    q4, k4, v4 = _as4(q, varlen), _as4(k, varlen), _as4(v, varlen)
    opts = _Options(q4, k4, softmax_scale, causal, window_size, softcap, alibi_slopes, block_mask, block_size,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seqused_k=seqused_k,
                    sinks=sinks, positions=positions)
    out4 = np.empty(q4.shape, dtype=q.dtype)
    lse = np.empty(opts.lse_shape(q4), dtype=np.float32)
    if _empty_problem(q4, k4):
        out4.fill(0)
        lse[...] = opts.empty_lse()
    else:
        ctx = _lib.context(_lib.BACKEND_CPU, 0)
        tq, q4 = _view(q4)
        tk, k4 = _view(k4)
        tv, v4 = _view(v4)
        to, _ = _view(out4)
        _lib.check(_core.forward_status(ctx, tq, tk, tv, opts.params, to, lse.ctypes.data), "flashc_forward",
                   ctx.handle)
    return (out4[0] if varlen else out4), lse


def attention_backward(dout, q, k, v, out, softmax_lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, block_mask=None, block_size=None, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                       deterministic=False, seqused_k=None, sinks=None, positions=None):
    """dq, dk, dv = attention_backward(dout, q, k, v, out, softmax_lse, ...): the gradients of attention() for
    the upstream gradient dout, given attention()'s out and softmax_lse and the same options. With sinks it
    returns dq, dk, dv, dsinks (fp32, (H,))."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    nd = 3 if varlen else 4
    arrs = [_array(n, a, nd) for n, a in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))]
    for n, a in zip(("dout", "q", "k", "v", "out"), arrs):
        _dtype(n, a)
    do4, q4, k4, v4, o4 = (_as4(a, varlen) for a in arrs)
    dsinks = None if sinks is None else np.zeros(q4.shape[2], dtype=np.float32)
    opts = _Options(q4, k4, softmax_scale, causal, window_size, softcap, alibi_slopes, block_mask, block_size,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, deterministic,
                    seqused_k=seqused_k, sinks=sinks, dsinks=dsinks, positions=positions)
    lse = np.ascontiguousarray(softmax_lse, dtype=np.float32)
    if lse.shape != opts.lse_shape(q4):
        raise ValueError("flashc: softmax_lse must have shape %s (from the forward), got %s"
                         % (opts.lse_shape(q4), lse.shape))
    dq4 = np.empty(q4.shape, dtype=q.dtype)
    dk4 = np.empty(k4.shape, dtype=q.dtype)
    dv4 = np.empty(v4.shape, dtype=q.dtype)
    if _empty_problem(q4, k4):
        # dsinks stays 0 too: every row's output is 0, so the sinks do not move the loss
        for g in (dq4, dk4, dv4):
            g.fill(0)
    else:
        ctx = _lib.context(_lib.BACKEND_CPU, 0)
        views = []
        for a in (q4, k4, v4, o4, do4, dq4, dk4, dv4):
            t, a = _view(a)
            views.append((t, a))  # keeps any copy alive until the call returns
        tq, tk, tv, to, tdo, tdq, tdk, tdv = (t for t, _ in views)
        _lib.check(_core.backward_status(ctx, tq, tk, tv, to, tdo, lse.ctypes.data, opts.params, tdq, tdk, tdv),
                   "flashc_backward", ctx.handle)
    grads = (dq4[0], dk4[0], dv4[0]) if varlen else (dq4, dk4, dv4)
    return grads if dsinks is None else grads + (dsinks,)


def _merged_lse(la, lb):
    """The merged lse by flashc_merge's rule, for shapes the library is not called on (a head dim of 0): an infinite
    lse is an empty part; both empty give +inf."""
    ea, eb = np.isinf(la), np.isinf(lb)
    with np.errstate(invalid="ignore"):
        m = np.logaddexp(np.where(ea, -np.inf, la), np.where(eb, -np.inf, lb))
    return np.where(ea & eb, np.inf, m).astype(np.float32)


def merge(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """out, lse = merge(...) on numpy arrays (see flashc.merge_attention)."""
    for n, a in (("out_a", out_a), ("out_b", out_b)) + ((("out", out),) if out is not None else ()):
        if not isinstance(a, np.ndarray):
            raise TypeError("flashc: %s must be a numpy array (or a torch tensor), got %s" % (n, type(a).__name__))
        _dtype(n, a)
    if out_b.dtype != out_a.dtype or (out is not None and out.dtype != out_a.dtype):
        raise TypeError("flashc: out_a, out_b%s must share one dtype, got %s" % (
            " and out" if out is not None else "",
            ", ".join(str(a.dtype) for a in (out_a, out_b, out) if a is not None)))
    la, lb = np.asarray(lse_a), np.asarray(lse_b)
    want = _core.check_merge_shapes(out_a.shape, la.shape, out_b.shape, lb.shape,
                                    None if out is None else out.shape, None if lse is None else np.shape(lse))
    # lse inputs as fp32 contiguous: the same arrays when they are already (so that lse=lse_a stays in place)
    la, lb = np.ascontiguousarray(la, dtype=np.float32), np.ascontiguousarray(lb, dtype=np.float32)
    if out is None:
        out = np.empty(out_a.shape, dtype=out_a.dtype)
    elif any(s % out.itemsize for s in out.strides):
        raise ValueError("flashc: out's strides %s are not whole elements" % (out.strides,))
    if lse is None:
        lse = np.empty(want, dtype=np.float32)
    elif not (isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.flags.c_contiguous):
        raise ValueError("flashc: lse (the merged lse output) must be a C-contiguous float32 array")
    if 0 in out.shape:
        if out.shape[-1] == 0 and lse.size:
            lse[...] = _merged_lse(la, lb)
        return out, lse
    varlen = out.ndim == 3
    ta, a4 = _view(_as4(out_a, varlen))
    tb, b4 = _view(_as4(out_b, varlen))
    to, _ = _view(_as4(out, varlen))
    ctx = _lib.context(_lib.BACKEND_CPU, 0)
    _lib.check(_core.merge_status(ctx, ta, la.ctypes.data, tb, lb.ctypes.data, to, lse.ctypes.data), "flashc_merge",
               ctx.handle)
    return out, lse
