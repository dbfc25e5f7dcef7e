import gc

import numpy as np
import pytest

import xferlib
from xferlib._backend import cupy_available


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_pinned_empty_is_a_numpy_array():
    with xferlib.pinned_empty((64, 8), "float32") as a:
        assert isinstance(a, np.ndarray) and a.shape == (64, 8) and a.dtype == np.float32
        a[:] = 3.0
        assert xferlib.is_pinned(a) == cupy_available()
        assert a.pinned == cupy_available()
    assert not xferlib.is_pinned(a)
    assert np.all(a == 3.0)  # closing unpins; the data stay valid
    a.close()  # idempotent


def test_pinned_zeros_and_bfloat16():
    a = xferlib.pinned_zeros((3, 5), "bfloat16")
    assert a.dtype.name == "bfloat16" and not np.any(a.astype(np.float32))


def test_pin_in_place_shares_memory():
    base = np.arange(1000, dtype=np.float32).reshape(100, 10)
    pinned = xferlib.pin(base)
    assert pinned.ctypes.data == base.ctypes.data and np.shares_memory(pinned, base)
    assert xferlib.is_pinned(base) == cupy_available()
    view = pinned[10:20]
    del pinned
    gc.collect()
    assert xferlib.is_pinned(view) == cupy_available()  # views keep the pages pinned
    view.close()
    assert not xferlib.is_pinned(base)


def test_pin_rejects_bad_input():
    with pytest.raises(ValueError, match="C-contiguous"):
        xferlib.pin(np.zeros((10, 10))[:, ::2])
    with pytest.raises(TypeError, match="numpy.ndarray"):
        xferlib.pin([1, 2, 3])


def test_is_pinned_on_ordinary_memory():
    assert not xferlib.is_pinned(np.zeros(10))
    assert not xferlib.is_pinned("not an array")


@pytest.mark.slow
def test_no_leak_over_200_cycles_of_64mb():
    nbytes = 64 << 20
    for _ in range(5):  # warm up allocator caches
        with xferlib.pinned_empty(nbytes // 4, np.float32) as a:
            a.fill(1.0)
    gc.collect()
    before = _rss_bytes()
    for i in range(200):
        a = xferlib.pinned_empty(nbytes // 4, np.float32)
        a.fill(float(i))  # touch every page
        if i % 2:
            a.close()
        del a  # the other half is freed by the finalizer
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 2 * nbytes, f"RSS grew by {grown / 2**20:.0f} MiB over 200 cycles"
