"""FLASHC_CPP_AUTOGRAD's policy (flashc/cpp_autograd.py): auto (the default) loads a module already in the cache at the
first planned call, or builds it in the background while the calls keep the Python autograd function and switches to
it when it is loaded; a build that fails leaves the calls on the Python path, silently apart from the "flashc" logger
and status(); 0 never builds; python -m flashc.cpp_autograd builds in the foreground.

Each case runs in a child process (the variable is read once per process, at the first planned call) with a cache
directory of its own. The one real compile (about half a minute) is shared: the background build fills the module's
cache, which the prebuilt case and the command then find (either builds it when run alone)."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

torch = pytest.importorskip("torch")

import flashc  # noqa: E402

_PYTHONPATH = os.path.dirname(os.path.dirname(os.path.abspath(flashc.__file__)))

# Calls of one key until one runs planned, and what the child saw; its report is JSON on the last line
_PRELUDE = """
import json, logging, sys, torch, flashc
from flashc import cpp_autograd
records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("flashc").addHandler(_Keep())
logging.getLogger("flashc").setLevel(logging.DEBUG)
gen = torch.Generator().manual_seed(3)
q, k, v, g = (torch.randn(1, 24, 2, 32, generator=gen) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
def step():
    out = flashc.flash_attn_func(q, k, v, causal=True)
    return out, torch.autograd.grad(out, (q, k, v), g), "CppNode" in out.grad_fn.name()
{setup}
seen = {{"before": cpp_autograd.status()}}
for _ in range(2):  # the key is planned by the first or second call (the first imports flashc.ops)
    step()
out0, grads0, cpp0 = step()
seen.update(first=cpp_autograd.status(), cpp0=cpp0, thread=cpp_autograd._thread is not None)
"""
_REPORT = """
seen.update(after=cpp_autograd.status(), cpp1=cpp1, records=records,
            same=bool(torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))))
print(json.dumps(seen))
"""


def _toolchain():
    cxx = (os.environ.get("CXX") or "c++").split()[0]
    return shutil.which(cxx) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


needs_toolchain = pytest.mark.skipif(not _toolchain(), reason="no C++ compiler or no Python headers")


def _env(cache, **extra):
    env = dict(os.environ, FLASHC_CACHE_DIR=str(cache))
    env.pop("FLASHC_CPP_AUTOGRAD", None)  # conftest's 0: these cases set their own
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PYTHONPATH, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _child(cache, code, setup="", **extra):
    """What the child saw (the JSON of its last line); setup runs before the first call."""
    r = subprocess.run([sys.executable, "-c", _PRELUDE.format(setup=setup) + code + _REPORT], env=_env(cache, **extra),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr, r.stderr  # nothing reaches the user
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("flashc_cache")


@pytest.fixture(scope="module")
def prebuilt(cache):
    """The module built into the cache by `python -m flashc.cpp_autograd` (found there after the background case)."""
    r = subprocess.run([sys.executable, "-m", "flashc.cpp_autograd"], env=_env(cache), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    path, how = r.stdout.strip().split(" (", 1)
    assert os.path.exists(path) and os.path.dirname(path) == str(cache) and how.startswith(("built in", "already"))
    return path


@needs_toolchain
def test_auto_builds_in_the_background(cache):
    seen = _child(cache, """
cpp_autograd._wait_for_build(600)
out1, grads1, cpp1 = step()
""")
    # the first planned calls went through Python while the compiler ran; the key planned then switched afterwards
    assert seen["before"] == "pending" and seen["first"] == "building" and seen["thread"] and not seen["cpp0"]
    assert seen["after"] == "enabled" and seen["cpp1"] and seen["same"]
    assert any("in the background" in m for m in seen["records"])
    assert not [f for f in os.listdir(cache) if f.endswith(".log") or f.startswith(".")]  # no log, no temporary


@needs_toolchain
def test_auto_loads_a_prebuilt_module(cache, prebuilt):
    seen = _child(cache, "out1, grads1, cpp1 = step()\n", FLASHC_CPP_AUTOGRAD="auto")
    # loaded at the first planned call: its second call already goes through C++, and nothing was built
    assert seen["first"] == "enabled" and seen["cpp0"] and not seen["thread"]
    assert seen["after"] == "enabled" and seen["cpp1"] and seen["same"]


@needs_toolchain
def test_command_builds_in_the_foreground(prebuilt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashc.cpp_autograd"], env=_env(tmp_path, CXX="/bin/false"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "compiling torch_autograd.cpp failed (exit status 1" in r.stderr
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".so")]


def test_auto_with_a_broken_compiler(tmp_path):
    seen = _child(tmp_path, """
cpp_autograd._wait_for_build(600)
out1, grads1, cpp1 = step()
""", CXX="/bin/false")
    # /bin/false fails at once: the build may be over by the time the first call returns
    assert seen["thread"] and not seen["cpp0"] and not seen["cpp1"] and seen["same"]
    assert seen["after"].startswith("failed: compiling torch_autograd.cpp failed (exit status 1")
    assert any("not used" in m for m in seen["records"])
    # a later process does not compile again in the background, and says why
    seen = _child(tmp_path, "out1, grads1, cpp1 = step()\n", CXX="/bin/false")
    assert not seen["thread"] and not seen["cpp1"] and seen["after"].startswith("failed: an earlier build")


def test_auto_with_a_cache_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    seen = _child(blocker / "cache", """
cpp_autograd._wait_for_build(600)
out1, grads1, cpp1 = step()
""")
    assert not seen["cpp0"] and not seen["cpp1"] and seen["same"]
    assert seen["after"].startswith("failed: the cache directory") and "cannot be written" in seen["after"]


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_off_never_builds(tmp_path, value):
    seen = _child(tmp_path / "cache", "out1, grads1, cpp1 = step()\n", FLASHC_CPP_AUTOGRAD=value)
    assert seen["first"] == seen["after"] == "off" and not seen["thread"] and not seen["cpp0"] and not seen["cpp1"]
    assert not os.path.exists(tmp_path / "cache")


def test_disable_before_the_first_call_overrides_auto(tmp_path):
    seen = _child(tmp_path / "cache", "out1, grads1, cpp1 = step()\n", setup="cpp_autograd.disable()")
    assert seen["after"] == "off" and not seen["thread"] and not seen["cpp1"]
    assert not os.path.exists(tmp_path / "cache")


def test_calls_without_gradients_never_build(tmp_path):
    # inference (no_grad, inference_mode) never starts a build: the variable is read at the first planned call that
    # needs gradients (the grad calls after it fail fast here: CXX=/bin/false)
    seen = _child(tmp_path / "cache", """
seen.update(inference=inference, inference_dir=inference_dir)
out1, grads1, cpp1 = step()
""", setup="""
import os
with torch.inference_mode():
    for _ in range(3):
        flashc.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
with torch.no_grad():
    for _ in range(3):
        flashc.flash_attn_func(q, k, v, causal=True)
inference = cpp_autograd.status()
inference_dir = os.path.exists(os.environ["FLASHC_CACHE_DIR"])
""", CXX="/bin/false")
    assert seen["inference"] == "pending" and not seen["inference_dir"]
    assert seen["thread"] and not seen["cpp1"] and seen["same"]


def test_an_unknown_value_is_logged_not_warned(tmp_path):
    # under -W error a warning would raise in the user's call: the value goes to the "flashc" logger
    seen = _child(tmp_path / "cache", "cpp_autograd._wait_for_build(600)\nout1, grads1, cpp1 = step()\n",
                  FLASHC_CPP_AUTOGRAD="maybe", PYTHONWARNINGS="error", CXX="/bin/false")
    assert any("none of auto" in m for m in seen["records"]) and not seen["cpp1"] and seen["same"]


@needs_toolchain
def test_a_module_others_can_write_is_not_loaded(prebuilt, tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir(mode=0o700)
    planted = cache / os.path.basename(prebuilt)
    shutil.copy(prebuilt, planted)
    os.chmod(planted, 0o664)  # group-writable: anyone in the group could have put code there
    seen = _child(cache, "out1, grads1, cpp1 = step()\n")
    assert not seen["cpp0"] and not seen["cpp1"] and seen["same"] and not seen["thread"]
    assert seen["after"].startswith("failed: ") and "writable by others" in seen["after"]
    os.chmod(planted, 0o644)  # the same file, writable by its owner only, loads
    seen = _child(cache, "out1, grads1, cpp1 = step()\n")
    assert seen["after"] == "enabled" and seen["cpp1"] and seen["same"]
