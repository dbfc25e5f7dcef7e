"""Warnings for slow paths: xferlib never takes a slower path silently.

Where an op can still run but only by a path much slower than the one the user meant (a
pageable host table handed to a GPU op, indices on the host for a table on the GPU, a cache
that evicts what it admits, a TT shape the kernels cannot take), it warns ONCE per table with
:class:`XferlibPerformanceWarning`, naming the path taken, the measured cost and the fix.

``XferlibPerformanceWarning`` is a ``UserWarning``, so the usual filters apply:

>>> import warnings, xferlib
>>> with warnings.catch_warnings():
...     warnings.simplefilter("error", xferlib.XferlibPerformanceWarning)  # make them errors
...     # warnings.simplefilter("ignore", xferlib.XferlibPerformanceWarning) silences them
...     pass
"""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np

from xferlib._backend import is_cupy_array

__all__ = ["XferlibPerformanceWarning", "warn_once", "reset_warnings", "warn_slow_rows_path",
           "warn_pageable_table", "warn_cache_thrashing", "warn_tt_fallback",
           "PAGEABLE_GATHER_GBPS", "PINNED_GATHER_GBPS", "PAGEABLE_FACTOR",
           "HOST_INDICES_FACTOR"]


class XferlibPerformanceWarning(UserWarning):
    """An op took a slower path than the one its inputs were probably meant for."""


# Measured with CUDA events (median of 20): 65,536 uniform random rows of 512 B from an
# 8M x 128 float32 table, gathered into GPU memory. H200 (PCIe Gen5): pageable 1.9 GB/s,
# pinned 43-48 GB/s. H100: pageable 2.0 GB/s, pinned 32 GB/s (16x).
PAGEABLE_GATHER_GBPS = 1.9
PINNED_GATHER_GBPS = "43-48"
PAGEABLE_FACTOR = 22
# Same H100 run: 65,536 rows from a 1M x 128 CuPy table, NumPy indices 0.42 ms per call
# against 0.19 ms for CuPy indices.
HOST_INDICES_FACTOR = 2.2

_warned: set = set()
_lock = threading.Lock()


def warn_once(key, message: str, *, stacklevel: int | None = None) -> bool:
    """Issue ``message`` as an :class:`XferlibPerformanceWarning` the first time ``key`` is
    seen in this process; later calls with the same key do nothing. Returns True when it
    warned. ``key`` is any hashable, e.g. ``("pageable", table_address)``. The warning points
    at the first caller outside xferlib unless ``stacklevel`` says otherwise."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    if stacklevel is None:
        stacklevel = _user_stacklevel()
    warnings.warn(message, XferlibPerformanceWarning, stacklevel=stacklevel)
    return True


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside the xferlib package (its
    adapters included), counted from warn_once."""
    frame = sys._getframe(2)  # warn_once's caller
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("xferlib"):
        frame = frame.f_back
        level += 1
    return level


def reset_warnings() -> None:
    """Forget which warnings were given (each warns once more). For tests."""
    with _lock:
        _warned.clear()


def _describe(table) -> str:
    shape = " x ".join(str(s) for s in table.shape)
    return f"{shape} {table.dtype} ({_bytes(table.nbytes)})"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _table_key(kind: str, table) -> tuple:
    # The memory, not the Python object: views of one table made per call (torch -> NumPy
    # conversions) count as the same table.
    if isinstance(table, np.ndarray):
        address = table.__array_interface__["data"][0]
    else:
        address = int(table.data.ptr)
    return (kind, address, table.shape, str(table.dtype))


def warn_pageable_table(op: str, table, name: str = "table") -> bool:
    """Warn (once per table) that ``op`` got a pageable host table with GPU operands."""
    return warn_once(
        _table_key("pageable", table),
        f"{op}: {name} ({_describe(table)}) is in pageable host memory, which GPU kernels "
        f"cannot reach, so the rows go the slow way (NumPy gather on the host, then a "
        f"pageable copy): about {PAGEABLE_GATHER_GBPS} GB/s instead of {PINNED_GATHER_GBPS} "
        f"GB/s, {PAGEABLE_FACTOR}x slower (65,536 rows of 512 B on an H200; 16x on an H100). "
        f"Fix: pin it once, in place and without a copy: xferlib.pin({name}) (it stays "
        f"pinned until freed or xferlib.unpin), or allocate it with xferlib.pinned_empty.",
    )


def warn_slow_rows_path(op: str, table, idx, rows=None) -> bool:
    """Called at the entry of the row ops: warns once per table when the inputs select a slow
    path. Cheap when they do not (no driver call unless a NumPy table meets GPU operands).

    - a NumPy table in pageable memory with indices or rows on the GPU;
    - a CuPy table with NumPy indices: the indices are checked on the host and uploaded with
      a synchronous copy on every call.
    """
    if isinstance(table, np.ndarray):
        if not (is_cupy_array(idx) or (rows is not None and is_cupy_array(rows))):
            return False
        if table.nbytes == 0:
            return False
        from xferlib.memory import is_gpu_mapped

        if is_gpu_mapped(table):
            return False
        return warn_pageable_table(op, table)
    if is_cupy_array(table) and isinstance(idx, np.ndarray) and idx.size:
        return warn_once(
            _table_key("host-indices", table),
            f"{op}: the table ({_describe(table)}) is on the GPU but the indices are a NumPy "
            f"array, so every call checks them on the host and uploads them with a "
            f"synchronous copy (the step waits for the GPU): {HOST_INDICES_FACTOR}x slower for "
            f"65,536 rows on an H100. Fix: build the indices on the GPU, "
            f"or move them once with cupy.asarray(idx) / torch's .cuda(non_blocking=True) "
            f"from pinned memory.",
        )
    return False


def warn_cache_thrashing(owner, hit_rate: float, evictions: int, lookups: int,
                         cache_rows: int) -> bool:
    """Warn once per ``owner`` (a HostTable or TT module) when a row cache evicts about as
    much as it serves: more evictions than cache rows while fewer than 1 lookup in 5 hits.
    Owners call it from their cache statistics; returns True when it warned."""
    if lookups < 4 * cache_rows or evictions <= cache_rows or hit_rate >= 0.2:
        return False
    return warn_once(
        ("cache-thrash", id(owner)),
        f"{type(owner).__name__}: the row cache ({cache_rows} rows) is thrashing: hit rate "
        f"{hit_rate:.0%} after {lookups} lookups, {evictions} evictions; each miss costs a "
        f"host round trip plus an eviction write-back, so the step is slower than without the "
        f"cache. Fix: a larger cache_rows (the hot set does not fit), "
        f"cache_admission='second-sight' for one-off rows, or cache_rows=0.",
    )


def warn_tt_fallback(shape, reason: str) -> bool:
    """Warn once per TT shape when the GPU kernels cannot take it and batched cuBLAS products
    run instead. ``shape``: a hashable description (e.g. ``(tuple(p), tuple(q), tuple(r))``)."""
    return warn_once(
        ("tt-fallback", shape),
        f"TT shape {shape}: {reason}; the step falls back to batched cuBLAS products "
        f"(slower than the fused kernels, with a dense intermediate per lookup). Fix: smaller "
        f"ranks or more cores (xferlib.tt.suggest_tt_shapes) so each core's slice fits "
        f"shared memory.",
    )
