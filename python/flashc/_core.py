"""What the numpy and torch front ends share: argument checks that do not depend on the array type, the
flashc_params builder, and the calls into the library with their error handling."""

import operator

from . import _lib


class FlashcCopyWarning(UserWarning):
    """The library refused a tensor layout, so flashc copied the inputs to contiguous tensors for that call."""


def check_dropout(dropout_p):
    """dropout_p as a float in [0, 1) (0.0 for None); ValueError otherwise."""
    # Comparisons only, no float() or math.isnan: torch.compile(dynamic=True) may pass a symbolic float, which a
    # comparison traces (as a guard); the chained compare is False for NaN too.
    if dropout_p is None or dropout_p == 0:
        return 0.0
    if not (0.0 <= dropout_p < 1.0):  # False for NaN too
        raise ValueError("dropout_p must be in [0, 1), got %r" % (dropout_p,))
    return dropout_p


def dropout_mask(params, b, h, nq, nk, ptr):
    """flashc_dropout_mask into ptr (b * h * nq * nk bytes): 1 where the calls with these params keep an element."""
    if not _lib.bound("flashc_dropout_mask"):
        raise NotImplementedError(
            "flashc: the dropout mask (return_attn_probs=True with dropout_p > 0) needs a libflashc with "
            "flashc_dropout_mask; the loaded %s (version %s) lacks it: rebuild it" % (_lib.library_path,
                                                                                     _lib.version()))
    _lib.check(_lib.lib.flashc_dropout_mask(params, b, h, nq, nk, ptr), "flashc_dropout_mask")


def window_pair(window_size):
    if window_size is None:
        return -1, -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError("window_size must be a pair (left, right), got %r" % (window_size,)) from None
    return int(left), int(right)


def block_size_pair(block_size):
    if block_size is None:
        raise ValueError("block_mask needs block_size=(block_q, block_k): the rows and keys per mask byte")
    if isinstance(block_size, int):
        return block_size, block_size
    bq, bk = block_size
    return int(bq), int(bk)


def mask_dims(shape):
    """(batch, heads) of a block mask shaped (nqb, nkb), (heads, nqb, nkb) or (batch, heads, nqb, nkb)."""
    if len(shape) == 2:
        return 1, 1
    if len(shape) == 3:
        return 1, shape[0]
    if len(shape) == 4:
        return shape[0], shape[1]
    raise ValueError("block_mask must have 2, 3 or 4 dimensions (batch, heads, q blocks, k blocks), got %d"
                     % len(shape))


def check_mask_shape(shape, bq, bk, nq, nk):
    want = (-(-nq // bq), -(-nk // bk))
    if tuple(shape[-2:]) != want:
        raise ValueError(
            "block_mask's last two dimensions must be (ceil(Nq / %d), ceil(Nk / %d)) = %s, got %s"
            % (bq, bk, want, tuple(shape[-2:])))


def check_seqused_k_shape(shape, b, varlen):
    if tuple(shape) != (b,):
        raise ValueError("flashc: seqused_k must be 1-d with one entry per sequence, (%s,) = (%d,), got shape %s"
                         % ("num_seqs" if varlen else "B", b, tuple(shape)))


def check_sinks_shape(shape, h):
    if tuple(shape) != (h,):
        raise ValueError("flashc: sinks must be 1-d with one fp32 logit per query head, (H,) = (%d,), got shape %s"
                         % (h, tuple(shape)))


def check_int32_range(name, values):
    """Host index values that int32 cannot hold would wrap on conversion into other, valid-looking ones."""
    if len(values) and (int(values.min()) < -2**31 or int(values.max()) >= 2**31):
        raise ValueError("flashc: %s holds values outside int32's range" % name)


# Fields flashc_params gained after 0.2: a library older than them lacks the field, and setting an attribute that is
# not a field of the ctypes struct would be silently ignored, so such calls are refused here.
_FIELDS = frozenset(name for name, _ in _lib.Params._fields_)


def _set_field(p, name, value, feature, since="0.3"):
    if name not in _FIELDS:
        raise NotImplementedError(
            "flashc: %s needs libflashc %s or later; the loaded %s (version %s) has no flashc_params.%s"
            % (feature, since, _lib.library_path, _lib.version(), name))
    setattr(p, name, value)


def check_block_table_shape(shape, b, varlen):
    if len(shape) != 2 or shape[0] != b or shape[1] < 1:
        raise ValueError("flashc: block_table must be 2-d (%s, max_pages) with max_pages >= 1, one row of page "
                         "indices per sequence, got shape %s" % ("num_seqs" if varlen else "B", tuple(shape)))


def make_params(softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi_ptr=None,
                alibi_batch_stride=0, block_mask_ptr=None, block_size=(0, 0), block_mask_dims=(1, 1),
                cu_q_ptr=None, cu_k_ptr=None, num_seqs=0, max_seqlen_q=0, max_seqlen_k=0, deterministic=False,
                seqused_k_ptr=None, sinks_ptr=None, dsinks_ptr=None, block_table_ptr=None, block_table_max_pages=0,
                block_table_stride=0, dropout_p=0.0, dropout_seed=0, dropout_offset=0, dropout_rng_ptr=None,
                positions=None):
    """flashc_params for these options. Dropout's (seed, offset) goes either as values (dropout_seed, dropout_offset,
    taken mod 2**64) or, with dropout_rng_ptr, as the address of two uint64 { seed, offset } that the library reads
    itself (flashc_params.dropout_rng, 0.5): device memory for a CUDA call, read by the kernels when they run, host
    memory otherwise, read at the call. The torch front end always passes the pointer.
    positions: None (bottom-right alignment), or (q_position, k_position), two ints: query row i of every sequence
    sits at q_position + i and key j at k_position + j, and causal, windows, ALiBi and dropout's (row, key) are
    measured between those positions (flashc_params.positions, 0.6; each strictly between -2**40 and 2**40; with
    dropout both >= 0 and k_position a multiple of 4)."""
    p = _lib.lib.flashc_params_default()
    # 0 asks the library for 1/sqrt(D); an explicit 0.0 from the caller is kept as "default" too, which is what
    # softmax_scale=None means everywhere in this package.
    p.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
    p.causal = 1 if causal else 0
    p.window_left, p.window_right = window
    p.softcap = float(softcap or 0.0)
    if alibi_ptr:
        p.alibi_slopes = alibi_ptr
        p.alibi_batch_stride = alibi_batch_stride
    if block_mask_ptr:
        p.block_mask = block_mask_ptr
        p.block_mask_q, p.block_mask_k = block_size
        p.block_mask_batch, p.block_mask_heads = block_mask_dims
    if cu_q_ptr:
        p.cu_seqlens_q = cu_q_ptr
        p.cu_seqlens_k = cu_k_ptr
        p.num_seqs = num_seqs
        p.max_seqlen_q = max_seqlen_q
        p.max_seqlen_k = max_seqlen_k
    p.deterministic = 1 if deterministic else 0
    if dropout_p:
        p.dropout_p = float(dropout_p)
        p.dropout_seed = dropout_seed & 0xFFFFFFFFFFFFFFFF
        p.dropout_offset = dropout_offset & 0xFFFFFFFFFFFFFFFF
        if dropout_rng_ptr:
            _set_field(p, "dropout_rng", dropout_rng_ptr, "dropout's (seed, offset) by pointer (dropout_rng)", "0.5")
    if seqused_k_ptr:
        _set_field(p, "seqused_k", seqused_k_ptr, "seqused_k")
    if sinks_ptr:
        _set_field(p, "sinks", sinks_ptr, "attention sinks")
    if dsinks_ptr:
        _set_field(p, "dsinks", dsinks_ptr, "the attention sinks' gradient")
    if block_table_ptr:
        _set_field(p, "block_table", block_table_ptr, "the paged KV cache (block_table)", "0.4")
        p.block_table_max_pages = block_table_max_pages
        p.block_table_stride = block_table_stride
    if positions is not None:
        qp, kp = check_positions(positions)
        _set_field(p, "positions", 1, "positions (q_position, k_position)", "0.6")
        p.q_position, p.k_position = qp, kp
    return p


def check_positions(positions):
    """(q_position, k_position) as two Python ints (not bools), or ValueError. The range (strictly inside +-2**40) is
    the library's to check; this refuses what would not fit the int64 fields (ctypes would wrap it silently)."""
    try:
        qp, kp = positions
        if isinstance(qp, bool) or isinstance(kp, bool):
            raise TypeError("bool")
        qp, kp = operator.index(qp), operator.index(kp)
    except (TypeError, ValueError):
        raise ValueError("flashc: positions must be None or a pair of ints (q_position, k_position), got %r"
                         % (positions,)) from None
    if not (-2**63 <= qp < 2**63 and -2**63 <= kp < 2**63):
        raise ValueError("flashc: positions (%d, %d) do not fit in int64 (the library takes |position| < 2**40)"
                         % (qp, kp))
    return qp, kp


def forward_status(ctx, q, k, v, params, out, lse_ptr, ws_ptr=None, ws_bytes=0):
    """flashc_forward on flashc_tensor views; returns the status so callers can react to NOT_SUPPORTED."""
    return _lib.lib.flashc_forward(ctx.handle, q, k, v, params, out, lse_ptr, ws_ptr, ws_bytes)


def backward_status(ctx, q, k, v, out, dout, lse_ptr, params, dq, dk, dv, ws_ptr=None, ws_bytes=0):
    return _lib.lib.flashc_backward(ctx.handle, q, k, v, out, dout, lse_ptr, params, dq, dk, dv, ws_ptr, ws_bytes)


def supported_status(ctx, q, k, v, params):
    """flashc_supported for the forward: whether the backend runs this configuration (host only, no data read)."""
    return _lib.lib.flashc_supported(ctx.handle, _lib.OP_FORWARD, q, k, v, params)


def kvcache_append_status(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens_ptr):
    """flashc_kvcache_append on flashc_tensor views: k_new, v_new written in place into the caches at rows
    cache_seqlens[b] ..; returns the status."""
    if not _lib.bound("flashc_kvcache_append"):
        raise NotImplementedError(
            "flashc: appending to a KV cache (flash_attn_with_kvcache with k, v) needs a libflashc with "
            "flashc_kvcache_append; the loaded %s (version %s) lacks it: rebuild it"
            % (_lib.library_path, _lib.version()))
    return _lib.lib.flashc_kvcache_append(ctx.handle, k_cache, v_cache, k_new, v_new, cache_seqlens_ptr)


def kvcache_append_paged_status(ctx, k_cache, v_cache, k_new, v_new, cache_seqlens_ptr, block_table_ptr, max_pages,
                                stride):
    """flashc_kvcache_append_paged on flashc_tensor views: the new rows written in place into the page pools at the
    pages block_table names; returns the status."""
    if not _lib.bound("flashc_kvcache_append_paged"):
        raise NotImplementedError(
            "flashc: appending to a paged KV cache (flash_attn_with_kvcache with block_table, k, v) needs libflashc "
            "0.4 or later; the loaded %s (version %s) lacks flashc_kvcache_append_paged: rebuild it"
            % (_lib.library_path, _lib.version()))
    return _lib.lib.flashc_kvcache_append_paged(ctx.handle, k_cache, v_cache, k_new, v_new, cache_seqlens_ptr,
                                                block_table_ptr, max_pages, stride)


def rotary_status(ctx, x, cos, sin, seq_start_ptr, interleaved, out):
    """flashc_rotary on flashc_tensor views (cos, sin (1, P, 1, R/2); seq_start_ptr None: every sequence from 0): x
    rotated into out (which may be x); returns the status. Callers check bound("flashc_rotary") first."""
    return _lib.lib.flashc_rotary(ctx.handle, x, cos, sin, seq_start_ptr, 1 if interleaved else 0, out)


def merge_lse_shape(out_shape):
    """The lse shape of merge parts shaped out_shape: (B, H, Nq) for (B, Nq, H, D), (H, total_q) for packed
    (total_q, H, D)."""
    if len(out_shape) == 4:
        return (out_shape[0], out_shape[2], out_shape[1])
    if len(out_shape) == 3:
        return (out_shape[1], out_shape[0])
    raise ValueError("flashc: merge parts must be (B, Nq, H, D), or (total_q, H, D) packed (varlen), got shape %s"
                     % (tuple(out_shape),))


def check_merge_shapes(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """Shapes of merge_attention's arguments (tuples; out, lse None when not given); returns the lse shape."""
    want = merge_lse_shape(out_a)
    if tuple(out_b) != tuple(out_a):
        raise ValueError("flashc: out_a and out_b must have one shape, got %s and %s" % (tuple(out_a), tuple(out_b)))
    if out is not None and tuple(out) != tuple(out_a):
        raise ValueError("flashc: out must have out_a's shape %s, got %s" % (tuple(out_a), tuple(out)))
    for name, shape in (("lse_a", lse_a), ("lse_b", lse_b), ("lse", lse)):
        if shape is not None and tuple(shape) != want:
            raise ValueError("flashc: %s must be %s = %s for parts of shape %s (the forward's softmax_lse), got %s"
                             % (name, "(B, H, Nq)" if len(out_a) == 4 else "(H, total_q)", want, tuple(out_a),
                                tuple(shape)))
    return want


def merge_status(ctx, out_a, lse_a_ptr, out_b, lse_b_ptr, out, lse_ptr):
    """flashc_merge on flashc_tensor views and lse pointers (lse_ptr None: not written); returns the status."""
    if not _lib.bound("flashc_merge"):
        raise NotImplementedError(
            "flashc: merge_attention needs a libflashc with flashc_merge; the loaded %s (version %s) lacks it: "
            "rebuild it" % (_lib.library_path, _lib.version()))
    return _lib.lib.flashc_merge(ctx.handle, out_a, lse_a_ptr, out_b, lse_b_ptr, out, lse_ptr)


def workspace_size(ctx, op, q, k, v, params):
    import ctypes

    n = ctypes.c_size_t(0)
    fn = _lib.lib.flashc_forward_workspace_size if op == _lib.OP_FORWARD else _lib.lib.flashc_backward_workspace_size
    _lib.check(fn(ctx.handle, q, k, v, params, ctypes.byref(n)), fn.__name__, ctx.handle)
    return n.value


def last_error(ctx):
    return _lib._s(_lib.lib.flashc_context_last_error(ctx.handle))
