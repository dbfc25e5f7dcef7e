"""Which array namespace an array belongs to, whether a GPU is usable, and streams.

Array types are detected through ``sys.modules`` (as array-api-compat does): asking whether
``x`` is a CuPy array must never import CuPy, so ``import xferlib`` stays light.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys

import numpy as np

__all__ = [
    "is_numpy_array",
    "is_cupy_array",
    "namespace_name",
    "array_module",
    "cupy_available",
    "require_cupy",
    "ExternalStream",
    "as_cupy_stream",
    "is_capturing",
    "capture_in_progress",
    "relaxed_capture_mode",
]


def is_numpy_array(x) -> bool:
    return isinstance(x, np.ndarray)


def is_cupy_array(x) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def namespace_name(x) -> str:
    """``"numpy"`` or ``"cupy"`` for an array; TypeError for anything else."""
    if is_numpy_array(x):
        return "numpy"
    if is_cupy_array(x):
        return "cupy"
    raise TypeError(
        f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__module__}.{type(x).__name__}; "
        "convert torch tensors and JAX arrays with xferlib.to_numpy / xferlib.to_cupy"
    )


def array_module(x):
    """The module of an array: ``numpy`` or, for CuPy arrays, ``cupy`` (imported already)."""
    return sys.modules["cupy"] if is_cupy_array(x) else np


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def require_cupy():
    """Import and return CuPy, or raise RuntimeError saying why the GPU path is unusable."""
    if not cupy_available():
        raise RuntimeError(
            "this operation needs a CUDA GPU and CuPy (pip install 'xferlib[cuda12]' or "
            "'xferlib[cuda13]'); none is available on this machine"
        )
    import cupy

    return cupy


class ExternalStream:
    """A raw ``cudaStream_t`` (an int, e.g. XLA's ``ctx.stream``) seen through the CUDA stream
    protocol, so ``cupy.cuda.Stream.from_external`` can wrap it."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


def as_cupy_stream(stream=None):
    """The CuPy stream to launch on.

    ``None``: CuPy's current stream. A ``cupy.cuda.Stream``: itself. An int: a raw
    ``cudaStream_t``. Anything with ``__cuda_stream__`` (torch streams, cuda.core streams): wrapped
    without a copy through ``cupy.cuda.Stream.from_external``.
    """
    cupy = require_cupy()
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    if isinstance(stream, (int, np.integer)):
        handle = int(stream)
    elif hasattr(stream, "__cuda_stream__"):
        handle = int(stream.__cuda_stream__()[1])
    else:
        raise TypeError(
            f"stream must be None, an int cudaStream_t, a cupy Stream or an object with "
            f"__cuda_stream__; got {type(stream).__name__}"
        )
    # One CuPy wrapper per raw handle: wrapping costs more than a kernel launch's host time.
    wrapped = _WRAPPED_STREAMS.get(handle)
    if wrapped is None:
        if len(_WRAPPED_STREAMS) > 64:
            _WRAPPED_STREAMS.clear()
        wrapped = _WRAPPED_STREAMS[handle] = cupy.cuda.Stream.from_external(ExternalStream(handle))
    return wrapped


_WRAPPED_STREAMS: dict = {}


def stream_scope(stream, gpu: bool):
    """A ``with`` context that makes ``stream`` CuPy's current stream (so CuPy array
    operations queue on it) when the work is on the GPU; a no-op for NumPy work."""
    if not gpu:
        import contextlib

        return contextlib.nullcontext()
    return as_cupy_stream(stream)


def is_capturing(stream) -> bool:
    """Whether ``stream`` (a CuPy stream) is capturing a CUDA graph: then no host sync, no
    event query and no host allocation may happen on it."""
    try:
        return bool(stream.is_capturing())
    except AttributeError:
        import cupy

        try:
            return cupy.cuda.runtime.streamIsCapturing(stream.ptr) != 0
        except AttributeError:  # a CuPy without the query cannot capture either
            return False


def upload(values, dtype=None):
    """A new CuPy array of host ``values``, copied on CuPy's current stream straight from
    their (pageable) memory: CUDA stages the bytes before the call returns, so ``values``
    may go at once, and the copy is ordered before later work on the stream. No pinned
    staging block, unlike ``cupy.asarray``: a fresh pinned block (``cudaHostAlloc``) waits
    for every device, and inside a JAX callback on a mesh of this process's GPUs that wait
    can be on a peer's collective which waits for this very thread (a deadlock)."""
    import cupy

    host = np.ascontiguousarray(values, dtype=dtype)
    array = cupy.empty(host.shape, host.dtype)
    if host.nbytes:
        cupy.cuda.runtime.memcpyAsync(array.data.ptr, host.ctypes.data, host.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice,
                                      cupy.cuda.get_current_stream().ptr)
    return array


def hyper_constant(values, capturing: bool):
    """A hyperparameter array (kept for later launches, from CuPy's default pool): uploaded on
    CuPy's current stream, ordered before the launch that reads it, no wait (a schedule may
    change it every step); ``capturing`` (the current stream records a CUDA graph): by
    :func:`device_constant` (a recorded copy would read the host values at every replay)."""
    if capturing:
        return device_constant(values)
    with default_allocator():
        return upload(values)


def changed_constant(array, captured: bool, values):
    """A device constant (e.g. a hyperparameter row) after its host values changed: None
    (uploaded again where next needed) while no launch that reads it was captured; else
    ``array`` itself, ``values()`` written in place once the queued work (which keeps the
    old values) is done: graph replays read it at the address they recorded (a wait for
    the device)."""
    if array is None or not captured:
        return None
    import cupy

    with array.device:
        cupy.cuda.runtime.deviceSynchronize()
        array.set(np.asarray(values(), dtype=array.dtype).reshape(array.shape))
        cupy.cuda.runtime.deviceSynchronize()
    return array


def device_constant(values, dtype=None):
    """A CuPy array of host ``values`` (a table kept for later launches) that kernels on any
    stream may read as soon as this returns: uploaded on CuPy's current stream and waited
    for. A kernel that reads it may run on another stream (torch's and JAX's streams are
    non-blocking: they do not wait for CuPy's, nor for the legacy default stream), where an
    upload still in flight is read as whatever the memory held (seen as wrong steps, and
    misaligned or illegal addresses from garbage offsets, on a loaded GPU). Called while
    CuPy's current stream captures a CUDA graph (a first call inside a user's capture, or
    inside a callback XLA records), the upload goes on a stream of its own in CUDA's
    relaxed capture mode and is waited for there: a copy recorded into the graph would
    read the host array again at every replay, long after it is gone."""
    import cupy

    host = np.asarray(values, dtype=dtype)
    if not is_capturing(cupy.cuda.get_current_stream()):
        with default_allocator():
            array = upload(host)
        finish_current_stream()
        return array
    with relaxed_capture_mode(), default_allocator():
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            array = upload(host)
        side.synchronize()
    return array


@contextlib.contextmanager
def default_allocator():
    """Inside, CuPy allocates from its default memory pool, whatever allocator a caller set:
    for memory kept for good (tables of constants, a collection's GPU side), which must not
    come from a pool whose blocks a recorded CUDA graph writes (a JAX callback's private
    pool hands its recordings' freed scratch to later calls)."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        yield


def finish_current_stream() -> None:
    """Wait for CuPy's current stream, where state kept for later launches was just uploaded
    or filled (see :func:`device_constant`); nothing inside a graph capture."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if not is_capturing(stream):
        stream.synchronize()


def capture_in_progress() -> bool:
    """Whether this thread's current torch or CuPy stream is capturing a CUDA graph (asked
    through ``sys.modules``: neither is imported here)."""
    torch = sys.modules.get("torch")
    try:
        if (torch is not None and torch.cuda.is_initialized()
                and torch.cuda.is_current_stream_capturing()):
            return True
    except Exception:  # noqa: BLE001  (a torch without CUDA, or a context being torn down)
        pass
    cupy = sys.modules.get("cupy")
    try:
        return cupy is not None and is_capturing(cupy.cuda.get_current_stream())
    except Exception:  # noqa: BLE001
        return False


@functools.lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library (``ctypes``), or None where it does not load."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED (cuda.h)


@contextlib.contextmanager
def relaxed_capture_mode():
    """Inside, this thread's CUDA calls may release memory while a CUDA graph is being
    captured. In CUDA's default (global) capture mode a free or a host unregistration made
    by any thread of the process during a capture invalidates it, and a finalizer runs
    wherever garbage collection happens, inside a user's capture too. (The thread's mode is
    swapped with ``cuThreadExchangeStreamCaptureMode`` and restored on the way out.)"""
    lib = libcuda()
    exchange = getattr(lib, "cuThreadExchangeStreamCaptureMode", None) if lib else None
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    swapped = exchange is not None and exchange(ctypes.byref(mode)) == 0
    try:
        yield
    finally:
        if swapped:
            exchange(ctypes.byref(mode))
