"""The GPU half of a HostTable: planning a batch, the lookup and update launches, deferred
input checks.

A step takes no host synchronization. Batches are planned by :func:`xferlib.batch.plan_batch`,
whose sort kernel checks the indices and leaves a 16-byte verdict on the device; every later
kernel of the batch reads it and writes nothing when it is set. The verdict goes to the
table's :class:`~xferlib.batch.PendingChecks` (the policy of :mod:`xferlib.batch`): read by a
later call (at the latest once the device is two batches behind, or by ``check()``, or by
anything that flushes), which raises IndexError then. Allocations depend on the batch size
only, so a step at a fixed batch size can be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import (as_cupy_stream, changed_constant, hyper_constant, is_capturing,
                              is_cupy_array)
from xferlib._kernels import grid_1d, launch_config, named
from xferlib.batch import BatchPlan, PendingChecks, RowsReport, Verdict, plan_batch
from xferlib.memory import device_pointer
from xferlib.rows import to_gpu_indices
from xferlib.table.cache import DeviceCache

def staged_state_start(dim: int, itemsize: int) -> int:
    """Where a row's state starts in a copy gathered with its weights: after the weights, at
    the next 16-byte boundary (as the kernels' ``staged_state_start``).

    >>> staged_state_start(33, 4), staged_state_start(16, 4), staged_state_start(5, 8)
    (36, 16, 6)
    """
    return -(-dim * itemsize // 16) * (16 // itemsize)


# The host may run this many unchecked batches ahead of the device: a call waits for the
# oldest verdict when it finds three unread.
_MAX_PENDING_CHECKS = 2


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
        self.s_tail = self._state_tail(layout, weights, state)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Kernels that reach host RAM: four blocks per SM at most (on an 8M-row table, half
        # a block to four per SM took the same time); prefetches take an eighth of the SMs,
        # leaving the rest to the compute they overlap (H100, 8M-row Adam table, 65,536 Zipf
        # lookups: 8 / 16 / 33 / 66 blocks hid 43 / 63 / 50 / 36% of a lookup behind equal compute).
        self.max_blocks, self.prefetch_blocks = 4 * sms, max(8, sms // 8)
        self.hyper = None
        self.captured = False  # an update was captured: replays read `hyper` where it is
        self.pending = None  # the prefetch in flight (xferlib/table/prefetch.py)
        self.side_stream = None
        self.last_event = None
        # The batch of the last cache pass (a lookup's or a prefetch's): the next prefetch's
        # pass cannot evict its rows (prefetch.py, Pending.protects).
        self.last_pass = None
        self.checks = PendingChecks(limit=_MAX_PENDING_CHECKS + 1)
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

    def _state_tail(self, layout, weights, state) -> int:
        """sparse_update's ``s_tail``: a host row's length from its state's start to the row's
        end, padding included (the update then writes the step count's word and the padding
        after it in one store, whole host cache lines); 0 where the words are not 16-byte
        aligned or the step count shares its word with other state."""
        word = 16 // self.table.dtype.itemsize
        if self.vec != word or layout.step_offset % word:
            return 0
        interleaved = (state.strides[0] == weights.strides[0] and self.s_ptr - self.w_ptr
                       == layout.state_offset * self.table.dtype.itemsize)
        return self.w_stride - layout.state_offset if interleaved else layout.state_width

    def launch_size(self, n_warps: int, prefetch: bool = False):
        """``(grid, block)`` for ``n_warps`` warps, capped for this GPU (lower for a
        prefetch, which leaves SMs to the compute it overlaps)."""
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

    def _hyper_values(self):
        return self.table.rule.kernel_row(self.table.hyper)

    def _hyper_array(self):
        """The hyperparameter row on the device, uploaded at the first update and after a
        change made before any capture, on the launch's own stream (apply's ``with
        stream``; ``hyper_constant``)."""
        import cupy

        capturing = is_capturing(cupy.cuda.get_current_stream())
        if self.hyper is None:
            self.hyper = hyper_constant(self._hyper_values(), capturing)
        self.captured = self.captured or capturing
        return self.hyper

    def hyper_changed(self) -> None:
        """New hyperparameters for the following updates. Until an update has been captured
        into a CUDA graph the next one uploads them; after, replays read the array at the
        address they recorded, so the new values are written there, in place, once the
        queued updates (which keep the old values) are done: a wait for the device."""
        self.hyper = changed_constant(self.hyper, self.captured, self._hyper_values)

    def plan(self, idx, stream) -> BatchPlan:
        """``idx`` checked and sorted, its runs of equal rows numbered (no host sync)."""
        idx = to_gpu_indices(idx, self.table.num_rows)
        return plan_batch(idx, self.table.num_rows, stream=stream, runs=True)

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

    def defer_check(self, plan: BatchPlan, stream) -> None:
        plan.verdict.defer(self.checks, stream)

    def resolve_checks(self, wait: bool = False) -> None:
        """Raise for the oldest bad batch whose verdict is in; wait for verdicts only when
        ``wait`` or when the host runs more than two batches ahead."""
        self.checks.poll(wait)

    # -------------------------------------------------------------- gather and expand

    def gather_unique(self, plan: BatchPlan, stream, which: int = 0, out=None,
                      prefetch: bool = False, full: bool = False):
        """Each distinct row of ``plan`` once (run r at row r of the result): its weights,
        and with ``full`` its optimizer state after them (the copy an update of the batch
        reads instead of host RAM)."""
        import cupy

        from xferlib._kernels.table import (CACHE_ARGS, GATHER_UNIQUE, HOST_ARGS, TABLE_MODULE,
                                            c_type, key_type)

        layout = self.table.layout
        if out is None:
            width = (staged_state_start(layout.dim, self.table.dtype.itemsize)
                     + layout.state_width) if full else layout.dim
            out = cupy.empty((plan.n, width), dtype=self.table.dtype)
        if plan.n:
            grid, block = self.launch_size(plan.n, prefetch)  # a warp per distinct row
            GATHER_UNIQUE.launch(
                TABLE_MODULE, (self.vec, c_type(self.dtype_name), key_type(plan.keys.itemsize)),
                grid, block, stream=stream, **named(HOST_ARGS, self.host_args()),
                **named(CACHE_ARGS, self._cache_args(plan.slots)), keys=plan.keys,
                run=plan.run, starts=plan.starts, n=plan.n, dim=layout.dim,
                s_width=layout.state_width, full=full, which=which, out=out,
                verdict=plan.verdict.words)
        return out

    def expand(self, plan: BatchPlan, uniq, out, stream):
        import cupy

        from xferlib._kernels.table import EXPAND_ROWS, TABLE_MODULE, c_type

        dim = self.table.dim
        if out is None:
            out = cupy.empty((plan.n, dim), dtype=self.table.dtype)
        if plan.n * dim:
            grid, block = launch_config(plan.n)  # a warp per batch position
            EXPAND_ROWS.launch(TABLE_MODULE, (c_type(self.dtype_name),), grid, block,
                               stream=stream, uniq=uniq, u_stride=uniq.shape[1], run=plan.run,
                               perm=plan.perm, n=plan.n, dim=dim, out=out,
                               verdict=plan.verdict.words)
        return out

    def check_out(self, out, n) -> None:
        if out is None:
            return
        if not is_cupy_array(out) or out.shape != (n, self.table.dim) \
                or out.dtype != self.table.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous CuPy array of shape "
                             f"{(n, self.table.dim)} and dtype {self.table.dtype}")

    # -------------------------------------------------------------- lookup

    def lookup(self, idx, out, stream, for_update: bool = False):
        """The rows of ``idx`` and the batch's plan. ``for_update``: the caller will hand the
        plan to :meth:`apply`, so the rows are gathered with their optimizer state, and the
        update reads them from HBM instead of host RAM (when nothing wrote to the table in
        between)."""
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
                    self.cache_pass(plan, stream)
                uniq = self.gather_unique(plan, stream, full=for_update)
            rows = self.expand(plan, uniq, out, stream)
            if self.table.shared_name is None:  # other processes may write a shared table
                plan.keep_staged(uniq, self.table.write_stamp())
            self.defer_check(plan, stream)
            self.record(stream)
        return rows, plan

    def _empty_plan(self, idx) -> BatchPlan:
        import cupy

        empty = cupy.empty(0, dtype=np.int64)
        words = cupy.full(2, np.iinfo(np.uint64).max, dtype=np.uint64)
        return BatchPlan(idx, empty, empty, Verdict(words, RowsReport(idx, self.table.num_rows)),
                         run=empty, starts=empty)

    # -------------------------------------------------------------- update

    def apply(self, idx, grads, stream) -> None:
        import cupy

        from xferlib._kernels.table import (CACHE_ARGS, HOST_ARGS, SPARSE_UPDATE, TABLE_MODULE,
                                            c_type, key_type)
        from xferlib.table.prefetch import must_wait, refresh_after_update

        table = self.table
        stream = as_cupy_stream(stream)
        self.resolve_checks()
        if (idx.n if isinstance(idx, BatchPlan) else idx.shape[0]) == 0:
            return
        with stream:
            grads = cupy.ascontiguousarray(grads, dtype=table.dtype)
            fresh = not isinstance(idx, BatchPlan)
            plan = self.plan(idx, stream) if fresh else idx
            # The lookup's copy of the weights is current when nothing wrote to the table
            # since: the update then reads rows in host RAM from HBM and only writes them.
            staged = (plan.staged if not fresh and plan.staged is not None
                      and table.stamp_current(plan.writes) else None)
            table.note_write()
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
            grid, block = self.launch_size(n)  # a warp per distinct row
            SPARSE_UPDATE.launch(
                TABLE_MODULE, (int(table.rule.kind), self.vec, c_type(self.dtype_name),
                               key_type(plan.keys.itemsize)),
                grid, block, stream=stream, **named(HOST_ARGS, self.host_args()),
                **named(CACHE_ARGS, self._cache_args(slots)),
                dirty=self.cache.dirty if slots is not None else None,
                keys=plan.keys, run=plan.run, starts=plan.starts, n=n, summed=summed,
                staged=staged, staged_width=staged.shape[1] if staged is not None else 0,
                staged_state=staged is not None and staged.shape[1] > dim, dim=dim,
                n_slots=len(table.layout.slots), step_off=table.layout.step_offset,
                s_tail=self.s_tail, h=self._hyper_array(), verdict=plan.verdict.words)
            if pending is not None:
                refresh_after_update(self, plan, slots, stream)
            if fresh:
                self.defer_check(plan, stream)
            self.record(stream)

    def _sum_gradients(self, plan: BatchPlan, grads, stream):
        """Each run's gradient sum, in sorted-position order: deterministic."""
        import cupy

        from xferlib._kernels.table import (SUM_CHUNK, SUM_CHUNKS, SUM_SPANS, TABLE_MODULE,
                                            c_type, key_type)

        n, dim = plan.n, self.table.dim
        chunks = -(-n // SUM_CHUNK)
        summed = cupy.empty((n, dim), dtype=self.table.dtype)  # rows past the last run unused
        head = cupy.empty((chunks, dim), dtype=self.table.dtype)
        tail = cupy.empty((chunks, dim), dtype=self.table.dtype)
        grid, block = grid_1d(chunks * dim, 256, 65535)
        types = (c_type(self.dtype_name), key_type(plan.keys.itemsize))
        SUM_CHUNKS.launch(TABLE_MODULE, types, grid, block, stream=stream, grads=grads,
                          keys=plan.keys, run=plan.run, perm=plan.perm, n=n, dim=dim,
                          summed=summed, head=head, tail=tail)
        SUM_SPANS.launch(TABLE_MODULE, types, grid, block, stream=stream, keys=plan.keys,
                         run=plan.run, n=n, dim=dim, summed=summed, head=head, tail=tail)
        return summed

    # -------------------------------------------------------------- flush

    def join_prefetch(self, stream) -> None:
        if self.pending is not None:
            stream.wait_event(self.pending.done)

    def drop_prefetch(self, stream) -> None:
        """Make ``stream`` wait for the prefetch in flight, then forget it (a write of rows
        follows: its staged rows would be stale)."""
        self.join_prefetch(stream)
        self.pending = None

    # -------------------------------------------------------------- prefetch state
    # (xferlib/table/prefetch.py drives the prefetch through these)

    def cache_pass(self, plan: BatchPlan, stream, protect_prev: bool = False) -> None:
        """The cache's find/admit/evict pass over ``plan``: its runs' slots, and the batch
        the next prefetch's pass must not evict."""
        plan.set_slots(self.cache.insert(plan, stream, protect_prev=protect_prev))
        self.last_pass = plan

    def prefetch_stream(self, make):
        """The stream prefetches run on, made by ``make()`` on first use."""
        if self.side_stream is None:
            self.side_stream = make()
        return self.side_stream

    def set_pending(self, pending) -> None:
        self.pending = pending

    def take_pending(self):
        """The prefetch in flight (or None), forgotten here."""
        pending, self.pending = self.pending, None
        return pending

    def flush(self, drop_cache: bool) -> None:
        """Queued work done, dirty cached rows written back (``drop_cache``: the cache
        emptied), every pending input check read."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        self.drop_prefetch(stream)
        if self.last_event is not None:
            stream.wait_event(self.last_event)
        if self.cache is not None:
            self.cache.flush(stream, drop_cache)
        stream.synchronize()
        self.resolve_checks(wait=True)
