"""The GPU half of a HostTable: planning a batch, the lookup and update launches, deferred
input checks.

A step takes no host synchronization. Indices are checked by the sort kernel, which leaves a
16-byte verdict on the device; every later kernel of the batch reads it and writes nothing
when it is set. The verdict is copied to pinned host memory asynchronously and read by a
later call (at the latest once the device is two batches behind, or by ``check()``, or by
anything that flushes), which raises IndexError then. Allocations depend on the batch size
only, so a step at a fixed batch size can be captured in a CUDA graph.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from xferlib._backend import as_cupy_stream, is_capturing, is_cupy_array
from xferlib.memory import device_pointer
from xferlib.rows import raise_if_bad, sorted_positions, to_gpu_indices
from xferlib.table.cache import DeviceCache

_NO_BAD = np.iinfo(np.uint64).max
_MAX_PENDING_CHECKS = 2  # the host may run this many unchecked batches ahead of the device


@dataclasses.dataclass(eq=False)
class Plan:
    """A batch on the GPU: indices checked and sorted, runs of equal rows numbered, and (with
    a cache) the slot of each run's row when it was looked up."""

    idx: object
    keys: object
    perm: object
    run: object
    verdict: object
    slots: object = None

    @property
    def n(self) -> int:
        return int(self.keys.size)


_RING = 16  # pinned verdict slots of uncaptured batches (more than _MAX_PENDING_CHECKS + 1)


class _VerdictRing:
    """Pinned 16-byte slots and their events, allocated once and reused round-robin: a
    step allocates no host memory. A slot is reused only after its check was resolved
    (at most ``_MAX_PENDING_CHECKS + 1`` are pending)."""

    def __init__(self):
        import cupyx

        self.host = cupyx.empty_pinned((_RING, 2), dtype=np.uint64)
        self.events = [None] * _RING
        self.next = 0

    def take(self):
        import cupy

        slot, self.next = self.next, (self.next + 1) % _RING
        if self.events[slot] is None:
            self.events[slot] = cupy.cuda.Event(block=False, disable_timing=True)
        return self.host[slot], self.events[slot]


class _PendingCheck:
    """A batch's verdict on its way to the host (pinned memory, an event on the stream)."""

    def __init__(self, plan: Plan, num_rows: int, stream, capturing: bool, ring=None):
        import cupy
        import cupyx

        self.plan, self.num_rows = plan, num_rows
        self.event = None
        if capturing or ring is None:  # a graph's copy node keeps its own buffer
            self.host = cupyx.empty_pinned(2, dtype=np.uint64)
        else:
            self.host, self.event = ring.take()
        self.host[...] = _NO_BAD
        cupy.cuda.runtime.memcpyAsync(self.host.ctypes.data, plan.verdict.data.ptr, 16,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        if not capturing:  # in a graph the copy is a node; read it after a replay (check())
            if self.event is None:
                self.event = cupy.cuda.Event(block=False, disable_timing=True)
            self.event.record(stream)

    @property
    def ready(self) -> bool:
        return self.event is None or self.event.done

    def resolve(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        if (self.host != _NO_BAD).any():
            import cupy

            raise_if_bad(self.plan.verdict, self.plan.idx, self.num_rows,
                          cupy.cuda.get_current_stream())


class DeviceSide:
    """Kernels, the hot-row cache, the prefetch stream and the pending input checks."""

    def __init__(self, table, weights, state):
        """``weights`` and ``state``: the table's pinned host arrays (their addresses and
        strides go into every launch)."""
        import cupy

        self.table = table
        layout = table.layout
        self.dtype_name = table.dtype.name
        self.w_ptr = device_pointer(weights.view(np.ndarray), "weights")
        self.s_ptr = device_pointer(state.view(np.ndarray), "state")
        self.w_stride = weights.strides[0] // table.dtype.itemsize
        self.s_stride = state.strides[0] // table.dtype.itemsize
        self.vec = self._vector_width(layout)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Kernels that reach host RAM are latency-bound: a few blocks per SM keep enough
        # loads in flight for the link; prefetches take fewer, leaving SMs to the compute
        # they overlap.
        self.max_blocks, self.prefetch_blocks = 4 * sms, max(8, sms // 4)
        self.hyper = None
        self.pending = None  # the prefetch in flight (xferlib/table/prefetch.py)
        self.side_stream = None
        self.last_event = None
        # The batch of the last cache pass (a lookup's or a prefetch's): the next prefetch's
        # pass cannot evict its rows (prefetch.py, Pending.protects).
        self.last_pass = None
        self.checks = collections.deque()
        self.graph_checks = []
        self.ring = None  # _VerdictRing, on the first uncaptured batch
        self.cache = (DeviceCache(self, table.cache_rows, table.cache_policy,
                                  table.cache_admission) if table.cache_rows else None)

    def device_id(self):
        """The CUDA device this side's arrays live on (its hyperparameter array's or its
        cache's), or None while it holds none (a side made by a write or a flush)."""
        arrays = [self.hyper] + (list(vars(self.cache).values()) if self.cache is not None
                                 else [])
        for value in arrays:
            owner = getattr(value, "device", None)
            if owner is not None and hasattr(owner, "id") and hasattr(value, "data"):
                return int(owner.id)
        return None

    # -------------------------------------------------------------- helpers

    def _vector_width(self, layout) -> int:
        """16-byte words per lane where every row part and pointer allows it, else 1."""
        word = 16 // self.table.dtype.itemsize
        units = (layout.dim, layout.state_width, layout.state_offset, self.w_stride,
                 self.s_stride)
        aligned = all(u % word == 0 for u in units) and self.w_ptr % 16 == 0 \
            and self.s_ptr % 16 == 0
        return word if aligned else 1

    def launch_size(self, n_warps: int, prefetch: bool = False):
        """``(grid, block)`` for ``n_warps`` warps, capped for this GPU (lower for a
        prefetch, which leaves SMs to the compute it overlaps)."""
        from xferlib._kernels import launch_config

        cap = self.prefetch_blocks if prefetch else self.max_blocks
        return launch_config(max(1, n_warps), max_blocks=cap)

    def _cache_args(self, slots):
        layout = self.table.layout
        if self.cache is None or slots is None:
            return (np.uint64(0), np.int64(0), np.int64(layout.state_offset), np.uint64(0))
        return (self.cache.data, np.int64(self.cache.width), np.int64(layout.state_offset),
                slots)

    def host_args(self):
        """The kernels' leading arguments: the host weights and state (addresses, strides)
        and the row count."""
        return (np.uint64(self.w_ptr), np.int64(self.w_stride), np.uint64(self.s_ptr),
                np.int64(self.s_stride), np.int64(self.table.num_rows))

    def _hyper_array(self):
        import cupy

        if self.hyper is None:
            values = [float(v) for v in self.table.rule.kernel_hyper(self.table.hyper)]
            self.hyper = cupy.asarray(np.array(values + [0.0] * (16 - len(values))))
        return self.hyper

    def plan(self, idx, stream) -> Plan:
        import cupy

        from xferlib._kernels.table import (RUN_IDS_MAX, TABLE_MODULE, run_ids_name,
                                            run_starts_name)

        idx = to_gpu_indices(idx, self.table.num_rows)
        keys, perm, verdict = sorted_positions(idx, self.table.num_rows, stream)
        n = keys.size
        if n <= RUN_IDS_MAX:
            run = cupy.empty(n, dtype=np.int64)
            if n:
                TABLE_MODULE.get_function(run_ids_name(keys.dtype.itemsize))(
                    (1,), (1024,), (keys, np.int64(n), run), stream=stream)
            return Plan(idx, keys, perm, run, verdict)
        flags = cupy.empty(n, dtype=np.int64)
        blocks = max(1, min(4096, -(-n // 256)))
        TABLE_MODULE.get_function(run_starts_name(keys.dtype.itemsize))(
            (blocks,), (256,), (keys, np.int64(n), flags), stream=stream)
        run = cupy.cumsum(flags)
        run -= 1
        return Plan(idx, keys, perm, run, verdict)

    def record(self, stream) -> None:
        """Record ``last_event`` on ``stream`` (the work a flush waits for); nothing while
        ``stream`` is being captured."""
        import cupy

        if is_capturing(stream):
            return
        if self.last_event is None:  # re-recorded: a wait takes the latest record
            self.last_event = cupy.cuda.Event(disable_timing=True)
        self.last_event.record(stream)

    # -------------------------------------------------------------- input checks

    def defer_check(self, plan: Plan, stream) -> None:
        capturing = is_capturing(stream)
        if not capturing and self.ring is None:
            self.ring = _VerdictRing()
        check = _PendingCheck(plan, self.table.num_rows, stream, capturing, self.ring)
        (self.graph_checks if capturing else self.checks).append(check)

    def resolve_checks(self, wait: bool = False) -> None:
        """Raise for the oldest bad batch whose verdict is in; wait for verdicts only when
        ``wait`` or when the host runs more than two batches ahead."""
        checks = self.checks
        while checks and (wait or checks[0].ready or len(checks) > _MAX_PENDING_CHECKS):
            check = checks.popleft()
            try:
                check.resolve()
            except Exception:
                for later in checks:  # their slots are reused: let the copies land first
                    if later.event is not None:
                        later.event.synchronize()
                checks.clear()  # later batches' kernels ran: only this one is reported
                raise
        if wait:
            for check in self.graph_checks:  # verdicts written by graph replays
                check.resolve()

    # -------------------------------------------------------------- gather and expand

    def gather_unique(self, plan: Plan, stream, which: int = 0, out=None,
                      prefetch: bool = False):
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, gather_unique_name

        layout = self.table.layout
        if out is None:
            out = cupy.empty((plan.n, layout.dim), dtype=self.table.dtype)
        if plan.n:
            grid, block = self.launch_size(plan.n, prefetch)
            name = gather_unique_name(self.vec, self.dtype_name, plan.keys.itemsize)
            TABLE_MODULE.get_function(name)(
                grid, block, (*self.host_args(), *self._cache_args(plan.slots), plan.keys,
                              plan.run, np.int64(plan.n), np.int64(layout.dim),
                              np.int64(layout.state_width), np.int32(0), np.int32(which), out,
                              plan.verdict), stream=stream)
        return out

    def expand(self, plan: Plan, uniq, out, stream):
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, expand_rows_name

        dim = self.table.dim
        if out is None:
            out = cupy.empty((plan.n, dim), dtype=self.table.dtype)
        total = plan.n * dim
        if total:
            blocks = max(1, min(65535, -(-total // 256)))
            TABLE_MODULE.get_function(expand_rows_name(self.dtype_name))(
                (blocks,), (256,), (uniq, plan.run, plan.perm, np.int64(plan.n), np.int64(dim),
                                    out, plan.verdict), stream=stream)
        return out

    def check_out(self, out, n) -> None:
        if out is None:
            return
        if not is_cupy_array(out) or out.shape != (n, self.table.dim) \
                or out.dtype != self.table.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous CuPy array of shape "
                             f"{(n, self.table.dim)} and dtype {self.table.dtype}")

    # -------------------------------------------------------------- lookup

    def lookup(self, idx, out, stream):
        import cupy

        from xferlib.table.prefetch import take_prefetch

        stream = as_cupy_stream(stream)
        self.resolve_checks()
        self.check_out(out, idx.shape[0])
        if idx.shape[0] == 0:
            rows = out if out is not None else cupy.empty((0, self.table.dim), self.table.dtype)
            return rows, self._empty_plan(idx)
        with stream:
            taken = take_prefetch(self, idx, stream)
            if taken is not None:  # rows from host RAM staged; cached ones read now
                plan, uniq = taken
                if plan.slots is not None:
                    self.gather_unique(plan, stream, which=2, out=uniq)
            else:
                plan = self.plan(idx, stream)
                if self.cache is not None:
                    plan.slots = self.cache.insert(plan, stream)
                    self.last_pass = plan
                uniq = self.gather_unique(plan, stream)
            rows = self.expand(plan, uniq, out, stream)
            self.defer_check(plan, stream)
            self.record(stream)
        return rows, plan

    def _empty_plan(self, idx) -> Plan:
        import cupy

        empty = cupy.empty(0, dtype=np.int64)
        return Plan(idx, empty, empty, empty,
                    cupy.full(2, np.iinfo(np.uint64).max, dtype=np.uint64))

    # -------------------------------------------------------------- update

    def apply(self, idx, grads, stream) -> None:
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, sparse_update_name
        from xferlib.table.prefetch import must_wait, refresh_after_update

        table = self.table
        stream = as_cupy_stream(stream)
        self.resolve_checks()
        if (idx.n if isinstance(idx, Plan) else idx.shape[0]) == 0:
            return
        with stream:
            grads = cupy.ascontiguousarray(grads, dtype=table.dtype)
            fresh = not isinstance(idx, Plan)
            plan = self.plan(idx, stream) if fresh else idx
            pending = self.pending
            slots = None
            if self.cache is not None:
                if must_wait(pending, plan):
                    # The prefetch's cache pass protects only the batch of the pass before it
                    # and may be evicting this batch's rows now: let it finish first.
                    stream.wait_event(pending.done)
                # Located again (one probe pass): a later lookup or prefetch may have evicted
                # some of the lookup's rows, and the slots the lookup used may hold others.
                slots = self.cache.probe(plan, stream)
            n, dim = plan.n, table.dim
            summed = self._sum_gradients(plan, grads, stream)
            grid, block = self.launch_size(n)
            kernel = sparse_update_name(table.rule.kind, self.vec, self.dtype_name,
                                        plan.keys.itemsize)
            TABLE_MODULE.get_function(kernel)(
                grid, block, (*self.host_args(), *self._cache_args(slots),
                              self.cache.dirty if slots is not None else np.uint64(0),
                              plan.keys, plan.run, np.int64(n), summed, np.int64(dim),
                              np.int64(len(table.layout.slots)),
                              np.int64(table.layout.step_offset), self._hyper_array(),
                              plan.verdict), stream=stream)
            if pending is not None:
                refresh_after_update(self, plan, slots, stream)
            if fresh:
                self.defer_check(plan, stream)
            self.record(stream)

    def _sum_gradients(self, plan: Plan, grads, stream):
        """Each run's gradient sum, in sorted-position order: deterministic."""
        import cupy

        from xferlib._kernels.table import (SUM_CHUNK, TABLE_MODULE, sum_chunks_name,
                                            sum_spans_name)

        n, dim = plan.n, self.table.dim
        chunks = -(-n // SUM_CHUNK)
        summed = cupy.empty((n, dim), dtype=self.table.dtype)  # rows past the last run unused
        head = cupy.empty((chunks, dim), dtype=self.table.dtype)
        tail = cupy.empty((chunks, dim), dtype=self.table.dtype)
        blocks = max(1, min(65535, -(-chunks * dim // 256)))
        key_bytes = plan.keys.itemsize
        TABLE_MODULE.get_function(sum_chunks_name(self.dtype_name, key_bytes))(
            (blocks,), (256,), (grads, plan.keys, plan.run, plan.perm, np.int64(n),
                                np.int64(dim), summed, head, tail), stream=stream)
        TABLE_MODULE.get_function(sum_spans_name(self.dtype_name, key_bytes))(
            (blocks,), (256,), (plan.keys, plan.run, np.int64(n), np.int64(dim), summed, head,
                                tail), stream=stream)
        return summed

    # -------------------------------------------------------------- flush

    def join_prefetch(self, stream) -> None:
        if self.pending is not None:
            stream.wait_event(self.pending.done)

    def flush(self, drop_cache: bool) -> None:
        """Queued work done, dirty cached rows written back (``drop_cache``: the cache
        emptied), every pending input check read."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        self.join_prefetch(stream)
        self.pending = None
        if self.last_event is not None:
            stream.wait_event(self.last_event)
        if self.cache is not None:
            self.cache.flush(stream, drop_cache)
        stream.synchronize()
        self.resolve_checks(wait=True)
