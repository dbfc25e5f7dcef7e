"""Host RAM that one GPU reaches at the link's rate for scattered rows: CUDA managed memory
kept in host RAM and mapped by that GPU.

A kernel that reads or writes rows of pinned (registered) host memory at random pays a
translation miss per row: the driver maps registered pages for the GPU one small page at a
time, and a batch's rows each land on a page of their own. Measured on an H100 (PCIe 5):
25,600 scattered 576-byte rows of a 4.6 GB table, fresh rows each pass, read at 35 GB/s and
written at 42 GB/s from registered memory, and in a collection step (lookups, then
sums and update) at 24 and 22 GB/s; the same rows of managed memory advised to stay in
host RAM read at 46-48 GB/s and write at 42-46 GB/s, and the collection step's two host
kernels run in half the time. FBGEMM's ``MANAGED`` placement rests on the same memory.

:func:`managed_empty` allocates it (``cudaMallocManaged``), advises the driver to keep it
in host RAM (``SET_PREFERRED_LOCATION``: the pages never migrate to the GPU) and to keep
it mapped by the current GPU (``SET_ACCESSED_BY``: no fault on a GPU access), and touches
every page from several threads at once, so that nothing faults later and the first step
runs at full rate. The array is an ordinary NumPy array to the host (reads and writes at
RAM speed) whose address is the GPU's address too; :func:`gpu_view` gives it to CuPy
kernels. The memory is freed with the last array that refers to it, or, when that array
goes during a CUDA-graph capture (a garbage-collection pass inside one: freeing waits for the
GPU, which a capture forbids), at the next :func:`managed_empty` or :func:`free_unused`.

Where the GPU cannot keep managed memory in host RAM while the host uses it
(``concurrentManagedAccess`` = 0, as on Windows) or the driver lacks the calls,
:func:`managed_available` says False and callers pin instead. ``XFERLIB_HOST_MEMORY=pinned``
makes them pin always.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import threading
import weakref

import numpy as np

from xferlib._backend import capture_in_progress, cupy_available, libcuda, relaxed_capture_mode

__all__ = ["pinned_requested", "managed_available", "managed_empty", "is_managed", "gpu_view",
           "free_unused"]

# CUmem_advise values and CUmemLocationType values of the driver API (cuda.h)
_SET_PREFERRED_LOCATION, _SET_ACCESSED_BY = 3, 5
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_CPU_DEVICE = -1  # CU_DEVICE_CPU, for the driver's older cuMemAdvise
_TOUCH_BLOCK = 2 << 20  # pages touched a 2 MB block at a time, by several threads


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's memory-advice entry point and whether it takes a location (CUDA >= 12.2)."""
    lib = libcuda()
    if lib is None:
        return None
    advise = getattr(lib, "cuMemAdvise_v2", None)
    if advise is not None:
        advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        return advise, True
    advise = getattr(lib, "cuMemAdvise", None)
    if advise is None:
        return None
    advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    return advise, False


def pinned_requested() -> bool:
    """Whether ``XFERLIB_HOST_MEMORY=pinned`` asks for pinned host tables."""
    return os.environ.get("XFERLIB_HOST_MEMORY", "managed").strip().lower() == "pinned"


def managed_available() -> bool:
    """Whether :func:`managed_empty` can give memory that stays in host RAM while the
    current GPU maps it (a GPU, ``concurrentManagedAccess``, the driver's advice calls, and
    ``XFERLIB_HOST_MEMORY`` not set to ``pinned``)."""
    if pinned_requested() or not cupy_available() or _driver() is None:
        return False
    import cupy

    return bool(cupy.cuda.Device().attributes.get("ConcurrentManagedAccess", 0))


# Live managed blocks by start address: {start: nbytes} (is_managed answers from here), and
# the blocks whose last array went during a capture, still to free: [(start, device)]. A
# finalizer may run on any thread, or from a GC pass inside a lookup: hence the lock.
_BLOCKS: dict[int, int] = {}
_UNFREED: list[tuple[int, int]] = []
_LOCK = threading.RLock()


def _last_array_gone(ptr: int, device: int) -> None:
    """The finalizer: free the block now, or after the capture under way on this thread."""
    with _LOCK:
        _BLOCKS.pop(ptr, None)
        _UNFREED.append((ptr, device))
    if not capture_in_progress():
        free_unused()


def free_unused() -> int:
    """Free the managed blocks no array refers to any more (those whose last array went
    during a CUDA-graph capture; the others are freed at once). Returns how many. Call it
    outside any capture; :func:`managed_empty` does."""
    with _LOCK:
        blocks = list(_UNFREED)
        _UNFREED.clear()
    if not blocks:
        return 0
    import cupy

    # relaxed: another thread's capture survives these calls
    with relaxed_capture_mode():
        for ptr, device in blocks:
            try:
                # the work queued on the GPU that maps the block finishes before the block
                # goes back to the driver (as pinned memory is released: xferlib.memory)
                with cupy.cuda.Device(device):
                    cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.runtime.free(ptr)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # no context left at interpreter exit
    return len(blocks)


def _advise(ptr: int, nbytes: int, device: int) -> None:
    advise, located = _driver()
    if located:
        calls = ((_SET_PREFERRED_LOCATION, _Location(_LOCATION_HOST, 0)),
                 (_SET_ACCESSED_BY, _Location(_LOCATION_DEVICE, device)))
    else:
        calls = ((_SET_PREFERRED_LOCATION, _CPU_DEVICE), (_SET_ACCESSED_BY, device))
    for advice, where in calls:
        status = advise(ptr, nbytes, advice, where)
        if status != 0:
            raise RuntimeError(f"cuMemAdvise({advice}) on {nbytes} bytes of managed memory "
                               f"failed with CUDA driver error {status}")


def _touch(ptr: int, nbytes: int) -> None:
    """Zero every page from several threads: the pages are made in host RAM now (and mapped
    for the GPU, as advised), in parallel, not one fault at a time in the first step."""
    blocks = -(-nbytes // _TOUCH_BLOCK)
    threads = max(1, min(16, os.cpu_count() or 1, blocks))
    per = -(-blocks // threads) * _TOUCH_BLOCK

    def zero(k: int) -> None:
        start = k * per
        if start < nbytes:
            ctypes.memset(ptr + start, 0, min(per, nbytes - start))  # releases the GIL

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(zero, range(threads)))


def managed_empty(shape, dtype=np.float32) -> np.ndarray:
    """A zero-filled NumPy array in managed memory kept in host RAM and mapped by the
    current GPU (see the module's notes). Its address is the same on the host and the GPU.
    Check :func:`managed_available` first; the host RAM check is the caller's (as for
    :func:`xferlib.pinned_empty`)."""
    import cupy

    dtype = np.dtype(dtype)
    dims = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(dims, dtype)
    free_unused()  # blocks whose last array went during a capture, before taking more
    device = cupy.cuda.Device().id
    ptr = cupy.cuda.runtime.mallocManaged(nbytes, 1)  # cudaMemAttachGlobal
    try:
        _advise(ptr, nbytes, device)
        _touch(ptr, nbytes)
    except BaseException:
        try:
            cupy.cuda.runtime.free(ptr)
        except cupy.cuda.runtime.CUDARuntimeError:
            pass  # the error that brought us here is the one to report
        raise
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    with _LOCK:
        _BLOCKS[ptr] = nbytes
    weakref.finalize(raw, _last_array_gone, ptr, device)  # freed with the last array over it
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


def is_managed(array) -> bool:
    """True when all of ``array``'s bytes lie in memory :func:`managed_empty` gave."""
    if not isinstance(array, np.ndarray) or array.nbytes == 0:
        return False
    start = array.ctypes.data
    with _LOCK:
        blocks = tuple(_BLOCKS.items())
    return any(ptr <= start and start + array.nbytes <= ptr + size for ptr, size in blocks)


def gpu_view(array: np.ndarray):
    """A CuPy array over the same memory as a C-contiguous ``array`` of managed memory (for
    kernels that fill or read it in place)."""
    if not is_managed(array) or not array.flags.c_contiguous:
        raise ValueError("gpu_view() needs a C-contiguous array of managed memory")
    import cupy

    memory = cupy.cuda.UnownedMemory(array.ctypes.data, array.nbytes, array)
    return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))
