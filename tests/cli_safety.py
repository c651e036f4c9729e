#!/usr/bin/env python3
"""`flashc run` against hostile paths and arguments: it must never destroy a file, and must say what is wrong.

usage: cli_safety.py PATH/TO/flashc

Each check runs the command in a fresh temporary directory and looks at the exit status, a fragment of the
message, and the files on disk afterwards (byte for byte, and whether they still exist and are still what they
were: a symbolic link, a device node). Covered:
  - an output naming an input or the other output, however spelled (./x, ../dir/x, a symbolic link, a hard
    link, a symbolic link to the directory), for files that exist and for names not created yet;
  - failed writes: to a device that is always full (a stand-in for /dev/full made with mknod, or /dev/full
    itself when the test cannot make one and cannot delete it either), and to an lse path that is a directory;
    the device must survive, an existing output must keep its old bytes, no temporary may be left behind;
  - writing through a FIFO and a symbolic link, and keeping an existing file's permission bits;
  - number options: --scale too small or too large for fp32, --window past int64, --softcap below zero;
  - .npy headers that claim more data than the file has, or sizes whose product overflows;
  - other malformed invocations (directories and empty files as inputs, repeated or empty options).
Prints one line per check and "N passed, M failed"; exits 1 on any failure.
"""
import glob
import os
import stat
import struct
import subprocess
import sys
import tempfile
import threading

import numpy as np

FLASHC = None
RESULTS = {"passed": 0, "failed": 0}


def check(name, ok, detail=""):
    if ok:
        RESULTS["passed"] += 1
        print("ok   " + name)
    else:
        RESULTS["failed"] += 1
        print("FAIL " + name + (": " + detail if detail else ""))


def run(args, cwd, timeout=120):
    p = subprocess.run([FLASHC, "run", "--backend", "cpu"] + args, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def leftovers(d):
    """Temporaries the command may have left in d (they are named .<name>.flashc-XXXXXX)."""
    return glob.glob(os.path.join(d, ".*.flashc-*")) + glob.glob(os.path.join(d, "*", ".*.flashc-*"))


def npy_header(shape, descr="<f4"):
    """A version 1.0 .npy header, padded to 64 bytes, with no data after it."""
    d = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, repr(tuple(shape)))
    n = 10 + len(d) + 1
    h = d + " " * ((64 - n % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode()


class Dir:
    """A scratch directory with q, k, v and a sentinel file whose bytes must never change unless asked to."""

    def __init__(self, root, name):
        self.path = os.path.join(root, name)
        os.mkdir(self.path)
        rng = np.random.default_rng(7)
        for t in "qkv":
            np.save(self.p(t + ".npy"), rng.standard_normal((1, 8, 2, 16)).astype(np.float32))
        self.inputs = {t: read(self.p(t + ".npy")) for t in "qkv"}
        self.sentinel = b"not a flashc output; must survive\n"

    def p(self, name):
        return os.path.join(self.path, name)

    def args(self, **extra):
        a = ["--q", "q.npy", "--k", "k.npy", "--v", "v.npy"]
        for key, val in extra.items():
            a += ["--" + key, val]
        return a

    def restore(self):
        """Puts the inputs' bytes back in place (same inodes, so links stay links) after a case that broke them,
        so that each case is judged on its own, not on what an earlier one destroyed."""
        for t in "qkv":
            if read(self.p(t + ".npy")) != self.inputs[t]:
                write(self.p(t + ".npy"), self.inputs[t])

    def inputs_intact(self):
        return all(read(self.p(t + ".npy")) == self.inputs[t] for t in "qkv")


def make_full_device(path):
    """A character device that fails every write with ENOSPC (same numbers as /dev/full, 1:7). Returns the path
    to use, or None. Without the right to mknod, the real /dev/full is used only when this process could not
    delete it anyway (not root): a broken flashc must not be able to remove a system device through this test."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        return path
    except (PermissionError, OSError):
        pass
    if os.geteuid() != 0 and os.path.exists("/dev/full") and not os.access("/dev", os.W_OK):
        return "/dev/full"
    return None


def is_char_device(path):
    try:
        return stat.S_ISCHR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


# ---- 1. an output that names an input or the other output ------------------------------------------------------

def test_same_file(root):
    d = Dir(root, "same")
    os.symlink("k.npy", d.p("klink.npy"))
    os.link(d.p("v.npy"), d.p("vhard.npy"))
    os.mkdir(d.p("sub"))
    os.symlink("sub", d.p("sublink"))
    write(d.p("o.npy"), d.sentinel)
    cases = [
        ("--out equal to --q", d.args(out="q.npy"), None),
        ("--out ./q.npy vs --q q.npy", d.args(out="./q.npy"), None),
        ("--out ../same/q.npy vs --q q.npy", d.args(out="../same/q.npy"), None),
        ("--out symlink to k.npy", d.args(out="klink.npy"), None),
        ("--out hard link of v.npy", d.args(out="vhard.npy"), None),
        ("--lse equal to --v", d.args(out="new.npy", lse="v.npy"), "new.npy"),
        ("--out equal to --lse (existing file)", d.args(out="o.npy", lse="o.npy"), None),
        ("--out vs --lse ./ spelling (new names)", d.args(out="n.npy", lse="./n.npy"), "n.npy"),
        ("--out vs --lse through a directory symlink (new names)", d.args(out="sub/x.npy", lse="sublink/x.npy"),
         "sub/x.npy"),
    ]
    for name, args, created in cases:
        d.restore()
        write(d.p("o.npy"), d.sentinel)
        rc, msg = run(args, d.path)
        ok = rc == 2 and "same file" in msg and d.inputs_intact() and read(d.p("o.npy")) == d.sentinel
        if created:
            ok = ok and not os.path.exists(d.p(created))
        check("same file: " + name, ok, "rc %d, %r" % (rc, msg.strip()))
    check("same file: the symlink and the hard link are still there",
          os.path.islink(d.p("klink.npy")) and os.stat(d.p("vhard.npy")).st_nlink == 2)
    # k and v may be one file: only outputs are compared with the rest
    rc, msg = run(["--q", "q.npy", "--k", "k.npy", "--v", "klink.npy", "--out", "ok.npy"], d.path)
    check("same file: two inputs naming one file are fine", rc == 0, "rc %d, %r" % (rc, msg.strip()))


# ---- 2, 3. failed writes never remove or change what was there ----------------------------------------------------

def test_failed_writes(root):
    d = Dir(root, "fail")
    full = make_full_device(d.p("full"))
    if full is None:
        print("skip full-device checks: cannot make a device node here, and /dev/full is deletable by this user")
    else:
        rc, msg = run(d.args(out=full), d.path)
        check("full device as --out: exit 1, 'No space left'", rc == 1 and "No space" in msg,
              "rc %d, %r" % (rc, msg.strip()))
        check("full device as --out: the device node is not deleted", is_char_device(full))

        write(d.p("o.npy"), d.sentinel)
        rc, msg = run(d.args(out="o.npy", lse=full), d.path)
        check("full device as --lse: exit 1, existing --out keeps its old bytes",
              rc == 1 and read(d.p("o.npy")) == d.sentinel, "rc %d, %r" % (rc, msg.strip()))
        check("full device as --lse: the device node is not deleted", is_char_device(full))

        write(d.p("l.npy"), d.sentinel)
        rc, msg = run(d.args(out=full, lse="l.npy"), d.path)
        check("full device as --out, regular --lse: exit 1, --lse keeps its old bytes, device kept",
              rc == 1 and read(d.p("l.npy")) == d.sentinel and is_char_device(full), "rc %d, %r" % (rc, msg.strip()))

    write(d.p("o.npy"), d.sentinel)
    os.mkdir(d.p("lsedir"))
    rc, msg = run(d.args(out="o.npy", lse="lsedir"), d.path)
    check("--lse is a directory: exit 1, message says so", rc == 1 and "directory" in msg,
          "rc %d, %r" % (rc, msg.strip()))
    check("--lse is a directory: existing --out keeps its old bytes, the directory stays",
          read(d.p("o.npy")) == d.sentinel and os.path.isdir(d.p("lsedir")))

    rc, msg = run(d.args(out="nodir/o.npy"), d.path)
    check("--out in a missing directory: exit 1, says the directory does not exist",
          rc == 1 and "nodir" in msg and "does not exist" in msg, "rc %d, %r" % (rc, msg.strip()))

    check("failed writes: no temporary left behind", not leftovers(d.path), repr(leftovers(d.path)))
    check("failed writes: inputs unchanged", d.inputs_intact())


# ---- writing through links and FIFOs, keeping modes --------------------------------------------------------------

def test_good_writes(root):
    d = Dir(root, "good")
    rc, msg = run(d.args(out="ref.npy", lse="ref_lse.npy"), d.path)
    check("plain run writes out and lse", rc == 0 and os.path.exists(d.p("ref.npy")), "rc %d, %r" % (rc, msg))
    if rc != 0:
        return
    ref = read(d.p("ref.npy"))

    write(d.p("real.npy"), d.sentinel)
    os.chmod(d.p("real.npy"), 0o640)
    os.symlink("real.npy", d.p("olink.npy"))
    rc, msg = run(d.args(out="olink.npy"), d.path)
    check("--out through a symlink: the file it points to is replaced, the link stays, mode 0640 kept",
          rc == 0 and os.path.islink(d.p("olink.npy")) and read(d.p("real.npy")) == ref
          and stat.S_IMODE(os.stat(d.p("real.npy")).st_mode) == 0o640, "rc %d, %r" % (rc, msg.strip()))

    fifo = d.p("fifo")
    os.mkfifo(fifo)
    got = []

    def reader():
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc, msg = run(d.args(out="fifo"), d.path, timeout=60)
    t.join(30)
    check("--out a FIFO: written straight through, the FIFO stays",
          rc == 0 and got and got[0] == ref and stat.S_ISFIFO(os.lstat(fifo).st_mode),
          "rc %d, %r, %d bytes" % (rc, msg.strip(), len(got[0]) if got else -1))
    check("good writes: no temporary left behind", not leftovers(d.path), repr(leftovers(d.path)))


# ---- 4. numbers ----------------------------------------------------------------------------------------------------

def test_numbers(root):
    d = Dir(root, "num")
    cases = [
        ("--scale 1e-50 (underflows fp32)", ["--scale", "1e-50"], 2, "not representable"),
        ("--scale 1e-40 (fp32 subnormal)", ["--scale", "1e-40"], 2, "not representable"),
        ("--scale 1e39 (past fp32)", ["--scale", "1e39"], 2, "too large for fp32"),
        ("--scale nan", ["--scale", "nan"], 2, "finite"),
        ("--scale= (empty)", ["--scale="], 2, "empty"),
        ("--softcap -1", ["--softcap", "-1"], 2, ">= 0"),
        ("--softcap 1e-45", ["--softcap", "1e-45"], 2, "not representable"),
        ("--window -1,99999999999999999999 (past int64)", ["--window", "-1,99999999999999999999"], 2, "64-bit"),
        ("--window -1,-99999999999999999999", ["--window", "-1,-99999999999999999999"], 2, "64-bit"),
        ("--window -2,0", ["--window", "-2,0"], 2, "[-1,"),
        ("--window 1,2,3", ["--window", "1,2,3"], 2, "two integers"),
        ("--window ' 1,2' (blank)", ["--window", " 1,2"], 2, "integer"),
        ("--threads 99999999999999999999", ["--threads", "99999999999999999999"], 2, "64-bit"),
    ]
    for name, extra, want_rc, needle in cases:
        if os.path.exists(d.p("o.npy")):
            os.remove(d.p("o.npy"))
        rc, msg = run(d.args(out="o.npy") + extra, d.path)
        check("numbers: " + name, rc == want_rc and needle in msg and not os.path.exists(d.p("o.npy")),
              "rc %d, %r" % (rc, msg.strip()))
    rc, msg = run(d.args(out="w.npy") + ["--window", "-1,9223372036854775807"], d.path)
    check("numbers: --window -1,9223372036854775807 is accepted", rc == 0, "rc %d, %r" % (rc, msg.strip()))
    rc, msg = run(d.args(out="s.npy") + ["--scale", "2e-38"], d.path)
    check("numbers: --scale 2e-38 (smallest normals) is accepted", rc == 0, "rc %d, %r" % (rc, msg.strip()))


# ---- 5. .npy headers that promise too much -----------------------------------------------------------------------

def test_npy_sizes(root):
    d = Dir(root, "npy")
    write(d.p("big.npy"), npy_header((1, 1024, 1024, 32768)))  # 128 GiB promised, 128 bytes of file
    rc, msg = run(["--q", "big.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"], d.path)
    check("npy: 128 GiB header in a 128-byte file says truncated, with both sizes",
          rc == 1 and "big.npy" in msg and "truncated" in msg and "137438953472" in msg and "out of memory" not in msg,
          "rc %d, %r" % (rc, msg.strip()))
    data = np.zeros(10, dtype=np.float32).tobytes()
    write(d.p("short.npy"), npy_header((1, 8, 2, 16)) + data)
    rc, msg = run(["--q", "short.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"], d.path)
    check("npy: a file one data block short says how many bytes the header wants and the file has",
          rc == 1 and "1024 bytes" in msg and "has 40" in msg, "rc %d, %r" % (rc, msg.strip()))
    write(d.p("huge.npy"), npy_header((0, 1 << 40, 1 << 40, 1 << 40)))
    rc, msg = run(["--q", "huge.npy", "--k", "huge.npy", "--v", "huge.npy", "--out", "o.npy"], d.path)
    check("npy: sizes whose product overflows are refused as too large", rc == 1 and "too large" in msg
          and "huge.npy" in msg, "rc %d, %r" % (rc, msg.strip()))
    check("npy: no output after refused inputs", not os.path.exists(d.p("o.npy")) and not leftovers(d.path))


# ---- other hostile invocations --------------------------------------------------------------------------------------

def test_misc(root):
    d = Dir(root, "misc")
    os.mkdir(d.p("adir"))
    write(d.p("empty.npy"), b"")
    cases = [
        ("a directory as --q", ["--q", "adir", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"], 1, "is a directory"),
        ("an empty file as --q", ["--q", "empty.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"], 1,
         "is empty"),
        ("a directory as --out", d.args(out="adir"), 1, "is a directory"),
        ("--out ending in /", d.args(out="nothere/"), 1, "directory"),
        ("--out= (empty)", d.args() + ["--out="], 2, "empty"),
        ("--q given twice", d.args(out="o.npy") + ["--q", "q.npy"], 2, "twice"),
        ("--causal=1", d.args(out="o.npy") + ["--causal=1"], 2, "takes no value"),
        ("--lse without a value", d.args(out="o.npy") + ["--lse"], 2, "needs a value"),
    ]
    for name, args, want_rc, needle in cases:
        if os.path.exists(d.p("o.npy")):
            os.remove(d.p("o.npy"))
        rc, msg = run(args, d.path)
        check("misc: " + name, rc == want_rc and needle in msg and not os.path.exists(d.p("o.npy")),
              "rc %d, %r" % (rc, msg.strip()))
    check("misc: the directory and the empty file are still there",
          os.path.isdir(d.p("adir")) and os.path.getsize(d.p("empty.npy")) == 0 and not leftovers(d.path))


def main():
    global FLASHC
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    FLASHC = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="flashc-safety-") as root:
        test_same_file(root)
        test_failed_writes(root)
        test_good_writes(root)
        test_numbers(root)
        test_npy_sizes(root)
        test_misc(root)
    print("%d passed, %d failed" % (RESULTS["passed"], RESULTS["failed"]))
    return 1 if RESULTS["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
