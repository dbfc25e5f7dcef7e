"""Prefetch: the next batch's rows move on a side stream while the current step computes.

``HostTable.prefetch(idx)`` queues, on a high-priority side stream that first waits for
everything already queued on the caller's stream: the sort and check of ``idx``, the cache's
fused find/admit/fill pass (admitted rows come into HBM with their state), and a gather of
the remaining rows' weights from host RAM into a staging buffer. The next ``lookup`` of the
same ``idx`` object reads the cached rows from HBM and expands the staged ones: only HBM work
is left on the critical path.

Ordering (an update queued while a prefetch is in flight, e.g. the current step's
``apply_gradients``):

* Where its rows are. The prefetch's cache pass never evicts a row used by the cache pass
  just before it (``protect_prev``: the rows whose tick is the previous one), and
  ``Pending.protects`` names that pass's batch. In the ordinary loop (``lookup(a)``,
  ``prefetch(b)``, update of ``a``) that is ``a``: the update locates its rows and trains them
  beside the prefetch, with no wait. Any other batch (a lookup before the last one, raw
  indices, a lookup followed by two prefetches, whose second protects only the first's rows)
  may lose rows to the prefetch's evictions while it runs: its update first waits for the
  prefetch (a stream wait, not a host sync), then locates its rows (:func:`must_wait`).
* What the prefetch read. The update may touch rows the prefetch already read from host RAM.
  After it the caller's stream waits for the prefetch and re-reads exactly those rows
  (``refresh_prefetched``): the next lookup sees every update queued before it, and a
  prefetch writes nothing a later write would lose.
"""

from __future__ import annotations

import dataclasses

from xferlib._backend import as_cupy_stream


@dataclasses.dataclass(eq=False)
class Pending:
    """A prefetch in flight: its ``idx`` object, batch, staging buffer, completion event, and
    the batch of the cache pass before it, whose rows its cache pass cannot evict."""

    idx: object
    plan: object
    staged: object
    done: object
    protects: object = None


def must_wait(pending, plan) -> bool:
    """Whether an update of ``plan`` must wait for the prefetch in flight before it locates
    its rows: unless the prefetch protects the batch, its cache pass may evict the batch's
    rows (writing them back and filling their slots) while the update runs.

    >>> a, b = object(), object()
    >>> must_wait(None, a), must_wait(Pending(b, b, None, None, protects=a), a)
    (False, False)
    >>> must_wait(Pending(b, b, None, None, protects=a), b)
    True
    """
    return pending is not None and plan is not pending.protects


def _high_priority_stream():
    """A non-blocking stream of the device's highest priority: when a prefetch overlaps
    compute, the block scheduler gives the prefetch's blocks the SMs that free up first.
    (CUDA clamps the requested priority into the device's range.)"""
    import cupy

    try:
        return cupy.cuda.Stream(non_blocking=True, priority=-(1 << 10))
    except TypeError:  # a CuPy without the priority argument
        return cupy.cuda.Stream(non_blocking=True)


def prefetch(side, idx, stream) -> None:
    """Queue the prefetch of ``idx`` (see the module docstring)."""
    import cupy

    main = as_cupy_stream(stream)
    side.resolve_checks()
    other = side.prefetch_stream(_high_priority_stream)
    side.join_prefetch(main)  # one prefetch in flight at a time
    ready = cupy.cuda.Event(disable_timing=True)
    ready.record(main)
    other.wait_event(ready)  # after every lookup and update queued so far
    protects = side.last_pass  # protect_prev: the rows of the pass just before this one
    with other:
        plan = side.plan(idx, other)
        if side.cache is not None and plan.n:
            side.cache_pass(plan, other, protect_prev=True)
        staged = side.gather_unique(plan, other, which=1, prefetch=True)
        side.defer_check(plan, other)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(other)
    side.set_pending(Pending(idx, plan, staged, done, protects))


def take_prefetch(side, idx, stream):
    """``(plan, staged)`` when the prefetch in flight is for this ``idx`` object (the caller's
    stream then waits for it), else None (after waiting for any prefetch in flight)."""
    pending = side.take_pending()
    if pending is None:
        return None
    stream.wait_event(pending.done)
    if pending.idx is not idx:
        return None
    return pending.plan, pending.staged


def refresh_after_update(side, plan, slots, stream) -> None:
    """After an update of ``plan`` queued while a prefetch is in flight: wait for the
    prefetch, then re-read the updated host rows it may have read before the update."""
    from xferlib._kernels import named
    from xferlib._kernels.cache import CACHE_MODULE, HOST_ARGS, REFRESH_PREFETCHED
    from xferlib._kernels.table import c_type, key_type

    pending = side.pending
    stream.wait_event(pending.done)
    pplan = pending.plan
    if not pplan.n or not plan.n:
        return
    cache = side.cache
    layout = side.table.layout
    grid, block = side.launch_size(plan.n)
    pkeys = pplan.keys
    if pkeys.dtype != plan.keys.dtype:  # int32 and int64 batches of a > 2**31-row table
        pkeys = pkeys.astype(plan.keys.dtype)
    REFRESH_PREFETCHED.launch(
        CACHE_MODULE, (c_type(side.dtype_name), key_type(plan.keys.itemsize)), grid, block,
        stream=stream, **named(HOST_ARGS, side.host_args()),
        cache=cache.data if cache is not None else None,
        cache_width=cache.width if cache is not None else 0, dim=layout.dim,
        s_off=layout.state_offset, tags=cache.tags if cache is not None else None,
        n_sets=cache.n_sets if cache is not None else 1,
        ukeys=plan.keys, urun=plan.run, un=plan.n, uslots=slots,
        pkeys=pkeys, prun=pplan.run, pn=pplan.n, pslots=pplan.slots,
        staged=pending.staged, uverdict=plan.verdict.words, pverdict=pplan.verdict.words)
