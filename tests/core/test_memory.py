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


# ----------------------------------------------------------------------------- pinning follows the memory


def test_pin_keeps_the_array_pinned_without_the_view():
    table = np.ones((256, 16), dtype=np.float32)
    xferlib.pin(table)  # the returned view is dropped at once
    gc.collect()
    assert xferlib.is_pinned(table) == cupy_available()
    assert xferlib.is_pinned(table[10:20]) == cupy_available()  # any view of the memory
    xferlib.pin(table)  # pinning again is a no-op
    xferlib.unpin(table)
    assert not xferlib.is_pinned(table)
    xferlib.unpin(table)  # idempotent
    assert np.all(table == 1.0)


def test_view_form_still_works_and_close_unpins_the_owner():
    table = np.zeros((64, 8), dtype=np.float32)
    with xferlib.pin(table) as view:
        assert np.shares_memory(view, table) and view.pinned == cupy_available()
        view[3] = 7.0
    assert not xferlib.is_pinned(table) and np.all(table[3] == 7.0)


@pytest.mark.gpu
def test_registration_released_when_the_owner_is_freed():
    from xferlib import memory

    table = np.ones((1024, 32), dtype=np.float32)
    xferlib.pin(table)
    ptr = table.ctypes.data
    assert ptr in memory._REGISTRY
    del table
    gc.collect()
    assert ptr not in memory._REGISTRY
    # a fresh array at possibly the same address is pageable until pinned
    again = np.ones((1024, 32), dtype=np.float32)
    assert not xferlib.is_pinned(again) or again.ctypes.data != ptr


@pytest.mark.gpu
def test_pin_rejects_a_partial_overlap():
    table = np.ones((100, 16), dtype=np.float32)
    xferlib.pin(table[:50])
    with pytest.raises(ValueError, match="overlaps"):
        xferlib.pin(table[25:75])
    assert xferlib.is_pinned(table[10:20]) and not xferlib.is_pinned(table)
    xferlib.unpin(table[:50])


def test_unpin_rejects_non_arrays():
    with pytest.raises(TypeError, match="numpy.ndarray"):
        xferlib.unpin([1.0])


# ----------------------------------------------------------------------------- host RAM check


def test_pinned_empty_beyond_host_ram_fails_before_allocating():
    from xferlib.memory import available_host_memory

    available = available_host_memory()
    if available is None:
        pytest.skip("this system does not report its available memory")
    rows = available // 512 + 1_000_000  # more than is available, in 512 B rows
    before = _rss_bytes()
    for fn in (xferlib.pinned_empty, xferlib.pinned_zeros):
        with pytest.raises(MemoryError) as info:
            fn((rows, 128), np.float32)
        message = str(info.value)
        assert f"shape=({rows}, 128)" in message and "needs" in message
        assert "available" in message and ("GB" in message or "TB" in message)
    assert _rss_bytes() - before < 64 << 20  # nothing was allocated


def test_host_memory_check_can_be_switched_off(monkeypatch):
    with pytest.raises(MemoryError, match="XFERLIB_HOST_MEMORY_CHECK=0"):
        xferlib.check_host_memory(1 << 62, "a test table")
    monkeypatch.setenv("XFERLIB_HOST_MEMORY_CHECK", "0")
    xferlib.check_host_memory(1 << 62, "a test table")


@pytest.mark.parametrize("shape, exc, match", [
    ((-1, 4), ValueError, "negative size -1"),
    ((4, 2.5), TypeError, "shape must hold ints"),
    ("rows", TypeError, "shape must hold ints|shape must be"),
    (None, TypeError, "shape must be an int"),
])
def test_pinned_empty_bad_shape(shape, exc, match):
    with pytest.raises(exc, match=match):
        xferlib.pinned_empty(shape, np.float32)


def test_pinned_empty_bad_dtype():
    with pytest.raises(TypeError, match="not a NumPy dtype"):
        xferlib.pinned_empty((4, 4), "floaty32")
    with pytest.raises(TypeError, match="Python objects"):
        xferlib.pinned_empty((4, 4), object)


# ----------------------------------------------------------------------------- slow-path warnings


def test_performance_warning_is_a_filterable_user_warning():
    import warnings

    from xferlib.perf import reset_warnings, warn_once

    assert issubclass(xferlib.XferlibPerformanceWarning, UserWarning)
    reset_warnings()
    with pytest.warns(xferlib.XferlibPerformanceWarning, match="slow thing"):
        assert warn_once(("test", 1), "a slow thing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_once(("test", 1), "a slow thing")  # once per key
    with warnings.catch_warnings():
        warnings.simplefilter("error", xferlib.XferlibPerformanceWarning)
        with pytest.raises(xferlib.XferlibPerformanceWarning):
            warn_once(("test", 2), "another")
    reset_warnings()


def test_pageable_warning_names_path_factor_and_fix():
    from xferlib.perf import reset_warnings, warn_pageable_table

    reset_warnings()
    table = np.zeros((1000, 128), dtype=np.float32)
    with pytest.warns(xferlib.XferlibPerformanceWarning) as record:
        warn_pageable_table("gather_rows", table)
    message = str(record[0].message)
    assert "pageable" in message and "22x" in message and "xferlib.pin(table)" in message
    assert record[0].filename == __file__  # points at the caller, not into xferlib
    reset_warnings()


@pytest.mark.gpu
def test_gather_from_pageable_table_warns_once_per_table():
    import warnings

    import cupy

    from xferlib.perf import reset_warnings

    reset_warnings()
    table = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    idx = cupy.asarray(np.array([5, 1, 5, 999]))
    expected = table[[5, 1, 5, 999]]
    with pytest.warns(xferlib.XferlibPerformanceWarning, match="pageable.*xferlib.pin") as rec:
        for _ in range(3):
            rows = xferlib.gather_rows(table, idx)
        xferlib.scatter_add_rows(table[:500], cupy.asarray(np.array([1])),
                                 cupy.ones((1, 4), cupy.float32))
    assert len([r for r in rec if r.category is xferlib.XferlibPerformanceWarning]) == 2
    np.testing.assert_array_equal(rows.get(), expected)
    assert table[1, 0] == expected[1, 0] + 1  # the scatter-add reached the pageable table
    xferlib.pin(table)  # fixed: no more warnings, same answer
    with warnings.catch_warnings():
        warnings.simplefilter("error", xferlib.XferlibPerformanceWarning)
        reset_warnings()
        np.testing.assert_array_equal(xferlib.gather_rows(table, idx).get(),
                                      table[[5, 1, 5, 999]])
    xferlib.unpin(table)


@pytest.mark.gpu
def test_host_indices_for_a_gpu_table_warn():
    import cupy

    from xferlib.perf import reset_warnings

    reset_warnings()
    table = cupy.arange(40, dtype=cupy.float32).reshape(10, 4)
    with pytest.warns(xferlib.XferlibPerformanceWarning, match="NumPy array.*cupy.asarray"):
        rows = xferlib.gather_rows(table, np.array([3, 4]))
    np.testing.assert_array_equal(rows.get(), table.get()[[3, 4]])


def test_cache_thrashing_warning_names_the_numbers_and_the_fix():
    import warnings

    from xferlib.perf import reset_warnings, warn_cache_thrashing

    reset_warnings()
    owner = object()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_cache_thrashing(owner, 0.6, 5000, 10000, 100)  # hits enough
        assert not warn_cache_thrashing(owner, 0.05, 50, 10000, 100)  # evicts little
    with pytest.warns(xferlib.XferlibPerformanceWarning) as record:
        assert warn_cache_thrashing(owner, 0.05, 5000, 10000, 100)
    message = str(record[0].message)
    assert "thrashing" in message and "5%" in message and "cache_rows" in message
    assert not warn_cache_thrashing(owner, 0.05, 5000, 10000, 100)  # once per owner
    reset_warnings()


def test_unpinning_waits_only_for_gpus_this_process_uses(monkeypatch):
    """Releasing pinned pages synchronizes the GPUs on which the process holds a context, as
    the driver reports them, and opens no other (a rank of a multi-GPU job stays on its own
    GPU); every GPU where the driver cannot be asked."""
    from xferlib import memory

    class FakeDriver:  # the two driver calls, on a machine whose process uses GPU 1 of 3
        def cuDeviceGet(self, device, ordinal):
            device._obj.value = ordinal
            return 0

        def cuDevicePrimaryCtxGetState(self, device, flags, active):
            active._obj.value = int(device.value == 1)
            return 0

    monkeypatch.setattr(memory, "libcuda", lambda: FakeDriver())
    assert memory._devices_in_use(3) == [1]
    monkeypatch.setattr(memory, "libcuda", lambda: None)  # no driver library to ask
    assert memory._devices_in_use(3) == [0, 1, 2]
