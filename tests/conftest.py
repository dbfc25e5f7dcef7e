import os

# Several test processes (pytest -n 4) and torch/CuPy share one GPU: JAX must not preallocate
# 75% of it. Set before anything imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from xferlib.testing import GPU_SKIP_REASON, backend_params, get_backend


@pytest.fixture(params=backend_params())
def backend(request):
    """Run the test once per backend; GPU backends skip (with the reason) without a GPU.
    ``xferlib.testing.for_each_backend`` picks some of the backends for one test."""
    return get_backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def pytest_collection_modifyitems(config, items):
    # A test marked gpu that has no backend parameter still needs the GPU.
    from xferlib.backend import cupy_available

    if cupy_available():
        return
    for item in items:
        if "gpu" in item.keywords and "backend" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))
