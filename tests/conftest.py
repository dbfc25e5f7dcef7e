import os

# Several test processes (pytest -n 4) and torch/CuPy share one GPU: JAX must not preallocate
# 75% of it. Set before anything imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from xferlib.testing import BACKEND_NAMES, get_backend


@pytest.fixture(
    params=[
        pytest.param(name, marks=() if name == "numpy" else pytest.mark.gpu)
        for name in BACKEND_NAMES
    ]
)
def backend(request):
    """Run the test once per backend; GPU backends skip (with the reason) without a GPU."""
    return get_backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def pytest_collection_modifyitems(config, items):
    # A test marked gpu that has no backend parameter still needs the GPU.
    from xferlib._backend import cupy_available

    if cupy_available():
        return
    for item in items:
        if "gpu" in item.keywords and "backend" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU with CuPy; none here"))
