import pytest


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Run the test on the CPU and, where torch sees a GPU and CuPy is installed, on CUDA
    (a test module with other needs defines its own ``device``)."""
    torch = pytest.importorskip("torch")
    import xferlib
    from xferlib.testing import GPU_SKIP_REASON

    if request.param == "cuda" and not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)
    return torch.device(request.param)
