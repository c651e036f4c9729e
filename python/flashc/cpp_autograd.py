"""flashc's autograd function in C++: on by default where it can be built (``FLASHC_CPP_AUTOGRAD``).

flash_attn_func, flashc.attention and flashc.scaled_dot_product_attention run a plain eager call (torch tensors,
scalar options only, no dropout or mask; see flashc.ops' per-shape plans) through a Python torch.autograd.Function. On
CUDA, autograd runs every backward on its own device thread, and a Python backward there must take the GIL from the
thread that called ``backward()``: on small problems that hand-over is a visible share of a training step's host time.
csrc/torch_autograd.cpp is an autograd function written in C++ that makes the same library calls (out, lse and the
gradients bit for bit the Python path's), with no Python in the forward or the backward; once it is loaded those calls
go through it (the switch takes effect between calls: a call's autograd node is fixed at its forward). Other calls
are unchanged. Its CUDA path ran on an H200 (python/tests/test_cpp_autograd.py, 63 passed; a B 1 N 128 bf16
flash_attn_func forward + backward step took 143.9 us of host time against 157.5 us on the Python path).

The module is compiled from that one file against the running torch (a C++20 compiler: $CXX, else c++; Python's
headers; about half a minute) into a cache directory ($FLASHC_CACHE_DIR, else $XDG_CACHE_HOME/flashc or
~/.cache/flashc; created private), keyed by the source, the torch and Python versions and the compiler command (with
torch's and Python's install paths), and later processes load it from there; a module or directory that another user
owns or others can write is not loaded (_trusted). FLASHC_CPP_AUTOGRAD, read at the first planned call that needs
gradients, decides when:

- unset or ``auto`` (the default): a module already in the cache is loaded and used at once; otherwise a daemon
  thread starts the compiler (``nice``d, in its own session) and the calls keep the Python function until the module
  is built and loaded, when later calls switch to it. No call waits for the build. A failure (no compiler, no
  Python.h, a compile or load error, a cache directory that cannot be written) only leaves a record on the "flashc"
  logger and in ``status()``; a failed compile leaves its output beside the module (``<module>.log``), and later
  processes do not try again in the background until ``python -m flashc.cpp_autograd`` or ``enable()`` builds it
  (a compiler killed by a signal leaves no log: the next process tries again).
- ``0`` / ``off`` / ``false``: never (the Python function).
- ``1`` / ``on`` / ``true``: built (if needed) and loaded at the first planned call, which waits for it; a failure
  warns once and keeps the Python function.

``enable()`` builds and loads it now (raising BuildError, with the compiler's output, on failure) and ``disable()``
goes back to the Python function; either one overrides the environment for the rest of the process.
``python -m flashc.cpp_autograd`` builds it in the foreground (for images and clusters that prebuild it).

One process builds a key at a time: the builder holds an flock on ``<module>.lock`` in the cache directory (and the
compiler inherits it, so a build outlives a process that exits first and still fills the cache); others wait for it
in the background, polling. Forks and threads: the build thread holds no lock of Python's or of this module's while
it waits; it only waits on the compiler's process. A child forked meanwhile closes its copy of the lock file (so the
lock goes with the builder) and looks again at its own next first-time shape.
"""
import ctypes
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings

import torch

from . import _lib

__all__ = ["enable", "disable", "enabled", "status", "build", "BuildError"]

_NAME = "flashc_cpp_autograd"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_autograd.cpp")
_FUNCTIONS = ("flashc_context_create", "flashc_context_set_stream", "flashc_context_set_threads",
              "flashc_context_last_error", "flashc_status_string", "flashc_forward", "flashc_backward")
_log = logging.getLogger("flashc")
_lock = threading.Lock()  # enable() and the end of a background build; never held while a compiler runs elsewhere
_module = None
_choice = None  # True / False once enable() / disable() was called: the environment no longer decides
_state = "pending"  # status(): pending (no planned call yet), off, building, enabled, failed: <reason>
_thread = None
_lock_fds = set()  # the lock files this process holds open (a forked child closes its copies)

# Runs the compiler, then renames its output into place (at once: a loader sees the whole module or none) in the same
# process, so a build the Python process leaves behind still lands; a failure leaves the output as the log (not when
# the compiler was killed by a signal, e.g. out of memory: a later build tries again). The module is made readable as
# the umask allows (mkstemp's file is the owner's only: an image built as root, run as a user).
_SCRIPT = """tmp=$1 target=$2 log=$3; shift 3
"$@" >"$tmp.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then chmod +r "$tmp" && mv -f "$tmp" "$target" 2>>"$tmp.log" && rm -f "$tmp.log" "$log" && exit 0
  rc=$?; fi
rm -f "$tmp"
if [ $rc -gt 128 ]; then rm -f "$tmp.log"; exit $rc; fi
mv -f "$tmp.log" "$log"
exit $rc
"""


class BuildError(RuntimeError):
    """The C++ autograd module could not be built or loaded (the first line says why, the rest gives details)."""


def _cache_dir():
    d = os.environ.get("FLASHC_CACHE_DIR")
    if not d:
        d = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "flashc")
    return d


def _command(source, target):
    """The compile and link command for the module (a list), against the running torch and Python."""
    # torch's headers and libraries as torch.utils.cpp_extension finds them (not imported: it warns without CUDA)
    root = os.path.dirname(os.path.abspath(torch.__file__))
    include_paths = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
    library_paths = [os.path.join(root, "lib")]
    cxx = shlex.split(os.environ.get("CXX") or "c++") or ["c++"]
    cmd = cxx + ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DTORCH_EXTENSION_NAME=" + _NAME,
                 "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch.compiled_with_cxx11_abi())]
    cmd += ["-I" + p for p in include_paths] + ["-I" + sysconfig.get_paths()["include"]]
    cmd += [source, "-o", target]
    for p in library_paths:
        cmd += ["-L" + p, "-Wl,-rpath," + p]
    return cmd + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _paths():
    """(cache directory, the module's path in it) for this source, torch, Python and compiler command."""
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cmd = _command(_SOURCE, "OUT")
    key = hashlib.sha256(b"\0".join([src, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(cmd).encode()])).hexdigest()[:16]
    d = _cache_dir()
    return d, os.path.join(d, "%s_%s%s" % (_NAME, key, sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _side(target, ext):
    """The lock file or the failed build's log beside the module."""
    return os.path.join(os.path.dirname(target), os.path.basename(target).split(".")[0] + ext)


def _compile(target, lock_fd, verbose, background):
    """Compiles the module into target (the caller holds the key's lock, lock_fd, which the compiler inherits)."""
    cmd0 = _command(_SOURCE, "OUT")[0]
    if shutil.which(cmd0) is None:
        raise BuildError("no C++ compiler (%s; set CXX)" % cmd0)
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise BuildError("no Python.h in %s (Python's development headers, e.g. python3-dev)" % include)
    d = os.path.dirname(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".%s_" % _NAME, suffix=".so", dir=d)
        os.close(fd)
    except OSError as e:
        raise BuildError("the cache directory %s cannot be written (%s)" % (d, e)) from e
    log = _side(target, ".log")
    cmd = _command(_SOURCE, tmp)
    if verbose:
        print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    nice = ["nice", "-n", "19"] if background and shutil.which("nice") else []
    # a new session in the background: a terminal's Ctrl-C stops the user's program, not a build that fills the cache
    proc = subprocess.Popen(["/bin/sh", "-c", _SCRIPT, "sh", tmp, target, log] + nice + cmd,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            pass_fds=(lock_fd,), start_new_session=background)
    try:
        rc = proc.wait()
    except BaseException:  # KeyboardInterrupt in a foreground build
        proc.kill()
        proc.wait()
        for p in (tmp, tmp + ".log"):
            if os.path.exists(p):
                os.unlink(p)
        raise
    if rc != 0:
        raise _failed(log, rc, cmd)


def _failed(log, rc=None, cmd=None):
    """The BuildError of a failed compile (rc, cmd), or of an earlier one whose log is left (neither)."""
    try:
        with open(log, errors="replace") as f:
            out = f.read()
    except OSError:
        out = ""
    if rc is None:
        first = ("an earlier build of the module failed (its output in %s; python -m flashc.cpp_autograd or enable() "
                 "tries again)" % log)
    else:
        first = "compiling %s failed (exit status %d; the compiler's output in %s)" % (os.path.basename(_SOURCE), rc,
                                                                                      log)
    return BuildError("%s\n%s%s" % (first, " ".join(shlex.quote(c) for c in cmd) + "\n" if cmd else "", out[-4000:]))


def _build(target, verbose, background):
    """target, compiled under the key's lock unless another process built it meanwhile. The foreground waits for
    the lock; the background polls for it (or for the module) and does not compile again after a failed build."""
    d = os.path.dirname(target)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        fd = os.open(_side(target, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise BuildError("the cache directory %s cannot be written (%s)" % (d, e)) from e
    _lock_fds.add(fd)
    try:
        if background:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # another process builds it
                    if os.path.exists(target):
                        return target
                    time.sleep(0.5)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.exists(target):
            return target
        if background and os.path.exists(_side(target, ".log")):
            raise _failed(_side(target, ".log"))
        _compile(target, fd, verbose, background)
        return target
    finally:
        _lock_fds.discard(fd)
        os.close(fd)  # the lock goes with the last copy (a forked child closed its own)


def build(verbose=False):
    """The path of the compiled module for this torch and Python, compiling it first (waiting for another process's
    build of it) when the cache has none."""
    _, target = _paths()
    if os.path.exists(target):
        return target
    return _build(target, verbose, background=False)


def _trusted(path):
    """Refuses a module (or its directory) that someone other than this user or root owns or can write: the cache
    directory may be shared ($FLASHC_CACHE_DIR), and a planted file would run in this process."""
    for p in (os.path.dirname(os.path.abspath(path)), path):
        st = os.stat(p)
        if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022 and not (p != path and st.st_mode & 0o1000):
            raise BuildError("%s is owned by another user or writable by others: not loaded (build it into a "
                             "directory of your own: FLASHC_CACHE_DIR)" % p)


def _load(path):
    _trusted(path)
    try:
        loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
        spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        lib = _lib.lib
        mod.init({name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _FUNCTIONS})
    except Exception as e:  # a module that does not load (an ABI or symbol mismatch)
        raise BuildError("the module does not load (%s): %s" % (path, e)) from e
    return mod


def _reason(e):
    return str(e).split("\n", 1)[0]


def enable(verbose=False):
    """Builds (first time) and loads the C++ autograd function, and routes planned calls through it."""
    global _module, _choice, _state
    from . import ops

    with _lock:
        _choice = True
        if _module is None:
            try:
                _module = _load(build(verbose))
            except BuildError as e:
                _state = "failed: " + _reason(e)
                raise BuildError("flashc.cpp_autograd: %s" % e) from e
            except OSError as e:
                _state = "failed: " + str(e)
                raise BuildError("flashc.cpp_autograd: %s" % e) from e
        ops._cpp = _module
        _state = "enabled"


def disable():
    """Planned calls go back to the Python autograd function (the module stays loaded; a background build that ends
    later is not used)."""
    global _choice, _state
    from . import ops

    with _lock:
        _choice = False
        ops._cpp = None
        _state = "off"


def enabled():
    """Whether planned calls go through the C++ autograd function."""
    from . import ops

    return ops._cpp is not None


def status():
    """Where the C++ autograd function stands: "enabled"; "building" (in the background, or waiting for another
    process's build); "failed: <reason>" (the "flashc" logger has the details); "off" (FLASHC_CPP_AUTOGRAD=0 or
    disable()); "pending" (the environment decides at the first planned call)."""
    return _state


def _wait_for_build(timeout=None):
    """Waits for a background build to end (tests); returns status()."""
    t = _thread
    if t is not None:
        t.join(timeout)
    return _state


def _mode():
    v = os.environ.get("FLASHC_CPP_AUTOGRAD", "").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    if v in ("1", "on", "true", "yes"):
        return "on"
    if v not in ("", "auto"):  # logged, not warned: under -W error a warning would raise in the user's call
        _log.warning("flashc.cpp_autograd: FLASHC_CPP_AUTOGRAD=%r is none of auto, 0/off, 1/on; taken as auto", v)
    return "auto"


def _finish(mod, err):
    """The end of the background build: the module routes later calls, unless enable() or disable() came first."""
    global _module, _state
    from . import ops

    with _lock:
        if err is not None:
            if _choice is None:
                _state = "failed: " + _reason(err)
            _log.info("flashc.cpp_autograd: the C++ autograd function is not used: %s", _reason(err))
            _log.debug("flashc.cpp_autograd: %s", err)
            return
        if _module is None:
            _module = mod
        if _choice is None:
            ops._cpp = _module
            _state = "enabled"
            _log.info("flashc.cpp_autograd: planned calls go through the C++ autograd function (%s)",
                      getattr(_module, "__file__", ""))


def _background(target):
    try:
        path = _build(target, False, background=True)
        mod = _module if _module is not None else _load(path)
    except Exception as e:
        _finish(None, e)
    else:
        _finish(mod, None)


def _from_environment():
    """FLASHC_CPP_AUTOGRAD at the first planned call (unless enable() or disable() was called): see the docstring."""
    global _state, _thread
    if _choice is not None:
        return
    mode = _mode()
    if mode == "off":
        _state = "off"
        return
    if mode == "on":
        try:
            enable()
        except Exception as e:
            warnings.warn("FLASHC_CPP_AUTOGRAD=1, but %s; flashc keeps its Python autograd function" % e,
                          RuntimeWarning, stacklevel=3)
        return
    try:  # auto: never fails or holds up the call
        _, target = _paths()
        if os.path.exists(target):
            _finish(_module if _module is not None else _load(target), None)
            return
        if os.path.exists(_side(target, ".log")):
            raise _failed(_side(target, ".log"))
        _state = "building"
        _log.info("flashc.cpp_autograd: building %s in the background", target)
        _thread = threading.Thread(target=_background, args=(target,), name="flashc-cpp-autograd-build", daemon=True)
        _thread.start()
    except Exception as e:
        _finish(None, e)


def _after_fork_in_child():
    global _lock, _state, _thread
    _lock = threading.Lock()
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    if _state == "building":  # by a thread this child does not have: its next first-time shape looks again
        _state = "pending"
        _thread = None
        ops = sys.modules.get(__package__ + ".ops")
        if ops is not None:
            ops._cpp_env = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flashc.cpp_autograd",
                                 description="Builds flashc's C++ autograd module into the cache directory now "
                                             "(%s), for images and clusters that prebuild it." % _cache_dir())
    ap.add_argument("-v", "--verbose", action="store_true", help="print the compiler's command")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        _, target = _paths()
        cached = os.path.exists(target)
        path = build(args.verbose)
        _load(path)
    except (BuildError, OSError) as e:
        print("flashc.cpp_autograd: %s" % e, file=sys.stderr)
        return 1
    print("%s (%s)" % (path, "already built" if cached else "built in %.1f s" % (time.perf_counter() - t0)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
