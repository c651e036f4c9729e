#!/usr/bin/env python3
"""flashc's masks and score modifiers beside plain attention, as users call them (flashc.flash_attn_func), with
FlexAttention (torch.compile) on the same problem as the peer.

    FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/features.py [--B 4 --N 4096 --H 16 --D 128] [--no-flex]

Cases: plain, causal, window (N, 0) (the causal mask written as a window), window (1024, 0) (a Mistral-style sliding
window), softcap 30 (Gemma 2), ALiBi (slopes 2^(-8 h / H)), softcap with causal, varlen (the B sequences packed,
flash_attn_varlen_func, as padding-free training calls it; no FlexAttention peer), plain and causal, attention sinks
(learnable, their gradient included; alone and with a 128-key sliding window, as GPT-OSS layers use them) and
seqused_k (every key used, then half; no FlexAttention peer for these). TFLOP/s count only the visible
work: 4 B H D times the number of (query, key) pairs a row keeps, forward; 2.5 times that, backward. Forward:
flash_attn_func alone; backward: (forward + backward through autograd) - forward, both medians of --runs, taken in
turns with the peer (CUDA events). The GPU sleeps before each timed call, so that the host queues the call
meanwhile and the time is the GPU's (as in training, where the host runs ahead; --host-time: the host's time per
call on the clock too, which moved short rows by 5-20% between runs). A feature on the fast path shows as TFLOP/s
close to plain's (causal's for banded masks, whose tiles at the band's edge are cut).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flashc  # noqa: E402
from compare_torch_bwd import interleaved_medians  # noqa: E402


AHEAD = 4_000_000  # GPU cycles slept before each timed call (~2 ms): longer than the host takes to queue one


def visible_pairs(nq, nk, left, right):
    """Number of (i, j) with j kept by row i under the bottom-right-aligned band (left, right), -1 unbounded."""
    diag, total = nk - nq, 0
    for i in range(nq):
        lo = 0 if left < 0 else max(0, i + diag - left)
        hi = nk - 1 if right < 0 else min(nk - 1, i + diag + right)
        total += max(0, hi - lo + 1)
    return total


def cases(n, h):
    slopes = [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]
    return [
        ("plain", dict()),
        ("causal", dict(causal=True)),
        ("window (N, 0)", dict(window_size=(n, 0))),
        ("window (1024, 0)", dict(window_size=(1024, 0))),
        ("softcap 30", dict(softcap=30.0)),
        ("ALiBi", dict(alibi=slopes)),
        ("softcap 30 causal", dict(softcap=30.0, causal=True)),
        ("varlen, B x N packed", dict(varlen=True)),
        ("varlen causal", dict(varlen=True, causal=True)),
        ("sinks", dict(sinks=True)),
        ("window (128, 0)", dict(window_size=(128, 0))),
        ("sinks, window (128, 0)", dict(sinks=True, window_size=(128, 0))),
        ("seqused_k = N", dict(used=n)),
        ("seqused_k = N / 2", dict(used=n // 2)),
    ]


def flex_fn(q, k, v, kw, n):
    """FlexAttention for the case (layout B, H, N, D), compiled; None when torch lacks it."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    left, right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        left, right = -1, 0
    mask_mod = None
    if left >= 0 or right >= 0:
        def mask_mod(b, h, qi, kj):
            m = kj >= 0
            if left >= 0:
                m = m & (qi - kj <= left)
            if right >= 0:
                m = m & (kj - qi <= right)
            return m
    score_mod = None
    cap = kw.get("softcap", 0.0)
    if cap > 0:
        cap_t = torch.tensor(cap, device=q.device, dtype=torch.float32)  # a python float becomes a symbol

        def score_mod(s, b, h, qi, kj):
            return cap_t * torch.tanh(s / cap_t)
    elif "alibi" in kw:
        sl = torch.tensor(kw["alibi"], device=q.device, dtype=torch.float32)

        def score_mod(s, b, h, qi, kj):
            return s - sl[h] * (qi - kj).abs()
    bm = create_block_mask(mask_mod, None, None, n, n, device=q.device) if mask_mod else None
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    fa = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    return lambda: fa(qt, kt, vt, score_mod=score_mod, block_mask=bm), (qt, kt, vt)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-flex", action="store_true", help="flashc alone (FlexAttention's compiles take minutes)")
    ap.add_argument("--only", default="", help="case names to run, separated by semicolons")
    ap.add_argument("--host-time", action="store_true", help="the host's time per call on the clock too")
    args = ap.parse_args(argv)
    B, N, H, D = args.B, args.N, args.H, args.D
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, torch {torch.__version__}, flashc {flashc.library_version()} ({flashc.library_path})")
    print(f"# B {B}, N {N}, H {H}, D {D}, {args.dtype}; TFLOP/s of the visible work; bwd = (fwd+bwd) - fwd; "
          + ("host time on the clock" if args.host_time else "GPU time (the host queues each call during a GPU sleep)"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=dt, generator=g).requires_grad_(True) for _ in range(3))
    dout = torch.randn(B, N, H, D, device="cuda", dtype=dt, generator=g)
    rows = []
    only = set(x.strip() for x in args.only.split(";") if x.strip())
    for name, kw in cases(N, H):
        if only and name not in only:
            continue
        left, right = kw.get("window_size", (-1, 0 if kw.get("causal") else -1))
        if kw.get("causal"):
            left, right = -1, 0
        flops = 4.0 * B * H * D * visible_pairs(N, kw.get("used", N), left, right)
        fkw = {x: y for x, y in kw.items() if x not in ("alibi", "varlen", "sinks", "used")}
        if kw.get("sinks"):  # learnable: the backward computes their gradient too
            fkw["sinks"] = torch.randn(H, device="cuda", generator=g).requires_grad_(True)
        if "used" in kw:
            fkw["seqused_k"] = torch.full((B,), kw["used"], device="cuda", dtype=torch.int32)
        if "alibi" in kw:
            fkw["alibi_slopes"] = torch.tensor(kw["alibi"], device="cuda", dtype=torch.float32)
        if kw.get("varlen"):
            cu = torch.arange(0, (B + 1) * N, N, device="cuda", dtype=torch.int32)
            qp, kp, vp = (x.detach().reshape(B * N, H, D).requires_grad_(True) for x in (q, k, v))
            dp = dout.reshape(B * N, H, D)

            def call():
                return flashc.flash_attn_varlen_func(qp, kp, vp, cu, cu, N, N, **fkw)
            ins, dgrad = (qp, kp, vp), dp
        else:
            def call():
                return flashc.flash_attn_func(q, k, v, **fkw)
            ins, dgrad = (q, k, v), dout

        def fc_fwd():
            with torch.no_grad():
                call()

        def fc_fb():
            torch.autograd.grad(call(), ins, dgrad)

        fns = {"fc_fwd": fc_fwd, "fc_fb": fc_fb}
        if not args.no_flex and not any(x in kw for x in ("varlen", "sinks", "used")):
            made = flex_fn(q, k, v, kw, N)
            if made:
                ffn, (qt, kt, vt) = made
                dt_out = dout.transpose(1, 2)

                def fx_fwd():
                    with torch.no_grad():
                        ffn()

                def fx_fb():
                    o = ffn()
                    torch.autograd.grad(o, (qt, kt, vt), dt_out)

                fns.update(fx_fwd=fx_fwd, fx_fb=fx_fb)
        t = interleaved_medians(fns, args.runs, warmup=3, ahead=0 if args.host_time else AHEAD)
        r = dict(name=name, fwd=flops / t["fc_fwd"] / 1e9, bwd=2.5 * flops / max(t["fc_fb"] - t["fc_fwd"], 1e-6) / 1e9)
        if "fx_fwd" in t:
            r["ffwd"] = flops / t["fx_fwd"] / 1e9
            r["fbwd"] = 2.5 * flops / max(t["fx_fb"] - t["fx_fwd"], 1e-6) / 1e9
        rows.append(r)
        print(f"# {name}: done", flush=True)
    plain = next((r for r in rows if r["name"] == "plain"), None)
    print("\n| case | flashc fwd | flashc bwd | fwd / plain fwd | FlexAttention fwd | FlexAttention bwd | flashc / Flex fwd |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rel = f"{r['fwd'] / plain['fwd']:.2f}" if plain else "-"
        ff = f"{r['ffwd']:.0f}" if "ffwd" in r else "-"
        fb = f"{r['fbwd']:.0f}" if "fbwd" in r else "-"
        ratio = f"{r['fwd'] / r['ffwd']:.2f}" if "ffwd" in r else "-"
        print(f"| {r['name']} | {r['fwd']:.0f} | {r['bwd']:.0f} | {rel} | {ff} | {fb} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
