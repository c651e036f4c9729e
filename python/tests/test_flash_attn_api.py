"""Signature compatibility: code written against flash-attn 2.x's flash_attn_interface (positional or keyword
arguments) and torch's scaled_dot_product_attention must bind to flashc's functions the same way.

The expected signatures are flash-attn 2.x's public interface (flash_attn/flash_attn_interface.py, the 2.6+
versions that have softcap) and torch.nn.functional.scaled_dot_product_attention's documented one. When the real
flash_attn package is importable, its functions are compared too. No torch needed: flashc imports torch lazily.

flashc's own arguments (seqused_k, sinks) follow flash-attn's as keyword-only ones, so no positional call binds
differently.
"""

import importlib
import inspect

import pytest

import flashc
import flashc.flash_attn_interface as fai

_E = inspect.Parameter.empty
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]

FLASH_ATTN = {
    "flash_attn_qkvpacked_func": [("qkv", _E)] + _COMMON,
    "flash_attn_kvpacked_func": [("q", _E), ("kv", _E)] + _COMMON,
    "flash_attn_func": [("q", _E), ("k", _E), ("v", _E)] + _COMMON,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _E), ("cu_seqlens", _E), ("max_seqlen", _E)] + _COMMON,
    "flash_attn_varlen_kvpacked_func": [("q", _E), ("kv", _E), ("cu_seqlens_q", _E), ("cu_seqlens_k", _E),
                                        ("max_seqlen_q", _E), ("max_seqlen_k", _E)] + _COMMON,
    "flash_attn_varlen_func": [("q", _E), ("k", _E), ("v", _E), ("cu_seqlens_q", _E), ("cu_seqlens_k", _E),
                               ("max_seqlen_q", _E), ("max_seqlen_k", _E)] + _COMMON + [("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", _E), ("k_cache", _E), ("v_cache", _E), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}
# flashc's keyword-only additions, after flash-attn's arguments (flash_attn_with_kvcache: sinks only, its
# cache_seqlens sets the keys each sequence uses).
FLASHC_EXTRA = [("seqused_k", None), ("sinks", None)]


def extra(name):
    return [("sinks", None)] if name == "flash_attn_with_kvcache" else FLASHC_EXTRA


def params(fn, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind == kind]


@pytest.mark.parametrize("name", sorted(FLASH_ATTN))
def test_flash_attn_signature(name):
    for where in (flashc, fai):
        fn = getattr(where, name)
        # flash-attn's arguments bind by position too, in its order; flashc's own only by keyword, after them
        assert params(fn) == FLASH_ATTN[name], "%s.%s" % (where.__name__, name)
        assert params(fn, inspect.Parameter.KEYWORD_ONLY) == extra(name), "%s.%s" % (where.__name__, name)
        assert len(inspect.signature(fn).parameters) == len(FLASH_ATTN[name]) + len(extra(name))


def test_flash_attn_interface_exports_everything():
    assert set(fai.__all__) == set(FLASH_ATTN)
    for name in FLASH_ATTN:
        assert getattr(flashc, name) is getattr(fai, name)
        assert name in flashc.__all__


def test_sdpa_signature():
    sig = inspect.signature(flashc.scaled_dot_product_attention)
    got = [(p.name, p.default, p.kind) for p in sig.parameters.values()]
    pk, kw = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    # torch: scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
    #        scale=None, enable_gqa=False)
    assert got == [("query", _E, pk), ("key", _E, pk), ("value", _E, pk), ("attn_mask", None, pk),
                   ("dropout_p", 0.0, pk), ("is_causal", False, pk), ("scale", None, kw), ("enable_gqa", False, kw)]


def test_sdpa_signature_matches_installed_torch():
    torch = pytest.importorskip("torch")
    doc = torch.nn.functional.scaled_dot_product_attention.__doc__ or ""
    head = doc.split("->")[0].replace("\n", " ")
    if "scaled_dot_product_attention(" not in head:
        pytest.skip("this torch documents no signature line")
    names = [a.split("=")[0].strip() for a in head.split("(", 1)[1].rsplit(")", 1)[0].split(",")]
    names = [n for n in names if n and n != "*"]
    ours = list(inspect.signature(flashc.scaled_dot_product_attention).parameters)
    assert ours[:len(names)] == names, (names, ours)


def test_against_installed_flash_attn():
    """If the real flash-attn is installed, its interface is the reference."""
    try:
        real = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # not installed, or installed without a usable CUDA extension
        pytest.skip("flash_attn is not installed")
    for name in FLASH_ATTN:
        if hasattr(real, name):
            theirs = params(getattr(real, name))
            ours = params(getattr(flashc, name))
            # newer flash-attn versions append arguments; everything flashc has by position must agree with theirs
            assert ours[:len(theirs)] == theirs[:len(ours)], name
