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
                deterministic, block_table=None, dropout_p=0.0, dropout_rng=None) -> (out, softmax_lse)
    flashc::bwd(dout, q, k, v, out, softmax_lse, <the same options>) -> (dq, dk, dv, dsinks)
    flashc::s_dmask(q, k, softmax_lse, <fwd's options but v, block_mask, sinks, deterministic, block_table>)
                -> flash-attn's S_dmask of a call with dropout (see flash_attn_interface; no gradient)

dropout_p > 0 needs dropout_rng, an int64 tensor (2,) holding the mask's (seed, offset) (taken mod 2**64), on q's
device (another device's is copied there): the library reads it through its address (flashc_params.dropout_rng), the
CUDA kernels from device memory when they run, so the operators never read it on the host and a CUDA graph replays
whatever it holds then. The callers draw it from torch's generator with torch.randint (_torch.dropout_rng), which
torch.compile keeps in the graph beside the operator and a CUDA graph records (a fresh pair each replay), and the
autograd formula hands the saved tensor to bwd so the backward drops the same elements. s_dmask copies it to the
host (flashc_dropout_mask runs there): a synchronization on CUDA, refused under capture. dropout_p = 0 (the default)
sets no dropout field: the calls without dropout are the same as before these arguments existed.

out is contiguous with q's shape and dtype; softmax_lse fp32 (B, H, Nq), varlen (H, total_q). dq, dk, dv are laid
out as torch.empty_like(q / k / v); dsinks is fp32 (H,), or (0,) without sinks. With block_table (num_seqs,
max_pages) int32 (varlen only), k and v are page pools (num_pages, page_size, Hkv, D) and so are dk, dv. Neither op
writes its inputs (no mutated arguments). deterministic only concerns the backward; the forward takes it so that the
autograd formula sees it. Gradients flow to q, k, v and sinks; softmax_lse is not differentiable (as in
flashc.attention).
"""

import ctypes
import sys as _sys
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
             block_table, dropout_p, dropout_rng):
    varlen = cu_seqlens_q is not None
    return _torch._Options(
        q4, k4, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, block_mask=block_mask,
        block_size=(block_q, block_k) if block_mask is not None else None,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        deterministic=deterministic, seqused_k=seqused_k, sinks=sinks, block_table=block_table, dropout_p=dropout_p,
        dropout_rng=dropout_rng)


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
         deterministic: bool, block_table: Optional[Tensor] = None, dropout_p: float = 0.0,
         dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    q4, k4, v4 = _as4(varlen, block_table, q, k, v)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic, block_table, dropout_p, dropout_rng)
    out4, lse = _torch._forward(q4, k4, v4, opts)
    return (out4[0] if varlen else out4), lse


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks, deterministic,
              block_table=None, dropout_p=0.0, dropout_rng=None):
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
         block_table: Optional[Tensor] = None, dropout_p: float = 0.0,
         dropout_rng: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    q4, k4, v4 = _as4(varlen, block_table, q, k, v)
    dq4, dk4, dv4 = _as4(varlen, block_table, dq, dk, dv)
    out4, do4 = (out.unsqueeze(0), dout.unsqueeze(0)) if varlen else (out, dout)
    if do4.dtype != out4.dtype:
        do4 = do4.to(out4.dtype)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic, block_table, dropout_p, dropout_rng)
    lse = softmax_lse.to(torch.float32).contiguous()  # the forward's lse already is: no copy
    dsinks = torch.empty(opts.H if sinks is not None else 0, dtype=torch.float32, device=q.device)
    _torch._backward(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4, dsinks if sinks is not None else None)
    return dq, dk, dv, dsinks


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k,
              seqused_k, sinks, deterministic, block_table=None, dropout_p=0.0, dropout_rng=None):
    h = q.shape[-2]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((h if sinks is not None else 0,), dtype=torch.float32))


# fwd's arguments after q, k, v: which of them are tensors to save, and their order.
_TENSOR_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "block_mask", "seqused_k", "sinks", "block_table",
                   "dropout_rng")
_SCALAR_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right",
                   "softcap", "block_q", "block_k", "deterministic", "dropout_p")
_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_left", "window_right", "softcap", "alibi_slopes", "block_mask", "block_q", "block_k",
             "seqused_k", "sinks", "deterministic", "block_table", "dropout_p", "dropout_rng")


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


@torch.library.custom_op("flashc::s_dmask", mutates_args=())
def _s_dmask(q: Tensor, k: Tensor, softmax_lse: Tensor, cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float],
             causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             seqused_k: Optional[Tensor], dropout_p: float, dropout_rng: Tensor) -> Tensor:
    """flash-attn's S_dmask of a fwd call with these arguments (_torch.probs); not differentiable."""
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    q4, k4, _ = _as4(varlen, None, q, k, k)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, None, 0, 0, seqused_k, None, False, None,
                    dropout_p, dropout_rng)
    return _torch.probs(q4, k4, softmax_lse, opts)


@_s_dmask.register_fake
def _s_dmask_fake(q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_left, window_right, softcap, alibi_slopes, seqused_k, dropout_p, dropout_rng):
    if _check_varlen(cu_seqlens_q, cu_seqlens_k):
        return q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k))
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))


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
    if return_attn_probs:
        return _torch.apply(kind, inputs, varlen=varlen, return_probs=True, **options)
    out, _ = _torch.apply(kind, inputs, varlen=varlen, **options)
    return out


def run(kind, inputs, varlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, seqused_k=None, sinks=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None):
    """The body of flash-attn's six functions: inputs laid out as `kind` (see _unpack), varlen with cu_seqlens.
    Returns out, or (out, softmax_lse, S_dmask) with return_attn_probs, S_dmask None without dropout (see
    _torch.probs for what it holds with dropout). The direct path (plain eager tensors) and the operators run the
    same library calls with the same arguments, and draw dropout's (seed, offset) from the generator the same way:
    the same bits."""
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
    dropout_p = _core.check_dropout(dropout_p)
    if varlen and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("flashc: under torch.compile, torch.export, make_fx or a CUDA-graph capture, pass "
                         "max_seqlen_q and max_seqlen_k (max_seqlen) as ints: computing them from cu_seqlens would "
                         "read device memory, which a traced or captured graph cannot hold")
    q, k, v = _unpack(kind, inputs, varlen, block_table is not None)
    left, right = _core.window_pair(window_size)
    alibi_slopes, sinks = _tensor_options(q, alibi_slopes, sinks)
    rng = _torch.dropout_rng(q.device) if dropout_p else None  # the direct path's draw (_torch.apply)
    out, lse = torch.ops.flashc.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q if varlen else 0,
                                    max_seqlen_k if varlen else 0, softmax_scale, bool(causal), left, right,
                                    float(softcap or 0.0), alibi_slopes, None, 0, 0, seqused_k, sinks,
                                    bool(deterministic), block_table, dropout_p, rng)
    if not return_attn_probs:
        return out
    s_dmask = None
    if dropout_p:
        s_dmask = torch.ops.flashc.s_dmask(q.detach(), k.detach(), lse, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q if varlen else 0, max_seqlen_k if varlen else 0,
                                           softmax_scale, bool(causal), left, right, float(softcap or 0.0),
                                           alibi_slopes, seqused_k, dropout_p, rng)
    return out, lse, s_dmask


# flashc.ops.flash_attn_func and flash_attn_varlen_func are flashc's own (they route here).
from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402


# ---- the direct path's per-shape plans (host time) -----------------------------------------------------------------
# A plain eager call of flash_attn_func or flashc.attention on (B, N, H, D) tensors with no tensor options, or of
# flashc.scaled_dot_product_attention on (B, H, N, D) tensors without attn_mask, spends most of its host time on work
# that depends only on the shapes, strides, dtypes, devices and scalar options: argument checks, views, the
# flashc_params struct, the flashc_tensor views, the workspace size. A plan holds that work for one such key, per
# thread (each thread has its own library contexts, and the views' data pointers are set per call, so a plan must not
# be shared by threads whose calls run at once: ctypes releases the GIL during the library call). The first call with
# a key takes the full path (its checks, its errors); it plans the key first when the full path's Python checks pass
# and the library takes the problem as it lies (flashc_supported, no copy). Later calls with the key make the same
# library call with the same arguments through the plan, so they give the same bits (results and gradients, laid out
# as the full path lays them out), and any failure status sends the call back to the full path, which raises or
# copies as it always does. The forward without autograd passes no lse pointer unless the lse is returned (the
# library then skips that store).
#
# SDPA's (B, H, N, D) tensors need no transposed views: the plan's flashc_tensor views carry the (B, N, H, D)
# shapes and strides (the full path's transposes, as numbers), and the autograd function takes and returns the
# caller's tensors, out laid out as the full path's out4.transpose(1, 2).
_local = threading.local()
_BNHD, _BHND = 0, 1  # how a plan's 4-d tensors hold (B, N, H, D): as they are (flash-attn), or as SDPA's (B, H, N, D)
_OK = _lib.STATUS_OK


def _to4(t, layout):
    """The full path's (B, N, H, D) view of a caller's 4-d tensor (_torch.sdpa's bnhd() for SDPA tensors)."""
    return t if layout == _BNHD else t.transpose(1, 2)


def _from4(t4, layout):
    """A (B, N, H, D) tensor as the full path hands it to the caller: SDPA's output, and its gradients as autograd
    takes them back through the transpose of _to4."""
    return t4 if layout == _BNHD else t4.transpose(1, 2)


_empty_like = torch.empty_like
_empty_strided = torch.empty_strided


class _Fallback(Exception):
    """Raised inside the fast autograd function's forward when the library refuses the call: the full path runs."""


class _Plan:
    __slots__ = ("key", "layout", "options", "thread", "ctx", "device", "index", "cuda", "params", "views", "vq", "vk",
                 "vv", "vo", "vdq", "vdk", "vdv", "vdo", "out_shape", "out_stride", "out_like_q", "grad_alloc",
                 "do_stride", "lse_like", "fwd_ws", "bwd_ws", "fwd_ws_like", "bwd_ws_like", "peer", "cpp_params")

    def __init__(self, key, layout, q, k, v, softmax_scale, causal, window, softcap, deterministic):
        """q, k, v: tensors of the call being planned, in `layout`; the options as the full path resolves them."""
        self.key = key
        self.layout = layout
        self.options = (softmax_scale, causal, window, softcap, deterministic)
        self.thread = _get_ident()
        self.peer = None  # the plan for this key of the last other thread that ran a backward of this plan's forward
        device = q.device
        self.device = device
        self.cuda = device.type == "cuda"
        self.index = device.index  # a tensor's CUDA device always has one
        with _torch._device_guard(device):
            self.ctx = _torch._context(device)
        left, right = _core.window_pair(window)
        self.params = _core.make_params(softmax_scale=softmax_scale, causal=bool(causal), window=(left, right),
                                        softcap=float(softcap or 0.0), deterministic=bool(deterministic))
        # Tensors as the full path makes them, for this key: its (B, N, H, D) views of the inputs, out4 and the
        # gradients' tensors, and what the caller gets (for SDPA transposed). Each call allocates out and the gradients
        # with those strides, by torch.empty_like of q, k, v where that gives them (SDPA's usual inputs, transposes of
        # (B, N, H, D) tensors, included), and points these views at them.
        q4, k4, v4 = (_to4(t, layout) for t in (q, k, v))
        out4 = torch.empty(q4.shape, dtype=q.dtype, device=device)
        grads4 = [torch.empty_like(t) for t in (q4, k4, v4)]
        out = _from4(out4, layout)
        grads = [_from4(g, layout) for g in grads4]
        self.out_shape = tuple(out.shape)
        self.do_stride = None
        self.out_stride = out.stride()
        self.out_like_q = torch.empty_like(q).stride() == self.out_stride
        like = all(torch.empty_like(t).stride() == g.stride() for t, g in zip((q, k, v), grads))
        self.grad_alloc = None if like else [(tuple(g.shape), g.stride()) for g in grads]
        # torch.empty_like of a broadcast fp32 scalar gives a new contiguous (B, H, Nq) tensor (a stride-0 input is not
        # dense, so its strides are not kept), for half the host time of torch.empty(shape, dtype=, device=)
        self.lse_like = torch.empty((1,), dtype=torch.float32, device=device).expand(q4.shape[0], q4.shape[2],
                                                                                       q4.shape[1])
        # q, k, v, out, dq, dk, dv; dout's view is that of a dout laid out as out (set per call when autograd's is)
        self.views = [_torch._view(t) for t in (q4, k4, v4, out4)] + [_torch._view(g) for g in grads4]
        self.vq, self.vk, self.vv, self.vo, self.vdq, self.vdk, self.vdv = self.views
        self.vdo = _torch._view(_to4(out, layout))
        # flashc.cpp_autograd's function takes the params as bytes, and the workspace sizes below (it lays out out
        # and the gradients as the full path does, for either layout)
        self.cpp_params = bytes(self.params)
        self.fwd_ws = self.bwd_ws = 0
        self.fwd_ws_like = self.bwd_ws_like = None
        lib = _lib.lib
        with _torch._device_guard(device):
            st = _core.supported_status(self.ctx, *self.views[:3], self.params)
            if st != _OK:
                raise _Fallback()
            if self.cuda:
                n = ctypes.c_size_t(0)
                _lib.check(lib.flashc_forward_workspace_size(self.ctx.handle, *self.views[:3], self.params,
                                                             ctypes.byref(n)), "flashc_forward_workspace_size")
                self.fwd_ws = n.value
                _lib.check(lib.flashc_backward_workspace_size(self.ctx.handle, *self.views[:3], self.params,
                                                              ctypes.byref(n)), "flashc_backward_workspace_size")
                self.bwd_ws = n.value
                # each call's workspace: torch.empty_like of these broadcast bytes (see lse_like) gives a new
                # contiguous uint8 tensor of the size from torch's caching allocator, on the plan's device
                one = torch.empty((1,), dtype=torch.uint8, device=device)
                if self.fwd_ws:
                    self.fwd_ws_like = one.expand(self.fwd_ws)
                if self.bwd_ws:
                    self.bwd_ws_like = one.expand(self.bwd_ws)

    def for_this_thread(self, q, k, v):
        """This thread's plan for the key (autograd may run a backward on another thread than its forward's), made
        from these tensors when the thread has none; None when it cannot be planned."""
        plans = _plans()
        plan = plans.get(self.key)
        if plan is None:
            try:
                plan = plans[self.key] = _Plan(self.key, self.layout, q, k, v, *self.options)
            except _Fallback:
                return None
        return plan

    def forward(self, q, k, v, want_lse):
        """(out, lse or None), or None when the library refused the call (nothing is returned then)."""
        out = _empty_like(q) if self.out_like_q else _empty_strided(self.out_shape, self.out_stride, dtype=q.dtype,
                                                                    device=self.device)
        lse = _empty_like(self.lse_like) if want_lse else None
        vq, vk, vv, vo = self.vq, self.vk, self.vv, self.vo
        vq.data, vk.data, vv.data, vo.data = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        lse_ptr = lse.data_ptr() if want_lse else None
        if self.cuda:
            prev = _exchange_device(self.index)
            try:
                ctx = self.ctx
                ctx.set_stream(_current_raw_stream(self.index))
                ws = _empty_like(self.fwd_ws_like) if self.fwd_ws else None
                st = _lib.lib.flashc_forward(ctx.handle, vq, vk, vv, self.params, vo, lse_ptr,
                                             ws.data_ptr() if ws is not None else None, self.fwd_ws)
                del ws  # stream-ordered: reused only after the kernels queued so far
            finally:
                _restore_device(prev)
        else:
            ctx = self.ctx
            n = _lib._num_threads or _get_num_threads()  # as _lib.context sets it for the full path
            if n != ctx._threads:
                ctx.set_threads(n)
            st = _lib.lib.flashc_forward(ctx.handle, vq, vk, vv, self.params, vo, lse_ptr, None, 0)
        return (out, lse) if st == _OK else None

    def backward(self, dout, q, k, v, out, lse):
        """(dq, dk, dv) laid out as the full path's, or None when the library refused the call."""
        if dout.dtype != out.dtype:
            dout = dout.to(out.dtype)
        if self.grad_alloc is None:
            dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        else:
            (sq, tq), (sk, tk), (sv, tv) = self.grad_alloc
            device = self.device
            dq = _empty_strided(sq, tq, dtype=q.dtype, device=device)
            dk = _empty_strided(sk, tk, dtype=q.dtype, device=device)
            dv = _empty_strided(sv, tv, dtype=q.dtype, device=device)
        vq, vk, vv, vo, vdq, vdk, vdv = self.vq, self.vk, self.vv, self.vo, self.vdq, self.vdk, self.vdv
        vq.data, vk.data, vv.data, vo.data = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        vdq.data, vdk.data, vdv.data = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        st = dout.stride()
        if (st == self.out_stride or st == self.do_stride) and dout.shape == self.out_shape:
            vdo = self.vdo
            vdo.data = dout.data_ptr()
        else:  # autograd's dout may come in any layout
            vdo = _torch._view(_to4(dout, self.layout))
            if dout.shape == self.out_shape and list(vdo.stride) == list(self.vdo.stride):
                self.do_stride = st  # strides whose view is out's (they differ in size-1 dimensions only)
        # lse is the forward's own fp32 contiguous tensor (saved, never exposed to a layout change)
        if self.cuda:
            prev = _exchange_device(self.index)
            try:
                ctx = self.ctx
                ctx.set_stream(_current_raw_stream(self.index))
                ws = _empty_like(self.bwd_ws_like) if self.bwd_ws else None
                st = _lib.lib.flashc_backward(ctx.handle, vq, vk, vv, vo, vdo, lse.data_ptr(), self.params, vdq, vdk,
                                              vdv, ws.data_ptr() if ws is not None else None, self.bwd_ws)
                del ws
            finally:
                _restore_device(prev)
        else:
            ctx = self.ctx
            n = _lib._num_threads or _get_num_threads()
            if n != ctx._threads:
                ctx.set_threads(n)
            st = _lib.lib.flashc_backward(ctx.handle, vq, vk, vv, vo, vdo, lse.data_ptr(), self.params, vdq, vdk, vdv,
                                          None, 0)
        return (dq, dk, dv) if st == _OK else None


# torch.cuda.device(i)'s enter and exit without the context manager object (torch >= 2.1, below the 2.4 this module
# needs): _exchange_device(i) makes device i current and returns the one that was, _restore_device(prev) puts it back;
# both are C functions that leave a device that is already current alone. _current_raw_stream(i): the cudaStream_t of
# torch's current stream on device i.
_exchange_device = torch.cuda._exchange_device
_restore_device = torch.cuda._maybe_exchange_device
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


# How _FastFunction keeps what its backward needs. ctx.save_for_backward wraps each tensor in a SavedVariable, and
# unpacking out (an output) in the backward builds a new tensor: on small problems a visible share of the host time.
# Where that machinery does nothing a plain reference would not (no saved-tensor hooks active, as checkpointing and
# save_on_cpu push), the function holds the tensors itself and does SavedVariable's work by hand: it records their
# versions and refuses a backward after an in-place change as autograd does, holds out through a detached alias (no
# reference cycle through out's grad_fn; the alias shares out's version counter; a returned lse is not differentiable,
# so it has no grad_fn), and lets go of them after a backward that does not keep the graph (retain_graph=False),
# raising autograd's error on a second one.
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_default_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_HOLD = _keep_graph is not None and _default_hooks is not None
_HELD_NAMES = ("q", "k", "v", "out", "softmax_lse")


def _modified(name, t, was):
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: flashc "
        "attention's %s (%s %s) is at version %d; expected version %d instead" % (name, t.dtype, tuple(t.shape),
                                                                                  t._version, was))


class _FastFunction(torch.autograd.Function):
    """flashc's autograd function for a planned call: the same library calls as _torch's, fewer Python steps. It
    returns out alone unless the caller wants the lse (the lse is kept either way), so the common call has one
    differentiable output and no lse gradient for autograd to fill with zeros. ctx.held is (plan,) when the tensors
    went through ctx.save_for_backward, (plan, q, k, v, out alias, lse, their five versions) when held here, and
    (plan, None) once let go."""

    # The plan is passed as an object, not its key: Function.apply walks tuple arguments with pytree, which for a key of
    # nested tuples costs more than the rest of apply.
    @staticmethod
    def forward(ctx, plan, want_lse, q, k, v):
        r = plan.forward(q, k, v, True)
        if r is None:
            raise _Fallback()
        out, lse = r
        if not _HOLD or _default_hooks(False) is not None:
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.held = (plan,)
        else:
            o = out.detach()
            ctx.held = (plan, q, k, v, o, lse, q._version, k._version, v._version, o._version, lse._version)
        if not want_lse:
            return out
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient is never used: no zeros made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, *_dlse):
        held = ctx.held
        plan = held[0]
        if len(held) == 1:
            q, k, v, out, lse = ctx.saved_tensors
        elif len(held) == 2:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after they have "
                "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
                "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time "
                "or if you need to access saved tensors after calling backward.")
        else:
            _, q, k, v, out, lse, vq, vk, vv, vo, vl = held
            if q._version != vq or k._version != vk or v._version != vv or out._version != vo or lse._version != vl:
                for name, t, was in zip(_HELD_NAMES, (q, k, v, out, lse), (vq, vk, vv, vo, vl)):
                    if t._version != was:
                        raise _modified(name, t, was)
            if not _keep_graph():
                ctx.held = (plan, None)
        if dout is None:  # what materialization would have passed
            dout = torch.zeros_like(out)
        ident = _get_ident()
        if plan.thread != ident:
            # autograd runs CUDA backward passes on its own device threads: remember that thread's plan
            peer = plan.peer
            if peer is None or peer.thread != ident:
                peer = plan.peer = plan.for_this_thread(q, k, v)
            plan = peer
        grads = plan.backward(dout, q, k, v, out, lse) if plan is not None else None
        if grads is None:
            # the full path: raises the library's error, or copies a layout it refuses
            grads = _full_backward(held[0], dout, q, k, v, out, lse)
        return (None, None) + grads


_fast_apply = _FastFunction.apply
# flashc.cpp_autograd's module once enabled (its attention() replaces _fast_apply where a plan allows), else None.
# Read at each call, so a module that a background build loads later serves the keys planned before it too.
_cpp = None
_cpp_env = True  # FLASHC_CPP_AUTOGRAD still to be read (at the first planned call that needs gradients; again
# in a child forked mid-build)


def _cpp_module():
    """flashc.cpp_autograd's module for a planned call that needs gradients, else None. FLASHC_CPP_AUTOGRAD is read at
    the first such call (inference never starts a build); read the result once per call: a background build may set
    it between calls (never within one)."""
    global _cpp_env
    if _cpp_env:
        _cpp_env = False
        from . import cpp_autograd

        cpp_autograd._from_environment()
    return _cpp


def _cpp_apply(cpp, plan, q, k, v, return_lse, bhnd):
    """cpp.attention for a planned call: out, or (out, lse) with return_lse; None when the library refused the problem
    (its message: the full path raises or copies)."""
    try:
        return cpp.attention(q, k, v, plan.cpp_params, 0 if plan.cuda else _lib._num_threads or _get_num_threads(),
                             return_lse, bhnd, plan.fwd_ws, plan.bwd_ws)
    except RuntimeError:
        return None


def _full_backward(plan, dout, q, k, v, out, lse):
    """The full path's backward (_torch._backward on the (B, N, H, D) views) for a planned forward."""
    softmax_scale, causal, window, softcap, deterministic = plan.options
    layout = plan.layout
    if dout.dtype != out.dtype:
        dout = dout.to(out.dtype)
    do4, q4, k4, v4, out4 = (_to4(t, layout) for t in (dout, q, k, v, out))
    dq4, dk4, dv4 = (torch.empty_like(t) for t in (q4, k4, v4))
    opts = _torch._Options(q4, k4, softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                           deterministic=deterministic)
    _torch._backward(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4)
    return tuple(_from4(g, layout) for g in (dq4, dk4, dv4))


def _plans():
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = {}
    return plans


_T = torch.Tensor
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_get_num_threads = torch.get_num_threads
_get_ident = threading.get_ident
_MAX_PLANS = 256  # per thread; the cache is cleared when full (shapes that keep changing get no benefit)
# The scale and softcap types a plan's key may hold: a plan keeps the value it was made with, and a tensor option
# hashes by identity, so one changed in place would hit its old plan (those calls take the full path).
_SCALAR = (type(None), int, float)


# The entry points below (fast_flash_attn_func, fast_attention, fast_sdpa) each spell out the same steps inline, since
# at the shapes where host time matters every Python call level costs a visible share of the call: _eager's rule for
# three tensors in its cheapest order (plain tensors, not Parameters, which take the full path; no torch.compile,
# dispatch mode, torch.func transform or CUDA-graph capture), the key, this thread's plan for it (none yet: the call
# takes the full path and plans the key for the next ones; an unhashable key, an option given as a list, never gets
# one), then the plan with autograd when q, k or v requires a gradient, or its forward alone.
def fast_flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs):
    """flash_attn_func's result for a plain eager call on (B, N, H, D) tensors with no tensor options, through this
    thread's plan for the call's key; None when the call must take the full path (not plain eager tensors, no plan
    yet, the library refused it)."""
    if not (type(q) is _T and type(k) is _T and type(v) is _T and _EAGER_FAST_PATH and not _compiling()
            and not _dispatch_stack_len() and not _functorch_active()
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
            and type(softmax_scale) in _SCALAR and type(softcap) in _SCALAR):
        return None
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, softmax_scale, causal, window_size, softcap, deterministic)
    try:
        plan = _local.plans[key]
    except (AttributeError, KeyError, TypeError):
        # this call takes the full path (its checks, its errors); the next ones with this key the plan
        _build(_plans(), key, q, k, v)
        return None
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        cpp = _cpp_module()
        if cpp is not None:
            r = _cpp_apply(cpp, plan, q, k, v, return_attn_probs, False)
            if r is None:
                return None
        else:
            try:
                r = _fast_apply(plan, return_attn_probs, q, k, v)
            except _Fallback:
                return None
        return (r[0], r[1], None) if return_attn_probs else r
    r = plan.forward(q, k, v, return_attn_probs)
    if r is None:
        return None
    return (r[0], r[1], None) if return_attn_probs else r[0]


def fast_attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic):
    """flashc.attention's (out, softmax_lse) for a plain eager call on (B, N, H, D) tensors with no tensor options and
    no dropout, through this thread's plan for the call's key; None when the call must take the full path. The key
    and the plan are flash_attn_func's: the same library call on the same views, out and lse laid out alike (the full
    paths of both are _torch.apply), so either function's calls plan the key for the other."""
    if not (type(q) is _T and type(k) is _T and type(v) is _T and _EAGER_FAST_PATH and not _compiling()
            and not _dispatch_stack_len() and not _functorch_active()
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
            and type(softmax_scale) in _SCALAR and type(softcap) in _SCALAR):
        return None
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, softmax_scale, causal, window_size, softcap, deterministic)
    try:
        plan = _local.plans[key]
    except (AttributeError, KeyError, TypeError):
        _build(_plans(), key, q, k, v)
        return None
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        cpp = _cpp_module()
        if cpp is not None:
            return _cpp_apply(cpp, plan, q, k, v, True, False)
        try:
            return _fast_apply(plan, True, q, k, v)
        except _Fallback:
            return None
    return plan.forward(q, k, v, True)


def _room_for(plans, key):
    """Whether key can be planned (False for an unhashable option, window_size as a list); makes room in this
    thread's plans (cleared when full)."""
    try:
        hash(key)
    except TypeError:
        return False
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    return True


def _build(plans, key, q, k, v):
    """Plans the key when the full path's Python checks pass (float32 / float16 / bfloat16 tensors of one dtype on one
    device, 4-d) and the library takes the problem as it lies (flashc_supported); otherwise no plan, and every call
    with the key takes the full path."""
    if not _room_for(plans, key):
        return
    if 0 in q.shape or 0 in k.shape:
        return
    softmax_scale, causal, window_size, softcap, deterministic = key[-5:]
    try:
        _torch._check("q", q)
        if not (k.dtype == v.dtype == q.dtype and q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape
                and q.device == k.device == v.device and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]):
            return
        plans[key] = _Plan(key, _BNHD, q, k, v, softmax_scale, causal, window_size, softcap, deterministic)
    except (_Fallback, TypeError, ValueError, _lib.FlashcError):
        return


_SDPA = "sdpa"  # the last element of an SDPA key (its keys never equal flash_attn_func's)


def fast_sdpa(query, key, value, is_causal, scale, enable_gqa):
    """flashc.scaled_dot_product_attention's result for a plain eager call on 4-d (B, H, N, D) tensors without
    attn_mask or dropout, through this thread's plan for the call's key; None when the call must take the full path."""
    if not (type(query) is _T and type(key) is _T and type(value) is _T and _EAGER_FAST_PATH and not _compiling()
            and not _dispatch_stack_len() and not _functorch_active()
            and not (query.is_cuda and torch.cuda.is_current_stream_capturing()) and type(scale) in _SCALAR):
        return None
    k = (query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(), query.dtype, key.dtype,
         value.dtype, query.device, key.device, value.device, scale, is_causal, enable_gqa, _SDPA)
    try:
        plan = _local.plans[k]
    except (AttributeError, KeyError, TypeError):
        _build_sdpa(_plans(), k, query, key, value, is_causal, scale, enable_gqa)
        return None
    if _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        cpp = _cpp_module()
        if cpp is not None:
            return _cpp_apply(cpp, plan, query, key, value, False, plan.layout == _BHND)
        try:
            return _fast_apply(plan, False, query, key, value)
        except _Fallback:
            return None
    r = plan.forward(query, key, value, False)
    return None if r is None else r[0]


def _build_sdpa(plans, k, query, key, value, is_causal, scale, enable_gqa):
    """Plans an SDPA key when the full path (_torch.sdpa) would run the problem as one flashc call on the (B, N, H, D)
    transposes of 4-d inputs: its checks pass, and the causal mask keeps every key (top-left causal with Nq < Nk
    drops keys by a view, which the full path's autograd handles)."""
    if not _room_for(plans, k):
        return
    try:
        for n, t in (("query", query), ("key", key), ("value", value)):
            _torch._check(n, t)
        if not (query.dim() == key.dim() == value.dim() == 4 and key.dtype == value.dtype == query.dtype
                and query.device == key.device == value.device and key.shape == value.shape
                and query.shape[0] == key.shape[0] and query.shape[3] == key.shape[3]):
            return
        if 0 in query.shape or 0 in key.shape:
            return
        h, nq, hkv, nk = query.shape[1], query.shape[2], key.shape[1], key.shape[2]
        if h != hkv and not enable_gqa:
            return
        kept, causal, window = _torch._causal_args("top-left" if is_causal else None, nq, nk)
        if kept != nk:
            return
        plans[k] = _Plan(k, _BHND, query, key, value, scale, causal, window, 0.0, False)
    except (_Fallback, TypeError, ValueError, _lib.FlashcError):
        return


# ---- flash_attn_with_kvcache's plain calls (host time) ------------------------------------------------------------
# A decode loop calls flash_attn_with_kvcache once per layer and step with the same shapes, and on the CPU a small
# decode's library call is a few tens of microseconds: the full path's checks, option objects, views and allocations
# (_torch.with_kvcache, about 25 us on the 2-vCPU Zen 4 VM) were most of a call at H 8 / Hkv 2 / D 32, Nk 1024. A
# kvcache plan holds that work for one key, as the plans above do for flash_attn_func: a plain eager call on CPU tensors
# with no new keys, rotary tables, block table, batch indices, left padding, ALiBi or sinks, and cache_seqlens None or
# an int32 tensor (B,) on the CPU. Per call only the data pointers (and cache_seqlens' address) change; the first call
# with a key takes the full path and plans it when the library takes the problem as it lies. The same library call with
# the same arguments (no lse pointer unless the lse is returned): the same bits. CUDA calls keep the full path (their
# decode is meant to run in a CUDA graph, where host time does not count).
_KV = "kvcache"  # the last element of a kvcache key (never equal to flash_attn_func's or SDPA's keys)


class _KVPlan:
    __slots__ = ("ctx", "params", "vq", "vk", "vv", "vo", "out_like_q", "out_shape", "lse_like")

    def __init__(self, q, k_cache, v_cache, lens, softmax_scale, causal, window, softcap):
        self.ctx = _torch._context(q.device)
        self.params = _core.make_params(softmax_scale=softmax_scale, causal=bool(causal),
                                        window=_core.window_pair(window), softcap=float(softcap or 0.0),
                                        seqused_k_ptr=None if lens is None else lens.data_ptr())
        out4 = torch.empty(q.shape, dtype=q.dtype)  # the full path's out: contiguous (B, Nq, H, D)
        self.vq, self.vk, self.vv, self.vo = (_torch._view(t) for t in (q, k_cache, v_cache, out4))
        if _core.supported_status(self.ctx, self.vq, self.vk, self.vv, self.params) != _OK:
            raise _Fallback()
        self.out_like_q = torch.empty_like(q).stride() == out4.stride()
        self.out_shape = tuple(q.shape)
        self.lse_like = torch.empty((1,), dtype=torch.float32).expand(q.shape[0], q.shape[2], q.shape[1])

    def forward(self, q, k_cache, v_cache, lens, want_lse):
        """(out, lse or None), or None when the library refused the call."""
        out = _empty_like(q) if self.out_like_q else _empty(self.out_shape, dtype=q.dtype)
        lse = _empty_like(self.lse_like) if want_lse else None
        vq, vk, vv, vo = self.vq, self.vk, self.vv, self.vo
        vq.data, vk.data, vv.data, vo.data = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
        params = self.params
        if lens is not None:
            params.seqused_k = lens.data_ptr()
        ctx = self.ctx
        n = _lib._num_threads or _get_num_threads()
        if n != ctx._threads:
            ctx.set_threads(n)
        st = _lib.lib.flashc_forward(ctx.handle, vq, vk, vv, params, vo, lse.data_ptr() if want_lse else None, None, 0)
        return (out, lse) if st == _OK else None


_empty = torch.empty


def fast_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, window_size, softcap, return_lse):
    """flash_attn_with_kvcache's result for a plain eager call on CPU tensors (see above: no new keys and no tensor
    options but cache_seqlens), through this thread's plan for the call's key; None when the call must take the full
    path (not plain eager tensors, no plan yet, the library refused it)."""
    if not (type(q) is _T and type(k_cache) is _T and type(v_cache) is _T and _EAGER_FAST_PATH and not _compiling()
            and not _dispatch_stack_len() and not _functorch_active() and type(softmax_scale) in _SCALAR
            and type(softcap) in _SCALAR):
        return None
    lens = cache_seqlens
    if lens is None:
        lk = None
    elif type(lens) is _T:
        lk = (lens.shape, lens.stride(), lens.dtype, lens.device)
    else:
        return None
    key = (q.shape, k_cache.shape, v_cache.shape, q.stride(), k_cache.stride(), v_cache.stride(), q.dtype,
           k_cache.dtype, v_cache.dtype, q.device, k_cache.device, v_cache.device, lk,
           softmax_scale, causal, window_size, softcap, _KV)
    try:
        plan = _local.plans[key]
    except (AttributeError, KeyError, TypeError):
        _build_kvcache(_plans(), key, q, k_cache, v_cache, lens)
        return None
    r = plan.forward(q, k_cache, v_cache, lens, return_lse)
    if r is None:
        return None
    return r if return_lse else r[0]


def _build_kvcache(plans, key, q, k_cache, v_cache, lens):
    """Plans a kvcache key when the full path's Python checks pass for CPU tensors laid out as the library takes them
    (q (B, Nq, H, D), caches (B, Nk_max, Hkv, D) of one dtype; cache_seqlens None or a contiguous int32 (B,)) and the
    library takes the problem as it lies (flashc_supported); otherwise every call with the key takes the full path."""
    if not _room_for(plans, key):
        return
    softmax_scale, causal, window_size, softcap = key[-5:-1]
    try:
        _torch._check("q", q)
        if not (q.device.type == "cpu" and k_cache.device == v_cache.device == q.device
                and k_cache.dtype == v_cache.dtype == q.dtype and q.dim() == k_cache.dim() == 4
                and k_cache.shape == v_cache.shape and q.shape[0] == k_cache.shape[0]
                and q.shape[3] == k_cache.shape[3] and k_cache.shape[2] > 0 and q.shape[2] % k_cache.shape[2] == 0):
            return
        if 0 in q.shape or 0 in k_cache.shape:
            return
        if lens is not None and not (lens.dtype == torch.int32 and lens.device == q.device
                                     and tuple(lens.shape) == (q.shape[0],) and lens.is_contiguous()):
            return
        plans[key] = _KVPlan(q, k_cache, v_cache, lens, softmax_scale, causal, window_size, softcap)
    except (_Fallback, TypeError, ValueError, _lib.FlashcError):
        return


from . import flash_attn_interface as _fai  # noqa: E402

_fai._fast = fast_flash_attn_func
_fai._fast_kvcache = fast_kvcache
_torch._fast_sdpa = fast_sdpa
_sys.modules[__package__]._fast_attention = fast_attention
