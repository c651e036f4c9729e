"""flashc's attention as torch operators: ``torch.ops.flashc.fwd`` and ``torch.ops.flashc.bwd``.

Registered with ``torch.library.custom_op`` (with a fake kernel for shape propagation and an autograd formula), so
that ``torch.compile(fullgraph=True)`` traces through a model that calls flashc without a graph break (the call
stays one opaque node; Inductor calls it as it is), ``torch.export`` keeps it, and CUDA-graph capture records its
kernels: the ops run on torch's current stream and take their workspace from torch's caching allocator, with no
host synchronization.

    import flashc.ops
    out = flashc.ops.flash_attn_func(q, k, v, causal=True)     # flash-attn's signature, as flashc.flash_attn_func

Importing this module imports torch and registers the ops (once per process). The ops call the same ctypes code
as flashc's torch front end (``_torch._Options``, ``_forward``, ``_backward``); they only add torch.library's
metadata around it. An eager call on plain tensors (nothing tracing or transforming it) skips the operators and
runs flashc.flash_attn_func's own path, with the same results: torch.library's Python dispatch and autograd wrapper
cost more host time than that whole path on small problems (a 2-core CPU VM, B 1 N 16 H 2 D 32: a forward
without autograd 53 us direct, 85 us through the operator; with autograd 77 against 239 us). Under torch.compile,
torch.export, make_fx, a dispatch mode or a torch.func transform the operators are used.

The operators (q, k, v are (B, N, H, D), or (total, H, D) packed with cu_seqlens_q / cu_seqlens_k):

    flashc::fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                deterministic) -> (out, softmax_lse)
    flashc::bwd(dout, q, k, v, out, softmax_lse, <the same options>) -> (dq, dk, dv, dsinks)

out is contiguous with q's shape and dtype; softmax_lse fp32 (B, H, Nq), varlen (H, total_q). dq, dk, dv are laid
out as torch.empty_like(q / k / v); dsinks is fp32 (H,), or (0,) without sinks. Neither op writes its inputs
(no mutated arguments). deterministic only concerns the backward; the forward takes it so that the autograd
formula sees it. Gradients flow to q, k, v and sinks; softmax_lse is not differentiable (as in flashc.attention).
"""

from typing import Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _core, _torch

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Tensor = torch.Tensor


# ---- the operators ---------------------------------------------------------------------------------------------
def _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
             window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks, deterministic):
    varlen = cu_seqlens_q is not None
    return _torch._Options(
        q4, k4, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, block_mask=block_mask,
        block_size=(block_q, block_k) if block_mask is not None else None,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        deterministic=deterministic, seqused_k=seqused_k, sinks=sinks)


def _check_varlen(cu_seqlens_q, cu_seqlens_k):
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("flashc: varlen needs both cu_seqlens_q and cu_seqlens_k")
    return cu_seqlens_q is not None


def _lse_shape(q, varlen):
    # (total_q, H, D) -> (H, total_q); (B, Nq, H, D) -> (B, H, Nq)
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("flashc::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
         window_right: int, softcap: float, alibi_slopes: Optional[Tensor], block_mask: Optional[Tensor],
         block_q: int, block_k: int, seqused_k: Optional[Tensor], sinks: Optional[Tensor],
         deterministic: bool) -> Tuple[Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v)) if varlen else (q, k, v)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic)
    out4, lse = _torch._forward(q4, k4, v4, opts)
    return (out4[0] if varlen else out4), lse


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks, deterministic):
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
         seqused_k: Optional[Tensor], sinks: Optional[Tensor],
         deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    varlen = _check_varlen(cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    q4, k4, v4, out4, do4, dq4, dk4, dv4 = (
        (t.unsqueeze(0) for t in (q, k, v, out, dout, dq, dk, dv)) if varlen else (q, k, v, out, dout, dq, dk, dv))
    if do4.dtype != out4.dtype:
        do4 = do4.to(out4.dtype)
    opts = _options(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k, seqused_k, sinks,
                    deterministic)
    lse = softmax_lse.to(torch.float32).contiguous()  # the forward's lse already is: no copy
    dsinks = torch.empty(opts.H if sinks is not None else 0, dtype=torch.float32, device=q.device)
    _torch._backward(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4, dsinks if sinks is not None else None)
    return dq, dk, dv, dsinks


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, block_mask, block_q, block_k,
              seqused_k, sinks, deterministic):
    h = q.shape[-2]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((h if sinks is not None else 0,), dtype=torch.float32))


# fwd's arguments after q, k, v: which of them are tensors to save, and their order.
_TENSOR_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "block_mask", "seqused_k", "sinks")
_SCALAR_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right",
                   "softcap", "block_q", "block_k", "deterministic")
_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_left", "window_right", "softcap", "alibi_slopes", "block_mask", "block_q", "block_k",
             "seqused_k", "sinks", "deterministic")


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


# ---- flash-attn's functions on the operators --------------------------------------------------------------------
# Eager calls on plain tensors skip the operators (see _eager): torch.library's Python dispatch and autograd wrapper
# cost more than the whole direct call on small problems. Tests turn it off to run the operators in eager mode.
_EAGER_FAST_PATH = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(*tensors):
    """Whether this call may take the direct path (flashc.flash_attn_func's own autograd function, the same library
    calls, the same bits): not under torch.compile / torch.export, on plain tensors (not fake, functional or
    subclass tensors such as DTensor), with no dispatch mode recording the calls (make_fx, FlopCounterMode) and no
    torch.func transform active. Anything else sees the operators."""
    if not _EAGER_FAST_PATH or torch.compiler.is_compiling():
        return False
    if any(isinstance(t, torch.Tensor) and type(t) not in _PLAIN for t in tensors):
        return False
    return _current_dispatch_mode() is None and not torch._C._are_functorch_transforms_active()


def _direct(return_attn_probs, inputs, varlen, **options):
    """The eager fast path: _torch.apply, what flashc.flash_attn_func runs (called directly, not through the public
    function, so that the public one can route to this module without a cycle)."""
    out, lse = _torch.apply("q,k,v", inputs, varlen=varlen, **options)
    return (out, lse, None) if return_attn_probs else out


def _prepare(names_and_tensors, varlen, dropout_p, window_size, alibi_slopes, sinks):
    """Checks as flashc.flash_attn_func makes them (each a Python check on metadata, which torch.compile traces
    as guards), and the sinks as fp32 on q's device: the cast happens here, under autograd, so the sinks' gradient
    comes back in their own dtype."""
    if dropout_p != 0.0:
        # only then: check_dropout's math.isnan is not traceable under torch.compile(dynamic=True), even on 0.0
        _core.check_dropout(dropout_p)
    q = names_and_tensors[0][1]
    device = q.device if isinstance(q, Tensor) else None
    for n, t in names_and_tensors:
        _torch._check(n, t, device)
        if t.dim() != (3 if varlen else 4):
            raise ValueError("flashc: %s must be %d-d %s, got shape %s"
                             % (n, 3 if varlen else 4, "(total, H, D)" if varlen else "(B, N, H, D)", tuple(t.shape)))
    left, right = _core.window_pair(window_size)
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32, device=device)
    if sinks is not None:
        sinks = torch.as_tensor(sinks)
        _core.check_sinks_shape(sinks.shape, q.shape[-2])
        sinks = sinks.to(device=device, dtype=torch.float32)
    return left, right, alibi_slopes, sinks


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, seqused_k=None, sinks=None):
    """flashc.flash_attn_func (flash-attn's signature and semantics) through torch.ops.flashc.fwd / bwd, for
    torch.compile(fullgraph=True), torch.export and CUDA graphs. Torch tensors only.

    q (B, Nq, H, D), k and v (B, Nk, Hkv, D) -> out (B, Nq, H, D), or (out, softmax_lse, None) with
    return_attn_probs. causal is bottom-right aligned; window_size (left, right), -1 unbounded; softcap > 0:
    softcap * tanh(s / softcap); alibi_slopes (H,) or (B, H) fp32; deterministic: bitwise-reproducible backward;
    seqused_k int32 (B,): batch b uses its first seqused_k[b] keys; sinks (H,): attention sinks, differentiable.
    Results are the same bits as flashc.flash_attn_func's (the same library calls); an eager call on plain tensors
    takes flashc.flash_attn_func's path itself, which costs less host time than the operators' dispatch."""
    if _eager(q, k, v, alibi_slopes, seqused_k, sinks):
        return _direct(return_attn_probs, (q, k, v), False, dropout_p=dropout_p, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       deterministic=deterministic, seqused_k=seqused_k, sinks=sinks)
    left, right, alibi_slopes, sinks = _prepare((("q", q), ("k", k), ("v", v)), False, dropout_p, window_size,
                                                alibi_slopes, sinks)
    out, lse = torch.ops.flashc.fwd(q, k, v, None, None, 0, 0, softmax_scale, bool(causal), left, right,
                                    float(softcap or 0.0), alibi_slopes, None, 0, 0, seqused_k, sinks,
                                    bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_k=None,
                           sinks=None):
    """flashc.flash_attn_varlen_func through the operators: q (total_q, H, D), k and v (total_k, Hkv, D), int32
    cu_seqlens_q / cu_seqlens_k (B + 1 offsets) -> out (total_q, H, D), or (out, softmax_lse (H, total_q), None)
    with return_attn_probs. max_seqlen_q and max_seqlen_k must be ints (as flash-attn requires): computing them
    from cu_seqlens would read device memory, a host sync that torch.compile cannot trace and a CUDA graph cannot
    hold. Other options as flash_attn_func."""
    if block_table is not None:
        raise NotImplementedError("flashc: paged KV cache (block_table) is not supported yet")
    if max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("flashc.ops.flash_attn_varlen_func: pass max_seqlen_q and max_seqlen_k as ints")
    if _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k, sinks):
        return _direct(return_attn_probs, (q, k, v), True, dropout_p=dropout_p, softmax_scale=softmax_scale,
                       causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       deterministic=deterministic, seqused_k=seqused_k, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    left, right, alibi_slopes, sinks = _prepare((("q", q), ("k", k), ("v", v)), True, dropout_p, window_size,
                                                alibi_slopes, sinks)
    out, lse = torch.ops.flashc.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    bool(causal), left, right, float(softcap or 0.0), alibi_slopes, None, 0, 0,
                                    seqused_k, sinks, bool(deterministic))
    return (out, lse, None) if return_attn_probs else out
