"""ctypes view of include/flashc.h: the library handle, the two structs, every function's signature, errors,
and per-thread contexts.

Everything else in the package goes through this module; it imports neither numpy nor torch.
"""

import ctypes
import glob
import os
import struct
import sys
import threading

__all__ = [
    "FlashcError", "lib", "library_path", "Tensor", "Params", "DTYPE_F32", "DTYPE_F16", "DTYPE_BF16",
    "BACKEND_AUTO", "BACKEND_CPU", "BACKEND_CUDA", "OP_FORWARD", "OP_BACKWARD", "context", "check",
    "STATUS_NAMES", "set_num_threads",
]

# ---- enums (values from flashc.h; they are only ever appended) -----------------------------------------------
STATUS_OK = 0
STATUS_NAMES = {
    0: "FLASHC_STATUS_OK",
    1: "FLASHC_STATUS_INVALID_ARGUMENT",
    2: "FLASHC_STATUS_NOT_SUPPORTED",
    3: "FLASHC_STATUS_OUT_OF_MEMORY",
    4: "FLASHC_STATUS_DEVICE_ERROR",
    5: "FLASHC_STATUS_INTERNAL",
}
STATUS_NOT_SUPPORTED = 2

BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA = 0, 1, 2
DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2
OP_FORWARD, OP_BACKWARD = 0, 1


# ---- structs ----------------------------------------------------------------------------------------------------
# flashc_tensor is fixed; flashc_params grows by appended fields, so Params is built from the library's own
# description of it once the library is loaded (below).
class Tensor(ctypes.Structure):
    """flashc_tensor: a strided 4-d view, shape and strides in elements."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),  # flashc_dtype
        ("shape", ctypes.c_int64 * 4),
        ("stride", ctypes.c_int64 * 4),
    ]


# ---- locating and loading the library ------------------------------------------------------------------------
_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    """Where libflashc may be, in order: $FLASHC_LIBRARY, the installed package, a build tree of the repo."""
    env = os.environ.get("FLASHC_LIBRARY")
    if env:
        # An explicit choice must not silently fall back to another copy of the library.
        return [env]
    if sys.platform == "darwin":
        names = ["libflashc.dylib"]
    elif sys.platform == "win32":
        names = ["flashc.dll", "libflashc.dll"]
    else:
        names = ["libflashc.so", "libflashc.so.0.6"]
    out = [os.path.join(_HERE, n) for n in names]
    repo = os.path.dirname(os.path.dirname(_HERE))  # python/flashc -> repo root
    for build in ["build"] + sorted(os.path.basename(p) for p in glob.glob(os.path.join(repo, "build-*"))):
        out += [os.path.join(repo, build, n) for n in names]
    return out


def _load():
    tried = []
    for path in _candidates():
        if not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError(
        "flashc: cannot load libflashc. Set FLASHC_LIBRARY to the library's path, install the package with "
        "`pip install ./python`, or build the repository into ./build (`make build`). Tried:\n  "
        + "\n  ".join(tried)
    )


lib, library_path = _load()


def _s(b):
    return b.decode("utf-8", "replace") if b is not None else ""


# flashc_params_field type codes.
_PARAM_TYPES = {"I": ctypes.c_uint32, "i": ctypes.c_int, "f": ctypes.c_float, "q": ctypes.c_int64,
                "Q": ctypes.c_uint64, "p": ctypes.c_void_p}


def _params_struct():
    """flashc_params as this library lays it out, from flashc_params_field / flashc_params_size. ctypes places
    the fields by the C rules, so a disagreement with the library's offsets means a library this module cannot
    describe (refused here rather than passing misplaced values)."""
    if not hasattr(lib, "flashc_params_field"):
        raise ImportError("flashc: %s is older than flashc 0.2 (it cannot describe flashc_params); rebuild it"
                          % library_path)
    field = lib.flashc_params_field
    field.restype = ctypes.c_int
    field.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t),
                      ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_char)]
    lib.flashc_params_size.restype = ctypes.c_size_t
    lib.flashc_params_size.argtypes = []
    name, offset, size, code = ctypes.c_char_p(), ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_char()
    fields, where = [], {}
    while field(len(fields), ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size), ctypes.byref(code)):
        ctype = _PARAM_TYPES.get(code.value.decode("ascii", "replace"))
        if ctype is None or ctypes.sizeof(ctype) != size.value:
            raise ImportError("flashc: flashc_params.%s has type code %r, %d bytes, which this module does not know"
                              % (_s(name.value), code.value, size.value))
        fields.append((_s(name.value), ctype))
        where[_s(name.value)] = offset.value
    cls = type("Params", (ctypes.Structure,), {
        "__doc__": "flashc_params, laid out as the loaded library reports it. Always start from "
                   "lib.flashc_params_default().",
        "_fields_": fields,
    })
    wrong = [n for n, _ in fields if getattr(cls, n).offset != where[n]]
    if wrong or ctypes.sizeof(cls) != lib.flashc_params_size():
        raise ImportError("flashc: %s lays out flashc_params differently from this platform's C rules (fields %s, "
                          "size %d vs %d)" % (library_path, wrong, lib.flashc_params_size(), ctypes.sizeof(cls)))
    return cls


Params = _params_struct()

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_TP = ctypes.POINTER(Tensor)
_PP = ctypes.POINTER(Params)
_SIGNATURES = {
    # name: (restype, argtypes)
    "flashc_version": (ctypes.c_char_p, []),
    "flashc_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "flashc_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "flashc_backend_name": (ctypes.c_char_p, [ctypes.c_int]),
    "flashc_backend_compiled": (ctypes.c_int, [ctypes.c_int]),
    "flashc_device_count": (ctypes.c_int, [ctypes.c_int]),
    "flashc_device_name": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "flashc_cpu_features": (ctypes.c_char_p, []),
    "flashc_params_default": (Params, []),
    "flashc_context_create": (ctypes.c_int, [ctypes.POINTER(_p), ctypes.c_int, ctypes.c_int]),
    "flashc_context_destroy": (None, [_p]),
    "flashc_context_backend": (ctypes.c_int, [_p]),
    "flashc_context_set_stream": (ctypes.c_int, [_p, _p]),
    "flashc_context_set_threads": (ctypes.c_int, [_p, ctypes.c_int]),
    "flashc_context_last_error": (ctypes.c_char_p, [_p]),
    "flashc_supported": (ctypes.c_int, [_p, ctypes.c_int, _TP, _TP, _TP, _PP]),
    "flashc_forward_workspace_size": (ctypes.c_int, [_p, _TP, _TP, _TP, _PP, ctypes.POINTER(ctypes.c_size_t)]),
    "flashc_backward_workspace_size": (ctypes.c_int, [_p, _TP, _TP, _TP, _PP, ctypes.POINTER(ctypes.c_size_t)]),
    "flashc_forward": (ctypes.c_int, [_p, _TP, _TP, _TP, _PP, _TP, _p, _p, ctypes.c_size_t]),
    "flashc_backward": (ctypes.c_int, [_p, _TP, _TP, _TP, _TP, _TP, _p, _PP, _TP, _TP, _TP, _p, ctypes.c_size_t]),
    "flashc_tensor_contiguous": (Tensor, [_p, ctypes.c_int, _i64, _i64, _i64, _i64]),
}
for _name, (_res, _args) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args

# Functions added after the first 0.3 builds: bound when the loaded library has them, so that an older library still
# loads; their callers raise NotImplementedError naming the function otherwise (see bound()).
_OPTIONAL_SIGNATURES = {
    "flashc_kvcache_append": (ctypes.c_int, [_p, _TP, _TP, _TP, _TP, _p]),
    "flashc_merge": (ctypes.c_int, [_p, _TP, _p, _TP, _p, _TP, _p]),
    "flashc_kvcache_append_paged": (ctypes.c_int, [_p, _TP, _TP, _TP, _TP, _p, _p, _i64, _i64]),
    "flashc_dropout_mask": (ctypes.c_int, [_PP, _i64, _i64, _i64, _i64, _p]),
    "flashc_rotary": (ctypes.c_int, [_p, _TP, _TP, _TP, _p, ctypes.c_int, _TP]),
}
_BOUND = set()
for _name, (_res, _args) in _OPTIONAL_SIGNATURES.items():
    _fn = getattr(lib, _name, None)
    if _fn is not None:
        _fn.restype = _res
        _fn.argtypes = _args
        _BOUND.add(_name)


def bound(name):
    """Whether the loaded library has the optional function `name` (bound with its signature)."""
    return name in _BOUND


# ---- errors ----------------------------------------------------------------------------------------------------
class FlashcError(RuntimeError):
    """A flashc call returned a status other than FLASHC_STATUS_OK.

    Attributes: status (int), status_name (e.g. "FLASHC_STATUS_INVALID_ARGUMENT"), message (the library's
    "file:line: what" text), function (the C function that failed).
    """

    def __init__(self, function, status, message):
        self.function = function
        self.status = status
        self.status_name = STATUS_NAMES.get(status, "FLASHC_STATUS_%d" % status)
        self.message = message
        super().__init__("%s failed with %s: %s" % (function, self.status_name, message or "(no message)"))


def check(status, function, ctx=None):
    """Raises FlashcError for a non-OK status, with the context's (or this thread's) last error."""
    if status != STATUS_OK:
        raise FlashcError(function, status, _s(lib.flashc_context_last_error(ctx)))


# ---- contexts --------------------------------------------------------------------------------------------------
class Context:
    """Owns one flashc_context_t (backend, device)."""

    def __init__(self, backend, device):
        handle = _p()
        check(lib.flashc_context_create(ctypes.byref(handle), backend, device), "flashc_context_create")
        self.handle = handle
        self.backend = backend
        self.device = device
        self._stream = None
        self._threads = None
        # Bound now: at interpreter exit the module globals may be gone when __del__ runs.
        self._destroy = lib.flashc_context_destroy

    def set_stream(self, stream):
        if stream != self._stream:
            check(lib.flashc_context_set_stream(self.handle, stream), "flashc_context_set_stream", self.handle)
            self._stream = stream

    def set_threads(self, threads):
        if threads != self._threads:
            check(lib.flashc_context_set_threads(self.handle, threads), "flashc_context_set_threads", self.handle)
            self._threads = threads

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle:
            self._destroy(handle)
            self.handle = None


# A context holds its last error and (on CUDA) a stream, and ctypes releases the GIL during calls: two Python
# threads sharing one context could read each other's error text or race on set_stream. One context per
# (thread, backend, device) keeps each call's state its own. torch's autograd runs CUDA backward passes on its own
# device threads, which get their own contexts this way.
_local = threading.local()
_num_threads = 0


def context(backend, device=0, default_threads=0):
    """This thread's context for (backend, device). CPU contexts use set_num_threads()'s count, or
    default_threads when that is 0 (the torch front end passes torch.get_num_threads())."""
    cache = getattr(_local, "contexts", None)
    if cache is None:
        cache = _local.contexts = {}
    ctx = cache.get((backend, device))
    if ctx is None:
        ctx = cache[(backend, device)] = Context(backend, device)
    if backend == BACKEND_CPU:
        ctx.set_threads(_num_threads or default_threads)
    return ctx


def set_num_threads(n):
    """Threads each CPU call uses; 0 (the default) leaves it to OpenMP (OMP_NUM_THREADS or all cores)."""
    global _num_threads
    n = int(n)
    if n < 0:
        raise ValueError("set_num_threads: n must be >= 0, got %d" % n)
    # The C call takes an int: larger counts would wrap (2**32 + 3 became 3); the library caps any count at what the
    # machine can run anyway.
    _num_threads = min(n, 2**31 - 1)


def get_num_threads():
    return _num_threads


_I64x4 = ctypes.c_int64 * 4
# flashc_tensor's bytes as the struct module packs them with the platform's alignment (the same rules ctypes
# follows); used only where it matches Tensor exactly.
_TENSOR_BYTES = struct.Struct("@Pi4q4q")
_PACKED = (_TENSOR_BYTES.size == ctypes.sizeof(Tensor) and
           struct.calcsize("@Pi0q") == Tensor.shape.offset and Tensor.stride.offset == Tensor.shape.offset + 32)


def make_tensor(ptr, dtype, shape, stride):
    # A CUDA call builds up to eight of these before its first kernel: packing the fields into a blank struct in one
    # step takes about a third of the time of the keyword constructor with its two arrays.
    if _PACKED and len(shape) == 4 and len(stride) == 4:
        t = Tensor()
        _TENSOR_BYTES.pack_into(t, 0, ptr or 0, dtype, *shape, *stride)
        return t
    return Tensor(ptr, dtype, _I64x4(*shape), _I64x4(*stride))


# ---- library information ---------------------------------------------------------------------------------------
def version():
    return _s(lib.flashc_version())


def status_string(status):
    return _s(lib.flashc_status_string(status))


def backend_compiled(backend):
    return bool(lib.flashc_backend_compiled(backend))


def device_count(backend):
    return int(lib.flashc_device_count(backend))


def device_name(backend, device=0):
    buf = ctypes.create_string_buffer(256)
    check(lib.flashc_device_name(backend, device, buf, len(buf)), "flashc_device_name")
    return _s(buf.value)


def cpu_features():
    return _s(lib.flashc_cpu_features())
