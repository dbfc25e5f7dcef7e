"""Input verdicts and the queues that read them: the checking side of :mod:`xferlib.batch`.

A :class:`Verdict` is a batch's input check on the device (two uint64 words, all ones while
the batch is clean) with the report that words its error (:class:`RowsReport` for row
batches). :class:`PendingChecks` carries deferred verdicts to pinned host memory and raises
for a bad one at the owner's next call or explicit check; :class:`SlotChecks` does the same
for kernels that write their verdict themselves. The checking policy is documented in
:mod:`xferlib.batch`, which re-exports every name here.

>>> import xferlib.checks as checks
>>> q = checks.PendingChecks(limit=2)
>>> q.poll(wait=True), len(q)
(None, 0)
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from xferlib._backend import as_cupy_stream, finish_current_stream, is_capturing
from xferlib.sizes import integral_size

__all__ = ["Verdict", "RowsReport", "PendingChecks", "SlotChecks", "NO_BAD", "PENDING",
           "index_error", "host_values"]

NO_BAD = int(np.iinfo(np.uint64).max)  # a verdict word with nothing to report


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
        # The bad index and its position first, where a reader (or a JAX user's handler)
        # looks; which call queued the batch after it.
        note = ("; nothing was written" if self.caller is None else
                f" (in an earlier call of {self.caller} on the GPU; nothing was written)")
        if bad != NO_BAD:
            value, = host_values(idx[bad:bad + 1])
            message = str(index_error(bad, value, self.num_rows))
            raise IndexError(message + (note if self.caller is not None else ""))
        before, value = host_values(idx[unsorted - 1:unsorted + 1])
        raise ValueError(f"sorted_indices=True, but index {value} at position {unsorted} "
                         f"comes after {before}{note}")


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

    def defer(self, queue: "PendingChecks", stream=None, keep=(), early: bool = True,
              copy=None) -> None:
        """Queue the check on ``queue`` (see :meth:`PendingChecks.push`)."""
        queue.push(self, stream, keep=keep, early=early, copy=copy)


# ----------------------------------------------------------------------------- pending checks

_RING = 64  # pinned slots of uncaptured verdicts, reused round-robin
_GRAPH_SLOTS = 64  # pinned slots of captured verdicts (PendingChecks: reused round-robin)


class _Entry:
    __slots__ = ("verdict", "host", "slot", "event", "keep", "early", "device", "stream")

    def __init__(self, verdict, host, slot, event, keep, early, device=None, stream=None):
        self.verdict, self.host, self.slot, self.event = verdict, host, slot, event
        self.keep, self.early, self.device, self.stream = keep, early, device, stream


def _copy_to_host(words, host, stream, copy=None) -> None:
    """A verdict's two device ``words`` written to its pinned ``host`` slot on ``stream`` by a
    one-thread-block kernel (``xferlib/_kernels/verdict.py``: a copy node would hold the
    stream's next kernel back several microseconds), or by ``copy(address)`` when given: the
    caller's own next kernel, which writes them there (no launch of its own)."""
    if copy is not None:
        copy(host.ctypes.data)
        return
    from xferlib._kernels.verdict import VERDICT_COPY, VERDICT_MODULE

    VERDICT_COPY.launch(VERDICT_MODULE, (), (1,), (32,), stream=stream, words=words,
                        host=host.ctypes.data)


def _still_capturing(stream) -> bool:
    """Whether a captured push's stream is still capturing (a stream since destroyed is not)."""
    try:
        return is_capturing(stream)
    except Exception:  # noqa: BLE001  (CUDA errors of a destroyed stream handle)
        return False


class PendingChecks:
    """Verdicts on their way to pinned host memory, oldest first: the one deferred-check queue
    of the row functions (one per device), each host table and each TT module.

    ``push(verdict, stream)`` queues the verdict's copy to a pinned slot (a one-block kernel,
    or the caller's next kernel: ``copy``) and an event on ``stream`` (no host sync, no host
    allocation after the first push); ``poll()`` raises for the oldest bad verdict that has
    arrived and waits for the oldest while ``limit`` or more are unread (so a call that polls
    before it pushes leaves at most ``limit`` unread); ``poll(wait=True)`` waits for every
    one, raises the first failure (dropping the later ones: each refused batch changed
    nothing) and then re-reads the slots that graph replays wrote. A failed check is
    reported once. Thread-safe (XLA callbacks may run on several threads).

    >>> q = PendingChecks(limit=2)
    >>> q.poll(), len(q)
    (None, 0)
    """

    def __init__(self, limit: int = 3):
        limit = integral_size("limit", limit)  # 1.5 or True is no count of batches
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.entries = collections.deque()
        # entries of captured pushes by slot; their slots are rewritten by replays
        self.graph = {}
        self.graph_memory = []  # device memory of captured pushes whose slot was taken over
        self.lock = threading.RLock()
        self.host = None  # pinned (_RING + _GRAPH_SLOTS, 2) uint64, on the first push
        self.events = [None] * _RING
        self.device = None
        self.next = 0
        self.next_graph = _RING
        self.held = None  # the first failure a poll(hold=True) kept for poll(wait=True)
        self.failed = None  # a failure of no batch's input, for poll(wait=True): fail_at_check

    def __len__(self) -> int:
        return len(self.entries)

    def _allocate(self) -> None:
        import cupy
        import cupyx

        self.host = cupyx.empty_pinned((_RING + _GRAPH_SLOTS, 2), dtype=np.uint64)
        self.host[...] = NO_BAD
        self.device = cupy.cuda.runtime.getDevice()

    def reserve(self) -> None:
        """Allocate the pinned ring now, on the current device, instead of at the first push:
        for a caller whose pushes must not allocate pinned memory (a fresh pinned block waits
        for every device; see ``HostTable.prepare_gpu``)."""
        with self.lock:
            if self.host is None:
                self._allocate()

    def push(self, verdict: Verdict, stream=None, keep=(), early: bool = True,
             copy=None) -> None:
        """Copy ``verdict`` toward the host on ``stream``. ``keep``: arrays that must outlive
        the batch's kernels (a temporary pinned table freed while a kernel still reads it
        would be reused under it); held until the verdict is read. ``early=False``: read
        only when the queue is full or on ``poll(wait=True)``, never because it arrived
        (ranks of a process group then raise at the same call). ``copy``: a function of the
        pinned slot's address that queues, on ``stream``, the caller's next kernel, which
        writes the verdict's two words there once no later kernel changes them (in place
        of the copy's own launch); called exactly once."""
        import cupy
        import cupyx

        stream = as_cupy_stream(stream)
        with self.lock:
            if self.host is None:
                self._allocate()
            if is_capturing(stream):
                # A graph's copy kernel writes this slot at every replay; no event (none can be
                # queried in a capture). The slots go round: recordings can be made without
                # end (XLA records again whenever a step's buffers move), each slot and its
                # pinned memory stays, and the newest recording takes over the slot of the
                # one _GRAPH_SLOTS recordings older (should both still replay, the slot
                # holds the verdict of whichever replayed last). The older one's device
                # words and kept arrays stay allocated: its graph may still write or read
                # them (a few bytes a recording).
                slot = _RING + (self.next_graph - _RING) % _GRAPH_SLOTS
                self.next_graph += 1
                host = self.host[slot]
                _copy_to_host(verdict.words, host, stream, copy)
                older = self.graph.pop(slot, None)  # re-inserted last: dicts keep push order
                if older is not None:
                    self.graph_memory.append((older.verdict.words, older.keep))
                self.graph[slot] = _Entry(verdict, host, slot, None, keep, early,
                                          cupy.cuda.runtime.getDevice(), stream)
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
            _copy_to_host(verdict.words, host, stream, copy)
            event.record(stream)
            self.entries.append(_Entry(verdict, host, slot, event, keep, early))

    def fail_at_check(self, error: Exception) -> None:
        """Keep ``error`` (unless one is kept already) for the next ``poll(wait=True)``, which
        raises it once the verdicts read before it raised nothing; for a caller whose own
        raise may not reach the user (a callback XLA records, whose failure XLA may only
        log). The verdicts are read and raised as before."""
        with self.lock:
            self.failed = self.failed or error

    def poll(self, wait: bool = False, hold: bool = False) -> None:
        """Raise for the oldest bad verdict that is in (see the class docstring).

        ``hold``: read the verdicts as usual (the queue stays bounded) but keep the first
        failure instead of raising it; the next ``poll(wait=True)`` raises it (later
        failures before that call are read and dropped: every refused batch changed
        nothing, and the first names the bad input). For callers in a collective step,
        where raising on one rank alone would strand the others."""
        if not self.entries and not (wait and (self.graph or self.held or self.failed)):
            return
        with self.lock:
            entries = self.entries
            while entries and (wait or len(entries) >= self.limit
                               or (entries[0].early and entries[0].event.done)):
                entry = entries.popleft()
                entry.event.synchronize()
                # A wait reads every verdict and raises the first failure: the later ones
                # were refused too (nothing changed) and would only repeat it at later calls.
                if not (hold or wait or self.held):
                    entry.verdict.raise_for(entry.host)
                    continue
                try:
                    entry.verdict.raise_for(entry.host)
                except Exception as err:  # noqa: BLE001 - kept, raised by poll(wait=True)
                    self.held = self.held or err
            if wait and self.held is not None:
                error, self.held = self.held, None
                raise error
            graph = list(self.graph.values())
            if wait and graph and not any(_still_capturing(e.stream) for e in graph):
                # Replays may run on any stream and carry no event: wait for the devices the
                # graphs were captured on, so a check right after graph.replay() reads that
                # replay's verdict. (Not while a capture is under way: a check inside it,
                # e.g. a torch adapter's after its op, reads the eager verdicts only.)
                import cupy

                for device in {e.device for e in graph}:
                    with cupy.cuda.Device(device):
                        cupy.cuda.runtime.deviceSynchronize()
                read = [(e.verdict, e.host.copy()) for e in graph]
                for e in graph:
                    e.host[...] = NO_BAD  # the next replay writes it again
                for verdict, words in read:
                    verdict.checked = False
                    verdict.raise_for(words)
            if wait and self.failed is not None:
                error, self.failed = self.failed, None
                raise error

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
        # zeroed on CuPy's current stream; the checked kernels may run on another
        # (non-blocking) stream and must find the zeros there
        finish_current_stream()
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
