"""The host tables' rows on their way between host RAM and HBM, for a collection's GPU side
(``device.py``): the staging launch (``coll_stage``) and the deferred write-back.

Deferred write-back: where no GPU cache holds host rows, the forward stages whole rows
(weights, optimizer state, step count) and the update leaves the host rows it wrote in an
HBM buffer (:class:`PendingRows`) instead of writing them over the link; the next staging
writes them back while it reads its own rows the other way: the link carries both at once
(an H200, 25,600 scattered 512-byte rows each way: 396 us together against 534 one after
the other; a replayed step of 8M x 128 rows, SGD 0.73 -> 0.54 ms, Adam 1.51 -> 1.20 ms). A
row the staging finds among the pending ones is taken from HBM, not from host RAM that the
write-back may not have reached, and, when the batch's own update defers, it is not written
back at all (its update holds it again, updated): consecutive Zipf batches share about a
fifth of their rows, the hot ones, which so stay in HBM from step to step (the same step,
Adam 1.14 -> 1.02 ms, SGD 0.47 -> 0.43). A cached collection writes through: with a 5% cache
(half the distinct rows cached) deferring lost, first with the search made for every run
(0.35 -> 0.37 ms a replayed SGD step), then with the cache's fill taking an admitted
pending row from its pending copy and the staging searching only uncached rows (SGD 0.304
-> 0.320 ms, row-wise Adagrad 0.327 -> 0.334: too few rows left to the link for the
overlap to pay for the halved staging grid). Everything that reads or writes host rows from
the host goes through ``synchronize``, which writes the pending rows back first.
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import is_capturing
from xferlib._kernels import launch_config
from xferlib._kernels.collection import STAGE, c_type, collection_module

__all__ = ["HostStaging", "PendingRows", "plan_args", "NO_CACHE_ARGS"]

NO_CACHE_ARGS = dict(cache=None, cache_width=0, slots=None)  # the kernels' "no cache slots"
# the kernels' "no pending rows"
NO_PENDING_ARGS = dict(pending=None, pending_key=None, pending_off=None, pending_tab=None,
                       pending_count=None, pending_rows=0)


class PendingRows:
    """An update's host rows held in HBM until the next staging writes them back: ``rows``
    (``capacity`` staged rows, one a run), each run's sorted key (``key``: what the staging
    searches), its row's place in the host buffer (``off``, -1: not held) and table
    (``tab``), and how many runs the last update left (``count``, on the device: a replayed
    graph keeps it)."""

    def __init__(self, capacity: int, width: int, dtype):
        import cupy

        self.capacity = int(capacity)
        self.rows = cupy.empty((self.capacity, width), dtype=dtype)
        self.key = cupy.empty(self.capacity, dtype=np.int64)
        self.off = cupy.empty(self.capacity, dtype=np.int64)
        self.tab = cupy.empty(self.capacity, dtype=np.int32)
        self.count = cupy.zeros(1, dtype=np.int64)


def plan_args(plan) -> dict:
    """A plan's sorted keys and runs, as the staging and the update read them (``None``:
    no plan, a write-back alone)."""
    if plan is None:
        return dict(keys=None, key_bytes=8, run=None, starts=None, run_off=None, run_tab=None)
    return dict(keys=plan.keys, key_bytes=plan.keys.itemsize, run=plan.run,
                starts=plan.starts, run_off=plan.run_off, run_tab=plan.run_tab)


class HostStaging:
    """The staging launch of a collection's GPU side ``side`` and its pending rows."""

    def __init__(self, side, defers: bool):
        coll = side.coll
        self.side = side
        self.defers = defers
        self.host_elems = int(coll.buffers["host"].size) if side.has_host else 0
        self.pending = None  # PendingRows, made by the first forward for an update
        self.retired = []  # (PendingRows, event): replaced buffers kept until written back
        self.stream = None  # the stream (its handle) of the side's last forward or backward

    def stage(self, stream, n, plan, cache_args, staged, full, verdict, keep_taken=False):
        """``coll_stage``: the plan's host rows copied into ``staged`` (n = 0: none), the
        pending rows written back beside them (then on half the grid: an H200, 8M x 128 SGD
        rows, a replayed step 0.52 ms against 0.55 on four blocks an SM). ``keep_taken``
        (the plan's update defers: it holds its rows in the pending buffer again): pending
        rows the plan takes are left unwritten, its update writes them. Safe in any order of
        calls: the buffer changes only by an update whose staged copy is current (its
        staging came after the buffer's last fill, so it took every such row it has and
        wrote back every one it has not) or by a staging that writes every row back."""
        side = self.side
        held = self.pending.capacity if self.pending is not None else 0
        blocks = side.max_blocks // 2 if held else side.max_blocks
        grid, block = launch_config(max(n, held), max_blocks=blocks)
        STAGE.launch(collection_module(), (side.vec, c_type(side.dtype_name)), grid, block,
                     stream=stream, host=side.host_ptr, meta=side.meta, **plan_args(plan),
                     n=n, **cache_args, staged=staged, stage_width=side.stage_width,
                     full=full, **self.pending_args(held > 0),
                     keep_taken=int(bool(keep_taken and held)), host_elems=self.host_elems,
                     num_tables=side.coll.num_tables, verdict=verdict)

    def room(self, n: int, stream) -> bool:
        """Whether a batch of ``n`` lookups may defer its host rows' write-back: a pending
        buffer of room for its runs, made (or grown, its rows written back first, with a
        quarter to spare: a graph of a padded batch bucket then fits) here, and never once a
        step was captured (a graph reads the buffer it recorded at every replay: a batch
        larger than it then writes host RAM as it goes)."""
        import cupy

        if not self.defers:
            return False
        capturing = is_capturing(stream)
        if self.retired and not capturing:  # replaced buffers whose write-back is done
            # (no event is queried inside a capture: that invalidates it)
            self.retired = [(p, e) for p, e in self.retired if not e.done]
        if self.pending is not None and self.pending.capacity >= n:
            return True
        if capturing or self.side.captured:
            return False
        self.write_back(stream)
        if self.pending is not None:  # freed once its write-back is done, on any stream
            done = cupy.cuda.Event(disable_timing=True)
            done.record(stream)
            self.retired.append((self.pending, done))
        capacity = max(n + n // 4, self.pending.capacity * 5 // 4 if self.pending else 0)
        with stream:
            self.pending = PendingRows(capacity, self.side.stage_width, self.side.coll.dtype)
        return True

    def follow(self, stream) -> None:
        """``stream`` made to wait for the side's last queued work when that ran on another
        stream and rows are pending (an evaluation lookup on a side stream writes them back
        and clears their count: never beside an update writing them). Not inside a capture
        (an event recorded outside it may not be waited on there). The module's replayed
        graphs record their event; a graph the caller replays records none."""
        side, last = self.side, self.stream
        self.stream = stream.ptr
        if (self.pending is not None and last is not None and last != stream.ptr
                and side.last_event is not None and not is_capturing(stream)):
            stream.wait_event(side.last_event)

    def pending_args(self, given: bool) -> dict:
        """The kernels' pending-row arguments (``given`` false: none)."""
        p = self.pending
        if not given or p is None:
            return NO_PENDING_ARGS
        return dict(pending=p.rows, pending_key=p.key, pending_off=p.off, pending_tab=p.tab,
                    pending_count=p.count, pending_rows=p.capacity)

    def written(self, stream) -> None:
        """The pending rows are in host RAM (a staging launch wrote them back): none held."""
        if self.pending is not None:
            self.pending.count.data.memset_async(0, 8, stream)

    def write_back(self, stream) -> None:
        """The last update's pending host rows written to host RAM, on ``stream``."""
        if self.pending is not None:
            self.stage(stream, 0, None, NO_CACHE_ARGS, None, 1, None)
            self.written(stream)
