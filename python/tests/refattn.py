"""Materialized attention in numpy (fp64, or rounding each stage to a low precision) for the tests.

Semantics follow CONVENTIONS.md: bottom-right aligned causal and window, softcap before masks and ALiBi, ALiBi
distance |i + Nk - Nq - j| (with positions (q_position, k_position): row i at q_position + i, key j at k_position + j,
the band and the ALiBi distance measured between those, flashc_params.positions), block mask bytes per (query block,
key block), rows with no visible key give out 0, lse +inf and zero gradients. The backward is written out by hand (dV = P^T dO, dS = P * (dP - rowsum(dO * O)),
softcap's chain rule, GQA sums), independently of the library's code.

An attention sink is one more term of each row's softmax denominator, exp(sink_h), without a value: lse includes it,
a row that sees no key gets out 0 and lse = sink_h, and dL/dsink_h = -sum_i exp(sink_h - lse_i) rowsum(dO * O)_i.
"""

import numpy as np


def _identity(x):
    return x


def token_positions(nq, nk, positions=None):
    """Positions of the queries (nq, 1) and keys (1, nk): (q_position + i, k_position + j), or bottom-right aligned
    (i + nk - nq, j) when positions is None."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    if positions is None:
        return i + nk - nq, j
    return i + positions[0], j + positions[1]


def visible(nq, nk, causal=False, window=(-1, -1), positions=None):
    """Boolean (nq, nk): key j is kept for query i."""
    qp, kp = token_positions(nq, nk, positions)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    keep = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        keep &= kp >= qp - left
    if right >= 0:
        keep &= kp <= qp + right
    return keep


def _sequence(q, k, v, do, b, scale, causal, window, softcap, alibi, block_mask, block_size, rnd, sinks=None,
              positions=None):
    """One sequence: q (Nq, H, D), k/v (Nk, Hkv, D), do like q or None -> out, lse (H, Nq), grads (with sinks:
    dq, dk, dv and this sequence's dsinks (H,))."""
    nq, h, d = q.shape
    nk, hkv, _ = k.shape
    g = h // hkv
    kr = np.repeat(k, g, axis=1)  # query head h reads kv head h // g
    vr = np.repeat(v, g, axis=1)
    s = rnd(scale * np.einsum("ihd,jhd->hij", q, kr))
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:
        slopes = alibi if alibi.ndim == 1 else alibi[b]
        qp, kp = token_positions(nq, nk, positions)
        s = s - slopes[:, None, None] * np.abs(qp - kp)[None]
    keep = np.broadcast_to(visible(nq, nk, causal, window, positions)[None], (h, nq, nk)).copy()
    if block_mask is not None:
        bq, bk = block_size
        m = block_mask
        m = m[None, None] if m.ndim == 2 else (m[None] if m.ndim == 3 else m)
        mb = m[0 if m.shape[0] == 1 else b]
        mb = np.broadcast_to(mb, (h,) + mb.shape[1:])
        keep &= mb[:, np.arange(nq) // bq][:, :, np.arange(nk) // bk] != 0
    s = np.where(keep, s, -np.inf)
    empty = ~keep.any(axis=-1)  # (h, nq)
    mx = np.where(empty, 0.0, s.max(axis=-1, initial=-np.inf))
    if sinks is not None:
        mx = np.where(empty, sinks[:, None], np.maximum(mx, sinks[:, None]))
    e = np.where(keep, np.exp(s - mx[..., None]), 0.0)
    den = e.sum(axis=-1)
    if sinks is not None:
        den = den + np.exp(sinks[:, None] - mx)  # the sink's term: empty rows get den 1, lse = sink
        empty = np.zeros_like(empty)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, np.inf, mx + np.log(np.where(empty, 1.0, den)))
    p = rnd(e / np.where(empty, 1.0, den)[..., None])
    out = rnd(np.einsum("hij,jhd->ihd", p, vr))
    if do is None:
        return out, lse, None
    dvr = rnd(np.einsum("hij,ihd->jhd", p, do))
    dp = rnd(np.einsum("ihd,jhd->hij", do, vr))
    di = np.einsum("ihd,ihd->hi", do, out)
    ds = rnd(p * (dp - di[..., None]))
    if softcap:
        ds = ds * (1.0 - t * t)
    dq = rnd(scale * np.einsum("hij,jhd->ihd", ds, kr))
    dkr = rnd(scale * np.einsum("hij,ihd->jhd", ds, q))
    # The group sum is a stage of its own (the backward of repeating k/v over the heads), rounded like the others.
    dk = rnd(dkr.reshape(nk, hkv, g, d).sum(axis=2))
    dv = rnd(dvr.reshape(nk, hkv, g, d).sum(axis=2))
    if sinks is None:
        return out, lse, (dq, dk, dv)
    dsinks = -(np.exp(sinks[:, None] - lse) * di).sum(axis=-1)
    return out, lse, (dq, dk, dv, dsinks)


def attention(q, k, v, dout=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, block_mask=None, block_size=None, cu_seqlens_q=None, cu_seqlens_k=None,
              rnd=_identity, sinks=None, positions=None):
    """(out, lse, grads or None) in fp64 for the layouts of flashc.attention: (B, N, H, D), or (total, H, D)
    with cu_seqlens. rnd rounds after each materialized stage (identity: the fp64 oracle). With sinks, grads is
    (dq, dk, dv, dsinks). positions: None, or (q_position, k_position) for every sequence."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    do = None if dout is None else np.asarray(dout, dtype=np.float64)
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    alibi = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    varlen = cu_seqlens_q is not None
    if varlen:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        seqs = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]
        out = np.zeros(q.shape)
        lse = np.zeros((q.shape[1], q.shape[0]))
    else:
        seqs = [(b, b) for b in range(q.shape[0])]
        out = np.zeros(q.shape)
        lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    grads = None if do is None else (np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape))
    if grads is not None and sinks is not None:
        grads += (np.zeros(sinks.shape),)
    for b, (sq, sk) in enumerate(seqs):
        qb, kb, vb = q[sq], k[sk], v[sk]
        if qb.shape[0] == 0:
            continue
        if kb.shape[0] == 0:
            lse_b = np.full((q.shape[-2], qb.shape[0]), np.inf)
            if sinks is not None:
                lse_b[:] = sinks[:, None]
            o, g = np.zeros(qb.shape), None
        else:
            o, lse_b, g = _sequence(qb, kb, vb, None if do is None else do[sq], b, scale, causal, window_size,
                                    softcap, alibi, block_mask, block_size, rnd, sinks, positions)
        out[sq] = o
        if varlen:
            lse[:, sq] = lse_b
        else:
            lse[b] = lse_b
        if g is not None:
            for acc, gi, s in zip(grads, g[:3], (sq, sk, sk)):
                acc[s] = gi
            if sinks is not None:
                grads[3][:] += g[3]
    return out, lse, grads


def rounder(dtype):
    """Rounds to dtype and back to float64 (numpy has float16; bfloat16 goes through torch in its tests)."""
    return lambda x: np.asarray(x).astype(dtype).astype(np.float64)


def rel_err(got, ref):
    """||got - ref|| / ||ref|| over the finite entries (lse's +inf rows are compared separately)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    num = np.linalg.norm((got - ref).ravel())
    den = np.linalg.norm(ref.ravel())
    return num / den if den > 0 else num


def check_lowp(name, got, ref, naive, factor):
    """CONVENTIONS.md's rule: max|got - ref| <= factor * max|naive - ref| + 1e-5."""
    got = np.asarray(got, dtype=np.float64)
    err = np.abs(got - ref).max()
    base = np.abs(naive - ref).max()
    assert err <= factor * base + 1e-5, "%s: max error %.3g > %g x naive low-precision error %.3g + 1e-5" % (
        name, err, factor, base)
