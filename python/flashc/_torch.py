"""torch front end: CPU and CUDA tensors, autograd, and the calls behind the flash-attn and SDPA entry points.

Tensors go to the library as they are: (B, N, H, D) views with torch's element strides, packed qkv / kv as
strided slices, SDPA's (B, H, N, D) as permuted strides. Only when the library refuses a layout (e.g. the CUDA
backend needs stride 1 on the last dimension) are the inputs copied to contiguous tensors, with a FlashcCopyWarning
that carries the library's reason. On CUDA every call runs on torch's current stream of the tensors' device, with
its workspace from torch's caching allocator.
"""

import contextlib
import ctypes
import warnings

import torch

from . import _core, _lib

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.float16: _lib.DTYPE_F16, torch.bfloat16: _lib.DTYPE_BF16}


# ---- tensors, devices, contexts -------------------------------------------------------------------------------
def _check(name, t, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError("flashc: %s must be a torch.Tensor, got %s" % (name, type(t).__name__))
    if t.dtype not in _DTYPES:
        raise TypeError(
            "flashc: %s has dtype %s; flashc computes on float32, float16 and bfloat16 tensors "
            "(cast with %s.float(), .half() or .bfloat16())" % (name, t.dtype, name))
    if device is not None and t.device != device:
        raise ValueError("flashc: %s is on %s but q is on %s; all tensors must be on one device"
                         % (name, t.device, device))


def _view(t):
    return _lib.make_tensor(t.data_ptr(), _DTYPES[t.dtype], t.shape, t.stride())


def _device_guard(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _context(device):
    if device.type == "cpu":
        return _lib.context(_lib.BACKEND_CPU, 0, torch.get_num_threads())
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ctx = _lib.context(_lib.BACKEND_CUDA, index)
        # The stream can change between calls (torch.cuda.stream(...) blocks), so follow it every time.
        ctx.set_stream(torch.cuda.current_stream(index).cuda_stream)
        return ctx
    raise ValueError("flashc runs on cpu and cuda tensors, not on %s" % device)


def _workspace(ctx, device, fn, views, params):
    """(tensor, ptr, bytes) of the workspace for a CUDA call, or a status when the query itself fails. On the
    CPU the library allocates its own scratch (NULL workspace)."""
    if device.type != "cuda":
        return None, None, 0, _lib.STATUS_OK
    n = ctypes.c_size_t(0)
    st = fn(ctx.handle, *views, params, ctypes.byref(n))
    if st != _lib.STATUS_OK or n.value == 0:
        return None, None, 0, st
    ws = torch.empty(n.value, dtype=torch.uint8, device=device)
    return ws, ws.data_ptr(), n.value, st


# ---- options -----------------------------------------------------------------------------------------------------
class _Options:
    """Attention options resolved against the problem: the tensors flashc_params points at live here, on the
    tensors' device, for as long as the forward's saved state (so the backward sees the same ones)."""

    def __init__(self, q4, k4, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, block_mask=None, block_size=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, deterministic=False, seqused_k=None, sinks=None):
        device = q4.device
        self.varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self.kw = dict(softmax_scale=softmax_scale, causal=bool(causal), window=_core.window_pair(window_size),
                       softcap=float(softcap or 0.0), deterministic=bool(deterministic))
        self.alibi = self.mask = self.cu_q = self.cu_k = self.used = self.sinks = None
        if self.varlen:
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ValueError("flashc: varlen needs both cu_seqlens_q and cu_seqlens_k")
            self.cu_q = _index_tensor("cu_seqlens_q", cu_seqlens_q, device)
            self.cu_k = _index_tensor("cu_seqlens_k", cu_seqlens_k, device)
            if self.cu_q.dim() != 1 or self.cu_k.shape != self.cu_q.shape or self.cu_q.numel() < 2:
                raise ValueError("flashc: cu_seqlens_q and cu_seqlens_k must be 1-d with the same length B + 1 >= 2,"
                                 " got %s and %s" % (tuple(self.cu_q.shape), tuple(self.cu_k.shape)))
            self.B = self.cu_q.numel() - 1
            # flash-attn callers always pass the maxima; computing them here costs a device sync on CUDA.
            self.Nq = int(max_seqlen_q) if max_seqlen_q is not None else int((self.cu_q[1:] - self.cu_q[:-1]).max())
            self.Nk = int(max_seqlen_k) if max_seqlen_k is not None else int((self.cu_k[1:] - self.cu_k[:-1]).max())
            self.kw.update(num_seqs=self.B, max_seqlen_q=self.Nq, max_seqlen_k=self.Nk)
        else:
            self.B, self.Nq, self.Nk = q4.shape[0], q4.shape[1], k4.shape[1]
        self.H = q4.shape[2]
        if alibi_slopes is not None:
            a = torch.as_tensor(alibi_slopes).to(device=device, dtype=torch.float32).contiguous()
            if tuple(a.shape) not in ((self.H,), (self.B, self.H)):
                raise ValueError("flashc: alibi_slopes must be (H,) = (%d,) or (B, H) = (%d, %d), got %s"
                                 % (self.H, self.B, self.H, tuple(a.shape)))
            self.alibi = a
            self.kw["alibi_batch_stride"] = 0 if a.dim() == 1 else self.H
        if block_mask is not None:
            bq, bk = _core.block_size_pair(block_size)
            m = torch.as_tensor(block_mask).to(device=device, dtype=torch.uint8).contiguous()
            _core.check_mask_shape(tuple(m.shape), bq, bk, self.Nq, self.Nk)
            self.mask = m
            self.kw.update(block_size=(bq, bk), block_mask_dims=_core.mask_dims(tuple(m.shape)))
        if seqused_k is not None:
            u = torch.as_tensor(seqused_k)
            _core.check_seqused_k_shape(u.shape, self.B, self.varlen)
            if u.device.type == "cpu" and u.dtype == torch.int64:
                _core.check_int32_range("seqused_k", u)
            self.used = _index_tensor("seqused_k", u, device)
        if sinks is not None:
            s = torch.as_tensor(sinks)
            _core.check_sinks_shape(s.shape, self.H)
            # the library reads fp32 (H,) where it computes; a tensor that already is one is used as it is
            self.sinks = s.detach().to(device=device, dtype=torch.float32).contiguous()

    def params(self, dsinks=None):
        """flashc_params pointing at this call's tensors; dsinks (fp32 (H,), backward only): where the library
        writes the sinks' gradient."""
        return _core.make_params(
            alibi_ptr=self.alibi.data_ptr() if self.alibi is not None else None,
            block_mask_ptr=self.mask.data_ptr() if self.mask is not None else None,
            cu_q_ptr=self.cu_q.data_ptr() if self.cu_q is not None else None,
            cu_k_ptr=self.cu_k.data_ptr() if self.cu_k is not None else None,
            seqused_k_ptr=self.used.data_ptr() if self.used is not None else None,
            sinks_ptr=self.sinks.data_ptr() if self.sinks is not None else None,
            dsinks_ptr=dsinks.data_ptr() if dsinks is not None else None,
            **self.kw)

    def lse_shape(self, q4):
        return (self.H, q4.shape[1]) if self.varlen else (q4.shape[0], self.H, q4.shape[1])

    def fill_empty_lse(self, lse):
        """lse of a problem whose rows see no key: +inf, or each head's sink (the library's rule)."""
        if self.sinks is None:
            lse.fill_(float("inf"))
        else:
            lse.copy_((self.sinks[:, None] if self.varlen else self.sinks[None, :, None]).expand(lse.shape))


def _index_tensor(name, t, device):
    t = torch.as_tensor(t)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError("flashc: %s must be an integer tensor (int32), got %s" % (name, t.dtype))
    return t.to(device=device, dtype=torch.int32).contiguous()


def _empty_problem(q4, k4):
    """No query rows, or no keys (every row sees nothing): answered without the library, which wants positive
    shapes."""
    return 0 in q4.shape[:3] or k4.shape[1] == 0


# ---- forward and backward on (B, N, H, D) views -----------------------------------------------------------------
def _forward(q4, k4, v4, opts):
    """out4 (B, Nq, H, D) contiguous and lse fp32 (B, H, Nq) or varlen (H, total_q)."""
    device = q4.device
    out4 = torch.empty(q4.shape, dtype=q4.dtype, device=device)
    lse = torch.empty(opts.lse_shape(q4), dtype=torch.float32, device=device)
    if _empty_problem(q4, k4):
        out4.zero_()
        opts.fill_empty_lse(lse)
        return out4, lse
    params = opts.params()
    lib = _lib.lib

    def call(ins):
        views = [_view(t) for t in ins]
        ws, wp, wn, st = _workspace(ctx, device, lib.flashc_forward_workspace_size, views, params)
        if st != _lib.STATUS_OK:
            return st
        st = _core.forward_status(ctx, *views, params, _view(out4), lse.data_ptr(), wp, wn)
        del ws  # stream-ordered: the caching allocator reuses it only after the kernels queued so far
        return st

    with _device_guard(device):
        ctx = _context(device)
        ins = (q4, k4, v4)
        st = call(ins)
        if st == _lib.STATUS_NOT_SUPPORTED and not all(t.is_contiguous() for t in ins):
            reason = _core.last_error(ctx)
            st = call([t.contiguous() for t in ins])
            if st == _lib.STATUS_OK:
                _warn_copy(reason)
        _lib.check(st, "flashc_forward", ctx.handle)
    return out4, lse


def _backward(dout4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4, dsinks=None):
    """Writes dq4, dk4, dv4 (any non-overlapping strided views), and dsinks (fp32 (H,), contiguous, on the
    tensors' device) when given."""
    device = q4.device
    if _empty_problem(q4, k4):
        # every output row is 0, so the sinks do not move the loss either
        for g in (dq4, dk4, dv4) + (() if dsinks is None else (dsinks,)):
            g.zero_()
        return
    params = opts.params(dsinks)
    lib = _lib.lib

    def call(ins, outs):
        iv = [_view(t) for t in ins]
        ov = [_view(t) for t in outs]
        ws, wp, wn, st = _workspace(ctx, device, lib.flashc_backward_workspace_size, iv[:3], params)
        if st != _lib.STATUS_OK:
            return st
        st = _core.backward_status(ctx, *iv, lse.data_ptr(), params, *ov, wp, wn)
        del ws
        return st

    with _device_guard(device):
        ctx = _context(device)
        ins = (q4, k4, v4, out4, dout4)
        outs = (dq4, dk4, dv4)
        st = call(ins, outs)
        if st == _lib.STATUS_NOT_SUPPORTED and not all(t.is_contiguous() for t in ins + outs):
            reason = _core.last_error(ctx)
            tmp = [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=device) for t in outs]
            st = call([t.contiguous() for t in ins], tmp)
            if st == _lib.STATUS_OK:
                for t, c in zip(outs, tmp):
                    if t is not c:
                        t.copy_(c)
                _warn_copy(reason)
        _lib.check(st, "flashc_backward", ctx.handle)


def _warn_copy(reason):
    warnings.warn("flashc: the library refused this tensor layout (%s); the inputs were copied to contiguous "
                  "tensors for this call" % reason, _core.FlashcCopyWarning, stacklevel=4)


# ---- autograd ------------------------------------------------------------------------------------------------------
class _Layout:
    """How the user's tensors hold q, k, v: 'q,k,v' separate, 'qkv' packed (.., 3, H, D), 'q,kv' with kv packed
    (.., 2, Hkv, D); varlen tensors have no batch dimension."""

    def __init__(self, kind, varlen):
        self.kind = kind
        self.varlen = varlen

    def unpack(self, inputs):
        if self.kind == "qkv":
            (qkv,) = inputs
            q, k, v = qkv.select(-3, 0), qkv.select(-3, 1), qkv.select(-3, 2)
        elif self.kind == "q,kv":
            q, kv = inputs
            k, v = kv.select(-3, 0), kv.select(-3, 1)
        else:
            q, k, v = inputs
        if self.varlen:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        return q, k, v

    def grads(self, inputs):
        """Gradient tensors in the inputs' shapes, and their (B, N, H, D) views dq4, dk4, dv4 for the library.
        Packed gradients get one block per q / k / v, laid out so the three views do not interleave in memory
        (the library refuses outputs whose address ranges overlap) and no concatenation is needed."""
        def packed(t, n):
            shape = t.shape[:-3] + t.shape[-2:]
            return torch.empty((n,) + tuple(shape), dtype=t.dtype, device=t.device).movedim(0, -3)

        if self.kind == "qkv":
            dqkv = packed(inputs[0], 3)
            grads = (dqkv,)
            dq, dk, dv = dqkv.select(-3, 0), dqkv.select(-3, 1), dqkv.select(-3, 2)
        elif self.kind == "q,kv":
            dq = torch.empty_like(inputs[0])
            dkv = packed(inputs[1], 2)
            grads = (dq, dkv)
            dk, dv = dkv.select(-3, 0), dkv.select(-3, 1)
        else:
            # empty_like keeps a dense input's strides, so a (B, H, N, D)-strided q gets a gradient laid out
            # the same way (no re-layout when it is accumulated into .grad).
            dq, dk, dv = (torch.empty_like(t) for t in inputs)
            grads = (dq, dk, dv)
        if self.varlen:
            dq, dk, dv = dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
        return grads, (dq, dk, dv)


class _AttentionFunction(torch.autograd.Function):
    """sinks: None, or the fp32 (H,) tensor on the inputs' device that opts.sinks views (the conversion from the
    caller's dtype and device happens before, in autograd, which casts the gradient back)."""

    @staticmethod
    def forward(ctx, opts, layout, sinks, *inputs):
        q4, k4, v4 = layout.unpack(inputs)
        out4, lse = _forward(q4, k4, v4, opts)
        out = out4[0] if layout.varlen else out4
        # sinks is saved so that an in-place change of it before the backward is caught by autograd
        ctx.save_for_backward(sinks, *inputs, out, lse)
        ctx.opts, ctx.layout = opts, layout
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        sinks, *inputs, out, lse = ctx.saved_tensors
        layout = ctx.layout
        q4, k4, v4 = layout.unpack(inputs)
        grads, (dq4, dk4, dv4) = layout.grads(inputs)
        if layout.varlen:
            out, dout = out.unsqueeze(0), dout.unsqueeze(0)
        if dout.dtype != out.dtype:
            dout = dout.to(out.dtype)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[2]:
            dsinks = torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)
        _backward(dout, q4, k4, v4, out, lse, ctx.opts, dq4, dk4, dv4, dsinks)
        return (None, None, dsinks) + grads


def apply(kind, inputs, varlen=False, dropout_p=0.0, sinks=None, **options):
    """(out, lse) with autograd for inputs laid out as `kind` (see _Layout), differentiable w.r.t. the inputs and
    sinks (a tensor of H logits); options go to _Options."""
    _core.check_dropout(dropout_p)
    names = {"q,k,v": ("q", "k", "v"), "qkv": ("qkv",), "q,kv": ("q", "kv")}[kind]
    device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else None
    for n, t in zip(names, inputs):
        _check(n, t, device)
    base = 3 if varlen else 4
    for n, t in zip(names, inputs):
        nd = base + (1 if n in ("qkv", "kv") else 0)
        if t.dim() != nd:
            layout = {"qkv": "(total, 3, H, D)" if varlen else "(B, N, 3, H, D)",
                      "kv": "(total, 2, Hkv, D)" if varlen else "(B, N, 2, Hkv, D)"}.get(
                n, "(total, H, D)" if varlen else "(B, N, H, D)")
            raise ValueError("flashc: %s must be %d-d %s, got shape %s" % (n, nd, layout, tuple(t.shape)))
        if n in ("qkv", "kv") and t.shape[-3] != (3 if n == "qkv" else 2):
            raise ValueError("flashc: %s's packed dimension (-3) must have size %d, got %s"
                             % (n, 3 if n == "qkv" else 2, tuple(t.shape)))
    layout = _Layout(kind, varlen)
    q4, k4, v4 = layout.unpack(inputs)
    s32 = None
    if sinks is not None:
        s32 = torch.as_tensor(sinks)
        _core.check_sinks_shape(s32.shape, q4.shape[2])
        # In autograd: a sinks tensor of another dtype or device gets its gradient back in its own.
        s32 = s32.to(device=q4.device, dtype=torch.float32).contiguous()
    opts = _Options(q4, k4, sinks=s32, **options)
    if torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or (s32 is not None and s32.requires_grad)):
        return _AttentionFunction.apply(opts, layout, s32, *inputs)
    # Nothing to differentiate (inference, torch.no_grad()): the same forward without an autograd node.
    out4, lse = _forward(q4, k4, v4, opts)
    return (out4[0] if varlen else out4), lse


def attention_backward(dout, q, k, v, out, softmax_lse, *, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                       sinks=None, **options):
    """dq, dk, dv for torch tensors without autograd (see flashc.attention_backward); with sinks also dsinks, in
    the sinks' dtype and on their device when they are a floating-point tensor (else fp32 on q's device)."""
    _core.check_dropout(dropout_p)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    device = q.device
    for n, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        _check(n, t, device)
        if t.dim() != (3 if varlen else 4):
            raise ValueError("flashc: %s must be %s, got shape %s"
                             % (n, "(total, H, D)" if varlen else "(B, N, H, D)", tuple(t.shape)))
    layout = _Layout("q,k,v", varlen)
    q4, k4, v4 = layout.unpack((q, k, v))
    out4, do4 = (out.unsqueeze(0), dout.unsqueeze(0)) if varlen else (out, dout)
    opts = _Options(q4, k4, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks, **options)
    lse = softmax_lse
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != opts.lse_shape(q4):
        raise ValueError("flashc: softmax_lse must be a tensor of shape %s (from the forward)" % (opts.lse_shape(q4),))
    lse = lse.to(device=device, dtype=torch.float32).contiguous()
    grads, (dq4, dk4, dv4) = layout.grads((q, k, v))
    dsinks = None if sinks is None else torch.empty(opts.H, dtype=torch.float32, device=device)
    _backward(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4, dsinks)
    if dsinks is None:
        return grads
    if isinstance(sinks, torch.Tensor) and sinks.is_floating_point():
        dsinks = dsinks.to(device=sinks.device, dtype=sinks.dtype)
    return grads + (dsinks,)


# ---- torch.nn.functional.scaled_dot_product_attention's interface --------------------------------------------------
def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise NotImplementedError(
            "flashc.scaled_dot_product_attention: attn_mask is not supported (flashc has causal, sliding-window, "
            "ALiBi and block-sparse masks, not arbitrary dense ones); pass is_causal=True for a causal mask or use "
            "flashc.attention(..., block_mask=...)")
    _core.check_dropout(dropout_p)
    for n, t in (("query", query), ("key", key), ("value", value)):
        _check(n, t, query.device if isinstance(query, torch.Tensor) else None)
        if t.dim() < 3:
            raise ValueError("flashc.scaled_dot_product_attention: %s must be (..., H, N, D) with at least 3 "
                             "dimensions, got shape %s" % (n, tuple(t.shape)))
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError("flashc.scaled_dot_product_attention: query, key and value must have the same number of "
                         "dimensions")
    lead = query.shape[:-3]

    def bnhd(t):
        # (..., H, N, D) -> (B, N, H, D): a transposed view; reshape copies only if the leading dims cannot merge.
        t4 = t.unsqueeze(0) if t.dim() == 3 else t.reshape((-1,) + tuple(t.shape[-3:]))
        return t4.transpose(1, 2)

    q4, k4, v4 = bnhd(query), bnhd(key), bnhd(value)
    H, Hkv = q4.shape[2], k4.shape[2]
    if H != Hkv and not enable_gqa:
        raise ValueError("flashc.scaled_dot_product_attention: query has %d heads and key/value %d; pass "
                         "enable_gqa=True for grouped-query attention" % (H, Hkv))
    nq, nk = q4.shape[1], k4.shape[1]
    kw = dict(softmax_scale=scale)
    if is_causal:
        # torch's is_causal is top-left aligned (query i sees keys j <= i); flashc's causal is bottom-right
        # (j <= i + Nk - Nq). Equal when Nq == Nk. With Nq < Nk no query sees a key past Nq - 1, so keys beyond
        # it are dropped (a view) and the square problem is causal. With Nq > Nk, window_right = Nq - Nk turns
        # j <= i + Nk - Nq + right into j <= i.
        if nq < nk:
            k4, v4 = k4[:, :nq], v4[:, :nq]
            kw["causal"] = True
        elif nq > nk:
            kw["window_size"] = (-1, nq - nk)
        else:
            kw["causal"] = True
    out4, _ = apply("q,k,v", (q4, k4, v4), **kw)
    out = out4.transpose(1, 2)  # (B, H, Nq, D) view
    return out[0] if query.dim() == 3 else out.reshape(tuple(lead) + tuple(out.shape[1:]))
