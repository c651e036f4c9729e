"""Padding helpers with flash-attn 2.x's names and signatures (flash_attn.bert_padding), for code that packs a padded
batch into flashc.flash_attn_varlen_func's layout and back:

    x_unpad, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(x, attention_mask)   # x (B, S, ...)
    out_unpad = flashc.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen,
                                              max_seqlen, causal=True)
    out = pad_input(out_unpad, indices, B, S)                                                  # (B, S, ...), 0 at pads

All of them are differentiable torch operations (gathers and scatters). unpad_input reads the largest length back to
the host (one synchronization on CUDA), as flash-attn's does. With flashc there is often no need to unpad: a padded
batch can run as it is with seqused_k (right padding) or, through flashc.scaled_dot_product_attention or
flashc.transformers, with a key-padding mask.
"""

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input"]


def index_first_axis(input, indices):
    """input[indices] along the first axis: (N, ...) -> (len(indices), ...)."""
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """A (first_axis_dim, ...) tensor of zeros with values (len(indices), ...) at rows indices."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (B, S, ...), attention_mask (B, S) (bool or 0/1 integers: 1 = a real token). unused_mask (B, S),
    optional: tokens that are kept in the packed output but not counted as used (flash-attn's meaning).

    Returns (hidden_states (total, ...) of the kept tokens in batch-major order, indices int64 (total,) of those
    tokens in the flattened (B * S) batch, cu_seqlens int32 (B + 1,), max_seqlen_in_batch (int), seqused int32 (B,):
    the counts of attention_mask alone)."""
    keep = attention_mask.bool()
    if unused_mask is not None:
        keep = keep | unused_mask.bool()
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: hidden_states (total, ...) -> (batch, seqlen, ...), zeros where nothing was kept."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
