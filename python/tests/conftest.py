"""Fresh random inputs each run (STYLE.md); the seed is printed so a failure can be replayed with
FLASHC_TEST_SEED=<seed>."""

import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("FLASHC_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print("FLASHC_TEST_SEED=%d (%s)" % (seed, request.node.name))
    return np.random.default_rng(seed)


def pytest_configure(config):
    # `-m gpu` selects the tests that need a GPU (they skip themselves without one)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and a libflashc with the CUDA backend")
