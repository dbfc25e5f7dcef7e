"""Pinned (page-locked) host memory that the GPU can read and write directly.

xferlib pins memory *in place*: it allocates an ordinary NumPy array and registers its pages
with the CUDA driver (``cudaHostRegister``), instead of asking CUDA for a fresh pinned block.
Large ``cudaHostAlloc`` calls are slow and take a global lock, and registering in place lets
an array the user already holds (a trained table, a memory map) be pinned without a second
copy. With unified addressing a registered page has the same address on the GPU, so a kernel
reads rows straight from host RAM.

On a machine without a GPU every function here still works: arrays are ordinary memory and
:func:`is_pinned` answers False.
"""

from __future__ import annotations

import weakref

import numpy as np

from xferlib._backend import cupy_available

__all__ = ["PinnedArray", "pinned_empty", "pinned_zeros", "pin", "is_pinned", "device_pointer"]

# cudaHostRegisterPortable: pinned for every CUDA context, not just the current device's.
_REGISTER_PORTABLE = 1
# cudaErrorHostMemoryAlreadyRegistered
_ALREADY_REGISTERED = 712


class _Registration:
    """Keeps one registered range pinned; unregisters exactly once (close or finalizer).

    The finalizer holds the array that owns the memory, so the pages are unregistered
    before they can be freed."""

    def __init__(self, owner: np.ndarray, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _unregister, ptr, owner)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        self._finalizer()


def _unregister(ptr: int, owner) -> None:
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(ptr)
    except cupy.cuda.runtime.CUDARuntimeError:
        pass  # the CUDA context is already gone at interpreter exit: nothing left to release


class PinnedArray(np.ndarray):
    """A NumPy array whose memory is page-locked (when a GPU is present).

    Use it like any ``numpy.ndarray``. ``close()`` (or leaving a ``with`` block) unpins the
    memory at once; otherwise it is unpinned when the last view of it is garbage-collected.
    After ``close()`` the data stay valid as ordinary pageable memory.
    """

    _registration: _Registration | None = None

    def __array_finalize__(self, obj):
        # Views and slices keep the registration (and so the pinning) alive; a new array
        # made from this one (a copy, np.take) lies elsewhere and gets none.
        registration = getattr(obj, "_registration", None)
        if registration is not None and self.size:
            start = self.ctypes.data
            if not registration.ptr <= start < registration.ptr + registration.nbytes:
                registration = None
        self._registration = registration

    @property
    def pinned(self) -> bool:
        return self._registration is not None and self._registration.alive

    def close(self) -> None:
        """Unpin now. Idempotent. Views taken earlier become unpinned too."""
        if self._registration is not None:
            self._registration.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _register(array: np.ndarray) -> _Registration | None:
    """Pin ``array``'s bytes in place; None when there is no GPU or nothing to pin."""
    if not cupy_available() or array.nbytes == 0:
        return None
    import cupy

    ptr = array.ctypes.data
    try:
        cupy.cuda.runtime.hostRegister(ptr, array.nbytes, _REGISTER_PORTABLE)
    except cupy.cuda.runtime.CUDARuntimeError as err:
        if getattr(err, "status", None) == _ALREADY_REGISTERED:
            return None  # pinned already by its owner; that owner keeps it pinned
        raise
    owner = array if array.base is None else array.base
    return _Registration(owner, ptr, array.nbytes)


def _as_pinned(array: np.ndarray) -> PinnedArray:
    registration = _register(array)
    view = array.view(PinnedArray)
    view._registration = registration
    return view


def pinned_empty(shape, dtype=np.float32) -> PinnedArray:
    """A new uninitialized array in pinned host memory.

    >>> import xferlib
    >>> with xferlib.pinned_empty((1024, 128), "float32") as table:
    ...     table[:] = 0.0
    """
    return _as_pinned(np.empty(shape, dtype=_numpy_dtype(dtype)))


def pinned_zeros(shape, dtype=np.float32) -> PinnedArray:
    """A new zero-filled array in pinned host memory."""
    array = np.zeros(shape, dtype=_numpy_dtype(dtype))
    return _as_pinned(array)


def pin(array: np.ndarray) -> PinnedArray:
    """Pin an existing C-contiguous NumPy array in place (no copy) and return a view of it.

    The returned view shares memory with ``array``; the pages stay pinned while the view
    (or any view of it) is alive, or until ``close()``. An array that is pinned already is
    returned as a view without a second registration.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"pin() takes a numpy.ndarray, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("pin() needs a C-contiguous array; pin np.ascontiguousarray(array)")
    if isinstance(array, PinnedArray) and array.pinned:
        return array.view(PinnedArray)
    return _as_pinned(array)


def is_pinned(array) -> bool:
    """True when ``array``'s memory is page-locked host memory the GPU can reach."""
    if not isinstance(array, np.ndarray) or not cupy_available() or array.nbytes == 0:
        return False
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    except cupy.cuda.runtime.CUDARuntimeError:
        return False
    return attrs.type == cupy.cuda.runtime.memoryTypeHost


def device_pointer(array: np.ndarray, name: str = "array") -> int:
    """The address at which the GPU sees a pinned host array (equal to the host address
    under unified addressing). ValueError, naming ``name``, when the array is not pinned."""
    if not is_pinned(array):
        raise ValueError(
            f"{name} is in pageable host memory, which GPU kernels cannot reach; "
            f"pin it with xferlib.pin({name}) or allocate it with xferlib.pinned_empty"
        )
    import cupy

    attrs = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    return int(attrs.devicePointer)


def _numpy_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
