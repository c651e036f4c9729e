#!/usr/bin/env python3
"""`flashc run` on .npy files written by numpy, checked against a numpy fp64 reference.

usage: cli_roundtrip.py PATH/TO/flashc [SEED] [--backend auto|cpu|cuda]

Writes q, k, v with numpy (float32, float16, and bfloat16 as uint16 bits), runs `flashc run`, reads o.npy and
lse.npy back with numpy and applies the error rule of CONVENTIONS.md: fp32 relative error <= 1e-5; f16/bf16 max
error <= 2 * (error of the naive algorithm in that precision) + 1e-5 (f32 inputs that ran on CUDA, which computes
them with bf16 operands, are held to the bf16 rule). Then feeds broken inputs (missing file,
corrupt header, wrong dtype, Fortran order, truncated data, wrong rank, mismatched shapes, bad options) and
checks the exit code, that the message names the file, and that no output is left behind.
Last, the other subcommands' promises: `flashc info` says CUDA can be used only when it lists a GPU; `flashc bench`
prints the median, min and max of each measurement and names the standard attention it ran (OpenBLAS or the C
loops), and its --json / --csv files are well-formed and hold the same rows (min <= median <= max, both outputs
agreeing), with null / empty fields where nothing was measured; refused file arguments write nothing.
"""
import csv
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

FLASHC = None
BACKEND = []  # extra `flashc run` arguments
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("FAIL: " + msg)


# ---- dtypes --------------------------------------------------------------------------------------------------

def bf16_bits(x):
    """float array -> uint16 bfloat16 bits, round to nearest even (as the library does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_storage(x, dt):
    if dt == "f32":
        return x.astype(np.float32)
    if dt == "f16":
        return x.astype(np.float32).astype(np.float16)
    return bf16_bits(x)


def as_f64(a, dt):
    return (bf16_value(a) if dt == "bf16" else a).astype(np.float64)


def round_to(x, dt):
    """Rounds float64 values to the storage dtype through fp32, as the oracle's store() does."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    if dt == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if dt == "bf16":
        return bf16_value(bf16_bits(x32)).astype(np.float64)
    return x32.astype(np.float64)


# ---- reference -----------------------------------------------------------------------------------------------

def visible(nq, nk, causal, left, right):
    """(nq, nk) bool: bottom-right aligned causal / window masks."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    diag = i + nk - nq
    keep = np.ones((nq, nk), dtype=bool)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep


def attention(q, k, v, scale, softcap, keep, lowp=None):
    """q (B, Nq, H, D), k/v (B, Nk, Hkv, D) float64 -> out (B, Nq, H, D), lse (B, H, Nq).

    lowp None: fp64 throughout. lowp 'f16'/'bf16': the plain materialized algorithm with S, P and O rounded to
    that dtype and every sum accumulated in fp32.
    """
    B, Nq, H, D = q.shape
    Hkv = k.shape[2]
    group = H // Hkv
    out = np.zeros((B, Nq, H, D))
    lse = np.full((B, H, Nq), np.inf)
    st = (lambda x: round_to(x, lowp)) if lowp else (lambda x: x)
    acc = (lambda x: np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)) if lowp else (lambda x: x)
    for b in range(B):
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, :, h // group], v[b, :, h // group]
            if lowp:
                dots = (qh.astype(np.float32) @ kh.astype(np.float32).T).astype(np.float64)
            else:
                dots = qh @ kh.T
            s = st(scale * dots)
            if softcap > 0:
                s = st(softcap * st(np.tanh(st(s / softcap))))
            s = np.where(keep, s, -np.inf)
            m = s.max(axis=1)
            rows = np.isfinite(m)
            if not rows.any():
                continue
            e = acc(np.exp(acc(s[rows] - m[rows, None])))
            if lowp:
                total = e.astype(np.float32).sum(axis=1, dtype=np.float32).astype(np.float64)
            else:
                total = e.sum(axis=1)
            p = st(e / total[:, None])
            if lowp:
                o = (p.astype(np.float32) @ vh.astype(np.float32)).astype(np.float64)
            else:
                o = p @ vh
            out[b, rows, h] = st(o)
            lse[b, h, rows] = acc(m[rows] + np.log(total))
    return out, lse


# ---- running the command -------------------------------------------------------------------------------------

def run(args):
    p = subprocess.run([FLASHC, "run"] + BACKEND + args, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def case(tmp, rng, name, dt, B, Nq, Nk, H, Hkv, D, causal=False, window=None, scale=0.0, softcap=0.0,
         three_d=False, bhnd=False):
    q = rng.standard_normal((B, Nq, H, D))
    # some rows get large logits, where a careless softmax overflows
    q *= rng.uniform(0.5, 4.0, size=(B, Nq, H, 1))
    k = rng.standard_normal((B, Nk, Hkv, D))
    v = rng.standard_normal((B, Nk, Hkv, D))
    qs, ks, vs = (to_storage(x, dt) for x in (q, k, v))
    qf, kf, vf = (as_f64(x, dt) for x in (qs, ks, vs))

    def layout(x):
        x = x.transpose(0, 2, 1, 3) if bhnd else x
        return np.ascontiguousarray(x[0] if three_d else x)

    paths = {t: os.path.join(tmp, "%s_%s.npy" % (name, t)) for t in ("q", "k", "v", "o", "lse")}
    np.save(paths["q"], layout(qs))
    np.save(paths["k"], layout(ks))
    np.save(paths["v"], layout(vs))
    args = ["--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out", paths["o"], "--lse", paths["lse"]]
    if causal:
        args.append("--causal")
    if window is not None:
        args += ["--window", "%d,%d" % window]
    if scale:
        args += ["--scale", repr(scale)]
    if softcap:
        args += ["--softcap", repr(softcap)]
    if bhnd:
        args += ["--layout", "bhnd"]
    rc, out, err = run(args)
    if rc != 0:
        fail("%s: flashc run exited %d: %s" % (name, rc, err.strip()))
        return
    # "flashc run: <backend> <dtype> ...": which backend ran it decides the f32 rule below
    backend = out.split()[2] if out.startswith("flashc run: ") else "?"

    o = np.load(paths["o"])
    lse = np.load(paths["lse"])
    want_o_shape = layout(qs).shape
    want_lse_shape = (H, Nq) if three_d else (B, H, Nq)
    if o.dtype != qs.dtype or o.shape != want_o_shape:
        fail("%s: out is %s %s, expected %s %s" % (name, o.dtype, o.shape, qs.dtype, want_o_shape))
        return
    if lse.dtype != np.float32 or lse.shape != want_lse_shape:
        fail("%s: lse is %s %s, expected float32 %s" % (name, lse.dtype, lse.shape, want_lse_shape))
        return
    if three_d:
        o, lse = o[None], lse[None]
    if bhnd:
        o = o.transpose(0, 2, 1, 3)
    of = as_f64(o, dt)
    lse = lse.astype(np.float64)

    left, right = window if window is not None else (-1, -1)
    keep = visible(Nq, Nk, causal, left, right)
    eff_scale = scale if scale else 1.0 / np.sqrt(D)
    ref_o, ref_lse = attention(qf, kf, vf, eff_scale, softcap, keep)

    dead = np.isinf(ref_lse)  # (B, H, Nq): rows that see no key
    if dead.any():
        dead_o = dead.transpose(0, 2, 1)  # (B, Nq, H)
        if not (np.all(of[dead_o] == 0) and np.all(np.isposinf(lse[dead]))):
            fail("%s: rows with no visible key must give out 0 and lse +inf" % name)
    if not (np.all(np.isfinite(of)) and np.all(np.isfinite(lse[~dead]))):
        fail("%s: non-finite values in the output" % name)
        return
    live = ~dead
    if dt == "f32" and backend != "cpu":
        # the GPU kernels take f32 inputs as bf16 operands: hold them to the bf16 rule, with the naive algorithm
        # run on the inputs rounded to bf16
        rq, rk, rv = (as_f64(to_storage(x, "bf16"), "bf16") for x in (qf, kf, vf))
        low_o, low_lse = attention(rq, rk, rv, eff_scale, softcap, keep, lowp="bf16")
        err_o = np.abs(of - ref_o).max()
        err_l = np.abs(lse[live] - ref_lse[live]).max()
        tol_o = 2 * np.abs(low_o - ref_o).max() + 1e-5
        tol_l = 2 * np.abs(low_lse[live] - ref_lse[live]).max() + 1e-5
    elif dt == "f32":
        err_o = np.linalg.norm(of - ref_o) / np.linalg.norm(ref_o)
        err_l = np.linalg.norm(lse[live] - ref_lse[live]) / np.linalg.norm(ref_lse[live])
        tol_o = tol_l = 1e-5
    else:
        low_o, low_lse = attention(qf, kf, vf, eff_scale, softcap, keep, lowp=dt)
        err_o = np.abs(of - ref_o).max()
        err_l = np.abs(lse[live] - ref_lse[live]).max()
        tol_o = 2 * np.abs(low_o - ref_o).max() + 1e-5
        tol_l = 2 * np.abs(low_lse[live] - ref_lse[live]).max() + 1e-5
    ok = err_o <= tol_o and err_l <= tol_l
    print("%-5s %-28s %-4s out %.2e (tol %.2e)  lse %.2e (tol %.2e)  %s"
          % ("ok" if ok else "FAIL", name + " " + dt, backend, err_o, tol_o, err_l, tol_l, "" if ok else "<-"))
    if not ok:
        fail("%s: error above the bound" % name)


# ---- info and bench ------------------------------------------------------------------------------------------

def command(args, timeout=300):
    p = subprocess.run([FLASHC] + args, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def info_case():
    rc, out, err = command(["info"])
    m = re.search(r"^gpus:\s+(\d+)", out, re.M)
    gpus = int(m.group(1)) if m else 0  # "gpus: - (CUDA backend not compiled)"
    if rc != 0:
        fail("info: exit %d, %r" % (rc, err.strip()))
    elif "can use CUDA" in out and gpus == 0:
        fail("info: says CUDA can be used with no GPU listed:\n" + out)
    elif m and gpus == 0 and "no GPU found" not in out and "without the CUDA runtime" not in out:
        fail("info: no GPU listed, and no line says run, check and bench use the CPU:\n" + out)
    else:
        print("ok    %-28s %d GPU(s): %s" % ("info", gpus, (re.findall(r"^command:.*$", out, re.M) or ["-"])[0]))


def check_stats(name, st):
    """st: one measurement's dict from the JSON; returns what is wrong, or ''."""
    if st is None:
        return "%s: missing" % name
    if not (isinstance(st.get("runs"), int) and st["runs"] >= 1):
        return "%s: runs %r" % (name, st.get("runs"))
    lo, med, hi = st.get("ms_min"), st.get("ms_median"), st.get("ms_max")
    if not all(isinstance(x, (int, float)) and x > 0 for x in (lo, med, hi)) or not lo <= med <= hi:
        return "%s: min/median/max %r %r %r" % (name, lo, med, hi)
    if not (isinstance(st.get("gflops"), (int, float)) and st["gflops"] > 0):
        return "%s: gflops %r" % (name, st.get("gflops"))
    return ""


def bench_case(tmp, name, extra, want_std, tol=1e-4):
    """One small CPU sweep (N 48 and 96: not a multiple of any tile) written to JSON and CSV, checked against
    each other and against the printed table."""
    jpath, cpath = os.path.join(tmp, name + ".json"), os.path.join(tmp, name + ".csv")
    args = ["bench", "--backend", "cpu", "--nmin", "48", "--nmax", "96", "--heads", "2", "--dim", "24", "--reps",
            "3", "--budget", "1", "--json", jpath, "--csv", cpath] + extra
    rc, out, err = command(args)
    if rc != 0:
        return fail("bench %s: exit %d, %r" % (name, rc, err.strip()))
    problems = []
    header = [ln for ln in out.splitlines() if ln.lstrip().startswith("N ")]
    if not header or header[0].split()[:5] != ["N", "B", "flash", "ms", "min"]:
        problems.append("the table has no min/max columns: %r" % header)
    std_line = [ln for ln in out.splitlines() if ln.startswith("standard:")]
    if want_std and not (std_line and ("OpenBLAS" in std_line[0] or "C loops" in std_line[0])):
        problems.append("the standard: line does not say what ran: %r" % std_line)
    with open(jpath) as f:
        doc = json.load(f)
    with open(cpath, newline="") as f:
        lines = list(csv.reader(f))
    rows = doc.get("rows", [])
    if [r.get("N") for r in rows] != [48, 96]:
        problems.append("json rows N %r" % [r.get("N") for r in rows])
    if want_std and doc.get("standard") not in ("openblas", "c-loops"):
        problems.append("json standard %r" % doc.get("standard"))
    if not want_std and doc.get("standard") is not None:
        problems.append("json standard %r with --no-std" % doc.get("standard"))
    printed = {int(ln.split()[0]): ln.split() for ln in out.splitlines() if re.match(r"^\s+\d+\s", ln)}
    for r in rows:
        for what in ("flash",) + (("standard",) if want_std else ()):
            wrong = check_stats("N=%s %s" % (r.get("N"), what), r.get(what))
            if wrong:
                problems.append(wrong)
        if not want_std and (r.get("standard") is not None or r.get("speedup") is not None):
            problems.append("N=%s: standard numbers with --no-std" % r.get("N"))
        if want_std and not (isinstance(r.get("max_abs_diff"), float) and r["max_abs_diff"] < tol):
            problems.append("N=%s: flash and standard differ by %r" % (r.get("N"), r.get("max_abs_diff")))
        p = printed.get(r.get("N"))
        if not p or [float(x) for x in p[2:5]] != [round(r["flash"][k], 3) for k in ("ms_median", "ms_min", "ms_max")]:
            # the table prints ms to 3 decimals, the file 6 significant digits: compare within both roundings
            if not p or any(abs(float(x) - r["flash"][k]) > 1.5e-3 + 1e-5 * r["flash"][k]
                            for x, k in zip(p[2:5], ("ms_median", "ms_min", "ms_max"))):
                problems.append("N=%s: the table's flash ms/min/max %r are not the file's %r" % (r.get("N"), p, r["flash"]))
    want_cols = ["backend", "dtype", "causal", "H", "D", "N", "B", "flash_ms_median", "flash_ms_min", "flash_ms_max",
                 "flash_runs", "flash_gflops", "flash_workspace_bytes", "standard", "std_ms_median", "std_ms_min",
                 "std_ms_max", "std_runs", "std_gflops", "std_bytes", "speedup", "max_abs_diff"]
    if not lines or lines[0] != want_cols:
        problems.append("csv header %r" % (lines[:1],))
    elif len(lines) != 1 + len(rows) or any(len(ln) != len(want_cols) for ln in lines):
        problems.append("csv: %d lines, widths %r" % (len(lines), [len(ln) for ln in lines]))
    else:
        for ln, r in zip(lines[1:], rows):
            c = dict(zip(want_cols, ln))
            if int(c["N"]) != r["N"] or abs(float(c["flash_ms_median"]) - r["flash"]["ms_median"]) > 1e-9:
                problems.append("csv row %r is not json row N=%s" % (ln, r["N"]))
            std_fields = [c[k] for k in want_cols[14:19]]
            if want_std and (c["standard"] != doc["standard"] or "" in std_fields):
                problems.append("csv row %r: standard columns" % ln)
            if not want_std and any(std_fields) or not want_std and c["standard"]:
                problems.append("csv row %r: standard columns with --no-std" % ln)
    if problems:
        for msg in problems:
            fail("bench %s: %s" % (name, msg))
    else:
        print("ok    %-28s %s" % ("bench " + name, (std_line or ["standard: -"])[0][:90]))


def bench_refusals(tmp):
    adir = os.path.join(tmp, "adir")
    os.makedirs(adir, exist_ok=True)
    keep = os.path.join(tmp, "keep.csv")
    with open(keep, "w") as f:
        f.write("old\n")
    small = ["bench", "--backend", "cpu", "--nmin", "32", "--nmax", "32", "--heads", "1", "--dim", "16", "--reps",
             "1", "--no-std"]
    cases = [
        ("bench --json a directory", small + ["--json", adir, "--csv", keep], 1, "is a directory"),
        ("bench --json = --csv", small + ["--json", keep, "--csv", keep], 2, "same file"),
        ("bench --csv given twice", small + ["--csv", keep, "--csv", keep + "2"], 2, "twice"),
        ("bench --json= (empty)", small + ["--json="], 2, "empty"),
        ("bench --csv in no directory", small + ["--csv", os.path.join(tmp, "nodir", "x.csv")], 1, "does not exist"),
    ]
    for name, args, want_rc, needle in cases:
        rc, out, err = command(args)
        with open(keep) as f:
            kept = f.read() == "old\n"
        stray = [n for n in os.listdir(tmp) if ".flashc-" in n] + os.listdir(adir)
        if rc != want_rc or needle not in err or not kept or stray:
            fail("%s: exit %d (want %d), stderr %r (want %r), old file kept %s, left behind %r"
                 % (name, rc, want_rc, err.strip(), needle, kept, stray))
        else:
            print("ok    %-28s exit %d: %s" % (name, rc, err.strip().splitlines()[0]))


def info_and_bench(tmp):
    info_case()
    bench_case(tmp, "standard", [], want_std=True)
    bench_case(tmp, "causal", ["--causal"], want_std=True)
    # the output stored in f16: one rounding (2^-11 relative) of values below 4 in magnitude
    bench_case(tmp, "f16", ["--dtype", "f16"], want_std=True, tol=4e-3)
    bench_case(tmp, "no_std", ["--no-std"], want_std=False)
    bench_refusals(tmp)


# ---- failures ------------------------------------------------------------------------------------------------

def expect_error(tmp, name, args, needles, code=1):
    out_path = os.path.join(tmp, "err_out.npy")
    if os.path.exists(out_path):
        os.remove(out_path)
    rc, _, err = run(args + ["--out", out_path] if "--out" not in args and code == 1 else args)
    missing = [n for n in needles if n not in err]
    if rc != code or missing:
        fail("%s: exit %d (want %d), stderr %r lacks %r" % (name, rc, code, err.strip(), missing))
    elif os.path.exists(out_path):
        fail("%s: an output file was left behind" % name)
    else:
        print("ok    %-28s exit %d: %s" % (name, rc, err.strip().splitlines()[0] if err.strip() else ""))


def error_cases(tmp, rng):
    q = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    good = os.path.join(tmp, "good.npy")
    np.save(good, q)
    base = ["--k", good, "--v", good]

    missing = os.path.join(tmp, "does_not_exist.npy")
    expect_error(tmp, "missing file", ["--q", missing] + base, [missing, "cannot open"])

    raw = open(good, "rb").read()
    bad_magic = os.path.join(tmp, "bad_magic.npy")
    open(bad_magic, "wb").write(b"\x00" + raw[1:])
    expect_error(tmp, "bad magic", ["--q", bad_magic] + base, [bad_magic, "bad magic"])

    bad_dict = os.path.join(tmp, "bad_dict.npy")
    open(bad_dict, "wb").write(raw.replace(b"'shape'", b"'shope'", 1))
    expect_error(tmp, "corrupt header", ["--q", good, "--k", bad_dict, "--v", good], [bad_dict, "bad header"])

    trunc = os.path.join(tmp, "truncated.npy")
    open(trunc, "wb").write(raw[:-5])
    expect_error(tmp, "truncated data", ["--q", good, "--k", good, "--v", trunc], [trunc, "truncated"])

    f64 = os.path.join(tmp, "f64.npy")
    np.save(f64, q.astype(np.float64))
    expect_error(tmp, "float64 input", ["--q", f64] + base, [f64, "unsupported dtype '<f8'"])

    fortran = os.path.join(tmp, "fortran.npy")
    np.save(fortran, np.asfortranarray(q))
    expect_error(tmp, "fortran order", ["--q", fortran] + base, [fortran, "Fortran"])

    big = os.path.join(tmp, "big_endian.npy")
    np.save(big, q.astype(">f4"))
    expect_error(tmp, "big-endian input", ["--q", big] + base, [big, "big-endian"])

    flat = os.path.join(tmp, "two_d.npy")
    np.save(flat, q[0, :, 0])
    expect_error(tmp, "2-d input", ["--q", flat] + base, [flat, "3-d"])

    three = os.path.join(tmp, "three_d.npy")
    np.save(three, q[0])
    expect_error(tmp, "rank mismatch", ["--q", three] + base, [three, "3-d"])

    other_d = os.path.join(tmp, "other_d.npy")
    np.save(other_d, rng.standard_normal((1, 8, 2, 32)).astype(np.float32))
    expect_error(tmp, "head dim mismatch", ["--q", good, "--k", other_d, "--v", other_d], ["flashc run: "])

    half = os.path.join(tmp, "half.npy")
    np.save(half, q.astype(np.float16))
    expect_error(tmp, "dtype mismatch", ["--q", good, "--k", half, "--v", good], ["flashc run: "])

    expect_error(tmp, "unknown option", ["--q", good, "--k", good, "--v", good, "--out", "x.npy", "--frobnicate"],
                 ["unknown argument '--frobnicate'"], code=2)
    expect_error(tmp, "missing --out", ["--q", good, "--k", good, "--v", good], ["--out"], code=2)
    expect_error(tmp, "bad --window", ["--q", good, "--k", good, "--v", good, "--out", "x.npy", "--window", "3"],
                 ["--window"], code=2)
    expect_error(tmp, "bad --scale", ["--q", good, "--k", good, "--v", good, "--out", "x.npy", "--scale", "abc"],
                 ["--scale"], code=2)

    unwritable = os.path.join(tmp, "no_such_dir", "o.npy")
    rc, _, err = run(["--q", good, "--k", good, "--v", good, "--out", unwritable])
    if rc != 1 or unwritable not in err:
        fail("unwritable output: exit %d, stderr %r" % (rc, err.strip()))
    else:
        print("ok    %-28s exit %d: %s" % ("unwritable output", rc, err.strip()))


def main():
    global FLASHC, BACKEND
    argv = sys.argv[1:]
    if "--backend" in argv:
        i = argv.index("--backend")
        BACKEND = argv[i:i + 2]
        del argv[i:i + 2]
    if not argv:
        print(__doc__)
        return 2
    FLASHC = os.path.abspath(argv[0])
    seed = int(argv[1]) if len(argv) > 1 else int.from_bytes(os.urandom(4), "little")
    print("cli_roundtrip: %s %s, seed %d" % (FLASHC, " ".join(BACKEND), seed))
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="flashc_cli_") as tmp:
        case(tmp, rng, "gqa", "f32", B=2, Nq=37, Nk=53, H=4, Hkv=2, D=64)
        case(tmp, rng, "gqa", "f16", B=2, Nq=37, Nk=53, H=4, Hkv=2, D=64)
        case(tmp, rng, "gqa", "bf16", B=2, Nq=37, Nk=53, H=4, Hkv=2, D=64)
        case(tmp, rng, "causal_nq_gt_nk", "f32", B=1, Nq=53, Nk=37, H=2, Hkv=2, D=32, causal=True)
        case(tmp, rng, "causal_nq_gt_nk", "bf16", B=1, Nq=53, Nk=37, H=2, Hkv=2, D=32, causal=True)
        case(tmp, rng, "causal", "f16", B=2, Nq=40, Nk=64, H=2, Hkv=1, D=48, causal=True)
        case(tmp, rng, "window_softcap_scale", "f32", B=1, Nq=45, Nk=45, H=3, Hkv=3, D=59, window=(8, 4),
             scale=0.3, softcap=5.0)
        case(tmp, rng, "window_softcap_scale", "f16", B=1, Nq=45, Nk=45, H=3, Hkv=3, D=59, window=(8, 4),
             scale=0.3, softcap=5.0)
        case(tmp, rng, "three_d", "f32", B=1, Nq=21, Nk=30, H=3, Hkv=1, D=16, three_d=True)
        case(tmp, rng, "three_d", "bf16", B=1, Nq=21, Nk=30, H=3, Hkv=1, D=16, three_d=True)
        case(tmp, rng, "bhnd", "f32", B=2, Nq=33, Nk=33, H=2, Hkv=2, D=24, causal=True, bhnd=True)
        case(tmp, rng, "bhnd_three_d", "f16", B=1, Nq=19, Nk=26, H=4, Hkv=2, D=32, bhnd=True, three_d=True)
        error_cases(tmp, rng)
        info_and_bench(tmp)
    if FAILURES:
        print("cli_roundtrip: %d failure(s), seed %d" % (len(FAILURES), seed))
        return 1
    print("cli_roundtrip: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
