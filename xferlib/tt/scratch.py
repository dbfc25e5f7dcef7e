"""Scratch buffers a caller's GPU steps reuse from call to call, instead of allocating them.

A :class:`Scratch` hands out named arrays that live only within one call's kernels: the tile
sort's working buffers, the per-lookup products of the backward, the flat core gradient of a
fused update. The next call on the same stream queues its kernels after this one's, so it may
reuse them (the rule CuPy's memory pool follows for freed blocks, without the allocation). An
array whose size or dtype changes is allocated again; the old one goes back to CuPy's pool.

Rules for callers: one Scratch per (device, stream) (:meth:`ScratchSet.get`); never hand out
an array that outlives the call (a plan's residuals, a returned gradient); no Scratch while a
CUDA graph is being captured (the graph would keep reading buffers that later eager calls
rewrite).

>>> from xferlib.tt.scratch import ScratchSet
>>> scratches = ScratchSet()   # a module keeps one; on the GPU: scratches.get(stream)
>>> len(scratches)
0
"""

from __future__ import annotations

__all__ = ["Scratch", "ScratchSet"]


class Scratch:
    """Named scratch arrays of one (device, stream); ``prefix`` keeps call sites apart."""

    __slots__ = ("arrays", "prefix", "children")

    def __init__(self, arrays=None, prefix: str = ""):
        self.arrays = {} if arrays is None else arrays
        self.prefix = prefix
        self.children = {}

    def named(self, prefix: str) -> "Scratch":
        """The same buffers under names that start with ``prefix`` (one call site's)."""
        child = self.children.get(prefix)
        if child is None:
            child = self.children[prefix] = Scratch(self.arrays, self.prefix + prefix)
        return child

    def empty(self, name: str, size: int, dtype):
        """A 1-D array of ``size`` elements, contents undefined."""
        key = self.prefix + name
        array = self.arrays.get(key)
        if array is None or array.size != size or array.dtype != dtype:
            import cupy

            array = self.arrays[key] = cupy.empty(size, dtype=dtype)
        return array

    def zeros(self, name: str, size: int, dtype, stream):
        """:meth:`empty`, zeroed on ``stream``."""
        array = self.empty(name, size, dtype)
        if array.nbytes:
            array.data.memset_async(0, array.nbytes, stream)
        return array


class ScratchSet:
    """One :class:`Scratch` per (device, stream) a caller runs on."""

    __slots__ = ("scratches",)

    _LIMIT = 8  # streams remembered; more (a new stream per step) start afresh

    def __init__(self):
        self.scratches = {}

    def __len__(self) -> int:
        return len(self.scratches)

    def get(self, stream) -> Scratch:
        """The Scratch of ``stream`` (a CuPy stream) on the current device."""
        import cupy

        key = (cupy.cuda.runtime.getDevice(), stream.ptr)
        scratch = self.scratches.get(key)
        if scratch is None:
            if len(self.scratches) >= self._LIMIT:
                self.scratches.clear()
            scratch = self.scratches[key] = Scratch()
        return scratch

    def clear(self) -> None:
        """Drop every buffer (back to CuPy's pool)."""
        self.scratches.clear()
