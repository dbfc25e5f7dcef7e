"""Managed host memory (xferlib.managed): what the GPU maps in host RAM for host tables."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from xferlib import managed
from xferlib.collection import EmbeddingCollection, TableConfig
from xferlib.testing import get_backend


def test_without_a_gpu_or_when_asked_for_pinned_memory_none_is_offered(monkeypatch):
    monkeypatch.setenv("XFERLIB_HOST_MEMORY", "pinned")
    assert not managed.managed_available()
    assert not managed.is_managed(np.zeros(4))
    assert not managed.is_managed("not an array")
    with pytest.raises(ValueError, match="managed memory"):
        managed.gpu_view(np.zeros(4))


def test_host_buffer_falls_back_to_pinned_memory_with_a_warning(monkeypatch):
    def refuse(shape, dtype):
        raise RuntimeError("cuMemAdvise(3) on 64 bytes of managed memory failed")

    from xferlib.collection.storage import host_buffer_empty

    monkeypatch.setattr(managed, "managed_available", lambda: True)
    monkeypatch.setattr(managed, "managed_empty", refuse)
    with pytest.warns(RuntimeWarning, match="pinning the host tables instead"):
        buffer = host_buffer_empty(16, np.float32)
    assert buffer.shape == (16,) and buffer.dtype == np.float32
    assert not managed.is_managed(buffer)


@pytest.mark.gpu
def test_gpu_managed_array_is_zeroed_shared_with_the_gpu_and_freed_with_its_last_view():
    get_backend("cupy")
    import cupy

    if not managed.managed_available():
        pytest.skip("this GPU cannot keep managed memory in host RAM")
    a = managed.managed_empty((5000, 3), np.float32)  # not a whole number of 2 MB blocks
    assert a.shape == (5000, 3) and not a.any()
    assert managed.is_managed(a) and managed.is_managed(a[10:20])
    ptr = a.ctypes.data
    from xferlib.memory import device_pointer

    assert device_pointer(a[7:], "a") == a[7:].ctypes.data
    view = managed.gpu_view(a)
    view[:] = cupy.arange(15000, dtype=cupy.float32).reshape(5000, 3)  # a kernel writes
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(a, np.arange(15000, dtype=np.float32).reshape(5000, 3))
    a[2, 1] = -1.0  # the host writes, a kernel reads
    assert float(view[2, 1].get()) == -1.0
    tail = a[4000:]
    del a, view
    gc.collect()
    assert managed.is_managed(tail)  # a view keeps the memory
    del tail
    gc.collect()
    assert ptr not in managed._BLOCKS
    assert managed.managed_empty((0, 4)).shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_host_tables_in_managed_and_pinned_memory_train_to_the_same_bits(
        optimizer, monkeypatch):
    """Host tables (one cached) built in managed memory and in pinned memory hold the same
    initial values and train to the same bits; the managed buffer is what the collection
    uses where the GPU offers it."""
    get_backend("cupy")
    import cupy

    if not managed.managed_available():
        pytest.skip("this GPU cannot keep managed memory in host RAM")
    hyper = {"lr": 0.05}
    rows = [5000, 300, 40]

    def build():
        return EmbeddingCollection(
            [TableConfig(rows[0], 16, placement="host"),
             TableConfig(rows[1], 16, placement="host", cache_rows=64),
             TableConfig(rows[2], 8, init=("normal", 0.0, 0.1))],
            optimizer, hyper, device="cuda", seed=4)

    in_managed = build()
    monkeypatch.setenv("XFERLIB_HOST_MEMORY", "pinned")
    in_pinned = build()
    assert managed.is_managed(in_managed.buffers["host"])
    assert not managed.is_managed(in_pinned.buffers["host"])
    rng = np.random.default_rng(2)
    for _ in range(6):
        n = 2000
        idx = np.concatenate([rng.zipf(1.2, n) % r for r in rows]).astype(np.int64)
        offsets = np.arange(0, 3 * n + 1, 20, dtype=np.int64)
        grad = rng.standard_normal((n // 20, 40)).astype(np.float32)
        outs = []
        for coll in (in_managed, in_pinned):
            out, ctx = coll.forward(cupy.asarray(idx), cupy.asarray(offsets))
            coll.backward(ctx, cupy.asarray(grad))
            outs.append(out.get())
        assert outs[0].tobytes() == outs[1].tobytes()
    a, b = in_managed.state_dict(), in_pinned.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.gpu
def test_gpu_managed_arrays_reach_the_row_kernels_and_the_handoff_without_a_copy():
    """A collection's host table views (managed memory) work where pinned arrays do: the
    row kernels read them in place, with no "pin it" warning, and to_cupy(copy=False)
    shares their memory."""
    get_backend("cupy")
    import warnings

    import cupy

    import xferlib
    from xferlib.handoff import to_cupy
    from xferlib.rows_fused import is_gpu_reachable

    if not managed.managed_available():
        pytest.skip("this GPU cannot keep managed memory in host RAM")
    table = managed.managed_empty((1000, 16), np.float32)
    table[:] = np.arange(16000, dtype=np.float32).reshape(1000, 16)
    assert is_gpu_reachable(table) and is_gpu_reachable(table[10:20])
    shared = to_cupy(table, copy=False)
    assert shared.data.ptr == table.ctypes.data
    idx = cupy.asarray([3, 999, 3, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow-path warning for managed memory
        rows = xferlib.gather_rows(table, idx)
    np.testing.assert_array_equal(cupy.asnumpy(rows), table[[3, 999, 3, 0]])


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["managed", "pinned"])
def test_gpu_host_memory_dropped_inside_a_cuda_graph_capture_leaves_the_capture_intact(memory):
    """A finalizer runs wherever garbage collection happens, a user's capture included: the
    release must not invalidate it (a host sync or a free there did, intermittently, in
    capture tests that followed tests leaving host tables behind). A managed block is freed
    after the capture; a pinned range is unregistered at once."""
    get_backend("cupy")
    torch = pytest.importorskip("torch")
    import xferlib

    if memory == "managed" and not managed.managed_available():
        pytest.skip("this GPU cannot keep managed memory in host RAM")
    host = (managed.managed_empty((4096, 8), np.float32) if memory == "managed"
            else xferlib.pinned_zeros((4096, 8), np.float32))
    ptr = host.ctypes.data
    x = torch.arange(4.0, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        del host  # the last reference: its finalizer runs here, inside the capture
        y = x * 2 + 1
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]
    if memory == "managed":
        assert any(p == ptr for p, _ in managed._UNFREED)  # kept until after the capture
        assert managed.free_unused() >= 1
        assert not any(p == ptr for p, _ in managed._UNFREED)
    else:
        from xferlib.memory import registration_of

        assert registration_of(ptr, 4) is None  # unregistered inside the capture
