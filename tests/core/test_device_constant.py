"""Device constants (xferlib._backend.device_constant): tables uploaded once and read by
kernels on other streams must have landed when the call returns."""

from __future__ import annotations

import numpy as np
import pytest

from xferlib._backend import device_constant
from xferlib.testing import get_backend


@pytest.mark.gpu
def test_gpu_device_constant_has_landed_when_it_returns():
    get_backend("cupy")
    import cupy

    busy = cupy.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(4):  # queue work ahead of the upload on the same stream
            busy = busy @ busy
            busy /= cupy.linalg.norm(busy)
        table = device_constant(np.arange(100_000), np.int64)
        assert stream.done  # the upload, and the work queued before it, finished
    assert table.dtype == np.int64 and table.shape == (100_000,)
    other = cupy.cuda.Stream(non_blocking=True)
    with other:  # a kernel on another non-blocking stream reads the uploaded values
        assert int((table == cupy.arange(100_000)).sum()) == 100_000
    np.testing.assert_array_equal(device_constant([[1.5, 2.0]], np.float64).get(),
                                  [[1.5, 2.0]])


@pytest.mark.gpu
def test_gpu_upload_takes_no_pinned_memory_and_keeps_the_values_it_was_given():
    """``upload`` (the hyperparameter arrays' copy, run inside JAX's step callbacks) copies
    straight from pageable memory: no pinned staging block (a pinned allocation can wait on
    another device's collective), and the host values may change as soon as it returns."""
    get_backend("cupy")
    import cupy

    from xferlib._backend import upload

    def refuse(size):
        raise AssertionError(f"upload asked for {size} bytes of pinned memory")

    host = np.arange(40, dtype=np.float64).reshape(8, 5)[:, ::2]  # not contiguous
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.set_pinned_memory_allocator(refuse)
    try:
        with stream:
            array = upload(host, np.float32)
            doubled = array * 2  # queued after the copy on the same stream
            empty = upload(np.zeros((0, 3)))
            host[...] = -1  # the caller's array is free once upload returns
    finally:
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    stream.synchronize()
    want = np.arange(40, dtype=np.float32).reshape(8, 5)[:, ::2]
    assert array.dtype == np.float32 and array.shape == (8, 3)
    np.testing.assert_array_equal(array.get(), want)
    np.testing.assert_array_equal(doubled.get(), 2 * want)
    assert empty.shape == (0, 3)
