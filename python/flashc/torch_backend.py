"""flashc as torch's flash-attention implementation: ``torch.nn.functional.scaled_dot_product_attention`` under the
flash backend (and everything else that calls torch's flash-attention operators) runs flashc.

    import flashc.torch_backend
    flashc.torch_backend.enable()          # SDPA's flash backend, torch.nn.attention.varlen, context parallel: flashc
    ...
    flashc.torch_backend.disable()         # torch's own kernels again

(The module is not called ``flashc.torch``: a submodule named torch would shadow the torch package for any code run
from inside python/flashc, and ``flashc.torch`` next to ``torch`` reads as if it were torch's namespace.)

How: torch dispatches SDPA's flash backend to aten operators, and this module registers flashc's kernels for them with
``torch.library.Library("aten", "IMPL")`` at the CUDA and CPU dispatch keys (below autograd, so torch's own autograd
formulas, fake kernels and torch.compile handling stay as they are):

    CUDA: aten::_scaled_dot_product_flash_attention, aten::_scaled_dot_product_flash_attention_backward (SDPA's flash
          backend, torch's context parallelism), aten::_flash_attention_forward, _flash_attention_backward and
          _flash_attention_forward_no_dropout_inplace (torch.nn.attention.varlen, flash-attn-style callers).
    CPU:  aten::_scaled_dot_product_flash_attention_for_cpu and its _backward (SDPA's flash backend on the CPU).

Where torch has the flash-attention registry (``torch.nn.attention.register_flash_attention_impl`` /
``activate_flash_attention_impl``, as its FA3 / FA4 providers use; found by feature, not by version), enable()
registers flashc there under the name "flashc" and activates it, so it replaces (and is replaced by) FA3 / FA4 the
registry's way. Without the registry the same registration is made and kept here.

What flashc does not take goes to the kernel torch had registered for that operator and key before (taken with
``torch.library.get_kernel`` at enable(), so the call never comes back here): dropout_p > 0, an attn_mask (CPU),
return_debug_mask, is_causal with Nq != Nk on the SDPA operators (torch's is_causal is top-left there; flashc's
flash-attn-style operators keep flash-attn's bottom-right causal), float64 or mixed dtypes, float32 on CUDA (flashc
would run it on bf16 operands), head dims other than q's for v or above 256, empty problems, CUDA tensors when the
loaded libflashc has no CUDA backend, and anything the library answers NOT_SUPPORTED (e.g. paged K/V on CUDA).
A torch without get_kernel (older than 2.9) cannot call its own kernel from an override: those calls raise
NotImplementedError naming the reason and disable().

``calls`` counts the calls flashc ran, per operator; ``fallbacks`` the calls handed to torch, per operator and reason.
"""

import collections
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from . import _core, _lib, _torch

__all__ = ["enable", "disable", "is_enabled", "calls", "fallbacks", "IMPL_NAME"]

IMPL_NAME = "flashc"

calls: "collections.Counter[str]" = collections.Counter()
fallbacks: "collections.Counter[Tuple[str, str]]" = collections.Counter()

_ORIGINAL: Dict[Tuple[str, str], Any] = {}  # (operator, dispatch key) -> torch's kernel before enable()
_ACTIVE: Optional["_Handle"] = None  # without torch's registry: our own registration
_NOT_SUPPORTED = object()


class _Handle:
    """What the registry keeps while flashc is active; remove() drops the registrations (torch's kernels return)."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None
        _ORIGINAL.clear()


# ---- what flashc takes ----------------------------------------------------------------------------------------------
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _refusal(query, key, value, dropout_p):
    """Why flashc does not take this problem, or None."""
    if dropout_p:
        return "dropout_p > 0"
    cuda = query.is_cuda
    if query.device.type not in ("cpu", "cuda"):
        return "device %s" % query.device.type
    if cuda and not _cuda_ready():
        return "the loaded libflashc has no CUDA backend or sees no GPU"
    dtypes = _CUDA_DTYPES if cuda else _CPU_DTYPES
    if query.dtype not in dtypes or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtype %s/%s/%s" % (query.dtype, key.dtype, value.dtype)
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d or d > 256:
        return "head dims %d/%d/%d" % (d, key.shape[-1], value.shape[-1])
    if query.numel() == 0 or key.numel() == 0:
        return "empty problem"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_ready():
    return _lib.backend_compiled(_lib.BACKEND_CUDA) and _lib.device_count(_lib.BACKEND_CUDA) > 0


@functools.lru_cache(maxsize=None)
def _schema_names(op):
    """The argument names of aten::op in this torch (its keyword-only arguments differ between versions: torch 2.11's
    _flash_attention_forward has no block_table or num_splits)."""
    return frozenset(a.name for a in getattr(torch.ops.aten, op).default._schema.arguments)


def _fallback(op, key, reason, keyset, args, kwargs):
    fallbacks[(op, reason)] += 1
    kernel = _ORIGINAL.get((op, key))
    if kernel is None:
        raise NotImplementedError(
            "flashc.torch_backend: flashc does not take this aten::%s call (%s), and this torch (%s) has no "
            "torch.library.get_kernel to hand it to its own kernel; call flashc.torch_backend.disable() for such "
            "calls" % (op, reason, torch.__version__))
    names = _schema_names(op)
    extra = [n for n, v in kwargs.items() if n not in names and v is not None]
    if extra:  # cannot happen for a call torch made (it passes only its schema's arguments)
        raise NotImplementedError("flashc.torch_backend: aten::%s in torch %s has no argument %s"
                                  % (op, torch.__version__, ", ".join(extra)))
    return kernel.call_boxed(keyset, *args, **{n: v for n, v in kwargs.items() if n in names})


# ---- library calls into given outputs ---------------------------------------------------------------------------
def _forward_into(q4, k4, v4, out4, lse, opts):
    """flashc_forward writing out4 (any strides) and lse (fp32, contiguous); _NOT_SUPPORTED when the backend refuses
    the problem (torch's kernel takes it then), FlashcError on any other failure."""
    device = q4.device
    params = opts.params()
    lib = _lib.lib
    with _torch._device_guard(device):
        ctx = _torch._context(device)
        views = [_torch._view(t) for t in (q4, k4, v4)]
        ws, wp, wn, st = _torch._workspace(ctx, device, lib.flashc_forward_workspace_size, views, params)
        if st == _lib.STATUS_OK:
            st = _core.forward_status(ctx, *views, params, _torch._view(out4), lse.data_ptr(), wp, wn)
        del ws  # stream-ordered: reused only after the kernels queued so far
        if st == _lib.STATUS_NOT_SUPPORTED:
            return _NOT_SUPPORTED
        _lib.check(st, "flashc_forward", ctx.handle)
    return None


def _backward_into(do4, q4, k4, v4, out4, lse, opts, dq4, dk4, dv4):
    device = q4.device
    params = opts.params()
    lib = _lib.lib
    with _torch._device_guard(device):
        ctx = _torch._context(device)
        iv = [_torch._view(t) for t in (q4, k4, v4, out4, do4)]
        ws, wp, wn, st = _torch._workspace(ctx, device, lib.flashc_backward_workspace_size, iv[:3], params)
        if st == _lib.STATUS_OK:
            st = _core.backward_status(ctx, *iv, lse.data_ptr(), params, *(_torch._view(t) for t in (dq4, dk4, dv4)),
                                       wp, wn)
        del ws
        if st == _lib.STATUS_NOT_SUPPORTED:
            return _NOT_SUPPORTED
        _lib.check(st, "flashc_backward", ctx.handle)
    return None


def _like_layout(query, shape):
    """A tensor of `shape` whose dimensions lie in memory in query's order (torch's meta functions allocate SDPA
    outputs so; a compiled graph relies on those strides)."""
    if tuple(query.shape) == tuple(shape):
        return torch.empty_like(query)
    order = sorted(range(query.dim()), key=lambda i: query.stride(i) or float("inf"))
    strides = [0] * query.dim()
    s = 1
    for i in order:
        strides[i] = s
        s *= shape[i]
    return torch.empty_strided(shape, strides, dtype=query.dtype, device=query.device)


def _rng(device):
    # SDPA's philox seed and offset, meaningless without dropout; shaped and typed as torch's meta functions say
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def _deterministic():
    return torch.are_deterministic_algorithms_enabled()


# ---- SDPA's flash operators (B, H, N, D); is_causal top-left: only square problems are taken ---------------------
def _sdpa_refusal(query, key, value, dropout_p, is_causal, scale):
    why = _refusal(query, key, value, dropout_p)
    if why is None and is_causal and query.shape[-2] != key.shape[-2]:
        why = "is_causal with Nq != Nk (top-left)"
    if why is None and scale is not None and scale == 0:
        why = "scale 0"
    return why


def _sdpa_forward(q, k, v, is_causal, scale, out, lse):
    """Runs flashc on (B, H, N, D) tensors into out (any layout) and a contiguous fp32 lse (B, H, Nq)."""
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    opts = _torch._Options(q4, k4, softmax_scale=scale, causal=is_causal)
    return _forward_into(q4, k4, v4, out.transpose(1, 2), lse, opts)


def _sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, dq, dk, dv):
    q4, k4, v4, o4, do4 = (t.transpose(1, 2) for t in (q, k, v, out, grad_out))
    opts = _torch._Options(q4, k4, softmax_scale=scale, causal=is_causal, deterministic=_deterministic())
    lse = lse.to(torch.float32).contiguous()
    if do4.dtype != o4.dtype:
        do4 = do4.to(o4.dtype)
    return _backward_into(do4, q4, k4, v4, o4, lse, opts, dq.transpose(1, 2), dk.transpose(1, 2),
                          dv.transpose(1, 2))


def _sdpa_flash(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    op = "_scaled_dot_product_flash_attention"
    why = "return_debug_mask" if return_debug_mask else _sdpa_refusal(query, key, value, dropout_p, is_causal, scale)
    if why is None:
        b, h, nq, _ = query.shape
        out = _like_layout(query, (*query.shape[:-1], value.shape[-1]))
        lse = torch.empty((b, h, nq), dtype=torch.float32, device=query.device)
        if _sdpa_forward(query, key, value, is_causal, scale, out, lse) is None:
            calls[op] += 1
            seed, offset = _rng(query.device)
            debug = torch.empty(0, dtype=query.dtype, device=query.device)
            return out, lse, None, None, nq, key.shape[2], seed, offset, debug
        why = "NOT_SUPPORTED by libflashc"
    return _fallback(op, "CUDA", why, keyset, (query, key, value, dropout_p, is_causal, return_debug_mask),
                     dict(scale=scale))


def _sdpa_flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    op = "_scaled_dot_product_flash_attention_backward"
    why = _sdpa_refusal(query, key, value, dropout_p, is_causal, scale)
    if why is None:
        dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
        if _sdpa_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, dq, dk, dv) is None:
            calls[op] += 1
            return dq, dk, dv
        why = "NOT_SUPPORTED by libflashc"
    return _fallback(op, "CUDA", why, keyset, (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                               max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset),
                     dict(scale=scale))


def _sdpa_flash_cpu(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    op = "_scaled_dot_product_flash_attention_for_cpu"
    why = "attn_mask" if attn_mask is not None else _sdpa_refusal(query, key, value, dropout_p, is_causal, scale)
    if why is None and query.dim() != 4:
        why = "query not 4-d"
    if why is None:
        b, h, nq, _ = query.shape
        out = torch.empty_like(query)
        lse = torch.empty((b, h, nq), dtype=torch.float32)
        if _sdpa_forward(query, key, value, is_causal, scale, out, lse) is None:
            calls[op] += 1
            # torch's CPU kernel (and its meta function) lays the lse out as (B, Nq, H) seen as (B, H, Nq)
            lse_t = torch.empty((b, nq, h), dtype=torch.float32).transpose(1, 2)
            lse_t.copy_(lse)
            return out, lse_t
        why = "NOT_SUPPORTED by libflashc"
    return _fallback(op, "CPU", why, keyset, (query, key, value, dropout_p, is_causal),
                     dict(attn_mask=attn_mask, scale=scale))


def _sdpa_flash_cpu_backward(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                             attn_mask=None, scale=None):
    op = "_scaled_dot_product_flash_attention_for_cpu_backward"
    why = "attn_mask" if attn_mask is not None else _sdpa_refusal(query, key, value, dropout_p, is_causal, scale)
    if why is None:
        # (B, N, H, D) in memory, as torch's CPU kernel and its meta function lay the gradients out
        dq, dk, dv = (torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype) for t in (query, key, value))
        if _sdpa_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, dq, dk, dv) is None:
            calls[op] += 1
            return dq, dk, dv
        why = "NOT_SUPPORTED by libflashc"
    return _fallback(op, "CPU", why, keyset, (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal),
                     dict(attn_mask=attn_mask, scale=scale))


# ---- flash-attn-style operators: (B, N, H, D) or varlen (total, H, D); causal bottom-right ---------------------------
def _fa_options(query, key, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window_size_left,
                window_size_right, seqused_k=None, alibi_slopes=None, block_table=None, deterministic=False):
    varlen = cum_seq_q is not None
    q4 = query.unsqueeze(0) if varlen else query
    k4 = key.unsqueeze(0) if varlen and block_table is None else key
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    kw = dict(cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k, max_seqlen_q=max_q, max_seqlen_k=max_k) if varlen else {}
    opts = _torch._Options(q4, k4, softmax_scale=scale, causal=is_causal, window_size=(left, right),
                           alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table,
                           deterministic=deterministic, **kw)
    return opts, varlen


def _fa_forward(op, keyset, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table):
    """(out, lse) from flashc, or a refusal reason (str)."""
    why = "return_debug_mask" if return_debug_mask else _refusal(query, key, value, dropout_p)
    if why is None and (cum_seq_q is None) != (cum_seq_k is None):
        why = "cum_seq_q without cum_seq_k"
    if why is None and scale is not None and scale == 0:
        why = "scale 0"
    if why is not None:
        return why
    opts, varlen = _fa_options(query, key, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window_size_left,
                               window_size_right, seqused_k, alibi_slopes, block_table)
    if out is None:
        out = _like_layout(query, (*query.shape[:-1], value.shape[-1]))
    lse = torch.empty((query.shape[1], query.shape[0]) if varlen else (query.shape[0], query.shape[2], query.shape[1]),
                      dtype=torch.float32, device=query.device)
    q4, o4 = (query.unsqueeze(0), out.unsqueeze(0)) if varlen else (query, out)
    k4, v4 = (key.unsqueeze(0), value.unsqueeze(0)) if varlen and block_table is None else (key, value)
    if _forward_into(q4, k4, v4, o4, lse, opts) is not None:
        return "NOT_SUPPORTED by libflashc"
    calls[op] += 1
    return out, lse


def _flash_forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                   alibi_slopes=None, block_table=None, num_splits=None):
    op = "_flash_attention_forward"
    r = _fa_forward(op, keyset, None, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                    block_table)
    if not isinstance(r, str):
        seed, offset = _rng(query.device)
        return r[0], r[1], seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)
    return _fallback(op, "CUDA", r, keyset, (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                             is_causal, return_debug_mask),
                     dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                          seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table,
                          num_splits=num_splits))


def _flash_forward_inplace(keyset, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    op = "_flash_attention_forward_no_dropout_inplace"
    r = _fa_forward(op, keyset, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                    block_table)
    if not isinstance(r, str):
        return r[1]
    return _fallback(op, "CUDA", r, keyset, (out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                             is_causal, return_debug_mask),
                     dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                          seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table,
                          num_splits=num_splits))


def _flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                    window_size_right=None):
    op = "_flash_attention_backward"
    why = _refusal(query, key, value, dropout_p)
    if why is None and (cum_seq_q is None) != (cum_seq_k is None):
        why = "cum_seq_q without cum_seq_k"
    if why is None and scale is not None and scale == 0:
        why = "scale 0"
    if why is None:
        opts, varlen = _fa_options(query, key, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                                   window_size_left, window_size_right, deterministic=_deterministic())
        dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
        ts = (grad_out, query, key, value, out, dq, dk, dv)
        do4, q4, k4, v4, o4, dq4, dk4, dv4 = (t.unsqueeze(0) for t in ts) if varlen else ts
        if do4.dtype != o4.dtype:
            do4 = do4.to(o4.dtype)
        lse = logsumexp.to(torch.float32).contiguous()
        if _backward_into(do4, q4, k4, v4, o4, lse, opts, dq4, dk4, dv4) is None:
            calls[op] += 1
            return dq, dk, dv
        why = "NOT_SUPPORTED by libflashc"
    return _fallback(op, "CUDA", why, keyset, (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                               max_q, max_k, dropout_p, is_causal, rng_state, unused),
                     dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right))


# (operator, dispatch key, kernel)
_KERNELS: Tuple[Tuple[str, str, Callable[..., Any]], ...] = (
    ("_scaled_dot_product_flash_attention", "CUDA", _sdpa_flash),
    ("_scaled_dot_product_flash_attention_backward", "CUDA", _sdpa_flash_backward),
    ("_flash_attention_forward", "CUDA", _flash_forward),
    ("_flash_attention_forward_no_dropout_inplace", "CUDA", _flash_forward_inplace),
    ("_flash_attention_backward", "CUDA", _flash_backward),
    ("_scaled_dot_product_flash_attention_for_cpu", "CPU", _sdpa_flash_cpu),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "CPU", _sdpa_flash_cpu_backward),
)


def _has_op(name):
    try:
        getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):
        return False
    return True


def _register(devices: Tuple[str, ...]) -> _Handle:
    """Registers flashc's kernels for the aten flash operators at the given dispatch keys, after taking torch's own
    kernels for the fallback."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that each registration overrides its kernel: that is the point
        warnings.simplefilter("ignore")
        for op, key, fn in _KERNELS:
            if key.lower() not in devices or not _has_op(op):
                continue
            if get_kernel is not None:
                _ORIGINAL[(op, key)] = get_kernel("aten::" + op, key)
            lib.impl(op, fn, key, with_keyset=True)
    return _Handle(lib)


def _registry():
    attention = torch.nn.attention
    names = ("register_flash_attention_impl", "activate_flash_attention_impl", "current_flash_attention_impl",
             "restore_flash_attention_impl")
    return attention if all(hasattr(attention, n) for n in names) else None


def has_torch_registry() -> bool:
    """Whether this torch has torch.nn.attention.register_flash_attention_impl / activate_flash_attention_impl."""
    return _registry() is not None


def enable(devices: Iterable[str] = ("cuda", "cpu")) -> None:
    """Makes flashc torch's flash-attention implementation on `devices` ("cuda", "cpu"): afterwards
    F.scaled_dot_product_attention with the flash backend (sdpa_kernel(SDPBackend.FLASH_ATTENTION), or torch's own
    choice of it), torch.nn.attention.varlen and torch's context parallelism run flashc, and what flashc does not take
    runs torch's kernel (see the module's docstring). Calling it again replaces the registration."""
    global _ACTIVE
    devices = tuple(d.lower() for d in ([devices] if isinstance(devices, str) else devices))
    bad = [d for d in devices if d not in ("cuda", "cpu")]
    if bad:
        raise ValueError("flashc.torch_backend.enable: devices are 'cuda' and 'cpu', got %s" % bad)
    disable()
    registry = _registry()
    if registry is not None:
        registry.register_flash_attention_impl(IMPL_NAME, register_fn=functools.partial(_register, devices))
        registry.activate_flash_attention_impl(IMPL_NAME)
    else:
        _ACTIVE = _register(devices)


def disable() -> None:
    """Gives torch's flash-attention operators their own kernels back (no-op when flashc is not enabled)."""
    global _ACTIVE
    registry = _registry()
    if registry is not None and registry.current_flash_attention_impl() == IMPL_NAME:
        registry.restore_flash_attention_impl()
    if _ACTIVE is not None:
        _ACTIVE.remove()
        _ACTIVE = None


def is_enabled() -> bool:
    registry = _registry()
    if registry is not None and registry.current_flash_attention_impl() == IMPL_NAME:
        return True
    return _ACTIVE is not None
