"""flash-attn 2.x's Python interface on flashc: the same function names, parameters, defaults, layouts and return
conventions, so that code written for flash-attn runs after changing the import:

    from flashc import flash_attn_func            # instead of: from flash_attn import flash_attn_func

Layouts (flash-attn's): q (B, Nq, H, D), k/v (B, Nk, Hkv, D), qkv (B, N, 3, H, D), kv (B, Nk, 2, Hkv, D); varlen
tensors drop the batch dimension and pack the sequences along the first one, described by int32 cu_seqlens
(B + 1 offsets). Returns out, or (out, softmax_lse, S_dmask) with return_attn_probs=True, where softmax_lse is
fp32 (B, H, Nq) or varlen (H, total_q).

dropout_p in [0, 1): each element of the attention probabilities P is dropped with probability dropout_p and the kept
ones scaled by 1 / (1 - dropout_p), fused in the kernels (forward and backward). Each call draws the mask's
(seed, offset) from torch's default generator for the tensors' device (torch.randint into an int64 tensor (2,) there),
so torch.manual_seed controls it and consecutive calls drop different elements; the backward replays the forward's
mask. The library reads the pair through its address (flashc_params.dropout_rng), never read back by Python: on CUDA
no host synchronization, and a captured CUDA graph draws a fresh pair on each replay. A libflashc whose CUDA backend
does not run dropout answers NOT_SUPPORTED, raised as FlashcError. softmax_lse is that of the undropped softmax, as in
flash-attn.

S_dmask is None without dropout (flashc's kernels never materialize P). With dropout it is flash-attn's "for testing
only" tensor: (B, H, Nq, Nk) in q's dtype (varlen: (num_seqs, H, max_seqlen_q, max_seqlen_k), each sequence in the
first rows and columns of its planes, 0 elsewhere) holding P = exp(s - softmax_lse), the normalized undropped
probabilities recomputed in fp32 from q, k and softmax_lse after every mask and score option (0 where a mask hides a
key), negated where dropout drops the element: where(keep, P, -P), keep from flashc_dropout_mask for the call's seed
and offset (computed on the host: on CUDA this copies the pair to the host, a synchronization, and is refused under
CUDA-graph capture). So S_dmask >= 0 marks the kept elements and O = (max(S_dmask, 0) / (1 - p)) V. flash-attn's
differs in that it holds P scaled by a running row maximum ("possibly with different scaling") and is padded to
multiples of 128; a masked entry there and here is 0 (or -0) whatever the mask says. It carries no gradient.

Two keyword-only arguments of flashc's own follow flash-attn's on every function (its positional order is kept):

* seqused_k: int32 (B,) (varlen: one per sequence), the keys each sequence uses, as flash-attn's C API and
  flash-attn 3 have it: sequence b attends to its first seqused_k[b] keys as if it had only those (causal and window
  bands, ALiBi distances align to that length), the keys past it are never read (NaN there included) and get
  dk = dv = 0. A padded or static KV cache needs it.
* sinks: (H,) attention sinks (GPT-OSS style), one logit per query head, natural-log units and not scaled, that
  joins every row's softmax denominator without a value: lse_i = log(exp(sinks[h]) + sum_j exp(s_ij)). The
  returned softmax_lse includes it (a row that sees no key gets out 0 and lse = sinks[h]). Differentiable: the
  gradient comes back in the sinks' dtype; computed in fp32.

flash_attn_with_kvcache works on a contiguous cache (B, Nk_max, Hkv, D) or, with block_table, a paged one (page
pools (num_pages, page_size, Hkv, D)): in-place append of k, v at cache_seqlens, rotary embedding, attention to each
sequence's used rows (flashc's seqused_k), cache_batch_idx and cache_leftpad; it takes sinks (keyword-only) but not
seqused_k, which cache_seqlens sets. flash_attn_varlen_func takes block_table too. On CUDA the paged forward and
append run; the paged backward is CPU-only for now. torch is imported on the first call, not at import.
"""

from typing import TYPE_CHECKING, Optional, Tuple, Union

if TYPE_CHECKING:  # torch is imported on the first call, not here
    from torch import Tensor
else:
    Tensor = "torch.Tensor"

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]


def _no_fast(*args):
    return None


# flashc.ops.fast_flash_attn_func once flashc.ops is imported (it sets this; the first call imports it), a function
# returning None before: always a function, so that torch.compile's guard on it keeps one type.
_fast = _no_fast


def _first_kvcache(*args):
    from . import ops  # sets _fast_kvcache to ops.fast_kvcache

    return ops.fast_kvcache(*args)


# flashc.ops.fast_kvcache once flashc.ops is imported, before it a function that imports it and forwards the call:
# always a function, as _fast is
_fast_kvcache = _first_kvcache


def _run(kind, inputs, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, seqused_k, sinks, **varlen_args):
    # flashc.ops imports torch and registers torch.ops.flashc.fwd / bwd on the first call; it sends an eager call on
    # plain tensors down the direct path and anything traced (torch.compile, torch.export, make_fx, a CUDA-graph
    # capture) through the operators.
    from . import ops

    return ops.run(kind, inputs, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs, seqused_k, sinks, **varlen_args)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """qkv (B, N, 3, H, D) -> out (B, N, H, D). The gradient comes back as one (B, N, 3, H, D) tensor."""
    return _run("qkv", (qkv,), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """q (B, Nq, H, D), kv (B, Nk, 2, Hkv, D) -> out (B, Nq, H, D)."""
    return _run("q,kv", (q, kv), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """q (B, Nq, H, D), k and v (B, Nk, Hkv, D) -> out (B, Nq, H, D).

    causal is bottom-right aligned (query i sees key j iff j <= i + Nk - Nq); window_size (left, right) keeps
    keys i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: unbounded); softcap > 0 applies
    softcap * tanh(s / softcap); alibi_slopes (H,) or (B, H) fp32 subtract slope * |i + Nk - Nq - j|.
    seqused_k (B,) int32: batch b uses its first seqused_k[b] keys (Nk becomes seqused_k[b] for the masks);
    sinks (H,): attention sinks (see the module's docstring).
    """
    if alibi_slopes is None and seqused_k is None and sinks is None and dropout_p == 0:
        # plain eager calls on tensors whose shapes were seen before (flashc.ops' per-shape plans); None otherwise
        r = _fast(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
        if r is not None:
            return r
    return _run("q,k,v", (q, k, v), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """qkv (total, 3, H, D), cu_seqlens int32 (B + 1) -> out (total, H, D)."""
    return _run("qkv", (qkv,), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """q (total_q, H, D), kv (total_k, 2, Hkv, D) -> out (total_q, H, D)."""
    return _run("q,kv", (q, kv), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    seqused_k: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """q (total_q, H, D), k and v (total_k, Hkv, D) -> out (total_q, H, D). Sequence b is rows
    cu_seqlens[b] .. cu_seqlens[b + 1] - 1; masks and ALiBi positions count from each sequence's start.
    seqused_k (num_seqs,) int32: sequence b uses the first seqused_k[b] of its keys; sinks (H,): attention sinks
    (see the module's docstring).
    block_table (num_seqs, max_pages) int32, as flash-attn: k and v are then page pools (num_pages, page_size, Hkv, D)
    and key j of sequence b lives at row j % page_size of page block_table[b, j // page_size]; cu_seqlens_k gives
    each sequence's key count (<= max_pages * page_size), not offsets. Differentiable, dk and dv coming back as page
    pools (0 where no key lies); the backward through pages runs on the CPU only for now (CUDA: NOT_SUPPORTED)."""
    extra = {} if block_table is None else dict(block_table=block_table)
    return _run("q,k,v", (q, k, v), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Union[int, Tensor, None] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention against a contiguous KV cache, updating it in place (inference: no autograd).

    q (B, Nq, H, D); k_cache, v_cache (B, Nk_max, Hkv, D); cache_seqlens: an int or an int32 tensor (B,), the rows
    of each sequence's cache filled so far (None: the whole cache). With k and v (B, Nnew, Hkv, D) the new rows are
    written into the caches at rows cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1 (cache_seqlens is then
    required), and q attends to the first cache_seqlens[b] + Nnew rows of sequence b; causal is bottom-right aligned
    to that length, so the queries sit at the end of the sequence (decode: Nq = 1; chunked prefill: Nq = Nnew).
    The rows past it are never read. The lengths stay on the device: no host sync, usable in a CUDA graph.

    rotary_cos, rotary_sin (positions >= Nk_max, R / 2): the new keys are rotated at positions cache_seqlens[b] + i
    before they are written; q is rotated at cache_seqlens[b] + i with causal or a window, else every query at
    cache_seqlens[b]; pairs (i, i + R/2), or (2i, 2i + 1) with rotary_interleaved. They need k and v, as in
    flash-attn. num_splits is accepted and ignored (flashc chooses its own split of the keys). sinks (H,),
    keyword-only: attention sinks (see the module's docstring).

    block_table (B, max_pages) int32: a paged cache, as flash-attn: k_cache, v_cache are page pools (num_pages,
    page_size, Hkv, D) and row j of sequence b lives at row j % page_size of page block_table[b, j // page_size]
    (Nk_max = max_pages * page_size); new rows are written at their pages. Any page size, on both backends.

    cache_batch_idx (B,) int32: sequence b uses cache k_cache[cache_batch_idx[b]] of (B_cache, Nk_max, Hkv, D)
    caches (its new rows are written there). cache_leftpad (B,) int32: sequence b's keys start at cache row
    cache_leftpad[b] (0 <= cache_leftpad[b] <= cache_seqlens[b]); the rows before it are padding, never read, and
    causal, windows and ALiBi count keys from it, as flash-attn does; the rotary positions stay the cache rows. Not
    with block_table (as in flash-attn). On the GPU left padding runs the mma.sync kernels' paged path (pages of one
    row): slower than a cache without it.

    Returns out (B, Nq, H, D), or (out, softmax_lse) with return_softmax_lse, softmax_lse fp32 (B, H, Nq).
    """
    if (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and cache_leftpad is None and block_table is None and alibi_slopes is None and sinks is None):
        # plain calls on tensors whose shapes were seen before (flashc.ops' kvcache plans); None otherwise
        r = _fast_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, window_size, softcap,
                          return_softmax_lse)
        if r is not None:
            return r
    from . import _torch

    out, lse = _torch.with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                                   sinks=sinks, block_table=block_table, cache_batch_idx=cache_batch_idx,
                                   cache_leftpad=cache_leftpad)
    return (out, lse) if return_softmax_lse else out
