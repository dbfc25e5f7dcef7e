"""Pinned (page-locked) host memory that the GPU can read and write directly.

xferlib pins memory *in place*: it allocates an ordinary NumPy array and registers its pages
with the CUDA driver (``cudaHostRegister``), instead of asking CUDA for a fresh pinned block.
Large ``cudaHostAlloc`` calls are slow and take a global lock, and registering in place lets
an array the user already holds (a trained table, a memory map) be pinned without a second
copy. With unified addressing a registered page has the same address on the GPU, so a kernel
reads rows straight from host RAM.

Pinning follows the memory, not a Python object: after ``xferlib.pin(a)``, ``a`` itself (and
every view of its memory) stays pinned until the array that owns the memory is freed or
``xferlib.unpin(a)`` / ``close()`` is called. The pages are unregistered just before their
owner frees them (a ``weakref.finalize`` on the owning array).

Pinned pages cannot be swapped out, so :func:`pinned_empty`, :func:`pinned_zeros` and
:func:`pin` check the size against the host RAM this process can still get (``MemAvailable``,
and the cgroup's limit in a container) and raise ``MemoryError`` with both sizes BEFORE
allocating, rather than letting the OS kill the process half-way through. Set
``XFERLIB_HOST_MEMORY_CHECK=0`` to skip the check.

On a machine without a GPU every function here still works: arrays are ordinary memory and
:func:`is_pinned` answers False.
"""

from __future__ import annotations

import bisect
import numbers
import os
import threading
import weakref

import numpy as np

from xferlib._backend import capture_in_progress, cupy_available, libcuda, relaxed_capture_mode

__all__ = ["PinnedArray", "pinned_empty", "pinned_zeros", "pin", "unpin", "is_pinned",
           "device_pointer", "available_host_memory", "check_host_memory"]
# Public for the rest of the core, outside __all__: registration_of, meminfo, format_bytes,
# as_pinned, numpy_dtype.

# cudaHostRegisterPortable: pinned for every CUDA context, not just the current device's.
_REGISTER_PORTABLE = 1
# cudaErrorHostMemoryAlreadyRegistered
_ALREADY_REGISTERED = 712
# cudaErrorMemoryAllocation
_OUT_OF_MEMORY = 2
# Where new pinned arrays start: a host page boundary.
_PAGE = 4096

# Every range xferlib registered, by start address: {start: _Registration}, plus the sorted
# starts for containment lookups (is_pinned answers from here without a driver call).
_REGISTRY: dict[int, "_Registration"] = {}
_STARTS: list[int] = []
_LOCK = threading.RLock()


class _Registration:
    """One registered range. Unregistered exactly once: by ``close()`` or just before the
    array that owns the memory is freed (the finalizer does not keep the owner alive)."""

    def __init__(self, owner: np.ndarray, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        with _LOCK:
            _REGISTRY[ptr] = self
            bisect.insort(_STARTS, ptr)
        # NumPy clears an array's weak references before it frees the data, so the pages are
        # unregistered while they are still mapped.
        self._finalizer = weakref.finalize(owner, _unregister, ptr)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        self._finalizer()


def _devices_in_use(count: int) -> list[int]:
    """The GPUs on which this process holds a CUDA context (the driver's primary-context
    state, read without opening one): the only ones whose queued work can touch its pinned
    pages. Making any other GPU current would open a context there, and a process of a
    multi-GPU job must stay on its own GPU. Every GPU where the driver cannot be asked."""
    import ctypes

    driver = libcuda()
    if driver is None:
        return list(range(count))
    try:
        used = []
        for ordinal in range(count):
            device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
            if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
                return list(range(count))
            if driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags),
                                                 ctypes.byref(active)) != 0:
                return list(range(count))
            if active.value:
                used.append(ordinal)
        return used
    except AttributeError:
        return list(range(count))


def _unregister(ptr: int) -> None:
    with _LOCK:
        _REGISTRY.pop(ptr, None)
        i = bisect.bisect_left(_STARTS, ptr)
        if i < len(_STARTS) and _STARTS[i] == ptr:
            del _STARTS[i]
    import cupy

    # A finalizer: it may run inside a CUDA-graph capture (a GC pass), where a host sync is
    # refused and an unregistration would invalidate the capture unless made in relaxed mode.
    with relaxed_capture_mode():
        if not capture_in_progress():
            try:
                # GPU calls return before the GPU is done with the memory (gathers and
                # scatters check their indices later), so work queued on these pages must
                # finish before they go back to the allocator and are reused. (A capture
                # queues nothing that runs: torch's waits for the device before it starts.)
                for device in _devices_in_use(cupy.cuda.runtime.getDeviceCount()):
                    with cupy.cuda.Device(device):
                        cupy.cuda.runtime.deviceSynchronize()
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # no context left at interpreter exit
        try:
            cupy.cuda.runtime.hostUnregister(ptr)
        except cupy.cuda.runtime.CUDARuntimeError:
            pass  # the CUDA context is already gone at interpreter exit: nothing to release


def registration_of(start: int, nbytes: int) -> "_Registration | None":
    """The registration holding all of ``[start, start + nbytes)``, or None."""
    with _LOCK:
        i = bisect.bisect_right(_STARTS, start) - 1
        if i < 0:
            return None
        reg = _REGISTRY[_STARTS[i]]
    return reg if start + nbytes <= reg.ptr + reg.nbytes else None


def _overlapping(start: int, nbytes: int) -> "_Registration | None":
    with _LOCK:
        i = bisect.bisect_right(_STARTS, start + nbytes - 1) - 1
        if i < 0:
            return None
        reg = _REGISTRY[_STARTS[i]]
    return reg if reg.ptr + reg.nbytes > start else None


def _owner(array: np.ndarray) -> np.ndarray:
    """The array at the root of ``array``'s views: it keeps the memory alive, so the memory
    is freed only after it goes."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


class PinnedArray(np.ndarray):
    """A NumPy array whose memory is page-locked (when a GPU is present).

    Use it like any ``numpy.ndarray``. ``close()`` (or leaving a ``with`` block) unpins the
    memory at once, for every array that shares it; otherwise it stays pinned until the array
    that owns the memory is freed. After ``close()`` the data stay valid as ordinary pageable
    memory.
    """

    _registration: _Registration | None = None

    def __array_finalize__(self, obj):
        # Views and slices know the registration (for close()); a new array made from this
        # one (a copy, np.take) lies elsewhere and gets none.
        registration = getattr(obj, "_registration", None)
        if registration is not None and self.size:
            start = self.ctypes.data
            if not registration.ptr <= start < registration.ptr + registration.nbytes:
                registration = None
        self._registration = registration

    @property
    def pinned(self) -> bool:
        return is_pinned(self)

    def close(self) -> None:
        """Unpin now. Idempotent. Every array sharing this memory becomes pageable."""
        if self._registration is not None:
            self._registration.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ----------------------------------------------------------------------------- host RAM


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key] = int(fields[0]) * 1024  # kB
    except OSError:
        pass
    return out


def _cgroup_available() -> int | None:
    """What the cgroup (a container's memory limit) still allows, or None without a limit."""
    limit = _read_int("/sys/fs/cgroup/memory.max")  # v2; "max" (no limit) reads as None
    usage = _read_int("/sys/fs/cgroup/memory.current")
    stat_path = "/sys/fs/cgroup/memory.stat"
    if limit is None or usage is None:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
        stat_path = "/sys/fs/cgroup/memory/memory.stat"
        if limit is None or usage is None or limit >= 1 << 60:
            return None
    reclaimable = 0  # page cache the kernel drops before it kills anyone
    try:
        with open(stat_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    reclaimable = int(value)
    except (OSError, ValueError):
        pass
    return max(0, limit - usage + reclaimable)


def available_host_memory() -> int | None:
    """Bytes of host RAM this process can still allocate without swapping or being killed:
    ``MemAvailable`` from /proc/meminfo (``os.sysconf`` elsewhere), capped by the cgroup's
    limit. None when the system does not say."""
    info = meminfo()
    available = info.get("MemAvailable")
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    cgroup = _cgroup_available()
    if cgroup is not None:
        available = cgroup if available is None else min(available, cgroup)
    return available


def format_bytes(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def check_host_memory(nbytes: int, what: str, *, resident: int = 0) -> None:
    """Raise ``MemoryError`` naming ``what`` and both sizes when ``nbytes`` of host RAM cannot
    be had (more than is available, plus ``resident`` bytes already in RAM). Called before
    allocating, so a table too large fails at once instead of being killed by the OS.

    >>> import xferlib
    >>> xferlib.check_host_memory(1 << 20, "a 1 MB table")   # fits: returns None
    >>> xferlib.check_host_memory(1 << 60, "a 1 EB table")   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    MemoryError: a 1 EB table needs 1152921.50 TB of host RAM, but only ... is available...
    """
    if os.environ.get("XFERLIB_HOST_MEMORY_CHECK", "1") == "0":
        return
    available = available_host_memory()
    if available is None or nbytes <= available + resident:
        return
    total = meminfo().get("MemTotal")
    total_text = f" of {format_bytes(total)} installed" if total else ""
    raise MemoryError(
        f"{what} needs {format_bytes(nbytes)} of host RAM, but only "
        f"{format_bytes(available + resident)} is available{total_text} (MemAvailable / the "
        f"container's limit); pinned pages cannot be swapped out. Use fewer rows or a smaller "
        f"dtype (float16/bfloat16), a TT-compressed table (xferlib.tt), or free memory; "
        f"XFERLIB_HOST_MEMORY_CHECK=0 skips this check.")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ----------------------------------------------------------------------------- pinning


def _register(array: np.ndarray) -> _Registration | None:
    """Pin ``array``'s bytes in place; None when there is no GPU, nothing to pin, or the
    range was pinned by someone else (cudaHostAlloc, torch's pin_memory)."""
    if not cupy_available() or array.nbytes == 0:
        return None
    import cupy

    ptr = array.ctypes.data
    try:
        cupy.cuda.runtime.hostRegister(ptr, array.nbytes, _REGISTER_PORTABLE)
    except cupy.cuda.runtime.CUDARuntimeError as err:
        status = getattr(err, "status", None)
        if status == _ALREADY_REGISTERED:
            return None  # pinned already by its owner; that owner keeps it pinned
        if status == _OUT_OF_MEMORY:
            raise MemoryError(
                f"the CUDA driver could not pin {format_bytes(array.nbytes)} of host memory "
                f"({err}); the locked-memory limit (ulimit -l) or host RAM is too small for "
                f"this table") from err
        raise
    return _Registration(_owner(array), ptr, array.nbytes)


def as_pinned(array: np.ndarray) -> PinnedArray:
    registration = _register(array)
    view = array.view(PinnedArray)
    view._registration = registration
    return view


def _checked_shape(shape, fn: str) -> tuple:
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"{fn}: shape must be an int or a tuple of ints, got "
                        f"{type(shape).__name__} {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"{fn}: shape must hold ints, got {shape!r} "
                            f"({type(d).__name__} {d!r})")
        if d < 0:
            raise ValueError(f"{fn}: shape {shape!r} has a negative size {int(d)}; every "
                             "size must be >= 0")
    return tuple(int(d) for d in dims)


def _allocate(shape, dtype, fn: str, fill_zero: bool) -> PinnedArray:
    dims = _checked_shape(shape, fn)
    dtype = numpy_dtype(dtype, fn)
    nbytes = dtype.itemsize
    for d in dims:
        nbytes *= d  # Python ints: no overflow
    check_host_memory(nbytes, f"{fn}(shape={dims}, dtype={dtype.name})")
    # Page-aligned (NumPy's own buffers start 16 bytes past a page): rows whose size is a
    # multiple of 64 bytes then start on host cache lines, and the GPU reads a row in whole
    # 64- and 128-byte pieces, not split across one more piece at each end.
    raw = (np.zeros if fill_zero else np.empty)(nbytes + _PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    array = raw[start:start + nbytes].view(dtype).reshape(dims)
    return as_pinned(array)


def pinned_empty(shape, dtype=np.float32) -> PinnedArray:
    """A new uninitialized array in pinned host memory.

    Raises ``MemoryError`` (with the requested and the available sizes) before allocating
    when the host cannot hold it.

    >>> import xferlib
    >>> with xferlib.pinned_empty((1024, 128), "float32") as table:
    ...     table[:] = 0.0
    """
    return _allocate(shape, dtype, "pinned_empty", fill_zero=False)


def pinned_zeros(shape, dtype=np.float32) -> PinnedArray:
    """A new zero-filled array in pinned host memory (checked as :func:`pinned_empty`)."""
    return _allocate(shape, dtype, "pinned_zeros", fill_zero=True)


def pin(array: np.ndarray) -> PinnedArray:
    """Pin an existing C-contiguous NumPy array in place (no copy); returns a view of it.

    ``array`` itself is pinned: it stays pinned until the array owning its memory is freed or
    :func:`unpin` (or the view's ``close()``) is called, whether or not the returned view is
    kept. Pinning an array that is pinned already does nothing more.

    >>> import numpy as np, xferlib
    >>> table = np.zeros((1000, 16), np.float32)
    >>> _ = xferlib.pin(table)                    # the result need not be kept
    >>> xferlib.is_pinned(table) == xferlib.cupy_available()
    True
    >>> xferlib.unpin(table)
    """
    if not isinstance(array, np.ndarray):
        hint = ("; for a CPU tensor use tensor.pin_memory() (a pinned copy), or pin a NumPy "
                "view you keep: view = tensor.numpy(); xferlib.pin(view) (pinned while the "
                "view lives)" if type(array).__module__.startswith("torch") else "")
        raise TypeError(f"pin() takes a numpy.ndarray, got {type(array).__name__}{hint}")
    if not array.flags.c_contiguous:
        raise ValueError(f"pin() needs a C-contiguous array, got one with strides "
                         f"{array.strides} for shape {array.shape}; pin "
                         "np.ascontiguousarray(array) (a copy) instead")
    if array.nbytes == 0 or not cupy_available():
        return array.view(PinnedArray)
    start = array.ctypes.data
    registration = registration_of(start, array.nbytes)
    if registration is not None:  # pinned already (maybe through another view)
        view = array.view(PinnedArray)
        view._registration = registration
        return view
    overlap = _overlapping(start, array.nbytes)
    if overlap is not None:
        raise ValueError(
            f"pin(): the array's memory [{start:#x}, {start + array.nbytes:#x}) overlaps a "
            f"range pinned earlier [{overlap.ptr:#x}, {overlap.ptr + overlap.nbytes:#x}); "
            "pin the whole array once, or xferlib.unpin the earlier one first")
    check_host_memory(array.nbytes, f"pin() of a {array.shape} {array.dtype} array",
                      resident=_rss_bytes())
    return as_pinned(array)


def unpin(array) -> None:
    """Unpin the memory that :func:`pin` / :func:`pinned_empty` pinned for ``array`` (all
    arrays sharing that memory become pageable; the data stay valid). Does nothing for
    memory xferlib did not pin."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"unpin() takes a numpy.ndarray, got {type(array).__name__}")
    registration = getattr(array, "_registration", None)
    if registration is None and array.nbytes:
        registration = registration_of(array.ctypes.data, array.nbytes)
    if registration is not None:
        registration.close()


def is_pinned(array) -> bool:
    """True when ``array``'s memory is page-locked host memory the GPU can reach."""
    if not isinstance(array, np.ndarray) or array.nbytes == 0 or not cupy_available():
        return False
    start = array.ctypes.data
    if registration_of(start, array.nbytes) is not None:
        return True
    import cupy

    # The driver answers per address: ask for the first and the last byte, so an array only
    # partly inside a pinned range (a kernel would fault past its end) is not called pinned.
    for address in {start, start + array.nbytes - 1}:
        try:
            attrs = cupy.cuda.runtime.pointerGetAttributes(address)
        except cupy.cuda.runtime.CUDARuntimeError:
            return False
        if attrs.type != cupy.cuda.runtime.memoryTypeHost:
            return False
    return True


def is_gpu_mapped(array) -> bool:
    """True when GPU kernels reach ``array``'s host memory: pinned (registered or allocated
    page-locked) or managed memory (:func:`xferlib.managed.managed_empty`)."""
    from xferlib.managed import is_managed

    return is_managed(array) or is_pinned(array)


def device_pointer(array: np.ndarray, name: str = "array") -> int:
    """The address at which the GPU sees a pinned host array, or one of managed memory
    (:func:`xferlib.managed.managed_empty`): equal to the host address under unified
    addressing. ValueError, naming ``name``, when the GPU cannot reach the array."""
    from xferlib.managed import is_managed

    if is_managed(array):
        return array.ctypes.data
    if not is_pinned(array):
        raise ValueError(
            f"{name} is in pageable host memory, which GPU kernels cannot reach; "
            f"pin it with xferlib.pin({name}) or allocate it with xferlib.pinned_empty"
        )
    import cupy

    attrs = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    return int(attrs.devicePointer)


def numpy_dtype(dtype, fn: str = "pinned_empty") -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        out = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{fn}: dtype {dtype!r} is not a NumPy dtype (e.g. 'float32', "
                        "np.float16, 'bfloat16')") from None
    if out.hasobject:
        raise TypeError(f"{fn}: dtype {out} holds Python objects, which cannot live in "
                        "pinned memory the GPU reads; use a numeric dtype")
    return out
