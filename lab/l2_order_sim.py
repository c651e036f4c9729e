#!/usr/bin/env python3
"""lab/l2_order_sim.py - the Hopper backward's DRAM bytes by block order, from a trace-driven LRU model of the L2.

The main kernel (bwd_sm90.cu) launches one block per (key tile, kv head, sequence) in fc90_group_order's order
(groups of pairs, pairs fastest inside a group); fc90b_kv_groups sizes the groups from FC90B_PAIR_BYTES x Nq x D
bytes per pair against half the L2. This model replays that order on `sms` SMs (a block starts when an SM frees;
every step takes one time unit, a block's fixed part `fixed` units), and at each time unit every running block
touches its step's Q and dO tiles (read) and dQ-sum tile (fp32, read-modify-write by the TMA reduction), in SM
order; K and V are read at a block's start, dK and dV written at its end. The L2 is one LRU of `l2` MB over whole
tiles. DRAM bytes = misses + dirty evictions + the dQ sums left dirty at the end + dK and dV. Not a cycle model:
it counts bytes only, to compare orders (and to check against Nsight Compute's DRAM throughput x duration).

  python3 lab/l2_order_sim.py --d 128 --n 4096 --pair-bytes 4,8,1e12 [--causal] [--l2 50]
"""
import argparse
import heapq
from collections import OrderedDict


def group_order(t, per, items, ng):
    """fc90_group_order (sm90.cuh): launch index -> (tile, item)."""
    q, rem = divmod(items, ng)
    big = rem * (q + 1) * per
    gs = q + 1 if t < big else q
    t0 = t if t < big else t - big
    g, r = divmod(t0, gs * per)
    item = (0 if t < big else rem * (q + 1)) + g * gs + r % gs
    return r // gs, item


def group_count(items, bytes_per_item, l2_bytes):
    """fc90_group_count (sm90.cuh)."""
    fit = (l2_bytes // 2) / bytes_per_item if bytes_per_item > 0 else 1.0
    per = 1 if fit < 1.0 else items if fit >= items else int(fit)
    return (items + per - 1) // per if per > 0 else 1


def simulate(d, n, causal, pair_bytes, l2_mb, sms, fixed, hidden=2048, tokens=16384, l2_order_mb=50):
    if d not in (64, 128):
        raise SystemExit("d 64 or 128 (d 256's kernel has its own tile and roles)")
    bn, bm = (128, 128) if d <= 64 else (128, 64)  # fc90_btile_for: keys per block, query rows per step
    H = hidden // d
    B = tokens // n
    n_kblk = (n + bn - 1) // bn
    pairs = H * B  # kv heads = heads (no GQA in the sweep)
    ng = group_count(pairs, pair_bytes * n * d, l2_order_mb << 20)
    nblocks = n_kblk * pairs
    qb, gb, dqb, kvb = bm * d * 2, bm * d * 2, bm * d * 4, bn * d * 2
    n_qt = (n + bm - 1) // bm

    def steps_of(kt):
        if not causal:
            return list(range(n_qt))
        first = (kt * bn) // bm  # the first query tile any key of the tile can see (bottom-right = top-left here)
        return list(range(first, n_qt))

    cap = l2_mb << 20
    lru = OrderedDict()  # key -> (bytes, dirty)
    used = 0
    dram = {"q/do": 0, "dq": 0, "kv": 0, "dkdv": 0}

    def touch(key, nbytes, write, cat):
        nonlocal used
        hit = lru.pop(key, None)
        if hit is None:
            if not (write and cat == "dkdv"):
                dram[cat] += nbytes  # read miss (the TMA reduction reads the line too)
            dirty = write
        else:
            dirty = hit[1] or write
            used -= hit[0]
        lru[key] = (nbytes, dirty)
        used += nbytes
        while used > cap:
            k, (b, dty) = lru.popitem(last=False)
            used -= b
            if dty:
                dram["dq" if k[0] == "dq" else "dkdv"] += b

    # list scheduling: SM heap of (free time, sm); each running block: its steps list and position
    free = [(0, s) for s in range(sms)]
    heapq.heapify(free)
    events = []  # (start time, sm, key tile, pair, steps) per block
    for t in range(nblocks):
        start, sm = heapq.heappop(free)
        kt, pair = group_order(t, n_kblk, pairs, ng)
        st = steps_of(kt)
        events.append((start, sm, kt, pair, st))
        heapq.heappush(free, (start + fixed + len(st), sm))
    end = max(f for f, _ in free)
    # replay by time unit
    events.sort()
    ei = 0
    active = {}
    for now in range(end + 1):
        while ei < len(events) and events[ei][0] == now:
            start, sm, kt, pair, st = events[ei]
            ei += 1
            touch(("k", pair, kt), kvb, False, "kv")
            touch(("v", pair, kt), kvb, False, "kv")
            active[sm] = (start, kt, pair, st)
        for sm in sorted(active):
            start, kt, pair, st = active[sm]
            i = now - start - fixed
            if 0 <= i < len(st):
                m = st[i]
                touch(("q", pair, m), qb, False, "q/do")
                touch(("g", pair, m), gb, False, "q/do")
                touch(("dq", pair, m), dqb, True, "dq")
            if i == len(st) - 1 or (not st and now == start + fixed - 1):
                touch(("dk", pair, kt), kvb, True, "dkdv")
                touch(("dv", pair, kt), kvb, True, "dkdv")
        for sm in [s for s, (start, kt, pair, st) in active.items() if now >= start + fixed + len(st) - 1]:
            del active[sm]
    for k, (b, dty) in lru.items():
        if dty:
            dram["dq" if k[0] == "dq" else "dkdv"] += b
    # the least: Q, K, V, dO read once, dK and dV written once (2 bytes each), the fp32 dQ sums read and written once
    least = pairs * n * d * (4 * 2 + 2 * 2 + 2 * 4)
    return ng, end, dram, least


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pair-bytes", default="4,8,1e12")
    ap.add_argument("--l2", default="50", help="LRU capacities in MB, comma-separated")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--fixed", type=int, default=3, help="a block's fixed part, in steps")
    args = ap.parse_args()
    print("| D | N | causal | pair bytes | groups | L2 MB | DRAM GB (Q+dO / dQ sums / K+V / dK+dV) | / least | time units |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.n.split(",")):
        for pb in (float(x) for x in args.pair_bytes.split(",")):
            for l2 in (int(x) for x in args.l2.split(",")):
                ng, end, dram, least = simulate(args.d, n, args.causal, pb, l2, args.sms, args.fixed)
                tot = sum(dram.values())
                print("| %d | %d | %s | %g | %d | %d | %.2f (%.2f / %.2f / %.2f / %.2f) | %.2f | %d |" % (
                    args.d, n, "causal" if args.causal else "-", pb, ng, l2, tot / 1e9, dram["q/do"] / 1e9,
                    dram["dq"] / 1e9, dram["kv"] / 1e9, dram["dkdv"] / 1e9, tot / least, end))


if __name__ == "__main__":
    main()
