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

The verdict and check-queue classes (:class:`Verdict`, :class:`RowsReport`,
:class:`PendingChecks`, :class:`SlotChecks`) live in :mod:`xferlib.checks`; this module
re-exports them.

>>> import numpy as np, xferlib
>>> checks = xferlib.PendingChecks(limit=3)   # what a table or TT module owns
>>> checks.poll(wait=True)                    # nothing pending
>>> len(checks)
0
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xferlib._backend import as_cupy_stream
from xferlib._kernels import grid_1d
from xferlib._kernels.radix import (RADIX_BINS, RADIX_BITS, RADIX_HISTOGRAM, RADIX_ITEM_CHOICES,
                                    RADIX_MAX_N, RADIX_MODULE, RADIX_PASS, RADIX_THREADS,
                                    key_bits, radix_items, radix_key_passes,
                                    radix_status_words, radix_tiles)
from xferlib._kernels.rows import (CHECK_AND_NARROW, CHECK_AND_SORT_SMALL, INDEX_TYPES,
                                   ROWS_MODULE, SMALL_SORT_ITEMS, SMALL_SORT_THREADS,
                                   SMALL_SORT_TILE, tile_sort_kernels)
from xferlib.checks import (NO_BAD, PENDING, PendingChecks, RowsReport,  # noqa: F401
                            SlotChecks, Verdict, host_values, index_error)

__all__ = ["BatchPlan", "plan_batch", "sort_positions", "Verdict", "RowsReport",
           "PendingChecks", "SlotChecks", "NO_BAD", "PENDING", "index_error", "host_values",
           "run_ids", "tile_sort", "radix_sort", "radix_takes", "radix_work_words",
           "sort_on_device", "sort_buffers"]

# Up to this many positions the sort stays on the device (the tile sort, the radix sort: no
# host sync); above it, CuPy's argsort. The radix sort is the faster at every size measured
# (one H200, per call from Python: 127 / 130 / 206 / 263 us against 147 / 147 / 207 / 332 us
# at 65k / 262k / 1M / 4M keys), so the bound is the most it sorts.
TILED_SORT_MAX = RADIX_MAX_N


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


def tile_sort(keys, num_keys: int, stream, words, rows, perm) -> None:
    """The stable sort of at most :data:`SMALL_SORT_TILE` (2,048) ``keys`` (all below
    ``num_keys``) by one block in shared memory, one launch: sorted int32 keys into ``rows``,
    batch positions into ``perm``; a key outside ``[0, num_keys)`` reported by an atomic
    minimum into ``words[0]``."""
    n = int(keys.size)
    if n > SMALL_SORT_TILE:
        raise ValueError(f"tile_sort sorts at most {SMALL_SORT_TILE} keys, not {n}")
    items = next(i for i in SMALL_SORT_ITEMS if i * SMALL_SORT_THREADS >= n)
    kernel, shared = tile_sort_kernels(keys.dtype.name, items)
    bits = key_bits(num_keys)
    kernel((1,), (SMALL_SORT_THREADS,),
           CHECK_AND_SORT_SMALL.arguments(idx=keys, n_total=n, n_rows=num_keys, bits=bits,
                                          rows_out=rows, perm_out=perm, first_bad=words),
           shared_mem=shared, stream=stream)


def radix_takes(n: int, num_keys: int) -> bool:
    """Whether :func:`sort_positions` (its default bounds) gives ``n`` keys below ``num_keys``
    to :func:`radix_sort`: past one tile, within the on-device sort's bounds.

    >>> radix_takes(2_048, 1000), radix_takes(65_536, 8_000_000), radix_takes(65_536, 2**40)
    (False, True, False)
    """
    return SMALL_SORT_TILE < n <= TILED_SORT_MAX and num_keys <= np.iinfo(np.int32).max


def radix_work_words(n: int, num_keys: int, items: int | None = None) -> tuple:
    """``(zeroed, total)``: uint32 words of :func:`radix_sort`'s working array for ``n`` keys
    below ``num_keys``, and how many of its first words start zeroed (the digit counts, one
    ``RADIX_BINS`` row a pass first, then the tile counters and look-back words)."""
    items = radix_items(n) if items is None else items
    passes = radix_key_passes(num_keys)
    zeroed = radix_status_words(n, passes, items)
    return zeroed, zeroed + 2 * min(2, passes - 1) * n


def radix_sort(idx, num_keys: int, stream, words, buffer, items: int | None = None,
               zeroed: bool = False):
    """``(sorted int32 keys, int64 positions)``: the stable sort of ``idx`` (int32 or int64,
    all below ``num_keys`` <= 2^31 - 1) on ``stream`` by the device-wide radix sort
    (``xferlib/_kernels/radix.py``: a histogram launch, then one launch per 8 bits of
    ``num_keys - 1``), no host sync. A key outside ``[0, num_keys)`` is reported by an
    atomic minimum into ``words[0]``. ``buffer(name, size, dtype)`` gives the result
    (``"rows"``, ``"perm"``) and one working array (``"radix_work"``: the zeroed counts,
    then the passes' keys and positions, addressed by offset: an eager sort's host time is
    its launches, not array views). ``items``: keys a thread ranks, one of
    ``RADIX_ITEM_CHOICES`` (a tile is 256 threads' worth; the same order whatever it is),
    by default the fastest measured for ``idx.size`` (``radix_items``). ``zeroed``:
    ``"radix_work"`` comes with its first words already zeroed (:func:`radix_work_words`),
    by a memset the caller shares with its own zeroed words: none is queued here."""
    n = int(idx.size)
    items = radix_items(n) if items is None else items
    if items not in RADIX_ITEM_CHOICES:
        raise ValueError(f"items must be one of {RADIX_ITEM_CHOICES}, got {items!r}")
    bits = key_bits(num_keys)
    passes = radix_key_passes(num_keys)
    tiles = radix_tiles(n, items)
    cleared, size = radix_work_words(n, num_keys, items)
    work = buffer("radix_work", size, np.uint32)
    base = work.data.ptr
    hist, counters = base, base + 4 * passes * RADIX_BINS
    status = counters + 4 * passes
    K = (INDEX_TYPES[idx.dtype.name], items)
    block = (RADIX_THREADS,)
    if not zeroed:
        work.data.memset_async(0, 4 * cleared, stream)
    RADIX_HISTOGRAM.launch(RADIX_MODULE, K, (tiles,), block, stream=stream, idx=idx, n=n,
                           n_rows=num_keys, bits=bits, passes=passes, hist=hist,
                           first_bad=words)
    rows, perm = buffer("rows", n, np.int32), buffer("perm", n, np.int64)
    keys_in = vals_in = None
    for p in range(passes):
        last = p == passes - 1
        pair = base + 4 * (cleared + 2 * n * (p % 2))
        keys_out, vals_out = (rows, None) if last else (pair, pair + 4 * n)
        RADIX_PASS.launch(RADIX_MODULE, K, (tiles,), block, stream=stream,
                          idx=idx if p == 0 else None, keys_in=keys_in, vals_in=vals_in, n=n,
                          n_rows=num_keys, bits=bits, shift=p * RADIX_BITS,
                          hist=hist + 4 * p * RADIX_BINS,
                          status=status + 4 * p * tiles * RADIX_BINS, counter=counters + 4 * p,
                          keys_out=keys_out, vals_out=vals_out,
                          perm_out=perm if last else None)
        keys_in, vals_in = keys_out, vals_out
    return rows, perm


def sort_on_device(idx, num_keys: int, stream, words, buffer):
    """``(sorted int32 keys, int64 positions)``: the stable sort of ``idx`` (keys below
    ``num_keys`` <= 2^31 - 1, at most :data:`RADIX_MAX_N` of them) on ``stream`` without a
    host sync: :func:`tile_sort` up to one tile, :func:`radix_sort` past it. A key outside
    ``[0, num_keys)`` is reported by an atomic minimum into ``words[0]`` (set by the
    caller). ``buffer(name, size, dtype)`` gives each array (``"rows"`` / ``"perm"`` the
    result); the sorts of the batch plans and of the TT plans."""
    if idx.size > SMALL_SORT_TILE:
        return radix_sort(idx, num_keys, stream, words, buffer)
    rows, perm = buffer("rows", idx.size, np.int32), buffer("perm", idx.size, np.int64)
    tile_sort(idx, num_keys, stream, words, rows, perm)
    return rows, perm


def sort_buffers(scratch=None, scratch_result: bool = False, out=None, work=None):
    """The ``buffer(name, size, dtype)`` of :func:`sort_on_device`: fresh CuPy arrays, or a
    :class:`xferlib.tt.scratch.Scratch`'s for the working ones (and the result's with
    ``scratch_result``); ``out``: the result's ``(int32 keys, int64 positions)`` arrays where
    the caller has them; ``work``: the radix sort's working array where the caller made it
    (sized by :func:`radix_work_words`; zeroed for ``radix_sort(zeroed=True)``)."""
    import cupy

    def buffer(name, size, dtype):
        if name == "radix_work" and work is not None:
            if work.size != size:
                raise ValueError(f"the radix sort needs {size} working words, not {work.size}")
            return work
        if name in ("rows", "perm"):
            if out is not None:
                return out[0] if name == "rows" else out[1]
            if scratch is None or not scratch_result:
                return cupy.empty(size, dtype=dtype)
            return scratch.empty("result." + name, size, dtype)
        if scratch is None:
            return cupy.empty(size, dtype=dtype)
        return scratch.empty(name, size, dtype)

    return buffer


def _sort_planned(idx, num_rows: int, stream, scratch=None, scratch_result=False):
    """:func:`sort_positions` on the device, its verdict words made here. ``scratch``: see
    :func:`sort_positions`."""
    buffer = sort_buffers(scratch, scratch_result)
    words = buffer("words", 2, np.uint64)
    words.data.memset_async(0xFF, 16, stream)
    rows, perm = sort_on_device(idx, num_rows, stream, words, buffer)
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
    sort stays on the device (one tile sort launch up to 2,048 positions, else
    :func:`radix_sort`); above, CuPy's argsort, whose Thrust call waits for the device (a
    host sync). ``scratch`` (an ``xferlib.tt.scratch.Scratch``, on-device sort only): the
    working buffers and ``words`` come from it (the caller reads ``words`` within the call),
    and ``keys`` / ``perm`` too with ``scratch_result``; none is allocated per call.
    """
    import cupy

    stream = as_cupy_stream(stream)
    n = idx.size
    if tiled_max is None:
        tiled_max = TILED_SORT_MAX
    with stream:
        if (not presorted and n <= min(tiled_max, RADIX_MAX_N)
                and num_rows <= np.iinfo(np.int32).max):
            return _sort_planned(idx, num_rows, stream, scratch, scratch_result)
        narrow = idx.dtype == np.int64 and num_rows <= np.iinfo(np.int32).max
        keys32 = cupy.empty(n, dtype=np.int32) if narrow else None
        words = cupy.empty(2, dtype=np.uint64)
        words.data.memset_async(0xFF, 16, stream)
        grid, block = grid_1d(n, 256, 4096)
        CHECK_AND_NARROW.launch(ROWS_MODULE, (INDEX_TYPES[idx.dtype.name],), grid, block,
                                stream=stream, idx=idx, n=n, n_rows=num_rows, verdict=words,
                                keys32=keys32, check_order=presorted)
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
    share one; ``runs=True``), so ``keys[run == r]`` is the r-th distinct row; ``starts``: the
    first sorted position of each run (run r at ``starts[r]``, for r up to ``run[-1]``; the
    rest unused), so kernels give each distinct row its own warp; ``verdict``: the
    input check (:class:`Verdict`); ``slots``: where a cache put each run's row (set by the
    host table's cache); ``staged`` / ``writes``: a host table lookup's copy of the distinct
    rows (run r at row r) and ``(the table's write counter, its count then)``.
    """

    idx: object
    keys: object
    perm: object
    verdict: Verdict
    run: object = None
    starts: object = None
    slots: object = None
    staged: object = None
    writes: object = None

    @property
    def n(self) -> int:
        return int(self.keys.size)

    def set_slots(self, slots) -> None:
        """Where the table's cache put each run's row (int32, -1: host RAM)."""
        self.slots = slots

    def keep_staged(self, staged, writes) -> None:
        """The lookup's copy of the distinct rows and the table's write stamp when it was
        made (an update reads the copy while the stamp is current)."""
        self.staged, self.writes = staged, writes


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
        plan.run, plan.starts = run_ids(keys, stream)
    return plan


def run_ids(keys, stream):
    """``(run, starts)`` of sorted ``keys``, on ``stream``: the run id of each position (0 for
    the first run) and each run's first position (run r at ``starts[r]``; entries past the
    last run are left unset). Sized by ``keys`` alone: no host sync."""
    import cupy

    from xferlib._kernels.table import (RUN_COUNTS, RUN_IDS, RUN_IDS_MAX, RUN_TILE,
                                        TABLE_MODULE, key_type)

    n = keys.size
    K = (key_type(keys.dtype.itemsize),)
    with stream:
        starts = cupy.empty(n, dtype=np.int64)
        run = cupy.empty(n, dtype=np.int64)
        if n == 0:
            return run, starts
        if n <= RUN_IDS_MAX:  # one block numbers them all
            RUN_IDS.launch(TABLE_MODULE, K, (1,), (1024,), stream=stream, keys=keys, n=n,
                           run=run, starts=starts, tile_count=None)
            return run, starts
        tiles = -(-n // RUN_TILE)  # a block per tile: its runs counted, then numbered
        counts = cupy.empty(tiles, dtype=np.int64)
        RUN_COUNTS.launch(TABLE_MODULE, K, (tiles,), (1024,), stream=stream, keys=keys, n=n,
                          tile_count=counts)
        RUN_IDS.launch(TABLE_MODULE, K, (tiles,), (1024,), stream=stream, keys=keys, n=n,
                       run=run, starts=starts, tile_count=counts)
        return run, starts
