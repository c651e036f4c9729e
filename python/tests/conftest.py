"""Fresh random inputs each run (STYLE.md); the seed is printed so a failure can be replayed with
FLASHC_TEST_SEED=<seed>.

FLASHC_CPP_AUTOGRAD defaults to 0 here: the tests choose their autograd function themselves (test_cpp_autograd.py
with enable() / disable(), test_cpp_autograd_policy.py in child processes with the variable set), and the default
(auto) would start a compiler in the background at the first planned call of the suite. Set it to 1 to run the whole
suite through the C++ autograd function."""

import os

import numpy as np
import pytest

os.environ.setdefault("FLASHC_CPP_AUTOGRAD", "0")


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("FLASHC_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print("FLASHC_TEST_SEED=%d (%s)" % (seed, request.node.name))
    return np.random.default_rng(seed)


def pytest_configure(config):
    # `-m gpu` selects the tests that need a GPU (they skip themselves without one)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and a libflashc with the CUDA backend")
