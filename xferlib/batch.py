"""One batch plan and one input verdict for rows, host tables and TT.

A batch of row indices on the GPU is *planned* once (:func:`plan_batch`): every index is
checked against the table, positions are sorted by row (ties in batch order) and, where the
caller needs them, runs of equal rows are numbered. All of it is queued on ``stream``
without a host sync. The check leaves a :class:`Verdict` on the device: two uint64 words,
all ones while the batch is clean. Every later kernel of the batch reads those words and
writes nothing when they are set, so a bad batch changes nothing anywhere.

Checking policy (rows, host tables and TT alike):

* NumPy path: indices are checked on the host before anything is written; errors raise at
  once.
* GPU path: the verdict is *deferred* (:meth:`Verdict.defer`): copied asynchronously into a
  pinned slot of its owner's :class:`PendingChecks` (the row functions: one queue per
  device; each ``HostTable``; each TT module). The owner's next call polls the queue before
  it queues anything and raises for the oldest bad batch whose verdict has arrived; at most
  ``limit`` verdicts stay unread (a call past that waits for the oldest). An explicit check
  waits for every pending verdict: ``xferlib.check_rows()``, ``HostTable.check()``, a TT
  module's ``check_inputs()``.
* A step captured in a CUDA graph writes its verdict into its own pinned slot at every
  replay; the explicit check waits for the device, then reads those slots and
  reports a bad batch in the last replay of each captured step (and rearms the slot).
* :meth:`Verdict.raise_now` reads the verdict at once (one 16-byte copy, a stream sync), for
  callers that must know before they return.

Errors are IndexError for an index outside the table and ValueError for a broken promise
(unsorted ``presorted`` indices, bad TT offsets); each family's :class:`Verdict` report
words the message.

>>> import numpy as np, xferlib
>>> checks = xferlib.PendingChecks(limit=3)   # what a table or TT module owns
>>> checks.poll(wait=True)                    # nothing pending
>>> len(checks)
0
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from xferlib._backend import as_cupy_stream, is_capturing
from xferlib._kernels import grid_1d
from xferlib._kernels.rows import (MERGE_NAME, ROWS_MODULE, SMALL_SORT_ITEMS,
                                   SMALL_SORT_THREADS, check_name, small_sort_name,
                                   small_sort_shared_bytes)

__all__ = ["BatchPlan", "plan_batch", "sort_positions", "Verdict", "RowsReport",
           "PendingChecks", "SlotChecks", "NO_BAD", "PENDING", "index_error", "host_values",
           "run_ids"]

NO_BAD = int(np.iinfo(np.uint64).max)  # a verdict word with nothing to report
# Up to this many positions the tile sort + merges runs (no host sync, no device-wide sort);
# above it, CuPy's radix argsort, faster there (measured on the H200: equal at 65k, the
# merges cost 10-20% of a 262k-row transfer).
TILED_SORT_MAX = 1 << 16


def index_error(position: int, value: int, num_rows: int) -> IndexError:
    """The IndexError for ``value`` at ``position`` outside a table of ``num_rows`` rows."""
    return IndexError(f"index {value} at position {position} is out of range for a table of "
                      f"{num_rows} rows (valid: 0 <= index < {num_rows})")


# ----------------------------------------------------------------------------- verdicts


def host_values(array) -> list:
    """A small slice of a NumPy or CuPy array as Python ints (a report's values)."""
    get = getattr(array, "get", None)
    return [int(v) for v in (get() if get is not None else np.asarray(array))]


class RowsReport:
    """Words the verdict of a row batch: word 0 is the first position out of range, word 1 the
    first position out of order (a broken ``presorted`` promise). ``caller``: the function
    named when the report comes from a later call (the row functions); None for the plain
    message (host tables)."""

    __slots__ = ("idx", "num_rows", "caller")

    def __init__(self, idx, num_rows: int, caller: str | None = None):
        self.idx, self.num_rows, self.caller = idx, int(num_rows), caller

    def __call__(self, bad: int, unsorted: int) -> None:
        idx = self.idx
        note = "" if self.caller is None else \
            f"{self.caller} (an earlier call on the GPU; nothing was written): "
        if bad != NO_BAD:
            value, = host_values(idx[bad:bad + 1])
            raise IndexError(note + str(index_error(bad, value, self.num_rows)))
        before, value = host_values(idx[unsorted - 1:unsorted + 1])
        tail = "" if note else "; nothing was written"
        raise ValueError(f"{note}sorted_indices=True, but index {value} at position "
                         f"{unsorted} comes after {before}{tail}")


class Verdict:
    """The device-side result of a batch's input check: ``words``, two uint64 device words
    (all ones: clean), and ``report``, a callable taking the two words read on the host that
    raises the family's error (:class:`RowsReport`; TT plans bring their own).

    ``raise_now()`` reads the words at once; ``defer(queue)`` hands them to a
    :class:`PendingChecks`. ``checked`` turns True once a read found the batch clean.
    """

    __slots__ = ("words", "report", "checked")

    def __init__(self, words, report):
        self.words, self.report, self.checked = words, report, False

    @classmethod
    def clean(cls, report, stream=None) -> "Verdict":
        """A fresh verdict whose words are set to clean on ``stream`` (no host sync)."""
        import cupy

        words = cupy.empty(2, dtype=np.uint64)
        words.data.memset_async(0xFF, 16, as_cupy_stream(stream))
        return cls(words, report)

    def raise_for(self, host_words) -> None:
        """Raise for words read on the host; return (and mark it checked) when clean."""
        first, second = (int(v) for v in host_words)
        if first == NO_BAD and second == NO_BAD:
            self.checked = True
            return
        self.report(first, second)
        raise RuntimeError("a verdict report returned for a bad batch")  # a report must raise

    def raise_now(self, stream=None) -> None:
        """Read the words (one 16-byte copy; waits for ``stream``, default the current one)
        and raise for a bad batch. Free once the verdict was found clean."""
        if self.checked:
            return
        self.raise_for(self.words.get(stream=as_cupy_stream(stream)))

    def defer(self, queue: "PendingChecks", stream=None, keep=(), early: bool = True) -> None:
        """Queue the check on ``queue`` (see :meth:`PendingChecks.push`)."""
        queue.push(self, stream, keep=keep, early=early)


# ----------------------------------------------------------------------------- pending checks

_RING = 64  # pinned slots of uncaptured verdicts, reused round-robin
_GRAPH_SLOTS = 64  # pinned slots handed once each to captured verdicts


class _Entry:
    __slots__ = ("verdict", "host", "slot", "event", "keep", "early", "device", "stream")

    def __init__(self, verdict, host, slot, event, keep, early, device=None, stream=None):
        self.verdict, self.host, self.slot, self.event = verdict, host, slot, event
        self.keep, self.early, self.device, self.stream = keep, early, device, stream


def _still_capturing(stream) -> bool:
    """Whether a captured push's stream is still capturing (a stream since destroyed is not)."""
    try:
        return is_capturing(stream)
    except Exception:  # noqa: BLE001  (CUDA errors of a destroyed stream handle)
        return False


class PendingChecks:
    """Verdicts on their way to pinned host memory, oldest first: the one deferred-check queue
    of the row functions (one per device), each host table and each TT module.

    ``push(verdict, stream)`` queues a 16-byte device-to-host copy and an event on ``stream``
    (no host sync, no host allocation after the first push); ``poll()`` raises for the oldest
    bad verdict that has arrived and waits for the oldest while ``limit`` or more are unread
    (so a call that polls before it pushes leaves at most ``limit`` unread); ``poll(wait=True)``
    waits for every one and then re-reads the slots that graph replays wrote. A failed check
    is reported once. Thread-safe (XLA callbacks may run on several threads).

    >>> q = PendingChecks(limit=2)
    >>> q.poll(), len(q)
    (None, 0)
    """

    def __init__(self, limit: int = 3):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = int(limit)
        self.entries = collections.deque()
        self.graph = []  # entries of captured pushes; their slots are rewritten by replays
        self.lock = threading.RLock()
        self.host = None  # pinned (_RING + _GRAPH_SLOTS, 2) uint64, on the first push
        self.events = [None] * _RING
        self.device = None
        self.next = 0
        self.next_graph = _RING

    def __len__(self) -> int:
        return len(self.entries)

    def _allocate(self) -> None:
        import cupy
        import cupyx

        self.host = cupyx.empty_pinned((_RING + _GRAPH_SLOTS, 2), dtype=np.uint64)
        self.host[...] = NO_BAD
        self.device = cupy.cuda.runtime.getDevice()

    def push(self, verdict: Verdict, stream=None, keep=(), early: bool = True) -> None:
        """Copy ``verdict`` toward the host on ``stream``. ``keep``: arrays that must outlive
        the batch's kernels (a temporary pinned table freed while a kernel still reads it
        would be reused under it); held until the verdict is read. ``early=False``: read
        only when the queue is full or on ``poll(wait=True)``, never because it arrived
        (ranks of a process group then raise at the same call)."""
        import cupy
        import cupyx

        stream = as_cupy_stream(stream)
        with self.lock:
            if self.host is None:
                self._allocate()
            if is_capturing(stream):
                # A graph's copy node writes this slot at every replay; no event (none can be
                # queried in a capture).
                if self.next_graph < len(self.host):
                    host, self.next_graph = self.host[self.next_graph], self.next_graph + 1
                else:
                    host = cupyx.empty_pinned(2, dtype=np.uint64)
                    host[...] = NO_BAD
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data, verdict.words.data.ptr, 16,
                                              cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                self.graph.append(_Entry(verdict, host, None, None, keep, early,
                                         cupy.cuda.runtime.getDevice(), stream))
                return
            if not self.entries and cupy.cuda.runtime.getDevice() != self.device:
                self._allocate()  # the owner moved to another device: a ring of its own
                self.events, self.next = [None] * _RING, 0
            busy = {e.slot for e in self.entries}
            slot = self.next
            if slot in busy or cupy.cuda.runtime.getDevice() != self.device:
                # every ring slot unread (a caller that never polls) or another device's
                # events: a slot of its own
                slot, host = None, cupyx.empty_pinned(2, dtype=np.uint64)
                event = cupy.cuda.Event(block=False, disable_timing=True)
            else:
                self.next = (slot + 1) % _RING
                host = self.host[slot]
                event = self.events[slot]
                if event is None:
                    event = self.events[slot] = cupy.cuda.Event(block=False,
                                                                disable_timing=True)
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, verdict.words.data.ptr, 16,
                                          cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            event.record(stream)
            self.entries.append(_Entry(verdict, host, slot, event, keep, early))

    def poll(self, wait: bool = False) -> None:
        """Raise for the oldest bad verdict that is in (see the class docstring)."""
        if not self.entries and not (wait and self.graph):
            return
        with self.lock:
            entries = self.entries
            while entries and (wait or len(entries) >= self.limit
                               or (entries[0].early and entries[0].event.done)):
                entry = entries.popleft()
                entry.event.synchronize()
                entry.verdict.raise_for(entry.host)
            if wait and self.graph and not any(_still_capturing(e.stream) for e in self.graph):
                # Replays may run on any stream and carry no event: wait for the devices the
                # graphs were captured on, so a check right after graph.replay() reads that
                # replay's verdict. (Not while a capture is under way: a check inside it,
                # e.g. a torch adapter's after its op, reads the eager verdicts only.)
                import cupy

                for device in {e.device for e in self.graph}:
                    with cupy.cuda.Device(device):
                        cupy.cuda.runtime.deviceSynchronize()
                read = [(e.verdict, e.host.copy()) for e in self.graph]
                for e in self.graph:
                    e.host[...] = NO_BAD  # the next replay writes it again
                for verdict, words in read:
                    verdict.checked = False
                    verdict.raise_for(words)

    # A module holding a queue is copied or pickled with an empty one (a lock, events and
    # pinned slots belong to this process and this queue's copies in flight).
    def __getstate__(self):
        return {"limit": self.limit}

    def __setstate__(self, state):
        self.__init__(state["limit"])

    def pending(self) -> bool:
        """Whether some verdict is still unread (captured ones excepted)."""
        return bool(self.entries)


PENDING = NO_BAD - 1  # word 0 of a slot whose kernel has not written its verdict yet


def _stream_idle(stream) -> bool:
    """Whether ``stream`` has no work left (CUDA errors raise); True for a stream since
    destroyed, once the device is idle."""
    import cupy

    try:
        return stream.done
    except cupy.cuda.runtime.CUDARuntimeError:
        cupy.cuda.runtime.deviceSynchronize()
        return True


class SlotChecks:
    """The deferred checks of kernels that write their verdict themselves (the fused row
    kernels): no copy, event or memset per call.

    Each call takes a pinned host slot (two uint64 words, word 0 set to :data:`PENDING`) and a
    device ticket counter; its kernel's last block writes word 1 then word 0, so word 0 no
    longer PENDING means the kernel finished. Reading a slot is one host load. The rules are
    :class:`PendingChecks`': ``poll()`` raises for the oldest bad verdict that is in and waits
    while ``limit`` or more are unread; ``poll(wait=True)`` waits for all and reads the slots
    that graph replays wrote. Callers hold ``lock`` from :meth:`take` to :meth:`commit`. A
    bad verdict raises through :class:`RowsReport` (``commit``'s ``report``: its arguments,
    made into a report only then).

    >>> SlotChecks.__name__   # GPU only: checks = SlotChecks(limit=4)
    'SlotChecks'
    """

    def __init__(self, limit: int = 4):
        import cupy
        import cupyx

        self.limit = int(limit)
        self.device = cupy.cuda.runtime.getDevice()
        count = _RING + _GRAPH_SLOTS
        self.host = cupyx.empty_pinned((count, 2), dtype=np.uint64)
        self.host[...] = NO_BAD
        self.words = memoryview(self.host.reshape(-1)).cast("B").cast("Q")
        self.host_ptr = int(cupy.cuda.runtime.pointerGetAttributes(
            self.host.ctypes.data).devicePointer)
        self.counters = cupy.zeros(count, dtype=np.uint32)
        self.counters_ptr = int(self.counters.data.ptr)
        self.entries = collections.deque()  # (slot, report, keep, stream), oldest first
        self.graph = []  # (words, report, keep, stream) of captured launches
        self.busy = [False] * _RING
        self.next = 0
        self.next_graph = _RING
        self.lock = threading.Lock()

    def take(self, capturing: bool):
        """A slot for the next launch: ``(slot, verdict address, counter address)``; a slot
        of its own (words clean until a replay writes them) in a stream capture."""
        if capturing:
            if self.next_graph < len(self.busy) + _GRAPH_SLOTS:
                slot, self.next_graph = self.next_graph, self.next_graph + 1
                return slot, self.host_ptr + 16 * slot, self.counters_ptr + 4 * slot
            import cupy
            import cupyx

            extra = cupyx.empty_pinned(2, dtype=np.uint64)  # kept by commit()
            extra[...] = NO_BAD
            counter = cupy.zeros(1, dtype=np.uint32)
            address = int(cupy.cuda.runtime.pointerGetAttributes(
                extra.ctypes.data).devicePointer)
            return (extra, counter), address, int(counter.data.ptr)
        slot = self.next
        while self.busy[slot]:  # every ring slot unread: read the oldest
            self._pop(wait=True)
        self.words[2 * slot] = PENDING
        return slot, self.host_ptr + 16 * slot, self.counters_ptr + 4 * slot

    def commit(self, slot, report, keep, stream, capturing: bool) -> None:
        """Record the launch made with ``slot``: ``report``, the ``(idx, num_rows, caller)``
        of a :class:`RowsReport` for a bad verdict; ``keep`` is held until the verdict is
        read."""
        if capturing:
            if isinstance(slot, tuple):
                words = memoryview(slot[0]).cast("B").cast("Q")
                keep = (keep, slot)
            else:
                words = self.words[2 * slot:2 * slot + 2]
            self.graph.append((words, report, keep, stream))
            return
        self.busy[slot] = True
        self.next = (slot + 1) % _RING
        self.entries.append((slot, report, keep, stream))

    def __len__(self) -> int:
        return len(self.entries)

    def _pop(self, wait: bool) -> bool:
        """Read the oldest entry if it is in (or ``wait``); False when it is not."""
        slot, report, _, stream = self.entries[0]
        words = self.words
        spins = 0
        while words[2 * slot] == PENDING:
            if not wait:
                return False
            spins += 1
            if spins % 64 == 0:
                time.sleep(0)  # let other threads run while the device works
                if _stream_idle(stream) and words[2 * slot] == PENDING:
                    raise RuntimeError("a row kernel finished without writing its verdict")
        self.entries.popleft()
        self.busy[slot] = False
        first, second = words[2 * slot], words[2 * slot + 1]
        if first & second != NO_BAD:
            RowsReport(*report)(first, second)
        return True

    def poll(self, wait: bool = False) -> None:
        """Raise for the oldest bad verdict that is in (see the class docstring)."""
        entries = self.entries
        if not entries and not (wait and self.graph):
            return
        with self.lock:
            while entries and self._pop(wait or len(entries) >= self.limit):
                pass
            if wait and self.graph and not any(_still_capturing(e[3]) for e in self.graph):
                import cupy

                with cupy.cuda.Device(self.device):
                    cupy.cuda.runtime.deviceSynchronize()
                read = [(report, words[0], words[1]) for words, report, _, _ in self.graph]
                for words, _, _, _ in self.graph:
                    words[0] = words[1] = NO_BAD  # the next replay writes them again
                for report, first, second in read:
                    if first & second != NO_BAD:
                        RowsReport(*report)(first, second)


# ----------------------------------------------------------------------------- sorting

_IDENTITY = {}


def _identity_permutation(n: int):
    """``arange(n)`` as int64, sliced from a cached array per device (no launch per call)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    cached = _IDENTITY.get(device)
    if cached is None or cached.size < n:
        cached = _IDENTITY[device] = cupy.arange(max(n, 1 << 16), dtype=np.int64)
    return cached[:n]


_SORT_KERNELS = {}  # (device, index dtype, items) -> (sort kernel, its shared bytes, merge)


def _sort_kernels(dtype_name: str, items: int):
    """The tile sort of ``items`` per thread for ``dtype_name`` indices, its dynamic shared
    memory (opted in once: an attribute query is a driver call) and the merge kernel, on the
    current device; looked up once per device."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), dtype_name, items)
    found = _SORT_KERNELS.get(key)
    if found is None:
        kernel = ROWS_MODULE.get_function(small_sort_name(dtype_name, items))
        shared = small_sort_shared_bytes(items)
        if kernel.max_dynamic_shared_size_bytes < shared:
            kernel.max_dynamic_shared_size_bytes = shared
        found = _SORT_KERNELS[key] = (kernel, shared, ROWS_MODULE.get_function(MERGE_NAME))
    return found


def _sort_tiled(idx, num_rows: int, stream, scratch=None, scratch_result=False):
    """:func:`sort_positions` without a device-wide sort or a host sync: tiles of up to
    2,048 positions are checked, narrowed and sorted by one block each (one launch), then
    merged pairwise (one launch per doubling). A single tile is one launch. ``scratch``:
    see :func:`sort_positions`."""
    import cupy

    n = idx.size
    items = next((i for i in SMALL_SORT_ITEMS if i * SMALL_SORT_THREADS >= n),
                 SMALL_SORT_ITEMS[-1])
    tile = items * SMALL_SORT_THREADS
    merges, width = 0, tile
    while width < n:
        merges, width = merges + 1, width * 2
    # The merges ping-pong between two pairs of buffers: the pair that ends up holding the
    # result comes from the scratch only if the caller lets the result be scratch.
    fresh = lambda name, dtype: cupy.empty(n, dtype=dtype)  # noqa: E731
    first = second = fresh
    if scratch is not None:
        reused = lambda name, dtype: scratch.empty(name, n, dtype)  # noqa: E731
        result_pair = reused if scratch_result else fresh
        first, second = (result_pair, reused) if merges % 2 == 0 else (reused, result_pair)
    rows = first("rows", np.int32)
    perm = first("perm", np.int64)
    words = (cupy.empty(2, dtype=np.uint64) if scratch is None
             else scratch.empty("words", 2, np.uint64))
    words.data.memset_async(0xFF, 16, stream)
    kernel, shared, merge = _sort_kernels(idx.dtype.name, items)
    bits = max(1, int(num_rows - 1).bit_length())
    grid, _ = grid_1d(n, tile)  # one block per tile
    kernel(grid, (SMALL_SORT_THREADS,), (idx, np.int64(n), np.int64(num_rows), np.int32(bits),
                                         rows, perm, words),
           shared_mem=shared, stream=stream)
    width = tile
    if width < n:
        rows_b, perm_b = second("rows_b", np.int32), second("perm_b", np.int64)
        grid, block = grid_1d(n, 256, 65535)
        n64 = np.int64(n)
        while width < n:
            merge(grid, block, (rows, perm, n64, np.int64(width), rows_b, perm_b),
                  stream=stream)
            rows, rows_b, perm, perm_b = rows_b, rows, perm_b, perm
            width *= 2
    return rows, perm, words


def sort_positions(idx, num_rows: int, *, stream=None, presorted: bool = False,
                   tiled_max: int | None = None, scratch=None, scratch_result: bool = False):
    """Check GPU indices and sort positions by row, all queued on ``stream`` without a host
    sync: ``(keys, perm, words)``.

    ``keys`` are the rows in ascending order (int32 where the table allows), ``perm`` maps
    each sorted position to its batch position (ties in batch order), ``words`` the two
    verdict words (first position out of range, first position out of order; all ones when
    clean). ``presorted``: the caller promises ascending indices; they are checked, not
    sorted. ``tiled_max`` (default :data:`TILED_SORT_MAX`): up to this many positions the
    tile sort + merges runs; above, CuPy's argsort, whose Thrust call waits for the device (a
    host sync). ``scratch`` (an ``xferlib.tt.scratch.Scratch``, tile sort only): the working
    buffers and ``words`` come from it (the caller reads ``words`` within the call), and
    ``keys`` / ``perm`` too with ``scratch_result``; none is allocated per call.
    """
    import cupy

    stream = as_cupy_stream(stream)
    n = idx.size
    if tiled_max is None:
        tiled_max = TILED_SORT_MAX
    with stream:
        if not presorted and n <= tiled_max and num_rows <= np.iinfo(np.int32).max:
            return _sort_tiled(idx, num_rows, stream, scratch, scratch_result)
        narrow = idx.dtype == np.int64 and num_rows <= np.iinfo(np.int32).max
        keys32 = cupy.empty(n, dtype=np.int32) if narrow else None
        words = cupy.empty(2, dtype=np.uint64)
        words.data.memset_async(0xFF, 16, stream)
        grid, block = grid_1d(n, 256, 4096)
        ROWS_MODULE.get_function(check_name(idx.dtype.name))(
            grid, block, (idx, np.int64(n), np.int64(num_rows), words,
                          keys32 if keys32 is not None else np.uint64(0), np.int32(presorted)),
            stream=stream)
        keys = keys32 if narrow else idx
        if presorted:
            return keys, _identity_permutation(n), words
        perm = cupy.argsort(keys)  # stable radix sort on the current (= our) stream
        # Sorted rows side by side: the kernels read them coalesced, one hop from the row.
        return keys.take(perm), perm, words


# ----------------------------------------------------------------------------- plans


@dataclasses.dataclass(eq=False)
class BatchPlan:
    """A batch planned on the GPU.

    ``idx``: the batch's indices; ``keys``: its rows in ascending order; ``perm``: the batch
    position of each sorted position; ``run``: the run id of each sorted position (equal rows
    share one; ``runs=True``), so ``keys[run == r]`` is the r-th distinct row; ``verdict``: the
    input check (:class:`Verdict`); ``slots``: where a cache put each run's row (set by the
    host table's cache); ``staged`` / ``writes``: a host table lookup's copy of the distinct
    rows' weights in HBM (run r at row r) and the table's write count when it was taken.
    """

    idx: object
    keys: object
    perm: object
    verdict: Verdict
    run: object = None
    slots: object = None
    staged: object = None
    writes: int = -1

    @property
    def n(self) -> int:
        return int(self.keys.size)


def plan_batch(idx, num_rows: int, *, stream=None, presorted: bool = False,
               runs: bool = False, caller: str | None = None,
               tiled_max: int | None = None) -> BatchPlan:
    """Check and sort GPU indices ``idx`` against a table of ``num_rows`` rows, queued on
    ``stream`` (default: CuPy's current stream), without a host sync.

    ``presorted``: the caller promises ascending indices (checked, not sorted). ``runs``:
    number the runs of equal rows too (``BatchPlan.run``). ``caller``: the function a deferred
    report names (see :class:`RowsReport`). ``tiled_max``: see :func:`sort_positions`.

    >>> import xferlib
    >>> xferlib.plan_batch.__name__   # GPU only: plan = plan_batch(cupy_idx, 1000, stream=s)
    'plan_batch'
    """
    stream = as_cupy_stream(stream)
    keys, perm, words = sort_positions(idx, num_rows, stream=stream, presorted=presorted,
                                       tiled_max=tiled_max)
    plan = BatchPlan(idx, keys, perm, Verdict(words, RowsReport(idx, num_rows, caller)))
    if runs:
        plan.run = run_ids(keys, stream)
    return plan


def run_ids(keys, stream):
    """The run id of each position of sorted ``keys`` (0 for the first run), on ``stream``."""
    import cupy

    from xferlib._kernels import grid_1d
    from xferlib._kernels.table import (RUN_IDS_MAX, TABLE_MODULE, run_ids_name,
                                        run_starts_name)

    n = keys.size
    with stream:
        if n <= RUN_IDS_MAX:  # one block numbers them all
            run = cupy.empty(n, dtype=np.int64)
            if n:
                TABLE_MODULE.get_function(run_ids_name(keys.dtype.itemsize))(
                    (1,), (1024,), (keys, np.int64(n), run), stream=stream)
            return run
        flags = cupy.empty(n, dtype=np.int64)
        grid, block = grid_1d(n, 256, 4096)
        TABLE_MODULE.get_function(run_starts_name(keys.dtype.itemsize))(
            grid, block, (keys, np.int64(n), flags), stream=stream)
        run = cupy.cumsum(flags)
        run -= 1
        return run
