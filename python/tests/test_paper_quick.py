"""bench/paper.py at tiny sizes on the CPU: every figure's PNG and CSV is written and well formed."""

import csv
import math
import os
import struct
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIGURES = {  # name -> the CSV's columns
    "fig1_runtime": ["N", "flashc_fwd_ms", "standard_fwd_ms", "flashc_fwdbwd_ms", "standard_fwdbwd_ms"],
    "fig2_memory": ["N", "flashc_fwd_MiB", "standard_fwd_MiB", "flashc_fwdbwd_MiB", "standard_fwdbwd_MiB",
                    "over_cap"],
    "fig4_blocksparse": ["density", "kept", "fwd_ms", "fwdbwd_ms", "dense_fwd_ms", "dense_fwdbwd_ms",
                         "fwd_over_dense", "fwdbwd_over_dense"],
    "fig5_backward": ["N", "flashc_bwd_ms", "standard_bwd_ms", "P_MiB", "lse_MiB"],
}


def read_csv(path):
    with open(path) as f:
        lines = f.read().splitlines()
    caption = [ln for ln in lines if ln.startswith("#")]
    rows = list(csv.reader(ln for ln in lines if not ln.startswith("#")))
    return caption, rows[0], rows[1:]


def test_paper_quick_tiny(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "figs"
    # cap 1e-4 GiB (107 KB): standard attention's S and P (2 * H * N^2 fp32) are 64 KiB at N 64, under the cap,
    # and 256 KiB at N 128, over it: both sides of the cap are exercised.
    cmd = [sys.executable, os.path.join(REPO, "bench", "paper.py"), "--quick", "--device", "cpu", "--out", str(out),
           "--ns", "64,128", "--reps", "1", "--bs-n", "256", "--bs-block", "64", "--threads", "1", "--heads", "2",
           "--cap-gib", "1e-4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HBM bytes: skipped" in r.stdout
    assert "5/5" in r.stderr  # the progress line
    for name, columns in FIGURES.items():
        png = (out / (name + ".png")).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = struct.unpack(">II", png[16:24])
        assert 200 <= w <= 2000 and 150 <= h <= 2000
        caption, header, rows = read_csv(out / (name + ".csv"))
        assert header == columns
        assert any(c.startswith("# machine: ") for c in caption) and any(c.startswith("# commit: ") for c in caption)
        assert any(c.startswith("# command: ") and "paper.py" in c for c in caption)
        assert rows and all(len(row) == len(columns) for row in rows)
        for row in rows:
            for x in row:
                assert x == "" or math.isfinite(float(x))
    _, _, rt = read_csv(out / "fig1_runtime.csv")
    assert [int(r[0]) for r in rt] == [64, 128]
    assert rt[0][2] != "" and rt[1][2] == ""  # standard ran under the cap, not over it
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rt)
    _, _, bs = read_csv(out / "fig4_blocksparse.csv")
    assert [float(r[0]) for r in bs] == [1, 0.5, 0.25, 0.1]
    assert float(bs[0][1]) == 1.0 and all(0 < float(r[1]) <= 1 for r in bs)
    md = (out / "figures.md").read_text()
    assert "commit: " in md and "fig1_runtime.png" in md and "skipped" in md
    assert not (out / "fig3_hbm.png").exists()
