"""flashc: exact, IO-aware softmax attention (FlashAttention) from a C library, for numpy and torch.

Two ways to call it:

* flashc's own: ``out, lse = flashc.attention(q, k, v, causal=True, ...)`` on numpy arrays (CPU) or torch tensors
  (CPU or CUDA, differentiable), layout (B, N, H, D); ``flashc.attention_backward(dout, q, k, v, out, lse, ...)``
  gives dq, dk, dv without autograd.
* ``flashc.merge_attention(out_a, lse_a, out_b, lse_b)`` merges two partial results over disjoint keys (cascade
  attention, ring / context parallelism).
* drop-in: flash-attn 2.x's functions (``flashc.flash_attn_func`` and friends, also importable from
  ``flashc.flash_attn_interface``) and ``flashc.scaled_dot_product_attention`` with torch's (B, H, N, D) layout.

Importing flashc loads libflashc (from $FLASHC_LIBRARY, the installed package, or the repository's build tree)
but not torch; torch is imported when a torch tensor is first passed in.
"""

import sys as _sys
from typing import Any, Optional, Sequence, Tuple, Union

from . import _lib
from ._core import FlashcCopyWarning
from ._lib import FlashcError, cpu_features, get_num_threads, library_path, set_num_threads
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "0.6.0"

# numpy arrays (CPU) or torch tensors (CPU, CUDA): the functions below take either (torch is not imported here)
Array = Any

__all__ = [
    "FlashcError", "FlashcCopyWarning", "attention", "attention_backward", "scaled_dot_product_attention",
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
    "merge_attention", "library_version", "library_path", "cuda_available", "cpu_features", "set_num_threads",
    "get_num_threads",
]


def library_version() -> str:
    """The loaded libflashc's version string."""
    return _lib.version()


def cuda_available() -> bool:
    """True when the loaded libflashc has the CUDA backend and sees at least one GPU."""
    return _lib.backend_compiled(_lib.BACKEND_CUDA) and _lib.device_count(_lib.BACKEND_CUDA) > 0


def _is_torch(x):
    torch = _sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _fast_attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic):
    """flashc.ops.fast_attention (the per-shape plans' entry), which replaces this function once flashc.ops is
    imported (importing it imports torch: only torch tensors come here)."""
    from . import ops

    return ops.fast_attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic)


def attention(q: Array, k: Array, v: Array, *, softmax_scale: Optional[float] = None, causal: bool = False,
              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Array] = None,
              block_mask: Optional[Array] = None, block_size: Union[int, Tuple[int, int], None] = None,
              cu_seqlens_q: Optional[Array] = None, cu_seqlens_k: Optional[Array] = None,
              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, dropout_p: float = 0.0,
              deterministic: bool = False, seqused_k: Optional[Array] = None,
              sinks: Optional[Array] = None) -> Tuple[Array, Array]:
    """Attention forward: returns (out, softmax_lse).

    q (B, Nq, H, D), k and v (B, Nk, Hkv, D), any strides; or, with cu_seqlens_q / cu_seqlens_k (int32, B + 1
    offsets), packed q (total_q, H, D), k and v (total_k, Hkv, D). numpy arrays (float32, float16) run on the CPU;
    torch tensors (float32, float16, bfloat16) run where they live and are differentiable w.r.t. q, k, v.

    softmax_scale: None for 1/sqrt(D). causal: bottom-right aligned (query i sees key j iff j <= i + Nk - Nq).
    window_size (left, right), -1 unbounded. softcap > 0: s = softcap * tanh(s / softcap). alibi_slopes: (H,)
    or (B, H) fp32, s -= slope * |i + Nk - Nq - j|. block_mask: bytes (nqb, nkb), (H, nqb, nkb) or
    (B, H, nqb, nkb) with block_size=(rows, keys) per byte; 0 skips the block. max_seqlen_*: computed from
    cu_seqlens when left out. deterministic: bitwise-reproducible backward (torch autograd).
    seqused_k: int32 (B,) (varlen: one per sequence), the keys each sequence uses: sequence b attends to its first
    seqused_k[b] keys as if it had only those (causal, window and ALiBi align to that length); the keys past it are
    never read and get zero gradients. sinks: (H,) attention sinks, one logit per query head (natural log, not
    scaled) that joins every row's softmax denominator without a value; differentiable with torch tensors.
    dropout_p > 0 (torch tensors): fused attention dropout, the mask's (seed, offset) drawn from torch's generator on
    the tensors' device, read by the library in place (no host sync on CUDA) and replayed by the autograd backward
    (numpy arrays raise NotImplementedError; a CUDA backend without dropout raises FlashcError).

    out has q's shape and dtype ((B, Nq, H, D) or (total_q, H, D)); softmax_lse is fp32 (B, H, Nq) or (H, total_q),
    natural log, the sink included; rows that see no key get out 0 and lse +inf (with sinks: the head's sink).
    """
    torch_tensors = _is_torch(q)
    if (torch_tensors and alibi_slopes is None and block_mask is None and cu_seqlens_q is None
            and cu_seqlens_k is None and seqused_k is None and sinks is None and (dropout_p is None or dropout_p == 0)):
        # plain eager calls on tensors whose key was seen before (flashc.ops' per-shape plans); None otherwise
        r = _fast_attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic)
        if r is not None:
            return r
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, block_mask=block_mask, block_size=block_size, cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
              seqused_k=seqused_k, sinks=sinks)
    if torch_tensors:
        from . import _torch

        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        return _torch.apply("q,k,v", (q, k, v), varlen=varlen, deterministic=deterministic, **kw)
    from . import _numpy

    # deterministic only concerns the backward; the numpy forward has nothing to do with it.
    return _numpy.attention(q, k, v, **kw)


def attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, softmax_lse: Array, *,
                       softmax_scale: Optional[float] = None, causal: bool = False,
                       window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: Optional[Array] = None, block_mask: Optional[Array] = None,
                       block_size: Union[int, Tuple[int, int], None] = None, cu_seqlens_q: Optional[Array] = None,
                       cu_seqlens_k: Optional[Array] = None, max_seqlen_q: Optional[int] = None,
                       max_seqlen_k: Optional[int] = None, dropout_p: float = 0.0, deterministic: bool = False,
                       seqused_k: Optional[Array] = None, sinks: Optional[Array] = None) -> Sequence[Array]:
    """Attention backward: returns (dq, dk, dv) for the upstream gradient dout, given attention()'s out and
    softmax_lse and the same options (numpy arrays or torch tensors, no autograd). With GQA, dk/dv sum the
    gradients of the query heads that share a kv head. With sinks it returns (dq, dk, dv, dsinks), dsinks (H,)
    summed over the batch and rows (fp32; with torch, in the sinks tensor's dtype)."""
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, block_mask=block_mask, block_size=block_size, cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
              deterministic=deterministic, seqused_k=seqused_k, sinks=sinks)
    if _is_torch(q):
        from . import _torch

        return _torch.attention_backward(dout, q, k, v, out, softmax_lse, **kw)
    from . import _numpy

    return _numpy.attention_backward(dout, q, k, v, out, softmax_lse, **kw)


def merge_attention(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array, *, out: Optional[Array] = None,
                    lse: Optional[Array] = None) -> Tuple[Array, Array]:
    """Merges two partial attention results, each over its own set of keys, into the attention over both (cascade
    attention, split-KV, ring / context parallelism): returns (out, lse) with
        lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b,
    computed in fp32 and rounded once to the parts' dtype.

    out_a, out_b: (B, Nq, H, D), or (total_q, H, D) packed (varlen), any strides, one dtype; lse_a, lse_b: their
    softmax_lse as attention() returns it, (B, H, Nq) or (H, total_q). A part whose lse is +inf (a row that saw no key)
    or -inf is empty and not used: the other part comes out bit for bit; both empty give 0 and lse +inf. out and lse:
    where to write (new arrays when None); out may be out_a or out_b and lse may be lse_a or lse_b (in place, as
    FlashInfer's merge_state_in_place). numpy arrays run on the CPU; torch tensors where they live, and are
    differentiable w.r.t. all four inputs when out and lse are not given. More than two parts merge two at a time.
    """
    if _is_torch(out_a):
        from . import _torch

        return _torch.merge(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    from . import _numpy

    return _numpy.merge(out_a, lse_a, out_b, lse_b, out=out, lse=lse)


def scaled_dot_product_attention(query: Array, key: Array, value: Array, attn_mask: Optional[Array] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Array:
    """torch.nn.functional.scaled_dot_product_attention's interface: query (..., H, Nq, D), key/value
    (..., Hkv, Nk, D) -> (..., H, Nq, D), differentiable. is_causal is top-left aligned as in torch (query i sees
    keys j <= i). The (B, H, N, D) tensors are passed with permuted strides, not copied. attn_mask runs the masks
    flashc runs exactly (key padding with any set of keys, top-left or bottom-right causal, the two combined, all
    True), recognized by an exact check; other masks raise ValueError naming these forms (python/README.md).
    dropout_p > 0 drops attention probabilities (fused), the mask drawn from torch's generator so that
    torch.manual_seed replays it (see flashc.flash_attn_interface)."""
    from . import _torch

    return _torch.sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=enable_gqa)
