"""The GPU side of :mod:`xferlib.rows` below its API: the one-launch ("fused") gather and
scatter path, and what it shares with the planned path (the table check, where a kernel finds
an array, each device's queue of pending checks).

Not a public module: :mod:`xferlib.rows` calls it and documents the behaviour (its module
docstring and :func:`xferlib.rows.gather_rows`). ``FUSED_MAX`` (the largest batch that takes
one launch) is read from here at call time: set ``xferlib.rows_fused.FUSED_MAX`` to change it.
"""

from __future__ import annotations

import sys
import threading
import weakref

import numpy as np

from xferlib._backend import as_cupy_stream, is_capturing, is_cupy_array, namespace_name
from xferlib._kernels.rows import FUSED_CHUNK_MAX, FUSED_THREADS, GATHER_FUSED, SCATTER_FUSED
from xferlib.checks import PendingChecks, SlotChecks
from xferlib.memory import device_pointer, is_gpu_mapped, registration_of


# ----------------------------------------------------------------------------- validation


INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def check_table(table, name: str = "table") -> None:
    namespace_name(table)
    if table.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows x row width), got shape {table.shape}")
    itemsize = table.dtype.itemsize
    if table.size == 0:  # no rows (or width 0): NumPy gives such arrays any strides
        return
    if table.shape[1] > 1 and table.strides[1] != itemsize:
        raise ValueError(f"{name} rows must be contiguous (strides {table.strides})")
    if table.strides[0] < 0 or table.strides[0] % itemsize:
        raise ValueError(f"{name} row stride {table.strides[0]} is not a positive multiple of "
                         f"its itemsize {itemsize}")


# ----------------------------------------------------------------------------- GPU helpers


# Device address of each registered pinned range's start (no driver call per launch).
_REGISTERED_BASES = weakref.WeakKeyDictionary()


def device_address(array, name: str) -> int:
    """Where a kernel finds ``array``: a CuPy array's pointer, or a pinned host array's
    device address (ValueError for pageable memory). Arrays inside a range xferlib
    registered are answered from a cache, without a driver call."""
    if is_cupy_array(array):
        return int(array.data.ptr)
    start = array.ctypes.data
    reg = registration_of(start, array.nbytes) if array.nbytes else None
    if reg is None:
        return device_pointer(array, name)
    base = _REGISTERED_BASES.get(reg)
    if base is None:
        import cupy

        base = _REGISTERED_BASES[reg] = int(
            cupy.cuda.runtime.pointerGetAttributes(reg.ptr).devicePointer)
    return base + (start - reg.ptr)


def is_gpu_reachable(array) -> bool:
    return is_cupy_array(array) or is_gpu_mapped(array)


def word_bytes(*values: int) -> int:
    """Largest access width (16, 8, 4, 2, 1 bytes) that divides every row width, stride and
    base address, so each lane's access stays aligned."""
    for word in (16, 8, 4, 2, 1):
        if all(v % word == 0 for v in values):
            return word
    return 1


_CHECKS = {}  # the pending verdicts of each device's calls (events belong to a device)
_CHECKS_LOCK = threading.Lock()
_MAX_PENDING = 4  # GPU calls whose verdict may be unread; a fifth waits for the oldest


def pending_checks():
    """This device's :class:`PendingChecks` (made on its first call)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    checks = _CHECKS.get(device)
    if checks is None:
        with _CHECKS_LOCK:
            checks = _CHECKS.setdefault(device, PendingChecks(limit=_MAX_PENDING))
    return checks


def poll_checks(wait: bool = False) -> None:
    for queues in (_CHECKS, _SLOT_CHECKS):
        for checks in tuple(queues.values()):
            checks.poll(wait)


# ----------------------------------------------------------------------------- fused path
#
# Batches of up to FUSED_MAX positions with CuPy indices and a GPU-reachable table take ONE
# launch: the kernel checks every index itself and writes its verdict into a pinned slot of
# this device's SlotChecks, so a call queues no sort, memset, copy or event. What a launch
# over a table needs (its device address, word width, kernel handles, an argument buffer the
# driver reads at launch) is computed on the table's first call and kept while the table
# lives, so a call costs a few attribute reads, one cuLaunchKernel and no DLPack exchange.

# Positions up to which gather_rows / scatter_rows take the fused kernel. It reads rows in
# batch order; the planned path sorts them first, which pays at larger batches (H100, pinned
# 8M-row table, random indices: 16k x 512 B rows 0.290 ms fused vs 0.326 planned, 64k 1.73 vs
# 0.97 ms; 16k x 256 B 0.233 vs 0.282, 64k 1.11 vs 0.50).
FUSED_MAX = 1 << 14
FUSED_BLOCKS_PER_SM = 1  # fused blocks (of FUSED_THREADS) per SM, at most, for a GPU table
# A table in pinned host RAM gets one block for every FUSED_HOST_SM_SHARE SMs: random rows read
# over the link miss the GPU's address translation, and fewer reads in flight miss less, down
# to a point (H100, 16k random rows of an 8M-row pinned table, 16 / 33 / 66 / 132 / 264 blocks:
# 512 B rows gathered at 22.5 / 32.4 / 28.6 / 28.0 / 23.2 GB/s, 256 B rows at 13.7 / 20.6 /
# 18.3 / 17.9 / 14.7; scatters alike).
FUSED_HOST_SM_SHARE = 4

_SLOT_CHECKS = {}  # device -> SlotChecks of the fused calls
_LAUNCHES = {}  # CuPy table's address and layout, or NumPy table's id -> _Launch
_SMS = {}  # device -> multiprocessor count
_HOST_ROWS = {}  # id(pinned out / src) -> (weak reference, shape, device address)


def _argument_slots() -> dict:
    """Where each fused-kernel argument sits in a table's argument buffer: its place in the
    kernels' declarations (gather_fused's arguments are scatter_fused's first twelve, the
    rows being ``out`` in one and ``src`` in the other; every one 8 bytes wide)."""
    gather = ["rows" + n[3:] if n.startswith("out") else n for n in GATHER_FUSED.names]
    scatter = ["rows" + n[3:] if n.startswith("src") else n for n in SCATTER_FUSED.names]
    if scatter[:len(gather)] != gather:
        raise ValueError(f"gather_fused's arguments {gather} must lead scatter_fused's")
    wide = [t for t, _ in SCATTER_FUSED.args if "*" not in t and t != "i64"]
    if wide:
        raise ValueError(f"scatter_fused's arguments must be 8 bytes wide, not {wide}")
    return {name: k for k, name in enumerate(scatter)}


_SLOTS_OF = _argument_slots()
_ARGS = len(_SLOTS_OF)
(_TABLE, _N_ROWS, _TABLE_STRIDE, _WIDTH, _IDX, _N, _ROWS, _ROWS_STRIDE, _GROUP, _SORTED, _VERDICT,
 _DONE, _CHUNK, _HASH_BITS) = (_SLOTS_OF[n] for n in (
    "table", "n_rows", "table_stride", "width", "idx", "n", "rows", "rows_stride", "group",
    "sorted", "verdict", "done", "chunk", "hash_bits"))


def _in_host_memory(ptr: int) -> bool:
    """Whether a CuPy array's memory is pinned host RAM (a CuPy view of it, as SpeedTorch's
    pinned collections are)."""
    import cupy

    try:
        return cupy.cuda.runtime.pointerGetAttributes(ptr).type == 1  # cudaMemoryTypeHost
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


class _Launch:
    """A table's fused-launch constants (see the comment above). Valid while ``ref()`` is the
    table and its shape, strides and dtype are unchanged."""

    __slots__ = ("ref", "shape", "strides", "dtype", "device", "word", "row_bytes", "blocks",
                 "sms", "functions", "args", "pointers", "params")

    def __init__(self, table, device: int):
        import ctypes

        import cupy

        self.ref = None if is_cupy_array(table) else weakref.ref(table)
        self.shape, self.strides, self.dtype, self.device = (table.shape, table.strides,
                                                             table.dtype, device)
        ptr = device_address(table, "table")
        self.row_bytes = table.shape[1] * table.dtype.itemsize
        self.word = word_bytes(self.row_bytes, table.strides[0], ptr)
        self.sms = _SMS.get(device)
        if self.sms is None:
            self.sms = _SMS[device] = cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device)
        host = not is_cupy_array(table) or _in_host_memory(ptr)
        self.blocks = (max(1, self.sms // FUSED_HOST_SM_SHARE) if host
                       else self.sms * FUSED_BLOCKS_PER_SM)
        self.functions = {}  # (op, word, index bytes) -> CUfunction
        # Every kernel argument is 8 bytes: one buffer, and the pointers the driver reads.
        self.args = (ctypes.c_uint64 * _ARGS)()
        self.args[_TABLE], self.args[_N_ROWS] = ptr, table.shape[0]
        base = ctypes.addressof(self.args)
        self.pointers = (ctypes.c_void_p * _ARGS)(*(base + 8 * i for i in range(_ARGS)))
        self.params = ctypes.addressof(self.pointers)

    def function(self, op: str, word: int, index_bytes: int) -> int:
        key = (op, word, index_bytes)
        found = self.functions.get(key)
        if found is None:
            from xferlib._kernels.rows import KEY_TYPES, ROWS_MODULE, WORD_TYPES

            decl = GATHER_FUSED if op == "gather" else SCATTER_FUSED
            found = self.functions[key] = decl.function(
                ROWS_MODULE, WORD_TYPES[word], KEY_TYPES[index_bytes]).kernel.ptr
        return found


def _launch_for(table, device: int):
    """The table's :class:`_Launch` on ``device``, or None where the fused path cannot read
    it (pageable memory, an unsupported layout). A CuPy table is known by its address and
    layout (views made per call, as the adapters do, find the same entry); a NumPy table by
    identity, as its memory may be unpinned and reused."""
    if is_cupy_array(table):
        key = (table.data.ptr, table.shape, table.strides, table.dtype, device)
        launch = _LAUNCHES.get(key)
        if launch is not None:
            return launch
    else:
        key = id(table)
        launch = _LAUNCHES.get(key)
        if (launch is not None and launch.ref() is table and launch.device == device
                and launch.shape == table.shape and launch.strides == table.strides
                and launch.dtype == table.dtype):
            return launch
    try:
        check_table(table)
    except (TypeError, ValueError):
        return None  # the planned path raises the error
    if table.shape[1] == 0 or not is_gpu_reachable(table):
        return None
    if len(_LAUNCHES) > 256:
        _LAUNCHES.clear()
    launch = _LAUNCHES[key] = _Launch(table, device)
    return launch


def _rows_address(rows, name: str):
    """Device address of ``out`` / ``src``: a CuPy array's pointer, or a pinned NumPy array's
    (cached per array); None for pageable memory."""
    if is_cupy_array(rows):
        return rows.data.ptr
    cached = _HOST_ROWS.get(id(rows))
    if cached is not None and cached[0]() is rows and cached[1] == rows.shape:
        return cached[2]
    if not is_gpu_reachable(rows):
        return None
    if len(_HOST_ROWS) > 256:
        _HOST_ROWS.clear()
    address = device_address(rows, name)
    _HOST_ROWS[id(rows)] = (weakref.ref(rows), rows.shape, address)
    return address


_LAUNCH_KERNEL = None  # the driver's cuLaunchKernel as CuPy binds it (set with a queue)


def _slot_checks(device: int) -> SlotChecks:
    """This device's queue of fused-call verdicts (made on its first call)."""
    global _LAUNCH_KERNEL
    checks = _SLOT_CHECKS.get(device)
    if checks is None:
        with _CHECKS_LOCK:
            checks = _SLOT_CHECKS.get(device)
            if checks is None:
                from cupy_backends.cuda.api.driver import launchKernel

                _LAUNCH_KERNEL = launchKernel
                checks = _SLOT_CHECKS[device] = SlotChecks(limit=_MAX_PENDING)
    return checks


def fused(op: str, table, idx, rows, stream, sorted_indices: bool):
    """Gather (``rows`` = ``out``, None: allocated) or scatter (``rows`` = ``src``) as one
    fused launch; returns ``out`` / ``table``, or None where the planned path must run (it
    also raises every input error). Kept short: this is the per-call host cost."""
    n = idx.shape[0]
    if (idx.ndim != 1 or not 0 < n <= FUSED_MAX or idx.dtype not in INDEX_DTYPES
            or not idx.flags.c_contiguous):
        return None
    cupy = sys.modules["cupy"]
    device = cupy.cuda.runtime.getDevice()
    launch = _launch_for(table, device)
    if launch is None:
        return None
    if rows is not None and (not isinstance(rows, (np.ndarray, cupy.ndarray))
                             or rows.dtype != launch.dtype or rows.shape != (n, launch.shape[1])
                             or (rows.shape[1] > 1 and rows.strides[1] != rows.dtype.itemsize)):
        return None  # the planned path names the error
    stream = as_cupy_stream(stream)
    poll_checks()  # an earlier call's bad batch raises here, before anything is queued
    if rows is None:
        with stream:
            rows = cupy.empty((n, launch.shape[1]), dtype=launch.dtype)
    address = _rows_address(rows, "out" if op == "gather" else "src")
    if address is None:
        return None
    stride = rows.strides[0]
    word = launch.word
    while (address | stride) & (word - 1):
        word >>= 1
    width = launch.row_bytes // word
    group = min(32, 1 << max(0, (width - 1).bit_length()))  # lanes per row
    function = launch.function(op, word, idx.dtype.itemsize)
    checks = _slot_checks(device)
    capturing = is_capturing(stream)
    with checks.lock:  # the slot ring, and this table's argument buffer (one per device)
        slot, verdict, counter = checks.take(capturing)
        args = launch.args
        args[_TABLE_STRIDE], args[_WIDTH] = launch.strides[0] // word, width
        args[_IDX], args[_N], args[_ROWS], args[_ROWS_STRIDE] = idx.data.ptr, n, address, \
            stride // word
        args[_GROUP], args[_SORTED] = group, 1 if sorted_indices else 0
        args[_VERDICT], args[_DONE] = verdict, counter
        if op == "gather":
            blocks = min(launch.blocks, -(-n * group // FUSED_THREADS))
        else:
            chunk = min(FUSED_CHUNK_MAX, -(-n // launch.blocks))
            blocks = -(-n // chunk)
            args[_CHUNK], args[_HASH_BITS] = chunk, (2 * chunk - 1).bit_length()
        _LAUNCH_KERNEL(function, blocks, 1, 1, FUSED_THREADS, 1, 1, 0, stream.ptr,
                       launch.params, 0)
        checks.commit(slot, (idx, launch.shape[0], _CALLERS[op]), (table, rows), stream,
                      capturing)
    return rows if op == "gather" else table


_CALLERS = {"gather": "gather_rows", "scatter": "scatter_rows"}
