"""Scratch buffers a caller's GPU steps reuse from call to call, instead of allocating them.

A :class:`Scratch` hands out named arrays that live only within one call's kernels: the tile
sort's working buffers, the per-lookup products of the backward, the flat core gradient of a
fused update. The next call on the same stream queues its kernels after this one's, so it may
reuse them (the rule CuPy's memory pool follows for freed blocks, without the allocation). An
array whose size or dtype changes is allocated again; the old one goes back to CuPy's pool.

Rules for callers: one Scratch per (device, stream, thread) (:meth:`ScratchSet.get`); never hand out
an array that outlives the call (a plan's residuals, a returned gradient); no Scratch while a
CUDA graph is being captured (the graph would keep reading buffers that later eager calls
rewrite).

>>> from xferlib.tt.scratch import ScratchSet
>>> scratches = ScratchSet()   # a module keeps one; on the GPU: scratches.get(stream)
>>> len(scratches)
0
"""

from __future__ import annotations

import threading

__all__ = ["Scratch", "ScratchSet"]


class _Store:
    """The arrays a Scratch and its named views share, and the bytes they hold."""

    __slots__ = ("arrays", "nbytes")

    def __init__(self):
        self.arrays = {}
        self.nbytes = 0


class Scratch:
    """Named scratch arrays of one (device, stream, thread); ``prefix`` keeps call sites apart.

    At most :attr:`KEEP_BYTES` are kept between calls: an array that would go past it is
    allocated from CuPy's pool for this call only (large batches pay one allocation, small ones
    none), so a module never holds more than that per stream."""

    __slots__ = ("store", "prefix", "children")

    KEEP_BYTES = 64 << 20

    def __init__(self, store=None, prefix: str = ""):
        self.store = _Store() if store is None else store
        self.prefix = prefix
        self.children = {}

    def named(self, prefix: str) -> "Scratch":
        """The same buffers under names that start with ``prefix`` (one call site's)."""
        child = self.children.get(prefix)
        if child is None:
            child = self.children[prefix] = Scratch(self.store, self.prefix + prefix)
        return child

    def empty(self, name: str, size: int, dtype):
        """A 1-D array of ``size`` elements, contents undefined."""
        import cupy

        key = self.prefix + name
        store = self.store
        array = store.arrays.get(key)
        if array is not None and array.size == size and array.dtype == dtype:
            return array
        if array is not None:  # back to CuPy's pool
            store.nbytes -= array.nbytes
            del store.arrays[key]
        array = cupy.empty(size, dtype=dtype)
        if store.nbytes + array.nbytes <= self.KEEP_BYTES:
            store.arrays[key] = array
            store.nbytes += array.nbytes
        return array

    def zeros(self, name: str, size: int, dtype, stream):
        """:meth:`empty`, zeroed on ``stream``."""
        array = self.empty(name, size, dtype)
        if array.nbytes:
            array.data.memset_async(0, array.nbytes, stream)
        return array


class ScratchSet:
    """One :class:`Scratch` per (device, stream, host thread) a caller runs on: two threads
    queueing on one stream interleave their launches, so they must not share buffers."""

    __slots__ = ("scratches",)

    _LIMIT = 8  # streams remembered; more (a new stream per step) start afresh

    def __init__(self):
        self.scratches = {}

    def __len__(self) -> int:
        return len(self.scratches)

    def get(self, stream) -> Scratch:
        """The Scratch of ``stream`` (a CuPy stream) on the current device and thread."""
        import cupy

        key = (cupy.cuda.runtime.getDevice(), stream.ptr, threading.get_ident())
        scratch = self.scratches.get(key)
        if scratch is None:
            if len(self.scratches) >= self._LIMIT:
                self.scratches.clear()
            scratch = self.scratches[key] = Scratch()
        return scratch

    def clear(self) -> None:
        """Drop every buffer (back to CuPy's pool)."""
        self.scratches.clear()
