"""Train a small GPT twice from the same initial weights on the same synthetic batches: once with flashc's
attention (flash_attn_qkvpacked_func, causal), once with torch's scaled_dot_product_attention, and print both loss
curves and step times side by side.

    python python/examples/train_gpt.py                # cuda if available (bf16 autocast), else cpu (fp32)
    python python/examples/train_gpt.py --steps 50     # a couple of minutes on a CPU

The data: sequences whose first half is a walk on a random Markov chain and whose second half repeats the first
half. The first half cannot be predicted better than the chain's entropy rate; the second half can be copied by
attending back half a sequence, so its loss ("copy" below) falls towards 0 once attention has learned to look there
(within about a hundred steps at the defaults).
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import flashc
except ImportError:  # not installed: use the checkout's package (it finds the library in ../build or $FLASHC_LIBRARY)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import flashc


# ---- data -----------------------------------------------------------------------------------------------------
class MarkovCopyData:
    def __init__(self, vocab, successors, seq_len, seed):
        g = torch.Generator().manual_seed(seed)
        # a walk of half tokens, repeated, cut to seq_len + 1 (inputs and next-token targets)
        self.vocab, self.seq_len, self.half = vocab, seq_len, seq_len // 2 + 1
        nxt = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
        prob = torch.rand(vocab, successors, generator=g) + 0.2
        prob /= prob.sum(-1, keepdim=True)
        self.table = torch.zeros(vocab, vocab).scatter_(1, nxt, prob)
        # entropy rate of the chain under its stationary distribution: the first half's loss floor
        pi = torch.full((vocab,), 1.0 / vocab)
        for _ in range(500):
            pi = pi @ self.table
        self.entropy = float(-(pi[:, None] * self.table * torch.log(self.table.clamp_min(1e-30))).sum())

    def batch(self, batch, g, device):
        tok = torch.randint(self.vocab, (batch,), generator=g)
        walk = [tok]
        for _ in range(self.half - 1):
            tok = torch.multinomial(self.table[tok], 1, generator=g)[:, 0]
            walk.append(tok)
        x = torch.stack(walk, 1)
        x = torch.cat([x, x], 1)[:, : self.seq_len + 1]  # second half repeats the first
        return x[:, :-1].to(device), x[:, 1:].to(device)


# ---- model ----------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim, heads, impl):
        super().__init__()
        self.heads, self.impl = heads, impl
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, c // self.heads)  # flash-attn's packed layout
        if self.impl == "flashc":
            y = flashc.flash_attn_qkvpacked_func(qkv, causal=True)  # (B, N, H, D)
        else:
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, D)
            if self.impl == "sdpa-math":  # the unfused reference: another rounding of the same function
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.MATH):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads, impl):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, impl)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, dim, heads, layers, impl):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, impl) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        # small initial weights (GPT-2's 0.02): the tied embedding / output matrix starts with logits near 0
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ---- training -------------------------------------------------------------------------------------------------
def train(impl, args, data, device, init_state):
    model = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers, impl).to(device)
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)  # same batches for both runs
    use_bf16 = device.type == "cuda" and not args.fp32
    copy_from = data.half - 1  # targets from here on are copies of earlier tokens
    losses, copy_losses, times = [], [], []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20)  # short warm-up
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.batch(args.batch, g, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(x)
        loss_tok = F.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1), reduction="none")
        loss = loss_tok.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        copy_losses.append(loss_tok.view(args.batch, -1)[:, copy_from:].mean().item())
    return losses, copy_losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64, help="sequence length")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--successors", type=int, default=0,
                    help="next tokens each token can have in the chain (default: all of the vocabulary)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on cuda")
    ap.add_argument("--log-every", type=int, default=0, help="rows in the loss table (default: about 15)")
    ap.add_argument("--noise", action="store_true",
                    help="a third run on torch's unfused (math) attention: how far two torch kernels drift apart, "
                         "the scale of the rounding noise the flashc-vs-sdpa gap is judged against")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and flashc.cuda_available() else "cpu"
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    data = MarkovCopyData(args.vocab, args.successors or args.vocab, args.seq, args.seed)
    init = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers, "sdpa").state_dict()
    precision = "fp32" if device.type == "cpu" or args.fp32 else "bf16 autocast"
    print("flashc %s (%s) | device %s, %s | GPT %d layers, dim %d, %d heads, seq %d, batch %d, %d steps"
          % (flashc.library_version(), flashc.library_path, device, precision, args.layers, args.dim, args.heads,
             args.seq, args.batch, args.steps))
    print("data: first half entropy rate %.3f nats (its loss floor), second half a copy (floor 0), uniform %.3f"
          % (data.entropy, math.log(args.vocab)))

    runs = {}
    for impl in ("flashc", "sdpa") + (("sdpa-math",) if args.noise else ()):
        runs[impl] = train(impl, args, data, device, init)

    every = args.log_every or max(1, args.steps // 15)
    print("\n%6s  %12s %12s %10s   %12s %12s" % ("step", "loss flashc", "loss sdpa", "|diff|", "copy flashc",
                                                 "copy sdpa"))
    for s in list(range(0, args.steps, every)) + ([args.steps - 1] if (args.steps - 1) % every else []):
        a, b = runs["flashc"][0][s], runs["sdpa"][0][s]
        print("%6d  %12.4f %12.4f %10.2e   %12.4f %12.4f" % (s, a, b, abs(a - b), runs["flashc"][1][s],
                                                             runs["sdpa"][1][s]))
    diffs = [abs(a - b) for a, b in zip(runs["flashc"][0], runs["sdpa"][0])]
    print("\nmax |loss flashc - loss sdpa| over all steps: %.3e (final %.4f vs %.4f)"
          % (max(diffs), runs["flashc"][0][-1], runs["sdpa"][0][-1]))
    if args.noise:
        ref = [abs(a - b) for a, b in zip(runs["sdpa-math"][0], runs["sdpa"][0])]
        print("max |loss sdpa-math - loss sdpa| over all steps: %.3e (final %.4f): the noise scale"
              % (max(ref), runs["sdpa-math"][0][-1]))
    skip = min(5, max(0, args.steps - 1))  # leave out the first steps (allocator and kernel warm-up)
    for impl in ("flashc", "sdpa"):
        t = runs[impl][2][skip:]
        print("step time %-6s: median %8.2f ms, mean %8.2f ms (steps %d..%d)"
              % (impl, 1e3 * statistics.median(t), 1e3 * statistics.fmean(t), skip, args.steps - 1))


if __name__ == "__main__":
    main()
