"""flashc.distributed (ring attention over torch.distributed) on the CPU with gloo.

- The step planner: for every rank, step, layout and band (causal, windows on either side, none), the calls it makes
  keep exactly the global band's (query, key) pairs, each once: checked exhaustively against the band on global
  positions, with each call's flashc window evaluated by CONVENTIONS.md's bottom-right rule; the planner for ALiBi,
  whose calls carry their global positions (flashc's positions option), likewise with the window measured between
  those positions, and each call's rows and keys on consecutive positions.
- 1, 2 and 4 processes (ring_worker.py, one per rank, a gloo group through a file store): forward and backward of a case
  table (causal, GQA, windows, softcap, ALiBi, both layouts, packed sequences; fp32 and bf16) against test_torch's fp64
  reference of the whole sequence by CONVENTIONS.md's rule (plus the 16-bit partial results' roundings; 16-bit
  gradients against the fp64 backward of the out the backward was given, see ring_worker.py); a second run gives
  the same bits; with dropout (fp32), the same elements dropped as by the one call on the whole sequence with the
  same seed; uneven shards, an odd zig-zag shard, dropout on chunks that are
  not whole groups of 4 keys, ALiBi slopes of the wrong shape, an unknown argument,
  a bad layout, a packed sequence that does not split evenly and cu_seqlens that differ between ranks are refused on
  every rank with a clear error, and the ring still works afterwards.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

import flashc.distributed as fcd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def kernel_keeps(nq, nk, left, right):
    """flashc's window on a call's own rows and keys (bottom-right aligned, -1 unbounded)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    keep = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        keep &= j >= i + nk - nq - left
    if right >= 0:
        keep &= j <= i + nk - nq + right
    return keep


def position_keeps(nq, nk, qpos, kpos, left, right):
    """flashc's window with positions: row i at qpos + i keeps key j at kpos + j within [-left, +right]."""
    x = (kpos + np.arange(nk))[None, :] - (qpos + np.arange(nq))[:, None]
    keep = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        keep &= x >= -left
    if right >= 0:
        keep &= x <= right
    return keep


def positions(layout, rank, world, n):
    return np.concatenate([np.arange(p.pos, p.pos + p.n) for p in fcd._pieces(layout, rank, world, n)])


BANDS = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (True, (0, -1)), (False, (2, 5)), (False, (7, 0)),
         (False, (0, 3)), (False, (-1, 2)), (False, (1, -1)), (False, (11, 11)), (True, (25, -1)), (False, (-1, 0))]


def check_plans(layout, plan, keeps, ns=(2, 4, 6, 10)):
    """For every world size, length, band, rank and step: the calls plan(qpieces, kpieces, lo, hi, step) makes keep,
    by keeps(call) on the call's own rows and keys, exactly the global band's (query, key) pairs, each once."""
    for world in (1, 2, 3, 4):
        for n in ns:
            total = world * n
            gi, gj = np.arange(total)[:, None], np.arange(total)[None, :]
            for causal, window in BANDS:
                lo, hi = fcd._band(causal, window)
                band = np.ones((total, total), dtype=bool)
                if lo is not None:
                    band &= gj - gi >= lo
                if hi is not None:
                    band &= gj - gi <= hi
                for rank in range(world):
                    for step in range(world):
                        src = (rank - step) % world
                        qpos, kpos = positions(layout, rank, world, n), positions(layout, src, world, n)
                        calls = plan(fcd._pieces(layout, rank, world, n), fcd._pieces(layout, src, world, n), lo, hi,
                                     step)
                        where = "layout %s world %d n %d band %s rank %d step %d: %s" % (
                            layout, world, n, (causal, window), rank, step, calls)
                        cover = np.zeros((n, n), dtype=int)
                        for c in calls:
                            assert 0 <= c.q0 < c.q1 <= n and 0 <= c.k0 < c.k1 <= n, where
                            assert c.left >= -1 and c.right >= -1, where
                            cover[c.q0:c.q1, c.k0:c.k1] += keeps(c, qpos, kpos)
                        assert cover.max(initial=0) <= 1, "a pair computed twice; " + where
                        assert np.array_equal(cover.astype(bool), band[np.ix_(qpos, kpos)]), where


@pytest.mark.parametrize("layout", fcd.LAYOUTS)
def test_plan_keeps_exactly_the_band(layout):
    check_plans(layout, lambda qp, kp, lo, hi, step: fcd._plan(qp, kp, lo, hi, step == 0),
                lambda c, qpos, kpos: kernel_keeps(c.q1 - c.q0, c.k1 - c.k0, c.left, c.right))


@pytest.mark.parametrize("layout", fcd.LAYOUTS)
def test_position_plan_keeps_exactly_the_band(layout):
    def keeps(c, qpos, kpos):
        # the rows and keys of a call sit on consecutive positions from qpos, kpos
        assert np.array_equal(qpos[c.q0:c.q1], c.qpos + np.arange(c.q1 - c.q0)), c
        assert np.array_equal(kpos[c.k0:c.k1], c.kpos + np.arange(c.k1 - c.k0)), c
        return position_keeps(c.q1 - c.q0, c.k1 - c.k0, c.qpos, c.kpos, c.left, c.right)

    check_plans(layout, lambda qp, kp, lo, hi, step: fcd._plan_positions(qp, kp, lo, hi), keeps)

    def keeps4(c, qpos, kpos):  # dropout's plan: every call starts on a key position that is a multiple of 4
        assert c.kpos % 4 == 0, c
        return keeps(c, qpos, kpos)

    check_plans(layout, lambda qp, kp, lo, hi, step: fcd._plan_positions(qp, kp, lo, hi, 4), keeps4, ns=(8, 16))


def test_zigzag_plan_is_balanced():
    """Causal zig-zag: after the rank's own step, every step is one call over half of the (query, key) pairs."""
    world, n = 4, 8
    for rank in range(world):
        for step in range(1, world):
            src = (rank - step) % world
            calls = fcd._plan(fcd._pieces("zigzag", rank, world, n), fcd._pieces("zigzag", src, world, n), None, 0,
                              False)
            assert len(calls) == 1 and calls[0].left == calls[0].right == -1
            c = calls[0]
            assert (c.q1 - c.q0) * (c.k1 - c.k0) == n * n // 2


def run_ranks(world, tmp_path, seed):
    store = str(tmp_path / "store")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        out = str(tmp_path / ("rank%d.json" % r))
        cmd = [sys.executable, os.path.join(HERE, "ring_worker.py"), str(r), str(world), store, str(seed), out]
        procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    records = []
    for out, p in procs:
        try:
            log, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for _, q in procs:
                q.kill()
            pytest.fail("ring_worker.py did not finish in 600 s (a rank waits on the ring?)")
        assert p.returncode == 0, "a rank exited with %d:\n%s" % (p.returncode, log.decode(errors="replace")[-4000:])
        with open(out) as f:
            records.append(json.load(f))
    return records


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_matches_one_process(world, tmp_path, rng):
    records = run_ranks(world, tmp_path, int(rng.integers(2**31)))
    failures = [f for r in records for f in r["failures"]]
    assert not failures, "\n".join(failures)
    for r in records:
        # every case and dtype ran and every refusal was seen, on every rank
        assert len(r["checked"]) == 27, r["checked"]
        both = ["uneven", "odd_zigzag", "dropout_chunks", "alibi_shape", "unknown", "layout", "varlen_length",
                "varlen_differ", "ring_after_refusals"]
        assert r["errors"] == [e for e in both if world > 1 or e not in ("uneven", "varlen_differ")], r


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    x = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fcd.ring_attention(x, x, x)
