"""flashc's autograd function in C++ (opt-in): ``flashc.cpp_autograd.enable()``.

flash_attn_func, flashc.attention and flashc.scaled_dot_product_attention run a plain eager call (torch tensors,
scalar options only, no dropout or mask; see flashc.ops' per-shape plans) through a Python torch.autograd.Function. On CUDA, autograd runs every
backward on its own device thread, and a Python backward there must take the GIL from the thread that called
``backward()``: on small problems that hand-over is a visible share of a training step's host time. After
``enable()`` those calls go through csrc/torch_autograd.cpp instead, an autograd function written in C++ that makes
the same library calls (out, lse and the gradients bit for bit the Python path's), with no Python in the forward or
the backward. Other calls are unchanged.

``enable()`` compiles that one file against the running torch the first time (a C++20 compiler: $CXX, else c++;
about half a minute) into a cache directory ($FLASHC_CACHE_DIR, else $XDG_CACHE_HOME/flashc or ~/.cache/flashc),
keyed by the source, the torch and Python versions and the compiler, and loads it; later processes load the cached
module. It raises flashc.cpp_autograd.BuildError when the module cannot be built or loaded (the message has the
compiler's output).
Setting FLASHC_CPP_AUTOGRAD=1 in the environment enables it at the first planned call (a failure then warns once
and leaves the Python path on). Off by default: its CUDA path has not yet run on a GPU (python/README.md).
"""
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings

import torch

from . import _lib

__all__ = ["enable", "disable", "enabled", "build", "BuildError"]

_NAME = "flashc_cpp_autograd"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_autograd.cpp")
_FUNCTIONS = ("flashc_context_create", "flashc_context_set_stream", "flashc_context_set_threads",
              "flashc_context_last_error", "flashc_status_string", "flashc_forward", "flashc_backward")
_lock = threading.Lock()
_module = None


class BuildError(RuntimeError):
    """The C++ autograd module could not be built or loaded."""


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
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    if shutil.which(cxx[0]) is None:
        raise BuildError("flashc.cpp_autograd: no C++ compiler (%s; set CXX)" % cxx[0])
    cmd = cxx + ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DTORCH_EXTENSION_NAME=" + _NAME,
                 "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch.compiled_with_cxx11_abi())]
    cmd += ["-I" + p for p in include_paths] + ["-I" + sysconfig.get_paths()["include"]]
    cmd += [source, "-o", target]
    for p in library_paths:
        cmd += ["-L" + p, "-Wl,-rpath," + p]
    return cmd + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build(verbose=False):
    """The path of the compiled module for this torch and Python, compiling it first when the cache has none."""
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cmd = _command(_SOURCE, "OUT")
    key = hashlib.sha256(b"\0".join([src, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(cmd).encode()])).hexdigest()[:16]
    d = _cache_dir()
    target = os.path.join(d, "%s_%s%s" % (_NAME, key, sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if os.path.exists(target):
        return target
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_NAME + "_", suffix=".so", dir=d)
    os.close(fd)
    try:
        cmd = _command(_SOURCE, tmp)
        if verbose:
            print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise BuildError("flashc.cpp_autograd: compiling %s failed (%s):\n%s"
                                   % (_SOURCE, " ".join(shlex.quote(c) for c in cmd), r.stdout[-4000:]))
        os.replace(tmp, target)  # whole, at once: another process building the same key loads one or the other
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path):
    loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    lib = _lib.lib
    mod.init({name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _FUNCTIONS})
    return mod


def enable(verbose=False):
    """Builds (first time) and loads the C++ autograd function, and routes planned calls through it."""
    global _module
    from . import ops

    with _lock:
        if _module is None:
            try:
                _module = _load(build(verbose))
            except BuildError:
                raise
            except Exception as e:  # a module that does not load (an ABI or symbol mismatch)
                raise BuildError("flashc.cpp_autograd: the module does not load: %s" % e) from e
        ops._cpp = _module


def disable():
    """Planned calls go back to the Python autograd function (the module stays loaded)."""
    from . import ops

    ops._cpp = None


def enabled():
    """Whether planned calls go through the C++ autograd function."""
    from . import ops

    return ops._cpp is not None


def _from_environment():
    """FLASHC_CPP_AUTOGRAD=1: enable at the first planned call; a failure warns once and keeps the Python path."""
    if os.environ.get("FLASHC_CPP_AUTOGRAD", "") not in ("1", "true", "yes", "on"):
        return
    try:
        enable()
    except BuildError as e:
        warnings.warn("FLASHC_CPP_AUTOGRAD=1, but %s; flashc keeps its Python autograd function" % e, RuntimeWarning,
                      stacklevel=3)
