"""Context-parallel (ring) attention over torch.distributed: the sequence is split across the ranks of a process
group, and each rank computes the attention of its own queries over every rank's keys while the keys and values
travel around the ring.

    import torch.distributed as dist
    import flashc.distributed as fcd

    q_local, k_local, v_local = (fcd.shard(t, group) for t in (q, k, v))    # (B, N / W, H, D) each
    out_local = fcd.ring_attention(q_local, k_local, v_local, group, causal=True)
    out = fcd.unshard(out_local, group)     # the whole (B, N, H, D) on every rank, when it is wanted

Any backend torch.distributed has point-to-point for: NCCL with CUDA tensors, gloo with CPU tensors (each process
on its own GPU: call torch.cuda.set_device(local_rank) first, as NCCL wants).

Layout. With W ranks the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r, in that order
(zig-zag): under a causal mask each rank then has the same amount of work at every step. shard() and unshard()
convert; layout="contiguous" (rank r holds the r-th of W chunks) is there for callers that shard that way. Every
rank must hold the same number of tokens (and an even number with zig-zag): ring_attention checks that across the
group before it sends anything and raises ValueError naming the ranks' sizes otherwise.

Forward. W steps; at step t rank r holds the keys and values of rank (r - t) mod W. It starts sending them to rank
r + 1 (and receiving the next rank's from r - 1, torch.distributed.batch_isend_irecv) before it computes with them,
so the transfer runs under the computation. For each of its query chunks and each key chunk it holds, the band
that causal / window_size cuts from the global positions is either empty (skipped), whole (one call without a mask)
or partial: then the query rows and keys that see nothing are trimmed and the rest is one flashc call whose window
reproduces the band exactly (flashc's windows are bottom-right aligned; trimming moves the alignment). Calls that
are whole and share a key chunk (or a query chunk) are made as one. Each call's (out, lse) is merged into fp32
accumulators with flashc's merge (flashc_merge); out is rounded to q's dtype once at the end.

Backward. The keys and values go around again with their gradients: at step t rank r computes the partial dq, dk,
dv of the same calls (flashc's backward with the global out and lse, which makes each partial gradient exact),
adds dq into its fp32 accumulator and dk, dv into the fp32 accumulator that travels with those keys. That
accumulator is sent on while the next step computes, and after W steps one more hop brings every rank's dk, dv home.

ALiBi and dropout. ALiBi's bias depends on the distance between a query's and a key's positions, which a chunk
pair's bottom-right alignment does not give, and dropout's mask on the positions themselves: with either, every call
passes its rows' and keys' global positions to the library (flashc_params.positions), and the window is the global
one, measured between those positions. Calls are then made per pair of chunks (up to four per step with zig-zag)
instead of merged. Dropout drops exactly the elements the one call on the whole sequence drops with the same
(seed, offset): one pair for the group (the first rank's draw, broadcast), packed sequence s on streams from
offset + s * H as in one varlen call.

Takes causal, window_size (as flash-attn's), softcap, ALiBi, dropout, softmax_scale, GQA / MQA (k, v with fewer
heads), packed sequences (cu_seqlens), float32, float16, bfloat16, and the deterministic backward. Not taken
(NotImplementedError, nothing sent): block masks, seqused_k and sinks.
"""

from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from . import _core, _torch

__all__ = ["ring_attention", "shard", "unshard", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")


# ---- the group and the layout -------------------------------------------------------------------------------------
def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashc.distributed: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError("flashc.distributed: layout must be one of %s, got %r" % (LAYOUTS, layout))


def _chunks_of(layout, world):
    return 2 * world if layout == "zigzag" else world


def _runs(dim_len, cu, world, rank, layout):
    """This rank's runs (start, length) of the sequence axis: chunks r and 2W-1-r of 2W (zig-zag) or chunk r of W,
    of the whole axis or, with offsets cu (varlen), of each packed sequence."""
    parts = _chunks_of(layout, world)
    seqs = [(0, dim_len)] if cu is None else list(zip(cu, (b - a for a, b in zip(cu, cu[1:]))))
    runs = []
    for i, (start, length) in enumerate(seqs):
        if length % parts:
            raise ValueError("flashc.distributed.shard: %s %d does not split into %d equal chunks (%s layout, %d "
                             "ranks); pad it to a multiple of %d" % (
                                 "the sequence length" if cu is None else "sequence %d's length" % i,
                                 length, parts, layout, world, parts))
        c = length // parts
        runs.append((start + rank * c, c))
        if layout == "zigzag":
            runs.append((start + (parts - 1 - rank) * c, c))
    return runs


def shard(x: torch.Tensor, group=None, *, dim: Optional[int] = None, layout: str = "zigzag",
          cu_seqlens=None) -> torch.Tensor:
    """This rank's part of the whole sequence x along dim (default 1, or 0 with cu_seqlens): chunks r and 2W-1-r of
    2W (zig-zag), or chunk r of W (a view then, without cu_seqlens). With cu_seqlens (the packed batch's offsets,
    B + 1) every packed sequence is cut that way and this rank's chunks are packed in sequence order. Lengths must
    divide evenly."""
    _check_layout(layout)
    group, world, rank = _group_info(group)
    dim = (0 if cu_seqlens is not None else 1) if dim is None else dim
    cu = None if cu_seqlens is None else _host_offsets(cu_seqlens)
    if cu is not None and cu[-1] != x.shape[dim]:
        raise ValueError("flashc.distributed.shard: cu_seqlens ends at %d but x has %d tokens along dim %d"
                         % (cu[-1], x.shape[dim], dim))
    runs = _runs(x.shape[dim], cu, world, rank, layout)
    if len(runs) == 1:
        return x.narrow(dim, *runs[0])
    return torch.cat([x.narrow(dim, a, n) for a, n in runs], dim)


def unshard(x: torch.Tensor, group=None, *, dim: Optional[int] = None, layout: str = "zigzag",
            cu_seqlens=None) -> torch.Tensor:
    """The whole sequence from every rank's part x (an all-gather): shard's inverse, the same on every rank."""
    _check_layout(layout)
    group, world, _ = _group_info(group)
    dim = (0 if cu_seqlens is not None else 1) if dim is None else dim
    cu = None if cu_seqlens is None else _host_offsets(cu_seqlens)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    total = x.shape[dim] * world
    if cu is not None and cu[-1] != total:
        raise ValueError("flashc.distributed.unshard: cu_seqlens ends at %d but the ranks' parts make %d tokens"
                         % (cu[-1], total))
    pieces = [(pc.pos, p.narrow(dim, pc.local, pc.n))  # (global start, tensor)
              for r, p in enumerate(parts) for pc in _local_runs(total, cu, world, r, layout)]
    return torch.cat([t for _, t in sorted(pieces, key=lambda e: e[0])], dim)


class _Piece(NamedTuple):
    """A run of a rank's local tokens: local row offset, global position of its first token, length."""
    local: int
    pos: int
    n: int


def _local_runs(dim_len, cu, world, rank, layout):
    """_runs with each run's offset in the rank's own (packed) tensor: its _Pieces."""
    pieces, local = [], 0
    for pos, n in _runs(dim_len, cu, world, rank, layout):
        pieces.append(_Piece(local, pos, n))
        local += n
    return tuple(pieces)


def _pieces(layout, rank, world, n):
    """The pieces of a rank holding n tokens of one sequence."""
    return _local_runs(n * world, None, world, rank, layout)


# ---- which calls a step makes ---------------------------------------------------------------------------------------
class _Call(NamedTuple):
    """One flashc call: query rows [q0, q1) and keys [k0, k1) of the local tensors, window (left, right), -1 for
    unbounded: flashc's bottom-right aligned window, which _pair chose to reproduce the global band, or, when qpos is
    set, the global window itself, measured between positions (flashc's positions option: row q0 sits at position
    qpos, key k0 at kpos, positions counted from the sequence's start). seq: the packed sequence's index."""
    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int
    qpos: Optional[int] = None
    kpos: Optional[int] = None
    seq: int = 0


def _band(causal, window_size):
    """The visible offsets key position - query position as (lo, hi), None for unbounded."""
    left, right = _core.window_pair(window_size)
    if causal:
        right = 0
    return (None if left < 0 else -left), (None if right < 0 else right)


def _pair(qp, kp, lo, hi):
    """The call (in piece-local rows and keys) for query piece qp against key piece kp under the band [lo, hi] on
    global positions; None when no query sees any key. Offsets x = j - i in piece-local indices are visible iff x in
    [lo + a - b, hi + a - b] (a, b: the pieces' first positions). A flashc call on rows [qs, qe) and keys [ks, ke)
    with window (left, right) keeps x in [d - left, d + right], d = ke - qe: trimming rows and keys that see nothing
    at the ends moves d into the band, which then gives left, right >= 0."""
    nq, nk = qp.n, kp.n
    lo = None if lo is None else lo + qp.pos - kp.pos
    hi = None if hi is None else hi + qp.pos - kp.pos
    if (lo is not None and lo > nk - 1) or (hi is not None and hi < -(nq - 1)):
        return None
    if (lo is None or lo <= -(nq - 1)) and (hi is None or hi >= nk - 1):
        return _Call(0, nq, 0, nk, -1, -1)
    qs = 0 if hi is None else max(0, -hi)  # rows i < -hi see no key j >= 0
    ks = 0 if lo is None else max(0, lo)  # keys j < lo are seen by no row i >= 0
    qe, ke = nq, nk
    if lo is not None and nk - nq < lo:
        qe = nk - lo  # rows i >= nk - lo see no key j < nk
    elif hi is not None and nk - nq > hi:
        ke = nq + hi  # keys j >= nq + hi are seen by no row i < nq
    d = ke - qe
    return _Call(qs, qe, ks, ke, -1 if lo is None else d - lo, -1 if hi is None else hi - d)


def _plan_positions(qpieces, kpieces, lo, hi, align=1):
    """The calls of one step when each call carries its global positions (ALiBi, whose bias depends on the distance
    between positions, not only on the band; dropout, whose mask does): one call per (query piece, key piece) pair
    that sees anything, on the rows and keys _pair keeps, with the global window. align: the first key of each call
    is moved down to a multiple of it (dropout wants key positions in whole groups of 4; the pieces start on such
    positions, and the window hides the keys added)."""
    calls = []
    for qp in qpieces:
        for kp in kpieces:
            c = _pair(qp, kp, lo, hi)
            if c is not None:
                k0 = c.k0 - (kp.pos + c.k0) % align
                calls.append(_Call(qp.local + c.q0, qp.local + c.q1, kp.local + k0, kp.local + c.k1,
                                   -1 if lo is None else -lo, -1 if hi is None else hi, qp.pos + c.q0, kp.pos + k0))
    return calls


def _plan(qpieces, kpieces, lo, hi, same_rank):
    """The calls of one step: query pieces of this rank against the key pieces it holds now."""
    nq = sum(p.n for p in qpieces)
    nk = sum(p.n for p in kpieces)
    if lo is None and hi is None:
        return [_Call(0, nq, 0, nk, -1, -1)]
    if same_rank and lo is None and hi == 0:
        # causal over the rank's own tokens: their positions increase with the local index, so flashc's causal mask
        # on the local indices is the global one
        return [_Call(0, nq, 0, nk, -1, 0)]
    pairs = {(a, b): _pair(qp, kp, lo, hi) for a, qp in enumerate(qpieces) for b, kp in enumerate(kpieces)}

    def full(a, b):
        c = pairs[a, b]
        return c is not None and c.left < 0 and c.right < 0

    calls, done = [], set()
    for b, kp in enumerate(kpieces):  # a key piece every query piece sees whole: one call for all rows
        if all(full(a, b) for a in range(len(qpieces))):
            calls.append(_Call(0, nq, kp.local, kp.local + kp.n, -1, -1))
            done.update((a, b) for a in range(len(qpieces)))
    for a, qp in enumerate(qpieces):  # a query piece's whole key pieces, adjacent ones as one call
        run = None
        for b, kp in enumerate(kpieces):
            if (a, b) not in done and full(a, b):
                done.add((a, b))
                if run is not None and run[1] == kp.local:
                    run = (run[0], kp.local + kp.n)
                    continue
                if run is not None:
                    calls.append(_Call(qp.local, qp.local + qp.n, run[0], run[1], -1, -1))
                run = (kp.local, kp.local + kp.n)
        if run is not None:
            calls.append(_Call(qp.local, qp.local + qp.n, run[0], run[1], -1, -1))
    for (a, b), c in pairs.items():  # the partial ones
        if c is not None and (a, b) not in done:
            qp, kp = qpieces[a], kpieces[b]
            calls.append(_Call(qp.local + c.q0, qp.local + c.q1, kp.local + c.k0, kp.local + c.k1, c.left, c.right))
    return calls


_REFUSED = ("block_mask", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks")
_REFUSAL = {"cu_seqlens_q": "self-attention over packed sequences takes one cu_seqlens (the whole batch's offsets)",
            "cu_seqlens_k": "self-attention over packed sequences takes one cu_seqlens (the whole batch's offsets)"}


# ---- checks ---------------------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, group, world, layout, kwargs, check_shapes, extra=()):
    """extra: integers every rank must agree on too (varlen: a digest of cu_seqlens). layout "contiguous" for
    varlen, whose per-sequence chunk rule _local_segments checks."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        _torch._check(n, t, q.device)
        if t.dim() != 4:
            raise ValueError("flashc.distributed.ring_attention: %s must be (B, N_local, H, D), got shape %s"
                             % (n, tuple(t.shape)))
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError("flashc.distributed.ring_attention: q (B, N, H, D), k and v (B, N, Hkv, D) with the same "
                         "B, N and D on a rank and H a multiple of Hkv, got %s, %s, %s" % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    for name, value in kwargs.items():
        if name not in _REFUSED:
            raise TypeError("flashc.distributed.ring_attention: unexpected argument %r" % name)
        if value is not None and not (isinstance(value, (int, float)) and value == 0):
            raise NotImplementedError("flashc.distributed.ring_attention does not take %s: %s"
                                      % (name, _REFUSAL.get(name, "not built for the ring yet")))
    backend = dist.get_backend(group)
    if q.is_cuda and backend == "gloo":
        raise ValueError("flashc.distributed.ring_attention: the group's backend is gloo, which has no "
                         "point-to-point for CUDA tensors; use an NCCL group for CUDA tensors (gloo for CPU ones)")
    # every rank's sizes, before anything is sent (and before a refusal that depends on them, which then comes on
    # every rank alike): a send that does not match its receive would hang or fail late
    if check_shapes:
        _check_same_shapes(q, k, group, world, layout, backend, extra)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError("flashc.distributed.ring_attention: the zig-zag layout holds two equal chunks per rank, so "
                         "N_local must be even, got %d (pad the sequence to a multiple of %d)"
                         % (q.shape[1], 2 * world))


def _check_same_shapes(q, k, group, world, layout, backend, extra):
    dev = torch.device("cpu") if backend == "gloo" else q.device
    mine = torch.tensor(list(q.shape) + list(k.shape) + list(extra), dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    shapes = [tuple(t.tolist()) for t in every]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "flashc.distributed.ring_attention: every rank must hold the same number of tokens (and the same B, H, "
            "D, and cu_seqlens with varlen); the ranks hold q, k of shapes %s. Shard the sequence into equal parts "
            "(flashc.distributed.shard; pad it to a multiple of %d tokens)" % (
                ", ".join("rank %d: %s, %s%s" % (i, s[:4], s[4:8], " (cu_seqlens differ)" if s[8:] != shapes[0][8:]
                                                  else "") for i, s in enumerate(shapes)),
                _chunks_of(layout, world)))


# ---- the ring ---------------------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point with the neighbours: send to rank r + 1, receive from r - 1 (ranks of the group)."""

    def __init__(self, group, world, rank):
        self.group, self.world = group, world
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def exchange(self, send, recv):
        """Starts sending send on and receiving recv; returns the requests to wait for."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


class _Setup(NamedTuple):
    group: object
    world: int
    rank: int
    layout: str
    lo: Optional[int]
    hi: Optional[int]
    softmax_scale: Optional[float]
    softcap: float
    deterministic: bool
    segments: Tuple[Tuple[int, int], ...]  # (first local row, local rows) of each sequence; one without varlen
    alibi: Optional[torch.Tensor] = None  # fp32 slopes on q's device: (H,), (B, H), or (num_seqs, H) with varlen
    dropout_p: float = 0.0
    rngs: Optional[torch.Tensor] = None  # dropout: (seed, offset) per packed sequence (int64 (S, 2)), one row without


def _options(s, q4, k4, call):
    kw = {}
    if call.qpos is not None:
        kw["positions"] = (call.qpos, call.kpos)
    if s.dropout_p:
        kw.update(dropout_p=s.dropout_p, dropout_rng=s.rngs[call.seq])
    if s.alibi is not None:
        # per packed sequence: each call is one sequence's rows (a batch of one)
        kw["alibi_slopes"] = s.alibi[call.seq] if s.alibi.dim() == 2 and len(s.segments) > 1 else s.alibi
    return _torch._Options(q4, k4, softmax_scale=s.softmax_scale, window_size=(call.left, call.right),
                           softcap=s.softcap, deterministic=s.deterministic, **kw)


def _calls(s, step):
    """The step's calls over every sequence (varlen: each packed sequence is planned alone, its calls moved to its
    rows, which are the same on every rank)."""
    out = []
    src = (s.rank - step) % s.world
    for seq, (off, n) in enumerate(s.segments):
        if n == 0:
            continue
        qpieces, kpieces = _pieces(s.layout, s.rank, s.world, n), _pieces(s.layout, src, s.world, n)
        plan = (_plan_positions(qpieces, kpieces, s.lo, s.hi, 4 if s.dropout_p else 1)
                if s.alibi is not None or s.dropout_p else _plan(qpieces, kpieces, s.lo, s.hi, step == 0))
        for c in plan:
            out.append(c._replace(q0=c.q0 + off, q1=c.q1 + off, k0=c.k0 + off, k1=c.k1 + off, seq=seq))
    return out


def _travel(ring, world, kv):
    """Yields (step, the K/V held at that step) for W steps: the next step's K/V is sent on and received while the
    caller works on the current one (its work for a step is done when it asks for the next)."""
    for step in range(world):
        nxt, reqs = None, []
        if step + 1 < world:
            nxt = torch.empty_like(kv)
            reqs = ring.exchange(kv, nxt)
        yield step, kv
        _wait(reqs)
        if nxt is not None:
            kv = nxt


def _ring_forward(s, q, k, v):
    b, n, h, _ = q.shape
    ring = _Ring(s.group, s.world, s.rank)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, n), float("inf"), dtype=torch.float32, device=q.device)
    for step, kv in _travel(ring, s.world, torch.stack((k, v))):
        for c in _calls(s, step):
            q4, k4, v4 = q[:, c.q0:c.q1], kv[0, :, c.k0:c.k1], kv[1, :, c.k0:c.k1]
            o, l = _torch._forward(q4, k4, v4, _options(s, q4, k4, c))
            rows = acc[:, c.q0:c.q1]
            whole = c.q0 == 0 and c.q1 == n
            lr = lse if whole else lse[:, :, c.q0:c.q1].contiguous()
            _torch._merge(rows, lr, o.float(), l, out=rows, lse=lr)
            if not whole:
                lse[:, :, c.q0:c.q1] = lr
    return acc.to(q.dtype), lse


def _ring_backward(s, dout, q, k, v, out, lse):
    ring = _Ring(s.group, s.world, s.rank)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_in, dkv_reqs, keep = None, [], None  # the travelling dk, dv accumulator of the keys held now
    for step, kv in _travel(ring, s.world, torch.stack((k, v))):
        part = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for c in _calls(s, step):
            q4, k4, v4 = q[:, c.q0:c.q1], kv[0, :, c.k0:c.k1], kv[1, :, c.k0:c.k1]
            dq4, dk4, dv4 = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)
            l = lse[:, :, c.q0:c.q1].contiguous()
            _torch._backward(dout[:, c.q0:c.q1], q4, k4, v4, out[:, c.q0:c.q1], l, _options(s, q4, k4, c),
                             dq4, dk4, dv4)
            dq[:, c.q0:c.q1] += dq4
            part[0, :, c.k0:c.k1] += dk4
            part[1, :, c.k0:c.k1] += dv4
        _wait(dkv_reqs)  # the accumulator of these keys, from the rank before (sent while this step computed)
        if dkv_in is not None:
            part += dkv_in
        if s.world == 1:  # no ring: the keys never left
            dkv_in = part
            continue
        dkv_in = torch.empty_like(part)
        dkv_reqs, keep = ring.exchange(part, dkv_in), part  # keep: the send buffer lives until its request is done
    _wait(dkv_reqs)  # after W hops every accumulator is back with its keys' owner
    del keep
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, setup, q, k, v):
        out, lse = _ring_forward(setup, q, k, v)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.setup, dout.contiguous(), q, k, v, out, lse)
        return None, dq, dk, dv


def _host_offsets(cu_seqlens):
    return [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def _local_segments(cu, n_local, world, layout):
    """(first local row, local rows) per sequence from the global offsets cu, checked."""
    parts = _chunks_of(layout, world)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("flashc.distributed.ring_attention: cu_seqlens must be the whole packed batch's offsets, "
                         "0 first and non-decreasing, got %s" % (cu[:8],))
    if cu[-1] != n_local * world:
        raise ValueError("flashc.distributed.ring_attention: cu_seqlens ends at %d tokens, but %d ranks holding %d "
                         "each make %d" % (cu[-1], world, n_local, n_local * world))
    bad = [(i, b - a) for i, (a, b) in enumerate(zip(cu, cu[1:])) if (b - a) % parts]
    if bad:
        raise ValueError("flashc.distributed.ring_attention: every sequence's length must split into %d equal chunks "
                         "(%s layout, %d ranks); sequence %d has %d tokens (pad each sequence to a multiple of %d)"
                         % (parts, layout, world, bad[0][0], bad[0][1], parts))
    return tuple((a // world, (b - a) // world) for a, b in zip(cu, cu[1:]))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                   softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, cu_seqlens=None,
                   layout: str = "zigzag",
                   deterministic: bool = False,
                   return_lse: bool = False, check_shapes: bool = True, **unsupported):
    """Attention of this rank's queries over the whole sequence's keys: q (B, N_local, H, D), k and v
    (B, N_local, Hkv, D), this rank's part of the sequence in `layout` (see shard). Returns out (B, N_local, H, D)
    in q's dtype, and with return_lse=True also lse (B, H, N_local) fp32 (natural log; +inf for a row that sees no
    key), both in the local order. Differentiable w.r.t. q, k and v (the backward is a ring too).

    causal, window_size and alibi_slopes apply to global positions, as flashc.attention / flash_attn_func do on
    the whole sequence; softcap, softmax_scale and deterministic as there. alibi_slopes: fp32 (H,) or (B, H)
    ((num_seqs, H) with cu_seqlens), bias -slope * |i - j| between global positions i and j; with it each call
    passes its positions to the library (one call per pair of chunks instead of merged ones). dropout_p: as
    flash_attn_func's, the mask the one call on the whole sequence would draw (the (seed, offset) pair is drawn from
    torch's generator on every rank, as flash_attn_func draws it, and the group's first rank's pair is used by all;
    element (b, h, i, j) at global positions i, j); each rank's chunk must hold a multiple of 4 tokens of every
    sequence (2 chunks of such a length per rank with zig-zag). Every rank of the group must call it with the same
    options and shapes. check_shapes: compare every rank's shapes first (one small all-gather, and on CUDA a wait for
    the GPU to reach it); False skips that for callers that guarantee equal shards (a mismatch then fails or hangs
    inside the point-to-point transfers).

    Packed sequences (varlen): cu_seqlens, the whole packed batch's int offsets (B + 1, the same on every rank, as
    flash_attn_varlen_func takes them; a tensor is read to the host), and q (total / W, H, D), k, v
    (total / W, Hkv, D): every sequence sharded on its own (shard(x, group, cu_seqlens=cu_seqlens)), so each
    length must split into 2W (zig-zag) or W equal chunks. lse is then (H, total / W). Each sequence is planned
    on its own (a few flashc calls per sequence and step)."""
    _check_layout(layout)
    group, world, rank = _group_info(group)
    varlen = cu_seqlens is not None
    if varlen:
        for n_, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError("flashc.distributed.ring_attention: with cu_seqlens, %s must be packed "
                                 "(total / W, H, D), got %s" % (n_, tuple(getattr(t, "shape", ()))))
        cu = _host_offsets(cu_seqlens)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        extra = (len(cu), sum(cu), sum(i * c for i, c in enumerate(cu)))
    else:
        extra = ()
    # the collective check first: a refusal after it comes on every rank alike
    _check_inputs(q, k, v, group, world, "contiguous" if varlen else layout, unsupported, check_shapes, extra)
    segments = _local_segments(cu, q.shape[1], world, layout) if varlen else ((0, q.shape[1]),)
    lo, hi = _band(causal, window_size)
    alibi = None
    if alibi_slopes is not None:
        alibi = torch.as_tensor(alibi_slopes).to(device=q.device, dtype=torch.float32).contiguous()
        batch = len(segments) if varlen else q.shape[0]
        if tuple(alibi.shape) not in ((q.shape[2],), (batch, q.shape[2])):
            raise ValueError("flashc.distributed.ring_attention: alibi_slopes must be (H,) = (%d,) or (%s, H) = "
                             "(%d, %d), got %s" % (q.shape[2], "num_seqs" if varlen else "B", batch, q.shape[2],
                                                   tuple(alibi.shape)))
    dropout_p = _core.check_dropout(dropout_p)
    rngs = None
    if dropout_p:
        chunk = [n // (2 if layout == "zigzag" else 1) for _, n in segments]
        if any(c % 4 for c in chunk):
            raise ValueError("flashc.distributed.ring_attention: with dropout every chunk of a sequence must hold a "
                             "multiple of 4 tokens (the mask's keys come in groups of 4), got chunks of %s tokens "
                             "(pad each sequence to a multiple of %d)" % (sorted(set(chunk)), 4 * _chunks_of(layout, world)))
        rng = _torch.dropout_rng(q.device)
        dist.broadcast(rng, src=dist.get_global_rank(group, 0), group=group)
        # packed sequence s is the one call's sequence s: its streams start at offset + s * H
        rngs = rng.repeat(len(segments), 1)
        rngs[:, 1] += torch.arange(len(segments), dtype=torch.int64, device=q.device) * q.shape[2]
    setup = _Setup(group, world, rank, layout, lo, hi, softmax_scale, float(softcap or 0.0), bool(deterministic),
                   segments, alibi, dropout_p, rngs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _RingFunction.apply(setup, q, k, v)
    else:
        out, lse = _ring_forward(setup, q, k, v)
    if varlen:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
