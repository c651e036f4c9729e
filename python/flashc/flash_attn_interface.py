"""flash-attn 2.x's Python interface on flashc: the same function names, parameters, defaults, layouts and return
conventions, so that code written for flash-attn runs after changing the import:

    from flashc import flash_attn_func            # instead of: from flash_attn import flash_attn_func

Layouts (flash-attn's): q (B, Nq, H, D), k/v (B, Nk, Hkv, D), qkv (B, N, 3, H, D), kv (B, Nk, 2, Hkv, D); varlen
tensors drop the batch dimension and pack the sequences along the first one, described by int32 cu_seqlens
(B + 1 offsets). Returns out, or (out, softmax_lse, S_dmask) with return_attn_probs=True, where softmax_lse is
fp32 (B, H, Nq) or varlen (H, total_q) and S_dmask is None: flashc never materializes the attention probabilities
(flash-attn documents its S_dmask as "for testing only", meaningful with dropout, which flashc does not have yet).

Two keyword-only arguments of flashc's own follow flash-attn's on every function (its positional order is kept):

* seqused_k: int32 (B,) (varlen: one per sequence), the keys each sequence uses, as flash-attn's C API and
  flash-attn 3 have it: sequence b attends to its first seqused_k[b] keys as if it had only those (causal and window
  bands, ALiBi distances align to that length), the keys past it are never read (NaN there included) and get
  dk = dv = 0. A padded or static KV cache needs it.
* sinks: (H,) attention sinks (GPT-OSS style), one logit per query head, natural-log units and not scaled, that
  joins every row's softmax denominator without a value: lse_i = log(exp(sinks[h]) + sum_j exp(s_ij)). The
  returned softmax_lse includes it (a row that sees no key gets out 0 and lse = sinks[h]). Differentiable: the
  gradient comes back in the sinks' dtype; computed in fp32.

Not supported yet, each raising NotImplementedError that names it: dropout_p > 0, the KV cache
(flash_attn_with_kvcache) and paged KV (block_table). torch is imported on the first call, not at import.
"""

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]


def _run(kind, inputs, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, seqused_k, sinks, **varlen_args):
    from . import _torch

    out, lse = _torch.apply(kind, inputs, varlen=varlen, dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic, seqused_k=seqused_k, sinks=sinks, **varlen_args)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_k=None,
    sinks=None,
):
    """qkv (B, N, 3, H, D) -> out (B, N, H, D). The gradient comes back as one (B, N, 3, H, D) tensor."""
    return _run("qkv", (qkv,), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_k=None,
    sinks=None,
):
    """q (B, Nq, H, D), kv (B, Nk, 2, Hkv, D) -> out (B, Nq, H, D)."""
    return _run("q,kv", (q, kv), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_k=None,
    sinks=None,
):
    """q (B, Nq, H, D), k and v (B, Nk, Hkv, D) -> out (B, Nq, H, D).

    causal is bottom-right aligned (query i sees key j iff j <= i + Nk - Nq); window_size (left, right) keeps
    keys i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: unbounded); softcap > 0 applies
    softcap * tanh(s / softcap); alibi_slopes (H,) or (B, H) fp32 subtract slope * |i + Nk - Nq - j|.
    seqused_k (B,) int32: batch b uses its first seqused_k[b] keys (Nk becomes seqused_k[b] for the masks);
    sinks (H,): attention sinks (see the module's docstring).
    """
    return _run("q,k,v", (q, k, v), False, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_k=None,
    sinks=None,
):
    """qkv (total, 3, H, D), cu_seqlens int32 (B + 1) -> out (total, H, D)."""
    return _run("qkv", (qkv,), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_k=None,
    sinks=None,
):
    """q (total_q, H, D), kv (total_k, 2, Hkv, D) -> out (total_q, H, D)."""
    return _run("q,kv", (q, kv), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_k=None,
    sinks=None,
):
    """q (total_q, H, D), k and v (total_k, Hkv, D) -> out (total_q, H, D). Sequence b is rows
    cu_seqlens[b] .. cu_seqlens[b + 1] - 1; masks and ALiBi positions count from each sequence's start.
    seqused_k (num_seqs,) int32: sequence b uses the first seqused_k[b] of its keys; sinks (H,): attention sinks
    (see the module's docstring)."""
    if block_table is not None:
        raise NotImplementedError("flashc: paged KV cache (block_table) is not supported yet")
    return _run("q,k,v", (q, k, v), True, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, seqused_k, sinks, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Present so that imports of flash-attn's module keep working; decoding with a KV cache is not there yet."""
    raise NotImplementedError(
        "flashc: the KV cache (flash_attn_with_kvcache: in-place cache update, cache_seqlens, rotary, paged "
        "block_table) is not supported yet; for a full cache call flash_attn_func(q, k_cache, v_cache, ...)")
