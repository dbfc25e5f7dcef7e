import pytest


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    """Run the test on JAX's CPU backend and, where there is one, its GPU backend."""
    jax = pytest.importorskip("jax")
    try:
        return jax.devices(request.param)[0]
    except RuntimeError:
        pytest.skip(f"needs a JAX {request.param} backend; none here")
