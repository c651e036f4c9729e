"""flashc's attention as torch operators: ``torch.ops.flashc.fwd`` and ``torch.ops.flashc.bwd``.

Registered with ``torch.library.custom_op`` (with a fake kernel for shape propagation and an autograd formula), so
that ``torch.compile(fullgraph=True)`` traces through a model that calls flashc without a graph break (the call
stays one opaque node; Inductor calls it as it is), ``torch.export`` keeps it, and CUDA-graph capture records its
kernels: the ops run on torch's current stream and take their workspace from torch's caching allocator, with no
host synchronization.

flashc's six flash-attn functions (flashc.flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
flash_attn_varlen_func and its two packed forms) run through run() below, which this module's flash_attn_func and
flash_attn_varlen_func are: under torch.compile, torch.export, make_fx, a dispatch mode, a torch.func transform or a
CUDA-graph capture they call the operators (packed inputs as q, k, v views); an eager call on plain tensors takes the
direct path (flashc's own autograd function over the same library calls: the same bits), since torch.library's
Python dispatch and autograd wrapper cost more host time than that whole path on small problems.

Importing this module imports torch and registers the ops (once per process); flash_attn_interface imports it on
its first call. The ops call the same ctypes code as flashc's torch front end (``_torch._Options``, ``_forward``,
``_backward``); they only add torch.library's metadata around it.

The operators (q, k, v are (B, N, H, D), or (total, H, D) packed with cu_seqlens_q / cu_seqlens_k):

    flashc::fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                deterministic, block_table=None) -> (out, softmax_lse)
    flashc::bwd(dout, q, k, v, out, softmax_lse, <the same options>) -> (dq, dk, dv, dsinks)

out is contiguous with q's shape and dtype; softmax_lse fp32 (B, H, Nq), varlen (H, total_q). dq, dk, dv are laid
out as torch.empty_like(q / k / v); dsinks is fp32 (H,), or (0,) without sinks. With block_table (num_seqs,
max_pages) int32 (varlen only), k and v are page pools (num_pages, page_size, Hkv, D) and so are dk, dv. Neither op
writes its inputs (no mutated arguments). deterministic only concerns the backward; the forward takes it so that the
autograd formula sees it. Gradients flow to q, k, v and sinks; softmax_lse is not differentiable (as in
flashc.attention).
"""

import contextlib
import ctypes
import threading
from typing import Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _core, _lib, _torch

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Tensor = torch.Tensor


# ---- the operators ---------------------------------------------------------------------------------------------
def _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
             window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks, deterministic,
             block_table):
    varlen = cu_seqlens_q is not None
    return _torch._Options(
        q4, k4, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, block_mask=block_mask,
        block_size=(block_q, block_k) if block_mask is not None else None,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        deterministic=deterministic, seqused_k=seqused_k, sinks=sinks, block_table=block_table)


def _check_varlen(cu_seqlens_q, cu_seqlens_k):
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("flashc: varlen needs both cu_seqlens_q and cu_seqlens_k")
    return cu_seqlens_q is not None


def _as4(varlen, block_table, q, k, v):
    """The library's (B, N, H, D) views: varlen tensors get a batch dimension of 1, except paged k, v (page pools
    (num_pages, page_size, Hkv, D) already)."""
    if not varlen:
        return q, k, v
    if block_table is not None:
        return q.unsqueeze(0), k, v
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


def _lse_shape(q, varlen):
    # (total_q, H, D) -> (H, total_q); (B, Nq, H, D) -> (B, H, Nq)
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("flashc::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
         window_right: int, softcap: float, alibi_slopes: Optional[Tensor], block_mask: Optional[Tensor],
         block_q: int, block_k: int, seqused_k: Optional[Tensor], sinks: Optional[Tensor],
         deterministic: bool, block_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    q4, k4, v4 = _as4(varlen, block_table, q, k, v)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic, block_table)
    out4, lse = _torch._forward(q4, k4, v4, opts)
    return (out4[0] if varlen else out4), lse


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks, deterministic,
              block_table=None):
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    if q.dim() != (3 if varlen else 4):
        raise ValueError("flashc: q must be %s, got shape %s"
                         % ("(total_q, H, D)" if varlen else "(B, Nq, H, D)", tuple(q.shape)))
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)


@torch.library.custom_op("flashc::bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
         cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
         softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
         alibi_slopes: Optional[Tensor], block_mask: Optional[Tensor], block_q: int, block_k: int,
         seqused_k: Optional[Tensor], sinks: Optional[Tensor], deterministic: bool,
         block_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    q4, k4, v4 = _as4(varlen, block_table, q, k, v)
    dq4, dk4, dv4 = _as4(varlen, block_table, dq, dk, dv)
    out4, do4 = (out.unsqueeze(0), dout.unsqueeze(0)) if varlen else (out, dout)
    if do4.dtype != out4.dtype:
        do4 = do4.to(out4.dtype)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic, block_table)
    lse = softmax_lse.to(torch.float32).contiguous()  # the forward's lse already is: no copy
    dsinks = torch.empty(opts.H if sinks is not None else 0, dtype=torch.float32, device=q.device)
    _torch._backward(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4, dsinks if sinks is not None else None)
    return dq, dk, dv, dsinks


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k,
              seqused_k, sinks, deterministic, block_table=None):
    h = q.shape[-2]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((h if sinks is not None else 0,), dtype=torch.float32))


# fwd's arguments after q, k, v: which of them are tensors to save, and their order.
_TENSOR_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "block_mask", "seqused_k", "sinks", "block_table")
_SCALAR_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right",
                   "softcap", "block_q", "block_k", "deterministic")
_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_left", "window_right", "softcap", "alibi_slopes", "block_mask", "block_q", "block_k",
             "seqused_k", "sinks", "deterministic", "block_table")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_ARGS, inputs))
    out, lse = output
    # The option tensors are saved too, so that an in-place change of one before the backward is caught.
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, *(args[n] for n in _TENSOR_OPTIONS))
    ctx.scalars = {n: args[n] for n in _SCALAR_OPTIONS}
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    options = dict(zip(_TENSOR_OPTIONS, tensors), **ctx.scalars)
    dq, dk, dv, dsinks = torch.ops.flashc.bwd(dout, q, k, v, out, lse, **options)
    grads = {"q": dq, "k": dk, "v": dv}
    sinks_index = _FWD_ARGS.index("sinks")
    if options["sinks"] is not None and ctx.needs_input_grad[sinks_index]:
        grads["sinks"] = dsinks.to(options["sinks"].dtype)
    return tuple(grads.get(n) for n in _FWD_ARGS)


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- flash-attn's functions: the direct path or the operators -----------------------------------------------------
# flashc.flash_attn_func and the other five flash-attn functions run here (flash_attn_interface imports this module on
# their first call). An eager call on plain tensors takes the direct path (see _eager): torch.library's Python dispatch
# and autograd wrapper cost more than the whole direct call on small problems. Tests set _EAGER_FAST_PATH to False to
# run the operators in eager mode too.
_EAGER_FAST_PATH = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NAMES = {"q,k,v": ("q", "k", "v"), "qkv": ("qkv",), "q,kv": ("q", "kv")}


def _eager(tensors):
    """Whether this call may take the direct path (the same library calls, the same bits): not under
    torch.compile / torch.export, on plain tensors (not fake, functional or subclass tensors such as DTensor), with no
    dispatch mode recording the calls (make_fx, FlopCounterMode), no torch.func transform active and no CUDA graph
    being captured. Anything else sees the operators."""
    if not _EAGER_FAST_PATH or torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    if _dispatch_stack_len() or torch._C._are_functorch_transforms_active():
        return False
    q = tensors[0]
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


# Whether a dispatch mode is active: one C call where torch has it, instead of a Python function.
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None) or (
    lambda: _current_dispatch_mode() is not None)


def _unpack(kind, inputs, varlen, paged):
    """q, k, v views of the inputs laid out as `kind` ('q,k,v', 'qkv' (.., 3, H, D), 'q,kv' (.., 2, Hkv, D)), after
    the checks flashc's direct path makes (each a Python check on metadata, which torch.compile traces as guards)."""
    names = _NAMES[kind]
    q = inputs[0]
    device = q.device if isinstance(q, Tensor) else None
    base = 3 if varlen else 4
    for n, t in zip(names, inputs):
        _torch._check(n, t, device)
        packed = n in ("qkv", "kv")
        nd = 4 if paged and n in ("k", "v") else base + packed
        if t.dim() != nd:
            what = ("(num_pages, page_size, Hkv, D) (a page pool: block_table is set)" if paged and n in ("k", "v")
                    else "(total, %sH, D)" if varlen else "(B, N, %sH, D)")
            if "%s" in what:
                what %= {"qkv": "3, ", "kv": "2, "}.get(n, "")
            raise ValueError("flashc: %s must be %d-d %s, got shape %s" % (n, nd, what, tuple(t.shape)))
        if packed and t.shape[-3] != (3 if n == "qkv" else 2):
            raise ValueError("flashc: %s's packed dimension (-3) must have size %d, got %s"
                             % (n, 3 if n == "qkv" else 2, tuple(t.shape)))
    if kind == "qkv":
        return inputs[0].select(-3, 0), inputs[0].select(-3, 1), inputs[0].select(-3, 2)
    if kind == "q,kv":
        return inputs[0], inputs[1].select(-3, 0), inputs[1].select(-3, 1)
    return inputs


def _tensor_options(q, alibi_slopes, sinks):
    """ALiBi slopes as a tensor, and the sinks as fp32 on q's device: the cast happens here, under autograd, so the
    sinks' gradient comes back in their own dtype."""
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32, device=q.device)
    if sinks is not None:
        sinks = torch.as_tensor(sinks)
        _core.check_sinks_shape(sinks.shape, q.shape[-2])
        sinks = sinks.to(device=q.device, dtype=torch.float32)
    return alibi_slopes, sinks


def _direct(kind, inputs, varlen, return_attn_probs, **options):
    """The direct path: _torch.apply (flashc's own autograd function over the library calls)."""
    out, lse = _torch.apply(kind, inputs, varlen=varlen, **options)
    return (out, lse, None) if return_attn_probs else out


def run(kind, inputs, varlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, seqused_k=None, sinks=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None):
    """The body of flash-attn's six functions: inputs laid out as `kind` (see _unpack), varlen with cu_seqlens.
    Returns out, or (out, softmax_lse, None) with return_attn_probs. The direct path (plain eager tensors) and the
    operators run the same library calls with the same arguments: the same bits."""
    if _eager(inputs + (alibi_slopes, seqused_k, sinks, cu_seqlens_q, cu_seqlens_k, block_table)):
        extra = {}
        if varlen:
            extra = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k)
        if block_table is not None:
            extra["block_table"] = block_table
        return _direct(kind, inputs, varlen, return_attn_probs, dropout_p=dropout_p, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       deterministic=deterministic, seqused_k=seqused_k, sinks=sinks, **extra)
    _core.check_dropout(dropout_p)
    if varlen and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("flashc: under torch.compile, torch.export, make_fx or a CUDA-graph capture, pass "
                         "max_seqlen_q and max_seqlen_k (max_seqlen) as ints: computing them from cu_seqlens would "
                         "read device memory, which a traced or captured graph cannot hold")
    q, k, v = _unpack(kind, inputs, varlen, block_table is not None)
    left, right = _core.window_pair(window_size)
    alibi_slopes, sinks = _tensor_options(q, alibi_slopes, sinks)
    out, lse = torch.ops.flashc.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q if varlen else 0,
                                    max_seqlen_k if varlen else 0, softmax_scale, bool(causal), left, right,
                                    float(softcap or 0.0), alibi_slopes, None, 0, 0, seqused_k, sinks,
                                    bool(deterministic), block_table)
    return (out, lse, None) if return_attn_probs else out


# flashc.ops.flash_attn_func and flash_attn_varlen_func are flashc's own (they route here).
from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402


# ---- the direct path's per-shape plans (host time) -----------------------------------------------------------------
# A plain eager flash_attn_func call on (B, N, H, D) tensors with no tensor options spends most of its host time on
# work that depends only on the shapes, strides, dtypes, devices and scalar options: argument checks, the
# flashc_params struct, the flashc_tensor views, the workspace size. A plan holds that work for one such key, per
# thread (each thread has its own library contexts, and the views' data pointers are set per call, so a plan must not
# be shared by threads whose calls run at once: ctypes releases the GIL during the library call). A key is planned
# only after its first call ran flashc.flash_attn_func's full path without an error, and only when the library
# takes the layout as it is (no copy): the plan then makes the same library call with the same arguments, so it gives
# the same bits, and any failure status sends the call back to the full path, which raises or copies as it always
# does. Forward without autograd passes no lse pointer unless the lse is returned (the library then skips that store).
_local = threading.local()
_DEVICE_INDEX = None  # torch.cuda's raw current stream, when torch has it


class _Fallback(Exception):
    """Raised inside the fast autograd function's forward when the library refuses the call: the full path runs."""


class _Plan:
    __slots__ = ("key", "ctx", "device", "params", "views", "out_shape", "lse_shape", "fwd_ws", "bwd_ws", "cuda")

    def __init__(self, key, q, k, v):
        softmax_scale, causal, window_size, softcap, deterministic = key[-5:]
        self.key = key
        device = q.device
        self.device = device
        self.cuda = device.type == "cuda"
        with _torch._device_guard(device):
            self.ctx = _torch._context(device)
        left, right = _core.window_pair(window_size)
        self.params = _core.make_params(softmax_scale=softmax_scale, causal=bool(causal), window=(left, right),
                                        softcap=float(softcap or 0.0), deterministic=bool(deterministic))
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        # q, k, v, out, and the gradients' layouts (torch.empty_like of q, k, v, as the full path allocates them)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        self.views = [_torch._view(t) for t in (q, k, v, out)] + [_torch._view(t) for t in grads]
        self.out_shape = tuple(q.shape)
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.fwd_ws = self.bwd_ws = 0
        lib = _lib.lib
        with _torch._device_guard(device):
            st = _core.supported_status(self.ctx, *self.views[:3], self.params)
            if st != _lib.STATUS_OK:
                raise _Fallback()
            if self.cuda:
                n = ctypes.c_size_t(0)
                _lib.check(lib.flashc_forward_workspace_size(self.ctx.handle, *self.views[:3], self.params,
                                                             ctypes.byref(n)), "flashc_forward_workspace_size")
                self.fwd_ws = n.value
                _lib.check(lib.flashc_backward_workspace_size(self.ctx.handle, *self.views[:3], self.params,
                                                              ctypes.byref(n)), "flashc_backward_workspace_size")
                self.bwd_ws = n.value

    def _begin(self):
        ctx = self.ctx
        if self.cuda:
            ctx.set_stream(_raw_stream(self.device))
        else:
            ctx.set_threads(_lib._num_threads or torch.get_num_threads())
        return ctx

    def forward(self, q, k, v, want_lse):
        """(out, lse or None), or None when the library refused the call (nothing is returned then)."""
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device) if self.cuda else _empty_like_contig(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if want_lse else None
        vq, vk, vv, vo = self.views[:4]
        vq.data, vk.data, vv.data, vo.data = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if self.cuda:
            with torch.cuda.device(self.device):
                ctx = self._begin()
                ws = torch.empty(self.fwd_ws, dtype=torch.uint8, device=q.device) if self.fwd_ws else None
                st = _lib.lib.flashc_forward(ctx.handle, vq, vk, vv, self.params, vo,
                                             lse.data_ptr() if lse is not None else None,
                                             ws.data_ptr() if ws is not None else None, self.fwd_ws)
                del ws
        else:
            ctx = self._begin()
            st = _lib.lib.flashc_forward(ctx.handle, vq, vk, vv, self.params, vo,
                                         lse.data_ptr() if lse is not None else None, None, 0)
        return (out, lse) if st == _lib.STATUS_OK else None

    def backward(self, dout, q, k, v, out, lse):
        """(dq, dk, dv), or None when the library refused the call."""
        if dout.dtype != out.dtype:
            dout = dout.to(out.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        vq, vk, vv, vo, vdq, vdk, vdv = self.views
        vq.data, vk.data, vv.data, vo.data = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        vdq.data, vdk.data, vdv.data = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        vdo = _torch._view(dout)  # autograd's dout comes in any layout
        lse = lse.contiguous()
        guard = torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()
        with guard:
            ctx = self._begin()
            ws = torch.empty(self.bwd_ws, dtype=torch.uint8, device=q.device) if self.bwd_ws else None
            st = _lib.lib.flashc_backward(ctx.handle, vq, vk, vv, vo, vdo, lse.data_ptr(), self.params, vdq, vdk, vdv,
                                          ws.data_ptr() if ws is not None else None, self.bwd_ws)
            del ws
        return (dq, dk, dv) if st == _lib.STATUS_OK else None


def _empty_like_contig(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _raw_stream(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class _FastFunction(torch.autograd.Function):
    """flashc's autograd function for a planned call: the same library calls as _torch's, fewer Python steps."""

    # The plan is passed as an object, not its key: Function.apply walks tuple arguments with pytree, which for a key of
    # nested tuples costs more than the rest of apply.
    @staticmethod
    def forward(ctx, plan, q, k, v):
        r = plan.forward(q, k, v, True)
        if r is None:
            raise _Fallback()
        out, lse = r
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        key = ctx.plan.key
        plan = _plans().get(key)  # this thread's (autograd may run the backward on another thread)
        if plan is None:
            try:
                plan = _plans()[key] = _Plan(key, q, k, v)
            except _Fallback:
                plan = None
        grads = plan.backward(dout, q, k, v, out, lse) if plan is not None else None
        if grads is None:
            # the full path: raises the library's error, or copies a layout it refuses
            grads = _full_backward(dout, q, k, v, out, lse, key)
        return (None,) + grads


def _full_backward(dout, q, k, v, out, lse, key):
    softmax_scale, causal, window_size, softcap, deterministic = key[-5:]
    opts = _torch._Options(q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                           deterministic=deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dout.dtype != out.dtype:
        dout = dout.to(out.dtype)
    _torch._backward(dout, q, k, v, out, lse.contiguous(), opts, dq, dk, dv)
    return dq, dk, dv


def _plans():
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = {}
    return plans


_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_MAX_PLANS = 256  # per thread; the cache is cleared when full (shapes that keep changing get no benefit)


def fast_flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs):
    """flash_attn_func's result for a plain eager call on (B, N, H, D) tensors with no tensor options, through this
    thread's plan for the call's key; None when the call must take the full path (not plain eager tensors, no plan
    yet, the library refused it)."""
    if not (type(q) is _T and type(k) is _T and type(v) is _T) or not _EAGER_FAST_PATH or _compiling() \
            or _dispatch_stack_len() or _functorch_active() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    try:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), softmax_scale, causal, window_size, softcap,
               deterministic)
        plans = _local.plans
        plan = plans.get(key)
    except (AttributeError, TypeError):  # no plans on this thread yet; an unhashable option (a list)
        plans = _plans()
        plan = None
    if plan is None:
        # this call takes the full path (its checks, its errors); the next ones with this key the plan
        _build(plans, key, q, k, v)
        return None
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        try:
            out, lse = _FastFunction.apply(plan, q, k, v)
        except _Fallback:
            return None
    else:
        r = plan.forward(q, k, v, return_attn_probs)
        if r is None:
            return None
        out, lse = r
    return (out, lse, None) if return_attn_probs else out


def _build(plans, key, q, k, v):
    """Plans the key when the full path's Python checks pass (float32 / float16 / bfloat16 tensors of one dtype on one
    device, 4-d) and the library takes the problem as it lies (flashc_supported); otherwise no plan, and every call
    with the key takes the full path."""
    try:
        hash(key)
    except TypeError:  # an unhashable option (window_size as a list)
        return
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    if 0 in q.shape or 0 in k.shape:
        return
    try:
        _torch._check("q", q)
        if not (k.dtype == v.dtype == q.dtype and q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape
                and q.device == k.device == v.device and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]):
            return
        plans[key] = _Plan(key, q, k, v)
    except (_Fallback, TypeError, ValueError, _lib.FlashcError):
        return


from . import flash_attn_interface as _fai  # noqa: E402

_fai._fast = fast_flash_attn_func
