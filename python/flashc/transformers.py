"""flashc as an attention implementation for Hugging Face transformers, with one line:

    import flashc.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=flashc.transformers.register())

register() adds flashc's attention function to transformers' AttentionInterface and its mask function to
AttentionMaskInterface, both under NAME, and returns NAME. The name has no "flash" in it on purpose: transformers
takes a name containing "flash" for one of its own flash-attention integrations (or a kernel to fetch from its
hub) and raises when that is not installed; and no "/" (a hub kernel's repo id) or "sdpa" / "flex_attention"
(which it checks as those). Registering the mask function matters as much as the attention function: without one,
transformers hands a custom implementation no mask at all, and padded batches come out silently wrong.

The mask function does not build the (B, 1, Nq, Nk) tensor transformers' sdpa path builds. It returns a KeyMask:
causal or not, a sliding window as flashc's window (transformers' sliding_window_causal_mask_function(w) is window
(w - 1, 0)), the keys each sequence may see (the 2-D padding mask, as one mask byte per key: flashc's block mask
with blocks of Nq rows x 1 key), and, for a static cache, the filled length (seqused_k = the cache's length after
this step), so a static cache's unfilled slots are never read. Left and right padding, padding with a cache, dynamic
and static caches (sliding-window ones too, which drop their oldest keys), GQA, causal, bidirectional and
sliding-window layers, attention sinks (transformers' s_aux, GPT-OSS), softcap and training (gradients) run that
way, with no host synchronization inside the attention and no copies of q, k, v (they are passed as strided views),
so a compiled, CUDA-graphed decode step with a static cache can hold it. The mask function synchronizes once per
forward outside compiled code, to drop a padding mask that masks nothing (transformers' sdpa mask does the same
check). The mask functions are recognized by identity (causal_mask_function, bidirectional_mask_function) or, for
the sliding windows, by the code objects and closure values of transformers' and_masks / sliding_window_overlay; a
mask function composed any other way is left to the dense path below, never guessed at.

Masks of other shapes (chunked attention, packed sequences found from position_ids, overlays such as image-token
masks, a 4-D mask passed by the caller) are built as transformers' sdpa masks and run through
flashc.scaled_dot_product_attention's mask recognition in each layer, which runs key padding and causal masks and
raises ValueError, naming the forms it runs, for the rest. Attention dropout (a module in training mode whose
attention_dropout is not 0) runs fused in flashc's kernels, its mask drawn from torch's generator (torch.manual_seed
controls it) and passed to the library by address, with no host synchronization on CUDA; a libflashc whose CUDA
backend does not run dropout raises FlashcError there. Position biases and output_attentions=True are not supported
and raise.
"""

import torch

from . import _torch

__all__ = ["NAME", "KeyMask", "register", "attention_forward", "mask_function"]

NAME = "fc_attention"


class KeyMask:
    """What flashc's mask function hands each attention layer.

    causal: bottom-right aligned to the keys in use (transformers' causal mask: query i at position q_offset + i
    sees the keys at positions <= q_offset + i). window: flashc's (left, right) on the same alignment, (-1, -1) for
    none (a sliding-window layer's). block_mask: None, or uint8 (B, 1, 1, Nk), 1 where a key may be
    seen (the padding mask), with block_size (Nq, 1). seqused_k: None, or int32 (B,), the keys each sequence uses
    (the filled part of a static cache). q_length, kv_length: the shapes the mask was made for."""

    __slots__ = ("causal", "block_mask", "seqused_k", "q_length", "kv_length", "window")

    def __init__(self, causal, block_mask, seqused_k, q_length, kv_length, window=(-1, -1)):
        self.causal = causal
        self.window = window
        self.block_mask = block_mask
        self.seqused_k = seqused_k
        self.q_length = q_length
        self.kv_length = kv_length

    # generate() builds the mask of a step with a compileable (static) cache ahead of the forward and passes it in as
    # attention_mask; the model's own mask creation then looks at its ndim (2 is a padding mask to build from, 4 is
    # prepared) and hands it back to mask_function, which returns it as it is.
    ndim = 4

    @property
    def shape(self):
        b = self.block_mask.shape[0] if self.block_mask is not None else (
            self.seqused_k.shape[0] if self.seqused_k is not None else 1)
        return (b, 1, self.q_length, self.kv_length)

    def __repr__(self):
        return "KeyMask(causal=%s, window=%s, padding=%s, seqused_k=%s, q_length=%s, kv_length=%s)" % (
            self.causal, self.window, self.block_mask is not None, self.seqused_k is not None, self.q_length,
            self.kv_length)


_MU = []


def _masking_utils():
    """transformers.masking_utils, imported once (register() does it first): an import statement inside the mask
    function would be traced by torch.compile, which some torch versions (2.11) refuse for transformers' lazy modules
    ("Bad import result")."""
    if not _MU:
        from transformers import masking_utils

        _MU.append(masking_utils)
    return _MU[0]


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                  **kwargs):
    """transformers' mask interface (the arguments its create_causal_mask and create_sliding_window_causal_mask pass):
    a KeyMask for causal, bidirectional and sliding-window masks, a dense transformers sdpa mask for anything else.

    Geometry: key slot j holds position kv_offset + j, query i sits at position q_offset + i, and the keys in use end
    at the last query's position, so each sequence uses e = q_offset - kv_offset + Nq keys (fewer than kv_length in
    a static cache, which is then left out with seqused_k) and flashc's bottom-right alignment to e is transformers'
    causal mask; a sliding window of w positions is window (w - 1, 0) on that alignment."""
    mu = _masking_utils()
    if isinstance(attention_mask, KeyMask):
        return attention_mask  # prepared already (by generate, see KeyMask.ndim)
    form = _form(mu, mask_function, kwargs.get("local_size"))
    if form is None or isinstance(kv_offset, torch.Tensor):
        # chunks, packed sequences, overlays: transformers' own boolean mask, recognized (or refused) by
        # flashc.scaled_dot_product_attention's attn_mask handling in each layer
        kwargs.pop("allow_is_causal_skip", None)
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                            kv_offset=kv_offset, mask_function=mask_function or mu.causal_mask_function,
                            attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)
    causal, window = form
    device = kwargs.get("device")
    if attention_mask is not None:
        device = attention_mask.device
    used = None
    if isinstance(q_offset, torch.Tensor):
        # a static cache: kv_length is its capacity, filled up to q_offset + q_length after this step's update
        # (computed now: the cache advances its counter in place during the forward)
        used = (q_offset.reshape(-1)[:1] - kv_offset + q_length).to(device=device, dtype=torch.int32)
        used = used.expand(batch_size)
    elif q_offset - kv_offset + q_length < kv_length:
        used = torch.full((batch_size,), q_offset - kv_offset + q_length, dtype=torch.int32, device=device)
    block_mask = None
    if attention_mask is not None:
        keys = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
        # Outside compiled code a mask that masks nothing is dropped (one host sync per forward); a compiled graph
        # keeps it, which gives the same result. A static cache's slots past the mask are not filled yet: seqused_k
        # leaves them out either way.
        if torch.compiler.is_compiling() or not bool(keys.all()):
            if keys.shape[1] < kv_length:
                keys = torch.nn.functional.pad(keys, (0, kv_length - keys.shape[1]))
            block_mask = keys.to(torch.uint8).reshape(batch_size, 1, 1, kv_length)
    return KeyMask(causal, block_mask, used, q_length, kv_length, window)


def _cells(f):
    code = getattr(f, "__code__", None)
    if code is None or not code.co_freevars:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in f.__closure__)))


def _form(mu, f, local_size):
    """(causal, window) of a transformers mask function that flashc runs as arguments: causal_mask_function,
    bidirectional_mask_function and the sliding-window masks (and_masks of sliding_window_overlay(w) with
    causal_mask_function, or of the bidirectional overlay with bidirectional_mask_function), recognized by their code
    objects and closure values, so that any other composition (overlays, packed sequences, chunks) is left to the
    dense path. None for those."""
    if f is None or f is mu.causal_mask_function:
        return True, (-1, -1)
    if f is mu.bidirectional_mask_function:
        return False, (-1, -1)
    if not isinstance(local_size, int) or getattr(f, "__code__", None) is not mu.and_masks(f).__code__:
        return None
    parts = _cells(f).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    w = _cells(overlay).get("sliding_window")
    if w != local_size:
        return None
    code = getattr(overlay, "__code__", None)
    if base is mu.causal_mask_function and code is mu.sliding_window_overlay(1).__code__:
        return True, (w - 1, 0)  # positions p - w < p' <= p
    if (base is mu.bidirectional_mask_function and hasattr(mu, "sliding_window_bidirectional_overlay")
            and code is mu.sliding_window_bidirectional_overlay(1).__code__):
        return False, (w, w)  # |p - p'| <= w
    return None


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention interface: query (B, H, Nq, D), key and value (B, Hkv, Nk, D) -> (out (B, Nq, H, D),
    None). attention_mask: a KeyMask from mask_function, a 4-D mask (run through flashc's SDPA mask recognition), or
    None (causal when the module is, as transformers' sdpa does). dropout: the probability of dropping an attention
    probability, applied when the module is training (models pass attention_dropout then, 0.0 in eval)."""
    if module is not None and not getattr(module, "training", True):
        dropout = 0.0
    dropout = dropout or 0.0
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("flashc: position_bias (an additive attention bias) is not supported")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("flashc: output_attentions=True is not supported (attention probabilities are "
                                  "never materialized); use attn_implementation='eager' for them")
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")
    q4, k4, v4 = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D) views, no copies
    nq, nk = q4.shape[1], k4.shape[1]
    if isinstance(attention_mask, KeyMask):
        m = attention_mask
        if m.kv_length != nk or m.q_length != nq:
            raise ValueError("flashc: the mask was made for %d queries x %d keys but this layer has %d x %d"
                             % (m.q_length, m.kv_length, nq, nk))
        out4 = _torch.attend(q4, k4, v4, softmax_scale=scaling, causal=m.causal, window_size=m.window, softcap=softcap,
                             seqused_k=m.seqused_k, block_mask=m.block_mask,
                             block_size=(max(nq, 1), 1) if m.block_mask is not None else None, sinks=sinks,
                             dropout_p=dropout)
        return out4, None
    if attention_mask is not None:
        if softcap or sinks is not None:
            raise NotImplementedError("flashc: softcap and s_aux (sinks) with a 4-D attention mask")
        if attention_mask.dim() == 4 and attention_mask.shape[-1] != nk:
            attention_mask = attention_mask[..., :nk]
        out = _torch.sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                          enable_gqa=True)
        return out.transpose(1, 2), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and nq > 1
    kept = nk
    if causal and nq < nk:
        # no mask and a causal module: transformers' sdpa path runs is_causal, top-left aligned (it never has a
        # cache here: with one, the mask function gives a KeyMask)
        kept = nq
    out4 = _torch.attend(q4, k4[:, :kept], v4[:, :kept], softmax_scale=scaling, causal=causal, softcap=softcap,
                         sinks=sinks, dropout_p=dropout)
    return out4, None


def register(name=NAME):
    """Registers flashc's attention and mask functions with transformers under `name` (default NAME,
    "fc_attention") and returns it, for from_pretrained / from_config(attn_implementation=...) or
    model.set_attn_implementation(...). Calling it again is harmless. Raises ValueError for a name transformers
    would treat as one of its own implementations."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if "flash" in name or "/" in name or "sdpa" in name or "flex_attention" in name or name in ("eager",):
        raise ValueError("flashc: transformers treats attention implementations named with 'flash', 'sdpa', "
                         "'flex_attention' or 'eager', or with a '/' (a hub kernel), as its own; %r is one" % name)
    _masking_utils()
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name
