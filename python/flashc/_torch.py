"""torch front end: CPU and CUDA tensors, autograd, and the calls behind the flash-attn and SDPA entry points.

Tensors go to the library as they are: (B, N, H, D) views with torch's element strides, packed qkv / kv as
strided slices, SDPA's (B, H, N, D) as permuted strides. Only when the library refuses a layout (e.g. the CUDA
backend needs stride 1 on the last dimension) are the inputs copied to contiguous tensors, with a FlashcCopyWarning
that carries the library's reason. On CUDA every call runs on torch's current stream of the tensors' device, with
its workspace from torch's caching allocator.
"""

import contextlib
import ctypes
import numbers
import warnings

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

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


_NO_GUARD = contextlib.nullcontext()  # reusable: it holds no state


def _device_guard(device):
    return torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD


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


# ---- dropout's seed and offset --------------------------------------------------------------------------------------
# flashc's mask is Philox keyed by a 64-bit seed over the streams offset .. offset + B*H - 1 (README, src/dropout.h).
# flash-attn takes (seed, offset) from the CUDA generator's Philox state and advances its offset; torch's CPU generator
# (mt19937) has no such offset, and a counter kept here would be neither reset by torch.manual_seed nor saved by
# torch.get_rng_state. So each call with dropout draws both numbers from torch's default generator for the tensors'
# device, uniform over the full int64 range (taken mod 2**64): torch.manual_seed(s) replays the same masks, and each
# call gets a fresh key, so consecutive calls get fresh masks whatever B*H is (no offset bookkeeping across calls). The
# draw is an ordinary torch.randint, which torch.compile traces into the graph and AOT autograd keeps in the forward
# (under Inductor's own RNG lowering the numbers differ from eager, as for torch's own dropout, unless
# torch._inductor.config.fallback_random is set). The pair travels as an int64 tensor (2,) on the tensors' device, so
# that torch.ops.flashc can take it as an argument and save it for the backward, which reuses it and never reads the
# generator: the backward recomputes the forward's mask. The library reads the pair through its address
# (flashc_params.dropout_rng) and Python never reads it back: on CUDA the kernels load it from device memory when they
# run, so a call with dropout makes no host synchronization, and under CUDA-graph capture torch.randint is recorded
# with the kernels (torch's graph-safe generator state), so each replay draws a fresh pair and drops fresh elements.
# p == 0 draws nothing, so calls without dropout leave the generator as it was.
def dropout_rng(device):
    """A fresh (seed, offset) as an int64 tensor (2,) on device, drawn from torch's default generator there."""
    return torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=device)


# ---- options -----------------------------------------------------------------------------------------------------
class _Options:
    """Attention options resolved against the problem: the tensors flashc_params points at live here, on the
    tensors' device, for as long as the forward's saved state (so the backward sees the same ones)."""

    def __init__(self, q4, k4, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, block_mask=None, block_size=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, deterministic=False, seqused_k=None, sinks=None,
                 block_table=None, dropout_p=0.0, dropout_rng=None, positions=None):
        """dropout_p > 0 needs dropout_rng, the (seed, offset) int64 tensor (2,) of dropout_rng().
        positions: None (bottom-right alignment), or (q_position, k_position): query row i of every sequence sits at
        q_position + i and key j at k_position + j, and causal, windows and ALiBi are measured between those
        positions (flashc_params.positions: a chunk pair of a longer sequence, as context parallelism calls it);
        dropout's (row, key) are the positions too (the library takes q_position, k_position >= 0, k_position a
        multiple of 4, and refuses others with dropout)."""
        device = q4.device
        self.varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self.kw = dict(softmax_scale=softmax_scale, causal=bool(causal), window=_core.window_pair(window_size),
                       softcap=float(softcap or 0.0), deterministic=bool(deterministic))
        self.dropout_p = float(dropout_p or 0.0)
        if positions is not None:
            self.kw["positions"] = _core.check_positions(positions)
        self.rng = None
        if self.dropout_p:
            if not (isinstance(dropout_rng, torch.Tensor) and dropout_rng.dtype == torch.int64
                    and tuple(dropout_rng.shape) == (2,)):
                raise ValueError("flashc: dropout_p > 0 needs dropout_rng, the mask's (seed, offset) as an int64 "
                                 "tensor (2,) (flashc._torch.dropout_rng draws one from torch's generator)")
            # The library reads the pair itself (flashc_params.dropout_rng): the CUDA kernels from device memory when
            # they run (no host sync, and a captured CUDA graph reads whatever the tensor holds at replay), the CPU
            # backend from host memory at the call. So the pair must live where the call runs, as 16 contiguous
            # bytes, for as long as the call's work may read it: self.rng is that tensor, and this object (or the
            # operator's saved rng tensor) is kept for the backward.
            rng = dropout_rng.detach()
            if rng.device != device:
                rng = rng.to(device)
            self.rng = rng.contiguous()
            self.kw["dropout_p"] = self.dropout_p
        self.alibi = self.mask = self.cu_q = self.cu_k = self.used = self.sinks = self.table = None
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
        if block_table is not None:
            # paged K/V: k4, v4 are page pools (num_pages, page_size, Hkv, D); each sequence has max_pages * page_size
            # logical keys (varlen: its cu_seqlens_k length), its first seqused_k[b] used
            t = torch.as_tensor(block_table)
            _core.check_block_table_shape(tuple(t.shape), self.B, self.varlen)
            if t.device.type == "cpu" and t.dtype == torch.int64:
                _core.check_int32_range("block_table", t)
            self.table = _index_tensor("block_table", t, device)
            if not self.varlen:
                self.Nk = self.table.shape[1] * k4.shape[1]
            self.kw.update(block_table_max_pages=self.table.shape[1], block_table_stride=self.table.stride(0))
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
            u = seqused_k if isinstance(seqused_k, torch.Tensor) else torch.as_tensor(seqused_k)
            _core.check_seqused_k_shape(u.shape, self.B, self.varlen)
            if u.device.type == "cpu" and u.dtype == torch.int64:
                _core.check_int32_range("seqused_k", u)
            self.used = _index_tensor("seqused_k", u, device)
        if sinks is not None:
            s = torch.as_tensor(sinks)
            _core.check_sinks_shape(s.shape, self.H)
            # the library reads fp32 (H,) where it computes; a tensor that already is one is used as it is
            self.sinks = s.detach().to(device=device, dtype=torch.float32).contiguous()

    def params(self, dsinks=None, rng=None):
        """flashc_params pointing at this call's tensors; dsinks (fp32 (H,), backward only): where the library
        writes the sinks' gradient; rng: a host copy of the dropout pair to point at instead of self.rng (for
        flashc_dropout_mask, which reads host memory)."""
        rng = self.rng if rng is None else rng
        return _core.make_params(
            alibi_ptr=self.alibi.data_ptr() if self.alibi is not None else None,
            block_mask_ptr=self.mask.data_ptr() if self.mask is not None else None,
            cu_q_ptr=self.cu_q.data_ptr() if self.cu_q is not None else None,
            cu_k_ptr=self.cu_k.data_ptr() if self.cu_k is not None else None,
            seqused_k_ptr=self.used.data_ptr() if self.used is not None else None,
            sinks_ptr=self.sinks.data_ptr() if self.sinks is not None else None,
            dsinks_ptr=dsinks.data_ptr() if dsinks is not None else None,
            block_table_ptr=self.table.data_ptr() if self.table is not None else None,
            dropout_rng_ptr=rng.data_ptr() if rng is not None else None,
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
    if isinstance(t, torch.Tensor):
        # what most calls pass (a decode step passes its cache_seqlens every call): used as it is, with no copy or
        # conversion calls (each costs about a microsecond of host time)
        if t.dtype == torch.int32 and t.device == device and t.is_contiguous():
            return t
    else:
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
    # empty_like and a tuple shape: about half the host time of torch.empty(torch.Size, dtype=, device=)
    out4 = torch.empty_like(q4, memory_format=torch.contiguous_format)
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
    (.., 2, Hkv, D); varlen tensors have no batch dimension, except paged k, v (page pools (num_pages, page_size,
    Hkv, D), 'q,k,v' only)."""

    def __init__(self, kind, varlen, paged=False):
        self.kind = kind
        self.varlen = varlen
        self.paged = paged

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
            q = q.unsqueeze(0)
            if not self.paged:
                k, v = k.unsqueeze(0), v.unsqueeze(0)
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
            dq = dq.unsqueeze(0)
            if not self.paged:
                dk, dv = dk.unsqueeze(0), dv.unsqueeze(0)
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
        ctx.set_materialize_grads(False)  # lse's gradient is never used: autograd makes (and launches) no zeros for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        sinks, *inputs, out, lse = ctx.saved_tensors
        if dout is None:  # out's gradient undefined (lse has none): what materialization would have passed
            dout = torch.zeros_like(out)
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


def apply(kind, inputs, varlen=False, dropout_p=0.0, sinks=None, return_probs=False, **options):
    """(out, lse) with autograd for inputs laid out as `kind` (see _Layout), differentiable w.r.t. the inputs and
    sinks (a tensor of H logits); options go to _Options. dropout_p > 0 draws the mask's (seed, offset) from torch's
    generator (dropout_rng). return_probs: (out, lse, S_dmask) with S_dmask as probs() gives it when dropout_p > 0,
    None otherwise (flash-attn's return_attn_probs)."""
    dropout_p = _core.check_dropout(dropout_p)
    names = {"q,k,v": ("q", "k", "v"), "qkv": ("qkv",), "q,kv": ("q", "kv")}[kind]
    device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else None
    for n, t in zip(names, inputs):
        _check(n, t, device)
    base = 3 if varlen else 4
    paged = options.get("block_table") is not None
    if paged and kind != "q,k,v":
        raise ValueError("flashc: a block_table (paged KV) takes separate k and v page pools, not packed ones")
    for n, t in zip(names, inputs):
        nd = 4 if paged and n in ("k", "v") else base + (1 if n in ("qkv", "kv") else 0)
        if t.dim() != nd:
            layout = {"qkv": "(total, 3, H, D)" if varlen else "(B, N, 3, H, D)",
                      "kv": "(total, 2, Hkv, D)" if varlen else "(B, N, 2, Hkv, D)"}.get(
                n, "(num_pages, page_size, Hkv, D) (a page pool: block_table is set)" if paged and n in ("k", "v")
                else "(total, H, D)" if varlen else "(B, N, H, D)")
            raise ValueError("flashc: %s must be %d-d %s, got shape %s" % (n, nd, layout, tuple(t.shape)))
        if n in ("qkv", "kv") and t.shape[-3] != (3 if n == "qkv" else 2):
            raise ValueError("flashc: %s's packed dimension (-3) must have size %d, got %s"
                             % (n, 3 if n == "qkv" else 2, tuple(t.shape)))
    layout = _Layout(kind, varlen, paged)
    q4, k4, v4 = layout.unpack(inputs)
    s32 = None
    if sinks is not None:
        s32 = torch.as_tensor(sinks)
        _core.check_sinks_shape(s32.shape, q4.shape[2])
        # In autograd: a sinks tensor of another dtype or device gets its gradient back in its own.
        s32 = s32.to(device=q4.device, dtype=torch.float32).contiguous()
    rng = dropout_rng(q4.device) if dropout_p else None
    opts = _Options(q4, k4, sinks=s32, dropout_p=dropout_p, dropout_rng=rng, **options)
    if torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or (s32 is not None and s32.requires_grad)):
        out, lse = _AttentionFunction.apply(opts, layout, s32, *inputs)
    else:
        # Nothing to differentiate (inference, torch.no_grad()): the same forward without an autograd node.
        out4, lse = _forward(q4, k4, v4, opts)
        out = out4[0] if varlen else out4
    if not return_probs:
        return out, lse
    return out, lse, (probs(q4, k4, lse, opts) if dropout_p else None)


def probs(q4, k4, lse, opts):
    """flash-attn's S_dmask for a forward with dropout: (B, H, Nq, Nk) in q's dtype (varlen: (num_seqs, H,
    max_seqlen_q, max_seqlen_k), sequence b in the first rows and columns of its planes, 0 beyond), holding the
    attention probabilities P = exp(s - lse) recomputed in fp32 from q, k and the forward's lse (so normalized, the
    undropped softmax, not scaled by 1 / (1 - p); 0 where a mask hides a key) with the sign carrying the dropout
    mask: where(keep, P, -P), keep from flashc_dropout_mask for the call's params. No gradient flows through it.

    flashc_dropout_mask runs on the host and reads the (seed, offset) pair from host memory, so for CUDA tensors the
    pair is copied to the host here: a device synchronization, which the attention calls themselves never make, and
    no use under CUDA-graph capture (refused there). This is flash-attn's "for testing only" output."""
    if opts.mask is not None:
        raise NotImplementedError("flashc: return_attn_probs=True with dropout is not supported with a block mask")
    device = q4.device
    host_rng = opts.rng
    if device.type != "cpu":
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                "flashc: return_attn_probs=True with dropout_p > 0 builds S_dmask on the host from the dropout's "
                "(seed, offset), which needs a copy from the device: not possible during CUDA-graph capture (the "
                "attention itself is captured fine without return_attn_probs)")
        host_rng = opts.rng.cpu()
    B, H, Nq, Nk = opts.B, opts.H, opts.Nq, opts.Nk
    keep = torch.empty((B, H, Nq, Nk), dtype=torch.uint8)
    if keep.numel():
        _core.dropout_mask(opts.params(rng=host_rng), B, H, Nq, Nk, keep.data_ptr())
    p = torch.zeros((B, H, Nq, Nk), dtype=torch.float32, device=device)
    kw = opts.kw
    d = q4.shape[-1]
    scale = kw["softmax_scale"] or 1.0 / d ** 0.5
    left, right = kw["window"]
    if kw["causal"]:
        right = 0
    softcap = kw["softcap"]
    positions = kw.get("positions")  # (q_position, k_position): row i's diagonal key is i + q_position - k_position
    group = H // k4.shape[2]
    cq = opts.cu_q.tolist() if opts.varlen else None
    ck = opts.cu_k.tolist() if opts.varlen else None
    table = opts.table.long() if opts.table is not None else None
    used = opts.used.tolist() if opts.used is not None else None
    with torch.no_grad():
        for b in range(B):
            if table is not None:  # paged: sequence b's keys are its pages' rows, in table order
                kb = k4[table[b]].flatten(0, 1)
                qb, lb = (q4[0, cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]]) if opts.varlen else (q4[b], lse[b])
                if opts.varlen:
                    kb = kb[:ck[b + 1] - ck[b]]
            elif opts.varlen:
                qb, kb, lb = q4[0, cq[b]:cq[b + 1]], k4[0, ck[b]:ck[b + 1]], lse[:, cq[b]:cq[b + 1]]
            else:
                qb, kb, lb = q4[b], k4[b], lse[b]
            if used is not None:
                kb = kb[:used[b]]
            nq, nk = qb.shape[0], kb.shape[0]
            if nq == 0 or nk == 0:
                continue
            s = torch.einsum("ihd,jhd->hij", qb.float(), kb.float().repeat_interleave(group, dim=1)) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            diag = nk - nq if positions is None else positions[0] - positions[1]
            i = torch.arange(nq, device=device)[:, None] + diag  # the query's diagonal key
            j = torch.arange(nk, device=device)[None, :]
            if opts.alibi is not None:
                slopes = opts.alibi[b] if opts.alibi.dim() == 2 else opts.alibi
                s = s - slopes[:, None, None] * (i - j).abs()
            visible = torch.ones((nq, nk), dtype=torch.bool, device=device)
            if left >= 0:
                visible &= j >= i - left
            if right >= 0:
                visible &= j <= i + right
            p[b, :, :nq, :nk] = torch.exp(s - lb.float()[:, :, None]).masked_fill(~visible, 0.0)
        return torch.where(keep.to(device=device, dtype=torch.bool), p, -p).to(q4.dtype)


def attention_backward(dout, q, k, v, out, softmax_lse, *, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                       sinks=None, **options):
    """dq, dk, dv for torch tensors without autograd (see flashc.attention_backward); with sinks also dsinks, in
    the sinks' dtype and on their device when they are a floating-point tensor (else fp32 on q's device)."""
    if _core.check_dropout(dropout_p):
        raise NotImplementedError(
            "flashc: attention_backward does not take dropout_p > 0 (the forward's mask comes from a seed drawn "
            "inside it); differentiate flashc.attention or flash_attn_func with autograd instead, whose backward "
            "replays the forward's mask")
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
MASK_FORMS = (
    "flashc runs these attn_mask forms (bool with True = attend, or additive float with only 0 and -inf), "
    "broadcastable to (B, H, Nq, Nk): key padding (the same set of keys for every query row, any set, per batch "
    "and head), a top-left causal mask (torch.ones(Nq, Nk).tril()), a bottom-right causal mask (flash-attn's, "
    "tril(diagonal=Nk - Nq)), key padding combined with either causal mask, and an all-True mask (no mask). "
    "Other masks (sliding windows, block-diagonal or document masks, float biases) are not supported here: "
    "flashc.attention takes windows, ALiBi, cu_seqlens and block-sparse masks directly")


def _traced(tensors):
    """Whether a call must go through torch.ops.flashc.fwd / bwd rather than _torch.apply: under torch.compile or
    torch.export, on fake, functional or subclass tensors, under a dispatch mode (make_fx, FlopCounterMode) or a
    torch.func transform, or during a CUDA-graph capture (the rule flashc.ops applies to flash-attn's functions)."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        if t is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            return True
    if _get_current_dispatch_mode() is not None or torch._C._are_functorch_transforms_active():
        return True
    return tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()


def attend(q4, k4, v4, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, seqused_k=None,
           block_mask=None, block_size=None, sinks=None, dropout_p=0.0):
    """out (B, Nq, H, D) of q4 (B, Nq, H, D), k4, v4 (B, Nk, Hkv, D), differentiable w.r.t. q, k, v and sinks:
    _torch.apply on plain eager tensors, torch.ops.flashc.fwd (whose autograd formula calls flashc.bwd) where
    torch.compile, torch.export, a dispatch mode or a CUDA-graph capture sees the call. The same library calls
    either way."""
    if not _traced((q4, k4, v4, seqused_k, block_mask, sinks)):
        out4, _ = apply("q,k,v", (q4, k4, v4), softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, seqused_k=seqused_k, block_mask=block_mask, block_size=block_size,
                        sinks=sinks, dropout_p=dropout_p)
        return out4
    from . import ops  # noqa: F401  (registers torch.ops.flashc.fwd / bwd on first use)

    dropout_p = _core.check_dropout(dropout_p)
    rng = dropout_rng(q4.device) if dropout_p else None

    left, right = _core.window_pair(window_size)
    bq, bk = block_size if block_mask is not None else (0, 0)
    if sinks is not None:
        sinks = sinks.to(device=q4.device, dtype=torch.float32)
    out4, _ = torch.ops.flashc.fwd(q4, k4, v4, None, None, 0, 0, softmax_scale, bool(causal), left, right,
                                   float(softcap or 0.0), None, block_mask, bq, bk, seqused_k, sinks, False,
                                   None, dropout_p, rng)
    return out4


def _mask_4d(mask, lead, full):
    """attn_mask as a 4-d (Bm, Hm, Qm, Km) view, each dimension 1 or full (B, H, Nq, Nk), the leading dimensions
    of q beyond the last three merged into B (a copy only when the mask varies over several of them)."""
    m = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))
    if all(s == 1 for s in m.shape[:-3]):
        return m.reshape((1,) + tuple(m.shape[-3:]))
    return m.expand(tuple(lead) + tuple(m.shape[-3:])).reshape((-1,) + tuple(m.shape[-3:]))


def mask_plan(mask, lead, h, nq, nk):
    """What an SDPA attn_mask is, checked exactly: (kind, seqused_k, keys) with kind None, 'top-left' or
    'bottom-right' (causal), seqused_k int32 (B,) or None, keys None or a bool (Bm, Hm, Nk') key set (Bm in {1, B},
    Hm in {1, H}, Nk' the keys the causal kind leaves: Nq for top-left with Nq < Nk). Raises for other masks.

    Cost: a few elementwise passes and reductions over the mask's own elements (Bm x Hm x Qm x Km, without its
    broadcast dimensions) and one device-to-host copy of 8 booleans: one synchronization on CUDA, and a graph break
    under torch.compile (the path taken depends on the mask's values)."""
    full = tuple(lead) + (h, nq, nk)
    if not isinstance(mask, torch.Tensor):
        raise TypeError("flashc.scaled_dot_product_attention: attn_mask must be a torch.Tensor, got %s"
                        % type(mask).__name__)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError("flashc.scaled_dot_product_attention: attn_mask must be bool (True = attend) or floating "
                        "(additive 0 / -inf), got %s" % mask.dtype)
    try:
        fits = torch.broadcast_shapes(tuple(mask.shape), full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError("flashc.scaled_dot_product_attention: attn_mask of shape %s does not broadcast to "
                         "(..., H, Nq, Nk) = %s" % (tuple(mask.shape), full))
    m = _mask_4d(mask, lead, full)
    if m.is_floating_point():
        values_ok = ((m == 0) | (m == float("-inf"))).all()
        keep = m == 0
    else:
        values_ok = torch.ones((), dtype=torch.bool, device=m.device)
        keep = m
    bm, hm, qm, km = keep.shape
    kset = keep.any(dim=2).expand(bm, hm, nk)  # the keys some row of (b, h) sees
    cand = kset[:, :, None, :]
    if qm == 1:
        # the same keys for every row: key padding as it stands (with Nq == 1 a causal mask is one too)
        m_none = torch.ones((), dtype=torch.bool, device=m.device)
        m_tl = m_br = torch.zeros((), dtype=torch.bool, device=m.device)
    else:
        i = torch.arange(nq, device=m.device)[:, None]
        j = torch.arange(nk, device=m.device)[None, :]
        m_none = (keep == cand).all()
        m_tl = (keep == (cand & (j <= i))).all()
        m_br = (keep == (cand & (j <= i + nk - nq))).all()
    n_tl = min(nq, nk)  # a top-left causal mask shows no query any key past Nq - 1
    lengths = kset.sum(-1, dtype=torch.int32)  # (Bm, Hm)
    prefix = ((kset == (torch.arange(nk, device=m.device) < lengths[..., None])).all()
              & (lengths == lengths[:, :1]).all())
    flags = torch.stack([values_ok, m_none, m_tl, m_br, kset.all(), kset[..., :n_tl].all(), prefix]).tolist()
    values_ok, m_none, m_tl, m_br, all_keys, all_tl, prefix = flags
    if not values_ok:
        raise ValueError("flashc.scaled_dot_product_attention: a float attn_mask must hold only 0 (attend) and -inf "
                         "(masked); additive biases are not supported. " + MASK_FORMS)
    if m_none:
        kind, all_seen = None, all_keys
    elif m_br:  # with Nq == Nk top-left and bottom-right are one mask: flashc's causal is bottom-right
        kind, all_seen = "bottom-right", all_keys
    elif m_tl:
        kind, all_seen = "top-left", all_tl
        if nq < nk:
            kset = kset[..., :nq]
    else:
        raise ValueError("flashc.scaled_dot_product_attention: attn_mask is none of the supported forms. "
                         + MASK_FORMS)
    if all_seen:
        return kind, None, None
    if kind is None and prefix:
        # right padding without causal: each sequence's first n keys, never reading the rest
        return kind, lengths[:, 0], None
    return kind, None, kset


def _causal_args(kind, nq, nk):
    """(keys kept, flashc causal, window) for a causal kind. torch's is_causal is top-left aligned (query i sees
    keys j <= i); flashc's causal is bottom-right (j <= i + Nk - Nq). Equal when Nq == Nk. With Nq < Nk no query
    sees a key past Nq - 1, so those keys are dropped (a view) and the square problem is causal. With Nq > Nk,
    window_right = Nq - Nk turns j <= i + Nk - Nq + right into j <= i."""
    if kind == "bottom-right":
        return nk, True, (-1, -1)
    if kind == "top-left":
        if nq < nk:
            return nq, True, (-1, -1)
        if nq > nk:
            return nk, False, (-1, nq - nk)
        return nk, True, (-1, -1)
    return nk, False, (-1, -1)


def _fast_sdpa(query, key, value, is_causal, scale, enable_gqa):
    """flashc.ops.fast_sdpa (the per-shape plans' entry), which replaces this function once flashc.ops is imported."""
    from . import ops

    return ops.fast_sdpa(query, key, value, is_causal, scale, enable_gqa)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is None and (dropout_p is None or dropout_p == 0):
        # plain eager calls on 4-d tensors whose shapes were seen before (flashc.ops' per-shape plans); None otherwise
        out = _fast_sdpa(query, key, value, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    dropout_p = _core.check_dropout(dropout_p)
    for n, t in (("query", query), ("key", key), ("value", value)):
        _check(n, t, query.device if isinstance(query, torch.Tensor) else None)
        if t.dim() < 3:
            raise ValueError("flashc.scaled_dot_product_attention: %s must be (..., H, N, D) with at least 3 "
                             "dimensions, got shape %s" % (n, tuple(t.shape)))
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError("flashc.scaled_dot_product_attention: query, key and value must have the same number of "
                         "dimensions")
    if attn_mask is not None and is_causal:
        raise ValueError("flashc.scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both "
                         "(as torch requires); a causal mask combined with padding is recognized in attn_mask")
    lead = query.shape[:-3]

    def bnhd(t):
        # (..., H, N, D) -> (B, N, H, D): a transposed view; reshape copies only if the leading dims cannot merge.
        # 4-d tensors need no reshape (nor its autograd node, which would hand back gradients with the strides of
        # size-1 dimensions recomputed).
        if t.dim() != 4:
            t = t.unsqueeze(0) if t.dim() == 3 else t.reshape((-1,) + tuple(t.shape[-3:]))
        return t.transpose(1, 2)

    q4, k4, v4 = bnhd(query), bnhd(key), bnhd(value)
    H, Hkv = q4.shape[2], k4.shape[2]
    if H != Hkv and not enable_gqa:
        raise ValueError("flashc.scaled_dot_product_attention: query has %d heads and key/value %d; pass "
                         "enable_gqa=True for grouped-query attention" % (H, Hkv))
    nq, nk = q4.shape[1], k4.shape[1]
    kind, used, keys = "top-left" if is_causal else None, None, None
    if attn_mask is not None:
        if attn_mask.device != query.device:
            raise ValueError("flashc.scaled_dot_product_attention: attn_mask is on %s but query is on %s"
                             % (attn_mask.device, query.device))
        kind, used, keys = mask_plan(attn_mask, lead, H, nq, nk)
    kept, causal, window = _causal_args(kind, nq, nk)
    if kept < nk:
        k4, v4 = k4[:, :kept], v4[:, :kept]
    block_mask = block_size = None
    if keys is not None and nq > 0:
        # one mask byte per key (blocks of Nq rows x 1 key): each (batch, head) attends to its key set exactly
        block_mask = keys.to(torch.uint8)[:, :, None, :]
        block_size = (nq, 1)
    if used is not None:
        used = used.expand(q4.shape[0]).contiguous()  # (1,) for a mask without a batch dimension
    out4 = attend(q4, k4, v4, softmax_scale=scale, causal=causal, window_size=window, seqused_k=used,
                  block_mask=block_mask, block_size=block_size, dropout_p=dropout_p)
    out = out4.transpose(1, 2)  # (B, H, Nq, D) view
    if query.dim() == 4:
        return out
    return out[0] if query.dim() == 3 else out.reshape(tuple(lead) + tuple(out.shape[1:]))


# ---- KV cache: flash-attn's flash_attn_with_kvcache ------------------------------------------------------------
def _cache_seqlens(cache_seqlens, b, device):
    """cache_seqlens as int32 (B,) on the caches' device: from an int (every sequence) or integers (B,)."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        n = int(cache_seqlens)
        if not 0 <= n < 2**31:
            raise ValueError("flashc: cache_seqlens = %d is not a length (0 <= cache_seqlens < 2**31)" % n)
        return torch.full((b,), n, dtype=torch.int32, device=device)
    if (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
            and cache_seqlens.device == device and tuple(cache_seqlens.shape) == (b,) and cache_seqlens.is_contiguous()):
        return cache_seqlens  # what a decode loop passes every step: no conversion calls
    try:
        t = torch.as_tensor(cache_seqlens)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError("flashc: cache_seqlens must be an int or an int32 tensor (B,), got %s"
                        % type(cache_seqlens).__name__) from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError("flashc: cache_seqlens must be an int or an integer tensor (int32) of shape (B,), got dtype %s"
                        % t.dtype)
    if tuple(t.shape) != (b,):
        raise ValueError("flashc: cache_seqlens must be an int or 1-d with one length per sequence, (B,) = (%d,), "
                         "got shape %s" % (b, tuple(t.shape)))
    if t.device.type == "cpu" and t.dtype == torch.int64:
        _core.check_int32_range("cache_seqlens", t)
    return t.to(device=device, dtype=torch.int32).contiguous()


def _rotary_tables(rotary_cos, rotary_sin, d, nk, device):
    """(cos, sin) as given, (positions, R/2) on the tensors' device, checked as flash-attn checks them: 2-d, the
    same shape, R = 2 * rotary_cos.shape[1] <= D, a row for every cache position."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flashc: rotary_cos and rotary_sin must be given together")
    tables = []
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError("flashc: %s must be a floating-point torch.Tensor (positions, rotary_dim / 2), got %s"
                            % (name, t.dtype if isinstance(t, torch.Tensor) else type(t).__name__))
        if t.dim() != 2:
            raise ValueError("flashc: %s must be 2-d (positions, rotary_dim / 2), got shape %s"
                             % (name, tuple(t.shape)))
        tables.append(t.to(device))
    cos, sin = tables
    if cos.shape != sin.shape:
        raise ValueError("flashc: rotary_cos and rotary_sin must have the same shape, got %s and %s"
                         % (tuple(cos.shape), tuple(sin.shape)))
    if 2 * cos.shape[1] > d:
        raise ValueError("flashc: the rotary dimension 2 * rotary_cos.shape[1] = %d exceeds the head dim %d"
                         % (2 * cos.shape[1], d))
    if cos.shape[0] < nk:
        raise ValueError("flashc: rotary_cos and rotary_sin have %d positions; they need one per cache row, at least "
                         "k_cache.shape[1] = %d (as in flash-attn)" % (cos.shape[0], nk))
    return cos, sin


def _angles(cos, sin, positions):
    """cos and sin at positions (B, N) as fp32 (B, N, 1, R/2), to broadcast over the heads. The positions are clamped
    to the table only so that the gather cannot fault: rows past the cache are refused by the append (CPU backend)
    or skipped (CUDA)."""
    positions = positions.clamp(0, cos.shape[0] - 1)
    return cos[positions].float()[:, :, None], sin[positions].float()[:, :, None]


def _rotate(x, c, s, interleaved):
    """x (B, N, heads, D) with its first R = 2 * c.shape[-1] dimensions rotated (c, s from _angles; N may be 1 for
    every row): flash-attn's apply_rotary_emb, pairs (i, i + R/2) (GPT-NeoX) or interleaved (2i, 2i + 1) (GPT-J).
    Computed in fp32 and rounded once to x's dtype, as flash-attn's kernel does. A decode step runs this on tiny
    tensors, where each kernel costs its launch: hence addcmul, and no concatenation when R = D."""
    r = 2 * c.shape[-1]
    xr = x[..., :r].float()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :r // 2], xr[..., r // 2:])
    o1 = torch.addcmul(x1 * c, x2, s, value=-1)  # x1 cos - x2 sin
    o2 = torch.addcmul(x1 * s, x2, c)  # x1 sin + x2 cos
    rot = (torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)).to(x.dtype)
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)


def _rotary(x, cos, sin, start, interleaved, one_position=False):
    """x (B, N, heads, D) rotated by the library (flashc_rotary) into a new contiguous tensor: row i of sequence b at
    position start[b] + i, or with one_position every row at start[b] (x seen as (B, 1, N * heads, D)). What
    _rotate computes from _angles there, bit for bit on CUDA (one fma onto each rounded product, as torch's addcmul
    is compiled there). cos, sin: the (positions, R/2) tables on x's device, in any floating dtype (one that the
    library does not take goes as float32, as _angles rounds it); the positions must lie inside them (the CPU backend
    refuses others, CUDA gives NaN rows)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    b, n, h, d = x.shape
    xv, ov = x, out
    if one_position and n > 1:
        xv, ov = x.reshape(b, 1, n * h, d), out.view(b, 1, n * h, d)
    if cos.dtype != sin.dtype or cos.dtype not in _DTYPES:
        cos, sin = cos.float(), sin.float()
    with _device_guard(x.device):
        ctx = _context(x.device)
        st = _core.rotary_status(ctx, _view(xv), _view(cos[None, :, None, :]), _view(sin[None, :, None, :]),
                                 start.data_ptr(), interleaved, _view(ov))
        _lib.check(st, "flashc_rotary", ctx.handle)
    return out


def _rotary_torch(x, cos, sin, start, interleaved, one_position=False):
    """_rotary with torch operations (_angles, _rotate), for a library without flashc_rotary or positions it would
    refuse: positions past the tables are clamped to their last row (see _angles)."""
    pos = start.long()[:, None]  # (B, 1): one position per sequence, broadcast over x's rows
    if not one_position:
        pos = pos + torch.arange(x.shape[1], device=x.device)
    return _rotate(x, *_angles(cos, sin, pos), interleaved)


def with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                 alibi_slopes=None, sinks=None, block_table=None, cache_batch_idx=None, cache_leftpad=None):
    """(out, lse) of flash-attn's flash_attn_with_kvcache: k, v (B, Nnew, Hkv, D), rotated first when rotary tables
    are given, are written in place into k_cache, v_cache (B, Nk_max, Hkv, D) at rows cache_seqlens[b] .. + Nnew - 1
    (flashc_kvcache_append), then q (B, Nq, H, D) attends to each sequence's first cache_seqlens[b] + Nnew rows
    (seqused_k). With block_table (B, max_pages) int32 the caches are page pools (num_pages, page_size, Hkv, D) and
    row j of sequence b lives at row j % page_size of page block_table[b, j // page_size] (Nk_max = max_pages *
    page_size; flashc_kvcache_append_paged). cache_batch_idx (B,): sequence b's cache is k_cache[cache_batch_idx[b]]
    of (B_cache, Nk_max, Hkv, D) caches; cache_leftpad (B,): its keys start at row cache_leftpad[b] (<=
    cache_seqlens[b]), and causal, windows and ALiBi count from there; both are block tables over the caches seen
    as pools (_cache_table), the rotary positions stay the cache rows. Everything stays on the device (no host sync)
    and on torch's current stream; no autograd."""
    device = q.device if isinstance(q, torch.Tensor) else None
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if (k is None) != (v is None):
        raise ValueError("flashc: k and v (the new keys and values) must be given together")
    if k is not None:
        named += [("k", k), ("v", v)]
    for n, t in named:
        _check(n, t, device)
        if t.dim() != 4:
            raise ValueError("flashc: %s must be 4-d %s, got shape %s"
                             % (n, {"q": "(B, Nq, H, D)", "k": "(B, Nnew, Hkv, D)", "v": "(B, Nnew, Hkv, D)"}.get(
                                 n, "(B, Nk_max, Hkv, D)"), tuple(t.shape)))
        if t.dtype != q.dtype:
            raise TypeError("flashc: %s has dtype %s but q has %s; q, the caches and k, v must share one dtype"
                            % (n, t.dtype, q.dtype))
    b, nq, h, d = q.shape
    nk, hkv = k_cache.shape[1], k_cache.shape[2]
    table = None
    pools = (k_cache, v_cache)  # what the library reads and writes: the caches, or their rows as pages of one
    lpad = None
    if cache_batch_idx is not None or cache_leftpad is not None:
        if block_table is not None:
            raise ValueError("flashc: cache_batch_idx and cache_leftpad index contiguous caches (B_cache, Nk_max, Hkv, "
                             "D); they do not go with block_table (nor in flash-attn)")
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
            raise ValueError("flashc: k_cache and v_cache must both be (B_cache, Nk_max, Hkv, D) with q's D = %d, got "
                             "%s and %s" % (d, tuple(k_cache.shape), tuple(v_cache.shape)))
        table, pools, lpad = _cache_table(cache_batch_idx, cache_leftpad, k_cache, v_cache, b, device)
    elif block_table is not None:
        table = torch.as_tensor(block_table)
        _core.check_block_table_shape(tuple(table.shape), b, False)
        if table.device.type == "cpu" and table.dtype == torch.int64:
            _core.check_int32_range("block_table", table)
        table = _index_tensor("block_table", table, device)
        nk = table.shape[1] * k_cache.shape[1]  # each sequence's rows: max_pages * page_size
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
            raise ValueError("flashc: with block_table, k_cache and v_cache must both be page pools (num_pages, "
                             "page_size, Hkv, D) with q's D = %d, got %s and %s"
                             % (d, tuple(k_cache.shape), tuple(v_cache.shape)))
    elif v_cache.shape != k_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError("flashc: k_cache and v_cache must both be (B, Nk_max, Hkv, D) with q's B = %d and D = %d, "
                         "got %s and %s" % (b, d, tuple(k_cache.shape), tuple(v_cache.shape)))
    if hkv == 0 or h % hkv:
        raise ValueError("flashc: q's %d heads must be a multiple of the caches' %d kv heads" % (h, hkv))
    nnew = 0
    if k is not None:
        if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (b, hkv, d):
            raise ValueError("flashc: k and v must both be (B, Nnew, Hkv, D) = (%d, Nnew, %d, %d), got %s and %s"
                             % (b, hkv, d, tuple(k.shape), tuple(v.shape)))
        nnew = k.shape[1]
        if nnew > nk:
            raise ValueError("flashc: %d new rows (k.shape[1]) do not fit a cache of %d rows" % (nnew, nk))
        if cache_seqlens is None:
            raise ValueError("flashc: k and v are written at each sequence's cache_seqlens: pass cache_seqlens "
                             "(flash-attn requires it too)")
    seqlens = None if cache_seqlens is None else _cache_seqlens(cache_seqlens, b, device)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError(
                "flashc: rotary_cos / rotary_sin rotate the new keys k (and q) at their cache positions, so they "
                "need k and v, as in flash-attn; to attend to the cache alone, rotate q yourself")
        # torch operations on q and k (which may require gradients): none recorded (inference)
        with torch.no_grad():
            cos, sin = _rotary_tables(rotary_cos, rotary_sin, d, nk, device)
            if cos.shape[1] > 0:
                # flash-attn's rule: with causal or a window that can bind (one shorter than the cache), query i sits
                # at cache_seqlens + i; otherwise every query sits at cache_seqlens.
                left, right = _core.window_pair(window_size)
                advance = bool(causal) or 0 <= left < nk or 0 <= right < nk
                # The library rotates where every position lies in the tables whenever the append takes the rows:
                # k's (cache_seqlens + i < Nk_max <= positions), and q's unless its rows pass the new ones. Else (q's
                # rows past them; or on the CPU, lengths the append will refuse, so that it names them) torch's
                # operations, which clamp to the tables' last row.
                lib = _lib.bound("flashc_rotary") and nnew > 0 and not (
                    device.type == "cpu" and bool(((seqlens < 0) | (seqlens > cos.shape[0] - nnew)).any()))
                rot_k = _rotary if lib else _rotary_torch
                rot_q = _rotary if lib and not (advance and nq > nnew) else _rotary_torch
                k = rot_k(k, cos, sin, seqlens, rotary_interleaved)
                q = rot_q(q, cos, sin, seqlens, rotary_interleaved, one_position=not advance)
    used = seqlens if nnew == 0 or seqlens is None else seqlens + nnew
    at = seqlens  # where the new rows go, counted in the table's keys
    if lpad is not None:  # keys from row cache_leftpad[b]: the table starts there
        used = (used if used is not None else torch.full((b,), nk, dtype=torch.int32, device=device)) - lpad
        at = None if seqlens is None else seqlens - lpad
    opts = _Options(q, pools[0], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=used, sinks=sinks, block_table=table)
    if nnew > 0 and b > 0 and d > 0:
        _append(q, pools[0], pools[1], k, v, at, opts)
    return _forward(q, pools[0], pools[1], opts)


def _cache_table(cache_batch_idx, cache_leftpad, k_cache, v_cache, b, device):
    """flash-attn's cache_batch_idx and cache_leftpad as a block table over the caches (B_cache, Nk_max, Hkv, D):
    (table, (k pool, v pool), leftpad or None). Batch indices alone: each cache is one page of Nk_max rows, page
    cache_batch_idx[b] for sequence b (the kernels' page paths; on Hopper a page of Nk_max rows a multiple of 128 is
    as fast as the contiguous cache). With left padding the table has a page of one row per key, row
    cache_batch_idx[b] * Nk_max + cache_leftpad[b] + j for key j (pages of one row take the mma.sync kernels on the
    GPU: slower), which needs each cache's rows evenly strided across its batch (stride(0) = Nk_max * stride(1), as
    torch.empty gives). Entries past a sequence's cache point at its last row: never read (the keys past
    cache_seqlens are not used). Bad indices are left for the library to find (below)."""
    bc, nk = k_cache.shape[0], k_cache.shape[1]

    def index(name, t):
        t = torch.as_tensor(t)
        if tuple(t.shape) != (b,):
            raise ValueError("flashc: %s must be 1-d with one entry per sequence, (B,) = (%d,), got shape %s"
                             % (name, b, tuple(t.shape)))
        if t.device.type == "cpu" and t.dtype == torch.int64:
            _core.check_int32_range(name, t)
        return _index_tensor(name, t, device)

    bidx = None if cache_batch_idx is None else index("cache_batch_idx", cache_batch_idx)
    if cache_leftpad is None:
        return bidx.view(b, 1), (k_cache, v_cache), None
    lpad = index("cache_leftpad", cache_leftpad)
    if bc * nk >= 2**31:
        raise ValueError("flashc: cache_leftpad: %d x %d cache rows do not fit the block table's int32" % (bc, nk))
    pools = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if nk > 1 and bc > 1 and c.stride(0) != nk * c.stride(1):
            raise ValueError("flashc: cache_leftpad needs %s's rows evenly strided across its batch (stride(0) = "
                             "Nk_max * stride(1) = %d, got %d), as a tensor from torch.empty is"
                             % (name, nk * c.stride(1), c.stride(0)))
        pools.append(c.as_strided((bc * nk, 1) + tuple(c.shape[2:]), (c.stride(1), c.stride(1)) + c.stride()[2:]))
    base = (bidx.long() if bidx is not None else torch.arange(b, device=device)) * nk
    rows = torch.minimum(base[:, None] + lpad.long()[:, None] + torch.arange(nk, device=device)[None, :],
                         base[:, None] + (nk - 1))
    # A batch index outside [0, B_cache) or a negative left padding names rows outside the pool (-1 or B_cache *
    # Nk_max, never wrapped into it by the int32 table): the library refuses them (CPU) or gives NaN rows (CUDA).
    rows = torch.where(lpad[:, None] < 0, -1, rows).clamp_(-1, bc * nk)
    return rows.to(torch.int32), tuple(pools), lpad


def _append(q, k_cache, v_cache, k, v, seqlens, opts):
    """flashc_kvcache_append, after asking the backend whether it runs the attention that follows, so that a
    configuration it refuses raises before the caches are written (a layout it refuses is copied by _forward)."""
    device = q.device
    with _device_guard(device):
        ctx = _context(device)
        if not _empty_problem(q, k_cache):
            st = _core.supported_status(ctx, _view(q), _view(k_cache), _view(v_cache), opts.params())
            layout = st == _lib.STATUS_NOT_SUPPORTED and not all(t.is_contiguous() for t in (q, k_cache, v_cache))
            if st != _lib.STATUS_OK and not layout:
                _lib.check(st, "flashc_supported", ctx.handle)
        if opts.table is None:
            st = _core.kvcache_append_status(ctx, _view(k_cache), _view(v_cache), _view(k), _view(v),
                                             seqlens.data_ptr())
            _lib.check(st, "flashc_kvcache_append", ctx.handle)
        else:
            t = opts.table
            st = _core.kvcache_append_paged_status(ctx, _view(k_cache), _view(v_cache), _view(k), _view(v),
                                                   seqlens.data_ptr(), t.data_ptr(), t.shape[1], t.stride(0))
            _lib.check(st, "flashc_kvcache_append_paged", ctx.handle)
    # The library wrote the caches behind torch's back: tell autograd, which would otherwise miss the change in a
    # tensor saved for a backward (torch >= 2.1 has the call).
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        for t in (k_cache, v_cache):
            bump(t)


# ---- merging partial results: flashc_merge ------------------------------------------------------------------------
def _lse_rows(x, varlen):
    """lse (B, H, Nq) or (H, total_q) to the parts' row order, (B, Nq, H) or (total_q, H), and back (its own
    inverse)."""
    return x.transpose(-1, -2) if varlen else x.transpose(1, 2)


def _merged_lse(la, lb):
    """flashc_merge's lse rule with torch operations (shapes the library is not called on): an infinite lse is an
    empty part; both empty give +inf."""
    la, lb = la.float(), lb.float()
    ea, eb = torch.isinf(la), torch.isinf(lb)
    m = torch.logaddexp(la.masked_fill(ea, float("-inf")), lb.masked_fill(eb, float("-inf")))
    return m.masked_fill(ea & eb, float("inf"))


def _merge(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """flashc_merge on checked tensors; out, lse: the outputs, or None for new ones."""
    device = out_a.device
    want = _core.merge_lse_shape(out_a.shape)
    # fp32 contiguous lse inputs: the same tensors when they already are, so that lse=lse_a stays in place
    la = lse_a.to(device=device, dtype=torch.float32).contiguous()
    lb = lse_b.to(device=device, dtype=torch.float32).contiguous()
    if out is None:
        out = torch.empty_like(out_a)
    if lse is None:
        lse = torch.empty(want, dtype=torch.float32, device=device)
    if out.numel() == 0:
        if out.shape[-1] == 0 and lse.numel():
            lse.copy_(_merged_lse(la, lb))
        return out, lse
    varlen = out.dim() == 3
    a4, b4, o4 = (t.unsqueeze(0) if varlen else t for t in (out_a, out_b, out))
    with _device_guard(device):
        ctx = _context(device)
        st = _core.merge_status(ctx, _view(a4), la.data_ptr(), _view(b4), lb.data_ptr(), _view(o4), lse.data_ptr())
        _lib.check(st, "flashc_merge", ctx.handle)
    return out, lse


class _MergeFunction(torch.autograd.Function):
    """out = wa out_a + wb out_b, lse = logaddexp(lse_a, lse_b), wa = exp(lse_a - lse) (0 for an empty part):
    d out_a = wa dout; d lse_a = wa (rowsum(dout (out_a - out)) + dlse); likewise b."""

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):
        out, lse = _merge(out_a, lse_a, out_b, lse_b)
        ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
        varlen = out.dim() == 3
        do, o = dout.float(), out.float()
        grads = []
        for part, l in ((out_a, lse_a), (out_b, lse_b)):
            lf = l.float()
            empty = torch.isinf(lf) | (lse == float("inf"))
            w = torch.exp(lf - lse).masked_fill(empty, 0.0)  # (B, H, Nq), 0 for an empty part
            wr = _lse_rows(w, varlen)[..., None]
            dpart = (wr * do).to(part.dtype)
            s = _lse_rows((do * (part.float() - o)).sum(-1), varlen)  # rowsum, back in lse's layout
            dl = (w * (s + dlse.float())).masked_fill(empty, 0.0)  # an empty part's garbage reaches nothing
            grads += [dpart, dl.to(l.dtype)]
        return tuple(grads)


def merge(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """(out, lse) of two partial results (see flashc.merge_attention); differentiable w.r.t. all four inputs when
    out and lse are not given."""
    device = out_a.device if isinstance(out_a, torch.Tensor) else None
    named = [("out_a", out_a), ("out_b", out_b)] + ([("out", out)] if out is not None else [])
    for n, t in named:
        _check(n, t, device)
    for n, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError("flashc: %s must be a floating-point torch.Tensor (fp32, the forward's softmax_lse)" % n)
        if t.device != device:
            raise ValueError("flashc: %s is on %s but out_a is on %s; all tensors must be on one device"
                             % (n, t.device, device))
    if out_b.dtype != out_a.dtype or (out is not None and out.dtype != out_a.dtype):
        raise TypeError("flashc: out_a, out_b%s must share one dtype, got %s" % (
            " and out" if out is not None else "",
            ", ".join(str(t.dtype) for t in (out_a, out_b, out) if t is not None)))
    _core.check_merge_shapes(out_a.shape, lse_a.shape, out_b.shape, lse_b.shape,
                             None if out is None else out.shape, None if lse is None else lse.shape)
    if lse is not None and not (isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.is_contiguous()
                                and lse.device == device):
        raise ValueError("flashc: lse (the merged lse output) must be a contiguous float32 tensor on %s" % device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out_a, lse_a, out_b, lse_b)):
        if out is not None or lse is not None:
            raise RuntimeError("flashc.merge_attention: out= and lse= do not support automatic differentiation; "
                               "leave them out (or call under torch.no_grad())")
        return _MergeFunction.apply(out_a, lse_a, out_b, lse_b)
    return _merge(out_a, lse_a, out_b, lse_b, out, lse)
