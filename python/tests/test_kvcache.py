"""flash_attn_with_kvcache on a contiguous cache: the in-place append (flashc_kvcache_append), attention to each
sequence's used rows (seqused_k), rotary embedding, and the arguments flashc refuses, on CPU and (when torch sees a
GPU and libflashc has the CUDA backend) CUDA. Paged caches (block_table): the same calls through a shuffled page pool
against the contiguous cache they mirror, bit for bit (CPU and CUDA), and flash_attn_varlen_func with block_table
against the packed keys, gradients included (CPU).

The reference is independent of the library's append: sequence b's keys are its first cache_seqlens[b] rows of the
cache as it was before the call, followed by the new rows (rotated with flash-attn's own torch formulation,
rotate_half with repeated cos / sin, in fp64, then rounded to the cache's dtype, in which the cache must store them);
attention on them is test_torch's materialized fp64 reference. Every unfilled cache row holds NaN, so a read past
the used rows shows up as a non-finite output. Accuracy follows CONVENTIONS.md: fp32 within 1e-5 relative error;
fp16/bf16 within 2x the naive algorithm run in the same low precision on the same rounded operands, plus 1e-5. The
rotation itself is held to the fp64 one on the cache rows it writes.
"""

import pytest

torch = pytest.importorskip("torch")

import flashc  # noqa: E402
# gen: test_torch's seeded-generator fixture, used by name
from test_torch import CUDA_REASON, attn_ref, check_close, cuda_ready, gen, rule_dtype  # noqa: E402,F401

needs_cuda = pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- inputs and reference ----------------------------------------------------------------------------------------
def make_cache(b, nk, hkv, d, filled, dtype, device):
    """k_cache, v_cache (B, Nk_max, Hkv, D): random rows below filled[b], NaN in every other row."""
    kc = torch.full((b, nk, hkv, d), float("nan"), device=device)
    vc = kc.clone()
    for i, n in enumerate(filled):
        kc[i, :n] = torch.randn(n, hkv, d, device=device)
        vc[i, :n] = torch.randn(n, hkv, d, device=device)
    return kc.to(dtype), vc.to(dtype)


def rotary_tables(positions, rotary_dim, dtype, device):
    """cos, sin (positions, rotary_dim / 2) of the usual rotary frequencies (base 10000)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype)


def rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_ref(x, cos, sin, pos, interleaved, dt):
    """flash-attn's apply_rotary_emb_torch, with cos / sin gathered per row: x (B, N, heads, D), pos (B, N), in dt."""
    r = 2 * cos.shape[1]
    c, s = cos.to(dt)[pos], sin.to(dt)[pos]  # (B, N, R/2)
    rep = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    c, s = rep(c)[:, :, None], rep(s)[:, :, None]
    xr = x[..., :r].to(dt)
    return torch.cat((xr * c + rotate_half(xr, interleaved) * s, x[..., r:].to(dt)), dim=-1)


def operand_dtype(dtype, device):
    """The dtype the backend's products read when it differs from the inputs' (fp32 on CUDA runs on bf16 operands),
    else None. The fp32-on-CUDA results are held to the bf16 rule against the fp64 attention of those bf16 values:
    against the fp64 attention of the fp32 values the rounding of q and k alone moves lse by 0.016-0.045 at these
    shapes (one query row x 6), which the naive bf16 algorithm shares only in part, so "2 x naive" failed at about one
    seed in three (lab/kv_f32_probe.py on an H200: the kernel's lse is within 3e-6 of the fp64 lse of its operands)."""
    low = rule_dtype(dtype, device)
    return low if low != dtype else None


def reference(q, kc0, vc0, k, v, filled, opts, rotary=None, low=None, rot_base=None, operand=None):
    """out, lse of the kvcache call, and the new key rows rotated in fp64 (None without rotary), computed from the
    cache before the call (kc0, vc0) without the library: in fp64, or (low: a dtype) the naive algorithm in that
    dtype. Rotated q and k are rounded to the inputs' dtype before the attention, in both: the cache has to store
    the rotated keys in its dtype (flash-attn's kernel rounds the rotated q too), so that rounding is part of the
    operation and is checked on its own (the cache rows against the fp64 rotation), not charged to the attention.
    rot_base: each sequence's first new row's rotary position (default: filled). operand: the dtype the backend's
    products read (bf16 for fp32 on CUDA, operand_dtype): q, k and v (rotated first) rounded to it, so that the fp64
    result is that of the values the kernel multiplies."""
    dt = torch.float64 if low is None else low
    rnd = (lambda t: t) if operand is None else (lambda t: t.to(operand).to(t.dtype))
    rot_dt = torch.float64 if low is None else torch.float32
    b, nq = q.shape[:2]
    nnew = 0 if k is None else k.shape[1]
    fl = torch.tensor(filled if rot_base is None else rot_base, device=q.device)[:, None]
    kn, k_exact = (None if k is None else k.to(dt)), None
    if rotary is not None:
        cos, sin, interleaved, advance = rotary
        k_exact = rotary_ref(k, cos, sin, fl + torch.arange(nnew, device=q.device), interleaved, rot_dt)
        kn = rnd(k_exact.to(k.dtype)).to(dt)
        qpos = fl + torch.arange(nq, device=q.device) if advance else fl.expand(b, nq)
        q = rotary_ref(q, cos, sin, qpos, interleaved, rot_dt).to(q.dtype)
    elif k is not None:
        kn = rnd(k).to(dt)
    q = rnd(q).to(dt)
    outs, lses = [], []
    for i, n in enumerate(filled):
        ks, vs = rnd(kc0[i:i + 1, :n]).to(dt), rnd(vc0[i:i + 1, :n]).to(dt)
        if k is not None:
            ks, vs = torch.cat((ks, kn[i:i + 1]), dim=1), torch.cat((vs, rnd(v[i:i + 1]).to(dt)), dim=1)
        o = dict(opts)
        if o.get("alibi_slopes") is not None and o["alibi_slopes"].dim() == 2:
            o["alibi_slopes"] = o["alibi_slopes"][i:i + 1]
        out, lse = attn_ref(q[i:i + 1], ks, vs, upcast=low is None, **o)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_exact


def same_bits(a, b):
    """Bitwise equality (NaN rows included)."""
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return a.shape == b.shape and torch.equal(a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype]))


# (name, B, Nk_max, Nq, Nnew (None: no k, v), H, Hkv, D, cache_seqlens, options)
CASES = [
    ("decode_causal_gqa", 3, 64, 1, 1, 4, 2, 64, [0, 17, 50], dict(causal=True)),
    ("decode_mqa", 3, 64, 1, 1, 8, 1, 64, [5, 0, 63], {}),
    ("prefill_causal", 3, 64, 5, 5, 4, 2, 64, [0, 17, 59], dict(causal=True)),
    ("prefill_noncausal", 3, 64, 5, 5, 4, 4, 32, [0, 17, 59], {}),
    ("prefill_q_gt_new", 2, 48, 7, 3, 4, 2, 64, [0, 20], dict(causal=True)),
    ("no_kv_causal", 3, 64, 3, None, 4, 2, 64, [0, 2, 64], dict(causal=True)),
    ("no_kv", 3, 40, 4, None, 4, 1, 32, [1, 13, 40], {}),
    ("window_softcap", 2, 64, 5, 5, 4, 2, 64, [10, 40], dict(window_size=(8, 2), softcap=5.0)),
    ("causal_window", 2, 64, 4, 4, 4, 2, 64, [30, 3], dict(causal=True, window_size=(6, -1))),
    ("alibi_h_scale", 2, 64, 5, 5, 4, 2, 64, [7, 30], dict(causal=True, alibi="h", softmax_scale=0.2)),
    ("alibi_bh_sinks", 3, 64, 1, 1, 4, 2, 64, [0, 11, 50], dict(alibi="bh", sinks=True)),
    ("sinks_causal", 2, 48, 5, 5, 6, 2, 32, [0, 30], dict(causal=True, sinks=True)),
]


def resolve(opts, b, h, device):
    """Options for flash_attn_with_kvcache and, split off, for the reference."""
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi == "h":
        opts["alibi_slopes"] = torch.rand(h, device=device) * 0.5
    elif alibi == "bh":
        opts["alibi_slopes"] = torch.rand(b, h, device=device) * 0.5
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(h, device=device) + 3.0
    return opts


def run_case(case, dtype, device, rotary=None, seqlens_as=torch.int32):
    """One call and its checks. rotary: None, or (rotary_dim, interleaved)."""
    _, b, nk, nq, nnew, h, hkv, d, filled, opts = case
    opts = resolve(opts, b, h, device)
    kc, vc = make_cache(b, nk, hkv, d, filled, dtype, device)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(b, nq, h, d, device=device)
    q[:, torch.randperm(nq)[:1]] *= 6.0  # a row with large logits
    q = q.to(dtype)
    k = v = None
    if nnew is not None:
        k = torch.randn(b, nnew, hkv, d, device=device).to(dtype)
        v = torch.randn(b, nnew, hkv, d, device=device).to(dtype)
    seqlens = torch.tensor(filled, dtype=seqlens_as, device=device) if seqlens_as is not None else None
    kw = dict(opts)
    rot = None
    if rotary is not None:
        rdim, interleaved = rotary
        cos, sin = rotary_tables(nk, rdim, dtype, device)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
        left, right = opts.get("window_size", (-1, -1))
        rot = (cos, sin, interleaved, opts.get("causal", False) or 0 <= left < nk or 0 <= right < nk)

    out, lse = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, return_softmax_lse=True, **kw)

    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "a NaN row past the used keys was read"
    used = filled if nnew is None else [n + nnew for n in filled]
    ref_opts = {n: t for n, t in opts.items()}
    low = rule_dtype(dtype, device)
    ref_out, ref_lse, ref_k = reference(q, kc0, vc0, k, v, filled, ref_opts, rot, operand=operand_dtype(dtype, device))
    low_out, low_lse, _ = reference(q, kc0, vc0, k, v, filled, ref_opts, rot, low=low)
    check_close("out", out, ref_out, low_out, low, 2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin), "rows that see no key must have lse +inf, and only those"
    if low == dtype and dtype == torch.float32:
        torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=2e-5, atol=2e-5)
    else:
        check_close("lse", lse[fin], ref_lse[fin], low_lse[fin], low, 2)

    # the caches: the new rows hold k (rotated) and v, every other row is as it was, bit for bit
    for i, n in enumerate(filled):
        new = slice(n, used[i])
        assert same_bits(kc[i, :n], kc0[i, :n]) and same_bits(vc[i, :n], vc0[i, :n])
        assert same_bits(kc[i, used[i]:], kc0[i, used[i]:]) and same_bits(vc[i, used[i]:], vc0[i, used[i]:])
        if nnew is None:
            continue
        assert same_bits(vc[i, new], v[i])
        if rot is None:
            assert same_bits(kc[i, new], k[i])
        else:
            # rotated in fp32 and rounded once to the cache's dtype: within half an ulp of the fp64 rotation
            tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
            torch.testing.assert_close(kc[i, new].double(), ref_k[i], rtol=tol, atol=tol)
    return out, lse


# ---- decode, chunked prefill, no k / v, masks, ALiBi, sinks ------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvcache(case, dtype, device, gen):
    run_case(case, dtype, device)


# ---- cache_batch_idx and cache_leftpad ---------------------------------------------------------------------------
# (name, cache_batch_idx (None: the identity), cache_leftpad (None: none), cache_seqlens, Nq, Nnew, options)
INDEX_CASES = [
    ("batch_idx_decode_causal", [4, 0, 2], None, [10, 0, 63], 1, 1, dict(causal=True)),
    ("batch_idx_no_kv", [1, 3, 0], None, [9, 40, 1], 3, None, {}),
    ("leftpad_decode", None, [3, 0, 17], [10, 0, 40], 1, 1, {}),
    ("leftpad_prefill_causal_window", None, [5, 2, 30], [5, 20, 40], 4, 4, dict(causal=True, window_size=(6, -1))),
    ("leftpad_alibi_no_kv", None, [1, 8, 0], [12, 30, 5], 2, None, dict(causal=True, alibi="h")),
    ("both_prefill_causal", [3, 1, 4], [2, 9, 0], [7, 33, 0], 3, 3, dict(causal=True)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("case", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_kvcache_batch_idx_leftpad(case, rotary, dtype, device, gen):
    """flash-attn's cache_batch_idx and cache_leftpad: sequence b reads cache bidx[b] from row leftpad[b] on (keys
    counted from there for causal, windows and ALiBi; rotary positions are the cache rows), its new rows are
    written at row cache_seqlens[b] of that cache, and no other cache row changes."""
    _, bidx, lpad, filled, nq, nnew, opts = case
    if rotary and nnew is None:
        pytest.skip("rotary needs new keys")
    b, nk, h, hkv, d = 3, 64, 4, 2, 64
    bc = 5 if bidx is not None else b
    sel = bidx if bidx is not None else list(range(b))
    lp = lpad if lpad is not None else [0] * b
    fill_c = [7] * bc
    for i, c in enumerate(sel):
        fill_c[c] = filled[i]
    opts = resolve(opts, b, h, device)
    kc, vc = make_cache(bc, nk, hkv, d, fill_c, dtype, device)
    for i, c in enumerate(sel):  # the left padding: NaN, never to be read
        kc[c, :lp[i]] = float("nan")
        vc[c, :lp[i]] = float("nan")
    kc0, vc0 = kc.clone(), vc.clone()
    q = (torch.randn(b, nq, h, d, device=device) * 2.0).to(dtype)
    k = v = None
    if nnew is not None:
        k = torch.randn(b, nnew, hkv, d, device=device).to(dtype)
        v = torch.randn(b, nnew, hkv, d, device=device).to(dtype)
    kw = dict(opts)
    rot = None
    if rotary:
        cos, sin = rotary_tables(nk, 32, dtype, device)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
        rot = (cos, sin, False, True if opts.get("causal") or "window_size" in opts else False)
    as_t = (lambda x: None if x is None else torch.tensor(x, dtype=torch.int32, device=device))
    out, lse = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=as_t(filled), cache_batch_idx=as_t(bidx),
                                              cache_leftpad=as_t(lpad), return_softmax_lse=True, **kw)
    assert torch.isfinite(out).all(), "a padding row or a row past the used keys was read"

    # reference: each sequence's keys are rows leftpad .. cache_seqlens of its cache (then the new ones), moved to
    # the front of a cache of its own; rotary at the cache rows
    ks0 = torch.full((b, nk, hkv, d), float("nan"), device=device).to(dtype)
    vs0 = ks0.clone()
    for i, c in enumerate(sel):
        ks0[i, :filled[i] - lp[i]] = kc0[c, lp[i]:filled[i]]
        vs0[i, :filled[i] - lp[i]] = vc0[c, lp[i]:filled[i]]
    rel = [n - p for n, p in zip(filled, lp)]
    low = rule_dtype(dtype, device)
    ref_out, ref_lse, ref_k = reference(q, ks0, vs0, k, v, rel, opts, rot, rot_base=filled,
                                        operand=operand_dtype(dtype, device))
    low_out, low_lse, _ = reference(q, ks0, vs0, k, v, rel, opts, rot, low=low, rot_base=filled)
    check_close("out", out, ref_out, low_out, low, 2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    check_close("lse", lse[fin], ref_lse[fin], low_lse[fin], low, 2)

    # the caches: sequence b's new rows at rows cache_seqlens[b] .. of cache bidx[b]; every other row as it was
    expect_k, expect_v = kc0.clone(), vc0.clone()
    if nnew is not None:
        for i, c in enumerate(sel):
            expect_v[c, filled[i]:filled[i] + nnew] = v[i]
            expect_k[c, filled[i]:filled[i] + nnew] = k[i] if rot is None else kc[c, filled[i]:filled[i] + nnew]
            if rot is not None:
                tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
                torch.testing.assert_close(kc[c, filled[i]:filled[i] + nnew].double(), ref_k[i], rtol=tol, atol=tol)
    assert same_bits(kc, expect_k) and same_bits(vc, expect_v)


# ---- rotary embedding --------------------------------------------------------------------------------------------
ROTARY_CASES = [c for c in CASES if c[0] in ("decode_causal_gqa", "prefill_causal", "prefill_noncausal",
                                             "window_softcap", "prefill_q_gt_new")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32, 16], ids=lambda r: "rdim%d" % r)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("case", ROTARY_CASES, ids=[c[0] for c in ROTARY_CASES])
def test_kvcache_rotary(case, interleaved, rotary_dim, dtype, device, gen):
    d = case[7]
    if rotary_dim > d:
        pytest.skip("rotary dim %d > head dim %d" % (rotary_dim, d))
    run_case(case, dtype, device, rotary=(rotary_dim, interleaved))


def test_rotary_positions_cpu(gen):
    """Without causal or a binding window every query sits at cache_seqlens (flash-attn's rule), so all the rows of
    one q give the same output when q's rows are equal; with causal they sit at cache_seqlens + i, and differ."""
    b, nk, h, d = 2, 32, 2, 32
    cos, sin = rotary_tables(nk, d, torch.float32, "cpu")
    q = torch.randn(b, 1, h, d).expand(b, 4, h, d).contiguous()
    outs = []
    for causal, window in ((False, (-1, -1)), (False, (nk, nk)), (True, (-1, -1))):
        kc, vc = make_cache(b, nk, h, d, [3, 9], torch.float32, "cpu")
        k, v = torch.randn(b, 4, h, d), torch.randn(b, 4, h, d)
        out = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=torch.tensor([3, 9]),
                                             causal=causal, window_size=window)
        outs.append(out)
    for out in outs[:2]:  # a window as long as the cache binds nothing: the queries stay at one position
        assert torch.allclose(out, out[:, :1].expand_as(out), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outs[2][:, 0], outs[2][:, 1])


# ---- calling conventions -----------------------------------------------------------------------------------------
def test_cache_seqlens_forms_cpu(gen):
    """cache_seqlens as an int, an int64 tensor or a list gives what the int32 tensor gives; None with no k, v is the
    whole cache; without return_softmax_lse the output alone comes back; num_splits is accepted and ignored."""
    b, nk, h, d = 2, 24, 4, 32
    q = torch.randn(b, 2, h, d)
    kc, vc = make_cache(b, nk, h, d, [nk, nk], torch.float32, "cpu")
    k, v = torch.randn(b, 2, h, d), torch.randn(b, 2, h, d)
    results = []
    for seqlens in (7, torch.tensor([7, 7]), [7, 7], torch.tensor([7, 7], dtype=torch.int32)):
        kcc, vcc = kc.clone(), vc.clone()
        out = flashc.flash_attn_with_kvcache(q, kcc, vcc, k, v, cache_seqlens=seqlens, causal=True, num_splits=3)
        assert isinstance(out, torch.Tensor)
        results.append((out, kcc, vcc))
    for out, kcc, vcc in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(kcc, results[0][1]) and torch.equal(vcc, results[0][2])
    ref, _, _ = reference(q, kc, vc, k, v, [7, 7], dict(causal=True))
    assert ((results[0][0].double() - ref).norm() / ref.norm()).item() <= 1e-5

    whole, lse = flashc.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True)
    ref_out, ref_lse = attn_ref(q, kc, vc)
    assert ((whole.double() - ref_out).norm() / ref_out.norm()).item() <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


def test_planned_decode_cpu(gen):
    """Plain calls (no new keys, no tensor options but cache_seqlens) go through flashc.ops' kvcache plans after a key's
    first call: the full path's bits, out contiguous and without autograd, cache_seqlens read at each call (its values
    may change, not its address), the lse only when asked; calls the plan cannot take, and errors, take the full
    path."""
    from flashc import _torch, ops

    b, nk, h, hkv, d = 2, 40, 8, 2, 32
    kc, vc = make_cache(b, nk, hkv, d, [nk, nk], torch.float32, "cpu")
    q = torch.randn(b, 3, 1, h, d)[:, 1]  # (B, 1, H, D), strided along B
    lens = torch.tensor([17, 33], dtype=torch.int32)

    def full(seqlens, **kw):
        return _torch.with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)

    for kw in (dict(causal=True), dict(softmax_scale=0.3, window_size=(5, 0), softcap=2.0)):
        for seqlens in (lens, None):
            key_calls = [flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True,
                                                        **kw) for _ in range(3)]
            want = full(seqlens, **kw)
            for out, lse in key_calls:
                assert out.is_contiguous() and torch.equal(out, want[0]) and torch.equal(lse, want[1])
            assert torch.equal(flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw), want[0])
    lens[0] = 5  # the same tensor with other lengths: the plan reads it at the call
    assert torch.equal(flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True),
                       full(lens, causal=True)[0])
    qg = q.clone().requires_grad_()
    out = flashc.flash_attn_with_kvcache(qg, kc, vc, cache_seqlens=lens, causal=True)
    assert out.grad_fn is None and not out.requires_grad
    key = [k for k in ops._local.plans if k[-1] == ops._KV]
    assert key, "no kvcache plan was made"
    # an int64 tensor and an int are not planned (the full path converts them)
    for seqlens in (lens.long(), 5):
        for _ in range(2):
            got = flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)
            assert torch.equal(got, full(seqlens, causal=True)[0])
    lens[1] = nk + 1  # a length past the cache: the planned call is refused, the full path raises the library's error
    with pytest.raises(Exception, match="seqused_k"):
        flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)


def test_planned_decode_keys_cpu(gen):
    """What a kvcache plan's key must tell apart: cache_seqlens on another device with the same shape (a meta tensor
    has no data, so its planned call would attend every row) and a tensor softmax_scale or softcap changed in place
    (a plan keeps the value it was made with: tensor options take the full path)."""
    from flashc import _torch

    b, nk, h, hkv, d = 2, 40, 8, 2, 32
    kc, vc = make_cache(b, nk, hkv, d, [nk, nk], torch.float32, "cpu")
    q = torch.randn(b, 1, h, d)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    for _ in range(3):
        flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    with pytest.raises((NotImplementedError, RuntimeError, ValueError, TypeError)):
        flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.empty(2, dtype=torch.int32, device="meta"))
    for opt in ("softmax_scale", "softcap"):
        x = torch.tensor(0.5)
        for _ in range(3):
            flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **{opt: x})
        x.fill_(0.1)
        got = flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **{opt: x})
        want = _torch.with_kvcache(q, kc, vc, cache_seqlens=lens, **{opt: 0.1})[0]
        assert torch.equal(got, want), opt


def test_inference_only_and_version_cpu(gen):
    """No autograd node (inference), the caller's q and k are not rotated in place, and the caches' version counter
    moves (the library wrote them)."""
    b, nk, h, d = 2, 16, 2, 32
    q = torch.randn(b, 1, h, d, requires_grad=True)
    kc, vc = make_cache(b, nk, h, d, [2, 5], torch.float32, "cpu")
    k, v = torch.randn(b, 1, h, d), torch.randn(b, 1, h, d)
    q0, k0 = q.detach().clone(), k.clone()
    cos, sin = rotary_tables(nk, d, torch.float32, "cpu")
    before = (kc._version, vc._version)
    out = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=torch.tensor([2, 5]))
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(q.detach(), q0) and torch.equal(k, k0)
    assert kc._version > before[0] and vc._version > before[1]
    with torch.inference_mode():
        kc2, vc2 = make_cache(b, nk, h, d, [2, 5], torch.float32, "cpu")
        flashc.flash_attn_with_kvcache(q0, kc2, vc2, k, v, cache_seqlens=torch.tensor([2, 5]))
        assert torch.equal(kc2[0, 2], k[0, 0]) and torch.equal(kc2[1, 5], k[1, 0])


def test_strided_caches_cpu(gen):
    """A cache laid out (B, Hkv, Nk_max, D) in memory (passed as a transposed view) is written in place."""
    b, nk, h, d = 2, 20, 2, 32
    kc_t = torch.full((b, h, nk, d), float("nan"))
    vc_t = torch.full((b, h, nk, d), float("nan"))
    kc_t[:, :, :6] = torch.randn(b, h, 6, d)
    vc_t[:, :, :6] = torch.randn(b, h, 6, d)
    kc, vc = kc_t.transpose(1, 2), vc_t.transpose(1, 2)
    kc0, vc0 = kc.clone(), vc.clone()
    q, k, v = torch.randn(b, 3, h, d), torch.randn(b, 3, h, d), torch.randn(b, 3, h, d)
    out = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=6, causal=True)
    assert torch.equal(kc_t.transpose(1, 2)[:, 6:9], k) and torch.equal(vc_t.transpose(1, 2)[:, 6:9], v)
    ref, _, _ = reference(q, kc0, vc0, k, v, [6, 6], dict(causal=True))
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5


def test_packed_cache_cpu(gen):
    """k and v halves of one packed (B, Nk_max, 2, Hkv, D) cache, as flash-attn's modules pass them: interleaved in
    memory but sharing no element, so the library takes them."""
    b, nk, h, d = 2, 20, 2, 32
    kv = torch.full((b, nk, 2, h, d), float("nan"))
    kv[:, :6] = torch.randn(b, 6, 2, h, d)
    kc, vc = kv[:, :, 0], kv[:, :, 1]
    kc0, vc0 = kc.clone(), vc.clone()
    q, k, v = torch.randn(b, 3, h, d), torch.randn(b, 3, h, d), torch.randn(b, 3, h, d)
    out = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=6, causal=True)
    assert torch.equal(kv[:, 6:9, 0], k) and torch.equal(kv[:, 6:9, 1], v)
    assert torch.equal(kv[:, :6], torch.stack((kc0[:, :6], vc0[:, :6]), dim=2))
    ref, _, _ = reference(q, kc0, vc0, k, v, [6, 6], dict(causal=True))
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5


# ---- refusals: nothing is written --------------------------------------------------------------------------------
def test_errors_cpu(gen):
    b, nk, h, d = 2, 16, 4, 32
    q = torch.randn(b, 1, h, d)
    kc, vc = make_cache(b, nk, 2, d, [3, 8], torch.float32, "cpu")
    kc0, vc0 = kc.clone(), vc.clone()
    k, v = torch.randn(b, 1, 2, d), torch.randn(b, 1, 2, d)
    sl = torch.tensor([3, 8], dtype=torch.int32)
    cos, sin = rotary_tables(nk, d, torch.float32, "cpu")

    def call(**kw):
        args = dict(k=k, v=v, cache_seqlens=sl)
        args.update(kw)
        return flashc.flash_attn_with_kvcache(q, kc, vc, **args)

    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    for name, value in (("cache_batch_idx", torch.tensor([1, 0], dtype=torch.int32)),
                        ("cache_leftpad", torch.tensor([0, 1], dtype=torch.int32))):
        with pytest.raises(ValueError, match="do not go with block_table"):
            call(**{name: value, "block_table": bt})
        with pytest.raises(ValueError, match=r"%s must be 1-d .*\(B,\) = \(2,\), got shape \(3,\)" % name):
            call(**{name: torch.tensor([0, 1, 0], dtype=torch.int32)})
        with pytest.raises(TypeError, match=name):
            call(**{name: torch.tensor([0.0, 1.0])})
    # a batch index past the caches, or a negative left padding: refused by the library, nothing written
    for kw in (dict(cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32)),
               dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32), cache_leftpad=torch.tensor([0, -1],
                                                                                                      dtype=torch.int32)),
               dict(cache_batch_idx=torch.tensor([-1, 1], dtype=torch.int32), cache_leftpad=torch.tensor([0, 1],
                                                                                                       dtype=torch.int32))):
        with pytest.raises(flashc.FlashcError):
            call(**kw)
        assert same_bits(kc, kc0) and same_bits(vc, vc0)
    with pytest.raises(ValueError, match=r"cache_leftpad needs k_cache's rows evenly strided"):
        flashc.flash_attn_with_kvcache(q, kc.transpose(0, 1).contiguous().transpose(0, 1), vc, k=k, v=v,
                                       cache_seqlens=sl, cache_leftpad=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens must be an int or 1-d .*\(B,\) = \(2,\), got shape \(3,\)"):
        call(cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"cache_seqlens .*got shape \(\)"):
        call(cache_seqlens=torch.tensor(3))
    with pytest.raises(TypeError, match="cache_seqlens must be an int or an integer tensor"):
        call(cache_seqlens=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="cache_seqlens"):
        call(cache_seqlens="3")
    with pytest.raises(ValueError, match="int32"):
        call(cache_seqlens=torch.tensor([2**32 + 3, 1]))
    with pytest.raises(ValueError, match="cache_seqlens = -1"):
        call(cache_seqlens=-1)
    with pytest.raises(ValueError, match="pass cache_seqlens"):
        call(cache_seqlens=None)
    with pytest.raises(ValueError, match="k and v .* together"):
        call(v=None)
    with pytest.raises(ValueError, match="need k and v"):
        call(k=None, v=None, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        call(rotary_cos=cos)
    with pytest.raises(ValueError, match="exceeds the head dim"):
        call(rotary_cos=torch.ones(nk, d), rotary_sin=torch.ones(nk, d))
    with pytest.raises(ValueError, match="at least k_cache.shape\\[1\\] = 16"):
        call(rotary_cos=cos[:10], rotary_sin=sin[:10])
    with pytest.raises(TypeError, match="share one dtype"):
        call(k=k.half(), v=v.half())
    with pytest.raises(ValueError, match="k and v must both be"):
        call(k=torch.randn(b, 1, 4, d), v=torch.randn(b, 1, 4, d))
    with pytest.raises(ValueError, match="do not fit a cache"):
        call(k=torch.randn(b, nk + 1, 2, d), v=torch.randn(b, nk + 1, 2, d))
    with pytest.raises(ValueError, match="k_cache and v_cache must both be"):
        flashc.flash_attn_with_kvcache(q, kc, vc[:, :8], k, v, cache_seqlens=sl)
    with pytest.raises(ValueError, match="multiple"):
        flashc.flash_attn_with_kvcache(torch.randn(b, 1, 3, d), kc, vc, k, v, cache_seqlens=sl)
    # values the library refuses: rows past the cache (the CPU backend checks every sequence before writing)
    with pytest.raises(flashc.FlashcError, match="cache_seqlens") as e:
        call(cache_seqlens=torch.tensor([3, 16], dtype=torch.int32))
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    # a configuration the backend does not run is refused before the caches are written
    qb, kcb, vcb = torch.randn(b, 1, 2, 300), torch.zeros(b, 4, 2, 300), torch.zeros(b, 4, 2, 300)
    with pytest.raises(flashc.FlashcError, match="head dim") as e:
        flashc.flash_attn_with_kvcache(qb, kcb, vcb, torch.ones(b, 1, 2, 300), torch.ones(b, 1, 2, 300),
                                       cache_seqlens=1)
    assert e.value.status_name == "FLASHC_STATUS_NOT_SUPPORTED"
    assert (kcb == 0).all() and (vcb == 0).all()
    assert same_bits(kc, kc0) and same_bits(vc, vc0), "a refused call wrote the cache"


def test_needs_a_library_with_the_append(gen, monkeypatch):
    """Against a libflashc without flashc_kvcache_append the append is refused by name; attending to the cache
    alone (no k, v) still runs."""
    from flashc import _lib

    monkeypatch.setattr(_lib, "_BOUND", set())
    q = torch.randn(1, 1, 2, 32)
    kc, vc = make_cache(1, 8, 2, 32, [8], torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match="flashc_kvcache_append"):
        flashc.flash_attn_with_kvcache(q, kc, vc, torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 32),
                                       cache_seqlens=3)
    out = flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    ref, _ = attn_ref(q, kc[:, :5], vc[:, :5])
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5


def test_empty_shapes_cpu(gen):
    """No new rows (Nnew = 0), no queries, an empty batch: answered without a library call where it wants positive
    shapes."""
    kc, vc = make_cache(2, 8, 2, 32, [3, 5], torch.float32, "cpu")
    kc0 = kc.clone()
    q = torch.randn(2, 1, 2, 32)
    e = torch.empty(2, 0, 2, 32)
    out = flashc.flash_attn_with_kvcache(q, kc, vc, e, e, cache_seqlens=torch.tensor([3, 5]))
    ref, _ = attn_ref(q[:1], kc[:1, :3], vc[:1, :3])
    assert ((out[:1].double() - ref).norm() / ref.norm()).item() <= 1e-5 and same_bits(kc, kc0)
    k1 = torch.randn(2, 1, 2, 32)
    out = flashc.flash_attn_with_kvcache(q[:, :0], kc, vc, k1, k1, cache_seqlens=torch.tensor([3, 5]))
    assert out.shape == (2, 0, 2, 32) and torch.equal(kc[0, 3], k1[0, 0]) and torch.equal(kc[1, 5], k1[1, 0])
    out = flashc.flash_attn_with_kvcache(q[:0], kc[:0], vc[:0], k1[:0], k1[:0], cache_seqlens=0)
    assert out.shape == (0, 1, 2, 32)


# ---- CUDA --------------------------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_stream_and_graph(gen):
    """Decode steps captured once in a CUDA graph and replayed with new cache_seqlens and inputs written into the
    captured tensors: the same results as eager calls (the lengths never leave the device), on torch's current
    stream."""
    b, nk, h, hkv, d, dtype = 3, 128, 8, 2, 64, torch.bfloat16
    filled = [0, 40, 100]
    kc, vc = make_cache(b, nk, hkv, d, filled, dtype, "cuda")
    kc_e, vc_e = kc.clone(), vc.clone()
    cos, sin = rotary_tables(nk, 32, dtype, "cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype)
    seqlens = torch.tensor(filled, dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=seqlens, causal=True,
                                             return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(kc.clone(), vc.clone())  # warm-up outside the capture (contexts, workspace)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step(kc, vc)
    for it in range(3):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        graph.replay()
        out_e, lse_e = step(kc_e, vc_e)
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        assert same_bits(kc, kc_e) and same_bits(vc, vc_e)
        seqlens.add_(1)
    assert torch.isfinite(out_g).all()


# ---- paged caches (block_table) ----------------------------------------------------------------------------------
def paged_twin(kc, vc, page_size, gen_extra=3):
    """A page pool and block table holding the contiguous caches kc, vc (B, Nk_max, Hkv, D), Nk_max a multiple of
    page_size: pages in a shuffled order, a few more pages than the table names, all NaN."""
    b, nk, hkv, d = kc.shape
    mp = nk // page_size
    npages = b * mp + gen_extra
    perm = torch.randperm(npages)
    table = perm[:b * mp].reshape(b, mp).to(torch.int32)
    kp = torch.full((npages, page_size, hkv, d), float("nan"), dtype=kc.dtype)
    vp = kp.clone()
    kp[table.long()] = kc.reshape(b, mp, page_size, hkv, d)
    vp[table.long()] = vc.reshape(b, mp, page_size, hkv, d)
    return kp, vp, table, perm[b * mp:]


def unpage(pool, table):
    """The contiguous (B, max_pages * page_size, Hkv, D) view of a page pool through its table."""
    b, mp = table.shape
    return pool[table.long()].reshape(b, mp * pool.shape[1], *pool.shape[2:])


PAGED_CASES = [c for c in CASES if c[0] in ("decode_causal_gqa", "prefill_causal", "no_kv_causal", "window_softcap",
                                            "alibi_bh_sinks", "decode_mqa")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_kvcache(case, dtype, page_size, device, gen):
    """flash_attn_with_kvcache through a block table: the appended pool equals the contiguous cache's bit for bit
    (same logical length max_pages * page_size), and so does the attention on the CPU; on CUDA the Hopper kernel may
    take the contiguous call but not the paged one (mma.sync), so there the two agree to the bf16 operands' rounding
    (gpu_fwd checks paged against contiguous bit for bit where both run one kernel); the call against the contiguous
    cache is itself checked against the fp64 reference by run_case."""
    _, b, nk, nq, nnew, h, hkv, d, filled, opts = case
    nk = -(-nk // page_size) * page_size  # whole pages
    opts = resolve(opts, b, h, device)
    kc, vc = make_cache(b, nk, hkv, d, filled, dtype, "cpu")
    kp, vp, table, unused = paged_twin(kc, vc, page_size)
    kc, vc, kp, vp, table = (t.to(device) for t in (kc, vc, kp, vp, table))
    q = torch.randn(b, nq, h, d).to(device, dtype)
    k = v = None
    if nnew is not None:
        k, v = torch.randn(b, nnew, hkv, d).to(device, dtype), torch.randn(b, nnew, hkv, d).to(device, dtype)
    seqlens = torch.tensor(filled, dtype=torch.int32, device=device)
    out_c, lse_c = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, return_softmax_lse=True,
                                                  **opts)
    out_p, lse_p = flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=seqlens, block_table=table,
                                                  return_softmax_lse=True, **opts)
    if device == "cpu":
        assert same_bits(out_p, out_c) and same_bits(lse_p, lse_c)
    else:
        torch.testing.assert_close(out_p.float(), out_c.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse_p, lse_c, atol=1e-3, rtol=1e-3)
    assert same_bits(unpage(kp, table), kc) and same_bits(unpage(vp, table), vc)
    assert torch.isnan(kp[unused]).all() and torch.isnan(vp[unused]).all(), "a page the table does not name was written"


def test_paged_rotary_cpu(gen):
    """Rotary embedding with a paged append: positions count in the sequence (max_pages * page_size of them)."""
    b, nk, ps, hkv, h, d = 2, 64, 16, 2, 4, 64
    kc, vc = make_cache(b, nk, hkv, d, [5, 40], torch.float32, "cpu")
    kp, vp, table, _ = paged_twin(kc, vc, ps)
    q, k, v = torch.randn(b, 3, h, d), torch.randn(b, 3, hkv, d), torch.randn(b, 3, hkv, d)
    cos, sin = rotary_tables(nk, 32, torch.float32, "cpu")
    sl = torch.tensor([5, 40], dtype=torch.int32)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=sl, causal=True)
    out_c = flashc.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    out_p = flashc.flash_attn_with_kvcache(q, kp, vp, k, v, block_table=table, **kw)
    assert same_bits(out_p, out_c) and same_bits(unpage(kp, table), kc)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_varlen_cpu(dtype, page_size, gen):
    """flash_attn_varlen_func with block_table (k, v page pools, cu_seqlens_k as lengths) against the same keys
    packed, forward and gradients (dk, dv come back as pools: 0 on rows no key maps to)."""
    lens_q, lens_k, h, hkv, d = [3, 1, 7], [40, 0, 70], 4, 2, 32
    mp = -(-max(lens_k) // page_size)
    b = len(lens_q)
    npages = b * mp + 2
    perm = torch.randperm(npages)
    table = perm[:b * mp].reshape(b, mp).to(torch.int32)
    kp = torch.randn(npages, page_size, hkv, d).to(dtype)
    vp = torch.randn(npages, page_size, hkv, d).to(dtype)
    q = torch.randn(sum(lens_q), h, d).to(dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    # the packed twin: sequence b's keys are its pages' first lens_k[b] rows
    kc = torch.cat([unpage(kp, table[i:i + 1])[0, :n] for i, n in enumerate(lens_k)])
    vc = torch.cat([unpage(vp, table[i:i + 1])[0, :n] for i, n in enumerate(lens_k)])
    go = torch.randn(sum(lens_q), h, d).to(dtype)

    def run(k, v, **kw):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse, _ = flashc.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                    return_attn_probs=True, **kw)
        out.backward(go)
        return out.detach(), lse, qq.grad, kk.grad, vv.grad

    out_c, lse_c, dq_c, dk_c, dv_c = run(kc, vc)
    out_p, lse_p, dq_p, dk_p, dv_p = run(kp, vp, block_table=table)
    assert dk_p.shape == kp.shape and dv_p.shape == vp.shape
    torch.testing.assert_close(out_p, out_c, rtol=0, atol=0)
    torch.testing.assert_close(lse_p, lse_c, rtol=0, atol=0)
    torch.testing.assert_close(dq_p, dq_c, rtol=0, atol=0)
    named = torch.zeros(npages * page_size, dtype=torch.bool)
    for i, n in enumerate(lens_k):
        rows = (table[i].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        named[rows] = True
        off = sum(lens_k[:i])
        torch.testing.assert_close(dk_p.reshape(-1, hkv, d)[rows], dk_c[off:off + n], rtol=0, atol=0)
        torch.testing.assert_close(dv_p.reshape(-1, hkv, d)[rows], dv_c[off:off + n], rtol=0, atol=0)
    assert (dk_p.reshape(-1, hkv, d)[~named] == 0).all() and (dv_p.reshape(-1, hkv, d)[~named] == 0).all()


def test_paged_errors_cpu(gen):
    b, nk, ps, hkv, h, d = 2, 32, 16, 2, 4, 32
    kc, vc = make_cache(b, nk, hkv, d, [5, 20], torch.float32, "cpu")
    kp, vp, table, _ = paged_twin(kc, vc, ps, gen_extra=0)
    q, k, v = torch.randn(b, 1, h, d), torch.randn(b, 1, hkv, d), torch.randn(b, 1, hkv, d)
    sl = torch.tensor([5, 20], dtype=torch.int32)
    kp0 = kp.clone()
    bad = table.clone()
    bad[1, 1] = kp.shape[0]  # sequence 1's row 20 lies on its second page
    with pytest.raises(flashc.FlashcError, match=r"block_table\[1\]\[1\]") as e:
        flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=bad)
    assert e.value.status_name == "FLASHC_STATUS_INVALID_ARGUMENT"
    assert same_bits(kp, kp0), "a refused append wrote the pool"
    with pytest.raises(flashc.FlashcError, match="do not fit the block table"):
        flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=torch.tensor([5, 32], dtype=torch.int32),
                                       block_table=table)
    with pytest.raises(ValueError, match="block_table must be 2-d"):
        flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=table[0])
    with pytest.raises(ValueError, match="block_table must be 2-d"):
        flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=table[:1])
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        flashc.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=table.float())
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(num_pages, page_size, Hkv, D\)"):
        flashc.flash_attn_varlen_func(q[:, 0], kc[0], vc[0], cu, cu, 1, 1, block_table=table)
