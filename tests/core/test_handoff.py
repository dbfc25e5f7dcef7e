"""Handoff between NumPy, CuPy, torch and JAX: pointer identity where zero-copy is promised."""

import numpy as np
import pytest

import xferlib
from xferlib import data_pointer

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy


def _aligned(shape, dtype=np.float32):
    # XLA wants 64-byte aligned host buffers for zero-copy import.
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    offset = (-raw.ctypes.data) % 64
    out = raw[offset:offset + nbytes].view(dtype).reshape(shape)
    out[...] = np.random.default_rng(0).standard_normal(shape)
    return out


def test_numpy_torch_roundtrip_shares_memory():
    a = _aligned((8, 4))
    t = xferlib.to_torch(a)
    assert isinstance(t, torch.Tensor) and data_pointer(t) == data_pointer(a)
    back = xferlib.to_numpy(t)
    assert data_pointer(back) == data_pointer(a)
    t[0, 0] = 42.0
    assert a[0, 0] == 42.0


def test_numpy_jax_shares_memory():
    a = _aligned((16, 8))
    j = xferlib.to_jax(a)
    assert isinstance(j, jax.Array) and data_pointer(j) == data_pointer(a)
    back = xferlib.to_numpy(j)
    assert data_pointer(back) == data_pointer(a) and not back.flags.writeable


def test_torch_cpu_jax_share_memory():
    t = torch.from_numpy(_aligned((16, 8)))
    j = xferlib.to_jax(t)
    assert data_pointer(j) == data_pointer(t)


def test_jax_to_torch_copies_by_default():
    j = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    t = xferlib.to_torch(j)
    assert data_pointer(t) != data_pointer(j)
    t[0, 0] = -1.0
    assert float(j[0, 0]) == 0.0  # the JAX array is untouched
    alias = xferlib.to_torch(j, copy=False)
    assert data_pointer(alias) == data_pointer(j)


def test_copy_true_always_copies():
    a = _aligned((4, 4))
    assert data_pointer(xferlib.to_torch(a, copy=True)) != data_pointer(a)
    assert data_pointer(xferlib.to_numpy(a, copy=True)) != data_pointer(a)
    assert data_pointer(xferlib.to_jax(a, copy=True)) != data_pointer(a)


def test_strided_views_reach_jax_as_copies():
    """XLA takes only compact buffers: a strided view is copied where copies are allowed,
    and copy=False raises BufferError."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    for view in (a[:, ::2], torch.from_numpy(a)[:, ::2]):
        for copy in (None, True):
            np.testing.assert_array_equal(np.asarray(xferlib.to_jax(view, copy=copy)),
                                          a[:, ::2])
    with pytest.raises(BufferError, match="without a copy"):
        xferlib.to_jax(a[:, ::2], copy=False)


def test_negative_strides_and_values_jax_would_narrow():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)[::-1]
    np.testing.assert_array_equal(xferlib.to_torch(a).numpy(), a)
    with pytest.raises(BufferError, match="negative strides"):
        xferlib.to_torch(a, copy=False)
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="do not fit"):
            xferlib.to_jax(np.array([2**40 + 5], np.int64))
        aligned = _aligned((4,), np.int64)  # so that alignment is not what refuses it
        aligned[:] = 5
        with pytest.raises(BufferError, match="x64 is off"):
            xferlib.to_jax(aligned, copy=False)
        assert int(xferlib.to_jax(np.array([5], np.int64))[0]) == 5


def test_bfloat16_numpy_torch():
    import ml_dtypes

    a = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    t = xferlib.to_torch(a)
    assert t.dtype == torch.bfloat16 and data_pointer(t) == data_pointer(a)
    back = xferlib.to_numpy(t)
    assert back.dtype == a.dtype and data_pointer(back) == data_pointer(a)
    np.testing.assert_array_equal(np.asarray(xferlib.to_jax(a)).astype(np.float32),
                                  a.astype(np.float32))


def test_bad_input():
    with pytest.raises(TypeError, match="NumPy, CuPy, torch or JAX"):
        xferlib.to_torch([1, 2])
    with pytest.raises(BufferError, match="bfloat16"):
        import ml_dtypes

        xferlib.to_jax(np.zeros(4, ml_dtypes.bfloat16), copy=False)


def test_pinned_numpy_to_torch_stays_pinned():
    a = xferlib.pinned_empty((128, 16), np.float32)
    t = xferlib.to_torch(a)
    assert data_pointer(t) == data_pointer(a)
    if xferlib.cupy_available():
        assert t.is_pinned()


@pytest.mark.gpu
def test_gpu_handoff_zero_copy():
    import cupy

    c = cupy.random.standard_normal((256, 32), dtype=cupy.float32)
    t = xferlib.to_torch(c)
    assert t.is_cuda and data_pointer(t) == data_pointer(c)
    assert data_pointer(xferlib.to_cupy(t)) == data_pointer(c)
    j = xferlib.to_jax(c)
    assert data_pointer(j) == data_pointer(c)
    assert data_pointer(xferlib.to_jax(t)) == data_pointer(c)
    # JAX -> torch / cupy copy unless asked to alias
    assert data_pointer(xferlib.to_torch(j)) != data_pointer(j)
    assert data_pointer(xferlib.to_cupy(j)) != data_pointer(j)
    assert data_pointer(xferlib.to_cupy(j, copy=False)) == data_pointer(j)
    np.testing.assert_array_equal(xferlib.to_numpy(j), c.get())


@pytest.mark.gpu
def test_pinned_host_aliases_from_cupy():
    import cupy

    host = xferlib.pinned_empty((1024, 8), np.float32)
    host[...] = 1.5
    view = xferlib.to_cupy(host, copy=False)  # GPU kernels read host RAM directly
    assert float(view.sum()) == 1.5 * host.size
    view *= 2
    cupy.cuda.get_current_stream().synchronize()
    assert np.all(host == 3.0)
    with pytest.raises(BufferError, match="pageable"):
        xferlib.to_cupy(np.zeros(4), copy=False)


@pytest.mark.gpu
def test_to_jax_pinned_host_memory_kind():
    a = xferlib.pinned_empty((64, 4), np.float32)
    a[...] = 2.0
    j = xferlib.to_jax(a, memory_kind="pinned_host")
    assert j.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(j), a)


def test_read_only_and_foreign_byte_order_arrays_reach_jax_as_copies():
    """NumPy's DLPack export refuses read-only arrays (JAX's own NumPy view of a CPU array is
    one) and non-native byte order: copied where copies are allowed, BufferError with
    copy=False."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    read_only = a.copy()
    read_only.flags.writeable = False
    for x in (read_only, a.astype(">f4"), xferlib.to_numpy(jnp.asarray(a))):
        for copy in (None, True):
            out = xferlib.to_jax(x, copy=copy)
            assert out.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(out), a)
    with pytest.raises(BufferError, match="without a copy"):
        xferlib.to_jax(read_only, copy=False)


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="JAX keeps 64-bit types with x64 on")
def test_copied_views_are_checked_for_values_jax_would_narrow():
    """A view XLA cannot take (strided, reversed, read-only) is copied: the copy is checked
    for int64 values that int32 would wrap, as the zero-copy path is."""
    big = np.array([2**40 + 5, 1, 2], np.int64)
    read_only = big.copy()
    read_only.flags.writeable = False
    for view in (big[::2], big[::-1], read_only):
        with pytest.raises(ValueError, match="do not fit"):
            xferlib.to_jax(view)
    small = np.array([5, 1, 2], np.int64)
    np.testing.assert_array_equal(np.asarray(xferlib.to_jax(small[::-1])), [2, 1, 5])
